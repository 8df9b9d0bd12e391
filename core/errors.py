"""Typed errors. User input is checked with these, never with ``assert``."""

from __future__ import annotations


class TokenloomError(Exception):
    """Base of every error tokenloom raises on purpose."""

    code = "internal"


class ClientError(TokenloomError, ValueError):
    """The request is wrong: names the parameter and the value it got."""

    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, value: object = None):
        super().__init__(message)
        self.param = param
        self.value = value

    @classmethod
    def bad_value(cls, param: str, value: object, expected: str) -> ClientError:
        return cls(f"{param} must be {expected}, got {quoted(value)}", param=param, value=value)


def quoted(value: object, limit: int = 100) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters plus its full
    length: a client's 1 MB value is not echoed back in full."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}… ({size})"


class NotFound(ClientError):
    """The request names something the engine does not serve (an adapter): HTTP 404."""

    code = "not_found"


class RequestTooLong(ClientError):
    """The prompt (plus max_tokens) can never fit the model or the KV cache."""

    code = "context_length_exceeded"


class ConfigError(TokenloomError, ValueError):
    """The engine configuration is invalid (unknown key, bad value, bad combination)."""

    code = "invalid_config"


class UnknownPluginError(ConfigError, KeyError):
    """A strategy name no plugin registered."""

    def __init__(self, role: str, name: str, known: list[str]):
        self.role, self.name, self.known = role, name, known
        msg = f"unknown {role} {name!r}; known: {', '.join(sorted(known)) or '(none)'}"
        ConfigError.__init__(self, msg)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ServerError(TokenloomError, RuntimeError):
    """Something went wrong on our side while serving an accepted request."""

    code = "server_error"


class EngineUnavailable(ServerError):
    """The engine cannot take requests: a failed step's restart is pending
    (``retry_after_ms`` says when to retry) or it failed too often and is dead (None)."""

    code = "engine_unavailable"

    def __init__(self, message: str, *, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class AdaptersBusy(EngineUnavailable):
    """A request names an adapter while ``max_loras`` others are in use by live requests: a
    step mixes at most that many. Retry once one of them has finished."""

    code = "adapters_busy"
