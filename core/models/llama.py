"""LLaMA-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Weights use Hugging Face names; q/k/v and gate/up are fused at load time so each layer
runs three matmuls fewer. The residual stream stays in float32 whatever the weight
dtype: SmolLM2's activations reach ~25,000 and its first answer token is a near-tie that
pure bf16 flips ("The" 25.33 vs "L" 25.24 for the README's question). Every hot op goes through ``self.backend``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.core.models.config import ModelConfig


def rope_cache(cfg: ModelConfig, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] for HF's rotate-half RoPE, in float32."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim] float32; cos/sin: [T, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        d, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.input_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv, d, dtype=dtype), requires_grad=False)
        self.o = nn.Parameter(torch.empty(d, cfg.q_size, dtype=dtype), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, d, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(d, cfg.intermediate_size, dtype=dtype), requires_grad=False)

    def forward(self, h, cos, sin, k_cache, v_cache, meta, backend):
        cfg, dtype = self.cfg, self.dtype
        T = h.shape[0]
        x = backend.rms_norm(h, self.input_norm, cfg.rms_norm_eps).to(dtype)
        qkv = backend.linear(x, self.qkv).float()
        # q and k rotate together: one RoPE over [T, heads + kv_heads, head_dim]
        qk = apply_rope(qkv[:, :cfg.q_size + cfg.kv_size].view(T, -1, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
        k, v, q = k.to(k_cache.dtype), v.to(v_cache.dtype), q.to(k_cache.dtype)
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = backend.attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim**-0.5)
        h = h + backend.linear(attn.reshape(T, cfg.q_size).to(dtype), self.o).float()
        x = backend.rms_norm(h, self.post_norm, cfg.rms_norm_eps).to(dtype)
        gate, up = backend.linear(x, self.gate_up).chunk(2, dim=-1)
        return h + backend.linear(backend.silu_mul(gate, up), self.down).float()


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend, max_len: int):
        super().__init__()
        self.cfg, self.dtype, self.backend = cfg, dtype, backend
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        cos, sin = rope_cache(cfg, max_len, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states [T, hidden] (float32)."""
        h = self.embed[input_ids].float()
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, k_cache, v_cache, meta, self.backend)
        return h

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        x = self.backend.rms_norm(h, self.norm, self.cfg.rms_norm_eps).to(self.dtype)
        return self.backend.linear(x, self.lm_head).float()

    @torch.inference_mode()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Missing or extra names fail."""
        cfg = self.cfg
        remaining = dict(weights)

        def take(name: str) -> torch.Tensor:
            try:
                return remaining.pop(name)
            except KeyError:
                raise ValueError(f"checkpoint is missing tensor {name!r}") from None

        self.embed.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if "lm_head.weight" in remaining and not cfg.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        elif cfg.tie_word_embeddings:
            remaining.pop("lm_head.weight", None)
        else:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            layer.qkv.copy_(torch.cat([q, k, v], dim=0))
            layer.o.copy_(take(p + "self_attn.o_proj.weight"))
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            layer.gate_up.copy_(torch.cat([gate, up], dim=0))
            layer.down.copy_(take(p + "mlp.down_proj.weight"))
        leftovers = [n for n in remaining if "rotary_emb" not in n]
        if leftovers:
            raise ValueError(f"checkpoint has tensors this model does not use: {leftovers[:5]}")
        self._pack_linears()

    def _pack_linears(self) -> None:
        """Let the backend lay out each matmul weight its way (once, at load time).
        A packed weight may not be a tensor, so it lives as a plain attribute."""
        pack = self.backend.pack_linear
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                packed = pack(getattr(layer, name).data)
                delattr(layer, name)
                setattr(layer, name, packed)
        # A tied head packed into another layout becomes a second copy; the embedding keeps rows.
        packed_head = pack(self.lm_head.data)
        del self.lm_head
        self.lm_head = packed_head

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step must read: each matmul weight and norm once (one
        layout), plus the output head; the embedding lookup reads a single row."""
        def size(w) -> int:
            if isinstance(w, torch.Tensor):
                return w.numel() * w.element_size()
            return w.nbytes()

        total = size(self.lm_head) + self.norm.numel() * 4
        for layer in self.layers:
            total += sum(size(getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down"))
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * 4
        return total
