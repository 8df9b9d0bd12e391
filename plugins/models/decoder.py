"""The decoder-only transformer every built-in family is (plugins/models/families.py says
which switches each turns on): RMSNorm, RoPE, grouped-query attention, a gated MLP or a
mixture of experts; optionally q/k/v biases, per-head q/k norms, sliding-window layers,
soft-capped scores and logits, Gemma's sandwich norms, (1 + weight) norms and scaled
embedding, GeGLU, partial rotary.

Weights use Hugging Face names; q/k/v and gate/up are fused at load time so each layer
runs three matmuls fewer. The residual stream stays in float32 whatever the weight
dtype: SmolLM2's activations reach ~25,000 and its first answer token is a near-tie that
pure bf16 flips ("The" 25.33 vs "L" 25.24 for the README's question). Every hot op goes
through ``self.backend`` or a LinearWeight the backend packed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import structlog
import torch
from torch import nn

from tokenloom.core.interfaces import CapturedStep, DecodeLayer, DecodeModel, LinearSite, Quantizer
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.weights import (
    CheckpointTensors,
    LinearSlot,
    LinearWeight,
    apply_float32,
    dense_tensor,
    spec_to,
)
from tokenloom.plugins.models.rope import rope_tables

log = structlog.get_logger("tokenloom.models")

#: a layer's MLP: (layer, normed input [T, hidden] in the model dtype) -> [T, hidden] (before all-reduce)
MLPFactory = Callable[..., nn.Module]


def fast_path_blockers(cfg: ModelConfig) -> list[str]:
    """What in ``cfg`` the backends' captured step does not implement: the model steps aside
    from it for those (empty: LLaMA's shape, or Qwen2's / Qwen3's). The q/k/v bias and the
    per-head q/k norms are not listed: they travel in ``DecodeLayer`` (``qkv_bias``,
    ``q_norm``, ``k_norm``), and a backend whose captured step lacks them returns None from
    ``capture_decode`` (the torch backend's C++ step has them)."""
    checks = (("sliding_window", any(cfg.window(i) for i in range(cfg.num_layers))),
              ("attn_logit_softcap", cfg.attn_logit_softcap is not None),
              ("sandwich_norms", cfg.sandwich_norms), ("hidden_act", cfg.hidden_act != "silu"),
              ("embedding_multiplier", cfg.embedding_multiplier != 1.0),
              ("partial_rotary_factor", cfg.partial_rotary_factor != 1.0),
              ("rope_local_theta", cfg.rope_local_theta is not None),
              ("query_pre_attn_scalar", cfg.attention_scale != cfg.head_dim ** -0.5),
              ("moe", cfg.moe is not None))
    return [name for name, on in checks if on]


class GatedMLP(nn.Module):
    """gate/up fused into one matmul, the activation, down (SwiGLU or GeGLU)."""

    gate_up: LinearWeight
    down: LinearWeight

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.act = cfg.hidden_act

    def slots(self, cfg: ModelConfig, prefix: str, parts: dict[str, tuple[str, ...]]) -> list[tuple[str, LinearSlot]]:
        """(attribute, slot) for each matmul, checkpoint names under ``prefix``."""
        d, ffn = cfg.hidden_size, cfg.intermediate_size
        rows = (ffn, ffn) if len(parts["gate_up"]) == 2 else (2 * ffn,)  # Phi-3 stores them fused
        return [("gate_up", LinearSlot(prefix + "gate_up", tuple(prefix + p for p in parts["gate_up"]), rows, d)),
                ("down", LinearSlot(prefix + "down", tuple(prefix + p for p in parts["down"]), (d,), ffn))]

    def forward(self, x, backend):
        gate, up = self.gate_up.apply(x).chunk(2, dim=-1)
        act = backend.silu_mul(gate, up) if self.act == "silu" else backend.gelu_tanh_mul(gate, up)
        return self.down.apply(act)

    def linears(self) -> dict[str, LinearWeight]:
        return {"gate_up": self.gate_up, "down": self.down}


class DecoderLayer(nn.Module):
    # The matmuls: LinearWeight objects the backend packs at load time (see load_weights).
    qkv: LinearWeight
    o: LinearWeight
    mlp: Any  # a GatedMLP, or a family's own (an MoE block): forward(x, backend), linears(), load(...)
    input_norm: torch.Tensor
    post_norm: torch.Tensor

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, tp: TensorParallel, mlp: nn.Module):
        """``cfg``: this rank's share of the heads and the FFN (the whole model on one rank)."""
        super().__init__()
        self.cfg, self.index, self.dtype, self.tp = cfg, index, dtype, tp
        self.mlp = mlp
        d = cfg.hidden_size
        self.window = cfg.window(index)
        self.local_rope = cfg.rope_local_theta is not None and self.window is not None
        self.input_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(d), requires_grad=False)  # before the MLP
        if cfg.sandwich_norms:  # Gemma: the attention output and the MLP output normed too
            self.attn_out_norm = nn.Parameter(torch.ones(d), requires_grad=False)
            self.mlp_out_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
        self.qkv_bias: torch.Tensor | None = None
        self.fused_attention = not (self.window or cfg.attn_logit_softcap or cfg.partial_rotary_factor != 1.0)

    def norms(self) -> list[str]:
        """The layer's norm attributes, each loaded from ``names[attr]`` (a family whose layer
        has other norms overrides this)."""
        cfg = self.cfg
        return ["input_norm", "post_norm"] + (["attn_out_norm", "mlp_out_norm"] if cfg.sandwich_norms else []) \
            + (["q_norm", "k_norm"] if cfg.qk_norm else [])

    def forward(self, h, delta, cos, sin, k_cache, v_cache, meta, backend):
        """``h + delta`` is the residual stream coming in (``delta``: the previous layer's MLP
        output, added here together with this layer's first norm); returns the stream after
        attention and this layer's MLP output, the next layer's ``delta``."""
        cfg, dtype = self.cfg, self.dtype
        x, h = backend.add_rms_norm(h, delta, self.input_norm, cfg.rms_norm_eps, dtype)
        o = self.attend(x, cos, sin, k_cache, v_cache, meta, backend)
        if cfg.sandwich_norms:
            o = backend.rms_norm(o, self.attn_out_norm, cfg.rms_norm_eps)
        # float32 h + a bf16 matmul output adds in float32 (type promotion): no copy op
        x, h = backend.add_rms_norm(h, o, self.post_norm, cfg.rms_norm_eps, dtype)
        out = self.tp.all_reduce(self.mlp.forward(x, backend))  # (forward: no module-call hooks per layer)
        if cfg.sandwich_norms:
            out = backend.rms_norm(out, self.mlp_out_norm, cfg.rms_norm_eps)
        return h, out

    def attend(self, x, cos, sin, k_cache, v_cache, meta, backend) -> torch.Tensor:
        """Attention of the normed input ``x [T, hidden]`` (model dtype) through ``o``: q/k/v
        (biases, q/k norms), RoPE, the KV write and attention over the cache; returns the
        output projection's result, summed over tensor-parallel ranks."""
        cfg, dtype = self.cfg, self.dtype
        T = x.shape[0]
        qkv = self.qkv.apply(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if cfg.qk_norm:  # each head of q and k normed on its own, before RoPE
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = backend.rms_norm(q.reshape(T, cfg.num_heads, cfg.head_dim), self.q_norm, cfg.rms_norm_eps)
            k = backend.rms_norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
            qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.float()], dim=-1).to(dtype)
        scale = cfg.attention_scale
        attn = None
        if self.fused_attention:
            attn = backend.decode_attention_block(qkv, cos, sin, k_cache, v_cache, meta, cfg.num_heads, scale)
        if attn is None:  # op by op (a prefill in the step, a window or soft-cap, or no fused path)
            # q and k rotate together: one RoPE over [T, heads + kv_heads, head_dim], computed in
            # float32 and rounded to the model dtype
            qk = qkv[:, :cfg.q_size + cfg.kv_size].view(T, -1, cfg.head_dim)
            rot = cfg.rotary_dim
            if rot == cfg.head_dim:
                qk = backend.rope(qk, cos, sin, dtype)
            else:  # partial rotary: the first ``rot`` dims of each head turn, the rest pass
                qk = torch.cat([backend.rope(qk[..., :rot], cos, sin), qk[..., rot:].float()], dim=-1)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim).to(dtype)
            k, q = k.to(dtype), q.to(dtype)  # the backend quantises K/V in write_kv if asked
            backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            if self.window is None and cfg.attn_logit_softcap is None:
                attn = backend.attention(q, k, v, k_cache, v_cache, meta, scale)
            else:
                attn = backend.attention(q, k, v, k_cache, v_cache, meta, scale, window=self.window,
                                         softcap=cfg.attn_logit_softcap)
        # o is row-parallel under tensor parallelism: its partial sums add up here
        return self.tp.all_reduce(self.o.apply(attn.reshape(T, cfg.q_size).to(dtype)))


