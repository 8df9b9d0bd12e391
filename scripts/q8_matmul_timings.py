"""Times one weight alone: the dense bf16 copy (oneDNN, as ``backend.quant_dense = "copy"``
runs it) against the C++ ``q8_matmul`` (``quant_dense = "q8"``), on the embedded model's
layer shapes, random 4-bit codes in groups of 32; milliseconds a call (mean of 20 after 3).

    python scripts/q8_matmul_timings.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenloom.backends.torch_linear import Q8Linear
from tokenloom.core.weights import QuantizedWeight
from tokenloom.kernels import cpu_ops

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate and up": (3072, 576), "down": (576, 1536)}
ROWS = (8, 32, 64, 284, 512)


def _ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops.load()
    if ops is None or not ops.q8_ready():
        raise SystemExit("q8_matmul needs the C++ ops built for AVX512-VNNI")
    print("| matmul (out x in) | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("| --- |" + " --- |" * len(ROWS))
    for name, (out, inp) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        qw = QuantizedWeight(codes=torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8),
                             scales=torch.rand(out, inp // 32, generator=g) * 0.01 + 1e-3,
                             zeros=torch.full((out, inp // 32), 8.0), bits=4, group_size=32)
        q8 = Q8Linear(qw, ops.q8_matmul)
        packed = torch.ops.mkldnn._reorder_linear_weight(qw.dequantize(torch.bfloat16), None)
        cells = []
        with torch.inference_mode():
            for rows in ROWS:
                x = torch.randn(rows, inp, generator=g).bfloat16()
                dense = _ms(lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
                cells.append(f"{dense:.3f} / {_ms(lambda x=x, q8=q8: q8.apply(x)):.3f}")
        print(f"| {out} x {inp} ({name}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
