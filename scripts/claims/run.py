"""`python scripts/claims`: the seed's numeric claims measured on this machine, one row each,
judged, printed as a markdown table and, with ``--write FILE``, written into FILE between its
claims markers (docs/results.md). measure.py measures, table.py judges and formats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

from claims import table as claims_table
from claims.measure import MEASUREMENTS, Context, only_command, script_command
from tokenloom.cli.args import ENGINE_FLAGS


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as command-line words (see cli/args.py)."""
    out = ["--config", args.config] if getattr(args, "config", None) else []
    for dest in ENGINE_FLAGS:
        value = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        elif value is not None:
            out += [flag, str(value)]
    for item in getattr(args, "set", []) or []:
        out += ["--set", item]
    return out


# ---- the command ---------------------------------------------------------------------------

def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {torch.get_num_threads()} torch threads"


def claims_command(args: argparse.Namespace) -> str:
    argv = [*(["--quick"] if args.quick else []), *(["--only", args.only] if args.only else []),
            *engine_argv(args), *(["--write", args.write] if args.write else []),
            *(["--json", args.json] if args.json else [])]
    return script_command(argv)


def section(rows: list, meta: dict) -> str:
    head = (f"_Generated {meta['date']} on {meta['machine']} by `{meta['command']}` in "
            f"{meta['elapsed_s'] / 60:.1f} minutes; model {meta['model']}._")
    return "\n".join([head, "", claims_table.format_claims(rows)])


def run_claims(args: argparse.Namespace) -> tuple[dict, list]:
    names = args.only.split(",") if args.only else list(MEASUREMENTS)
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown:
        raise ValueError(f"unknown measurement {unknown[0]!r}; known: {', '.join(MEASUREMENTS)}")
    t0 = time.perf_counter()
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="tokenloom-claims-") as tmp:
        ctx = Context(args.quick, engine_argv(args), Path(tmp), {})
        for name in names:
            t1 = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                got = MEASUREMENTS[name](ctx)
            except Exception as exc:  # one failed measurement is a row that says so, not the end of the run
                traceback.print_exc()
                got = {c.key: {"error": f"{type(exc).__name__}: {exc}", "command": only_command(ctx, name)}
                       for c in claims_table.CLAIMS if c.measurement == name}
            for fig in got.values():
                fig["seconds"] = time.perf_counter() - t1
            figures.update(got)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": claims_command(args),
            "elapsed_s": time.perf_counter() - t0, "model": getattr(args, "model", None) or "smollm2-135m",
            "measured": names}
    commands = {c.key: only_command(ctx, c.measurement) for c in claims_table.CLAIMS}
    return {"meta": meta, "figures": figures, "reports": ctx.reports}, claims_table.build_rows(figures, commands)


def cmd_claims(args: argparse.Namespace) -> int:
    target = Path(args.write) if args.write else None
    if target is not None:
        if args.only:
            print("error: --write rewrites the whole table: run every measurement (no --only)")
            return 2
        try:
            claims_table.replace_section(target.read_text(), "")  # fail now, not after the run
        except (OSError, ValueError) as exc:
            print(f"error: --write {target}: {exc}")
            return 2
    result, rows = run_claims(args)
    text = section(rows, result["meta"])
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if target is not None:
        target.write_text(claims_table.replace_section(target.read_text(), text))
        print(f"{target}: the claims section is rewritten")
    return 1 if any("error" in f for f in result["figures"].values()) else 0


def build_parser() -> argparse.ArgumentParser:
    from tokenloom.cli.args import add_engine_args

    cl = argparse.ArgumentParser(prog="python scripts/claims",
                                 description="the seed's claims measured on this machine: a row each, with a verdict and its command")
    cl.add_argument("--quick", action="store_true", help="much smaller sizes (a few minutes; for tests)")
    cl.add_argument("--only", metavar="NAMES",
                    help="comma list of measurements: weights, kv, paged, batching, prefix, quant, spec, ttft")
    cl.add_argument("--json", metavar="FILE", help="the raw figures, with every sub-command and its report")
    cl.add_argument("--write", metavar="FILE",
                    help="rewrite the section between <!-- claims:begin --> and <!-- claims:end --> of FILE")
    add_engine_args(cl)  # forwarded to every command a row runs (they win over the row's own)
    return cl


def main(argv: list[str] | None = None) -> int:
    return cmd_claims(build_parser().parse_args(argv))
