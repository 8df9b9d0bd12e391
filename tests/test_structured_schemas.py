"""Structured outputs over many schemas, end to end: the official openai client's
``client.chat.completions.parse(..., response_format=PydanticModel)`` against a real
``tokenloom serve`` (the tiny random-weight model in its own process).

Every schema below, from a lone boolean to recursive and discriminated models, is asked
greedily (temperature 0) and sampled (temperature 1, seeds 1 and 2), under every decoder a
request can name: ``standard``, ``ngram``, ``speculative`` (the server's own decoder, its
draft a second tiny model made with another seed) and ``medusa`` (random heads written where
the decoder looks for them by default: ``$TOKENLOOM_CACHE/medusa/<model>.safetensors``;
exactness needs no training). Each answer must stop by itself (finish_reason ``stop``),
parse into the model, and its raw text must be valid, under ``jsonschema`` (Draft 2020-12,
formats checked), against the exact schema the client sent, read from the request body on
the wire (a request hook on the client's own HTTP client), which must also equal what the client's own
``type_to_response_format_param`` gives (pydantic's schema after the client's strict
transformation: every property required, ``additionalProperties: false``).

All requests go out at once from a thread pool (the engine batches them), before the
per-case tests read their answers. Random weights decide what gets written, so bounds keep
every output finite: numbers have ranges, strings a maxLength or a pattern, arrays
maxItems, and recursive models end when the model picks ``null`` or ``[]``.

Schema keywords the grammar backend would ignore are refused with a 400 naming them
(``param == "response_format"``), through the client too: keywords it never enforces
(``not``, ``if``, ``uniqueItems``, ``contains``, ...) and ones it drops where they stand
(``maxLength`` beside ``pattern``/``format``, ``multipleOf`` on a float, a second ``allOf``
entry, a constraint beside ``anyOf``).

Left out: ``format: email`` (its local part has no bound, so a random model need not end
it); a binary recursive ``Add(left, right)`` expression (greedy never closes it here).
Three findings of this file are fixed and checked like every case: a stop token drafted by
ngram/speculative/medusa crashed the step (core/grammar.py); special tokens were allowed
inside JSON strings (plugins/grammars/xgrammar_backend.py); xgrammar's ``format: date``
took day 31 of any month (the backends now compile it as ``DATE_PATTERN``, the calendar's
dates only).
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, Optional, Union

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from openai.lib._parsing._completions import type_to_response_format_param  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, StringConstraints  # noqa: E402

CLI = [sys.executable, "-m", "tokenloom.cli.main"]
MESSAGES = [{"role": "user", "content": "Fill in the form."}]
MAX_TOKENS = 600
DECODERS = ("standard", "ngram", "speculative", "medusa")
MODES = {"greedy": (0.0, None), "seed1": (1.0, 1), "seed2": (1.0, 2)}

Digit = Annotated[int, Field(ge=0, le=9)]
Word = Annotated[str, StringConstraints(min_length=1, max_length=5)]


# ---- the schemas, flat to hard ----------------------------------------------------------
class Flag(BaseModel):
    ok: bool


class ShortName(BaseModel):
    name: str = Field(min_length=2, max_length=6)


class Percent(BaseModel):
    value: int = Field(ge=0, le=100)


class NegativeRanges(BaseModel):
    below: int = Field(ge=-50, le=-10)
    between: int = Field(gt=-3, lt=3)


class Celsius(BaseModel):
    celsius: float = Field(ge=-50, le=60)


class Probability(BaseModel):
    p: float = Field(gt=0, lt=1)


class Step(BaseModel):
    n: int = Field(ge=0, le=100, multiple_of=5)


class Color(BaseModel):
    color: Literal["red", "green", "blue"]


class Size(str, enum.Enum):
    small = "S"
    medium = "M"
    large = "L"


class Shirt(BaseModel):  # an Enum class: a $ref into $defs
    size: Size
    sleeves: Literal[0, 1, 2]


class Version(BaseModel):  # one-value Literal: const
    version: Literal["v1"]
    kind: Literal["fixed"] = "fixed"


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")


class Nickname(BaseModel):
    nickname: Optional[str] = Field(default=None, max_length=5)


class Described(BaseModel):  # annotations only: title, description, examples
    model_config = ConfigDict(title="A described thing")
    label: str = Field(max_length=4, title="Label", description="a short label", examples=["ab"])
    rank: int = Field(ge=1, le=3, description="1 is best")


class Day(BaseModel):
    day: datetime.date


class Ident(BaseModel):
    id: uuid.UUID
    at: datetime.datetime


class Point(BaseModel):
    x: int = Field(ge=-10, le=10)
    y: int = Field(ge=-10, le=10)


class Segment(BaseModel):  # one $defs entry used by two fields
    start: Point
    end: Point


class Tags(BaseModel):
    tags: list[Word] = Field(min_length=1, max_length=3)


class Scores(BaseModel):
    scores: list[Digit] = Field(min_length=2, max_length=4)


class ExactPair(BaseModel):
    sizes: list[Size] = Field(min_length=2, max_length=2)


class Pair(BaseModel):  # a tuple: prefixItems
    pair: tuple[Digit, Word]


class Triple(BaseModel):
    triple: tuple[bool, Literal["a", "b"], Optional[Digit]]


class Counts(BaseModel):  # a dict: additionalProperties schema, propertyNames, maxProperties
    counts: dict[Annotated[str, StringConstraints(max_length=3)], Digit] = Field(max_length=2)


class IntOrWord(BaseModel):  # a union: anyOf
    value: Union[Digit, Word]


class MaybeScores(BaseModel):
    scores: Optional[list[Digit]] = Field(default=None, max_length=3)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: Digit


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class AnyPet(BaseModel):  # a union of models: anyOf of $refs
    pet: Union[Cat, Dog]


class Pet(BaseModel):  # a discriminated union: oneOf with a discriminator
    pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]


class Address(BaseModel):
    street: Word
    city: Word
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):  # three levels of nesting
    name: Word
    age: int = Field(ge=0, le=120)
    address: Address
    previous: Optional[Address] = None


class Matrix(BaseModel):
    rows: list[list[Digit]] = Field(max_length=3)


class Places(BaseModel):  # a dict of models
    places: dict[Annotated[str, StringConstraints(max_length=3)], Point] = Field(max_length=2)


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
    qty: int = Field(ge=1, le=9)
    price: float = Field(ge=0, le=1000)


class Order(BaseModel):
    id: str = Field(pattern=r"^ord-[0-9]{4}$")
    status: Literal["new", "paid", "shipped"]
    items: list[LineItem] = Field(min_length=1, max_length=3)
    note: Optional[Word] = None


class Link(BaseModel):  # recursive $ref: a chain that ends where the model picks null
    value: Digit
    next: Optional[Link] = None


class Node(BaseModel):  # recursive $ref through a bounded list: a tree
    value: Digit
    children: list[Node] = Field(max_length=2)


class Lit(BaseModel):
    value: Digit


class Neg(BaseModel):
    neg: Term


Term = Union[Lit, Neg]


class Sum(BaseModel):
    terms: list[Term] = Field(min_length=1, max_length=2)


class Formula(BaseModel):  # mutually recursive models under unions (a binary `Add` never ends greedily here)
    expr: Union[Lit, Sum]


class Everything(BaseModel):  # most of the above in one schema
    code: Code
    shirt: Shirt
    segment: Segment
    pets: list[AnyPet] = Field(max_length=2)
    pair: tuple[Digit, Word]
    order: Optional[Order] = None
    when: datetime.date


Neg.model_rebuild()
Sum.model_rebuild()
Formula.model_rebuild()

SCHEMAS: list[type[BaseModel]] = [
    Flag, ShortName, Percent, NegativeRanges, Celsius, Probability, Step, Color, Shirt, Version, Code, Nickname,
    Described, Day, Ident, Point, Segment, Tags, Scores, ExactPair, Pair, Triple, Counts, IntOrWord, MaybeScores,
    AnyPet, Pet, Person, Matrix, Places, Order, Link, Node, Formula, Everything,
]
NAMES = [m.__name__ for m in SCHEMAS]
assert len(set(NAMES)) == len(NAMES)


# ---- the server ---------------------------------------------------------------------------
def _write_random_medusa_heads(model_dir, cache_dir) -> None:
    """Random Medusa heads where the decoder looks by default for this model (no training:
    verification keeps the output the target's whatever the heads guess)."""
    import torch

    from tokenloom.plugins.decoders.medusa import MedusaHeads

    heads = MedusaHeads(3, 64)  # the tiny model's hidden size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) * 0.3 / 64 ** 0.5)
    for name in {model_dir.name, str(model_dir)}:  # the model's name: whichever the loader reports
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        heads.save(cache_dir / "medusa" / f"{safe}.safetensors", name)


class _Wire:
    """An httpx request hook: the JSON body of every request, by its ``x-case`` header."""

    def __init__(self):
        self.bodies: dict[str, dict] = {}
        self.lock = threading.Lock()

    def __call__(self, request):
        case = request.headers.get("x-case")
        if case:
            with self.lock:
                self.bodies[case] = json.loads(request.content)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import make_tiny_llama

    root = tmp_path_factory.mktemp("structured-schemas")
    target, draft, cache = root / "target", root / "draft", root / "cache"
    target.mkdir()
    draft.mkdir()
    make_tiny_llama(target)
    make_tiny_llama(draft, seed=1)
    _write_random_medusa_heads(target, cache)
    proc = subprocess.Popen([*CLI, "serve", "--model", str(target), "--dtype", "float32", "--num-kv-blocks", "512",
                             "--port", "0", "--openai-port", "0", "--shutdown-deadline", "0.2", "--threads", "1",
                             "--decoder", "speculative", "--set", f"decoder.draft_model={json.dumps(str(draft))}",
                             "--set", 'decoder.draft_quantizer="none"',
                             "--set", "decoder.draft_num_kv_blocks=512",
                             "--set", "frontends.openai.served_model_name=\"tiny\""],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TOKENLOOM_LOG_FORMAT": "json", "TOKENLOOM_CACHE": str(cache)})
    url, log = None, []
    for line in proc.stderr:
        log.append(line)
        if m := re.search(r"(http://127\.0\.0\.1:\d+/v1)", line):
            url = m.group(1)
            break
    assert url, "server did not start:\n" + "".join(log[-20:])
    # the decoders this file asks for must all be there (eagle has no draft for a random model)
    unavailable = [line for line in log if "decoder_unavailable" in line
                   and any(f'"decoder": "{d}"' in line for d in DECODERS)]
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
    wire = _Wire()
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(event_hooks={"request": [wire]}, timeout=120))
    yield client, wire, unavailable
    client.close()
    proc.terminate()
    proc.wait(timeout=30)


def _ask(client, model: type[BaseModel], decoder: str, mode: str):
    temperature, seed = MODES[mode]
    try:
        return client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=model, max_tokens=MAX_TOKENS,
            temperature=temperature, seed=seed, extra_body={"decoder": decoder},
            extra_headers={"x-case": f"{model.__name__}/{decoder}/{mode}"})
    except Exception as exc:  # noqa: BLE001 - the case's test reports it
        return exc


