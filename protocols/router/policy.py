"""The router's routing decision, as pure functions and one small data structure.

:class:`PrefixIndex` is an approximate, bounded picture of what one replica's prefix cache
holds: the canonical text of every prompt routed there (and of each answer, as the next
turn of that conversation will repeat it), cut into blocks of ``block_chars`` characters
chained by hash (block *i*'s key hashes block *i-1*'s key with its own text, so a key
stands for the whole prefix up to it, as in a paged KV cache's block hashes). A lookup
counts the leading blocks present. Eviction is least recently used, and a prefix's blocks
are touched from its end back to its start, so a chain loses its leaves before its root.
:func:`route` is the policy itself (see :mod:`tokenloom.protocols.router.server`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.protocols.websocket.messages import Generate

_ROLE_END, _TURN_END, _SALT_END = "\x1f", "\x1e", "\x1d"  # never in a role name; rare in text


def render_turn(role: str, content: str) -> str:
    """One chat message; turns are self-terminated, so a conversation's rendering is a
    prefix of its next turn's."""
    return f"{role}{_ROLE_END}{content}{_TURN_END}"


def canonical_text(msg: Generate) -> str:
    """The text the index sees for a request: the prompt, the rendered messages, or the
    token ids as digits. A ``cache_salt`` leads, since tenants never share KV."""
    head = f"{msg.cache_salt}{_SALT_END}" if msg.cache_salt else ""
    if msg.prompt is not None:
        return head + msg.prompt
    if msg.messages is not None:
        return head + "".join(render_turn(m.role, m.content) for m in msg.messages)
    return head + "".join(f"{t}," for t in msg.prompt_token_ids or ())


def continued_text(msg: Generate, text: str, token_ids: Sequence[int]) -> str:
    """The prompt the same conversation's next request starts with, once this one has
    answered: the messages plus the answer as an assistant turn, the raw prompt plus its
    completion, or the ids plus the generated ids."""
    base = canonical_text(msg)
    if msg.prompt is not None:
        return base + text
    if msg.messages is not None:
        return base + render_turn("assistant", text)
    return base + "".join(f"{t}," for t in token_ids)


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained keys of the full blocks of ``text`` (a partial last block is not indexed)."""
    keys, prev = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        prev = hash((prev, text[start:start + block_chars]))
        keys.append(prev)
    return keys


class PrefixIndex:
    """Block keys of the prefixes routed to one replica, at most ``max_chars`` worth."""

    def __init__(self, block_chars: int = 16, max_chars: int = 1 << 22):
        if block_chars < 1:
            raise ValueError(f"block_chars must be >= 1, got {block_chars}")
        self.block_chars = block_chars
        self.max_blocks = max(1, max_chars // block_chars)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def chars(self) -> int:
        return len(self._blocks) * self.block_chars

    def match(self, keys: Sequence[int]) -> int:
        """Characters of the longest indexed prefix (a lookup does not refresh recency)."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n * self.block_chars

    def insert(self, keys: Sequence[int]) -> None:
        blocks = self._blocks
        for key in reversed(keys):  # the root ends most recent: leaves are evicted first
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.evictions += 1


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that is up, as the policy sees it."""

    index: int  # position in the router's replica list
    in_flight: int
    matched: int  # characters of the prompt its index holds


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    reason: str  # cache | load
    matched: int


def route(candidates: Sequence[Candidate], prompt_chars: int, *, cache_threshold: float,
          balance_abs_threshold: int, rr: int = 0) -> Decision:
    """The longest match if it covers ``cache_threshold`` of the prompt and its replica is
    not more than ``balance_abs_threshold`` requests busier than the least loaded one;
    else the least loaded (ties: the first at or after ``rr``, the round-robin cursor)."""
    if not candidates:
        raise ValueError("no replica to route to")
    least = min(c.in_flight for c in candidates)
    best = max(candidates, key=lambda c: (c.matched, -c.in_flight))
    if (best.matched > 0 and best.matched >= cache_threshold * prompt_chars
            and best.in_flight - least <= balance_abs_threshold):
        return Decision(best.index, "cache", best.matched)
    span = max(c.index for c in candidates) + 1
    pick = min((c for c in candidates if c.in_flight == least), key=lambda c: (c.index - rr) % span)
    return Decision(pick.index, "load", pick.matched)
