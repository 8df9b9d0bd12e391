"""`tokenloom bench slo`: latency targets under a mixed load, `continuous` against `slo`.

The workload (seeded, identical for every scheduler): ``--batch-concurrency`` lanes each
keep one long best-effort job running (a long prompt, a long output, class ``batch``, no
targets), one after another, while interactive requests (short prompts and outputs, class
``interactive``, targets ``--ttft-ms`` and ``--tpot-ms``) arrive as a Poisson process at
``--rate`` per second for ``--duration`` seconds. When the last interactive request has
finished, the batch jobs still running are aborted and the run ends. Each scheduler runs in
its own freshly spawned process (same threads, dtype and model: only the scheduler differs),
after a short warm-up that also gives `slo` its first step times.

Reported per scheduler: goodput (finished requests that met all their targets, per second
of the run; a batch job has none, so it counts when it finishes), per class the share that
met the TTFT target, the TPOT target and both, TTFT and TPOT p50/p99, and output tok/s (every
generated token, aborted batch jobs' included). TTFT and TPOT are the engine's own per-request
measurements (arrival to first token; mean gap after it).

How the targets are chosen. They must sit between what a request gets when it is scheduled
at once and what it gets behind a long prompt's chunks, and on this 2-core machine a step's
cost moves by an order of magnitude with what else shares the cores (measured in this
session, alone / beside two busy processes: a 512-token chunk 0.37 s / 2-3.6 s, a decode step
of a few sequences 7-12 ms / 70-250 ms). So unless ``--ttft-ms`` and ``--tpot-ms`` are given,
the first scheduler's process, after its warm-up, measures plain steps: one full chunk (C),
a 40-token prefill, and a decode step of the workload's decode set (the batch lanes at their
shortest prompt's context plus two short sequences: d). Then TTFT = C: a request that waits
behind one full chunk of a batch prompt, then runs its own prefill, misses it, while one
admitted at once, after at most half of C for the step in flight (the `slo` scheduler's
arrival guard), meets it. And TPOT = 3 x d: a stream meets it when decode steps are plain, and
misses when most of a batch prompt's chunks land within its 16-48 tokens (each adds
C / n to a stream of n tokens). Both schedulers then get these same targets; the table says
what was measured.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from dataclasses import dataclass

from tokenloom.bench.runner import isolated
from tokenloom.bench.stats import percentile
from tokenloom.bench.workload import parse_range, token_range_for
from tokenloom.core.config import merge_layers
from tokenloom.core.outputs import Finished
from tokenloom.core.plugins import PluginManager

COUNTED = ("stop", "length")  # finished requests; aborted batch jobs (the run ended) are not


@dataclass(frozen=True, slots=True)
class SloRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    slo_class: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    arrival_s: float = 0.0  # from the start of the run (interactive requests)


def make_slo_workload(opts: dict, vocab_size: int) -> tuple[list[SloRequest], list[SloRequest]]:
    """(interactive requests in arrival order, batch jobs in lane order), from ``opts['seed']``."""
    rng = random.Random(opts["seed"])
    lo, hi = token_range_for(vocab_size)

    def prompt(rng_range: tuple[int, int]) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(rng.randint(*rng_range))]

    interactive, t = [], 0.0
    while True:
        t += rng.expovariate(opts["rate"])
        if t > opts["duration"]:
            break
        interactive.append(SloRequest(prompt(opts["interactive_prompt_len"]), rng.randint(*opts["interactive_output_len"]),
                                      "interactive", opts["ttft_ms"], opts["tpot_ms"], arrival_s=t))
    batch = [SloRequest(prompt(opts["batch_prompt_len"]), rng.randint(*opts["batch_output_len"]), "batch")
             for _ in range(opts["num_batch_jobs"])]
    return interactive, batch


def _digest(*parts: list[SloRequest]) -> str:
    h = hashlib.sha256()
    for reqs in parts:
        for r in reqs:
            h.update(repr((r.prompt_token_ids, r.max_tokens, r.slo_class, r.ttft_ms, r.tpot_ms, r.arrival_s)).encode())
    return h.hexdigest()[:16]


async def _drive(engine, interactive: list[SloRequest], batch: list[SloRequest], lanes: int) -> tuple[list, float]:
    from tokenloom.core.sampling_params import SamplingParams

    loop = asyncio.get_running_loop()
    records: list[dict] = []
    in_flight: dict[str, SloRequest] = {}

    async def one(req: SloRequest, rid: str) -> None:
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True, slo_class=req.slo_class,
                                ttft_ms=req.ttft_ms, tpot_ms=req.tpot_ms)
        in_flight[rid] = req
        final = None
        async for item in engine.generate(req.prompt_token_ids, params, request_id=rid):
            final = item
        del in_flight[rid]
        assert isinstance(final, Finished)
        m = final.metrics
        records.append({"class": req.slo_class, "finish_reason": final.finish_reason, "ttft_ms": m.ttft_ms,
                        "tpot_ms": m.tpot_ms, "ttft_target": req.ttft_ms, "tpot_target": req.tpot_ms,
                        "prompt_tokens": final.usage.prompt_tokens, "output_tokens": final.usage.completion_tokens})

    done = asyncio.Event()

    async def lane(k: int) -> None:
        for i in range(k, len(batch), lanes):
            if done.is_set():
                return
            await one(batch[i], f"batch-{i}")

    t0 = loop.time()
    lane_tasks = [asyncio.create_task(lane(k)) for k in range(lanes)]
    tasks = []
    for i, req in enumerate(interactive):
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - loop.time()))
        tasks.append(asyncio.create_task(one(req, f"chat-{i}")))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t0
    done.set()
    for rid in list(in_flight):  # the interactive stream is over: so is the run
        engine.abort(rid)
    await asyncio.gather(*lane_tasks)
    return records, elapsed


def _warm_llm(scheduler: str, config_file: str | None, flags: dict, pm: PluginManager):
    """An engine with ``scheduler``, warmed up: a 600-token prefill beside three short
    requests (their shapes get built; `slo` gets its first step times)."""
    from tokenloom import LLM
    from tokenloom.core.sampling_params import SamplingParams

    llm = LLM(config_file=config_file, flags=merge_layers(flags, {"scheduler": {"name": scheduler}}),
              plugin_manager=pm)
    vocab = llm.engine.model_config.vocab_size
    warm = [[(300 + i) % vocab] * 8 for i in range(3)] + [[(400 + i) % vocab for i in range(600)]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return llm


def calibrate(llm, recorder, opts: dict) -> dict:
    """Plain step times on this machine, now: a full prefill chunk alone; the median of three
    prefills of a mid-sized interactive prompt alone; and the median decode-only step of
    ``batch_concurrency`` sequences at the shortest batch prompt's length beside two short
    ones (the decode set the workload runs). The targets follow (see the module docstring).
    ``recorder`` is a StepRecorder registered with ``llm``'s plugin manager."""
    from statistics import median

    from tokenloom.core.sampling_params import SamplingParams

    lo, hi = token_range_for(llm.engine.model_config.vocab_size)
    rng = random.Random(opts["seed"] + 1)
    n_pre = sum(opts["interactive_prompt_len"]) // 2
    # a full chunk: the step's token budget, or the longest prompt that leaves room for a token
    chunk = min(llm.engine.config.scheduler.options.max_num_batched_tokens, llm.engine.max_model_len - 1)
    lanes = opts["batch_concurrency"]

    def steps(prompts: list[int], max_tokens: int) -> list:
        recorder.steps.clear()
        llm.generate([[rng.randrange(lo, hi) for _ in range(n)] for n in prompts],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return list(recorder.steps)

    chunk_ms = steps([chunk], 1)[0].step_time_ms
    prefill = median(steps([n_pre], 1)[0].step_time_ms for _ in range(3))
    decode = median(s.step_time_ms for s in steps([opts["batch_prompt_len"][0]] * lanes + [n_pre] * 2, 12)
                    if s.num_prefill_tokens == 0)
    return {"chunk_ms": chunk_ms, "chunk_tokens": chunk, "prefill_ms": prefill, "prefill_tokens": n_pre,
            "decode_ms": decode, "decode_seqs": lanes + 2, "decode_context": opts["batch_prompt_len"][0],
            "ttft_ms": 10.0 * math.ceil(chunk_ms / 10), "tpot_ms": float(math.ceil(3 * decode))}


def run_scheduler(scheduler: str, opts: dict, config_file: str | None, flags: dict) -> dict:
    """One scheduler through the workload, in this process; the raw per-request records. A
    target left None is calibrated first (:func:`calibrate`), on this engine."""
    from tokenloom.bench.runner import StepRecorder

    recorder = StepRecorder()
    llm = _warm_llm(scheduler, config_file, flags, PluginManager(extra=[recorder]))
    try:
        calibration = None
        if opts["ttft_ms"] is None or opts["tpot_ms"] is None:
            calibration = calibrate(llm, recorder, opts)
            opts = {**opts, "ttft_ms": opts["ttft_ms"] or calibration["ttft_ms"],
                    "tpot_ms": opts["tpot_ms"] or calibration["tpot_ms"]}
        interactive, batch = make_slo_workload(opts, llm.engine.model_config.vocab_size)
        records, elapsed = llm.run(_drive(llm.engine, interactive, batch, opts["batch_concurrency"]))
        stats = llm.engine.stats()
        dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    finally:
        llm.close()
    return {"scheduler": scheduler, "elapsed_s": elapsed, "records": records, "dtype": dtype,
            "targets": (opts["ttft_ms"], opts["tpot_ms"]), "calibration": calibration,
            "workload_digest": _digest(interactive, batch), "preemptions": stats["preemptions"],
            "scheduler_stats": {k: v for k, v in stats.items() if k.startswith("scheduler_")}}


def _met(r: dict) -> tuple[bool, bool]:
    ttft = r["ttft_target"] is None or (r["ttft_ms"] is not None and r["ttft_ms"] <= r["ttft_target"])
    tpot = r["tpot_target"] is None or r["tpot_ms"] is None or r["tpot_ms"] <= r["tpot_target"]
    return ttft, tpot


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else math.nan


def summarize_run(run: dict) -> dict:
    """Goodput, attainment per class, latency percentiles and throughput of one run."""
    elapsed = run["elapsed_s"]
    finished = [r for r in run["records"] if r["finish_reason"] in COUNTED]
    classes = {}
    for name in sorted({r["class"] for r in run["records"]}):
        rs = [r for r in finished if r["class"] == name]
        met = [_met(r) for r in rs]
        n = len(rs)
        ttft = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        tpot = [r["tpot_ms"] for r in rs if r["tpot_ms"] is not None]
        classes[name] = {
            "finished": n, "aborted": sum(r["class"] == name and r["finish_reason"] not in COUNTED
                                          for r in run["records"]),
            "ttft_met": sum(a for a, _ in met) / n if n else math.nan,
            "tpot_met": sum(b for _, b in met) / n if n else math.nan,
            "both_met": sum(a and b for a, b in met) / n if n else math.nan,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
        }
    good = sum(all(_met(r)) for r in finished)
    return {"scheduler": run["scheduler"], "elapsed_s": elapsed, "goodput_req_s": good / elapsed,
            "output_tok_s": sum(r["output_tokens"] for r in run["records"]) / elapsed,
            "preemptions": run["preemptions"], "classes": classes, "dtype": run["dtype"],
            "workload_digest": run["workload_digest"], "scheduler_stats": run["scheduler_stats"]}


def slo_options(args) -> dict:
    return {"seed": args.workload_seed, "rate": args.rate, "duration": args.duration,
            "interactive_prompt_len": parse_range(args.interactive_prompt_len),
            "interactive_output_len": parse_range(args.interactive_output_len),
            "batch_prompt_len": parse_range(args.batch_prompt_len), "batch_output_len": parse_range(args.batch_output_len),
            "batch_concurrency": args.batch_concurrency, "num_batch_jobs": 256, "ttft_ms": args.ttft_ms,
            "tpot_ms": args.tpot_ms}


def run_slo(args, flags: dict, pm: PluginManager) -> dict:
    opts = slo_options(args)
    if opts["rate"] <= 0 or opts["duration"] <= 0 or opts["batch_concurrency"] < 0:
        raise ValueError("--rate and --duration must be > 0 and --batch-concurrency >= 0")
    calibration, results = None, []
    for name in args.schedulers.split(","):
        run = isolated(run_scheduler, name, opts, args.config, flags)
        if run["calibration"] is not None:  # the first run measured the targets: the others share them
            calibration = run["calibration"]
            opts["ttft_ms"], opts["tpot_ms"] = run["targets"]
            print(f"  calibration: {calibration['chunk_tokens']}-token chunk {calibration['chunk_ms']:.0f} ms, "
                  f"decode step of {calibration['decode_seqs']} {calibration['decode_ms']:.0f} ms: targets TTFT "
                  f"{opts['ttft_ms']:.0f} ms, TPOT {opts['tpot_ms']:.0f} ms", flush=True)
        res = summarize_run(run)
        results.append(res)
        chat = res["classes"].get("interactive", {})
        print(f"  {name}: goodput {res['goodput_req_s']:.2f} req/s, interactive both met "
              f"{100 * chat.get('both_met', math.nan):.0f}%, {res['output_tok_s']:.1f} output tok/s", flush=True)
    if len({r["workload_digest"] for r in results}) != 1:
        raise RuntimeError("the schedulers saw different workloads (different vocabularies?)")
    workload = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()}
    return {"workload": workload, "calibration": calibration, "results": results}


