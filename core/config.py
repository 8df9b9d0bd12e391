"""One validated engine config from defaults, a TOML file, CLI flags and keyword arguments.

Precedence: keyword arguments > flags > file > defaults. Each layer is a nested dict:
top-level engine keys, plus one table per role whose ``name`` picks the strategy and whose
other keys are that strategy's options (validated against the options struct it
registered, so an unknown key fails naming it)::

    model = "smollm2-135m"
    dtype = "bfloat16"
    [scheduler]
    name = "continuous"
    max_num_seqs = 32
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from tokenloom.core.errors import ConfigError
from tokenloom.core.plugins import ROLE_LABELS, ROLES, PluginManager

DEFAULT_MODEL = "smollm2-135m"
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
ENGINE_PROCESSES = ("auto", "inline", "separate")
SELECTABLE_ROLES = ("scheduler", "cache_manager", "decoder", "backend", "quantizer", "adapter")
DEFAULT_STRATEGIES = {
    "scheduler": "continuous",
    "cache_manager": "paged",
    "decoder": "standard",
    "backend": "torch",
    "quantizer": None,
    "adapter": None,
}
#: config tables that select a role's strategy by their own name: ``[lora]`` is ``[adapter] name = "lora"``
ROLE_ALIASES = {"lora": ("adapter", "lora")}
# `tokenloom serve` mounts these unless `[frontends] enabled` says otherwise (each on its port)
DEFAULT_FRONTENDS = ("websocket", "openai")


class EngineOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Top-level keys (not tied to one strategy)."""

    model: str = DEFAULT_MODEL
    # a Hugging Face id's branch, tag or commit hash (``model = "org/name"``); unset: main
    revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 where native, else fp32)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int = 0  # 0 = the model's own context length
    block_size: int = 16  # tokens per KV block, shared by every cache manager
    kv_cache_memory_mb: int = 1024  # KV pool budget; ignored when num_kv_blocks > 0
    # decoders that load a second model (``speculative``'s draft), built at start-up so that a
    # request may name them (SamplingParams.decoder); the others are always built at start-up
    enable_decoders: list[str] = msgspec.field(default_factory=list)
    num_kv_blocks: int = 0
    # KV pool storage: auto (the model dtype) | fp8 (float8_e4m3fn) | int8; the 8-bit ones keep a
    # bfloat16 scale per token per head beside the data and hold ~2x the tokens of bf16 in the same memory
    kv_cache_dtype: str = "auto"
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    max_restarts: int = 5  # failed steps in a row before the engine gives up (core/health.py)
    restart_backoff_s: float = 0.5  # first wait before restarting the step loop; doubles per failure
    # publish a step's outputs (detokenise, stream, time, log) while the next step runs
    overlap: bool = True
    # run each pure decode step as the backend's captured step (torch on CPU: the whole step in
    # one C++ call, backends/torch_backend.py); false runs every step op by op from Python
    capture: bool = True
    # where the engine core runs: ``inline`` (in the caller's process: the Python API, tests),
    # ``separate`` (its own process; requests and per-step token batches cross a pipe), or
    # ``auto`` (separate for `tokenloom serve`, inline everywhere else)
    process: str = "auto"
    # a request's tokens do not depend on what else is in its batch nor on the decoder: every
    # row takes the same kernels in the same reduction order (costlier; docs/quantization.md)
    batch_invariant: bool = False
    # Tensor parallelism (core/parallel.py, core/executor.py): ranks the model is split over;
    # under torchrun, the processes torchrun started. A hung rank fails the engine after
    # distributed_timeout_s.
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 30.0
    # the grammar backend (``register_grammars``) that compiles structured-output constraints
    grammar_backend: str = "xgrammar"
    # the tool-call parser (``register_tool_parsers``): ``auto`` picks by the chat template
    tool_call_parser: str = "auto"


@dataclass(slots=True)
class StrategyConfig:
    name: str
    options: msgspec.Struct | None = None  # the strategy's own options struct (None: it takes none)

    def to_dict(self) -> dict[str, Any]:
        opts = msgspec.to_builtins(self.options) if self.options is not None else {}
        return {"name": self.name, **opts}


