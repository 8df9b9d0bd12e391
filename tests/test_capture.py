"""The captured decode step (the torch backend's whole decode step in one C++ call,
``TorchBackend.capture_decode``) against the op-by-op path it replaces: the same greedy
tokens and the same log-probabilities, bit for bit, for each kind of matmul it mirrors."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import _streams

from tokenloom import LLM, SamplingParams
from tokenloom.backends.torch_linear import AmxLinear
from tokenloom.core.errors import ConfigError
from tokenloom.kernels import cpu_ops

from conftest import tiny_engine_kwargs

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ ops cannot be built here")

PROMPTS = [[3 + (7 * i) % 250 for i in range(n)] for n in (5, 23, 40, 9)]


def _run(model_dir, capture: bool, **kw):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    with LLM(**tiny_engine_kwargs(model_dir, capture=capture, **kw)) as llm:
        streams = llm.run(_streams(llm.engine, PROMPTS, params))
        captured = llm.engine.runner.model.captured
        steps = captured.steps if captured is not None else None
        amx = isinstance(getattr(llm.engine.runner.model.layers[0].qkv, "dense", None), AmxLinear)
    tokens = [[t for d in deltas for t in d.token_ids] for deltas in streams]
    logprobs = torch.tensor([lp.logprob for deltas in streams for d in deltas for lp in d.logprobs])
    return tokens, logprobs, steps, amx


# Each row picks a different mirror in C++: dense F.linear (bf16), MKL / oneDNN fp32 (the batch
# of four crosses where oneDNN takes over), and the int4 / int8 kernels with their dense copy
# above two rows (so both sides of the switch run as the batch shrinks from 4 to 1); a bfloat16
# int4 model's "dense" side is amx_matmul where the CPU has AMX (quant_dense auto), a copy with
# quant_dense copy, q8_matmul with quant_dense q8.
@pytest.mark.parametrize("kw", [
    {"dtype": "bfloat16"},
    {"dtype": "float32", "backend": {"name": "torch", "cpu_linear": "onednn"}},
    {"dtype": "float32", "backend": {"name": "torch", "cpu_linear": "dual"}},
    {"dtype": "bfloat16", "quantizer": "rtn", "backend": {"name": "torch", "quant_max_rows": 2}},
    {"dtype": "bfloat16", "quantizer": "rtn", "backend": {"name": "torch", "quant_max_rows": 2, "quant_dense": "copy"}},
    {"dtype": "bfloat16", "quantizer": "rtn", "backend": {"name": "torch", "quant_max_rows": 2, "quant_dense": "q8"}},
    {"dtype": "float32", "quantizer": "int8", "backend": {"name": "torch", "quant_max_rows": 2}},
    {"dtype": "float32", "quantizer": "rtn", "backend": {"name": "torch", "quant_max_rows": 0}},
    {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    {"dtype": "float32", "kv_cache_dtype": "fp8"},
], ids=["dense-bf16", "onednn-fp32", "mkl+onednn-fp32", "int4+amx-bf16", "int4+copy-bf16", "int4+q8-bf16",
         "int8+onednn-fp32", "int4-fp32",
        "int8-kv-bf16", "fp8-kv-fp32"])
def test_captured_step_gives_the_op_by_op_outputs(tiny_model_dir, kw):
    if kw.get("backend", {}).get("quant_dense") == "q8" and not cpu_ops.load().q8_ready():
        with pytest.raises(ConfigError, match="no AVX512-VNNI"):  # (a build without it refuses q8 by name)
            _run(tiny_model_dir, True, **kw)
        return
    tokens, logprobs, steps, amx = _run(tiny_model_dir, True, **kw)
    eager_tokens, eager_logprobs, eager_steps, _ = _run(tiny_model_dir, False, **kw)
    int4_bf16 = kw.get("quantizer") == "rtn" and kw["dtype"] == "bfloat16"
    assert amx == (int4_bf16 and cpu_ops.load().amx_ready() and kw["backend"].get("quant_dense", "auto") == "auto")
    assert steps and steps > 10  # the decode steps really ran captured ...
    assert eager_steps is None  # ... and with capture off nothing was captured
    assert tokens == eager_tokens
    assert torch.equal(logprobs, eager_logprobs)  # bit for bit: the same ops in the same order


def test_the_triton_backend_and_tensor_parallel_ranks_capture_nothing(tiny_model_dir):
    from tokenloom.backends.triton_backend import TritonBackend

    assert TritonBackend.capture_decode(object.__new__(TritonBackend), None) is None
    with LLM(**tiny_engine_kwargs(tiny_model_dir, capture=False)) as llm:
        assert llm.engine.runner.model.captured is None and llm.engine.runner.captured is False
