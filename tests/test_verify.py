"""Speculative-decoding verification (plugins/decoders/verify.py): rejection sampling keeps
the target's output distribution exactly.

What is checked:

- the closed form: ``reference_chain`` gives ``p[0]`` for any target ``p`` and draft ``q``;
- Monte Carlo on ``accept_chain`` (chi-square at p = 0.001, fixed seeds, so deterministic):
  the first emitted token follows ``p[0]``, the next one (after an accepted draft) ``p[1]``,
  the bonus ``p[k]``, the acceptance rate is ``sum min(p, q)``; the same for a
  deterministic proposer (``q=None``, one-hot drafts);
- power: three plausible wrong rules, run on the very same draft table and seed, fail that
  chi-square test;
- greedy (``gen=None``): drafts are kept while they equal the argmax, then the argmax;
- ``verify`` end to end with real ``Sequence``/``Sampler`` objects: rows without drafts take
  the sampler's ordinary path (same tokens, same logprobs), greedy rows match plain greedy
  decoding, penalties see the earlier drafts, logprobs come from the raw logits, a seeded
  request does not depend on its batch, and the sampled first token's law is the
  sampler's ``probs`` (temperature, top-k, draft distributions passed in).
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.core.interfaces import SequenceOutput
from tokenloom.core.sampler import Sampler, SamplingRow, TokenLogprob
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.decoders.verify import (
    accept_chain,
    reference_chain,
    row_contexts,
    target_probs,
    verify,
)

PROMPT = [1, 2, 3]
N_TRIALS = 20_000
# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- helpers


def _chi2(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``tokens`` against ``probs [V]`` and its degrees of freedom;
    inf when a token of probability 0 was seen."""
    probs = probs.double()
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(probs)).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf, int(support.sum()) - 1
    expected = counts.sum() * probs[support]
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def _follows(tokens: list[int], probs: torch.Tensor) -> bool:
    stat, dof = _chi2(tokens, probs)
    return stat < CHI2_CRIT_001[dof]


def _assert_law(tokens: list[int], probs: torch.Tensor, what: str) -> None:
    stat, dof = _chi2(tokens, probs)
    assert stat < CHI2_CRIT_001[dof], (
        f"{what}: chi2={stat:.1f} >= {CHI2_CRIT_001[dof]} ({dof} dof, n={len(tokens)}); "
        f"observed {torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()}, "
        f"expected law {[round(float(x), 4) for x in probs]}")


def _assert_rate(hits: int, n: int, rate: float, what: str) -> None:
    z = (hits - n * rate) / math.sqrt(n * rate * (1 - rate))
    assert abs(z) < 4, f"{what}: {hits}/{n} vs expected rate {rate:.4f} (z={z:.1f})"


def _laws(seed: int, k: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target ``p [k+1, V]`` and a draft ``q [k, V]``, float32 like the engine's."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g), dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
    return p, q


def _run(rule, p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int,
         drafts: list[int] | None = None) -> list[tuple[list[int], int]]:
    """``n`` independent verification steps. Drafts ``d_i ~ q_i`` (a fixed ``q`` per
    position, so drawing each position's column at once is the same as drawing the chain
    in order), or the fixed ``drafts`` of a deterministic proposer."""
    if drafts is None:
        gd = torch.Generator().manual_seed(seed)
        cols = [torch.multinomial(q[i], n, replacement=True, generator=gd) for i in range(q.shape[0])]
        table = torch.stack(cols, dim=1).tolist()
    else:
        table = [drafts] * n
    gen = torch.Generator().manual_seed(seed + 1)
    return [rule(p, d, q, gen) for d in table]


def _multinomial(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs.double(), 1, generator=gen))


# Plausible wrong rules, each with accept_chain's signature.
def _always_accept(p, drafts, q, gen):
    return list(drafts) + [_multinomial(p[len(drafts)], gen)], len(drafts)


def _recover_from_p(p, drafts, q, gen):
    """Right acceptance test, but a rejection resamples from p instead of the residual."""
    out = []
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=gen)) * float(q[i, d]) < float(p[i, d]):
            out.append(d)
            continue
        return out + [_multinomial(p[i], gen)], i
    return out + [_multinomial(p[len(drafts)], gen)], len(drafts)


