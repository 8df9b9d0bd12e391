"""The `torch` backend: the reference every other backend is tested against.

Attention reads K/V from the paged pool through block tables: the decode rows' blocks are
gathered into one padded [kv_heads * batch, max_context] view and done in two batched
matmuls; each prefill (chunk) is one scaled_dot_product_attention call, straight on the
new K/V when nothing is cached, otherwise over the gathered context with a causal mask
offset by the cached length.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from tokenloom.backends.torch_linear import pack
from tokenloom.core.attention import AttentionInputs
from tokenloom.core.hookspecs import hookimpl


class TorchBackendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # fp32 matmuls on CPU: "dual" keeps two layouts of each weight (2x weight memory): a
    # plain [in, out] copy for MKL's GEMV at <= 4 rows and a oneDNN-packed copy for
    # batches, 1.5-2.8x faster than MKL there on an AVX2 EPYC. "mkl" or "onednn" keep one.
    cpu_linear: str = "dual"
    # 4-bit weights on CPU: above this many rows per matmul a dense bf16 copy (kept beside the
    # int4 one) is faster than the int4 kernel; 0 keeps 4-bit only (least memory).
    int4_max_rows: int = 8


@dataclass(slots=True)
class TorchAttnMeta:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # [B] rows of q that decode one token
    decode_blocks: torch.Tensor | None  # [B * max_blocks] block ids, padded with block 0
    decode_bias: torch.Tensor | None  # [B, 1, max_blocks * block_size] 0 where valid, -inf past the context
    prefills: list  # (q_start, q_end, blocks [n] or None, context_len, mask [q, ctx] or None)


class TorchBackend:
    """KV layout per layer: ``[kv_heads, num_blocks, block_size, head_dim]``. Head-major
    means gathering a batch's blocks along dim 1 yields ``[kv_heads * B, len, head_dim]``
    directly, which is what a batched matmul wants: no strided copy per layer."""

    name = "torch"

    def __init__(self, options: TorchBackendOptions | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        options = options or TorchBackendOptions()
        self.cpu_linear, self.int4_max_rows = options.cpu_linear, options.int4_max_rows
        if self.cpu_linear not in ("dual", "mkl", "onednn"):
            from tokenloom.core.errors import ConfigError

            raise ConfigError(f"backend.cpu_linear must be dual, mkl or onednn, got {self.cpu_linear!r}")
        if self.cpu_linear != "mkl" and not torch.backends.mkldnn.is_available():
            self.cpu_linear = "mkl"

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Zeroed, not empty: padded decode rows read (and mask) unwritten slots, and
        # 0 * NaN from uninitialised memory would poison the probability-weighted sum.
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(num_layers)]

    # ---- per-step metadata ------------------------------------------------------
    def prepare(self, inp: AttentionInputs) -> TorchAttnMeta:
        dev, bs = self.device, inp.block_size
        decode_rows = decode_blocks = decode_bias = None
        if inp.decode_rows:
            max_blocks = (max(inp.decode_context_lens) + bs - 1) // bs
            table = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in inp.decode_block_tables]
            decode_blocks = torch.tensor(table, dtype=torch.long, device=dev).view(-1)
            lens = torch.tensor(inp.decode_context_lens, device=dev)
            valid = torch.arange(max_blocks * bs, device=dev)[None, :] < lens[:, None]
            decode_bias = torch.zeros(valid.shape, dtype=torch.float32, device=dev)
            decode_bias.masked_fill_(~valid, float("-inf"))
            decode_bias = decode_bias[:, None, :]
            decode_rows = torch.tensor(inp.decode_rows, dtype=torch.long, device=dev)
        prefills = []
        for span in inp.prefills:
            if span.q_len == span.context_len:  # nothing cached: attend to the new K/V directly
                prefills.append((span.q_start, span.q_end, None, span.context_len, None))
                continue
            num_blocks = (span.context_len + bs - 1) // bs
            blocks = torch.tensor(span.block_table[:num_blocks], dtype=torch.long, device=dev)
            offset = span.context_len - span.q_len
            i = torch.arange(span.q_len, device=dev)[:, None]
            j = torch.arange(span.context_len, device=dev)[None, :]
            prefills.append((span.q_start, span.q_end, blocks, span.context_len, j <= i + offset))
        return TorchAttnMeta(inp.slot_mapping, decode_rows, decode_blocks, decode_bias, prefills)

    def copy_blocks(self, kv_caches, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first ``n`` token slots of block ``src`` into block ``dst``, every layer."""
        for k_cache, v_cache in kv_caches:
            for src, dst, n in copies:
                k_cache[:, dst, :n] = k_cache[:, src, :n]
                v_cache[:, dst, :n] = v_cache[:, src, :n]

    # ---- ops --------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        # k_cache: [kv_heads, num_blocks, block_size, head_dim]; k: [T, kv_heads, head_dim]
        kv_heads, _, _, head_dim = k_cache.shape
        k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def attention(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float):
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's); returns [T, H, D]."""
        out = torch.empty_like(q)
        kv_heads, _, block_size, head_dim = k_cache.shape
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        for q_start, q_end, blocks, context_len, mask in meta.prefills:
            qs = q[q_start:q_end].transpose(0, 1)  # [H, q, D]
            if blocks is None:
                ks, vs = k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ks = k_cache.index_select(1, blocks).view(kv_heads, -1, head_dim)[:, :context_len]
                vs = v_cache.index_select(1, blocks).view(kv_heads, -1, head_dim)[:, :context_len]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: TorchAttnMeta, scale: float):
        # q: [B, H, D] -> [KVH * B, G, D]; keys gathered to [KVH * B, L, D]
        B, H, D = q.shape
        kv_heads = k_cache.shape[0]
        group = H // kv_heads
        keys = k_cache.index_select(1, meta.decode_blocks).view(kv_heads * B, -1, D)
        values = v_cache.index_select(1, meta.decode_blocks).view(kv_heads * B, -1, D)
        qg = q.view(B, kv_heads, group, D).transpose(0, 1).reshape(kv_heads * B, group, D)
        scores = torch.bmm(qg, keys.transpose(1, 2)).float() * scale
        scores = scores.view(kv_heads, B, group, -1) + meta.decode_bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads * B, group, -1)
        out = torch.bmm(probs, values)  # [KVH * B, G, D]
        return out.view(kv_heads, B, group, D).transpose(0, 1).reshape(B, H, D)

    def rms_norm(self, x, weight, eps: float):
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)

    def pack_linear(self, spec, dtype):
        """Called once per matmul at load time: the LinearWeight this machine computes it
        with (backends/torch_linear.py says which kernel for which spec)."""
        return pack(spec, dtype, cpu_linear=self.cpu_linear, int4_max_rows=self.int4_max_rows)

    def silu_mul(self, gate, up):
        return F.silu(gate) * up


@hookimpl
def register_backends(register):
    register("torch", TorchBackend, options=TorchBackendOptions,
             description="PyTorch reference backend (CPU or CUDA)")
