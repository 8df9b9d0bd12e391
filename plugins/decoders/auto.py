"""`auto`: per request and per step, the speculative decoder that pays.

- **n-gram** (prompt lookup) when the text being written copies what came before: a lookup
  hit, and the n-gram drafts of this request kept on average at least
  ``ngram_min_accepted`` tokens per step (a measured match rate; every request starts
  optimistic and a request whose lookups stop paying drifts back to trying them slowly);
- **EAGLE** otherwise, when a draft for the model is found (plugins/decoders/eagle.py);
- **plain decoding** when neither is available, or when drafting stops paying for the
  request (the shared step's per-sequence pause) or the batch is large (``max_batch``: a
  big batch is compute-bound and extra rows cost more than they save).

Verification is the shared exact core, so every choice gives the target's distribution.
Each request's final message says which decoders drafted for it
(``metrics.drafted_by``: draft tokens per decoder).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec
import numpy as np
import structlog

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput, SequenceOutput
from tokenloom.core.runner import ForwardOutput
from tokenloom.core.sequence import Batch, Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder
from tokenloom.plugins.decoders.ngram import NgramDecoder, NgramOptions, lookup

log = structlog.get_logger("tokenloom.decoders")

NGRAM_PRIOR = 1.5  # drafts kept per n-gram step a request starts from (optimistic: try it first)
DECAY = 0.3  # weight of the latest n-gram step in the average
RECOVER = 0.05  # per step without n-gram drafts, how far the average drifts back to the prior


class AutoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ngram_min_accepted: float = 1.0  # n-gram drafts kept per step (average) for n-gram to go on
    ngram_k: int = 3  # n-gram drafts per step
    eagle: bool = True  # use an EAGLE draft when one is found for the model
    max_batch: int = 4


@dataclass(slots=True)
class _Choice:
    ngram: float = NGRAM_PRIOR  # average drafts kept per n-gram step


class AutoDecoder(SharedStepDecoder):
    name = "auto"

    def __init__(self, options: AutoOptions | None, context: DecoderContext):
        super().__init__(options, context)
        o = self.opts = options or AutoOptions()
        if o.ngram_min_accepted < 0:
            raise ConfigError(f"decoder.ngram_min_accepted must be >= 0, got {o.ngram_min_accepted}")
        quiet = dataclasses.replace(context, per_request_decoders=(), disabled_decoders={})
        self.ngram = NgramDecoder(NgramOptions(num_speculative_tokens=o.ngram_k), quiet)
        self.eagle: SharedStepDecoder | None = None
        self.eagle_unavailable = "decoder.eagle = false"
        if o.eagle:
            try:
                self.eagle = context.plugin_manager.get("decoder", "eagle").factory(None, quiet)
                self.eagle_unavailable = ""
            except Exception as exc:  # noqa: BLE001 - no draft for this model: auto goes on without EAGLE
                self.eagle_unavailable = f"{type(exc).__name__}: {exc}"
                log.info("auto_without_eagle", reason=self.eagle_unavailable)
        self.needs_hidden = "all" if self.eagle is not None else False
        self.default_k, self.max_batch = o.ngram_k, o.max_batch
        self._choices: dict[int, _Choice] = {}
        self._chosen = {"ngram": 0, "eagle": 0, "none": 0}

    def observe(self, batch: Batch, forward: ForwardOutput, result: DecoderOutput, seqs: list[Sequence]) -> None:
        if self.eagle is not None:
            self.eagle.observe(batch, forward, result, seqs)

    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        to_eagle = []
        for seq in seqs:
            out = outputs[seq]
            c = self._choices.setdefault(seq.seq_id, _Choice())
            if out.num_drafted and out.drafted_by == "ngram":
                c.ngram += DECAY * (out.num_accepted - c.ngram)
            else:
                c.ngram += RECOVER * (NGRAM_PRIOR - c.ngram)
            seq.draft_token_ids, seq.draft_parents, seq.drafted_by = [], None, None
            k = self.num_speculative_tokens(seq)
            drafts: list[int] = []
            if k and c.ngram >= self.opts.ngram_min_accepted:
                tokens = np.asarray(seq.token_ids + out.token_ids, dtype=np.int64)
                drafts = lookup(tokens, k, self.ngram.n_max, self.ngram.n_min)
            if drafts:
                seq.draft_token_ids, seq.drafted_by = drafts, "ngram"
                self._chosen["ngram"] += 1
            elif self.eagle is not None:
                to_eagle.append(seq)
            else:
                self._chosen["none"] += 1
        if to_eagle and self.eagle is not None:
            self.eagle.propose(to_eagle, outputs, forward)
            for seq in to_eagle:
                seq.drafted_by = "eagle" if seq.draft_token_ids else None
                self._chosen["eagle" if seq.draft_token_ids else "none"] += 1

    def discard(self, seq: Sequence, output: SequenceOutput) -> None:
        seq.drafted_by = None

    def release_state(self, seq: Sequence) -> None:
        self._choices.pop(seq.seq_id, None)
        if self.eagle is not None:
            self.eagle.release_state(seq)

    def model_bytes(self) -> int:
        return self.eagle.model_bytes() if self.eagle is not None else 0

    def extra_stats(self) -> dict[str, float]:
        return {f"auto_chose_{name}": n for name, n in self._chosen.items()}


@hookimpl
def register_decoders(register):
    register("auto", AutoDecoder, options=AutoOptions,
             description="n-gram where the text copies its context, EAGLE otherwise, plain decoding where "
                         "neither pays; verified exactly")
