"""Backend-neutral description of one step's attention work, built by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSpan:
    """One sequence whose ``q_len`` new tokens (rows q_start:q_end) attend to ``context_len``
    cached-plus-new tokens; ``q_len < context_len`` when earlier chunks or a prefix hit
    are already in the cache."""

    q_start: int
    q_end: int
    context_len: int
    block_table: list[int]
    # A draft tree in the span's last len(tree_parents) rows (see Batch.draft_parents): a
    # node attends to the context before the tree and to its ancestors and itself only.
    tree_parents: list[int] | None = None

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


@dataclass(slots=True)
class AttentionInputs:
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot of each new token
    block_size: int
    decode_rows: list[int] = field(default_factory=list)  # rows of single-token sequences
    decode_context_lens: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
