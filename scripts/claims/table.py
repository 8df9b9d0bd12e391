"""The seed's claims as a table: what each claim says, how a measured figure is judged, and
the markdown that `python scripts/claims` prints and writes into docs/results.md. Pure: it
takes the raw figures (``claims.py`` measures them) and returns text.

A verdict is ``holds`` (every figure inside what the seed says), ``refuted`` (every figure
outside it) or ``partly`` (some in, some out). Where the seed gives no number ("slightly",
"small", "cuts TTFT"), the reading we judge by is written in the seed's column, so a reader
can disagree with the reading and still use the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

HOLDS, PARTLY, REFUTED = "holds", "partly", "refuted"
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
NEGLIGIBLE_PCT = 1.0  # "negligible" perplexity change, read as at most this many percent
SLIGHT_PCT = 5.0  # "slight" / "small"
CUT_TTFT = 1.1  # "cuts TTFT": at least this speedup, above run-to-run noise
FORMULA_TOLERANCE = 0.2  # the speculative speedup "follows" the formula within 20%
KiB, GB = 1024, 1e9


class Check(NamedTuple):
    """One figure judged; ``why`` says where it fell when it is not ok."""

    ok: bool
    why: str = ""


def within(x: float, lo: float, hi: float, unit: str = "", nd: int = 2, what: str = "") -> Check:
    """Inclusive at both ends: a figure on the boundary holds. ``what`` names the figure."""
    where = "below" if x < lo else "above" if x > hi else ""
    return Check(not where, where and f"{what}{x:.{nd}f}{unit} is {where} {lo:g}-{hi:g}{unit}")


def about(x: float, target: float, rel: float, unit: str = "", nd: int = 2, what: str = "") -> Check:
    """``x`` within ``rel`` (a fraction) of ``target``, inclusive."""
    ok = within(x, target * (1 - rel), target * (1 + rel)).ok
    return Check(ok, "" if ok else f"{what}{x:.{nd}f}{unit} is not within {100 * rel:g}% of {target:g}{unit}")


def at_most(x: float, limit: float, what: str, unit: str = "") -> Check:
    return Check(x <= limit, "" if x <= limit else f"{what} is over {limit:g}{unit}")


def at_least(x: float, limit: float, what: str, unit: str = "") -> Check:
    return Check(x >= limit, "" if x >= limit else f"{what} is under {limit:g}{unit}")


def verdict(checks: list[Check]) -> str:
    """``holds`` / ``partly`` / ``refuted``, with the failed checks' reasons."""
    failed = [why for ok, why in checks if not ok]
    if not failed:
        return HOLDS
    word = REFUTED if len(failed) == len(checks) else PARTLY
    return f"**{word}**: " + "; ".join(failed)


def _pct(x: float) -> str:
    return f"{x:+.2f}%"


# ---- one function per claim: figures -> (measured text, checks) ---------------------------

def _kv_per_token(f: dict) -> tuple[str, list[Check]]:
    s = f["small"]
    text = (f"{s['model']}: the engine allocates {s['allocated']:,} B/token, the formula gives {s['formula']:,} "
            f"(2 x {s['layers']} x {s['kv_heads']} x {s['head_dim']} x {s['bytes']} B); Llama-2-7B shapes "
            f"{f['llama2_7b'] / KiB:.0f} KiB, Llama-2-70B {f['llama2_70b'] / KiB:.0f} KiB")
    return text, [Check(s["allocated"] == s["formula"], "the engine allocates other than the formula"),
                  Check(f["llama2_7b"] == 512 * KiB, "7B is not 512 KiB"),
                  Check(f["llama2_70b"] == 320 * KiB, "70B is not 320 KiB")]


def _weights(f: dict) -> tuple[str, list[Check]]:
    a, b = f["7b"], f["70b"]
    text = (f"7B: {a['bf16'] / GB:.2f} GB BF16, {a['int4'] / GB:.2f} GB INT4; 70B: {b['bf16'] / GB:.1f} GB, "
            f"{b['int4'] / GB:.1f} GB (INT4 = group-128 scales and zeros, embedding and head BF16)")
    return text, [about(a["bf16"] / GB, 14, 0.1, " GB", what="7B BF16 "),
                  within(a["int4"] / GB, 3.5, 4, " GB", what="7B INT4 "),
                  about(b["bf16"] / GB, 140, 0.1, " GB", 1, what="70B BF16 "),
                  within(b["int4"] / GB, 35, 40, " GB", 1, what="70B INT4 ")]


