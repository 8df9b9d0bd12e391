"""`radix`: a RadixAttention-style prefix cache (SGLang) over a paged block pool.

A radix tree over token ids records, for every cached token, the block that holds its
KV (at offset ``position % block_size``, as in any block table). A new request takes the
longest matching prefix, token-exact: whole blocks are shared by reference, and a
prefix that ends inside a block is reused too, by copying its first tokens into a fresh
block (a copy-on-write the runner performs before the step), which hash-chained full
blocks cannot do. Nodes in use by a running request are locked; when the pool runs dry,
unlocked leaves are evicted least-recently-used first.

Reference counts: ``ref[b]`` = block tables holding ``b`` + tree nodes whose token span
uses ``b``; a block returns to the free pool at zero. ``check_integrity`` recomputes it.

Block states (see ``CacheStats``): ``pin[b]`` = block tables holding ``b`` + *locked* tree
nodes whose span uses ``b``. A block is *used* while pinned, *cached* when only unlocked
nodes hold it (eviction can reclaim it), and *free* in the pool. The count of pinned
blocks is kept up to date, so every count is O(1).
"""

from __future__ import annotations

import heapq
import itertools

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, CacheStats
from tokenloom.core.sequence import Sequence
from tokenloom.core.utils import cdiv


class RadixOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class Node:
    __slots__ = ("tokens", "blocks", "children", "parent", "lock", "last_access")

    def __init__(self, tokens: list[int], blocks: list[int], parent: Node | None):
        self.tokens, self.blocks, self.parent = tokens, blocks, parent
        self.children: dict[int, Node] = {}
        self.lock = 0
        self.last_access = 0


