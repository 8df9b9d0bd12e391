"""Quantise / dequantise primitives for linear weights ``w [out, in]`` (torch only).

Everything here is pure tensor math: no module state, no device assumptions (the outputs
live on the input's device); the one type, :class:`QuantizedWeight`, is the engine's own
(core/weights.py), so what these functions make is what the backend packs. Weights are ``[out_features,
in_features]`` as in ``torch.nn.Linear``; "row" means output channel, "column" means input
channel, and a *group* is ``group_size`` consecutive columns of one row sharing a scale and
a zero point.

What each primitive guarantees (``s`` is the scale actually used, returned with the codes):

* :func:`quantize_rtn`: ``w ≈ (q - z) * s`` per row and group, ``|error| <= s / 2``.
* :func:`quantize_int8_per_channel`: ``w ≈ q * s`` per row, ``|error| <= s / 2``.
* :func:`quantize_fp8_e4m3`: ``w ≈ float(q) * s`` per row,
  ``|error| <= max(2^-4 |w|, 2^-10 s)``.
* :func:`pack_int4` / :func:`unpack_int4`: exact inverses.

The bounds are exact-arithmetic statements; the ``*_error_bound`` helpers add a relative
slack of ``2^-12`` (or ``2^-10`` for fp8) that absorbs float32 rounding in ``w / s`` and in
the dequantising multiply (each at most ``2^-24`` relative, times at most ``2^8`` code
units). They assume finite inputs and normal (not subnormal) float32 scales.
"""

from __future__ import annotations

import torch

from tokenloom.core.weights import QuantizedWeight

__all__ = [
    "FP8_E4M3_MAX",
    "QuantizedWeight",
    "dequantize_fp8_e4m3",
    "dequantize_int8_per_channel",
    "fp8_e4m3_error_bound",
    "int8_error_bound",
    "pack_int4",
    "quantize_fp8_e4m3",
    "quantize_int8_per_channel",
    "quantize_rtn",
    "rtn_error_bound",
    "unpack_int4",
]

#: Largest finite ``torch.float8_e4m3fn`` value (``1.75 * 2^8``).
FP8_E4M3_MAX = 448.0

# Float32 rounding slack of the error-bound helpers (see the module docstring).
_SLACK = 2.0**-12
_FP8_SLACK = 2.0**-10


# --------------------------------------------------------------------------- QuantizedWeight


# --------------------------------------------------------------------------- helpers


def token_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """A layer's input ``x [..., in]`` as float32 ``[tokens, in]`` (calibration statistics)."""
    if x.shape[-1] != in_features:
        raise ValueError(f"expected inputs with {in_features} features, got shape {tuple(x.shape)}")
    return x.detach().reshape(-1, in_features).float()


