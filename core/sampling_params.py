"""SamplingParams: what the user asks of the sampler, validated before admission."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from tokenloom.core.errors import ClientError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_TIMEOUT_S = 86400.0  # one day
MAX_TEMPERATURE = 100.0  # dividing by it only flattens logits: harmless at any scale
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tinier
# one overflows float32 (inf - inf = nan) or, below ~1e-45, divides by zero.
GREEDY_TEMPERATURE_EPS = 1e-5
# repetition_penalty divides (or multiplies) logits: within [1/100, 10] a logit changes by
# at most 100x, so even extreme logits (1e4) stay far from float32 overflow, and 1e-45 or
# 1e-300 (zero in float32) cannot reach the sampler.
MAX_SPECULATIVE_TOKENS = 16  # draft tokens verified per step (K)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024  # biased token ids per request: each is applied to every row the request samples from
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range; -100 bans the token outright
MAX_N = 128  # parallel samples of one prompt (OpenAI's bound on n)
MAX_SLO_TARGET_MS = 3_600_000.0  # an hour: a latency target beyond it is no target
# an SLO class name labels stats keys and metrics: letters, digits, '_', '-', '.'
SLO_CLASS_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


CONSTRAINT_KINDS = ("json", "json_schema", "regex", "grammar", "choice", "tagged_json")
MAX_TAGGED = 16  # JSON values in one ``tagged_json`` constraint (e.g. parallel tool calls)
MAX_TAG_CHARS = 64
MAX_CONSTRAINT_CHARS = 65_536  # a regex, an EBNF grammar or a JSON schema (as JSON text)
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32
# JSON-schema keywords the grammar backend enforces, or that only annotate (title, ...):
# anything else (not, if/then/else, uniqueItems, contains, ...) would be silently ignored by
# xgrammar, so a schema that uses one is refused up front, naming the keyword.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems", "additionalItems", "title", "description", "default", "examples", "$schema", "$id",
    "$comment", "deprecated", "readOnly", "writeOnly", "discriminator",
})
# Keywords that only annotate, or hold definitions: what may stand beside ``$ref``, ``anyOf`` or
# ``oneOf``, whose siblings xgrammar drops (``{"$ref": ..., "minimum": 1}`` takes any value of
# the referenced schema). ``discriminator`` (OpenAPI's, written by pydantic for a
# discriminated union) names the property whose ``const`` tells the branches apart.
_SCHEMA_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                 "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions"})
# string formats the grammar enforces (xgrammar 0.2); any other would be a free string
SCHEMA_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_TYPED_KEYWORDS = {"minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
                   "minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
                   "exclusiveMaximum": "number", "multipleOf": "number"}
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
               "array": (list,), "object": (dict,)}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")  # [subschema]
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
               "additionalItems")  # a subschema (or a bool)


class Constraint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A structured-output constraint (``SamplingParams.constraint``): the output must match it.

    ``kind``: ``json`` (any JSON value; ``value`` unset), ``json_schema`` (``value`` a JSON
    schema object), ``regex`` (``value`` a regular expression), ``grammar`` (``value`` an
    grammar in the grammar backend's dialect: EBNF with rule ``root`` first for ``xgrammar``,
    Lark or such EBNF for ``llguidance``), ``choice`` (``value`` a list of
    strings: the output is exactly one of them), ``tagged_json`` (``value`` a dict: between
    ``min`` and ``max`` JSON values, each valid under ``schema`` and written as ``begin``,
    the compact JSON, ``end``, joined by ``separator``; how a tool parser forces its call
    format, e.g. ``<tool_call>\\n{...}\\n</tool_call>``). ``param`` names the request
    parameter it came from (``response_format``, ``guided_regex``, ``tool_choice``, ...):
    errors name it."""

    kind: str
    value: str | list[str] | dict[str, Any] | None = None
    param: str = "constraint"

    def validate(self) -> None:
        """Raise :class:`ClientError` naming ``param`` for a malformed constraint or a JSON-schema
        keyword the backend does not enforce (compiling catches the rest)."""
        p = self.param
        if self.kind not in CONSTRAINT_KINDS:
            raise ClientError.bad_value(p, self.kind, f"a constraint kind: {', '.join(CONSTRAINT_KINDS)}")
        v = self.value
        if self.kind == "json":
            if v is not None:
                raise ClientError(f"{p}: a 'json' constraint takes no value", param=p)
        elif self.kind in ("regex", "grammar"):
            if not isinstance(v, str) or not 0 < len(v) <= MAX_CONSTRAINT_CHARS:
                raise ClientError.bad_value(p, v, f"a non-empty string of at most {MAX_CONSTRAINT_CHARS} characters")
        elif self.kind == "choice":
            if not isinstance(v, list) or not 0 < len(v) <= MAX_CHOICES or \
                    not all(isinstance(c, str) and 0 < len(c) <= MAX_STOP_STRING_LEN for c in v):
                raise ClientError.bad_value(p, v, f"a list of 1 to {MAX_CHOICES} non-empty strings "
                                            f"of at most {MAX_STOP_STRING_LEN} characters")
        elif self.kind == "tagged_json":
            keys = {"schema", "begin", "end", "separator", "min", "max"}
            if not isinstance(v, dict) or not set(v) <= keys or "schema" not in v:
                raise ClientError.bad_value(p, v, f"a dict with 'schema' and some of {sorted(keys - {'schema'})}")
            for key in ("begin", "end", "separator"):
                if not isinstance(v.get(key, ""), str) or len(v.get(key, "")) > MAX_TAG_CHARS:
                    raise ClientError.bad_value(p, v.get(key), f"{key}: a string of at most {MAX_TAG_CHARS} characters")
            lo, hi = v.get("min", 1), v.get("max", 1)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= MAX_TAGGED):
                raise ClientError.bad_value(p, (lo, hi), f"min and max with 1 <= min <= max <= {MAX_TAGGED}")
            Constraint(kind="json_schema", value=v["schema"], param=p).validate()
        else:  # json_schema
            if not isinstance(v, dict):
                raise ClientError.bad_value(p, v, "a JSON schema object")
            if len(msgspec.json.encode(v)) > MAX_CONSTRAINT_CHARS:
                raise ClientError(f"{p}: the JSON schema is longer than {MAX_CONSTRAINT_CHARS} characters", param=p)
            check_schema(v, p)


