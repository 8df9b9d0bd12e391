"""The `triton` backend: the torch backend with its hot ops replaced by Triton kernels
(kernels/triton/).

Kernels: paged decode attention (split-K over long contexts), paged prefill attention
(chunks over cached context), the KV write (plain and 8-bit pools), RoPE + KV write +
decode attention for a decode-only step (``decode_attention_block``), RMSNorm fused with
the residual add, and the 4-bit (GPTQ/AWQ) and fp8 weight matmuls. Everything else is the
torch backend's, inherited: the KV pool layout ``[kv_heads, num_blocks, block_size,
head_dim]`` and its 8-bit ``QuantizedKV`` form (so both backends' pools mean the same
bytes), ``copy_blocks``, ``move_kv_slots``, ``silu_mul``, dense and 8-bit matmuls, and
attention for a step with a draft tree (its mask is not in the kernels) and for sliding-window
and soft-capped layers (the kernels have neither: such a layer's attention is the torch
backend's, from the torch metadata of the same step, built on its first such layer; the
other layers of the step keep the kernels).

It needs a CUDA device, or ``TRITON_INTERPRET=1`` set before start-up: Triton's
interpreter then runs the kernels on CPU tensors (about 1000x slower than torch; for
tests). Anything else fails at start-up with a ConfigError saying so.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import msgspec
import torch

from tokenloom.backends.torch_backend import (
    QuantizedKV,
    TorchAttnMeta,
    TorchBackend,
    TorchBackendOptions,
)
from tokenloom.core.attention import AttentionInputs
from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.weights import Fp8Weight, QuantizedWeight


class TritonBackendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # decode attention: tokens per split-K partition (a multiple of 64); longer contexts are
    # split across programs and their partial results reduced
    partition_size: int = 512
    # 4-bit matmuls: up to this many rows the GEMV kernel runs, above it the tiled GEMM
    gemv_max_rows: int = 4


@dataclass(slots=True)
class TritonAttnMeta:
    """One step's attention inputs as the kernels take them (int32 tensors on the device)."""

    slot_mapping: torch.Tensor  # [T]
    decode_rows: torch.Tensor | None = None  # [B] rows of q that decode one token
    decode_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None = None  # [B]
    decode_max_len: int = 0
    prefill_tables: torch.Tensor | None = None  # [S, max_blocks]
    prefill_lens: torch.Tensor | None = None  # [S] context lengths
    prefill_starts: torch.Tensor | None = None  # [S] first row of each chunk
    prefill_q_lens: torch.Tensor | None = None  # [S]
    prefill_max_q_len: int = 0
    fallback: TorchAttnMeta | None = None  # a draft tree in the step: the torch backend's attention
    inputs: AttentionInputs | None = None  # the step's inputs, for windowed layers' ``torch_meta``
    torch_meta: TorchAttnMeta | None = None  # the torch backend's metadata, built by the first windowed layer


