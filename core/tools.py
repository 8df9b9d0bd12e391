"""Tool calling: a request's ``tools`` and ``tool_choice``, the prompt that shows the tools
to the model, and the parse of its answer into calls, whole or streamed.

The model writes calls in its family's own text format; a tool parser (the ``tool_parser``
role, ``register_tool_parsers``, core/interfaces.py ``ToolParser``) reads that format.
Everything here is the same for every parser:

- the prompt: a chat template that reads ``tools`` (and renders ``tool_calls`` and ``tool``
  messages) gets them as Hugging Face's ``apply_chat_template`` passes them. A template
  that does not (SmolLM2's) would silently drop them, so the parser's own
  ``system_prompt`` describes the tools in the system message, and history is rendered in
  the parser's format (:func:`chat_messages`);
- ``tool_choice``: ``none`` (the tools are shown, the answer is text), ``auto`` (the answer
  is parsed: calls where the model wrote them, text otherwise), ``required`` (at least one
  call, ``parallel_tool_calls`` decides whether more may follow) and a named function
  (exactly one call to it). The last two are constrained by a grammar
  (:meth:`ToolParser.constraint`), so their answer always parses;
- the answer: :class:`ToolStream` turns the growing text into OpenAI's deltas, a call at a
  time once the parser has read it whole; the whole answer is the same stream fed at once,
  so a streamed answer and a whole one cannot differ.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.core import contracts
from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import MAX_TAGGED, Constraint, check_schema

if TYPE_CHECKING:
    from tokenloom.core.interfaces import ToolParser
    from tokenloom.core.plugins import PluginManager

MAX_TOOLS = 128
MAX_TOOL_NAME = 64


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolScan(msgspec.Struct, frozen=True):
    """What a parser has read of an answer so far: the text that is surely content, and
    the calls read whole. A later scan of a longer text extends both (content by
    appending, calls by adding), which is what lets the stream equal the whole answer."""

    content: str
    calls: list[ToolCall] = msgspec.field(default_factory=list)


class ToolRequest(msgspec.Struct, frozen=True):
    """A request's tools (OpenAI's ``{"type": "function", "function": {...}}`` entries, as
    given), its ``tool_choice`` (``none``, ``auto``, ``required`` or a function name) and
    whether several calls may come at once."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls (every choice but ``none``)."""
        return self.choice != "none"

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """Validate OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None without
    tools (a ``tool_choice`` other than ``none``/``auto`` then is an error naming it)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ClientError("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise ClientError.bad_value("tools", len(tools), f"at most {MAX_TOOLS} tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ClientError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME or \
                not all(c.isalnum() or c in "_-." for c in name):
            raise ClientError.bad_value("tools", name, f"tools[{i}].function.name: 1 to {MAX_TOOL_NAME} letters, "
                                        "digits, '_', '-' or '.'")
        if name in names:
            raise ClientError(f"tools[{i}]: function {name!r} is listed twice", param="tools", value=name)
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ClientError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    choice, named = "auto", None
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function" and \
            isinstance(tool_choice.get("function"), dict):
        choice, named = "named", tool_choice["function"].get("name")
        if named not in names:
            raise ClientError.bad_value("tool_choice", named, f"the name of one of the tools: {sorted(names)}")
    else:
        raise ClientError.bad_value("tool_choice", tool_choice,
                                    "none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ClientError.bad_value("parallel_tool_calls", parallel_tool_calls, "a boolean")
    req = ToolRequest(tools=[{"type": "function", "function": t["function"]} for t in tools], choice=choice,
                      named=named, parallel=parallel_tool_calls is not False)
    if choice in ("required", "named"):  # their schemas are compiled: refuse what would be ignored
        for fn in req.functions():
            if choice == "required" or fn["name"] == named:
                check_schema(fn.get("parameters", {}), "tools")
    return req


def build_parser(pm: PluginManager, name: str, chat_template: str | None) -> ToolParser:
    """The engine's tool parser: ``name`` (``engine.tool_call_parser``), or for ``auto`` the one
    the chat template's call markers point to (``hermes`` when it has none)."""
    if name == "auto":
        name = pick(chat_template)
    return contracts.build(pm.get("tool_parser", name), None)


def pick(chat_template: str | None) -> str:
    """The built-in parser ``engine.tool_call_parser = "auto"`` picks for a chat template: the
    one whose call marker the template writes (``hermes`` when it writes none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template:
        return "llama3_json"
    return "hermes"


def constraint(req: ToolRequest, parser: ToolParser) -> Constraint | None:
    """The grammar that ``required`` and a named ``tool_choice`` decode under (None for
    ``auto`` and ``none``): the parser's call format around a JSON object naming one of the
    allowed functions with arguments valid under its ``parameters``."""
    if req.choice not in ("required", "named"):
        return None
    fns = [f for f in req.functions() if req.choice == "required" or f["name"] == req.named]
    key = parser.arguments_key
    alternatives = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      key: f.get("parameters") or {"type": "object"}},
                     "required": ["name", key], "additionalProperties": False} for f in fns]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    most = MAX_TAGGED if req.parallel and req.choice == "required" else 1
    c = parser.constraint(schema, min_calls=1, max_calls=most)
    return msgspec.structs.replace(c, param="tool_choice")


# ---- the prompt ---------------------------------------------------------------------------
def template_reads_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` variable itself (and with it, as every
    such template does, assistant ``tool_calls`` and ``tool`` messages)."""
    return chat_template is not None and "tools" in chat_template


def chat_messages(messages: list[dict], req: ToolRequest | None, parser: ToolParser,
                  native: bool) -> list[dict]:
    """Messages for the template. ``native`` (the template reads tools): assistant
    ``tool_calls`` get their arguments as objects (as Hugging Face templates expect them).
    Otherwise the tools are described in the system message by the parser, calls in
    history are written in the parser's format and ``tool`` results become the user turns
    the parser's family reads them in."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if native:
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                             "arguments": _as_object(c["function"]["arguments"])}}
                                         for c in calls]}
            out.append(m)
            continue
        if calls:
            text = parser.render_calls([ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m["role"] == "tool":
            m = {"role": "user", "content": parser.render_result(m.get("content") or "")}
        out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if req is not None and not native:
        prompt = parser.system_prompt(req.functions())
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt) if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# ---- the answer ---------------------------------------------------------------------------
def arguments_text(value: Any) -> str:
    """Arguments as OpenAI returns them: compact JSON text."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolStream:
    """One choice's answer as OpenAI's message fields: ``feed`` the text as it grows, get
    the new content and the calls read whole since the last feed; ``finish`` reads the
    rest. The concatenated content and the calls are the same however the text was cut."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content = ""  # content handed out so far
        self.calls: list[tuple[str, ToolCall]] = []  # (id, call) handed out so far

    def feed(self, delta: str) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        self.text += delta
        return self._advance(self.parser.scan(self.text, final=False))

    def finish(self) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        return self._advance(self.parser.scan(self.text, final=True))

    def _advance(self, scan: ToolScan) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        if not scan.content.startswith(self.content) or scan.calls[:len(self.calls)] != [c for _, c in self.calls]:
            raise AssertionError(f"tool parser {self.parser.name!r} took back what it had read")
        new_content = scan.content[len(self.content):]
        self.content = scan.content
        new = []
        for call in scan.calls[len(self.calls):]:
            self.calls.append((new_call_id(), call))
            new.append((len(self.calls) - 1, self.calls[-1][0], call))
        return new_content, new
