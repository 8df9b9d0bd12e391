"""`speculative`: a draft model proposes, the target verifies (Leviathan et al. 2023; Chen et
al. 2023). The draft is a second checkpoint with the same tokenizer — by default the
engine's own model through the native 4-bit kernel, or its first ``draft_num_layers``
layers — loaded with its own KV pool and cache manager (``DecoderContext.load_model``).

After each target step, for every sequence of this decoder: the draft catches up on the
tokens it has not seen (the prompt at first, then the step's new tokens) in one forward,
then drafts K tokens one at a time, each drawn from the draft's distribution under the
request's own sampling parameters (greedy requests take the draft's argmax). Those
distributions ``q`` go to verification, which keeps the output exactly the target's.

The draft's KV stays valid for the prefix both models agree on: after a step that accepted
``a`` of K drafts, the draft keeps its KV for the old tokens plus ``min(a, K - 1)`` drafts
(the last draft was never fed to it) and recomputes from there.

**Adaptive K**: per sequence, K grows by one after a step that accepted every draft and
shrinks by one after a step that accepted fewer than half (within 1..``max_k``; a request's
``num_speculative_tokens`` fixes it instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput
from tokenloom.core.runner import ForwardOutput
from tokenloom.core.sampler import SamplingRow
from tokenloom.core.sampling_params import MAX_SPECULATIVE_TOKENS
from tokenloom.core.sequence import Batch, Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder
from tokenloom.plugins.decoders.verify import draw, target_probs


class SpeculativeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    draft_model: str | None = None  # default: the engine's own model
    draft_quantizer: str | None = "gguf"  # the draft's weights: the native 4-bit kernel by default
    draft_dtype: str = "auto"
    draft_num_layers: int | None = None  # keep only the first N layers (a truncated draft)
    draft_num_kv_blocks: int = 1024
    num_speculative_tokens: int = 4  # K to start from
    max_k: int = 8
    adaptive: bool = True
    max_batch: int = 4


@dataclass(eq=False, slots=True)
class _DraftState:
    shadow: Sequence  # the draft's view: its tokens and how many have KV in the draft pool
    k: int
    probs: torch.Tensor | None = None  # [K, V] the last proposal's draft distributions
    num_drafted: int = 0


class SpeculativeDecoder(SharedStepDecoder):
    name = "speculative"

    def __init__(self, options: SpeculativeOptions | None, context: DecoderContext):
        super().__init__(options, context)
        o = options or SpeculativeOptions()
        if not 1 <= o.num_speculative_tokens <= o.max_k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"decoder.num_speculative_tokens and max_k must satisfy 1 <= K <= max_k <= "
                              f"{MAX_SPECULATIVE_TOKENS}, got {o.num_speculative_tokens} and {o.max_k}")
        if context.load_model is None:
            raise ConfigError("decoder 'speculative' needs DecoderContext.load_model to load its draft model")
        self.draft = context.load_model(model=o.draft_model, quantizer=o.draft_quantizer, dtype=o.draft_dtype,
                                        num_kv_blocks=o.draft_num_kv_blocks, num_layers=o.draft_num_layers)
        if self.draft.runner.cfg.vocab_size != context.model_config.vocab_size:
            raise ConfigError(f"draft model {self.draft.name!r} has a vocabulary of {self.draft.runner.cfg.vocab_size}"
                              f" tokens, the target {context.model_config.vocab_size}: they must share a tokenizer")
        self.default_k, self.max_k, self.adaptive, self.max_batch = (o.num_speculative_tokens, o.max_k, o.adaptive,
                                                                      o.max_batch)
        self.generator = torch.Generator(device=self.draft.runner.device).manual_seed(context.config.engine.seed + 7)
        self._seq_generators: dict[int, torch.Generator] = {}
        self._states: dict[int, _DraftState] = {}

    # ---- per sequence -----------------------------------------------------------------
    def model_bytes(self) -> int:
        return self.draft.memory_bytes

    def _state(self, seq: Sequence) -> _DraftState:
        st = self._states.get(seq.seq_id)
        if st is None:
            shadow = Sequence(seq.request_id, [], seq.params, num_prompt_tokens=seq.num_prompt_tokens)
            st = self._states[seq.seq_id] = _DraftState(shadow, self.num_speculative_tokens(seq) or self.default_k)
        return st

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:  # a stream of its own, apart from the one verification draws from
            gen = torch.Generator(device=self.draft.runner.device).manual_seed((seq.params.seed + 0x5EED) % 2**63)
            self._seq_generators[seq.seq_id] = gen
        return gen

    def release_state(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.draft.cache.free(st.shadow)
        self._seq_generators.pop(seq.seq_id, None)

    def fresh(self, seq: Sequence) -> bool:
        """Whether ``seq`` has no draft state yet: its next proposal first runs its whole
        context through the draft (``auto`` leaves that step out of its timings)."""
        return seq.seq_id not in self._states

    def draft_probs(self, seq: Sequence, k: int):
        st = self._states.get(seq.seq_id)
        if st is None or st.probs is None or seq.params.greedy:
            return None
        return st.probs[:k]

    def _sync(self, seq: Sequence, out) -> _DraftState:
        """After a step: adapt K, roll the draft's KV back to the prefix both models agree on,
        and make the shadow's tokens the sequence's (with this step's new ones)."""
        st = self._state(seq)
        if out.num_drafted and self.adaptive and seq.params.num_speculative_tokens is None:
            if out.num_accepted == out.num_drafted == st.num_drafted:  # all it proposed, kept
                st.k = min(st.k + 1, self.max_k)
            elif out.num_accepted * 2 < out.num_drafted:
                st.k = max(st.k - 1, 1)
        if st.num_drafted:  # proposed last time (verified, or dropped by the scheduler)
            # Draft KV stays valid for the old tokens and the accepted drafts it was fed
            # (all but the last draft were).
            st.shadow.num_computed_tokens = min(st.shadow.num_computed_tokens,
                                                seq.num_tokens + min(out.num_accepted, st.num_drafted - 1))
        tokens = seq.token_ids + out.token_ids
        st.shadow.token_ids = list(tokens)
        st.shadow.num_computed_tokens = min(st.shadow.num_computed_tokens, len(tokens) - 1)
        st.probs, st.num_drafted = None, 0
        return st

    def discard(self, seq: Sequence, output) -> None:
        self._sync(seq, output)

    # ---- proposing ----------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        active: list[tuple[Sequence, _DraftState, int]] = []
        for seq in seqs:
            seq.draft_token_ids = []
            out = outputs[seq]
            st = self._sync(seq, out)
            tokens = list(st.shadow.token_ids)
            k = min(self.num_speculative_tokens(seq) if seq.params.num_speculative_tokens is not None else st.k,
                    seq.max_len - len(tokens) - 1)
            if k <= 0:
                continue
            if not self.draft.cache.allocate(st.shadow, len(tokens) - st.shadow.num_computed_tokens, num_lookahead=k):
                continue  # the draft pool is full: this sequence decodes plainly this time
            active.append((seq, st, k))
        if not active:
            return
        runner, cache = self.draft.runner, self.draft.cache
        probs: dict[int, list[torch.Tensor]] = {st.shadow.seq_id: [] for _, st, _ in active}
        live = list(active)
        first = True
        while live:
            shadows = [st.shadow for _, st, _ in live]
            n = [len(s.token_ids) - s.num_computed_tokens for s in shadows] if first else [1] * len(live)
            fwd = runner.forward(Batch(shadows, n, [cache.block_table(s) for s in shadows]))
            rows = torch.tensor([sum(fwd.num_rows[:i]) for i in range(len(live))], device=fwd.logits.device)
            logits = fwd.logits[rows]
            q = target_probs(runner.sampler, logits, [SamplingRow.of(s) for s in shadows])
            still = []
            for i, (seq, st, k) in enumerate(live):
                s = st.shadow
                s.num_computed_tokens += n[i]
                tok = int(q[i].argmax()) if seq.params.greedy else draw(q[i], self._generator(seq))
                probs[s.seq_id].append(q[i])
                s.token_ids.append(tok)
                seq.draft_token_ids.append(tok)
                if len(seq.draft_token_ids) < k:
                    still.append((seq, st, k))
            live, first = still, False
        for seq, st, _ in active:
            st.probs = torch.stack(probs[st.shadow.seq_id])
            st.num_drafted = len(seq.draft_token_ids)
            del st.shadow.token_ids[len(seq.token_ids) + len(outputs[seq].token_ids):]  # drafts are not tokens yet


@hookimpl
def register_decoders(register):
    register("speculative", SpeculativeDecoder, options=SpeculativeOptions, loads_model=True,
             description="a draft model (default: this model, 4-bit) proposes K tokens, verified exactly")

