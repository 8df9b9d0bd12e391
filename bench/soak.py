"""`tokenloom bench serve --duration S`: a soak test of a running server.

Poisson arrivals for ``S`` seconds (the workload cycles). Over the WebSocket protocol
(``--url``) most requests are multiplexed on one connection, a fraction
``--disconnect-fraction`` each on its own connection that is dropped after a few tokens.
Through the OpenAI frontend (``--openai URL``) each request is its own HTTP connection
streaming ``/v1/completions`` as server-sent events, and that fraction hangs up mid-stream.
What it checks is the server's promise, not its speed:

- lost: requests the server accepted that never got their ``done`` (HTTP: a 200 whose
  stream never carried a finish reason), excluding the ones whose client left on purpose;
- duplicate ``done``s (HTTP: more than one finish in a stream);
- refusals by error code, finish reasons (``error`` is an internal failure);
- the server's RSS over the run and its peak, its peak KV usage (from ``/health``);
- afterwards: no request left in the engine and no KV block in use, and — where
  ``/metrics`` answers — the server ended exactly as many requests as it accepted
  (``tokenloom_requests_total`` over the run: every one finished or was aborted, once).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from urllib.parse import urlsplit

from tokenloom.bench.workload import BenchRequest


def _get(url: str, path: str, api_key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url.replace("ws://", "http://").replace("wss://", "https://") + path,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:  # 503 while draining or restarting: still a JSON body
        return exc.code, exc.read()


def _health(url: str, api_key: str | None) -> dict:
    """The server's /health body; a refusal that is not JSON (a connection cap's plain 503)
    becomes ``{"status": "HTTP <code>"}`` so that a sample under overload does not end the soak."""
    status, body = _get(url, "/health", api_key)
    try:
        return json.loads(body)
    except ValueError:
        return {"status": f"HTTP {status}"}


def _ended(url: str, api_key: str | None) -> Counter | None:
    """``tokenloom_requests_total`` by finish reason from ``/metrics``; None where it does
    not answer (no key)."""
    try:
        status, body = _get(url, "/metrics", api_key)
    except OSError:
        return None
    if status != 200:
        return None
    found = re.findall(r'^tokenloom_requests_total\{finish_reason="([^"]+)"\} ([0-9.e+]+)$', body.decode(), re.M)
    return Counter({reason: int(float(n)) for reason, n in found})


async def _settle(loop, url: str, api_key: str | None, ended_before: Counter | None, accepted: int) -> tuple:
    """Wait (10 s at most) until nothing runs, no block is in use and, where /metrics
    answers, the server has ended every accepted request; then (health, ended over the run)."""
    ended = None
    for _ in range(100):  # the last aborts land within a step or two
        after = await loop.run_in_executor(None, _health, url, api_key)
        if ended_before is not None:
            now = await loop.run_in_executor(None, _ended, url, api_key)
            ended = None if now is None else now - ended_before
        idle = after.get("running") == 0 and after.get("waiting") == 0 and after.get("kv_blocks_used") == 0
        if idle and (ended is None or sum(ended.values()) >= accepted):
            break
        await asyncio.sleep(0.1)
    return after, ended


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
    ended_before = await loop.run_in_executor(None, _ended, url, api_key)
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
    after, ended = await _settle(loop, url, api_key, ended_before, accepted)
    rss.append((time.perf_counter() - t0, after.get("rss_bytes", 0)))
    tally["duplicate_done"] = sum(1 for m in stray if type(m).__name__ == "Done")
    return _report("websocket", rate, elapsed, n, accepted, tally, rss, after, ended)


def _report(frontend: str, rate: float, elapsed: float, sent: int, accepted: int, tally: dict, rss: list,
            after: dict, ended: Counter | None) -> dict:
    finished = sum(tally["finish"].values())
    return {
        "frontend": frontend, "rate": rate, "duration_s": elapsed, "sent": sent, "accepted": accepted,
        "lost": accepted - finished - tally["disconnected"],
        "duplicate_done": tally["duplicate_done"],
        "finish_reasons": dict(tally["finish"]), "refused": dict(tally["refused"]),
        "disconnected": tally["disconnected"], "lost_connection": tally["lost_connection"],
        "output_tok_s": tally["output_tokens"] / elapsed,
        "rss_mb": [(round(t), round(b / 2**20)) for t, b in rss],
        "peak_rss_mb": round(after.get("peak_rss_bytes", 0) / 2**20),
        "peak_kv_usage": after.get("peak_kv_usage"), "engine_failures": after.get("engine_failures"),
        "server_ended": None if ended is None else dict(+ended),
        "after": {k: after.get(k) for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_cached",
                                            "kv_blocks_free", "kv_blocks_total")},
    }


# ---- through the OpenAI frontend ----------------------------------------------------------
async def _http_stream(host: str, port: int, path: str, payload: bytes, api_key: str | None):
    """POST ``payload`` on a connection of its own: (reader, writer, status, headers, body
    iterator). The body iterator yields the decoded body (chunked or not) as it arrives."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    writer.write(head.encode() + b"\r\n" + payload)
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()

    async def body():
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
                yield await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    return reader, writer, status, headers, body()


def _refusal_code(status: int, data: bytes) -> str:
    try:
        return json.loads(data)["error"]["code"] or f"http_{status}"
    except (ValueError, KeyError, TypeError):
        text = data.decode("utf-8", "replace").strip()
        return text.replace(" ", "_") if text == "too many connections" else f"http_{status}"


