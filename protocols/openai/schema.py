"""OpenAI request bodies as msgspec Structs, their mapping onto SamplingParams, and the
response shapes (chat.completion, text_completion, their stream chunks, errors).

Fields OpenAI defines that change what is generated and that tokenloom cannot honour
(``suffix``, non-text content parts) are refused
with a 400 naming the field; fields that only describe the caller (``user``, ``metadata``,
``store``, ...) and unknown fields are ignored, as OpenAI's own server and vLLM ignore what
they do not use. ``n`` (up to 128) samples the prompt n times, the prompt prefilled once
(SamplingParams.n); completions' ``best_of`` (n to 128, not streamed) runs best_of samples
and returns the n with the highest cumulative logprob. ``logit_bias`` maps token-id strings
to [-100, 100] (-100 bans the token). Completions' ``echo`` returns the prompt before the
completion and, with ``logprobs``, the prompt tokens' logprobs (the first one's ``None``);
``max_tokens: 0`` is allowed with ``echo`` (scoring a text, as lm-eval's loglikelihood does).
Extensions in vLLM's spirit: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, and tokenloom's ``decoder``, ``num_speculative_tokens`` and the latency
targets ``slo_class``, ``ttft_ms``, ``tpot_ms`` (see SamplingParams).
Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls``
and ``tool`` messages in history) is :mod:`tokenloom.core.tools`.
Log-probabilities: chat's ``top_logprobs`` in [0, 20] as OpenAI bounds it (a value out of
range is refused naming ``top_logprobs``); the completions endpoint's ``logprobs: N`` in
[0, 20] too (OpenAI's legacy endpoint stops at 5). Error messages quote a client's value
cut to 100 characters, with its length.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tokenloom.core import tools
from tokenloom.core.errors import ClientError, quoted
from tokenloom.core.sampling_params import MAX_N, Constraint, SamplingParams
from tokenloom.protocols.websocket.messages import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_TOKEN_ID

Text = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs; tokenloom holds completions' logprobs to it too


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: Text | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    arguments: Text = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    function: FunctionCallIn
    id: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    type: str = "function"


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    content: Text | list[ContentPart] | None = None
    name: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    tool_calls: Annotated[list[ToolCallIn], msgspec.Meta(max_length=128)] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None


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
    # structured outputs, as extensions (vLLM's names); chat also takes OpenAI's response_format
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Any], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Text | Annotated[list[Any], msgspec.Meta(max_length=1 << 17)]  # checked in completion_prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; its ``lora_int_id`` is ignored)."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


def decode_request(body: bytes, kind: type[_Sampling]) -> _Sampling:
    """Parse a body; a ClientError naming the field for bad JSON, types or refused fields."""
    req = decode_body(body, kind)
    _refuse_unsupported(req)
    return req


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a body as ``kind``; a ClientError naming the field for bad JSON or types."""
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise ClientError("JSON nested deeper than this server decodes") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise ClientError(text.splitlines()[0][:300], param=_param_of(text)) from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"the body is not valid JSON: {str(exc)[:200]}") from None


def _param_of(text: str) -> str | None:
    if "`$." in text:
        path = text.split("`$.", 1)[1].split("`", 1)[0]
        return path.split("[", 1)[0].split(".", 1)[0]
    if "field `" in text:
        return text.split("field `", 1)[1].split("`", 1)[0]
    return None


