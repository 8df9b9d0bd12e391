"""Role contracts checked at start-up (core/contracts.py): a plugin whose factory builds an
object that lacks a method of its role's Protocol fails while the engine starts, with a
sentence naming the role, the strategy, the plugin and each missing member; the built-ins
pass the same check (and every other test builds them through it)."""

from __future__ import annotations

import re

import pytest
import torch

from tokenloom.core import contracts
from tokenloom.core.build import config_from_sources
from tokenloom.core.config import build_config
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import CacheManager, Decoder, Scheduler
from tokenloom.core.plugins import ROLES, PluginEntry, PluginManager
from tokenloom.protocols.gateway import FrontendHost, ServerOptions

from conftest import tiny_engine_kwargs

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

_BUILTINS = PluginManager(load_entry_points=False)


class Without:
    """A real built-in strategy object with some of its members hidden (and some replaced
    by a value that is not callable)."""

    def __init__(self, inner, *hidden: str, not_callable: tuple[str, ...] = ()):
        self._inner, self._hidden, self._not_callable = inner, hidden, not_callable

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        if name in self._not_callable:
            return 42
        return getattr(self._inner, name)


def builtin(role: str, name: str):
    return _BUILTINS.get(role, name).factory


class NoFrontendMethods:
    name = "half"

    def __init__(self, options, context):
        self.started = False

    async def start(self) -> None:
        self.started = True


class ClaimsOnly:
    def claims(self, path) -> bool:
        return False


class Broken:
    """One broken strategy per role, each a built-in with members taken away."""

    @hookimpl
    def register_schedulers(self, register):
        register("no-observe", lambda options, cache, config: Without(
            builtin("scheduler", "continuous")(options, cache, config), "observe", "stats"))

    @hookimpl
    def register_cache_managers(self, register):
        register("no-free", lambda options, num_blocks, block_size: Without(
            builtin("cache_manager", "paged")(options, num_blocks, block_size), "allocate", "free"))

    @hookimpl
    def register_decoders(self, register):
        register("no-release", lambda options, context: Without(
            builtin("decoder", "standard")(options, context), "release", not_callable=("stats",)))
        register("nothing", lambda options, context: None)

    @hookimpl
    def register_backends(self, register):
        register("no-rope", lambda options, device: Without(builtin("backend", "torch")(options, device), "rope"))

    @hookimpl
    def register_quantizers(self, register):
        register("no-spec", lambda options: Without(builtin("quantizer", "none")(options), "weight_spec"))

    @hookimpl
    def register_frontends(self, register):
        register("half", NoFrontendMethods)


class BrokenFormat:
    """Always asked: a model format is not chosen by the config."""

    @hookimpl
    def register_model_formats(self, register):
        register("claims-only", ClaimsOnly)


# The plugin object is named after its class (module.qualname), not pluggy's id() default.
FROM = r"\(from plugin [\w.]*Broken\)"


def _start(tiny_model_dir, *plugins, **config):
    pm = PluginManager(load_entry_points=False, extra=plugins or [Broken()])
    return AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir, **config)),
                       plugin_manager=pm)


def _start_fails(tiny_model_dir, message: str, *plugins, **config) -> None:
    with pytest.raises(ConfigError) as info:
        engine = _start(tiny_model_dir, *plugins, **config)
        engine.close()
    assert re.fullmatch(message, str(info.value)), str(info.value)


@pytest.mark.parametrize(("config", "message"), [
    ({"scheduler": "no-observe"}, f"scheduler 'no-observe' {FROM} does not implement Scheduler: missing observe, stats"),
    ({"cache_manager": "no-free"},
     f"cache manager 'no-free' {FROM} does not implement CacheManager: missing allocate, free"),
    ({"decoder": "no-release"},
     f"decoder 'no-release' {FROM} does not implement Decoder: missing release; not callable: stats"),
    ({"decoder": "nothing"}, f"decoder 'nothing' {FROM} does not implement Decoder: its factory returned None"),
    ({"backend": "no-rope"}, f"backend 'no-rope' {FROM} does not implement Backend: missing rope"),
    ({"quantizer": "no-spec"}, f"quantizer 'no-spec' {FROM} does not implement Quantizer: missing weight_spec"),
], ids=["scheduler", "cache_manager", "decoder", "decoder-none", "backend", "quantizer"])
def test_a_strategy_missing_a_method_fails_at_start_up_naming_it(tiny_model_dir, config, message):
    _start_fails(tiny_model_dir, message, **config)


def test_a_broken_model_format_fails_start_up_even_when_another_format_claims_the_model(tiny_model_dir):
    # `hf` claims the tiny model before `claims-only` would be asked: every format is checked
    _start_fails(tiny_model_dir, "model format 'claims-only' " + FROM.replace("Broken", "BrokenFormat")
                 + " does not implement ModelFormat: missing load", BrokenFormat())


async def test_a_frontend_missing_methods_fails_before_it_starts(tiny_model_dir):
    engine = _start(tiny_model_dir, frontends={"enabled": ["half"]})
    try:
        host = FrontendHost(engine, ServerOptions())
        with pytest.raises(ConfigError) as info:
            await host.start()
        assert re.fullmatch(f"frontend 'half' {FROM} does not implement Frontend: missing urls, stop_accepting, close",
                            str(info.value)), str(info.value)
        assert host.frontends == []
    finally:
        await engine.shutdown()
        engine.close()


def test_the_message_names_a_third_party_package():
    entry = PluginEntry("cache_manager", "foo", lambda *a: object(), None, "tokenloom_foo", "tokenloom-foo")
    with pytest.raises(ConfigError) as info:
        contracts.check(object(), entry)
    assert str(info.value).startswith("cache manager 'foo' (from plugin tokenloom_foo, package tokenloom-foo) "
                                      "does not implement CacheManager: missing block_size, num_blocks, ")


def test_every_role_has_a_contract():
    assert set(contracts.ROLE_CONTRACTS) == set(ROLES)


def test_members_are_the_protocols_methods_and_attributes():
    members = contracts.protocol_members(Scheduler)
    assert [m for m, is_method in members.items() if not is_method] == ["num_running", "num_waiting"]
    assert {"add", "schedule", "finish", "abort", "observe", "on_finished", "stats"} <= set(members)
    cache = contracts.protocol_members(CacheManager)
    assert cache["block_size"] is False and cache["num_free_blocks"] is False and cache["allocate"] is True
    assert contracts.protocol_members(Decoder)["unavailable"] is False


def test_the_builtins_satisfy_their_contracts():
    pm = _BUILTINS
    entries = pm.entries
    caches = {name: contracts.build(entry, None, 32, 16) for name, entry in entries("cache_manager").items()}
    config = build_config(pm, {})
    for name, entry in entries("scheduler").items():
        cache = caches["contiguous" if name == "static" else "paged"]
        contracts.build(entry, None, cache, config)
    for entry in entries("quantizer").values():
        contracts.build(entry, None)
    contracts.build(pm.get("backend", "torch"), None, torch.device("cpu"))
    assert set(contracts.model_formats(pm)) == {"gguf", "hf"}
