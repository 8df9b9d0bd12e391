"""`tokenloom bench structured`: what structured outputs cost, in-process on one engine.

1. **Decode under a constraint**: the same chat prompt and ``max_tokens`` at batch 1 and
   batch 32 (``--batch-sizes``), for: no constraint (EOS ignored, so every answer is
   ``max_tokens`` long); a nested JSON schema; a regex; and tool calls (two tools,
   ``tool_choice: required``, the ``hermes`` format: the grammar of
   :func:`tokenloom.core.tools.constraint`, the tools described in the system prompt as the
   OpenAI frontend does). A constrained answer ends when its grammar completes (EOS is
   ignored only until then), so each row reports the tokens generated and the time per
   token, not per request: TPOT is the mean over requests of the time per output token
   after the first (``RequestMetrics.tpot_ms``), output tok/s is the tokens generated over
   the batch's wall time. "vs unconstrained" divides by the unconstrained row with the same
   prompt (the tool prompt is longer, and a longer context costs every step more), so it is
   what the grammar costs. Every constraint is compiled before these rows (the compile
   times are the second table), so they measure the masked decode alone.
2. **Compile time** per constraint, cold (its first compile, on the engine's grammar
   thread, after the backend's own start-up, which is timed on its own) and cached (the
   engine's per-constraint cache), in ms.
3. **Compile gap**: while one unconstrained stream decodes, 20 requests (``--gap-requests``)
   with 20 never-seen schemas are submitted at once. Compiles run on the grammar thread,
   not the step loop: the largest gap between the stream's tokens from the submission until
   the 20 have finished, against its median gap before. The same 20 schemas are then sent
   again (compiled, cached) as the control: what the 20 requests joining the batch cost
   the stream without any compile.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shlex
import statistics
import sys
import time
import uuid
from typing import Any

from tokenloom.core.config import merge_layers
from tokenloom.core.outputs import Finished, TokenDelta
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sampling_params import Constraint, SamplingParams

PROMPT = ("Plan a three-day trip to Lisbon for two people. For each day list the activities with their "
          "start time, the place and the cost in euros, then give the total cost.")

TRIP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "destination": {"type": "string", "maxLength": 40},
        "travellers": {"type": "integer", "minimum": 1, "maximum": 10},
        "days": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object",
            "properties": {
                "day": {"type": "integer", "minimum": 1, "maximum": 5},
                "activities": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                    "type": "object",
                    "properties": {
                        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                        "place": {"type": "string", "maxLength": 60},
                        "kind": {"enum": ["museum", "food", "walk", "transport", "other"]},
                        "cost_eur": {"type": "number", "minimum": 0},
                    },
                    "required": ["time", "place", "kind", "cost_eur"],
                }},
            },
            "required": ["day", "activities"],
        }},
        "total_cost_eur": {"type": "number", "minimum": 0},
    },
    "required": ["destination", "travellers", "days", "total_cost_eur"],
}

# one line per day: "Day 1: ..." (the regex case's answer has the shape of the prompt's plan)
DAY_REGEX = r"(Day [1-3]: [A-Za-z0-9 ,.'-]{10,120}\n){3}Total: [0-9]{2,4} EUR"

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city on a date.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "date"]}}},
    {"type": "function", "function": {
        "name": "search_hotels", "description": "Hotels in a city with a free room for the dates given.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "check_in": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
            "nights": {"type": "integer", "minimum": 1, "maximum": 30},
            "guests": {"type": "integer", "minimum": 1, "maximum": 8},
            "max_price_eur": {"type": "number", "minimum": 0}},
            "required": ["city", "check_in", "nights"]}}},
]

# more schemas for the compile-time table (besides the cases'): typical response formats
PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 80},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 120},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 10},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "postcode": {"type": "string",
                                                                                   "pattern": "^[0-9]{4,5}$"}},
            "required": ["city"]},
    },
    "required": ["name", "age"],
}
INVOICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "$defs": {"line": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "quantity": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "unit_price"]}},
    "properties": {
        "invoice_id": {"type": "string"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1},
        "paid": {"type": "boolean"},
    },
    "required": ["invoice_id", "currency", "lines", "paid"],
}
SENTIMENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "neutral", "negative"]},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["label", "confidence"],
}


def machine(threads: int | None = None) -> str:
    """CPU model, the cores this process may use (of all), torch's threads (``threads``: the
    engine's step thread's) and version."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {cores} cores (of {os.cpu_count()}), {threads or torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def tool_case(engine) -> tuple[list[dict], Constraint, list[dict] | None]:
    """The tool-call case's messages, constraint and template tools, as the OpenAI frontend
    builds them for ``tool_choice: required`` with the ``hermes`` parser."""
    from tokenloom.core import tools

    parser = tools.build_parser(engine.pm, "hermes", engine.tokenizer.chat_template)
    req = tools.tool_request(TOOLS, "required", None)
    assert req is not None
    native = tools.template_reads_tools(engine.tokenizer.chat_template)
    messages = tools.chat_messages([{"role": "user", "content": PROMPT}], req, parser, native)
    constraint = tools.constraint(req, parser)
    assert constraint is not None
    return messages, constraint, (req.tools if native else None)


