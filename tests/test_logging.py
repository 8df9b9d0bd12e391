"""Logging follows sys.stderr as it is when a line is written, not as it was configured."""

from __future__ import annotations

import io
import sys

import structlog

from tokenloom.core.logging import configure_logging


def test_a_closed_stderr_from_configuration_time_is_not_written_to(monkeypatch):
    """`tokenloom` commands configure logging; under a test's capture (closed afterwards) or
    a later redirect, every later log line went to the closed stream and raised, which broke
    whatever called the logger (a server cutting a slow client)."""
    early = io.StringIO()
    monkeypatch.setattr(sys, "stderr", early)
    configure_logging("WARNING", "json")
    early.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    structlog.get_logger("tokenloom.test").warning("still_logging", n=1)
    assert "still_logging" in later.getvalue()
    configure_logging("WARNING", "console")
