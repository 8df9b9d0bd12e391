"""`python scripts/claims`: the verdict rules at their boundaries, the table from a fake
figures dict, the section replacement (docs/results.md), and one --quick run on the tiny model."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from claims import table as ct
from claims.run import build_parser as claims_parser
from claims.run import engine_argv, main

from tokenloom.cli.main import build_parser

KiB = 1024
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "claims"

# What the measurements return, one entry per claim (claims.py), every figure inside the seed's.
FIGURES = {
    "kv_per_token": {"small": {"model": "m", "allocated": 23040, "formula": 23040, "layers": 30, "kv_heads": 3,
                               "head_dim": 64, "bytes": 2},
                     "llama2_7b": 512 * KiB, "llama2_70b": 320 * KiB, "command": "python scripts/claims --only kv"},
    "weights": {"7b": {"bf16": 13.48e9, "int4": 3.89e9}, "70b": {"bf16": 137.9e9, "int4": 36.6e9},
                "command": "python scripts/claims --only weights"},
    "paged_concurrency": {"ratio": 3.0, "paged_mean": 12.0, "contiguous_mean": 4.0, "paged_peak": 20,
                          "contiguous_peak": 4, "paged_preemptions": 3, "num_kv_blocks": 160, "requests": 48,
                          "max_tokens": 512, "mean_output": 200.0, "mean_prompt": 40.0, "hit_max_tokens": 5,
                          "command": "python scripts/claims --only paged"},
    "continuous_batching": {"ratio": 2.5, "static_tok_s": 100.0, "continuous_tok_s": 250.0, "num_requests": 64,
                            "prompt_len": "32-256", "output_len": "32-256", "max_num_seqs": 16,
                            "command": "tokenloom bench offline --combo static+paged --combo continuous+paged"},
    "prefix_ttft": {"system_len": 1000, "no_cache_ms": 900.0,
                    "cached": {"paged": {"ttft_ms": 100.0, "speedup": 9.0}, "radix": {"ttft_ms": 90.0, "speedup": 10.0}},
                    "command": "tokenloom bench prefix --workload shared-system"},
    "weight_quant": {"base": "dense", "int8": 0.5, "four_bit": {"rtn": 9.0, "gptq": 4.0, "awq": 3.0},
                     "command": "python scripts/claims --only quant"},
    "gptq_awq": {"rtn": 20.0, "dense": 17.0, "methods": {"gptq": 19.0, "awq": 18.0},
                 "command": "python scripts/claims --only quant"},
    "kv_quant": {"base": "a 16-bit KV cache", "command": "python scripts/claims --only kv",
                 "kv": {"fp8": {"bytes_ratio": 0.516, "blocks_ratio": 1.94, "ppl_change_pct": 1.0},
                        "int8": {"bytes_ratio": 0.516, "blocks_ratio": 1.94, "ppl_change_pct": 0.3}}},
    "spec_formula": {"command": "tokenloom bench spec", "rows": [
        {"task": "grounded", "decoder": "standard", "speedup": 1.0, "predicted": 1.0, "acceptance": None, "k": 0,
         "cost_ratio": 1.0},
        {"task": "grounded", "decoder": "ngram", "speedup": 1.9, "predicted": 1.8, "acceptance": 0.8, "k": 3.0,
         "cost_ratio": 1.1}]},
    "ttft_target": {"setting": "chat beside batch jobs", "target_ms": 500.0, "command": "tokenloom bench slo",
                    "rows": [{"label": "continuous", "p50_ms": 80.0, "p99_ms": 400.0, "met": 1.0},
                             {"label": "slo", "p50_ms": 60.0, "p99_ms": 300.0, "met": 1.0}]},
}


def _rows(**changes) -> dict[str, ct.Row]:
    figures = copy.deepcopy(FIGURES)
    for key, change in changes.items():
        if change is None:
            del figures[key]
        else:
            figures[key].update(change)
    return {c.key: row for c, row in zip(ct.CLAIMS, ct.build_rows(figures), strict=True)}


# ---- verdict rules ---------------------------------------------------------------------

def test_a_range_holds_at_both_ends_and_says_which_side_it_missed():
    assert ct.within(2.0, 2, 4).ok and ct.within(4.0, 2, 4).ok
    low, high = ct.within(1.99, 2, 4, "x"), ct.within(4.01, 2, 4, "x")
    assert not low.ok and low.why == "1.99x is below 2-4x"
    assert not high.ok and high.why == "4.01x is above 2-4x"
    assert ct.about(0.549, 0.5, 0.1).ok and ct.about(0.451, 0.5, 0.1).ok
    assert not ct.about(0.56, 0.5, 0.1).ok and "not within 10% of 0.5" in ct.about(0.56, 0.5, 0.1).why
    assert ct.at_most(5.0, 5.0, "x").ok and not ct.at_most(5.01, 5.0, "x").ok
    assert ct.at_least(1.1, 1.1, "x").ok and not ct.at_least(1.09, 1.1, "x").ok


def test_verdict_is_holds_partly_or_refuted_with_the_reasons():
    ok, bad = ct.Check(True), ct.Check(False, "too slow")
    assert ct.verdict([ok, ok]) == "holds"
    assert ct.verdict([ok, bad]) == "**partly**: too slow"
    assert ct.verdict([bad, ct.Check(False, "too big")]) == "**refuted**: too slow; too big"


def test_every_claim_holds_on_figures_inside_the_seeds():
    rows = _rows()
    assert [r.verdict for r in rows.values()] == ["holds"] * len(ct.CLAIMS)
    assert rows["continuous_batching"].command == FIGURES["continuous_batching"]["command"]
    assert "2.50x: 250.0 vs 100.0 output tok/s" in rows["continuous_batching"].measured


@pytest.mark.parametrize(("ratio", "expected"), [
    (2.0, "holds"), (5.0, "holds"), (1.99, "**refuted**: 1.99x is below 2-5x"),
    (5.01, "**refuted**: 5.01x is above 2-5x")])
def test_continuous_batching_boundaries(ratio, expected):
    assert _rows(continuous_batching={"ratio": ratio})["continuous_batching"].verdict == expected


@pytest.mark.parametrize(("ratio", "expected"), [(2.0, "holds"), (4.0, "holds"), (1.5, "refuted"), (4.5, "refuted")])
def test_paged_concurrency_boundaries(ratio, expected):
    assert expected in _rows(paged_concurrency={"ratio": ratio})["paged_concurrency"].verdict


def test_a_composite_claim_is_partly_when_only_some_figures_hold():
    row = _rows(weight_quant={"int8": 0.9, "four_bit": {"rtn": 30.0, "gptq": 23.0, "awq": 12.0}})["weight_quant"]
    assert row.verdict == "**partly**: the best 4-bit (awq) +12.00% is over 5%"
    assert _rows(weight_quant={"int8": 1.0, "four_bit": {"rtn": 5.0}})["weight_quant"].verdict == "holds"
    row = _rows(gptq_awq={"methods": {"gptq": 21.0, "awq": 18.0}})["gptq_awq"]
    assert row.verdict == "**partly**: gptq is not below rtn"
    ttft = _rows(ttft_target={"rows": [{"label": "continuous", "p50_ms": 90.0, "p99_ms": 2100.0},
                                       {"label": "slo", "p50_ms": 60.0, "p99_ms": 500.0}]})["ttft_target"]
    assert ttft.verdict == "**partly**: continuous's p99 2100 ms is over 500 ms"
    spec = FIGURES["spec_formula"]["rows"][1]
    row = _rows(spec_formula={"rows": [{**spec, "speedup": 2.3, "predicted": 1.8}]})["spec_formula"]
    assert row.verdict.startswith("**refuted**: grounded ngram measured/predicted 1.28x is not within 20%")


def test_a_missing_measurement_names_the_issue_that_will_measure_it():
    rows = _rows(spec_formula=None, prefix_ttft=None)
    assert rows["spec_formula"].measured == "not yet measured: issue 9" and rows["spec_formula"].verdict == "-"
    assert rows["prefix_ttft"].measured == "not yet measured: issue 13"
    assert rows["weights"].verdict == "holds"  # the others are untouched
    fallback = ct.build_rows({}, {"spec_formula": "python scripts/claims --only spec"})
    assert fallback[[c.key for c in ct.CLAIMS].index("spec_formula")].command == "python scripts/claims --only spec"


def test_a_failed_measurement_is_a_row_that_says_so():
    figures = {**FIGURES, "kv_quant": {"error": "RuntimeError: boom", "command": "python scripts/claims --only kv"}}
    row = dict(zip([c.key for c in ct.CLAIMS], ct.build_rows(figures), strict=True))["kv_quant"]
    assert row.measured == "measurement failed: RuntimeError: boom" and row.verdict == "-"


def test_the_table_is_one_markdown_row_per_claim():
    rows = ct.build_rows(FIGURES)
    rows[0] = ct.Row("a | b", "s", "m", "holds", "tokenloom x")
    table = ct.format_claims(rows).splitlines()
    assert table[0] == "| claim | the seed says | measured | verdict | measured by |"
    assert len(table) == 2 + len(ct.CLAIMS)
    assert table[2] == "| a \\| b | s | m | holds | `tokenloom x` |"


# ---- the README section ----------------------------------------------------------------

README = f"# T\n\nintro\n\n## Claims\n\n{ct.BEGIN}\nold table\n{ct.END}\n\n## Next\n\ntail  \n"


def test_the_section_is_replaced_and_nothing_else_changes():
    out = ct.replace_section(README, "\nnew table\n")
    assert out == README.replace("old table", "new table")
    assert ct.replace_section(out, "old table") == README  # and back


@pytest.mark.parametrize(("text", "message"), [
    ("# T\nno markers\n", "exactly one <!-- claims:begin -->"),
    (f"{ct.BEGIN}\nx\n", "exactly one <!-- claims:end -->"),
    (README + ct.BEGIN, "(found 2)"),
    (f"{ct.END}\nx\n{ct.BEGIN}\n", "comes before"),
])
def test_missing_or_misplaced_markers_fail_clearly(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ct.replace_section(text, "table")


def test_readme_without_markers_fails_before_measuring(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert main(["--write", str(readme)]) == 2
    assert "claims:begin" in capsys.readouterr().out and readme.read_text() == "# no markers\n"
    assert main(["--only", "weights", "--write", str(readme)]) == 2


def test_engine_flags_are_forwarded_as_given():
    words = ["--model", "m", "--threads", "1", "--no-overlap", "--set", "backend.quant_max_rows=0"]
    args = claims_parser().parse_args(words)
    assert engine_argv(args) == words


def test_only_a_planner_measurement_runs_in_process(tmp_path, capsys):
    """`--only weights` needs no model: the planner on Llama-2 shapes."""
    assert main(["--only", "weights", "--json", str(tmp_path / "c.json")]) == 0
    figures = json.loads((tmp_path / "c.json").read_text())["figures"]
    assert set(figures) == {"weights"} and figures["weights"]["7b"]["bf16"] == 13_477_363_712
    out = capsys.readouterr().out
    assert "| Weight memory of 7B and 70B models |" in out and "not yet measured: issue 9" in out


# ---- end to end ------------------------------------------------------------------------

def test_quick_run_on_the_tiny_model_rewrites_the_readme(tiny_model_dir, tmp_path):
    """~25 s on 2 idle cores (one torch thread: the tiny model gains nothing from two)."""
    readme = tmp_path / "README.md"
    readme.write_text(README)
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick",
                          "--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--json", str(tmp_path / "c.json"),
                          "--write", str(readme)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "c.json").read_text())
    assert set(result["figures"]) == {c.key for c in ct.CLAIMS}
    assert not [k for k, f in result["figures"].items() if "error" in f]
    text = readme.read_text()
    head, section = text.split(ct.BEGIN)
    section, tail = section.split(ct.END)
    assert head + ct.BEGIN + "\nold table\n" + ct.END + tail == README
    lines = section.strip().splitlines()
    assert lines[0].startswith("_Generated ") and "scripts/claims --quick" in lines[0] and "torch threads" in lines[0]
    assert len([ln for ln in lines if ln.startswith("| ")]) == 2 + len(ct.CLAIMS)
    assert "not yet measured" not in section
    # every row's command is a command line that its parser accepts: `tokenloom ...` or the script's
    for f in result["figures"].values():
        words = shlex.split(f["command"])
        if words[:2] == ["python", "scripts/claims"]:
            claims_parser().parse_args(words[2:])
        else:
            assert words[0] == "tokenloom", f["command"]
            build_parser().parse_args(words[1:])
