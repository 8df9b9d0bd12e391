"""Paged decode attention: one new query token per sequence over its cached context.

One program per (sequence, KV head, partition): the ``GROUP`` query heads that share the
KV head are the rows of one ``tl.dot`` (padded to 16, a GPU's minimum), so each key is
read once per group (GQA at any ratio). A program walks its partition ``BLOCK_N`` tokens
at a time, finding each token's page through the block table, with an online softmax in
float32 (exp2, the scale folded with log2 e). A long context is split into partitions of
``partition_size`` tokens (split-K, "flash decoding"): each writes an unnormalised partial
output with its running max and sum, and ``_decode_reduce_kernel`` combines them; when
one partition covers every context the first kernel writes the output itself.

8-bit pools (float8_e4m3fn / int8 with a bfloat16 scale per slot, as the torch backend's
``QuantizedKV``) are dequantised on load: ``data * scale``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_kv_pool,
    check_shape,
    check_tensor,
    dot_dtype,
    next_pow2,
)

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, pos, valid, kvh, d, d_mask, stride_kh, stride_kb,
                  stride_kt, stride_vh, stride_vb, stride_vt, stride_sh, stride_sb, stride_st,
                  BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):
    """One tile of a sequence's K and V (token positions ``pos``, float32, dequantised when
    the pool is 8-bit), read from the blocks its table names: the decode and prefill
    kernels' shared load."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kvh * stride_kh + block[:, None] * stride_kb + slot[:, None] * stride_kt + d[None, :],
                mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kvh * stride_vh + block[:, None] * stride_vb + slot[:, None] * stride_vt + d[None, :],
                mask=kv_mask, other=0.0).to(tl.float32)
    if KV_QUANT:
        s_off = kvh * stride_sh + block * stride_sb + slot * stride_st
        k = k * tl.load(ks_ptr + s_off, mask=valid, other=0.0).to(tl.float32)[:, None]
        v = v * tl.load(vs_ptr + s_off, mask=valid, other=0.0).to(tl.float32)[:, None]
    return k, v


