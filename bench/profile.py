"""`tokenloom bench decode --profile`: where a decode step's time goes.

Runs ``steps`` decode steps of ``batch_size`` sequences straight through the decoder, on the
engine's own torch thread (the one the engine steps on), under torch.profiler, and reports
the top ops by self time and the share spent in the weight matmuls — the part the weight
format decides — against everything else (attention, norms, casts, dispatch, Python). The
C++ ops of kernels/cpu_ops.py record themselves as ``tokenloom::...``; the captured step's
own self time (``tokenloom::decode_step``) is the glue between its ops.
"""

from __future__ import annotations

import time

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Batch, Sequence

# Ops that multiply by model weights (one per linear kernel the torch backend can choose).
WEIGHT_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_weight_int4pack_mm_for_cpu",
                     "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "tokenloom::quant_matmul",
                     "tokenloom::amx_matmul")


def profile_decode(llm, batch_size: int, prompt_len: int, steps: int = 20, top: int = 12) -> dict:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    seqs = [Sequence(f"profile-{i}", [(17 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)],
                     SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)) for i in range(batch_size)]
    cache = engine.cache
    for s in seqs:
        if not cache.allocate(s, prompt_len + steps + 2):
            raise RuntimeError(f"{batch_size} x {prompt_len + steps} tokens do not fit the KV cache")

    def run() -> dict:
        from torch.profiler import ProfilerActivity, profile

        engine.executor.forward(Batch(seqs, [prompt_len] * batch_size, [cache.block_table(s) for s in seqs]))
        for s in seqs:
            s.num_computed_tokens = prompt_len
            s.append_token(7)

        def step():
            engine.decoder.step(Batch(seqs, [1] * batch_size, [cache.block_table(s) for s in seqs]))
            for s in seqs:
                s.num_computed_tokens += 1
                s.append_token(7)

        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        matmul = sum(e.self_cpu_time_total for e in events if e.key in WEIGHT_MATMUL_OPS)
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        return {"batch_size": batch_size, "steps": steps, "ms_per_step": total / steps / 1e3,
                "wall_ms_per_step": wall / steps * 1e3,
                "weight_matmul_share": matmul / total if total else 0.0,
                "top": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / steps / 1e3, "calls_per_step":
                         e.count / steps, "share": e.self_cpu_time_total / total} for e in rows]}

    try:
        return engine.call_in_step_thread(run)
    finally:
        for s in seqs:
            cache.free(s)
            engine.decoder.release(s)


def format_profile(p: dict) -> str:
    lines = [f"profile: batch {p['batch_size']}, {p['steps']} decode steps, {p['ms_per_step']:.2f} ms/step of op "
             f"time ({p['wall_ms_per_step']:.2f} ms/step wall, profiler on); weight matmuls {100 * p['weight_matmul_share']:.0f}%, everything else "
             f"{100 * (1 - p['weight_matmul_share']):.0f}%", "",
             "| op | ms/step | calls/step | share |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['op']} | {r['ms_per_step']:.3f} | {r['calls_per_step']:.0f} | {100 * r['share']:.1f}% |"
              for r in p["top"]]
    return "\n".join(lines)
