"""Structured outputs through `tokenloom serve` (the engine core in its own process) and the
official openai client: response_format json_object / json_schema (client.chat.completions.parse
with a pydantic model), guided_regex / guided_choice / guided_grammar in extra_body, and 400s
naming the parameter for a schema keyword that would be ignored, a regex that does not
compile, or two constraints at once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("xgrammar")

CLI = [sys.executable, "-m", "tokenloom.cli.main"]
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from conftest import make_tiny_llama

    model_dir = tmp_path_factory.mktemp("tiny-structured")
    make_tiny_llama(model_dir)
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model_dir), "--dtype", "float32",
                             "--num-kv-blocks", "128", "--port", "0", "--openai-port", "0", "--shutdown-deadline", "0.2",
                             "--set", "frontends.openai.served_model_name=\"tiny\""],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TOKENLOOM_LOG_FORMAT": "json"})
    url = None
    for line in proc.stderr:
        if m := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line):
            url = m.group(1)
            break
    assert url, "server did not start"
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    proc.terminate()
    proc.wait(timeout=30)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10_000_000)


class Answer(pydantic.BaseModel):
    cities: list[City] = pydantic.Field(max_length=3)
    capital: City


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_parse_with_a_pydantic_model(client, seed):
    temperature = 0 if seed is None else 1.0
    out = client.chat.completions.parse(model="tiny", messages=HI, response_format=Answer, max_tokens=300,
                                        temperature=temperature, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Answer)


def test_json_object(client):
    out = client.chat.completions.create(model="tiny", messages=HI, response_format={"type": "json_object"},
                                         max_tokens=64, temperature=0)
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].message.content)


def test_guided_extensions(client):
    out = client.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0.7, seed=3,
                                         extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].message.content)
    out = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=16, temperature=1.0, n=3,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in out.choices)
    out = client.completions.create(model="tiny", prompt="Say:", max_tokens=16, temperature=0,
                                    extra_body={"guided_grammar": 'root ::= "a" | "b" "c"'})
    assert out.choices[0].text in ("a", "bc")
    stream = client.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"guided_regex": r"[xyz]{5}"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[xyz]{5}", text)


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}}}},
     "response_format", ["'not'"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["xml"]),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex", ["parenthesis"]),
    ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar", ["missing"]),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     ["only one"]),
])
def test_refusals_name_the_parameter(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, **kwargs)
    err = info.value.body
    assert err["param"] == param
    for w in words:
        assert w in err["message"]
