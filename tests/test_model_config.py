"""What a Hugging Face config.json may ask that the LLaMA model cannot do is refused at load."""

from __future__ import annotations

import pytest

from tokenloom.core.models.config import ModelConfig

BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def test_a_mistral_sliding_window_is_refused_naming_it():
    cfg = {**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 16}
    with pytest.raises(ValueError, match="sliding_window 16 in MistralForCausalLM"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("extra", [{"model_type": "mistral", "sliding_window": None},
                                   {"model_type": "mistral", "sliding_window": 4096},  # wider than the context
                                   {"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}])
def test_a_window_that_never_applies_loads(extra):
    assert ModelConfig.from_hf({**BASE, **extra}).max_position_embeddings == 1024