def _accept_with_p(p, drafts, q, gen):
    """Keeps a draft with probability p(d), ignoring q; right residual."""
    out = []
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < float(p[i, d]):
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        return out + [_multinomial(residual / residual.sum(), gen)], i
    return out + [_multinomial(p[len(drafts)], gen)], len(drafts)


def _seq(params: SamplingParams, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(PROMPT), params)


def _greedy_reference(logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[int]:
    """Plain greedy decoding, one ``Sampler.__call__`` per row, the history growing by each
    emitted token; stops after the first token that differs from its draft."""
    sampler, out = Sampler(seed=0), []
    for j in range(len(drafts) + 1):
        (tok,), _ = sampler(logits[j:j + 1], [SamplingRow.of(seq, out)])
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=10)


# ------------------------------------------------------------------- closed form


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3])
def test_reference_chain_is_target_law(seed, k):
    V = 6
    g = torch.Generator().manual_seed(100 * seed + k)
    p = torch.softmax(3 * torch.randn(k + 1, V, generator=g), dim=-1)
    q = torch.softmax(3 * torch.randn(k, V, generator=g), dim=-1)
    if seed % 2:  # disjoint-ish supports: zeros in both
        p[0, :2] = 0.0
        q[0, -2:] = 0.0
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
    law = reference_chain(p, drafts, q)
    assert law.sum().item() == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(law, p[0].double(), atol=1e-6, rtol=0)


def test_reference_chain_when_p_equals_q():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    torch.testing.assert_close(reference_chain(p, [2], p[:1].clone()), p[0].double())


def test_chi2_critical_values():
    # Upper tail of chi-square(dof) at x is Q(dof / 2, x / 2).
    for dof, crit in CHI2_CRIT_001.items():
        tail = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                       torch.tensor(crit / 2, dtype=torch.float64))
        assert float(tail) == pytest.approx(1e-3, rel=1e-3)


# ------------------------------------------------------------------- Monte Carlo


def test_sampled_drafts_keep_target_law():
    V, k = 5, 2
    p, q = _laws(seed=3, k=k, V=V)
    results = _run(accept_chain, p, q, N_TRIALS, seed=11)

    assert all(1 <= len(toks) == acc + 1 <= k + 1 for toks, acc in results)
    _assert_law([toks[0] for toks, _ in results], p[0], "first token")

    beta = float(torch.minimum(p[0], q[0]).sum())
    accepted_first = [toks for toks, acc in results if acc >= 1]
    _assert_rate(len(accepted_first), N_TRIALS, beta, "first draft acceptance")

    # After an accepted first draft equal to a, the next token follows p[1].
    counts = torch.bincount(torch.tensor([t[0] for t in accepted_first]), minlength=V)
    a = int(counts.argmax())
    _assert_law([t[1] for t in accepted_first if t[0] == a], p[1], f"second token | first = draft {a}")
    _assert_law([t[1] for t in accepted_first], p[1], "second token | first accepted")

    # Every draft accepted: the bonus follows p[k].
    _assert_law([toks[k] for toks, acc in results if acc == k], p[k], "bonus token")


