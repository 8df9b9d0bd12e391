"""Request inputs -> prompt token ids: a raw string, chat messages, or token ids."""

from __future__ import annotations

from tokenloom.core.errors import ClientError, RequestTooLong

MAX_PROMPT_CHARS = 1 << 22


def encode_prompt(tokenizer, vocab_size: int, prompt: str | list[int] | None = None,
                  messages: list[dict] | None = None) -> list[int]:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (rendered with the
    model's chat template); every failure is a ClientError naming the parameter."""
    if (prompt is None) == (messages is None):
        raise ClientError("give exactly one of prompt or messages", param="prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise ClientError.bad_value("messages", messages, "a non-empty list of {role, content}")
        prompt = tokenizer.apply_chat_template(messages)
    if isinstance(prompt, str):
        if not prompt:
            raise ClientError("prompt must not be empty", param="prompt", value=prompt)
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestTooLong(f"prompt has {len(prompt)} characters, over {MAX_PROMPT_CHARS}", param="prompt")
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise ClientError.bad_value("prompt", prompt, "a non-empty string or list of token ids")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ClientError.bad_value("prompt", t, f"token ids in [0, {vocab_size})")
    return list(prompt)
