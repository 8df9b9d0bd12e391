"""Structured outputs (SamplingParams.constraint, the ``grammar`` role, xgrammar): every
sampled token is one the grammar allows, greedy and sampled, under the standard and the
n-gram decoder (exact: a draft the grammar forbids is rejected); a constraint that does not
compile, or a JSON-schema keyword that would be ignored, is refused naming the parameter;
a request waiting for its grammar holds no KV block; every block comes back."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import Constraint

from conftest import tiny_engine_kwargs

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def _valid(doc: object) -> bool:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    if not isinstance(doc, dict) or set(doc) != {"name", "age", "tags", "address"}:
        return False
    return (isinstance(doc["name"], str) and len(doc["name"]) <= 12 and isinstance(doc["age"], int) and 0 <= doc["age"] <= 120
            and isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
            and all(t in ("red", "green", "blue") for t in doc["tags"])
            and isinstance(doc["address"], dict) and set(doc["address"]) == {"city"}
            and isinstance(doc["address"]["city"], str) and len(doc["address"]["city"]) <= 8)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(**tiny_engine_kwargs(tiny_model_dir)) as made:
        yield made


def _blocks_back(engine) -> None:
    assert engine.num_unfinished == 0
    assert engine.cache.stats().num_used_blocks == 0
    engine.cache.check_integrity()


def _params(kind, value=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(constraint=Constraint(kind=kind, value=value, param="test"), **kw)


SAMPLED = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in range(4)]


@pytest.mark.parametrize("how", SAMPLED)
def test_json_schema_output_is_valid(llm, how):
    out = llm.generate("Describe a person:", _params("json_schema", SCHEMA, **how))[0]
    assert out.finish_reason == "stop", out.text
    assert _valid(json.loads(out.text)), out.text  # strict: no raw control characters in strings
    _blocks_back(llm.engine)


@pytest.mark.parametrize("how", SAMPLED[:3])
def test_any_json_parses(llm, how):
    out = llm.generate("JSON:", _params("json", **how))[0]
    if out.finish_reason == "stop":  # (a random model may still be inside a long value at max_tokens)
        json.loads(out.text)
    _blocks_back(llm.engine)


@pytest.mark.parametrize("how", SAMPLED)
def test_regex_and_choice(llm, how):
    regex, choice = llm.generate(["Phone:", "Pick:"], [_params("regex", r"\d{3}-\d{4}", **how),
                                                        _params("choice", ["yes", "no", "don't know"], **how)])
    assert re.fullmatch(r"\d{3}-\d{4}", regex.text) and regex.finish_reason == "stop"
    assert choice.text in ("yes", "no", "don't know") and choice.finish_reason == "stop"


def test_ebnf_grammar_and_n_samples(llm):
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    outs = llm.generate("Sum:", _params("grammar", grammar, temperature=1.0, seed=3, n=3, max_tokens=40))
    assert len(outs) == 3
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert re.fullmatch(r"\(\d(\+\d)*\)", o.text), o.text
    _blocks_back(llm.engine)


def test_ngram_decoder_stays_exact_under_a_grammar(llm):
    """The n-gram proposer knows nothing of the grammar: its drafts are verified against the
    masked target, so greedy output equals plain decoding and every output matches."""
    prompts = ["abcabcabcabcabcabcabc", "abab abab abab abab"]
    for regex in (r"(abc|ab ){2,12}", r"[a-c ]{30}"):
        std = _params("regex", regex, temperature=0, decoder="standard", max_tokens=60)
        ngram = msgspec.structs.replace(std, decoder="ngram")
        a, b = llm.generate(prompts, std), llm.generate(prompts, ngram)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for o in a:
            assert re.fullmatch(regex, o.text), o.text
        for seed in range(3):
            sampled = msgspec.structs.replace(ngram, temperature=1.0, seed=seed)
            for o in llm.generate(prompts, sampled):
                assert re.fullmatch(regex, o.text), o.text
    assert llm.engine.stats().get("decoder_ngram_drafted", 1) > 0
    _blocks_back(llm.engine)


@pytest.mark.parametrize("constraint, words", [
    (Constraint(kind="json_schema", value={"type": "object", "not": {"type": "null"}}, param="response_format"),
     ["'not'", "response_format"]),
    (Constraint(kind="json_schema", value={"type": "object", "properties": {"a": {"uniqueItems": True}}},
                param="response_format"), ["'uniqueItems'", "#/properties/a"]),
    (Constraint(kind="json_schema", value={"type": "strin"}, param="response_format"), ["response_format", "strin"]),
    (Constraint(kind="regex", value="(", param="guided_regex"), ["guided_regex", "parenthesis"]),
    (Constraint(kind="grammar", value="root ::= foo", param="guided_grammar"), ["guided_grammar", "foo"]),
    (Constraint(kind="choice", value=[], param="guided_choice"), ["guided_choice"]),
    (Constraint(kind="xml", param="response_format"), ["response_format"]),
])
def test_bad_constraints_are_refused_naming_the_parameter(llm, constraint, words):
    with pytest.raises(ClientError) as info:
        llm.generate("x", SamplingParams(constraint=constraint, max_tokens=4))
    assert info.value.param == constraint.param
    for w in words:
        assert w in str(info.value)
    _blocks_back(llm.engine)


def test_constraint_from_dict_round_trip():
    p = SamplingParams.from_dict({"constraint": {"kind": "choice", "value": ["a", "b"], "param": "guided_choice"}})
    assert p.constraint == Constraint(kind="choice", value=["a", "b"], param="guided_choice")
    with pytest.raises(ClientError) as info:
        SamplingParams.from_dict({"constraint": {"kind": "json_schema", "value": {"if": {}}}})
    assert info.value.param == "constraint" and "'if'" in str(info.value)


async def test_a_request_waits_for_its_grammar_without_blocks(tiny_model_dir):
    """engine.submit with a grammar not compiled yet: accepted now, queued once compiled (no
    KV block held meanwhile); one that fails to compile ends with an error naming the parameter."""
    engine = AsyncEngine.from_options(**tiny_engine_kwargs(tiny_model_dir))
    try:
        ok = engine.submit("Code:", _params("regex", r"[A-Z]{2}\d{2}", temperature=0))
        assert engine.cache.stats().num_used_blocks == 0 or ok.seq.grammar is not None
        bad = engine.submit("Code:", SamplingParams(constraint=Constraint(kind="regex", value="[", param="guided_regex")))
        texts = {}
        for req in (ok, bad):
            async for item in engine.stream(req):
                texts[req.request_id] = item
        assert re.fullmatch(r"[A-Z]{2}\d{2}", texts[ok.request_id].text)
        fin = texts[bad.request_id]
        assert fin.finish_reason == "error" and "guided_regex" in (fin.error or "")
        # a constraint compiled before: refused at submit, accepted ones queued at once
        with pytest.raises(ClientError):
            engine.submit("Code:", SamplingParams(constraint=Constraint(kind="regex", value="[", param="guided_regex")))
        again = engine.submit("Code:", _params("regex", r"[A-Z]{2}\d{2}", temperature=0))
        assert again.seq.grammar is not None
        async for item in engine.stream(again):
            last = item
        assert last.text == texts[ok.request_id].text
        _blocks_back(engine)
    finally:
        await engine.shutdown()
        engine.close()
