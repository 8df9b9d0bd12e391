"""The load pipeline with quantised weights: raw GGUF blocks -> quantizer -> backend kernel."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import write_gguf

from tokenloom import LLM
from tokenloom.core.errors import ConfigError

from conftest import quant_kernel

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5, 77, 3, 200, 14, 9, 9, 120, 33, 1, 250]


def _logits(path, **kw):
    with LLM(model=str(path), dtype="float32", num_kv_blocks=16, **kw) as llm:
        layer = llm.engine.runner.model.linear_layers()[0]
        kernels = {n: layer[n].kernel for n in ("qkv", "o", "gate_up", "down")}
        layer_bytes = sum(layer[n].nbytes() for n in ("qkv", "o", "gate_up", "down"))
        return llm.engine.runner.prefill_logits(IDS, [0]), kernels, layer_bytes


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_native_gguf_4bit_matches_the_dequantised_model(tmp_path, tiny_hf_model, qtype):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model, qtype)
    native, kernels, native_bytes = _logits(path)  # a quantised GGUF gets the `gguf` quantizer by default
    dense, dense_kernels, dense_bytes = _logits(path, quantizer="none")
    assert all(k.startswith(quant_kernel(4)) for k in kernels.values()), kernels
    assert all("float32" in k for k in dense_kernels.values()), dense_kernels
    assert native_bytes * 5 < dense_bytes  # 4 bits + a float32 scale and zero per 32 vs 32 bits
    # quant_matmul: float32 activations, GGUF's float16 scales exactly: the dense model's logits
    # up to float32 summation order; torch's int4 kernel (bf16 activations and scales): close
    rel = (native - dense).abs().max() / dense.abs().max()
    assert rel < (1e-4 if quant_kernel(4).startswith("quant_matmul") else 0.02), f"max logit difference {rel:.3%}"
    assert (native.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def test_batches_above_quant_max_rows_use_the_dense_copy(tmp_path, tiny_hf_model):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model, Q.Q4_1)
    with LLM(model=str(path), dtype="float32", num_kv_blocks=16, backend={"name": "torch", "quant_max_rows": 8}) as llm:
        w = llm.engine.runner.model.linear_layers()[0]["gate_up"]
        big = torch.randn(40, w.in_features)
        by_int4 = torch.cat([w.apply(big[i:i + 8]) for i in range(0, 40, 8)])  # <= 8 rows: the 4-bit kernel
        assert torch.equal(by_int4[:8], w.quantised(big[:8]).float())
        assert torch.allclose(w.apply(big), by_int4, rtol=2e-2, atol=2e-2)  # > 8 rows: the dense copy, same values
        assert torch.equal(w.apply(big), w.dense.apply(big))
        assert "onednn above (float32, measured)" in w.dense.kernel  # the engine dtype's best dense path


def test_the_crossing_to_the_dense_copy_is_measured_per_shape(tmp_path, tiny_hf_model):
    from tokenloom.backends.torch_linear import KERNEL_TIMINGS, TUNE_MARGIN, QuantMatmulLinear

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model, Q.Q4_1)
    KERNEL_TIMINGS.clear()
    with LLM(model=str(path), dtype="float32", num_kv_blocks=16) as llm:  # quant_max_rows = -1 by default
        layer = llm.engine.runner.model.linear_layers()[0]
        for name in ("qkv", "o", "gate_up", "down"):
            w = layer[name]
            kind = ("quant_matmul", "int4", f"g{w.group_size}") if isinstance(w, QuantMatmulLinear) else ("int4", w.group_size)
            t = KERNEL_TIMINGS[(*kind, w.out_features, w.in_features, "float32")]
            assert w.kernel.endswith(f"dense above {w.max_rows} rows (measured)") and w.max_rows == t["max_rows"]
            # the quantised kernel is kept exactly while it was measured at most TUNE_MARGIN slower
            slack = 1 + TUNE_MARGIN
            kept = [r for r, q, d in zip(t["rows"], t["quantised_us"], t["dense_us"], strict=True) if r <= w.max_rows]
            assert all(q <= d * slack for r, q, d in zip(t["rows"], t["quantised_us"], t["dense_us"], strict=True)
                       if r in kept)
            if w.max_rows < t["rows"][-1]:
                i = t["rows"].index(w.max_rows) + 1 if w.max_rows else 0
                assert t["quantised_us"][i] > t["dense_us"][i] * slack


def test_unknown_quantizer_names_the_known_ones(tmp_path, tiny_hf_model):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model, Q.Q4_1)
    with pytest.raises(ConfigError, match="unknown quantizer 'int3'; known: .*gguf.*none"):
        LLM(model=str(path), quantizer="int3")


def test_missing_and_misshapen_tensors_are_named(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for mutate, message in ((lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"),
                             "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
                            (lambda sd: sd.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 64)),
                             r"tensor model.layers.0.self_attn.k_proj.weight has shape \(3, 64\), the model needs \(32, 64\)")):
        broken = tmp_path / f"broken{len(message)}"
        shutil.copytree(tiny_model_dir, broken)
        sd = load_file(broken / "model.safetensors")
        mutate(sd)
        save_file(sd, broken / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            LLM(model=str(broken), dtype="float32", num_kv_blocks=8)


@pytest.mark.parametrize("method, kernel, tolerance", [("int8", 8, 0.02), ("rtn", 4, 0.3),
                                                       ("fp8", "dequantised fp8", 0.06)])
def test_quantizing_at_load_stays_close_to_the_dense_model(tiny_model_dir, method, kernel, tolerance):
    kernel = quant_kernel(kernel) if isinstance(kernel, int) else kernel
    dense, _, dense_bytes = _logits(tiny_model_dir)
    quant, kernels, quant_bytes = _logits(tiny_model_dir, quantizer=method)
    assert all(k.startswith(kernel) for k in kernels.values()), kernels
    rel = ((quant - dense).abs().max() / dense.abs().max()).item()
    assert 0 < rel < tolerance, f"{method}: max logit difference {rel:.3%} of the largest logit"
    if method != "fp8":  # fp8 is dequantised at load on CPU (no fp8 matmul there)
        assert quant_bytes < dense_bytes / (3.5 if method == "int8" else 5)


def test_rtn_group_size_fits_the_input_width():
    from tokenloom.plugins.quantizers.online import fit_group

    assert fit_group(128, 576) == 64 and fit_group(128, 1536) == 128 and fit_group(-1, 576) == 576
    assert fit_group(128, 100) == 100  # no power-of-two group of >= 32 divides 100: one group per row


@pytest.mark.parametrize("lm_head", [False, True])
def test_fp8_keeps_the_output_head_dense_unless_asked(tiny_model_dir, lm_head):
    with LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16,
             quantizer={"name": "fp8", "lm_head": lm_head}) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].qkv.kernel.startswith("dequantised fp8")
        assert model.lm_head.kernel.startswith("dequantised fp8") == lm_head, model.lm_head.kernel