@triton.jit
def _paged_decode_attention_kernel(
    out_ptr,  # [B, H, D] (SPLIT false) or float32 partials [B, H, S, D]
    m_ptr, l_ptr,  # float32 [B, H, S]: each partition's running max (log2 units) and sum (SPLIT only)
    q_ptr,  # [B, H, D]
    k_ptr, v_ptr,  # [KVH, NB, BS, D]
    ks_ptr, vs_ptr,  # [KVH, NB, BS] per-slot scales (KV_QUANT only)
    block_tables_ptr,  # [B, max_blocks] int
    context_lens_ptr,  # [B] int
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_sh, stride_sb, stride_st,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, KV_QUANT: tl.constexpr, DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32).to(DOT)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, ctx)
    n = tl.arange(0, BLOCK_N)
    for tok in range(start, end, BLOCK_N):
        pos = tok + n
        valid = pos < end
        k, v = load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, block_tables_ptr + seq * stride_btb, pos, valid, kvh, d,
                             d_mask, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt, stride_sh,
                             stride_sb, stride_st, BLOCK_SIZE, KV_QUANT)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision="ieee")
        m_i = m_new

    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        o_off = seq * stride_ob + heads[:, None] * stride_oh + part * stride_os + d[None, :]
        tl.store(out_ptr + o_off, acc, mask=o_mask)
        ml_off = seq * stride_mb + heads * stride_mh + part
        tl.store(m_ptr + ml_off, m_i, mask=g_mask)
        tl.store(l_ptr + ml_off, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [B, H, D]
    part_ptr,  # float32 [B, H, S, D]
    m_ptr, l_ptr,  # float32 [B, H, S]
    num_parts,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_mb, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_parts
    ml_off = seq * stride_mb + head * stride_mh + s
    m = tl.load(m_ptr + ml_off, mask=s_mask, other=float("-inf"))  # -inf too for a partition past the context
    l_part = tl.load(l_ptr + ml_off, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(l_part * w, axis=0)
    parts = tl.load(part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_context_len: int | None = None, partition_size: int = 512,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, H, D] (sequence b's one new token) over the first
    ``context_lens[b]`` tokens of its pages ``block_tables[b]`` in the pools ``k_cache`` /
    ``v_cache`` [KVH, NB, BS, D] (``k_scale``/``v_scale`` [KVH, NB, BS] for 8-bit pools);
    ``H`` a multiple of ``KVH``. Contexts longer than ``partition_size`` tokens are split
    (``max_context_len``, when given, spares reading ``context_lens`` back). Returns
    [B, H, D] in q's dtype (into ``out`` when given)."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, unit_last=True)
    dev = q.device
    B, H, D = q.shape
    check_kv_pool(k_cache, k_scale, "k_cache", q.dtype, dev)
    check_kv_pool(v_cache, v_scale, "v_cache", q.dtype, dev)
    KVH, _, BS, _ = k_cache.shape
    check_shape(k_cache, "k_cache", (None, None, None, D))
    check_shape(v_cache, "v_cache", tuple(k_cache.shape))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache is {v_cache.dtype}, k_cache {k_cache.dtype}: they must match")
    if H % KVH:
        raise ValueError(f"q has {H} heads, not a multiple of the cache's {KVH} KV heads")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale: give both (8-bit pools) or neither")
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=INT_DTYPES, device=dev)
    check_tensor(context_lens, "context_lens", ndim=1, dtypes=INT_DTYPES, device=dev)
    check_shape(block_tables, "block_tables", (B, None))
    check_shape(context_lens, "context_lens", (B,))
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor(out, "out", dtypes=(q.dtype,), device=dev, unit_last=True)
        check_shape(out, "out", (B, H, D))
    if B == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_n = 64  # tokens per iteration, gathered through the block table whatever the page size
    if partition_size <= 0 or partition_size % block_n:
        raise ValueError(f"partition_size must be a positive multiple of {block_n} tokens, got {partition_size}")
    num_parts = max(1, math.ceil(max_context_len / partition_size))
    split = num_parts > 1
    group = H // KVH
    quant = k_cache.dtype in (torch.float8_e4m3fn, torch.int8)
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused pointers when not quantised
    s_strides = k_scale.stride() if quant else (0, 0, 0)
    if quant and v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale must have the same strides")
    if split:
        partial = torch.empty(B, H, num_parts, D, dtype=torch.float32, device=dev)
        m = torch.empty(B, H, num_parts, dtype=torch.float32, device=dev)
        ell = torch.empty_like(m)
        target, o_strides, ml_strides = partial, partial.stride()[:3], m.stride()[:2]
    else:
        m = ell = q  # unused
        target, o_strides, ml_strides = out, (*out.stride()[:2], 0), (0, 0)
    _paged_decode_attention_kernel[(B, KVH, num_parts)](
        target, m, ell, q, k_cache, v_cache, ks, vs, block_tables, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides, block_tables.stride(0), *o_strides, *ml_strides,
        GROUP=group, GROUP_PAD=next_pow2(group, 16), HEAD_DIM=D, HEAD_DIM_PAD=next_pow2(D, 16),
        BLOCK_SIZE=BS, BLOCK_N=block_n, PARTITION=partition_size,
        SPLIT=split, KV_QUANT=quant, DOT=dot_dtype(q.dtype),
    )
    if split:
        _decode_reduce_kernel[(B, H)](
            out, partial, m, ell, num_parts, out.stride(0), out.stride(1), *partial.stride()[:3], *m.stride()[:2],
            HEAD_DIM=D, HEAD_DIM_PAD=next_pow2(D), PARTS_PAD=next_pow2(num_parts),
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                               max_context_len: int | None = None, partition_size: int = 512,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """The same in plain torch, one sequence at a time, in float32 (``max_context_len`` and
    ``partition_size`` change nothing here)."""
    B, H, D = q.shape
    KVH, _, BS, _ = k_cache.shape
    result = torch.empty_like(q) if out is None else out
    for b in range(B):
        n = int(context_lens[b])
        pages = block_tables[b, :(n + BS - 1) // BS].long()
        k = gather_pages(k_cache, k_scale, pages)[:, :n]  # [KVH, n, D]
        v = gather_pages(v_cache, v_scale, pages)[:, :n]
        qb = q[b].float().view(KVH, H // KVH, D)
        p = torch.softmax(qb @ k.transpose(1, 2) * scale, dim=-1)
        result[b] = (p @ v).reshape(H, D).to(q.dtype)
    return result


def gather_pages(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    """float32 [KVH, len(pages) * BS, D] of ``pages``, dequantised with ``scale`` if given."""
    KVH, _, BS, D = cache.shape
    x = cache.index_select(1, pages).float()
    if scale is not None:
        x = x * scale.index_select(1, pages).float().unsqueeze(-1)
    return x.reshape(KVH, -1, D)