def _paged(f: dict) -> tuple[str, list[Check]]:
    text = (f"{f['ratio']:.2f}x: {f['paged_mean']:.1f} vs {f['contiguous_mean']:.1f} requests running per step on "
            f"average while others waited (peak {f['paged_peak']} vs {f['contiguous_peak']}; paged preempted "
            f"{f['paged_preemptions']}) "
            f"in one {f['num_kv_blocks']}-block pool; {f['requests']} chat requests of {f['mean_prompt']:.0f} "
            f"prompt tokens declaring max_tokens {f['max_tokens']}, answered in {f['mean_output']:.0f} on average "
            f"({f['hit_max_tokens']} reached the cap)")
    return text, [within(f["ratio"], 2, 4, "x")]


def _batching(f: dict) -> tuple[str, list[Check]]:
    text = (f"{f['ratio']:.2f}x: {f['continuous_tok_s']:.1f} vs {f['static_tok_s']:.1f} output tok/s "
            f"({f['num_requests']} requests, prompts {f['prompt_len']}, outputs {f['output_len']}, "
            f"max_num_seqs {f['max_num_seqs']}, both paged)")
    return text, [within(f["ratio"], 2, 5, "x")]


def _prefix(f: dict) -> tuple[str, list[Check]]:
    base = f"TTFT mean {f['no_cache_ms']:.0f} ms without caching"
    parts = [f"{name} {r['ttft_ms']:.0f} ms ({r['speedup']:.1f}x)" for name, r in f["cached"].items()]
    text = f"{f['system_len']}-token shared system prompt: {base}; " + ", ".join(parts)
    return text, [at_least(r["speedup"], CUT_TTFT, f"{name}'s speedup {r['speedup']:.2f}x", "x")
                  for name, r in f["cached"].items()]


def _weight_quant(f: dict) -> tuple[str, list[Check]]:
    fours = f["four_bit"]
    best = min(fours, key=fours.get)
    text = (f"perplexity vs {f['base']}: int8 {_pct(f['int8'])}; 4-bit "
            + ", ".join(f"{k} {_pct(v)}" for k, v in fours.items()) + f" (best: {best})")
    return text, [at_most(f["int8"], NEGLIGIBLE_PCT, f"int8's {_pct(f['int8'])}", "%"),
                  at_most(fours[best], SLIGHT_PCT, f"the best 4-bit ({best}) {_pct(fours[best])}", "%")]


def _gptq_awq(f: dict) -> tuple[str, list[Check]]:
    rtn = f["rtn"]
    text = f"perplexity: rtn {rtn:.3f}, " + ", ".join(
        f"{k} {v:.3f} ({100 * (v - rtn) / rtn:+.1f}%)" for k, v in f["methods"].items()) + f" (dense {f['dense']:.3f})"
    return text, [Check(v < rtn, f"{k} is not below rtn") for k, v in f["methods"].items()]


def _kv_quant(f: dict) -> tuple[str, list[Check]]:
    rows = f["kv"]
    text = "; ".join(f"{k}: {r['bytes_ratio']:.3f}x the bytes a token, {r['blocks_ratio']:.2f}x the blocks, "
                     f"perplexity {_pct(r['ppl_change_pct'])}" for k, r in rows.items()) + f" (vs {f['base']})"
    checks = []
    for k, r in rows.items():
        checks.append(about(r["bytes_ratio"], 0.5, 0.1, "x", 3, what=f"{k}'s bytes "))
        checks.append(at_most(r["ppl_change_pct"], SLIGHT_PCT, f"{k}'s perplexity {_pct(r['ppl_change_pct'])}", "%"))
    return text, checks


def _spec(f: dict) -> tuple[str, list[Check]]:
    rows = [r for r in f["rows"] if r["decoder"] != "standard"]
    text = "; ".join(f"{r['task']} {r['decoder']}: {r['speedup']:.2f}x measured, {r['predicted']:.2f}x predicted "
                     f"(a {r['acceptance']:.2f}, k {r['k']:.1f}, cost {r['cost_ratio']:.2f})"
                     if r["acceptance"] is not None else
                     f"{r['task']} {r['decoder']}: {r['speedup']:.2f}x, nothing drafted" for r in rows)
    return text, [about(r["speedup"] / r["predicted"], 1.0, FORMULA_TOLERANCE, "x", 2,
                        what=f"{r['task']} {r['decoder']} measured/predicted ") for r in rows]


