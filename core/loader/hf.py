"""Hugging Face directories: config.json + *.safetensors + tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.tokenizer import Tokenizer


def load_hf_dir(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None) -> LoadedCheckpoint:
    from safetensors import safe_open

    raw_cfg = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw_cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for i, file in enumerate(files):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                weights[name] = t.float() if t.dim() == 1 else t.to(dtype)
        if progress is not None:
            progress(i + 1, len(files))
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    tokenizer = Tokenizer.from_hf_dir(path, raw_cfg)
    return LoadedCheckpoint(cfg, weights, tokenizer, name=path.name, format="hf")
