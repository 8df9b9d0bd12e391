"""The backend conformance kit (``tokenloom.testing.check_backend``): every op of the
``Backend`` protocol against the ``torch`` backend, at odd shapes.

A backend may compute differently, never something else. :func:`check_backend` builds the
backend under test and the reference (``torch``, its plain-torch attention) on the same
device and drives both through the same work, per :class:`BackendCase` (GQA ratios 1, 3
and 8; head dims 64 and 128; block sizes 16 and 32; contexts that end inside a block; steps
with no decode rows or no prefill chunks; a long decode context), per dtype and per KV-cache
dtype (``auto``, ``fp8``, ``int8``):

1. ``write_kv`` of a random history into shuffled block tables;
2. a step of decode rows and prefill chunks (some with cached context) interleaved:
   ``write_kv`` then ``attention``, after ``prepare``;
3. a decode-only step the model's two ways: ``write_kv`` + ``attention``, and
   ``decode_attention_block`` (RoPE, KV write, attention; skipped when it returns None);
4. ``copy_blocks`` (a full block and a partial one) and ``move_kv_slots``, each checked by
   attention through a block table that points at the copies;
5. ``rms_norm``, ``add_rms_norm`` (with and without a delta), ``silu_mul``, ``argmax`` (ties
   and NaN included: the same index exactly);
6. ``pack_linear(spec).apply(x)`` at 1, 3 and 17 rows for a dense weight, 4-bit
   (group-wise and act-order), 8-bit and fp8 specs, against the dense matmul of the
   dequantised weight;
7. ``capture_decode``: a two-layer LLaMA (random weights, head dim 64, GQA 2), a Qwen2-like
   one (q/k/v biases) and a Qwen3-like one (per-head q/k RMSNorm, head dim 128) on the
   backend under test each prefill three prompts, then three decode steps each run by the
   captured step and by the same model op by op (skipped when it captures nothing);
8. ``kv_bytes_per_token`` (what the engine sizes its KV pool with) against the bytes of
   the tensors a pool from ``allocate_kv_cache`` really holds, per dtype and KV-cache dtype;
9. sliding-window and soft-capped attention (``attention(..., window=, softcap=)``), per
   :class:`WindowCase` (a window shorter than most contexts: decode rows shorter and longer
   than it, a prompt from scratch, chunks over a cached prefix; a soft-cap small enough to
   bite; both at once), a mixed step and then a decode-only step, against the kit's own
   float32 reference (a plain masked softmax over the K/V the reference pool holds), not
   against the torch backend. A backend that refuses a feature with a ConfigError at the call
   (as the Backend contract allows) is reported as not supported: ``None`` for that op.

KV pools are opaque: a backend's layout is its own, so the pools are compared directly only
where they have the torch backend's form (same type, shape and dtype); otherwise the KV
write is checked through attention. A mismatch raises :class:`ConformanceError` naming the
op, the shape, the dtypes, and where: the largest difference, its index and both values.

Tolerances are per dtype (:data:`TOLERANCES`): ``|got - want| <= atol * max(1, max|want|)
+ rtol * |want|``. Quantised weights get the bfloat16 tolerance whatever the dtype (the
torch backend's CPU kernels for them take bfloat16 activations), 8-bit KV pools an extra
``atol`` of about one quantisation step (:data:`KV8_ATOL`).

Use it from a third-party backend's tests::

    from tokenloom.testing import check_backend

    def test_my_backend_conforms():
        check_backend("my-backend", plugins=[my_plugin_module], device="cuda")

``backend`` is a registered name (looked up with ``plugins`` registered, built by its
factory with ``options``) or a factory ``(options, device) -> Backend``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.core.attention import AttentionInputs, PrefillSpan, apply_rope
from tokenloom.core.errors import ConfigError
from tokenloom.core.weights import Fp8Weight, QuantizedWeight, dequantize
from tokenloom.testing import ConformanceError

#: dtype -> (atol, rtol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
#: extra atol for 8-bit KV pools: about one quantisation step of a unit-scale value
KV8_ATOL = {"auto": 0.0, "fp8": 0.07, "int8": 0.01}


@dataclass(frozen=True, slots=True)
class BackendCase:
    """One attention shape: heads, KV heads, head dim, block size, one decode row per entry of
    ``decode_context_lens`` and one prefill chunk per ``(q_len, context_len)``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_context_lens: tuple[int, ...] = ()
    prefills: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return (f"heads={self.num_heads} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"block_size={self.block_size} decode_context_lens={list(self.decode_context_lens)} "
                f"prefills(q_len, context_len)={list(self.prefills)}")


