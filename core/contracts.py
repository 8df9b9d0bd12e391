"""Each role's contract, checked once, when a plugin's factory has built its object.

A scheduler without ``observe`` or a cache manager without ``free`` would otherwise fail at
the first step or the first finished request that calls it, far from the plugin that is
wrong. :func:`build` calls the factory and checks the result against the role's Protocol
(core/interfaces.py): every method the Protocol declares must be there and callable,
every attribute and property must be there. A miss is a :class:`ConfigError` at start-up
that names the role, the strategy, the plugin it came from and each missing member::

    cache manager 'foo' (from plugin tokenloom_foo, package tokenloom-foo) does not implement
    CacheManager: missing allocate, free

Signatures are not compared (the Protocols leave most tensor arguments untyped); the static
type check (``make typecheck``) covers the built-ins' signatures.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenloom.core.errors import ConfigError
from tokenloom.core.interfaces import (
    AdapterManager,
    Backend,
    CacheManager,
    Decoder,
    Frontend,
    GrammarBackend,
    ModelArchitecture,
    ModelFormat,
    Quantizer,
    Scheduler,
    ToolParser,
)
from tokenloom.core.plugins import ROLE_LABELS, PluginEntry, PluginManager

if TYPE_CHECKING:
    from tokenloom.core.models.registry import ModelRegistry

# Names every class has, or that typing.Protocol / Generic / dataclass machinery adds: not members.
_NOT_MEMBERS = frozenset({
    "__abstractmethods__", "__annotations__", "__annotate__", "__annotations_cache__", "__class_getitem__",
    "__dict__", "__doc__", "__firstlineno__", "__init__", "__init_subclass__", "__match_args__", "__module__",
    "__new__", "__non_callable_proto_members__", "__orig_bases__", "__orig_class__", "__parameters__",
    "__protocol_attrs__", "__qualname__", "__slots__", "__static_attributes__", "__subclasshook__",
    "__type_params__", "__weakref__", "_is_protocol", "_is_runtime_protocol",
})


#: the Protocol each role's objects must satisfy
ROLE_CONTRACTS: dict[str, type] = {
    "scheduler": Scheduler, "cache_manager": CacheManager, "quantizer": Quantizer, "decoder": Decoder,
    "backend": Backend, "model_format": ModelFormat, "architecture": ModelArchitecture, "frontend": Frontend,
    "grammar": GrammarBackend, "tool_parser": ToolParser, "adapter": AdapterManager,
}


def protocol_members(protocol: type) -> dict[str, bool]:
    """Every member ``protocol`` declares (its own and its Protocol bases'), in declaration
    order, mapped to whether it is a method (True: must be callable) or an attribute or
    property (False: must only be there)."""
    members: dict[str, bool] = {}
    for base in reversed(protocol.__mro__):
        if base is object or base.__name__ in ("Protocol", "Generic"):
            continue
        for name in inspect.get_annotations(base):  # attributes (the Protocols declare them first)
            if name not in _NOT_MEMBERS:
                members[name] = False
        for name, value in vars(base).items():
            if name in _NOT_MEMBERS or name.startswith("_abc_"):
                continue
            members[name] = inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
    return members


def missing_members(obj: object, protocol: type) -> tuple[list[str], list[str]]:
    """(members ``obj`` lacks, methods it has that are not callable), in declaration order."""
    missing: list[str] = []
    not_callable: list[str] = []
    for name, is_method in protocol_members(protocol).items():
        if not hasattr(obj, name):
            missing.append(name)
        elif is_method and not callable(getattr(obj, name)):
            not_callable.append(name)
    return missing, not_callable


def origin(entry: PluginEntry) -> str:
    """Where a strategy came from, for messages: its plugin, and its package unless built in."""
    if entry.package in ("tokenloom", "(in-process)", "?"):
        return f"from plugin {entry.source}"
    return f"from plugin {entry.source}, package {entry.package}"


def check(obj: object, entry: PluginEntry) -> None:
    """Raise :class:`ConfigError` unless ``obj`` (what ``entry.factory`` built) satisfies its
    role's Protocol, naming the role, the strategy, its plugin and what is missing."""
    protocol = ROLE_CONTRACTS[entry.role]
    what = f"{ROLE_LABELS[entry.role]} {entry.name!r} ({origin(entry)}) does not implement {protocol.__name__}"
    if obj is None:
        raise ConfigError(f"{what}: its factory returned None")
    missing, not_callable = missing_members(obj, protocol)
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
        ([f"not callable: {', '.join(not_callable)}"] if not_callable else [])
    if problems:
        raise ConfigError(f"{what}: {'; '.join(problems)}")


def build(entry: PluginEntry, *args: Any, **kwargs: Any) -> Any:
    """``entry.factory(*args, **kwargs)``, checked with :func:`check`. The result is typed
    ``Any`` because the role is a run-time string; callers annotate it with the role's
    Protocol, which the check has just made true."""
    obj = entry.factory(*args, **kwargs)
    check(obj, entry)
    return obj


def model_formats(pm: PluginManager) -> dict[str, Callable[[], ModelFormat]]:
    """Every registered model format, built and checked now (``load_checkpoint`` builds
    them in turn only until one claims the checkpoint: a broken format registered after
    the one that claims would otherwise never be noticed), as the factories
    ``runner.load_checkpoint`` takes."""
    built: dict[str, ModelFormat] = {name: build(entry) for name, entry in pm.entries("model_format").items()}
    return {name: functools.partial(_same, fmt) for name, fmt in built.items()}


def model_registry(pm: PluginManager) -> ModelRegistry:
    """Every registered model architecture, built and checked now."""
    from tokenloom.core.models.registry import ModelRegistry

    return ModelRegistry({name: build(entry) for name, entry in pm.entries("architecture").items()})


def _same(fmt: ModelFormat) -> ModelFormat:
    return fmt
