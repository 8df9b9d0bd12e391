"""Hugging Face directories: config.json + *.safetensors (or the shards that
model.safetensors.index.json names) + tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.models.registry import default_registry
from tokenloom.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenloom.core.interfaces import ModelRegistry

INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None,
                models: ModelRegistry | None = None) -> LoadedCheckpoint:
    from safetensors import safe_open

    raw_cfg = json.loads((path / "config.json").read_text())
    arch = (models or default_registry()).for_hf(raw_cfg)  # the model plugin that claims it
    cfg = arch.config_from_hf(raw_cfg)
    files = safetensors_files(path)
    weights: dict[str, torch.Tensor] = {}
    for i, file in enumerate(files):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
                    weights[name] = t  # packed codes (qweight, qzeros, g_idx) and fp8 stay raw
                elif t.dim() == 1 or name.endswith(("scales", "weight_scale")):
                    weights[name] = t.float()
                else:
                    weights[name] = t.to(dtype)
        if progress is not None:
            progress(i + 1, len(files))
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    tokenizer = Tokenizer.from_hf_dir(path, raw_cfg)
    quant = quantization_config(path, raw_cfg)
    return LoadedCheckpoint(cfg, weights, tokenizer, name=checkpoint_name(path), format="hf", architecture=arch,
                            quant_method=quant.get("quant_method") if quant else None, quant_config=quant)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: the shards ``model.safetensors.index.json`` names when there is one
    (a directory may hold other .safetensors beside them, e.g. Mistral's consolidated copy),
    else every ``*.safetensors``."""
    index = path / INDEX_FILE
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} has no *.safetensors files")
        return files
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ValueError(f"{path}: {'shard' if len(missing) == 1 else 'shards'} {', '.join(missing)} named by "
                         f"{INDEX_FILE} {'is' if len(missing) == 1 else 'are'} missing "
                         f"({len(missing)} of {len(names)})")
    return [path / n for n in names]


def checkpoint_name(path: Path) -> str:
    """The directory's name; for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<commit>``), the repository's (``name``), not the commit's."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo.split("--", 2)[2]
    return path.name


def quantization_config(path: Path, raw_cfg: dict) -> dict | None:
    """What the checkpoint says it is quantised with: config.json's ``quantization_config``
    (Transformers), else AutoGPTQ's ``quantize_config.json`` or AutoAWQ's ``quant_config.json``."""
    cfg = raw_cfg.get("quantization_config")
    if cfg is None:
        for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            if (path / name).exists():
                cfg = {"quant_method": method, **json.loads((path / name).read_text())}
                break
    if cfg is not None and not isinstance(cfg.get("quant_method"), str):
        raise ValueError(f"{path}: quantization config has no quant_method: {cfg!r}")
    return {**cfg, "quant_method": cfg["quant_method"].lower()} if cfg is not None else None
