"""`tokenloom bench decode`: decode speed at fixed batch sizes, and batch 1 against the
memory-bandwidth floor (every weight byte is read once per token)."""

from __future__ import annotations

import statistics
import time

import torch

from tokenloom.bench.runner import StepRecorder, run_workload
from tokenloom.bench.workload import make_workload, token_range_for
from tokenloom.core.config import merge_layers
from tokenloom.core.errors import ConfigError
from tokenloom.core.plugins import PluginManager


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N read bandwidth of ``torch.sum`` over a buffer far larger than the caches."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9


def _variants(args) -> list[dict]:
    """Each (quantizer, dtype) pair asked for, as a config layer ({} = the configured one)."""
    quantizers = args.quantizers.split(",") if args.quantizers else [None]
    dtypes = args.dtypes.split(",") if args.dtypes else [None]
    captures = [None]
    if getattr(args, "capture_modes", None):
        modes = {"on": True, "off": False}
        bad = [m for m in args.capture_modes.split(",") if m not in modes]
        if bad:
            raise ConfigError(f"--capture-modes takes on and/or off, got {bad[0]!r}")
        captures = [modes[m] for m in args.capture_modes.split(",")]
    out = []
    for dtype in dtypes:
        for q in quantizers:
            for capture in captures:
                out.append({key: value for key, value in (("quantizer", q), ("dtype", dtype), ("capture", capture))
                            if value is not None})
    return out


def run_decode(args, flags: dict, pm: PluginManager) -> dict:
    """Decode tok/s per batch size for every variant, then the read bandwidth once.

    With ``--rounds N`` every variant is built and measured N times, the rounds interleaved
    (A, B, A, B, ...) so that a slow spell of a shared machine hits every variant alike; each
    figure is the median over the rounds, and the rounds' own figures are kept beside it."""
    layers = _variants(args)
    rounds = [[run_variant(args, merge_layers(flags, v), pm) for v in layers]
              for _ in range(max(1, getattr(args, "rounds", 1)))]
    variants = [_median_of_rounds([r[i] for r in rounds]) for i in range(len(layers))]
    bw = read_bandwidth_gbs()
    for v in variants:
        v["floor_ms_per_token"] = v["weight_bytes"] / (bw * 1e9) * 1e3
        for r in v["results"]:
            if r["batch_size"] == 1 and r["ms_per_step"]:
                r["floor_ms"] = v["floor_ms_per_token"]
                r["fraction_of_floor"] = v["floor_ms_per_token"] / r["ms_per_step"]
    return {"read_bandwidth_gbs": bw, "threads": torch.get_num_threads(), "variants": variants}


def _median_of_rounds(runs: list[dict]) -> dict:
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    out["results"] = []
    for i, first in enumerate(runs[0]["results"]):
        tok_s = [run["results"][i]["decode_tok_s"] for run in runs]
        med = statistics.median(tok_s)
        out["results"].append({**first, "decode_tok_s": med, "ms_per_step": 1e3 * first["batch_size"] / med if med else None,
                               "output_tok_s": statistics.median(run["results"][i]["output_tok_s"] for run in runs),
                               "rounds_decode_tok_s": tok_s})
    return out


def run_variant(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM

    recorder = StepRecorder()
    pm.register(recorder, name="bench-decode-recorder")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    layer = {"scheduler": {"max_num_seqs": max(sizes), "max_num_batched_tokens": max(512, max(sizes) * args.prompt_len)}}
    llm = LLM(config_file=args.config, flags=merge_layers(flags, layer), plugin_manager=pm)
    try:
        # warm-up at each measured shape: a first prefill or decode at a new size pays one-time
        # costs (kernel choice, packed layouts) that once made a first row read 9x slow
        for b in sizes:
            run_workload(llm, make_workload(b, (args.prompt_len, args.prompt_len), (4, 4), seed=1000 + b,
                                            token_range=token_range_for(llm.engine.model_config.vocab_size)), recorder)
        model = llm.engine.runner.model
        dtype = str(llm.engine.runner.dtype).replace("torch.", "")
        step = "captured" if llm.engine.runner.captured else "op by op"
        name = f"{llm.engine.config.quantizer.name if llm.engine.config.quantizer else 'checkpoint'} / {dtype} / {step}"
        print(f"{name}: {model.layers[0].qkv.kernel}", flush=True)
        results = []
        for b in sizes:
            work = make_workload(b, (args.prompt_len, args.prompt_len), (args.gen, args.gen), seed=b,
                                 token_range=token_range_for(llm.engine.model_config.vocab_size))
            res = run_workload(llm, work, recorder)
            results.append({"batch_size": b, "decode_tok_s": res["decode_tok_s"],
                            "ms_per_step": 1e3 * b / res["decode_tok_s"] if res["decode_tok_s"] else None,
                            "output_tok_s": res["output_tok_s"]})
            print(f"  batch {b}: {res['decode_tok_s']:.1f} tok/s decode", flush=True)
        profiles = []
        if getattr(args, "profile", False):  # `bench quant` reuses this without the flag
            from tokenloom.bench.profile import format_profile, profile_decode

            for b in sizes:
                profiles.append(profile_decode(llm, b, args.prompt_len))
                print(format_profile(profiles[-1]), flush=True)
        return {"name": name, "dtype": dtype, "kernel": model.layers[0].qkv.kernel, "profiles": profiles,
                "weight_bytes": model.weight_bytes_per_token(), "results": results}
    finally:
        llm.close()
        pm.pm.unregister(recorder)


def format_decode(report: dict) -> str:
    sizes = [r["batch_size"] for r in report["variants"][0]["results"]]
    lines = [f"read bandwidth {report['read_bandwidth_gbs']:.1f} GB/s, {report['threads']} threads; the floor is "
             "weight bytes / bandwidth (every weight read once per token at batch 1)", "",
             "| quantizer / dtype / step | layer kernel | weights MB | floor ms (tok/s) | "
             + " | ".join(f"batch {b} tok/s" for b in sizes) + " | batch-1 share of floor | batch 1 vs first row |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in sizes) + " | --- | --- |"]
    base = report["variants"][0]["results"][0]["decode_tok_s"]
    rounds = len(report["variants"][0]["results"][0].get("rounds_decode_tok_s", [0]))
    if rounds > 1:
        lines[0] += f"; each figure the median of {rounds} interleaved rounds"
    for v in report["variants"]:
        first = v["results"][0]
        share = f"{100 * first['fraction_of_floor']:.0f}%" if "fraction_of_floor" in first else "-"
        lines.append(f"| {v['name']} | {v['kernel']} | {v['weight_bytes'] / 1e6:.0f} | "
                     f"{v['floor_ms_per_token']:.2f} ({1e3 / v['floor_ms_per_token']:.0f}) | "
                     + " | ".join(f"{r['decode_tok_s']:.1f}" for r in v["results"])
                     + f" | {share} | {first['decode_tok_s'] / base:.2f}x |")
    return "\n".join(lines)
