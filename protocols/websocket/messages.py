"""The WebSocket wire protocol: JSON text frames, msgspec tagged unions on ``type``.

Version 1. Client -> server: ``generate``, ``cancel``, ``ping``. Server -> client:
``session`` (on connect), ``accepted``, ``delta``, ``done``, ``error``, ``pong``.
Invariants: every accepted request ends in exactly one ``done``; the concatenated
``delta`` texts equal the final text; a request-level error never closes the connection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from tokenloom.core.outputs import Usage
from tokenloom.core.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
MAX_ID_LEN = 128
MAX_MESSAGES = 256
MAX_PROMPT_CHARS = 1 << 20  # 1 MiB of text; the frame limit caps it anyway
MAX_TOKEN_ID = 2**31 - 1

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    content: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]


# ---- client -> server --------------------------------------------------------------
class Generate(msgspec.Struct, tag="generate", frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: RequestId
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=1 << 17)] | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # tenants never share KV
    # Control-token strings (<|im_end|>, ...) in the input: None = parsed in a raw prompt,
    # literal text in chat messages' content (so a user cannot forge a turn).
    parse_special_tokens: bool | None = None


class Cancel(msgspec.Struct, tag="cancel", frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: RequestId


class Ping(msgspec.Struct, tag="ping", frozen=True, kw_only=True, forbid_unknown_fields=True):
    data: Annotated[str, msgspec.Meta(max_length=256)] | None = None


ClientMessage = Generate | Cancel | Ping


# ---- server -> client --------------------------------------------------------------
class Limits(msgspec.Struct, frozen=True, kw_only=True):
    max_model_len: int
    max_frame_bytes: int
    max_queue: int
    max_tokens_default: int


class Session(msgspec.Struct, tag="session", frozen=True, kw_only=True):
    protocol: int
    model: str
    limits: Limits
    strategies: dict[str, Any]


class Accepted(msgspec.Struct, tag="accepted", frozen=True, kw_only=True):
    id: str


class LogprobOut(msgspec.Struct, frozen=True, kw_only=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


class Delta(msgspec.Struct, tag="delta", frozen=True, kw_only=True):
    id: str
    text: str
    token_ids: list[int]
    logprobs: list[LogprobOut] | None = None


class MetricsOut(msgspec.Struct, frozen=True, kw_only=True):
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    num_accepted_tokens: int = 0
    drafted_by: dict[str, int] = msgspec.field(default_factory=dict)  # draft tokens per decoder (auto's choices)


class Done(msgspec.Struct, tag="done", frozen=True, kw_only=True):
    id: str
    finish_reason: str  # stop | length | cancelled | aborted | timeout | error
    usage: Usage  # the engine's own struct: prompt, cached and completion tokens
    metrics: MetricsOut
    error: str | None = None


class Error(msgspec.Struct, tag="error", frozen=True, kw_only=True):
    code: str
    message: str
    id: str | None = None
    param: str | None = None
    retry_after_ms: int | None = None


class Pong(msgspec.Struct, tag="pong", frozen=True, kw_only=True):
    data: str | None = None


ServerMessage = Session | Accepted | Delta | Done | Error | Pong

_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)
_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> str:
    return _encoder.encode(msg).decode()


def decode_server(data: str | bytes) -> ServerMessage:
    return _server_decoder.decode(data)


def dispatch_client_frame(frame: str | bytes, put: Callable[[Any], None], on_generate: Callable[[Generate], None],
                          on_cancel: Callable[[str], None]) -> None:
    """One client frame, as a server and the router both take it: a binary frame or a bad
    message is answered with an :class:`Error`, a ping with a pong (``put`` queues the
    answer); a ``generate`` or ``cancel`` goes to its handler."""
    if isinstance(frame, bytes):
        put(Error(code="binary_not_supported", message="send JSON text frames"))
        return
    msg = decode_client(frame)
    if isinstance(msg, Error):
        put(msg)
    elif isinstance(msg, Ping):
        put(Pong(data=msg.data))
    elif isinstance(msg, Cancel):
        on_cancel(msg.id)
    elif isinstance(msg, Generate):
        on_generate(msg)


def decode_client(data: str | bytes) -> ClientMessage | Error:
    """Never raises: a bad frame becomes an :class:`Error` with a stable code and, where
    msgspec can tell, the offending parameter. No stack trace or path leaks out."""
    try:
        msg = _decoder.decode(data)
    except RecursionError:  # msgspec recurses per nesting level; a hostile frame can nest deeply
        return Error(code="invalid_json", message="JSON nested deeper than this server decodes",
                     id=_shallow_id(data))
    except msgspec.ValidationError as exc:
        text = str(exc)
        code = "unknown_type" if "Invalid value" in text and "$.type" in text else "invalid_message"
        return Error(code=code, message=_clean(text), param=_param_of(text), id=_id_of(data))
    except msgspec.DecodeError as exc:
        return Error(code="invalid_json", message=_clean(str(exc)), id=_shallow_id(data))
    if isinstance(msg, Generate):
        given = sum(x is not None for x in (msg.prompt, msg.prompt_token_ids, msg.messages))
        if given != 1:
            return Error(code="invalid_request", id=msg.id, param="prompt",
                         message="give exactly one of prompt, prompt_token_ids or messages")
    return msg


def _clean(text: str) -> str:
    return text.splitlines()[0][:300] if text else "invalid message"


def _param_of(text: str) -> str | None:
    if "`$." in text:
        path = text.split("`$.", 1)[1].split("`", 1)[0]
        parts = [p.split("[", 1)[0] for p in path.split(".")]
        return parts[-1] if parts[0] == "params" else parts[0]
    if "field `" in text:
        return text.split("field `", 1)[1].split("`", 1)[0]
    return None


class _IdOnly(msgspec.Struct):
    id: str | None = None


_id_decoder = msgspec.json.Decoder(_IdOnly)


def _id_of(data: str | bytes) -> str | None:
    """The ``id`` of a frame that failed validation, so the error can name its request.
    Typed, never untyped: other fields are skipped, not built. Skipping still recurses (and
    msgspec bounds the depth it skips), so a frame nested too deep for that is scanned."""
    try:
        rid = _id_decoder.decode(data).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _shallow_id(data)
    return rid if rid is not None and 0 < len(rid) <= MAX_ID_LEN else None


_STRUCTURAL = re.compile(r'[\[\]{}"]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"')  # the rest of a string literal after its opening quote
_SPACE = re.compile(r"[ \t\r\n]*")
_SCAN_STEPS = 20_000  # structural characters and strings looked at, at most (bounded work per bad frame)
_SCAN_CHARS = 1 << 18  # and characters: an id comes early in a frame
_ID_SPELLINGS = frozenset(f'"{i}{d}"' for i in ("i", "\\u0069") for d in ("d", "\\u0064"))  # JSON's ways to write "id"


def _shallow_id(data: str | bytes) -> str | None:
    """A string ``id`` key of the top-level object, found without decoding the frame: for
    frames that cannot be decoded (nested too deep, truncated), whose error should still
    name the request when its id comes before the trouble. A linear scan that never
    recurses, gives up after ``_SCAN_STEPS`` tokens or ``_SCAN_CHARS`` characters, and
    returns None when unsure."""
    text = data[:_SCAN_CHARS] if isinstance(data, str) else data[:_SCAN_CHARS].decode("utf-8", "replace")
    depth, pos = 0, 0
    for _ in range(_SCAN_STEPS):
        m = _STRUCTURAL.search(text, pos)
        if m is None:
            return None
        char, pos = m.group(), m.end()
        if depth == 0 and char != "{":
            return None  # not an object
        if char in "[{":
            depth += 1
            continue
        if char in "]}":
            depth -= 1
            if depth == 0:
                return None
            continue
        end = _STRING_REST.match(text, pos)
        if end is None:
            return None  # unterminated
        literal, pos = text[m.start():end.end()], end.end()
        if depth != 1:
            continue
        pos = _skip_space(text, pos)
        if not text.startswith(":", pos):
            continue  # a value, not a key
        pos = _skip_space(text, pos + 1)
        if literal not in _ID_SPELLINGS:
            continue
        if not text.startswith('"', pos) or (value := _STRING_REST.match(text, pos + 1)) is None:
            return None
        rid = _json_string(text[pos:value.end()])
        return rid if rid is not None and 0 < len(rid) <= MAX_ID_LEN else None
    return None


def _skip_space(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m else pos


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
