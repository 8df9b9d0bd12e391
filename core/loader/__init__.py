"""Checkpoint loading: GGUF files and Hugging Face directories, as raw tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.core.models.config import ModelConfig
from tokenloom.core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenloom.core.interfaces import ModelArchitecture


@dataclass(slots=True)
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, Any]  # HF tensor names -> torch tensors, or raw quantised tensors (GGUFTensor, ...)
    tokenizer: Tokenizer
    name: str
    format: str
    quant_method: str | None = None  # what the checkpoint's own metadata says it is quantised with
    quant_config: dict | None = None  # that metadata (bits, group_size, ...), for the quantizer
    architecture: ModelArchitecture | None = None  # the model plugin that builds it (load_checkpoint sets it)
