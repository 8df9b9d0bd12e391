"""The measurements behind `python scripts/claims` (run.py): each runs the project's own
commands and returns the raw figures of the claims it covers, ``{claim key: figures}``
(table.py judges them).

A command's argv is parsed by the `tokenloom` parser and handed to that bench's ``run_*``
function in this process, so the command a row shows is exactly what was run; the engine
flags given to the script are appended to every argv (so they win over a row's own).
Measurements that no single command makes (the KV bytes the engine allocates, paged against
contiguous concurrency, the planner on Llama-2 shapes, the quantised checkpoints `bench
quant` compares) show ``python scripts/claims --only NAME``; the JSON keeps every sub-command.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from tokenloom.cli.args import flags_layer


@dataclass(slots=True)
class Context:
    quick: bool
    engine_argv: list[str]  # the engine flags given to the script, forwarded to every command
    workdir: Path  # scratch: quantised checkpoints
    reports: dict  # measurement name -> the raw reports it ran (the JSON's "reports")


def command(argv: list[str]) -> str:
    return "tokenloom " + shlex.join(argv)


def script_command(argv: list[str]) -> str:
    """A command line of this script (its own rows, which no single `tokenloom` command makes)."""
    return "python scripts/claims " + shlex.join(argv)


def run_command(ctx: Context, name: str, argv: list[str]):
    """Parse ``tokenloom ARGV ENGINE-FLAGS`` and run it in this process; returns (args, report)."""
    from tokenloom.bench.cli import benches
    from tokenloom.cli.main import build_parser
    from tokenloom.core.plugins import PluginManager

    full = [*argv, *ctx.engine_argv]
    print(f"$ {command(full)}", flush=True)
    args = build_parser().parse_args(full)
    ctx.reports.setdefault(name, []).append({"command": command(full)})
    if argv[0] != "bench":
        return args, None
    report = benches()[argv[1]].run(args, flags_layer(args), PluginManager())
    ctx.reports[name][-1]["report"] = report
    return args, report


def only_command(ctx: Context, name: str) -> str:
    return script_command(["--only", name, *ctx.engine_argv])


# ---- measurements: each returns {claim key: figures} -----------------------------------------

def measure_weights(ctx: Context) -> dict:
    """The planner on Llama-2-7B and -70B shapes (their config.json, trimmed)."""
    from tokenloom.planner import PlanOptions, plan, read_checkpoint

    out = {}
    for key, cfg in (("7b", LLAMA2_7B), ("70b", LLAMA2_70B)):
        p = plan(read_checkpoint(_config_json(ctx, key, cfg)), PlanOptions(dtype="bfloat16", quantizer="none"))
        rows = {r.format: r.bytes for r in p.weights}
        out[key] = {"params": p.num_params, "bf16": rows["bf16/fp16"], "int4": rows["int4-g128"],
                    "kv_bytes_per_token": p.kv_bytes_per_token}
    return {"weights": {**out, "command": only_command(ctx, "weights")}}


def measure_kv(ctx: Context) -> dict:
    """Perplexity with a 16-bit, an fp8 and an int8 KV cache (`tokenloom eval perplexity`'s
    computation), and the bytes the backend allocated for each pool."""
    from tokenloom import LLM
    from tokenloom.core import evaluation

    runs = {}
    for kv in ("auto", "fp8", "int8"):
        args, _ = run_command(ctx, "kv", ["eval", "perplexity", "--max-tokens", "256" if ctx.quick else "4096",
                                          "--dtype", "bfloat16", "--kv-cache-dtype", kv])
        with LLM(config_file=args.config, flags=flags_layer(args)) as llm:
            res = evaluation.perplexity(llm, evaluation.evaluation_text(), window=args.window, stride=args.stride,
                                        max_tokens=args.max_tokens)
            runner, cfg = llm.engine.runner, llm.engine.model_config
            allocated = sum(t.numel() * t.element_size() for pair in runner.kv_caches for pool in pair
                            for t in ((pool,) if hasattr(pool, "element_size") else (pool.data, pool.scale)))
            num_blocks = llm.engine.cache.num_blocks
            runs[kv] = {"ppl": res["ppl"], "tokens": res["tokens"], "num_blocks": num_blocks,
                        "allocated_per_token": allocated // (num_blocks * runner.block_size),
                        "dtype_bytes": runner.dtype.itemsize, "model": llm.engine.model_name,
                        "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
        print(f"  kv {kv}: ppl {res['ppl']:.4f}, {runs[kv]['allocated_per_token']} B/token", flush=True)
    base = runs["auto"]
    formula = 2 * base["layers"] * base["kv_heads"] * base["head_dim"] * base["dtype_bytes"]
    weights = measure_weights(ctx)["weights"]
    kv_per_token = {"small": {"model": base["model"], "allocated": base["allocated_per_token"], "formula": formula,
                              "layers": base["layers"], "kv_heads": base["kv_heads"], "head_dim": base["head_dim"],
                              "bytes": base["dtype_bytes"]},
                    "llama2_7b": weights["7b"]["kv_bytes_per_token"], "llama2_70b": weights["70b"]["kv_bytes_per_token"],
                    "command": only_command(ctx, "kv")}
    kv_quant = {"base": f"a {8 * base['dtype_bytes']}-bit KV cache", "runs": runs, "command": only_command(ctx, "kv"),
                "kv": {kv: {"bytes_ratio": r["allocated_per_token"] / base["allocated_per_token"],
                            "blocks_ratio": r["num_blocks"] / base["num_blocks"],
                            "ppl_change_pct": 100 * (r["ppl"] / base["ppl"] - 1)}
                       for kv, r in runs.items() if kv != "auto"}}
    return {"kv_per_token": kv_per_token, "kv_quant": kv_quant}


def measure_paged(ctx: Context) -> dict:
    """Chat requests that declare ``max_tokens`` and stop at EOS, through `continuous` with
    one KV pool (its own size and cache manager, over any given), paged against contiguous:
    the requests running per step while others wait, mean and peak."""
    from pydoc_data.topics import topics

    from tokenloom import LLM, SamplingParams
    from tokenloom.bench.runner import StepRecorder
    from tokenloom.core.config import merge_layers
    from tokenloom.core.plugins import PluginManager

    num, max_tokens, blocks = (6, 32, 16) if ctx.quick else (48, 512, 160)
    messages = [[{"role": "user", "content": f"Explain Python's {key.replace('-', ' ')} in a few sentences."}]
                for key in sorted(topics)[:num]]
    args = _engine_args(ctx)
    out = {}
    for cache in ("contiguous", "paged"):
        pm, recorder = PluginManager(), StepRecorder()
        pm.register(recorder, name="claims-recorder")
        layer = {"num_kv_blocks": blocks, "cache_manager": {"name": cache}, "scheduler": {"name": "continuous"}}
        with LLM(config_file=args.config, flags=merge_layers(flags_layer(args), layer), plugin_manager=pm) as llm:
            outs = llm.generate(messages=messages, params=SamplingParams(temperature=0, max_tokens=max_tokens))
            # while requests wait, the pool (not the demand) sets how many run
            running = [s.num_running for s in recorder.steps if s.num_running]
            steps = [s.num_running for s in recorder.steps if s.num_waiting] or running
            out[cache] = {"mean_running": sum(steps) / len(steps), "peak_running": max(running),
                          "preemptions": llm.engine.counters.preemptions,
                          "mean_output": sum(len(o.token_ids) for o in outs) / len(outs),
                          "mean_prompt": sum(o.usage.prompt_tokens for o in outs) / len(outs),
                          "hit_max_tokens": sum(o.finish_reason == "length" for o in outs)}
        print(f"  {cache}: {out[cache]['mean_running']:.1f} running on average, peak {out[cache]['peak_running']}",
              flush=True)
    p, c = out["paged"], out["contiguous"]
    return {"paged_concurrency": {
        "ratio": p["mean_running"] / c["mean_running"], "paged_mean": p["mean_running"],
        "contiguous_mean": c["mean_running"], "paged_peak": p["peak_running"], "contiguous_peak": c["peak_running"],
        "paged_preemptions": p["preemptions"], "num_kv_blocks": blocks, "requests": num, "max_tokens": max_tokens,
        "mean_output": p["mean_output"], "mean_prompt": p["mean_prompt"], "hit_max_tokens": p["hit_max_tokens"],
        "runs": out, "command": only_command(ctx, "paged")}}


def measure_batching(ctx: Context) -> dict:
    n, plen, olen, seqs = ("6", "4-16", "2-12", "2") if ctx.quick else ("64", "32-256", "32-256", "16")
    argv = ["bench", "offline", "--combo", "static+paged", "--combo", "continuous+paged", "--num-requests", n,
            "--prompt-len", plen, "--output-len", olen, "--max-num-seqs", seqs]
    _, report = run_command(ctx, "batching", argv)
    static, cont = report["results"]
    return {"continuous_batching": {
        "ratio": cont["ratio_output_tok_s"], "static_tok_s": static["output_tok_s"],
        "continuous_tok_s": cont["output_tok_s"], "num_requests": int(n), "prompt_len": plen, "output_len": olen,
        "max_num_seqs": int(seqs), "ttft_ms": cont["ttft_ms"], "command": command([*argv, *ctx.engine_argv])}}


def measure_prefix(ctx: Context) -> dict:
    size = ["--system-len", "64", "--num-requests", "3", "--output-len", "2"] if ctx.quick else \
        ["--system-len", "1000", "--num-requests", "12"]
    argv = ["bench", "prefix", "--workload", "shared-system", "--combos", "no-cache,paged,radix", *size]
    args, report = run_command(ctx, "prefix", argv)
    base, *cached = report["results"]
    return {"prefix_ttft": {
        "system_len": args.system_len, "no_cache_ms": base["ttft_ms"]["mean"],
        "cached": {r["combo"]: {"ttft_ms": r["ttft_ms"]["mean"], "speedup": r["ttft_speedup"]} for r in cached},
        "command": command([*argv, *ctx.engine_argv])}}


def measure_quant(ctx: Context) -> dict:
    """Offline rtn / gptq / awq checkpoints (`tokenloom quantize`), then `bench quant` scores
    them beside the dense weights and int8 on the same tokens."""
    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.planner import read_checkpoint

    calib = "512" if ctx.quick else "8192"
    paths = {}
    for method in ("rtn", "gptq", "awq"):
        paths[method] = str(ctx.workdir / method)
        args, _ = run_command(ctx, "quant", ["quantize", "--method", method, "--out", paths[method],
                                             "--calibration-tokens", calib])
        if args.func(args) != 0:
            raise RuntimeError(f"tokenloom quantize --method {method} failed")
    methods = ",".join(["none", "int8", *(f"{m}={p}" for m, p in paths.items())])
    _, report = run_command(ctx, "quant", ["bench", "quant", "--methods", methods, "--eval-tokens",
                                           "256" if ctx.quick else "4096", "--batch-sizes", ""])
    rows = {r["name"]: r for r in report["methods"]}
    args = _engine_args(ctx)
    own = read_checkpoint(resolve_model_path(args.model or "smollm2-135m")).quant_method
    base = f"the checkpoint's {own} weights dequantised" if own else "the dense checkpoint"
    cmd = only_command(ctx, "quant")
    return {"weight_quant": {"base": base, "int8": rows["int8"]["ppl_change_pct"], "command": cmd,
                             "four_bit": {m: rows[m]["ppl_change_pct"] for m in paths}},
            "gptq_awq": {"rtn": rows["rtn"]["ppl"], "dense": rows["none"]["ppl"], "command": cmd,
                         "methods": {m: rows[m]["ppl"] for m in ("gptq", "awq")}}}


def measure_spec(ctx: Context) -> dict:
    size = ["--decoders", "ngram", "--max-tokens", "16"] if ctx.quick else \
        ["--decoders", "ngram,speculative", "--dtype", "float32", "--quantizer", "none"]
    argv = ["bench", "spec", *size]
    _, report = run_command(ctx, "spec", argv)
    rows = [{"task": r["task"], "decoder": r["decoder"], "speedup": r["speedup"],
             "predicted": r["predicted_speedup"], "acceptance": r["acceptance"], "k": r.get("mean_k", 0.0),
             "cost_ratio": r["cost_ratio"], "tokens_per_step": r["tokens_per_step"],
             "predicted_tokens_per_step": r["predicted_tokens_per_step"]} for r in report["rows"]]
    return {"spec_formula": {"rows": rows, "command": command([*argv, *ctx.engine_argv])}}


def measure_ttft(ctx: Context) -> dict:
    """Interactive TTFT beside long batch jobs (`bench slo`, both schedulers); without that
    bench, `bench offline`'s TTFT under a burst of requests."""
    try:
        import tokenloom.bench.slo  # noqa: F401
    except ImportError:
        figures = measure_batching(ctx)["continuous_batching"]
        t = figures["ttft_ms"]
        return {"ttft_target": {"setting": f"{figures['num_requests']} requests at once (`bench offline`)",
                                "target_ms": 500.0, "command": figures["command"],
                                "rows": [{"label": "continuous", "p50_ms": t["p50"], "p99_ms": t["p99"]}]}}
    size = ["--duration", "4", "--rate", "2", "--interactive-prompt-len", "8-16", "--interactive-output-len", "4-8",
            "--batch-prompt-len", "64-128", "--batch-output-len", "16-32"] if ctx.quick else []
    argv = ["bench", "slo", "--ttft-ms", "500", "--tpot-ms", "100", *size]  # the seed's target; a TPOT one
    _, report = run_command(ctx, "ttft", argv)
    rows = []
    for r in report["results"]:
        c = r["classes"]["interactive"]
        rows.append({"label": r["scheduler"], "p50_ms": c["ttft_p50_ms"], "p99_ms": c["ttft_p99_ms"],
                     "met": c["ttft_met"]})
    w = report["workload"]
    return {"ttft_target": {"setting": f"chat requests ({w['rate']:g}/s for {w['duration']:g} s) beside "
                                       f"{w['batch_concurrency']} long batch jobs (`bench slo`)",
                            "target_ms": w["ttft_ms"], "rows": rows,
                            "command": command([*argv, *ctx.engine_argv])}}


MEASUREMENTS = {"weights": measure_weights, "kv": measure_kv, "paged": measure_paged, "batching": measure_batching,
                "prefix": measure_prefix, "quant": measure_quant, "spec": measure_spec, "ttft": measure_ttft}

# Llama-2's shapes (their config.json files, trimmed to what the planner reads)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LLAMA2_70B = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}


def _config_json(ctx: Context, name: str, cfg: dict) -> Path:
    path = ctx.workdir / f"llama2-{name}" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def _engine_args(ctx: Context) -> argparse.Namespace:
    from tokenloom.cli.main import build_parser

    return build_parser().parse_args(["config", *ctx.engine_argv])