def cases(engine) -> list[dict[str, Any]]:
    """Each decode case: its name, prompt token ids and constraint (None: unconstrained)."""
    user = [{"role": "user", "content": PROMPT}]
    ids = engine.prompt_ids(messages=user)
    messages, tool_constraint, template_tools = tool_case(engine)
    tool_ids = engine.prompt_ids(messages=messages, tools=template_tools)
    return [
        {"name": "unconstrained", "prompt_ids": ids, "constraint": None},
        {"name": "json schema (trip plan)", "prompt_ids": ids,
         "constraint": Constraint(kind="json_schema", value=TRIP_SCHEMA, param="response_format")},
        {"name": "regex (three day lines)", "prompt_ids": ids,
         "constraint": Constraint(kind="regex", value=DAY_REGEX, param="guided_regex")},
        {"name": "unconstrained (the tool prompt)", "prompt_ids": tool_ids, "constraint": None},
        {"name": "tool calls (2 tools, required, hermes)", "prompt_ids": tool_ids, "constraint": tool_constraint},
    ]


def compile_constraints(case_list: list[dict[str, Any]]) -> list[tuple[str, Constraint]]:
    """The compile-time table's constraints: the cases' and a few more response formats."""
    named = [(c["name"], c["constraint"]) for c in case_list if c["constraint"] is not None]
    return named + [
        ("json schema (user profile)", Constraint(kind="json_schema", value=PROFILE_SCHEMA)),
        ("json schema (invoice, $ref)", Constraint(kind="json_schema", value=INVOICE_SCHEMA)),
        ("json schema (sentiment, enum)", Constraint(kind="json_schema", value=SENTIMENT_SCHEMA)),
    ]


def new_schemas(n: int) -> list[dict[str, Any]]:
    """``n`` schemas this engine (and the backend's own cache) has never seen: the trip plan's
    shape, its property names carrying a fresh nonce, each one different."""
    nonce = uuid.uuid4().hex[:8]
    out = []
    for i in range(n):
        tag = f"{nonce}_{i}"
        out.append({"type": "object", "properties": {
            f"destination_{tag}": {"type": "string", "maxLength": 40},
            f"days_{tag}": TRIP_SCHEMA["properties"]["days"],
            f"note_{tag}": {"type": "string", "maxLength": 20 + i}},
            "required": [f"destination_{tag}", f"days_{tag}"]})
    return out


async def _one(engine, prompt_ids: list[int], params: SamplingParams) -> Finished:
    final = None
    async for item in engine.generate(list(prompt_ids), params):
        if isinstance(item, Finished):
            final = item
    assert final is not None
    return final


async def _batch(engine, prompt_ids: list[int], params: SamplingParams, n: int) -> tuple[list[Finished], float]:
    t0 = time.perf_counter()
    finals = await asyncio.gather(*(_one(engine, prompt_ids, params) for _ in range(n)))
    return list(finals), time.perf_counter() - t0


def decode_row(name: str, batch: int, finals: list[Finished], elapsed: float) -> dict[str, Any]:
    tokens = [f.usage.completion_tokens for f in finals]
    tpots = [f.metrics.tpot_ms for f in finals if f.metrics.tpot_ms is not None]
    reasons: dict[str, int] = {}
    for f in finals:
        reasons[f.finish_reason] = reasons.get(f.finish_reason, 0) + 1
    return {"case": name, "batch_size": batch, "requests": len(finals), "output_tokens": sum(tokens),
            "mean_tokens": sum(tokens) / len(tokens), "finish_reasons": reasons, "elapsed_s": elapsed,
            "tpot_ms": statistics.fmean(tpots) if tpots else None,
            "output_tok_s": sum(tokens) / elapsed if elapsed else 0.0,
            "failed": sum(f.finish_reason not in ("stop", "length") for f in finals),
            "preemptions": sum(f.metrics.num_preemptions for f in finals)}


