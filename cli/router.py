"""`tokenloom router` and `tokenloom serve --data-parallel-size N`.

With N > 1, `serve` is a supervisor: it starts N `tokenloom serve` children (the same
engine flags and config; the WebSocket frontend alone, on loopback, each on a port the OS
picks, read back from its banner), waits for each ``/health``, runs the router on
``--port`` in front of them, and on SIGTERM/SIGINT stops the router, then the children.
Children die with the supervisor even if it is killed (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
from typing import Any

from tokenloom.core.errors import ClientError

_BANNER_URL = re.compile(r"websocket\s+(ws://\S+)")
_RELAYS: set[asyncio.Task] = set()  # stderr relays of the replicas, kept referenced


def add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="cache-aware router in front of N `tokenloom serve` replicas")
    r.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="ws://host:port of a running `tokenloom serve` (repeatable)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8765)
    add_router_args(r)
    r.add_argument("--api-key-file", help="file holding the API key (else $TOKENLOOM_API_KEY); sent to replicas too")
    r.add_argument("--allow-origin", action="append", default=None, help="browser Origin to accept (repeatable)")
    r.add_argument("--public-metrics", action="store_true", help="serve /metrics and /stats without the API key")
    r.add_argument("--shutdown-deadline", type=float, default=30.0)
    r.set_defaults(func=cmd_router)


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="route by cache when a replica holds this fraction of the prompt (default 0.5)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="in-flight lead over the least loaded replica that overrides the cache (default 32)")


def router_options(args: argparse.Namespace, port: int):
    from tokenloom.cli.args import api_key_from
    from tokenloom.protocols.router.server import RouterOptions

    return RouterOptions(host=args.host, port=port, api_key=api_key_from(args.api_key_file),
                         allowed_origins=tuple(getattr(args, "allow_origin", None) or ()),
                         cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
                         shutdown_deadline_s=args.shutdown_deadline, public_metrics=args.public_metrics)


async def _run_router(router, stop: asyncio.Event) -> None:
    await router.start()
    print(f"routing over {len(router.replicas)} replicas\n  router     {router.url}", file=sys.stderr, flush=True)
    await stop.wait()
    await router.shutdown()


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def cmd_router(args: argparse.Namespace) -> int:
    from tokenloom.core.logging import configure_logging
    from tokenloom.protocols.router.server import Router

    configure_logging("INFO")
    router = Router(args.replica, router_options(args, args.port))

    async def main() -> None:
        await _run_router(router, _stop_event())

    asyncio.run(main())
    return 0


# ---- serve --data-parallel-size N ---------------------------------------------------------
def child_argv(args: argparse.Namespace) -> list[str]:
    """The `tokenloom serve` arguments of one replica: the engine flags as ``--set`` (their
    config keys), the config file, and the serve limits that hold per replica."""
    from tokenloom.cli.args import flags_layer

    for flag, value in (("--frontends", args.frontends), ("--openai-port", args.openai_port),
                        ("--rate-limit-rpm", args.rate_limit_rpm), ("--rate-limit-tpm", args.rate_limit_tpm)):
        if value is not None and not (flag == "--frontends" and value.strip() == "websocket"):
            raise ClientError(f"{flag} is not supported with --data-parallel-size > 1 (the router serves "
                              "the WebSocket protocol only, and replicas see one pooled connection)",
                              param=flag.lstrip("-").replace("-", "_"), value=value)
    argv = ["--host", "127.0.0.1", "--port", "0", "--frontends", "websocket",
            "--max-connections", str(args.max_connections), "--max-queue", str(args.max_queue),
            "--send-timeout", str(args.send_timeout), "--shutdown-deadline", str(args.shutdown_deadline)]
    if args.config:
        argv += ["--config", args.config]
    if args.request_timeout is not None:
        argv += ["--request-timeout", str(args.request_timeout)]
    if args.api_key_file:
        argv += ["--api-key-file", args.api_key_file]
    if args.public_metrics:
        argv.append("--public-metrics")
    for key, value in _flatten(flags_layer(args)):
        argv += ["--set", f"{key}={json.dumps(value)}"]  # JSON scalars and lists are TOML values
    return argv


def _flatten(layer: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in layer.items():
        out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _start_child(i: int, argv: list[str], children: list) -> str:
    """Start replica ``i`` (listed in ``children`` at once, so it is stopped whatever
    happens next) and read its URL from its banner; its stderr is then relayed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenloom.cli.main", "serve", *argv, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent)
    children.append(proc)
    while True:
        line = (await proc.stderr.readline()).decode(errors="replace")
        if not line:
            code = await proc.wait()
            raise RuntimeError(f"replica {i} exited with status {code} before serving")
        sys.stderr.write(f"[replica {i}] {line}")
        if m := _BANNER_URL.search(line):
            _RELAYS.add(asyncio.create_task(_relay(i, proc.stderr)))
            return m.group(1)


async def _relay(i: int, stream: asyncio.StreamReader) -> None:
    while line := await stream.readline():
        sys.stderr.write(f"[replica {i}] {line.decode(errors='replace')}")


async def _wait_healthy(url: str, api_key: str | None, timeout_s: float = 120.0) -> None:
    from tokenloom.protocols.router.upstream import http_get

    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while (await asyncio.to_thread(http_get, "http" + url[2:] + "/health", api_key, 2.0))[0] != 200:
        if loop.time() > end:
            raise RuntimeError(f"replica {url} is not healthy after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def _start_children(n: int, argv: list[str], children: list, api_key: str | None) -> list[str]:
    urls = await asyncio.gather(*(_start_child(i, argv, children) for i in range(n)))
    await asyncio.gather(*(_wait_healthy(u, api_key) for u in urls))
    return list(urls)


async def _stop_children(children: list[asyncio.subprocess.Process], deadline_s: float) -> None:
    for proc in children:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    for proc in children:
        try:
            await asyncio.wait_for(proc.wait(), deadline_s + 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def cmd_serve_data_parallel(args: argparse.Namespace) -> int:
    """`tokenloom serve --data-parallel-size N` (N > 1): N replicas behind a router. Exit
    status 1 when every replica has exited on its own (a supervisor restarts the lot)."""
    from tokenloom.core.logging import configure_logging
    from tokenloom.protocols.router.server import Router

    configure_logging("INFO")
    argv = child_argv(args)
    options = router_options(args, args.port if args.port is not None else 8765)

    async def main() -> int:
        stop = _stop_event()
        children: list[asyncio.subprocess.Process] = []
        stopped = asyncio.ensure_future(stop.wait())
        try:
            startup = asyncio.ensure_future(_start_children(args.data_parallel_size, argv, children, options.api_key))
            await asyncio.wait([startup, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not startup.done():  # stopped while the replicas load their model
                startup.cancel()
                return 0
            router = Router(startup.result(), options)
            all_exited = asyncio.ensure_future(asyncio.gather(*(p.wait() for p in children)))
            runner = asyncio.create_task(_run_router(router, stop))
            await asyncio.wait([all_exited, runner, stopped], return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            await runner
            if all_exited.done():
                print("every replica has exited; stopping", file=sys.stderr, flush=True)
                return 1
            all_exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await all_exited  # retrieved: a cancelled gather left alone logs a traceback at exit
            return 0
        finally:
            await _stop_children(children, args.shutdown_deadline)

    return asyncio.run(main())