@pytest.fixture(scope="module")
def answers(server):
    """Every (schema, decoder, mode) asked at once: {case: ParsedChatCompletion or exception}."""
    client, _, unavailable = server
    assert not unavailable, unavailable
    answers = {}
    for d in DECODERS:  # one decoder at a time: a step that fails fails only its own decoder's cases
        cases = [(m, d, mode) for m in SCHEMAS for mode in MODES]
        with ThreadPoolExecutor(max_workers=32) as pool:
            results = list(pool.map(lambda c: _ask(client, *c), cases))
        answers.update({f"{m.__name__}/{d}/{mode}": r for (m, d, mode), r in zip(cases, results, strict=True)})
    return answers


def _validator(schema: dict) -> Any:
    cls = jsonschema.Draft202012Validator
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_the_client_sends_its_strict_pydantic_schema(server, answers):
    _, wire, _ = server
    for model in SCHEMAS:
        want = type_to_response_format_param(model)
        for d in DECODERS:
            for mode in MODES:
                body = wire.bodies[f"{model.__name__}/{d}/{mode}"]
                assert body["response_format"] == want, model.__name__
                assert body["decoder"] == d and body["temperature"] == MODES[mode][0]




@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("model", SCHEMAS, ids=NAMES)
def test_parse_gives_a_valid_object(server, answers, model, decoder, mode):
    _, wire, _ = server
    case = f"{model.__name__}/{decoder}/{mode}"
    _check_answer(wire, case, model, answers[case])


