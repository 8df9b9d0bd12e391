"""Every rotary scaling kind of plugins/models/rope.py against transformers.

A config is made with transformers' own class (LlamaConfig; Phi3Config for longrope), its
rotary embedding module is run over positions ``0..n-1`` (one sequence of length ``n``) and
its cos/sin compared to ``rope_tables(cfg, n, ...)`` of the ModelConfig the family reads from
the same ``config.json`` dict. transformers computes in float32, the engine in float64, so
tables are compared over positions whose float32 angle still resolves 1e-5 (n <= 256), and
at full-size settings (Llama 3.1, Qwen3's yarn, Phi-3-128k) the inverse frequencies and the
magnitude are compared instead."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402

from tokenloom.core.errors import ConfigError  # noqa: E402
from tokenloom.core.models.config import ModelConfig, RopeScaling  # noqa: E402
from tokenloom.plugins.models.families import Llama, Phi3  # noqa: E402
from tokenloom.plugins.models.rope import inv_freq, rope_tables  # noqa: E402

ATOL = 1e-5
SMALL = dict(vocab_size=300, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # head_dim 32

#: (id, rope_scaling, max_position_embeddings, n = the sequence length / table length)
LLAMA_CASES = [
    ("default", None, 256, 256),
    ("linear", {"rope_type": "linear", "factor": 4.0}, 256, 256),
    # dynamic: the plain table up to max_position_embeddings, then the base of an n-long sequence
    ("dynamic-within", {"rope_type": "dynamic", "factor": 4.0}, 64, 64),
    ("dynamic-short", {"rope_type": "dynamic", "factor": 4.0}, 64, 40),
    ("dynamic-beyond", {"rope_type": "dynamic", "factor": 4.0}, 64, 200),
    # llama3: an original context of 32 puts frequencies in all three bands of head_dim 32
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 256, 256),
    ("llama3-no-original", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     32, 128),  # original: max_position_embeddings
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256, 256),
    # a long original context puts the ramp's ends (dimensions 4.0 and 7.6 here) inside head_dim 32
    ("yarn-betas-untruncated", {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 1024,
                                "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, 3072, 192),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "mscale": 0.707, "mscale_all_dim": 1.0}, 256, 256),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "attention_factor": 0.9}, 256, 256),
    ("yarn-no-original", {"rope_type": "yarn", "factor": 2.0}, 128, 128),  # original: max_position_embeddings
]


def phi3_scaling(rotary_dim: int, **extra) -> dict:
    """Distinct short and long per-frequency divisors (``rotary_dim / 2`` of each)."""
    half = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.03 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)], **extra}


#: (id, partial_rotary_factor, extra rope_scaling keys, n); max_position_embeddings 256, original 64
PHI3_CASES = [
    ("short", 1.0, {}, 64),  # the whole original context: short factors
    ("short-partial", 0.5, {}, 48),
    ("long", 1.0, {}, 256),  # past it: long factors
    ("long-partial", 0.5, {}, 200),
    ("attention-factor", 0.5, {"attention_factor": 1.3}, 256),
]


def hf_llama(scaling: dict | None, max_pos: int, theta: float = 10000.0) -> LlamaConfig:
    """(A copy of ``scaling``: transformers fills rope_theta and the like into the dict it is given.)"""
    return LlamaConfig(**SMALL, max_position_embeddings=max_pos, rope_theta=theta,
                       rope_scaling=dict(scaling) if scaling else None)


def hf_phi3(partial: float, extra: dict) -> Phi3Config:
    rotary_dim = int(32 * partial)
    return Phi3Config(**SMALL, max_position_embeddings=256, original_max_position_embeddings=64,
                      partial_rotary_factor=partial, rope_scaling=phi3_scaling(rotary_dim, **extra))


def hf_tables(rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for one sequence at positions 0..n-1 (a fresh module: dynamic
    and longrope keep state across calls)."""
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    return cos[0], sin[0]


