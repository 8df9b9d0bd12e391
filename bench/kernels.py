"""`tokenloom bench kernels`: what the torch backend measured on this machine when it
chose its matmul kernels at load: each quantised kernel against its dense copy
(``backend.quant_max_rows = -1``), and for float32 MKL's GEMV against oneDNN's GEMM
(``backend.cpu_linear = "dual"``) — microseconds per matmul at each row count, for every
weight shape of the model, and the row count up to which the first of the two is kept."""

from __future__ import annotations

import torch

from tokenloom.core.config import merge_layers
from tokenloom.core.plugins import PluginManager


def run_kernels(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM
    from tokenloom.backends import torch_linear

    torch_linear.KERNEL_TIMINGS.clear()
    llm = LLM(config_file=args.config, flags=merge_layers(flags, {"backend": {"quant_max_rows": -1}}),
              plugin_manager=pm)
    try:
        dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        quantizer = llm.engine.config.quantizer.name if llm.engine.config.quantizer else "checkpoint"
    finally:
        llm.close()
    rows = [{"kernel": " ".join(str(k) for k in key[:-3]), "out": key[-3], "in": key[-2], "dtype": key[-1], **t}
            for key, t in torch_linear.KERNEL_TIMINGS.items()]
    return {"threads": torch.get_num_threads(), "dtype": dtype, "quantizer": quantizer, "shapes": rows}


def format_kernels(report: dict) -> str:
    if not report["shapes"]:
        return (f"quantizer {report['quantizer']}, dtype {report['dtype']}: no kernel choice was timed "
                "(no quantised matmul with a dense copy, no float32 dual layout)")
    sizes = report["shapes"][0]["rows"]
    lines = [f"kernels timed at load ({report['dtype']}), microseconds per matmul, median of 9; "
             f"{report['threads']} threads; quantizer {report['quantizer']}", "",
             "| choice | out x in | " + " | ".join(f"{r} rows" for r in sizes) + " | first kept up to |",
             "| --- | --- | " + " | ".join("---" for _ in sizes) + " | --- |"]
    for s in report["shapes"]:
        cells = [f"{q:.0f} / {d:.0f}" for q, d in zip(s["quantised_us"], s["dense_us"], strict=True)]
        lines.append(f"| {s['kernel']} | {s['out']} x {s['in']} | " + " | ".join(cells) + f" | {s['max_rows']} rows |")
    lines.append("")
    lines.append("each cell: first / second — quant_matmul, int4, int8: the quantised kernel / its dense copy "
                 "(quant_matmul ... amx: / amx_matmul, which stands in for the copy); fp32 mkl-vs-onednn: MKL / "
                 "oneDNN. Above the last column's row count the second runs.")
    return "\n".join(lines)
