"""Checkpoint loading: GGUF files and Hugging Face directories, dequantised to torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.core.models.config import ModelConfig
from tokenloom.core.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, Any]  # HF tensor names -> torch tensors
    tokenizer: Tokenizer
    name: str
    format: str