def _as_2d_float(w: torch.Tensor, who: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"{who}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"{who}: expected a floating-point weight, got {w.dtype}")
    if w.shape[1] == 0:
        raise ValueError(f"{who}: weight has no input columns")
    w = w.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{who}: weight has inf or NaN values")
    return w


def _resolve_group_size(group_size: int | None, in_f: int) -> int:
    """``None`` / ``-1`` (any value <= 0) / ``in`` -> per-channel; else it must divide ``in``."""
    if group_size is None or group_size <= 0:
        return in_f
    gs = int(group_size)
    if in_f % gs:
        raise ValueError(f"group_size={gs} does not divide in_features={in_f}; use a "
                         f"divisor of {in_f} or group_size=-1 (per-channel)")
    return gs


# --------------------------------------------------------------------------- RTN


def quantize_rtn(
    w: torch.Tensor, bits: int = 4, group_size: int | None = 128, sym: bool = False
) -> QuantizedWeight:
    """Round-to-nearest quantisation of ``w [out, in]`` per output row and input group.

    :param w: float weight ``[out, in]`` (any float dtype; the math runs in float32).
    :param bits: code width: 1..8 asymmetric, 2..8 symmetric.
    :param group_size: columns per group; ``-1``, ``None``, ``0`` or ``in`` mean one group
        per row (per-channel). Any other value must divide ``in`` (``ValueError`` otherwise).
    :param sym: symmetric grid instead of a fitted zero point.
    :returns: a :class:`QuantizedWeight` (``scales``/``zeros`` float32, ``g_idx`` ``None``).

    With ``m = 2^bits - 1`` and, per group, ``lo = min(min w, 0)``, ``hi = max(max w, 0)``:

    * **asymmetric**: ``s = (hi - lo) / m``, ``z = clamp(round(-lo / s), 0, m)`` (an
      integer), ``q = clamp(round(w / s) + z, 0, m)``. The range is widened to include 0
      (as AutoGPTQ's quantizer does) so that 0 is exactly representable and the clamp
      never costs more than rounding: ``lo / s = -z0`` and ``hi / s = m - z0`` with
      ``z0 = -lo / s`` in ``[0, m]``, so ``w / s + z`` lies in ``[-1/2, m + 1/2]`` and
      ``|w / s - (q - z)| <= 1/2``. Hence **|w - (q - z) s| <= s / 2 for every element**.
    * **symmetric**: ``s = max|w| / (2^(bits-1) - 1)``, ``q = round(w / s)`` lies in
      ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]`` and is stored offset by ``2^(bits-1)``, i.e.
      ``z = 2^(bits-1)`` for every group (code 0 is unused). Error ``<= s / 2`` likewise.

    ``round`` is round-half-to-even (``torch.round``). A group whose values are all zero
    (``s`` would be 0) gets ``s = 1`` and ``z = 2^(bits-1)``: its codes all equal ``z`` and
    dequantise to exactly 0, no NaN, and the zero point is representable in every on-disk
    layout (GPTQ v1 cannot store ``z = 0``; see :mod:`.layouts`).
    Values exactly on a grid ``(k - z) * s`` with power-of-two ``s`` round-trip exactly.
    """
    w = _as_2d_float(w, "quantize_rtn")
    if not isinstance(bits, int) or not (2 if sym else 1) <= bits <= 8:
        raise ValueError(f"quantize_rtn: bits must be in {2 if sym else 1}..8 "
                         f"({'symmetric' if sym else 'asymmetric'}), got {bits!r}")
    out_f, in_f = w.shape
    gs = _resolve_group_size(group_size, in_f)
    n_groups = in_f // gs
    maxq = float(2**bits - 1)
    mid = float(2 ** (bits - 1))
    wg = w.reshape(out_f, n_groups, gs)

    if sym:
        scale = wg.abs().amax(dim=2) / (mid - 1.0)
        degenerate = scale == 0
        scale = torch.where(degenerate, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, mid)
    else:
        lo = wg.amin(dim=2).clamp(max=0.0)
        hi = wg.amax(dim=2).clamp(min=0.0)
        scale = (hi - lo) / maxq
        degenerate = scale == 0
        scale = torch.where(degenerate, torch.ones_like(scale), scale)
        zero = torch.clamp(torch.round(-lo / scale), 0.0, maxq)
        zero = torch.where(degenerate, torch.full_like(zero, mid), zero)

    codes = torch.clamp(torch.round(wg / scale.unsqueeze(2)) + zero.unsqueeze(2), 0.0, maxq)
    return QuantizedWeight(
        codes=codes.reshape(out_f, in_f).to(torch.uint8),
        scales=scale.contiguous(),
        zeros=zero.contiguous(),
        bits=bits,
        group_size=gs,
        g_idx=None,
    )


def rtn_error_bound(qt: QuantizedWeight) -> torch.Tensor:
    """``float32 [out, in]``: the bound ``s / 2`` on ``|w - qt.dequantize()|`` per element.

    Valid for a :class:`QuantizedWeight` from :func:`quantize_rtn` (whose clamp never bites beyond
    rounding, see there). Includes the float32 slack ``s * 2^-12`` (module docstring).
    """
    s = qt.scales.to(torch.float32).index_select(1, qt.group_index().to(qt.scales.device))
    return s * (0.5 + _SLACK)


# --------------------------------------------------------------------------- int8


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: ``(q int8 [out, in], scales float32 [out])``.

    ``s = max|w_row| / 127``, ``q = clamp(round(w / s), -127, 127)`` (-128 unused, so the
    grid is symmetric). Error ``|w - q s| <= s / 2`` everywhere (``|w / s| <= 127``, so the
    clamp never bites). All-zero rows get ``s = 1`` and ``q = 0``.
    """
    w = _as_2d_float(w, "quantize_int8_per_channel")
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.clamp(torch.round(w / scales.unsqueeze(1)), -127.0, 127.0).to(torch.int8)
    return q, scales


def dequantize_int8_per_channel(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32 [out, in]``: ``q * scales[:, None]``."""
    if q.ndim != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"expected q [out, in] and scales [out], got {tuple(q.shape)} "
                         f"and {tuple(scales.shape)}")
    return q.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)


