"""The `triton` backend on a real GPU, in one run, into one JSON file.

    .venv/bin/python scripts/gpu_check.py [--out gpu-check.json] [--quick]

1. ``checks``: every kernel of kernels/triton/ against its torch reference at full size
   (bfloat16 and float32; the interpreter tests in tests/test_triton_kernels.py are small);
2. ``bench``: each kernel's time (``triton.testing.do_bench``, median ms), the bytes and
   FLOPs it must move and do, achieved GB/s and TFLOP/s and their fraction of the device's
   peak (H200: ~4.8 TB/s HBM3e, ~989 dense bf16 TFLOP/s), beside the torch backend's op
   where it has one; paged decode attention at batch 64, context 2048 among them;
3. ``engine``: generation throughput on the embedded model (SmolLM2-135M Q4_1) with
   ``backend = triton`` and ``backend = torch``, same batch, same settings, and how many
   requests' greedy tokens agree.

Without CUDA it says so and exits with status 2. It never sets TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

#: device-name fragment -> (peak HBM bytes/s, peak dense bf16 FLOP/s), from the vendors' sheets
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12), "L40S": (0.864e12, 362e12)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, a shorter engine run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a machine with an "
              "NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    from tokenloom.kernels import triton as K

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAKS.items() if k in name), (None, None))
    result = {"device": name, "torch": torch.__version__, "triton": __import__("triton").__version__,
              "peak_bytes_per_s": peak[0], "peak_flops": peak[1]}
    t0 = time.time()
    result["checks"] = run_checks(K, args.quick)
    result["bench"] = run_bench(K, peak, args.quick)
    result["engine"] = run_engine(args.quick)
    result["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    failed = [c for c in result["checks"] if not c["ok"]]
    print(f"gpu_check: {len(result['checks']) - len(failed)}/{len(result['checks'])} checks passed; wrote {args.out}")
    return 1 if failed else 0


# ---- inputs ------------------------------------------------------------------------
def attention_inputs(B, H, KVH, D, ctx, bs, dtype, quant=None, q_len=1):
    """Random pools and block tables for B sequences of ``ctx`` tokens, ``q_len`` new each."""
    nb = B * ((ctx + bs - 1) // bs) + 1
    dev = "cuda"
    if quant is None:
        kc, vc = (torch.randn(KVH, nb, bs, D, device=dev, dtype=dtype) for _ in range(2))
        ks = vs = None
    else:
        kc, vc = ((torch.randn(KVH, nb, bs, D, device=dev) * 40).clamp(-127, 127).to(quant) for _ in range(2))
        ks, vs = ((torch.rand(KVH, nb, bs, device=dev) * 0.02 + 0.005).bfloat16() for _ in range(2))
    tables = torch.randperm(nb - 1, device=dev)[:B * ((ctx + bs - 1) // bs)].view(B, -1).int()
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B * q_len, H, D, device=dev, dtype=dtype)
    return q, kc, vc, ks, vs, tables, lens


def q4_weight(N, Kd, group, dev="cuda"):
    from tokenloom.core.weights import QuantizedWeight

    G = Kd // group
    return QuantizedWeight(torch.randint(0, 16, (N, Kd), dtype=torch.uint8, device=dev),
                           torch.rand(N, G, device=dev) * 0.02, torch.randint(0, 16, (N, G), device=dev).float(), 4,
                           group)


# ---- 1. correctness at full size ---------------------------------------------------
def run_checks(K, quick: bool) -> list[dict]:
    out = []

    def check(op, shape, got, want, tol):
        g, w = got.float(), want.float()
        diff = float((g - w).abs().max())
        ok = diff <= tol * max(1.0, float(w.abs().max()))
        out.append({"op": op, "shape": shape, "max_abs_diff": diff, "tol": tol, "ok": ok})
        print(f"  check {op} {shape}: max abs diff {diff:.3g} {'ok' if ok else 'FAIL'}")

    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
        dt = str(dtype).removeprefix("torch.")
        for H, KVH, D, bs in ((32, 8, 128, 16), (9, 3, 64, 32), (64, 8, 128, 16)):
            for B, ctx in ((8, 2048),) + (() if quick else ((64, 777),)):
                q, kc, vc, _, _, t, lens = attention_inputs(B, H, KVH, D, ctx, bs, dtype)
                a = (q, kc, vc, t, lens, D ** -0.5)
                check("paged_decode_attention", f"B{B} H{H}/{KVH} D{D} bs{bs} ctx{ctx} {dt}",
                      K.paged_decode_attention(*a), K.paged_decode_attention_ref(*a), tol)
            q, kc, vc, _, _, t, lens = attention_inputs(4, H, KVH, D, 1000, bs, dtype, q_len=300)
            starts = torch.arange(4, device="cuda", dtype=torch.int32) * 300
            a = (q, kc, vc, t, lens, starts, torch.full_like(lens, 300), D ** -0.5)
            check("paged_prefill_attention", f"4x300 of ctx 1000 H{H}/{KVH} D{D} bs{bs} {dt}",
                  K.paged_prefill_attention(*a), K.paged_prefill_attention_ref(*a), tol)
        for quant in (torch.float8_e4m3fn, torch.int8):
            q, kc, vc, ks, vs, t, lens = attention_inputs(16, 32, 8, 128, 1500, 16, dtype, quant)
            a = (q, kc, vc, t, lens, 128 ** -0.5)
            check("paged_decode_attention", f"B16 ctx1500 {quant} pool {dt}", K.paged_decode_attention(
                *a, k_scale=ks, v_scale=vs), K.paged_decode_attention_ref(*a, k_scale=ks, v_scale=vs), tol)
        for M in (1, 4, 128):
            qw = q4_weight(4096, 4096, 128)
            p = K.pack_int4(qw)
            x = torch.randn(M, 4096, device="cuda", dtype=dtype)
            a = (x, p.qweight, p.scales, p.zeros, p.group_size, p.g_idx)
            check("int4_matmul", f"{M}x4096x4096 g128 {dt}", K.int4_matmul(*a), K.int4_matmul_ref(*a), tol)
            w = (torch.randn(4096, 4096, device="cuda") * 64).to(torch.float8_e4m3fn)
            s = torch.rand(4096, device="cuda") * 1e-3
            check("fp8_matmul", f"{M}x4096x4096 {dt}", K.fp8_matmul(x, w, s), K.fp8_matmul_ref(x, w, s), tol)
        h, delta, wn = (torch.randn(512, 4096, device="cuda"), torch.randn(512, 4096, device="cuda", dtype=dtype),
                        torch.rand(4096, device="cuda") + 0.5)
        check("add_rms_norm", f"512x4096 {dt}", K.add_rms_norm(h, delta, wn, 1e-5, dtype)[0],
              K.add_rms_norm_ref(h, delta, wn, 1e-5, dtype)[0], tol)
        x = torch.randn(512, 40, 128, device="cuda", dtype=dtype)
        cos, sin = torch.rand(512, 128, device="cuda"), torch.rand(512, 128, device="cuda")
        check("rope", f"512x40x128 {dt}", K.rope(x, cos, sin, dtype), K.rope_ref(x, cos, sin, dtype), tol)
    for quant in (torch.float8_e4m3fn, torch.int8):
        k, v = torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(1024 * 16, device="cuda")[:4096]
        pools = [[torch.zeros(8, 1024, 16, 128, device="cuda", dtype=quant) for _ in range(2)] +
                 [torch.zeros(8, 1024, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
        for fn, (kc, vc, ks, vs) in zip((K.write_kv, K.write_kv_ref), pools, strict=True):
            fn(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*pools, strict=True))
        out.append({"op": "write_kv", "shape": f"4096 tokens x 8 heads x 128, {quant} pool", "bit_exact": same,
                    "ok": same})
        print(f"  check write_kv {quant}: {'bit-exact' if same else 'FAIL: bytes differ'}")
    return out


# ---- 2. micro-benchmarks -----------------------------------------------------------
def run_bench(K, peak, quick: bool) -> list[dict]:
    from triton.testing import do_bench

    from tokenloom.backends.torch_backend import TorchBackend, TorchBackendOptions
    from tokenloom.core.attention import AttentionInputs

    torch_backend = TorchBackend(TorchBackendOptions(decode_attention="torch"), "cuda")
    rows = []

    def bench(op, shape, fn, nbytes, flops, torch_fn=None):
        ms = do_bench(fn, return_mode="median")
        row = {"op": op, "shape": shape, "ms": ms, "GB_per_s": nbytes / ms / 1e6, "TFLOP_per_s": flops / ms / 1e9}
        if peak[0]:
            row["frac_peak_bw"], row["frac_peak_flops"] = nbytes / ms / 1e-3 / peak[0], flops / ms / 1e-3 / peak[1]
        if torch_fn is not None:
            row["torch_ms"] = do_bench(torch_fn, return_mode="median")
        rows.append(row)
        print(f"  bench {op} {shape}: {ms:.4f} ms, {row['GB_per_s']:.0f} GB/s, {row['TFLOP_per_s']:.2f} TFLOP/s"
              + (f" (torch {row['torch_ms']:.4f} ms)" if torch_fn else ""))

    bf = torch.bfloat16
    for B, ctx in ((64, 2048),) + (() if quick else ((1, 8192), (256, 1024))):
        H, KVH, D, bs = 32, 8, 128, 16
        q, kc, vc, _, _, t, lens = attention_inputs(B, H, KVH, D, ctx, bs, bf)
        inp = AttentionInputs(slot_mapping=torch.zeros(B, dtype=torch.long, device="cuda"), block_size=bs,
                              decode_rows=list(range(B)), decode_context_lens=[ctx] * B,
                              decode_block_tables=t.tolist())
        meta = torch_backend.prepare(inp)
        bench("paged_decode_attention", f"B{B} ctx{ctx} H{H}/{KVH} D{D} bf16",
              lambda q=q, kc=kc, vc=vc, t=t, lens=lens, ctx=ctx, D=D: K.paged_decode_attention(
                  q, kc, vc, t, lens, D ** -0.5, max_context_len=ctx),
              2 * B * ctx * KVH * D * 2 + 2 * q.numel() * 2, 4 * B * H * ctx * D,
              lambda q=q, kc=kc, vc=vc, meta=meta, D=D: torch_backend.attention(q, None, None, kc, vc, meta,
                                                                                 D ** -0.5))
    S, ql, ctx = 4, 1024, 2048
    q, kc, vc, _, _, t, lens = attention_inputs(S, 32, 8, 128, ctx, 16, bf, q_len=ql)
    starts = torch.arange(S, device="cuda", dtype=torch.int32) * ql
    causal_pairs = S * sum(ctx - ql + i + 1 for i in range(ql))
    bench("paged_prefill_attention", f"{S}x{ql} of ctx {ctx} H32/8 D128 bf16",
          lambda: K.paged_prefill_attention(q, kc, vc, t, lens, starts, torch.full_like(lens, ql), 128 ** -0.5,
                                            max_query_len=ql),
          2 * q.numel() * 2 + 2 * S * ctx * 32 * 128 * 2, 4 * 32 * 128 * causal_pairs)
    T = 4096
    k, v = torch.randn(2, T, 8, 128, device="cuda", dtype=bf)
    slots = torch.randperm(2048 * 16, device="cuda")[:T]
    for storage in (bf, torch.int8):
        kc, vc = (torch.zeros(8, 2048, 16, 128, device="cuda", dtype=storage) for _ in range(2))
        ks, vs = ((torch.zeros(8, 2048, 16, device="cuda", dtype=bf),) * 2) if storage != bf else (None, None)
        bench("write_kv", f"{T} tokens x 8 x 128 into {storage}",
              lambda kc=kc, vc=vc, ks=ks, vs=vs: K.write_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs),
              2 * k.numel() * (2 + kc.element_size()), 0)
    for M in (1, 16, 2048):
        for N, Kd in ((4096, 4096), (14336, 4096)):
            x = torch.randn(M, Kd, device="cuda", dtype=bf)
            p = K.pack_int4(q4_weight(N, Kd, 128))
            dense = torch.randn(N, Kd, device="cuda", dtype=bf)
            bench("int4_matmul", f"{M}x{N}x{Kd} g128",
                  lambda x=x, p=p: K.int4_matmul(x, p.qweight, p.scales, p.zeros, p.group_size),
                  N * Kd // 2 + p.scales.numel() * 8 + (x.numel() + M * N) * 2, 2 * M * N * Kd,
                  lambda x=x, dense=dense: torch.nn.functional.linear(x, dense))
            w = (torch.randn(N, Kd, device="cuda") * 64).to(torch.float8_e4m3fn)
            s = torch.rand(N, device="cuda") * 1e-3
            bench("fp8_matmul", f"{M}x{N}x{Kd}", lambda x=x, w=w, s=s: K.fp8_matmul(x, w, s),
                  N * Kd + N * 4 + (x.numel() + M * N) * 2, 2 * M * N * Kd,
                  lambda x=x, dense=dense: torch.nn.functional.linear(x, dense))
    for T in (1, 64, 4096):
        h, delta, wn = (torch.randn(T, 4096, device="cuda"), torch.randn(T, 4096, device="cuda", dtype=bf),
                        torch.rand(4096, device="cuda"))
        bench("add_rms_norm", f"{T}x4096 (h fp32, delta bf16)",
              lambda h=h, delta=delta, wn=wn: K.add_rms_norm(h, delta, wn, 1e-5, bf, in_place=True),
              T * 4096 * (4 + 2 + 4 + 2), 0,
              lambda h=h, delta=delta, wn=wn: torch_backend.add_rms_norm(h, delta, wn, 1e-5, bf))
        x = torch.randn(T, 40, 128, device="cuda", dtype=bf)
        cos, sin = torch.rand(T, 128, device="cuda"), torch.rand(T, 128, device="cuda")
        bench("rope", f"{T}x40x128 bf16", lambda x=x, cos=cos, sin=sin: K.rope(x, cos, sin, bf),
              x.numel() * 4 + T * 128 * 8, 0)
    return rows


# ---- 3. the engine -----------------------------------------------------------------
def run_engine(quick: bool) -> dict:
    from tokenloom import LLM, SamplingParams

    n, max_tokens = (16, 64) if quick else (64, 256)
    prompts = [f"Write a short story about a lighthouse keeper, number {i}." for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs, tokens = {}, {}
    for backend in ("triton", "torch"):
        try:
            with LLM(model="smollm2-135m", backend=backend, device="cuda", dtype="bfloat16") as llm:
                llm.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up: kernels compile
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - t0
        except Exception as exc:  # a backend that fails is reported, not fatal
            runs[backend] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        tokens[backend] = [o.token_ids for o in outs]
        total = sum(len(t) for t in tokens[backend])
        runs[backend] = {"requests": n, "max_tokens": max_tokens, "generated_tokens": total,
                         "seconds": round(seconds, 3), "tokens_per_s": round(total / seconds, 1)}
        print(f"  engine {backend}: {total} tokens in {seconds:.2f} s = {total / seconds:.0f} tok/s")
    if len(tokens) == 2:
        runs["greedy_identical_requests"] = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"], strict=True))
    runs["settings"] = "smollm2-135m (GGUF Q4_1), bfloat16, default scheduler and cache, one process each"
    return runs


if __name__ == "__main__":
    sys.exit(main())
