"""Plugin manager: built-ins and third-party packages register through the same hooks."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pluggy
import structlog

from tokenloom.core import env, hookspecs
from tokenloom.core.errors import ConfigError, UnknownPluginError

log = structlog.get_logger("tokenloom.plugins")

ROLES = ("scheduler", "cache_manager", "quantizer", "decoder", "backend", "model_format", "architecture", "frontend",
         "grammar", "tool_parser", "adapter")
_HOOK_OF_ROLE = {
    "scheduler": "register_schedulers",
    "cache_manager": "register_cache_managers",
    "quantizer": "register_quantizers",
    "decoder": "register_decoders",
    "backend": "register_backends",
    "model_format": "register_model_formats",
    "architecture": "register_models",
    "frontend": "register_frontends",
    "grammar": "register_grammars",
    "tool_parser": "register_tool_parsers",
    "adapter": "register_adapters",
}
ROLE_LABELS = {role: role.replace("_", " ") for role in ROLES} | {"architecture": "model architecture"}

#: Built-in plugins, registered exactly like third-party ones.
BUILTIN_PLUGINS = (
    "tokenloom.plugins.schedulers.continuous",
    "tokenloom.plugins.schedulers.static",
    "tokenloom.plugins.schedulers.cache_aware",
    "tokenloom.plugins.schedulers.slo",
    "tokenloom.plugins.cache.paged",
    "tokenloom.plugins.cache.contiguous",
    "tokenloom.plugins.cache.radix",
    "tokenloom.plugins.decoders.standard",
    "tokenloom.plugins.decoders.ngram",
    "tokenloom.plugins.decoders.speculative",
    "tokenloom.plugins.decoders.medusa",
    "tokenloom.plugins.decoders.eagle",
    "tokenloom.plugins.decoders.auto",
    "tokenloom.plugins.quantizers.native",
    "tokenloom.plugins.quantizers.online",
    "tokenloom.plugins.quantizers.packed",
    "tokenloom.plugins.formats",
    "tokenloom.plugins.models",
    "tokenloom.backends.torch_backend",
    "tokenloom.backends.triton_backend",
    "tokenloom.protocols.frontends",
    "tokenloom.plugins.grammars",
    "tokenloom.plugins.tool_parsers",
    "tokenloom.plugins.adapters.lora",
)


@dataclass(frozen=True, slots=True)
class PluginEntry:
    """One registered strategy."""

    role: str
    name: str
    factory: Callable[..., Any]  # arguments and result depend on the role (core/hookspecs.py)
    options: type[msgspec.Struct] | None  # its options struct: a config table is converted to it
    source: str  # the plugin (module or entry point) that registered it
    package: str  # the distribution it came from
    requires: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    conflicts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    description: str = ""
    # a decoder that loads a second model (a draft): built at start-up only when the engine's
    # decoder or listed in ``enable_decoders``, so that no request can make a server load one
    loads_model: bool = False


class PluginManager:
    """Collects the strategies every plugin registers; answers lookups by name."""

    def __init__(self, *, load_entry_points: bool | None = None, extra: Iterable[object] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._package_of: dict[str, str] = {}
        for module_path in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(module_path), name=module_path)
            self._package_of[module_path] = "tokenloom"
        if load_entry_points is None:
            load_entry_points = not env.plugin_autoload_disabled()
        if load_entry_points:
            self._load_entry_points()
        for plugin in extra:
            self.register(plugin)
        self._entries: dict[str, dict[str, PluginEntry]] | None = None

    def register(self, plugin: object, name: str | None = None, package: str = "(in-process)") -> None:
        if name is None and not hasattr(plugin, "__name__"):
            # an object (pluggy would name it by its id()): named after its class, so that
            # `tokenloom plugins` and the start-up checks' messages can say which it is
            base = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
            name, n = base, 1
            while self.pm.has_plugin(name):
                n += 1
                name = f"{base}#{n}"
        registered = self.pm.register(plugin, name=name)
        if registered is None:  # pluggy refuses a plugin blocked by name: nothing to record
            return
        self._package_of[registered] = package
        self._entries = None

    def _load_entry_points(self) -> None:
        allow = env.plugin_allowlist()
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:
                if allow is not None:  # explicitly requested: fail loudly
                    raise ConfigError(f"plugin {ep.name!r} from {dist} failed to load: {exc}") from exc
                log.warning("plugin_load_failed", plugin=ep.name, package=dist, error=str(exc))
                continue
            self._package_of[ep.name] = dist

    @property
    def hook(self):
        return self.pm.hook

    def has_impl(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    # ---- registry -------------------------------------------------------------------
    def entries(self, role: str) -> dict[str, PluginEntry]:
        if self._entries is None:
            self._entries = self._collect()
        return self._entries[role]

    def _collect(self) -> dict[str, dict[str, PluginEntry]]:
        out: dict[str, dict[str, PluginEntry]] = {role: {} for role in ROLES}
        for role, hook_name in _HOOK_OF_ROLE.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                source = impl.plugin_name
                package = self._package_of.get(source, "?")

                def register(name, factory, *, options=None, requires=None, conflicts=None,
                             description="", loads_model=False, _role=role, _source=source, _package=package):
                    if name in out[_role]:
                        prev = out[_role][name]
                        raise ConfigError(
                            f"{ROLE_LABELS[_role]} {name!r} registered twice: by {prev.source} and {_source}"
                        )
                    out[_role][name] = PluginEntry(
                        _role, name, factory, options, _source, _package,
                        {k: tuple(v) for k, v in (requires or {}).items()},
                        {k: tuple(v) for k, v in (conflicts or {}).items()},
                        description or (factory.__doc__ or "").strip().split("\n")[0],
                        bool(loads_model),
                    )

                impl.function(register=register)
        return out

    def get(self, role: str, name: str) -> PluginEntry:
        entries = self.entries(role)
        if name not in entries:
            raise UnknownPluginError(ROLE_LABELS[role], name, list(entries))
        return entries[name]

    def check_combination(self, selection: Mapping[str, str | None]) -> None:
        """Fail with a sentence when a selected strategy requires or conflicts with another."""
        for role, name in selection.items():
            if name is None:
                continue
            entry = self.get(role, name)
            for other_role, allowed in entry.requires.items():
                chosen = selection.get(other_role)
                if chosen not in allowed:
                    raise ConfigError(
                        f"{ROLE_LABELS[role]} {name!r} requires {ROLE_LABELS[other_role]} "
                        f"{' or '.join(map(repr, allowed))}, but {chosen!r} is selected"
                    )
            for other_role, banned in entry.conflicts.items():
                chosen = selection.get(other_role)
                if chosen in banned:
                    raise ConfigError(
                        f"{ROLE_LABELS[role]} {name!r} cannot be combined with "
                        f"{ROLE_LABELS[other_role]} {chosen!r}"
                    )