async def _timed_compile(engine, constraint: Constraint) -> float:
    t0 = time.perf_counter()
    await engine.wait_for_grammar(constraint)
    return 1e3 * (time.perf_counter() - t0)


async def _compile_times(engine, named: list[tuple[str, Constraint]]) -> dict[str, Any]:
    startup = await _timed_compile(engine, Constraint(kind="json"))  # the backend's tokenizer tables, once
    rows = []
    for name, c in named:
        cold = await _timed_compile(engine, c)
        cached = await _timed_compile(engine, c)
        rows.append({"constraint": name, "kind": c.kind, "cold_ms": cold, "cached_ms": cached})
    return {"backend_startup_ms": startup, "rows": rows}


async def _gap(engine, prompt_ids: list[int], schemas: list[dict[str, Any]], args) -> dict[str, Any]:
    """One unconstrained stream decoding; after ``--gap-before`` of its tokens, one request
    per schema is submitted at once. The stream's gaps (between its deltas, as a client
    sees them) before, and from the submission until the last of those requests ended."""
    room = engine.max_model_len - len(prompt_ids) - 1
    stream_params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    arrivals: list[float] = []
    rid = f"gap-{uuid.uuid4().hex}"

    async def stream() -> Finished:
        final = None
        async for item in engine.generate(list(prompt_ids), stream_params, request_id=rid):
            if isinstance(item, TokenDelta):
                arrivals.append(time.perf_counter())
            elif isinstance(item, Finished):
                final = item
        assert final is not None
        return final

    task = asyncio.create_task(stream())
    while len(arrivals) < args.gap_before and not task.done():
        await asyncio.sleep(0.001)
    small = prompt_ids[-8:]  # a short prompt: their prefills cost the stream little
    submitted = time.perf_counter()
    finals = await asyncio.gather(*(
        _one(engine, small, SamplingParams(temperature=0, max_tokens=args.gap_max_tokens, ignore_eos=True,
                                           constraint=Constraint(kind="json_schema", value=s)))
        for s in schemas))
    ended = time.perf_counter()
    engine.abort(rid)
    stream_final = await task
    before = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b <= submitted]
    before = before[2:] or before  # the first gaps follow the prefill
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if submitted < b <= ended]
    tail = [t for t in arrivals if t > ended]
    return {"requests": len(finals), "failed": sum(f.finish_reason not in ("stop", "length") for f in finals),
            "window_s": ended - submitted, "stream_outlived_window": bool(tail) or stream_final.finish_reason == "aborted",
            "median_gap_before_ms": 1e3 * statistics.median(before) if before else None,
            "median_gap_during_ms": 1e3 * statistics.median(during) if during else None,
            "max_gap_during_ms": 1e3 * max(during) if during else None,
            "tokens_before": len(before), "deltas_during": len(during)}


def run_structured(args, flags: dict, pm: PluginManager) -> dict:
    import torch

    from tokenloom import LLM

    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    biggest = max([*sizes, args.gap_requests + 1])
    layer = {"scheduler": {"max_num_seqs": biggest}}
    llm = LLM(config_file=args.config, flags=merge_layers(flags, layer), plugin_manager=pm)
    engine = llm.engine
    try:
        case_list = cases(engine)
        print("compile times ...", flush=True)
        compiles = llm.run(_compile_times(engine, compile_constraints(case_list)))
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for b in sizes:  # a first step at a new batch size pays one-time costs
            llm.run(_batch(engine, case_list[0]["prompt_ids"], warm, b))
        rows = []
        for case in case_list:
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                    constraint=case["constraint"])
            for b in sizes:
                finals, elapsed = llm.run(_batch(engine, case["prompt_ids"], params, b))
                row = decode_row(case["name"], b, finals, elapsed)
                row["prompt_tokens"] = len(case["prompt_ids"])
                row["constrained"] = case["constraint"] is not None
                rows.append(row)
                print(f"  {case['name']}, batch {b}: {row['mean_tokens']:.0f} tokens/request, "
                      f"TPOT {row['tpot_ms'] or float('nan'):.2f} ms", flush=True)
        gap: dict[str, Any] = {}
        if args.gap_requests:
            schemas = new_schemas(args.gap_requests)
            print(f"compile gap: {len(schemas)} new schemas ...", flush=True)
            gap["new"] = llm.run(_gap(engine, case_list[0]["prompt_ids"], schemas, args))
            gap["cached"] = llm.run(_gap(engine, case_list[0]["prompt_ids"], schemas, args))
        # each row against the unconstrained one with the same prompt (TPOT grows with the context)
        base = {(r["batch_size"], r["prompt_tokens"]): r["tpot_ms"] for r in rows if not r["constrained"]}
        for r in rows:
            b0 = base.get((r["batch_size"], r["prompt_tokens"]))
            r["tpot_vs_unconstrained"] = r["tpot_ms"] / b0 if r["tpot_ms"] and b0 else None
        return {"command": "tokenloom " + shlex.join(sys.argv[1:]), "machine": machine(engine.call_in_step_thread(torch.get_num_threads)),
                "torch": torch.__version__, "model": engine.model_name, "grammar_backend": engine.config.engine.grammar_backend,
                "max_tokens": args.max_tokens, "batch_sizes": sizes, "prompt": PROMPT, "decode": rows,
                "compile": compiles, "gap": gap}
    finally:
        llm.close()


