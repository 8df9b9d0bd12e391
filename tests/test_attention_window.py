"""Sliding-window and soft-capped attention (``Backend.attention(..., window=, softcap=)``) against
an explicit float32 reference: per query, the keys it may see listed by position, gathered from
the pool (dequantised), a plain masked softmax. The torch backend on every path it has: decode
rows by the C++ paged op and by the torch path, a prompt from scratch, a chunk over a cached
prefix, a linear draft span, a draft tree; bfloat16 and float32; plain and int8 KV pools; the
batch-invariant mode's slot attention; the triton backend's fallback to the torch attention;
and the conformance kit's window cases (a backend that ignores the window fails them, one that
refuses it is reported as not supported)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel (as test_backend_conformance)

import pytest  # noqa: E402
import torch  # noqa: E402

from tokenloom.backends.conformance import WindowCase, check_backend  # noqa: E402
from tokenloom.backends.torch_backend import QuantizedKV, TorchBackend, TorchBackendOptions  # noqa: E402
from tokenloom.core.attention import AttentionInputs, PrefillSpan  # noqa: E402
from tokenloom.core.errors import ConfigError  # noqa: E402
from tokenloom.kernels import cpu_ops  # noqa: E402
from tokenloom.testing import BackendCase, ConformanceError  # noqa: E402

BS, KVH, H, D = 8, 2, 6, 64
WINDOW, SOFTCAP = 12, 4.0
FEATURES = {"window": (WINDOW, None), "softcap": (None, SOFTCAP), "both": (WINDOW, SOFTCAP)}
TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
needs_cpp = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU ops cannot be built here")


def _backend(kind: str) -> TorchBackend:
    if kind == "fused":  # decode rows by the C++ paged op
        if cpu_ops.load() is None:
            pytest.skip(f"the C++ CPU ops cannot be built here: {cpu_ops.unavailable_reason()}")
        backend = TorchBackend(TorchBackendOptions(cpu_linear="mkl", quant_max_rows=0))
        assert backend.fused_decode is not None
        return backend
    if kind == "invariant":
        if cpu_ops.load() is None:
            pytest.skip("the batch-invariant mode needs the C++ CPU ops")
        return TorchBackend(TorchBackendOptions(batch_invariant=True))
    return TorchBackend(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl", quant_max_rows=0))


class Seq:
    """One sequence of a step: ``n`` tokens of context, its last ``q`` new this step (``tree``:
    the parents of a draft tree in its last len(tree) slots, the positions of their depths)."""

    def __init__(self, n: int, q: int, table: list[int], tree: list[int] | None = None, decode: bool = False):
        self.n, self.q, self.table, self.tree, self.decode = n, q, table, tree, decode
        self.pos = list(range(n))  # each slot's position
        if tree:
            depth: list[int] = []
            for p in tree:
                depth.append(0 if p < 0 else depth[p] + 1)
            before = n - len(tree)
            self.pos[before:] = [before + d for d in depth]

    def slot(self, i: int) -> int:
        return self.table[i // BS] * BS + i % BS

    def visible(self, i: int) -> list[int]:
        """The slot indexes query ``i`` (a slot index of this step's rows) sees, window aside."""
        if not self.tree or i < self.n - len(self.tree):
            return list(range(i + 1))
        before = self.n - len(self.tree)
        node, path = i - before, []
        while node >= 0:
            path.append(before + node)
            node = self.tree[node]
        return list(range(before)) + path[::-1]


def _step(seqs: list[Seq]) -> AttentionInputs:
    inp = AttentionInputs(slot_mapping=None, block_size=BS)  # type: ignore[arg-type]
    slots, row = [], 0
    for s in seqs:
        slots += [s.slot(i) for i in range(s.n - s.q, s.n)]
        if s.decode:
            inp.decode_rows.append(row)
            inp.decode_context_lens.append(s.n)
            inp.decode_block_tables.append(s.table)
        else:
            inp.prefills.append(PrefillSpan(row, row + s.q, s.n, s.table, s.tree))
        row += s.q
    inp.slot_mapping = torch.tensor(slots, dtype=torch.long)
    return inp


def _layout(specs, seed: int = 0) -> tuple[list[Seq], int]:
    """Sequences from ``(n, q, kind)`` ("decode", "span" or a tree's parents), on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + BS - 1) // BS for n, _, _ in specs]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    seqs = []
    for (n, q, kind), k in zip(specs, need, strict=True):
        seqs.append(Seq(n, q, perm[:k], tree=kind if isinstance(kind, list) else None, decode=kind == "decode"))
        perm = perm[k:]
    return seqs, sum(need) + 2


def _pool_rows(pool, slots: list[int]) -> torch.Tensor:
    """float32 [KVH, len(slots), D] of the pool, dequantised."""
    idx = torch.tensor(slots, dtype=torch.long)
    if isinstance(pool, QuantizedKV):
        data = pool.data.view(KVH, -1, D)[:, idx].float()
        return data * pool.scale.view(KVH, -1)[:, idx].float().unsqueeze(-1)
    return pool.view(KVH, -1, D)[:, idx].float()


def reference(q, seqs: list[Seq], k_cache, v_cache, scale: float, window, softcap) -> torch.Tensor:
    """float32 [T, H, D]: each query over the keys it sees (by position), one at a time."""
    out, row, group = torch.empty(q.shape, dtype=torch.float32), 0, H // KVH
    for s in seqs:
        for i in range(s.n - s.q, s.n):
            seen = [j for j in s.visible(i) if window is None or s.pos[i] - s.pos[j] < window]
            keys = _pool_rows(k_cache, [s.slot(j) for j in seen]).repeat_interleave(group, 0)  # [H, n, D]
            values = _pool_rows(v_cache, [s.slot(j) for j in seen]).repeat_interleave(group, 0)
            scores = torch.einsum("hd,hnd->hn", q[row].float(), keys) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[row] = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values)
            row += 1
    return out


def _run(backend, specs, dtype, kv_dtype, window, softcap, seed=0):
    """A step of ``specs`` on ``backend``: its K/V history written, then the step's K/V and its
    attention, as the model calls them; returns (got, the reference)."""
    seqs, num_blocks = _layout(specs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k_cache, v_cache = backend.allocate_kv_cache(1, num_blocks, BS, KVH, D, dtype, kv_dtype)[0]
    hist = [s.slot(i) for s in seqs for i in range(s.n - s.q)]
    if hist:
        backend.write_kv(k_cache, v_cache, torch.randn(len(hist), KVH, D, generator=g).to(dtype),
                         torch.randn(len(hist), KVH, D, generator=g).to(dtype), torch.tensor(hist))
    inp = _step(seqs)
    T = inp.slot_mapping.numel()
    q = (torch.randn(T, H, D, generator=g) * 1.5).to(dtype)  # scores of a few units: a cap of 4 bites
    k, v = torch.randn(T, KVH, D, generator=g).to(dtype), torch.randn(T, KVH, D, generator=g).to(dtype)
    meta = backend.prepare(inp)
    backend.write_kv(k_cache, v_cache, k, v, inp.slot_mapping)
    got = backend.attention(q, k, v, k_cache, v_cache, meta, D ** -0.5, window=window, softcap=softcap)
    return got, reference(q, seqs, k_cache, v_cache, D ** -0.5, window, softcap)


# decode contexts shorter than, equal to, one past and well past the window
DECODE = [(3, 1, "decode"), (12, 1, "decode"), (13, 1, "decode"), (29, 1, "decode"), (50, 1, "decode")]
MIXED = [(29, 1, "decode"), (20, 20, "span"),  # a prompt from scratch, longer than the window
         (5, 1, "decode"), (33, 7, "span"),  # a chunk over a cached prefix
         (41, 4, "span"), (50, 1, "decode")]  # a last token and three linear drafts
# a last token and a draft tree (two chains of three and two under it) over a cached context
TREE = [(13, 1, "decode"), (35, 6, [-1, 0, 1, -1, 3]), (50, 1, "decode")]


def _close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    diff = (got.float() - want).abs().max().item()
    assert diff <= TOL[dtype] * max(1.0, want.abs().max().item()), diff


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_windowed_attention_matches_the_reference(kind, kv_dtype, dtype, feature):
    backend = _backend(kind)
    window, softcap = FEATURES[feature]
    for specs in (DECODE, MIXED, TREE):
        got, want = _run(backend, specs, dtype, kv_dtype, window, softcap)
        _close(got, want, dtype)


@pytest.mark.parametrize("window", [2, 5])
def test_a_tree_node_sees_by_position_not_slot(window):
    """A window shorter than the tree is deep: a node sees its nearest ancestors only, counted
    by depth (the runner's positions), not by how far its lookahead slot lies."""
    got, want = _run(_backend("torch"), TREE, torch.float32, "auto", window, None)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_a_window_past_every_context_changes_nothing(kind):
    """Bit for bit: the plain path (no window masks, the C++ op from key 0)."""
    backend = _backend(kind)
    for specs in (DECODE, MIXED, TREE):
        got, _ = _run(backend, specs, torch.float32, "auto", 64, None)
        plain, _ = _run(backend, specs, torch.float32, "auto", None, None)
        assert torch.equal(got, plain)
    # and the window does matter where a context is longer
    got, _ = _run(backend, MIXED, torch.float32, "auto", WINDOW, None)
    plain, _ = _run(backend, MIXED, torch.float32, "auto", None, None)
    assert not torch.allclose(got, plain, atol=1e-2)


@needs_cpp
@pytest.mark.parametrize("head_dim, block_size", [(24, 5), (128, 3)])
def test_the_cpp_op_takes_a_window_and_a_softcap(head_dim, block_size):
    """The paged op alone at other head dims (the generic and the 128-wide paths) and block
    sizes, window starts inside a block: against the torch path's masked softmax."""
    ops = cpu_ops.load()
    g = torch.Generator().manual_seed(3)
    lens = [1, 4, 7, 11, 30]
    num_blocks = sum((n + block_size - 1) // block_size for n in lens)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, width = [], max((n + block_size - 1) // block_size for n in lens)
    for n in lens:
        k = (n + block_size - 1) // block_size
        tables.append(perm[:k] + [0] * (width - k))
        perm = perm[k:]
    kc, vc = (torch.randn(KVH, num_blocks, block_size, head_dim, generator=g) for _ in range(2))
    q = torch.randn(len(lens), H, head_dim, generator=g) * 2
    for window, softcap in ((6, 0.0), (0, 3.0), (6, 3.0), (1, 0.0)):
        got = ops.paged_decode_attention(q, kc, vc, torch.tensor(tables), torch.tensor(lens), 0.2, window, softcap)
        for b, n in enumerate(lens):
            slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(n)])
            keys = kc.view(KVH, -1, head_dim)[:, slots].repeat_interleave(H // KVH, 0)
            values = vc.view(KVH, -1, head_dim)[:, slots].repeat_interleave(H // KVH, 0)
            scores = torch.einsum("hd,hnd->hn", q[b], keys) * 0.2
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if window:
                scores[:, :max(0, n - window)] = float("-inf")
            want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values)
            assert (got[b] - want).abs().max() < 1e-5, (window, softcap, b)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_batch_invariant_mode_has_windows_and_softcaps(dtype, feature):
    backend = _backend("invariant")
    window, softcap = FEATURES[feature]
    for specs in (DECODE, MIXED, TREE):
        got, want = _run(backend, specs, dtype, "auto", window, softcap)
        _close(got, want, dtype)


@needs_cpp
def test_the_batch_invariant_mode_stays_invariant_under_a_window():
    """A query's result is the same bits as a decode row alone and inside a prompt chunk."""
    backend = _backend("invariant")
    g = torch.Generator().manual_seed(5)
    table, L, n = [3, 9, 1, 12, 5, 7, 0], 50, 20
    k_cache, v_cache = (torch.randn(KVH, 16, BS, D, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)

    def slots(positions):
        return torch.tensor([table[p // BS] * BS + p % BS for p in positions])

    def run(q, inp):
        return backend.attention(q, None, None, k_cache, v_cache, backend.prepare(inp), D ** -0.5, window=WINDOW,
                                 softcap=SOFTCAP)

    chunk = run(q, AttentionInputs(slots(range(L - n, L)), BS, prefills=[PrefillSpan(0, n, L, table)]))
    for i in range(n):
        p = L - n + i
        alone = run(q[i:i + 1], AttentionInputs(slots([p]), BS, decode_rows=[0], decode_context_lens=[p + 1],
                                                decode_block_tables=[table]))
        assert torch.equal(alone[0], chunk[i])


def test_a_window_under_one_token_or_a_softcap_under_zero_is_refused():
    backend = _backend("torch")
    with pytest.raises(ConfigError, match="at least 1 token.*window=0"):
        _run(backend, DECODE, torch.float32, "auto", 0, None)
    with pytest.raises(ConfigError, match="soft-cap positive.*softcap=0.0"):
        _run(backend, DECODE, torch.float32, "auto", None, 0.0)


# ---- the triton backend: its kernels for plain layers, the torch attention for windowed ones
def _triton():
    pytest.importorskip("triton")
    from tokenloom.backends.triton_backend import TritonBackend

    try:
        return TritonBackend(device="cpu")
    except ConfigError as exc:  # e.g. the kernels were defined before this module set TRITON_INTERPRET
        pytest.skip(str(exc))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_triton_backend_falls_back_to_the_torch_attention(kv_dtype):
    backend = _triton()
    got, want = _run(backend, MIXED, torch.float32, kv_dtype, WINDOW, SOFTCAP)
    _close(got, want, torch.float32)
    got, want = _run(backend, TREE, torch.float32, kv_dtype, WINDOW, None)  # a tree step: its own fallback
    _close(got, want, torch.float32)
    got, want = _run(backend, DECODE, torch.float32, kv_dtype, None, None)  # a plain layer: the kernels
    _close(got, want, torch.float32)


# ---- the conformance kit's window cases
KIT = dict(cases=[], dtypes=[torch.float32], kv_cache_dtypes=["auto", "int8"],
           window_cases=[WindowCase(BackendCase(4, 2, 64, 16, (5, 30), ((25, 25), (4, 40))), window=10),
                         WindowCase(BackendCase(4, 2, 64, 16, (30,), ((25, 25),)), softcap=5.0)])


class _NoWindow(TorchBackend):
    """Ignores the window (attends to the whole context)."""

    def __init__(self, options=None, device="cpu"):
        super().__init__(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl", quant_max_rows=0), device)

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None):
        return super().attention(q, k, v, k_cache, v_cache, meta, scale, softcap=softcap)


class _Refuses(_NoWindow):
    def attention(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None):
        if window is not None:
            raise ConfigError(f"this backend does not implement sliding-window attention (layer window {window})")
        return super().attention(q, k, v, k_cache, v_cache, meta, scale, softcap=softcap)


@pytest.mark.parametrize("options", [{"decode_attention": "torch"}, {}], ids=["torch-path", "fused"])
def test_the_torch_backend_passes_the_kits_window_cases(options):
    if not options and cpu_ops.load() is None:
        pytest.skip("the C++ CPU ops cannot be built here")
    report = check_backend("torch", options={"cpu_linear": "mkl", "quant_max_rows": 0, **options}, **KIT)
    assert report["attention (sliding window)"] < 1e-4 and report["attention (soft-cap)"] < 1e-4


def test_the_kit_fails_a_backend_that_ignores_the_window():
    with pytest.raises(ConformanceError, match=r"^attention \(sliding window\) \[.*window=10.*max abs diff"):
        check_backend(_NoWindow, **KIT)


def test_the_kit_reports_a_refused_window_as_not_supported():
    report = check_backend(_Refuses, **KIT)
    assert report["attention (sliding window)"] is None  # not supported
    assert report["attention (soft-cap)"] < 1e-4
