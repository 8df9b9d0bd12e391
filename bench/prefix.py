"""`tokenloom bench prefix`: what prefix caching buys, per cache manager.

``shared-system``: every request is a long shared system prompt plus a short user turn,
sent one after another (or ``--concurrency`` at a time): TTFT with and without caching.
``multi-turn``: conversations whose every turn resends the whole history (the previous
answer's exact token ids included): the prefix hit rate of each manager.
"""

from __future__ import annotations

import asyncio
import random
import time

from tokenloom.bench.stats import ratio, summarize
from tokenloom.core.config import merge_layers
from tokenloom.core.outputs import Finished
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sampling_params import SamplingParams

COMBOS = {
    "no-cache": {"cache_manager": {"name": "paged", "enable_prefix_caching": False}},
    "paged": {"cache_manager": {"name": "paged", "enable_prefix_caching": True}},
    "radix": {"cache_manager": {"name": "radix"}},
}


async def _generate(engine, prompt: list[int], max_tokens: int) -> Finished:
    final = None
    async for item in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)):
        final = item
    return final


async def _shared_system(engine, args, rng) -> list[Finished]:
    hi = min(40000, engine.model_config.vocab_size)
    system = [rng.randrange(hi // 2, hi) for _ in range(args.system_len)]
    turns = [system + [rng.randrange(hi // 2, hi) for _ in range(rng.randint(*args.user_len))]
             for _ in range(args.num_requests)]
    sem = asyncio.Semaphore(args.concurrency)

    async def one(p):
        async with sem:
            return await _generate(engine, p, args.output_len)

    return list(await asyncio.gather(*(one(p) for p in turns)))


async def _multi_turn(engine, args, rng) -> list[Finished]:
    hi = min(40000, engine.model_config.vocab_size)
    histories = [[rng.randrange(hi // 2, hi) for _ in range(rng.randint(*args.user_len))]
                 for _ in range(args.num_conversations)]
    finals = []
    for _ in range(args.turns):
        outs = await asyncio.gather(*(_generate(engine, h, args.output_len) for h in histories))
        finals += outs
        histories = [h + o.token_ids + [rng.randrange(hi // 2, hi) for _ in range(rng.randint(*args.user_len))]
                     for h, o in zip(histories, outs, strict=True)]
    return finals


def run_prefix(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM

    results = []
    for name in args.combos.split(","):
        layer = merge_layers({"max_model_len": 4096}, flags, COMBOS[name])
        llm = LLM(config_file=args.config, flags=layer, plugin_manager=pm)
        try:
            warm = [(300 + i) % llm.engine.model_config.vocab_size for i in range(32)]
            llm.run(_generate(llm.engine, warm, 4))  # warm-up
            rng = random.Random(args.workload_seed)
            run = _shared_system if args.workload == "shared-system" else _multi_turn
            t0 = time.perf_counter()
            finals = llm.run(run(llm.engine, args, rng))
            elapsed = time.perf_counter() - t0
            prompt = sum(f.usage.prompt_tokens for f in finals)
            cached = sum(f.usage.cached_tokens for f in finals)
            stats = llm.engine.cache.stats()
            results.append({"combo": name, "requests": len(finals), "elapsed_s": elapsed,
                            "ttft_ms": summarize([f.metrics.ttft_ms for f in finals]),
                            "prompt_tokens": prompt, "cached_tokens": cached,
                            "hit_rate": cached / prompt if prompt else 0.0,
                            "evictions": stats.num_evictions})
            print(f"  {name}: TTFT mean {results[-1]['ttft_ms']['mean']:.0f} ms, "
                  f"hit rate {100 * results[-1]['hit_rate']:.1f}%", flush=True)
        finally:
            llm.close()
    base = results[0]
    for r in results:
        r["ttft_speedup"] = ratio(base["ttft_ms"]["mean"], r["ttft_ms"]["mean"])
    return {"workload": args.workload, "results": results}


def format_prefix(report: dict) -> str:
    lines = [f"workload {report['workload']}",
             "combo     requests  TTFT ms mean/p50/p90   speedup  prompt tok  cached tok  hit rate  evictions"]
    for r in report["results"]:
        t = r["ttft_ms"]
        lines.append(f"{r['combo']:<9} {r['requests']:<9} {t['mean']:.0f}/{t['p50']:.0f}/{t['p90']:.0f}".ljust(42)
                     + f"{r['ttft_speedup']:.1f}x".ljust(9) + f"{r['prompt_tokens']:<11} {r['cached_tokens']:<11} "
                     f"{100 * r['hit_rate']:.1f}%".ljust(10) + f" {r['evictions']}")
    return "\n".join(lines)
