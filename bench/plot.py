"""Charts for bench reports (matplotlib, Agg: no display needed)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_offline(report: dict, path: str) -> dict[str, list[str]]:
    """Left: throughput per combination; right: TTFT and TPOT percentiles. Returns the
    series drawn per panel (the test checks them)."""
    plt = _pyplot()
    results = report["results"]
    names = [r["combo"] for r in results]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8))
    x = range(len(names))
    width = 0.38
    out = [r["output_tok_s"] for r in results]
    tot = [r["total_tok_s"] for r in results]
    ax1.bar([i - width / 2 for i in x], out, width, label="output tok/s", color="#3b7dd8")
    ax1.bar([i + width / 2 for i in x], tot, width, label="total tok/s", color="#9cc0f0")
    for i, r in enumerate(results):
        ax1.annotate(f"{r.get('ratio_output_tok_s', 1.0):.2f}x", (i - width / 2, out[i]), ha="center", va="bottom")
    ax1.set_xticks(list(x), names, rotation=15)
    ax1.set_ylabel("tokens / s")
    ax1.set_title("Throughput (higher is better)")
    ax1.legend(loc="lower right")
    series = {"throughput": ["output tok/s", "total tok/s"], "ttft": [], "tpot": []}
    for ax, key, title in ((ax2, "ttft_ms", "TTFT ms"), (ax3, "tpot_ms", "TPOT ms")):
        pcts = ("p50", "p90", "p99")
        w = 0.8 / len(pcts)
        for j, p in enumerate(pcts):
            ax.bar([i - 0.4 + w * (j + 0.5) for i in x], [r[key][p] for r in results], w, label=p)
            series["ttft" if key == "ttft_ms" else "tpot"].append(p)
        ax.set_xticks(list(x), names, rotation=15)
        ax.set_ylabel("ms")
        ax.set_title(f"{title} percentiles (lower is better)")
        ax.legend()
    wl = report.get("workload", {})
    fig.suptitle(f"tokenloom bench offline: {wl.get('num_requests', '?')} requests, prompts {wl.get('prompt_len', '?')}, "
                 f"outputs {wl.get('output_len', '?')} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def plot_peers(report: dict, path: str) -> list[str]:
    """Output tokens/s against concurrency, one line per system."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(dict.fromkeys(r["system"] for r in report["results"]))
    peer_colours = iter(["#e07b39", "#5a9a3a", "#9b59b6", "#888888", "#c0392b"])
    for name in names:
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in report["results"] if r["system"] == name)
        ours = name.startswith("tokenloom")
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", linewidth=2.5 if ours else 1.5,
                color="#3b7dd8" if ours else next(peer_colours, None), label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Same workload, same threads: throughput vs concurrency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return names


def plot_slo(report: dict, path: str) -> dict[str, list[str]]:
    """Left: share of each class that met both targets, per scheduler; middle: TTFT p50 and
    p99 per class; right: goodput and output tok/s. Returns the series drawn per panel."""
    plt = _pyplot()
    results = report["results"]
    names = [r["scheduler"] for r in results]
    classes = sorted({c for r in results for c in r["classes"]})
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8))
    x = range(len(names))
    w = 0.8 / max(1, len(classes))
    series = {"attainment": [], "ttft": [], "throughput": ["goodput req/s", "output tok/s"]}
    for j, cls in enumerate(classes):
        vals = [100 * r["classes"].get(cls, {}).get("both_met", float("nan")) for r in results]
        ax1.bar([i - 0.4 + w * (j + 0.5) for i in x], vals, w, label=cls)
        series["attainment"].append(cls)
    ax1.set_xticks(list(x), names)
    ax1.set_ylim(0, 105)
    ax1.set_ylabel("% of finished requests")
    ax1.set_title("Met both targets (higher is better)")
    ax1.legend()
    bars = [(cls, p) for cls in classes for p in ("p50", "p99")]
    w = 0.8 / len(bars)
    for j, (cls, p) in enumerate(bars):
        ax2.bar([i - 0.4 + w * (j + 0.5) for i in x],
                [r["classes"].get(cls, {}).get(f"ttft_{p}_ms", float("nan")) for r in results], w, label=f"{cls} {p}")
        series["ttft"].append(f"{cls} {p}")
    ttft_target = report.get("workload", {}).get("ttft_ms")
    if ttft_target:
        ax2.axhline(ttft_target, color="#c0392b", linestyle="--", linewidth=1, label="interactive target")
    ax2.set_yscale("log")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("ms")
    ax2.set_title("TTFT (lower is better)")
    ax2.legend(fontsize=8)
    ax3.bar([i - 0.2 for i in x], [r["goodput_req_s"] for r in results], 0.4, label="goodput req/s", color="#3b7dd8")
    ax3.set_ylabel("requests / s meeting their targets")
    ax3b = ax3.twinx()
    ax3b.bar([i + 0.2 for i in x], [r["output_tok_s"] for r in results], 0.4, label="output tok/s", color="#9cc0f0")
    ax3b.set_ylabel("output tokens / s")
    ax3.set_xticks(list(x), names)
    ax3.set_title("Goodput and throughput")
    fig.legend(*[sum(z, []) for z in zip(ax3.get_legend_handles_labels(), ax3b.get_legend_handles_labels(),
                                          strict=True)], loc="lower right", fontsize=8)
    fig.suptitle("tokenloom bench slo: interactive requests with targets beside long best-effort jobs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series
