"""Regenerate the benchmark summary of docs/results.md: `make results` (or
`python scripts/update_results.py [--quick] [--no-peers] [--reuse] [--write FILE]`).

Runs the bench commands on the embedded model, keeps their JSON under bench-results/, and
rewrites the section of docs/results.md between its results markers with the figures, the
date, the command that produced them and the machine. Peers appear when installed
(`make peers`: pip install -e '.[peers]' and scripts/build-llama-server.sh). The seed's
claims table, in the same file, is `python scripts/claims --write docs/results.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

from tokenloom.bench.decode import format_decode
from tokenloom.bench.peers import format_peers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-results"
RESULTS = ROOT / "docs" / "results.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


REUSE = False


def bench(name: str, *args: str) -> dict:
    path = OUT / f"{name}.json"
    if REUSE and path.exists():
        print(f"reusing {path.relative_to(ROOT)}", flush=True)
        return json.loads(path.read_text())
    cmd = [sys.executable, "-m", "tokenloom.cli.main", "bench", *args, "--json", str(path)]
    print("$ tokenloom bench " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(path.read_text())


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    except (OSError, StopIteration):
        isa = "?"
    import torch

    return f"{cpu} ({isa}), {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def render(decode: dict, offline: dict, shared: dict, multi: dict, peers: dict | None, command: str) -> str:
    today = datetime.date.today().isoformat()
    lines = [START, f"_Generated {today} by `{command}` on {machine()}; model SmolLM2-135M-Instruct "
                    "(Q4_1 GGUF; `gguf` keeps its 4-bit blocks, `none` dequantises them)._", ""]
    lines += ["**Decode** (`tokenloom bench decode`): each quantizer and dtype in one run.", "",
              format_decode(decode)]
    wl = offline["workload"]
    lines += ["", f"**Offline** (`tokenloom bench offline`): {wl['num_requests']} requests, prompts "
                  f"{wl['prompt_len']}, outputs {wl['output_len']} tokens, EOS ignored.", "",
              "| combination | output tok/s | vs first | TTFT p50 / p99 ms | TPOT p50 / p99 ms | peak KV | preemptions |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in offline["results"]:
        t, p = r["ttft_ms"], r["tpot_ms"]
        lines.append(f"| {r['combo']} | {r['output_tok_s']:.1f} | {r['ratio_output_tok_s']:.2f}x | "
                     f"{t['p50']:.0f} / {t['p99']:.0f} | {p['p50']:.0f} / {p['p99']:.0f} | "
                     f"{100 * r['peak_kv_usage']:.0f}% | {r['preemptions']} |")
    lines += ["", "**Prefix caching** (`tokenloom bench prefix`): a shared 1,000-token system prompt with short "
                  "user turns (TTFT), and multi-turn chats (hit rate).", "",
              "| cache | shared-system TTFT mean / p50 ms | speedup | multi-turn hit rate |", "| --- | --- | --- | --- |"]
    hits = {r["combo"]: r["hit_rate"] for r in multi["results"]}
    for r in shared["results"]:
        t = r["ttft_ms"]
        hit = f"{100 * hits[r['combo']]:.1f}%" if r["combo"] in hits else "-"
        lines.append(f"| {r['combo']} | {t['mean']:.0f} / {t['p50']:.0f} | {r['ttft_speedup']:.1f}x | {hit} |")
    if peers:
        w = peers["workload"]
        lines += ["", f"**Peers** (`tokenloom bench peers --concurrency {','.join(map(str, peers['concurrency']))}`): "
                      f"{w['num_requests']} requests, prompts {w['prompt_len']}, outputs {w['output_len']}, "
                      f"{peers['threads']} threads.", "", format_peers(peers).split("\n", 2)[2]]
    lines.append(END)
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """``text`` with its results section (markers included, exactly one pair) replaced."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"needs exactly one {START} line followed by one {END} line")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + section + tail


def command_line(argv: list[str]) -> str:
    """How this run was started, as a reader would retype it."""
    return " ".join(["python scripts/update_results.py", *argv])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep bench-results/*.json that exist; run the rest")
    ap.add_argument("--write", metavar="FILE", default=str(RESULTS.relative_to(ROOT)),
                    help="the file whose results section is rewritten (default: docs/results.md)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    target = Path(args.write) if Path(args.write).is_absolute() else ROOT / args.write
    try:
        replace_section(target.read_text(), "")  # fail now, not after an hour of benches
    except (OSError, ValueError) as exc:
        print(f"error: --write {args.write}: {exc}")
        return 2
    global REUSE
    REUSE = args.reuse
    OUT.mkdir(exist_ok=True)
    # --quick keeps 64 requests for the offline comparison (fewer would fit one static batch
    # and hide what continuous batching changes) but shortens them, and runs 16 for peers.
    n, plen, olen = ("16", "32-256", "32-128") if args.quick else ("64", "32-512", "32-256")
    decode = bench("decode", "decode", "--batch-sizes", "1,32", "--gen", "64", "--quantizers", "gguf,none",
                   "--dtypes", "auto,float32")
    offline = bench("offline", "offline", "--combo", "continuous+paged", "--combo", "static+contiguous",
                    "--num-requests", "64", "--prompt-len", plen, "--output-len", olen,
                    "--plot", str(OUT / "offline.png"))
    shared = bench("prefix-shared", "prefix", "--workload", "shared-system", "--num-requests", "16")
    multi = bench("prefix-multi", "prefix", "--workload", "multi-turn", "--combos", "paged,radix")
    peers = None if args.no_peers else bench("peers", "peers", "--num-requests", n, "--prompt-len", plen,
                                             "--output-len", olen, "--plot", str(OUT / "peers.png"))
    section = render(decode, offline, shared, multi, peers, command_line(argv))
    target.write_text(replace_section(target.read_text(), section))
    print(f"{args.write}: the results section is rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
