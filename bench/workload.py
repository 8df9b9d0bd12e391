"""Seeded synthetic workloads as token ids, so every system sees identical prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int = 0, token_range: tuple[int, int] = (200, 40000)) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges; ordinary (non-special)
    token ids, so prompts look like text to a byte-level BPE model."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {lo}..{hi}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        out.append(BenchRequest([rng.randrange(*token_range) for _ in range(n)], rng.randint(*output_len)))
    return out


def token_range_for(vocab_size: int) -> tuple[int, int]:
    """Ordinary token ids of a vocabulary: skip the first ids (specials, bytes) when it is large."""
    return min(200, vocab_size // 2), min(40000, vocab_size)


def parse_range(text: str) -> tuple[int, int]:
    """``"32-512"`` -> (32, 512); ``"128"`` -> (128, 128)."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)