def engine_config(hf_config, family=Llama, architecture: str = "LlamaForCausalLM") -> ModelConfig:
    return family().config_from_hf({**hf_config.to_dict(), "architectures": [architecture]})


def engine_tables(cfg: ModelConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_tables(cfg, n, cfg.rope_theta, cfg.rope_scaling)


def assert_tables(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for name, g, w in zip(("cos", "sin"), got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape, (name, g.shape, w.shape)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def hub_spelling(raw: dict) -> dict:
    """``raw`` (transformers 5's ``rope_parameters``) as hub checkpoints spell it:
    ``rope_theta`` next to a ``rope_scaling`` without it (None for plain RoPE)."""
    raw = dict(raw)
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)  # top level in hub configs (Phi-4-mini)
    raw["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    return raw


# ---- tables against transformers -------------------------------------------------------------

@pytest.mark.parametrize("case", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_llama_kinds_match_transformers(case):
    _, scaling, max_pos, n = case
    config = hf_llama(scaling, max_pos)
    cfg = engine_config(config)
    assert cfg.rope_scaling.kind == (scaling or {}).get("rope_type", "default")
    assert_tables(engine_tables(cfg, n), hf_tables(LlamaRotaryEmbedding(config), n))


@pytest.mark.parametrize("case", PHI3_CASES, ids=[c[0] for c in PHI3_CASES])
def test_longrope_matches_transformers(case):
    _, partial, extra, n = case
    config = hf_phi3(partial, extra)
    cfg = engine_config(config, Phi3, "Phi3ForCausalLM")
    assert cfg.rope_scaling.kind == "longrope" and cfg.rotary_dim == int(32 * partial)
    assert cfg.rope_scaling.original_max_position_embeddings == 64 and cfg.rope_scaling.factor == 4.0
    assert_tables(engine_tables(cfg, n), hf_tables(Phi3RotaryEmbedding(config), n))


def test_static_tables_differ_from_transformers_only_where_documented():
    """A table longer than the trained (dynamic) / original (longrope) context uses the
    scaled frequencies at every position; transformers turns a short sequence unscaled / with
    the short factors. The docs (rope.py, docs/models.md) say so: this pins it."""
    config = hf_llama({"rope_type": "dynamic", "factor": 4.0}, 64)
    cos, _ = engine_tables(engine_config(config), 200)
    short_cos, _ = hf_tables(LlamaRotaryEmbedding(config), 64)
    assert not torch.allclose(cos[:64], short_cos, atol=1e-3)

    config = hf_phi3(1.0, {})
    cos, _ = engine_tables(engine_config(config, Phi3, "Phi3ForCausalLM"), 256)
    short_cos, _ = hf_tables(Phi3RotaryEmbedding(config), 64)
    long_cos, _ = hf_tables(Phi3RotaryEmbedding(config), 256)
    assert not torch.allclose(cos[:64], short_cos, atol=1e-3)
    torch.testing.assert_close(cos[:64], long_cos[:64], atol=ATOL, rtol=0)


# ---- full-size settings: frequencies and magnitude -----------------------------------------------

BIG = dict(vocab_size=300, hidden_size=4096, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
           num_key_value_heads=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # head_dim 128

#: (id, config class, module, family, architecture, config kwargs, n)
FULL_SIZE = [
    ("llama3.1", LlamaConfig, LlamaRotaryEmbedding, Llama, "LlamaForCausalLM", dict(
        BIG, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}), 131072),
    ("qwen3-yarn", LlamaConfig, LlamaRotaryEmbedding, Llama, "LlamaForCausalLM", dict(
        BIG, max_position_embeddings=40960, rope_theta=1000000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), 40960),
    ("dynamic-2x", LlamaConfig, LlamaRotaryEmbedding, Llama, "LlamaForCausalLM", dict(
        BIG, max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 8192),
    ("phi3-128k-short", Phi3Config, Phi3RotaryEmbedding, Phi3, "Phi3ForCausalLM", dict(
        BIG, num_key_value_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling=phi3_scaling(128)), 4096),
    ("phi3-128k-long", Phi3Config, Phi3RotaryEmbedding, Phi3, "Phi3ForCausalLM", dict(
        BIG, num_key_value_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling=phi3_scaling(128)), 131072),
]


@pytest.mark.parametrize("case", FULL_SIZE, ids=[c[0] for c in FULL_SIZE])
def test_full_size_frequencies_match_transformers(case):
    _, config_cls, module, family, architecture, kwargs, n = case
    config = config_cls(**{**kwargs, "rope_scaling": dict(kwargs["rope_scaling"])})
    rotary = module(config)
    with torch.no_grad():  # one forward at position n-1: what a sequence of length n sets up
        rotary(torch.zeros(1), torch.tensor([[n - 1]]))
    cfg = engine_config(config, family, architecture)
    freqs, magnitude = inv_freq(cfg, cfg.rope_theta, cfg.rope_scaling, n)
    torch.testing.assert_close(freqs, rotary.inv_freq.double(), rtol=1e-6, atol=0)
    assert magnitude == pytest.approx(rotary.attention_scaling, rel=1e-12)


# ---- config spellings ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_both_spellings_give_the_same_tables(case):
    _, scaling, max_pos, n = case
    raw = {**hf_llama(scaling, max_pos, theta=20000.0).to_dict(), "architectures": ["LlamaForCausalLM"]}
    assert "rope_parameters" in raw and "rope_scaling" not in raw  # transformers 5 writes this one
    v5, hub = Llama().config_from_hf(raw), Llama().config_from_hf(hub_spelling(raw))
    assert v5.rope_theta == hub.rope_theta == 20000.0 and v5.rope_scaling == hub.rope_scaling
    for a, b in zip(engine_tables(v5, n), engine_tables(hub, n), strict=True):
        assert torch.equal(a, b)


def test_phi3_spellings_give_the_same_tables():
    """Phi-3's hub config: ``type`` longrope (or the older ``su``), the original context at
    the top level, no ``factor`` (the ratio of the two contexts)."""
    raw = {**hf_phi3(0.5, {}).to_dict(), "architectures": ["Phi3ForCausalLM"]}
    v5 = Phi3().config_from_hf(raw)
    hub = hub_spelling(raw)
    assert hub["original_max_position_embeddings"] == 64 and hub["partial_rotary_factor"] == 0.5
    hub["rope_scaling"].pop("original_max_position_embeddings", None)
    hub["rope_scaling"].pop("rope_type")
    for kind in ("longrope", "su"):
        hub["rope_scaling"]["type"] = kind
        got = Phi3().config_from_hf(hub)
        assert got.rope_scaling == v5.rope_scaling and got.rotary_dim == v5.rotary_dim == 16
        for a, b in zip(engine_tables(v5, 200), engine_tables(got, 200), strict=True):
            assert torch.equal(a, b)


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_an_unknown_rope_type_is_refused_naming_it(spelling):
    raw = {**hf_llama(None, 256).to_dict(), "architectures": ["LlamaForCausalLM"]}
    raw.pop("rope_parameters")
    raw[spelling] = {"rope_type": "xpos-ish", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*'xpos-ish'"):
        Llama().config_from_hf(raw)
    with pytest.raises(ValueError, match="'xpos-ish'"):
        RopeScaling(kind="xpos-ish")


def test_longrope_factors_of_the_wrong_length_are_refused():
    cfg = engine_config(hf_phi3(1.0, {}), Phi3, "Phi3ForCausalLM")
    scaling = RopeScaling(kind="longrope", original_max_position_embeddings=64, short_factor=(1.0,) * 3,
                          long_factor=(1.0,) * 16)
    with pytest.raises(ValueError, match="short_factor must have rotary_dim / 2 = 16 values, got 3"):
        rope_tables(cfg, 64, cfg.rope_theta, scaling)
