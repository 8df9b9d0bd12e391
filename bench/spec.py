"""`tokenloom bench spec`: speculative decoders against `standard`, one request at a time
(batch 1), greedy, on two kinds of task:

- ``grounded``: rewrite or summarise a passage given in the prompt (passages from CPython's
  ``pydoc_data.topics``), where the output copies its input and prompt lookup shines;
- ``chat``: open questions, where nothing in the prompt predicts the answer.

For each (decoder, task): decode tok/s (output tokens after the first over the time after
the first token, summed over the task's requests), the speedup over `standard` on the same
task, whether the greedy tokens equal `standard`'s, the acceptance rate ``a`` (accepted /
drafted) and the mean draft length ``k`` per step that drafted.

**Predicted speedup** (Leviathan et al. 2023, eq. 1 and theorem 3.8): with an i.i.d.
acceptance rate ``a`` and ``k`` drafts, a step emits ``E = (1 - a^(k+1)) / (1 - a)`` tokens
in expectation; if a step costs ``c`` times a plain decode step (drafting included; the
n-gram drafter costs nothing, so ``c`` is the verification forward's extra rows), the
speedup is ``E / c``. Here ``a`` and ``k`` are measured, and ``c`` is the mean decode step
time (wall time after the first token over the steps after the prefill) over `standard`'s; ``k`` is the mean draft length of the steps that
drafted, and steps that drafted nothing emit one token (``E`` is weighted by the share of
steps that drafted). The table prints ``E`` beside the measured tokens per step.

For a **tree** (Medusa, EAGLE) a per-token rate means nothing (many nodes compete for each
depth), so ``E = 1 + sum_d prod_{i <= d} a_i`` with ``a_i`` the measured chance that the
accepted branch reaches depth ``i`` once it reached ``i - 1`` (EAGLE-2's acceptance length
from per-depth rates).

**Row cost**: the target's forward for one sequence with 0, 4, 8 and 16 draft rows (a chain),
timed directly; the table's footer gives the cost of one more verified row as a share of a
plain step, which is what every speculative decoder pays per extra row on this machine.
"""

from __future__ import annotations

import time

from tokenloom.core.config import merge_layers
from tokenloom.core.plugins import PluginManager

PROMPTS = {
    "grounded": [
        "Rewrite the following text, fixing any grammar mistakes and leaving everything else exactly as it "
        "is:\n\n{passage}",
        "Repeat the following documentation paragraph, replacing the word 'Python' by 'the language' "
        "wherever it appears:\n\n{passage}",
        "Summarise the following text, quoting its key sentences:\n\n{passage}",
    ],
    "chat": [
        "What is the capital of France?",
        "Give me three tips for writing clear emails.",
        "Explain what a hash table is in two sentences.",
    ],
}


def _passages(n: int, chars: int = 700) -> list[str]:
    from tokenloom.core.evaluation import split_corpus

    _, evaluation = split_corpus()
    texts = [text.strip() for _, text in evaluation if len(text) > chars]
    return [t[:chars].rsplit(" ", 1)[0] for t in texts[:n]]


def task_messages() -> dict[str, list[list[dict]]]:
    passages = _passages(len(PROMPTS["grounded"]))
    grounded = [[{"role": "user", "content": p.format(passage=text)}]
                for p, text in zip(PROMPTS["grounded"], passages, strict=True)]
    chat = [[{"role": "user", "content": p}] for p in PROMPTS["chat"]]
    return {"grounded": grounded, "chat": chat}


def _expected_tokens(a: float, k: float) -> float:
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return k + 1
    return (1 - a ** (k + 1)) / (1 - a)


def _tree_tokens(rates: list[float]) -> float:
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


