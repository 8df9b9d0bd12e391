"""Quantisation primitives and checkpoint layouts: error bounds, exact round trips, bit order."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.quantizers.layouts import (
    AWQ_PACK_ORDER,
    AWQ_UNPACK_ORDER,
    awq_pack,
    awq_unpack,
    gptq_pack,
    gptq_unpack,
)
from tokenloom.plugins.quantizers.primitives import (
    QuantizedWeight,
    dequantize_fp8_e4m3,
    dequantize_int8_per_channel,
    fp8_e4m3_error_bound,
    int8_error_bound,
    pack_int4,
    quantize_fp8_e4m3,
    quantize_int8_per_channel,
    quantize_rtn,
    rtn_error_bound,
    unpack_int4,
)
from tokenloom.plugins.quantizers.quant_config import (
    QuantConfig,
    awq_config,
    gptq_config,
    read_quant_config,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _i32(u: int) -> int:
    """An unsigned 32-bit word as the signed int32 value stored on disk."""
    return u - 2**32 if u >= 2**31 else u


def _weights(out_f: int = 24, in_f: int = 40, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    w = torch.randn(out_f, in_f, generator=g)
    # rows of different magnitudes and an outlier, so groups differ
    w = w * torch.logspace(-3, 1, out_f).unsqueeze(1)
    w[min(5, out_f - 1), 7] = 40.0
    return w


def _random_qtensor(out_f, in_f, bits, group_size, zero_lo, zero_hi, seed=0, g_idx=None):
    """Known codes / zeros / fp16-exact scales, in the shapes a QuantizedWeight needs."""
    g = _gen(seed)
    n_groups = -(-in_f // group_size) if g_idx is None else int(g_idx.max()) + 1
    q = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.uint8)
    zeros = torch.randint(zero_lo, zero_hi + 1, (out_f, n_groups), generator=g).float()
    scales = (torch.rand(out_f, n_groups, generator=g) * 0.1 + 1e-3).half().float()
    return QuantizedWeight(codes=q, scales=scales, zeros=zeros, bits=bits, group_size=group_size, g_idx=g_idx)


def _assert_same_qtensor(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert a.bits == b.bits and a.group_size == b.group_size
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.float(), b.scales.float())
    assert torch.equal(a.zeros.float(), b.zeros.float())
    if a.g_idx is None or b.g_idx is None:
        assert torch.equal(a.group_index(), b.group_index())
    else:
        assert torch.equal(a.g_idx.to(torch.int64), b.g_idx.to(torch.int64))
    assert torch.equal(a.dequantize(), b.dequantize())


# --------------------------------------------------------------------------- int4 packing


@pytest.mark.parametrize("shape", [(24, 40), (3, 5, 8), (2,)])
def test_pack_int4_round_trip(shape):
    codes = torch.randint(0, 16, shape, generator=_gen(1), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_int4(packed), codes)


def test_pack_int4_low_nibble_first():
    codes = torch.tensor([1, 2, 15, 0, 0, 9], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [0x21, 0x0F, 0x90]


def test_pack_int4_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(TypeError):
        pack_int4(torch.zeros(2, dtype=torch.int32))


# --------------------------------------------------------------------------- RTN


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size,n_groups", [(-1, 1), (None, 1), (40, 1), (8, 5), (20, 2)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rtn_error_within_half_scale(sym, group_size, n_groups, bits):
    w = _weights()
    qt = quantize_rtn(w, bits=bits, group_size=group_size, sym=sym)
    assert qt.codes.shape == (24, 40) and qt.codes.dtype == torch.uint8
    assert qt.scales.shape == qt.zeros.shape == (24, n_groups)
    assert qt.scales.dtype == torch.float32 and qt.g_idx is None
    assert int(qt.codes.max()) <= 2**bits - 1
    assert torch.equal(qt.zeros, qt.zeros.round())
    if sym:
        assert bool((qt.zeros == 2 ** (bits - 1)).all())
        assert int(qt.codes.min()) >= 1  # signed range [-(2^(b-1)-1), 2^(b-1)-1], offset 2^(b-1)
    err = (qt.dequantize() - w).abs()
    assert bool((err <= rtn_error_bound(qt)).all()), float((err / rtn_error_bound(qt)).max())


@pytest.mark.parametrize("group_size", [-1, 8])
def test_rtn_asym_on_grid_is_exact(group_size):
    out_f, in_f, bits = 6, 16, 4
    gs = in_f if group_size == -1 else group_size
    n_groups = in_f // gs
    g = _gen(2)
    q = torch.randint(0, 16, (out_f, in_f), generator=g)
    q[:, 0::gs] = 0  # every group spans the whole code range, so min/max pin the grid
    q[:, 1::gs] = 15
    z = torch.randint(0, 16, (out_f, n_groups), generator=g).float()
    s = 2.0 ** -torch.randint(2, 9, (out_f, n_groups), generator=g).float()  # powers of two
    w = (q.float() - z.repeat_interleave(gs, dim=1)) * s.repeat_interleave(gs, dim=1)
    qt = quantize_rtn(w, bits=bits, group_size=group_size, sym=False)
    assert torch.equal(qt.codes, q.to(torch.uint8))
    assert torch.equal(qt.zeros, z)
    assert torch.equal(qt.scales, s)
    assert torch.equal(qt.dequantize(), w)


@pytest.mark.parametrize("group_size", [-1, 4])
def test_rtn_sym_on_grid_is_exact(group_size):
    out_f, in_f = 5, 12
    gs = in_f if group_size == -1 else group_size
    g = _gen(3)
    k = torch.randint(-7, 8, (out_f, in_f), generator=g)
    k[:, 0::gs] = 7  # max |k| = 7 in each group
    k[1, 0::gs] = -7
    s = 2.0 ** -torch.randint(1, 6, (out_f, in_f // gs), generator=g).float()
    w = k.float() * s.repeat_interleave(gs, dim=1)
    qt = quantize_rtn(w, bits=4, group_size=group_size, sym=True)
    assert torch.equal(qt.codes, (k + 8).to(torch.uint8))
    assert torch.equal(qt.scales, s)
    assert torch.equal(qt.dequantize(), w)


@pytest.mark.parametrize("sym", [False, True])
def test_rtn_all_zero_rows_and_groups(sym):
    w = _weights(8, 32)
    w[3] = 0.0
    w[6, 8:16] = 0.0
    qt = quantize_rtn(w, bits=4, group_size=8, sym=sym)
    deq = qt.dequantize()
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(qt.scales).all())
    assert bool((deq[3] == 0).all()) and bool((deq[6, 8:16] == 0).all())
    assert bool((qt.scales[3] == 1).all()) and float(qt.scales[6, 1]) == 1.0
    assert float(qt.zeros[3, 0]) == 8.0  # mid code: storable in GPTQ v1 (z - 1 >= 0)
    assert bool(((deq - w).abs() <= rtn_error_bound(qt)).all())


def test_rtn_zero_is_exact_and_low_precision_input():
    w = _weights(4, 16).to(torch.bfloat16)
    w[:, 3] = 0
    qt = quantize_rtn(w, bits=3, group_size=8)
    assert bool((qt.dequantize()[:, 3] == 0).all())  # 0 is always on the asymmetric grid
    assert bool(((qt.dequantize() - w.float()).abs() <= rtn_error_bound(qt)).all())


def test_rtn_rejects_bad_arguments():
    w = torch.randn(4, 40)
    with pytest.raises(ValueError, match="group_size=16"):
        quantize_rtn(w, group_size=16)
    with pytest.raises(ValueError, match="group_size=64"):
        quantize_rtn(w, group_size=64)
    with pytest.raises(ValueError, match="bits"):
        quantize_rtn(w, bits=9)
    with pytest.raises(ValueError, match="bits"):
        quantize_rtn(w, bits=1, sym=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(torch.randn(40))
    with pytest.raises(ValueError, match="NaN"):
        quantize_rtn(torch.full((2, 8), float("nan")), group_size=8)


def test_qtensor_validates_shapes():
    q = torch.zeros(4, 16, dtype=torch.uint8)
    s = torch.ones(4, 2)
    QuantizedWeight(codes=q, scales=s, zeros=s, bits=4, group_size=8)
    QuantizedWeight(codes=q, scales=torch.ones(4, 3), zeros=torch.ones(4, 3), bits=4, group_size=6)  # ragged
    with pytest.raises(ValueError, match="groups"):
        QuantizedWeight(codes=q, scales=s, zeros=s, bits=4, group_size=4)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(codes=q.to(torch.int32), scales=s, zeros=s, bits=4, group_size=8)
    with pytest.raises(ValueError, match="g_idx"):
        QuantizedWeight(codes=q, scales=s, zeros=s, bits=4, group_size=8,
                g_idx=torch.full((16,), 2, dtype=torch.int32))


# --------------------------------------------------------------------------- int8 / fp8


def test_int8_per_channel_error_within_half_scale():
    w = _weights()
    w[2] = 0.0
    q, s = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (24,)
    assert int(q.min()) >= -127 and float(s[2]) == 1.0 and bool((q[2] == 0).all())
    assert bool((q.abs().amax(dim=1)[[0, 1, 3]] == 127).all())  # max|w| lands on +-127
    err = (dequantize_int8_per_channel(q, s) - w).abs()
    assert bool((err <= int8_error_bound(s)).all())


def test_fp8_e4m3_relative_error():
    # Values spread over 5 decades per row, so some scaled values x = w / s fall below
    # e4m3's smallest normal 2^-6. There the spacing is the fixed subnormal step 2^-9, so
    # the relative bound 2^-4 |x| no longer holds; the bound used is
    # max(2^-4 |w|, 2^-10 s): half-ulp relative for normals, half the subnormal step below.
    g = _gen(4)
    w = torch.randn(24, 40, generator=g) * 10.0 ** torch.empty(24, 40).uniform_(-5, 0, generator=g)
    w[7] = 0.0
    q, s = quantize_fp8_e4m3(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (24,) and float(s[7]) == 1.0
    deq = dequantize_fp8_e4m3(q, s)
    assert bool(torch.isfinite(deq).all()) and bool((deq[7] == 0).all())
    err = (deq - w).abs()
    bound = fp8_e4m3_error_bound(w, s)
    assert bool((err <= bound).all())
    x = (w / s.unsqueeze(1)).abs()
    normal = x >= 2.0**-6
    assert bool(normal.any()) and bool((~normal & (w != 0)).any())  # both regimes exercised
    assert bool((err[normal] <= w.abs()[normal] * 2.0**-4 * (1 + 2**-10)).all())
    assert float((err / bound).max()) > 0.5  # the bound is not vacuous
    # max|w| of each row maps to 448 and comes back to float32 rounding
    amax = w.abs().amax(dim=1)
    assert torch.allclose(deq.abs().amax(dim=1), amax, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- GPTQ v1


def test_gptq_hand_packed_example():
    # K = N = 8, 4 bits, one group of 8. Codes q[n, k] = (k + n) % 16, zero of column n is
    # n + 1, scale 0.5 * (n + 1).
    k_, n_ = 8, 8
    q = ((torch.arange(k_).unsqueeze(0) + torch.arange(n_).unsqueeze(1)) % 16).to(torch.uint8)
    zeros = (torch.arange(n_) + 1).float().unsqueeze(1)
    scales = (0.5 * (torch.arange(n_) + 1)).float().unsqueeze(1)
    qt = QuantizedWeight(codes=q, scales=scales, zeros=zeros, bits=4, group_size=8)
    t = gptq_pack(qt)
    # qweight[0, n]: input rows 0..7 of column n, row 0 in the lowest nibble.
    expected_qweight = [0x76543210, 0x87654321, 0x98765432, 0xA9876543,
                        0xBA987654, 0xCBA98765, 0xDCBA9876, 0xEDCBA987]
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (1, 8)
    assert t["qweight"][0].tolist() == [_i32(u) for u in expected_qweight]
    # qzeros[0, 0]: columns 0..7, column 0 lowest, each stored as z - 1 = n.
    assert t["qzeros"].tolist() == [[0x76543210]]
    assert t["scales"].dtype == torch.float16
    assert t["scales"].tolist() == [[0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]]
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].tolist() == [0] * 8
    back = gptq_unpack(t, bits=4, group_size=8)
    _assert_same_qtensor(back, qt)
    assert back.g_idx is None


def test_gptq_hand_packed_8bit_and_sign():
    # 8 bits: 4 codes per word; q[n, k] = 16 n + k; zeros 0x81..0x84 stored as 0x80..0x83.
    q = (16 * torch.arange(4).unsqueeze(1) + torch.arange(4).unsqueeze(0)).to(torch.uint8)
    zeros = (0x81 + torch.arange(4)).float().unsqueeze(1)
    qt = QuantizedWeight(codes=q, scales=torch.ones(4, 1), zeros=zeros, bits=8, group_size=4)
    t = gptq_pack(qt)
    assert t["qweight"].tolist() == [[0x03020100, 0x13121110, 0x23222120, 0x33323130]]
    assert t["qzeros"].tolist() == [[_i32(0x83828180)]]
    _assert_same_qtensor(gptq_unpack(t, bits=8, group_size=-1), qt)


@pytest.mark.parametrize("bits,k_,n_,gs", [(2, 48, 32, 16), (4, 40, 24, 8), (4, 40, 24, 40),
                                           (8, 40, 24, 20), (8, 12, 4, 5)])
def test_gptq_round_trip_known_values(bits, k_, n_, gs):
    qt = _random_qtensor(n_, k_, bits, gs, 1, 2**bits, seed=bits + k_)  # v1 zero range [1, 2^b]
    t = gptq_pack(qt)
    per = 32 // bits
    assert t["qweight"].shape == (k_ // per, n_) and t["qzeros"].shape == (qt.n_groups, n_ // per)
    assert t["scales"].shape == (qt.n_groups, n_)
    _assert_same_qtensor(gptq_unpack(t, bits=bits, group_size=gs), qt)


def _gptq_reference_dequant(t, bits):
    """W^T from the on-disk tensors, one element at a time, as a v1 loader does."""
    per, mask = 32 // bits, 2**bits - 1
    qweight, qzeros = t["qweight"].tolist(), t["qzeros"].tolist()
    scales, g_idx = t["scales"].float(), t["g_idx"].tolist()
    k_, n_ = len(qweight) * per, len(qweight[0])
    out = torch.empty(n_, k_)
    for k in range(k_):
        g = g_idx[k]
        for n in range(n_):
            code = ((qweight[k // per][n] & 0xFFFFFFFF) >> (bits * (k % per))) & mask
            zero = (((qzeros[g][n // per] & 0xFFFFFFFF) >> (bits * (n % per))) & mask) + 1
            out[n, k] = (code - zero) * float(scales[g, n])
    return out


def test_gptq_act_order_g_idx_survives():
    k_, n_, gs = 64, 16, 16
    perm = torch.randperm(k_, generator=_gen(5))
    g_idx = torch.empty(k_, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k_) // gs).to(torch.int32)  # groups formed in permuted order
    qt = _random_qtensor(n_, k_, 4, gs, 1, 16, seed=6, g_idx=g_idx)
    t = gptq_pack(qt)
    assert torch.equal(t["g_idx"], g_idx)
    back = gptq_unpack(t, bits=4, group_size=gs)
    assert back.g_idx is not None and back.g_idx.dtype == torch.int32
    _assert_same_qtensor(back, qt)
    assert torch.equal(_gptq_reference_dequant(t, 4), qt.dequantize())


def test_gptq_from_rtn_and_zero_point_limits():
    w = _weights(16, 64)
    qt = quantize_rtn(w, bits=4, group_size=32, sym=True)
    back = gptq_unpack(gptq_pack(qt), bits=4, group_size=32)
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.zeros, qt.zeros)
    assert torch.equal(back.scales, qt.scales.half().float())  # fp16 on disk
    assert torch.equal(_gptq_reference_dequant(gptq_pack(qt), 4), back.dequantize())
    # z = 2^b fits (lane 15), z = 0 does not (v1 stores z - 1)
    top = QuantizedWeight(codes=qt.codes, scales=qt.scales, zeros=torch.full_like(qt.zeros, 16), bits=4,
                  group_size=32)
    assert torch.equal(gptq_unpack(gptq_pack(top), 4, 32).zeros, top.zeros)
    positive = quantize_rtn(w.abs() + 0.1, bits=4, group_size=32)  # no negatives -> z = 0
    with pytest.raises(ValueError, match="z - 1"):
        gptq_pack(positive)
    with pytest.raises(ValueError, match="bits=3"):
        gptq_pack(quantize_rtn(w, bits=3, group_size=32))
    with pytest.raises(ValueError, match="multiples"):
        gptq_pack(quantize_rtn(torch.randn(12, 64), bits=4, group_size=32, sym=True))


# --------------------------------------------------------------------------- AWQ GEMM


def test_awq_hand_packed_example():
    # K = 2, N = 8, one group. Row 0 codes = column index, row 1 codes = 15 - column;
    # zero of column j is 8 + j. Lane i of a word holds column AWQ_PACK_ORDER[i].
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert AWQ_UNPACK_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)
    j = torch.arange(8)
    q = torch.stack([j, 15 - j], dim=1).to(torch.uint8)  # [N, K]
    zeros = (8 + j).float().unsqueeze(1)
    scales = torch.full((8, 1), 0.25)
    qt = QuantizedWeight(codes=q, scales=scales, zeros=zeros, bits=4, group_size=2)
    t = awq_pack(qt)
    # lanes (low first) 0,2,4,6,1,3,5,7 -> hex digits (high first) 7 5 3 1 6 4 2 0
    assert t["qweight"].tolist() == [[0x75316420], [_i32(0x8ACE9BDF)]]
    assert t["qzeros"].tolist() == [[_i32(0xFDB9ECA8)]]  # zero points stored as is
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    assert set(t) == {"qweight", "qzeros", "scales"}
    _assert_same_qtensor(awq_unpack(t, group_size=2), qt)


@pytest.mark.parametrize("k_,n_,gs", [(40, 24, 8), (40, 24, -1), (16, 8, 16)])
def test_awq_round_trip_known_values(k_, n_, gs):
    qt = _random_qtensor(n_, k_, 4, k_ if gs == -1 else gs, 0, 15, seed=k_ + n_)
    t = awq_pack(qt)
    assert t["qweight"].shape == (k_, n_ // 8) and t["qzeros"].shape == (qt.n_groups, n_ // 8)
    _assert_same_qtensor(awq_unpack(t, group_size=gs), qt)


def test_awq_from_rtn_and_rejections():
    w = _weights(16, 64)
    qt = quantize_rtn(w, bits=4, group_size=32)
    back = awq_unpack(awq_pack(qt), group_size=32)
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.zeros, qt.zeros)
    assert torch.allclose(back.dequantize(), qt.dequantize(), rtol=2**-10, atol=0)
    with pytest.raises(ValueError, match="act-order"):
        g_idx = torch.randperm(64, generator=_gen(7)).to(torch.int32) // 32
        awq_pack(QuantizedWeight(codes=qt.codes, scales=qt.scales, zeros=qt.zeros, bits=4, group_size=32,
                         g_idx=g_idx))
    with pytest.raises(ValueError, match="bits=8"):
        awq_pack(quantize_rtn(w, bits=8, group_size=32))
    with pytest.raises(ValueError, match="group_size=24"):
        awq_unpack(awq_pack(qt), group_size=24)


# --------------------------------------------------------------------------- configs


def test_gptq_config_keys_and_read_back():
    cfg = gptq_config(4, 128, desc_act=True, sym=False)
    assert set(cfg) == {"bits", "group_size", "desc_act", "sym", "damp_percent", "static_groups",
                        "true_sequential", "model_name_or_path", "model_file_base_name",
                        "quant_method", "checkpoint_format"}
    assert cfg["quant_method"] == "gptq" and cfg["checkpoint_format"] == "gptq"
    rc = read_quant_config(cfg)
    assert rc == QuantConfig("gptq", 4, 128, True, False, "gptq")
    assert rc[:3] == ("gptq", 4, 128)


def test_read_quant_config_variants():
    old_autogptq = {"bits": 8, "group_size": -1, "damp_percent": 0.01, "desc_act": False,
                    "sym": True, "true_sequential": True}
    assert read_quant_config(old_autogptq) == QuantConfig("gptq", 8, -1, False, True, "gptq")
    autoawq = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    assert read_quant_config(autoawq) == QuantConfig("awq", 4, 128, False, False, "gemm")
    hf_awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    assert read_quant_config(hf_awq) == QuantConfig("awq", 4, 64, False, False, "gemm")
    assert read_quant_config(awq_config(group_size=64)) == read_quant_config(hf_awq)
    whole = {"architectures": ["LlamaForCausalLM"], "quantization_config": hf_awq}
    assert read_quant_config(whole).method == "awq"


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
     "checkpoint_format='gptq_v2'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
     "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"w_bit": 4, "q_group_size": 128, "zero_point": False}, "zero_point"),
    ({"w_bit": 8, "q_group_size": 128}, "w_bit=8"),
    ({"quant_method": "awq", "bits": "4", "group_size": 128}, "bits='4'"),
])
def test_read_quant_config_rejects(cfg, match):
    with pytest.raises(ValueError, match=match):
        read_quant_config(cfg)
