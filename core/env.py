"""Every environment variable tokenloom reads, in one place, all prefixed ``TOKENLOOM_``."""

from __future__ import annotations

import os
from pathlib import Path

#: Comma-separated names of entry points (third-party plugins) that may load; empty = all.
PLUGINS_ALLOWLIST = "TOKENLOOM_PLUGINS"
#: Set to 1 to load no third-party plugin at all (tests set it).
DISABLE_PLUGIN_AUTOLOAD = "TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD"
#: structlog output: "json" (default when not a TTY) or "console".
LOG_FORMAT = "TOKENLOOM_LOG_FORMAT"
#: Log level name, default WARNING for the CLI generate command, INFO for serve.
LOG_LEVEL = "TOKENLOOM_LOG_LEVEL"
#: Number of torch intra-op threads; default: torch's choice.
NUM_THREADS = "TOKENLOOM_NUM_THREADS"
#: Where trained artefacts are kept (Medusa heads); default ~/.cache/tokenloom.
CACHE_DIR = "TOKENLOOM_CACHE"
#: Extra compiler flags for the C++ CPU ops, after ours (kernels/cpu_ops.py), e.g. -mno-avx512f.
CPU_OPS_CFLAGS = "TOKENLOOM_CPU_OPS_CFLAGS"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "tokenloom")


def cpu_ops_cflags() -> list[str]:
    return os.environ.get(CPU_OPS_CFLAGS, "").split()


def plugin_allowlist() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ALLOWLIST, "").strip()
    return {p.strip() for p in raw.split(",") if p.strip()} if raw else None


def plugin_autoload_disabled() -> bool:
    return os.environ.get(DISABLE_PLUGIN_AUTOLOAD, "").strip() not in ("", "0", "false")


def log_format() -> str | None:
    return os.environ.get(LOG_FORMAT) or None


def log_level(default: str) -> str:
    return os.environ.get(LOG_LEVEL, default).upper()


def num_threads() -> int | None:
    raw = os.environ.get(NUM_THREADS)
    return int(raw) if raw else None

#: API key the WebSocket server requires (Authorization: Bearer KEY); never logged.
API_KEY = "TOKENLOOM_API_KEY"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None
