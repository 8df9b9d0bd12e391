"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE): one block for both.

A linear router scores every expert for each token; the softmax (in float32) picks the
``top_k`` best, whose weights are renormalised to sum to 1 where the family does (Mixtral
always, Qwen3-MoE when ``norm_topk_prob``). Each expert is a SwiGLU MLP whose gate/up and
down are ordinary packed matmuls (``LinearWeight``: every quantizer works per expert).

A step groups the (token, expert) pairs by expert: one sort, then each expert that some
token chose runs its two matmuls once over all of its rows, and the weighted outputs are
added into their tokens with ``index_add_`` -- a loop over the active experts, none over
tokens. Under tensor parallelism each rank holds whole experts (a contiguous share of the
indices, ``TensorParallel.experts``) and the router; its output is the partial sum over its
experts, which the layer's all-reduce adds up.

Checkpoint names: hub checkpoints (and transformers' ``save_pretrained``) store each expert
on its own (``block_sparse_moe.experts.E.w1/w3/w2`` for Mixtral, ``mlp.experts.E.
gate_proj/up_proj/down_proj`` for Qwen3-MoE); transformers 5 holds them fused in memory
(``mlp.experts.gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``) and writes that with
``save_pretrained(save_original_format=False)``: both load.

GGUF, as llama.cpp's converter writes it: Mixtral as ``llama`` with ``llama.expert_count``
(the LLaMA family hands such a file to Mixtral; q/k permuted as LLaMA's), Qwen3-MoE as
``qwen3moe`` (every layer sparse, the top-k weights always renormalised: llama.cpp's rules).
The router is ``blk.N.ffn_gate_inp``, the experts 3-D ``ffn_{gate,up,down}_exps`` tensors
that the loader splits into the per-expert checkpoint names. A Qwen2-MoE style shared
expert is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig, MoEConfig
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.weights import CheckpointTensors, LinearSlot, LinearWeight, dense_tensor
from tokenloom.plugins.models.decoder import DecoderModel, GatedMLP
from tokenloom.plugins.models.families import (
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    Family,
    base_fields,
    refuse,
    truthy,
)


@dataclass(frozen=True, slots=True)
class MoENames:
    """A family's checkpoint names of one MoE block, under ``model.layers.N.``."""

    blocks: tuple[str, ...]  # where the block may be: (per-expert checkpoints', transformers 5's fused)
    gate: str  # an expert's gate, up and down projections: experts.E.<gate>.weight
    up: str
    down: str


MIXTRAL_NAMES = MoENames(blocks=("block_sparse_moe", "mlp"), gate="w1", up="w3", down="w2")
QWEN3_MOE_NAMES = MoENames(blocks=("mlp",), gate="gate_proj", up="up_proj", down="down_proj")


class MoEBlock(nn.Module):
    """A router and this rank's experts (SwiGLU each): ``forward(x, backend)`` ->
    float32 ``[T, hidden]``, the partial sum over this rank's experts."""

    router: torch.Tensor  # [num_experts, hidden] in the model dtype (transformers' router dtype)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, names: MoENames,
                 round_weights: bool):
        """``round_weights``: the chosen experts' weights are rounded to the model dtype
        before they scale the outputs (Qwen3-MoE; Mixtral keeps them in float32)."""
        super().__init__()
        assert cfg.moe is not None
        self.moe: MoEConfig = cfg.moe
        self.hidden = cfg.hidden_size
        self.names, self.round_weights = names, round_weights
        self.local = tp.experts(self.moe.num_experts)  # whole experts: this rank's contiguous share
        self.router = nn.Parameter(torch.empty(self.moe.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.gate_up: list[LinearWeight] = []  # this rank's experts, in index order
        self.down: list[LinearWeight] = []

    def forward(self, x: torch.Tensor, backend) -> torch.Tensor:
        moe, T = self.moe, x.shape[0]
        # the router in the model dtype, its softmax in float32 (as transformers does)
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)  # [T, top_k]
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype)
        flat = chosen.flatten()  # pair p = token p // top_k choosing expert flat[p]
        order = torch.argsort(flat, stable=True)  # the pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        lo, hi = self.local.start, self.local.stop
        start = sum(counts[:lo])
        pairs = order[start:start + sum(counts[lo:hi])]  # this rank's experts' pairs
        tokens = pairs // moe.top_k
        rows, scale = x[tokens], weights.flatten()[pairs].float()[:, None]
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        at = 0
        for j, n in enumerate(counts[lo:hi]):
            if not n:
                continue
            gate, up = self.gate_up[j].apply(rows[at:at + n]).chunk(2, dim=-1)
            y = self.down[j].apply(backend.silu_mul(gate, up))
            out.index_add_(0, tokens[at:at + n], y.float() * scale[at:at + n])
            at += n
        return out

    def linears(self) -> dict[str, LinearWeight]:
        """This rank's experts' matmuls, ``experts.E.gate_up`` / ``experts.E.down`` (E the
        model's expert index)."""
        out: dict[str, LinearWeight] = {}
        for e, gate_up, down in zip(self.local, self.gate_up, self.down, strict=True):
            out[f"experts.{e}.gate_up"] = gate_up
            out[f"experts.{e}.down"] = down
        return out

    def bytes_per_token(self) -> int:
        """What one token reads: the router and ``top_k`` experts (this rank's share of them,
        under even routing: ``top_k / num_experts`` of its experts' bytes)."""
        experts = sum(w.nbytes() for w in (*self.gate_up, *self.down))
        return self.router.numel() * self.router.element_size() + experts * self.moe.top_k // self.moe.num_experts

    # ---- loading ----------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, tensors: CheckpointTensors, prefix: str, pack) -> None:
        """The router and this rank's experts from ``model.layers.N.`` (``prefix``), in either
        layout (per expert, or transformers 5's fused 3-D tensors); other ranks' experts are
        dropped unread."""
        block = next((b for b in self.names.blocks if tensors.has(f"{prefix}{b}.gate.weight")), self.names.blocks[0])
        base = f"{prefix}{block}."
        E, H = self.moe.num_experts, self.hidden
        router = dense_tensor(tensors.take(base + "gate.weight"))
        if tuple(router.shape) != (E, H):
            raise ValueError(f"checkpoint tensor {base}gate.weight has shape {tuple(router.shape)}, "
                             f"the model needs {(E, H)}")
        self.router.copy_(router)
        if tensors.has(base + "experts.gate_up_proj"):
            self._load_fused(tensors, base, prefix, pack)
            return
        experts = base + "experts."
        for name in tensors.names():  # other ranks' experts
            index = name[len(experts):].split(".", 1)[0]
            if name.startswith(experts) and index.isdigit() and int(index) not in self.local:
                tensors.discard(name)
        for e in self.local:
            self._pack_expert(tensors, f"{experts}{e}.", f"{prefix}experts.{e}.", pack)

    def _pack_expert(self, tensors: CheckpointTensors, part: str, slot: str, pack) -> None:
        """Expert checkpoint parts under ``part``, slots named ``slot`` + gate_up / down."""
        f, h, n = self.moe.intermediate_size, self.hidden, self.names
        self.gate_up.append(pack(LinearSlot(slot + "gate_up", (part + n.gate, part + n.up), (f, f), h), tensors,
                                 "expert"))
        self.down.append(pack(LinearSlot(slot + "down", (part + n.down,), (h,), f), tensors, "expert"))

    def _load_fused(self, tensors: CheckpointTensors, base: str, prefix: str, pack) -> None:
        """transformers 5's ``experts.gate_up_proj [E, 2F, H]`` (gate rows first) and
        ``experts.down_proj [E, H, F]``: each expert's slices go through ``pack`` as if the
        checkpoint stored them apart."""
        E, f, h, n = self.moe.num_experts, self.moe.intermediate_size, self.hidden, self.names
        fused = {}
        for name, shape in (("gate_up_proj", (E, 2 * f, h)), ("down_proj", (E, h, f))):
            t = dense_tensor(tensors.take(f"{base}experts.{name}"))
            if tuple(t.shape) != shape:
                raise ValueError(f"checkpoint tensor {base}experts.{name} has shape {tuple(t.shape)}, "
                                 f"the model needs {shape}")
            fused[name] = t
        for e in self.local:
            part = f"{base}experts.{e}."
            one = CheckpointTensors({part + n.gate + ".weight": fused["gate_up_proj"][e, :f],
                                     part + n.up + ".weight": fused["gate_up_proj"][e, f:],
                                     part + n.down + ".weight": fused["down_proj"][e]}, tensors.quant_config)
            self._pack_expert(one, part, f"{prefix}experts.{e}.", pack)


def gguf_expert_names(names: MoENames) -> dict[str, str]:
    """llama.cpp's router and stacked-expert tensors -> a family's per-expert names
    (``{expert}``: filled in by the GGUF loader for each expert of the 3-D tensor)."""
    block = names.blocks[0]
    return {"ffn_gate_inp": f"{block}.gate", "ffn_gate_exps": f"{block}.experts.{{expert}}.{names.gate}",
            "ffn_up_exps": f"{block}.experts.{{expert}}.{names.up}",
            "ffn_down_exps": f"{block}.experts.{{expert}}.{names.down}"}


class MoEFamily(Family):
    """A family whose MLPs are mixtures of experts (some layers dense: ``moe.dense_layers``)."""

    moe_names = QWEN3_MOE_NAMES
    round_weights = False  # see MoEBlock
    gguf_experts = True

    def gguf_moe(self, g, fields: dict[str, Any], arch: str) -> MoEConfig | None:
        """llama.cpp's keys: ``expert_count``, ``expert_used_count``, the expert width
        ``expert_feed_forward_length`` (else ``feed_forward_length``); every layer sparse
        and the top-k weights renormalised (how llama.cpp runs both families)."""
        experts = int(g("expert_count", 0) or 0)
        if not experts:
            return None
        used = g("expert_used_count")
        if not used:
            raise ConfigError(f"GGUF {arch}: {arch}.expert_count={experts} without {arch}.expert_used_count")
        gating = g("expert_gating_func")
        if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ConfigError(f"GGUF {arch}: {arch}.expert_gating_func {gating} is not implemented (softmax)")
        return MoEConfig(num_experts=experts, top_k=int(used),
                         intermediate_size=int(g("expert_feed_forward_length") or fields["intermediate_size"]),
                         norm_topk_prob=True,
                         shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0) or 0))

    def check(self, cfg: ModelConfig, model: str) -> None:
        moe = cfg.moe
        if moe is None:
            return
        if cfg.hidden_act != "silu":
            raise ConfigError(f"{model}: hidden_act {cfg.hidden_act!r} is not implemented for experts (silu)")
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ConfigError(f"{model}: num_experts_per_tok {moe.top_k} must be in 1..{moe.num_experts} (the experts)")
        if moe.shared_expert_intermediate_size:
            raise ConfigError(f"{model}: a shared expert (shared_expert_intermediate_size) is not implemented")

    def build(self, cfg: ModelConfig, dtype: torch.dtype, backend, max_len: int, tp: TensorParallel) -> DecoderModel:
        moe = cfg.moe
        if moe is None:  # no experts at all: the dense decoder
            return DecoderModel(cfg, dtype, backend, max_len, tp, names=self.names)
        model = cfg.checkpoint_architecture or cfg.architecture
        if getattr(backend, "batch_invariant", False):
            raise ConfigError(f"{model}: batch_invariant is not implemented for mixture-of-experts models (the "
                              "router is a dense matmul, whose rounding depends on the batch)")
        tp.experts(moe.num_experts)  # more ranks than experts: refused here, naming it

        def mlp(local: ModelConfig, index: int, t: TensorParallel) -> nn.Module:
            if index in moe.dense_layers:
                return GatedMLP(local, t)
            return MoEBlock(local, dtype, t, self.moe_names, self.round_weights)

        return DecoderModel(cfg, dtype, backend, max_len, tp, names=self.names, mlp=mlp)


