"""Prefill attention over a paged context: a chunk of ``q_len`` new tokens per sequence,
causal, attending to its ``context_len`` tokens (the cached ones first, then the chunk
itself, all already written to the pool), so ``q_len <= context_len``: query ``i`` sits at
position ``context_len - q_len + i`` and sees keys up to it.

One program per (sequence, query head, tile of ``BLOCK_M`` queries) runs a FlashAttention-2
loop over ``BLOCK_N`` keys at a time up to the tile's causal limit, finding each key's page
through the block table; online softmax in float32 with exp2. The sequences' query rows
need not be contiguous or ordered (``query_start``/``query_lens``): a step's decode rows
may sit between them. (Packing a KV head's GQA group into the rows, as the decode kernel
does, would read each key once per group rather than once per head: a later optimisation.)
"""

from __future__ import annotations

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
from .decode_attention import LOG2E, gather_pages, load_kv_tile


@triton.jit
def _paged_prefill_attention_kernel(
    out_ptr, q_ptr,  # [T, H, D]
    k_ptr, v_ptr,  # [KVH, NB, BS, D]
    ks_ptr, vs_ptr,  # [KVH, NB, BS] per-slot scales (KV_QUANT only)
    block_tables_ptr,  # [S, max_blocks] int
    context_lens_ptr, query_start_ptr, query_lens_ptr,  # [S] int
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_sh, stride_sb, stride_st,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr, DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq).to(tl.int32)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    offset = ctx - q_len  # position of the chunk's first token
    kvh = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    r_mask = rows < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32).to(DOT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # keys up to the tile's last query (none for a tile past the chunk)
    kv_end = tl.where(tile * BLOCK_M < q_len, tl.minimum(ctx, offset + (tile + 1) * BLOCK_M), 0)
    n = tl.arange(0, BLOCK_N)
    for tok in range(0, kv_end, BLOCK_N):
        pos = tok + n
        valid = pos < kv_end
        k, v = load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, block_tables_ptr + seq * stride_btb, pos, valid, kvh, d,
                             d_mask, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt, stride_sh,
                             stride_sb, stride_st, BLOCK_SIZE, KV_QUANT)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        causal = pos[None, :] <= offset + rows[:, None]
        s = tl.where(causal & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row has seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                            query_lens: torch.Tensor, scale: float, *, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, max_query_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of sequence s's rows ``q[query_start[s] : query_start[s] + query_lens[s]]``
    (q [T, H, D]) over the first ``context_lens[s]`` tokens of its pages ``block_tables[s]``
    in ``k_cache``/``v_cache`` [KVH, NB, BS, D] (``k_scale``/``v_scale`` for 8-bit pools);
    ``query_lens[s] <= context_lens[s]``. Writes those rows of ``out`` (allocated like q when
    None; other rows are left as they are) and returns it. ``max_query_len``, when given,
    spares reading ``query_lens`` back."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, unit_last=True)
    dev = q.device
    T, H, D = q.shape
    check_kv_pool(k_cache, k_scale, "k_cache", q.dtype, dev)
    check_kv_pool(v_cache, v_scale, "v_cache", q.dtype, dev)
    KVH, _, BS, _ = k_cache.shape
    check_shape(k_cache, "k_cache", (None, None, None, D))
    check_shape(v_cache, "v_cache", tuple(k_cache.shape))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache is {v_cache.dtype}, k_cache {k_cache.dtype}: they must match")
    if H % KVH:
        raise ValueError(f"q has {H} heads, not a multiple of the cache's {KVH} KV heads")
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=INT_DTYPES, device=dev)
    S = block_tables.shape[0]
    for name, t in (("context_lens", context_lens), ("query_start", query_start), ("query_lens", query_lens)):
        check_tensor(t, name, ndim=1, dtypes=INT_DTYPES, device=dev)
        check_shape(t, name, (S,))
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor(out, "out", dtypes=(q.dtype,), device=dev, unit_last=True)
        check_shape(out, "out", (T, H, D))
    if S == 0 or T == 0:
        return out
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    quant = k_cache.dtype in (torch.float8_e4m3fn, torch.int8)
    if quant and (v_scale is None or v_scale.stride() != k_scale.stride()):
        raise ValueError("k_scale and v_scale must both be given, with the same strides")
    block_m = 16 if max_query_len <= 16 else 32
    grid = (S, H, triton.cdiv(max_query_len, block_m))
    _paged_prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, context_lens, query_start, query_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(k_scale.stride() if quant else (0, 0, 0)), block_tables.stride(0),
        GROUP=H // KVH, HEAD_DIM=D, HEAD_DIM_PAD=next_pow2(D, 16), BLOCK_SIZE=BS, BLOCK_M=block_m,
        BLOCK_N=64, KV_QUANT=quant, DOT=dot_dtype(q.dtype),
    )
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                                query_lens: torch.Tensor, scale: float, *, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None, max_query_len: int | None = None,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """The same in plain torch, one sequence at a time, in float32."""
    T, H, D = q.shape
    KVH, _, BS, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    for s in range(block_tables.shape[0]):
        n, start, q_len = int(context_lens[s]), int(query_start[s]), int(query_lens[s])
        pages = block_tables[s, :(n + BS - 1) // BS].long()
        k = gather_pages(k_cache, k_scale, pages)[:, :n].repeat_interleave(H // KVH, dim=0)  # [H, n, D]
        v = gather_pages(v_cache, v_scale, pages)[:, :n].repeat_interleave(H // KVH, dim=0)
        qs = q[start:start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        visible = torch.arange(n)[None, :] <= torch.arange(q_len)[:, None] + (n - q_len)
        scores = (qs @ k.transpose(1, 2) * scale).masked_fill(~visible.to(q.device), float("-inf"))
        out[start:start + q_len] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out
