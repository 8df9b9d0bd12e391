"""`tokenloom bench peers --concurrency 1,8,32,64`: the same seeded workload through
tokenloom and the engines a user would otherwise pick, at each concurrency, in one run:
same prompts (token ids), same output lengths (EOS ignored), same thread count, and the
dtype tokenloom runs in wherever the peer has it. Throughput against concurrency is the curve.

Peers, each only if installed (``pip install -e '.[peers]'`` and
``scripts/build-llama-server.sh``), each in its own process so that one that crashes (an
AMX kernel dying with SIGILL) is reported and skipped instead of ending the run:
* llama.cpp through llama-cpp-python: one stream, requests one after another (concurrency 1);
* llama.cpp's ``llama-server --parallel N`` (continuous batching, its fastest batched path),
  driven over loopback HTTP with N requests in flight;
* Hugging Face transformers ``generate``: static batches of N, left padding, greedy.
At concurrency N tokenloom runs with ``max_num_seqs = N``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tokenloom.bench.runner import StepRecorder, isolated, run_workload
from tokenloom.bench.stats import ratio
from tokenloom.bench.workload import (
    BenchRequest,
    make_workload,
    parse_range,
    token_range_for,
)
from tokenloom.core.config import merge_layers
from tokenloom.core.loader.resolve import resolve_model_path
from tokenloom.core.plugins import PluginManager


def _row(system: str, workload: list[BenchRequest], elapsed: float, note: str = "") -> dict:
    out = sum(r.max_tokens for r in workload)
    prompt = sum(len(r.prompt_token_ids) for r in workload)
    return {"system": system, "elapsed_s": elapsed, "output_tok_s": out / elapsed,
            "total_tok_s": (out + prompt) / elapsed, "note": note}


def run_tokenloom(args, flags, pm) -> tuple[dict, list[BenchRequest]]:
    from tokenloom import LLM

    recorder = StepRecorder()
    pm.register(recorder, name="bench-peers-recorder")
    llm = LLM(config_file=args.config, flags=flags, plugin_manager=pm)
    try:
        vocab = llm.engine.model_config.vocab_size
        workload = make_workload(args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len),
                                 seed=args.workload_seed, token_range=token_range_for(vocab))
        run_workload(llm, [BenchRequest([(300 + i) % vocab for i in range(16)], 4)], recorder)
        res = run_workload(llm, workload, recorder)
        sched = llm.engine.config.scheduler.name
        cache = llm.engine.config.cache_manager.name
        dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    finally:
        llm.close()
        pm.pm.unregister(recorder)
    return _row(f"tokenloom {sched}+{cache}", workload, res["elapsed_s"], dtype), workload


def run_llama_cpp_single(model_path: Path, workload, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in workload) + 16
    llm = Llama(str(model_path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    t0 = time.perf_counter()
    for req in workload:
        llm.reset()
        for n, _ in enumerate(llm.generate(req.prompt_token_ids, top_k=1, temp=0.0, reset=True), start=1):
            if n >= req.max_tokens:
                break
    elapsed = time.perf_counter() - t0
    del llm
    return _row("llama.cpp (llama-cpp-python)", workload, elapsed, "one stream, its own Q4_1 kernels")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(explicit: str | None) -> str | None:
    for cand in (explicit, os.environ.get("TOKENLOOM_LLAMA_SERVER"), ".peers/llama-server", shutil.which("llama-server")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def run_llama_server(binary: str, model_path: Path, workload, threads: int, parallel: int) -> dict:
    ctx_per_seq = max(len(r.prompt_token_ids) + r.max_tokens for r in workload) + 16
    port = _free_port()
    cmd = [binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "--parallel", str(parallel), "-c", str(ctx_per_seq * parallel), "-fa", "on", "--no-kv-unified",
           "--no-warmup", "-b", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)

        def one(req: BenchRequest) -> int:
            body = json.dumps({"prompt": req.prompt_token_ids, "n_predict": req.max_tokens, "temperature": 0,
                               "top_k": 1, "ignore_eos": True, "cache_prompt": False}).encode()
            r = urllib.request.Request(base + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(r, timeout=3600) as resp:
                return json.loads(resp.read())["tokens_predicted"]

        one(BenchRequest(list(range(300, 316)), 4))  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            produced = list(pool.map(one, workload))
        elapsed = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    short = sum(p < r.max_tokens for p, r in zip(produced, workload, strict=True))
    return _row("llama.cpp (llama-server)", workload, elapsed,
                "--parallel N, flash-attn, per-slot KV" + (f"; {short} requests short at {parallel}" if short else ""))


def run_transformers(model_path: Path, workload, batch_size: int, dtype: str = "float32",
                     threads: int | None = None) -> dict | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    if model_path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=torch.float32).to(torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
    model.eval()
    pad = 0
    t0 = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        group = workload[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for j, r in enumerate(group):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in group)  # a static batch runs until its longest member is done
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - t0
    return _row("transformers generate", workload, elapsed, f"{dtype}, static batches of N, left padding")


def run_peers(args, flags: dict, pm: PluginManager) -> dict:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    flags = merge_layers(flags, {"num_threads": threads})
    model_path = resolve_model_path(flags.get("model", "smollm2-135m"))
    levels = [int(c) for c in str(args.concurrency).split(",")]
    binary = find_llama_server(args.llama_server)
    rows, skipped = [], []

    def attempt(name: str, hint: str, level: int, fn, *fn_args) -> None:
        if name in args.skip:
            return
        try:
            row = fn(*fn_args)
        except Exception as exc:  # one broken peer must not cost the others' figures
            skipped.append(f"{name} at {level}: failed ({type(exc).__name__}: {str(exc)[:160]})")
            return
        if row:
            rows.append({**row, "concurrency": level})
            print(f"  {level:>3} {row['system']}: {row['output_tok_s']:.1f} output tok/s", flush=True)
        elif not any(s.startswith(f"{name}:") for s in skipped):
            skipped.append(f"{name}: not installed ({hint})")

    for level in levels:
        ours, workload = run_tokenloom(args, merge_layers(flags, {"scheduler": {"max_num_seqs": level}}), pm)
        rows.append({**ours, "concurrency": level})
        print(f"  {level:>3} {ours['system']}: {ours['output_tok_s']:.1f} output tok/s", flush=True)
        dtype = ours["note"]
        if level == 1:
            attempt("llama-cpp-python", "pip install -e '.[peers]'", level,
                    isolated, run_llama_cpp_single, model_path, workload, threads)
        if binary:
            attempt("llama-server", "", level, run_llama_server, binary, model_path, workload, threads, level)
        elif "llama-server" not in args.skip and level == levels[0]:
            skipped.append("llama-server: not installed (scripts/build-llama-server.sh)")
        attempt("transformers", "pip install -e '.[peers]'", level,
                isolated, run_transformers, model_path, workload, level, dtype, threads)
    for r in rows:  # tokenloom over the peer at the same concurrency
        mine = next(x for x in rows if x["concurrency"] == r["concurrency"] and x["system"].startswith("tokenloom"))
        r["tokenloom_ratio"] = ratio(mine["output_tok_s"], r["output_tok_s"])
    return {"threads": threads, "concurrency": levels,
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "seed": args.workload_seed},
            "results": rows, "skipped": skipped}


def format_peers(report: dict) -> str:
    """Output tok/s per system (rows) and concurrency (columns), tokenloom's ratio beside each."""
    levels = report["concurrency"]
    systems = list(dict.fromkeys(r["system"] for r in report["results"]))
    w = report["workload"]
    lines = [f"{w['num_requests']} requests, prompts {w['prompt_len']}, outputs {w['output_len']} tokens "
             f"(EOS ignored), {report['threads']} threads; output tok/s (tokenloom is Nx that)", "",
             "| system | " + " | ".join(f"concurrency {c}" for c in levels) + " | note |",
             "| --- | " + " | ".join("---" for _ in levels) + " | --- |"]
    for name in systems:
        cells, note = [], ""
        for c in levels:
            r = next((x for x in report["results"] if x["system"] == name and x["concurrency"] == c), None)
            if r is None:
                cells.append("-")
                continue
            note = r["note"]
            cells.append(f"{r['output_tok_s']:.1f}" + ("" if name.startswith("tokenloom")
                                                        else f" ({r['tokenloom_ratio']:.2f}x)"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {note} |")
    lines += [f"skipped: {s}" for s in report["skipped"]]
    return "\n".join(lines)
