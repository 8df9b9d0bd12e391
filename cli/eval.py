"""`tokenloom eval perplexity`: sliding-window perplexity of the engine as configured (model,
quantizer, dtype, backend) on the evaluation part of the pydoc text (core/evaluation.py)."""

from __future__ import annotations

import argparse
import sys
import time


def add_eval_parser(sub) -> None:
    from tokenloom.cli.args import add_engine_args

    ev = sub.add_parser("eval", help="quality: perplexity of the engine as configured")
    esub = ev.add_subparsers(dest="eval_command", required=True)

    pp = esub.add_parser("perplexity", help="sliding-window perplexity on the pydoc evaluation text (or a file)")
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens (default: all)")
    pp.add_argument("--window", type=int, default=512, help="tokens per window (capped at max_model_len)")
    pp.add_argument("--stride", type=int, default=None,
                    help="a window every S tokens (default: --window); S < W scores only each window's new tail")
    pp.add_argument("--split", choices=["evaluation", "calibration"], default="evaluation",
                    help="part of the pydoc_data.topics text to score")
    pp.add_argument("--text-file", metavar="FILE", help="score this UTF-8 file instead of the pydoc text")
    pp.add_argument("--json", metavar="FILE")
    add_engine_args(pp)
    pp.set_defaults(func=cmd_perplexity)


def quantizer_label(llm) -> str:
    """The configured quantizer, or what the checkpoint implies when none is configured."""
    q = llm.engine.config.quantizer
    return q.name if q is not None else "checkpoint default"


def cmd_perplexity(args: argparse.Namespace) -> int:
    from tokenloom import LLM
    from tokenloom.bench.offline import write_json
    from tokenloom.cli.args import flags_layer
    from tokenloom.core import evaluation

    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text, source = f.read(), args.text_file
    else:
        text = evaluation.evaluation_text() if args.split == "evaluation" else evaluation.calibration_text()
        source = f"pydoc_data.topics {args.split} split (Python {sys.version.split()[0]})"
    t0 = time.perf_counter()
    llm = LLM(config_file=args.config, flags=flags_layer(args))
    try:
        load_s = time.perf_counter() - t0
        model = llm.engine.runner.model
        t1 = time.perf_counter()
        res = evaluation.perplexity(llm, text, window=args.window, stride=args.stride, max_tokens=args.max_tokens)
        seconds = time.perf_counter() - t1
        leaked = llm.engine.cache.stats().num_used_blocks
        report = {**res, "seconds": seconds, "load_seconds": load_s, "text": source, "model": llm.engine.model_name,
                  "quantizer": quantizer_label(llm), "dtype": str(llm.engine.runner.dtype).replace("torch.", ""),
                  "kernel": model.linear_layers()[0]["qkv"].kernel, "weight_bytes": model.weight_bytes_per_token()}
    finally:
        llm.close()
    print(f"text        {report['text']}")
    print(f"model       {report['model']} | quantizer {report['quantizer']} | dtype {report['dtype']}")
    print(f"kernel      {report['kernel']} | weights {report['weight_bytes'] / 1e6:.1f} MB")
    print(f"windows     {report['windows']} of {report['window']} tokens, stride {report['stride']}")
    print(f"tokens      {report['tokens']} scored of {report['input_tokens']}")
    print(f"nll         {report['nll']:.5f} nats/token")
    print(f"ppl         {report['ppl']:.4f}")
    print(f"seconds     {seconds:.2f} ({report['input_tokens'] / seconds:.0f} tok/s; load {load_s:.2f} s)")
    write_json(report, args.json)
    if leaked:
        print(f"error: {leaked} KV blocks still in use after scoring", file=sys.stderr)
        return 1
    return 0
