"""Bench statistics on synthetic timings, the workload generator, and a real serve run."""

from __future__ import annotations

import math

import pytest

from tokenloom.bench.offline import format_table, parse_combo
from tokenloom.bench.stats import percentile, ratio, summarize
from tokenloom.bench.workload import make_workload, parse_range
from tokenloom.core.plugins import PluginManager

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_percentile_interpolates_like_numpy():
    xs = [10, 1, 4, 7]  # sorted 1 4 7 10
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)  # 7 + 0.7 * 3
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize_skips_missing_values():
    s = summarize([1.0, None, 3.0, float("nan"), 2.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["p50"] == 2.0 and s["p99"] == pytest.approx(2.98)


def test_ratio():
    assert ratio(30.0, 10.0) == 3.0
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(1.0, None))


def test_workload_is_seeded_and_in_range():
    a = make_workload(20, (5, 9), (3, 4), seed=1)
    assert a == make_workload(20, (5, 9), (3, 4), seed=1) != make_workload(20, (5, 9), (3, 4), seed=2)
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 3 <= r.max_tokens <= 4 for r in a)
    assert parse_range("32-512") == (32, 512) and parse_range("7") == (7, 7)
    with pytest.raises(ValueError):
        make_workload(3, (9, 5), (1, 1))


def test_combo_parsing_names_roles():
    pm = PluginManager(load_entry_points=False)
    assert parse_combo("static+contiguous", pm) == ("static+contiguous", {
        "scheduler": {"name": "static"}, "cache_manager": {"name": "contiguous"}})
    with pytest.raises(Exception, match="no strategy named 'warp'"):
        parse_combo("continuous+warp", pm)
    with pytest.raises(Exception, match="two schedulers"):
        parse_combo("continuous+static", pm)


def test_table_shows_ratios():
    base = {"combo": "a", "output_tok_s": 100.0, "ratio_output_tok_s": 1.0, "total_tok_s": 200.0,
            "decode_tok_s": 120.0, "ttft_ms": summarize([10, 20]), "tpot_ms": summarize([5.0]),
            "peak_kv_usage": 0.5, "peak_running": 8, "preemptions": 0}
    table = format_table({"results": [base, {**base, "combo": "b", "output_tok_s": 250.0, "ratio_output_tok_s": 2.5}]})
    assert "2.50x" in table and "1.00x" in table and "15/15/19/20" in table


async def test_bench_serve_against_a_real_server(tiny_model_dir):
    from tokenloom.bench.serve import format_serve, run_serve_bench
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.protocols.websocket.server import ServerOptions, TokenServer

    from conftest import tiny_engine_kwargs

    pm = PluginManager(load_entry_points=False)
    engine = AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir)), plugin_manager=pm)
    server = TokenServer(engine, ServerOptions(port=0))
    await server.start()
    try:
        work = make_workload(12, (4, 20), (5, 9), seed=0, token_range=(0, 256))
        rep = await run_serve_bench(f"ws://127.0.0.1:{server.port}", 50.0, 4, work, seed=0)
    finally:
        await server.shutdown(deadline_s=0)
        await engine.shutdown()
        engine.close()
    assert rep["requests"] == 12 and rep["failed"] == 0
    assert rep["ttft_ms"]["n"] == 12 and rep["ttft_ms"]["p50"] <= rep["ttft_ms"]["p99"]
    assert rep["output_tok_s"] > 0
    assert "rate" in format_serve([rep])


