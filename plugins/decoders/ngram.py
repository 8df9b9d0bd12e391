"""`ngram`: prompt-lookup decoding. The draft for the next step is whatever followed the
latest earlier occurrence of the sequence's last n tokens, in the prompt or the output
(Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` speculator): the longest n from
``prompt_lookup_max`` down to ``prompt_lookup_min`` that matches wins. It costs no model
at all, and pays off where the output copies its input: rewriting, summarising, editing
code, answering from a given passage. The drafts are verified exactly like any other
(plugins/decoders/verify.py), so the output distribution is the target's.
"""

from __future__ import annotations

import msgspec
import numpy as np

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput
from tokenloom.core.runner import ForwardOutput
from tokenloom.core.sampling_params import MAX_SPECULATIVE_TOKENS
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder


class NgramOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    num_speculative_tokens: int = 3  # K: draft tokens per step (3 + the last token = the 4-bit kernel tile)
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # shortest; 1 matches almost anywhere and drafts mostly noise
    max_batch: int = 8  # more sampling sequences than this in a step: no drafts (it would cost more)


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram of ``tokens`` (n from ``n_max`` down to ``n_min``); [] when none recurs."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        pattern = tokens[total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: its continuation is the most local
            return tokens[start:start + k].tolist()
    return []


class NgramDecoder(SharedStepDecoder):
    name = "ngram"

    def __init__(self, options: NgramOptions | None, context: DecoderContext):
        super().__init__(options, context)
        o = options or NgramOptions()
        if not 1 <= o.prompt_lookup_min <= o.prompt_lookup_max:
            raise ConfigError("decoder.prompt_lookup_min must be in 1..prompt_lookup_max, got "
                              f"{o.prompt_lookup_min}..{o.prompt_lookup_max}")
        if not 0 <= o.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"decoder.num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {o.num_speculative_tokens}")
        self.default_k, self.max_batch = o.num_speculative_tokens, o.max_batch
        self.n_max, self.n_min = o.prompt_lookup_max, o.prompt_lookup_min

    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        for seq in seqs:
            k = self.num_speculative_tokens(seq)
            tokens = np.asarray(seq.token_ids + outputs[seq].token_ids, dtype=np.int64)
            seq.draft_token_ids = lookup(tokens, k, self.n_max, self.n_min) if k else []


@hookimpl
def register_decoders(register):
    register("ngram", NgramDecoder, options=NgramOptions,
             description="prompt lookup: drafts copied from earlier in the sequence, verified exactly")