class RadixCacheManager:
    prefix_caching = True

    def __init__(self, options: RadixOptions | None, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.roots: dict[str | None, Node] = {None: Node([], [], None)}  # one tree per cache_salt
        self._ref = [0] * num_blocks
        self._pin = [0] * num_blocks
        self._num_used = 0  # blocks with pin > 0
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._lookahead: dict[int, int] = {}  # slots held past the tokens for drafts (max so far)
        self._locked: dict[int, Node] = {}  # seq -> deepest node it locked (the path up is locked)
        self._copies: list[tuple[int, int, int]] = []
        self._clock = itertools.count(1)
        self.num_evictions = self.prefix_queries = self.prefix_hits = 0

    # ---- tree ---------------------------------------------------------------------
    def _root(self, salt: str | None) -> Node:
        """Tenants with different salts get separate trees, so they never share a block."""
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node([], [], None)
        return root

    def _match(self, root: Node, tokens: list[int], limit: int, split: bool) -> tuple[Node, list[int]]:
        """Deepest node matching ``tokens[:limit]`` and the block of each matched position.
        With ``split``, a match ending inside a node splits it there."""
        node, pos, blocks = root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = 0
            while n < len(child.tokens) and pos + n < limit and child.tokens[n] == tokens[pos + n]:
                n += 1
            if n < len(child.tokens):
                if not split:
                    blocks += child.blocks[:n]
                    break
                child = self._split(child, n)
            child.last_access = now
            blocks += child.blocks
            pos += n
            node = child
        return node, blocks

    def _split(self, node: Node, k: int) -> Node:
        top = Node(node.tokens[:k], node.blocks[:k], node.parent)
        top.lock, top.last_access = node.lock, node.last_access
        node.parent.children[top.tokens[0]] = top
        node.tokens, node.blocks, node.parent = node.tokens[k:], node.blocks[k:], top
        top.children[node.tokens[0]] = node
        for b in set(top.blocks) & set(node.blocks):  # a block now spans two nodes
            self._ref[b] += 1
            if top.lock:
                self._pin_block(b, 1)
        return top

    def _insert(self, root: Node, tokens: list[int], blocks: list[int]) -> None:
        node, matched = self._match(root, tokens, len(tokens), split=True)
        pos = len(matched)
        if pos < len(tokens):
            leaf = Node(tokens[pos:], blocks[pos:], node)
            leaf.last_access = next(self._clock)
            node.children[leaf.tokens[0]] = leaf
            for b in set(leaf.blocks):
                self._ref[b] += 1

    @staticmethod
    def _path(node: Node) -> list[Node]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out

    def _evict(self, need: int) -> None:
        leaves = [(n.last_access, id(n), n) for n in self._iter_nodes() if not n.children and not n.lock]
        heapq.heapify(leaves)
        while len(self._free) < need and leaves:
            _, _, leaf = heapq.heappop(leaves)
            del leaf.parent.children[leaf.tokens[0]]
            for b in set(leaf.blocks):
                self._release(b)
            self.num_evictions += 1
            parent = leaf.parent
            if parent.parent is not None and not parent.children and not parent.lock:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))

    def _iter_nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _pin_block(self, block: int, delta: int) -> None:
        before = self._pin[block]
        self._pin[block] = after = before + delta
        self._num_used += (after > 0) - (before > 0)

    def _lock_path(self, node: Node, delta: int) -> None:
        """Lock (+1) or unlock (-1) ``node`` and its ancestors; a node's blocks are pinned
        while it is locked at all."""
        for n in self._path(node):
            before = n.lock
            n.lock += delta
            if (before > 0) != (n.lock > 0):
                for b in set(n.blocks):
                    self._pin_block(b, delta)

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def _take(self, count: int) -> list[int] | None:
        if len(self._free) < count:
            self._evict(count)
        if len(self._free) < count:
            return None
        out = [self._free.pop() for _ in range(count)]
        for b in out:
            self._ref[b] = 1
        return out

    def _evictable_blocks(self) -> int:
        """Blocks eviction could free right now (those only unlocked tree nodes hold):
        the cached ones. (Every descendant of an unlocked node is unlocked, so a whole
        unlocked subtree can go, leaves first.)"""
        return self.num_blocks - len(self._free) - self._num_used

    # ---- the cache-manager contract ---------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        if seq.num_computed_tokens:
            return 0
        return len(self._match(self._root(seq.cache_salt), seq.token_ids, seq.num_tokens - 1, split=False)[1])

    def claim_prefix(self, seq: Sequence) -> int:
        if seq.num_computed_tokens or seq.seq_id in self._tables:
            return 0
        root = self._root(seq.cache_salt)
        node, pos_blocks = self._match(root, seq.token_ids, seq.num_tokens - 1, split=True)
        m, bs = len(pos_blocks), self.block_size
        table = [pos_blocks[min((k + 1) * bs, m) - 1] for k in range(m // bs)]
        for b in table:
            self._ref[b] += 1
            self._pin_block(b, 1)
        if m % bs:
            self._lock_path(node, 1)  # lock first: the copy source must survive eviction
            dst = self._take(1)
            self._lock_path(node, -1)
            if dst is None:
                m -= m % bs
                node, _ = self._match(root, seq.token_ids, m, split=True)
            else:
                self._copies.append((pos_blocks[m - 1], dst[0], m % bs))
                table.append(dst[0])
                self._pin_block(dst[0], 1)
        self._lock_path(node, 1)
        self._locked[seq.seq_id] = node
        self._tables[seq.seq_id] = table
        self._num_tokens[seq.seq_id] = m
        if not seq.num_preemptions:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += m
        return m

    def take_copies(self) -> list[tuple[int, int, int]]:
        """(src block, dst block, tokens) copies the runner must do before the next step."""
        out, self._copies = self._copies, []
        return out

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def can_ever_fit(self, seq: Sequence) -> bool:
        return cdiv(seq.max_len, self.block_size) <= self.num_blocks

    def _need(self, seq: Sequence, num_new_tokens: int) -> int:
        have = len(self._tables.get(seq.seq_id, ()))
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        need = self._need(seq, num_new_tokens + num_lookahead)
        return need <= len(self._free) or need <= len(self._free) + self._evictable_blocks()

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        table = self._tables.get(seq.seq_id)
        if table and seq.num_computed_tokens <= seq.num_prompt_tokens:
            self._cache_computed(seq)  # share a prompt while it is still being prefilled
        blocks = self._take(self._need(seq, num_new_tokens + num_lookahead))
        if blocks is None:
            return False
        self._tables.setdefault(seq.seq_id, []).extend(blocks)
        for b in blocks:
            self._pin_block(b, 1)
        self._locked.setdefault(seq.seq_id, self._root(seq.cache_salt))
        self._num_tokens[seq.seq_id] = max(self._num_tokens.get(seq.seq_id, 0),
                                           seq.num_computed_tokens + num_new_tokens)
        if num_lookahead:
            self._lookahead[seq.seq_id] = max(self._lookahead.get(seq.seq_id, 0), seq.num_computed_tokens
                                              + num_new_tokens + num_lookahead - self._num_tokens[seq.seq_id])
        return True

    def _cache_computed(self, seq: Sequence) -> None:
        table, bs, n = self._tables[seq.seq_id], self.block_size, seq.num_computed_tokens
        if n:
            self._insert(self._root(seq.cache_salt), seq.token_ids[:n], [table[p // bs] for p in range(n)])

    def free(self, seq: Sequence) -> None:
        if seq.seq_id not in self._tables:
            return
        self._cache_computed(seq)
        self._lock_path(self._locked.pop(seq.seq_id, self._root(seq.cache_salt)), -1)
        for b in self._tables.pop(seq.seq_id):
            self._pin_block(b, -1)
            self._release(b)
        self._num_tokens.pop(seq.seq_id, None)
        self._lookahead.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share what ``parent`` has computed: insert it, then claim it for ``child``."""
        if parent.seq_id in self._tables:
            self._cache_computed(parent)
        return self.claim_prefix(child)

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables.get(seq.seq_id, [])

    def stats(self) -> CacheStats:
        cached = self.num_blocks - len(self._free) - self._num_used
        return CacheStats(self.num_blocks, len(self._free), self.block_size,
                          num_tokens_stored=sum(self._num_tokens.values()),
                          num_reserved_slots=sum(len(t) for t in self._tables.values()) * self.block_size,
                          num_evictions=self.num_evictions, num_cached_blocks=cached,
                          prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits)

    def block_states(self) -> bytes:
        return bytes(BLOCK_USED if pin else BLOCK_CACHED if ref else BLOCK_FREE
                     for pin, ref in zip(self._pin, self._ref, strict=True))

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for sid, table in self._tables.items():
            tokens, extra = self._num_tokens[sid], self._lookahead.get(sid, 0)
            assert cdiv(tokens, self.block_size) <= len(table) <= cdiv(tokens + extra, self.block_size), \
                f"seq {sid}: table size"
            for b in table:
                refs[b] += 1
        locks: dict[int, int] = {}
        for node in self._locked.values():
            for n in self._path(node):
                locks[id(n)] = locks.get(id(n), 0) + 1
        for n in self._iter_nodes():
            assert len(n.tokens) == len(n.blocks) > 0, "node with no tokens or a block per token"
            assert n.parent.children.get(n.tokens[0]) is n, "child indexed under the wrong token"
            assert n.lock == locks.get(id(n), 0), "lock count disagrees with running sequences"
            for b in set(n.blocks):
                refs[b] += 1
        assert refs == self._ref, "reference counts disagree with tables and tree"
        pins, held = [0] * self.num_blocks, [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                pins[b] += 1
        for n in self._iter_nodes():
            for b in set(n.blocks):
                if n.lock:
                    pins[b] += 1
                else:
                    held[b] += 1
        assert pins == self._pin, "pin counts disagree with tables and locked nodes"
        assert self._num_used == sum(1 for p in pins if p), "used count drifted"
        evictable = sum(1 for b in range(self.num_blocks) if refs[b] and held[b] == refs[b])
        assert self._evictable_blocks() == evictable, "cached count disagrees with unlocked-only blocks"
        assert sorted(self._free) == [b for b in range(self.num_blocks) if refs[b] == 0], "free != unreferenced"


@hookimpl
def register_cache_managers(register):
    register("radix", RadixCacheManager, options=RadixOptions,
             description="radix tree prefix cache (RadixAttention), token-exact reuse, LRU leaves")
