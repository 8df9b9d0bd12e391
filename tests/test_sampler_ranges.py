"""Every accepted float parameter, down to subnormals, gives a token from a real distribution."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.core.sampler import Sampler, SamplingRow
from tokenloom.core.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from tokenloom.core.sequence import Sequence

TINY = [5e-324, 1e-320, 1e-45, 1e-40, 1e-38, 1e-30, 1e-10, 1e-6]


def _floats(lo: float, hi: float, edges: list[float], exclude_min: bool = False) -> st.SearchStrategy[float]:
    # the edges by name (bounds, float32 underflow, near 1) and anything in between, subnormals included
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, exclude_min=exclude_min))


params_st = st.builds(
    SamplingParams,
    temperature=_floats(0.0, MAX_TEMPERATURE, [0.0, *TINY, GREEDY_TEMPERATURE_EPS, 2e-5, 1.0, MAX_TEMPERATURE]),
    top_p=_floats(0.0, 1.0, [*TINY, 0.5, 1 - 1e-9, 1 - 1e-16, 1.0], exclude_min=True),
    top_k=st.one_of(st.just(0), st.integers(-1, 50)),  # vocab >= 50
    min_p=_floats(0.0, 1.0, [0.0, *TINY, 0.5, 1 - 1e-9, 1.0]),
    repetition_penalty=_floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                               [MIN_REPETITION_PENALTY, 1.0, MAX_REPETITION_PENALTY]),
    presence_penalty=_floats(-2.0, 2.0, [-2.0, 0.0, 2.0]),
    frequency_penalty=_floats(-2.0, 2.0, [-2.0, 0.0, 2.0]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    logprobs=st.sampled_from([None, 0, 3]),
)


@settings(max_examples=400, deadline=None)
@given(
    params=params_st,
    vocab=st.integers(50, 300),
    scale=st.sampled_from([1e-3, 1.0, 10.0, 30.0, 1e2, 1e3, 1e4]),
    ties=st.booleans(),
    history=st.integers(0, 40),
    rng_seed=st.integers(0, 2**31 - 1),
)
def test_every_accepted_value_samples_from_a_real_distribution(params, vocab, scale, ties, history, rng_seed):
    params.validate(vocab_size=vocab)  # the strategies stay inside the accepted range
    gen = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(1, vocab, generator=gen) * scale
    if ties:  # coarse logits: many exact ties, the top one included
        logits = (logits / scale * 2).round() * scale
    tokens = torch.randint(0, vocab, (1 + history,), generator=gen).tolist()
    seq = Sequence("r", tokens, params)
    seq.num_prompt_tokens = 1 + history // 2  # the rest is output: presence/frequency apply
    row = SamplingRow.of(seq)
    sampler = Sampler(rng_seed)

    penalised = sampler.apply_penalties(logits, [row])
    assert torch.isfinite(penalised).all()
    dist = sampler.probs(penalised, [row])[0]
    assert torch.isfinite(dist).all() and (dist >= 0).all()
    assert math.isclose(dist.sum().item(), 1.0, abs_tol=1e-4)

    (token,), (lp,) = sampler(logits, [row])
    assert dist[token] > 0, f"token {token} has probability 0"
    greedy_like = params.greedy or params.top_k == 1 or torch.tensor(params.top_p).item() == 0.0
    if params.greedy:
        assert token == penalised[0].argmax().item()
    if greedy_like:
        assert penalised[0, token] == penalised[0].max()
    if params.logprobs is not None:
        assert lp is not None and lp.token_id == token and math.isfinite(lp.logprob)