def test_offline_plot_is_a_png_with_the_expected_series(tmp_path):
    import matplotlib.image

    from tokenloom.bench.plot import plot_offline

    def result(name, out):
        return {"combo": name, "output_tok_s": out, "total_tok_s": out * 2, "ratio_output_tok_s": out / 10,
                "ttft_ms": summarize([100, 200, 300]), "tpot_ms": summarize([10, 20])}

    path = tmp_path / "bench.png"
    series = plot_offline({"results": [result("continuous+paged", 10.0), result("static+contiguous", 4.0)],
                           "workload": {"num_requests": 2}}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 300 and img.shape[1] > 1000
    assert series == {"throughput": ["output tok/s", "total tok/s"], "ttft": ["p50", "p90", "p99"],
                      "tpot": ["p50", "p90", "p99"]}


def test_peers_runs_tokenloom_and_transformers_on_the_same_workload(tiny_model_dir, tmp_path):
    import argparse

    from tokenloom.bench.peers import format_peers, run_peers
    from tokenloom.bench.plot import plot_peers

    from conftest import tiny_engine_kwargs

    args = argparse.Namespace(config=None, threads=2, num_requests=6, prompt_len="4-12", output_len="3-6",
                              workload_seed=0, concurrency="1,4", llama_server=None,
                              skip=["llama-cpp-python", "llama-server"])
    flags = tiny_engine_kwargs(tiny_model_dir)
    report = run_peers(args, flags, PluginManager(load_entry_points=False))
    rows = [(r["system"], r["concurrency"]) for r in report["results"]]
    assert rows == [("tokenloom continuous+paged", 1), ("transformers generate", 1),
                    ("tokenloom continuous+paged", 4), ("transformers generate", 4)]
    ours, hf = report["results"][2], report["results"][3]
    assert ours["tokenloom_ratio"] == 1.0 and "static batches of N" in hf["note"] and "float32" in hf["note"]
    assert hf["tokenloom_ratio"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])  # same concurrency
    table = format_peers(report)
    assert "| system | concurrency 1 | concurrency 4 | note |" in table and "tokenloom is" in table
    systems = ["tokenloom continuous+paged", "transformers generate"]
    assert plot_peers(report, str(tmp_path / "p.png")) == systems
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_offline_and_decode_commands_on_a_tiny_model(tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "tokenloom.cli.main", "bench"]
    model = ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64"]
    out = subprocess.run([*base, "offline", "--num-requests", "5", "--prompt-len", "4-9", "--output-len", "2-4",
                          "--combo", "continuous+radix", "--combo", "static+contiguous", "--json",
                          str(tmp_path / "o.json"), *model], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "o.json").read_text())
    assert [r["combo"] for r in report["results"]] == ["continuous+radix", "static+contiguous"]
    assert all(r["requests"] == 5 and r["failed"] == 0 for r in report["results"])
    assert report["results"][0]["output_tokens"] == report["results"][1]["output_tokens"] == \
        report["workload"]["output_tokens"]
    dec = subprocess.run([*base, "decode", "--batch-sizes", "1,3", "--gen", "4", "--json", str(tmp_path / "d.json"),
                          "--dtypes", "float32,bfloat16", "--profile", *model], capture_output=True, text=True,
                         timeout=300)
    assert dec.returncode == 0, dec.stderr[-2000:]
    d = json.loads((tmp_path / "d.json").read_text())
    assert [v["dtype"] for v in d["variants"]] == ["float32", "bfloat16"]
    for v in d["variants"]:
        assert [r["batch_size"] for r in v["results"]] == [1, 3] and "fraction_of_floor" in v["results"][0]
    assert d["variants"][1]["weight_bytes"] < d["variants"][0]["weight_bytes"]
    assert "| float32 |" not in dec.stdout and "1.00x" in dec.stdout  # a row per variant, ratio to the first
    prof = d["variants"][0]["profiles"][0]
    assert prof["batch_size"] == 1 and 0 < prof["weight_matmul_share"] < 1 and prof["top"]
    assert "weight matmuls" in dec.stdout and "aten::" in dec.stdout