# RFC 3339 full-date with the calendar: years 0001-9999, each month's days, February 29 in
# leap years only (divisible by 4, centuries only when divisible by 400), as
# datetime.date.fromisoformat and jsonschema's "date" check read it
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
DATE_PATTERN = (f"^({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
                f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)$")


def calendar_dates(schema: Any) -> Any:
    """``schema`` with every ``format: date`` string written as :data:`DATE_PATTERN`: a
    grammar backend's own date format takes any day 01-31 of any month (xgrammar's does);
    the pattern takes only dates the calendar has. (``check_schema`` has refused a length
    beside a format, so the pattern is the string's only constraint.)"""
    if isinstance(schema, list):
        return [calendar_dates(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: calendar_dates(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    if out.get("format") == "date" and out.get("type") == "string":
        del out["format"]
        out["pattern"] = DATE_PATTERN
    return out


def check_schema(schema: object, param: str, depth: int = 0) -> None:
    """Walk a JSON schema; raise :class:`ClientError` naming ``param`` and the first keyword
    not in :data:`SCHEMA_KEYWORDS` (its path in the schema too)."""
    _walk_schema(schema, param, "#", depth)


def _check_combination(schema: dict, param: str, path: str) -> None:
    """Refuse keywords the grammar backend would ignore where they stand (xgrammar 0.2: a
    ``maxLength`` beside a ``pattern`` or ``format``, a ``multipleOf`` on anything but an
    integer, every ``allOf`` entry but one, a constraint beside ``$ref``/``anyOf``/``oneOf``)."""
    def refuse(key: str, why: str) -> None:
        raise ClientError(f"{param}: JSON schema keyword {key!r} (at {path}) is not supported {why}", param=param,
                          value=key)

    for length in ("minLength", "maxLength"):
        if length in schema and ("pattern" in schema or "format" in schema):
            refuse(length, f"beside {'pattern' if 'pattern' in schema else 'format'} (it would be ignored)")
    if "multipleOf" in schema:
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if "integer" not in types or "number" in types or not isinstance(schema["multipleOf"], int) \
                or isinstance(schema["multipleOf"], bool):
            refuse("multipleOf", "except as an integer on an integer schema (it would be ignored)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        refuse("allOf", "with more than one subschema (all but one would be ignored)")
    for combinator in ("$ref", "anyOf", "oneOf"):
        if combinator in schema:
            extra = sorted(k for k in schema if k != combinator and k not in _SCHEMA_ANNOTATIONS)
            if extra:
                refuse(extra[0], f"beside {combinator!r} (it would be ignored)")
    if isinstance(schema.get("oneOf"), list) and "discriminator" not in schema and not _disjoint(schema):
        refuse("oneOf", "unless its subschemas exclude each other (distinct types, a property with a distinct "
                        "const in each, or a 'discriminator' as pydantic writes one): it is enforced as anyOf")
    if "format" in schema and schema["format"] not in SCHEMA_FORMATS:
        refuse("format", f"with the value {schema['format']!r} (not enforced: any string would pass; "
                         f"enforced: {', '.join(sorted(SCHEMA_FORMATS))})")
    if "type" not in schema and not any(k in schema for k in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        for key, kind in _TYPED_KEYWORDS.items():
            if key in schema:
                refuse(key, f"without a 'type' (give type: {kind!r}; it would be ignored)")
    if "propertyNames" in schema and "properties" in schema:
        refuse("propertyNames", "beside 'properties' (it would not apply to them)")
    for fixed in ("enum", "const"):
        if fixed in schema:
            values = schema[fixed] if fixed == "enum" else [schema[fixed]]
            extra = sorted(k for k in schema if k not in (fixed, "type") and k not in _SCHEMA_ANNOTATIONS)
            if extra:
                refuse(extra[0], f"beside {fixed!r} (it would be ignored)")
            if "type" in schema and isinstance(values, list) and \
                    not all(_has_type(v, schema["type"]) for v in values):
                refuse("type", f"beside a {fixed!r} value of another type (the type would be ignored)")


def _has_type(value: object, types: object) -> bool:
    names = types if isinstance(types, list) else [types]
    for name in names:
        kinds = _JSON_TYPES.get(name) if isinstance(name, str) else None
        if kinds is None:
            continue
        if isinstance(value, bool) and name not in ("boolean",):
            continue
        if name == "integer" and isinstance(value, float):
            if value.is_integer():
                return True
            continue
        if isinstance(value, kinds):
            return True
    return False


def _disjoint(schema: dict) -> bool:
    """Whether no JSON value can match two of ``oneOf``'s subschemas: each has one ``type``
    and no two share it, or one property holds a ``const`` (or one-value ``enum``) in each,
    all different (a discriminated union)."""
    branches = schema["oneOf"]
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) and \
            not {"integer", "number"} <= set(types):
        return True
    props = [b.get("properties") for b in branches]
    if not all(isinstance(p, dict) for p in props) or not props:
        return False
    for name in props[0]:
        tags = []
        for b, p in zip(branches, props, strict=True):
            sub = p.get(name)
            if not isinstance(sub, dict) or name not in b.get("required", []):
                break
            if "const" in sub:
                tags.append(json.dumps(sub["const"], sort_keys=True))
            elif isinstance(sub.get("enum"), list) and len(sub["enum"]) == 1:
                tags.append(json.dumps(sub["enum"][0], sort_keys=True))
            else:
                break
        else:
            if len(set(tags)) == len(tags):
                return True
    return False


def _walk_schema(schema: object, param: str, path: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ClientError(f"{param}: the JSON schema at {path} must be an object or a boolean", param=param)
    if depth > MAX_SCHEMA_DEPTH:
        raise ClientError(f"{param}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH}", param=param)
    for key in schema:
        if key not in SCHEMA_KEYWORDS:
            raise ClientError(f"{param}: JSON schema keyword {key!r} (at {path}) is not supported", param=param,
                              value=key)
    _check_combination(schema, param, path)
    for key, sub in schema.items():
        if key in _SCHEMA_MAPS:
            if not isinstance(sub, dict):
                raise ClientError(f"{param}: {key!r} at {path} must be an object", param=param)
            for name, s in sub.items():
                _walk_schema(s, param, f"{path}/{key}/{name}", depth + 1)
        elif key in _SCHEMA_LISTS:
            if not isinstance(sub, list):
                raise ClientError(f"{param}: {key!r} at {path} must be an array", param=param)
            for i, s in enumerate(sub):
                _walk_schema(s, param, f"{path}/{key}/{i}", depth + 1)
        elif key in _SCHEMA_ONE:
            if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
                sub = {**sub, "type": "string"}  # a property name is a string
            _walk_schema(sub, param, f"{path}/{key}", depth + 1)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling knobs, named as in vLLM / the OpenAI API.

    ``temperature`` below ``GREEDY_TEMPERATURE_EPS`` (0 included) means greedy. ``top_k <= 0``
    and ``top_p == 1`` and ``min_p == 0`` switch those filters off; whatever their values, the
    most likely token always survives them. Penalties: ``repetition_penalty`` (CTRL/HF style,
    over prompt and output), ``presence_penalty`` and ``frequency_penalty`` (OpenAI style, over
    the output). ``stop`` strings are not included in the returned text. ``logprobs=n`` returns
    the sampled token's log-probability and the top ``n`` alternatives, computed from the
    model's raw distribution (before penalties and temperature), as vLLM does.
    ``timeout_s`` is a deadline in seconds from the request's arrival (``None``: no deadline).
    ``decoder`` picks the request's decoder strategy by name (``standard``, ``ngram``, ...;
    ``None``: the engine's configured one) and ``num_speculative_tokens`` its K, the draft
    tokens verified per step (``None``: the decoder's own default). Every decoder gives the
    same output distribution; only the speed differs.
    ``logit_bias`` maps token ids to a value in [-100, 100] added to their logits before
    every other sampling rule (penalties, temperature, filters) on every row the request
    samples from, speculative verification rows included; -100 bans the token (its logit
    becomes -inf), as OpenAI describes it. ``logprobs`` stay the raw model's.
    ``n`` asks for that many independent samples of the prompt: the prompt is prefilled
    once and the samples fork its KV blocks (``AsyncEngine.submit`` returns sample 0's
    request; ``req.samples`` holds all n, each with its own stream and ``Finished``); with
    a ``seed``, sample ``i`` draws from ``seed + i``.
    ``prompt_logprobs=k`` returns each prompt token's log-probability given the tokens
    before it (``None`` for the first) with the top ``k`` alternatives, from one extra
    prefill of the prompt (vLLM's name); only then may ``max_tokens`` be 0 (scoring alone).
    ``constraint`` (a :class:`Constraint`: any JSON, a JSON schema, a regex, an EBNF grammar
    or a choice of strings) restricts every sampled token to those the grammar allows at
    that point (tokens it forbids get probability 0 before every other rule, speculative
    verification rows included); the request waits for its grammar to compile before it
    is scheduled, and finishes (``stop``) when the grammar is complete and the model ends.
    ``slo_class`` names the request's service class (free names of letters, digits, ``_``,
    ``-`` and ``.``, e.g. ``interactive`` or ``batch``); ``ttft_ms`` and ``tpot_ms`` are its latency targets: time to the first token
    and mean time per output token after it, in milliseconds. A target left ``None`` comes
    from the class's defaults in the ``slo`` scheduler's options; other schedulers ignore
    all three (they only label the request).
    ``adapter`` names a low-rank adapter the engine serves (``--lora NAME=PATH``; the OpenAI
    ``model`` field names one too): the request runs the base model with that adapter's
    update, in the same steps as requests under other adapters or none (``None``: the base).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    timeout_s: float | None = None
    decoder: str | None = None
    adapter: str | None = None
    num_speculative_tokens: int | None = None
    slo_class: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    logit_bias: dict[int, float] | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from untrusted input; an unknown field or a wrong type names the field."""
        try:
            params = msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise ClientError(f"invalid sampling params: {exc}", param=_field_of(exc)) from None
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or too small to divide float32 logits by."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`ClientError` naming the first bad parameter."""
        _finite("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ClientError.bad_value("temperature", self.temperature, f"in [0, {MAX_TEMPERATURE:g}]")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ClientError.bad_value("top_p", self.top_p, "in (0, 1]")
        _int("top_k", self.top_k)
        if self.top_k < -1 or (vocab_size is not None and self.top_k > vocab_size):
            limit = vocab_size if vocab_size is not None else "vocab_size"
            raise ClientError.bad_value("top_k", self.top_k, f"-1, 0 (off) or in [1, {limit}]")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ClientError.bad_value("min_p", self.min_p, "in [0, 1]")
        _finite("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ClientError.bad_value("repetition_penalty", self.repetition_penalty,
                                        f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ClientError.bad_value(name, value, "in [-2, 2]")
        _int("max_tokens", self.max_tokens)
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ClientError.bad_value("max_tokens", self.max_tokens,
                                        ">= 1 (0 only with prompt_logprobs: the prompt scored alone)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ClientError.bad_value("stop", len(self.stop), f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_LEN:
                raise ClientError.bad_value("stop", s, f"non-empty strings of <= {MAX_STOP_STRING_LEN} chars")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ClientError.bad_value("stop_token_ids", len(self.stop_token_ids), f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ClientError.bad_value("stop_token_ids", t, "valid token ids")
        if self.seed is not None:
            _int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ClientError.bad_value("seed", self.seed, f"in [0, {MAX_SEED}]")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ClientError.bad_value("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ClientError.bad_value("prompt_logprobs", self.prompt_logprobs, f"in [0, {MAX_LOGPROBS}]")
        _int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ClientError.bad_value("n", self.n, f"in [1, {MAX_N}]")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise ClientError.bad_value("constraint", self.constraint, "a Constraint")
            self.constraint.validate()
        if self.timeout_s is not None:
            _finite("timeout_s", self.timeout_s)
            if not 0.0 < self.timeout_s <= MAX_TIMEOUT_S:
                raise ClientError.bad_value("timeout_s", self.timeout_s, f"in (0, {MAX_TIMEOUT_S:g}] seconds")
        if self.decoder is not None and (not isinstance(self.decoder, str) or not 0 < len(self.decoder) <= 64):
            raise ClientError.bad_value("decoder", self.decoder, "a decoder name")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not 0 < len(self.adapter) <= 256):
            raise ClientError.bad_value("adapter", self.adapter, "an adapter name")
        if self.num_speculative_tokens is not None:
            _int("num_speculative_tokens", self.num_speculative_tokens)
            if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ClientError.bad_value("num_speculative_tokens", self.num_speculative_tokens,
                                            f"in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.slo_class is not None and (not isinstance(self.slo_class, str)
                                           or not SLO_CLASS_RE.fullmatch(self.slo_class)):
            raise ClientError.bad_value("slo_class", self.slo_class,
                                        "a name of 1 to 64 letters, digits, '_', '-' or '.'")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None:
                _finite(name, value)
                if not 0.0 < value <= MAX_SLO_TARGET_MS:
                    raise ClientError.bad_value(name, value, f"in (0, {MAX_SLO_TARGET_MS:g}] milliseconds")


def _check_logit_bias(bias: object, vocab_size: int | None) -> None:
    if not isinstance(bias, dict):
        raise ClientError.bad_value("logit_bias", bias, "a map of token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ClientError.bad_value("logit_bias", len(bias), f"at most {MAX_LOGIT_BIAS} token ids")
    limit = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                (vocab_size is not None and token >= vocab_size):
            raise ClientError.bad_value("logit_bias", token, f"keyed by token ids in {limit}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
            raise ClientError.bad_value("logit_bias", value, f"biases in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                        f"{MAX_LOGIT_BIAS_VALUE:g}] (token {token})")
    if vocab_size is not None and sum(v <= -MAX_LOGIT_BIAS_VALUE for v in bias.values()) >= vocab_size:
        raise ClientError("logit_bias bans every token of the vocabulary", param="logit_bias")


def _finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClientError.bad_value(name, value, "a finite number")


def _int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClientError.bad_value(name, value, "an integer")


def _field_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.top_k`" or "Object contains unknown field `foo`".
    text = str(exc)
    for marker in ("`$.", "field `"):
        if marker in text:
            rest = text.split(marker, 1)[1]
            return rest.split("`", 1)[0].split("[", 1)[0]
    return None