@dataclass(slots=True)
class EngineConfig:
    engine: EngineOptions = field(default_factory=EngineOptions)
    scheduler: StrategyConfig = field(default_factory=lambda: StrategyConfig("continuous"))
    cache_manager: StrategyConfig = field(default_factory=lambda: StrategyConfig("paged"))
    decoder: StrategyConfig = field(default_factory=lambda: StrategyConfig("standard"))
    backend: StrategyConfig = field(default_factory=lambda: StrategyConfig("torch"))
    quantizer: StrategyConfig | None = None
    adapter: StrategyConfig | None = None  # low-rank adapters (none unless selected: ``[lora]``)
    # what `tokenloom serve` mounts, in order; the engine itself never reads it
    frontends: list[StrategyConfig] = field(default_factory=lambda: [StrategyConfig(n) for n in DEFAULT_FRONTENDS])

    def selection(self) -> dict[str, str | None]:
        return {
            role: (getattr(self, role).name if getattr(self, role) is not None else None)
            for role in SELECTABLE_ROLES
        }

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self.engine)
        for role in SELECTABLE_ROLES:
            strategy = getattr(self, role)
            if strategy is not None:
                out[role] = strategy.to_dict()
        fronts: dict[str, Any] = {"enabled": [f.name for f in self.frontends]}
        for f in self.frontends:
            if f.options is not None:
                fronts[f.name] = msgspec.to_builtins(f.options)
        out["frontends"] = fronts
        return out

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def merge_layers(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win. A role table whose ``name`` changes drops the earlier options."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in ROLE_ALIASES and isinstance(value, Mapping):
                key, value = ROLE_ALIASES[key][0], {"name": ROLE_ALIASES[key][1], **value}
            if key in SELECTABLE_ROLES or key in ROLES:
                value = {"name": value} if isinstance(value, str) else dict(value or {})
                prev = out.get(key, {})
                if "name" in value and prev.get("name") not in (None, value["name"]):
                    prev = {}
                out[key] = {**prev, **copy.deepcopy(value)}
            elif key == "frontends" and isinstance(value, Mapping):  # a frontend's table merges key by key
                earlier = out.get(key)
                prev = earlier if isinstance(earlier, Mapping) else {}
                merged = dict(prev)
                for name, sub in value.items():
                    if isinstance(sub, Mapping) and isinstance(prev.get(name), Mapping):
                        merged[name] = {**prev[name], **copy.deepcopy(dict(sub))}
                    else:
                        merged[name] = copy.deepcopy(sub)
                out[key] = merged
            else:
                out[key] = copy.deepcopy(value)
    return out


def build_config(pm: PluginManager, *layers: Mapping[str, Any]) -> EngineConfig:
    """Validate merged layers into an :class:`EngineConfig`; errors name the key."""
    raw = merge_layers(*layers)
    role_tables = {role: raw.pop(role) for role in list(raw) if role in SELECTABLE_ROLES}
    frontends_table = raw.pop("frontends", {})
    for key in list(raw):
        if key in ROLES:  # e.g. model_format: chosen by the checkpoint, not by config
            raise ConfigError(f"{ROLE_LABELS[key]} cannot be selected in the config")
    try:
        engine = msgspec.convert(raw, EngineOptions, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid engine option: {exc}") from None
    _check_engine(engine)
    pm.get("grammar", engine.grammar_backend)  # an unknown name fails here, naming the known ones
    if engine.tool_call_parser != "auto":
        pm.get("tool_parser", engine.tool_call_parser)
    config = EngineConfig(engine=engine)
    for role in SELECTABLE_ROLES:
        table = dict(role_tables.get(role, {}))
        name = table.pop("name", DEFAULT_STRATEGIES[role])
        # "none" deselects a role, except for the quantizer, where it is a strategy: dense
        # weights (no [quantizer] at all means: what the checkpoint's metadata says).
        if name is None or (name == "none" and role != "quantizer"):
            if table:
                raise ConfigError(f"options given for {ROLE_LABELS[role]} but none is selected")
            setattr(config, role, None)
            continue
        entry = pm.get(role, name)
        setattr(config, role, StrategyConfig(name, _convert_options(role, name, entry.options, table)))
    pm.check_combination(config.selection())
    config.frontends = _frontends(pm, frontends_table)
    return config


def _frontends(pm: PluginManager, table: Any) -> list[StrategyConfig]:
    """``[frontends]``: ``enabled`` (names, in mounting order) and one ``[frontends.<name>]``
    options table per enabled frontend."""
    if not isinstance(table, Mapping):
        raise ConfigError("frontends must be a table: enabled = [...] and [frontends.<name>] options")
    table = dict(table)
    enabled = table.pop("enabled", list(DEFAULT_FRONTENDS))
    if isinstance(enabled, str):
        enabled = [n.strip() for n in enabled.split(",") if n.strip()]
    if not isinstance(enabled, list) or not all(isinstance(n, str) for n in enabled):
        raise ConfigError(f"frontends.enabled must be a list of frontend names, got {enabled!r}")
    if len(set(enabled)) != len(enabled):
        raise ConfigError(f"frontends.enabled names a frontend twice: {enabled}")
    out = []
    for name in enabled:
        entry = pm.get("frontend", name)
        options = table.pop(name, {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"frontends.{name} must be a table of options, got {options!r}")
        out.append(StrategyConfig(name, _convert_options(f"frontends.{name}", name, entry.options, dict(options),
                                                            label="frontend")))
    for key, options in table.items():  # a frontend not enabled now: its options are checked, then kept aside
        if key not in pm.entries("frontend"):
            raise ConfigError(f"unknown key frontends.{key}; known: enabled, {', '.join(sorted(pm.entries('frontend')))}")
        if not isinstance(options, Mapping):
            raise ConfigError(f"frontends.{key} must be a table of options, got {options!r}")
        _convert_options(f"frontends.{key}", key, pm.get("frontend", key).options, dict(options), label="frontend")
    return out


def _convert_options(role: str, name: str, options_type: type[msgspec.Struct] | None, table: dict,
                     label: str | None = None) -> msgspec.Struct | None:
    """``role`` prefixes the keys in messages (``scheduler``, ``frontends.openai``)."""
    label = label or ROLE_LABELS[role]
    if options_type is None:
        if table:
            key = next(iter(table))
            raise ConfigError(f"unknown key {role}.{key}: {label} {name!r} takes no options")
        return None
    try:
        return msgspec.convert(table, options_type, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if "unknown field" in msg:
            key = msg.split("`")[1] if "`" in msg else "?"
            if "at `$." in msg:  # inside a nested table (msgspec writes a mapping's keys as [...])
                where = msg.split("at `$.", 1)[1].split("`", 1)[0]
                raise ConfigError(f"unknown key {key!r} in {role}.{where} for {label} {name!r}") from None
            known = ", ".join(options_type.__struct_fields__)
            raise ConfigError(
                f"unknown key {role}.{key} for {label} {name!r}; known: {known}"
            ) from None
        raise ConfigError(f"invalid option for {label} {name!r}: {msg}") from None


def _check_engine(e: EngineOptions) -> None:
    if e.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {e.dtype!r}")
    if e.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be auto, fp8 or int8, got {e.kv_cache_dtype!r}")
    if e.process not in ENGINE_PROCESSES:
        raise ConfigError(f"process must be auto, inline or separate, got {e.process!r}")
    if e.block_size < 1 or e.block_size & (e.block_size - 1):
        raise ConfigError(f"block_size must be a power of two, got {e.block_size}")
    for key in ("max_model_len", "kv_cache_memory_mb", "num_kv_blocks", "seed", "num_threads", "max_restarts",
                "restart_backoff_s"):
        if getattr(e, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(e, key)}")
    if e.tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {e.tensor_parallel_size}")
    if e.distributed_timeout_s <= 0:
        raise ConfigError(f"distributed_timeout_s must be > 0, got {e.distributed_timeout_s}")


def parse_override(item: str) -> dict[str, Any]:
    """``"scheduler.max_num_seqs=8"`` -> ``{"scheduler": {"max_num_seqs": 8}}`` (TOML value)."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    key, value = item.split("=", 1)
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value  # a bare string
    return nested(key.strip(), parsed)


def nested(dotted_key: str, value: Any) -> dict[str, Any]:
    """``nested("scheduler.max_num_seqs", 8)`` -> ``{"scheduler": {"max_num_seqs": 8}}``."""
    parts = dotted_key.split(".")
    out: dict[str, Any] = {}
    node = out
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def dump_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """A small TOML writer: keys, then tables and their sub-tables (all a config needs)."""
    # TOML has no null: a None is left out, which reads back as the option's default (None)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping) and v is not None]
    for key, table in data.items():
        if isinstance(table, Mapping):
            lines.append(f"\n[{prefix}{key}]")
            lines.append(dump_toml(table, f"{prefix}{key}.").rstrip("\n"))
    return "\n".join(line for line in lines if line) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
