"""Serving defaults (planner/serving.py): ``scheduler.max_num_seqs`` and
``max_num_batched_tokens`` left at 0 are chosen at start-up from the KV pool the engine
allocated and the machine; values the user set win; the start-up log says what and why;
``tokenloom plan`` prints the same figures."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from tokenloom import SamplingParams
from tokenloom.cli.main import main
from tokenloom.core.config import build_config
from tokenloom.core.errors import ConfigError
from tokenloom.core.plugins import PluginManager
from tokenloom.planner import PlanOptions, plan, read_checkpoint
from tokenloom.planner.serving import (
    CPU_SEQS_PER_CORE,
    CPU_STEP_TOKENS,
    GPU_MAX_NUM_SEQS,
    GPU_STEP_TOKENS,
    serving_defaults,
)

# The tiny model's context is 1024 tokens; with max_model_len 128 a typical request is 128
# tokens = 8 blocks of 16.
SMALL = {"num_kv_blocks": 24, "max_model_len": 128}  # 384 token slots: 3 requests of 128


def test_the_rule():
    cpu = serving_defaults(num_blocks=1456, block_size=16, max_model_len=8192, device_type="cpu", cores=2)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (45, CPU_STEP_TOKENS)  # 1456 // 32 blocks
    assert cpu.seqs_reason == "KV pool holds 23296 tokens = 45 x 512-token requests"
    big = serving_defaults(num_blocks=100_000, block_size=16, max_model_len=8192, device_type="cpu", cores=2)
    assert big.max_num_seqs == 2 * CPU_SEQS_PER_CORE and "2 threads" in big.seqs_reason
    gpu = serving_defaults(num_blocks=100_000, block_size=16, max_model_len=8192, device_type="cuda", cores=2)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (GPU_MAX_NUM_SEQS, GPU_STEP_TOKENS)
    tiny = serving_defaults(num_blocks=3, block_size=16, max_model_len=8192, device_type="cpu", cores=2)
    assert tiny.max_num_seqs == 1  # the pool holds no whole request: one at a time
    # every running sequence decodes each step; chunked prefill off: a prompt runs whole
    many = serving_defaults(num_blocks=100_000, block_size=16, max_model_len=8192, device_type="cpu", cores=64)
    assert many.max_num_batched_tokens == many.max_num_seqs == 64 * CPU_SEQS_PER_CORE
    whole = serving_defaults(num_blocks=1456, block_size=16, max_model_len=8192, device_type="cpu", cores=2,
                             chunked_prefill=False)
    assert whole.max_num_batched_tokens == 8192


def test_auto_limits_follow_the_pool(make_llm):
    small = make_llm(**SMALL)
    assert small.engine.scheduler.max_num_seqs == 3
    assert small.engine.scheduler.token_budget == CPU_STEP_TOKENS
    # the config and the stats (engine.stats(), /health) show the values in force
    assert small.engine.config.scheduler.options.max_num_seqs == 3
    assert small.engine.stats()["scheduler_max_num_seqs"] == 3
    assert small.engine.stats()["scheduler_max_num_batched_tokens"] == CPU_STEP_TOKENS
    larger = make_llm(num_kv_blocks=40, max_model_len=128)
    assert larger.engine.scheduler.max_num_seqs == 5
    capped = make_llm(num_kv_blocks=4096, max_model_len=128)
    assert capped.engine.scheduler.max_num_seqs == CPU_SEQS_PER_CORE * torch.get_num_threads()


def test_a_small_pool_admits_what_it_holds_instead_of_preempting(make_llm):
    """Requests of 120 tokens (20 prompt + 100 output): the 24-block pool holds 3 whole. With
    max_num_seqs 64 the engine admits all 8 short prompts, runs out of blocks as they grow
    and preempts; with the auto value (3) it never does. Same tokens either way."""
    prompts = [[(7 * i + j) % 250 for j in range(20)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    forced = make_llm(**SMALL, scheduler={"name": "continuous", "max_num_seqs": 64})
    forced_out = forced.generate(prompts, params)
    assert forced.engine.counters.preemptions > 0
    auto = make_llm(**SMALL)
    auto_out = auto.generate(prompts, params)
    assert auto.engine.counters.preemptions == 0
    assert auto.engine.counters.peak_running == 3
    assert [o.token_ids for o in auto_out] == [o.token_ids for o in forced_out]


def test_user_values_win(make_llm):
    llm = make_llm(**SMALL, scheduler={"name": "continuous", "max_num_seqs": 5})
    assert llm.engine.scheduler.max_num_seqs == 5  # set: kept, although the pool holds 3
    assert llm.engine.scheduler.token_budget == CPU_STEP_TOKENS  # not set: auto
    llm = make_llm(**SMALL, scheduler={"name": "continuous", "max_num_batched_tokens": 64})
    assert (llm.engine.scheduler.max_num_seqs, llm.engine.scheduler.token_budget) == (3, 64)
    # the same through the flags layer (--max-num-seqs, --set, TOML reach it the same way)
    from tokenloom import LLM

    from conftest import tiny_engine_kwargs

    with LLM(**tiny_engine_kwargs(llm.engine.config.engine.model, **SMALL),
             flags={"scheduler": {"max_num_seqs": 7, "max_num_batched_tokens": 96}}) as flagged:
        assert (flagged.engine.scheduler.max_num_seqs, flagged.engine.scheduler.token_budget) == (7, 96)


@pytest.mark.parametrize("scheduler", ["slo", "cache-aware"])
def test_the_other_continuous_schedulers_get_them_too(make_llm, scheduler):
    llm = make_llm(**SMALL, scheduler=scheduler)
    assert llm.engine.scheduler.max_num_seqs == 3
    assert llm.engine.stats()["scheduler_max_num_seqs"] == 3


def test_static_keeps_its_own_default(make_llm):
    llm = make_llm(**SMALL, scheduler="static", cache_manager="contiguous")
    assert llm.engine.scheduler.max_num_seqs == 32


@pytest.mark.parametrize("key", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_negative_value_is_a_config_error_naming_the_key(key):
    with pytest.raises(ConfigError, match=f"scheduler.{key}"):
        build_config(PluginManager(load_entry_points=False), {"scheduler": {key: -1}})


def test_the_startup_log_names_the_values(make_llm, monkeypatch):
    from tokenloom.core.logging import configure_logging

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging("INFO", "json")
    try:
        make_llm(**SMALL, scheduler={"name": "continuous", "max_num_batched_tokens": 64})
    finally:
        configure_logging("WARNING", "console")
    lines = [json.loads(line) for line in err.getvalue().splitlines() if line.startswith("{")]
    [line] = [x for x in lines if x["event"] == "scheduler_limits"]
    assert (line["max_num_seqs"], line["max_num_batched_tokens"]) == (3, 64)
    assert line["why"] == ("max_num_seqs=3 (KV pool holds 384 tokens = 3 x 128-token requests), "
                           "max_num_batched_tokens=64 (set in the config)")


def test_plan_prints_what_the_engine_picks(make_llm, tiny_model_dir, capsys):
    """The planner's pool (1 MiB of float32 KV on the tiny model: 128 blocks) gives the
    engine's own choice for that pool."""
    p = plan(read_checkpoint(tiny_model_dir), PlanOptions(dtype="float32", kv_cache_memory_mb=1, max_model_len=128))
    llm = make_llm(num_kv_blocks=0, kv_cache_memory_mb=1, max_model_len=128)
    assert llm.engine.cache.num_blocks == p.num_kv_blocks == 128
    assert p.max_num_seqs == llm.engine.scheduler.max_num_seqs == min(16, CPU_SEQS_PER_CORE * torch.get_num_threads())
    assert p.max_num_batched_tokens == llm.engine.scheduler.token_budget
    assert p.limits_reasons["max_num_seqs"].startswith("KV pool holds 2048 tokens = 16 x 128-token requests") or \
        p.limits_reasons["max_num_seqs"].startswith("the CPU cap")
    # explicit values are kept and said to be
    q = plan(read_checkpoint(tiny_model_dir), PlanOptions(dtype="float32", kv_cache_memory_mb=1, max_model_len=128,
                                                          max_num_seqs=9))
    assert q.max_num_seqs == 9 and q.limits_reasons["max_num_seqs"] == "set"
    assert main(["plan", "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory-mb", "1",
                 "--max-model-len", "128"]) == 0
    out = capsys.readouterr().out
    assert f"max_num_seqs            {p.max_num_seqs:>6}  " in out
    assert "KV pool holds 2048 tokens = 16 x 128-token requests" in out
