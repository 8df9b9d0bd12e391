"""Built-in tool-call parsers (the ``tool_parser`` role): the three formats open-weight
models are trained to call functions in.

- ``hermes``: each call a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>`` lines (Qwen 2/2.5/3, Hermes, SmolLM2 and most
  ChatML models); results come back in ``<tool_response>`` blocks;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of such objects (Mistral's v3 format);
- ``llama3_json``: the answer is the call, ``{"name": ..., "parameters": {...}}``,
  several joined by ``;`` (Llama 3.1-3.3's JSON tool calling).

Text before the first call is content; text between and after calls is dropped, as the
other engines drop it. A call that does not parse (bad JSON, no name) ends the reading:
it and everything after it is content.
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.sampling_params import Constraint
from tokenloom.core.tools import ToolCall, ToolScan, arguments_text

_DECODER = json.JSONDecoder()


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _call(obj: Any, key: str) -> ToolCall | None:
    """A decoded call object as a ToolCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], arguments_text(args))


def _object(name: str, key: str, arguments: str) -> str:
    """A call object as the model writes it (``json.dumps``' spacing, which the call grammar
    also uses)."""
    try:
        return json.dumps({"name": name, key: json.loads(arguments)}, ensure_ascii=False)
    except ValueError:  # history the client wrote: kept as it came
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": {arguments}}}'



def _describe(functions: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)


class HermesToolParser:
    name = "hermes"
    arguments_key = "arguments"
    begin, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> ToolScan:
        start = text.find(self.begin)
        if start < 0:
            if final:
                return ToolScan(text)
            return ToolScan(text[:len(text) - _held(text, self.begin)].rstrip())
        head = text[:start].rstrip()
        calls: list[ToolCall] = []
        pos = start
        while pos >= 0:
            body_at = pos + len(self.begin)
            stop = text.find(self.end, body_at)
            if stop < 0 and not final:
                break  # this call is still being written
            body = text[body_at:stop if stop >= 0 else len(text)].strip()
            try:
                call = _call(json.loads(body), self.arguments_key)
            except ValueError:
                call = None
            if call is None:  # the rest is content
                return ToolScan(text if not calls else head + text[pos:], calls)
            calls.append(call)
            if stop < 0:
                break
            pos = text.find(self.begin, stop + len(self.end))
        return ToolScan(head, calls)

    def constraint(self, call_schema: dict[str, Any], *, min_calls: int, max_calls: int) -> Constraint:
        return Constraint(kind="tagged_json", value={"schema": call_schema, "begin": self.begin + "\n",
                                                     "end": "\n" + self.end, "separator": "\n",
                                                     "min": min_calls, "max": max_calls})

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.begin}\n{_object(c.name, self.arguments_key, c.arguments)}\n{self.end}"
                         for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        return ("You can call functions to help with the user's request. The functions you can call are "
                f"listed, one JSON object per line, between <tools> and </tools>:\n<tools>\n{_describe(functions)}"
                "\n</tools>\n\nTo call a function, answer with a JSON object naming the function and giving "
                "its arguments, between <tool_call> and </tool_call>, one call per block:\n"
                '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
                "The results come back between <tool_response> and </tool_response>.")


