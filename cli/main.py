"""The `tokenloom` command: generate, plugins, config."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from tokenloom.cli.args import add_engine_args, flags_layer, progress_bar


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "-t", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--logprobs", type=int, default=None, help="print top-N logprobs of each token")


def _sampling_params(args):
    from tokenloom.core.sampling_params import SamplingParams

    return SamplingParams.from_dict({
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty, "max_tokens": args.max_tokens, "stop": args.stop,
        "stop_token_ids": args.stop_token_id, "ignore_eos": args.ignore_eos, "seed": args.sampling_seed,
        "logprobs": args.logprobs,
    })


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="LLM inference, every optimisation a plugin.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--system", help="system prompt (chat mode)")
    _add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("plugins", help="list every registered strategy and where it came from")
    p.set_defaults(func=cmd_plugins)

    c = sub.add_parser("config", help="print the effective strategy combination and options")
    add_engine_args(c)
    c.set_defaults(func=cmd_config)

    from tokenloom.bench.cli import add_bench_parser
    from tokenloom.cli.eval import add_eval_parser
    from tokenloom.cli.plan import add_plan_parser
    from tokenloom.cli.quantize import add_quantize_parser
    from tokenloom.cli.router import add_router_parser
    from tokenloom.cli.serve import add_serve_parsers
    from tokenloom.cli.train_eagle import add_train_eagle_parser
    from tokenloom.cli.train_medusa import add_train_medusa_parser

    add_serve_parsers(sub)
    add_router_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    add_quantize_parser(sub)
    add_train_medusa_parser(sub)
    add_train_eagle_parser(sub)
    add_plan_parser(sub)
    return parser


def cmd_generate(args) -> int:
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.outputs import Finished

    params = _sampling_params(args)
    engine = AsyncEngine.from_options(args.config, flags_layer(args), progress=progress_bar("loading model"))
    if args.raw:
        inputs = {"prompt": args.prompt}
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        inputs = {"messages": messages}

    async def run() -> Finished:
        final = None
        async for item in engine.generate(params=params, **inputs):
            if isinstance(item, Finished):
                final = item
            else:
                sys.stdout.write(item.text)
                sys.stdout.flush()
                if args.logprobs is not None and item.logprobs:
                    for lp in item.logprobs:
                        alts = ", ".join(f"{engine.tokenizer.decode([t.token_id])!r}:{t.logprob:.2f}" for t in lp.top)
                        print(f"\n  [{lp.token_id} {lp.logprob:.3f}] {alts}", file=sys.stderr)
        await engine.shutdown()
        return final

    t0 = time.perf_counter()
    final = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    m, u = final.metrics, final.usage
    rate = u.completion_tokens / elapsed if elapsed else 0.0
    ttft = f"{m.ttft_ms:.0f} ms" if m.ttft_ms is not None else "-"
    tpot = f"{m.tpot_ms:.1f} ms" if m.tpot_ms is not None else "-"
    print(f"[{final.finish_reason}] prompt {u.prompt_tokens} tok, completion {u.completion_tokens} tok, "
          f"TTFT {ttft}, TPOT {tpot}, {rate:.1f} tok/s", file=sys.stderr)
    engine.close()
    return 0 if final.finish_reason in ("stop", "length") else 1


def cmd_plugins(args) -> int:
    from tokenloom.core.plugins import ROLES, PluginManager

    pm = PluginManager()
    rows = [(role, e.name, e.package, e.source, e.description)
            for role in ROLES for e in pm.entries(role).values()]
    widths = [max(len(str(r[i])) for r in rows + [("ROLE", "NAME", "PACKAGE", "PLUGIN", "")]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(("ROLE", "NAME", "PACKAGE", "PLUGIN"), widths, strict=True)) + "  DESCRIPTION")
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return 0


def cmd_config(args) -> int:
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.plugins import PluginManager

    config = config_from_sources(PluginManager(), args.config, flags_layer(args))
    print(config.to_toml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    from tokenloom.core.errors import TokenloomError
    from tokenloom.core.logging import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging("WARNING")
    try:
        return args.func(args)
    except TokenloomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
