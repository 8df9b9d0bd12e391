"""Turn logits into tokens: logit bias, penalties, temperature, top-k, top-p, min-p, seeds,
logprobs.

All rows are processed together; a seeded request draws its noise from its own
``torch.Generator``, so its output does not depend on what else is in the batch.
Sampling uses the exponential-race form ``argmax(p / E)``, E ~ Exp(1), which draws
exactly from ``p`` and lets each row use its own generator.

Each row of logits comes with a :class:`SamplingRow`: what the sampler reads of the
sequence behind it. A sequence's last token gives ``SamplingRow.of(seq)``; a row that
verifies a draft gives ``SamplingRow.of(seq, drafts_before_it)`` (its penalties see them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from tokenloom.core.grammar import GrammarState, apply_grammars
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), best first


class SamplingRow(NamedTuple):
    """What the sampler reads for one row of logits: the request's ``params``, the token
    history its penalties look at (``token_ids``: prompt, output so far and, for a row that
    verifies a draft, the drafts before it), where the prompt ends in it (the rest is output:
    frequency and presence penalties), and the sequence's id (a seeded request draws from a
    generator of its own, kept per ``seq_id``)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int
    grammar: GrammarState | None = None  # structured outputs: the sequence's matcher (core/grammar.py)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @classmethod
    def of(cls, seq: Sequence, drafts: list[int] | None = None) -> SamplingRow:
        """``seq``'s row after ``drafts`` (none: its own tokens, not copied)."""
        return cls(seq.params, seq.token_ids + drafts if drafts else seq.token_ids, seq.num_prompt_tokens, seq.seq_id,
                   seq.grammar)


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu",
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``argmax``: the backend's (``Backend.argmax``), ``torch.argmax(x, -1)`` if None."""
        self.device = torch.device(device)
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop its generator (a seeded request's)."""
        self._seq_generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [B, V] float32, one row per entry of ``rows``: a token for each, and its
        logprobs where the request asked for them."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.apply_penalties(logits, rows)
        tokens = self.argmax(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            sub = [rows[i] for i in random_rows]
            tokens[idx] = self._sample(logits[idx], sub)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                n = r.params.logprobs
                if n is None:
                    continue
                lp = raw_logprobs[i]
                top = []
                if n:
                    vals, ids = lp.topk(n)
                    top = list(zip(ids.tolist(), vals.tolist(), strict=True))
                logprobs[i] = TokenLogprob(token_list[i], lp[token_list[i]].item(), top)
        return token_list, logprobs

    def apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """What comes before temperature and the filters, in this order: the grammar's mask
        (structured outputs: tokens the row's grammar forbids, after the row's drafts, become
        -inf; core/grammar.py), ``logit_bias`` (added
        first, as OpenAI and vLLM do; -100 bans a token: -inf), then repetition, presence and
        frequency penalties, each row over its own history. The same tensor back when no
        row has any of them. Every row the sampler sees goes through here (verification
        rows too, :func:`~tokenloom.plugins.decoders.verify.target_probs`)."""
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
                     or r.params.presence_penalty or r.params.frequency_penalty]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not penalised and not biased and not constrained:
            return logits
        logits = logits.clone()
        V = logits.shape[-1]
        grammars = []
        for i in constrained:
            r = rows[i]
            g = r.grammar
            assert g is not None
            grammars.append((i, g, r.token_ids[r.num_prompt_tokens + g.num_accepted:]))
        apply_grammars(logits, grammars)
        for i in biased:
            ids, bias = _bias_tensors(rows[i].params.logit_bias or {}, V, logits.device, logits.dtype)
            logits[i, ids] += bias
        for i in penalised:
            p = rows[i].params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(rows[i].token_ids)), dtype=torch.long, device=logits.device)
                seen = seen[seen < V]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
                if out.numel():
                    counts = torch.bincount(out[out < V], minlength=V).to(logits.dtype)
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row's token is drawn from: [B, V], rows sum to 1.

        ``logits`` are already penalised (see ``apply_penalties``). Temperature, then top-k and
        top-p on the scaled logits, then min-p on the probabilities. A greedy row is a one-hot
        at the argmax, as ``__call__`` picks it. Public so tests can check every sampled token
        against the distribution it came from.
        """
        greedy = [r.params.greedy for r in rows]
        # A greedy row is scaled by 1: its temperature may be 0 or too small to divide by.
        temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)]
        scaled = logits / torch.tensor(temps, device=logits.device)[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_p):
            # thresh <= max in float32, so the most likely token always survives; a tiny min_p
            # rounds thresh to 0 and drops nothing.
            thresh = torch.tensor(min_p, device=probs.device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if any(greedy):
            one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
            probs = torch.where(torch.tensor(greedy, device=probs.device)[:, None], one_hot, probs)
        return probs

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = self.probs(logits, rows)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=self.generator_for(r))
        # A zero draw would make 0/0 = nan, which argmax picks: clamp it to the smallest normal
        # float (a change of ~1e-38 in probability) so a token of probability 0 never wins.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return self.argmax(probs / noise)

    def generator_for(self, row: SamplingRow) -> torch.Generator:
        """The generator ``row``'s draws come from: the shared one, or for a seeded request
        its own (one per ``seq_id``, kept until :meth:`forget`)."""
        if row.params.seed is None:
            return self.generator
        gen = self._seq_generators.get(row.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._seq_generators[row.seq_id] = gen
        return gen


def _bias_tensors(bias: dict[int, float], V: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, values to add) of a logit_bias: ids past ``V`` skipped (a draft model's
    smaller vocabulary), -100 and below as -inf (a ban, whatever the logits' scale)."""
    items = [(t, float("-inf") if v <= -100 else float(v)) for t, v in bias.items() if t < V]
    ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=device)
    return ids, torch.tensor([v for _, v in items], dtype=dtype, device=device)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else V for kk in top_k], device=logits.device)[:, None]
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=logits.device)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop = mass_before >= p  # keeps the smallest set whose mass reaches p
    drop[:, 0] = False  # the most likely token always stays, even if a tiny top_p is 0 in float32
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
