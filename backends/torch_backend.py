"""The `torch` backend: the reference every other backend is tested against.

Attention reads K/V from the paged pool through block tables: the decode rows' blocks are
gathered into one padded [kv_heads * batch, max_context] view and done in two batched
matmuls; each prefill (chunk) is one scaled_dot_product_attention call, straight on the
new K/V when nothing is cached, otherwise over the gathered context with a causal mask
offset by the cached length.

Quantised KV (engine option ``kv_cache_dtype`` = ``fp8`` or ``int8``): each layer's K and V
pool is a :class:`QuantizedKV`: the data in the same layout, stored as float8_e4m3fn or int8,
plus one bfloat16 scale per token per head, ``scale = amax(|x|) / qmax`` over head_dim
(qmax 448 for e4m3, 127 for symmetric int8), computed when ``write_kv`` stores the token.
A per-token scale needs no calibration, is never re-quantised as a block fills, and copies
with its slot. Every read dequantises (``data * scale`` in the compute dtype), including
a prefill with nothing cached, which reads its own just-written slots back, so a prompt
sees the same K/V whether it is computed at once, in chunks or from cached blocks. Decode
rows read 8-bit pools in place through the C++ ops (and the captured step), which quantise
the new token's K/V with the same arithmetic (the same bytes and scales) and dequantise each
row as ``data * scale`` rounded to the model dtype, as the torch path does: half the bytes
of a bfloat16 pool per token read.

Sliding windows and soft-caps (``attention(..., window=, softcap=)``; Mistral, Phi-3, Qwen2 and
Gemma's sliding layers, Gemma 2's soft-cap): a query at position p sees keys at positions
j > p - window only; scores (after the scale) become ``softcap * tanh(score / softcap)``
before the softmax. Every path has them: decode rows in the C++ op (it skips the keys before
``context_len - window``) or, on the torch path, through a windowed -inf
bias; a prefill span through SDPA with an explicit causal-and-window mask (positions, not
slots: a draft tree's node sits at its depth), or, with a soft-cap, which SDPA has not, its
scores computed in float32 a few query rows at a time; the batch-invariant mode in the C++
``slot_attention``. The masks are built on the first such layer of a step and kept in the
step's metadata; without a window or a soft-cap none of this runs. A window at least as long
as a span's context is no window (no mask is built for it).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from tokenloom.backends.torch_linear import (
    Int4Linear,
    Int8Linear,
    QuantMatmulLinear,
    StepRows,
    pack,
    step_linear,
)
from tokenloom.core.attention import AttentionInputs, apply_rope
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecodeModel
from tokenloom.core.weights import LowRankUpdated


class TorchBackendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # fp32 matmuls on CPU: "dual" keeps two layouts of each weight (2x weight memory): a
    # plain [in, out] copy for MKL's GEMV at <= 4 rows and a oneDNN-packed copy for
    # batches, 1.5-2.8x faster than MKL there on an AVX2 EPYC. "mkl" or "onednn" keep one.
    cpu_linear: str = "dual"
    # Quantised weights on CPU: above this many rows per matmul a dense copy (kept beside the
    # int4/int8 one) is faster than the quantised kernel; 0 keeps the quantised one only;
    # -1 measures the crossing per weight shape on this machine at load (backends/torch_linear.py).
    quant_max_rows: int = -1
    # 8-bit weights with per-group scales (GGUF Q8_0) are re-quantised to one scale per row so
    # the int8 kernel can run them (a second rounding); false dequantises them instead.
    int8_regroup: bool = True
    # Quantised matmuls on CPU: "cpp" runs 4-bit and symmetric 8-bit weights through the C++
    # quant_matmul (kernels/csrc/quant_matmul.h: float32 activations, the stored groups, rows
    # at a fraction of a first row's cost); "torch" through torch's int4pack / int8pack
    # kernels (bfloat16 activations); "auto" takes cpp where it builds, else torch.
    quant_kernel: str = "auto"
    # Above quant_max_rows, what a bfloat16 model's quant_matmul weights run: "amx" the C++
    # amx_matmul (kernels/csrc/amx_matmul.h: bfloat16 tiles widened from the codes as they
    # are read, on Intel AMX) up to 64 rows and the dense copy above (prompt chunks); "copy"
    # the dense bfloat16 copy (oneDNN) throughout; "auto" takes amx where the CPU and the
    # build have AMX-BF16, else copy. "q8" (asked for by name; any model dtype): the C++
    # q8_matmul (kernels/csrc/q8_matmul.h) for 4-bit and 8-bit weights, activations rounded
    # to 8 bits in blocks of 32 and multiplied with the codes as bytes on AVX512-VNNI
    # (llama.cpp's arithmetic); no dense copy is kept.
    quant_dense: str = "auto"
    # Decode attention on CPU: "fused" reads the KV blocks in place with one C++ op
    # (kernels/cpu_ops.py, built on first use); "torch" gathers each context with
    # torch ops; "auto" takes fused where it builds, else torch.
    decode_attention: str = "auto"
    # The batch-invariant mode (set from the engine's ``batch_invariant`` by core/build.py): a
    # row's result does not depend on the step's other rows (see TorchBackend.__init__).
    batch_invariant: bool = False


@dataclass(slots=True)
class TorchAttnMeta:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # [B] rows of q that decode one token
    decode_blocks: torch.Tensor | None  # [B * max_blocks] block ids, padded with block 0
    decode_bias: torch.Tensor | None  # [B, 1, max_blocks * block_size] 0 where valid, -inf past the context
    prefills: list  # (q_start, q_end, blocks [n] or None, context_len, mask [q, ctx] or None)
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] (the fused op's block tables)
    decode_lens: torch.Tensor | None = None  # [B] context lengths (the fused op's)
    # the batch-invariant mode's attention inputs: (slot_rows [R, W], q_row [T], q_len [T]),
    # every query of the step (kernels/csrc/attention.h ``slot_attention``)
    slots: tuple | None = None
    inputs: AttentionInputs | None = None  # the step's inputs (a window's masks are built from them)
    windowed: dict[Any, torch.Tensor] | None = None  # masks and biases of a window, built on first use


KV_STORAGE = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}  # dtype, qmax
# 2 bytes per token per head (TorchBackend.kv_bytes_per_token counts them). bfloat16, not float16: its
# range needs no clamping (a float16 scale floors at 6e-5, coarsening rows under ~0.01), and its
# coarser rounding costs nothing, as values are divided by the stored scale itself.
KV_SCALE_DTYPE = torch.bfloat16
_SCALE_MIN = torch.finfo(KV_SCALE_DTYPE).tiny  # an all-zero row: a finite scale, zeros back


@dataclass(slots=True, eq=False)
class QuantizedKV:
    """One layer's K (or V) pool in 8 bits: ``data`` [kv_heads, num_blocks, block_size, head_dim]
    (float8_e4m3fn or int8) and ``scale`` [kv_heads, num_blocks, block_size] (bfloat16); a
    slot's value is ``data.float() * scale``. ``dtype`` is the dtype K/V are handed over in
    and attention computes in (the model dtype), which is what the model casts q/k/v to; the
    storage dtype is ``data.dtype``. ``shape`` is the data's."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    qmax: float

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.data.dtype

    def _raw(self) -> torch.Tensor:
        # index_copy_ has no float8 kernel on CPU: move fp8 bytes through a uint8 view
        return self.data.view(torch.uint8) if self.data.dtype == torch.float8_e4m3fn else self.data

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., head_dim] -> (data in the storage dtype, scale [...])."""
        xf = x.float()
        scale = (xf.abs().amax(-1) / self.qmax).clamp_(min=_SCALE_MIN).to(KV_SCALE_DTYPE)
        q = xf / scale.float().unsqueeze(-1)  # by the stored (rounded) scale, the one a read multiplies by
        if self.data.dtype == torch.int8:
            q = q.round_()
        return q.clamp_(-self.qmax, self.qmax).to(self.data.dtype), scale

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """x: [T, kv_heads, head_dim] into flat slots ``slot_mapping`` [T]."""
        kv_heads, _, _, head_dim = self.data.shape
        q, scale = self.quantize(x.transpose(0, 1))  # [kv_heads, T, head_dim], [kv_heads, T]
        raw = self._raw()
        raw.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, q.view(raw.dtype))
        self.scale.view(kv_heads, -1).index_copy_(1, slot_mapping, scale)

    def gather_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantised [kv_heads, len(blocks), block_size, head_dim] in ``dtype``."""
        return self._dequant(self.data.index_select(1, blocks), self.scale.index_select(1, blocks))

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantised [kv_heads, len(slots), head_dim] in ``dtype``."""
        kv_heads, _, _, head_dim = self.data.shape
        return self._dequant(self.data.view(kv_heads, -1, head_dim).index_select(1, slots),
                             self.scale.view(kv_heads, -1).index_select(1, slots))

    def _dequant(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return data.to(self.dtype) * scale.to(self.dtype).unsqueeze(-1)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self.data[:, dst, :n] = self.data[:, src, :n]
        self.scale[:, dst, :n] = self.scale[:, src, :n]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_heads, _, _, head_dim = self.data.shape
        raw = self._raw().view(kv_heads, -1, head_dim)
        raw[:, dst] = raw[:, src]
        scale = self.scale.view(kv_heads, -1)
        scale[:, dst] = scale[:, src]


SMALL_BF16_BMM = 3 * 64 * 256  # gathered key elements up to which decode attention runs in fp32


class TorchBackend:
    """KV layout per layer: ``[kv_heads, num_blocks, block_size, head_dim]``. Head-major
    means gathering a batch's blocks along dim 1 yields ``[kv_heads * B, len, head_dim]``
    directly, which is what a batched matmul wants: no strided copy per layer."""

    name = "torch"

    def __init__(self, options: TorchBackendOptions | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        options = options or TorchBackendOptions()
        self.cpu_linear, self.quant_max_rows = options.cpu_linear, options.quant_max_rows
        self.int8_regroup = options.int8_regroup
        if self.cpu_linear not in ("dual", "mkl", "onednn"):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.cpu_linear must be dual, mkl or onednn, got {self.cpu_linear!r}")
        if self.cpu_linear != "mkl" and not torch.backends.mkldnn.is_available():
            self.cpu_linear = "mkl"
        if options.decode_attention not in ("auto", "fused", "torch"):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.decode_attention must be auto, fused or torch, got {options.decode_attention!r}")
        self.fused_decode = None  # the C++ paged decode attention ops (a module), when in use
        if options.decode_attention != "torch" and self.device.type == "cpu":
            from tokenloom.kernels import cpu_ops

            self.fused_decode = cpu_ops.load()
            if self.fused_decode is None and options.decode_attention == "fused":
                from tokenloom.core.errors import ConfigError

                raise ConfigError("backend.decode_attention = fused, but the C++ op could not be built: "
                                  f"{cpu_ops.unavailable_reason()}")
        self.decode_attention = "fused" if self.fused_decode is not None else "torch"
        if options.quant_kernel not in ("auto", "cpp", "torch"):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.quant_kernel must be auto, cpp or torch, got {options.quant_kernel!r}")
        if options.quant_dense not in ("auto", "amx", "copy", "q8"):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.quant_dense must be auto, amx, copy or q8, got {options.quant_dense!r}")
        self.quant_dense = options.quant_dense
        self.quant_ops = None  # the C++ ops whose quant_matmul runs quantised weights, when in use
        # this step's floor under the quantised weights' row thresholds (set by prepare)
        self.step_rows = StepRows()
        if options.quant_kernel != "torch" and self.device.type == "cpu":
            from tokenloom.kernels import cpu_ops

            self.quant_ops = cpu_ops.load()  # (the module built once above, or None again)
            if self.quant_ops is None and options.quant_kernel == "cpp":
                from tokenloom.core.errors import ConfigError

                raise ConfigError("backend.quant_kernel = cpp, but the C++ ops could not be built: "
                                  f"{cpu_ops.unavailable_reason()}")
        # the C++ ops whose amx_matmul stands in for quant_matmul weights' dense copies, or None
        self.amx_ops = self.quant_ops if self.quant_ops is not None and self.quant_dense in ("auto", "amx") and \
            self.quant_ops.amx_ready() else None
        # the C++ ops whose q8_matmul stands in for quant_matmul weights' dense copies, or None
        self.q8_ops = self.quant_ops if self.quant_ops is not None and self.quant_dense == "q8" and \
            self.quant_ops.q8_ready() else None
        if self.quant_dense in ("amx", "q8"):
            self._check_quant_dense(options)
        self.batch_invariant = options.batch_invariant
        if self.batch_invariant:
            self._check_batch_invariant(options)

    def _check_quant_dense(self, options: TorchBackendOptions) -> None:
        """``quant_dense = amx`` or ``q8`` asked for by name: refused, naming why, wherever its
        kernel would not run (``auto`` takes amx where it can and the dense copy elsewhere)."""
        from tokenloom.core.errors import ConfigError

        from .torch_linear import AMX_MAX_ROWS

        mode = options.quant_dense
        kernel = f"{mode}_matmul"
        why = None
        if self.device.type != "cpu":
            why = f"{kernel} is a CPU kernel and the device is {str(self.device)!r}"
        elif options.quant_kernel == "torch":
            why = (f"backend.quant_kernel = torch runs torch's int4 / int8 kernels, and {kernel} stands in for the "
                   "C++ quant_matmul's dense copy")
        elif options.batch_invariant:
            why = "batch_invariant keeps the quantised kernels at every row count"
        elif options.quant_max_rows == 0:
            why = "backend.quant_max_rows = 0 keeps the quantised kernels at every row count"
        elif mode == "amx" and options.quant_max_rows >= AMX_MAX_ROWS:
            why = (f"backend.quant_max_rows = {options.quant_max_rows} leaves no rows to it (it runs from there "
                   f"up to {AMX_MAX_ROWS})")
        elif self.quant_ops is None:
            from tokenloom.kernels import cpu_ops

            why = f"the C++ ops could not be built: {cpu_ops.unavailable_reason()}"
        elif mode == "amx" and self.amx_ops is None:
            why = "this CPU or build has no AMX-BF16 (kernels/csrc/amx_matmul.h: amx_ready() is False)"
        elif mode == "q8" and self.q8_ops is None:
            why = "this CPU or build has no AVX512-VNNI (kernels/csrc/q8_matmul.h: q8_ready() is False)"
        if why is not None:
            raise ConfigError(f"backend.quant_dense = {mode}, but {why}; use auto or copy")

    def _check_batch_invariant(self, options: TorchBackendOptions) -> None:
        """The batch-invariant mode: every row of a step takes the same kernels, whose reduction
        order does not depend on how many rows the step has:

        - matmuls: the int4 / int8 kernels at every row count (``quant_max_rows`` 0, no dense
          copy): their per-row results are the same bit for bit at 1 to 2,310 rows, where
          MKL's and oneDNN's dense GEMMs change with the row count (so a dense weight is
          refused at load, ``pack_linear``);
        - attention: one C++ kernel per query over its own list of key slots
          (``slot_attention``) for decode rows, prompt chunks and draft rows alike, keys taken
          in blocks of ``block_size`` in order, a float32 softmax;
        - the norms (the C++ ``add_rms_norm``, also for the final norm) and SwiGLU (the C++
          ``silu_mul``) row by row; RoPE and the residual adds are elementwise;
        - the captured step and the fused decode-attention op are off (their RoPE is C++'s).

        What it cannot make invariant is refused here with a ConfigError naming it."""
        from tokenloom.core.errors import ConfigError

        if self.device.type != "cpu":
            raise ConfigError(f"batch_invariant: the torch backend's invariant mode runs on CPU only, not on "
                              f"device {str(self.device)!r} (its kernels are the C++ CPU ops)")
        if options.quant_max_rows > 0:
            raise ConfigError(f"batch_invariant: backend.quant_max_rows = {options.quant_max_rows} sends matmuls "
                              "over more rows to a dense copy; the mode keeps the quantised kernels at every row "
                              "count (leave it at -1 or set 0)")
        if options.decode_attention == "torch":
            raise ConfigError("batch_invariant: backend.decode_attention = torch; the mode's attention is the "
                              "C++ op (leave it at auto)")
        self.quant_max_rows = 0
        if self.fused_decode is None:
            from tokenloom.kernels import cpu_ops

            raise ConfigError("batch_invariant: the mode needs the C++ CPU ops (kernels/cpu_ops.py), which "
                              f"could not be built: {cpu_ops.unavailable_reason()}")
        import structlog

        structlog.get_logger("tokenloom.backend").info(
            "batch_invariant", matmuls="int4/int8 kernels at every row count", attention="slot_attention (C++)",
            captured_step="off", fused_decode_attention="off")

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list[tuple]:
        """Per layer a (k, v) pair: plain tensors of ``dtype`` for ``kv_cache_dtype="auto"``,
        else two :class:`QuantizedKV` (8-bit data plus per-token-per-head scales)."""
        # Zeroed, not empty: padded decode rows read (and mask) unwritten slots, and
        # 0 * NaN from uninitialised memory would poison the probability-weighted sum.
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        if self.batch_invariant and kv_cache_dtype != "auto":
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"batch_invariant: kv_cache_dtype = {kv_cache_dtype} is not supported by the mode's "
                              "attention (it reads plain pools of the model dtype)")
        if kv_cache_dtype == "auto":
            return [(_pool_zeros(shape, dtype, self.device), _pool_zeros(shape, dtype, self.device))
                    for _ in range(num_layers)]
        if kv_cache_dtype not in KV_STORAGE:
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"kv_cache_dtype must be auto, fp8 or int8, got {kv_cache_dtype!r}")
        storage, qmax = KV_STORAGE[kv_cache_dtype]

        def pool() -> QuantizedKV:
            return QuantizedKV(_pool_zeros(shape, storage, self.device),
                               torch.zeros(shape[:3], dtype=KV_SCALE_DTYPE, device=self.device), dtype, qmax)

        return [(pool(), pool()) for _ in range(num_layers)]

    def kv_bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           kv_cache_dtype: str = "auto") -> int:
        """What :meth:`allocate_kv_cache` holds per token: K and V, every layer, each kv head
        ``head_dim`` elements of ``dtype``; 8-bit pools one byte per element plus one
        ``KV_SCALE_DTYPE`` scale per kv head."""
        if kv_cache_dtype == "auto":
            per_head = head_dim * dtype.itemsize
        elif kv_cache_dtype in KV_STORAGE:
            per_head = head_dim * KV_STORAGE[kv_cache_dtype][0].itemsize + KV_SCALE_DTYPE.itemsize
        else:
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"kv_cache_dtype must be auto, fp8 or int8, got {kv_cache_dtype!r}")
        return 2 * num_layers * num_kv_heads * per_head

    # ---- per-step metadata ------------------------------------------------------
    def prepare(self, inp: AttentionInputs) -> TorchAttnMeta:
        """The step's tensors (``inp.tensors``: block tables, lengths, rows) as the ops take
        them; per prefill span its blocks and, when it has a cached part or a tree, a mask."""
        dev, bs = self.device, inp.block_size
        t = inp.tensors(dev)
        # one sequence's rows (its decode row and draft chain) round as one row would
        self.step_rows.floor = len(inp.decode_rows) if inp.single_sequence else 0
        if self.batch_invariant:
            return TorchAttnMeta(inp.slot_mapping, None, None, None, [], slots=_query_slots(inp, t))
        decode_rows = decode_blocks = decode_bias = decode_tables = decode_lens = None
        if t.decode_rows is not None:
            decode_rows, decode_tables, decode_lens = t.decode_rows, t.decode_block_tables, t.decode_context_lens
            if self.fused_decode is None:  # the torch path: flat padded blocks and a -inf bias
                meta = _padded_decode(TorchAttnMeta(inp.slot_mapping, decode_rows, None, None, [], decode_tables,
                                                    decode_lens), bs)
                # (the lengths stay: a sliding window's bias is built from them)
                decode_blocks, decode_bias, decode_tables = meta.decode_blocks, meta.decode_bias, None
        prefills = []
        for i, span in enumerate(inp.prefills):
            if span.q_len == span.context_len and span.tree_parents is None:  # nothing cached: the new K/V directly
                prefills.append((span.q_start, span.q_end, None, span.context_len, None))
                continue
            blocks = t.prefill_block_tables[i, :(span.context_len + bs - 1) // bs]
            offset = span.context_len - span.q_len
            q = torch.arange(span.q_len, device=dev)[:, None]
            j = torch.arange(span.context_len, device=dev)[None, :]
            mask = j <= q + offset
            if span.tree_parents:
                mask[span.q_len - len(span.tree_parents):, span.context_len - len(span.tree_parents):] = \
                    _tree_mask(span.tree_parents, dev)
            prefills.append((span.q_start, span.q_end, blocks, span.context_len, mask))
        return TorchAttnMeta(inp.slot_mapping, decode_rows, decode_blocks, decode_bias, prefills, decode_tables,
                             decode_lens, inputs=inp)

    def move_kv_slots(self, kv_caches, src: list[int], dst: list[int]) -> None:
        """Copy the KV of flat slots ``src`` to slots ``dst`` in every layer (a tree's
        accepted branch into the positions it now holds); all reads happen before writes."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in kv_caches:
            for cache in (k_cache, v_cache):
                if isinstance(cache, QuantizedKV):
                    cache.move_slots(s, d)
                else:
                    kv_heads, _, _, head_dim = cache.shape
                    flat = cache.view(kv_heads, -1, head_dim)
                    flat[:, d] = flat[:, s]

    def copy_blocks(self, kv_caches, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first ``n`` token slots of block ``src`` into block ``dst``, every layer."""
        for k_cache, v_cache in kv_caches:
            for src, dst, n in copies:
                if isinstance(k_cache, QuantizedKV):  # the scales travel with their slots
                    k_cache.copy_block(src, dst, n)
                    v_cache.copy_block(src, dst, n)
                    continue
                k_cache[:, dst, :n] = k_cache[:, src, :n]
                v_cache[:, dst, :n] = v_cache[:, src, :n]

    # ---- ops --------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        # k_cache: [kv_heads, num_blocks, block_size, head_dim]; k: [T, kv_heads, head_dim]
        if isinstance(k_cache, QuantizedKV):
            k_cache.write(k, slot_mapping)
            v_cache.write(v, slot_mapping)
            return
        kv_heads, _, _, head_dim = k_cache.shape
        k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def attention(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float, window: int | None = None,
                  softcap: float | None = None):
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's); returns [T, H, D]. ``window`` /
        ``softcap``: a sliding-window or soft-capped layer (see :meth:`_windowed_attention`)."""
        if window is not None or softcap is not None:
            return self._windowed_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        if meta.slots is not None:  # the batch-invariant mode: every query alike
            return self.fused_decode.slot_attention(q, k_cache, v_cache, *meta.slots, scale)
        if not meta.prefills and meta.decode_rows is not None and meta.decode_rows.numel() == q.shape[0]:
            return self._decode_any(q, k_cache, v_cache, meta, scale)  # a pure decode step: rows in order
        out = torch.empty_like(q)
        kv_heads, _, block_size, head_dim = k_cache.shape
        quantized = isinstance(k_cache, QuantizedKV)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode_any(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        for q_start, q_end, blocks, context_len, mask in meta.prefills:
            qs = q[q_start:q_end].transpose(0, 1)  # [H, q, D]
            if blocks is None:
                if quantized:  # what was stored, not the exact k/v: the same values a later read sees
                    slots = meta.slot_mapping[q_start:q_end]
                    ks, vs = k_cache.gather_slots(slots), v_cache.gather_slots(slots)
                else:
                    ks, vs = k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1)
                o = _sdpa(qs, ks, vs, is_causal=True, scale=scale)
            else:
                ks, vs = _gather(k_cache, blocks), _gather(v_cache, blocks)
                ks = ks.view(kv_heads, -1, head_dim)[:, :context_len]
                vs = vs.view(kv_heads, -1, head_dim)[:, :context_len]
                o = _sdpa(qs, ks, vs, attn_mask=mask, scale=scale)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    def _windowed_attention(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float,
                            window: int | None, softcap: float | None):
        """:meth:`attention` of a sliding-window (``window`` tokens) and/or soft-capped layer, on
        the same paths as the plain one: decode rows by the C++ op (its ``window`` / ``softcap``
        arguments) or the torch path with a windowed bias; prefill spans by SDPA with a causal
        (or tree) mask and the window, or with a soft-cap by explicit float32 scores; the
        batch-invariant mode by ``slot_attention`` (its ``window`` / ``softcap`` arguments)."""
        if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"attention: a sliding window must be at least 1 token and a soft-cap positive, got "
                              f"window={window} softcap={softcap}")
        if meta.slots is not None:  # the batch-invariant mode: every query alike
            return self.fused_decode.slot_attention(q, k_cache, v_cache, *meta.slots, scale, window or 0,
                                                    softcap or 0.0)
        if not meta.prefills and meta.decode_rows is not None and meta.decode_rows.numel() == q.shape[0]:
            return self._decode_windowed(q, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)
        kv_heads, _, _, head_dim = k_cache.shape
        quantized = isinstance(k_cache, QuantizedKV)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode_windowed(q[meta.decode_rows], k_cache, v_cache, meta, scale, window,
                                                          softcap)
        for i, (q_start, q_end, blocks, context_len, mask) in enumerate(meta.prefills):
            qs = q[q_start:q_end].transpose(0, 1)  # [H, q, D]
            if blocks is None:  # nothing cached (mask None: causal)
                if quantized:
                    slots = meta.slot_mapping[q_start:q_end]
                    ks, vs = k_cache.gather_slots(slots), v_cache.gather_slots(slots)
                else:
                    ks, vs = k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1)
            else:
                ks = _gather(k_cache, blocks).view(kv_heads, -1, head_dim)[:, :context_len]
                vs = _gather(v_cache, blocks).view(kv_heads, -1, head_dim)[:, :context_len]
            if (window is not None and window < context_len) or (softcap is not None and mask is None):
                mask = _window_mask(meta, i, window)  # (window None: the causal mask, for the explicit scores)
            if softcap is not None:
                o = _softcapped_attention(qs, ks, vs, scale, softcap, mask)
            elif mask is None:
                o = _sdpa(qs, ks, vs, is_causal=True, scale=scale)
            else:
                o = _sdpa(qs, ks, vs, attn_mask=mask, scale=scale)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    def decode_attention_block(self, qkv, cos, sin, k_cache, v_cache, meta: TorchAttnMeta, num_heads: int,
                               scale: float):
        """A pure decode step with the fused op: RoPE, the KV write and attention in one C++
        call per layer (kernels/cpu_ops.py), on plain or 8-bit pools. None where it does not
        apply (a prefill in the step, no fused op): the model then calls the ops one by one."""
        if (self.fused_decode is None or meta.decode_tables is None or meta.prefills or meta.slots is not None
                or qkv.dtype != k_cache.dtype or meta.decode_rows.numel() != qkv.shape[0]):
            return None
        k, v, k_scale, v_scale = _pools(k_cache, v_cache)
        return self.fused_decode.decode_layer_attention(qkv, cos, sin, k, v, meta.slot_mapping, meta.decode_tables,
                                                        meta.decode_lens, num_heads, scale, k_scale, v_scale)

    def _decode_windowed(self, q, k_cache, v_cache, meta: TorchAttnMeta, scale: float, window: int | None,
                         softcap: float | None):
        """Decode rows of a sliding-window / soft-capped layer: the C++ op where the plain
        rows take it, else the torch path with the window's bias."""
        if meta.decode_tables is not None:
            k, v, k_scale, v_scale = _pools(k_cache, v_cache)
            return self.fused_decode.paged_decode_attention(q, k, v, meta.decode_tables, meta.decode_lens, scale,
                                                            window or 0, softcap or 0.0, k_scale, v_scale)
        bias = meta.decode_bias if window is None else _window_bias(meta, window)
        return self._decode(q, k_cache, v_cache, meta, scale, bias, softcap)

    def _decode_any(self, q, k_cache, v_cache, meta: TorchAttnMeta, scale: float):
        if meta.decode_tables is not None:
            k, v, k_scale, v_scale = _pools(k_cache, v_cache)
            return self.fused_decode.paged_decode_attention(q, k, v, meta.decode_tables, meta.decode_lens, scale,
                                                            0, 0.0, k_scale, v_scale)
        return self._decode(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: TorchAttnMeta, scale: float, bias: torch.Tensor | None = None,
                softcap: float | None = None):
        # q: [B, H, D] -> [KVH * B, G, D]; keys gathered to [KVH * B, L, D]; ``bias`` (None:
        # ``meta.decode_bias``) [B, 1, L] 0 where a key is seen, -inf where not
        B, H, D = q.shape
        kv_heads = k_cache.shape[0]
        group = H // kv_heads
        keys = _gather(k_cache, meta.decode_blocks).view(kv_heads * B, -1, D)
        values = _gather(v_cache, meta.decode_blocks).view(kv_heads * B, -1, D)
        if keys.dtype == torch.bfloat16 and keys.numel() <= SMALL_BF16_BMM:
            # CPU bf16 bmm has a fixed cost (~15 us here) that fp32 does not: for a few short
            # contexts, upcasting first is faster (8 us at batch 1, 80 tokens); past ~4K
            # elements per head the conversion costs more than it saves.
            keys, values = keys.float(), values.float()
        qg = q.view(B, kv_heads, group, D).transpose(0, 1).reshape(kv_heads * B, group, D).to(keys.dtype)
        scores = torch.bmm(qg, keys.transpose(1, 2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(kv_heads, B, group, -1) + (meta.decode_bias if bias is None else bias)
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads * B, group, -1)
        out = torch.bmm(probs, values).to(q.dtype)  # [KVH * B, G, D]
        return out.view(kv_heads, B, group, D).transpose(0, 1).reshape(B, H, D)

    def rope(self, x, cos, sin, out_dtype=None):
        """Rotate-half RoPE, core/attention.py's ``apply_rope`` (the reference) rounded to
        ``out_dtype`` (None: float32): with the C++ ops one pass (``rope_rows``, the same values) instead of
        about eight torch ops and two copies; else ``apply_rope`` (float32 cos/sin promote a
        bf16 ``x``: the same values as converting it first, without a copy op)."""
        if (self.fused_decode is not None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()):
            return self.fused_decode.rope_rows(x, cos, sin, out_dtype or torch.float32)
        y = apply_rope(x, cos, sin)
        return y if out_dtype is None else y.to(out_dtype)

    def argmax(self, x):
        """``x.argmax(-1)``; with the C++ ops two vectorised passes per row (``argmax_rows``,
        the same index): torch's reduction took 4-10 ms for 64 rows of a 49152-token vocabulary
        on 2 threads, a twentieth of a decode step; this takes ~1.5 ms."""
        if self.fused_decode is not None and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0:
            return self.fused_decode.argmax_rows(x)
        return x.argmax(dim=-1)

    def rms_norm(self, x, weight, eps: float):
        if self.batch_invariant and x.dim() == 2:  # row by row, as add_rms_norm (x is not changed)
            return self.fused_decode.add_rms_norm(x.float().contiguous(), None, weight, eps, torch.float32)
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float, dtype):
        """The residual stream ``h`` (float32) plus ``delta`` (None: nothing to add), and its
        RMSNorm in ``dtype``: returns ``(x, h + delta)``. With the C++ ops one call, updating
        ``h`` in place (the model owns it); else add, norm and cast as three torch ops."""
        if self.batch_invariant:
            h = h.contiguous()
        if self.fused_decode is not None and h.dtype == torch.float32 and h.dim() == 2 and h.is_contiguous():
            return self.fused_decode.add_rms_norm(h, delta, weight, eps, dtype), h
        if delta is not None:
            h = h + delta
        return F.rms_norm(h, (h.shape[-1],), weight, eps).to(dtype), h

    def pack_linear(self, spec, dtype):
        """Called once per matmul at load time: the LinearWeight this machine computes it
        with (backends/torch_linear.py says which kernel for which spec)."""
        if self.quant_dense == "amx" and dtype != torch.bfloat16:
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.quant_dense = amx runs bfloat16 models only, and a {dtype} one is loading "
                              "(the model's --dtype, or decoder.draft_dtype for a draft model); use bfloat16 "
                              "there, or quant_dense auto or copy")
        lw = pack(spec, dtype, cpu_linear=self.cpu_linear, quant_max_rows=self.quant_max_rows,
                  int8_regroup=self.int8_regroup, quant_ops=self.quant_ops, step_rows=self.step_rows,
                  amx_ops=self.amx_ops, q8_ops=self.q8_ops)
        if self.batch_invariant and not isinstance(lw, (Int4Linear, Int8Linear, QuantMatmulLinear)):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"batch_invariant: a {lw.out_features}x{lw.in_features} matmul would run "
                              f"{lw.kernel}, a dense GEMM whose per-row result changes with the row count; the "
                              "mode needs 4-bit or 8-bit weights (the embedded GGUF as it is, or --quantizer "
                              "int8 / rtn, or a GPTQ / AWQ checkpoint)")
        return lw

    def silu_mul(self, gate, up):
        # The C++ silu_mul (one pass, the same roundings) in the batch-invariant mode, where
        # torch's split of a large tensor between threads would make an element's rounding
        # depend on the row count, and for prompt chunks of SILU_MUL_ROWS rows or more, whose
        # gate/up halves outgrow the caches: one pass over them instead of two ops and a
        # temporary (2048 x 1536, 2 threads: 2.55 -> 1.67 ms). Below, these two vectorised torch
        # ops ran as fast (64 rows: 0.045 / 0.043 ms; 512: 0.357 / 0.342 ms).
        if gate.dim() == 2 and self.fused_decode is not None and (self.batch_invariant or
                                                                  gate.shape[0] >= SILU_MUL_ROWS):
            return self.fused_decode.silu_mul(gate, up)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate, up):
        return F.gelu(gate, approximate="tanh") * up

    def capture_decode(self, model: DecodeModel) -> CppDecodeStep | None:
        """On CPU with the C++ ops built: the whole decode step in one C++ call
        (kernels/cpu_ops.py ``DecodeStep``), the same ops in the same order as the model's
        Python, so the same output; a layer's q/k/v bias (Qwen2) and per-head q/k RMSNorm
        (Qwen3) included. None where a weight's kernel has no C++ mirror."""
        if self.fused_decode is None or self.batch_invariant:  # (the mode: logged at start-up)
            return None
        ops = self.fused_decode
        layers = []
        low_rank = any(isinstance(lw, LowRankUpdated) for layer in model.layers
                       for lw in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for layer in model.layers:
            linears = [step_linear(lw, ops) for lw in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(lin is None for lin in linears) or (layer.q_norm is None) != (layer.k_norm is None):
                return None
            layers.append(linears)
        step = ops.DecodeStep(model.embed, model.cos, model.sin, [lyr.input_norm for lyr in model.layers],
                              [lyr.post_norm for lyr in model.layers], *(list(col) for col in zip(*layers, strict=True)),
                              [lyr.qkv_bias for lyr in model.layers], [lyr.q_norm for lyr in model.layers],
                              [lyr.k_norm for lyr in model.layers], model.num_heads, model.num_kv_heads,
                              model.head_dim, model.rms_norm_eps, model.head_dim**-0.5, model.dtype)
        return CppDecodeStep(step, model.dtype, low_rank, self.step_rows)


class CppDecodeStep:
    """The captured decode step (``TorchBackend.capture_decode``): runs a pure decode step on
    KV pools of the model dtype, plain or 8-bit, and returns None for any other step."""

    def __init__(self, step, dtype: torch.dtype, low_rank: bool = False, step_rows: StepRows | None = None):
        self.step, self.dtype = step, dtype
        self.step_rows = step_rows or StepRows()  # the backend's: this step's floor under the row thresholds
        self.low_rank = low_rank  # it runs the adapters' updates of LowRankUpdated matmuls
        self._bound = None  # the kv_caches list the C++ step holds
        self.steps = 0  # steps it ran (the rest ran op by op)

    def __call__(self, input_ids, positions, kv_caches, meta: TorchAttnMeta):
        if meta.prefills or meta.decode_tables is None or meta.decode_rows.numel() != input_ids.numel():
            return None
        if kv_caches is not self._bound:
            if kv_caches[0][0].dtype != self.dtype:
                return None
            pools = [_pools(k, v) for k, v in kv_caches]
            quantized = isinstance(kv_caches[0][0], QuantizedKV)
            self.step.bind([p[0] for p in pools], [p[1] for p in pools],
                           [p[2] for p in pools] if quantized else [], [p[3] for p in pools] if quantized else [])
            self._bound = kv_caches
        self.steps += 1
        return self.step.run(input_ids, positions, meta.slot_mapping, meta.decode_tables, meta.decode_lens,
                             self.step_rows.floor)


_HUGE_PAGE = 2 << 20
#: rows from which TorchBackend.silu_mul runs the C++ op outside the batch-invariant mode
SILU_MUL_ROWS = 1024


def _pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool; on Linux CPUs in memory asked to be backed by 2 MB pages
    (``madvise(MADV_HUGEPAGE)`` before the first touch, where transparent huge pages are
    ``madvise`` or ``always``): the decode attention reads each context's blocks from wherever
    they lie, a new 4 KB page every block or two, and the page walks cost it about 5% (30
    layers' pools, 64 contexts of 208 keys, 2 threads, 23.1 -> 22.0 ms). Elsewhere, or where
    the call fails, plain ``torch.zeros``."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if device.type == "cpu" and nbytes >= 4 * _HUGE_PAGE else None
    if madvise is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    # MADV_HUGEPAGE (14); a failure (no THP) leaves ordinary pages
    madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes // _HUGE_PAGE * _HUGE_PAGE), 14)
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()  # (the view keeps raw's storage)


@functools.cache
def _madvise():
    """libc's ``madvise`` on Linux, else None (looked up once)."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def _pools(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A layer's K and V pools as the C++ ops take them: (k, v, None, None) for plain pools,
    (k data, v data, k scales, v scales) for 8-bit ones."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.data, v_cache.data, k_cache.scale, v_cache.scale
    return k_cache, v_cache, None, None


def _sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """A prefill span's attention, ``q [H, q_len, D]`` over ``k``/``v`` ``[KVH, len, D]``: with a
    batch dimension of one, which sends it to torch's flash-attention kernel on CPU instead of
    the math fallback a 3-D call takes (1.3-1.8x at 64-384 keys, bf16, 2 threads)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kwargs)[0]


def _padded_decode(meta: TorchAttnMeta, block_size: int) -> TorchAttnMeta:
    """The torch path's inputs (flat padded blocks, a -inf bias past each context) from the
    fused op's (block tables, lengths); built once per step and kept in ``meta``."""
    if meta.decode_blocks is None:
        tables, lens = meta.decode_tables, meta.decode_lens
        valid = torch.arange(tables.shape[1] * block_size, device=lens.device)[None, :] < lens[:, None]
        meta.decode_bias = torch.zeros(valid.shape, dtype=torch.float32, device=lens.device) \
            .masked_fill_(~valid, float("-inf"))[:, None, :]
        meta.decode_blocks = tables.reshape(-1)
    return meta


def _window_bias(meta: TorchAttnMeta, window: int) -> torch.Tensor:
    """The decode rows' bias [B, 1, L] under a sliding window: 0 for the keys at positions
    ``context_len - window`` .. ``context_len - 1``, -inf elsewhere (built once per step)."""
    if meta.windowed is None:
        meta.windowed = {}
    bias = meta.windowed.get(("decode", window))
    if bias is None:
        lens = meta.decode_lens[:, None]
        j = torch.arange(meta.decode_bias.shape[-1], device=lens.device)[None, :]
        seen = (j < lens) & (j >= lens - window)
        bias = torch.zeros(seen.shape, dtype=torch.float32, device=lens.device) \
            .masked_fill_(~seen, float("-inf"))[:, None, :]
        meta.windowed[("decode", window)] = bias
    return bias


def _window_mask(meta: TorchAttnMeta, i: int, window: int | None) -> torch.Tensor:
    """Prefill span ``i``'s mask [q_len, context_len] (True: seen) under a sliding window: its
    causal (or draft-tree) mask and ``query position - key position < window`` (window None:
    the causal / tree mask alone). Positions, not slots: a draft tree's node and its key sit at
    the node's depth after the context before the tree (core/runner.py), everything else at
    its slot's index. Built once per step."""
    if meta.windowed is None:
        meta.windowed = {}
    got = meta.windowed.get((i, window))
    if got is not None:
        return got
    q_start, q_end, _, context_len, mask = meta.prefills[i]
    q_len = q_end - q_start
    device = meta.slot_mapping.device
    key_pos = torch.arange(context_len, device=device)
    parents = meta.inputs.prefills[i].tree_parents if meta.inputs is not None else None
    if parents:
        depth: list[int] = []
        for p in parents:  # (a node's parent comes before it)
            depth.append(0 if p < 0 else depth[p] + 1)
        before = context_len - len(parents)
        key_pos[before:] = before + torch.tensor(depth, device=device)
    dist = key_pos[context_len - q_len:, None] - key_pos[None, :]  # query i is key context_len - q_len + i
    seen = mask.clone() if mask is not None else dist >= 0
    if window is not None:
        seen &= dist < window
    meta.windowed[(i, window)] = seen
    return seen


#: score elements (float32) one step of the soft-capped prefill computes at a time (64 MiB)
SOFTCAP_CHUNK = 1 << 24


def _softcapped_attention(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float, softcap: float,
                          mask: torch.Tensor) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA has not: qs [H, q, D], ks/vs [KVH, n, D],
    ``mask`` [q, n] bool (True: seen). In float32: ``scores = q k^T * scale``, ``softcap *
    tanh(scores / softcap)``, masked, softmax, times v; a block of query rows at a time
    (:data:`SOFTCAP_CHUNK` scores). Returns [H, q, D] in qs's dtype."""
    H, nq, D = qs.shape
    kv_heads, n, _ = ks.shape
    group = H // kv_heads
    qf = qs.float().reshape(kv_heads, group, nq, D)
    kt = ks.float().transpose(1, 2)[:, None]  # [KVH, 1, D, n]
    vf = vs.float()[:, None]  # [KVH, 1, n, D]
    out = torch.empty(kv_heads, group, nq, D, dtype=torch.float32, device=qs.device)
    rows = max(1, SOFTCAP_CHUNK // max(1, H * n))
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        scores = torch.matmul(qf[:, :, r0:r1], kt).mul_(scale).div_(softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~mask[r0:r1], float("-inf"))
        out[:, :, r0:r1] = torch.matmul(torch.softmax(scores, dim=-1), vf)
    return out.view(H, nq, D).to(qs.dtype)


def _query_slots(inp: AttentionInputs, t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch-invariant mode's attention inputs: for each query (row) of the step, the flat
    KV slots it attends to, in position order, as ``(slot_rows [R, W], q_row [T], q_len [T])``:
    a decode row its sequence's slots; a prompt chunk's (or a linear draft's) queries share
    their span's row, each with its causal length; a draft tree's node gets its own row, the
    context before the tree and then the lookahead slots of its ancestors and itself, so that
    it sees the same keys in the same order as the token would at its depth in a plain
    decode."""
    bs = inp.block_size
    T = int(inp.slot_mapping.numel())
    q_row = torch.empty(T, dtype=torch.long)
    q_len = torch.empty(T, dtype=torch.long)
    parts: list[torch.Tensor] = []  # blocks of rows [n, width]
    num_rows = 0
    offsets = torch.arange(bs, dtype=torch.long)
    if t.decode_rows is not None:
        tables = t.decode_block_tables
        parts.append((tables[:, :, None] * bs + offsets).reshape(tables.shape[0], -1))
        q_row[t.decode_rows] = torch.arange(tables.shape[0])
        q_len[t.decode_rows] = t.decode_context_lens
        num_rows = tables.shape[0]
    for i, span in enumerate(inp.prefills):
        blocks = t.prefill_block_tables[i, :(span.context_len + bs - 1) // bs]
        base = (blocks[:, None] * bs + offsets).reshape(-1)[:span.context_len]
        k = len(span.tree_parents) if span.tree_parents else 0
        causal = span.q_len - k  # rows before the tree (all of them without one)
        q_row[span.q_start:span.q_start + causal] = num_rows
        q_len[span.q_start:span.q_start + causal] = torch.arange(span.context_len - span.q_len + 1,
                                                                 span.context_len - k + 1)
        parts.append(base[None])
        num_rows += 1
        if k:
            before = span.context_len - k
            for node in range(k):
                path = [node]
                while span.tree_parents[path[-1]] >= 0:
                    path.append(span.tree_parents[path[-1]])
                row = span.q_start + causal + node
                q_row[row], q_len[row] = num_rows, before + len(path)
                parts.append(torch.cat([base[:before], base[before + torch.tensor(path[::-1])]])[None])
                num_rows += 1
    slot_rows = torch.zeros(num_rows, max(part.shape[1] for part in parts), dtype=torch.long)
    row = 0
    for part in parts:
        slot_rows[row:row + part.shape[0], :part.shape[1]] = part
        row += part.shape[0]
    return slot_rows, q_row, q_len


def _tree_mask(parents: list[int], device) -> torch.Tensor:
    """[k, k] bool: node i sees node j when j is i or one of its ancestors."""
    k = len(parents)
    mask = torch.eye(k, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(device)


def _gather(cache, blocks: torch.Tensor) -> torch.Tensor:
    """[kv_heads, len(blocks), block_size, head_dim] of ``blocks``, dequantised if need be."""
    return cache.gather_blocks(blocks) if isinstance(cache, QuantizedKV) else cache.index_select(1, blocks)


@hookimpl
def register_backends(register):
    register("torch", TorchBackend, options=TorchBackendOptions,
             description="PyTorch reference backend (CPU or CUDA)")
