"""The roles' contracts. The hot loop calls objects that satisfy these Protocols
directly; pluggy is only used at start-up to find the factories that build them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tokenloom.core.sequence import Batch, Sequence


@dataclass(slots=True)
class CacheStats:
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_tokens_stored: int  # tokens whose KV lives in allocated blocks
    num_reserved_slots: int  # token slots held by allocated blocks (>= tokens stored)
    num_evictions: int = 0
    num_cached_blocks: int = 0  # blocks kept for prefix reuse
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # prompt tokens found there

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        """Fraction of reserved slots that hold no token (internal + reservation waste)."""
        if not self.num_reserved_slots:
            return 0.0
        return 1.0 - self.num_tokens_stored / self.num_reserved_slots

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@runtime_checkable
class CacheManager(Protocol):
    """Owns KV block *ids* (the runner owns the tensors)."""

    block_size: int
    num_blocks: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks available right now (cheap: the engine reads it every step)."""

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Could ``seq`` at its maximum length fit an otherwise empty cache?"""

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool: ...

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens``
        tokens. All or nothing: returns False (and changes nothing) when it cannot."""

    def free(self, seq: Sequence) -> None: ...

    def match_prefix(self, seq: Sequence) -> int:
        """Prompt tokens a claim would find cached right now (read-only; 0 without caching)."""

    def claim_prefix(self, seq: Sequence) -> int:
        """At admission (nothing computed yet): take the longest cached prefix of ``seq``
        into its block table; returns its length in tokens (< the sequence's length)."""

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share ``parent``'s computed prefix with ``child``; returns the tokens shared."""

    def block_table(self, seq: Sequence) -> list[int]: ...

    def stats(self) -> CacheStats: ...

    def check_integrity(self) -> None:
        """Raise AssertionError when the internal bookkeeping is inconsistent."""


@runtime_checkable
class Scheduler(Protocol):
    def add(self, seq: Sequence) -> None: ...

    def schedule(self) -> Batch: ...

    def finish(self, seq: Sequence) -> None:
        """``seq`` is finished: drop it from the queues and give its blocks back."""

    def abort(self, request_id: str) -> Sequence | None: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


@runtime_checkable
class Decoder(Protocol):
    def step(self, batch: Batch) -> dict[Sequence, list[int]]:
        """Run one step; return the new tokens of each sequence that sampled this step."""


@runtime_checkable
class Backend(Protocol):
    """The hot ops the model calls. ``torch`` is the reference implementation."""

    name: str

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype) -> list:
        """One (k, v) pair of tensors per layer; their layout is the backend's business."""

    def prepare(self, meta: Any) -> Any:
        """Build per-step attention metadata once, before the layers run."""

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None: ...

    def copy_blocks(self, kv_caches, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first n slots of block src into block dst, in every layer."""

    def attention(self, q, k_cache, v_cache, meta, scale: float): ...

    def rms_norm(self, x, weight, eps: float): ...

    def linear(self, x, weight, bias=None): ...

    def silu_mul(self, gate, up): ...
