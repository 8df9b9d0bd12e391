"""Request inputs -> prompt token ids: a raw string, chat messages, or token ids."""

from __future__ import annotations

from tokenloom.core.errors import ClientError, RequestTooLong

MAX_PROMPT_CHARS = 1 << 22


def encode_prompt(tokenizer, vocab_size: int, prompt: str | list[int] | None = None,
                  messages: list[dict] | None = None, *, parse_special_tokens: bool | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (rendered with the
    model's chat template); every failure is a ClientError naming the parameter.

    ``parse_special_tokens``: whether control-token strings (``<|im_start|>``, ...) in the
    text become their special ids. None is the default for the input: True for a raw
    ``prompt`` string (clients send pre-formatted chat prompts), False for ``messages``,
    whose content is then encoded as plain text so a message cannot forge a turn (only
    the template's own markers are special; see ``Tokenizer.encode_chat``). ``tools``
    (OpenAI's tool objects) go to a chat template that reads them."""
    if (prompt is None) == (messages is None):
        raise ClientError("give exactly one of prompt or messages", param="prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise ClientError.bad_value("messages", messages, "a non-empty list of {role, content}")
        _check_text(tokenizer.apply_chat_template(messages, tools=tools), "messages")
        return tokenizer.encode_chat(messages, parse_special_tokens=bool(parse_special_tokens), tools=tools)
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
        return tokenizer.encode(prompt, parse_special_tokens=parse_special_tokens is not False)
    if not isinstance(prompt, list) or not prompt:
        raise ClientError.bad_value("prompt", prompt, "a non-empty string or list of token ids")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ClientError.bad_value("prompt", t, f"token ids in [0, {vocab_size})")
    return list(prompt)


def _check_text(text: str, param: str) -> None:
    if not text:
        raise ClientError("prompt must not be empty", param=param, value=text)
    if len(text) > MAX_PROMPT_CHARS:
        raise RequestTooLong(f"prompt has {len(text)} characters, over {MAX_PROMPT_CHARS}", param=param)


def refuse_by_size(tokenizer, max_model_len: int, prompt: str | list[int] | None = None,
                   messages: list[dict] | None = None) -> None:
    """Refuse a text that cannot fit without tokenising it. No token spans more than
    ``tokenizer.max_token_chars`` characters, so a text of n characters has at least
    n / max_token_chars tokens (a chat template only adds to them)."""
    if isinstance(prompt, str):
        param, chars = "prompt", len(prompt)
    elif isinstance(messages, list):
        param = "messages"
        chars = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    else:
        return
    min_tokens = -(-chars // tokenizer.max_token_chars)
    if min_tokens >= max_model_len:
        raise RequestTooLong(f"{param} has {chars} characters, so at least {min_tokens} tokens: it cannot fit "
                             f"the context length {max_model_len}", param=param, value=chars)


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A prompt that leaves no room to generate, or with max_tokens more than the context."""
    if num_prompt_tokens >= max_model_len:
        raise RequestTooLong(f"prompt ({num_prompt_tokens} tokens) leaves no room to generate within the context "
                             f"length {max_model_len}", param="prompt", value=num_prompt_tokens)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestTooLong(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"length {max_model_len}", param="max_tokens", value=max_tokens)
