"""Hook specs, the registry, combination checks and third-party entry points."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from tokenloom.core import hookspecs
from tokenloom.core.config import build_config
from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.plugins import PluginManager

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _specs():
    return [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(f, "tokenloom_spec")]


def test_every_hook_is_documented():
    specs = _specs()
    assert {f.__name__ for f in specs} >= {
        "register_schedulers", "register_cache_managers", "register_quantizers", "register_decoders",
        "register_backends", "register_model_formats", "engine_started", "step_finished", "request_finished"}
    for f in specs:
        doc = inspect.getdoc(f) or ""
        assert "Called" in doc, f"{f.__name__}: say when and how often it is called"
        for param in inspect.signature(f).parameters:
            assert f":param {param}:" in doc, f"{f.__name__}: document :param {param}:"
        assert ":returns:" in doc, f"{f.__name__}: document :returns:"


class _Plugin:
    @hookimpl
    def register_decoders(self, register):
        register("needs-contiguous", lambda options, context: None,
                 requires={"cache_manager": ["contiguous"]}, conflicts={"scheduler": ["static"]})


def test_requires_and_conflicts_fail_at_startup_with_a_sentence():
    pm = PluginManager(load_entry_points=False, extra=[_Plugin()])
    with pytest.raises(ConfigError) as info:
        build_config(pm, {"decoder": "needs-contiguous"})
    assert str(info.value) == ("decoder 'needs-contiguous' requires cache manager 'contiguous', "
                               "but 'paged' is selected")
    with pytest.raises(ConfigError) as info:
        build_config(pm, {"decoder": "needs-contiguous", "cache_manager": "contiguous", "scheduler": "static"})
    assert str(info.value) == "decoder 'needs-contiguous' cannot be combined with scheduler 'static'"
    build_config(pm, {"decoder": "needs-contiguous", "cache_manager": "contiguous"})


def test_duplicate_names_are_refused():
    class Dup:
        @hookimpl
        def register_schedulers(self, register):
            register("continuous", object)

    pm = PluginManager(load_entry_points=False, extra=[Dup()])
    with pytest.raises(ConfigError, match="registered twice"):
        pm.entries("scheduler")


def test_builtins_come_from_tokenloom():
    pm = PluginManager(load_entry_points=False)
    entry = pm.get("scheduler", "continuous")
    assert entry.package == "tokenloom" and entry.source.endswith("schedulers.continuous")


def _run_cli(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tokenloom.cli.main", *args],
                          capture_output=True, text=True, env=env)


def test_example_plugin_is_found_through_its_entry_point():
    out = _run_cli("plugins").stdout
    line = next(ln for ln in out.splitlines() if "shortest-first" in ln)
    assert "tokenloom-example-plugin" in line and line.startswith("scheduler")


def test_allowlist_env_var_restricts_third_party_plugins():
    out = _run_cli("plugins", env_extra={"TOKENLOOM_PLUGINS": "something_else"}).stdout
    assert "shortest-first" not in out and "continuous" in out


def test_config_file_selects_the_example_plugin_by_name(tiny_model_dir, tmp_path):
    from tokenloom import LLM, SamplingParams

    cfg = tmp_path / "plugin.toml"
    cfg.write_text(f'model = "{tiny_model_dir}"\ndtype = "float32"\nnum_kv_blocks = 64\n'
                   '[scheduler]\nname = "shortest-first"\nmax_num_seqs = 2\nmax_wait_steps = 4\n')
    pm = PluginManager(load_entry_points=True)
    with LLM(config_file=cfg, plugin_manager=pm) as llm:
        sched = llm.engine.scheduler
        assert type(sched).__name__ == "ShortestFirstScheduler" and sched.max_wait_steps == 4
        outs = llm.generate([[1] * 40, [2] * 3, [3] * 10], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [4, 4, 4]
