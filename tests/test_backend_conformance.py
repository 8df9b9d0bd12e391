"""The backend conformance kit (tokenloom.testing.check_backend): the torch backend passes
it, the triton backend passes it under Triton's interpreter, and deliberately broken
backends fail it with a message naming the op. Then the engine: ``--backend triton`` gives
the torch backend's greedy tokens on the tiny model, and fails at start-up, with a
sentence, where its kernels cannot run."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel

import pytest  # noqa: E402
import torch  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.backends.torch_backend import TorchBackend, TorchBackendOptions  # noqa: E402
from tokenloom.core.errors import ConfigError  # noqa: E402
from tokenloom.testing import BackendCase, ConformanceError, check_backend  # noqa: E402

from conftest import tiny_engine_kwargs  # noqa: E402

needs_triton = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                  reason="the triton package is not installed (pip install 'tokenloom[triton]')")

# the kits' tensors are small: one torch thread (conftest.one_thread; the C++ ops' parallel
# splits are tested on two threads in test_cpu_kernels and test_capture)
pytestmark = pytest.mark.usefixtures("one_thread")

ONE_CASE = dict(cases=[BackendCase(6, 2, 64, 16, (1, 19), ((5, 5), (4, 23)))], dtypes=[torch.float32],
                kv_cache_dtypes=["auto"])


def test_torch_backend_passes_the_kit():
    # its CPU matmuls without the load-time timing (seconds per weight shape, nothing to check)
    report = check_backend("torch", options={"cpu_linear": "mkl", "quant_max_rows": 0})
    assert {"attention", "write_kv (K pool)", "copy_blocks", "move_kv_slots", "add_rms_norm (normalised)",
            "pack_linear(...).apply", "silu_mul", "kv_bytes_per_token"} <= set(report)
    if TorchBackend().fused_decode is not None:  # where the C++ ops build: its captured step, bit for bit
        assert report["capture_decode (hidden states)"] == 0.0


@needs_triton
def test_triton_backend_passes_the_kit():
    """Every case, dtype (float32, bfloat16) and KV pool (auto, fp8, int8) of the kit."""
    report = check_backend("triton")
    assert "decode_attention_block" in report  # its fused decode path ran and was compared


class _Broken(TorchBackend):
    def __init__(self, options=None, device="cpu"):
        super().__init__(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl", quant_max_rows=0), device)


class WrongSoftmaxScale(_Broken):
    def attention(self, q, k, v, k_cache, v_cache, meta, scale):
        return super().attention(q, k, v, k_cache, v_cache, meta, scale * 1.1)


class SwappedKV(_Broken):
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        super().write_kv(k_cache, v_cache, v, k, slot_mapping)


class NoBlockCopy(_Broken):
    def copy_blocks(self, kv_caches, copies):
        pass


class NormWithoutWeight(_Broken):
    def add_rms_norm(self, h, delta, weight, eps, dtype):
        return super().add_rms_norm(h, delta, torch.ones_like(weight), eps, dtype)


class InterleavedRope(_Broken):  # GPT-J's pairing instead of rotate-half
    def rope(self, x, cos, sin, out_dtype=None):
        pairs = x.float().unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        return (x.float() * cos + rotated * sin).to(out_dtype or torch.float32)


class ScalesNotCounted(_Broken):
    """Sizes an 8-bit pool without its per-token scales: the engine would overfill memory."""

    def kv_bytes_per_token(self, num_layers, num_kv_heads, head_dim, dtype, kv_cache_dtype="auto"):
        if kv_cache_dtype == "auto":
            return super().kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        return 2 * num_layers * num_kv_heads * head_dim


class CapturedWithSwappedRope(TorchBackend):
    """A captured step built from the wrong tables (sin for cos): the kit must see it."""

    def __init__(self, options=None, device="cpu"):
        super().__init__(TorchBackendOptions(cpu_linear="mkl", quant_max_rows=0), device)

    def capture_decode(self, model):
        import dataclasses

        return super().capture_decode(dataclasses.replace(model, cos=model.sin, sin=model.cos))


def test_the_kit_checks_the_captured_step():
    if TorchBackend().fused_decode is None:
        pytest.skip("the C++ ops cannot be built here: no captured step to break")
    with pytest.raises(ConformanceError, match="capture_decode"):
        check_backend(lambda options, device: CapturedWithSwappedRope(device=device), **ONE_CASE)


@pytest.mark.parametrize("broken, op", [(WrongSoftmaxScale, "attention"), (SwappedKV, "write_kv"),
                                        (NoBlockCopy, "copy_blocks"), (NormWithoutWeight, "add_rms_norm"),
                                        (InterleavedRope, "rope")])
def test_the_kit_names_the_broken_op(broken, op):
    with pytest.raises(ConformanceError) as err:
        check_backend(broken, **ONE_CASE)
    msg = str(err.value)
    assert msg.startswith(op), msg
    assert "max abs diff" in msg and "at index" in msg, msg


def test_the_kit_checks_the_kv_sizing():
    check_backend(ScalesNotCounted, **ONE_CASE)  # auto pools: right
    with pytest.raises(ConformanceError, match=r"^kv_bytes_per_token .*kv_cache_dtype=int8.*61440 for 5 blocks of 16.*holds 63360"):
        check_backend(ScalesNotCounted, **{**ONE_CASE, "kv_cache_dtypes": ["auto", "int8"]})


@needs_triton
def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch, tiny_model_dir):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=r"backend = triton needs a CUDA device.*TRITON_INTERPRET=1"):
        LLM(**tiny_engine_kwargs(tiny_model_dir, backend="triton"))


PROMPTS = ["Hello, world", "The quick brown fox jumps over", "a", "tokenloom " * 5, "abcabcabcabcabc"]


@needs_triton
@pytest.mark.parametrize("overrides", [
    {},
    # chunked prefill beside decodes (mixed steps, chunks over cached context) and 8-bit KV
    {"scheduler": {"name": "continuous", "max_num_batched_tokens": 8}, "kv_cache_dtype": "int8"},
    # a last token and its drafts (a 4-bit draft model: the int4 kernel) as causal chunks
    # of a few rows over the cached context
    {"decoder": {"name": "speculative", "max_batch": 8}},
], ids=["default", "chunked-int8kv", "speculative"])
def test_triton_engine_greedy_equals_torch(make_llm, overrides):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in make_llm(backend="torch", **overrides).generate(PROMPTS, params)]
    llm = make_llm(backend="triton", **overrides)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    if "decoder" in overrides:
        assert llm.engine.stats()["decoder_speculative_drafted"] > 0


@needs_triton
@pytest.mark.parametrize("quantizer, kernel", [({"name": "rtn", "group_size": 32}, "triton int4"),
                                               ({"name": "fp8"}, "triton fp8")])
def test_triton_engine_runs_quantised_weights_on_its_kernels(make_llm, quantizer, kernel):
    """4-bit and fp8 weights go to the Triton matmuls, and the logits stay the torch
    backend's (whose CPU 4-bit kernel takes bf16 activations: a bf16 tolerance)."""
    ids = list(b"Hello there, tiny model")
    logits = {}
    for backend in ("torch", "triton"):
        llm = make_llm(backend=backend, quantizer=quantizer)
        runner = llm.engine.runner
        if backend == "triton":
            assert kernel in runner.model.layers[0].qkv.kernel
        table = list(range((len(ids) + 15) // 16))
        logits[backend] = llm.engine.call_in_step_thread(runner.prefill_logits, ids, table)
    want = logits["torch"]
    assert (logits["triton"] - want).abs().max() <= 3e-2 * want.abs().max()
