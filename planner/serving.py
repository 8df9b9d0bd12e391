"""Serving defaults: the continuous schedulers' ``max_num_seqs`` and ``max_num_batched_tokens``
when the config leaves them at 0 (auto), chosen from the KV pool actually allocated and the
machine. Nothing heavy is imported here: the engine (core/build.py) and the schedulers use it.

- ``max_num_seqs``: how many requests of min(:data:`TYPICAL_REQUEST_TOKENS`, max_model_len)
  tokens the pool holds whole (``tokenloom plan``'s "paged" count), capped by the machine:
  :data:`CPU_SEQS_PER_CORE` per torch thread on a CPU, :data:`GPU_MAX_NUM_SEQS` on a GPU.
  A pool that holds 10 such requests does not admit 64 and preempt them as they grow.
- ``max_num_batched_tokens``: :data:`CPU_STEP_TOKENS` on a CPU, :data:`GPU_STEP_TOKENS` on a
  GPU, and never fewer than ``max_num_seqs`` (every running sequence decodes each step); with
  chunked prefill off, at least ``max_model_len`` (a prompt runs whole or is refused).

The engine resolves them at start-up (core/build.py, where the pool and max_model_len are
known) and logs them; ``tokenloom plan`` prints the same figures. The constants and the
measurement behind them are in docs/configuration.md#serving-defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the request a pool is sized in (prompt + output): a chat turn. A longer one grows its blocks
#: as it goes and is preempted (recomputed later) if the pool runs out; sizing for 1024 held
#: the default pool to 45 running on this 2-core CPU, where 64 serve 10-18% more tokens a second
TYPICAL_REQUEST_TOKENS = 512
#: CPU: running sequences per torch thread. Measured on a 2-core EPYC (docs/configuration.md
#: #serving-defaults): 64 streams served 586-600 output tok/s with 64 running, 497-538 with 32
CPU_SEQS_PER_CORE = 32
#: CPU: tokens per step (a prefill chunk beside the decodes), vLLM's CPU server default too.
#: Placed on a 2-core AMX Xeon (docs/configuration.md#serving-defaults): 64 requests at once,
#: output tok/s 745-754 at 256, 773-813 at 512, 831-854 at 1024, 846-903 at 2048, 838-887 at
#: 4096; fewer, larger chunks also lowered mean TTFT and TPOT there
CPU_STEP_TOKENS = 2048
#: GPU: vLLM's default sequence cap and its online-serving token budget (not measured here)
GPU_MAX_NUM_SEQS = 256
GPU_STEP_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ServingDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    seqs_reason: str  # why, in words: "KV pool holds 45 x 512-token requests" / "cap: 32 x 2 cores"
    tokens_reason: str

    def reason(self, key: str) -> str:
        return self.seqs_reason if key == "max_num_seqs" else self.tokens_reason


#: the options 0 leaves to this rule, in any scheduler options struct that has them
AUTO_OPTIONS = ("max_num_seqs", "max_num_batched_tokens")


def serving_defaults(*, num_blocks: int, block_size: int, max_model_len: int | None, device_type: str,
                     cores: int, chunked_prefill: bool = True) -> ServingDefaults:
    """The rule in the module docstring. ``max_model_len`` None: unknown (a scheduler built
    outside the engine), the typical request is then :data:`TYPICAL_REQUEST_TOKENS`.
    ``device_type``: ``cuda`` (or any GPU kind) or ``cpu``; ``cores``: torch's threads."""
    request = min(TYPICAL_REQUEST_TOKENS, max_model_len) if max_model_len else TYPICAL_REQUEST_TOKENS
    per_request = -(-request // block_size)
    fit = num_blocks // per_request
    gpu = device_type != "cpu"
    cap, cap_why = (GPU_MAX_NUM_SEQS, f"the GPU cap {GPU_MAX_NUM_SEQS}") if gpu else \
        (CPU_SEQS_PER_CORE * max(1, cores), f"the CPU cap {CPU_SEQS_PER_CORE} x {max(1, cores)} threads")
    pool = f"KV pool holds {num_blocks * block_size} tokens = {fit} x {request}-token requests"
    if fit >= cap:
        seqs, seqs_why = cap, f"{cap_why}; {pool}"
    else:
        seqs, seqs_why = max(1, fit), pool
    step = GPU_STEP_TOKENS if gpu else CPU_STEP_TOKENS
    tokens, tokens_why = step, f"the {'GPU' if gpu else 'CPU'} step size"
    if seqs > tokens:
        tokens, tokens_why = seqs, "one decode token per running sequence"
    if not chunked_prefill and max_model_len and max_model_len > tokens:
        tokens, tokens_why = max_model_len, "max_model_len: chunked prefill is off, a prompt runs whole"
    return ServingDefaults(seqs, tokens, seqs_why, tokens_why)


def resolve_auto(options, num_blocks: int, block_size: int, *, max_model_len: int | None, device_type: str,
                 cores: int):
    """``options`` (a scheduler's options struct, or None) with its :data:`AUTO_OPTIONS` that
    are 0 replaced by :func:`serving_defaults` for a pool of ``num_blocks`` x ``block_size``,
    and a line saying what is in force and why (None when nothing was auto: the user set
    both, or the struct has neither field, like `static`'s)."""
    import msgspec

    auto = [k for k in AUTO_OPTIONS if getattr(options, k, None) == 0]
    if not auto:
        return options, None
    chosen = serving_defaults(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                              device_type=device_type, cores=cores,
                              chunked_prefill=getattr(options, "enable_chunked_prefill", True))
    options = msgspec.structs.replace(options, **{k: getattr(chosen, k) for k in auto})
    return options, ", ".join(f"{k}={getattr(options, k)} ({chosen.reason(k) if k in auto else 'set in the config'})"
                              for k in AUTO_OPTIONS if hasattr(options, k))
