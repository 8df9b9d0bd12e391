"""LLaMA-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Weights use Hugging Face names; q/k/v and gate/up are fused at load time so each layer
runs three matmuls fewer. The residual stream stays in float32 whatever the weight
dtype: SmolLM2's activations reach ~25,000 and its first answer token is a near-tie that
pure bf16 flips ("The" 25.33 vs "L" 25.24 for the README's question). Every hot op goes
through ``self.backend`` or a LinearWeight the backend packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from tokenloom.core.interfaces import CapturedStep, DecodeLayer, DecodeModel, Quantizer
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.weights import (
    CheckpointTensors,
    LinearSlot,
    LinearWeight,
    dense_tensor,
    spec_to,
)


def rope_cache(cfg: ModelConfig, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] for HF's rotate-half RoPE, in float32."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


class LlamaLayer(nn.Module):
    # The matmuls: LinearWeight objects the backend packs at load time (see load_weights).
    qkv: LinearWeight
    o: LinearWeight
    gate_up: LinearWeight
    down: LinearWeight

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        """``cfg``: this rank's share of the heads and the FFN (the whole model on one rank)."""
        super().__init__()
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        d = cfg.hidden_size
        self.input_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, h, delta, cos, sin, k_cache, v_cache, meta, backend):
        """``h + delta`` is the residual stream coming in (``delta``: the previous layer's MLP
        output, added here together with this layer's first norm); returns the stream after
        attention and this layer's MLP output, the next layer's ``delta``."""
        cfg, dtype = self.cfg, self.dtype
        T = h.shape[0]
        x, h = backend.add_rms_norm(h, delta, self.input_norm, cfg.rms_norm_eps, dtype)
        qkv = self.qkv.apply(x)
        scale = cfg.head_dim**-0.5
        attn = backend.decode_attention_block(qkv, cos, sin, k_cache, v_cache, meta, cfg.num_heads, scale)
        if attn is None:  # op by op (a prefill in the step, or no fused path)
            # q and k rotate together: one RoPE over [T, heads + kv_heads, head_dim], in float32
            # (the float32 cos/sin promote a bf16 qkv: the same values as converting it first,
            # without a copy op)
            qk = backend.rope(qkv[:, :cfg.q_size + cfg.kv_size].view(T, -1, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim).to(dtype)
            k, q = k.to(dtype), q.to(dtype)  # the backend quantises K/V in write_kv if asked
            backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = backend.attention(q, k, v, k_cache, v_cache, meta, scale)
        # float32 h + a bf16 matmul output adds in float32 (type promotion): no copy op
        # o and down are row-parallel under tensor parallelism: their partial sums add up here
        o = self.tp.all_reduce(self.o.apply(attn.reshape(T, cfg.q_size).to(dtype)))
        x, h = backend.add_rms_norm(h, o, self.post_norm, cfg.rms_norm_eps, dtype)
        gate, up = self.gate_up.apply(x).chunk(2, dim=-1)
        return h, self.tp.all_reduce(self.down.apply(backend.silu_mul(gate, up)))


class LlamaModel(nn.Module):
    lm_head: LinearWeight  # packed at load time (tied to the embedding or not)
    cos: torch.Tensor  # float32 RoPE tables [max_len, head_dim], registered buffers
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend, max_len: int, tp: TensorParallel | None = None):
        """``cfg``: the whole model's; with ``tp`` this rank holds its share (core/parallel.py):
        ``embed`` and ``lm_head`` a slice of the vocabulary, each layer its heads and FFN slice."""
        super().__init__()
        self.cfg, self.dtype, self.backend = cfg, dtype, backend
        self.tp = tp = tp or TensorParallel()
        tp.check(cfg)
        self.embed = nn.Parameter(torch.empty(len(tp.vocab(cfg)), cfg.hidden_size, dtype=dtype), requires_grad=False)
        local = tp.local_config(cfg)
        self.layers = nn.ModuleList(LlamaLayer(local, dtype, tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        cos, sin = rope_cache(cfg, max_len, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.captured: CapturedStep | None = None  # the backend's whole decode step (capture())

    @property
    def decoder_layers(self) -> Sequence[LlamaLayer]:
        """``layers`` as what they are (an ``nn.ModuleList`` is typed as holding any Module)."""
        return cast(Sequence[LlamaLayer], self.layers)

    def capture(self) -> bool:
        """Ask the backend for a captured decode step over the loaded weights (one rank only:
        the captured step has no all-reduce). True when it gave one."""
        if self.tp.enabled:
            return False
        cfg = self.decoder_layers[0].cfg
        layers = tuple(DecodeLayer(lyr.input_norm, lyr.qkv, lyr.o, lyr.post_norm, lyr.gate_up, lyr.down)
                       for lyr in self.decoder_layers)
        self.captured = self.backend.capture_decode(DecodeModel(
            self.embed, self.cos, self.sin, layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.rms_norm_eps, self.dtype))
        return self.captured is not None

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states [T, hidden] (float32).
        A pure decode step goes to the captured step when there is one."""
        if self.captured is not None:
            hidden = self.captured(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        h, delta = self.tp.embed(self.embed, input_ids, self.cfg), None  # a copy: the stream is ours to update
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h, delta = layer(h, delta, cos, sin, k_cache, v_cache, meta, self.backend)
        assert delta is not None  # a model has at least one layer
        return h + delta

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Float32 ``[T, vocab]``; under tensor parallelism on rank 0 only (``None`` elsewhere)."""
        x = self.backend.rms_norm(h, self.norm, self.cfg.rms_norm_eps).to(self.dtype)
        return self.tp.gather_logits(self.lm_head.apply(x).float(), self.cfg)

    @torch.inference_mode()
    def load_weights(self, weights: dict[str, Any], quantizer: Quantizer, quant_config: dict | None = None) -> None:
        """Take every checkpoint tensor: norms and the embedding are copied in (dequantised
        if need be); each matmul slot goes through ``quantizer`` (which fuses q/k/v and
        gate/up) and is packed by the backend. A missing, misshapen or unused tensor fails
        with a sentence naming it. The model must already be on its device."""
        cfg = self.cfg
        tensors = CheckpointTensors(weights, quant_config)
        tp = self.tp
        embed_raw = tensors.take("model.embed_tokens.weight")
        embed = _checked(dense_tensor(embed_raw), (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")
        self.embed.copy_(embed[tp.vocab(cfg).start:tp.vocab(cfg).stop])
        self.norm.copy_(_checked(dense_tensor(tensors.take("model.norm.weight")), self.norm.shape, "model.norm.weight"))
        head_slot = LinearSlot("lm_head", ("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head",),
                               (cfg.vocab_size,), cfg.hidden_size)
        if cfg.tie_word_embeddings:
            tensors.discard("lm_head.weight")
            self.lm_head = self._pack(quantizer, head_slot, CheckpointTensors({"model.embed_tokens.weight": embed_raw},
                                                                              tensors.quant_config), "lm_head")
        else:
            self.lm_head = self._pack(quantizer, head_slot, tensors, "lm_head")
        q, kv, d, ffn = cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size
        slots = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (q, kv, kv), d),
                 ("o", ("self_attn.o_proj",), (d,), q),
                 ("gate_up", ("mlp.gate_proj", "mlp.up_proj"), (ffn, ffn), d),
                 ("down", ("mlp.down_proj",), (d,), ffn))
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            for norm, name in ((layer.input_norm, "input_layernorm"), (layer.post_norm, "post_attention_layernorm")):
                norm.copy_(_checked(dense_tensor(tensors.take(p + name + ".weight")), norm.shape, p + name + ".weight"))
            for name, parts, rows, cols in slots:
                slot = LinearSlot(p + name, tuple(p + part for part in parts), rows, cols)
                setattr(layer, name, self._pack(quantizer, slot, tensors, name))
        leftovers = [n for n in tensors.names() if "rotary_emb" not in n]
        if leftovers:
            raise ValueError(f"checkpoint has tensors this model does not use: {leftovers[:5]}")

    def _pack(self, quantizer: Quantizer, slot: LinearSlot, tensors: CheckpointTensors, kind: str) -> LinearWeight:
        """The quantizer makes the slot's whole weight; this rank keeps its share (rows or
        columns, core/parallel.py) before the backend packs it."""
        spec = quantizer.weight_spec(slot, tensors)
        if tuple(spec.shape) != slot.shape:
            raise ValueError(f"quantizer gave {slot.name} a {tuple(spec.shape)} weight, the model needs {slot.shape}")
        spec = self.tp.shard(kind, slot.name, spec, self.cfg, type(quantizer).__name__)
        return self.backend.pack_linear(spec_to(spec, self.embed.device), self.dtype)

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step must read: each matmul weight and norm once (one
        layout), plus the output head; the embedding lookup reads a single row."""
        total = self.lm_head.nbytes() + self.norm.numel() * 4
        for layer in self.decoder_layers:
            total += sum(w.nbytes() for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * 4
        return total


def _checked(t: torch.Tensor, shape, name: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model needs {tuple(shape)}")
    return t