def int8_error_bound(scales: torch.Tensor) -> torch.Tensor:
    """``float32 [out, 1]`` (broadcasts over ``in``): ``s / 2`` plus the float32 slack."""
    return scales.to(torch.float32).unsqueeze(1) * (0.5 + _SLACK)


# --------------------------------------------------------------------------- fp8 e4m3


def quantize_fp8_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 per output channel: ``(q float8_e4m3fn [out, in], scales float32 [out])``.

    ``s = max|w_row| / 448`` (448 = largest finite e4m3fn), ``q = fp8(w / s)`` with
    round-to-nearest-even; ``w / s`` is clamped to ``[-448, 448]`` first so float32
    rounding can never overflow to NaN (e4m3fn has no inf). All-zero rows get ``s = 1``.

    E4M3 has 3 mantissa bits, so for a scaled value ``x = w / s`` in the normal range
    (``|x| >= 2^-6``) the rounding error is at most half an ulp, ``2^-4 |x|``; below that
    the subnormals are spaced ``2^-9`` apart, so the error is at most ``2^-10``. Hence
    ``|w - float(q) s| <= max(2^-4 |w|, 2^-10 s)``.
    """
    w = _as_2d_float(w, "quantize_fp8_e4m3")
    scales = w.abs().amax(dim=1) / FP8_E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    x = torch.clamp(w / scales.unsqueeze(1), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(torch.float8_e4m3fn), scales


def dequantize_fp8_e4m3(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32 [out, in]``: ``float(q) * scales[:, None]``."""
    if q.ndim != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"expected q [out, in] and scales [out], got {tuple(q.shape)} "
                         f"and {tuple(scales.shape)}")
    return q.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)


def fp8_e4m3_error_bound(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32 [out, in]``: ``max(2^-4 |w|, 2^-10 s)`` per element, times ``1 + 2^-10``.

    ``2^-4 |w|`` is the half-ulp of a normal e4m3 value; ``2^-10 s`` is half the subnormal
    spacing (``2^-9``) in the unscaled domain, which dominates for ``|w| < 2^-6 s``.
    """
    a = w.detach().to(torch.float32).abs()
    s = scales.to(torch.float32).unsqueeze(1)
    return torch.maximum(a * 2.0**-4, s * 2.0**-10) * (1.0 + _FP8_SLACK)


# --------------------------------------------------------------------------- int4 packing


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``uint8 [..., n]`` codes in ``[0, 15]`` two a byte: ``uint8 [..., n / 2]``.

    Byte ``i`` holds code ``2i`` in its low nibble and code ``2i + 1`` in its high nibble
    (low nibble first). ``n`` must be even; :func:`unpack_int4` inverts it exactly.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_int4: expected uint8 codes, got {codes.dtype}")
    if codes.ndim < 1 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last dimension must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_int4: codes must be in [0, 15], got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 [..., m]`` -> ``uint8 [..., 2m]`` codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4: expected uint8, got {packed.dtype}")
    if packed.ndim < 1:
        raise ValueError("unpack_int4: expected at least one dimension")
    both = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
