"""GGUF checkpoints (llama.cpp's format).

Tensors of the types tokenloom computes with natively (Q4_0, Q4_1, Q8_0) come back raw, as
:class:`GGUFTensor`: the `gguf` quantizer turns them into integer codes with scales and zero
points without ever going through floats, the `none` quantizer dequantises them. Every other
type is dequantised here with the `gguf` package. A 3-D stack of experts (llama.cpp's
``ffn_*_exps``) comes back as one tensor per expert, under the family's per-expert names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.core.interfaces import ModelRegistry

import numpy as np
import torch

from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.loader.gguf_reader import GGUFFile
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.models.registry import default_registry
from tokenloom.core.tokenizer import Tokenizer
from tokenloom.core.weights import QuantizedWeight

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
NATIVE_TYPES = {"Q4_0", "Q4_1", "Q8_0"}  # kept quantised: blocks of 32 with fp16 scale (and min)
_BLOCK = 32



@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """A quantised GGUF tensor, untouched: ``blocks`` is [rows, row_bytes] uint8 in ggml's
    block layout, ``shape`` is (rows, columns) = (out, in). ``row_order`` un-permutes Q/K."""

    name: str
    qtype: str
    blocks: np.ndarray
    shape: tuple[int, int]
    row_order: np.ndarray | None = None  # new row i is stored row row_order[i]

    def to_quantized(self) -> QuantizedWeight:
        """Integer codes, scales and zero points, exactly as llama.cpp decodes them:
        Q4_0 w = d * (q - 8); Q4_1 w = d * q + m (zero = -m / d); Q8_0 w = d * q (q int8)."""
        rows, cols = self.shape
        b = self.blocks.reshape(rows, cols // _BLOCK, -1)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros: np.ndarray  # float32 (numpy's stubs type Q4_1's division as float64)
        if self.qtype == "Q8_0":
            codes = b[..., 2:].copy().view(np.int8).astype(np.int16) + 128
            zeros, bits = np.full_like(d, 128.0), 8
        else:
            first = 4 if self.qtype == "Q4_1" else 2
            qs = b[..., first:first + 16]
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles are values 0..15
            bits = 4
            if self.qtype == "Q4_1":
                m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                flat = d == 0  # a constant block: w = m, written as (0 - (-1)) * m
                zeros = -m / np.where(flat, 1.0, d)
                codes[flat] = 0
                d, zeros = np.where(flat, m, d), np.where(flat, -1.0, zeros)
            else:
                zeros = np.full_like(d, 8.0)
        qw = QuantizedWeight(codes=torch.from_numpy(codes.reshape(rows, cols).astype(np.uint8)),
                             scales=torch.from_numpy(np.ascontiguousarray(d)),
                             zeros=torch.from_numpy(np.ascontiguousarray(zeros)), bits=bits, group_size=_BLOCK)
        return qw.rows(torch.from_numpy(self.row_order)) if self.row_order is not None else qw

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_quantized().dequantize(dtype)

def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (made for its interleaved RoPE) so the
    weights work with HF's rotate-half RoPE. Getting this wrong still runs, badly."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


#: tables llama.cpp's converter writes as tensors where an HF config has keys (Llama 3's
#: per-frequency RoPE divisors, Phi-3's longrope factors): metadata, read as ``tensor.<name>``
GGUF_TABLES = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def read_metadata(reader: GGUFFile) -> dict:
    """The file's key/values, and the values of its ``GGUF_TABLES`` tensors as float tuples
    under ``tensor.<name>`` (what the model families read their RoPE scaling from)."""
    from gguf.quants import dequantize

    meta = dict(reader.metadata)
    for t in reader.tensors:
        name = t.name.removesuffix(".weight")
        if name in GGUF_TABLES:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            meta[f"tensor.{name}"] = tuple(float(v) for v in values)
    return meta


def model_config(meta: dict, models: ModelRegistry | None = None) -> ModelConfig:
    """The model config of GGUF metadata, through the model plugin that claims its
    ``general.architecture``."""
    models = models or default_registry()
    return models.for_gguf(meta.get("general.architecture", "?")).config_from_gguf(meta)


def _split_experts(t, name: str, qtype: str, dtype: torch.dtype, weights: dict) -> None:
    """A 3-D stacked-experts tensor ([experts, out, in] in numpy order) as one 2-D tensor per
    expert under ``name`` with ``{expert}`` filled in. A native quantised type stays raw: an
    expert's rows are whole rows of blocks, so its slice of the blocks is its tensor."""
    from gguf.quants import dequantize

    if len(t.shape) != 3 or "{expert}" not in name:
        raise ValueError(f"GGUF tensor {t.name!r} has shape {tuple(reversed(t.shape))}: the engine reads "
                         f"{name!r} as {'one tensor' if '{expert}' not in name else 'a 3-D stack of experts'}")
    experts, rows, cols = (int(x) for x in reversed(t.shape))
    if qtype in NATIVE_TYPES:
        blocks = np.asarray(t.data).reshape(experts, rows, -1)
        for e in range(experts):
            weights[name.format(expert=e)] = GGUFTensor(f"{t.name}[{e}]", qtype, blocks[e], (rows, cols))
        return
    arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True).reshape(experts, rows, cols)
    for e in range(experts):
        weights[name.format(expert=e)] = torch.from_numpy(arr[e]).to(dtype)


