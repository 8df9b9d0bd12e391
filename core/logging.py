"""structlog set-up: key=value events, JSON when not on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from tokenloom.core import env


def configure_logging(level: str = "WARNING", fmt: str | None = None) -> None:
    level = env.log_level(level)
    fmt = env.log_format() or fmt or ("console" if sys.stderr.isatty() else "json")
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # sys.stderr looked up per logger, not captured now: a later redirect (or a test's
        # capture, closed after it) must not leave every log call writing to a closed file
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
