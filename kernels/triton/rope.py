"""RoPE, neox-style rotate-half as core/attention.py's ``apply_rope``:
``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` for the
halves ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``, computed in float32.

One program per token rotates all its heads (a [heads, D/2] tile per half); ``x`` may be a
strided view (the q and k heads of a fused qkv row) and the result can be stored in the
model dtype directly, which saves the copy the model's float32 result then needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_shape, check_tensor, next_pow2


@triton.jit
def _rope_kernel(
    out_ptr,  # [T, heads, D]
    x_ptr,  # [T, heads, D]
    cos_ptr, sin_ptr,  # float32 [T, D]
    num_heads,
    stride_ot, stride_oh, stride_xt, stride_xh, stride_ct, stride_st,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    mask = (h < num_heads)[:, None] & d_mask[None, :]
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d_mask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d_mask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=d_mask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_mask, other=0.0)[None, :]
    o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_row, (x1 * c1 + (-x2) * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] (D even; any strides with a unit last one) by float32
    ``cos``/``sin`` of each token's position, [T, D] or [T, 1, D] (llama's tables, whose two
    halves are equal); returns a new [T, heads, D] of ``out_dtype``."""
    check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES, unit_last=True)
    T, H, D = x.shape
    if D % 2:
        raise ValueError(f"x's head dim must be even for rotate-half RoPE, got {D}")
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, name, dtypes=(torch.float32,), device=x.device)
        t2 = t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 and t.shape[1] == 1 else t
        check_shape(t2, name, (T, D))
        if t2.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension")
        tables.append(t2)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")
    out = torch.empty(T, H, D, dtype=out_dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    c, s = tables
    _rope_kernel[(T,)](
        out, x, c, s, H, out.stride(0), out.stride(1), x.stride(0), x.stride(1), c.stride(0), s.stride(0),
        HALF=D // 2, HALF_PAD=next_pow2(D // 2), HEADS_PAD=next_pow2(H),
    )
    return out


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """core/attention.py's ``apply_rope``, cast to ``out_dtype``."""
    from tokenloom.core.attention import apply_rope

    T, _, D = x.shape
    return apply_rope(x, cos.reshape(T, 1, D), sin.reshape(T, 1, D)).to(out_dtype)
