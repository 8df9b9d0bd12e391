"""A checkpoint's header: its model config, and for a GGUF file every tensor's type and
size. Nothing else is read: GGUF tensor data stays memory-mapped, a Hugging Face directory
needs only its config.json (and a quantize_config.json / quant_config.json if it has one)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.core.errors import ClientError
from tokenloom.core.loader.gguf_file import NATIVE_TYPES, model_config
from tokenloom.core.loader.hf import quantization_config
from tokenloom.core.models.config import ModelConfig
from tokenloom.plugins.formats import GGUFFormat


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    qtype: str
    num_elements: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What the planner reads from a checkpoint's header."""

    config: ModelConfig
    name: str
    format: str  # gguf | hf
    quant_method: str | None = None
    quant_config: dict | None = None
    gguf_tensors: list[GGUFTensorInfo] = field(default_factory=list)


def read_checkpoint(path) -> CheckpointInfo:
    """The model config (and, for GGUF, every tensor's type and size) from a checkpoint's
    header: a .gguf file, a Hugging Face directory or its config.json. No weight is read."""
    path = Path(path)
    try:
        if GGUFFormat().claims(path):
            from tokenloom.core.loader.gguf_reader import GGUFFile

            reader = GGUFFile(path)  # tensor data is memory-mapped, never read here
            arch = reader.metadata.get("general.architecture", "?")
            meta = {k: v for k, v in reader.metadata.items() if k.startswith(("general.", f"{arch}."))}
            if f"{arch}.vocab_size" not in meta:  # model_config then counts the tokenizer's tokens
                meta["tokenizer.ggml.tokens"] = reader.metadata["tokenizer.ggml.tokens"]
            tensors = [GGUFTensorInfo(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes))
                       for t in reader.tensors]
            names = {t.name for t in tensors}
            cfg = dataclasses.replace(model_config(meta), tie_word_embeddings="output.weight" not in names)
            native = any(t.tensor_type.name in NATIVE_TYPES and len(t.shape) == 2 for t in reader.tensors)
            return CheckpointInfo(cfg, meta.get("general.name", path.stem), "gguf",
                                  "gguf" if native else None, None, tensors)
        directory = path.parent if path.suffix == ".json" else path
        config_file = path if path.suffix == ".json" else path / "config.json"
        if not config_file.is_file():
            raise ClientError(f"model {str(path)!r} is neither a .gguf file nor a directory with a config.json",
                              param="model", value=str(path))
        raw = json.loads(config_file.read_text())
        quant = quantization_config(directory, raw)
        return CheckpointInfo(ModelConfig.from_hf(raw), directory.name, "hf",
                              quant["quant_method"] if quant else None, quant)
    except ClientError:
        raise
    except (ValueError, KeyError) as exc:  # an unsupported architecture, a missing key
        raise ClientError(f"model {str(path)!r}: {exc}", param="model", value=str(path)) from None
