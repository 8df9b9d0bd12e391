"""GGUF checkpoints (llama.cpp's format), dequantised with the `gguf` package."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.tokenizer import Tokenizer

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (made for its interleaved RoPE) so the
    weights work with HF's rotate-half RoPE. Getting this wrong still runs, badly."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode; we do not need it
            continue
    return meta


def model_config(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama only)")
    g = lambda k, default=None: meta.get(f"llama.{k}", default)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length") or g("rope.dimension_count") or hidden // heads,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings=False,  # set below from the tensor list
    )


def load_gguf(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None) -> LoadedCheckpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    cfg = model_config(meta)
    names = {t.name for t in reader.tensors}
    cfg = dataclasses.replace(cfg, tie_word_embeddings="output.weight" not in names)
    weights: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {t.name}: GGUF type {qtype} is not supported")
        arr = dequantize(t.data, t.tensor_type)  # [out, in] float32 (or a read-only memmap for F32)
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(tuple(int(x) for x in reversed(t.shape)))
        if t.name.startswith("blk.") and ".attn_q." in t.name:
            arr = unpermute_qk(arr, cfg.num_heads)
        elif t.name.startswith("blk.") and ".attn_k." in t.name:
            arr = unpermute_qk(arr, cfg.num_kv_heads)
        tensor = torch.from_numpy(arr)
        weights[hf_name(t.name)] = tensor if tensor.dim() == 1 else tensor.to(dtype)
        if progress is not None:
            progress(i + 1, total)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return LoadedCheckpoint(cfg, weights, tokenizer, name=meta.get("general.name", path.stem), format="gguf")
