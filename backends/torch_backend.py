"""The `torch` backend: the reference every other backend is tested against.

Attention reads K/V from the paged pool through block tables: decode rows are gathered
into one padded [batch, max_context] view and done in one grouped matmul; each prefill
(chunk) is one scaled_dot_product_attention call, straight on the new K/V when nothing
is cached, otherwise over the gathered context with a causal mask offset by the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F
from tokenloom.core.attention import AttentionInputs
from tokenloom.core.hookspecs import hookimpl


class TorchBackendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


@dataclass(slots=True)
class TorchAttnMeta:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # [B] rows of q
    decode_slots: torch.Tensor | None  # [B, L] flat slots (padded with 0)
    decode_bias: torch.Tensor | None  # [B, 1, 1, L] 0 / -inf
    prefills: list  # (q_start, q_end, slots [ctx] or None, mask [q, ctx] or None)


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size] * block_size + pos % block_size


class TorchBackend:
    name = "torch"

    def __init__(self, options: TorchBackendOptions | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    # ---- per-step metadata ------------------------------------------------------
    def prepare(self, inp: AttentionInputs) -> TorchAttnMeta:
        dev, bs = self.device, inp.block_size
        decode_rows = decode_slots = decode_bias = None
        if inp.decode_rows:
            max_len = max(inp.decode_context_lens)
            max_blocks = (max_len + bs - 1) // bs
            table = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                                  for t in inp.decode_block_tables], dtype=torch.long, device=dev)
            decode_slots = _slots(table, max_len, bs)
            lens = torch.tensor(inp.decode_context_lens, device=dev)
            valid = torch.arange(max_len, device=dev)[None, :] < lens[:, None]
            decode_bias = torch.zeros(valid.shape, dtype=torch.float32, device=dev)
            decode_bias.masked_fill_(~valid, float("-inf"))
            decode_bias = decode_bias[:, None, None, :]
            decode_rows = torch.tensor(inp.decode_rows, dtype=torch.long, device=dev)
        prefills = []
        for span in inp.prefills:
            if span.q_len == span.context_len:  # nothing cached: attend to the new K/V directly
                prefills.append((span.q_start, span.q_end, None, None))
                continue
            table = torch.tensor(span.block_table, dtype=torch.long, device=dev)
            slots = _slots(table, span.context_len, bs)
            offset = span.context_len - span.q_len
            i = torch.arange(span.q_len, device=dev)[:, None]
            j = torch.arange(span.context_len, device=dev)[None, :]
            prefills.append((span.q_start, span.q_end, slots, j <= i + offset))
        return TorchAttnMeta(inp.slot_mapping, decode_rows, decode_slots, decode_bias, prefills)

    # ---- ops --------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        # k_cache: [num_blocks, block_size, kv_heads, head_dim]; k: [T, kv_heads, head_dim]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def attention(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float):
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's); returns [T, H, D]."""
        out = torch.empty_like(q)
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], flat_k, flat_v, meta, scale)
        for q_start, q_end, slots, mask in meta.prefills:
            qs = q[q_start:q_end].transpose(0, 1)  # [H, q, D]
            if slots is None:
                ks, vs = k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ks, vs = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, flat_k, flat_v, meta: TorchAttnMeta, scale: float):
        # q: [B, H, D] -> [B, KVH, G, D]; keys gathered to [B, KVH, D, L]
        B, H, D = q.shape
        kv_heads = flat_k.shape[1]
        qg = q.view(B, kv_heads, H // kv_heads, D)
        keys = flat_k[meta.decode_slots].permute(0, 2, 3, 1)
        values = flat_v[meta.decode_slots].permute(0, 2, 1, 3)  # [B, KVH, L, D]
        scores = torch.matmul(qg, keys).float() * scale + meta.decode_bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(B, H, D)

    def rms_norm(self, x, weight, eps: float):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight

    def linear(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def silu_mul(self, gate, up):
        return F.silu(gate) * up


@hookimpl
def register_backends(register):
    register("torch", TorchBackend, options=TorchBackendOptions,
             description="PyTorch reference backend (CPU or CUDA)")
