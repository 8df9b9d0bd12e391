"""A Hugging Face config.json read by the model plugin that claims it: the family's
switches come out typed, and what a family does not implement is refused naming the key
and the model."""

from __future__ import annotations

import pytest

from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.models.registry import default_registry

BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def test_a_mistral_sliding_window_is_read():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                               "sliding_window": 16})
    assert cfg.architecture == "mistral" and [cfg.window(i) for i in range(2)] == [16, 16]


@pytest.mark.parametrize("extra", [{"model_type": "mistral", "sliding_window": None},
                                   {"model_type": "mistral", "sliding_window": 4096},  # wider than the context
                                   {"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}])
def test_a_window_that_never_applies_is_not_set(extra):
    arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[extra["model_type"]]
    cfg = ModelConfig.from_hf({**BASE, **extra, "architectures": [arch]})
    assert cfg.sliding_window is None and cfg.window(0) is None


def test_qwen2_windows_only_past_max_window_layers():
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                               "use_sliding_window": True, "max_window_layers": 1})
    assert [cfg.window(i) for i in range(2)] == [None, 16] and cfg.attention_bias


def test_gemma3_layer_pattern_and_two_rope_bases():
    cfg = ModelConfig.from_hf({**BASE, "num_hidden_layers": 6, "architectures": ["Gemma3ForCausalLM"],
                               "model_type": "gemma3_text", "sliding_window": 32, "sliding_window_pattern": 3,
                               "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 16})
    assert [cfg.window(i) for i in range(6)] == [32, 32, None, 32, 32, None]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0 and cfg.hidden_act == "gelu_tanh"
    assert cfg.attention_scale == 16 ** -0.5


@pytest.mark.parametrize(("extra", "named"), [
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling type 'mrope'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
])
def test_what_a_family_does_not_implement_is_refused_naming_it(extra, named):
    with pytest.raises(ConfigError, match=f"LlamaForCausalLM.*{named}"):
        ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"], **extra})


def test_an_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError, match="unsupported architecture 'FalconForCausalLM'.*Qwen3ForCausalLM"):
        ModelConfig.from_hf({**BASE, "architectures": ["FalconForCausalLM"]})


def test_every_family_is_registered_once_per_checkpoint_name():
    registry = default_registry()
    for name in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"):
        arch = registry.get(name)
        assert all(registry.for_hf({"architectures": [a]}) is arch for a in arch.hf_architectures)
