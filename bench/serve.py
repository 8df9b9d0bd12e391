"""`tokenloom bench serve`: a load generator over the WebSocket protocol (with
``--duration``, a soak of either frontend: bench/soak.py).

Requests arrive as a Poisson process at ``--rate`` per second (``inf``: all at once),
at most ``--concurrency`` in flight; the prompts are the seeded offline workload. Each
request records TTFT, inter-token latencies, TPOT and end-to-end latency on the client
side, as vLLM's `benchmark_serving` does.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request
from urllib.parse import urlsplit

from tokenloom.bench.stats import summarize
from tokenloom.bench.workload import BenchRequest, make_workload, parse_range


async def _one(client, req: BenchRequest, sem: asyncio.Semaphore, record: list) -> None:
    from tokenloom.protocols.websocket.client import RequestError
    from tokenloom.protocols.websocket.messages import Delta, Done

    async with sem:
        start = time.perf_counter()
        arrivals: list[tuple[float, int]] = []
        try:
            async for ev in client.generate(req.prompt_token_ids, params={
                    "temperature": 0, "max_tokens": req.max_tokens, "ignore_eos": True}):
                if isinstance(ev, Delta) and ev.token_ids:
                    arrivals.append((time.perf_counter(), len(ev.token_ids)))
                elif isinstance(ev, Done):
                    ok = ev.finish_reason in ("stop", "length")
        except (RequestError, ConnectionError) as exc:
            record.append({"ok": False, "error": str(exc)})
            return
        end = time.perf_counter()
        n = sum(k for _, k in arrivals)
        itl = []
        for (t0, _), (t1, k) in zip(arrivals, arrivals[1:], strict=False):
            itl.extend([(t1 - t0) / k * 1e3] * k)  # a coalesced delta spreads its gap over its tokens
        record.append({
            "ok": ok, "output_tokens": n, "prompt_tokens": len(req.prompt_token_ids),
            "ttft_ms": (arrivals[0][0] - start) * 1e3 if arrivals else None,
            "tpot_ms": (arrivals[-1][0] - arrivals[0][0]) * 1e3 / (n - 1) if n > 1 else None,
            "e2e_ms": (end - start) * 1e3, "itl_ms": itl,
        })


async def run_serve_bench(url: str, rate: float, concurrency: int, workload: list[BenchRequest], seed: int,
                          api_key: str | None = None) -> dict:
    from tokenloom.protocols.websocket.client import Client

    rng = random.Random(seed)
    record: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    async with Client(url, api_key=api_key) as client:
        t0 = time.perf_counter()
        tasks = []
        for req in workload:
            tasks.append(asyncio.create_task(_one(client, req, sem, record)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return _report(record, rate, concurrency, elapsed, errors=False)


# ---- the same load through an OpenAI-compatible server (tokenloom's frontend, vLLM, llama-server)
async def _sse_completion(base: str, payload: dict, api_key: str | None):
    """POST ``payload`` to ``base``/v1/completions on a connection of its own; yields
    (arrival time, event dict) per server-sent event. A non-200 answer raises ConnectionError."""
    url = urlsplit(base)
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}:{url.port or 80}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if api_key:
            head += f"Authorization: Bearer {api_key}\r\n"
        writer.write(head.encode() + b"\r\n" + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection before answering")
        status = int(status_line.split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            chunked |= name.strip().lower() == "transfer-encoding" and "chunked" in value.lower()
        if status != 200:
            raise ConnectionError(f"HTTP {status}: {(await reader.read(300)).decode(errors='replace')}")
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if not size:
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)
            else:
                data = await reader.read(65536)
                if not data:
                    break
            buffer += data.replace(b"\r\n", b"\n")
            now = time.perf_counter()
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    yield now, json.loads(event[6:])
    finally:
        writer.close()


async def _one_openai(base: str, model: str, req: BenchRequest, sem: asyncio.Semaphore, record: list,
                      api_key: str | None) -> None:
    """One streamed completion of ``req`` (its token ids as the prompt), recorded as :func:`_one` does.
    Its output tokens are the server's ``usage`` when it sends one, else its content chunks;
    inter-token latencies are the gaps between chunks, each spread over the tokens it carried
    when the count is known."""
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with sem:
        start = time.perf_counter()
        arrivals: list[float] = []
        usage, finish = None, None
        try:
            async for now, msg in _sse_completion(base, payload, api_key):
                if "error" in msg:
                    raise ConnectionError(str(msg["error"])[:200])
                for choice in msg.get("choices") or ():
                    if choice.get("text") or choice.get("finish_reason") is None:
                        arrivals.append(now)
                    finish = choice.get("finish_reason") or finish
                usage = msg.get("usage") or usage
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            record.append({"ok": False, "error": str(exc)})
            return
        end = time.perf_counter()
        n = usage["completion_tokens"] if usage else len(arrivals)
        per_chunk = (n - 1) / (len(arrivals) - 1) if len(arrivals) > 1 and n > 1 else 1.0
        itl = [(t1 - t0) * 1e3 / per_chunk for t0, t1 in zip(arrivals, arrivals[1:], strict=False)]
        record.append({
            "ok": finish in ("stop", "length"), "output_tokens": n, "prompt_tokens": len(req.prompt_token_ids),
            "ttft_ms": (arrivals[0] - start) * 1e3 if arrivals else None,
            "tpot_ms": (arrivals[-1] - arrivals[0]) * 1e3 / (n - 1) if n > 1 and arrivals else None,
            "e2e_ms": (end - start) * 1e3, "itl_ms": itl,
        })


async def run_openai_serve_bench(base_url: str, rate: float, concurrency: int, workload: list[BenchRequest],
                                 seed: int, api_key: str | None = None) -> dict:
    """:func:`run_serve_bench` through any OpenAI-compatible server at ``base_url``
    (``http://host:port``; a trailing ``/v1`` is dropped): each request streams
    ``/v1/completions`` on its own connection, greedy, EOS ignored. Same report."""
    base = base_url.rstrip("/").removesuffix("/v1")
    loop = asyncio.get_running_loop()

    def models() -> str:
        req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    model = await loop.run_in_executor(None, models)
    rng = random.Random(seed)
    record: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    tasks = []
    for req in workload:
        tasks.append(asyncio.create_task(_one_openai(base, model, req, sem, record, api_key)))
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return _report(record, rate, concurrency, elapsed, errors=True)


def _report(record: list[dict], rate: float, concurrency: int, elapsed: float, *, errors: bool) -> dict:
    """Throughput and latency of one load run from its per-request records."""
    good = [r for r in record if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in good)
    report = {"rate": rate, "concurrency": concurrency, "requests": len(record), "failed": len(record) - len(good)}
    if errors:
        report["errors"] = sorted({r["error"] for r in record if "error" in r})[:3]
    return {
        **report,
        "elapsed_s": elapsed, "request_throughput": len(good) / elapsed, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + sum(r["prompt_tokens"] for r in good)) / elapsed,
        "ttft_ms": summarize([r["ttft_ms"] for r in good]), "tpot_ms": summarize([r["tpot_ms"] for r in good]),
        "itl_ms": summarize([x for r in good for x in r["itl_ms"]]), "e2e_ms": summarize([r["e2e_ms"] for r in good]),
    }


def format_serve(reports: list[dict]) -> str:
    lines = ["rate req/s  conc  done/failed  req/s  out tok/s  TTFT ms mean/p50/p90/p99   TPOT ms mean/p50/p90/p99"
             "   ITL ms p50/p99   E2E ms p50/p99"]
    for r in reports:
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
        f = lambda s, keys, nd=0: "/".join(f"{s[k]:.{nd}f}" for k in keys)  # noqa: E731
        lines.append(f"{r['rate']:<10}  {r['concurrency']:<4}  {r['requests'] - r['failed']}/{r['failed']:<9}  "
                     f"{r['request_throughput']:.2f}   {r['output_tok_s']:.1f}      "
                     f"{f(t, ('mean', 'p50', 'p90', 'p99'))}   {f(p, ('mean', 'p50', 'p90', 'p99'), 1)}   "
                     f"{f(i, ('p50', 'p99'), 1)}   {f(e, ('p50', 'p99'))}")
    return "\n".join(lines)


def cmd_serve_bench(args) -> int:
    from tokenloom.bench.offline import write_json
    from tokenloom.core import env

    workload = make_workload(args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len),
                             seed=args.workload_seed)
    openai_url = getattr(args, "openai", None)
    if openai_url is not None and args.duration is None:
        print("--openai soaks the OpenAI frontend: give --duration S (the load benchmark speaks WebSocket)")
        return 2
    if args.duration is not None and not all(math.isfinite(float(r)) and float(r) > 0 for r in args.rate):
        print("a soak sends at a finite --rate R > 0 requests/s")
        return 2
    if args.duration is not None:
        from tokenloom.bench.soak import format_soak, run_openai_soak, run_soak, soak_passed

        url, soak = (openai_url, run_openai_soak) if openai_url is not None else (args.url, run_soak)
        reports = [asyncio.run(soak(url, float(rate), args.duration, workload, args.workload_seed,
                                    args.disconnect_fraction, env.api_key())) for rate in args.rate]
        for r in reports:
            print(format_soak(r))
        write_json({"url": url, "soak": reports}, args.json)
        return 0 if all(soak_passed(r) for r in reports) else 1
    reports = []
    for rate in args.rate:
        rep = asyncio.run(run_serve_bench(args.url, float(rate), args.concurrency, workload, args.workload_seed))
        reports.append(rep)
        print(f"  rate {rate}: {rep['output_tok_s']:.1f} output tok/s, {rep['failed']} failed", flush=True)
    print(format_serve(reports))
    write_json({"url": args.url, "results": reports}, args.json)
    return 0 if all(r["failed"] == 0 for r in reports) else 1
