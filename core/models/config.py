"""Architecture hyper-parameters, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass


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
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") not in ("llama", "mistral", "qwen2") and archs[0] not in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
        ):
            raise ValueError(f"unsupported architecture {archs[0]!r} (LLaMA-style models only)")
        for key in ("rope_scaling", "rope_parameters"):
            scaling = cfg.get(key)
            if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
                raise ValueError(f"unsupported {key} {scaling!r} (plain RoPE only)")
        window = cfg.get("sliding_window")
        max_pos = cfg.get("max_position_embeddings", 2048)
        if window and cfg.get("use_sliding_window", True) and window < max_pos:
            # A window layer must read only its last `window` keys; full attention past it
            # would answer, and answer wrongly, so it is refused until windows are built.
            raise ValueError(f"unsupported sliding_window {window} in {archs[0]} (its layers attend to the last "
                             f"{window} tokens only; this engine implements full attention)")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
