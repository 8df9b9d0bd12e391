"""`tokenloom quantize`: write a quantised checkpoint (see plugins/quantizers/offline.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_quantize_parser(sub) -> None:
    from tokenloom.cli.args import add_engine_args
    from tokenloom.plugins.quantizers.offline import METHODS

    q = sub.add_parser("quantize", help="write a quantised checkpoint (GPTQ/AWQ/fp8 layouts) from a model")
    q.add_argument("--method", required=True, choices=METHODS)
    q.add_argument("--out", required=True, help="output directory (a Hugging Face layout)")
    q.add_argument("--bits", type=int, default=4, help="rtn/gptq/awq code width (awq: 4 only)")
    q.add_argument("--group-size", type=int, default=128,
                   help="columns per scale; halved until it divides every matmul width")
    q.add_argument("--act-order", action="store_true", help="gptq: quantise columns by descending Hessian diagonal")
    q.add_argument("--rounding", choices=("gptq", "nearest"), default="gptq",
                   help="int8/fp8: GPTQ error feedback against calibration Hessians (default), or round each "
                        "weight to the nearest grid point (no calibration)")
    q.add_argument("--calibration-tokens", type=int, default=16384,
                   help="gptq/awq, int8/fp8 with --rounding gptq: tokens of calibration text (CPython's pydoc topics, the calibration part)")
    add_engine_args(q)
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from tokenloom import LLM
    from tokenloom.cli.args import flags_layer, progress_bar
    from tokenloom.core import contracts
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.evaluation import calibration_texts
    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.core.plugins import PluginManager
    from tokenloom.core.runner import load_checkpoint
    from tokenloom.plugins.quantizers.offline import (
        QuantizeOptions,
        calibrate,
        dense_weights,
        quantize_state_dict,
        save_hf_dir,
    )

    if args.method == "awq" and args.bits != 4:
        print("error: --bits: awq writes 4-bit weights only (AutoAWQ's GEMM layout)", file=sys.stderr)
        return 2
    opts = QuantizeOptions(args.method, args.bits, args.group_size, args.act_order, rounding=args.rounding)
    flags = {**flags_layer(args), "quantizer": "none", "dtype": "float32"}  # calibrate on the dense model
    pm = PluginManager()
    config = config_from_sources(pm, args.config, flags)
    t0 = time.perf_counter()
    checkpoint = load_checkpoint(resolve_model_path(config.engine.model, config.engine.revision),
                                 contracts.model_formats(pm), torch.float32, models=contracts.model_registry(pm))
    dense = dense_weights(checkpoint)
    captures = None
    if opts.needs_hessians or opts.method == "awq":
        llm = LLM(config_file=args.config, flags=flags, plugin_manager=pm, progress=progress_bar("loading model"))
        try:
            chunks = calibration_texts(args.calibration_tokens, llm.engine.tokenizer)
            captures = calibrate(llm, chunks, hessian=opts.needs_hessians, awq=opts.method == "awq",
                                 progress=progress_bar(f"calibrating on {sum(map(len, chunks))} tokens"))
        finally:
            llm.close()
    tensors, quant_config = quantize_state_dict(dense, checkpoint.config.num_layers, opts, captures,
                                                progress=progress_bar(f"quantizing ({opts.method})"))
    out = Path(args.out)
    save_hf_dir(out, checkpoint, tensors, quant_config)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.0f} MB, {opts.method}, {quant_config.get('bits', 8)}-bit, group "
          f"{quant_config.get('group_size', quant_config.get('q_group_size', '-'))}) in {time.perf_counter() - t0:.0f} s;"
          f" run it with: tokenloom generate --model {out} \"...\"", file=sys.stderr)
    return 0