def test_structured_command_on_a_tiny_model(tiny_model_dir, tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    pytest.importorskip("xgrammar")
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # the tool prompt describes both tools: ~1,500 byte tokens
    (model / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", "bench", "structured", "--batch-sizes", "1,2",
                          "--max-tokens", "6", "--gap-requests", "3", "--gap-before", "4", "--json",
                          str(tmp_path / "s.json"), "--model", str(model), "--dtype", "float32", "--num-kv-blocks",
                          "512", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "s.json").read_text())
    cases = ["unconstrained", "json schema (trip plan)", "regex (three day lines)",
             "unconstrained (the tool prompt)", "tool calls (2 tools, required, hermes)"]
    assert [(r["case"], r["batch_size"]) for r in report["decode"]] == [(c, b) for c in cases for b in (1, 2)]
    assert all(r["failed"] == 0 and 0 < r["output_tokens"] <= 6 * r["batch_size"] for r in report["decode"])
    kinds = [r["kind"] for r in report["compile"]["rows"]]
    assert kinds[:3] == ["json_schema", "regex", "tagged_json"] and len(kinds) == 6
    assert report["gap"]["new"]["requests"] == report["gap"]["cached"]["requests"] == 3
    assert report["gap"]["new"]["failed"] == 0
    for row in ("| unconstrained | 1 |", "| tool calls (2 tools, required, hermes) | 2 |",
                "| json schema (invoice, $ref) | json_schema |", "| 3 new (compiled then)",
                "| the same 3 again (cached)"):
        assert row in out.stdout, row
    assert "bench structured --batch-sizes 1,2" in out.stdout and "machine: " in out.stdout and "torch " in out.stdout


@pytest.mark.slow
async def test_soak_loses_nothing_under_overload_and_disconnects(make_server):
    """A short soak (the 10-minute one is `tokenloom bench serve --duration 600`): Poisson
    arrivals past capacity, a third of the clients leaving mid-stream, a small queue so some
    requests are refused; every accepted request still ends in exactly one `done`, and
    afterwards nothing runs and no block is in use."""
    from tokenloom.bench.soak import format_soak, run_soak, soak_passed

    server, url = await make_server(max_queue=6, engine={"num_kv_blocks": 48})
    work = make_workload(16, (4, 40), (20, 120), seed=1, token_range=(0, 256))
    rep = await run_soak(url, 60.0, 4.0, work, seed=0, disconnect_fraction=0.3, sample_every_s=1.0)
    assert soak_passed(rep), format_soak(rep)
    # How many get in depends on the machine's speed (14 of ~240 on a slow CI host): enough that
    # the queue turned over, some finished, some left and some were refused.
    assert rep["accepted"] > 10 and sum(rep["finish_reasons"].values()) > 0
    assert rep["disconnected"] > 0 and rep["refused"].get("overloaded", 0) > 0
    assert rep["after"]["kv_blocks_used"] == 0 and rep["lost"] == 0
    assert "lost (accepted, no done) | 0" in format_soak(rep)


def test_a_peer_that_crashes_is_a_failure_not_the_end_of_the_run():
    """Each peer runs in its own process: one dying of a signal (llama.cpp's AMX kernels die
    with SIGILL on some machines) raises here, and the run goes on."""
    import os
    from concurrent.futures.process import BrokenProcessPool

    from tokenloom.bench.runner import isolated

    with pytest.raises(BrokenProcessPool):
        isolated(os.abort)
    assert isolated(os.getpid) != os.getpid()  # and it really was another process