#: HF checkpoint names of one layer's parts, the LLaMA layout; families override entries
LLAMA_NAMES: dict[str, Any] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",  # the norm before the MLP
    "attn_out_norm": "post_attention_layernorm",  # (sandwich norms: after attention)
    "mlp_out_norm": "post_feedforward_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


class DecoderModel(nn.Module):
    lm_head: LinearWeight  # packed at load time (tied to the embedding or not)
    embed: torch.Tensor
    norm: torch.Tensor
    cos: torch.Tensor  # float32 RoPE tables [max_len, rotary_dim], registered buffers
    sin: torch.Tensor
    local_cos: torch.Tensor  # (Gemma 3's sliding layers)
    local_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend, max_len: int, tp: TensorParallel | None = None,
                 *, names: dict[str, Any] | None = None, mlp: MLPFactory | None = None,
                 layer: type[DecoderLayer] | None = None):
        """``cfg``: the whole model's; with ``tp`` this rank holds its share (core/parallel.py):
        ``embed`` and ``lm_head`` a slice of the vocabulary, each layer its heads and FFN slice.
        ``names``: the family's checkpoint names (LLAMA_NAMES's keys); ``mlp(cfg, layer, tp)``
        builds a layer's MLP (default: the gated MLP); ``layer``: a DecoderLayer subclass for
        a family whose block is wired otherwise (its ``forward`` and ``norms``)."""
        super().__init__()
        self.cfg, self.dtype, self.backend = cfg, dtype, backend
        self.names = {**LLAMA_NAMES, **(names or {})}
        self.tp = tp = tp or TensorParallel()
        tp.check(cfg)
        self.embed = nn.Parameter(torch.empty(len(tp.vocab(cfg)), cfg.hidden_size, dtype=dtype), requires_grad=False)
        local = tp.local_config(cfg)
        make_mlp = mlp or (lambda c, i, t: GatedMLP(c, t))
        layer_cls = layer or DecoderLayer
        self.layers = nn.ModuleList(layer_cls(local, i, dtype, tp, make_mlp(local, i, tp))
                                    for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        cos, sin = rope_tables(cfg, max_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)  # float32 [max_len, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)
        if cfg.rope_local_theta is not None:  # Gemma 3: sliding layers turn at their own base, unscaled
            from tokenloom.core.models.config import RopeScaling

            cos, sin = rope_tables(cfg, max_len, cfg.rope_local_theta, RopeScaling())
            self.register_buffer("local_cos", cos, persistent=False)
            self.register_buffer("local_sin", sin, persistent=False)
        self.captured: CapturedStep | None = None  # the backend's whole decode step (capture())
        fused = sum(layer.fused_attention for layer in self.decoder_layers)
        if fused < cfg.num_layers:
            log.info("fused_decode_attention_stepped_aside", model=cfg.checkpoint_architecture or cfg.architecture,
                     layers=cfg.num_layers - fused, of=cfg.num_layers,
                     because=[name for name, on in (("sliding_window", any(cfg.window(i) for i in range(cfg.num_layers))),
                                                    ("attn_logit_softcap", cfg.attn_logit_softcap is not None),
                                                    ("partial_rotary_factor", cfg.partial_rotary_factor != 1.0))
                              if on])

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """``layers`` as what they are (an ``nn.ModuleList`` is typed as holding any Module)."""
        return cast(Sequence[DecoderLayer], self.layers)

    def capture(self) -> bool:
        """Ask the backend for a captured decode step over the loaded weights (one rank only:
        the captured step has no all-reduce; LLaMA's structure, with Qwen2's q/k/v bias and
        Qwen3's q/k norms). True when it gave one."""
        if self.tp.enabled:
            return False
        blockers = fast_path_blockers(self.cfg)
        if type(self.decoder_layers[0]) is not DecoderLayer:
            blockers.append(f"layer {type(self.decoder_layers[0]).__qualname__}")
        if blockers:
            log.info("captured_step_stepped_aside", model=self.cfg.checkpoint_architecture or self.cfg.architecture,
                     because=blockers)
            return False
        cfg = self.decoder_layers[0].cfg
        layers = tuple(DecodeLayer(lyr.input_norm, lyr.qkv, lyr.o, lyr.post_norm, lyr.mlp.gate_up, lyr.mlp.down,
                                   qkv_bias=lyr.qkv_bias, q_norm=lyr.q_norm if cfg.qk_norm else None,
                                   k_norm=lyr.k_norm if cfg.qk_norm else None)
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
        if self.cfg.embedding_multiplier != 1.0:
            # Gemma scales in the model dtype (its normaliser is a tensor of the embedding's dtype)
            h = (h.to(self.dtype) * torch.tensor(self.cfg.embedding_multiplier, dtype=self.dtype)).float()
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        local = None
        if self.cfg.rope_local_theta is not None:
            local = self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.decoder_layers, kv_caches, strict=True):
            c, s = local if (local is not None and layer.local_rope) else (cos, sin)
            h, delta = layer(h, delta, c, s, k_cache, v_cache, meta, self.backend)
        assert delta is not None  # a model has at least one layer
        return h + delta

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Float32 ``[T, vocab]``; under tensor parallelism on rank 0 only (``None`` elsewhere)."""
        x = self.backend.rms_norm(h, self.norm, self.cfg.rms_norm_eps).to(self.dtype)
        logits = self.tp.gather_logits(self.lm_logits(x), self.cfg)
        cap = self.cfg.final_logit_softcap
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        return apply_float32(self.lm_head, x.to(self.dtype))

    def linear_layers(self) -> list[dict[str, LinearWeight]]:
        return [{"qkv": layer.qkv, "o": layer.o, **layer.mlp.linears()} for layer in self.decoder_layers]

    def linear_sites(self) -> list[LinearSite]:
        """qkv and o of every layer, gate_up and down where the MLP is the gated one (an MoE's
        experts are not offered), named as in the checkpoint."""
        cfg, names = self.cfg, self.names
        d, ffn = cfg.hidden_size, cfg.intermediate_size
        qkv_rows = (cfg.q_size, cfg.kv_size, cfg.kv_size) if len(names["qkv"]) == 3 else (cfg.q_size + 2 * cfg.kv_size,)
        sites = []
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            sites += [LinearSite(i, "qkv", tuple(p + n for n in names["qkv"]), qkv_rows, d, "qkv"),
                      LinearSite(i, "o", tuple(p + n for n in names["o"]), (d,), cfg.q_size, "o")]
            if isinstance(layer.mlp, GatedMLP):
                gu_rows = (ffn, ffn) if len(names["gate_up"]) == 2 else (2 * ffn,)
                sites += [LinearSite(i, "gate_up", tuple(p + n for n in names["gate_up"]), gu_rows, d, "gate_up"),
                          LinearSite(i, "down", tuple(p + n for n in names["down"]), (d,), ffn, "down")]
        return sites

    def set_linear(self, layer: int, slot: str, weight: LinearWeight) -> None:
        if slot not in ("qkv", "o", "gate_up", "down"):
            raise KeyError(f"layer {layer} has no matmul {slot!r}")
        owner = self.decoder_layers[layer]
        setattr(owner.mlp if slot in ("gate_up", "down") else owner, slot, weight)

    # ---- loading --------------------------------------------------------------------------------
    @torch.inference_mode()
    def load_weights(self, weights: dict[str, Any], quantizer: Quantizer, quant_config: dict | None = None) -> None:
        """Take every checkpoint tensor: norms and the embedding are copied in (dequantised
        if need be); each matmul slot goes through ``quantizer`` (which fuses q/k/v and
        gate/up) and is packed by the backend. A missing, misshapen or unused tensor fails
        with a sentence naming it. The model must already be on its device."""
        cfg, names = self.cfg, self.names
        tensors = CheckpointTensors(weights, quant_config)
        tp = self.tp
        embed_raw = tensors.take("model.embed_tokens.weight")
        embed = _checked(dense_tensor(embed_raw), (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")
        self.embed.copy_(embed[tp.vocab(cfg).start:tp.vocab(cfg).stop])
        self._norm(self.norm, tensors, "model.norm.weight")
        head_slot = LinearSlot("lm_head", ("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head",),
                               (cfg.vocab_size,), cfg.hidden_size)
        if cfg.tie_word_embeddings:
            tensors.discard("lm_head.weight")
            self.lm_head = self._pack(quantizer, head_slot, CheckpointTensors({"model.embed_tokens.weight": embed_raw},
                                                                              tensors.quant_config), "lm_head")
        else:
            self.lm_head = self._pack(quantizer, head_slot, tensors, "lm_head")
        q, kv, d = cfg.q_size, cfg.kv_size, cfg.hidden_size
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            for attr in layer.norms():
                self._norm(getattr(layer, attr), tensors, p + names[attr] + ".weight")
            qkv_rows = (q, kv, kv) if len(names["qkv"]) == 3 else (q + 2 * kv,)
            layer.qkv = self._pack(quantizer, LinearSlot(p + "qkv", tuple(p + n for n in names["qkv"]), qkv_rows, d),
                                   tensors, "qkv")
            layer.o = self._pack(quantizer, LinearSlot(p + "o", tuple(p + n for n in names["o"]), (d,), q), tensors, "o")
            if cfg.attention_bias:
                bias = torch.cat([_checked(dense_tensor(tensors.take(f"{p}{n}.bias")), (rows,), f"{p}{n}.bias")
                                  for n, rows in zip(names["qkv"], qkv_rows, strict=True)])
                layer.qkv_bias = self.tp.shard_bias("qkv", bias, cfg).to(self.dtype).to(self.embed.device)
            self._load_mlp(layer, i, p, tensors, quantizer)
        leftovers = [n for n in tensors.names() if "rotary_emb" not in n]
        if leftovers:
            raise ValueError(f"checkpoint has tensors this model does not use: {leftovers[:5]}")

    def _load_mlp(self, layer: DecoderLayer, index: int, prefix: str, tensors: CheckpointTensors,
                  quantizer: Quantizer) -> None:
        """The layer's MLP weights: a gated MLP's two slots, or what its module loads itself."""
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            for attr, slot in mlp.slots(self.cfg, prefix, self.names):
                setattr(mlp, attr, self._pack(quantizer, slot, tensors, attr))
        else:  # an MoE block: (tensors, prefix, pack(slot, tensors, kind) -> LinearWeight, norm copy)
            mlp.load(tensors, prefix, lambda slot, t, kind: self._pack(quantizer, slot, t, kind))

    def _norm(self, param: torch.Tensor, tensors: CheckpointTensors, name: str) -> None:
        """A norm weight, plus the family's offset (Gemma's ``1 + weight``), in float32."""
        param.copy_(_checked(dense_tensor(tensors.take(name)), param.shape, name).float() + self.cfg.norm_offset)

    def _pack(self, quantizer: Quantizer, slot: LinearSlot, tensors: CheckpointTensors, kind: str) -> LinearWeight:
        """The quantizer makes the slot's whole weight; this rank keeps its share (rows or
        columns, core/parallel.py) before the backend packs it."""
        spec = quantizer.weight_spec(slot, tensors)
        if tuple(spec.shape) != slot.shape:
            raise ValueError(f"quantizer gave {slot.name} a {tuple(spec.shape)} weight, the model needs {slot.shape}")
        if kind != "expert":  # an MoE expert is whole on the rank that holds it (TensorParallel.experts)
            spec = self.tp.shard(kind, slot.name, spec, self.cfg, type(quantizer).__name__)
        return self.backend.pack_linear(spec_to(spec, self.embed.device), self.dtype)

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step must read: each matmul weight and norm once (one
        layout), plus the output head; the embedding lookup reads a single row. An MoE layer
        counts its ``top_k`` experts (what one token reads)."""
        total = self.lm_head.nbytes() + self.norm.numel() * 4
        for layer in self.decoder_layers:
            mlp = layer.mlp
            mlp_bytes = mlp.bytes_per_token() if hasattr(mlp, "bytes_per_token") else \
                sum(w.nbytes() for w in mlp.linears().values())
            total += layer.qkv.nbytes() + layer.o.nbytes() + mlp_bytes
            total += sum(p.numel() * 4 for name, p in layer.named_parameters(recurse=False))
        return total


def _checked(t: torch.Tensor, shape, name: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model needs {tuple(shape)}")
    return t

