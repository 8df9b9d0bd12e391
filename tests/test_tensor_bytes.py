"""core/utils.tensor_bytes: what the start-up log and the memory planner count as a model's
bytes. Opaque tensors (oneDNN-packed fp32 weights, which `--dtype float32` with a draft
model gives) have no storage to ask; they are counted by their elements."""

import torch

from tokenloom.core.utils import tensor_bytes


def test_views_count_once_and_opaque_tensors_by_their_elements():
    w = torch.randn(64, 32)
    assert tensor_bytes([w, w[:8], w.t()]) == 64 * 32 * 4
    packed = torch.randn(16, 16).to_mkldnn()
    assert tensor_bytes([w, packed]) == 64 * 32 * 4 + 16 * 16 * 4


def test_a_draft_model_in_float32_starts(tmp_path):
    """`--dtype float32` with a float32 draft: counting the draft's bytes once failed on its
    oneDNN-packed weights ("Cannot access storage of OpaqueTensorImpl")."""
    from tokenloom import LLM, SamplingParams

    from conftest import make_tiny_llama

    make_tiny_llama(tmp_path / "target")
    make_tiny_llama(tmp_path / "draft", seed=1)
    llm = LLM(model=str(tmp_path / "target"), dtype="float32", num_kv_blocks=64,
              decoder={"name": "speculative", "draft_model": str(tmp_path / "draft"), "draft_quantizer": "none",
                       "draft_dtype": "float32"})
    try:
        [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=6))
        assert out.usage.completion_tokens == 6
    finally:
        llm.close()
