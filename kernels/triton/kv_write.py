"""KV write: this step's keys and values into their slots of the paged pools.

``slot_mapping[t]`` is token t's flat slot, ``block * block_size + offset`` (a negative slot
is skipped: padding). One program per (16 tokens, KV head) stores their K and V rows.

8-bit pools store what the torch backend's ``QuantizedKV.write`` stores, bit for bit: a
bfloat16 scale per (slot, head), ``amax(|x|) / qmax`` (448 for e4m3, 127 for int8) floored at
the smallest normal float and rounded to nearest-even, and ``x / scale`` (IEEE division,
``div_rn``) clamped to ``[-qmax, qmax]``, rounded half-to-even for int8 and to the nearest
e4m3 value (ties to even) for fp8. Both roundings the kernel does itself on the float32
bits (bf16: keep the top 16 bits; e4m3: the byte is assembled and stored through a uint8
view of the pool), because the interpreter's fp32 -> bf16 cast truncates and its fp32 ->
fp8 conversion loses the carry out of the mantissa: so it stores what a GPU stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_shape, check_tensor, next_pow2

#: storage dtype -> (kernel mode, qmax); mode 0 is a plain pool of the model dtype
_QUANT = {torch.float8_e4m3fn: (1, 448.0), torch.int8: (2, 127.0)}
_FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.bfloat16).tiny, the torch backend's scale floor


@triton.jit
def _round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(x):
    f = tl.floor(x + 0.5)
    return tl.where((f - x == 0.5) & (f - 2.0 * tl.floor(f * 0.5) != 0.0), f - 1.0, f)


@triton.jit
def _e4m3_byte(q):
    """float32 in [-448, 448] -> the float8_e4m3fn byte of its nearest value (ties to even)."""
    bits = q.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = tl.abs(q)
    # normal range (>= 2^-6): round the float32 mantissa to 3 bits, carrying into the exponent
    rounded = (a.to(tl.uint32, bitcast=True) + 0x7FFFF + ((a.to(tl.uint32, bitcast=True) >> 20) & 1)) & 0xFFF00000
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # subnormals: multiples of 2^-9 (8 of them is 2^-6, the first normal: the same byte)
    sub = _round_half_even(a * 512.0).to(tl.uint32)
    return (sign | tl.where(a >= 0.015625, normal, sub)).to(tl.uint8)


@triton.jit
def _store_rows(x, cache_ptr, scale_ptr, off, s_off, mask, row_mask, QUANT: tl.constexpr, QMAX: tl.constexpr,
                TINY: tl.constexpr):
    """Rows ``x`` (float32 [BLOCK_T, HEAD_DIM_PAD], one head of BLOCK_T tokens) into their
    slots, quantised (a scale per row) if QUANT."""
    if QUANT == 0:
        tl.store(cache_ptr + off, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        scale = _round_to_bf16(tl.maximum(tl.math.div_rn(amax, QMAX), TINY))
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -QMAX), QMAX)
        if QUANT == 2:  # int8, rounded half to even (torch.round)
            tl.store(cache_ptr + off, _round_half_even(q).to(tl.int8), mask=mask)
        else:  # e4m3, through the pool's uint8 view
            tl.store(cache_ptr + off, _e4m3_byte(q), mask=mask)
        tl.store(scale_ptr + s_off, scale.to(scale_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [KVH, NB, BS, D]
    k_scale_ptr, v_scale_ptr,  # [KVH, NB, BS] (QUANT only)
    slot_mapping_ptr,  # [T] int
    T,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ch, stride_cb, stride_cs,
    stride_sh, stride_sb, stride_ss,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, TINY: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t, mask=t < T, other=-1).to(tl.int64)
    block = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    offset = tl.where(slot >= 0, slot, 0) % BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (slot >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + h * stride_kh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    off = h * stride_ch + block[:, None] * stride_cb + offset[:, None] * stride_cs + d[None, :]
    s_off = h * stride_sh + block * stride_sb + offset * stride_ss
    _store_rows(k, k_cache_ptr, k_scale_ptr, off, s_off, mask, slot >= 0, QUANT, QMAX, TINY)
    _store_rows(v, v_cache_ptr, v_scale_ptr, off, s_off, mask, slot >= 0, QUANT, QMAX, TINY)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store ``k``/``v`` [T, KVH, D] into flat slots ``slot_mapping`` [T] of the pools
    ``k_cache``/``v_cache`` [KVH, NB, BS, D]: of k's dtype, or float8_e4m3fn / int8 with
    ``k_scale``/``v_scale`` [KVH, NB, BS] (bfloat16) receiving each slot's scale."""
    check_tensor(k, "k", ndim=3, dtypes=FLOAT_DTYPES, unit_last=True)
    dev = k.device
    T, KVH, D = k.shape
    check_tensor(v, "v", ndim=3, dtypes=(k.dtype,), device=dev, unit_last=True)
    check_shape(v, "v", (T, KVH, D))
    check_tensor(k_cache, "k_cache", ndim=4, device=dev, unit_last=True)
    check_shape(k_cache, "k_cache", (KVH, None, None, D))
    check_tensor(v_cache, "v_cache", ndim=4, dtypes=(k_cache.dtype,), device=dev, unit_last=True)
    if v_cache.stride() != k_cache.stride() or v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape and strides, got {list(v_cache.shape)} "
                         f"{v_cache.stride()} vs {list(k_cache.shape)} {k_cache.stride()}")
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    check_shape(slot_mapping, "slot_mapping", (T,))
    quant, qmax = _QUANT.get(k_cache.dtype, (0, 0.0))
    if quant:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{name} is needed for a {str(k_cache.dtype).removeprefix('torch.')} pool")
            check_tensor(s, name, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
            check_shape(s, name, tuple(k_cache.shape[:3]))
        if v_scale.stride() != k_scale.stride():
            raise ValueError("k_scale and v_scale must have the same strides")
    elif k_cache.dtype != k.dtype:
        raise ValueError(f"k_cache must be {str(k.dtype).removeprefix('torch.')} (k's dtype) or 8-bit, "
                         f"got {str(k_cache.dtype).removeprefix('torch.')}")
    if T == 0:
        return
    if quant == 1:  # the kernel stores e4m3 bytes it assembled itself
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_t = min(16, next_pow2(T))
    _write_kv_kernel[(triton.cdiv(T, block_t), KVH)](
        k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping, T,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        *(k_scale.stride() if quant else (0, 0, 0)),
        BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=D, HEAD_DIM_PAD=next_pow2(D), BLOCK_T=block_t, QUANT=quant, QMAX=qmax,
        TINY=_FP32_TINY,
    )


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """The same in plain torch (the torch backend's ``write_kv`` / ``QuantizedKV.write``)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        kvh, _, _, d = cache.shape
        x = x.transpose(0, 1)  # [KVH, n, D]
        if cache.dtype in _QUANT:
            qmax = _QUANT[cache.dtype][1]
            xf = x.float()
            s = (xf.abs().amax(-1) / qmax).clamp_(min=_FP32_TINY).to(scale.dtype)
            q = xf / s.float().unsqueeze(-1)
            if cache.dtype == torch.int8:
                q = q.round_()
            q = q.clamp_(-qmax, qmax).to(cache.dtype)
            raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
            raw.view(kvh, -1, d).index_copy_(1, slots, q.view(raw.dtype))
            scale.view(kvh, -1).index_copy_(1, slots, s)
        else:
            cache.view(kvh, -1, d).index_copy_(1, slots, x.to(cache.dtype))
