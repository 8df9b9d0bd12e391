"""RMSNorm fused with the residual add: ``s = h + delta`` (float32), ``x = s / rms(s) * weight``
in the model dtype, as ``Backend.add_rms_norm``; without ``delta`` a plain RMSNorm.

One program per row (the hidden size, padded to a power of two, is one tile): the row is
read once, the sum written back (into ``h`` itself with ``in_place``: the model owns its
residual stream) and normalised in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_shape, check_tensor, next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N] the normalised rows (out dtype)
    res_ptr,  # float32 [T, N] h + delta (STORE_RES only; may be h itself)
    h_ptr,  # [T, N] the residual stream
    delta_ptr,  # [T, N] (HAS_DELTA only)
    w_ptr,  # [N]
    N, eps,
    stride_xt, stride_rt, stride_ht, stride_dt,
    HAS_DELTA: tl.constexpr, STORE_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    s = tl.load(h_ptr + t * stride_ht + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        s += tl.load(delta_ptr + t * stride_dt + c, mask=mask, other=0.0).to(tl.float32)
    if STORE_RES:
        tl.store(res_ptr + t * stride_rt + c, s, mask=mask)
    mean_sq = tl.sum(s * s, axis=0) / N
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    x = s * (1.0 / tl.sqrt(mean_sq + eps)) * w
    tl.store(x_ptr + t * stride_xt + c, x.to(x_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype, *, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` [T, N] (float32) plus ``delta`` [T, N] (any float dtype, or None), normalised by
    ``weight`` [N]: returns ``(x in out_dtype, h + delta)``; ``in_place`` writes the sum
    into ``h`` and returns ``h``. Without delta the second item is ``h`` itself."""
    check_tensor(h, "h", ndim=2, dtypes=(torch.float32,), unit_last=True)
    dev = h.device
    T, N = h.shape
    if delta is not None:
        check_tensor(delta, "delta", ndim=2, dtypes=FLOAT_DTYPES, device=dev, unit_last=True)
        check_shape(delta, "delta", (T, N))
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    check_shape(weight, "weight", (N,))
    if weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride(0)}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")
    x = torch.empty(T, N, dtype=out_dtype, device=dev)
    res = h if delta is None or in_place else torch.empty_like(h)
    if T == 0:
        return x, res
    _add_rms_norm_kernel[(T,)](
        x, res, h, delta if delta is not None else h, weight, N, eps,
        x.stride(0), res.stride(0), h.stride(0), delta.stride(0) if delta is not None else 0,
        HAS_DELTA=delta is not None, STORE_RES=delta is not None, BLOCK=next_pow2(N),
    )
    return x, res


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype, *, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch (``in_place`` changes nothing here: a new tensor comes back)."""
    s = h if delta is None else h + delta
    return torch.nn.functional.rms_norm(s, (s.shape[-1],), weight.float(), eps).to(out_dtype), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., N] (any float dtype) by ``weight`` [N], in float32."""
    check_tensor(x, "x", dtypes=FLOAT_DTYPES, unit_last=True)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    N = x2.shape[-1]
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape(weight, "weight", (N,))
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            out, out, x2, x2, weight.contiguous(), N, eps, out.stride(0), 0, x2.stride(0), 0,
            HAS_DELTA=False, STORE_RES=False, BLOCK=next_pow2(N),
        )
    return out.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
