"""The step every built-in decoder shares, and per-request decoder choice.

One step: the target model runs each sequence's scheduled tokens and the draft tokens the
scheduler let it verify (``Batch.draft_tokens``); :func:`verify` turns the logits into new
tokens by rejection sampling (exact); then each sequence's *proposer* sets
``seq.draft_token_ids`` for the next step, so the scheduler can reserve their KV slots.

The proposer is the request's own decoder (``SamplingParams.decoder``, else the engine's
configured one), so one batch mixes standard, n-gram and other sequences: they share the
forward and the verification and differ only in what they propose. A decoder named by a
request but not configured is built on first use with its default options.

Speculation switches itself off two ways, both counted in the stats: for a step, when more
than ``max_batch`` sequences sample in it (``skipped``: with a batch that large the forward
is compute-bound, and k extra rows per sequence cost more than the accepted tokens save);
and for a sequence, when its drafts stop being kept (``paused``: see :meth:`_pays`). The
first rule spares seeded requests: whether a sequence drafts changes which random draws
it makes, so a seeded request's tokens would otherwise depend on the batch around it. (So
does the scheduler dropping drafts for want of token budget or KV blocks.)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import structlog

from tokenloom.core.executor import UniprocExecutor
from tokenloom.core.interfaces import DecoderContext, DecoderOutput, SequenceOutput
from tokenloom.core.runner import ForwardOutput, HiddenRows
from tokenloom.core.sequence import Batch, Sequence, draft_depths
from tokenloom.plugins.decoders.verify import verify

log = structlog.get_logger("tokenloom.decoders")

#: drafts a sequence must keep per verifying step, on average, for drafting to go on
MIN_GAIN = 0.35
GAIN_PRIOR = 1.0  # the average a sequence starts (and restarts) from
GAIN_DECAY = 0.25  # weight of the latest step in the average
PAUSE_STEPS = 8  # plain steps before a paused sequence drafts again


class SharedStepDecoder:
    """Base of the built-in decoders: the shared :meth:`step`; subclasses override
    :meth:`propose` (and ``default_k``, ``max_batch``, ``needs_hidden``)."""

    name = "standard"
    default_k = 0
    max_batch = 1 << 30
    needs_hidden: HiddenRows = False  # True: the sampled rows' hidden states; "all": every row's (observe)

    def __init__(self, options, context: DecoderContext):
        self.options = options
        self.context = context
        self.runner = context.runner  # rank 0's: its sampler and model (the steps go through the executor)
        self.executor = context.executor or UniprocExecutor(context.runner)
        # Requests name decoders as the registry does: the configured one is this object.
        self._proposers: dict[str, SharedStepDecoder] = {self.name: self, context.config.decoder.name: self}
        self._counters: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(
            ("steps", "drafting_steps", "drafted", "accepted", "emitted", "skipped", "paused", "tree_steps"), 0))
        self._gain: dict[int, list] = {}
        # per decoder name, per depth d (index d - 1): steps whose drafts reached depth d with
        # the accepted branch at depth d - 1, and of those, steps that accepted depth d
        self._depth_counts: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        self.unavailable: dict[str, str] = dict(context.disabled_decoders)  # name -> why a request may not name it
        self._build_proposers(context.per_request_decoders)

    # ---- what a subclass changes ----------------------------------------------------
    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        """After a step: set ``seq.draft_token_ids`` for each of ``seqs`` (all of them this
        decoder's requests, each with an entry in ``outputs`` whose tokens are not yet in
        ``seq.token_ids``). ``standard`` proposes nothing."""
        for seq in seqs:
            seq.draft_token_ids = []

    def observe(self, batch: Batch, forward: ForwardOutput, result: DecoderOutput, seqs: list[Sequence]) -> None:
        """After every step that ran ``seqs`` (this decoder's requests in ``batch``, prompt
        chunks included, whether or not they propose next), before their new tokens join
        ``seq.token_ids``: a decoder with ``needs_hidden = "all"`` reads their rows'
        hidden states here (``forward.step_hidden``, ``forward.first_row``)."""

    def discard(self, seq: Sequence, output: SequenceOutput) -> None:
        """``seq`` verified ``output`` but proposes nothing next (paused or skipped): bring
        per-sequence state up to date anyway (a draft model rolls its KV back)."""

    def num_speculative_tokens(self, seq: Sequence) -> int:
        k = seq.params.num_speculative_tokens
        return self.default_k if k is None else k

    def draft_probs(self, seq: Sequence, k: int):
        """``[k, V]``: the distributions ``seq``'s first k drafts were drawn from, or ``None``
        when they were chosen deterministically (n-gram lookup, greedy drafting)."""
        return None

    def verify_drafts(self, forward: ForwardOutput, drafts: list[list[int]], draft_probs: list,
                      draft_parents: list | None = None) -> list[SequenceOutput]:
        """New tokens for each sampling sequence of ``forward`` (which ran ``drafts``, drawn
        from ``draft_probs``, as chains or trees): rejection sampling
        (plugins/decoders/verify.py). The engine's configured decoder verifies every
        sequence of the batch."""
        return verify(self.runner.sampler, forward.logits, forward.seqs, forward.num_rows, drafts, draft_probs,
                      draft_parents)

    def _move_accepted_branches(self, batch: Batch, index: dict, result: DecoderOutput) -> None:
        """A tree's accepted nodes wrote their KV to lookahead slots ``end + node``; they now
        hold positions ``end, end + 1, ...``: move their KV there before the next step."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.runner.block_size
        for seq, out in result.items():
            if not out.accepted_nodes:
                continue
            i = index[seq]
            table, end = batch.block_tables[i], seq.num_computed_tokens + batch.num_scheduled_tokens[i]
            for depth, node in enumerate(out.accepted_nodes):
                if node != depth:
                    a, b = end + node, end + depth
                    src.append(table[a // bs] * bs + a % bs)
                    dst.append(table[b // bs] * bs + b % bs)
        if src:
            self.executor.move_kv_slots(src, dst)

    def _build_proposers(self, names: tuple[str, ...]) -> None:
        """Build, with their default options, the decoders a request may name (at start-up, on
        the step thread: a draft model is never loaded inside a step). One that cannot be
        built (Medusa without heads, a decoder with its own step) is recorded in
        :attr:`unavailable` with the reason, and the engine refuses requests naming it."""
        quiet = dataclasses.replace(self.context, per_request_decoders=(), disabled_decoders={})
        for name in names:
            if name in self._proposers:
                continue
            try:
                built = self.context.plugin_manager.get("decoder", name).factory(None, quiet)
                if not isinstance(built, SharedStepDecoder):
                    raise TypeError(f"decoder {name!r} cannot be chosen per request: it does not share the step")
            except Exception as exc:  # noqa: BLE001 - one decoder that cannot be built must not stop the engine
                self.unavailable[name] = f"{type(exc).__name__}: {exc}"
                log.info("decoder_unavailable", decoder=name, reason=self.unavailable[name])
                continue
            self._proposers[name] = built

    # ---- the shared step ------------------------------------------------------------
    def proposer_for(self, seq: Sequence) -> SharedStepDecoder:
        """The request's decoder (built at start-up). A name it does not hold (the engine
        refuses those at submit) decodes plainly with this decoder: the same output, slower."""
        return self._proposers.get(seq.params.decoder or self.name, self)

    def step(self, batch: Batch) -> DecoderOutput:
        proposers = {seq: self.proposer_for(seq) for seq in batch.seqs}
        wants = {p.needs_hidden for p in proposers.values()}
        fwd = self.executor.forward(batch, return_hidden="all" if "all" in wants else True in wants)
        observers: dict[SharedStepDecoder, list[Sequence]] = defaultdict(list)
        if "all" in wants:
            for seq, p in proposers.items():
                if p.needs_hidden == "all":
                    observers[p].append(seq)
        if fwd.logits is None:
            for p, seqs in observers.items():
                p.observe(batch, fwd, {}, seqs)
            return {}
        index = {seq: i for i, seq in enumerate(batch.seqs)}
        drafts = [batch.draft_tokens[index[seq]] if batch.draft_tokens else [] for seq in fwd.seqs]
        parents = [batch.draft_parents[index[seq]] if batch.draft_parents else None for seq in fwd.seqs]
        qs = [proposers[seq].draft_probs(seq, len(d)) if d else None for seq, d in zip(fwd.seqs, drafts, strict=True)]
        outs = self.verify_drafts(fwd, drafts, qs, parents)
        result: DecoderOutput = dict(zip(fwd.seqs, outs, strict=True))
        for seq, out in result.items():
            if out.num_drafted:
                out.drafted_by = seq.drafted_by or proposers[seq].name
        self._move_accepted_branches(batch, index, result)
        for p, seqs in observers.items():
            p.observe(batch, fwd, result, seqs)
        by_proposer: dict[SharedStepDecoder, list[Sequence]] = defaultdict(list)
        for i, (seq, out) in enumerate(result.items()):
            proposer = proposers[seq]
            c = self._counters[proposer.name]
            c["steps"] += 1
            c["drafting_steps"] += out.num_drafted > 0
            c["drafted"] += out.num_drafted
            c["accepted"] += out.num_accepted
            c["emitted"] += len(out.token_ids)
            if out.num_drafted:
                self._count_depths(proposer.name, drafts[i], parents[i], out.num_accepted)
            if type(proposer).propose is SharedStepDecoder.propose:
                continue  # plain decoding: nothing to propose, no drafts to pause (the hot path)
            if not self._pays(seq, out):
                seq.draft_token_ids, seq.draft_parents = [], None
                proposer.discard(seq, out)
                c["paused"] += 1
                continue
            by_proposer[proposer].append(seq)
        for proposer, seqs in by_proposer.items():
            for seq in seqs:
                seq.draft_parents = None  # a proposer that drafts a tree sets it again
            if len(result) > proposer.max_batch:
                # A seeded request drafts regardless, so that its tokens never depend on
                # what else is in the batch (drafting changes which draws it makes).
                skip = [seq for seq in seqs if seq.params.seed is None]
                for seq in skip:
                    seq.draft_token_ids = []
                    proposer.discard(seq, result[seq])
                self._counters[proposer.name]["skipped"] += len(skip)
                seqs = [seq for seq in seqs if seq.params.seed is not None]
            if seqs:
                proposer.propose(seqs, result, fwd)
        for seq, out in list(result.items()):  # forks' first tokens (n > 1): after the proposers,
            if out.forks:                        # which only see the sequences the forward ran
                result.update(zip(seq.forks, out.forks, strict=True))
        return result

    def _count_depths(self, name: str, drafts: list[int], parents: list[int] | None, accepted: int) -> None:
        reached, kept = self._depth_counts[name]
        deepest = max(draft_depths(parents)) if parents is not None else len(drafts)
        if parents is not None:
            self._counters[name]["tree_steps"] += 1
        for d in range(1, deepest + 1):
            if len(reached) < d:
                reached.append(0)
                kept.append(0)
            if accepted >= d - 1:
                reached[d - 1] += 1
                kept[d - 1] += accepted >= d

    def depth_acceptance(self, name: str) -> list[float]:
        """Per depth d: how often the accepted branch reached depth d when it had reached d - 1
        and the drafts went that deep (a tree's acceptance, depth by depth)."""
        reached, kept = self._depth_counts.get(name, ([], []))
        return [k / r if r else 0.0 for r, k in zip(reached, kept, strict=True)]

    def _pays(self, seq: Sequence, out: SequenceOutput) -> bool:
        """Does drafting still pay for ``seq``? An exponential average of the drafts it
        accepts per verifying step; below ``MIN_GAIN`` (a verification step costs more
        than plain decoding, so a few drafts kept per step are needed to break even) the
        sequence pauses drafting for ``PAUSE_STEPS`` steps, then tries again."""
        g = self._gain.get(seq.seq_id)
        if g is None:
            g = self._gain[seq.seq_id] = [GAIN_PRIOR, 0]  # [average drafts kept per step, steps left paused]
        if g[1] > 0:
            g[1] -= 1
            if g[1] == 0:
                g[0] = GAIN_PRIOR  # probe again with a clean slate
            return g[1] == 0
        if out.num_drafted:
            g[0] += GAIN_DECAY * (out.num_accepted - g[0])
            if g[0] < MIN_GAIN:
                g[1] = PAUSE_STEPS
                return False
        return True

    def release(self, seq: Sequence) -> None:
        seq.draft_token_ids, seq.draft_parents = [], None
        self._gain.pop(seq.seq_id, None)
        self.runner.sampler.forget(seq.seq_id)
        for proposer in self._proposers.values():
            proposer.release_state(seq)

    def release_state(self, seq: Sequence) -> None:
        """Drop what this decoder keeps per sequence (a draft model's KV, ...)."""

    def extra_stats(self) -> dict[str, float]:
        """A decoder's own counters for :meth:`stats` (``auto``'s choices, ...), names prefixed."""
        return {}

    def model_bytes(self) -> int:
        """Bytes of the models this decoder loaded beside the target (a draft's weights and KV
        pool); 0: none."""
        return 0

    def stats(self) -> dict[str, float]:
        """Per decoder name, counted per sequence-step: steps, drafting_steps (steps that
        verified drafts), drafted, accepted, emitted, skipped (proposals switched off by batch
        size), paused (by a sequence's low acceptance), acceptance rate and mean tokens per step;
        and ``<name>_model_bytes`` for each decoder built here that loaded a model of its own."""
        out: dict[str, float] = {}
        for name, proposer in sorted(self._proposers.items()):
            if proposer.model_bytes():
                out[f"{name}_model_bytes"] = proposer.model_bytes()
        for proposer in {id(p): p for p in self._proposers.values()}.values():
            out.update(proposer.extra_stats())
        for name, c in sorted(self._counters.items()):
            for key, value in c.items():
                out[f"{name}_{key}"] = value
            if c["drafted"]:
                out[f"{name}_acceptance_rate"] = c["accepted"] / c["drafted"]
            if c["steps"]:
                out[f"{name}_tokens_per_step"] = c["emitted"] / c["steps"]
        return out
