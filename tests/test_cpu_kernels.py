"""The C++ CPU ops (kernels/cpu_ops.py) against what they replace: the fused decode
attention against the torch path, at odd shapes, op by op, and as greedy outputs of a whole
engine; quant_matmul against the dequantised matmul."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.backends.torch_backend import TorchBackend, TorchBackendOptions
from tokenloom.core.attention import AttentionInputs, apply_rope
from tokenloom.core.errors import ConfigError
from tokenloom.kernels import cpu_ops

from conftest import tiny_engine_kwargs


def test_the_ops_build_where_there_is_a_compiler():
    """The other tests here skip where the ops cannot be built; a machine with a C++ compiler
    must build them, so a broken source fails here instead of skipping everything."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    assert cpu_ops.load() is not None, cpu_ops.unavailable_reason()


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    if module is None:
        pytest.skip(f"the C++ op cannot be built here: {cpu_ops.unavailable_reason()}")
    return module


def _decode_inputs(lens, block_size, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randperm(num_blocks, generator=g)[:(n + block_size - 1) // block_size].tolist() for n in lens]
    inp = AttentionInputs(slot_mapping=torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                                                     for t, n in zip(tables, lens, strict=True)]),
                          block_size=block_size)
    inp.decode_rows = list(range(len(lens)))
    inp.decode_context_lens = list(lens)
    inp.decode_block_tables = tables
    return inp


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# head dims 64 and 128 take the compiled-in-size path (on AVX-512 one pass with an online
# softmax, query heads in groups of 16 / (head_dim / 16): 9/3 and 4/1 at 64, 8/2 and 6/2 at 128
# fill their groups or leave one short), the others the generic one
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (8, 2, 128, 16), (6, 2, 128, 16), (4, 2, 24, 4), (6, 6, 8, 1), (4, 1, 64, 5)])
def test_paged_decode_attention_matches_the_torch_path(ops, dtype, tol, heads, kv_heads, head_dim, block_size):
    lens, num_blocks = [1, 17, 45, 5], 64
    torch.manual_seed(1)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    inp = _decode_inputs(lens, block_size, num_blocks)
    fused, plain = TorchBackend(TorchBackendOptions(decode_attention="fused")), \
        TorchBackend(TorchBackendOptions(decode_attention="torch"))
    want = plain.attention(q, None, None, k_cache, v_cache, plain.prepare(inp), head_dim**-0.5)
    got = fused.attention(q, None, None, k_cache, v_cache, fused.prepare(inp), head_dim**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() < tol


def _rope_write_attend(qkv, cos, sin, k_cache, v_cache, inp, heads, kv_heads, head_dim, dtype):
    """What the model does op by op on the torch path for a decode layer: RoPE on q and k,
    the KV write into ``k_cache`` / ``v_cache``, attention; returns [T, heads * head_dim]."""
    plain = TorchBackend(TorchBackendOptions(decode_attention="torch"))
    T, qs = qkv.shape[0], heads * head_dim
    qk = apply_rope(qkv[:, :qs + kv_heads * head_dim].view(T, -1, head_dim), cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[:, qs + kv_heads * head_dim:].view(T, kv_heads, head_dim)
    meta = plain.prepare(inp)
    plain.write_kv(k_cache, v_cache, k.to(dtype), v, meta.slot_mapping)
    return plain.attention(q.to(dtype), None, None, k_cache, v_cache, meta, head_dim**-0.5).reshape(T, qs)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim, lens", [(16, [3, 9, 1]), (64, [3, 30, 1, 13])])
def test_decode_layer_attention_matches_rope_write_and_attend(ops, dtype, tol, head_dim, lens):
    """One call does what the model does op by op: RoPE on q and k, the KV write (the same
    bits in the same slots), and attention over each context including the new token."""
    heads, kv_heads, block_size, num_blocks = 6, 2, 4, 32
    torch.manual_seed(2)
    caches = [torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype) for _ in range(2)]
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(len(lens), head_dim // 2) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    inp = _decode_inputs(lens, block_size, num_blocks, seed=3)

    k_ref, v_ref = (c.clone() for c in caches)
    want = _rope_write_attend(qkv, cos, sin, k_ref, v_ref, inp, heads, kv_heads, head_dim, dtype)

    fused = TorchBackend(TorchBackendOptions(decode_attention="fused"))
    k_got, v_got = (c.clone() for c in caches)
    got = fused.decode_attention_block(qkv, cos, sin, k_got, v_got, fused.prepare(inp), heads, head_dim**-0.5)
    assert torch.equal(v_got, v_ref)
    assert (k_got.float() - k_ref.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert (got.float() - want.float()).abs().max().item() < tol


def _eight_bit_pools(storage: str, dtype, kv_heads, num_blocks, block_size, head_dim):
    """Two 8-bit pools (K, V) as the backend allocates them, filled through QuantizedKV.write."""
    backend = TorchBackend(TorchBackendOptions(decode_attention="torch"))
    (k, v), = backend.allocate_kv_cache(1, num_blocks, block_size, kv_heads, head_dim, dtype, storage)
    slots = torch.arange(num_blocks * block_size)
    for pool in (k, v):
        pool.write((torch.randn(len(slots), kv_heads, head_dim) * 3).to(dtype), slots)
    return k, v


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 2, 24, 4)])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_decode_attention_reads_eight_bit_pools_in_place(ops, storage, dtype, tol, heads, kv_heads, head_dim,
                                                               block_size, window):
    """int8 / fp8 pools with their per-token scales: the C++ op dequantises each row as the
    torch path does (data * scale in the model dtype) and gives its attention."""
    lens, num_blocks = [1, 17, 45, 5], 64
    torch.manual_seed(5)
    k, v = _eight_bit_pools(storage, dtype, kv_heads, num_blocks, block_size, head_dim)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    inp = _decode_inputs(lens, block_size, num_blocks)
    fused, plain = TorchBackend(TorchBackendOptions(decode_attention="fused")), \
        TorchBackend(TorchBackendOptions(decode_attention="torch"))
    win = window or None
    want = plain.attention(q, None, None, k, v, plain.prepare(inp), head_dim**-0.5, window=win)
    got = fused.attention(q, None, None, k, v, fused.prepare(inp), head_dim**-0.5, window=win)
    assert got.dtype == dtype and (got.float() - want.float()).abs().max().item() < tol
    # the same attention over plain pools holding the dequantised values
    kd, vd = (pool.gather_blocks(torch.arange(num_blocks)) for pool in (k, v))
    plain_pools = fused.attention(q, None, None, kd, vd, fused.prepare(inp), head_dim**-0.5, window=win)
    assert torch.equal(got, plain_pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_code_reads_back_exactly(ops, dtype):
    """The op converts e4m3 on the bits (no table): every finite code, subnormals and -0
    included, gives the value torch's conversion gives."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    (k, v), = TorchBackend(TorchBackendOptions(decode_attention="torch")).allocate_kv_cache(1, 16, 16, 1, 64, dtype, "fp8")
    for pool, shift in ((k, 0), (v, 7)):
        pool.data.view(torch.uint8).view(-1).copy_(codes.roll(shift).repeat(65)[:16 * 16 * 64])
        pool.scale.fill_(0.5)
    lens = [256, 100, 3]
    inp = _decode_inputs(lens, 16, 16)
    q = torch.randn(len(lens), 2, 64).to(dtype) * 0.01
    fused = TorchBackend(TorchBackendOptions(decode_attention="fused"))
    got = fused.attention(q, None, None, k, v, fused.prepare(inp), 0.125)
    kd, vd = (pool.gather_blocks(torch.arange(16)) for pool in (k, v))
    assert torch.equal(got, fused.attention(q, None, None, kd, vd, fused.prepare(inp), 0.125))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layer_attention_writes_eight_bit_pools_as_the_torch_path(ops, storage, dtype):
    """The fused layer quantises the new k and v into the same bytes and scales as
    QuantizedKV.write, and attends as the op-by-op path does."""
    heads, kv_heads, head_dim, block_size, num_blocks, lens = 6, 2, 64, 4, 32, [3, 30, 1, 13]
    torch.manual_seed(6)
    qkv = (torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim) * 2).to(dtype)
    qkv[0, heads * head_dim:(heads + 1) * head_dim] = 0  # an all-zero k row: the smallest scale, zeros back
    angles = torch.rand(len(lens), head_dim // 2) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    inp = _decode_inputs(lens, block_size, num_blocks, seed=3)

    k_ref, v_ref = _eight_bit_pools(storage, dtype, kv_heads, num_blocks, block_size, head_dim)
    k_got, v_got = (type(p)(p.data.clone(), p.scale.clone(), p.dtype, p.qmax) for p in (k_ref, v_ref))
    want = _rope_write_attend(qkv, cos, sin, k_ref, v_ref, inp, heads, kv_heads, head_dim, dtype)

    fused = TorchBackend(TorchBackendOptions(decode_attention="fused"))
    got = fused.decode_attention_block(qkv, cos, sin, k_got, v_got, fused.prepare(inp), heads, head_dim**-0.5)
    assert got is not None
    for mine, theirs in ((k_got, k_ref), (v_got, v_ref)):
        assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8))
        assert torch.equal(mine.scale, theirs.scale)
    assert (got.float() - want.float()).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 576), (7, 33), (40, 64)])
def test_add_rms_norm_matches_torch(ops, dtype, rows, width):
    torch.manual_seed(4)
    h = torch.randn(rows, width) * 30
    pair = torch.randn(rows, 2 * width).to(dtype)
    delta = pair[:, :width]  # a strided view, as a fused projection's half is
    weight = torch.randn(width)
    fused, plain = TorchBackend(TorchBackendOptions(decode_attention="fused")), \
        TorchBackend(TorchBackendOptions(decode_attention="torch"))
    want_x, want_h = plain.add_rms_norm(h, delta, weight, 1e-5, dtype)
    h_in = h.clone()
    got_x, got_h = fused.add_rms_norm(h_in, delta, weight, 1e-5, dtype)
    assert got_h.data_ptr() == h_in.data_ptr() and got_x.dtype == dtype  # the stream, updated in place
    assert torch.allclose(got_h, want_h, rtol=0, atol=1e-5)
    ulp = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got_x.float(), want_x.float(), rtol=ulp, atol=ulp)
    no_delta, _ = fused.add_rms_norm(h.clone(), None, weight, 1e-5, dtype)
    assert torch.allclose(no_delta.float(), plain.add_rms_norm(h, None, weight, 1e-5, dtype)[0].float(),
                          rtol=ulp, atol=ulp)



def test_the_fused_path_steps_aside_where_it_does_not_apply(ops):
    backend = TorchBackend(TorchBackendOptions(decode_attention="fused"))
    inp = _decode_inputs([5], 4, 8)
    meta = backend.prepare(inp)
    qkv = torch.randn(1, (2 + 2) * 8)
    caches = [torch.zeros(1, 8, 4, 8) for _ in range(2)]
    cos = sin = torch.ones(1, 1, 8)
    assert backend.decode_attention_block(qkv.bfloat16(), cos, sin, *caches, meta, 2, 0.3) is None  # dtype differs
    assert backend.decode_attention_block(qkv, cos, sin, *caches, meta, 2, 0.3) is not None
    assert TorchBackend(TorchBackendOptions(decode_attention="torch")).decode_attention_block(
        qkv, cos, sin, *caches, meta, 2, 0.3) is None
    with pytest.raises(ConfigError, match="decode_attention"):
        TorchBackend(TorchBackendOptions(decode_attention="fast"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_greedy_outputs_are_the_same_with_and_without_the_fused_op(ops, tiny_model_dir, kv_cache_dtype):
    """Continuous batching mixes prefill and decode steps; 8-bit pools are read in place by
    the fused op and dequantised by the torch path."""
    prompts = [[3 + i for i in range(n)] for n in (5, 23, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs, logprobs = {}, {}
    for mode in ("fused", "torch"):
        kw = tiny_engine_kwargs(tiny_model_dir, backend={"name": "torch", "decode_attention": mode},
                                kv_cache_dtype=kv_cache_dtype)
        with LLM(**kw) as llm:
            assert llm.engine.runner.backend.decode_attention == mode
            streams = llm.run(_streams(llm.engine, prompts, params))
        outs[mode] = [[t for d in deltas for t in d.token_ids] for deltas in streams]
        logprobs[mode] = torch.tensor([lp.logprob for deltas in streams for d in deltas for lp in d.logprobs])
    assert outs["fused"] == outs["torch"]
    # and not by luck: the chosen tokens' log-probabilities agree to float32 rounding
    assert (logprobs["fused"] - logprobs["torch"]).abs().max().item() < 1e-4


async def _streams(engine, prompts, params) -> list[list]:
    """Every request's deltas, all requests in flight at once (continuous batching)."""
    import asyncio

    from tokenloom.core.outputs import TokenDelta

    async def one(prompt):
        return [d async for d in engine.generate(prompt, params) if isinstance(d, TokenDelta)]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag}" in line for line in f)
    except OSError:
        return False