def row_costs(engine, rows: tuple[int, ...] = (0, 4, 8, 16), reps: int = 7, context: int = 96) -> dict[int, float]:
    """Median ms of the target's forward for one sequence of ``context`` tokens plus ``k``
    draft rows (a chain), for each k in ``rows``."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Batch, Sequence

    cache = engine.cache
    vocab = engine.runner.model.cfg.vocab_size
    seq = Sequence("row-cost", [(i * 37) % (vocab - 1) + 1 for i in range(context)], SamplingParams(max_tokens=1))
    if not cache.allocate(seq, context, num_lookahead=max(rows)):
        return {}
    table = cache.block_table(seq)
    try:
        def run() -> dict[int, float]:
            engine.executor.forward(Batch([seq], [context - 1], [table]))  # the context's KV
            seq.num_computed_tokens = context - 1
            out = {}
            for k in rows:
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.executor.forward(Batch([seq], [1], [table], draft_tokens=[[seq.token_ids[-1]] * k]))
                    times.append(time.perf_counter() - t0)
                out[k] = 1e3 * sorted(times)[reps // 2]
            return out

        return engine.call_in_step_thread(run)
    finally:
        seq.num_computed_tokens = 0
        cache.free(seq)


def run_spec(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM
    from tokenloom.core.sampling_params import SamplingParams

    decoders = ["standard"] + [d for d in args.decoders.split(",") if d and d != "standard"]
    tasks = task_messages()
    # every compared decoder is built at start-up (one that loads a draft model only when enabled)
    llm = LLM(config_file=args.config, plugin_manager=pm,
              flags=merge_layers(flags, {"scheduler": {"max_num_seqs": 1}, "enable_decoders": decoders[1:]}))
    rows = []
    try:
        llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=8))
        engine = llm.engine
        for task, messages in tasks.items():
            base_tokens = None
            # each prompt once first, so every decoder's run finds the same prefix cache: a run
            # that prefills the whole prompt and one that hits the cache compute the prompt's
            # tail over different row counts, which rounds its KV differently (docs/quantization.md)
            for m in messages:
                llm.generate(messages=[m], params=SamplingParams(temperature=0, max_tokens=1))
            for dec in decoders:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, decoder=dec,
                                        num_speculative_tokens=args.k)
                stats0 = engine.decoder.stats()
                outs, decode_s, decode_tokens = [], 0.0, 0
                for m in messages:  # one at a time: batch 1
                    t0 = time.perf_counter()
                    out = llm.generate(messages=[m], params=params)[0]
                    wall = time.perf_counter() - t0
                    outs.append(out)
                    ttft = (out.metrics.ttft_ms or 0) / 1e3
                    decode_s += max(wall - ttft, 1e-9)
                    decode_tokens += max(len(out.token_ids) - 1, 0)
                stats = engine.decoder.stats()
                delta = {key: stats.get(key, 0) - stats0.get(key, 0) for key in stats}
                drafted, accepted = delta.get(f"{dec}_drafted", 0), delta.get(f"{dec}_accepted", 0)
                seq_steps = delta.get(f"{dec}_steps", 0)
                drafting = delta.get(f"{dec}_drafting_steps", 0)
                tokens = [o.token_ids for o in outs]
                base_tokens = base_tokens or tokens
                trees = delta.get(f"{dec}_tree_steps", 0) > 0
                rates = engine.decoder.depth_acceptance(dec) if trees else None
                rows.append({
                    "task": task, "decoder": dec, "requests": len(outs), "decode_tokens": decode_tokens,
                    "decode_tok_s": decode_tokens / decode_s,
                    # decode steps only: each request's first step is its prefill
                    "step_ms": 1e3 * decode_s / max(seq_steps - len(outs), 1),
                    "drafted": drafted, "accepted": accepted, "steps": seq_steps, "drafting_steps": drafting, "acceptance": accepted / drafted if drafted else None,
                    "tokens_per_step": delta.get(f"{dec}_emitted", 0) / seq_steps if seq_steps else None,
                    "same_tokens_as_standard": tokens == base_tokens,
                    "tree": trees, "depth_acceptance": rates,
                    "drafted_by": _drafted_by(outs),
                })
        costs = row_costs(engine)
    finally:
        llm.close()
    for task in tasks:
        base = next(r for r in rows if r["task"] == task and r["decoder"] == "standard")
        for r in rows:
            if r["task"] != task:
                continue
            r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            r["cost_ratio"] = r["step_ms"] / base["step_ms"]
            expected = 1.0
            if r["drafted"]:
                k = r["mean_k"] = r["drafted"] / r["drafting_steps"]
                share = r["drafting_steps"] / r["steps"]
                per_step = _tree_tokens(r["depth_acceptance"]) if r["tree"] else _expected_tokens(r["acceptance"], k)
                expected = share * per_step + (1 - share)
            r["predicted_tokens_per_step"] = expected
            r["predicted_speedup"] = expected / r["cost_ratio"]
    per_row = None
    if costs and costs.get(0):
        k = max(costs)
        per_row = (costs[k] - costs[0]) / k / costs[0]
    return {"k": args.k, "max_tokens": args.max_tokens, "rows": rows, "row_cost_ms": costs, "row_cost": per_row}


def _drafted_by(outs) -> dict[str, int]:
    total: dict[str, int] = {}
    for o in outs:
        for name, n in o.metrics.drafted_by.items():
            total[name] = total.get(name, 0) + n
    return total


def format_spec(report: dict) -> str:
    lines = [f"batch 1, greedy, max_tokens {report['max_tokens']}, K = {report['k']}", "",
             "| task | decoder | decode tok/s | speedup | predicted | step ms | cost ratio | acceptance | "
             "tokens/step (predicted) | same tokens | drafted by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        if r["tree"] and r["depth_acceptance"]:
            acc = "tree " + "/".join(f"{a:.2f}" for a in r["depth_acceptance"][:6])
        tps = f"{r['tokens_per_step']:.2f} ({r['predicted_tokens_per_step']:.2f})" if r["tokens_per_step"] else "-"
        by = ", ".join(f"{k} {v}" for k, v in sorted(r.get("drafted_by", {}).items())) or "-"
        lines.append(f"| {r['task']} | {r['decoder']} | {r['decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['predicted_speedup']:.2f}x | {r['step_ms']:.2f} | {r['cost_ratio']:.2f} | {acc} | {tps} | "
                     f"{'yes' if r['same_tokens_as_standard'] else 'no'} | {by} |")
    if report.get("row_cost_ms"):
        costs = report["row_cost_ms"]
        lines += ["", "target forward, one sequence: " + ", ".join(f"{k} draft rows {v:.2f} ms" for k, v in costs.items())
                  + (f"; one more verified row costs {100 * report['row_cost']:.1f}% of a plain step"
                     if report.get("row_cost") is not None else "")]
    return "\n".join(lines)