def _check_answer(wire, case, model, out):
    if isinstance(out, Exception):
        raise AssertionError(f"{case}: {type(out).__name__}: {out}") from out
    choice = out.choices[0]
    assert choice.finish_reason == "stop", (case, choice.message.content)
    assert isinstance(choice.message.parsed, model), (case, choice.message.content)
    schema = wire.bodies[case]["response_format"]["json_schema"]["schema"]
    errors = [e.message for e in _validator(schema).iter_errors(json.loads(choice.message.content))]
    assert not errors, (case, choice.message.content, errors)
    # the object pydantic parsed is the text's (nothing dropped or defaulted on the way)
    assert choice.message.parsed == model.model_validate_json(choice.message.content)


def test_sampled_answers_differ(answers):
    """Seeds and temperature reach the sampler: over the whole set, seed 1's answers are not
    seed 2's, nor the greedy ones."""
    def texts(decoder, mode):
        out = [answers[f"{n}/{decoder}/{mode}"] for n in NAMES]
        return [o.choices[0].message.content for o in out if not isinstance(o, Exception)]

    for d in DECODERS:
        assert texts(d, "seed1") != texts(d, "seed2")
        assert texts(d, "seed1") != texts(d, "greedy")


# ---- keywords the grammar backend would ignore: refused, naming them ------------------------
def _with(extra: dict, **fields) -> type[BaseModel]:
    """A model whose schema carries ``extra`` at its root (pydantic's json_schema_extra)."""
    return pydantic.create_model("Refused", __config__=ConfigDict(json_schema_extra=extra),
                                 **{k: (v, ...) for k, v in fields.items()})


