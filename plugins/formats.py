"""Model formats: GGUF files and Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.loader.gguf_file import load_gguf
from tokenloom.core.loader.hf import load_hf_dir


class GGUFFormat:
    """llama.cpp GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants, dequantised)."""

    def claims(self, path: Path) -> bool:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"

    load = staticmethod(load_gguf)


class HFDirFormat:
    """Hugging Face directory: config.json + *.safetensors + tokenizer.json."""

    def claims(self, path: Path) -> bool:
        return path.is_dir() and (path / "config.json").exists()

    load = staticmethod(load_hf_dir)


@hookimpl
def register_model_formats(register):
    register("gguf", GGUFFormat)
    register("hf", HFDirFormat)
