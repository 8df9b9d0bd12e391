"""Evaluation text split, perplexity against transformers, and the eval / bench quant CLIs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tokenloom.core import evaluation
from tokenloom.core.evaluation import (
    calibration_texts,
    perplexity,
    pydoc_corpus,
    split_corpus,
    window_spans,
)

from conftest import quant_kernel

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The quick brown fox jumps over the lazy dog. Perplexity is exp of the mean loss; " * 3


def _hf_nll(model, ids: list[int]) -> list[float]:
    """-log p(ids[i] | ids[:i]) for i >= 1, from one transformers forward, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return (-lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()


def test_corpus_split_is_disjoint_deterministic_and_sizeable():
    corpus = pydoc_corpus()
    assert [k for k, _ in corpus] == sorted(k for k, _ in corpus) and len(corpus) >= 40
    cal, ev = split_corpus()
    assert (cal, ev) == split_corpus()
    assert not {k for k, _ in cal} & {k for k, _ in ev}
    assert len(cal) + len(ev) == len(corpus) and len(ev) == len(corpus) // evaluation.EVAL_EVERY
    assert sum(map(len, (t for _, t in ev))) > 50_000 and sum(map(len, (t for _, t in cal))) > 150_000
    assert evaluation.evaluation_text() == evaluation.evaluation_text()
    assert evaluation.evaluation_text() not in evaluation.calibration_text()


def test_calibration_chunks(make_llm):
    tok = make_llm().tokenizer
    chunks = calibration_texts(1000, tok, chunk_len=256)
    assert len(chunks) == 4 and all(len(c) == 256 for c in chunks)
    assert chunks == calibration_texts(1000, tok, chunk_len=256)
    assert evaluation.calibration_text().startswith(tok.decode(sum(chunks, [])))
    with pytest.raises(ValueError, match="calibration text has"):
        calibration_texts(10**8, tok)


def test_window_spans_score_each_token_once():
    for n, w, s in [(10, 4, 4), (10, 4, 2), (11, 5, 3), (3, 8, 8), (9, 4, 1)]:
        spans = window_spans(n, w, s)
        scored = [p for _, end, first in spans for p in range(first, end)]
        assert all(end - begin <= w for begin, end, _ in spans)
        if s == w:  # non-overlapping: each window's first token is context only
            assert scored == [p for p in range(1, n) if p % w]
        else:
            assert scored == list(range(1, n))
    assert window_spans(10, 4, 4)[1] == (4, 8, 5)
    with pytest.raises(ValueError):
        window_spans(10, 4, 5)


def test_single_window_perplexity_matches_transformers(make_llm, tiny_hf_model):
    llm = make_llm()
    ids = llm.tokenizer.encode(TEXT, add_bos=False)
    assert 200 < len(ids) < 512
    res = perplexity(llm, ids, window=512)
    nll = _hf_nll(tiny_hf_model, ids)
    assert res["windows"] == 1 and res["tokens"] == len(ids) - 1
    assert res["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-3)
    assert res["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-3)
    # a text goes through the engine's tokenizer (this one adds no BOS by default)
    assert perplexity(llm, TEXT)["ppl"] == pytest.approx(res["ppl"], rel=1e-6)
    assert llm.engine.cache.stats().num_used_blocks == 0


@pytest.mark.parametrize("window, stride", [(64, 24), (64, 64), (48, 47)])
def test_sliding_window_matches_a_manual_computation(make_llm, tiny_hf_model, window, stride):
    llm = make_llm()
    ids = llm.tokenizer.encode(TEXT, add_bos=False)[:200]
    res = perplexity(llm, ids, window=window, stride=stride)
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        nll = _hf_nll(tiny_hf_model, ids[begin:end])  # nll[j] scores position begin + 1 + j
        new = end - max(prev_end, begin + 1)
        total += sum(nll[len(nll) - new:])
        count += new
        prev_end = end
        if end == len(ids):
            break
    assert res["tokens"] == count and res["windows"] == len(window_spans(len(ids), window, stride))
    assert res["ppl"] == pytest.approx(math.exp(total / count), rel=1e-3)
    assert llm.engine.cache.stats().num_used_blocks == 0


def test_no_block_leaks_and_limits(make_llm):
    llm = make_llm(num_kv_blocks=8, cache_manager="radix")  # 8 x 16 slots
    ids = list(range(3, 250))
    before = llm.engine.cache.stats()
    perplexity(llm, ids, window=128, stride=100)
    after = llm.engine.cache.stats()
    assert after.num_used_blocks == 0 and after.num_cached_blocks == before.num_cached_blocks
    with pytest.raises(RuntimeError, match="free KV blocks"):
        perplexity(llm, ids, window=200)
    assert llm.engine.cache.stats().num_used_blocks == 0
    assert perplexity(llm, ids, max_tokens=40, window=128)["tokens"] == 39
    with pytest.raises(ValueError):
        perplexity(llm, [5])
    llm.engine.cache.check_integrity()
    # the engine still serves afterwards
    from tokenloom import SamplingParams

    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tokenloom.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_eval_perplexity_cli(tiny_model_dir, tmp_path):
    out = _cli("eval", "perplexity", "--max-tokens", "300", "--window", "128", "--model", str(tiny_model_dir),
               "--dtype", "float32", "--num-kv-blocks", "16", "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ppl " in out.stdout and "kernel" in out.stdout and "seconds" in out.stdout
    rep = json.loads((tmp_path / "p.json").read_text())
    assert rep["input_tokens"] == 300 and rep["windows"] == 3 and math.isfinite(rep["ppl"]) and rep["ppl"] > 1
    assert rep["quantizer"] == "checkpoint default" and rep["weight_bytes"] > 0


def test_bench_quant_cli(tiny_model_dir, tmp_path):
    out = _cli("bench", "quant", "--methods", "none,int8", "--eval-tokens", "150", "--window", "64",
               "--batch-sizes", "1,2", "--gen", "4", "--prompt-len", "8", "--json", str(tmp_path / "q.json"),
               "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64")
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads((tmp_path / "q.json").read_text())
    none, int8 = rep["methods"]
    assert (none["method"], int8["method"]) == ("none", "int8")
    assert (none["bits"], int8["bits"]) == (32, 8) and int8["weight_bytes"] < none["weight_bytes"]
    assert none["ppl_change_pct"] == 0.0 and int8["same_tokens"] and quant_kernel(8) in int8["kernel"]
    assert abs(int8["ppl_change_pct"]) < 10
    assert [r["batch_size"] for r in int8["results"]] == [1, 2] and int8["results"][0]["decode_tok_s"] > 0
    assert "| none | 32 |" in out.stdout and "| int8 | 8 |" in out.stdout


def test_method_specs():
    from tokenloom.bench.quant import method_layer, nominal_bits, parse_methods
    from tokenloom.core.plugins import PluginManager

    assert parse_methods("none, int8,gptq=out/g") == [("none", None), ("int8", None), ("gptq", "out/g")]
    with pytest.raises(ValueError):
        parse_methods("gptq=")
    pm = PluginManager(load_entry_points=False)
    flags = {"model": "m", "dtype": "float32", "quantizer": {"name": "rtn"}}
    assert method_layer("int8", None, flags, pm) == {"model": "m", "dtype": "float32", "quantizer": {"name": "int8"}}
    assert method_layer("mine", "ck", flags, pm) == {"model": "ck", "dtype": "float32"}  # the checkpoint decides
    assert "quantizer" not in method_layer("rtn", "ck", flags, pm)  # even for a known name: its metadata rules
    assert nominal_bits("none", "bfloat16") == 16 and nominal_bits("gguf", "float32") == 4
    assert nominal_bits("mystery", "float32") is None