def test_deterministic_proposer_keeps_target_law():
    V, k = 5, 2
    p, _ = _laws(seed=5, k=k, V=V)
    drafts = [int(p[0].argsort()[V // 2]), int(p[1].argmax())]  # a middling, then a likely draft
    results = _run(accept_chain, p, None, N_TRIALS, seed=21, drafts=drafts)

    _assert_law([toks[0] for toks, _ in results], p[0], "first token (one-hot drafts)")
    _assert_rate(sum(acc >= 1 for _, acc in results), N_TRIALS, float(p[0, drafts[0]]), "acceptance")
    # A rejected one-hot draft is never the recovered token.
    assert all(toks[0] != drafts[0] for toks, acc in results if acc == 0)
    _assert_law([toks[1] for toks, acc in results if acc >= 1], p[1], "second token | first accepted")
    _assert_law([toks[k] for toks, acc in results if acc == k], p[k], "bonus token")


@pytest.mark.parametrize("wrong_rule", [_always_accept, _recover_from_p, _accept_with_p])
def test_wrong_rules_fail_the_same_test(wrong_rule):
    """The statistic has power: the same draws through a wrong rule are rejected."""
    V, k = 5, 2
    p, q = _laws(seed=3, k=k, V=V)
    first = [toks[0] for toks, _ in _run(wrong_rule, p, q, N_TRIALS, seed=11)]
    assert not _follows(first, p[0]), f"{wrong_rule.__name__} passed the first-token test"


def test_identical_draft_and_target_accept_everything():
    V, k = 6, 3
    p, _ = _laws(seed=8, k=k, V=V)
    gen = torch.Generator().manual_seed(0)
    for drafts in ([0, 1, 2], [5, 5, 5], [3, 0, 4]):
        toks, acc = accept_chain(p, drafts, p[:k].clone(), gen)
        assert acc == k and toks[:k] == drafts and len(toks) == k + 1


# ------------------------------------------------------------------- greedy


@pytest.mark.parametrize("matching", [0, 1, 2, 3])
@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_chain(matching, with_q):
    V, k = 7, 3
    argmax = [4, 1, 6, 2]
    p = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
    drafts = [argmax[j] if j < matching else (argmax[j] + 3) % V for j in range(k)]
    q = torch.nn.functional.one_hot(torch.tensor(drafts), V).float() if with_q else None
    toks, acc = accept_chain(p, drafts, q, None)
    assert acc == matching
    assert toks == argmax[:matching + 1]
    assert len(toks) == (k + 1 if matching == k else matching + 1)


# ------------------------------------------------------------------- verify, end to end


def test_row_contexts_see_earlier_drafts():
    seq = Sequence("r", [1, 2, 3, 9], GREEDY, num_prompt_tokens=3)  # one token already generated
    ctxs = row_contexts(seq, [5, 6])
    assert [c.token_ids for c in ctxs] == [[1, 2, 3, 9], [1, 2, 3, 9, 5], [1, 2, 3, 9, 5, 6]]
    assert [c.output_token_ids for c in ctxs] == [[9], [9, 5], [9, 5, 6]]
    assert all(c.params is seq.params and c.seq_id == seq.seq_id for c in ctxs)
    assert seq.token_ids == [1, 2, 3, 9]  # untouched


@pytest.mark.parametrize("seed", [None, 1234])
def test_verify_rows_without_drafts_take_the_sampler_path(seed):
    V = 12
    params = SamplingParams(temperature=0.9, top_k=5, max_tokens=10, seed=seed, logprobs=2)
    plain_a, plain_c = _seq(params, "a"), _seq(params, "c")
    spec_b = _seq(GREEDY, "b")
    ref_a, ref_c = _seq(params, "a"), _seq(params, "c")
    sampler, reference = Sampler(seed=0), Sampler(seed=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(5, V, generator=g)  # rows: a | b b b | c
        outs = verify(sampler, logits, [plain_a, spec_b, plain_c], [1, 3, 1], [[], [4, 7], []])
        tokens, lps = reference(logits[[0, 4]], [SamplingRow.of(ref_a), SamplingRow.of(ref_c)])
        for out, tok, lp in zip((outs[0], outs[2]), tokens, lps, strict=True):
            assert isinstance(out, SequenceOutput)
            assert out.token_ids == [tok] and out.num_accepted == 0 and out.num_drafted == 0
            assert out.logprobs == [lp]
        assert outs[1].num_drafted == 2


def test_verify_greedy_drafts():
    V = 10
    g = torch.Generator().manual_seed(1)
    cases = [  # (drafts, row argmaxes, expected tokens, accepted)
        ([3, 8, 1], [3, 8, 5, 0], [3, 8, 5], 2),
        ([2, 9], [2, 9, 4], [2, 9, 4], 2),  # all accepted: bonus
        ([6, 6], [0, 6, 6], [0], 0),  # first rejected
        ([], [7], [7], 0),  # no drafts
    ]
    rows, seqs, drafts = [], [], []
    for i, (d, am, _, _) in enumerate(cases):
        block = torch.randn(len(am), V, generator=g)
        block[torch.arange(len(am)), torch.tensor(am)] += 10.0
        rows.append(block)
        seqs.append(_seq(GREEDY, f"s{i}"))
        drafts.append(d)
    logits = torch.cat(rows)
    outs = verify(Sampler(seed=0), logits, seqs, [len(d) + 1 for d in drafts], drafts)
    start = 0
    for out, seq, (d, am, expected, accepted) in zip(outs, seqs, cases, strict=True):
        assert out.token_ids == expected
        assert out.num_accepted == accepted and out.num_drafted == len(d)
        assert out.logprobs is None
        assert out.token_ids == _greedy_reference(logits[start:start + len(am)], seq, d)
        start += len(am)


PENALTIES = {
    "repetition": dict(repetition_penalty=10.0),
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=2.0),
}


def _penalty_logits(V: int = 8) -> torch.Tensor:
    """Drafts [5, 6, 6]. Unpenalised argmaxes: 5, 5, 6. With 5 and then 6 in the history
    (the earlier drafts), a penalty turns rows 1 and 2 to 6 and 7."""
    logits = torch.zeros(4, V)
    logits[0, 5] = 3.0
    logits[1, 5], logits[1, 6] = 4.0, 3.0
    logits[2, 6], logits[2, 7] = 4.0, 3.0
    logits[3, 4] = 1.0
    return logits


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_verify_penalties_see_the_drafts(penalty):
    params = SamplingParams(temperature=0, max_tokens=10, **PENALTIES[penalty])
    seq, drafts, logits = _seq(params), [5, 6, 6], _penalty_logits()
    (out,) = verify(Sampler(seed=0), logits, [seq], [4], [drafts])
    assert out.token_ids == [5, 6, 7] and out.num_accepted == 2 and out.num_drafted == 3
    assert out.token_ids == _greedy_reference(logits, seq, drafts)
    # Without the drafts in the history, row 1 would have kept 5 (and rejected draft 6).
    (stale,), _ = Sampler(seed=0)(logits[1:2], [SamplingRow.of(_seq(params))])
    assert stale == 5


@pytest.mark.parametrize("n", [2, 0])
def test_verify_logprobs_come_from_raw_logits(n):
    V = 8
    lp_params = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=10.0, logprobs=n)
    other = _seq(GREEDY, "other")  # no logprobs asked: None
    seq = _seq(lp_params, "lp")
    plain = _seq(lp_params, "plain")
    g = torch.Generator().manual_seed(2)
    other_rows = torch.randn(2, V, generator=g)
    plain_row = torch.randn(1, V, generator=g)
    logits = torch.cat([other_rows, _penalty_logits(V), plain_row])
    outs = verify(Sampler(seed=0), logits, [other, seq, plain], [2, 4, 1], [[0], [5, 6, 6], []])
    assert outs[0].logprobs is None
    out = outs[1]
    assert out.token_ids == [5, 6, 7]
    raw = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = raw[2 + j]
        assert isinstance(lp, TokenLogprob) and lp.token_id == tok
        assert lp.logprob == pytest.approx(float(row[tok]), abs=1e-6)
        assert len(lp.top) == n
        vals, ids = row.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
    (plain_lp,) = outs[2].logprobs
    assert plain_lp.logprob == pytest.approx(float(raw[6, outs[2].token_ids[0]]), abs=1e-6)
    assert len(plain_lp.top) == n


def test_verify_seeded_request_ignores_its_batch():
    V = 9
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    other_params = SamplingParams(temperature=1.2, max_tokens=10)
    alone_seq, batched_seq, other = _seq(params), _seq(params), _seq(other_params, "other")
    alone, batched = Sampler(seed=0), Sampler(seed=99)
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    for _ in range(8):
        logits = torch.randn(3, V, generator=g)
        other_logits = torch.randn(3, V, generator=g)
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        (a,) = verify(alone, logits, [alone_seq], [3], [drafts], [q])
        outs = verify(batched, torch.cat([other_logits, logits]), [other, batched_seq], [3, 3],
                      [[1, 2], drafts], [None, q])
        assert outs[1].token_ids == a.token_ids and outs[1].num_accepted == a.num_accepted


def test_verify_sampling_law():
    """Many sampling sequences with sampled drafts and their draft distributions: the first
    token follows the sampler's ``probs`` (temperature and top-k applied), and after an
    accepted draft the bonus follows the next row's."""
    N = 4000
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=10)
    block = torch.tensor([[1.0, 0.2, -1.0, 0.8, 0.5, 0.0],
                          [0.0, 0.6, 0.3, -0.5, 1.0, 0.4]])
    q = torch.tensor([[0.05, 0.45, 0.25, 0.05, 0.1, 0.1]])  # mass on tokens top-k drops
    g = torch.Generator().manual_seed(4)
    drafts = [[d] for d in torch.multinomial(q[0], N, replacement=True, generator=g).tolist()]
    seqs = [_seq(params, f"s{i}") for i in range(N)]
    sampler = Sampler(seed=0)
    outs = verify(sampler, block.repeat(N, 1), seqs, [2] * N, drafts, [q] * N)

    law = sampler.probs(block, [SamplingRow.of(seqs[0])] * 2)
    assert (law > 0).sum(-1).tolist() == [4, 4]
    _assert_law([o.token_ids[0] for o in outs], law[0], "first token via verify")
    assert all(o.num_drafted == 1 and len(o.token_ids) == o.num_accepted + 1 for o in outs)
    _assert_rate(sum(o.num_accepted for o in outs), N, float(torch.minimum(law[0], q[0]).sum()),
                 "acceptance via verify")
    _assert_law([o.token_ids[1] for o in outs if o.num_accepted], law[1], "bonus via verify")
    # Also agrees with the closed form for this p and q.
    torch.testing.assert_close(reference_chain(law, [0], q), law[0].double(), atol=1e-6, rtol=0)
    # The helper target_probs is the same law, row by row.
    ctxs = row_contexts(seqs[0], drafts[0])
    torch.testing.assert_close(target_probs(sampler, block, ctxs), law)


# ---- trees ------------------------------------------------------------------------
def test_tree_keeps_the_target_law_at_every_depth():
    """accept_tree with three candidates at the root and two below the first: the first
    emitted token follows p[root], and the second, given the first was node 0's token,
    follows p[node 0's row]. Dropping the renormalisation after a rejection breaks it."""
    from tokenloom.plugins.decoders.verify import accept_tree

    V = 5
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, V, generator=g) * 1.5, dim=-1)
    drafts, parents = [0, 1, 2, 3, 4], [-1, -1, -1, 0, 0]
    gen = torch.Generator().manual_seed(11)
    first, second = [], []
    for _ in range(20_000):
        out, nodes = accept_tree(p, drafts, parents, gen)
        first.append(out[0])
        if nodes[:1] == [0]:
            second.append(out[1])
    _assert_law(first, p[0], "tree: first token")
    _assert_law(second, p[1], "tree: second token under node 0")

    def no_renormalise(p, drafts, parents, gen):  # accept each child with its raw p, no residual
        for c in (0, 1, 2):
            if float(torch.rand((), generator=gen)) < float(p[0, drafts[c]]):
                return [drafts[c]], [c]
        return [int(torch.multinomial(p[0], 1, generator=gen))], []

    gen = torch.Generator().manual_seed(11)
    wrong = [no_renormalise(p, drafts, parents, gen)[0][0] for _ in range(20_000)]
    assert not _follows(wrong, p[0])


def test_greedy_tree_follows_the_argmax_branch():
    from tokenloom.plugins.decoders.verify import accept_tree

    V = 6
    p = torch.zeros(5, V)
    for row, best in enumerate([2, 0, 4, 1, 5]):
        p[row, best] = 1.0
    # root children: nodes 0 (token 1), 1 (token 2); node 1's children: 2 (token 3), 3 (token 4)
    out, nodes = accept_tree(p, [1, 2, 3, 4], [-1, -1, 1, 1], None)
    assert nodes == [1, 3] and out == [2, 4, p[4].argmax().item()]
