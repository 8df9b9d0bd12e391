"""One mutable Sequence carries a request through queue, cache, runner and back."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Order means something: every status >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its KV was dropped and will be recomputed
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5  # the client cancelled, left, or the server shut down
    FINISHED_ERROR = 6  # rejected or failed on our side
    FINISHED_TIMEOUT = 7  # past the request's deadline (SamplingParams.timeout_s)

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "aborted",
    SequenceStatus.FINISHED_ERROR: "error",
    SequenceStatus.FINISHED_TIMEOUT: "timeout",
}

_seq_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    """Token state of one request. ``token_ids`` is prompt + output.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix hits included);
    the scheduler advances it after each step; preemption resets it to 0.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache at first admission
    num_preemptions: int = 0
    cache_salt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    # Tokens a decoder proposed after the last step, for the next step to verify (see Batch).
    draft_token_ids: list[int] = field(default_factory=list)
    # A tree of drafts instead of a chain: draft_parents[i] is the index of node i's parent
    # (-1: the sequence's last token); nodes come parents first, depth by depth. None: a chain.
    draft_parents: list[int] | None = None
    # Which decoder proposed them, when the request's decoder chooses among several (`auto`);
    # None: the request's own decoder.
    drafted_by: str | None = None
    # The request's other samples (SamplingParams.n > 1) waiting for this sequence's prefill:
    # in the step that samples its first token, each samples its own first token from the
    # same logits row, then forks this sequence's KV blocks (AsyncEngine._fork_samples).
    forks: list[Sequence] = field(default_factory=list)
    # Structured outputs (params.constraint): a core.grammar.GrammarState, set once the
    # request's grammar has compiled (before the sequence is scheduled); it has accepted
    # exactly the sequence's output tokens.
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __hash__(self) -> int:
        return self.seq_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_len(self) -> int:
        """The most tokens this sequence can ever hold (prompt + max_tokens)."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


def draft_depths(parents: list[int]) -> list[int]:
    """Depth of each tree node (a child of the last token has depth 1)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@dataclass(slots=True)
class Batch:
    """What the scheduler hands the decoder for one step.

    ``num_scheduled_tokens[i]`` tokens of ``seqs[i]`` are run, starting at its
    ``num_computed_tokens``; a sequence whose scheduled tokens reach its end gets a new
    token sampled, a partial prefill chunk does not.

    ``draft_tokens[i]`` are proposed tokens run after those (speculative decoding): their KV
    goes into slots the scheduler reserved with ``allocate(seq, n, num_lookahead=k)``, the
    runner returns logits for them too, and the decoder verifies them. Only a sequence whose
    scheduled tokens reach its end carries drafts. ``num_batched_tokens`` counts them.
    ``draft_parents[i]`` (when not None) makes ``draft_tokens[i]`` a tree (see
    ``Sequence.draft_parents``): each node sees the context and its own ancestors only, at
    the position of its depth, and its KV sits in lookahead slot ``i`` until accepted.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (src block, dst block, num tokens): KV copies to make before the step (copy-on-write
    # of a partially shared block, from a prefix cache that shares at token granularity)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    draft_tokens: list[list[int]] = field(default_factory=list)
    draft_parents: list[list[int] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens) + sum(map(len, self.draft_tokens))

    @property
    def is_empty(self) -> bool:
        return not self.seqs
