"""The ``xgrammar`` grammar backend: constraints compiled by xgrammar (github.com/mlc-ai/xgrammar)
against the engine's tokenizer, a ``GrammarMatcher`` per sequence.

xgrammar (and transformers, which builds its tokenizer description) is imported at the
first compile, not at start-up: an engine without the package serves everything else and
refuses a constrained request with a 400 that names the package.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import Constraint, calendar_dates

INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'tokenloom[structured]'"


class XGrammarMatcher:
    """xgrammar's ``GrammarMatcher`` under the :class:`~tokenloom.core.interfaces.GrammarMatcher`
    names, with two more rules ANDed into its bitmask. ``also``: no raw control characters
    in JSON, and no token holding a UTF-8 surrogate (bytes ``ED A0``-``ED BF``), which
    xgrammar's UTF-8 accepts as one character and every decoder reads as three U+FFFD (a
    string would pass ``maxLength`` and fail it once decoded). ``after_ed``: the tokens
    that may follow a token ending in ``ED`` (none starting with ``A0``-``BF``)."""

    __slots__ = ("_m", "_also", "_after_ed", "_ends_ed", "_tail")

    def __init__(self, matcher: Any, also: Any = None, after_ed: Any = None, ends_ed: frozenset[int] = frozenset()):
        self._m = matcher
        self._also, self._after_ed, self._ends_ed = also, after_ed, ends_ed
        self._tail: list[bool] = []  # per accepted token: whether it ends in byte ED

    def fill_bitmask(self, bitmask, index: int = 0) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)
        if self._also is not None:
            bitmask[index] &= self._also
        if self._tail and self._tail[-1] and self._after_ed is not None:
            bitmask[index] &= self._after_ed

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self._m.accept_token(token_id))
        if ok:
            self._tail.append(token_id in self._ends_ed)
        return ok

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        del self._tail[len(self._tail) - num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, options, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._decoded_vocab: list[bytes] = []
        self._masks: dict[frozenset[int] | None, Any] = {}  # bitmask rows: tokens without a control byte (but these)
        self._after_ed: Any = None
        self._ends_ed: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    def _get_compiler(self, param: str) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                    from transformers import PreTrainedTokenizerFast
                except ImportError as exc:
                    raise ClientError(f"{INSTALL_HINT} ({exc})", param=param) from None
                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tok)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=sorted(self.tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._decoded_vocab = info.decoded_vocab
                vocab = info.decoded_vocab[:self.vocab_size]
                self._ends_ed = frozenset(i for i, b in enumerate(vocab) if b.endswith(b"\xed"))
                self._after_ed = _bitmask_of([not (b and 0xA0 <= b[0] <= 0xBF) for b in vocab], self.vocab_size)
            return self._compiler

    def _mask(self, allowed: frozenset[int] | None) -> Any:
        """Tokens without a UTF-8 surrogate, no special token but the stop tokens (xgrammar
        reads a special token it was not told of, ``<pad>``, as its characters, and the
        detokenizer then drops it), and (``allowed`` not None) without a control byte other
        than those in ``allowed``."""
        with self._lock:
            if allowed not in self._masks:
                banned = self.tokenizer.special_ids - frozenset(self.tokenizer.eos_token_ids)
                self._masks[allowed] = _no_control_bitmask(self._decoded_vocab, self.vocab_size, allowed, banned)
            return self._masks[allowed]

    def compile(self, constraint: Constraint) -> Any:
        param = constraint.param
        compiler = self._get_compiler(param)
        kind, value = constraint.kind, constraint.value
        try:
            # JSON is compiled on one line, with json.dumps' ", " and ": " and no other
            # whitespace (a small model given free whitespace may emit nothing else), and its matchers refuse tokens with raw control characters, which
            # xgrammar's strings let through and JSON forbids (json.loads, pydantic refuse them)
            if kind == "json":
                return _Json(compiler.compile_json_schema("{}", any_whitespace=False))
            if kind == "json_schema":
                return _Json(compiler.compile_json_schema(json.dumps(calendar_dates(value)), any_whitespace=False,
                                                          strict_mode=True))
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "grammar":
                return compiler.compile_grammar(value)
            if kind == "choice":
                assert isinstance(value, list)
                return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
            if kind == "tagged_json":
                assert isinstance(value, dict)
                tags = "".join(value.get(k, "") for k in ("begin", "end", "separator"))
                return _Json(compiler.compile_grammar(_tagged_json(value)), frozenset(c for c in tags.encode() if c < 0x20))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ClientError(f"{param}: cannot compile the {kind.replace('_', ' ')}: {_message(exc)}",
                              param=param) from None
        raise ClientError.bad_value(param, kind, "a constraint kind")

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        import xgrammar as xgr

        if isinstance(compiled, _Json):
            return XGrammarMatcher(xgr.GrammarMatcher(compiled.grammar), self._mask(compiled.allowed),
                                   self._after_ed, self._ends_ed)
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self._mask(None), self._after_ed, self._ends_ed)


class _Json:
    """A compiled JSON grammar: its matchers also ban raw control characters, except those
    in ``allowed`` (a ``tagged_json`` constraint's tags may hold a newline, which
    xgrammar's JSON strings exclude themselves)."""

    __slots__ = ("grammar", "allowed")

    def __init__(self, grammar: Any, allowed: frozenset[int] = frozenset()):
        self.grammar, self.allowed = grammar, allowed


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _no_control_bitmask(decoded_vocab: list[bytes], vocab_size: int, allowed: frozenset[int] | None,
                        banned: frozenset[int] = frozenset()):
    """The bitmask row of tokens not in ``banned``, with no UTF-8 surrogate and, unless
    ``allowed`` is None, no byte below 0x20 but those in ``allowed``."""
    return _bitmask_of([i not in banned and not _SURROGATE.search(b) and
                        (allowed is None or not any(c < 0x20 and c not in allowed for c in b))
                        for i, b in enumerate(decoded_vocab[:vocab_size])], vocab_size)


def _bitmask_of(flags: list[bool], vocab_size: int):
    import torch

    ok = torch.zeros(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    ok[:len(flags)] = torch.tensor(flags, dtype=torch.bool)
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (ok.view(-1, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _tagged_json(value: dict) -> Any:
    """The grammar of a ``tagged_json`` constraint: ``min`` to ``max`` values of ``begin``,
    compact JSON under ``schema``, ``end``, joined by ``separator``. xgrammar's EBNF has no
    way to name a JSON-schema grammar inside it, so the counts are spelt out: a value is
    required ``min`` times, then each further one (up to ``max``) is optional, nested so
    that no value follows a missing one."""
    import xgrammar as xgr

    def literal(text: str) -> Any:
        return xgr.Grammar.from_ebnf("root ::= " + _ebnf_literal(text))

    body = xgr.Grammar.from_json_schema(json.dumps(calendar_dates(value["schema"])), any_whitespace=False,
                                        strict_mode=True)
    parts = [literal(value[key]) for key in ("begin",) if value.get(key)] + [body] + \
        [literal(value[key]) for key in ("end",) if value.get(key)]
    one = xgr.Grammar.concat(*parts) if len(parts) > 1 else body
    sep = value.get("separator", "")
    more = one if not sep else xgr.Grammar.concat(literal(sep), one)
    lo, hi = value.get("min", 1), value.get("max", 1)
    tail = None  # the optional values after the required ones, innermost first
    for _ in range(hi - lo):
        tail = more if tail is None else xgr.Grammar.union(more, xgr.Grammar.concat(more, tail))
    required = [one] + [more] * (lo - 1)
    grammar = xgr.Grammar.concat(*required) if len(required) > 1 else one
    if tail is not None:
        grammar = xgr.Grammar.union(grammar, xgr.Grammar.concat(grammar, tail))
    return grammar


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _message(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text