def test_venv_peers_are_skipped_when_not_built_and_their_runner_results_are_read(tmp_path):
    import sys

    from tokenloom.bench import peers
    from tokenloom.bench.workload import BenchRequest

    wl = [BenchRequest([300, 301, 302], 4), BenchRequest([303], 2)]
    # nothing built under the peers dir: each venv peer answers None (reported as not installed)
    assert peers.run_vllm_offline(tmp_path, wl, 2, 2, "float32", "all") is None
    assert peers.run_openvino_offline(tmp_path, wl, 2, 2, "float32", "int4") is None
    skipped: list[str] = []
    import argparse

    args = argparse.Namespace(skip=["llama-server"], llama_server=None, config=None, vllm_bind="both")
    systems = peers.served_systems(args, {"model": "smollm2-135m"}, 2, 4, 64, tmp_path, skipped)
    assert [s for s, _ in systems] == ["tokenloom"] and skipped[0].startswith("vllm serve: not installed")
    # a runner's PEER_RESULT line is its result; a runner that dies raises with its last lines
    ok = [sys.executable, "-c", "import json,sys; j=json.load(sys.stdin); print('log'); "
          "print('PEER_RESULT ' + json.dumps({'elapsed_s': 2.0, 'produced': [n for _, n in j['workload']]}))"]
    res = peers.run_venv_peer("fake", ok, peers._job(tmp_path, wl, 2, 2, "float32"), log=tmp_path / "l.log")
    row = peers._venv_row("fake", wl, res, "note")
    assert row["output_tok_s"] == 3.0 and row["note"] == "note" and (tmp_path / "l.log").exists()
    short = peers._venv_row("fake", wl, {"elapsed_s": 1.0, "produced": [4, 1]}, "n")
    assert short["note"] == "n; 1 requests short"
    with pytest.raises(RuntimeError, match="boom"):
        peers.run_venv_peer("fake", [sys.executable, "-c", "import sys; sys.exit('boom')"], {})
    # vLLM's binding: its default, or compute on the first `threads` allowed cores, none reserved
    assert peers.vllm_bind_env("auto", 2) == {}
    env = peers.vllm_bind_env("all", 1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"].isdigit()


def test_a_server_that_fails_to_start_is_reported(tmp_path):
    import sys

    from tokenloom.bench.peers import Server, _free_port

    server = Server("broken", [sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"], _free_port(),
                    tmp_path / "s.log")
    with pytest.raises(RuntimeError, match="exited 3 while starting: no model"):
        with server:
            pass


def test_served_rounds_report_the_median_round_of_each_system():
    """`bench peers --serve --rounds N`: each system's figure at a concurrency is its median
    round's row (the lower middle for an even count), every round's figure kept in order."""
    from tokenloom.bench.peers import median_rounds

    def row(system, level, tok_s, rnd, ttft):
        return {"system": system, "concurrency": level, "output_tok_s": tok_s, "note": "bfloat16", "round": rnd,
                "ttft_ms": ttft}

    rows = [row("tokenloom serve", 64, 1100.0, 0, 1), row("vLLM", 64, 800.0, 0, 2),
            row("tokenloom serve", 64, 1000.0, 1, 3), row("vLLM", 64, 780.0, 1, 4),
            row("tokenloom serve", 64, 1150.0, 2, 5), row("vLLM", 64, 790.0, 2, 6),
            row("vLLM", 8, 240.0, 0, 7), row("vLLM", 8, 250.0, 1, 8)]
    got = {(r["system"], r["concurrency"]): r for r in median_rounds(rows)}
    assert len(got) == 3
    ours, theirs, low = got[("tokenloom serve", 64)], got[("vLLM", 64)], got[("vLLM", 8)]
    assert (ours["output_tok_s"], ours["ttft_ms"]) == (1100.0, 1)  # the whole row of the median round
    assert ours["rounds_output_tok_s"] == [1100.0, 1000.0, 1150.0]
    assert ours["note"] == "bfloat16; rounds 1100.0 / 1000.0 / 1150.0, the median shown"
    assert theirs["output_tok_s"] == 790.0 and low["output_tok_s"] == 240.0  # even count: the lower middle
    single = median_rounds([row("x", 1, 5.0, 0, 9)])
    assert single[0]["note"] == "bfloat16" and single[0]["rounds_output_tok_s"] == [5.0]


def test_rounds_without_serve_are_refused():
    import argparse

    from tokenloom.bench.peers import run_peers
    from tokenloom.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--rounds applies to --serve only"):
        run_peers(argparse.Namespace(serve=False, rounds=3), {}, None)


def test_rounds_below_one_are_refused():
    import argparse

    from tokenloom.bench.peers import served_rounds
    from tokenloom.core.errors import ConfigError

    assert served_rounds(argparse.Namespace()) == 1 and served_rounds(argparse.Namespace(rounds=3)) == 3
    for bad in (0, -2):
        with pytest.raises(ConfigError, match=f"--rounds must be at least 1, got {bad}"):
            served_rounds(argparse.Namespace(serve=True, rounds=bad))
