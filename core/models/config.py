"""Architecture hyper-parameters, read from GGUF metadata or an HF config.json.

One :class:`ModelConfig` describes every decoder-only family the model plugins build
(plugins/models/): the fields below are what the families differ in. Each family's
``ModelArchitecture`` (core/interfaces.py) fills them from its own checkpoint keys and
refuses, naming the key and the model, anything it does not implement. Defaults are
LLaMA's, so a config that sets none of them is a LLaMA model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: rotary scaling kinds the RoPE tables implement (plugins/models/rope.py)
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the rotary frequencies are scaled past the trained context (HF ``rope_scaling``).

    ``kind``: default (none), linear, dynamic (NTK, at the longest context the engine
    serves), llama3, yarn or longrope; the other fields are the ones that kind reads (as
    transformers' ``rope_parameters`` names them; ``factor`` for yarn / longrope is filled by
    the config reader with max_position_embeddings / original_max_position_embeddings where
    the checkpoint gives none)."""

    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends out to whole dimensions
    mscale: float | None = None  # yarn (DeepSeek): with mscale_all_dim, the default attention_factor's numerator
    mscale_all_dim: float | None = None  # yarn: ... and its denominator
    attention_factor: float | None = None  # yarn / longrope: the cos/sin magnitude (None: the kind's default)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original context
    long_factor: tuple[float, ...] = ()  # longrope: past it

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope scaling kind {self.kind!r} is not implemented (known: {', '.join(ROPE_KINDS)})")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE): ``num_experts`` SwiGLU experts of
    ``intermediate_size`` columns, ``top_k`` chosen per token by a linear router."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to 1
    shared_expert_intermediate_size: int = 0  # an always-on expert beside them (0: none)
    #: layers whose MLP is dense (``intermediate_size`` of the model) instead: Qwen3-MoE's
    #: ``mlp_only_layers`` / ``decoder_sparse_step``
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    #: the model plugin that builds it (a registered ``register_models`` name)
    architecture: str = "llama"
    #: what the checkpoint calls it (HF ``architectures[0]`` or GGUF ``general.architecture``), for messages
    checkpoint_architecture: str = ""
    # ---- what the families differ in -------------------------------------------------------
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    #: the attention window of "sliding" layers (a query sees its last ``sliding_window`` keys, itself
    #: included); None: every layer attends to the whole context
    sliding_window: int | None = None
    #: per layer "full" or "sliding" (None: all sliding when ``sliding_window`` is set, else all full)
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    embedding_multiplier: float = 1.0  # the embedding row times this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 2/3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_local_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3); None: rope_theta
    partial_rotary_factor: float = 1.0  # the fraction of each head RoPE rotates
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {"full", "sliding"}:
                raise ValueError(f"layer_types must give 'full' or 'sliding' for each of the {self.num_layers} "
                                 f"layers, got {self.layer_types!r}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not implemented (silu, gelu_tanh)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: the whole context)."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """The config of a Hugging Face ``config.json``, through the model plugin that claims
        its architecture (the built-in ones and those of installed plugin packages)."""
        from tokenloom.core.models.registry import default_registry

        return default_registry().for_hf(cfg).config_from_hf(cfg)
