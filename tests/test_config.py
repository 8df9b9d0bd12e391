"""Config layers: kwargs > flags > file > defaults; unknown keys name themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenloom.core.config import build_config, parse_override
from tokenloom.core.errors import ConfigError, UnknownPluginError
from tokenloom.core.plugins import PluginManager


@pytest.fixture(scope="module")
def pm():
    return PluginManager(load_entry_points=False)


def test_defaults(pm):
    cfg = build_config(pm)
    assert cfg.selection() == {"scheduler": "continuous", "cache_manager": "paged", "decoder": "standard",
                               "backend": "torch", "quantizer": None, "adapter": None}
    # 0: auto, chosen at start-up from the KV pool and the machine (tests/test_scheduler_defaults.py)
    assert cfg.scheduler.options.max_num_seqs == cfg.scheduler.options.max_num_batched_tokens == 0


def test_precedence_kwargs_over_flags_over_file(pm):
    file = {"dtype": "float16", "seed": 1, "scheduler": {"name": "continuous", "max_num_seqs": 4,
                                                          "max_num_batched_tokens": 100}}
    flags = {"seed": 2, "scheduler": {"max_num_seqs": 8}}
    kwargs = {"seed": 3}
    cfg = build_config(pm, file, flags, kwargs)
    assert cfg.engine.seed == 3  # kwargs win
    assert cfg.engine.dtype == "float16"  # only the file set it
    assert cfg.scheduler.options.max_num_seqs == 8  # flags over file
    assert cfg.scheduler.options.max_num_batched_tokens == 100  # file over defaults


def test_switching_strategy_drops_the_other_strategys_options(pm):
    file = {"scheduler": {"name": "continuous", "max_num_batched_tokens": 100}}
    cfg = build_config(pm, file, {"scheduler": "static"})
    assert cfg.scheduler.name == "static" and cfg.scheduler.options.max_num_seqs == 32


@pytest.mark.parametrize("layer, words", [
    ({"scheduler": {"max_num_seqz": 3}}, ["scheduler.max_num_seqz", "max_num_seqs"]),
    ({"cache_manager": {"name": "paged", "block": 3}}, ["cache_manager.block"]),
    ({"modle": "x"}, ["modle"]),
    ({"dtype": "int3"}, ["dtype", "int3"]),
    ({"block_size": 12}, ["block_size"]),
    ({"scheduler": {"max_num_seqs": "many"}}, ["max_num_seqs"]),
])
def test_bad_keys_and_values_are_named(pm, layer, words):
    with pytest.raises(ConfigError) as info:
        build_config(pm, layer)
    for word in words:
        assert word in str(info.value)


def test_unknown_strategy_lists_known_ones(pm):
    with pytest.raises(UnknownPluginError) as info:
        build_config(pm, {"cache_manager": "x"})
    assert str(info.value) == "unknown cache manager 'x'; known: contiguous, paged, radix"


def test_parse_override_reads_toml_values():
    assert parse_override("scheduler.max_num_seqs=8") == {"scheduler": {"max_num_seqs": 8}}
    assert parse_override("scheduler.enable_chunked_prefill=false") == {"scheduler": {"enable_chunked_prefill": False}}
    assert parse_override("model=some/dir") == {"model": "some/dir"}


def test_config_command_prints_effective_combination(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dtype = "float32"\n[scheduler]\nname = "static"\nmax_num_seqs = 3\n')
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", "config", "--config", str(cfg),
                          "--max-num-seqs", "5", "--cache-manager", "contiguous"],
                         capture_output=True, text=True, check=True).stdout
    assert 'dtype = "float32"' in out
    assert '[scheduler]\nname = "static"\nmax_num_seqs = 5' in out
    assert '[cache_manager]\nname = "contiguous"' in out


def test_config_command_fails_naming_the_key(tmp_path):
    res = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", "config", "--set", "scheduler.nope=1"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "scheduler.nope" in res.stderr and "Traceback" not in res.stderr


def test_frontends_default_merge_and_round_trip(pm):
    assert [f.name for f in build_config(pm).frontends] == ["websocket", "openai"]
    file = {"frontends": {"enabled": ["openai", "websocket"], "openai": {"port": 9000, "max_body_bytes": 4096}}}
    flags = {"frontends": {"openai": {"port": 9001}}}  # a flag changes one key, the file's others stay
    cfg = build_config(pm, file, flags)
    assert [f.name for f in cfg.frontends] == ["openai", "websocket"]
    openai = cfg.frontends[0].options
    assert (openai.port, openai.max_body_bytes) == (9001, 4096)
    assert build_config(pm, {"frontends": {"enabled": "openai"}}).frontends[0].name == "openai"
    # a dumped config (every frontend's table) still works with fewer frontends enabled
    only_ws = build_config(pm, file, {"frontends": {"enabled": ["websocket"]}})
    assert [f.name for f in only_ws.frontends] == ["websocket"]

    import tomllib

    text = cfg.to_toml()
    assert "[frontends.openai]" in text
    again = build_config(pm, tomllib.loads(text))
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("layer, words", [
    ({"frontends": {"enabled": ["websocket", "gopher"]}}, ["gopher", "websocket", "openai"]),
    ({"frontends": {"openai": {"prot": 1}}}, ["frontends.openai.prot", "port"]),
    ({"frontends": {"openai": {"port": 70000}}}, ["frontend 'openai'", "port"]),
    ({"frontends": {"enabled": ["websocket"], "openai": {"prot": 1}}}, ["frontends.openai.prot"]),  # checked, if off
    ({"frontends": {"enabled": ["openai", "openai"]}}, ["twice"]),
    ({"frontends": {"http": {}}}, ["frontends.http"]),
    ({"frontends": 3}, ["frontends must be a table"]),
])
def test_bad_frontend_config_is_named(pm, layer, words):
    with pytest.raises(ConfigError) as info:
        build_config(pm, layer)
    for word in words:
        assert word in str(info.value), str(info.value)
