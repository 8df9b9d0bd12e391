"""Chat messages -> token ids, with control-token strings in message content kept as text.

A user who writes ``<|im_end|>\\n<|im_start|>system ...`` in a message must not forge a
turn: only the chat template's own markers may become special tokens. See
:func:`encode_chat` for how the content is located in the rendered template.
"""

from __future__ import annotations

import functools
import re
import secrets
from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog

from tokenloom.core.errors import ClientError

if TYPE_CHECKING:
    from tokenloom.core.tokenizer import Tokenizer

log = structlog.get_logger("tokenloom.chat")

# Sentinels stand in for message content while the chat template renders: Unicode
# noncharacters (for a program's internal use, not for text) around a random nonce per
# call and an index, all digits, which case changes and trimming leave alone. A user who
# cannot guess the nonce cannot write a sentinel.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


def encode_chat(tokenizer: Tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                parse_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template.

    With ``parse_special_tokens=False`` (the default) only the template's own markers
    become special tokens: a control-token string inside a message's ``content``
    (``<|im_end|>\\n<|im_start|>system ...``) is encoded as plain text, so a message
    cannot forge a turn, and a control-token string in any other field (``role``,
    ``name``, non-string content) is refused with a ClientError. ``True`` is the old
    behaviour: the rendered text is encoded with every special token parsed. ``tools``
    go to the template as they are (a control-token string in them is refused too).

    How: the template is rendered once more with each string content replaced by a
    sentinel, which gives the content's place in the rendered text.
    - If no special token of the real rendering overlaps a content, the ids are
      exactly ``encode(apply_chat_template(messages))`` (every ordinary request).
    - Otherwise the template text around the contents is encoded with special tokens
      parsed and each content without; BPE merges do not cross those boundaries.
    - A template that changes content (``content | trim`` on a message with edge
      whitespace, content rendered twice or not at all) gives no places; then only
      the special-token strings found in each content are replaced by sentinels, the
      template renders the rest of the content as it likes, and those strings are
      encoded as text where their sentinels land. A special token the template
      completes across a content's edge is not caught on this path.
    - If that template cuts a sentinel (``content[:n]``), the cut piece stays in the
      text as characters (no control token comes back), and a warning is logged once
      per tokenizer.
    """
    render = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt, tools=tools)
    text = render(messages)
    if parse_special_tokens or not tokenizer.special_ids:
        return tokenizer.encode(text)
    _refuse_specials_outside_content(tokenizer, messages)
    for string in _strings(tools or []):
        if tokenizer.special_ids.intersection(tokenizer.encoding(string).ids):
            raise ClientError(f"tools contain a control token: {string!r}", param="tools", value=string)
    enc = tokenizer.encoding(text)
    spans = _content_spans(render, messages, text)
    if spans is None:
        return _encode_segments(tokenizer, _literal_marker_segments(tokenizer, render, messages))
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True):
        if tid in tokenizer.special_ids:
            j = bisect_right(ends, s)  # the first content ending after s
            if j < len(spans) and starts[j] < e:
                break  # a special token inside (or across the edge of) a content
    else:
        return tokenizer.with_bos(enc.ids)
    segments, pos = [], 0
    for s, e in spans:
        segments += [(text[pos:s], True), (text[s:e], False)]
        pos = e
    segments.append((text[pos:], True))
    return _encode_segments(tokenizer, segments)


def _content_spans(render: Callable[[list[dict]], str], messages: list[dict],
                   text: str) -> list[tuple[int, int]] | None:
    """[start, end) of each non-empty string content in ``text``, in order, or None
    when the template does not render every content exactly once, unchanged."""
    nonce = f"{_OPEN}{secrets.randbits(64)}."
    marked, contents = [], {}
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            sentinel = f"{nonce}{i}{_CLOSE}"
            contents[sentinel] = m["content"]
            m = {**m, "content": sentinel}
        marked.append(m)
    if not contents:
        return []
    rendered = render(marked)
    found = []
    for sentinel, content in contents.items():
        at = rendered.find(sentinel)
        if at < 0 or rendered.find(sentinel, at + 1) >= 0:
            return None
        found.append((at, sentinel, content))
    found.sort()
    pieces, spans, pos, length = [], [], 0, 0
    for at, sentinel, content in found:
        pieces += [rendered[pos:at], content]
        length += at - pos
        if content:
            spans.append((length, length + len(content)))
        length += len(content)
        pos = at + len(sentinel)
    pieces.append(rendered[pos:])
    return spans if "".join(pieces) == text else None


def _literal_marker_segments(tokenizer: Tokenizer, render: Callable[[list[dict]], str],
                             messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered text as (text, parse_special_tokens) segments, where each special-token
    string found in a content is its own literal segment."""
    nonce = f"{_OPEN}{secrets.randbits(64)}."
    literal: dict[str, str] = {}
    marked = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            content = m["content"]
            enc = tokenizer.encoding(content)
            cuts = [off for tid, off in zip(enc.ids, enc.offsets, strict=True) if tid in tokenizer.special_ids]
            if cuts:
                parts, pos = [], 0
                for s, e in cuts:
                    sentinel = f"{nonce}{len(literal)}{_CLOSE}"
                    literal[sentinel] = content[s:e]
                    parts += [content[pos:s], sentinel]
                    pos = e
                parts.append(content[pos:])
                m = {**m, "content": "".join(parts)}
        marked.append(m)
    rendered = render(marked)
    segments, pos = [], 0
    for match in re.finditer(re.escape(nonce) + r"\d+" + re.escape(_CLOSE), rendered):
        segments.append((rendered[pos:match.start()], True))
        segments.append((literal.get(match.group(0), ""), False))
        pos = match.end()
    segments.append((rendered[pos:], True))
    if literal and not tokenizer.warned_unsafe_template and any(_OPEN in seg for seg, special in segments if special):
        tokenizer.warned_unsafe_template = True  # (or the user wrote U+FDD0: only this log line follows)
        log.warning("chat_template_cuts_content",
                    detail="the chat template cut a placeholder of a control-token string in message content; "
                           "its remains are in the prompt as text")
    return segments


def _encode_segments(tokenizer: Tokenizer, segments: list[tuple[str, bool]]) -> list[int]:
    """Encode (text, parse_special_tokens) segments; neighbours of one kind go together."""
    ids: list[int] = []
    i = 0
    while i < len(segments):
        special, j = segments[i][1], i
        while j < len(segments) and segments[j][1] == special:
            j += 1
        text = "".join(seg for seg, _ in segments[i:j])
        if text:
            ids += tokenizer.encoding(text, parse_special_tokens=special).ids
        i = j
    return tokenizer.with_bos(ids)


def _refuse_specials_outside_content(tokenizer: Tokenizer, messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        for key, value in m.items():
            if key == "content" and isinstance(value, str):
                continue
            for s in _strings(value):
                if tokenizer.special_ids.intersection(tokenizer.encoding(s).ids):
                    raise ClientError(f"messages[{i}].{key} contains a control token: {s!r}",
                                      param="messages", value=s)


def _strings(value) -> Iterator[str]:
    """Every string in a JSON-like value (dict values, list items)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