def load_gguf(path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None,
              models: ModelRegistry | None = None) -> LoadedCheckpoint:
    from gguf.quants import dequantize

    models = models or default_registry()
    reader = GGUFFile(path)
    meta = read_metadata(reader)
    arch = models.for_gguf(meta.get("general.architecture", "?"))
    cfg = arch.config_from_gguf(meta)
    if cfg.architecture != getattr(arch, "name", cfg.architecture):
        arch = models.get(cfg.architecture)  # a family that hands a file over (`llama` + experts: Mixtral)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    # from the tensor list: tied (no output.weight), and the vocabulary the embedding has rows for
    # (Gemma 3's converter trims the embedding to the tokenizer's tokens)
    vocab = shapes.get("token_embd.weight", (cfg.vocab_size,))[0]
    cfg = dataclasses.replace(cfg, tie_word_embeddings="output.weight" not in shapes, vocab_size=vocab)
    permuted = arch.gguf_permuted_qk()
    weights: dict[str, torch.Tensor | GGUFTensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {t.name}: GGUF type {qtype} is not supported")
        name = arch.gguf_tensor_name(t.name, cfg)
        if name is None:  # a table the engine recomputes (rope_freqs, ...)
            if progress is not None:
                progress(i + 1, total)
            continue
        if len(t.shape) == 3 or "{expert}" in name:
            _split_experts(t, name, qtype, dtype, weights)
            if progress is not None:
                progress(i + 1, total)
            continue
        qk_heads = None
        if permuted and t.name.startswith("blk.") and (".attn_q." in t.name or ".attn_k." in t.name):
            qk_heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        if qtype in NATIVE_TYPES and len(t.shape) == 2:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            order = unpermute_qk(np.arange(rows)[:, None], qk_heads)[:, 0] if qk_heads else None
            weights[name] = GGUFTensor(t.name, qtype, t.data, (rows, cols), order)
            if progress is not None:
                progress(i + 1, total)
            continue
        arr = dequantize(t.data, t.tensor_type)  # [out, in] float32 (or a read-only memmap for F32)
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(tuple(int(x) for x in reversed(t.shape)))
        if qk_heads:
            arr = unpermute_qk(arr, qk_heads)
        tensor = torch.from_numpy(arr)
        weights[name] = tensor if tensor.dim() == 1 else tensor.to(dtype)
        if progress is not None:
            progress(i + 1, total)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    quantized = any(isinstance(w, GGUFTensor) for w in weights.values())
    return LoadedCheckpoint(cfg, weights, tokenizer, name=meta.get("general.name", path.stem), format="gguf",
                            quant_method="gguf" if quantized else None, architecture=arch)
