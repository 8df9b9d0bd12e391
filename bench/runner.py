"""Run a workload through one engine and collect what the field reports."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from tokenloom.bench.stats import summarize
from tokenloom.bench.workload import BenchRequest
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.outputs import Finished
from tokenloom.core.sampling_params import SamplingParams


@dataclass
class StepRecorder:
    """Observer plugin: keeps every step's stats (decode-only steps give decode speed)."""

    steps: list = field(default_factory=list)

    @hookimpl
    def step_finished(self, stats):
        self.steps.append(stats)

    def decode_rate(self) -> float:
        """Tokens per second over steps that only decoded (llama-batched-bench's S_TG)."""
        pure = [s for s in self.steps if s.num_prefill_tokens == 0 and s.num_decode_seqs]
        busy = sum(s.step_time_ms for s in pure) / 1e3
        return sum(s.num_generated_tokens for s in pure) / busy if busy else 0.0


async def _run(engine, workload: list[BenchRequest]) -> tuple[list[Finished], float]:
    async def one(req: BenchRequest) -> Finished:
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        final = None
        async for item in engine.generate(req.prompt_token_ids, params):
            if isinstance(item, Finished):
                final = item
        return final

    t0 = time.perf_counter()
    finals = await asyncio.gather(*(one(r) for r in workload))
    return list(finals), time.perf_counter() - t0


def run_workload(llm, workload: list[BenchRequest], recorder: StepRecorder) -> dict:
    recorder.steps.clear()
    finals, elapsed = llm.run(_run(llm.engine, workload))
    out_tokens = sum(f.usage.completion_tokens for f in finals)
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    steps = recorder.steps
    return {
        "requests": len(finals),
        "failed": sum(f.finish_reason not in ("stop", "length") for f in finals),
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + prompt_tokens) / elapsed,
        "decode_tok_s": recorder.decode_rate(),
        "ttft_ms": summarize([f.metrics.ttft_ms for f in finals]),
        "tpot_ms": summarize([f.metrics.tpot_ms for f in finals]),
        "itl_ms": summarize([x for f in finals for x in f.metrics.itl_ms]),
        "e2e_ms": summarize([f.metrics.e2e_ms for f in finals]),
        "peak_kv_usage": max((s.kv_usage for s in steps), default=0.0),
        "peak_running": max((s.num_running for s in steps), default=0),
        "preemptions": sum(s.num_preempted for s in steps),
        "steps": len(steps),
    }


def isolated(fn, *args):
    """``fn(*args)`` in a fresh process (spawned: no inherited torch threads or memory); a
    crash there, SIGILL included, raises here (BrokenProcessPool) instead of ending the run."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