def _quantized(out: int, inp: int, bits: int, group: int, seed: int = 0):
    """A random QuantizedWeight whose scales and scale * zero products are float16 values (as
    GGUF stores them), so the kernel's float16 copies hold them exactly."""
    from tokenloom.core.weights import QuantizedWeight

    g = torch.Generator().manual_seed(seed)
    groups = inp // group
    codes = torch.randint(0, 2 ** bits, (out, inp), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, groups, generator=g) * 0.05 + 1e-3).half().float()
    if bits == 8:
        zeros = torch.full((out, groups), 128.0)
    else:  # offsets -zero * scale in float16 (GGUF Q4_1's m): zero = -offset / scale
        offsets = (torch.randn(out, groups, generator=g) * 0.1).half().float()
        zeros = -offsets / scales
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=group)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bits, out, inp, group", [(4, 48, 64, 32), (4, 32, 96, 96), (4, 16, 256, 128),
                                                   (8, 48, 64, 32), (8, 32, 33, 33), (8, 16, 40, 40)])
def test_quant_matmul_matches_the_dequantised_matmul(ops, dtype, tol, bits, out, inp, group):
    from tokenloom.backends.torch_linear import QuantMatmulLinear

    qw = _quantized(out, inp, bits, group)
    assert QuantMatmulLinear.fits(qw)
    lw = QuantMatmulLinear(qw, ops.quant_matmul, 0, None)
    w = qw.dequantize(torch.float64)
    for rows in (1, 3, 8, 9, 17):
        x = torch.randn(rows, inp, dtype=torch.float32).to(dtype)
        ref = x.double() @ w.t()
        y = lw.apply(x)
        assert y.dtype == dtype and y.shape == (rows, out)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (rows, err)
        y32 = lw.apply_float32(x)  # the float32 sums, unrounded
        assert y32.dtype == torch.float32
        assert ((y32.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_quant_matmul_result_does_not_depend_on_the_rows_beside_it(ops, dtype, bits):
    """Rows are taken in chunks of up to 8 (4 without AVX-512), each row's arithmetic the same
    in any chunk: alone or among 21 other rows, a row's output is bit-identical."""
    from tokenloom.backends.torch_linear import QuantMatmulLinear

    lw = QuantMatmulLinear(_quantized(64, 128, bits, 32, seed=3), ops.quant_matmul, 0, None)
    x = torch.randn(22, 128).to(dtype)
    together = lw.apply(x)
    for r in range(22):
        assert torch.equal(lw.apply(x[r:r + 1])[0], together[r]), r
    assert torch.equal(lw.apply(x[5:14]), together[5:14])


def test_pack_gives_quant_matmul_what_fits_and_torch_the_rest(ops):
    from tokenloom.backends.torch_linear import Int4Linear, QuantMatmulLinear, pack
    from tokenloom.core.weights import QuantizedWeight

    def packed(qw):
        return pack(qw, torch.bfloat16, cpu_linear="mkl", quant_max_rows=0, quant_ops=ops)

    assert isinstance(packed(_quantized(64, 128, 4, 32)), QuantMatmulLinear)
    assert isinstance(packed(_quantized(64, 128, 8, 32)), QuantMatmulLinear)  # GGUF Q8_0: no re-grouping
    assert "quant_matmul" not in packed(_quantized(24, 128, 4, 32)).kernel  # 16 does not divide out
    act_order = _quantized(64, 128, 4, 32)
    act_order = QuantizedWeight(codes=act_order.codes, scales=act_order.scales, zeros=act_order.zeros, bits=4,
                                group_size=32, g_idx=torch.randperm(128).to(torch.int32) // 32)
    assert "quant_matmul" not in packed(act_order).kernel
    asymmetric = _quantized(64, 128, 8, 32)
    asymmetric = QuantizedWeight(codes=asymmetric.codes, scales=asymmetric.scales,
                                 zeros=asymmetric.zeros - 3, bits=8, group_size=32)
    assert "quant_matmul" not in packed(asymmetric).kernel
    huge = _quantized(64, 128, 4, 32)
    huge = QuantizedWeight(codes=huge.codes, scales=huge.scales * 1e6, zeros=huge.zeros, bits=4, group_size=32)
    assert isinstance(packed(huge), Int4Linear)  # scales past float16's range: torch's kernel
    # a float16 subnormal scale (a GGUF block of tiny weights) is exact: taken; a float32 one
    # float16 would round by more than its own precision: not
    tiny = _quantized(64, 128, 8, 32)
    exact = tiny.scales.clone()
    exact[0, 0] = 2.0 ** -20
    assert QuantMatmulLinear.fits(QuantizedWeight(codes=tiny.codes, scales=exact, zeros=tiny.zeros, bits=8,
                                                  group_size=32))
    exact[0, 0] = 1.2345e-7
    assert not QuantMatmulLinear.fits(QuantizedWeight(codes=tiny.codes, scales=exact, zeros=tiny.zeros, bits=8,
                                                      group_size=32))
    # quant_kernel = torch keeps torch's kernels
    assert isinstance(pack(_quantized(64, 128, 4, 32), torch.bfloat16, cpu_linear="mkl", quant_max_rows=0),
                      Int4Linear)


@pytest.mark.parametrize("bits, out, inp, group", [(4, 48, 64, 32), (4, 32, 128, 64), (8, 48, 96, 32),
                                                   (8, 16, 64, 64), (4, 208, 128, 64), (8, 176, 64, 32)])
def test_amx_matmul_matches_the_dense_bfloat16_matmul(ops, bits, out, inp, group):
    """Where the CPU and the build have AMX-BF16, ``amx_matmul`` over quant_matmul's packed
    weight computes what a dense bfloat16 copy would (weights rounded to bfloat16, float32
    sums) at any row count (the wider shapes give each thread several pairs of column blocks,
    the next widened inside the last one's loop, and an odd block at the end), and ``pack``
    puts it in the dense copy's place, sharing the codes; elsewhere the op refuses, saying why, and ``pack`` keeps a dense copy."""
    from tokenloom.backends.torch_linear import AmxLinear, QuantMatmulLinear, pack, step_linear

    qw = _quantized(out, inp, bits, group)
    lw = QuantMatmulLinear(qw, ops.quant_matmul, 0, None)
    x = torch.randn(5, inp).bfloat16()
    if not ops.amx_ready():
        with pytest.raises(RuntimeError, match="amx_ready"):
            ops.amx_matmul(x, lw.codes, lw.sm, bits, group)
        return
    w = qw.dequantize(torch.float32).bfloat16().double()  # the dense copy's weights
    for rows in (1, 5, 16, 17, 33, 48, 70):  # (one row tile or two in the last 32-row chunk)
        x = torch.randn(rows, inp).bfloat16()
        ref = x.double() @ w.t()
        y = ops.amx_matmul(x, lw.codes, lw.sm, bits, group)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, rows
        y32 = ops.amx_matmul(x, lw.codes, lw.sm, bits, group, True)  # the float32 sums, unrounded
        assert y32.dtype == torch.float32
        assert ((y32.double() - ref).abs().max() / ref.abs().max()).item() < 2e-3, rows
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_matmul(x.float(), lw.codes, lw.sm, bits, group)
    with pytest.raises(RuntimeError, match="group must be positive"):
        ops.amx_matmul(x, lw.codes, lw.sm, bits, 0)
    with pytest.raises(RuntimeError, match="codes are uint8"):
        ops.amx_matmul(x, lw.codes.view(torch.int8 if bits == 4 else torch.uint8), lw.sm, bits, group)
    packed = pack(qw, torch.bfloat16, cpu_linear="mkl", quant_max_rows=2, quant_ops=ops, amx_ops=ops)
    assert isinstance(packed.dense, AmxLinear) and packed.dense.codes.data_ptr() == packed.codes.data_ptr()
    assert packed.kernel.endswith("/ amx_matmul above 2 rows / dense above 64 rows")
    x = torch.randn(9, inp).bfloat16()
    assert torch.equal(packed.apply(x), ops.amx_matmul(x, lw.codes, lw.sm, bits, group))  # > 2 rows
    many = torch.randn(65, inp).bfloat16()  # > 64 rows (prompt chunks): the dense copy
    assert torch.equal(packed.apply(many), packed.dense.dense.apply(many))
    assert torch.equal(packed.apply(x[:2]), lw.quantised(x[:2]))
    assert torch.equal(packed.apply_float32(x), ops.amx_matmul(x, lw.codes, lw.sm, bits, group, True))
    assert step_linear(packed, ops) is not None  # the captured step mirrors it (StepLinear kind 10 + bits)
    # a float32 model keeps its dense copy
    assert not isinstance(pack(qw, torch.float32, cpu_linear="mkl", quant_max_rows=2, quant_ops=ops,
                               amx_ops=ops).dense, AmxLinear)


def _q8_reference(x: torch.Tensor, qw) -> torch.Tensor:
    """x [rows, K] rounded to 8 bits in blocks of 32 as q8_matmul rounds it (scale max|x| / 127,
    codes to nearest even), times the dequantised weights, in float64."""
    rows, k = x.shape
    xf = x.float().view(rows, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # (127 / t: 127 * (1 / t))
    xq = torch.round(xf * inv).double() * (amax / 127).double()
    return xq.view(rows, k) @ qw.dequantize(torch.float64).t()


@pytest.mark.parametrize("bits, out, inp, group", [(4, 64, 96, 32), (4, 96, 256, 64), (8, 32, 128, 32),
                                                   (4, 32, 1536, 32)])
def test_q8_matmul_is_the_dequantised_weights_times_8_bit_activations(ops, bits, out, inp, group):
    """``q8_matmul`` (AVX512-VNNI builds) multiplies each row's activations, rounded to 8 bits in
    blocks of 32, by the dequantised weights, with each row's result the same alone and in a
    batch; elsewhere it refuses, naming the instruction set it lacks."""
    from tokenloom.backends.torch_linear import Q8Linear

    qw = _quantized(out, inp, bits, group)
    lw = Q8Linear(qw, ops.q8_matmul)
    x = torch.randn(7, inp)
    if not ops.q8_ready():
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            lw.apply(x)
        return
    for rows in (1, 2, 5, 6, 7, 13, 70):
        x = torch.randn(rows, inp) * 3
        x[0, :32] = 0  # an all-zero block: scale 0, codes 0
        ref = _q8_reference(x, qw)
        y = lw.apply(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, rows
        alone = torch.cat([lw.apply(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(alone, y), rows  # a row's result does not depend on the rows beside it
        xb = x.bfloat16()
        yb = lw.apply(xb)
        assert yb.dtype == torch.bfloat16
        assert torch.equal(yb, lw.apply(xb.float()).bfloat16())  # the float32 sums rounded once
    with pytest.raises(RuntimeError, match="group"):
        ops.q8_matmul(x, lw.codes, lw.sm, bits, 16)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.q8_matmul(x, lw.codes, lw.sm, 2, group)
    with pytest.raises(RuntimeError, match="codes"):
        ops.q8_matmul(x, lw.codes.view(torch.int8), lw.sm, bits, group)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.q8_matmul(x[:, :-32], lw.codes, lw.sm, bits, group)


def test_q8_dense_replaces_the_copy_and_is_captured(ops):
    """``pack(..., q8_ops=)``: a 4-bit or 8-bit quant_matmul weight runs q8_matmul above its
    threshold instead of a dense copy, and the captured step mirrors it (StepLinear kinds 24 and
    28); a weight it does not take (groups of 16, asymmetric 8-bit codes) keeps its dense copy."""
    from tokenloom.backends.torch_linear import Q8Linear, QuantMatmulLinear, pack, step_linear
    from tokenloom.core.weights import QuantizedWeight

    if not ops.q8_ready():  # (the generic build: refused at start-up, test_quant_dense_is_checked_at_start_up)
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            Q8Linear(_quantized(64, 128, 4, 32), ops.q8_matmul).apply(torch.randn(3, 128))
        return
    for bits in (4, 8):
        qw = _quantized(64, 128, bits, 32)
        packed = pack(qw, torch.bfloat16, cpu_linear="mkl", quant_max_rows=2, quant_ops=ops, q8_ops=ops)
        assert isinstance(packed, QuantMatmulLinear) and isinstance(packed.dense, Q8Linear)
        assert packed.kernel.endswith("/ q8_matmul above 2 rows")
        x = torch.randn(9, 128).bfloat16()
        assert torch.equal(packed.apply(x), packed.dense.apply(x))  # > 2 rows
        assert torch.equal(packed.apply(x[:2]), packed.quantised(x[:2]))
        assert step_linear(packed, ops) is not None
    sixteen = pack(_quantized(64, 128, 4, 16), torch.bfloat16, cpu_linear="mkl", quant_max_rows=2, quant_ops=ops,
                   q8_ops=ops)
    assert not isinstance(sixteen.dense, Q8Linear)
    eight = _quantized(64, 128, 8, 32)
    asymmetric = QuantizedWeight(codes=eight.codes, scales=eight.scales, zeros=eight.zeros - 3, bits=8, group_size=32)
    assert not Q8Linear.fits(asymmetric)


def test_quant_dense_is_checked_at_start_up(make_llm, ops):
    """``backend.quant_dense``: a value it does not know, or ``amx`` where it cannot run (no
    AMX-BF16 here, or a float32 model), is refused at start-up naming it; ``auto`` on a
    bfloat16 4-bit model takes amx_matmul where the CPU has it, a dense copy elsewhere."""
    from tokenloom.backends.torch_linear import AmxLinear
    from tokenloom.core.errors import ConfigError

    with pytest.raises(ConfigError, match="quant_dense must be auto, amx, copy or q8"):
        make_llm(flags={"backend": {"quant_dense": "tiles"}})
    with pytest.raises(ConfigError, match="bfloat16 models only.*decoder.draft_dtype" if ops.amx_ready()
                       else "no AMX-BF16"):
        make_llm(quantizer="rtn", dtype="float32", flags={"backend": {"quant_dense": "amx"}})
    # where amx_matmul would not run whatever the CPU: named before the CPU is asked
    for backend, why in (({"quant_kernel": "torch"}, "backend.quant_kernel = torch"),
                         ({"quant_max_rows": 0}, "backend.quant_max_rows = 0"),
                         ({"quant_max_rows": 64}, "backend.quant_max_rows = 64 leaves no rows"),
                         ({"batch_invariant": True}, "batch_invariant")):
        with pytest.raises(ConfigError, match=f"quant_dense = amx, but {why}"):
            make_llm(quantizer="rtn", dtype="bfloat16", flags={"backend": {"quant_dense": "amx", **backend}})
    for backend, why in (({"quant_kernel": "torch"}, "backend.quant_kernel = torch"),
                         ({"quant_max_rows": 0}, "backend.quant_max_rows = 0"),
                         ({"batch_invariant": True}, "batch_invariant")):
        with pytest.raises(ConfigError, match=f"quant_dense = q8, but {why}"):
            make_llm(quantizer="rtn", dtype="bfloat16", flags={"backend": {"quant_dense": "q8", **backend}})
    if not ops.q8_ready():
        with pytest.raises(ConfigError, match="quant_dense = q8, but this CPU or build has no AVX512-VNNI"):
            make_llm(quantizer="rtn", dtype="bfloat16", flags={"backend": {"quant_dense": "q8"}})
    llm = make_llm(quantizer="rtn", dtype="bfloat16", flags={"backend": {"quant_max_rows": 2}})
    qkv = llm.engine.runner.model.layers[0].qkv
    assert isinstance(qkv.dense, AmxLinear) == ops.amx_ready()
    assert llm.generate([[5, 9, 33]] * 6, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids


def test_the_build_has_the_paths_its_flags_allow(ops):
    """``TOKENLOOM_CPU_OPS_CFLAGS=-mno-avx512f`` builds the generic paths (the AVX2 machines'
    build); otherwise an AVX-512 CPU gets the hand-vectorised ones."""
    if "-mno-avx512f" in os.environ.get("TOKENLOOM_CPU_OPS_CFLAGS", ""):
        assert ops.simd_path() == "generic"
    elif _cpu_has("avx512f"):
        assert ops.simd_path() == "avx512"


@pytest.mark.slow
def test_the_generic_build_passes_the_same_tests():
    """This machine has AVX-512, CI's or a user's may not: build the ops without it (a
    separate build, cached apart) and run these tests and the captured step's against it."""
    if not _cpu_has("avx512f"):
        pytest.skip("the default build here is already the generic one")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TOKENLOOM_CPU_OPS_CFLAGS": "-mno-avx512f"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          "tests/test_cpu_kernels.py", "tests/test_capture.py"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_rows_gives_apply_ropes_values_exactly(ops, dtype):
    """The prefill RoPE (one pass) against core/attention.py's reference rounded as the model
    rounds it: bit for bit, on the q and k heads of a wider qkv row (strided rows), float32 out
    and the model's dtype out, at a row count that splits between threads and one that does not."""
    g = torch.Generator().manual_seed(3)
    for T in (1, 5, 300):
        qkv = (torch.randn(T, 15 * 64, generator=g) * 3).to(dtype)
        x = qkv[:, :12 * 64].view(T, 12, 64)  # 9 q heads + 3 k heads; v follows in the row
        angles = torch.rand(T, 1, 32, generator=g) * 500
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        for out in (torch.float32, dtype):
            got, want = ops.rope_rows(x, cos, sin, out), apply_rope(x, cos, sin).to(out)
            assert got.dtype == out and torch.equal(got, want), (T, out, (got.float() - want.float()).abs().max())
    with pytest.raises(RuntimeError, match="heads contiguous"):
        ops.rope_rows(torch.zeros(2, 64, 3).transpose(1, 2), cos[:2], sin[:2], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_picks_torchs_index(ops, dtype):
    """The sampler's argmax: torch.argmax's index exactly, ties (the first), NaN (the first NaN
    wins), all -inf, strided rows, and a row count that splits between threads."""
    g = torch.Generator().manual_seed(0)
    for B, V in ((1, 1), (3, 7), (5, 49152), (64, 4099)):
        x = torch.randn(B, V, generator=g).to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1)), (B, V)
    ties = torch.randint(0, 3, (8, 100), generator=g).to(dtype)
    assert torch.equal(ops.argmax_rows(ties), ties.argmax(-1))
    x = torch.randn(4, 50, generator=g).to(dtype)
    x[1, 30] = x[2, 40] = x[2, 3] = float("nan")
    x[3] = float("-inf")
    assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [int(x[0].argmax()), 30, 3, 0]
    x = torch.randn(6, 70, generator=g).to(dtype)[:, 3:]
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))


def test_silu_mul_rounds_as_torch_does(ops):
    """The batch-invariant mode's SwiGLU: F.silu(gate) * up's two roundings in bf16 / fp16 (its
    own exp differs from torch's by an ulp or two in float32, so an element on a rounding
    boundary may round the other way: at most one in a thousand, by one unit), float32 within
    an ulp or two."""
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(37, 2 * 1536, generator=g) * 3
    for dtype in (torch.bfloat16, torch.float16):
        gate, up = gu.to(dtype).chunk(2, -1)
        got, want = ops.silu_mul(gate, up).float(), (torch.nn.functional.silu(gate) * up).float()
        off = got != want
        assert off.float().mean() <= 1e-3
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - {torch.bfloat16: 7, torch.float16: 10}[dtype])
        assert ((got - want).abs()[off] <= 2 * ulp[off]).all()
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
