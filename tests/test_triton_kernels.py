"""Each Triton kernel (kernels/triton/) against its plain-torch reference, at small odd
shapes, under Triton's interpreter: no GPU needed (scripts/gpu_check.py runs them at full
size on one). bfloat16 cases load and store bf16 and compute in float32, the one way the
interpreter gets bf16 right; its fp32 -> bf16 cast truncates, so their tolerance is a bf16 step."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the triton package is not installed (pip install 'tokenloom[triton]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tokenloom.core.weights import QuantizedWeight  # noqa: E402
from tokenloom.kernels import triton as K  # noqa: E402
from tokenloom.kernels.triton.kv_write import _e4m3_byte  # noqa: E402
from tokenloom.plugins.quantizers.layouts import gptq_pack  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    """|got - want| <= tol * max(1, max|want|) everywhere, else say where and by how much."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    g, w = got.float(), want.float()
    diff = (g - w).abs().nan_to_num(nan=float("inf"))
    allowed = tol * max(1.0, float(w.abs().max())) if w.numel() else tol
    if diff.numel() and float(diff.max()) > allowed:
        idx = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
        raise AssertionError(f"{what}: max abs diff {float(diff.max()):.4g} > {allowed:.3g} at {idx} "
                             f"(got {float(g[tuple(idx)]):.6g}, want {float(w[tuple(idx)]):.6g}), "
                             f"{int((diff > allowed).sum())} of {diff.numel()} elements off")


def _pool(kv_heads, num_blocks, block_size, head_dim, dtype, quant, gen):
    """A random pool: plain, or 8-bit codes with bf16 per-slot scales."""
    x = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    if quant is None:
        return x.to(dtype), None
    scale = (torch.rand(kv_heads, num_blocks, block_size, generator=gen) * 0.02 + 0.005).bfloat16()
    codes = (x * 40).clamp(-127, 127)
    return (codes.round().to(torch.int8) if quant == torch.int8 else codes.to(quant)), scale


def _tables(lens, block_size, num_blocks, gen):
    width = max((n + block_size - 1) // block_size for n in lens)
    return torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens]).to(torch.int32)