def constraint(req: _Sampling) -> Constraint | None:
    """The request's structured-output constraint: chat's ``response_format`` (``text``,
    ``json_object``, ``json_schema`` with its ``schema``; ``strict`` is accepted, and the
    schema is always enforced), or one of ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``; two at once are refused naming the second."""
    found: list[Constraint] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(Constraint(kind="json", param="response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ClientError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                                  param="response_format")
            if "strict" in spec and not isinstance(spec["strict"], bool | None):
                raise ClientError.bad_value("response_format", spec["strict"], "strict: a boolean")
            found.append(Constraint(kind="json_schema", value=spec.get("schema", {}), param="response_format"))
        elif kind != "text":
            raise ClientError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format", value=kind)
    for name, kind, value in (("guided_json", "json_schema", req.guided_json), ("guided_regex", "regex", req.guided_regex),
                              ("guided_choice", "choice", req.guided_choice),
                              ("guided_grammar", "grammar", req.guided_grammar)):
        if value is not None:
            found.append(Constraint(kind=kind, value=value, param=name))
    if len(found) > 1:
        raise ClientError(f"{found[1].param}: only one structured-output constraint per request "
                          f"(also given: {found[0].param})", param=found[1].param)
    if found:
        found[0].validate()
        return found[0]
    return None


def _refuse_unsupported(req: _Sampling) -> None:
    constraint(req)  # a malformed one, or a JSON-schema keyword that would be ignored: a 400 now
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise ClientError.bad_value("n", req.n, f"in [1, {MAX_N}]")
    if isinstance(req, ChatCompletionRequest):
        tool_request(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ClientError.bad_value("top_logprobs", req.top_logprobs, f"in [0, {MAX_TOP_LOGPROBS}]")
        if req.top_logprobs is not None and not req.logprobs:
            raise ClientError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        n = req.n or 1
        if req.best_of is not None and not n <= req.best_of <= MAX_N:
            raise ClientError.bad_value("best_of", req.best_of, f"in [n, {MAX_N}] (n = {n})")
        if req.best_of is not None and req.best_of > n and req.stream:
            raise ClientError("best_of > n cannot be streamed (the best are known only at the end)", param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise ClientError.bad_value("max_tokens", 0, ">= 1 (0 only with echo: the prompt scored alone)")
        if req.suffix:
            raise ClientError("suffix (insertion) is not supported", param="suffix")


def tool_request(req: ChatCompletionRequest) -> tools.ToolRequest | None:
    return tools.tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them: text parts joined, ``developer`` as
    ``system`` (OpenAI's newer name for it); an assistant's ``tool_calls`` and a ``tool``
    message's ``tool_call_id`` kept in OpenAI's shape (:func:`tokenloom.core.tools.chat_messages`
    writes them for the template)."""
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
        if role not in ("system", "user", "assistant", "tool"):
            raise ClientError(f"messages[{i}].role must be system, developer, user, assistant or tool, "
                              f"got {m.role!r}", param="messages")
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if m.tool_calls:
            if role != "assistant":
                raise ClientError(f"messages[{i}]: only an assistant message has tool_calls", param="messages")
            message["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
        out.append(message)
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


def logit_bias(req: _Sampling) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token-id strings) as SamplingParams takes it (ids)."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise ClientError.bad_value("logit_bias", key, "keyed by token ids (strings of digits)")
        out[int(key)] = value
    return out


def num_samples(req: _Sampling) -> int:
    """The samples the engine runs: ``n``, or completions' ``best_of`` when larger."""
    n = req.n or 1
    best_of = getattr(req, "best_of", None)
    return max(n, best_of or n)


def sampling_params(req: _Sampling, num_logprobs: int | None,
                    tool_constraint: Constraint | None = None) -> tuple[SamplingParams, bool]:
    """SamplingParams for the request (validated later, naming the field), and whether
    max_tokens was left open (then the rest of the context is the limit).
    ``tool_constraint``: the grammar of ``tool_choice`` ``required`` or a named function,
    which no other constraint may join. Ranking
    ``best_of`` samples needs each token's logprob: asked for here (``logprobs=0``) if the
    client did not; echo with logprobs (or with ``max_tokens: 0``) asks for the prompt's."""
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
    n = num_samples(req)
    if n > (req.n or 1) and num_logprobs is None:
        num_logprobs = 0  # best_of ranks by cumulative logprob
    prompt_logprobs = None
    if isinstance(req, CompletionRequest) and req.echo and (req.logprobs is not None or max_tokens == 0):
        prompt_logprobs = req.logprobs or 0
    chosen = constraint(req)
    if tool_constraint is not None:
        if chosen is not None:
            raise ClientError(f"tool_choice {'required' if req.tool_choice == 'required' else 'naming a function'} "
                              f"cannot be combined with {chosen.param}", param="tool_choice")
        chosen = tool_constraint
    params = SamplingParams(**fields, max_tokens=max_tokens if max_tokens is not None else 1, stop=stop,
                            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                            logprobs=num_logprobs, logit_bias=logit_bias(req), n=n, prompt_logprobs=prompt_logprobs,
                            constraint=chosen)
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
    characters their bytes complete, never past the piece's end. An entry whose logprob is
    ``None`` (an echoed prompt's first token) has ``None`` for its top logprobs too."""
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
            "top_logprobs": [None if e.logprob is None else {token_text(tokenizer, t.token_id)[0]: t.logprob
                                                             for t in e.top} for e in entries],
            "text_offset": offsets}


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two pieces of the legacy shape (an echoed prompt's, then the completion's) as one."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


class PromptToken(msgspec.Struct, frozen=True):
    """One echoed prompt token as :func:`completion_logprobs` reads it."""

    token_id: int
    logprob: float | None
    top: list = msgspec.field(default_factory=list)


def prompt_entries(prompt_ids: list[int], scored) -> list[PromptToken]:
    """The prompt's tokens with their logprobs (``Finished.prompt_logprobs``; the first
    ``None``), for :func:`completion_logprobs`."""
    out = [PromptToken(prompt_ids[0], None)]
    out += [PromptToken(e.token_id, e.logprob, e.top) for e in (scored or [None])[1:]]
    return out
