"""The ``llguidance`` grammar backend (plugins/grammars/llguidance_backend.py): every
constraint kind compiles and constrains real generation of the tiny model (greedy and
sampled, standard and n-gram decoder), JSON is compact and strict as under xgrammar, bad
constraints are refused naming the parameter, a refused token changes nothing, rollback
(speculative verification) restores the state, the ``required`` tool-call grammars take
their format and nothing else, UTF-8 surrogates are refused."""

from __future__ import annotations

import json
import re
import sys

import msgspec
import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import Constraint
from tokenloom.core.tools import ToolCall, tool_request
from tokenloom.core.tools import constraint as tool_constraint
from tokenloom.plugins.tool_parsers import PARSERS

from conftest import EOS_ID, TINY_VOCAB, tiny_engine_kwargs

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tokenloom.plugins.grammars.llguidance_backend import LLGuidanceBackend  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"]},  # closed by strictness, not by the schema
    },
    "required": ["name", "age", "tags", "address"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
SAMPLED = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in range(3)]
WIDE = TINY_VOCAB + 40  # logits wider than the tokenizer, as the factory may be given


@pytest.fixture(scope="module")
def llm(tiny_model_dir, one_thread_module):
    with LLM(**tiny_engine_kwargs(tiny_model_dir, grammar_backend="llguidance")) as made:
        assert made.engine.grammar.name == "llguidance"
        yield made


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from tokenloom.core.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(tiny_model_dir, json.loads((tiny_model_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def backend(tok):
    return LLGuidanceBackend(None, tok, WIDE)


def _params(kind, value=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(constraint=Constraint(kind=kind, value=value, param="test"), **kw)


def _blocks_back(engine) -> None:
    assert engine.num_unfinished == 0
    assert engine.cache.stats().num_used_blocks == 0
    engine.cache.check_integrity()


def _allowed(matcher, width: int = WIDE) -> set[int]:
    bitmask = torch.zeros((1, (width + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return {i for i, b in enumerate(bits.flatten().tolist()) if b}


def _takes(backend, tok, kind, value, text: str) -> bool:
    """Whether the grammar takes exactly ``text`` and then the stop token."""
    m = backend.matcher(backend.compile(Constraint(kind=kind, value=value)))
    return all(m.accept_token(t) for t in tok.encode(text, add_bos=False)) and m.accept_token(EOS_ID) \
        and m.is_terminated()


# ---- generation under every kind ------------------------------------------------------------
@pytest.mark.parametrize("how", SAMPLED)
def test_every_kind_constrains_generation(llm, how):
    tagged = {"schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["n"]}, "begin": "<v>", "end": "</v>", "separator": "\n", "min": 2, "max": 3}
    lark = 'start: "(" DIGIT ("+" DIGIT)* ")"\nDIGIT: /[0-9]/'
    ebnf = 'root ::= "[" digit ("," digit)* "]"\ndigit ::= [0-9]'
    prompts = ["Describe a person:", "JSON:", "Phone:", "Pick:", "Sum:", "List:", "Values:"]
    params = [_params("json_schema", SCHEMA, **how), _params("json", **how), _params("regex", r"\d{3}-\d{4}", **how),
              _params("choice", ["yes", "no", "don't know"], **how), _params("grammar", lark, max_tokens=40, **how),
              _params("grammar", ebnf, max_tokens=40, **how), _params("tagged_json", tagged, **how)]
    doc, anything, phone, choice, summed, listed, values = llm.generate(prompts, params)
    assert doc.finish_reason == "stop", doc.text
    jsonschema.validate(json.loads(doc.text), {**SCHEMA, "additionalProperties": False})
    assert set(json.loads(doc.text)["address"]) == {"city"}  # strict: no property the schema does not list
    assert "\n" not in doc.text and ": " in doc.text  # one line, xgrammar's separators
    if anything.finish_reason == "stop":  # (a random model may still be inside a long value at max_tokens)
        json.loads(anything.text)
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    assert choice.text in ("yes", "no", "don't know") and choice.finish_reason == "stop"
    for out, whole, cut in ((summed, r"\(\d(\+\d)*\)", r"\((\d(\+\d)*\+?)?"),
                            (listed, r"\[\d(,\d)*\]", r"\[(\d(,\d)*,?)?")):
        assert out.finish_reason in ("stop", "length")
        assert re.fullmatch(whole if out.finish_reason == "stop" else cut, out.text), out.text
    assert values.finish_reason == "stop", values.text
    found = re.findall(r"<v>(.*?)</v>", values.text)
    assert 2 <= len(found) <= 3 and "\n".join(f"<v>{v}</v>" for v in found) == values.text
    assert all(0 <= json.loads(v)["n"] <= 9 and set(json.loads(v)) == {"n"} for v in found)
    _blocks_back(llm.engine)


def test_n_samples_and_the_ngram_decoder_stay_exact(llm):
    """Drafts are verified against the masked target (the matcher advanced through them and
    rolled back): greedy output equals plain decoding, every sampled output matches."""
    prompts = ["abcabcabcabcabcabcabc", "abab abab abab abab"]
    for regex in (r"(abc|ab ){2,12}", r"[a-c ]{30}"):
        std = _params("regex", regex, temperature=0, decoder="standard", max_tokens=60)
        ngram = msgspec.structs.replace(std, decoder="ngram")
        a, b = llm.generate(prompts, std), llm.generate(prompts, ngram)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for o in a:
            assert re.fullmatch(regex, o.text), o.text
        for seed in range(2):
            for o in llm.generate(prompts, msgspec.structs.replace(ngram, temperature=1.0, seed=seed, n=2)):
                assert re.fullmatch(regex, o.text), o.text
    assert llm.engine.stats().get("decoder_ngram_drafted", 0) > 0
    _blocks_back(llm.engine)


@pytest.mark.parametrize("constraint, words", [
    (Constraint(kind="regex", value="(", param="guided_regex"), ["guided_regex", "unclosed group"]),
    (Constraint(kind="regex", value="a(?=b)", param="guided_regex"), ["guided_regex", "look-around"]),
    (Constraint(kind="grammar", value="start: foo", param="guided_grammar"), ["guided_grammar", "foo"]),
    (Constraint(kind="grammar", value="root ::= foo", param="guided_grammar"), ["guided_grammar", "foo"]),
    (Constraint(kind="json_schema", value={"type": "strin"}, param="response_format"), ["response_format", "strin"]),
    (Constraint(kind="json_schema", value={"type": "object", "unevaluatedProperties": False},
                param="response_format"), ["response_format", "unevaluatedProperties"]),
    (Constraint(kind="json_schema", value={"type": "object", "not": {"type": "null"}}, param="response_format"),
     ["response_format", "'not'"]),
    (Constraint(kind="tagged_json", value={"schema": {"type": "strin"}}, param="tool_choice"), ["tool_choice"]),
])
def test_bad_constraints_are_refused_naming_the_parameter(llm, constraint, words):
    with pytest.raises(ClientError) as info:
        llm.generate("x", SamplingParams(constraint=constraint, max_tokens=4))
    assert info.value.param == constraint.param
    for w in words:
        assert w in str(info.value)
    _blocks_back(llm.engine)


def test_a_missing_package_is_a_client_error_naming_it(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(ClientError) as info:
        LLGuidanceBackend(None, tok, WIDE).compile(Constraint(kind="json", param="response_format"))
    assert info.value.param == "response_format" and "llguidance" in str(info.value)


# ---- JSON: compact and strict, as under xgrammar ------------------------------------------------
@pytest.mark.parametrize("schema, text, ok", [
    ({}, '{"a": [1, 2], "b": null}', True),
    ({}, '{"a":1}', False),  # xgrammar's separators: ", " and ": "
    ({}, '{ "a": 1}', False),
    ({}, '"a\\u0001"', True),
    ({}, '"a\x01"', False),  # a raw control character
    ({}, '"a\tb"', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),  # strict
    ({"type": "object"}, '{"x": {"y": 1}}', True),  # no properties listed: open, as in xgrammar
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a": 1, "b": "x"}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a": 1, "b": 2}', False),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"z": {"type": "integer"}}}}},
     '{"a": {"z": 1, "q": 2}}', False),  # nested objects are closed too
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", True),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]", False),
    ({"type": "array"}, "[1, 2]", True),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}', True),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "integer"}]},
     '{"b": 1}', False),
    ({"type": "string", "maxLength": 2}, '"ab"', True),
    ({"type": "string", "maxLength": 2}, '"abc"', False),
    ({"type": "string", "pattern": "^\\d+$"}, '"12"', True),
    ({"type": "string", "pattern": "^\\d+$"}, '"1a"', False),
])
def test_json_schema_is_compact_and_strict(backend, tok, schema, text, ok):
    kind, value = ("json", None) if schema == {} else ("json_schema", schema)
    assert _takes(backend, tok, kind, value, text) is ok


def test_regex_classes_are_ascii_as_in_xgrammar(backend, tok):
    assert _takes(backend, tok, "regex", r"\d+\w", "12_")
    assert not _takes(backend, tok, "regex", r"\d", "\u0661")  # ARABIC-INDIC DIGIT ONE
    assert not _takes(backend, tok, "regex", r"\w", "é")
    assert _takes(backend, tok, "regex", r"a/b\s", "a/b\u00a0")  # '/' needs no escape; \s is Unicode
    assert _takes(backend, tok, "choice", ["x", 'say "hi"\n'], 'say "hi"\n')
    assert not _takes(backend, tok, "choice", ["x", "y"], "xy")


def test_a_quoted_special_token_is_text(backend, tok):
    """A literal spells its characters; the special token itself is never text."""
    im_end = tok.encode("<|im_end|>", add_bos=False)
    assert len(im_end) == 1
    m = backend.matcher(backend.compile(Constraint(kind="grammar", value='start: "<|im_end|>"')))
    assert not m.accept_token(im_end[0])
    assert all(m.accept_token(t) for t in tok.encode("<|im_end|>", add_bos=False, parse_special_tokens=False))


# ---- the matcher -------------------------------------------------------------------------------
def test_matcher_mask_refusals_rollback_and_termination(backend, tok):
    digits = {tok.encode(str(d), add_bos=False)[0] for d in range(10)}
    m = backend.matcher(backend.compile(Constraint(kind="regex", value=r"\d{3}")))
    assert _allowed(m) == digits  # the engine's layout; ids past the tokenizer's never allowed
    wider = torch.full((1, (WIDE + 31) // 32 + 2), -1, dtype=torch.int32)
    m.fill_bitmask(wider)
    assert wider[0, -2:].tolist() == [0, 0]  # a wider row: the words past the vocabulary cleared
    # a refused token (text, a stop token too early, an id past the tokenizer) changes nothing
    for bad in (tok.encode("x", add_bos=False)[0], EOS_ID, TINY_VOCAB + 5):
        assert not m.accept_token(bad)
        assert _allowed(m) == digits and not m.is_terminated()
    one, two, three = (tok.encode(c, add_bos=False)[0] for c in "123")
    assert m.accept_token(one) and m.accept_token(two)
    assert m.accept_token(three) and _allowed(m) == {EOS_ID} and not m.is_terminated()
    assert m.accept_token(EOS_ID) and m.is_terminated() and _allowed(m) == {EOS_ID}
    assert not m.accept_token(EOS_ID) and not m.accept_token(one)  # nothing after the stop token
    # rolling back the stop token taken where nothing else could follow: back after "123"
    m.rollback(1)
    assert not m.is_terminated() and _allowed(m) == {EOS_ID}
    m.rollback(2)
    assert _allowed(m) == digits
    assert m.accept_token(two) and m.accept_token(three) and m.accept_token(EOS_ID) and m.is_terminated()
    m.rollback(4)  # back to the start, through every kind of step
    assert _allowed(m) == digits and not m.is_terminated()
    # a stop token taken while more could follow is its own step
    m = backend.matcher(backend.compile(Constraint(kind="regex", value=r"\d+")))
    assert m.accept_token(one) and _allowed(m) == digits | {EOS_ID}
    assert m.accept_token(EOS_ID) and m.is_terminated()
    m.rollback(1)
    assert _allowed(m) == digits | {EOS_ID} and m.accept_token(two)


def test_no_utf8_surrogates(backend, tok):
    """``ED A0 80`` (U+D800) is refused byte by byte; ``ED 9F BF`` (U+D7FF) is taken."""
    byte_id = {tok.token_bytes(i): i for i in range(256)}
    compiled = backend.compile(Constraint(kind="json_schema", value={"type": "string", "maxLength": 2}))
    for surrogate, ok in ((b"\xed\xa0\x80", False), (b"\xed\x9f\xbf", True)):
        m = backend.matcher(compiled)
        assert m.accept_token(byte_id[b'"']) and m.accept_token(byte_id[b"\xed"])
        second = byte_id[surrogate[1:2]]
        assert (second in _allowed(m)) is ok
        assert m.accept_token(second) is ok
        m.rollback(2 if ok else 1)  # back to just after the quote: the lead byte is allowed again
        assert byte_id[b"\xed"] in _allowed(m) and second not in _allowed(m)


# ---- tool calls (tagged_json) ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_call_grammar_takes_the_format_and_nothing_else(name, backend, tok):
    parser = PARSERS[name]()
    compiled = backend.compile(tool_constraint(tool_request([WEATHER, TIME], "required", True), parser))
    good = parser.render_calls([ToolCall("get_time", '{"zone":"UTC"}'),
                                ToolCall("get_weather", '{"city":"Rome","unit":"celsius"}')])

    def takes(text: str) -> bool:
        m = backend.matcher(compiled)
        return all(m.accept_token(t) for t in tok.encode(text, add_bos=False)) and m.accept_token(EOS_ID)

    assert takes(good), good
    assert takes(parser.render_calls([ToolCall("get_time", '{"zone":"UTC"}')]))
    assert not takes(good.replace("Rome", "R" * 30))  # maxLength
    assert not takes(good.replace("get_time", "get_date"))
    assert not takes(good.replace('"celsius"', '"celsius", "extra": 1'))
    named = backend.compile(tool_constraint(tool_request([WEATHER, TIME], {"function": {"name": "get_time"}}, True),
                                            parser))
    m = backend.matcher(named)
    assert not all(m.accept_token(t) for t in tok.encode(good, add_bos=False))  # one call, to get_time only


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_required_tool_calls_parse_from_generation(llm, name):
    parser = PARSERS[name]()
    c = tool_constraint(tool_request([WEATHER, TIME], "required", False), parser)
    outs = llm.generate(["Call a tool:"] * 2, [SamplingParams(constraint=c, max_tokens=300, temperature=1.0, seed=s)
                                               for s in range(2)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        calls = parser.scan(out.text, final=True).calls
        assert len(calls) == 1, out.text
        fn = {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]["function"]
        jsonschema.validate(json.loads(calls[0].arguments), fn["parameters"])
    _blocks_back(llm.engine)
