"""`tokenloom bench offline`: one workload through several strategy combinations."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenloom.bench.runner import StepRecorder, run_workload
from tokenloom.bench.stats import ratio
from tokenloom.bench.workload import (
    BenchRequest,
    make_workload,
    parse_range,
    token_range_for,
)
from tokenloom.core.config import SELECTABLE_ROLES, load_toml, merge_layers
from tokenloom.core.errors import ConfigError
from tokenloom.core.plugins import ROLE_LABELS, PluginManager


def parse_combo(spec: str, pm: PluginManager) -> tuple[str, dict]:
    """``continuous+paged`` (names matched to roles) or a TOML file -> (label, config layer)."""
    if spec.endswith(".toml"):
        return Path(spec).stem, load_toml(spec)
    layer: dict = {}
    for name in spec.split("+"):
        roles = [r for r in SELECTABLE_ROLES if name in pm.entries(r)]
        if not roles:
            known = sorted({n for r in SELECTABLE_ROLES for n in pm.entries(r)})
            raise ConfigError(f"combo {spec!r}: no strategy named {name!r}; known: {', '.join(known)}")
        if len(roles) > 1:
            raise ConfigError(f"combo {spec!r}: {name!r} names a {' and a '.join(ROLE_LABELS[r] for r in roles)}")
        if roles[0] in layer:
            raise ConfigError(f"combo {spec!r} names two {ROLE_LABELS[roles[0]]}s")
        layer[roles[0]] = {"name": name}
    return spec, layer


def run_offline(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM

    workload: list[BenchRequest] = []
    combos = [parse_combo(c, pm) for c in (args.combo or ["continuous+paged"])]
    results = []
    for label, layer in combos:
        recorder = StepRecorder()
        pm.register(recorder, name=f"bench-recorder-{label}")
        try:
            llm = LLM(config_file=args.config, flags=merge_layers(flags, layer), plugin_manager=pm)
            try:
                if not workload:  # drawn once, from the first model's vocabulary, then shared
                    workload = make_workload(args.num_requests, parse_range(args.prompt_len),
                                             parse_range(args.output_len), seed=args.workload_seed,
                                             token_range=token_range_for(llm.engine.model_config.vocab_size))
                run_workload(llm, [BenchRequest([100 + i for i in range(16)], 4)] * 2, recorder)  # warm-up
                res = run_workload(llm, workload, recorder)
                res["combo"] = label
                res["config"] = llm.engine.config.to_dict()
                results.append(res)
                print(f"  {label}: {res['output_tok_s']:.1f} output tok/s", flush=True)
            finally:
                llm.close()
        finally:
            pm.pm.unregister(recorder)
    base = results[0]
    for r in results:
        r["ratio_output_tok_s"] = ratio(r["output_tok_s"], base["output_tok_s"])
        r["ratio_total_tok_s"] = ratio(r["total_tok_s"], base["total_tok_s"])
        r["ratio_ttft_mean"] = ratio(r["ttft_ms"]["mean"], base["ttft_ms"]["mean"])
        r["ratio_tpot_mean"] = ratio(r["tpot_ms"]["mean"], base["tpot_ms"]["mean"])
    return {"workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "seed": args.workload_seed,
                         "prompt_tokens": sum(len(w.prompt_token_ids) for w in workload),
                         "output_tokens": sum(w.max_tokens for w in workload)},
            "results": results}


def _f(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def format_table(report: dict) -> str:
    head = ["combo", "out tok/s", "x", "total tok/s", "decode tok/s", "TTFT ms mean/p50/p90/p99",
            "TPOT ms mean/p50/p90/p99", "peak KV", "peak seqs", "preempt"]
    rows = []
    for r in report["results"]:
        t, p = r["ttft_ms"], r["tpot_ms"]
        rows.append([r["combo"], _f(r["output_tok_s"]), _f(r["ratio_output_tok_s"], 2) + "x", _f(r["total_tok_s"]),
                     _f(r["decode_tok_s"]),
                     "/".join(_f(t[k], 0) for k in ("mean", "p50", "p90", "p99")),
                     "/".join(_f(p[k], 1) for k in ("mean", "p50", "p90", "p99")),
                     f"{r['peak_kv_usage'] * 100:.0f}%", str(r["peak_running"]), str(r["preemptions"])])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    return "\n".join(lines)


def write_json(report: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=float))
