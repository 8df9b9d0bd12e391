"""Verification of draft tokens by rejection sampling: the one core every speculative
decoder shares.

A proposer guesses k tokens ``d_1..d_k`` for a sequence, each drawn from a draft
distribution ``q_i`` (a deterministic proposer such as n-gram lookup has ``q_i`` one-hot at
``d_i``). The target model scores the sequence's last token and the k drafts in one forward,
which gives k + 1 target distributions ``p_1..p_{k+1}`` (``p_i`` is the distribution of the
token at draft i's position, *after* every sampling parameter: penalties over the history
including the earlier drafts, temperature, top-k, top-p, min-p; see ``Sampler.probs``).
Then, for i = 1..k (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv:2211.17192, Algorithm 1; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling", arXiv:2302.01318, Algorithm 2):

- **accepted** token: ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
- **recovered** token: at the first rejection, a token is drawn from the residual
  ``norm(max(0, p_i - q_i))`` and the step ends (the remaining drafts are discarded);
- **bonus** token: when all k drafts are accepted, one more token is drawn from
  ``p_{k+1}``, which the same forward computed for free.

Each emitted token is then distributed exactly as the target alone would sample it, so a
step emits between 1 and k + 1 tokens and the output distribution never changes. Greedy
requests (one-hot ``p``) reduce to "keep drafts while they equal the target's argmax, then
emit the argmax": token-identical to plain greedy decoding.

Randomness comes from the request's own generator (``Sampler.generator_for``), so a
seeded request's draws do not depend on the rest of the batch. A sequence with no drafts
takes the sampler's ordinary path, unchanged.

:func:`reference_chain` is a short, slow, pure-torch statement of the same rule, kept for
the tests to compare against.
"""

from __future__ import annotations

import torch

from tokenloom.core.interfaces import SequenceOutput
from tokenloom.core.sampler import Sampler, SamplingRow, TokenLogprob
from tokenloom.core.sequence import Sequence