async def _openai_request(base: str, model: str, req: BenchRequest, leave_after: int | None, tally: dict,
                          api_key: str | None) -> None:
    """One streamed completion; ``leave_after``: hang up after that many content chunks."""
    url = urlsplit(base)
    payload = json.dumps({"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                          "temperature": 0.7, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
    writer = None
    try:
        _, writer, status, _, body = await _http_stream(url.hostname, url.port or 80, "/v1/completions", payload,
                                                        api_key)
        if status != 200:
            tally["refused"][_refusal_code(status, b"".join([c async for c in body]))] += 1
            return
        tally["accepted"] += 1
        chunks, finishes, buffer = 0, 0, b""
        async for data in body:
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                msg = json.loads(event[6:])
                if "error" in msg:
                    finishes += 1
                    tally["finish"]["error"] += 1
                    continue
                for choice in msg.get("choices") or ():
                    if choice.get("finish_reason") is not None:
                        finishes += 1
                        tally["finish"][choice["finish_reason"]] += 1
                    elif choice.get("text"):
                        chunks += 1
                if msg.get("usage"):
                    tally["output_tokens"] += msg["usage"]["completion_tokens"]
                if leave_after is not None and chunks >= leave_after and not finishes:
                    tally["disconnected"] += 1
                    writer.transport.abort()  # the client leaves mid-stream
                    return
        tally["duplicate_done"] += max(0, finishes - 1)
    except (OSError, asyncio.IncompleteReadError, ValueError):
        tally["lost_connection"] += 1
    finally:
        if writer is not None:
            writer.close()


async def run_openai_soak(base_url: str, rate: float, duration_s: float, workload: list[BenchRequest], seed: int,
                          disconnect_fraction: float = 0.05, api_key: str | None = None,
                          sample_every_s: float = 10.0) -> dict:
    """The soak through the OpenAI frontend at ``base_url`` (``http://host:port``, a
    trailing ``/v1`` is dropped): each request streams ``/v1/completions`` on its own
    connection; ``disconnect_fraction`` of them hang up after a few chunks. Its report has
    :func:`run_soak`'s shape (:func:`format_soak`, :func:`soak_passed`)."""
    base = base_url.rstrip("/").removesuffix("/v1")
    rng = random.Random(seed)
    tally = {"finish": Counter(), "refused": Counter(), "disconnected": 0, "lost_connection": 0,
             "output_tokens": 0, "accepted": 0, "duplicate_done": 0}
    loop = asyncio.get_running_loop()
    status, models = await loop.run_in_executor(None, _get, base, "/v1/models", api_key)
    if status != 200:
        raise RuntimeError(f"{base}/v1/models answered {status}: {models[:200]!r}")
    model = json.loads(models)["data"][0]["id"]
    ended_before = await loop.run_in_executor(None, _ended, base, api_key)
    rss: list[tuple[float, int]] = []
    tasks, n = [], 0
    t0 = time.perf_counter()
    next_sample = 0.0
    while (now := time.perf_counter() - t0) < duration_s:
        if now >= next_sample:
            h = await loop.run_in_executor(None, _health, base, api_key)
            rss.append((now, h.get("rss_bytes", 0)))
            next_sample += sample_every_s
        leave = rng.randint(1, 8) if rng.random() < disconnect_fraction else None
        tasks.append(asyncio.create_task(_openai_request(base, model, workload[n % len(workload)], leave, tally,
                                                         api_key)))
        n += 1
        await asyncio.sleep(rng.expovariate(rate) if math.isfinite(rate) and rate > 0 else 0)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    after, ended = await _settle(loop, base, api_key, ended_before, tally["accepted"])
    rss.append((time.perf_counter() - t0, after.get("rss_bytes", 0)))
    return _report("openai", rate, elapsed, n, tally["accepted"], tally, rss, after, ended)


def format_soak(r: dict) -> str:
    rss = [mb for _, mb in r["rss_mb"]]
    rows = [
        ("duration", f"{r['duration_s']:.0f} s at {r['rate']} req/s (Poisson), {r.get('frontend', 'websocket')}"),
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
        ("server ended (finish reasons)", "-" if r.get("server_ended") is None else
         f"{sum(r['server_ended'].values())}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["server_ended"].items()))),
        ("after: running/waiting", f"{r['after']['running']}/{r['after']['waiting']}"),
        ("after: KV used/cached/free/total", "/".join(str(r["after"][k]) for k in (
            "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free", "kv_blocks_total"))),
    ]
    return "\n".join(f"| {k} | {v} |" for k, v in [("measure", "value"), ("---", "---"), *rows])


def soak_passed(r: dict) -> bool:
    """Something was accepted; nothing lost, nothing ended twice, no internal error, nothing
    left running or holding a block, and (where /metrics answered) the server ended each
    accepted request once."""
    ended = r.get("server_ended")
    return (r["accepted"] > 0 and r["lost"] == 0 and r["duplicate_done"] == 0 and r["finish_reasons"].get("error", 0) == 0
            and r["lost_connection"] == 0 and r["after"]["running"] == 0 and r["after"]["kv_blocks_used"] == 0
            and (ended is None or sum(ended.values()) == r["accepted"]))