def _check_usable(device: torch.device) -> None:
    """Fail at start-up, with a sentence, where the kernels cannot run."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if importlib.util.find_spec("triton") is None:
        raise ConfigError("backend = triton needs the triton package: pip install 'tokenloom[triton]'")
    if device.type == "cuda":
        if interpret:
            raise ConfigError("backend = triton: TRITON_INTERPRET is set, which runs the kernels on CPU "
                              "tensors; use device = cpu with it, or unset it on a GPU")
        if not torch.cuda.is_available():
            raise ConfigError("backend = triton on device cuda, but torch sees no CUDA device")
    elif device.type == "cpu":
        if not interpret:
            raise ConfigError("backend = triton needs a CUDA device and none is available here (device cpu); "
                              "set TRITON_INTERPRET=1 before start-up to run its kernels in Triton's "
                              "interpreter on CPU (about 1000x slower: for tests)")
    else:
        raise ConfigError(f"backend = triton runs on cuda (or on cpu under TRITON_INTERPRET=1), not {device.type}")
    from tokenloom.kernels.triton import common

    if common.INTERPRET != interpret:
        raise ConfigError("backend = triton: TRITON_INTERPRET changed after the kernels were defined; "
                          "set it before anything imports tokenloom.kernels.triton")


class TritonBackend(TorchBackend):
    """Triton kernels for the hot ops; the torch backend (its base class) for the rest."""

    name = "triton"

    def __init__(self, options: TritonBackendOptions | None = None, device: str | torch.device = "cpu"):
        device = torch.device(device)
        _check_usable(device)
        options = options or TritonBackendOptions()
        if options.partition_size <= 0 or options.partition_size % 64:
            raise ConfigError(f"backend.partition_size must be a positive multiple of 64, got {options.partition_size}")
        if options.gemv_max_rows < 0:
            raise ConfigError(f"backend.gemv_max_rows must be >= 0, got {options.gemv_max_rows}")
        # The torch ops it falls back to: plain torch attention (no C++ op to build); on CPU
        # (only ever under the interpreter, for tests) one fp32 layout and no load-time timing.
        super().__init__(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl", quant_max_rows=0), device)
        from tokenloom.kernels import triton as kernels

        self.kernels = kernels
        self.partition_size, self.gemv_max_rows = options.partition_size, options.gemv_max_rows

    # ---- per-step metadata ------------------------------------------------------
    def prepare(self, inp: AttentionInputs) -> TritonAttnMeta:
        """The step's tensors (``inp.tensors``), as int32 for the kernels."""
        if any(span.tree_parents for span in inp.prefills):
            return TritonAttnMeta(inp.slot_mapping, fallback=super().prepare(inp))
        meta = TritonAttnMeta(inp.slot_mapping, inputs=inp)
        t = inp.tensors(self.device)
        if t.decode_rows is not None:
            meta.decode_rows = t.decode_rows.int()
            meta.decode_tables = t.decode_block_tables.int()
            meta.decode_lens = t.decode_context_lens.int()
            meta.decode_max_len = max(inp.decode_context_lens)
        if t.prefill_q_starts is not None:
            meta.prefill_tables = t.prefill_block_tables.int()
            meta.prefill_lens = t.prefill_context_lens.int()
            meta.prefill_starts = t.prefill_q_starts.int()
            meta.prefill_q_lens = t.prefill_q_lens.int()
            meta.prefill_max_q_len = max(s.q_len for s in inp.prefills)
        return meta

    # ---- ops --------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        kc, ks = _pool(k_cache)
        vc, vs = _pool(v_cache)
        self.kernels.write_kv(k, v, kc, vc, slot_mapping, k_scale=ks, v_scale=vs)

    def attention(self, q, k, v, k_cache, v_cache, meta: TritonAttnMeta, scale: float, window: int | None = None,
                  softcap: float | None = None):
        """q: [T, H, D]; returns [T, H, D]. Decode rows by the split-K decode kernel, chunks by
        the prefill kernel, both reading K/V from the pool (``write_kv`` already ran). A
        sliding-window or soft-capped layer: the torch backend's attention (the same pools)."""
        if meta.fallback is not None:
            return super().attention(q, k, v, k_cache, v_cache, meta.fallback, scale, window=window, softcap=softcap)
        if window is not None or softcap is not None:
            if meta.torch_meta is None:
                meta.torch_meta = TorchBackend.prepare(self, meta.inputs)
            return super().attention(q, k, v, k_cache, v_cache, meta.torch_meta, scale, window=window,
                                     softcap=softcap)
        kc, ks = _pool(k_cache)
        vc, vs = _pool(v_cache)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            pure = meta.prefill_tables is None and meta.decode_rows.numel() == q.shape[0]
            got = self.kernels.paged_decode_attention(
                q if pure else q[meta.decode_rows], kc, vc, meta.decode_tables, meta.decode_lens, scale,
                k_scale=ks, v_scale=vs, max_context_len=meta.decode_max_len, partition_size=self.partition_size,
                out=out if pure else None)
            if not pure:
                out[meta.decode_rows] = got
        if meta.prefill_tables is not None:
            self.kernels.paged_prefill_attention(
                q, kc, vc, meta.prefill_tables, meta.prefill_lens, meta.prefill_starts, meta.prefill_q_lens, scale,
                k_scale=ks, v_scale=vs, max_query_len=meta.prefill_max_q_len, out=out)
        return out

    def decode_attention_block(self, qkv, cos, sin, k_cache, v_cache, meta: TritonAttnMeta, num_heads: int,
                               scale: float):
        """A decode-only step: RoPE on q and k (stored in the model dtype), the KV write and
        decode attention, three kernels; None for any other step."""
        kc, _ = _pool(k_cache)
        model_dtype = k_cache.dtype  # QuantizedKV.dtype is the model's
        if (meta.fallback is not None or meta.prefill_tables is not None or meta.decode_rows is None
                or meta.decode_rows.numel() != qkv.shape[0] or qkv.dtype != model_dtype):
            return None
        T = qkv.shape[0]
        kv_heads, head_dim = kc.shape[0], kc.shape[3]
        x = qkv.view(T, num_heads + 2 * kv_heads, head_dim)
        qk = self.kernels.rope(x[:, :num_heads + kv_heads], cos, sin, out_dtype=model_dtype)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        self.write_kv(k_cache, v_cache, k, x[:, num_heads + kv_heads:], meta.slot_mapping)
        return self.attention(q, None, None, k_cache, v_cache, meta, scale).view(T, num_heads * head_dim)

    def rope(self, x, cos, sin, out_dtype=None):
        return self.kernels.rope(x, cos, sin, out_dtype=out_dtype or torch.float32)

    def argmax(self, x):
        return x.argmax(dim=-1)

    def rms_norm(self, x, weight, eps: float):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float, dtype):
        """One kernel: ``h + delta`` written back into ``h`` (the model's float32 stream) and
        its RMSNorm in ``dtype``."""
        if h.dtype != torch.float32 or h.dim() != 2 or (delta is not None and delta.shape != h.shape):
            return super().add_rms_norm(h, delta, weight, eps, dtype)
        return self.kernels.add_rms_norm(h, delta, weight, eps, dtype, in_place=True)

    def capture_decode(self, model):
        """No captured step yet: every step runs its kernels op by op (a CUDA graph of the
        decode step per batch-size bucket is the way to add one)."""
        return None

    def pack_linear(self, spec, dtype):
        """4-bit weights (GPTQ, AWQ, RTN; act-order too) and fp8 weights get the Triton
        kernels; dense and 8-bit ones the torch backend's matmuls."""
        if isinstance(spec, QuantizedWeight) and spec.bits == 4 and spec.shape[1] % 8 == 0:
            return TritonInt4Linear(self.kernels, self.kernels.pack_int4(spec), self.gemv_max_rows)
        if isinstance(spec, Fp8Weight):
            return TritonFp8Linear(self.kernels, spec)
        return super().pack_linear(spec, dtype)


