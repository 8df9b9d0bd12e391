"""Tool calling (core/tools.py, the ``tool_parser`` role, plugins/tool_parsers.py).

The parsers: a streamed answer cut anywhere reads the same as the whole one (content and
calls), bad calls become content, never a call. The request side: ``tools`` /
``tool_choice`` validated naming the parameter, the prompt (a template that reads
``tools`` gets them; one that does not gets the parser's system prompt and history in the
parser's format). Through `tokenloom serve` and the official openai client: ``required``
and a named ``tool_choice`` always parse (grammar-constrained), streamed and whole answers
agree over many seeds, a two-turn exchange with a tool result works.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from tokenloom.core.errors import ClientError
from tokenloom.core.tools import ToolCall, ToolStream, chat_messages, pick, tool_request
from tokenloom.plugins.tool_parsers import PARSERS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


def read(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[int, ToolCall]]]:
    """The answer as a client assembles the stream cut at ``cuts``."""
    stream, content, calls, pos = ToolStream(parser), "", [], 0
    for cut in [*cuts, len(text)]:
        more, new = stream.feed(text[pos:cut])
        content, calls, pos = content + more, calls + [(k, c) for k, _, c in new], cut
    more, new = stream.finish()
    return content + more, calls + [(k, c) for k, _, c in new]


HERMES_TEXTS = [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", '{"zone":"CET"}')]),
    ("Plain <b>text</b> and a <tool", "Plain <b>text</b> and a <tool", []),
    ('x <tool_call>\n{"name": 1}\n</tool_call> rest', 'x <tool_call>\n{"name": 1}\n</tool_call> rest', []),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{bad}</tool_call> tail',
     "<tool_call>{bad}</tool_call> tail", [("a", '{"x":1}')]),
    ('<tool_call>\n{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}', "", [("a", '{"x":[1,2]}')]),
]
MISTRAL_TEXTS = [
    ('ok [TOOL_CALLS][{"name": "a", "arguments": {"q": "é"}}, {"name": "b", "arguments": {}}]', "ok",
     [("a", '{"q":"é"}'), ("b", "{}")]),
    ("no calls [TOOL", "no calls [TOOL", []),
    ('[TOOL_CALLS][{"name": "a"', '[TOOL_CALLS][{"name": "a"', []),
]
LLAMA3_TEXTS = [
    ('{"name": "a", "parameters": {"x": 2}}; {"name": "b", "parameters": {}}', "", [("a", '{"x":2}'), ("b", "{}")]),
    ('  {"name": "a", "parameters": {"x": 2}} junk', " junk", [("a", '{"x":2}')]),
    ("Hi there", "Hi there", []),
    ('<|python_tag|>{"name": "a", "parameters": {}}', "", [("a", "{}")]),
    ('{"answer": 3}', '{"answer": 3}', []),
]


@pytest.mark.parametrize("name, text, content, calls", [("hermes", *t) for t in HERMES_TEXTS]
                         + [("mistral", *t) for t in MISTRAL_TEXTS] + [("llama3_json", *t) for t in LLAMA3_TEXTS])
def test_streamed_equals_whole_wherever_the_text_is_cut(name, text, content, calls):
    parser = PARSERS[name]()
    whole = read(parser, text, [])
    assert whole == (content, [(k, ToolCall(n, a)) for k, (n, a) in enumerate(calls)])
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        assert read(parser, text, cuts) == whole, cuts


def test_a_parser_that_takes_back_what_it_read_is_caught():
    class Fickle:
        name, arguments_key = "fickle", "arguments"

        def scan(self, text, final):
            from tokenloom.core.tools import ToolScan
            return ToolScan(text[::-1])

    stream = ToolStream(Fickle())
    stream.feed("ab")
    with pytest.raises(AssertionError, match="fickle"):
        stream.feed("c")


def test_the_parser_is_picked_by_the_chat_template():
    assert pick("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert pick("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert pick("<|python_tag|>") == "llama3_json"
    assert pick(None) == "hermes"


@pytest.mark.parametrize("tools, choice, param, words", [
    ([{"type": "function"}], None, "tools", "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "bad name"),
    ([WEATHER, WEATHER], None, "tools", "twice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
    ([WEATHER], "sometimes", "tool_choice", "sometimes"),
    (None, "required", "tool_choice", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], "required",
     "tools", "'not'"),
])
def test_bad_tools_are_refused_naming_the_parameter(tools, choice, param, words):
    with pytest.raises(ClientError) as info:
        tool_request(tools, choice, None)
    assert info.value.param == param and words in str(info.value)


def test_auto_does_not_compile_the_schemas():
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    assert tool_request([odd], "auto", None).choice == "auto"


def test_history_without_a_tool_template_is_written_in_the_parser_format():
    parser = PARSERS["hermes"]()
    req = tool_request([WEATHER], "auto", None)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "content": "18 degrees", "tool_call_id": "call_1"}]
    out = chat_messages(history, req, parser, native=False)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 degrees\n</tool_response>"}
    # a system message of the client's own keeps its text, the tools follow it
    out = chat_messages([{"role": "system", "content": "Be brief."}, history[0]], req, parser, native=False)
    assert out[0]["content"].startswith("Be brief.\n\n") and len(out) == 2


def test_a_template_that_reads_tools_gets_them(tiny_model_dir):
    from tokenloom.core.inputs import encode_prompt
    from tokenloom.core.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(tiny_model_dir, json.loads((tiny_model_dir / "config.json").read_text()))
    tok.chat_template = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} "
                         "{{ t.function.parameters | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments.city }}"
                         "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    tok._template = None
    req = tool_request([WEATHER], "auto", None)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    messages = chat_messages(history, req, PARSERS["hermes"](), native=True)
    text = tok.decode(encode_prompt(tok, 10**6, messages=messages, tools=req.tools))
    assert "get_weather {" in text and '"maxLength": 20' in text and "call get_weather Oslo" in text
    bad = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>", "parameters": {}}}]
    with pytest.raises(ClientError) as info:
        encode_prompt(tok, 10**6, messages=messages, tools=bad)
    assert info.value.param == "tools"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_call_grammar_takes_the_format_and_nothing_else(name, tiny_model_dir):
    pytest.importorskip("xgrammar")
    from tokenloom.core.tokenizer import Tokenizer
    from tokenloom.core.tools import constraint
    from tokenloom.plugins.grammars.xgrammar_backend import XGrammarBackend

    parser = PARSERS[name]()
    tok = Tokenizer.from_hf_dir(tiny_model_dir, json.loads((tiny_model_dir / "config.json").read_text()))
    backend = XGrammarBackend(None, tok, tok.vocab_size)
    compiled = backend.compile(constraint(tool_request([WEATHER, TIME], "required", True), parser))
    good = parser.render_calls([ToolCall("get_time", '{"zone":"UTC"}'), ToolCall("get_weather",
                                                                                   '{"city":"Rome","unit":"celsius"}')])

    def takes(text: str) -> bool:
        m = backend.matcher(compiled)
        return all(m.accept_token(t) for t in tok.encode(text, add_bos=False)) and \
            m.accept_token(min(tok.eos_token_ids))

    assert takes(good), good
    assert parser.scan(good, final=True).calls == [ToolCall("get_time", '{"zone":"UTC"}'),
                                                   ToolCall("get_weather", '{"city":"Rome","unit":"celsius"}')]
    assert not takes(good.replace("Rome", "R" * 30))  # maxLength
    assert not takes(good.replace("get_time", "get_date"))
    named = backend.compile(constraint(tool_request([WEATHER, TIME], {"function": {"name": "get_time"}}, True),
                                       parser))
    m = backend.matcher(named)
    assert not all(m.accept_token(t) for t in tok.encode(good, add_bos=False))  # one call, to get_time only


# ---- through a served engine and the official client --------------------------------------
openai = pytest.importorskip("openai")
CLI = [sys.executable, "-m", "tokenloom.cli.main"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from conftest import make_tiny_llama, start_serve_process

    model_dir = tmp_path_factory.mktemp("tiny-tools")
    make_tiny_llama(model_dir)
    config = json.loads((model_dir / "config.json").read_text())  # byte tokens: the tools prompt is ~1,000
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    proc, url = start_serve_process("--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "1024",
                                    "--port", "0", "--openai-port", "0", "--shutdown-deadline", "0.2",
                                    "--set", "frontends.openai.served_model_name=\"tiny\"",
                                    url=r"http://127\.0\.0\.1:\d+/v1")
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    proc.terminate()
    proc.wait(timeout=30)


def whole_and_streamed(client, **kw):
    whole = client.chat.completions.create(model="tiny", **kw).choices[0]
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    streamed = (content or None if calls else content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
                reason)
    got = (whole.message.content, [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []],
           whole.finish_reason)
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    return got, streamed


def valid_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 20 and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and set(args) == {"zone"} and len(args["zone"]) <= 12


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_tool_choice_always_parses_and_streams_the_same(client, choice):
    for seed in range(8):
        kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 2500,
              "temperature": 1.0, "seed": seed}
        whole, streamed = whole_and_streamed(client, **kw)
        assert whole == streamed, seed
        content, calls, reason = whole
        assert reason == "tool_calls" and calls and content is None, whole
        for name, arguments in calls:
            valid_call(name, arguments)
        if choice != "required":
            assert [n for n, _ in calls] == ["get_time"]


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=400, temperature=1.0, seed=seed)
        assert len(out.choices[0].message.tool_calls) == 1


def test_auto_streams_the_same_as_whole(client):
    for seed in range(6):
        whole, streamed = whole_and_streamed(client, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=1.0,
                                             seed=seed)
        assert whole == streamed, seed


def test_two_turns_call_result_answer(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_refusals_name_the_parameter(client, extra, param):
    kw = {"tools": [WEATHER], **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kw)
    assert info.value.body["param"] == param


def test_no_utf8_surrogates_in_constrained_strings(tiny_model_dir):
    """xgrammar's UTF-8 takes ``ED A0 80`` (a surrogate) as one character; every decoder
    reads three U+FFFD, past ``maxLength``. The byte pair is banned inside a token and
    across two."""
    pytest.importorskip("xgrammar")
    from tokenloom.core.sampling_params import Constraint
    from tokenloom.core.tokenizer import Tokenizer
    from tokenloom.plugins.grammars.xgrammar_backend import XGrammarBackend

    tok = Tokenizer.from_hf_dir(tiny_model_dir, json.loads((tiny_model_dir / "config.json").read_text()))
    byte_id = {tok.token_bytes(i): i for i in range(256)}
    backend = XGrammarBackend(None, tok, tok.vocab_size)
    compiled = backend.compile(Constraint(kind="json_schema", value={"type": "string", "maxLength": 2}))
    for surrogate, ok in ((b"\xed\xa0\x80", False), (b"\xed\x9f\xbf", True)):  # U+D800 no, U+D7FF yes
        m = backend.matcher(compiled)
        assert m.accept_token(byte_id[b'"']) and m.accept_token(byte_id[b"\xed"])
        bitmask = torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
        m.fill_bitmask(bitmask)
        second = byte_id[surrogate[1:2]]
        assert bool((bitmask[0, second // 32] >> (second % 32)) & 1) is ok
        m.rollback(1)
        m.fill_bitmask(bitmask)  # after the rollback the byte is allowed again as a start
        assert bool((bitmask[0, byte_id[b"\xed"] // 32] >> (byte_id[b"\xed"] % 32)) & 1)


def test_a_drafted_stop_token_gives_no_mask_and_no_crash(tiny_model_dir):
    """A speculative row after a draft that completed the grammar with the stop token is
    never used; asking a terminated xgrammar matcher for its next mask would abort the step."""
    pytest.importorskip("xgrammar")
    from tokenloom.core.grammar import GrammarState
    from tokenloom.core.sampling_params import Constraint
    from tokenloom.core.tokenizer import Tokenizer
    from tokenloom.plugins.grammars.xgrammar_backend import XGrammarBackend

    tok = Tokenizer.from_hf_dir(tiny_model_dir, json.loads((tiny_model_dir / "config.json").read_text()))
    backend = XGrammarBackend(None, tok, tok.vocab_size)
    state = GrammarState(backend.matcher(backend.compile(Constraint(kind="regex", value="ab"))), tok.vocab_size)
    a, b = tok.encode("a", add_bos=False)[0], tok.encode("b", add_bos=False)[0]
    eos = min(tok.eos_token_ids)
    assert state.allowed([a, b, eos]) is None and state.allowed([a, b, eos, a]) is None
    after = state.allowed([a, b])
    assert after is not None and after.nonzero().flatten().tolist() == [eos]
    assert state.allowed([a]).nonzero().flatten().tolist() == [b]  # the matcher was rolled back each time
    # special tokens other than the stop token are never allowed, not even where text is free
    free = GrammarState(backend.matcher(backend.compile(Constraint(kind="regex", value=".{0,4}"))), tok.vocab_size)
    allowed = free.allowed()
    assert all(not allowed[i] for i in tok.special_ids if i not in tok.eos_token_ids) and allowed[eos]


def test_a_grammar_the_vocabulary_cannot_spell_ends_the_request_with_an_error(tmp_path):
    """The kit model's 12 tokens are JSON pieces: a regex of letters has no token to start
    with. The request ends with an error naming the parameter (not a token sampled outside
    the grammar), and its blocks come back."""
    pytest.importorskip("xgrammar")
    from tokenloom import LLM, SamplingParams
    from tokenloom.core.sampling_params import Constraint
    from tokenloom.testing import make_tiny_model

    llm = LLM(model=str(make_tiny_model(tmp_path / "kit")), dtype="float32", num_kv_blocks=32)
    try:
        free = llm.engine.cache.num_free_blocks
        [out] = llm.generate([[0, 1, 2]], SamplingParams(max_tokens=8, constraint=Constraint(
            kind="regex", value="zz", param="guided_regex")))
        assert out.finish_reason == "error" and out.error.startswith("guided_regex: the grammar allows no token")
        assert out.token_ids == [] and llm.engine.cache.num_free_blocks == free
    finally:
        llm.close()
