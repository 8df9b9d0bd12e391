"""`auto`: per request and per step, the speculative decoder that pays.

- **n-gram** (prompt lookup) when the text being written copies what came before: a lookup
  hit, and the n-gram drafts of this request kept on average more tokens per step than an
  n-gram step costs over a plain one (``ms/step(ngram) / ms/step(none) - 1``, measured here;
  at least ``ngram_min_accepted``): a measured match rate against a measured price. Every
  request starts optimistic, and one whose lookups stop paying drifts back to trying them;
- **a model draft** otherwise, the faster of those available *and* only while it is measured
  to pay: the time per emitted token of its steps (the step's wall time over the tokens it
  emitted) against plain steps', all measured here as they run. The candidates: **EAGLE**
  when a draft for the model is found (plugins/decoders/eagle.py), and **speculative** (the
  engine's own model through the native 4-bit kernel drafting for it,
  plugins/decoders/speculative.py) when the target does not already run that kernel (a
  float32 or dense target: ``speculative = true`` loads it anyway, ``false`` never);
- **plain decoding** when neither pays or is available, when drafting stops paying for the
  request (the shared step's per-sequence pause) or when the batch is large (``max_batch``:
  a big batch is compute-bound and extra rows cost more than they save).

The timing: the wall time from one proposal's start to the next while the same sequences
run (the drafting, then the step that verifies it), counted for the mode those drafts came
from (``none`` for a step without drafts), an exponential average per mode of
milliseconds per emitted token. A mode with fewer than ``probe_steps`` timed steps is tried
first; a mode that lost is tried again for ``probe_steps`` steps every ``reprobe_steps``, so
the choice follows the machine, the dtype and the text.

A **seeded** request's choice depends on the request alone, never on timings taken from
other requests (drafting changes which random draws it makes, so its tokens would otherwise
depend on what ran before it): n-gram when its own match rate reaches
``ngram_min_accepted``, plain decoding otherwise, never a model draft.

Verification is the shared exact core, so every choice gives the target's distribution.
Each request's final message says which decoders drafted for it
(``metrics.drafted_by``: draft tokens per decoder).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import structlog

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput, SequenceOutput
from tokenloom.core.runner import ForwardOutput, HiddenRows
from tokenloom.core.sequence import Batch, Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder
from tokenloom.plugins.decoders.ngram import NgramDecoder, NgramOptions, lookup
from tokenloom.plugins.decoders.speculative import SpeculativeOptions

log = structlog.get_logger("tokenloom.decoders")

NGRAM_PRIOR = 1.5  # drafts kept per n-gram step a request starts from (optimistic: try it first)
DECAY = 0.3  # weight of the latest n-gram step in the average
RECOVER = 0.05  # per step without n-gram drafts, how far the average drifts back to the prior


class AutoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ngram_min_accepted: float = 0.1  # the least n-gram drafts kept per step (average) for n-gram to go on
    ngram_k: int = 3  # n-gram drafts per step
    eagle: bool = True  # use an EAGLE draft when one is found for the model (and it pays)
    # the engine's model in 4 bits as a draft (and when it pays); None: where the target does not
    # already run the native 4-bit kernel (a float32 or dense target), which is where it can pay
    speculative: bool | None = None
    draft_num_kv_blocks: int = 256  # the 4-bit draft's KV pool, in blocks
    probe_steps: int = 4  # timed steps a mode needs before it is judged
    reprobe_steps: int = 512  # steps after which a mode that lost is tried again
    max_batch: int = 4


class _Timing:
    """One mode's steps: exponential averages of milliseconds and tokens per step, and a count."""

    __slots__ = ("ms_per_step", "tokens_per_step", "steps")

    def __init__(self) -> None:
        self.ms_per_step = self.tokens_per_step = 0.0
        self.steps = 0

    def add(self, ms: float, tokens: float) -> None:
        self.steps += 1
        w = max(1.0 / self.steps, 0.1)  # the mean of the first ten (one slow first step does not decide), then 0.1
        self.ms_per_step += w * (ms - self.ms_per_step)
        self.tokens_per_step += w * (tokens - self.tokens_per_step)

    @property
    def ms_per_token(self) -> float:
        return self.ms_per_step / max(self.tokens_per_step, 1e-9)


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
        self.speculative: SharedStepDecoder | None = None
        if o.speculative or (o.speculative is None and not _target_runs_int4(context)):
            # (a draft pool for max_batch sequences, not the standalone decoder's 1,024 blocks)
            self.speculative = context.plugin_manager.get("decoder", "speculative").factory(
                SpeculativeOptions(draft_num_kv_blocks=o.draft_num_kv_blocks), quiet)
        #: the model drafts auto may choose between, by name
        self.drafters = {name: d for name, d in (("eagle", self.eagle), ("speculative", self.speculative))
                         if d is not None}
        self._drafter: str | None = next(iter(self.drafters), None)  # the model draft in use (or measured) now
        self.default_k, self.max_batch = o.ngram_k, o.max_batch
        self._choices: dict[int, _Choice] = {}
        self._chosen = {"ngram": 0, "eagle": 0, "speculative": 0, "none": 0}
        self._timing = {"eagle": _Timing(), "speculative": _Timing(), "ngram": _Timing(), "none": _Timing()}
        self._last: tuple[float, frozenset[int]] | None = None  # (when the last proposal ended, its sequences)
        self._since_probe = 0

    def _time_step(self, seqs: list[Sequence], outputs: DecoderOutput, now: float) -> None:
        """Charge the time since the last proposal began (that drafting, the step that verified
        it) to the mode those drafts came from, when the same sequences ran (no gap between
        requests, no other sequence's prefill)."""
        last, self._last = self._last, None
        if last is None or last[1] != frozenset(s.seq_id for s in seqs) or len(outputs) != len(seqs):
            return
        modes = {outputs[s].drafted_by or "none" for s in seqs}
        if len(modes) == 1 and (mode := modes.pop()) in self._timing:
            self._timing[mode].add(1e3 * (now - last[0]), sum(len(outputs[s].token_ids) for s in seqs) / len(seqs))

    def _ngram_threshold(self) -> float:
        """Drafts an n-gram step must keep to pay: what it costs over a plain step, measured."""
        ng, plain = self._timing["ngram"], self._timing["none"]
        if ng.steps < self.opts.probe_steps or plain.steps < self.opts.probe_steps:
            return self.opts.ngram_min_accepted
        return max(self.opts.ngram_min_accepted, ng.ms_per_step / plain.ms_per_step - 1.0)

    def _model_drafter(self) -> str | None:
        """The model draft worth trying this step, or None: while a mode (a draft, or plain
        decoding) is still being measured, the least measured one; then the fastest per token,
        if it is a draft; and the drafts again for a few steps every ``reprobe_steps``."""
        if not self.drafters:
            return None
        o = self.opts
        modes = [*self.drafters, "none"]
        timing = [self._timing[m] for m in modes]
        if min(t.steps for t in timing) < o.probe_steps:  # measure each, in turn
            least = min(modes, key=lambda m: self._timing[m].steps)
            return None if least == "none" else least
        self._since_probe += 1
        if self._since_probe >= o.reprobe_steps:  # measure all again: the text or the load may have changed
            self._since_probe = 0
            for t in timing:
                t.steps = min(t.steps, o.probe_steps // 2)
        best = min(modes, key=lambda m: self._timing[m].ms_per_token)
        return None if best == "none" else best

    @property  # type: ignore[override]
    def needs_hidden(self) -> HiddenRows:
        """Every row's hidden states while EAGLE drafts or is measured; none otherwise (its
        draft starts over from where it comes back)."""
        return "all" if self._drafter == "eagle" else False

    def draft_probs(self, seq: Sequence, k: int):
        """The model draft's distributions for the drafts it made (the speculative draft
        samples a sampled request's drafts); n-gram and EAGLE drafts are deterministic."""
        drafter = self.drafters.get(seq.drafted_by or "")
        return drafter.draft_probs(seq, k) if drafter is not None else None

    def observe(self, batch: Batch, forward: ForwardOutput, result: DecoderOutput, seqs: list[Sequence]) -> None:
        if self.eagle is not None:
            self.eagle.observe(batch, forward, result, seqs)

    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        began = time.perf_counter()
        self._time_step(seqs, outputs, began)
        to_model: list[Sequence] = []
        drafter = self._drafter = self._model_drafter()
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
            seeded = seq.params.seed is not None
            threshold = self.opts.ngram_min_accepted if seeded else self._ngram_threshold()
            if k and c.ngram >= threshold:
                tokens = np.asarray(seq.token_ids + out.token_ids, dtype=np.int64)
                drafts = lookup(tokens, k, self.ngram.n_max, self.ngram.n_min)
            if drafts:
                seq.draft_token_ids, seq.drafted_by = drafts, "ngram"
                self._chosen["ngram"] += 1
            elif drafter is not None and not seeded:
                to_model.append(seq)
                continue
            else:
                self._chosen["none"] += 1
            if out.drafted_by == "speculative" and self.speculative is not None:
                self.speculative.discard(seq, out)  # its draft's KV back to what the target kept
        # a speculative draft's first proposal for a request feeds it the whole context: a
        # one-off cost per request that would make a few timed steps judge it
        untimed = self.speculative is not None and drafter == "speculative" and any(
            self.speculative.fresh(s) for s in to_model)
        if to_model and drafter is not None:
            self.drafters[drafter].propose(to_model, outputs, forward)
            for seq in to_model:
                seq.drafted_by = drafter if seq.draft_token_ids else None
                self._chosen[drafter if seq.draft_token_ids else "none"] += 1
        self._last = None if untimed else (began, frozenset(s.seq_id for s in seqs))

    def discard(self, seq: Sequence, output: SequenceOutput) -> None:
        if output.drafted_by == "speculative" and self.speculative is not None:
            self.speculative.discard(seq, output)
        seq.drafted_by = None

    def release_state(self, seq: Sequence) -> None:
        self._choices.pop(seq.seq_id, None)
        for drafter in self.drafters.values():
            drafter.release_state(seq)

    def model_bytes(self) -> int:
        return sum(d.model_bytes() for d in self.drafters.values())

    def extra_stats(self) -> dict[str, float]:
        out: dict[str, float] = {f"auto_chose_{name}": n for name, n in self._chosen.items()}
        for mode, t in self._timing.items():
            if t.steps:
                out[f"auto_{mode}_ms_per_token"] = round(t.ms_per_token, 3)
                out[f"auto_{mode}_ms_per_step"] = round(t.ms_per_step, 3)
        return out


def _target_runs_int4(context: DecoderContext) -> bool:
    """Does the target's first matmul already run the native 4-bit kernel (the speculative
    draft's own)? Then a 4-bit copy of it as a draft costs a step and saves nothing. An
    unknown model says yes (auto then loads no draft model for it)."""
    layers = getattr(context.runner.model, "linear_layers", None)
    if layers is None:
        return True
    return str(getattr(layers()[0].get("qkv"), "kernel", "")).startswith(("int4pack_mm", "quant_matmul int4"))


@hookimpl
def register_decoders(register):
    register("auto", AutoDecoder, options=AutoOptions,
             description="n-gram where the text copies its context, a model draft (EAGLE, or this model in "
                         "4 bits) otherwise, plain decoding where neither pays; verified exactly")
