"""`standard`: one forward pass, one sampled token per sequence that reached its end."""

from __future__ import annotations

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext
from tokenloom.core.sequence import Batch, Sequence


class StandardOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StandardDecoder:
    def __init__(self, options: StandardOptions | None, context: DecoderContext):
        self.runner = context.runner

    def step(self, batch: Batch) -> dict[Sequence, list[int]]:
        logits, seqs = self.runner.forward(batch)
        if logits is None:
            return {}
        tokens, logprobs = self.runner.sampler(logits, seqs)
        for seq, lp in zip(seqs, logprobs, strict=True):
            seq.new_logprobs = [lp] if lp is not None else None
        return {seq: [tok] for seq, tok in zip(seqs, tokens, strict=True)}

    def release(self, seq: Sequence) -> None:
        self.runner.sampler.forget(seq)


@hookimpl
def register_decoders(register):
    register("standard", StandardDecoder, options=StandardOptions,
             description="one forward pass per step, one token per sequence")
