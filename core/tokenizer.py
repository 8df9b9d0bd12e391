"""Tokenizer (the `tokenizers` library) and chat template (sandboxed jinja2)."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import structlog
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.core.chat import encode_chat
from tokenloom.core.errors import ClientError

log = structlog.get_logger("tokenloom.tokenizer")

CONTROL_TOKEN_TYPE = 3  # GGUF token_type for control tokens (<|im_start|>, ...)
USER_DEFINED_TOKEN_TYPE = 4


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable Latin-1 bytes stand for
    themselves, every other byte for the character 256 + its rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None, add_bos: bool = False):
        self.tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template: Template | None = None  # the chat template, compiled on first use
        #: ids of the special added tokens: the ones ``parse_special_tokens=False`` spells out as text
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._literal_tok: HFTokenizer | None = None
        self._literal_lock = threading.Lock()
        self._byte_level: bool | None = None  # is it byte-level BPE? (found on first use)
        self.warned_unsafe_template = False  # core/chat.py logs a cut placeholder once
        #: the most characters one token spans (a byte-level token string has one character per
        #: byte): a text of n characters has at least n / max_token_chars tokens
        self.max_token_chars = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)

    def __getstate__(self) -> dict:
        """What crosses to another process (a server's frontend when the engine core runs in
        its own): the vocabulary as JSON and the settings; caches are rebuilt on use."""
        return {"tok": self.tok.to_str(), "bos_token_id": self.bos_token_id, "eos_token_ids": sorted(self.eos_token_ids),
                "chat_template": self.chat_template, "add_bos": self.add_bos}

    def __setstate__(self, state: dict) -> None:
        self.__init__(HFTokenizer.from_str(state["tok"]), bos_token_id=state["bos_token_id"],  # type: ignore[misc]
                      eos_token_ids=state["eos_token_ids"], chat_template=state["chat_template"],
                      add_bos=state["add_bos"])

    def token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a UTF-8 character (what
        OpenAI's logprobs call ``bytes``): byte-level BPE pieces are mapped back through
        GPT-2's byte alphabet, SentencePiece byte pieces (``<0x0A>``) and ``▁`` spaces are
        spelled out; a control token is its own text."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self._byte_level is None:
            self._byte_level = "ByteLevel" in repr(self.tok.decoder)
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``parse_special_tokens=False`` the strings of special
        tokens (``<|im_start|>``, ...) are encoded as ordinary text, never as their ids;
        non-special added tokens still match, as in llama.cpp."""
        return self.with_bos(self.encoding(text, parse_special_tokens=parse_special_tokens).ids, add_bos)

    def encoding(self, text: str, *, parse_special_tokens: bool = True):
        """The `tokenizers` Encoding of ``text`` (ids and character offsets), no BOS.
        encode_batch releases the GIL while it works; encode holds it (a 780 KB prompt held
        it ~0.6 s), which would stall the event loop even from a worker thread."""
        tok = self.tok if parse_special_tokens else self.literal_tok()
        return tok.encode_batch([text], add_special_tokens=False)[0]

    def with_bos(self, ids: list[int], add_bos: bool | None = None) -> list[int]:
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def literal_tok(self) -> HFTokenizer:
        """A second copy of the tokenizer that splits special-token strings as text.
        ``encode_special_tokens`` is a flag of the whole object, so it is never flipped on
        the shared one: other threads may be encoding with it."""
        if self._literal_tok is None:
            with self._literal_lock:
                if self._literal_tok is None:
                    tok = HFTokenizer.from_str(self.tok.to_str())
                    tok.encode_special_tokens = True
                    self._literal_tok = tok
        return self._literal_tok

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ClientError("this model has no chat template; send a raw prompt", param="messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            # what Hugging Face's template environment adds: tojson that keeps non-ASCII and
            # '<' as they are (jinja's escapes them for HTML), and strftime_now (Llama 3's date)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=self.token(min(self.eos_token_ids)) if self.eos_token_ids else "",
            )
        except (TemplateError, TypeError) as exc:  # TypeError: e.g. tojson of a value the request left out
            raise ClientError(f"chat template failed: {exc}", param="messages") from None

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    parse_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template; control-token strings in
        content stay text unless ``parse_special_tokens`` (see :mod:`tokenloom.core.chat`)."""
        return encode_chat(self, messages, add_generation_prompt=add_generation_prompt,
                           parse_special_tokens=parse_special_tokens, tools=tools)

    # ---- builders ------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (byte-level BPE only)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        if pre in ("smollm", "starcoder", "refact", "default"):
            # llama.cpp's rule for these: every digit is its own pre-token, then GPT-2's regex.
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("gpt2", "gpt-2"):
            tok.pre_tokenizer = byte_level
        elif pre in ("llama3", "llama-bpe", "qwen2"):
            pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE)]
        tok.add_special_tokens(special)
        eos: set[int] = {i for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
                         if i is not None}
        return cls(tok, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=sorted(eos),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: Path, model_cfg: dict) -> Tokenizer:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tcfg = _read_json(path / "tokenizer_config.json")
        gcfg = _read_json(path / "generation_config.json")
        template = tcfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if template is None:  # processors' spelling: {"chat_template": "..."}
            template = _read_json(path / "chat_template.json").get("chat_template")

        def token_id(value) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        eos: set[int] = set()
        for src in (gcfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos.update(src if isinstance(src, list) else [src] if src is not None else [])
        if (t := token_id(tcfg.get("eos_token"))) is not None:
            eos.add(t)
        bos = model_cfg.get("bos_token_id")
        if bos is None:
            bos = token_id(tcfg.get("bos_token"))
        return cls(tok, bos_token_id=bos, eos_token_ids=sorted(eos), chat_template=template,
                   add_bos=bool(tcfg.get("add_bos_token", False)))


def _tojson(value, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _raise_template_error(message: str):
    raise TemplateError(message)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
