"""The captured decode step (``TorchBackend.capture_decode``: the whole decode step in one C++
call) for Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm before RoPE): tiny models
made with transformers' classes are captured, give transformers' greedy ids in float32, and
give the op-by-op path's tokens and log-probabilities bit for bit in float32 and bfloat16."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_models_dense import hf_greedy, make_family_model

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ ops cannot be built here")

# mixed lengths decoding together (batch 3 down to 1 as they finish)
PROMPTS = [list(range(3, 60, 2)) + [200, 17, 5], [5, 9, 100, 42, 7], list(range(40, 90))]
GEN = (24, 16, 8)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_family_model(path, request.param)


async def _streams(engine, prompts, params) -> list[list]:
    """Every request's deltas, all requests in flight at once (continuous batching)."""
    from tokenloom.core.outputs import TokenDelta

    async def one(prompt, p):
        return [d async for d in engine.generate(prompt, p) if isinstance(d, TokenDelta)]

    return list(await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params, strict=True))))


def _run(path, capture: bool, dtype: str):
    """Tokens and log-probabilities of every prompt, all in flight at once, and how many steps
    ran captured (None: nothing was captured)."""
    with LLM(model=str(path), dtype=dtype, device="cpu", num_kv_blocks=128, block_size=8, capture=capture) as llm:
        assert llm.engine.runner.captured is capture
        streams = llm.run(_streams(llm.engine, PROMPTS, [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in GEN]))
        captured = llm.engine.runner.model.captured
        steps = captured.steps if captured is not None else None
    tokens = [[t for d in deltas for t in d.token_ids] for deltas in streams]
    logprobs = torch.tensor([lp.logprob for deltas in streams for d in deltas for lp in d.logprobs])
    return tokens, logprobs, steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_step_gives_the_op_by_op_outputs(family, dtype):
    name, path, model = family
    tokens, logprobs, steps = _run(path, True, dtype)
    eager_tokens, eager_logprobs, eager_steps = _run(path, False, dtype)
    assert steps is not None and steps >= GEN[0] - 2, name  # the decode steps really ran captured
    assert eager_steps is None
    assert tokens == eager_tokens, name
    assert torch.equal(logprobs, eager_logprobs), name  # bit for bit: the same ops in the same order
    if dtype == "float32":
        assert tokens == [hf_greedy(model, p, n) for p, n in zip(PROMPTS, GEN, strict=True)], name
