"""The ``xgrammar`` grammar backend: constraints compiled by xgrammar (github.com/mlc-ai/xgrammar)
against the engine's tokenizer, a ``GrammarMatcher`` per sequence.

xgrammar (and transformers, which builds its tokenizer description) is imported at the
first compile, not at start-up: an engine without the package serves everything else and
refuses a constrained request with a 400 that names the package.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import Constraint

INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'tokenloom[structured]'"


class XGrammarMatcher:
    """xgrammar's ``GrammarMatcher`` under the :class:`~tokenloom.core.interfaces.GrammarMatcher` names."""

    __slots__ = ("_m", "_also")

    def __init__(self, matcher: Any, also: Any = None):
        self._m = matcher
        self._also = also  # a bitmask row ANDed in (JSON: no raw control characters)

    def fill_bitmask(self, bitmask, index: int = 0) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)
        if self._also is not None:
            bitmask[index] &= self._also

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, options, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._no_control: Any = None  # bitmask row: tokens without a byte below 0x20
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
                self._no_control = _no_control_bitmask(info.decoded_vocab, self.vocab_size)
            return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        param = constraint.param
        compiler = self._get_compiler(param)
        kind, value = constraint.kind, constraint.value
        try:
            # JSON is compiled compact (a small model given free whitespace may emit nothing
            # else), and its matchers refuse tokens with raw control characters, which
            # xgrammar's strings let through and JSON forbids (json.loads, pydantic refuse them)
            if kind == "json":
                return _Json(compiler.compile_json_schema("{}", any_whitespace=False))
            if kind == "json_schema":
                return _Json(compiler.compile_json_schema(json.dumps(value), any_whitespace=False, strict_mode=True))
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "grammar":
                return compiler.compile_grammar(value)
            if kind == "choice":
                assert isinstance(value, list)
                return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ClientError(f"{param}: cannot compile the {kind.replace('_', ' ')}: {_message(exc)}",
                              param=param) from None
        raise ClientError.bad_value(param, kind, "a constraint kind")

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        import xgrammar as xgr

        if isinstance(compiled, _Json):
            return XGrammarMatcher(xgr.GrammarMatcher(compiled.grammar), self._no_control)
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))


class _Json:
    """A compiled JSON grammar: its matchers also ban raw control characters."""

    __slots__ = ("grammar",)

    def __init__(self, grammar: Any):
        self.grammar = grammar


def _no_control_bitmask(decoded_vocab: list[bytes], vocab_size: int):
    import torch

    ok = torch.zeros(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    for i, b in enumerate(decoded_vocab[:vocab_size]):
        ok[i] = not any(c < 0x20 for c in b)
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (ok.view(-1, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _message(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text
