"""OpenAI request bodies as msgspec Structs, their mapping onto SamplingParams, and the
response shapes (chat.completion, text_completion, their stream chunks, errors).

Fields OpenAI defines that change what is generated and that tokenloom cannot honour
(``n`` > 1, ``best_of`` > 1, ``tools``, a JSON ``response_format``, ``logit_bias``,
``echo``, ``suffix``, non-text content parts) are refused with a 400 naming the field;
fields that only describe the caller (``user``, ``metadata``, ``store``, ...) and unknown
fields are ignored, as OpenAI's own server and vLLM ignore what they do not use.
Extensions in vLLM's spirit: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, and tokenloom's ``decoder``, ``num_speculative_tokens`` and the latency
targets ``slo_class``, ``ttft_ms``, ``tpot_ms`` (see SamplingParams).
Log-probabilities: chat's ``top_logprobs`` in [0, 20] as OpenAI bounds it (a value out of
range is refused naming ``top_logprobs``); the completions endpoint's ``logprobs: N`` in
[0, 20] too (OpenAI's legacy endpoint stops at 5). Error messages quote a client's value
cut to 100 characters, with its length.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tokenloom.core.errors import ClientError, quoted
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.protocols.websocket.messages import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_TOKEN_ID

Text = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs; tokenloom holds completions' logprobs to it too


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: Text | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    content: Text | list[ContentPart] | None = None
    name: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """The sampling fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, msgspec.Meta(max_length=256)] | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names), and tokenloom's decoder choice
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    decoder: str | None = None
    num_speculative_tokens: int | None = None
    # latency targets for the `slo` scheduler (a service class and its TTFT/TPOT in ms)
    slo_class: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Text | Annotated[list[Any], msgspec.Meta(max_length=1 << 17)]  # checked in completion_prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def decode_request(body: bytes, kind: type[_Sampling]) -> _Sampling:
    """Parse a body; a ClientError naming the field for bad JSON, types or refused fields."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise ClientError("JSON nested deeper than this server decodes") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise ClientError(text.splitlines()[0][:300], param=_param_of(text)) from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"the body is not valid JSON: {str(exc)[:200]}") from None
    _refuse_unsupported(req)
    return req


def _param_of(text: str) -> str | None:
    if "`$." in text:
        path = text.split("`$.", 1)[1].split("`", 1)[0]
        return path.split("[", 1)[0].split(".", 1)[0]
    if "field `" in text:
        return text.split("field `", 1)[1].split("`", 1)[0]
    return None


def _refuse_unsupported(req: _Sampling) -> None:
    if req.n is not None and req.n != 1:
        raise ClientError.bad_value("n", req.n, "1 (one choice per request: send parallel requests instead)")
    if req.logit_bias:
        raise ClientError("logit_bias is not supported", param="logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            raise ClientError("tools (function calling) are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ClientError("only response_format {'type': 'text'} is supported", param="response_format")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ClientError.bad_value("top_logprobs", req.top_logprobs, f"in [0, {MAX_TOP_LOGPROBS}]")
        if req.top_logprobs is not None and not req.logprobs:
            raise ClientError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if req.best_of is not None and req.best_of != 1:
            raise ClientError.bad_value("best_of", req.best_of, "1")
        if req.echo:
            raise ClientError("echo is not supported", param="echo")
        if req.suffix:
            raise ClientError("suffix (insertion) is not supported", param="suffix")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them: text parts joined, ``developer`` as
    ``system`` (OpenAI's newer name for it)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ClientError(f"messages[{i}]: only text content parts are supported, got {quoted(part.type)}",
                                      param="messages")
            content = "".join(p.text for p in content)
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise ClientError(f"messages[{i}].role must be system, developer, user or assistant, got {m.role!r}",
                              param="messages")
        out.append({"role": role, "content": content or ""})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """A string or a list of token ids; a batch of one of either is unwrapped."""
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if p and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_TOKEN_ID for x in p):
        return p
    raise ClientError("prompt must be a string or a list of token ids, one prompt per request", param="prompt")


def sampling_params(req: _Sampling, num_logprobs: int | None) -> tuple[SamplingParams, bool]:
    """SamplingParams for the request (validated later, naming the field), and whether
    max_tokens was left open (then the rest of the context is the limit)."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
             "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
             "frequency_penalty": req.frequency_penalty, "seed": req.seed, "decoder": req.decoder,
             "num_speculative_tokens": req.num_speculative_tokens, "slo_class": req.slo_class,
             "ttft_ms": req.ttft_ms, "tpot_ms": req.tpot_ms}
    fields = {k: v for k, v in given.items() if v is not None}
    params = SamplingParams(**fields, max_tokens=max_tokens if max_tokens is not None else 1, stop=stop,
                            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                            logprobs=num_logprobs)
    return params, max_tokens is None


# ---- responses -------------------------------------------------------------------------
encode = msgspec.json.Encoder().encode


def json_response(body: dict, status: int = 200, headers: dict | None = None):
    from starlette.responses import Response

    return Response(encode(body), status, headers, media_type="application/json")


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape; ``kind`` is its ``type`` (invalid_request_error, server_error, ...)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(reason: str) -> str:
    """OpenAI's words where they exist; ``abort`` (as vLLM says) and ``timeout`` otherwise."""
    return {"stop": "stop", "length": "length", "aborted": "abort"}.get(reason, reason)


def token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token as OpenAI spells it in logprobs: its text, or ``bytes:\\xe6\\x9d`` where its
    bytes are part of a UTF-8 character (so distinct tokens never share a spelling), and the
    bytes themselves."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode(), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_logprobs(tokenizer, entries) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text, raw = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                        for e in entries]}


def completion_logprobs(tokenizer, entries, offset: int, text_len: int) -> dict:
    """The legacy shape. ``text_offset`` counts characters of the returned text: the
    tokens of one piece of ``text_len`` characters starting at ``offset`` advance by the
    characters their bytes complete, never past the piece's end."""
    tokens, offsets, pending, done = [], [], b"", 0
    for e in entries:
        text, raw = token_text(tokenizer, e.token_id)
        tokens.append(text)
        offsets.append(offset + min(done, text_len))
        pending += raw
        try:  # a character counts once its last byte has come
            done += len(pending.decode())
            pending = b""
        except UnicodeDecodeError:
            pass
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(tokenizer, t.token_id)[0]: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}
