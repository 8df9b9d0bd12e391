"""structlog set-up: key=value events, JSON when not on a terminal.

Exceptions are rendered into the record: JSON lines carry an ``exception`` list (type,
message and stack frames per chained exception, without local variables, which may hold
prompts or keys), console lines a plain traceback. The standard-library loggers of the
servers underneath (uvicorn, websockets, asyncio) write through the same renderer, so one
process writes one format."""

from __future__ import annotations

import logging
import sys

import structlog

from tokenloom.core import env

#: standard-library loggers whose records go through the same renderer
FOREIGN_LOGGERS = ("uvicorn", "websockets", "asyncio")


def _renderer(fmt: str):
    if fmt == "console":
        return structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    return structlog.processors.JSONRenderer()


def _exceptions(fmt: str) -> list:
    """JSON: exc_info becomes a structured ``exception`` (the console renderer formats it)."""
    if fmt == "console":
        return []
    return [structlog.processors.ExceptionRenderer(
        structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=50))]


class _StderrHandler(logging.Handler):
    """Writes to sys.stderr as it is when the record is written (see below)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def configure_logging(level: str = "WARNING", fmt: str | None = None) -> None:
    level = env.log_level(level)
    fmt = env.log_format() or fmt or ("console" if sys.stderr.isatty() else "json")
    renderer = _renderer(fmt)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *_exceptions(fmt),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # sys.stderr looked up per logger, not captured now: a later redirect (or a test's
        # capture, closed after it) must not leave every log call writing to a closed file
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_exceptions(fmt), renderer],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso")]))
    for name in FOREIGN_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
