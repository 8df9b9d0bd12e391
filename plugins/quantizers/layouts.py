"""Checkpoint layouts of pre-quantised weights, as pure converters to and from :class:`QuantizedWeight`.

Two layouts that published checkpoints use, for one ``Linear`` with ``K = in_features``,
``N = out_features``, code width ``b`` and group size ``g`` (``G`` groups). Note that both
store the weight transposed relative to :class:`QuantizedWeight` (input rows, output columns).
Packed words are int32 on disk; bit ``0`` is the least significant bit of the word viewed
as unsigned, and "lane ``i``" means bits ``[i b, (i + 1) b)``.

**GPTQ v1** (AutoGPTQ, and GPTQModel with ``checkpoint_format="gptq"``), ``b`` in 2, 4, 8:

* ``qweight`` int32 ``[K b / 32, N]``: word ``[r, n]`` holds the codes of input rows
  ``r * 32/b + i`` of output column ``n`` in lane ``i`` (lowest bits first).
* ``qzeros`` int32 ``[G, N b / 32]``: word ``[k, c]`` holds the zero points of output
  columns ``c * 32/b + i`` of group ``k`` in lane ``i``, **stored minus one**: the lane
  holds ``z - 1`` and loaders compute ``z = lane + 1``.
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``, the group of each input row
  (``row // g`` unless act-order / ``desc_act``, which makes it a permutation of that).
* dequantised ``W^T[k, n] = (code - z[g_idx[k], n]) * scales[g_idx[k], n]``.

This is what AutoGPTQ's ``QuantLinear.pack`` writes (``zeros -= 1``, then
``qweight[row] |= intweight[j] << (bits * (j - i))``) and what its torch fallback reads
(``(qzeros >> shifts) & maxq``, then ``zeros + 1``). The "minus one" means a zero point of
0 cannot be stored (AutoGPTQ's own packer then corrupts neighbouring lanes, a known v1
defect that GPTQModel's ``gptq_v2`` format fixes); :func:`gptq_pack` refuses it, while
``z = 2^b`` round-trips (lane ``2^b - 1``). :func:`quantize_rtn` gives all-zero groups
``z = 2^(b-1)`` so that only groups with no negative weight at all can hit ``z = 0``.

**AWQ GEMM** (AutoAWQ ``version="gemm"``; HF ``quantization_config.version == "gemm"``),
``b = 4`` only:

* ``qweight`` int32 ``[K, N / 8]``: word ``[k, c]`` packs 8 *output* columns
  ``c * 8 + j`` of input row ``k``, interleaved: lane ``i`` holds column
  ``c * 8 + AWQ_PACK_ORDER[i]`` with ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
  equivalently column ``j`` sits in lane ``AWQ_UNPACK_ORDER[j]``, ``(0, 4, 1, 5, 2, 6, 3, 7)``.
* ``qzeros`` int32 ``[G, N / 8]``, same packing, the zero point itself (no offset).
* ``scales`` float16 ``[G, N]``; no ``g_idx`` (groups are always ``row // g``).

This matches AutoAWQ's ``WQLinear_GEMM.from_linear`` (``order_map = [0, 2, 4, 6, 1, 3, 5,
7]``, ``qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)``) and its
``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]`` used when unpacking.

The configs that go with these layouts (``quantize_config.json``, ``quantization_config``)
are read and written in quant_config.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .primitives import QuantizedWeight

__all__ = [
    "AWQ_PACK_ORDER",
    "AWQ_UNPACK_ORDER",
    "GPTQ_BITS",
    "awq_pack",
    "awq_unpack",
    "gptq_pack",
    "gptq_unpack",
]

#: Lane ``i`` of an AWQ GEMM word holds output column ``AWQ_PACK_ORDER[i]`` of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Output column ``j`` of an AWQ GEMM word sits in lane ``AWQ_UNPACK_ORDER[j]``.
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: Code widths the GPTQ v1 layout supports here (3-bit's word-straddling packing is not).
GPTQ_BITS = (2, 4, 8)

_TensorDict = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- bit packing


def _pack_lanes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., 32/bits]`` integer codes -> int32 ``[...]``; lane ``i`` at bits ``i*bits``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (values.to(torch.int64) << shifts).sum(dim=-1)  # lanes are disjoint: sum == OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed
    return words.to(torch.int32)


def _unpack_lanes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[...]`` -> int64 ``[..., 32/bits]``, lane ``i`` from bits ``i*bits``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    return (unsigned.unsqueeze(-1) >> shifts) & (2**bits - 1)


def _integer_values(t: torch.Tensor, lo: int, hi: int, what: str) -> torch.Tensor:
    """``t`` as int64, checking that it is integer-valued within ``[lo, hi]``."""
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or not torch.equal(t, torch.round(t)):
            raise ValueError(f"{what} must be integers")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"{what} must lie in [{lo}, {hi}], got [{int(t.min())}, {int(t.max())}]")
    return t


def _checked_scales(scales: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = scales.to(dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{what}: scales overflow {dtype}")
    return out


def _group_size(group_size: int | None, k: int) -> int:
    return k if group_size is None or group_size <= 0 else int(group_size)


def _get(tensors: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{what}: missing tensor {name!r} (have {sorted(tensors)})")
    return tensors[name]


def _check_int32_2d(t: torch.Tensor, name: str, what: str) -> None:
    if t.dtype != torch.int32 or t.ndim != 2:
        raise ValueError(f"{what}: {name} must be int32 2-D, got {t.dtype} {tuple(t.shape)}")


# --------------------------------------------------------------------------- GPTQ v1


def gptq_pack(qt: QuantizedWeight, *, scale_dtype: torch.dtype = torch.float16) -> _TensorDict:
    """:class:`QuantizedWeight` -> ``{"qweight", "qzeros", "scales", "g_idx"}`` in GPTQ v1 layout.

    ``qt.bits`` must be 2, 4 or 8; ``in`` and ``out`` multiples of ``32 / bits``; zero
    points integers in ``[1, 2^bits]`` (v1 stores ``z - 1``, see the module docstring).
    ``scales`` are cast to ``scale_dtype`` (float16 as AutoGPTQ stores them: exact only for
    fp16-representable scales). ``g_idx`` is always written (``column // group_size``
    when ``qt.g_idx`` is ``None``), as AutoGPTQ does.
    """
    what = "gptq_pack"
    b = qt.bits
    if b not in GPTQ_BITS:
        raise ValueError(f"{what}: bits={b} unsupported (GPTQ v1 here: {GPTQ_BITS})")
    per = 32 // b
    n, k = qt.shape
    if k % per or n % per:
        raise ValueError(f"{what}: in_features={k} and out_features={n} must be multiples "
                         f"of {per} for {b}-bit packing")
    codes = _integer_values(qt.codes, 0, 2**b - 1, f"{what}: codes").T  # [K, N]
    qweight = _pack_lanes(codes.reshape(k // per, per, n).transpose(1, 2), b)
    z = _integer_values(qt.zeros, 1, 2**b, f"{what}: zero points (GPTQ v1 stores z - 1, so "
                        f"z = 0 is unrepresentable; quantize with sym=True or use another layout)")
    g = qt.n_groups
    qzeros = _pack_lanes((z.T - 1).reshape(g, n // per, per), b)
    return {
        "qweight": qweight.contiguous(),
        "qzeros": qzeros.contiguous(),
        "scales": _checked_scales(qt.scales.T, scale_dtype, what),
        "g_idx": qt.group_index().to(torch.int32).contiguous(),
    }


def gptq_unpack(tensors: Mapping[str, torch.Tensor], bits: int, group_size: int | None) -> QuantizedWeight:
    """GPTQ v1 tensors (``qweight``, ``qzeros``, ``scales``, optional ``g_idx``) -> :class:`QuantizedWeight`.

    ``group_size`` as in ``quantize_config.json`` (``-1``/``None`` = per-channel). Zero
    points come back as ``lane + 1`` (float32), scales as float32. A ``g_idx`` equal to
    ``row // group_size`` is dropped (``QuantizedWeight.g_idx = None``); any other (act-order) is
    kept as int32. Without ``g_idx``, ``scales`` must have ``ceil(K / group_size)`` rows.
    """
    what = "gptq_unpack"
    if bits not in GPTQ_BITS:
        raise ValueError(f"{what}: bits={bits} unsupported (GPTQ v1 here: {GPTQ_BITS})")
    per = 32 // bits
    qweight = _get(tensors, "qweight", what)
    qzeros = _get(tensors, "qzeros", what)
    scales = _get(tensors, "scales", what)
    _check_int32_2d(qweight, "qweight", what)
    _check_int32_2d(qzeros, "qzeros", what)
    k, n = qweight.shape[0] * per, qweight.shape[1]
    if scales.ndim != 2 or scales.shape[1] != n or not scales.is_floating_point():
        raise ValueError(f"{what}: scales must be float [n_groups, {n}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    g = scales.shape[0]
    if n % per or qzeros.shape != (g, n // per):
        raise ValueError(f"{what}: qzeros must be [{g}, {n}/{per}], got {tuple(qzeros.shape)}")
    gs = _group_size(group_size, k)

    codes = _unpack_lanes(qweight, bits).transpose(1, 2).reshape(k, n)  # [K, N]
    zeros = _unpack_lanes(qzeros, bits).reshape(g, n) + 1

    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        if g_idx.shape != (k,):
            raise ValueError(f"{what}: g_idx must be [{k}], got {tuple(g_idx.shape)}")
        trivial = torch.arange(k, device=g_idx.device) // gs
        if g == -(-k // gs) and torch.equal(g_idx.to(torch.int64), trivial):
            g_idx = None
        else:
            g_idx = g_idx.to(torch.int32).contiguous()
    return QuantizedWeight(
        codes=codes.T.to(torch.uint8).contiguous(),
        scales=scales.T.to(torch.float32).contiguous(),
        zeros=zeros.T.to(torch.float32).contiguous(),
        bits=bits,
        group_size=gs,
        g_idx=g_idx,
    )


# --------------------------------------------------------------------------- AWQ GEMM


def awq_pack(qt: QuantizedWeight, *, scale_dtype: torch.dtype = torch.float16) -> _TensorDict:
    """:class:`QuantizedWeight` -> ``{"qweight", "qzeros", "scales"}`` in AutoAWQ's GEMM layout.

    Needs ``bits == 4``, ``out`` a multiple of 8, ``in`` a multiple of ``group_size``,
    zero points integers in ``[0, 15]`` (stored as is) and no act-order (``g_idx`` ``None``
    or ``column // group_size``). ``scales`` are cast to ``scale_dtype`` (float16).
    """
    what = "awq_pack"
    if qt.bits != 4:
        raise ValueError(f"{what}: bits={qt.bits} unsupported (AWQ GEMM is 4-bit)")
    n, k = qt.shape
    if n % 8 or k % qt.group_size:
        raise ValueError(f"{what}: out_features={n} must be a multiple of 8 and "
                         f"in_features={k} a multiple of group_size={qt.group_size}")
    if qt.g_idx is not None and not torch.equal(
        qt.g_idx.to(torch.int64), torch.arange(k, device=qt.g_idx.device) // qt.group_size
    ):
        raise ValueError(f"{what}: AWQ has no act-order; g_idx must be column // group_size")
    order = torch.tensor(AWQ_PACK_ORDER, device=qt.codes.device)
    codes = _integer_values(qt.codes, 0, 15, f"{what}: codes").T  # [K, N]
    qweight = _pack_lanes(codes.reshape(k, n // 8, 8).index_select(2, order), 4)
    z = _integer_values(qt.zeros, 0, 15, f"{what}: zero points").T  # [G, N]
    qzeros = _pack_lanes(z.reshape(z.shape[0], n // 8, 8).index_select(2, order.to(z.device)), 4)
    return {
        "qweight": qweight.contiguous(),
        "qzeros": qzeros.contiguous(),
        "scales": _checked_scales(qt.scales.T, scale_dtype, what),
    }


def awq_unpack(tensors: Mapping[str, torch.Tensor], group_size: int | None) -> QuantizedWeight:
    """AutoAWQ GEMM tensors (``qweight``, ``qzeros``, ``scales``) -> 4-bit :class:`QuantizedWeight`.

    ``group_size`` as in the config (``-1``/``None`` = per-channel); it must divide ``K``
    and ``scales`` must have ``K / group_size`` rows. Zero points and scales come back as
    float32, ``g_idx`` as ``None``.
    """
    what = "awq_unpack"
    qweight = _get(tensors, "qweight", what)
    qzeros = _get(tensors, "qzeros", what)
    scales = _get(tensors, "scales", what)
    _check_int32_2d(qweight, "qweight", what)
    _check_int32_2d(qzeros, "qzeros", what)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    gs = _group_size(group_size, k)
    if k % gs:
        raise ValueError(f"{what}: group_size={gs} does not divide in_features={k}")
    g = k // gs
    if scales.ndim != 2 or scales.shape != (g, n) or not scales.is_floating_point():
        raise ValueError(f"{what}: scales must be float [{g}, {n}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if qzeros.shape != (g, n // 8):
        raise ValueError(f"{what}: qzeros must be [{g}, {n // 8}], got {tuple(qzeros.shape)}")
    inv = torch.tensor(AWQ_UNPACK_ORDER, device=qweight.device)
    codes = _unpack_lanes(qweight, 4).index_select(2, inv).reshape(k, n)
    zeros = _unpack_lanes(qzeros, 4).index_select(2, inv.to(qzeros.device)).reshape(g, n)
    return QuantizedWeight(
        codes=codes.T.to(torch.uint8).contiguous(),
        scales=scales.T.to(torch.float32).contiguous(),
        zeros=zeros.T.to(torch.float32).contiguous(),
        bits=4,
        group_size=gs,
        g_idx=None,
    )
