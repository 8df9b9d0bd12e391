"""The ``llguidance`` grammar backend: constraints compiled by llguidance
(github.com/guidance-ai/llguidance, the ``llguidance`` package) against the engine's
tokenizer, an ``LLMatcher`` per sequence. Chosen with ``engine.grammar_backend =
"llguidance"`` (``--grammar-backend llguidance``).

The constraint kinds mean what they mean under the ``xgrammar`` backend:

* ``json`` and ``json_schema``: one-line JSON with xgrammar's separators (``", "`` and
  ``": "``, no other whitespace); no raw control characters in strings, no escaped lone
  surrogate (``\\ud800``; xgrammar lets that one through). ``json_schema`` is made strict
  the way xgrammar's ``strict_mode`` is: an object schema that lists ``properties`` and
  says nothing of ``additionalProperties`` takes no other property, an array schema with
  ``prefixItems`` and no ``items`` takes no further item; the branches of an ``allOf``
  are left open (xgrammar merges them; llguidance intersects them, so closing each branch
  would refuse the properties of the others). Differences that remain: llguidance refuses
  (a 400 naming the parameter) ``unevaluatedProperties``, ``unevaluatedItems`` and a
  ``format`` it does not know, which xgrammar ignores; it enforces ``patternProperties``
  (xgrammar refuses every pattern-matched key); regexes in ``pattern`` are read by
  llguidance's engine (ECMAScript-like classes).
* ``regex``: the whole output matches. ``\\d`` and ``\\w`` are ASCII as in xgrammar, ``\\s``
  is Unicode whitespace; the syntax is Rust's ``regex`` crate (no look-around, no
  back-references: such a regex is refused naming the parameter, as under xgrammar).
* ``grammar``: a Lark grammar in llguidance's dialect (``start:`` rule, ``/regex/``
  terminals, ``%json {...}``, ``x{m,n}``), or an EBNF / GBNF grammar in the ``root ::=``
  style xgrammar reads, which llguidance's converter turns into Lark (the common subset:
  literals, character classes, ``* + ?``, grouping, alternation). A grammar neither reads
  is a ``ClientError`` naming ``constraint.param``.
* ``choice``: exactly one of the strings.
* ``tagged_json``: ``min`` to ``max`` values, each ``begin``, the compact JSON (strict as
  above), ``end``, joined by ``separator`` (one Lark rule with ``%json`` and a repetition).

Raw UTF-8 surrogates (bytes ``ED A0``-``ED BF``) are refused by llguidance's own UTF-8
lexer, inside a token and across two, so this backend needs no extra bitmask rule.
Special tokens never match text: a quoted literal ``"<|im_end|>"`` is the characters,
the token itself is written bare (``<|im_end|>``) in a Lark grammar.

llguidance is imported at the first compile, not at start-up: an engine without the
package serves everything else and refuses a constrained request with a 400 that names
the package.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import Constraint, calendar_dates

log = logging.getLogger(__name__)

INSTALL_HINT = "the llguidance grammar backend needs the llguidance package: pip install 'tokenloom[structured]'"

# xgrammar's layout of compact JSON (any_whitespace=False, no indent): one line, ", " and ": "
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher:
    """llguidance's ``LLMatcher`` under the :class:`~tokenloom.core.interfaces.GrammarMatcher`
    names. A refused token leaves it as it was (an ``LLMatcher`` that consumes a token its
    grammar forbids enters an error state for good, so every token is validated first), and
    it is terminated once it took a stop token, as an xgrammar matcher is (llguidance stops
    as soon as nothing but a stop token can follow)."""

    __slots__ = ("_m", "_eos", "_words", "_stops", "_steps")

    def __init__(self, matcher: Any, eos: frozenset[int], vocab_size: int):
        self._m = matcher
        self._eos = eos
        self._words = (vocab_size + 31) // 32
        self._stops: list[bool] = []  # per accepted token: whether it was a stop token
        self._steps: list[bool] = []  # per accepted token: whether the LLMatcher consumed it

    def fill_bitmask(self, bitmask, index: int = 0) -> None:
        import torch

        row = bitmask[index]
        words = self._words
        if row.device.type == "cpu" and row.dtype == torch.int32 and row.is_contiguous() and row.shape[0] >= words:
            target = row[:words]
        else:
            target = torch.empty(words, dtype=torch.int32)
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)
        if target.data_ptr() != row.data_ptr():
            row[:words].copy_(target)
        if row.shape[0] > words:
            row[words:] = 0

    def accept_token(self, token_id: int) -> bool:
        m = self._m
        if self._stops and self._stops[-1]:
            return False  # terminated: nothing follows the stop token
        stop = token_id in self._eos
        if stop:
            # (llguidance's validate_tokens says 0 for a stop token once it has stopped)
            ok = m.is_accepting() and not m.is_error()
        else:
            ok = m.validate_tokens([token_id]) == 1
        if not ok:
            return False
        # A matcher that has stopped (nothing but a stop token can follow) takes the stop
        # token without a step of its own: its rollback(1) would then undo the token
        # before it. It is left alone; the stop token is only counted here.
        consume = not (stop and m.is_stopped())
        if consume and not m.consume_token(token_id):  # validated above: only an llguidance bug gets here
            raise RuntimeError(f"llguidance refused token {token_id} after validating it: {_first_line(m.get_error())}")
        self._stops.append(stop)
        self._steps.append(consume)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._stops):
            raise ValueError(f"cannot roll back {num_tokens} tokens, {len(self._stops)} accepted")
        keep = len(self._stops) - num_tokens
        steps = sum(self._steps[keep:])
        if steps and not self._m.rollback(steps):
            raise RuntimeError(f"llguidance could not roll back {steps} tokens: {_first_line(self._m.get_error())}")
        del self._stops[keep:], self._steps[keep:]

    def is_terminated(self) -> bool:
        return bool(self._stops) and self._stops[-1]


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, options, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._eos: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    def _get_tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    import llguidance
                except ImportError as exc:
                    raise ClientError(f"{INSTALL_HINT} ({exc})", param=param) from None
                self._ll_tokenizer = ll_tokenizer(llguidance, self.tokenizer, self.vocab_size, param)
                self._eos = frozenset(self._ll_tokenizer.eos_tokens)
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> Any:
        param = constraint.param
        tokenizer = self._get_tokenizer(param)
        import llguidance as llg

        kind, value = constraint.kind, constraint.value
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema({}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
            elif kind == "json_schema":
                assert isinstance(value, dict)
                grammar = llg.LLMatcher.grammar_from_json_schema(strict_schema(calendar_dates(value)),
                                                                 overrides=JSON_OPTIONS)  # type: ignore[arg-type]
            elif kind == "regex":
                assert isinstance(value, str)
                grammar = llg.LLMatcher.grammar_from_lark("start: /" + llg.regex_to_lark(value, "dw") + "/")
            elif kind == "grammar":
                assert isinstance(value, str)
                grammar = llg.grammar_from("grammar", value)  # Lark as is; `root ::=` EBNF converted
            elif kind == "choice":
                assert isinstance(value, list)
                grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in value))
            elif kind == "tagged_json":
                assert isinstance(value, dict)
                grammar = llg.LLMatcher.grammar_from_lark(tagged_json_lark(value))
            else:
                raise ClientError.bad_value(param, kind, "a constraint kind")
        except (ValueError, TypeError, RuntimeError) as exc:  # a schema or an EBNF grammar that does not convert
            raise ClientError(f"{param}: cannot compile the {kind.replace('_', ' ')}: {_message(str(exc))}",
                              param=param) from None
        # the matcher built here is the template each sequence's matcher copies (building
        # one parses the grammar and builds its lexer: the slow part, on the compile thread)
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ClientError(f"{param}: cannot compile the {kind.replace('_', ' ')}: {_message(template.get_error())}",
                              param=param)
        for warning in template.get_grammar_warnings():
            log.warning("%s: llguidance: %s", param, warning)
        return template

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._eos, self.vocab_size)


def ll_tokenizer(llguidance: Any, tokenizer: Any, vocab_size: int, param: str = "constraint") -> Any:
    """llguidance's tokenizer over the engine's: each token's bytes as the engine reads them
    (``Tokenizer.token_bytes``), the special tokens marked special (never text), the engine's
    stop tokens, ``vocab_size`` ids (the logits' width: ids past the tokenizer's are empty
    and never allowed)."""
    eos = sorted(e for e in tokenizer.eos_token_ids if e < vocab_size)
    if not eos:
        raise ClientError(f"{param}: structured outputs need the model to have a stop token below its vocabulary size",
                          param=param)
    n = min(tokenizer.vocab_size, vocab_size)
    special = sorted(i for i in tokenizer.special_ids if i < n)

    class _Vocabulary:
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None and \
            tokenizer.bos_token_id < n else None
        tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        special_token_ids = special

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode(text, add_bos=False, parse_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=vocab_size, eos_token=eos)


def strict_schema(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` closed as xgrammar's ``strict_mode`` closes it: an object schema with
    ``properties`` and no ``additionalProperties`` (nor ``patternProperties``' keys aside)
    takes no other key, an array schema with ``prefixItems`` and no ``items`` no further
    item; every subschema likewise, but the direct branches of an ``allOf``."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, sub in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(sub, dict):
            out[key] = {name: strict_schema(s) for name, s in sub.items()}
        elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(sub, list):
            out[key] = [strict_schema(s) for s in sub]
        elif key == "allOf" and isinstance(sub, list):
            out[key] = [strict_schema(s, in_all_of=True) for s in sub]
        elif key in ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
                     "unevaluatedItems"):
            out[key] = strict_schema(sub)
        else:
            out[key] = sub
    if not in_all_of:
        if "properties" in out and not {"additionalProperties", "unevaluatedProperties"} & set(out):
            out["additionalProperties"] = False
        if "prefixItems" in out and not {"items", "additionalItems", "unevaluatedItems"} & set(out):
            out["items"] = False
    return out


def tagged_json_lark(value: dict) -> str:
    """The Lark grammar of a ``tagged_json`` constraint: ``min`` to ``max`` values of
    ``begin``, the compact strict JSON under ``schema`` (``%json``, its layout given in the
    schema's ``x-guidance`` options), ``end``, joined by ``separator``."""
    schema = strict_schema(calendar_dates(value["schema"]))
    schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    parts = [_lark_literal(value["begin"])] if value.get("begin") else []
    parts.append("%json " + json.dumps(schema))
    parts += [_lark_literal(value["end"])] if value.get("end") else []
    one = " ".join(parts)
    lo, hi = value.get("min", 1), value.get("max", 1)
    sep = value.get("separator", "")
    rest = f"({_lark_literal(sep)} item)" if sep else "item"
    more = f" {rest}{{{lo - 1},{hi - 1}}}" if hi > 1 else ""
    return f"start: item{more}\nitem: {one}\n"


def _lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (llguidance reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


_SOURCE_LINE = re.compile(r"\d+ \| ")  # llguidance quotes the grammar's line: "   1 | start: foo"


def _message(text: str, limit: int = 400) -> str:
    """llguidance's error on one line: its lines (the offending source line and its caret
    marker dropped), joined, at most ``limit`` characters."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("^") and not _SOURCE_LINE.match(ln)]
    joined = " ".join(kept) or text.strip() or "unknown error"
    return joined if len(joined) <= limit else joined[:limit - 3] + "..."