class UniqueSet(BaseModel):  # pydantic writes a set as an array with uniqueItems
    ids: set[Digit]


class PatternAndLength(BaseModel):  # xgrammar drops maxLength beside a pattern
    code: str = Field(pattern=r"^[a-z]+$", max_length=3)


class FormatAndLength(BaseModel):  # ... and beside a format
    contact: str = Field(json_schema_extra={"format": "email"}, max_length=40)


class FloatStep(BaseModel):  # xgrammar enforces multipleOf on integers only
    x: float = Field(ge=0, le=10, multiple_of=0.5)


REFUSED = [
    (UniqueSet, "uniqueItems"),
    (_with({"not": {"required": ["a"]}}, a=Optional[int]), "not"),
    (_with({"if": {"required": ["a"]}, "then": {"required": ["b"]}}, a=int, b=int), "if"),
    (_with({"properties": {"xs": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}}},
           xs=list[int]), "contains"),
    (_with({"dependentRequired": {"a": ["b"]}}, a=int, b=int), "dependentRequired"),
    (_with({"dependentSchemas": {"a": {"required": ["b"]}}}, a=int, b=int), "dependentSchemas"),
    (_with({"properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minContains": 1}}},
           xs=list[int]), "minContains"),
    # keywords the backend supports, but not where these stand
    (PatternAndLength, "maxLength"),
    (FormatAndLength, "maxLength"),
    (FloatStep, "multipleOf"),
    (_with({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, a=int, b=int), "allOf"),
    (_with({"properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}}},
           v=Union[int, str]), "minimum"),
    # and where they would be weakened: oneOf whose branches overlap, a format the backend does
    # not know, a typed keyword with no type, propertyNames beside properties, enum with a type
    # that its values do not have
    (_with({"properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}, v=float), "oneOf"),
    (_with({"properties": {"v": {"type": "string", "format": "password"}}}, v=str), "format"),
    (_with({"properties": {"v": {"minimum": 3}}}, v=int), "minimum"),
    (_with({"propertyNames": {"maxLength": 1}}, a=int), "propertyNames"),
    (_with({"properties": {"v": {"type": "string", "enum": [1, 2]}}}, v=str), "type"),
]


@pytest.mark.parametrize("model, keyword", REFUSED, ids=[f"{m.__name__}-{k}" for m, k in REFUSED])
def test_unsupported_keywords_are_refused_by_name(server, model, keyword):
    client, wire, _ = server
    case = f"refused/{keyword}"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=model, max_tokens=16,
                                      extra_headers={"x-case": case})
    assert keyword in json.dumps(wire.bodies[case]["response_format"])  # the client did send it
    err = info.value.body
    assert err["param"] == "response_format"
    assert f"'{keyword}'" in err["message"]


def test_format_date_takes_only_the_calendars_dates():
    """A grammar backend's own ``format: date`` took 2023-11-31; a date field is compiled as
    DATE_PATTERN (leap years by the Gregorian rule, years 0001-9999), checked here against
    datetime.date for every day of four years."""
    import datetime as dt

    from tokenloom.core.sampling_params import DATE_PATTERN, calendar_dates

    assert calendar_dates({"type": "string", "format": "date"}) == {"type": "string", "pattern": DATE_PATTERN}
    assert calendar_dates({"enum": [{"format": "date"}]}) == {"enum": [{"format": "date"}]}  # values stay
    pattern = re.compile(DATE_PATTERN)
    for year in (1900, 2000, 2023, 2024, 1, 9999, 0):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    dt.date.fromisoformat(text)
                    real = True
                except ValueError:
                    real = False
                assert bool(pattern.match(text)) is real, text
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema = json.dumps(calendar_dates({"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                                        "required": ["d"]}))
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    assert _is_grammar_accept_string(grammar, '{"d": "2024-02-29"}')
    assert not _is_grammar_accept_string(grammar, '{"d": "2023-11-31"}')
