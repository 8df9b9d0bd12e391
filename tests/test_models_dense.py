"""Each dense model family against transformers' own implementation of it.

For every family a tiny random-weight model is made with transformers' classes (odd
sizes: 1, 2 and 3 KV heads, head dims 32 and 64, a window shorter than the prompt, random
norms and biases so that nothing is an identity), saved as safetensors and served: the
prefill logits match in float32 to 1e-4 relative, and the greedy ids for 32 tokens match
through a plain prefill, a chunked prefill behind a cached prefix and a batch of prompts
of mixed lengths decoding together."""

from __future__ import annotations

import json

import pytest
import torch

from tokenloom import LLM, SamplingParams

from conftest import CHAT_TEMPLATE, EOS_ID, TINY_VOCAB, _byte_tokenizer

COMMON = dict(vocab_size=TINY_VOCAB, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=257, eos_token_id=EOS_ID, pad_token_id=259)

FAMILIES = {
    # Llama 3: llama3 rope scaling (the original context short enough that it bites), 3 KV heads of 32
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=96, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral: every layer a window of 8 (prompts are longer); GQA 3
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
        sliding_window=8)),
    # Qwen2: q/k/v biases
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1)),
    # Qwen3: per-head q/k norms, head_dim 64 wider than hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=64)),
    # Gemma 2: soft-caps small enough to bite, local/global layers, its own attention scale
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"])),
    # Gemma 3: q/k norms, a local RoPE base on the sliding layer
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=96, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
        sliding_window=8, query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    # Phi-3: q/k/v and gate/up fused in the checkpoint, half the head rotated
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


def make_family_model(path, family: str, seed: int = 0):
    """Save a random ``family`` model (transformers' classes) and the byte tokenizer to ``path``."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (Gemma's start at zero: 1 + w) and biases (zero-initialised)
                p.add_(torch.randn_like(p) * 0.3)
        lm_head = model.get_output_embeddings().weight
        if not cfg.tie_word_embeddings:  # larger logits than the default init: fewer greedy near-ties
            lm_head.mul_(8.0)
        else:
            lm_head.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_family_model(path, request.param)
    return request.param, path, model


def engine(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=128, block_size=8, **kw)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(3, 60, 2)) + [200, 17, 5], [5, 9, 100, 42, 7], list(range(40, 90))]


def test_prefill_logits_match_transformers(family):
    name, path, model = family
    llm = engine(path)
    try:
        ids = PROMPTS[0]
        ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2, 3])
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative"
    finally:
        llm.close()


def test_batched_greedy_matches_transformers(family):
    """Three prompts of mixed lengths prefilled and decoded together (windows wrap in decode)."""
    name, path, model = family
    llm = engine(path)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy(model, prompt, 32), name
    finally:
        llm.close()


def test_chunked_prefill_behind_a_cached_prefix_matches(family):
    """A prompt whose first 48 tokens are cached from an earlier request, its rest prefilled
    in chunks of 16 tokens, then decoded."""
    name, path, model = family
    llm = engine(path, scheduler={"name": "continuous", "max_num_batched_tokens": 16, "max_num_seqs": 4})
    try:
        prefix = list(range(10, 58))
        llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prompt = prefix + [7, 8, 9, 120, 121, 122, 30, 31, 32, 33, 99, 98, 97, 1, 2, 3, 4, 5, 6]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        assert llm.engine.stats()["prefix_hits"] >= 40, "the prefix was not served from the cache"
        assert out.token_ids == hf_greedy(model, prompt, 32), name
    finally:
        llm.close()


def test_every_feature_runs_on_every_family(family):
    """Prefix caching as a radix tree, the n-gram decoder and a draft model (this model in
    4 bits) give transformers' greedy ids (all exact); int8 weights and an int8 KV pool serve
    with logits close to float32's."""
    name, path, model = family
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [p + p[:12] for p in PROMPTS]  # a repeat for the n-gram decoder to find
    want = [hf_greedy(model, p, 24) for p in prompts]
    for extra in ({"cache_manager": {"name": "radix"}}, {"decoder": {"name": "ngram"}},
                  {"decoder": {"name": "speculative"}}):
        llm = engine(path, **extra)
        try:
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == want, f"{name} with {extra}"
            assert llm.engine.cache.stats().num_used_blocks == 0
        finally:
            llm.close()
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0]
    for extra in ({"quantizer": {"name": "int8"}}, {"kv_cache_dtype": "int8"}):
        llm = engine(path, **extra)
        try:
            ours = llm.engine.runner.prefill_logits(PROMPTS[0], block_table=[0, 1, 2, 3])
            rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            assert rel < 0.05, f"{name} with {extra}: logits {rel:.2%} off"
            assert len(llm.generate([PROMPTS[1]], params)[0].token_ids) == 24
        finally:
            llm.close()


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_two_gloo_ranks_give_one_ranks_greedy_ids(name, tmp_path):
    """Heads and the FFN split over two ranks (two KV heads here), biases, q/k norms, sandwich
    norms, soft-caps and windows included."""
    path = tmp_path / name
    _, _, extra = FAMILIES[name]
    FAMILIES[f"{name}-tp"] = (FAMILIES[name][0], FAMILIES[name][1], {**extra, "num_key_value_heads": 2,
                                                                     "num_attention_heads": 4})
    try:
        make_family_model(path, f"{name}-tp")
    finally:
        del FAMILIES[f"{name}-tp"]
    outs = {}
    for tp in (1, 2):
        llm = engine(path, tensor_parallel_size=tp)
        try:
            outs[tp] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True))]
        finally:
            llm.close()
    assert outs[1] == outs[2]
