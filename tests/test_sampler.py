"""The sampler, tested statistically where it is random."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.core.sampler import Sampler, SamplingRow
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence


def _seq(tokens=(1, 2, 3), n_prompt=None, **params) -> SamplingRow:
    s = Sequence("r", list(tokens), SamplingParams(**params))
    if n_prompt is not None:
        s.num_prompt_tokens = n_prompt
    return SamplingRow.of(s)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def _histogram(sampler, logits, seq, n=20000):
    # one row per draw: the batch path, many rows with the same params
    rows = logits.expand(n, -1).contiguous()
    tokens, _ = sampler(rows, [seq] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


def _assert_close_to(freq, probs, n=20000):
    # 5-sigma binomial bound per category
    sigma = torch.sqrt(probs * (1 - probs) / n)
    bad = (freq - probs).abs() > 5 * sigma + 1e-4
    assert not bad.any(), f"freq {freq.tolist()} vs probs {probs.tolist()}"


def test_greedy_is_argmax():
    tokens, _ = Sampler()(torch.tensor([[0.1, 3.0, 2.9], [5.0, 1.0, 0.0]]), [_seq(temperature=0)] * 2)
    assert tokens == [1, 0]


def test_temperature_sampling_matches_softmax():
    probs = torch.softmax(LOGITS[0] / 0.7, -1)
    _assert_close_to(_histogram(Sampler(1), LOGITS, _seq(temperature=0.7)), probs)


def test_top_k_renormalises_over_k_best():
    probs = torch.softmax(LOGITS[0], -1)
    probs[3:] = 0
    _assert_close_to(_histogram(Sampler(2), LOGITS, _seq(top_k=3)), probs / probs.sum())


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)  # [0.56, 0.21, 0.13, 0.08, ...]
    keep = probs.clone()
    keep[3:] = 0  # 0.56 + 0.21 < 0.8 <= 0.56 + 0.21 + 0.13
    _assert_close_to(_histogram(Sampler(3), LOGITS, _seq(top_p=0.8)), keep / keep.sum())


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.softmax(LOGITS[0], -1)
    keep = torch.where(probs >= 0.2 * probs.max(), probs, torch.zeros_like(probs))
    _assert_close_to(_histogram(Sampler(4), LOGITS, _seq(min_p=0.2)), keep / keep.sum())


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50)
    a = Sampler(0)
    b = Sampler(99)
    s1, s2 = _seq(seed=1234), _seq(seed=1234)
    first = [a(logits, [s1])[0][0] for _ in range(20)]
    other = _seq()
    second = [b(torch.cat([torch.randn(1, 50), logits]), [other, s2])[0][1] for _ in range(20)]
    assert first == second
    assert len(set(first)) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.9, -2.1]])
    # token 0 (seen) drops below token 2; token 1 (seen, negative) drops below token 3
    seq = _seq(tokens=[0, 1], temperature=0, repetition_penalty=2.0)
    tokens, _ = Sampler()(logits, [seq])
    assert tokens == [2]
    penalised = Sampler().apply_penalties(logits, [seq])
    assert penalised[0].tolist() == pytest.approx([1.0, -4.0, 1.9, -2.1])


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.zeros(1, 4)
    seq = _seq(tokens=[3, 1, 1, 2], n_prompt=1, presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler().apply_penalties(logits, [seq])[0].tolist()
    # prompt token 3 untouched; token 1 twice in output; token 2 once
    assert out == pytest.approx([0.0, -(0.5 + 0.5), -(0.5 + 0.25), 0.0])


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, lps = Sampler()(logits, [_seq(temperature=0, logprobs=2, repetition_penalty=3.0, tokens=[1])])
    ref = torch.log_softmax(logits[0], -1)
    assert lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(ref[tokens[0]].item())
    assert [t for t, _ in lps[0].top] == [1, 2]
    assert lps[0].top[0][1] == pytest.approx(ref[1].item())
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("params, logits", [
    # issue 14: large logits divided by a temperature that is subnormal or 0 in float32 overflowed
    ({"temperature": 1e-38}, [0.5, 1.0, 30.0, 20.0, -1.0]),
    ({"temperature": 5e-324}, [0.5, 1.0, 30.0, 20.0, -1.0]),
    # a top_p that is 0 in float32 dropped every token; now the most likely one always stays
    ({"top_p": 5e-324}, [0.5, 1.0, 1.3, 1.2, -1.0]),
])
def test_tiny_values_give_the_top_token(params, logits):
    logits = torch.tensor([logits])
    n = 64
    tokens, lps = Sampler(5)(logits.expand(n, -1).contiguous(), [_seq(logprobs=0, **params)] * n)
    assert tokens == [2] * n
    assert lps[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_probs_is_what_is_sampled():
    seq = _seq(tokens=[0, 3], temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3)
    sampler = Sampler(6)
    dist = sampler.probs(sampler.apply_penalties(LOGITS, [seq]), [seq])[0]
    assert dist.sum().item() == pytest.approx(1.0)
    assert dist[5] == 0  # below min_p (and outside top_k)
    _assert_close_to(_histogram(sampler, LOGITS, seq), dist)


def test_probs_of_a_greedy_row_is_one_hot_at_the_argmax():
    dist = Sampler().probs(LOGITS, [_seq(temperature=1e-6)])[0]
    assert dist.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