class Mixtral(MoEFamily):
    """Mixtral 8x7B / 8x22B: Mistral's decoder with 8 SwiGLU experts per layer, top-2."""

    name = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    hf_model_types = ("mixtral",)
    gguf_architectures = ()  # llama.cpp writes Mixtral as `llama`, which the LLaMA family claims (and hands over)
    moe_names = MIXTRAL_NAMES
    gguf_layer_names = {**GGUF_LAYER_NAMES, **gguf_expert_names(MIXTRAL_NAMES)}

    def gguf_fields(self, meta, arch, g, fields):
        return {**super().gguf_fields(meta, arch, g, fields), "hidden_act": "silu",
                "moe": self.gguf_moe(g, fields, arch)}

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        refuse(raw, model, attention_bias=truthy, mlp_bias=truthy)
        fields = base_fields(raw, self.name, model)
        self.window_fields(raw, model, fields)
        fields["hidden_act"] = _act(raw, model)
        fields["moe"] = MoEConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                                  intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
        return fields


class Qwen3Moe(MoEFamily):
    """Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's q/k norms, many small experts, top-k
    weights renormalised when ``norm_topk_prob``; ``mlp_only_layers`` / ``decoder_sparse_step``
    layers dense."""

    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    moe_names = QWEN3_MOE_NAMES
    round_weights = True
    gguf_layer_names = {**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES, **gguf_expert_names(QWEN3_MOE_NAMES)}

    def gguf_fields(self, meta, arch, g, fields):
        return {**super().gguf_fields(meta, arch, g, fields), "qk_norm": True, "hidden_act": "silu",
                "moe": self.gguf_moe(g, fields, arch)}

    def gguf_permuted_qk(self) -> bool:
        return False  # the converter's Qwen3MoeModel (a TextModel) leaves q/k as they are

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        refuse(raw, model, mlp_bias=truthy, shared_expert_intermediate_size=truthy)
        fields = base_fields(raw, self.name, model)
        # transformers' Qwen3-MoE windows every layer when use_sliding_window (no max_window_layers)
        self.window_fields({k: v for k, v in raw.items() if k != "max_window_layers"}, model, fields)
        fields.update(qk_norm=True, attention_bias=bool(raw.get("attention_bias", False)), hidden_act=_act(raw, model))
        # transformers 5 writes num_experts as num_local_experts (its attribute map)
        experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
        if experts:
            step = int(raw.get("decoder_sparse_step", 1) or 1)
            only = set(raw.get("mlp_only_layers") or ())
            dense = tuple(i for i in range(fields["num_layers"]) if i in only or (i + 1) % step)
            fields["moe"] = MoEConfig(num_experts=experts, top_k=int(raw["num_experts_per_tok"]),
                                      intermediate_size=int(raw["moe_intermediate_size"]),
                                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
        return fields


def _act(raw: dict, model: str) -> str:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{model}: hidden_act {act!r} is not implemented for this family (silu)")
    return "silu"


MOE_FAMILIES: tuple[type[Family], ...] = (Mixtral, Qwen3Moe)