ATTN_SHAPES = [  # heads, kv heads, head dim, block size: GQA 1, 3, 8; a head dim and block size far from 2^k
    (4, 4, 64, 16), (6, 2, 128, 32), (8, 1, 64, 16), (3, 3, 24, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
@pytest.mark.parametrize("partition_size", [64, 512])  # 64: the longer contexts split and are reduced
def test_paged_decode_attention(shape, dtype, partition_size):
    heads, kv_heads, head_dim, bs = shape
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 45, 150]
    kc, _ = _pool(kv_heads, 64, bs, head_dim, dtype, None, gen)
    vc, _ = _pool(kv_heads, 64, bs, head_dim, dtype, None, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    tables, ctx = _tables(lens, bs, 64, gen), torch.tensor(lens, dtype=torch.int32)
    args = (q, kc, vc, tables, ctx, head_dim ** -0.5)
    got = K.paged_decode_attention(*args, partition_size=partition_size)
    assert_close(got, K.paged_decode_attention_ref(*args), TOL[dtype], "decode attention")


@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("partition_size", [64, 512])
def test_paged_decode_attention_8bit_pool(quant, partition_size):
    gen = torch.Generator().manual_seed(1)
    lens = [3, 70, 33]
    kc, ks = _pool(2, 32, 16, 64, None, quant, gen)
    vc, vs = _pool(2, 32, 16, 64, None, quant, gen)
    q = torch.randn(len(lens), 6, 64, generator=gen)
    args = (q, kc, vc, _tables(lens, 16, 32, gen), torch.tensor(lens), 0.125)
    got = K.paged_decode_attention(*args, k_scale=ks, v_scale=vs, partition_size=partition_size)
    assert_close(got, K.paged_decode_attention_ref(*args, k_scale=ks, v_scale=vs), 1e-4, "decode attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
@pytest.mark.parametrize("quant", [None, torch.int8])
def test_paged_prefill_attention(shape, dtype, quant):
    """Chunks with and without cached context, their rows apart (decode rows between) and
    out of order; rows outside every chunk are left alone."""
    heads, kv_heads, head_dim, bs = shape
    gen = torch.Generator().manual_seed(2)
    spans = [(13, 13), (3, 41), (1, 18), (20, 37)]  # (q_len, context_len)
    starts = [30, 1, 16, 55]
    T = 80
    kc, ks = _pool(kv_heads, 48, bs, head_dim, dtype, quant, gen)
    vc, vs = _pool(kv_heads, 48, bs, head_dim, dtype, quant, gen)
    q = torch.randn(T, heads, head_dim, generator=gen).to(dtype)
    args = (q, kc, vc, _tables([n for _, n in spans], bs, 48, gen), torch.tensor([n for _, n in spans]),
            torch.tensor(starts), torch.tensor([a for a, _ in spans]), head_dim ** -0.5)
    got = K.paged_prefill_attention(*args, k_scale=ks, v_scale=vs, out=torch.full_like(q, 7.0))
    want = K.paged_prefill_attention_ref(*args, k_scale=ks, v_scale=vs, out=torch.full_like(q, 7.0))
    assert_close(got, want, TOL[dtype], "prefill attention")
    assert (got[0] == 7).all() and (got[14:16] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("kv_heads, head_dim, bs", [(2, 64, 16), (3, 24, 4), (1, 128, 32)])
def test_write_kv_is_bit_exact(dtype, storage, kv_heads, head_dim, bs):
    """The same bytes (and bf16 scales) as the reference, i.e. the torch backend's
    QuantizedKV.write; a negative slot is skipped."""
    gen = torch.Generator().manual_seed(3)
    T, nb = 37, 16
    k = (torch.randn(T, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=gen).to(dtype)
    k[4] = 0  # an all-zero row: the floor scale, zeros back
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[5] = -1
    shape = (kv_heads, nb, bs, head_dim)

    def pools():
        data = torch.zeros(shape, dtype=storage or dtype)
        return data, (torch.zeros(shape[:3], dtype=torch.bfloat16) if storage else None)

    (kc, ks), (vc, vs), (kr, ksr), (vr, vsr) = pools(), pools(), pools(), pools()
    K.write_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    K.write_kv_ref(k, v, kr, vr, slots, k_scale=ksr, v_scale=vsr)
    for got, want in ((kc, kr), (vc, vr), (ks, ksr), (vs, vsr)):
        if got is not None:
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)


@triton.jit
def _e4m3_probe_kernel(x_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, _e4m3_byte(tl.load(x_ptr + o)))


def test_e4m3_rounding_matches_torch_at_every_value_and_tie():
    """Every finite e4m3 value, each midpoint between neighbours (ties go to even) and points
    just either side of it: the kernel's byte is torch's conversion."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[values.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf"))),
                   torch.tensor([-0.0])])
    x = x[x.abs() <= 448]
    n = triton.next_power_of_2(x.numel())
    xp = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty(n, dtype=torch.uint8)
    _e4m3_probe_kernel[(1,)](xp, out, N=n)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out[:x.numel()] != want).nonzero().flatten()
    assert not bad.numel(), f"{bad.numel()} values differ, e.g. {x[bad[:5]].tolist()}"


def _q4(out, inp, group, act_order, gen):
    groups = -(-inp // group)
    g_idx = (torch.randperm(inp, generator=gen) % groups).to(torch.int32) if act_order else None
    return QuantizedWeight(torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8),
                           torch.rand(out, groups, generator=gen) * 0.05, torch.randint(1, 16, (out, groups),
                                                                                         generator=gen).float(),
                           4, group, g_idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 33])  # GEMV, GEMV, tiled (the default switch is at 4 rows)
@pytest.mark.parametrize("out, inp, group, act_order", [(48, 128, 32, False), (37, 200, 64, False),
                                                        (24, 96, 32, True)])
def test_int4_matmul(dtype, rows, out, inp, group, act_order):
    gen = torch.Generator().manual_seed(4)
    qw = _q4(out, inp, group, act_order, gen)
    p = K.pack_int4(qw)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    args = (x, p.qweight, p.scales, p.zeros, p.group_size, p.g_idx)
    assert_close(K.int4_matmul(*args), K.int4_matmul_ref(*args), TOL[dtype], "int4 matmul")
    exact = (x.float() @ qw.dequantize().T).to(dtype)  # the reference dequantises what the loader gave
    assert_close(K.int4_matmul_ref(*args), exact, TOL[dtype], "int4 reference")


def test_int4_packing_is_the_gptq_layout():
    """pack_int4 lays codes out as GPTQ v1 checkpoints store ``qweight``: a GPTQ qweight can be
    used as it is."""
    qw = _q4(64, 128, 32, False, torch.Generator().manual_seed(5))
    assert torch.equal(K.pack_int4(qw).qweight, gptq_pack(qw)["qweight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("out, inp", [(48, 128), (37, 200)])
def test_fp8_matmul(dtype, rows, out, inp):
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(out, inp, generator=gen) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(out, generator=gen) * 0.01
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    assert_close(K.fp8_matmul(x, w, scales), K.fp8_matmul_ref(x, w, scales), TOL[dtype], "fp8 matmul")


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_add_rms_norm(delta_dtype, out_dtype, in_place):
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(7, 97, generator=gen) * 10
    delta = torch.randn(7, 97, generator=gen).to(delta_dtype) if delta_dtype else None
    weight = torch.rand(97, generator=gen) + 0.5
    want_x, want_h = K.add_rms_norm_ref(h.clone(), delta, weight, 1e-5, out_dtype)
    h_in = h.clone()
    got_x, got_h = K.add_rms_norm(h_in, delta, weight, 1e-5, out_dtype, in_place=in_place)
    assert_close(got_x, want_x, TOL[out_dtype], "normalised")
    assert_close(got_h, want_h, 1e-6, "h + delta")
    assert (got_h is h_in) == (in_place or delta is None)
    if not in_place and delta is not None:
        assert torch.equal(h_in, h)  # left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(8)
    x, weight = (torch.randn(5, 3, 97, generator=gen) * 4).to(dtype), torch.rand(97, generator=gen) + 0.5
    assert_close(K.rms_norm(x, weight, 1e-6), K.rms_norm_ref(x, weight, 1e-6), 1e-5, "rms_norm")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rope_on_a_strided_view(out_dtype):
    """The q and k heads of a fused qkv row (a strided view), llama's cos/sin tables."""
    gen = torch.Generator().manual_seed(9)
    T, heads, kv_heads, D = 5, 6, 2, 24
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=gen).view(T, -1, D)
    x = qkv[:, :heads + kv_heads]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.tensor([0.0, 3, 7, 100, 2], dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
    assert_close(K.rope(x, cos, sin, out_dtype), K.rope_ref(x, cos, sin, out_dtype), TOL[out_dtype], "rope")


def test_launchers_name_the_bad_argument():
    q, kc = torch.randn(2, 6, 64), torch.randn(2, 8, 16, 64)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be one of int32, int64"):
        K.paged_decode_attention(q, kc, kc, tables.float(), lens, 0.1)
    with pytest.raises(ValueError, match="not a multiple of the cache's 4 KV heads"):
        K.paged_decode_attention(q, torch.randn(4, 8, 16, 64), torch.randn(4, 8, 16, 64), tables, lens, 0.1)
    with pytest.raises(ValueError, match="k_cache must be bfloat16"):
        K.paged_decode_attention(q.bfloat16(), kc, kc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="its scales are needed"):
        K.paged_decode_attention(q, kc.to(torch.int8), kc.to(torch.int8), tables, lens, 0.1)
    with pytest.raises(ValueError, match="context_lens must have shape"):
        K.paged_decode_attention(q, kc, kc, tables, torch.ones(3, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="q must have stride 1"):
        K.paged_decode_attention(torch.randn(2, 64, 6).transpose(1, 2), kc, kc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="partition_size"):
        K.paged_decode_attention(q, kc, kc, tables, lens, 0.1, partition_size=100)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        K.write_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), kc, kc, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="qweight must have shape"):
        K.int4_matmul(torch.randn(1, 128), torch.zeros(8, 16, dtype=torch.int32), torch.ones(4, 16),
                      torch.ones(4, 16), 32)
    with pytest.raises(ValueError, match="weight must be one of float8_e4m3fn"):
        K.fp8_matmul(torch.randn(1, 16), torch.randn(8, 16), torch.ones(8))
    with pytest.raises(ValueError, match="h must be one of float32"):
        K.add_rms_norm(torch.randn(2, 8).bfloat16(), None, torch.ones(8), 1e-5, torch.float32)
    with pytest.raises(ValueError, match="head dim must be even"):
        K.rope(torch.randn(2, 1, 5), torch.ones(2, 5), torch.ones(2, 5))


def test_empty_inputs_launch_nothing():
    kc = torch.randn(2, 8, 16, 64)
    empty_i = torch.zeros(0, dtype=torch.int32)
    assert K.paged_decode_attention(torch.randn(0, 4, 64), kc, kc, torch.zeros(0, 1, dtype=torch.int32), empty_i,
                                    0.1).shape == (0, 4, 64)
    q = torch.randn(3, 4, 64)
    out = K.paged_prefill_attention(q, kc, kc, torch.zeros(0, 1, dtype=torch.int32), empty_i, empty_i, empty_i, 0.1,
                                    out=q.clone())
    assert torch.equal(out, q)
    K.write_kv(torch.randn(0, 2, 64), torch.randn(0, 2, 64), kc, kc, torch.zeros(0, dtype=torch.long))