def _pool(cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's K or V pool as the kernels take it: (data, per-slot scales or None)."""
    return (cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache, None)


class TritonInt4Linear:
    """A 4-bit weight in the GPTQ packed layout (kernels/triton/int4_matmul.py)."""

    __slots__ = ("kernels", "packed", "out_features", "in_features", "gemv_max_rows", "kernel")

    def __init__(self, kernels, packed, gemv_max_rows: int):
        self.kernels, self.packed, self.gemv_max_rows = kernels, packed, gemv_max_rows
        self.out_features, self.in_features = packed.shape
        group = "act-order" if packed.g_idx is not None else f"g{packed.group_size}"
        self.kernel = f"triton int4 {group} (gemv up to {gemv_max_rows} rows, tiled above)"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        out = self.kernels.int4_matmul(x.reshape(-1, self.in_features), p.qweight, p.scales, p.zeros, p.group_size,
                                       p.g_idx, gemv_max_rows=self.gemv_max_rows)
        return out.view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.packed.nbytes()


class TritonFp8Linear:
    """An e4m3 weight with per-channel scales (kernels/triton/fp8_matmul.py)."""

    __slots__ = ("kernels", "weight", "scales", "out_features", "in_features", "kernel")

    def __init__(self, kernels, spec: Fp8Weight):
        self.kernels = kernels
        self.weight = spec.data.contiguous()
        self.scales = spec.scales.float().contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.kernel = "triton fp8 e4m3 (per-channel scales)"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.fp8_matmul(x.reshape(-1, self.in_features), self.weight, self.scales)
        return out.view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4


@hookimpl
def register_backends(register):
    register("triton", TritonBackend, options=TritonBackendOptions,
             description="Triton kernels for attention, KV write, norms, RoPE, 4-bit and fp8 matmuls "
                         "(CUDA; on CPU only under TRITON_INTERPRET=1)")