def _p(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0f}"


def format_slo(report: dict) -> str:
    w = report["workload"]
    lines = [f"interactive: Poisson {w['rate']}/s for {w['duration']} s, prompts {w['interactive_prompt_len']}, "
             f"outputs {w['interactive_output_len']}, targets TTFT {w['ttft_ms']} ms / TPOT {w['tpot_ms']} ms; "
             f"batch: {w['batch_concurrency']} lanes of prompts {w['batch_prompt_len']}, outputs "
             f"{w['batch_output_len']} (no targets); seed {w['seed']}, dtype {report['results'][0]['dtype']}"]
    cal = report.get("calibration")
    if cal:
        lines.append(f"targets from plain steps measured first: a {cal['chunk_tokens']}-token chunk "
                     f"{cal['chunk_ms']:.0f} ms, a decode step of {cal['decode_seqs']} sequences "
                     f"{cal['decode_ms']:.0f} ms ({cal['prefill_tokens']}-token prefill {cal['prefill_ms']:.0f} ms): "
                     "TTFT = the chunk, TPOT = 3 x the decode step")
    lines += ["", "| scheduler | goodput req/s | output tok/s | class | finished | TTFT met | TPOT met | both met "
              "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | preemptions |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        for i, (name, c) in enumerate(r["classes"].items()):
            head = (f"| {r['scheduler']} | {r['goodput_req_s']:.2f} | {r['output_tok_s']:.1f} |" if i == 0
                    else "| | | |")
            lines.append(f"{head} {name} | {c['finished']} | {_p(c['ttft_met'])} | {_p(c['tpot_met'])} | "
                         f"{_p(c['both_met'])} | {_ms(c['ttft_p50_ms'])} / {_ms(c['ttft_p99_ms'])} | "
                         f"{_ms(c['tpot_p50_ms'])} / {_ms(c['tpot_p99_ms'])} | {r['preemptions'] if i == 0 else ''} |")
    return "\n".join(lines)

