"""Structured outputs on the engine's side: one sequence's grammar state and the mask it
puts on a row of logits.

The grammar role (``register_grammars``, core/interfaces.py ``GrammarBackend``) compiles a
request's :class:`~tokenloom.core.sampling_params.Constraint`; each sequence holds a
:class:`GrammarState` around its backend matcher. The matcher holds exactly the sequence's
committed output tokens (``AsyncEngine._take_tokens`` accepts each one as it is appended);
preemption by recompute keeps a sequence's tokens, so the matcher stays where it was.

Ordering under ``engine.overlap``: the engine overlaps a step with the *publishing* of the
previous step's outputs (detokenising, streaming), never with its commit. A step's tokens
are committed, and so accepted by their matchers, in ``AsyncEngine._commit`` before the next
schedule, so every mask is filled after the row's previous token was accepted; a
constrained row costs the overlap nothing. What it does cost is on the step thread: one
``fill_bitmask`` per constrained row per step (plus one per draft position under a
speculative decoder) and the masking itself.

The mask applies in :meth:`~tokenloom.core.sampler.Sampler.apply_penalties`, before the
logit bias and every other rule, on every row the sampler sees. A speculative verification
row that has seen drafts gets the mask of the grammar *after* those drafts: the matcher is
advanced through them, the bitmask filled, and the drafts rolled back. A draft the grammar
forbids therefore has target probability 0 at its position and is always rejected, so
verification stays exact with respect to the masked target distribution (and the rows past
such a draft, whose mask is left open, are never used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenloom.core.interfaces import GrammarMatcher

_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarState:
    """A sequence's matcher and how many of its output tokens it has accepted."""

    __slots__ = ("matcher", "num_accepted", "_bitmask", "vocab_size", "dead_end")

    def __init__(self, matcher: GrammarMatcher, vocab_size: int):
        self.matcher = matcher
        self.num_accepted = 0
        self.vocab_size = vocab_size
        self._bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
        # the grammar allowed no token of the vocabulary after the committed tokens (one it
        # cannot spell): the engine ends the request with an error instead of sampling outside it
        self.dead_end = False

    def accept(self, token_id: int) -> bool:
        """Advance by one committed output token; False when the grammar forbids it (a stop
        token the grammar does not list, e.g. a ``stop_token_ids`` entry): the matcher is
        then left as it was."""
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Write the tokens allowed after the committed tokens and ``drafts`` into ``row`` of
        ``bitmask``; False (the row left as it was: no restriction) where a draft is itself
        forbidden (that row is never used: verification rejects the draft before it) or
        where a draft completed the grammar with a stop token (the sequence ends there; a
        terminated matcher has no next mask)."""
        m = self.matcher
        advanced = 0
        for d in drafts:
            if m.is_terminated() or not m.accept_token(d):
                break
            advanced += 1
        try:
            if advanced < len(drafts) or (advanced and m.is_terminated()):
                return False
            m.fill_bitmask(bitmask, row)
            return True
        finally:
            if advanced:
                m.rollback(advanced)

    def allowed(self, drafts: list[int] = ()) -> torch.Tensor | None:  # type: ignore[assignment]
        """``[vocab_size]`` bool: the tokens allowed after the committed tokens and ``drafts``;
        ``None`` (no restriction) where :meth:`fill` leaves its row alone."""
        if not self.fill(self._bitmask, 0, drafts):
            return None
        bits = (self._bitmask[0].unsqueeze(-1) >> _SHIFTS) & 1
        return bits.flatten()[:self.vocab_size].bool()


def apply_grammars(logits: torch.Tensor, rows: list[tuple[int, GrammarState, list[int]]]) -> None:
    """For each ``(i, state, drafts)``: row ``i`` of ``logits`` (in place) gets -inf where the
    grammar forbids a token after ``drafts``. Every row's matcher fills its own row of one
    bitmask; the bits are then unpacked and applied for all rows at once (a constrained
    batch costs one fill per row plus a handful of tensor ops, not a handful per row)."""
    if not rows:
        return
    V = logits.shape[-1]
    words = (max(V, max(s.vocab_size for _, s, _ in rows)) + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # -1: every token allowed
    filled = [j for j, (_, state, drafts) in enumerate(rows) if state.fill(bitmask, j, drafts)]
    if not filled:
        return
    if len(filled) < len(rows):
        bitmask = bitmask[filled]
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(filled), -1)
    allowed = bits[:, :V].bool()
    for k, j in enumerate(filled):  # ids past a grammar's vocabulary (logits wider than it) are forbidden
        if rows[j][1].vocab_size < V:
            allowed[k, rows[j][1].vocab_size:] = False
    for k in (~allowed.any(dim=1)).nonzero().flatten().tolist():
        if not rows[filled[k]][2]:  # (a row after drafts is only used if they are accepted: judged then)
            rows[filled[k]][1].dead_end = True
    index = torch.tensor([rows[j][0] for j in filled], device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