def _ttft(f: dict) -> tuple[str, list[Check]]:
    text = f"{f['setting']}: " + "; ".join(
        f"{r['label']} p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms"
        + (f", {100 * r['met']:.0f}% under {f['target_ms']:g} ms" if r.get("met") is not None else "")
        for r in f["rows"])
    return text, [at_most(r["p99_ms"], f["target_ms"], f"{r['label']}'s p99 {r['p99_ms']:.0f} ms", " ms") for r in f["rows"]]


@dataclass(frozen=True, slots=True)
class Claim:
    key: str
    claim: str
    seed: str
    judge: Callable[[dict], tuple[str, list[Check]]]
    measurement: str  # the `--only` name that measures it
    issue: int = 13  # the issue that measures it (issue 13 part 4 wrote this table)


CLAIMS = (
    Claim("kv_per_token", "KV cache bytes per token = 2 x layers x KV heads x head dim x bytes (GQA)",
          "Llama-2-7B 512 KiB; a 70B with 8 KV heads 320 KiB", _kv_per_token, "kv"),
    Claim("weights", "Weight memory of 7B and 70B models", "7B ≈ 14 GB BF16, 3.5-4 GB INT4; 70B, at the "
          "same 2 and ~0.5 bytes a parameter, ≈ 140 GB and 35-40 GB", _weights, "weights"),
    Claim("paged_concurrency", "Paged KV allocation admits more concurrent requests than contiguous",
          "2-4x", _paged, "paged"),
    Claim("continuous_batching", "Continuous batching beats static batching on throughput", "2-5x", _batching,
          "batching"),
    Claim("prefix_ttft", "Prefix caching cuts TTFT for a shared prefix",
          f"lower TTFT (no figure; read as ≥ {CUT_TTFT:g}x)", _prefix, "prefix"),
    Claim("weight_quant", "8-bit weights change perplexity negligibly, 4-bit slightly",
          f"negligible / slight (read as ≤ {NEGLIGIBLE_PCT:g}% / ≤ {SLIGHT_PCT:g}%)", _weight_quant, "quant"),
    Claim("gptq_awq", "GPTQ and AWQ beat round-to-nearest at 4 bits", "lower perplexity than RTN", _gptq_awq,
          "quant"),
    Claim("kv_quant", "An FP8/INT8 KV cache halves KV memory at a small quality cost",
          f"0.5x the bytes; small cost (read as ≤ {SLIGHT_PCT:g}% perplexity)", _kv_quant, "kv"),
    Claim("spec_formula", "Speculative decoding's speedup is E[tokens/step] / step cost ratio, "
          "E = (1 - a^(k+1)) / (1 - a)", f"the formula (read as within {100 * FORMULA_TOLERANCE:g}%)", _spec, "spec",
          issue=9),
    Claim("ttft_target", "Interactive chat wants TTFT under 500 ms (measured: is it met under load?)",
          "p99 ≤ 500 ms", _ttft, "ttft"),
)


@dataclass(frozen=True, slots=True)
class Row:
    claim: str
    seed: str
    measured: str
    verdict: str
    command: str


def build_rows(figures: dict, commands: dict[str, str] | None = None) -> list[Row]:
    """One row per claim of :data:`CLAIMS`, in order. ``figures[key]`` is that claim's raw
    figures (with its ``command``), ``{"error": ...}`` when its measurement failed, or absent
    when nothing measured it: then the row says which issue will."""
    rows = []
    for c in CLAIMS:
        f = figures.get(c.key)
        command = (f or {}).get("command") or (commands or {}).get(c.key, "-")
        if f is None:
            rows.append(Row(c.claim, c.seed, f"not yet measured: issue {c.issue}", "-", command))
        elif "error" in f:
            rows.append(Row(c.claim, c.seed, f"measurement failed: {f['error']}", "-", command))
        else:
            text, checks = c.judge(f)
            rows.append(Row(c.claim, c.seed, text, verdict(checks), command))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_claims(rows: list[Row]) -> str:
    lines = ["| claim | the seed says | measured | verdict | measured by |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(x) for x in (r.claim, r.seed, r.measured, r.verdict))
                     + f" | `{_cell(r.command)}` |")
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by ``section``
    (the markers kept, everything outside them byte for byte).

    :raises ValueError: a marker is missing, repeated, or the end comes first.
    """
    for marker in (BEGIN, END):
        if text.count(marker) != 1:
            raise ValueError(f"the file needs exactly one {marker} line (found {text.count(marker)}); "
                             f"add {BEGIN} and {END} where the claims table goes")
    head, rest = text.split(BEGIN)
    if END not in rest:
        raise ValueError(f"{END} comes before {BEGIN}")
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{section.strip()}\n{END}{tail}"
