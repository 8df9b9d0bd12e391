"""`tokenloom bench quant`: every quantisation method in one run: weight size, nominal bits,
perplexity on the evaluation text (the same tokens for every method; core/evaluation.py) and
its change against the first method, and decode tok/s at fixed batch sizes (the same runs as
`bench decode`).

A method is given as

- ``name``: the engine's model (``--model``, default the embedded one) quantised at load with
  ``quantizer=name`` (``none``, ``gguf``, ``int8``, ``rtn``, ``fp8``, or any registered
  quantizer);
- ``name=PATH``: a checkpoint (directory or file) produced offline, e.g. ``gptq=out/gptq``,
  loaded as ``--model PATH`` with the method its own metadata names (as with no
  ``--quantizer``: `tokenloom quantize` writes rtn and int8 in the GPTQ layout); ``name`` is
  the row's label.

``name`` (up to its first ``-``: ``fp8-gptq=DIR`` is an fp8 row) also picks the row's nominal
bits per weight (:data:`NOMINAL_BITS`; ``none`` is the engine dtype's width).
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch

from tokenloom.core.config import merge_layers
from tokenloom.core.plugins import PluginManager

#: bits per matmul weight each method stores, nominally (scales and zero points not counted)
NOMINAL_BITS = {"gguf": 4, "int8": 8, "rtn": 4, "fp8": 8, "gptq": 4, "awq": 4}


def parse_methods(spec: str) -> list[tuple[str, str | None]]:
    """``"none,int8,gptq=out/gptq"`` -> ``[("none", None), ("int8", None), ("gptq", "out/gptq")]``."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not name.strip() or (sep and not path.strip()):
            raise ValueError(f"bad method {item!r}: use NAME or NAME=PATH")
        out.append((name.strip(), path.strip() if sep else None))
    if not out:
        raise ValueError("no method given")
    return out


def method_layer(name: str, path: str | None, flags: dict, pm: PluginManager) -> dict:
    """The engine flags for one method (see the module docstring)."""
    if path is None:
        return merge_layers(flags, {"quantizer": name})
    # A checkpoint is read with the method its own metadata names (`tokenloom quantize`
    # writes rtn and int8 in the GPTQ layout): ``name`` is only the row's label.
    layer = {k: v for k, v in flags.items() if k != "quantizer"}
    layer["model"] = path
    return layer


def nominal_bits(name: str, dtype: str) -> int | None:
    """Bits per weight of the method a row's label names (``fp8-gptq`` -> ``fp8``)."""
    if name == "none":
        return torch.finfo(getattr(torch, dtype)).bits
    return NOMINAL_BITS.get(name.partition("-")[0])


def _score(args, flags: dict, pm: PluginManager, text: str) -> dict:
    from tokenloom import LLM
    from tokenloom.cli.eval import quantizer_label
    from tokenloom.core.evaluation import encode_text, perplexity

    llm = LLM(config_file=args.config, flags=flags, plugin_manager=pm)
    try:
        model = llm.engine.runner.model
        ids = encode_text(llm.engine.tokenizer, text, add_bos=None)[:args.eval_tokens]
        t0 = time.perf_counter()
        res = perplexity(llm, ids, window=args.window, stride=args.stride)
        seconds = time.perf_counter() - t0
        leaked = llm.engine.cache.stats().num_used_blocks
        if leaked:
            raise RuntimeError(f"{leaked} KV blocks still in use after scoring")
        return {"quantizer": quantizer_label(llm), "dtype": str(llm.engine.runner.dtype).replace("torch.", ""),
                "kernel": model.layers[0].qkv.kernel, "weight_bytes": model.weight_bytes_per_token(),
                "ppl": res["ppl"], "nll": res["nll"], "scored_tokens": res["tokens"], "windows": res["windows"],
                "eval_seconds": seconds,
                "tokens_sha1": hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]}
    finally:
        llm.close()


def run_quant(args, flags: dict, pm: PluginManager) -> dict:
    """Score, then (if --batch-sizes is not empty) time decode, one method after another."""
    from tokenloom.bench.decode import run_variant
    from tokenloom.core.evaluation import evaluation_text

    methods = parse_methods(args.methods)
    text = evaluation_text()
    rows = []
    for name, path in methods:
        label = name if path is None else f"{name}={path}"
        mflags = method_layer(name, path, flags, pm)
        print(f"{label}: scoring {args.eval_tokens} tokens", flush=True)
        row = {"method": label, "name": name, "path": path, **_score(args, mflags, pm, text)}
        row["bits"] = nominal_bits(name, row["dtype"])
        print(f"  ppl {row['ppl']:.4f} ({row['eval_seconds']:.1f} s), {row['kernel']}", flush=True)
        row["results"] = run_variant(args, mflags, pm)["results"] if args.batch_sizes.strip() else []
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["ppl_change_pct"] = 100.0 * (row["ppl"] / base["ppl"] - 1.0)
        row["same_tokens"] = row["tokens_sha1"] == base["tokens_sha1"]
    return {"eval": {"text": "pydoc_data.topics evaluation split", "python": sys.version.split()[0],
                     "max_tokens": args.eval_tokens, "window": args.window, "stride": args.stride or args.window},
            "threads": torch.get_num_threads(), "methods": rows}


def format_quant(report: dict) -> str:
    rows = report["methods"]
    sizes = [r["batch_size"] for r in rows[0]["results"]]
    ev = report["eval"]
    lines = [f"perplexity: {rows[0]['scored_tokens']} tokens of the {ev['text']} (Python {ev['python']}), "
             f"window {ev['window']}, stride {ev['stride']}; {report['threads']} threads", "",
             "| method | bits | layer kernel | weights MB | ppl | ppl vs first | "
             + "".join(f"batch {b} tok/s | " for b in sizes),
             "| --- | --- | --- | --- | --- | --- | " + "".join("--- | " for _ in sizes)]
    for r in rows:
        note = "" if r["same_tokens"] else " (other tokens!)"
        bits = "-" if r["bits"] is None else str(r["bits"])
        by_size = {x["batch_size"]: x["decode_tok_s"] for x in r["results"]}
        lines.append(f"| {r['method']} | {bits} | {r['kernel']} | {r['weight_bytes'] / 1e6:.1f} | "
                     f"{r['ppl']:.3f}{note} | {r['ppl_change_pct']:+.2f}% | "
                     + "".join(f"{by_size[b]:.1f} | " if by_size.get(b) else "- | " for b in sizes))
    return "\n".join(lines)
