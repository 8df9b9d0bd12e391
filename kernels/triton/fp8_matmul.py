"""FP8 weight matmul: ``out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]`` for float8 e4m3
weights ``w`` [N, K] with one float32 scale per output channel (``Fp8Weight``).

Weight-only: the weights are read as 8 bits and widened in registers (to the activations'
dtype on a GPU, exact since every e4m3 value is a bfloat16 value; to float32 under the
interpreter), the per-channel scale applied once to the float32 accumulator. A tiled
kernel serves every row count; at decode (few rows) it is bound by the weight bytes, which
this halves against bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_shape, check_tensor, dot_dtype, next_pow2


@triton.jit
def _fp8_matmul_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # float8_e4m3fn [N, K]
    scales_ptr,  # float32 [N]
    M, N, K,
    stride_om, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * stride_wn + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32).to(DOT), w.to(tl.float32).to(DOT), acc, input_precision="ieee")
    scale = tl.load(scales_ptr + n, mask=n_mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] times float8_e4m3fn ``weight`` [N, K] transposed, each output column
    scaled by float32 ``scales`` [N]: [M, N] in x's dtype."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, unit_last=True)
    dev = x.device
    M, K = x.shape
    check_tensor(weight, "weight", ndim=2, dtypes=(torch.float8_e4m3fn,), device=dev, unit_last=True)
    check_shape(weight, "weight", (None, K))
    N = weight.shape[0]
    check_tensor(scales, "scales", ndim=1, dtypes=(torch.float32,), device=dev)
    check_shape(scales, "scales", (N,))
    if scales.stride(0) != 1:
        raise ValueError(f"scales must be contiguous, got stride {scales.stride(0)}")
    out = torch.empty(M, N, dtype=x.dtype, device=dev)
    if M == 0 or N == 0:
        return out
    block_m = 16 if M <= 16 else 64
    block_n = 64 if N >= 64 else next_pow2(N, 16)
    block_k = 64 if K >= 64 else next_pow2(K, 16)
    _fp8_matmul_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        out, x, weight, scales, M, N, K, out.stride(0), x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot_dtype(x.dtype),
    )
    return out


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same in plain torch, in float32."""
    return ((x.float() @ weight.float().T) * scales[None, :]).to(x.dtype)
