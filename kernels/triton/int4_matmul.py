"""4-bit dequantising matmul over the GPTQ packed layout: ``out = x @ W^T`` with
``W^T[k, n] = (code[k, n] - zeros[g(k), n]) * scales[g(k), n]``.

``qweight`` is int32 ``[K / 8, N]`` exactly as GPTQ v1 checkpoints store it
(plugins/quantizers/layouts.py): word ``[r, n]`` holds the codes of input rows ``8 r + i`` of
column ``n`` in bits ``[4 i, 4 i + 4)``. AWQ checkpoints' interleaved words are re-packed to
it at load (:func:`pack_int4` takes the unpacked :class:`QuantizedWeight` either loader
gives). ``scales`` and ``zeros`` are float ``[G, N]``, the zero point unpacked and without
GPTQ v1's minus one (so ``z = 0`` is representable); ``g_idx`` int32 ``[K]`` (act-order)
or None for ``g(k) = k // group_size``.

Two kernels: a GEMV for a few rows (decode: one program per (row, BLOCK_N columns), the
dequantised tile multiplied elementwise and summed: memory-bound, every packed word read
once per row) and a tiled GEMM for more (prefill: ``tl.dot`` over dequantised
``[BLOCK_K, BLOCK_N]`` tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_shape, check_tensor, dot_dtype, next_pow2


@triton.jit
def _dequant_tile(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k, n, mask,
                  stride_qk, stride_sg, stride_zg,
                  GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr):
    """float32 [len(k), len(n)] of W^T for input rows ``k`` and columns ``n``."""
    words = tl.load(qw_ptr + (k // 8)[:, None] * stride_qk + n[None, :], mask=mask, other=0)
    codes = (words >> ((k % 8) * 4)[:, None]) & 0xF
    if HAS_G_IDX:
        g = tl.load(g_idx_ptr + k, mask=k >= 0, other=0).to(tl.int64)
    else:
        g = (k // GROUP_SIZE).to(tl.int64)
    s = tl.load(scales_ptr + g[:, None] * stride_sg + n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g[:, None] * stride_zg + n[None, :], mask=mask, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) - z) * s


@triton.jit
def _int4_gemv_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    qw_ptr,  # int32 [K / 8, N]
    scales_ptr, zeros_ptr,  # [G, N]
    g_idx_ptr,  # int32 [K] (HAS_G_IDX only)
    N, K,
    stride_om, stride_xm, stride_qk, stride_sg, stride_zg,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
        w = _dequant_tile(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, tl.where(k_mask, k, 0), n,
                          k_mask[:, None] & n_mask[None, :], stride_qk, stride_sg, stride_zg, GROUP_SIZE, HAS_G_IDX)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(out_ptr + row * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_gemm_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    qw_ptr,  # int32 [K / 8, N]
    scales_ptr, zeros_ptr,  # [G, N]
    g_idx_ptr,  # int32 [K] (HAS_G_IDX only)
    M, N, K,
    stride_om, stride_xm, stride_qk, stride_sg, stride_zg,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, tl.where(k_mask, k, 0), n,
                          k_mask[:, None] & n_mask[None, :], stride_qk, stride_sg, stride_zg, GROUP_SIZE, HAS_G_IDX)
        acc = tl.dot(x.to(tl.float32).to(DOT), w.to(DOT), acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class Int4Packed:
    """A 4-bit weight ``[N, K]`` in the layout the kernels read (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor  # float32 [G, N]
    group_size: int
    g_idx: torch.Tensor | None = None  # int32 [K], act-order only

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[1]), int(self.qweight.shape[0]) * 8

    def nbytes(self) -> int:
        extra = self.g_idx.numel() * 4 if self.g_idx is not None else 0
        return self.qweight.numel() * 4 + (self.scales.numel() + self.zeros.numel()) * 4 + extra


