"""tokenloom against HF transformers on the same random tiny LLaMA."""

from __future__ import annotations

import pytest
import torch

from tokenloom import SamplingParams

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("cpu_linear", ["dual", "mkl", "onednn"])
def test_prefill_logits_match_transformers(make_llm, tiny_hf_model, cpu_linear):
    llm = make_llm(backend={"name": "torch", "cpu_linear": cpu_linear})
    ids = list(range(3, 60, 2)) + [200, 17, 5]
    ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2])
    with torch.no_grad():
        theirs = tiny_hf_model(torch.tensor([ids])).logits[0]
    diff = (ours - theirs).abs()
    assert diff.max() < 1e-4, f"max diff {diff.max():.2e} at {divmod(diff.argmax().item(), diff.shape[1])}"


def test_greedy_continuation_matches_transformers(make_llm, tiny_hf_model):
    llm = make_llm()
    prompts = [[5, 9, 100, 42, 7], list(range(40, 90))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = tiny_hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_bfloat16_weights_stay_close(make_llm, tiny_hf_model):
    llm = make_llm(dtype="bfloat16")
    ids = [7, 8, 9, 10, 200, 3]
    ours = llm.engine.runner.prefill_logits(ids, block_table=[0])
    with torch.no_grad():
        theirs = tiny_hf_model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max() / theirs.abs().max() < 0.05
