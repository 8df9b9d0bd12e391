"""`tokenloom bench serve --duration S`: a soak test of a running server.

Poisson arrivals for ``S`` seconds (the workload cycles), most requests multiplexed on
one connection, a fraction ``--disconnect-fraction`` each on its own connection that is
dropped after a few tokens. What it checks is the server's promise, not its speed:

- lost: requests the server accepted that never got their ``done`` (excluding the ones
  whose client left on purpose);
- duplicate ``done``s;
- refusals by error code, finish reasons (``error`` is an internal failure);
- the server's RSS over the run and its peak, its peak KV usage (from ``/health``);
- afterwards: no request left in the engine and no KV block in use.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request
from collections import Counter

from tokenloom.bench.workload import BenchRequest


def _health(url: str, api_key: str | None) -> dict:
    req = urllib.request.Request(url.replace("ws://", "http://").replace("wss://", "https://") + "/health",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503 while draining or restarting: still a JSON body
        return json.loads(exc.read())


async def _request(client, req: BenchRequest, rid: str, leave_after: int | None, tally: dict) -> None:
    from tokenloom.protocols.websocket.client import RequestError
    from tokenloom.protocols.websocket.messages import Delta, Done

    tokens = 0
    try:
        async for ev in client.generate(req.prompt_token_ids, id=rid, params={
                "temperature": 0.7, "max_tokens": req.max_tokens, "ignore_eos": True}):
            if isinstance(ev, Delta):
                tokens += len(ev.token_ids)
                if leave_after is not None and tokens >= leave_after:
                    tally["disconnected"] += 1
                    await client.close()  # the client leaves mid-stream
                    return
            elif isinstance(ev, Done):
                tally["finish"][ev.finish_reason] += 1
                tally["output_tokens"] += ev.usage.completion_tokens
    except RequestError as exc:
        tally["refused"][exc.code] += 1
    except ConnectionError:
        tally["lost_connection"] += 1


async def run_soak(url: str, rate: float, duration_s: float, workload: list[BenchRequest], seed: int,
                   disconnect_fraction: float = 0.05, api_key: str | None = None,
                   sample_every_s: float = 10.0) -> dict:
    from tokenloom.protocols.websocket.client import Client

    rng = random.Random(seed)
    tally = {"finish": Counter(), "refused": Counter(), "disconnected": 0, "lost_connection": 0,
             "output_tokens": 0}
    loop = asyncio.get_running_loop()
    rss: list[tuple[float, int]] = []
    tasks, own_clients, n = [], [], 0
    async with Client(url, api_key=api_key) as main:
        t0 = time.perf_counter()
        next_sample = 0.0
        while (now := time.perf_counter() - t0) < duration_s:
            if now >= next_sample:
                h = await loop.run_in_executor(None, _health, url, api_key)
                rss.append((now, h.get("rss_bytes", 0)))
                next_sample += sample_every_s
            req = workload[n % len(workload)]
            if rng.random() < disconnect_fraction:
                own = await Client(url, api_key=api_key).__aenter__()
                own_clients.append(own)
                tasks.append(asyncio.create_task(_request(own, req, f"s{n}", rng.randint(1, 8), tally)))
            else:
                tasks.append(asyncio.create_task(_request(main, req, f"s{n}", None, tally)))
            n += 1
            await asyncio.sleep(rng.expovariate(rate) if math.isfinite(rate) and rate > 0 else 0)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        stray = []  # messages for no request the client is waiting on: a second `done` would land here
        while not main.errors.empty():
            stray.append(main.errors.get_nowait())
        accepted = len(main.accepted) + sum(len(c.accepted) for c in own_clients)
    for c in own_clients:
        await c.close()
    for _ in range(100):  # the last aborts land within a step or two
        after = await loop.run_in_executor(None, _health, url, api_key)
        if after.get("running") == 0 and after.get("waiting") == 0 and after.get("kv_blocks_used") == 0:
            break
        await asyncio.sleep(0.1)
    rss.append((time.perf_counter() - t0, after.get("rss_bytes", 0)))
    finished = sum(tally["finish"].values())
    return {
        "rate": rate, "duration_s": elapsed, "sent": n, "accepted": accepted,
        "lost": accepted - finished - tally["disconnected"],
        "duplicate_done": sum(1 for m in stray if type(m).__name__ == "Done"),
        "finish_reasons": dict(tally["finish"]), "refused": dict(tally["refused"]),
        "disconnected": tally["disconnected"], "lost_connection": tally["lost_connection"],
        "output_tok_s": tally["output_tokens"] / elapsed,
        "rss_mb": [(round(t), round(b / 2**20)) for t, b in rss],
        "peak_rss_mb": round(after.get("peak_rss_bytes", 0) / 2**20),
        "peak_kv_usage": after.get("peak_kv_usage"), "engine_failures": after.get("engine_failures"),
        "after": {k: after.get(k) for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_cached",
                                            "kv_blocks_free", "kv_blocks_total")},
    }


def format_soak(r: dict) -> str:
    rss = [mb for _, mb in r["rss_mb"]]
    rows = [
        ("duration", f"{r['duration_s']:.0f} s at {r['rate']} req/s (Poisson)"),
        ("sent / accepted", f"{r['sent']} / {r['accepted']}"),
        ("lost (accepted, no done)", r["lost"]),
        ("duplicate done", r["duplicate_done"]),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items())) or "-"),
        ("refused by code", ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "none"),
        ("clients that left mid-stream", r["disconnected"]),
        ("connections lost", r["lost_connection"]),
        ("output tok/s", f"{r['output_tok_s']:.1f}"),
        ("server RSS MB first/max/last", f"{rss[0]}/{max(rss)}/{rss[-1]} (peak {r['peak_rss_mb']})"),
        ("peak KV usage", f"{r['peak_kv_usage']:.3f}" if r["peak_kv_usage"] is not None else "-"),
        ("engine failures", r["engine_failures"]),
        ("after: running/waiting", f"{r['after']['running']}/{r['after']['waiting']}"),
        ("after: KV used/cached/free/total", "/".join(str(r["after"][k]) for k in (
            "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free", "kv_blocks_total"))),
    ]
    return "\n".join(f"| {k} | {v} |" for k, v in [("measure", "value"), ("---", "---"), *rows])


def soak_passed(r: dict) -> bool:
    return (r["lost"] == 0 and r["duplicate_done"] == 0 and r["finish_reasons"].get("error", 0) == 0
            and r["lost_connection"] == 0 and r["after"]["running"] == 0 and r["after"]["kv_blocks_used"] == 0)
