"""The torch backend's matmul weights: each a LinearWeight (``apply``, ``nbytes``, ``kernel``).

Which kernel runs depends on the spec, the device and the batch:

- dense fp32 on CPU: MKL GEMV on a [in, out] copy for few rows, oneDNN-packed GEMM above
  (``cpu_linear = "dual"`` keeps both, 2x memory, and times them per shape at load to find
  where oneDNN starts winning: 4 rows on an AVX2 EPYC, fewer on a Zen 5);
- dense bf16 on a CPU whose oneDNN computes bf16 natively (AVX512-BF16, AMX): packed once at
  load for oneDNN's GEMM (``_reorder_linear_weight``), 1.2-2x ``F.linear`` at 8-64 rows on a
  Zen 5, because ``F.linear`` re-lays the weight out on every call (the 49152-row head at 32
  rows: 3.2 ms against 6.3 ms); ``cpu_linear = "mkl"`` keeps ``F.linear``;
- dense fp16, bf16 elsewhere, or any dense weight on CUDA: ``F.linear``;
- 4-bit group-quantised (GGUF Q4_0/Q4_1, RTN, GPTQ, AWQ) and symmetric 8-bit (per channel or
  in groups: GGUF Q8_0, SmolLM2's tied embedding and head) on CPU: the C++ ``quant_matmul``
  (``QuantMatmulLinear``; float32 activations and sums, one pass over the codes for all rows,
  each row's result independent of the others) where the C++ ops build and the weight fits
  (``QuantMatmulLinear.fits``); ``quant_kernel = "torch"`` or a weight it does not take goes
  to torch's kernels below;
- otherwise 4-bit: ``torch._weight_int4pack_mm_for_cpu`` with bf16 activations (it has no
  fast fp32 path); 8-bit per-channel symmetric: ``torch._weight_int8pack_mm`` (bf16
  activations); 8-bit with finer groups: with ``int8_regroup`` (default) re-quantised to one
  scale per row for that kernel — a second rounding, of at most half an int8 step of the
  row's range; without, dequantised;
- above ``quant_max_rows`` rows (every quantised kernel) a dense copy in the engine dtype,
  kept beside the quantised one, is used instead: the kernels are built for few rows.
  ``quant_max_rows = -1`` (the default) measures where that crossing lies on this machine,
  per weight shape, at load (``_tuned``; `tokenloom bench kernels` prints the timings).
  On a CPU with AMX-BF16 a bfloat16 model's ``quant_matmul`` weights run the C++
  ``amx_matmul`` over the same codes between that threshold and ``AMX_MAX_ROWS`` rows
  (``AmxLinear``; ``backend.quant_dense``), the dense copy only above. With ``quant_dense =
  "q8"`` (asked for by name, AVX512-VNNI) 4-bit and symmetric 8-bit ones run the C++
  ``q8_matmul`` with 8-bit activations everywhere above the threshold (``Q8Linear``), and no
  dense copy is built. A step whose rows are all one sequence's (its decode row and draft
  chain, a batch-1 verification) keeps the quantised kernel at any row count (``StepRows``),
  so each row rounds as a plain one-row decode step does;
- anything else (fp8, quantised specs on CUDA): dequantised once at load to the engine
  dtype — the kernel name says so.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tokenloom.core.weights import (
    Fp8Weight,
    LowRankUpdated,
    QuantizedWeight,
    WeightSpec,
    dequantize,
)

INT4_GROUP_SIZES = (32, 64, 128, 256)


class DenseLinear:
    __slots__ = ("weight", "out_features", "in_features", "kernel")

    def __init__(self, weight: torch.Tensor, kernel: str = "F.linear"):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.kernel = f"{kernel} ({str(weight.dtype).removeprefix('torch.')})"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class PackedLinear:
    """A CPU fp32 weight in the layout(s) the chosen GEMM wants; a bf16 one packed for oneDNN
    only (mode ``onednn``)."""

    __slots__ = ("out_features", "in_features", "itemsize", "wt", "onednn", "kernel", "max_rows")

    def __init__(self, weight: torch.Tensor, mode: str):
        self.out_features, self.in_features = weight.shape
        self.itemsize = weight.element_size()
        self.max_rows = 4  # "dual": MKL up to this many rows, oneDNN above (measured at load: _tuned_dual)
        self.wt = weight.t().contiguous() if mode in ("dual", "mkl") else None
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None) if mode in ("dual", "onednn") else None
        dtype = str(weight.dtype).removeprefix("torch.")
        self.kernel = {"dual": "mkl-gemv+onednn", "mkl": "mkl", "onednn": "onednn packed"}[mode] + f" ({dtype})"

    def nbytes(self) -> int:
        """Bytes one matmul reads (one layout)."""
        return self.out_features * self.in_features * self.itemsize

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.onednn is None or (self.wt is not None and x2.shape[0] <= self.max_rows):
            out = self.by_mkl(x2)
        else:
            out = self.by_onednn(x2)
        return out.view(*x.shape[:-1], self.out_features)

    def by_mkl(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.mm(x2, self.wt)

    def by_onednn(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2, self.onednn, None, "none", [], "")


class StepRows:
    """What a step tells its quantised matmuls (one per backend, shared by its weights and
    its captured step): ``floor``, the row count up to which each keeps its own kernel
    whatever its threshold. The backend sets it per step: the row count when every row is
    one sequence's (``AttentionInputs.single_sequence``), else 0. It holds until the next
    step's ``prepare``, so what a decoder computes from that step's hidden rows after the
    forward (Medusa's heads through the output head) rounds as the step did."""

    __slots__ = ("floor",)

    def __init__(self) -> None:
        self.floor = 0


NO_STEP_ROWS = StepRows()  # (a weight packed outside a backend: its threshold alone decides)


class _QuantisedLinear:
    """A quantised kernel for few rows, and the dense copy (when kept) for more."""

    __slots__ = ()

    def takes_dense(self, rows: int) -> bool:
        """Whether ``rows`` rows go to the dense copy: above the threshold and the step's floor."""
        return self.dense is not None and rows > self.max_rows and rows > self.step_rows.floor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self.takes_dense(x.shape[0]):
            return self.dense.apply(x)
        if x.dtype == torch.bfloat16:  # the kernels' own dtype: no conversion op either way
            return self.quantised(x)
        return self.quantised(x).to(x.dtype)


class Int4Linear(_QuantisedLinear):
    """4-bit codes packed for torch's CPU int4 kernel: w = (q - 8) * scale + zero' per group,
    where zero' = (8 - zero) * scale turns our zero points into the kernel's form."""

    __slots__ = ("packed", "scales_zeros", "group_size", "out_features", "in_features", "dense", "max_rows",
                 "step_rows", "kernel", "_nbytes")

    def __init__(self, qw: QuantizedWeight, max_rows: int, dense):
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.packed = torch._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32).contiguous(), 1)
        zero = (8.0 - qw.zeros) * qw.scales  # [out, groups]
        self.scales_zeros = torch.stack([qw.scales, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.max_rows, self.step_rows = max_rows, NO_STEP_ROWS
        self.dense = dense  # the backend's dense LinearWeight of the same values, or None
        self._nbytes = qw.nbytes()
        self.kernel = "int4pack_mm (bf16 act)" + (f" / dense above {max_rows} rows" if max_rows > 0 else "")

    def quantised(self, x2: torch.Tensor) -> torch.Tensor:
        """The 4-bit kernel itself on ``x2 [rows, in]``, whatever the row count."""
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)

    def nbytes(self) -> int:
        return self._nbytes


class QuantMatmulLinear(_QuantisedLinear):
    """4-bit codes, or symmetric 8-bit ones, with their per-group scales as stored, for the C++
    ``quant_matmul`` (kernels/csrc/quant_matmul.h): activations and sums in float32 whatever
    the engine dtype, the scales (and 4-bit offsets, -zero * scale) in float16 (exact for
    GGUF's, rounded to 11 significant bits for a float32 quantizer's), one pass over the codes
    for all rows (each row's result is the same whatever the rows beside it). Layouts: 16
    output columns side by side, so a 16-byte load feeds 16 accumulators."""

    __slots__ = ("codes", "sm", "bits", "group_size", "out_features", "in_features", "dense", "max_rows",
                 "step_rows", "kernel", "_op", "_nbytes")

    def __init__(self, qw: QuantizedWeight, op, max_rows: int, dense):
        self.out_features, self.in_features = out, inp = qw.shape
        self.bits, self.group_size, self._op = qw.bits, qw.group_size, op
        groups = inp // qw.group_size
        scales = qw.scales.to(torch.float32)
        if qw.bits == 4:
            c = qw.codes.contiguous().view(out // 16, 16, inp // 2, 2)
            self.codes = (c[..., 0] | (c[..., 1] << 4)).permute(0, 2, 1).contiguous()
            offsets = -qw.zeros.to(torch.float32) * scales
            sm = torch.stack([scales.view(out // 16, 16, groups), offsets.view(out // 16, 16, groups)], dim=1)
            self.sm = sm.permute(0, 3, 1, 2).to(torch.float16).contiguous()  # [out/16, groups, 2, 16]
        else:
            signed = (qw.codes.to(torch.int16) - 128).to(torch.int8)
            self.codes = signed.contiguous().view(out // 16, 16, inp).permute(0, 2, 1).contiguous()
            self.sm = scales.view(out // 16, 16, groups).permute(0, 2, 1).to(torch.float16).contiguous()  # [out/16, groups, 16]
        self.max_rows, self.dense, self.step_rows = max_rows, dense, NO_STEP_ROWS
        self._nbytes = qw.nbytes()
        self.kernel = f"quant_matmul int{qw.bits} g{qw.group_size} (float32 sums)" + (
            f" / dense above {max_rows} rows" if dense is not None else "")

    @staticmethod
    def fits(qw: QuantizedWeight) -> bool:
        """Whether the kernel takes ``qw``: 4-bit, or 8-bit with every zero point 128 (a signed
        code), in groups that divide the rows (even, unless one group a row), 16 | out, with
        scales (and offsets) that float16 holds (:func:`_float16_holds`)."""
        out, inp = qw.shape
        if qw.g_idx is not None or out % 16 or inp % qw.group_size:
            return False
        if qw.bits == 4:
            shape_fits = qw.group_size % 2 == 0
        else:
            shape_fits = qw.bits == 8 and (qw.group_size % 2 == 0 or qw.group_size == inp) and bool(
                (qw.zeros == 128).all())
        return shape_fits and _float16_holds(qw.scales) and (qw.bits == 8 or _float16_holds(qw.zeros * qw.scales))

    def quantised(self, x2: torch.Tensor) -> torch.Tensor:
        """The kernel itself on ``x2 [rows, in]``, whatever the row count (out in x2's dtype)."""
        return self._op(x2, self.codes, self.sm, self.bits, self.group_size)

    def apply_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``apply(x)`` in float32: where the kernel runs, its float32 sums unrounded (x is
        widened first, exactly); above ``max_rows`` the dense copy's result, widened."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.takes_dense(x2.shape[0]):
            if isinstance(self.dense, AmxLinear):
                return self.dense.apply_float32(x)
            return self.dense.apply(x).float()
        return self.quantised(x2.float()).view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self._nbytes


#: rows up to which AmxLinear runs amx_matmul; its dense copy above (prompt chunks), where
#: oneDNN's own AMX GEMM over the copy wins (docs/quantization.md has the timings)
AMX_MAX_ROWS = 64


class AmxLinear:
    """What a bfloat16 model's :class:`QuantMatmulLinear` runs above its row threshold on a
    CPU with AMX-BF16, up to ``max_rows``: the C++ ``amx_matmul``
    (kernels/csrc/amx_matmul.h) over the same packed codes and scales, which widens each
    16-column block to bfloat16 weights (a dense bfloat16 copy's, up to a last bit) as it
    reads it and multiplies on the tile unit with float32 sums: it reads the codes (a quarter
    of a dense copy's bytes at 4 bits). Above ``max_rows`` (prompt chunks) the dense copy."""

    __slots__ = ("codes", "sm", "bits", "group_size", "out_features", "in_features", "kernel", "dense", "max_rows",
                 "_op")

    def __init__(self, q: QuantMatmulLinear, op, dense, max_rows: int):
        self.codes, self.sm, self.bits, self.group_size = q.codes, q.sm, q.bits, q.group_size
        self.out_features, self.in_features, self._op = q.out_features, q.in_features, op
        self.dense, self.max_rows = dense, max_rows
        self.kernel = f"amx_matmul int{q.bits} g{q.group_size} (bfloat16 weights, float32 sums)" + (
            f" / dense above {max_rows} rows" if dense is not None else "")

    @staticmethod
    def fits(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
        """A bfloat16 model, and groups (and so the rows) in multiples of 32: one tile's depth."""
        return dtype == torch.bfloat16 and qw.group_size % 32 == 0 and qw.shape[1] % 32 == 0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.dense is not None and x2.shape[0] > self.max_rows:
            return self.dense.apply(x)
        return self._op(x2, self.codes, self.sm, self.bits, self.group_size).view(*x.shape[:-1], self.out_features)

    def apply_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``apply(x)`` with amx_matmul's float32 sums unrounded (the output head's logits);
        the dense copy's result, widened, above ``max_rows``."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.dense is not None and x2.shape[0] > self.max_rows:
            return self.dense.apply(x).float()
        return self._op(x2, self.codes, self.sm, self.bits, self.group_size, True).view(*x.shape[:-1],
                                                                                        self.out_features)

    def nbytes(self) -> int:
        return 0  # (the QuantMatmulLinear's codes and scales)


class Q8Linear:
    """What a :class:`QuantMatmulLinear` runs above its row threshold under
    ``backend.quant_dense = "q8"``: the C++ ``q8_matmul`` (kernels/csrc/q8_matmul.h), which
    rounds each row's activations to 8 bits in blocks of 32 (llama.cpp's Q8 blocks) and
    multiplies them with the codes (4-bit, or symmetric 8-bit ones as unsigned bytes, GGUF
    Q8_0's value + 128) as bytes (AVX512-VNNI): twice the multiply-adds an
    instruction of a bfloat16 GEMM, at the cost of that rounding. A row's result does not
    depend on the rows beside it. It keeps its own copy of the codes (a byte a weight, in the
    kernel's layout: half a bfloat16 copy) and float32 scales; no dense copy is built."""

    __slots__ = ("codes", "sm", "bits", "group_size", "out_features", "in_features", "kernel", "_op")

    def __init__(self, qw: QuantizedWeight, op):
        self.out_features, self.in_features = out, inp = qw.shape
        self.bits, self.group_size, self._op = qw.bits, qw.group_size, op
        groups = inp // qw.group_size
        c = qw.codes.to(torch.uint8).contiguous().view(out // 16, 16, inp // 4, 4)
        self.codes = c.permute(0, 2, 1, 3).contiguous()  # [N/16, K/4, 16, 4]: a code a byte
        scales = qw.scales.to(torch.float32)
        offsets = -qw.zeros.to(torch.float32) * scales
        sm = torch.stack([scales.view(out // 16, 16, groups), offsets.view(out // 16, 16, groups)], dim=1)
        self.sm = sm.permute(0, 3, 1, 2).contiguous()  # [N/16, groups, 2, 16]
        self.kernel = f"q8_matmul int{qw.bits} g{qw.group_size} (8-bit activations in blocks of 32, int32 sums)"

    @staticmethod
    def fits(qw: QuantizedWeight) -> bool:
        """4-bit codes, or symmetric 8-bit ones (every zero point 128), in groups (and rows) of a
        multiple of 32, 32 | out."""
        out, inp = qw.shape
        bits_fit = qw.bits == 4 or (qw.bits == 8 and bool((qw.zeros == 128).all()))
        return bits_fit and qw.g_idx is None and qw.group_size % 32 == 0 and inp % qw.group_size == 0 and \
            out % 32 == 0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            return self._op(x2.float(), self.codes, self.sm, self.bits, self.group_size).to(x.dtype).view(
                *x.shape[:-1], self.out_features)
        return self._op(x2, self.codes, self.sm, self.bits, self.group_size).view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return 0  # (the QuantMatmulLinear's codes and scales are what a few-row step reads)


def _float16_holds(t: torch.Tensor) -> bool:
    """Whether float16 holds every value of ``t`` exactly (GGUF's float16 scales, subnormal
    ones included) or to float16's own precision (a relative error of at most 2^-11, as for a
    float32 scale in its normal range); False if a value overflows or loses more as a
    subnormal."""
    t = t.float()
    h = t.half().float()
    return bool(torch.isfinite(h).all() and ((h - t).abs() <= t.abs() * 2.0 ** -11).all())


class Int8Linear(_QuantisedLinear):
    """Symmetric 8-bit per output channel for torch's CPU int8 weight-only kernel."""

    __slots__ = ("weight", "scales", "out_features", "in_features", "dense", "max_rows", "step_rows", "kernel")

    def __init__(self, qw: QuantizedWeight, max_rows: int, dense, kernel: str = "int8pack_mm (bf16 act)"):
        self.out_features, self.in_features = qw.shape
        self.weight = (qw.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        self.scales = qw.scales[:, 0].to(torch.bfloat16).contiguous()
        self.max_rows, self.dense, self.step_rows = max_rows, dense, NO_STEP_ROWS
        self.kernel = kernel + (f" / dense above {max_rows} rows" if dense is not None else "")

    def quantised(self, x2: torch.Tensor) -> torch.Tensor:
        """The int8 kernel itself on ``x2 [rows, in]``, whatever the row count."""
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        return torch._weight_int8pack_mm(x2, self.weight, self.scales)

    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 2


def is_int8_per_channel(qw: QuantizedWeight) -> bool:
    return qw.bits == 8 and qw.group_size == qw.shape[1] and bool((qw.zeros == 128).all())


def per_channel_int8(qw: QuantizedWeight) -> QuantizedWeight:
    """8-bit codes with per-group scales re-quantised to one symmetric scale per row."""
    w = qw.dequantize()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (torch.round(w / scales).clamp(-127, 127) + 128).to(torch.uint8)
    return QuantizedWeight(codes=codes, scales=scales, zeros=torch.full_like(scales, 128.0), bits=8,
                           group_size=w.shape[1])


def pack(spec: WeightSpec, dtype: torch.dtype, *, cpu_linear: str, quant_max_rows: int, int8_regroup: bool = True,
         quant_ops=None, step_rows: StepRows | None = None, amx_ops=None, q8_ops=None):
    """The torch backend's choice of LinearWeight for ``spec`` (see the module docstring);
    ``quant_ops``: the C++ ops module whose ``quant_matmul`` takes the quantised weights it
    fits, or None for torch's kernels; ``step_rows``: the backend's per-step floor, which a
    quantised weight reads; ``amx_ops``: the C++ ops whose ``amx_matmul`` replaces the dense
    copy of a bfloat16 model's quant_matmul weights (:class:`AmxLinear`), or None; ``q8_ops``: the
    C++ ops whose q8_matmul replaces the dense copy of 4-bit and symmetric 8-bit quant_matmul
    weights (:class:`Q8Linear`, ``quant_dense = "q8"``), or None."""
    lw = _pack(spec, dtype, cpu_linear=cpu_linear, quant_max_rows=quant_max_rows, int8_regroup=int8_regroup,
               quant_ops=quant_ops, amx_ops=amx_ops, q8_ops=q8_ops)
    if step_rows is not None and isinstance(lw, _QuantisedLinear):
        lw.step_rows = step_rows
    return lw


def _pack(spec: WeightSpec, dtype: torch.dtype, *, cpu_linear: str, quant_max_rows: int, int8_regroup: bool,
          quant_ops, amx_ops=None, q8_ops=None):
    cpu = (spec.device if isinstance(spec, torch.Tensor) else _device(spec)).type == "cpu"
    if isinstance(spec, QuantizedWeight) and cpu and spec.g_idx is None:
        out, inp = spec.shape

        def dense():  # the copy used above quant_max_rows, built only for a quantised kernel
            return _dense(spec.dequantize(dtype), cpu_linear, "") if quant_max_rows != 0 else None

        if quant_ops is not None and QuantMatmulLinear.fits(spec):
            kind = ("quant_matmul", f"int{spec.bits}", f"g{spec.group_size}")
            if amx_ops is not None and quant_max_rows != 0 and quant_max_rows < AMX_MAX_ROWS and \
                    AmxLinear.fits(spec, dtype):
                lw = QuantMatmulLinear(spec, quant_ops.quant_matmul, quant_max_rows, None)
                lw.dense = AmxLinear(lw, amx_ops.amx_matmul, dense(), AMX_MAX_ROWS)  # (its codes and scales)
                if quant_max_rows > 0:
                    lw.kernel += f" / amx_matmul above {quant_max_rows} rows / dense above {AMX_MAX_ROWS} rows"
                return _tuned(lw, quant_max_rows, (*kind, "amx"), dtype)
            if q8_ops is not None and quant_max_rows != 0 and Q8Linear.fits(spec):
                lw = QuantMatmulLinear(spec, quant_ops.quant_matmul, quant_max_rows, Q8Linear(spec, q8_ops.q8_matmul))
                lw.kernel = lw.kernel.split(" / ")[0] + (f" / q8_matmul above {quant_max_rows} rows"
                                                         if quant_max_rows > 0 else "")
                return _tuned(lw, quant_max_rows, (*kind, "q8"), dtype)
            return _tuned(QuantMatmulLinear(spec, quant_ops.quant_matmul, quant_max_rows, dense()), quant_max_rows,
                          kind, dtype)

        if spec.bits == 4 and spec.group_size in INT4_GROUP_SIZES and inp % spec.group_size == 0 and out % 16 == 0:
            return _tuned(Int4Linear(spec, quant_max_rows, dense()), quant_max_rows, ("int4", spec.group_size), dtype)
        if is_int8_per_channel(spec):
            return _tuned(Int8Linear(spec, quant_max_rows, dense()), quant_max_rows, ("int8",), dtype)
        if spec.bits == 8 and int8_regroup:
            return _tuned(Int8Linear(per_channel_int8(spec), quant_max_rows, dense(),
                                     f"int8pack_mm (bf16 act; int8 g{spec.group_size} re-grouped)"),
                          quant_max_rows, ("int8",), dtype)
    return _dense(dequantize(spec, dtype), cpu_linear, "" if isinstance(spec, torch.Tensor) else
                  f"dequantised {_kind(spec)} -> ")


#: row counts at which `quant_max_rows = -1` times the quantised kernel against the dense copy
TUNE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: what those measurements found in this process, for `tokenloom bench kernels`:
#: (kind..., out, in, dtype) -> {"rows", "quantised_us", "dense_us", "max_rows"}
KERNEL_TIMINGS: dict[tuple, dict] = {}


#: the second kernel must beat the first by this much before it takes over: a near-tie
#: keeps the first (the quantised one reads fewer bytes, which counts more when other
#: streams share the memory bus), and timing noise cannot flip a choice
TUNE_MARGIN = 0.10


def _best_us(first, second, x: torch.Tensor, reps: int = 7) -> tuple[float, float]:
    """Each kernel's fastest time on ``x``, the two timed in alternation so that a burst of
    load from elsewhere hits both; the minimum, because other work can only add time."""
    for _ in range(2):
        first(x)
        second(x)
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((first, second)):
            t0 = time.perf_counter()
            fn(x)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] * 1e6, best[1] * 1e6


def _tuned(lw, quant_max_rows: int, kind: tuple, dtype: torch.dtype):
    """``quant_max_rows = -1``: time the quantised kernel and the dense copy for this weight's
    shape at TUNE_ROWS rows (once per shape and dtype in a process) and use the quantised
    one up to the largest row count below the first where the dense copy wins."""
    if quant_max_rows >= 0 or lw.dense is None:
        return lw
    key = (*kind, lw.out_features, lw.in_features, str(dtype).removeprefix("torch."))
    lw.max_rows = _crossing(key, lw.quantised, lw.dense.apply, lw.in_features, dtype)
    if isinstance(lw.dense, AmxLinear):
        lw.kernel = lw.kernel.split(" / ")[0] + (f" / amx_matmul above {lw.max_rows} rows (measured) / dense above "
                                                 f"{lw.dense.max_rows} rows")
    elif isinstance(lw.dense, Q8Linear):
        lw.kernel = lw.kernel.split(" / ")[0] + f" / q8_matmul above {lw.max_rows} rows (measured)"
    else:
        lw.kernel = lw.kernel.split(" / ")[0] + f" / dense above {lw.max_rows} rows (measured)"
    return lw


def _crossing(key: tuple, first, second, in_features: int, dtype: torch.dtype) -> int:
    """The largest of TUNE_ROWS up to which ``first`` is at most TUNE_MARGIN slower than
    ``second`` (0: never), timed once per ``key`` in a process and kept in KERNEL_TIMINGS."""
    found = KERNEL_TIMINGS.get(key)
    if found is None:
        a_us, b_us = [], []
        with torch.inference_mode():
            for rows in TUNE_ROWS:
                a, b = _best_us(first, second, torch.randn(rows, in_features, dtype=dtype))
                a_us.append(a)
                b_us.append(b)
        max_rows = 0
        for rows, a, b in zip(TUNE_ROWS, a_us, b_us, strict=True):
            if a > b * (1 + TUNE_MARGIN):
                break
            max_rows = rows
        found = KERNEL_TIMINGS[key] = {"rows": list(TUNE_ROWS), "quantised_us": a_us, "dense_us": b_us,
                                       "max_rows": max_rows}
    return found["max_rows"]


def _dense(weight: torch.Tensor, cpu_linear: str, label: str):
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        packed = PackedLinear(weight, cpu_linear)
        packed.kernel = label + packed.kernel
        if cpu_linear == "dual":  # where MKL's GEMV stops beating oneDNN's GEMM, on this machine
            key = ("fp32 mkl-vs-onednn", packed.out_features, packed.in_features, "float32")
            packed.max_rows = _crossing(key, packed.by_mkl, packed.by_onednn, packed.in_features, torch.float32)
            packed.kernel = label + f"mkl up to {packed.max_rows} rows, onednn above (float32, measured)"
        return packed
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_linear != "mkl" and onednn_bf16():
        packed = PackedLinear(weight, "onednn")
        packed.kernel = label + packed.kernel
        return packed
    return DenseLinear(weight, label + "F.linear")


def onednn_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here (AVX512-BF16 or AMX): only then is a packed
    bf16 weight worth it (elsewhere oneDNN emulates bf16, as ``F.linear`` does)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() and (
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def step_linear(lw, ops):
    """``lw`` as the C++ decode step's ``StepLinear`` (kernels/cpu_ops.py): the same kernel
    choice, kind by kind, made in C++; None for a kind it does not mirror."""
    none = torch.empty(0)
    if isinstance(lw, LowRankUpdated):  # an adapter wrapper: its base, with the updates mirrored
        base = step_linear(lw.base, ops)
        if base is None:
            return None
        mirror = next((m for m in lw.step.mirrors if isinstance(m, ops.LoraStep)), None)
        if mirror is None:
            mirror = ops.LoraStep()
            lw.step.mirrors.append(mirror)
        base.set_lora(lw.lora_a, lw.lora_b, mirror)
        base.set_lora_used(lw.used)
        lw.mirrors.append(base)
        return base
    if isinstance(lw, DenseLinear):
        return ops.StepLinear(0, lw.weight, none, 0, 0, None)
    if isinstance(lw, AmxLinear):  # (kinds 14 and 18: 10 + the bits), its dense copy above max_rows
        dense = step_linear(lw.dense, ops) if lw.dense is not None else None
        if lw.dense is not None and dense is None:
            return None
        return ops.StepLinear(10 + lw.bits, lw.codes, lw.sm, lw.group_size, lw.max_rows if dense is not None else 0,
                              dense)
    if isinstance(lw, Q8Linear):  # (kinds 24 and 28: 20 + the bits)
        return ops.StepLinear(20 + lw.bits, lw.codes, lw.sm, lw.group_size, 0, None)
    if isinstance(lw, PackedLinear):
        return ops.StepLinear(3, lw.wt if lw.wt is not None else none, lw.onednn if lw.onednn is not None else none,
                              0, lw.max_rows, None)
    if isinstance(lw, (Int4Linear, Int8Linear, QuantMatmulLinear)):
        dense = None
        if lw.dense is not None:
            dense = step_linear(lw.dense, ops)
            if dense is None:
                return None
        if isinstance(lw, QuantMatmulLinear):  # (kinds 4 and 8: the bits)
            return ops.StepLinear(lw.bits, lw.codes, lw.sm, lw.group_size, lw.max_rows, dense)
        if isinstance(lw, Int4Linear):
            return ops.StepLinear(1, lw.packed, lw.scales_zeros, lw.group_size, lw.max_rows, dense)
        return ops.StepLinear(2, lw.weight, lw.scales, 0, lw.max_rows, dense)
    return None


def _device(spec) -> torch.device:
    return spec.codes.device if isinstance(spec, QuantizedWeight) else spec.data.device


def _kind(spec) -> str:
    if isinstance(spec, Fp8Weight):
        return "fp8"
    return f"int{spec.bits} g{spec.group_size}"
