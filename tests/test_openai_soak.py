"""The soak through the OpenAI frontend (`tokenloom bench serve --openai URL --duration S`):
streamed completions over HTTP, some clients hanging up mid-stream, a queue small enough
that some are refused; nothing is lost, and afterwards the server has ended each accepted
request once and holds no block."""

from __future__ import annotations

import pytest

from tokenloom.bench.soak import format_soak, run_openai_soak, soak_passed
from tokenloom.bench.workload import make_workload
from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.plugins import PluginManager
from tokenloom.protocols.gateway import FrontendHost, ServerOptions

from conftest import SlowSteps, tiny_engine_kwargs


@pytest.fixture
async def openai_url(tiny_model_dir):
    pm = PluginManager(load_entry_points=False, extra=[SlowSteps(0.002)])
    kwargs = tiny_engine_kwargs(tiny_model_dir, num_kv_blocks=48,
                                frontends={"enabled": ["openai"], "openai": {"port": 0}})
    engine = AsyncEngine(config_from_sources(pm, None, None, kwargs), plugin_manager=pm)
    host = FrontendHost(engine, ServerOptions(max_queue=6))
    await host.start()
    yield host.frontends[0].urls()[0]  # http://127.0.0.1:PORT/v1: the soak drops the /v1
    await host.shutdown(0)
    await engine.shutdown()
    engine.close()


async def test_an_openai_soak_loses_nothing_under_overload_and_hang_ups(openai_url):
    work = make_workload(16, (4, 40), (16, 64), seed=1, token_range=(0, 256))
    rep = await run_openai_soak(openai_url, 30.0, 5.0, work, seed=0, disconnect_fraction=0.5, sample_every_s=1.0)
    report = format_soak(rep)
    assert soak_passed(rep), report
    assert rep["frontend"] == "openai" and rep["accepted"] >= 10, report
    assert rep["disconnected"] > 0 and rep["refused"].get("overloaded", 0) > 0, report
    assert sum(rep["server_ended"].values()) == rep["accepted"], report  # each once: finished or aborted
    assert rep["server_ended"].get("aborted", 0) >= rep["disconnected"], report
    assert rep["after"]["running"] == 0 and rep["after"]["kv_blocks_used"] == 0, report
    assert "openai" in report and "server ended (finish reasons)" in report


def test_the_cli_refuses_an_openai_soak_without_a_duration_or_at_an_infinite_rate():
    from tokenloom.cli.main import main

    assert main(["bench", "serve", "--openai", "http://127.0.0.1:9"]) == 2
    assert main(["bench", "serve", "--openai", "http://127.0.0.1:9", "--duration", "1", "--rate", "inf"]) == 2
