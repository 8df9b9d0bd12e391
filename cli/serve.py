"""`tokenloom serve` and `tokenloom chat`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def add_serve_parsers(sub) -> None:
    from tokenloom.cli.args import add_engine_args
    from tokenloom.cli.router import add_router_args

    s = sub.add_parser("serve", help="serve the model: WebSocket streaming + playground page, OpenAI HTTP API")
    s.add_argument("--host", default="127.0.0.1", help="address every frontend binds")
    s.add_argument("--port", type=int, default=None, help="WebSocket frontend and playground page (default 8765)")
    s.add_argument("--openai-port", type=int, default=None, help="OpenAI-compatible HTTP frontend (default 8000)")
    s.add_argument("--frontends", default=None, metavar="NAMES",
                   help="comma-separated frontends to mount (default websocket,openai)")
    s.add_argument("--api-key-file", help="file holding the API key (else $TOKENLOOM_API_KEY)")
    s.add_argument("--allow-origin", action="append", default=None, help="browser Origin to accept (repeatable)")
    s.add_argument("--max-connections", type=_positive(int), default=1024, metavar="N",
                   help="open TCP connections, every frontend's port counted together (WebSocket connections, "
                        "HTTP connections); one more is answered 503 and closed (default 1024; lowered, with "
                        "a warning, to what the open-file limit allows)")
    s.add_argument("--max-connections-per-client", type=_positive(int, zero=True), default=256, metavar="N",
                   help="of those, per client address (default 256: one HTTP client can still fill the default "
                        "--max-queue, each HTTP request holding a connection; behind a proxy every client is "
                        "the proxy's address: raise it or 0 = no per-address cap)")
    s.add_argument("--http-header-timeout", type=_positive(float), default=10.0, metavar="S",
                   help="a new connection's request head (a WebSocket handshake too) must arrive within S "
                        "seconds, a later request's within S of its first byte; else 408 and close (default 10)")
    s.add_argument("--http-body-timeout", type=_positive(float), default=30.0, metavar="S",
                   help="a request body must arrive within S seconds of its head; else 408 and close (default 30)")
    s.add_argument("--http-keepalive-timeout", type=_positive(float), default=5.0, metavar="S",
                   help="close an HTTP connection idle S seconds between requests (default 5)")
    s.add_argument("--max-queue", type=int, default=256, help="unfinished requests before `overloaded`")
    s.add_argument("--send-timeout", type=float, default=10.0, help="seconds a blocked send may take")
    s.add_argument("--shutdown-deadline", type=float, default=30.0)
    s.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="deadline for requests that set no timeout_s (finish reason `timeout`)")
    s.add_argument("--rate-limit-rpm", type=int, default=None, metavar="N", help="requests per minute per connection")
    s.add_argument("--rate-limit-tpm", type=int, default=None, metavar="N",
                   help="tokens (prompt + max_tokens) per minute per connection")
    s.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine processes behind a cache-aware router on --port (WebSocket only)")
    add_router_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="interactive chat against a running server")
    c.add_argument("--url", default="ws://127.0.0.1:8765")
    c.add_argument("--api-key-file")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--max-tokens", type=int, default=512)
    c.set_defaults(func=cmd_chat)


def _positive(kind, *, zero: bool = False):
    """An argparse type: a number > 0 (or >= 0 with ``zero``)."""
    def parse(text: str):
        value = kind(text)
        if not (value >= 0 if zero else value > 0) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


async def serve_until_stopped(server, stop: asyncio.Event) -> int:
    """Run a started server until ``stop`` is set (exit status 0) or its engine gives up
    after repeated step failures (core/health.py): then drain and return 1, so that a
    supervisor (systemd, Kubernetes) starts a fresh process."""
    engine = server.engine
    dead = asyncio.ensure_future(engine.dead_event.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, dead], return_when=asyncio.FIRST_COMPLETED)
    await server.shutdown()
    await engine.shutdown()
    for waiter in (dead, stopped):
        waiter.cancel()
    if engine.dead_event.is_set():
        print(f"engine failed: {engine.health_report().reason}; exiting", file=sys.stderr, flush=True)
        return 1
    return 0


#: what `serve` changes from the engine's defaults (a config file or flag overrides it)
SERVE_DEFAULTS = {"decoder": {"name": "auto"}}


def serve_layer(args: argparse.Namespace) -> dict:
    """The serve-only flags as a config layer over ``[frontends]``."""
    from tokenloom.core.config import merge_layers, nested

    layers = []
    if args.frontends is not None:
        layers.append(nested("frontends.enabled", [n.strip() for n in args.frontends.split(",") if n.strip()]))
    if args.port is not None:
        layers.append(nested("frontends.websocket.port", args.port))
    if args.openai_port is not None:
        layers.append(nested("frontends.openai.port", args.openai_port))
    return merge_layers(*layers)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:
        from tokenloom.cli.router import cmd_serve_data_parallel
        from tokenloom.core.errors import ClientError

        if args.data_parallel_size < 1:
            raise ClientError.bad_value("data_parallel_size", args.data_parallel_size, ">= 1")
        return cmd_serve_data_parallel(args)
    from tokenloom.cli.args import api_key_from, flags_layer, progress_bar
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.config import merge_layers
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.errors import ConfigError
    from tokenloom.core.logging import configure_logging
    from tokenloom.core.plugins import PluginManager
    from tokenloom.protocols.connections import fit_fd_limit
    from tokenloom.protocols.gateway import FrontendHost, ServerOptions
    from tokenloom.protocols.ratelimit import RateLimits

    configure_logging("INFO")
    flags = merge_layers(flags_layer(args), serve_layer(args))
    options = ServerOptions(host=args.host, api_key=api_key_from(args.api_key_file),
                            allowed_origins=args.allow_origin, max_connections=fit_fd_limit(args.max_connections),
                            max_connections_per_client=args.max_connections_per_client,
                            http_header_timeout_s=args.http_header_timeout, http_body_timeout_s=args.http_body_timeout,
                            http_keepalive_timeout_s=args.http_keepalive_timeout,
                            max_queue=args.max_queue, send_timeout_s=args.send_timeout,
                            shutdown_deadline_s=args.shutdown_deadline, default_timeout_s=args.request_timeout,
                            rate_limits=RateLimits(args.rate_limit_rpm, args.rate_limit_tpm),
                            public_metrics=args.public_metrics)
    pm = PluginManager()
    # a server answers one chat at a time as often as it batches: `auto` speculates while the
    # batch is small and steps aside under load (docs/speculative-decoding.md)
    config = config_from_sources(pm, args.config, flags, defaults=SERVE_DEFAULTS)
    separate = config.engine.process in ("auto", "separate")
    if separate and config.engine.tensor_parallel_size > 1:
        if config.engine.process == "separate":
            raise ConfigError("process = \"separate\" does not combine with tensor_parallel_size > 1 yet "
                              "(the ranks are the engine's own processes); use --engine-process inline")
        separate = False  # auto: tensor-parallel ranks keep the engine in the server's process
    inline = None if separate else AsyncEngine(config, plugin_manager=pm, progress=progress_bar("loading model"))

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if separate:
            from tokenloom.core.engine_process import EngineClient

            engine = await EngineClient.start(config, pm, log_level="INFO", show_progress=True)
        else:
            engine = inline
        try:
            host = FrontendHost(engine, options)
            await host.start()
            print(host.banner(), file=sys.stderr, flush=True)
            return await serve_until_stopped(host, stop)
        finally:
            if separate:
                await engine.aclose()

    code = asyncio.run(main())
    if inline is not None:
        inline.close()
    return code


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenloom.cli.args import api_key_from
    from tokenloom.protocols.websocket.client import Client, RequestError
    from tokenloom.protocols.websocket.messages import Delta, Done

    async def main() -> int:
        history = [{"role": "system", "content": args.system}] if args.system else []
        async with Client(args.url, api_key=api_key_from(args.api_key_file)) as client:
            print(f"connected to {client.session.model}; an empty line or Ctrl-D quits", file=sys.stderr)
            loop = asyncio.get_running_loop()
            while True:
                sys.stdout.write("> ")
                sys.stdout.flush()
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line.strip():
                    return 0
                history.append({"role": "user", "content": line.strip()})
                reply = []
                try:
                    async for ev in client.generate(messages=history, params={
                            "temperature": args.temperature, "max_tokens": args.max_tokens}):
                        if isinstance(ev, Delta):
                            reply.append(ev.text)
                            sys.stdout.write(ev.text)
                            sys.stdout.flush()
                        elif isinstance(ev, Done):
                            ttft = f"{ev.metrics.ttft_ms:.0f} ms" if ev.metrics.ttft_ms is not None else "-"
                            print(f"\n[{ev.finish_reason}, {ev.usage.completion_tokens} tokens, TTFT {ttft}]",
                                  file=sys.stderr)
                except RequestError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": "".join(reply)})

    return asyncio.run(main())
