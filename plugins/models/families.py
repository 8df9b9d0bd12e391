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
from tokenloom.plugins.models.rope import inv_freq

#: GGUF per-layer tensor names -> HF names (llama.cpp's gguf-py ``tensor_mapping``): LLaMA's
#: (Mistral's, Qwen2's with its q/k/v ``.bias``); a family maps its own (``Family.gguf_layer_names``)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # the norm before the MLP
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: per-head q/k norms (Qwen3, Gemma 3)
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: Gemma 2/3: ``ffn_norm`` is the norm before the MLP (HF ``pre_feedforward_layernorm``); the
#: sandwich norms after attention and after the MLP have names of their own
GGUF_GEMMA_NAMES = {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
#: Phi-3: q/k/v in one tensor and ``ffn_up`` holding gate and up, kept fused (the HF checkpoint's names)
GGUF_PHI3_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                   "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                   "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: tables the converter writes as tensors: not weights; core/loader/gguf_file.py's read_metadata puts
#: their values in the metadata as ``tensor.<name>``, where gguf_rope reads them
GGUF_DROPPED = ("rope_freqs", "rope_factors_long", "rope_factors_short")
#: the original context llama3 parameters are solved for from a ``rope_freqs`` table (Llama 3.x's own)
LLAMA3_ORIGINAL_CONTEXT = 8192


def gguf_window(g: Callable[..., Any], fields: dict[str, Any], *, default: int | None = None,
                pattern: int | None = None, bounded: bool = True) -> dict[str, Any]:
    """``{arch}.attention.sliding_window`` (``default`` where the file has none) and the layers it
    applies to: ``{arch}.attention.sliding_window_pattern`` (a flag per layer, or n: every n-th
    layer global, as llama.cpp's ``set_swa_pattern`` reads it), else ``pattern``, else every
    layer. ``bounded``: only a window narrower than the context (as the HF readers)."""
    window = g("attention.sliding_window", default)
    n = fields["num_layers"]
    if not window or (bounded and window >= fields["max_position_embeddings"]):
        return {}
    spec = g("attention.sliding_window_pattern", pattern)
    types: tuple[str, ...] | None = None
    if isinstance(spec, (list, tuple)):
        if len(spec) < n:
            raise ConfigError(f"GGUF attention.sliding_window_pattern has {len(spec)} flags for {n} layers")
        types = tuple("sliding" if flag else "full" for flag in spec[:n])
    elif spec is not None:
        p = int(spec)
        types = tuple("sliding" if p == 0 or i % p < p - 1 else "full" for i in range(n))
    return {"sliding_window": int(window), "layer_types": types}


def gguf_rope(meta: dict, arch: str, g: Callable[..., Any], fields: dict[str, Any]) -> RopeScaling:
    """The rotary scaling of a GGUF file: ``{arch}.rope.scaling.*`` (linear, yarn) or the tables
    llama.cpp's converter writes as tensors instead of keys (read into the metadata as
    ``tensor.<name>``): Llama 3's ``rope_freqs`` (a divisor per frequency) and Phi-3's longrope
    ``rope_factors_long`` / ``rope_factors_short``."""
    kind = g("rope.scaling.type") or "none"
    factor = float(g("rope.scaling.factor") or 0.0)  # llama.cpp: absent or 0 is no scaling
    ctx = int(fields["max_position_embeddings"])
    original = g("rope.scaling.original_context_length")
    long_f, short_f = meta.get("tensor.rope_factors_long"), meta.get("tensor.rope_factors_short")
    if long_f is not None or short_f is not None or kind == "longrope":
        if long_f is None or short_f is None:
            raise ConfigError(f"GGUF {arch}: longrope needs both the rope_factors_long and rope_factors_short tensors")
        original = int(original or ctx)
        attention = g("rope.scaling.attn_factor")
        return RopeScaling(kind="longrope", factor=ctx / original, original_max_position_embeddings=original,
                           attention_factor=None if attention is None else float(attention),
                           short_factor=tuple(float(x) for x in short_f), long_factor=tuple(float(x) for x in long_f))
    freqs = meta.get("tensor.rope_freqs")
    if freqs is not None:
        if kind not in ("none", "linear") or factor not in (0.0, 1.0):
            raise ConfigError(f"GGUF {arch}: a rope_freqs tensor with rope.scaling.type {kind!r} is not implemented")
        return rope_freqs_scaling(freqs, fields["rope_theta"], int(fields["head_dim"] * fields["partial_rotary_factor"]),
                                  ctx)
    if kind == "yarn":
        original = int(original or ctx)
        attention = g("rope.scaling.yarn_attn_factor")
        return RopeScaling(kind="yarn", factor=factor or ctx / original, original_max_position_embeddings=original,
                           beta_fast=float(g("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(g("rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=None if attention is None else float(attention))
    if kind in ("none", "linear"):  # llama.cpp reads a missing type as linear
        return RopeScaling(kind="linear", factor=factor) if factor not in (0.0, 1.0) else RopeScaling()
    raise ConfigError(f"GGUF {arch}: rope.scaling.type {kind!r} is not implemented")


def rope_freqs_scaling(freqs: Any, theta: float, dim: int, ctx: int) -> RopeScaling:
    """Llama 3's rotary scaling from llama.cpp's ``rope_freqs`` tensor: the converter writes each
    frequency's divisor (1 for the fast ones, ``factor`` for the slow ones, a ramp between)
    instead of the parameters. Here: the llama3 parameters that give those divisors (``factor``
    the largest; low / high_freq_factor solved for an original context of 8192, which gives
    back Llama 3.1's 1 and 4), checked against the table to 1e-5; a table no llama3 setting
    gives is used as it is (longrope with it as both factor sets, magnitude 1)."""
    r = [float(v) for v in freqs]
    if len(r) != dim // 2:
        raise ConfigError(f"GGUF rope_freqs has {len(r)} values; a rotary dimension of {dim} needs {dim // 2}")
    as_is = RopeScaling(kind="longrope", original_max_position_embeddings=ctx, attention_factor=1.0,
                        short_factor=tuple(r), long_factor=tuple(r))
    f, tol = max(r), 1e-5
    if all(abs(v - 1.0) <= tol for v in r):
        return RopeScaling()
    if min(r) < 1.0 - tol:
        return as_is
    x = [theta ** (-2 * i / dim) / (2 * math.pi) for i in range(dim // 2)]  # 1 / wavelength
    low = [xi for xi, v in zip(x, r, strict=True) if abs(v - f) <= tol * f]
    high = [xi for xi, v in zip(x, r, strict=True) if abs(v - 1.0) <= tol]
    # the ramp between: s = 0 at the slow end (divisor f), 1 at the fast end (divisor 1), linear in 1 / wavelength
    ramp = sorted((xi, (1 / v - 1 / f) / (1 - 1 / f)) for xi, v in zip(x, r, strict=True)
                  if abs(v - f) > tol * f and abs(v - 1.0) > tol)
    lo, hi = max(low, default=0.0), min(high, default=math.inf)
    if len(ramp) >= 2:  # the line through the ramp's ends
        (x0, s0), (x1, s1) = ramp[0], ramp[-1]
        slope = (s1 - s0) / (x1 - x0)
    elif ramp:  # one point: a line through it, steep enough that the slow and fast ones fall outside
        ((x0, s0),) = ramp
        slope = 2 * max(s0 / (x0 - lo) if x0 > lo else math.inf, (1 - s0) / (hi - x0) if hi < math.inf else 0.0)
    else:  # no ramp: 0 and 1 a third and two thirds of the way from the slowest fast one to the fastest slow one
        a, b = (lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3) if hi < math.inf else (1.5 * lo, 3 * lo)
        x0, s0, slope = a, 0.0, 1 / (b - a) if b > a else math.inf
    if not 0 < slope < math.inf:
        return as_is
    span = LLAMA3_ORIGINAL_CONTEXT / slope  # high_freq_factor - low_freq_factor
    low_ff = -(s0 - slope * x0) * span
    if low_ff <= 0:
        return as_is
    fit = RopeScaling(kind="llama3", factor=f, low_freq_factor=low_ff, high_freq_factor=low_ff + span,
                      original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT)
    probe = ModelConfig(vocab_size=1, hidden_size=dim, intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=dim, max_position_embeddings=ctx)
    got, _ = inv_freq(probe, theta, fit, ctx)
    want = [theta ** (-2 * i / dim) / v for i, v in enumerate(r)]
    if max(abs(gv - w) / w for gv, w in zip(got.tolist(), want, strict=True)) > tol:
        return as_is
    return fit


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
        arch = meta.get("general.architecture", (self.gguf_architectures or (self.name,))[0])

        def g(key: str, default: Any = None) -> Any:  # Any: GGUF metadata values are whatever the file holds
            return meta.get(f"{arch}.{key}", default)

        if g("expert_count") and not self.gguf_experts:
            raise ConfigError(f"GGUF {arch}: {arch}.expert_count={g('expert_count')}: mixture-of-experts GGUF "
                              f"files are not read (load the Hugging Face checkpoint)")
        heads = g("attention.head_count")
        hidden = g("embedding_length")
        head_dim = g("attention.key_length") or hidden // heads  # llama.cpp's defaults
        rotary = g("rope.dimension_count") or head_dim
        if rotary > head_dim:
            raise ConfigError(f"GGUF {arch}: rope.dimension_count {rotary} is wider than a head ({head_dim})")
        vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])  # the loader corrects it from token_embd
        fields: dict[str, Any] = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
            num_layers=g("block_count"), num_heads=heads, num_kv_heads=g("attention.head_count_kv", heads),
            head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=g("context_length", 2048),
            tie_word_embeddings=False,  # the loader sets it from the tensor list
            architecture=self.name, checkpoint_architecture=f"GGUF {arch}")
        fields["rope_scaling"] = gguf_rope(meta, arch, g, fields)
        fields.update(self.gguf_fields(meta, arch, g, fields))
        cfg = ModelConfig(**fields)
        self.check(cfg, f"GGUF {arch}")
        return cfg

    #: GGUF per-layer tensor names (``blk.N.<name>``) -> HF names under ``model.layers.N.``; a
    #: 3-D tensor (stacked experts) maps to a name with ``{expert}``, which the loader fills per expert
    gguf_layer_names: dict[str, str] = GGUF_LAYER_NAMES
    #: whether the family reads ``{arch}.expert_count`` (mixture-of-experts families)
    gguf_experts = False

    def gguf_fields(self, meta: dict, arch: str, g: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Family keys beyond the common ones; LLaMA's: a sliding window where the file has one
        (on every layer; llama.cpp's converter writes none for LLaMA or Mistral, llama.cpp reads none)."""
        return gguf_window(g, fields)

    def gguf_tensor_name(self, name: str, cfg: ModelConfig) -> str | None:
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3:
            if parts[2] not in self.gguf_layer_names:
                raise ValueError(f"GGUF tensor {name!r} is not one this engine knows for {cfg.checkpoint_architecture}")
            return f"model.layers.{parts[1]}.{self.gguf_layer_names[parts[2]]}.{suffix}"
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
    """LLaMA 1/2/3/3.1/3.2 (and SmolLM, TinyLlama, ...): the base decoder; llama3 rope scaling.

    A ``llama`` GGUF with ``llama.expert_count`` is Mixtral (llama.cpp's converter writes it
    so): its config comes from the Mixtral family, ``architecture="mixtral"``, which the GGUF
    loader then builds and names the tensors with."""

    def config_from_gguf(self, meta: dict) -> ModelConfig:
        arch = meta.get("general.architecture", "llama")
        if meta.get(f"{arch}.expert_count"):
            from tokenloom.plugins.models.moe import Mixtral  # moe.py imports this module

            return Mixtral().config_from_gguf(meta)
        return super().config_from_gguf(meta)


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
        return {**super().gguf_fields(meta, arch, g, fields), "attention_bias": True}

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

    gguf_layer_names = {**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES}

    def gguf_fields(self, meta, arch, g, fields):
        return {**super().gguf_fields(meta, arch, g, fields), "qk_norm": True}

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

    gguf_layer_names = GGUF_GEMMA_NAMES
    gguf_default_window: int | None = 4096  # llama.cpp's Gemma 2 window where the file gives none
    gguf_window_pattern = 2  # llama.cpp: every 2nd layer global, the first local
    gguf_27b_layers = 46  # llama.cpp: the 27B scales queries by hidden / heads, the others by head_dim

    def gguf_fields(self, meta, arch, g, fields):
        """The converter stores the norms as 1 + w (no offset here). What the file does not carry
        follows llama.cpp: the query scale (the 27B's by its layer count) and which layers are local."""
        hidden, heads = fields["hidden_size"], fields["num_heads"]
        scalar = hidden // heads if fields["num_layers"] == self.gguf_27b_layers else fields["head_dim"]
        out: dict[str, Any] = dict(
            hidden_act="gelu_tanh", embedding_multiplier=math.sqrt(hidden), norm_offset=0.0, sandwich_norms=True,
            query_pre_attn_scalar=float(scalar),
            attn_logit_softcap=float(g("attn_logit_softcapping") or 0.0) or None,
            final_logit_softcap=float(g("final_logit_softcapping") or 0.0) or None)
        out.update(gguf_window(g, fields, default=self.gguf_default_window, pattern=self.gguf_window_pattern,
                               bounded=False))
        local = g("rope.freq_base_swa")
        if out.get("sliding_window") and local is not None and float(local) != fields["rope_theta"]:
            out["rope_local_theta"] = float(local)
        return out

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

    gguf_layer_names = {**GGUF_GEMMA_NAMES, **GGUF_QK_NORM_NAMES}
    gguf_default_window = None  # llama.cpp: no window key, no local layers
    gguf_window_pattern = 6
    gguf_27b_layers = 62

    def gguf_fields(self, meta, arch, g, fields):
        out = {**super().gguf_fields(meta, arch, g, fields), "qk_norm": True}
        if out.get("sliding_window"):  # the local layers' own base (llama.cpp's default 10000)
            out["rope_local_theta"] = float(g("rope.freq_base_swa", 10000.0))
        return out


class Phi3(Family):
    """Phi-3 / Phi-3.5 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint, longrope."""

    name = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    names = {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}
    gguf_layer_names = GGUF_PHI3_NAMES

    def gguf_permuted_qk(self) -> bool:
        return False


BUILTIN_FAMILIES: tuple[type[Family], ...] = (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3)