KIT_BACKEND_CASES: tuple[BackendCase, ...] = (
    BackendCase(4, 4, 64, 16, (1, 17, 40), ((5, 5), (7, 29))),  # GQA 1, mixed
    BackendCase(6, 2, 128, 32, (45, 70, 33)),  # GQA 3, no prefill
    BackendCase(8, 1, 64, 16, (), ((13, 13), (3, 41), (1, 18))),  # GQA 8, no decode
    BackendCase(8, 1, 128, 32, (1100, 9), ((20, 50),)),  # GQA 8, a long context (split-K)
)


@dataclass(frozen=True, slots=True)
class WindowCase:
    """A sliding-window (``window`` tokens) and/or soft-capped (``softcap``) layer's attention
    over the sequences of ``case``; None: without that feature."""

    case: BackendCase
    window: int | None = None
    softcap: float | None = None

    @property
    def feature(self) -> str:
        return " + ".join(name for name, on in (("sliding window", self.window is not None),
                                                 ("soft-cap", self.softcap is not None)) if on)

    def __str__(self) -> str:
        return f"{self.case}; window={self.window} softcap={self.softcap}"


_WINDOW_SHAPE = BackendCase(6, 2, 64, 16, (5, 24, 61), ((40, 40), (9, 50), (3, 30)))
KIT_WINDOW_CASES: tuple[WindowCase, ...] = (
    # decode contexts shorter than, equal to and longer than the window; a prompt from scratch
    # longer than it; a chunk and a last token with drafts over a cached prefix
    WindowCase(_WINDOW_SHAPE, window=24),
    WindowCase(_WINDOW_SHAPE, softcap=5.0),
    WindowCase(BackendCase(8, 1, 128, 32, (70, 9), ((37, 37), (6, 66))), window=20, softcap=5.0),  # GQA 8
)


def _close(op: str, where: str, got, want, atol: float, rtol: float) -> float:
    """Raise ConformanceError unless ``got`` matches ``want``; returns the max abs diff."""
    if not isinstance(got, torch.Tensor):
        raise ConformanceError(f"{op} [{where}]: returned {type(got).__name__}, want a tensor")
    if got.shape != want.shape:
        raise ConformanceError(f"{op} [{where}]: returned shape {list(got.shape)}, want {list(want.shape)}")
    if got.dtype != want.dtype:
        raise ConformanceError(f"{op} [{where}]: returned {got.dtype}, want {want.dtype}")
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    if not g.numel():
        return 0.0
    diff = (g - w).abs().nan_to_num(nan=float("inf"))
    allowed = atol * max(1.0, float(w.abs().max())) + rtol * w.abs()
    bad = diff > allowed
    if bool(bad.any()):
        flat = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        raise ConformanceError(
            f"{op} [{where}]: max abs diff {float(diff.max()):.4g} at index {list(idx)} "
            f"(got {float(g[idx]):.6g}, want {float(w[idx]):.6g}, allowed {float(allowed[idx]):.3g}); "
            f"{int(bad.sum())} of {g.numel()} elements outside atol={atol:g} rtol={rtol:g}")
    return float(diff.max())


def _pools_comparable(got_pool, want_pool) -> bool:
    return type(got_pool) is type(want_pool) and got_pool.shape == want_pool.shape and got_pool.dtype == want_pool.dtype