def row_contexts(seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
    """The sampler's view of each verification row: row j has seen ``drafts[:j]``."""
    return [SamplingRow.of(seq, drafts[:j]) for j in range(len(drafts) + 1)]


def _contexts(seq: Sequence, drafts: list[int], parents: list[int] | None) -> list[SamplingRow]:
    """Rows for a chain, or for a tree: node i's row has seen its own branch."""
    if parents is None:
        return row_contexts(seq, drafts)
    branch: list[list[int]] = []
    for i, parent in enumerate(parents):
        branch.append((branch[parent] if parent >= 0 else []) + [drafts[i]])
    return [SamplingRow.of(seq)] + [SamplingRow.of(seq, b) for b in branch]


def target_probs(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``[R, V]``: each row's sampling distribution, every sampling parameter applied."""
    return sampler.probs(sampler.apply_penalties(logits, rows), rows)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from ``probs [V]`` (the sampler's exponential race, the request's generator)."""
    noise = torch.empty_like(probs).exponential_(generator=gen).clamp_min_(torch.finfo(probs.dtype).tiny)
    return int((probs / noise).argmax())


def _uniform(gen: torch.Generator, device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def accept_chain(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, gen: torch.Generator | None
                 ) -> tuple[list[int], int]:
    """Rejection sampling along one chain: ``p [k+1, V]`` target distributions, ``drafts``
    (k tokens), ``q [k, V]`` draft distributions (``None``: one-hot at each draft). Returns
    (emitted tokens, number of drafts accepted). ``gen=None`` means every row of ``p`` is
    one-hot (greedy): no randomness is drawn."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        keep = pd > 0 and (pd >= qd or (gen is not None and _uniform(gen, p.device) * qd < pd))
        if keep:
            out.append(d)
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[i]).clamp_min_(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p[i]
        out.append(int(residual.argmax()) if gen is None else draw(residual, gen))
        return out, i
    out.append(int(p[len(drafts)].argmax()) if gen is None else draw(p[len(drafts)], gen))
    return out, len(drafts)


def accept_tree(p: torch.Tensor, drafts: list[int], parents: list[int], gen: torch.Generator | None
                ) -> tuple[list[int], list[int]]:
    """Verification of a tree of deterministic drafts (Miao et al. 2024, "SpecInfer",
    multi-step speculative sampling with one-hot drafts): ``p [k+1, V]`` (row 0 the root,
    row i+1 draft node i), ``drafts`` the nodes' tokens (siblings distinct), ``parents`` as
    ``Batch.draft_parents``. From the root, the children of the current node are tried in
    order: child c is accepted with probability ``r(c)``, where ``r`` starts as the node's
    target distribution and, after each rejected child, is that child zeroed and the rest
    renormalised; accepting moves down to the child, rejecting every child emits one token
    drawn from the final ``r`` (with no children: the bonus token from ``p``). Every emitted
    token is distributed as the target's, as for a chain. Returns (emitted tokens, the
    accepted nodes in order). ``gen=None``: greedy (one-hot rows), no randomness drawn."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    out: list[int] = []
    path: list[int] = []
    node, row = -1, 0
    while True:
        r = p[row]
        accepted = None
        for c in children.get(node, ()):
            t = drafts[c]
            pt = float(r[t])
            if pt > 0 and (pt >= 1.0 or (gen is not None and _uniform(gen, p.device) < pt)):
                accepted = c
                break
            if pt > 0:  # rejected: the residual of a one-hot draft is r without t
                rest = r.clone()
                rest[t] = 0.0
                total = float(rest.sum())
                if total > 0:  # else t held all the mass (rounding): keep r, t is then drawn
                    r = rest / total
        if accepted is None:
            out.append(int(r.argmax()) if gen is None else draw(r, gen))
            return out, path
        out.append(drafts[accepted])
        path.append(accepted)
        node, row = accepted, accepted + 1


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int],
           drafts: list[list[int]], draft_probs: list[torch.Tensor | None] | None = None,
           draft_parents: list[list[int] | None] | None = None) -> list[SequenceOutput]:
    """Turn a forward's logits into each sequence's new tokens.

    :param logits: ``[R, V]`` float32, ``num_rows[i] = 1 + len(drafts[i])`` consecutive rows
        per sequence (the runner's :class:`ForwardOutput` order).
    :param drafts: the draft tokens each sequence ran this step (may be empty).
    :param draft_probs: per sequence, ``[k, V]`` draft distributions, or ``None`` for a
        deterministic proposer (one-hot drafts).
    :param draft_parents: per sequence, the tree's parents (:func:`accept_tree`; drafts
        must then be deterministic), or ``None`` for a chain.
    """
    starts, offset = [], 0
    for n in num_rows:
        starts.append(offset)
        offset += n
    results: list[SequenceOutput | None] = [None] * len(seqs)

    plain = [i for i, d in enumerate(drafts) if not d]
    if plain:  # no drafts: exactly the ordinary sampling path
        rows = [SamplingRow.of(seqs[i]) for i in plain]
        # The other samples of an n > 1 request draw their first token from the same row,
        # each with its own generator (its own seq_id, its own seed).
        forked = [(i, child) for i in plain for child in seqs[i].forks]
        if not forked and len(plain) == logits.shape[0]:  # every row (no drafts anywhere): no copy
            plain_logits = logits
        else:
            picked = [starts[i] for i in plain] + [starts[i] for i, _ in forked]
            plain_logits = logits[torch.tensor(picked, device=logits.device)]
            rows += [SamplingRow.of(child) for _, child in forked]
        tokens, logprobs = sampler(plain_logits, rows)
        for i, tok, lp in zip(plain, tokens, logprobs, strict=False):
            results[i] = SequenceOutput([tok], logprobs=[lp] if lp is not None else None)
        for (i, _), tok, lp in zip(forked, tokens[len(plain):], logprobs[len(plain):], strict=True):
            out = results[i]
            assert out is not None
            if out.forks is None:
                out.forks = []
            out.forks.append(SequenceOutput([tok], logprobs=[lp] if lp is not None else None))

    spec = [i for i, d in enumerate(drafts) if d]
    parents_of = draft_parents or [None] * len(seqs)
    if spec:
        contexts = [ctx for i in spec for ctx in _contexts(seqs[i], drafts[i], parents_of[i])]
        rows = torch.cat([torch.arange(starts[i], starts[i] + num_rows[i]) for i in spec]).to(logits.device)
        spec_logits = logits[rows]
        probs = target_probs(sampler, spec_logits, contexts)
        raw_logprobs = None
        if any(seqs[i].params.logprobs is not None for i in spec):
            raw_logprobs = torch.log_softmax(spec_logits, dim=-1)
        at = 0
        for i in spec:
            seq, k = seqs[i], len(drafts[i])
            p = probs[at:at + k + 1]
            gen = None if seq.params.greedy else sampler.generator_for(contexts[at])
            q = draft_probs[i] if draft_probs is not None else None
            nodes = None
            if parents_of[i] is not None:
                tokens, nodes = accept_tree(p, drafts[i], parents_of[i], gen)
                accepted = len(nodes)
            else:
                tokens, accepted = accept_chain(p, drafts[i], q, gen)
            lps = None
            if raw_logprobs is not None and seq.params.logprobs is not None:
                rows_used = [0] + [c + 1 for c in nodes] if nodes is not None else range(len(tokens))
                lps = [_logprob(raw_logprobs[at + j], tok, seq.params.logprobs)
                       for j, tok in zip(rows_used, tokens, strict=False)]
            results[i] = SequenceOutput(tokens, num_accepted=accepted, num_drafted=k, logprobs=lps,
                                        accepted_nodes=nodes)
            at += k + 1
    return results  # type: ignore[return-value]


def _logprob(row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    top = []
    if n:
        vals, ids = row.topk(n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(row[token]), top)


def reference_chain(p: torch.Tensor, drafts: list[int], q: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the *first* emitted token, in closed form, for tests:
    ``P(t) = q(t) min(1, p(t)/q(t))`` summed over draft draws (here: the draft ``d`` is
    random with law ``q``), plus the rejection mass times the residual. Equals ``p[0]``
    whenever the rule is implemented right (Leviathan et al., appendix A.1)."""
    p0, q0 = p[0].double(), q[0].double()
    accept = torch.minimum(q0, p0)  # P(draft = t and accepted)
    residual = (p0 - q0).clamp_min(0.0)
    beta = accept.sum()
    if residual.sum() > 0:
        residual = residual / residual.sum()
    return accept + (1.0 - beta) * residual