def _ms(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_structured(report: dict) -> str:
    lines = [f"`{report['command']}`", "", f"machine: {report['machine']}",
             f"model {report['model']}, grammar backend {report['grammar_backend']}, greedy, max_tokens "
             f"{report['max_tokens']} (EOS ignored; a constrained answer ends when its grammar completes)", "",
             "| case | batch | prompt tokens | tokens/request | finish | TPOT ms | vs unconstrained | output tok/s "
             "| preemptions |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["decode"]:
        finish = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        ratio = "-" if r["tpot_vs_unconstrained"] is None else f"{r['tpot_vs_unconstrained']:.2f}x"
        lines.append(f"| {r['case']} | {r['batch_size']} | {r['prompt_tokens']} | {r['mean_tokens']:.1f} | {finish} | "
                     f"{_ms(r['tpot_ms'])} | {ratio} | {r['output_tok_s']:.1f} | {r['preemptions']} |")
    comp = report["compile"]
    lines += ["", f"compile (grammar thread; the backend's start-up, once: {comp['backend_startup_ms']:.0f} ms)", "",
              "| constraint | kind | cold ms | cached ms |", "| --- | --- | --- | --- |"]
    for r in comp["rows"]:
        lines.append(f"| {r['constraint']} | {r['kind']} | {r['cold_ms']:.1f} | {r['cached_ms']:.3f} |")
    gap = report["gap"]
    if gap:
        n = gap["new"]["requests"]
        lines += ["", f"compile gap: one unconstrained stream decoding while {n} requests are submitted at once "
                      "(short prompts); its gaps between tokens from then until the last of them ended", "",
                  "| the requests' schemas | window s | stream gap before: median ms | during: median ms | "
                  "during: max ms | max / median before |", "| --- | --- | --- | --- | --- | --- |"]
        for key, label in (("new", f"{n} new (compiled then)"), ("cached", f"the same {n} again (cached)")):
            g = gap[key]
            times = "-" if not (g["max_gap_during_ms"] and g["median_gap_before_ms"]) else \
                f"{g['max_gap_during_ms'] / g['median_gap_before_ms']:.1f}x"
            note = "" if g["stream_outlived_window"] else " (the stream ended first)"
            lines.append(f"| {label}{note} | {g['window_s']:.2f} | {_ms(g['median_gap_before_ms'])} | "
                         f"{_ms(g['median_gap_during_ms'])} | {_ms(g['max_gap_during_ms'])} | {times} |")
    return "\n".join(lines)


def add_parser(bsub, add_engine_args, cmd) -> None:
    st = bsub.add_parser("structured", help="structured outputs: decode under JSON schema / regex / tool-call "
                                            "grammars, compile times, the step's gap while schemas compile")
    st.add_argument("--batch-sizes", default="1,32")
    st.add_argument("--max-tokens", type=int, default=256, help="per request (EOS ignored)")
    st.add_argument("--gap-requests", type=int, default=20,
                    help="requests with never-seen schemas sent while a stream decodes (0 skips the gap check)")
    st.add_argument("--gap-before", type=int, default=32, help="the stream's tokens before they are sent")
    st.add_argument("--gap-max-tokens", type=int, default=8, help="max_tokens of each of those requests")
    st.add_argument("--json", metavar="FILE")
    add_engine_args(st)
    st.set_defaults(func=cmd)
