"""`tokenloom bench decode`: decode speed at fixed batch sizes, and batch 1 against the
memory-bandwidth floor (every weight byte is read once per token)."""

from __future__ import annotations

import time

import torch

from tokenloom.core.config import merge_layers
from tokenloom.core.plugins import PluginManager
from tokenloom.protocols.bench.runner import StepRecorder, run_workload
from tokenloom.protocols.bench.workload import BenchRequest, make_workload, token_range_for


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


def run_decode(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM

    recorder = StepRecorder()
    pm.register(recorder, name="bench-decode-recorder")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    layer = {"scheduler": {"max_num_seqs": max(sizes), "max_num_batched_tokens": max(512, max(sizes) * args.prompt_len)}}
    llm = LLM(config_file=args.config, flags=merge_layers(flags, layer), plugin_manager=pm)
    try:
        run_workload(llm, [BenchRequest([100 + i for i in range(16)], 8)], recorder)  # warm-up
        results = []
        for b in sizes:
            work = make_workload(b, (args.prompt_len, args.prompt_len), (args.gen, args.gen), seed=b,
                                 token_range=token_range_for(llm.engine.model_config.vocab_size))
            res = run_workload(llm, work, recorder)
            results.append({"batch_size": b, "decode_tok_s": res["decode_tok_s"],
                            "ms_per_step": 1e3 * b / res["decode_tok_s"] if res["decode_tok_s"] else None,
                            "output_tok_s": res["output_tok_s"]})
            print(f"  batch {b}: {res['decode_tok_s']:.1f} tok/s decode", flush=True)
        wbytes = llm.engine.runner.model.weight_bytes_per_token()
        dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    finally:
        llm.close()
        pm.pm.unregister(recorder)
    bw = read_bandwidth_gbs()
    floor_ms = wbytes / (bw * 1e9) * 1e3
    for r in results:
        if r["batch_size"] == 1 and r["ms_per_step"]:
            r["floor_ms"] = floor_ms
            r["fraction_of_floor"] = floor_ms / r["ms_per_step"]
    return {"dtype": dtype, "weight_bytes": wbytes, "read_bandwidth_gbs": bw, "floor_ms_per_token": floor_ms,
            "threads": torch.get_num_threads(), "results": results}


def format_decode(report: dict) -> str:
    lines = [f"dtype {report['dtype']}, weights {report['weight_bytes'] / 1e6:.0f} MB, "
             f"read bandwidth {report['read_bandwidth_gbs']:.1f} GB/s -> floor "
             f"{report['floor_ms_per_token']:.2f} ms/token ({1e3 / report['floor_ms_per_token']:.0f} tok/s) at batch 1, "
             f"{report['threads']} threads"]
    for r in report["results"]:
        line = f"batch {r['batch_size']:>3}: {r['decode_tok_s']:8.1f} tok/s decode ({r['ms_per_step']:.1f} ms/step)"
        if "fraction_of_floor" in r:
            line += f" = {100 * r['fraction_of_floor']:.0f}% of the bandwidth floor"
        lines.append(line)
    return "\n".join(lines)