class _JsonTailParser:
    """Formats whose calls are JSON after an optional marker, up to the end of the answer."""

    name = ""
    arguments_key = "arguments"
    marker = ""
    at_start = False  # the marker (or the JSON) must open the answer

    def _values(self, body: str, final: bool) -> tuple[list[tuple[int, Any]], int | None]:
        """The complete JSON values in ``body`` with where each starts, and where text that
        cannot be a call starts (None: none so far)."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> ToolScan:
        stripped = text.lstrip()
        if self.at_start:
            start = len(text) - len(stripped)
            if self.marker and stripped.startswith(self.marker):
                body_at = start + len(self.marker)
            elif stripped.startswith("{"):
                body_at = start
            elif not final and (not stripped or self.marker.startswith(stripped)):
                return ToolScan("")  # too early to tell
            else:
                return ToolScan(text)
        else:
            start = text.find(self.marker)
            if start < 0:
                return ToolScan(text if final else text[:len(text) - _held(text, self.marker)].rstrip())
            body_at = start + len(self.marker)
        head = text[:start].rstrip()
        values, bad_at = self._values(text[body_at:], final)
        calls: list[ToolCall] = []
        for at, value in values:
            call = _call(value, self.arguments_key)
            if call is None:
                bad_at = at
                break
            calls.append(call)
        if bad_at is not None:  # the rest is content
            return ToolScan(text if not calls else head + text[body_at + bad_at:], calls)
        return ToolScan(head, calls)


class MistralToolParser(_JsonTailParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def _values(self, body: str, final: bool) -> tuple[list[tuple[int, Any]], int | None]:
        at = len(body) - len(body.lstrip())
        try:
            value, _ = _DECODER.raw_decode(body, at)  # (what follows the array is dropped)
        except ValueError:
            return [], (0 if final else None)
        return [(at, v) for v in (value if isinstance(value, list) else [value])], None

    def constraint(self, call_schema: dict[str, Any], *, min_calls: int, max_calls: int) -> Constraint:
        schema = {"type": "array", "items": call_schema, "minItems": min_calls, "maxItems": max_calls}
        return Constraint(kind="tagged_json", value={"schema": schema, "begin": self.marker})

    def render_calls(self, calls: list[ToolCall]) -> str:
        return self.marker + "[" + ", ".join(_object(c.name, self.arguments_key, c.arguments) for c in calls) + "]"

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        return (f"[AVAILABLE_TOOLS]{json.dumps([{'type': 'function', 'function': f} for f in functions])}"
                "[/AVAILABLE_TOOLS] To call functions, answer with [TOOL_CALLS] and a JSON array of "
                '{"name": ..., "arguments": {...}} objects.')


class Llama3JsonToolParser(_JsonTailParser):
    name = "llama3_json"
    arguments_key = "parameters"
    marker = "<|python_tag|>"
    at_start = True

    def _values(self, body: str, final: bool) -> tuple[list[tuple[int, Any]], int | None]:
        values: list[tuple[int, Any]] = []
        pos = 0
        while True:
            at = pos
            while pos < len(body) and body[pos] in " \t\r\n":
                pos += 1
            if pos == len(body):
                return values, None
            if values:  # a call ends with ';' before the next one
                if body[pos] != ";":
                    return values, at
                pos += 1
                while pos < len(body) and body[pos] in " \t\r\n":
                    pos += 1
                if pos == len(body):
                    return values, (at if final else None)
            try:
                value, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                return values, (at if final or body[pos] != "{" else None)
            values.append((at, value))
            pos = end

    def constraint(self, call_schema: dict[str, Any], *, min_calls: int, max_calls: int) -> Constraint:
        return Constraint(kind="tagged_json", value={"schema": call_schema, "separator": "; ",
                                                     "min": min_calls, "max": max_calls})

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(_object(c.name, self.arguments_key, c.arguments) for c in calls)

    def render_result(self, content: str) -> str:
        return content

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        return ("You have access to the functions below. To call one, answer only with a JSON object "
                '{"name": <function name>, "parameters": {<arguments>}}; several calls are joined by "; ".\n\n'
                + _describe(functions))


PARSERS = {p.name: p for p in (HermesToolParser, MistralToolParser, Llama3JsonToolParser)}


@hookimpl
def register_tool_parsers(register):
    descriptions = {"hermes": "<tool_call>{json}</tool_call> blocks (Qwen, Hermes, SmolLM2, ChatML models)",
                    "mistral": "[TOOL_CALLS] and a JSON array (Mistral)",
                    "llama3_json": 'the answer is {"name", "parameters"} JSON (Llama 3.1-3.3)'}
    for name, cls in PARSERS.items():
        register(name, lambda options, _cls=cls: _cls(), description=descriptions[name])
