"""The built-in model families: each a :class:`Family` (core/interfaces.py's
``ModelArchitecture``) that reads its checkpoints' config keys into a ``ModelConfig`` and
builds the shared decoder (plugins/models/decoder.py) with its switches on.

Config keys are read in both spellings transformers has written: ``rope_theta`` +
``rope_scaling`` (what hub checkpoints carry) and ``rope_parameters`` (transformers 5).
A key whose value a family does not implement is refused naming it and the model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig, RopeScaling
from tokenloom.core.parallel import TensorParallel
from tokenloom.plugins.models.decoder import DecoderModel

#: GGUF per-layer tensor names -> HF names (llama.cpp's gguf-py ``tensor_mapping``, the subset
#: the families below use)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: tensors the converter writes that the engine recomputes
GGUF_DROPPED = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def rope_of(raw: dict, model: str, key: str | None = None) -> tuple[float, RopeScaling]:
    """``(theta, scaling)`` from either spelling; ``key`` picks one layer type's entry of a
    per-layer-type ``rope_parameters`` (Gemma 3)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and key is not None and key in params:
        params = params[key]
    scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
    theta = raw.get("rope_theta", (params or {}).get("rope_theta", scaling.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind == "su":  # Phi-3's early name for longrope
        kind = "longrope"
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn", "longrope"):
        raise ConfigError(f"{model}: rope_scaling type {kind!r} is not implemented")
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kw: dict[str, Any] = {k: v for k, v in scaling.items() if k in fields and v is not None}
    for k in ("short_factor", "long_factor"):
        if k in kw:
            kw[k] = tuple(float(x) for x in kw[k])
    trained = raw.get("max_position_embeddings", 2048)
    # the pre-scaling context, as transformers' standardize_rope_params fills it: Phi-3 keeps it
    # next to rope_scaling (and that one wins), the others inside it; absent: max_position_embeddings
    if kind == "longrope" and raw.get("original_max_position_embeddings"):
        kw["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if kind in ("llama3", "yarn", "longrope"):
        kw["original_max_position_embeddings"] = int(kw.get("original_max_position_embeddings") or trained)
        if kind != "llama3" and "factor" not in kw:  # transformers: the ratio of the two contexts
            kw["factor"] = trained / kw["original_max_position_embeddings"]
    return float(theta), RopeScaling(kind=kind, **kw)


def refuse(raw: dict, model: str, **unsupported: Callable[[Any], bool]) -> None:
    """Each key whose value makes ``unsupported[key](value)`` true fails naming it."""
    for key, bad in unsupported.items():
        if key in raw and bad(raw[key]):
            raise ConfigError(f"{model}: config key {key}={raw[key]!r} is not implemented by this engine")


def truthy(v: Any) -> bool:
    return bool(v)


def base_fields(raw: dict, name: str, model: str) -> dict[str, Any]:
    """The fields every family reads alike."""
    heads = raw["num_attention_heads"]
    theta, scaling = rope_of(raw, model)
    partial = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    return dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=float(partial or 1.0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=name, checkpoint_architecture=model,
    )


def layer_types_of(raw: dict, num_layers: int) -> tuple[str, ...] | None:
    """transformers' ``layer_types`` (full_attention / sliding_attention) as full / sliding."""
    types = raw.get("layer_types")
    if not types:
        return None
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types[:num_layers])


class Family:
    """A model family: the keys it reads, the switches it turns on, its checkpoint names."""

    name = "llama"
    hf_architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    hf_model_types: tuple[str, ...] = ("llama",)
    gguf_architectures: tuple[str, ...] = ("llama",)
    names: dict[str, Any] = {}  # checkpoint names that differ from LLaMA's (decoder.LLAMA_NAMES)

    def config_from_hf(self, raw: dict) -> ModelConfig:
        model = (raw.get("architectures") or [self.hf_architectures[0]])[0]
        cfg = ModelConfig(**self.hf_fields(raw, model))
        self.check(cfg, model)
        return cfg

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        refuse(raw, model, attention_bias=truthy, mlp_bias=truthy)
        fields = base_fields(raw, self.name, model)
        self.window_fields(raw, model, fields)
        return fields

    def window_fields(self, raw: dict, model: str, fields: dict[str, Any]) -> None:
        """A sliding window only where it can apply (narrower than the context)."""
        window = raw.get("sliding_window")
        if window and raw.get("use_sliding_window", True) and window < fields["max_position_embeddings"]:
            types = layer_types_of(raw, fields["num_layers"])
            if types is None and "max_window_layers" in raw:  # Qwen2's older spelling
                types = tuple("sliding" if i >= raw["max_window_layers"] else "full"
                              for i in range(fields["num_layers"]))
            fields.update(sliding_window=int(window), layer_types=types)

    def check(self, cfg: ModelConfig, model: str) -> None:
        """What the decoder cannot take at all, named (backend limits come at build)."""

    def config_from_gguf(self, meta: dict) -> ModelConfig:
        arch = meta.get("general.architecture", self.gguf_architectures[0])

        def g(key: str, default: Any = None) -> Any:  # Any: GGUF metadata values are whatever the file holds
            return meta.get(f"{arch}.{key}", default)

        heads = g("attention.head_count")
        hidden = g("embedding_length")
        vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        fields: dict[str, Any] = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
            num_layers=g("block_count"), num_heads=heads, num_kv_heads=g("attention.head_count_kv", heads),
            head_dim=g("attention.key_length") or g("rope.dimension_count") or hidden // heads,
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=g("context_length", 2048),
            tie_word_embeddings=False,  # the loader sets it from the tensor list
            architecture=self.name, checkpoint_architecture=f"GGUF {arch}")
        scaling = g("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ConfigError(f"GGUF {arch}: rope.scaling.type {scaling!r} is not implemented")
            fields["rope_scaling"] = RopeScaling(kind="linear", factor=float(g("rope.scaling.factor", 1.0)))
        fields.update(self.gguf_fields(meta, arch, g, fields))
        cfg = ModelConfig(**fields)
        self.check(cfg, f"GGUF {arch}")
        return cfg

    def gguf_fields(self, meta: dict, arch: str, g: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Family keys beyond the common ones (none for LLaMA)."""
        if g("attention.sliding_window"):
            raise ConfigError(f"GGUF {arch}: attention.sliding_window is not read for this family yet")
        return {}

    def gguf_tensor_name(self, name: str, cfg: ModelConfig) -> str | None:
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3:
            if parts[2] not in GGUF_LAYER_NAMES:
                raise ValueError(f"GGUF tensor {name!r} is not one this engine knows for {cfg.checkpoint_architecture}")
            return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
        if base in GGUF_DROPPED:
            return None
        if base not in GGUF_GLOBAL_NAMES:
            raise ValueError(f"GGUF tensor {name!r} is not one this engine knows for {cfg.checkpoint_architecture}")
        return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"

    def gguf_permuted_qk(self) -> bool:
        return True

    def build(self, cfg: ModelConfig, dtype: torch.dtype, backend, max_len: int, tp: TensorParallel) -> DecoderModel:
        return DecoderModel(cfg, dtype, backend, max_len, tp, names=self.names)


class Llama(Family):
    """LLaMA 1/2/3/3.1/3.2 (and SmolLM, TinyLlama, ...): the base decoder; llama3 rope scaling."""


class Mistral(Family):
    """Mistral: LLaMA with a sliding window on every layer (v0.1); later versions have none."""

    name = "mistral"
    hf_architectures = ("MistralForCausalLM",)
    hf_model_types = ("mistral",)
    gguf_architectures = ()  # llama.cpp's converter writes Mistral as `llama`


class Qwen2(Family):
    """Qwen2 / Qwen2.5: q/k/v biases.

    A window on the layers past ``max_window_layers`` where ``use_sliding_window`` is set."""

    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        fields = base_fields(raw, self.name, model)
        self.window_fields(raw, model, fields)
        fields["attention_bias"] = True
        return fields

    def gguf_fields(self, meta, arch, g, fields):
        return {"attention_bias": True}

    def gguf_permuted_qk(self) -> bool:
        return False


class Qwen3(Family):
    """Qwen3: per-head RMSNorm on q and k, no biases (``attention_bias`` read)."""

    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        fields = base_fields(raw, self.name, model)
        self.window_fields(raw, model, fields)
        return {**fields, "qk_norm": True, "attention_bias": bool(raw.get("attention_bias", False))}

    def gguf_fields(self, meta, arch, g, fields):
        return {"qk_norm": True}

    def gguf_permuted_qk(self) -> bool:
        return False


class Gemma2(Family):
    """Gemma 2: GeGLU, sandwich (1 + w) norms, soft-caps, local and global layers alternating.

    The embedding is scaled by sqrt(hidden); norms come before and after attention and the
    MLP; scores and logits are soft-capped."""

    name = "gemma2"
    hf_architectures = ("Gemma2ForCausalLM",)
    hf_model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    names = {"post_norm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm"}

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        refuse(raw, model, attention_bias=truthy)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"{model}: hidden_activation {act!r} is not implemented (gelu_pytorch_tanh)")
        fields = base_fields(raw, self.name, model)
        fields.update(
            hidden_act="gelu_tanh", embedding_multiplier=math.sqrt(raw["hidden_size"]), norm_offset=1.0,
            sandwich_norms=True, query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or fields["head_dim"]),
            attn_logit_softcap=raw.get("attn_logit_softcapping"), final_logit_softcap=raw.get("final_logit_softcapping"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
        window = raw.get("sliding_window")
        if window:
            types = layer_types_of(raw, fields["num_layers"]) or \
                tuple("sliding" if i % 2 == 0 else "full" for i in range(fields["num_layers"]))
            fields.update(sliding_window=int(window), layer_types=types)
        return fields

    def gguf_permuted_qk(self) -> bool:
        return False


class Gemma3(Gemma2):
    """Gemma 3 (text): Gemma 2 with q/k norms instead of soft-caps, 5 local layers per global.

    The local (sliding-window) layers turn RoPE at a base of their own."""

    name = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM",)
    hf_model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)

    def hf_fields(self, raw: dict, model: str) -> dict[str, Any]:
        fields = super().hf_fields(raw, model)
        n = fields["num_layers"]
        if fields.get("sliding_window") and raw.get("layer_types") is None:
            pattern = raw.get("sliding_window_pattern", 6)
            fields["layer_types"] = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
        theta, scaling = rope_of(raw, model, "full_attention")
        local = raw.get("rope_local_base_freq")
        if local is None:
            local, local_scaling = rope_of(raw, model, "sliding_attention")
            if local_scaling.kind != "default":
                raise ConfigError(f"{model}: rope scaling on the sliding layers is not implemented")
        fields.update(rope_theta=theta, rope_scaling=scaling, rope_local_theta=float(local), qk_norm=True)
        return fields


class Phi3(Family):
    """Phi-3 / Phi-3.5 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint, longrope."""

    name = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    names = {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}

    def gguf_permuted_qk(self) -> bool:
        return False


BUILTIN_FAMILIES: tuple[type[Family], ...] = (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3)
