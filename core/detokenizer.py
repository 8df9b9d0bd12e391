"""Incremental detokenisation with stop strings.

Two rules: never emit a partial UTF-8 character (byte-level BPE splits characters
across tokens; the tokenizer decodes an incomplete tail as U+FFFD, which we hold back),
and never emit text that a stop string might still remove (the last
``len(longest stop) - 1`` characters are held back until they can no longer start one).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_PREFIX_TOKENS = 5  # decode a few tokens of context so spacing rules see a real left side


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_PREFIX_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # stable decoded output text (stop string cut off once found)
        self.stop = stop or []
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.stopped = False

    @property
    def needs_text(self) -> bool:
        """Whether stopping depends on the text (stop strings), not only on token ids."""
        return bool(self.stop)

    def add(self, token_id: int) -> bool:
        """Add one token; returns True when a stop string has been found."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop:
                return self._check_stop(max(0, start - self.holdback))
        return False

    def _check_stop(self, search_from: int) -> bool:
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def take_delta(self, final: bool) -> str:
        """Text that is now safe to emit (all of it when ``final``)."""
        upto = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