def pack_int4(qw) -> Int4Packed:
    """A 4-bit ``QuantizedWeight`` (codes ``[N, K]``, K a multiple of 8) in the kernels' layout."""
    n, k = qw.shape
    if qw.bits != 4 or k % 8:
        raise ValueError(f"pack_int4 needs 4-bit codes with in_features a multiple of 8, got "
                         f"{qw.bits}-bit [{n}, {k}]")
    codes = qw.codes.T.to(torch.int64).reshape(k // 8, 8, n)  # [K/8, lane, N]
    shifts = (torch.arange(8, device=codes.device, dtype=torch.int64) * 4)[None, :, None]
    words = (codes << shifts).sum(dim=1)  # lanes are disjoint: sum == OR
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    g_idx = qw.g_idx.to(torch.int32).contiguous() if qw.g_idx is not None else None
    return Int4Packed(qweight, qw.scales.T.float().contiguous(), qw.zeros.T.float().contiguous(), qw.group_size,
                      g_idx)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, g_idx: torch.Tensor | None = None, *, gemv_max_rows: int = 4) -> torch.Tensor:
    """``x`` [M, K] times the 4-bit weight (``qweight`` int32 [K / 8, N], ``scales``/``zeros``
    [G, N], ``g_idx`` [K] or None) transposed: [M, N] in x's dtype. Up to ``gemv_max_rows``
    rows the GEMV kernel runs, above them the tiled one."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, unit_last=True)
    dev = x.device
    M, K = x.shape
    check_tensor(qweight, "qweight", ndim=2, dtypes=(torch.int32,), device=dev, unit_last=True)
    if qweight.shape[0] * 8 != K:
        raise ValueError(f"qweight must have shape [K / 8, N] = [{K // 8}, N] for x's K = {K}, got "
                         f"{list(qweight.shape)}")
    N = qweight.shape[1]
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    check_tensor(scales, "scales", ndim=2, dtypes=FLOAT_DTYPES, device=dev, unit_last=True)
    check_tensor(zeros, "zeros", ndim=2, dtypes=FLOAT_DTYPES, device=dev, unit_last=True)
    G = scales.shape[0]
    check_shape(scales, "scales", (None, N))
    check_shape(zeros, "zeros", (G, N))
    if g_idx is not None:
        check_tensor(g_idx, "g_idx", ndim=1, dtypes=(torch.int32,), device=dev)
        check_shape(g_idx, "g_idx", (K,))
    elif G != triton.cdiv(K, group_size):
        raise ValueError(f"scales must have ceil(K / group_size) = {triton.cdiv(K, group_size)} rows, got {G}")
    out = torch.empty(M, N, dtype=x.dtype, device=dev)
    if M == 0 or N == 0:
        return out
    has_g = g_idx is not None
    gi = g_idx if has_g else qweight  # unused pointer
    if M <= gemv_max_rows:
        block_n = 64 if N >= 64 else next_pow2(N, 16)
        _int4_gemv_kernel[(M, triton.cdiv(N, block_n))](
            out, x, qweight, scales, zeros, gi, N, K, out.stride(0), x.stride(0), qweight.stride(0),
            scales.stride(0), zeros.stride(0),
            GROUP_SIZE=group_size, HAS_G_IDX=has_g, BLOCK_N=block_n, BLOCK_K=128 if K >= 128 else next_pow2(K, 16),
        )
    else:
        block_m = 16 if M <= 16 else 64
        block_n = 64 if N >= 64 else next_pow2(N, 16)
        _int4_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
            out, x, qweight, scales, zeros, gi, M, N, K, out.stride(0), x.stride(0), qweight.stride(0),
            scales.stride(0), zeros.stride(0),
            GROUP_SIZE=group_size, HAS_G_IDX=has_g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32,
            DOT=dot_dtype(x.dtype),
        )
    return out


def int4_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, g_idx: torch.Tensor | None = None, *, gemv_max_rows: int = 4) -> torch.Tensor:
    """The same in plain torch: unpack, dequantise to float32, matmul."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    shifts = torch.arange(8, device=x.device, dtype=torch.int64) * 4
    codes = ((qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(K, N)
    g = g_idx.long() if g_idx is not None else torch.arange(K, device=x.device) // group_size
    w = (codes.float() - zeros.float()[g]) * scales.float()[g]  # [K, N]
    return (x.float() @ w).to(x.dtype)