def pool_bytes(pool: Any) -> int:
    """The bytes of the distinct tensor storages reachable from ``pool`` (an opaque KV pool:
    tensors inside lists, tuples, dicts and objects' fields), each storage counted once."""
    storages: dict[tuple[int, str], int] = {}
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > 6 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, torch.dtype, torch.device)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[(storage.data_ptr(), str(obj.device))] = storage.nbytes()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                walk(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
        else:
            names = [n for klass in type(obj).__mro__ for n in getattr(klass, "__slots__", ())]
            values = [getattr(obj, n, None) for n in names] + list(getattr(obj, "__dict__", {}).values())
            for item in values:
                walk(item, depth + 1)

    walk(pool, 0)
    return sum(storages.values())


def _slots_of(pool, slots: torch.Tensor) -> torch.Tensor:
    """float32 [kv_heads, len(slots), head_dim] of a torch-layout pool, dequantised."""
    kv_heads, _, _, head_dim = pool.shape
    if isinstance(pool, torch.Tensor):
        return pool.view(kv_heads, -1, head_dim)[:, slots].float()
    data = pool.data.view(kv_heads, -1, head_dim)[:, slots].float()  # QuantizedKV
    return data * pool.scale.view(kv_heads, -1)[:, slots].float().unsqueeze(-1)


class _Kit:
    """One backend under test and the reference, driven through the same calls."""

    def __init__(self, cand, ref, device: torch.device, seed: int, tolerances: dict):
        self.cand, self.ref, self.device = cand, ref, device
        self.gen = torch.Generator().manual_seed(seed)
        self.tolerances = tolerances
        self.report: dict[str, float | None] = {}

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(device=self.device, dtype=dtype)

    def check(self, op: str, where: str, got, want, dtype: torch.dtype, extra_atol: float = 0.0) -> None:
        atol, rtol = self.tolerances[dtype]
        diff = _close(op, where, got, want, atol + extra_atol, rtol)
        self.report[op] = max(self.report.get(op) or 0.0, diff)

    @property
    def backends(self) -> tuple[Any, Any]:
        return self.cand, self.ref

    # ---- attention and the KV cache ---------------------------------------------
    def attention_case(self, case: BackendCase, dtype: torch.dtype, kv_dtype: str) -> None:
        where = f"{case}; dtype={str(dtype).removeprefix('torch.')} kv_cache_dtype={kv_dtype}"
        H, KVH, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
        extra = KV8_ATOL[kv_dtype]
        seqs = [(n, 1) for n in case.decode_context_lens] + [(n, q) for q, n in case.prefills]
        need = [(n + 4 + bs - 1) // bs for n, _ in seqs]  # room for the decode step's token and a draft chain
        num_blocks = sum(need) + 4
        perm = torch.randperm(num_blocks, generator=self.gen).tolist()
        tables, spare = [], perm[sum(need):]
        for k in need:
            tables.append(perm[:k])
            perm = perm[k:]
        pools = [b.allocate_kv_cache(1, num_blocks, bs, KVH, D, dtype, kv_dtype)[0] for b in self.backends]

        def slots(i: int, positions) -> list[int]:
            return [tables[i][p // bs] * bs + p % bs for p in positions]

        # 1. the cached history, written in a shuffled order
        hist = [s for i, (n, q) in enumerate(seqs) for s in slots(i, range(n - q))]
        if hist:
            order = torch.randperm(len(hist), generator=self.gen)
            mapping = torch.tensor(hist, device=self.device)[order.to(self.device)]
            k, v = self.randn(len(hist), KVH, D, dtype=dtype), self.randn(len(hist), KVH, D, dtype=dtype)
            for backend, (kc, vc) in zip(self.backends, pools, strict=True):
                backend.write_kv(kc, vc, k, v, mapping)
            self.compare_pools("write_kv", where, pools, mapping, dtype, extra)

        # 2. one step: decode rows and prefill chunks interleaved
        items = torch.randperm(len(seqs), generator=self.gen).tolist()
        inp = AttentionInputs(slot_mapping=None, block_size=bs)  # type: ignore[arg-type]
        mapping, row = [], 0
        for i in items:
            n, q = seqs[i]
            mapping += slots(i, range(n - q, n))
            if i < len(case.decode_context_lens):
                inp.decode_rows.append(row)
                inp.decode_context_lens.append(n)
                inp.decode_block_tables.append(tables[i])
            else:
                inp.prefills.append(PrefillSpan(row, row + q, n, tables[i]))
            row += q
        inp.slot_mapping = torch.tensor(mapping, dtype=torch.long, device=self.device)
        q, k, v = (self.randn(row, H, D, dtype=dtype), self.randn(row, KVH, D, dtype=dtype),
                   self.randn(row, KVH, D, dtype=dtype))
        self.step("attention", where, inp, pools, q, k, v, dtype, extra)

        # 3. a decode-only step: every decode sequence's next token, both of the model's ways
        decodes = list(range(len(case.decode_context_lens)))
        if decodes:
            lens = [seqs[i][0] + 1 for i in decodes]
            inp = AttentionInputs(slot_mapping=torch.tensor([slots(i, [n - 1])[0] for i, n in zip(decodes, lens,
                                                                                                    strict=True)],
                                                            dtype=torch.long, device=self.device),
                                  block_size=bs, decode_rows=list(range(len(decodes))), decode_context_lens=lens,
                                  decode_block_tables=[tables[i] for i in decodes])
            self.decode_block(where, inp, pools, lens, case, dtype, extra)

            # 3b. a draft chain: one sequence's next three tokens as decode rows sharing its
            # block table (core/attention.py AttentionInputs): every row's KV is written before
            # any row attends, row j seeing the context up to itself
            first = decodes[0]
            chain = [lens[0] + 1 + j for j in range(3)]
            inp = AttentionInputs(slot_mapping=torch.tensor(slots(first, [n - 1 for n in chain]), dtype=torch.long,
                                                            device=self.device),
                                  block_size=bs, decode_rows=[0, 1, 2], decode_context_lens=chain,
                                  decode_block_tables=[tables[first]] * 3)
            self.decode_block(f"{where}; a draft chain as decode rows", inp, pools, chain, case, dtype, extra)

        # 4. copy_blocks and move_kv_slots, read back through attention
        self.copies(where, case, pools, seqs, tables, spare, dtype, extra)

    def step(self, op: str, where: str, inp: AttentionInputs, pools, q, k, v, dtype, extra: float) -> None:
        metas = [b.prepare(inp) for b in self.backends]
        outs = []
        for backend, (kc, vc), meta in zip(self.backends, pools, metas, strict=True):
            backend.write_kv(kc, vc, k, v, inp.slot_mapping)
            outs.append(backend.attention(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5))
        self.compare_pools("write_kv", where, pools, inp.slot_mapping, dtype, extra)
        self.check(op, where, outs[0], outs[1], dtype, extra)

    def decode_block(self, where: str, inp: AttentionInputs, pools, lens, case: BackendCase, dtype, extra) -> None:
        H, KVH, D = case.num_heads, case.num_kv_heads, case.head_dim
        T = len(lens)
        qkv = self.randn(T, (H + 2 * KVH) * D, dtype=dtype)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = torch.outer(torch.tensor(lens, dtype=torch.float64) - 1, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (t.float().unsqueeze(1).to(self.device) for t in (emb.cos(), emb.sin()))
        qk = apply_rope(qkv[:, :(H + KVH) * D].view(T, -1, D), cos, sin)
        q, k = (t.to(dtype) for t in qk.split([H, KVH], dim=1))
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        metas = [b.prepare(inp) for b in self.backends]
        (kc, vc), (kr, vr) = pools
        got = self.cand.decode_attention_block(qkv, cos, sin, kc, vc, metas[0], H, D ** -0.5)
        if got is not None:  # optional (None: the model calls write_kv and attention, checked next)
            self.ref.write_kv(kr, vr, k, v, inp.slot_mapping)
            want = self.ref.attention(q, k, v, kr, vr, metas[1], D ** -0.5).reshape(T, H * D)
            self.check("decode_attention_block", where, got, want, dtype, extra)
            self.compare_pools("decode_attention_block (its KV write)", where, pools, inp.slot_mapping, dtype,
                               extra)
        # the same step op by op (rewriting the same slots with the same values)
        self.step("attention (decode-only step)", where, inp, pools, q, k, v, dtype, extra)

    def copies(self, where: str, case: BackendCase, pools, seqs, tables, spare, dtype, extra) -> None:
        bs = case.block_size
        i = max(range(len(seqs)), key=lambda j: seqs[j][0])
        n = seqs[i][0] + (1 if i < len(case.decode_context_lens) else 0)  # after the decode-only step
        last, used = (n - 1) // bs, (n - 1) % bs + 1
        copies = [(tables[i][last], spare[0], used)] + ([(tables[i][0], spare[1], bs)] if last > 0 else [])
        table = list(tables[i])
        table[last] = spare[0]
        if last > 0:
            table[0] = spare[1]
        for backend, pool in zip(self.backends, pools, strict=True):
            backend.copy_blocks([pool], copies)
        self.read_back("copy_blocks", where, case, pools, n, table, dtype, extra)
        if used < 2:
            return
        # move the last token's KV into a third block that holds a copy of the others
        src, dst = [spare[0] * bs + used - 1], [spare[2] * bs + used - 1]
        for backend, pool in zip(self.backends, pools, strict=True):
            backend.copy_blocks([pool], [(spare[0], spare[2], used - 1)])
            backend.move_kv_slots([pool], src, dst)
        table[last] = spare[2]
        self.read_back("move_kv_slots", where, case, pools, n, table, dtype, extra)

    def read_back(self, op: str, where: str, case: BackendCase, pools, n: int, table, dtype, extra) -> None:
        """One decode query over the first ``n`` tokens through ``table`` on both backends."""
        inp = AttentionInputs(slot_mapping=torch.empty(0, dtype=torch.long, device=self.device),
                              block_size=case.block_size, decode_rows=[0], decode_context_lens=[n],
                              decode_block_tables=[table])
        q = self.randn(1, case.num_heads, case.head_dim, dtype=dtype)
        outs = [backend.attention(q, None, None, kc, vc, backend.prepare(inp), case.head_dim ** -0.5)
                for backend, (kc, vc) in zip(self.backends, pools, strict=True)]
        self.check(op, f"{where}; read back through attention", outs[0], outs[1], dtype, extra)

    def compare_pools(self, op: str, where: str, pools, slots: torch.Tensor, dtype, extra: float) -> None:
        """The slots just written, where the candidate's pools have the torch layout."""
        (kc, vc), (kr, vr) = pools
        for name, got, want in (("K", kc, kr), ("V", vc, vr)):
            if _pools_comparable(got, want):
                self.check(f"{op} ({name} pool)", where, _slots_of(got, slots), _slots_of(want, slots),
                           torch.float32, extra + self.tolerances[dtype][0])

    def window_case(self, wc: WindowCase, dtype: torch.dtype, kv_dtype: str) -> None:
        """A mixed step (decode rows and prefill chunks) and then a decode-only step of a
        windowed / soft-capped layer, against :func:`reference_attention` over the K/V of the
        reference backend's pool (the same writes); the candidate refusing it with a
        ConfigError: None in the report."""
        case = wc.case
        where = f"{wc}; dtype={str(dtype).removeprefix('torch.')} kv_cache_dtype={kv_dtype}"
        op = f"attention ({wc.feature})"
        H, KVH, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
        extra = KV8_ATOL[kv_dtype]
        seqs = [(n, 1) for n in case.decode_context_lens] + [(n, q) for q, n in case.prefills]
        need = [(n + 1 + bs - 1) // bs for n, _ in seqs]
        num_blocks = sum(need) + 1
        perm = torch.randperm(num_blocks, generator=self.gen).tolist()
        tables = []
        for k in need:
            tables.append(perm[:k])
            perm = perm[k:]
        pools = [b.allocate_kv_cache(1, num_blocks, bs, KVH, D, dtype, kv_dtype)[0] for b in self.backends]

        def slots(i: int, positions) -> list[int]:
            return [tables[i][p // bs] * bs + p % bs for p in positions]

        hist = [s for i, (n, q) in enumerate(seqs) for s in slots(i, range(n - q))]
        if hist:
            mapping = torch.tensor(hist, device=self.device)
            k, v = self.randn(len(hist), KVH, D, dtype=dtype), self.randn(len(hist), KVH, D, dtype=dtype)
            for backend, (kc, vc) in zip(self.backends, pools, strict=True):
                backend.write_kv(kc, vc, k, v, mapping)
        decodes = range(len(case.decode_context_lens))
        steps = [("mixed step", [(i, n, q) for i, (n, q) in enumerate(seqs)])]
        if case.decode_context_lens:
            steps.append(("decode-only step", [(i, seqs[i][0] + 1, 1) for i in decodes]))
        for label, rows in steps:
            inp = AttentionInputs(slot_mapping=None, block_size=bs)  # type: ignore[arg-type]
            mapping, queries, row = [], [], 0
            for i, n, q in rows:
                mapping += slots(i, range(n - q, n))
                queries.append((row, q, slots(i, range(n))))
                if q == 1 and i in decodes:
                    inp.decode_rows.append(row)
                    inp.decode_context_lens.append(n)
                    inp.decode_block_tables.append(tables[i])
                else:
                    inp.prefills.append(PrefillSpan(row, row + q, n, tables[i]))
                row += q
            inp.slot_mapping = torch.tensor(mapping, dtype=torch.long, device=self.device)
            # q scaled up: scores of a few units, so that a soft-cap of 5 changes them
            q, k, v = (self.randn(row, H, D, dtype=dtype, scale=3.0), self.randn(row, KVH, D, dtype=dtype),
                       self.randn(row, KVH, D, dtype=dtype))
            meta = self.cand.prepare(inp)
            for backend, (kc, vc) in zip(self.backends, pools, strict=True):
                backend.write_kv(kc, vc, k, v, inp.slot_mapping)
            kc, vc = pools[0]
            try:
                got = self.cand.attention(q, k, v, kc, vc, meta, D ** -0.5, window=wc.window, softcap=wc.softcap)
            except ConfigError:
                self.report.setdefault(op, None)  # not supported (wherever it is refused)
                return
            except TypeError as exc:
                raise ConformanceError(f"{op} [{where}; {label}]: attention() does not take window= / softcap= "
                                       f"({exc}); the Backend contract has them (refuse with a ConfigError "
                                       "where they are not implemented)") from exc
            kr, vr = pools[1]
            want = torch.empty(q.shape, dtype=torch.float32)
            for start, q_len, keys in queries:
                key_slots = torch.tensor(keys, device=self.device)
                want[start:start + q_len] = reference_attention(
                    q[start:start + q_len], _slots_of(kr, key_slots), _slots_of(vr, key_slots), D ** -0.5,
                    window=wc.window, softcap=wc.softcap).cpu()
            self.check(op, f"{where}; {label}", got, want.to(dtype=dtype, device=self.device), dtype, extra)

    def kv_sizing(self, dtype: torch.dtype, kv_dtype: str) -> None:
        """``kv_bytes_per_token`` times the tokens a pool holds is the bytes it really holds."""
        layers, blocks, bs, kv_heads, head_dim = 3, 5, 16, 2, 64
        pools = self.cand.allocate_kv_cache(layers, blocks, bs, kv_heads, head_dim, dtype, kv_dtype)
        said = self.cand.kv_bytes_per_token(layers, kv_heads, head_dim, dtype, kv_dtype)
        held = pool_bytes(pools)
        if said * blocks * bs != held:
            raise ConformanceError(
                f"kv_bytes_per_token [layers={layers} kv_heads={kv_heads} head_dim={head_dim}; "
                f"dtype={str(dtype).removeprefix('torch.')} kv_cache_dtype={kv_dtype}]: says {said} bytes a token, "
                f"so {said * blocks * bs} for {blocks} blocks of {bs}, but allocate_kv_cache's pool holds {held} "
                f"({held / (blocks * bs):g} a token)")
        self.report["kv_bytes_per_token"] = 0.0

    # ---- elementwise ops and matmuls --------------------------------------------
    def norms(self, dtype: torch.dtype) -> None:
        for T, N in ((7, 97), (1, 64)):
            where = f"x [{T}, {N}]; dtype={str(dtype).removeprefix('torch.')}"
            x, weight = self.randn(T, N, dtype=dtype, scale=3.0), self.randn(N).abs() + 0.5
            got, want = [b.rms_norm(x, weight, 1e-5) for b in self.backends]
            self.check("rms_norm", where, got, want, dtype)
            h = self.randn(T, N, scale=10.0)
            for delta in (None, self.randn(T, N, dtype=dtype)):
                (gx, gh), (wx, wh) = [b.add_rms_norm(h.clone(), delta, weight, 1e-5, dtype) for b in self.backends]
                label = f"{where}, delta {'None' if delta is None else 'given'}"
                self.check("add_rms_norm (normalised)", label, gx, wx, dtype)
                self.check("add_rms_norm (h + delta)", label, gh, wh, torch.float32)
            gate, up = self.randn(T, N, dtype=dtype, scale=2.0), self.randn(T, N, dtype=dtype)
            got, want = [b.silu_mul(gate, up) for b in self.backends]
            self.check("silu_mul", where, got, want, dtype)
            scores = self.randn(T, N * 37, dtype=dtype)
            scores[0, 5:] = scores[0, :5].max()  # a tie: the first index
            if T > 1:
                scores[T - 1, 11] = scores[T - 1, 3] = float("nan")  # a NaN wins, the first one
            got, want = [b.argmax(scores).cpu() for b in self.backends]
            if not torch.equal(got, want):
                raise ConformanceError(f"argmax at {where}: {got.tolist()} != {want.tolist()}")
            self.report["argmax"] = 0.0
        for T, H, D in ((5, 12, 64), (1, 4, 128)):  # q and k heads together (GQA 9 + 3), odd T
            where = f"x [{T}, {H}, {D}]; dtype={str(dtype).removeprefix('torch.')}"
            x = self.randn(T, H, D, dtype=dtype)
            angles = (torch.rand(T, 1, D // 2, generator=self.gen) * 100).to(self.device)
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            got, want = [b.rope(x, cos, sin) for b in self.backends]
            self.check("rope", where, got, want, dtype)
            got, want = [b.rope(x, cos, sin, dtype) for b in self.backends]  # rounded to the model dtype
            self.check("rope", f"{where}, out_dtype={str(dtype).removeprefix('torch.')}", got, want, dtype)
            view = self.randn(T, H + 2, D, dtype=dtype)[:, :H]  # heads of a wider row, as q and k of qkv
            got, want = [b.rope(view, cos, sin, dtype) for b in self.backends]
            self.check("rope", f"{where}, strided rows", got, want, dtype)

    def captured_step(self, dtype: torch.dtype) -> None:
        """The captured step of three two-layer models against the same model op by op: a
        LLaMA (head dim 64, GQA 2), a Qwen2 (its q/k/v bias) and a Qwen3 (per-head q/k
        RMSNorm, head dim 128: q wider than the hidden size)."""
        from tokenloom.core.models.config import ModelConfig

        common = dict(vocab_size=97, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256)
        for label, cfg in (("two-layer LLaMA, head dim 64, GQA 2", ModelConfig(head_dim=64, **common)),
                           ("two-layer Qwen2 (q/k/v bias), head dim 64, GQA 2",
                            ModelConfig(head_dim=64, architecture="qwen2", attention_bias=True, **common)),
                           ("two-layer Qwen3 (q/k norm), head dim 128, GQA 2",
                            ModelConfig(head_dim=128, architecture="qwen3", qk_norm=True, **common))):
            self._captured_model(label, cfg, dtype)

    def _captured_model(self, label: str, cfg, dtype: torch.dtype) -> None:
        from tokenloom.core.models.registry import default_registry
        from tokenloom.core.parallel import TensorParallel

        d, f, q, kv, V = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.vocab_size
        shapes = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d)}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                           p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                           p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                           p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                           p + "mlp.down_proj.weight": (d, f)})
            if cfg.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                               p + "self_attn.k_norm.weight": (cfg.head_dim,)})
        weights = {n: (1 + 0.1 * self.randn(*shape)) if len(shape) == 1 else 0.05 * self.randn(*shape)
                   for n, shape in shapes.items()}
        if cfg.attention_bias:  # biases of the size of the projections' outputs, so they bite
            for i in range(cfg.num_layers):
                for part, rows in (("q", q), ("k", kv), ("v", kv)):
                    weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = 0.5 * self.randn(rows)
        model = default_registry().get(cfg.architecture).build(cfg, dtype, self.cand, cfg.max_position_embeddings,
                                                               TensorParallel()).to(self.device)
        model.load_weights(weights, _DenseWeights())
        if not model.capture():
            return
        captured, model.captured = model.captured, None  # the model itself now runs op by op
        bs, lens = 16, [5, 21, 40]
        pools = self.cand.allocate_kv_cache(cfg.num_layers, 16, bs, cfg.num_kv_heads, cfg.head_dim, dtype)
        perm = torch.randperm(16, generator=self.gen).tolist()
        tables = [perm[0:2], perm[2:5], perm[5:9]]

        def slot(i: int, pos: int) -> int:
            return tables[i][pos // bs] * bs + pos % bs

        def ids(n: int) -> torch.Tensor:
            return torch.randint(0, V, (n,), generator=self.gen).to(self.device)

        inp = AttentionInputs(slot_mapping=torch.tensor([slot(i, p) for i, n in enumerate(lens) for p in range(n)],
                                                        device=self.device), block_size=bs)
        row = 0
        for i, n in enumerate(lens):
            inp.prefills.append(PrefillSpan(row, row + n, n, tables[i]))
            row += n
        positions = torch.tensor([p for n in lens for p in range(n)], device=self.device)
        model(ids(row), positions, pools, self.cand.prepare(inp))
        where = f"{label}, contexts {lens}; dtype={str(dtype).removeprefix('torch.')}"
        for _ in range(3):
            tokens, positions = ids(len(lens)), torch.tensor(lens, device=self.device)
            inp = AttentionInputs(slot_mapping=torch.tensor([slot(i, n) for i, n in enumerate(lens)], device=self.device),
                                  block_size=bs, decode_rows=list(range(len(lens))),
                                  decode_context_lens=[n + 1 for n in lens], decode_block_tables=tables)
            got = captured(tokens, positions, pools, self.cand.prepare(inp))
            if got is None:  # not a step it covers: nothing to compare
                return
            want = model(tokens, positions, pools, self.cand.prepare(inp))  # rewrites the same slots
            self.check("capture_decode (hidden states)", where, got, want, dtype)
            lens = [n + 1 for n in lens]

    def linears(self, dtype: torch.dtype) -> None:
        for label, spec in self.weight_specs():
            got_w = self.cand.pack_linear(spec, dtype)
            want_w = self.ref.pack_linear(dequantize(spec, torch.float32).to(self.device), dtype)
            quantised = not isinstance(spec, torch.Tensor)
            for rows in (1, 3, 17):
                x = self.randn(rows, spec.shape[1], dtype=dtype)
                where = f"{label} [{spec.shape[0]}, {spec.shape[1]}], x [{rows}, {spec.shape[1]}]; " \
                        f"dtype={str(dtype).removeprefix('torch.')}"
                self.check("pack_linear(...).apply", where, got_w.apply(x), want_w.apply(x),
                           torch.bfloat16 if quantised else dtype)

    def weight_specs(self) -> list[tuple[str, Any]]:
        g, dev = self.gen, self.device

        def q4(out: int, inp: int, group: int, act_order: bool) -> QuantizedWeight:
            groups = -(-inp // group)
            g_idx = (torch.randperm(inp, generator=g) % groups).to(torch.int32) if act_order else None
            return QuantizedWeight(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8).to(dev),
                                   (torch.rand(out, groups, generator=g) * 0.02 + 0.005).to(dev),
                                   torch.randint(0, 16, (out, groups), generator=g).float().to(dev), 4, group,
                                   g_idx.to(dev) if g_idx is not None else None)

        int8 = QuantizedWeight(torch.randint(1, 256, (48, 96), generator=g, dtype=torch.uint8).to(dev),
                               (torch.rand(48, 1, generator=g) * 0.01).to(dev), torch.full((48, 1), 128.0).to(dev), 8, 96)
        fp8 = Fp8Weight((torch.randn(40, 96, generator=g) * 64).to(torch.float8_e4m3fn).to(dev),
                        (torch.rand(40, generator=g) * 0.002).to(dev))
        return [("dense", self.randn(48, 96, scale=0.1)), ("int4 g32", q4(48, 128, 32, False)),
                ("int4 g64 act-order", q4(32, 192, 64, True)), ("int8 per-channel", int8), ("fp8 e4m3", fp8)]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, *,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The kit's float32 attention of one sequence's last ``len(q)`` positions over all its
    keys: q [q, H, D], keys/values [KVH, n, D] (positions 0..n-1; query i at position
    n - len(q) + i sees keys j <= its position and, with a window, j > position - window);
    scores ``q k^T * scale``, soft-capped (``softcap * tanh(s / softcap)``) if asked, a
    softmax, times the values. Returns float32 [q, H, D]."""
    nq, H, D = q.shape
    kv_heads, n, _ = keys.shape
    group = H // kv_heads
    qf = q.float().transpose(0, 1)  # [H, q, D]
    k = keys.float().repeat_interleave(group, dim=0)  # [H, n, D]
    v = values.float().repeat_interleave(group, dim=0)
    scores = qf @ k.transpose(1, 2) * scale  # [H, q, n]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(n - nq, n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    seen = j <= pos
    if window is not None:
        seen &= j > pos - window
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)


class _DenseWeights:
    """The quantizer the captured-step check loads its random weights with: as they are."""

    def weight_spec(self, slot, tensors):
        return slot.fuse([tensors.take(part + ".weight") for part in slot.parts])


def _make_backend(backend, options, device: torch.device, plugins: Sequence[Any]):
    if isinstance(backend, str):
        import msgspec

        from tokenloom.core.plugins import PluginManager

        entry = PluginManager(load_entry_points=False, extra=list(plugins)).get("backend", backend)
        if entry.options is not None and not isinstance(options, entry.options):
            options = msgspec.convert(options or {}, entry.options)
        from tokenloom.core import contracts

        return contracts.build(entry, options, device)  # a registered backend must satisfy Backend
    return backend(options, device)


def check_backend(backend: str | Callable[..., Any], *, options: Any = None, device: str | torch.device = "cpu",
                  plugins: Sequence[Any] = (), cases: Sequence[BackendCase] = KIT_BACKEND_CASES,
                  dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                  kv_cache_dtypes: Sequence[str] = ("auto", "fp8", "int8"), seed: int = 0,
                  tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
                  window_cases: Sequence[WindowCase] = KIT_WINDOW_CASES) -> dict[str, float | None]:
    """Run every Backend op of ``backend`` against the ``torch`` backend (see the module
    docstring). ``backend``: a registered name (``plugins`` are registered first; ``options``
    a dict or the backend's options struct) or a factory ``(options, device) -> Backend``.
    Raises :class:`ConformanceError` at the first mismatch; returns the largest difference
    seen per op, None for a windowed / soft-capped attention op the backend refused with a
    ConfigError everywhere it was tried (not supported)."""
    from tokenloom.backends.torch_backend import TorchBackend, TorchBackendOptions

    device = torch.device(device)
    cand = _make_backend(backend, options, device, plugins)
    ref = TorchBackend(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl", quant_max_rows=0), device)
    kit = _Kit(cand, ref, device, seed, {**TOLERANCES, **(tolerances or {})})
    with torch.inference_mode():
        for dtype in dtypes:
            kit.norms(dtype)
            kit.linears(dtype)
            kit.captured_step(dtype)
            for kv_dtype in kv_cache_dtypes:
                kit.kv_sizing(dtype, kv_dtype)
            for case in cases:
                for kv_dtype in kv_cache_dtypes:
                    kit.attention_case(case, dtype, kv_dtype)
            for wc in window_cases:
                for kv_dtype in kv_cache_dtypes:
                    kit.window_case(wc, dtype, kv_dtype)
    return kit.report
