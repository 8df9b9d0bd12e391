"""`tokenloom bench peers`: the same seeded workload through tokenloom and the engines a
user would otherwise pick, in one run, same prompts (token ids), same output lengths
(EOS ignored), same thread count.

Peers, each only if installed (``pip install -e '.[peers]'`` and
``scripts/build-llama-server.sh``):
* llama.cpp through llama-cpp-python: one stream, requests one after another;
* llama.cpp's ``llama-server --parallel N`` (continuous batching, its fastest batched path),
  driven over loopback HTTP with N requests in flight;
* Hugging Face transformers ``generate``: static batches, left padding, greedy.
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

from tokenloom.core.config import merge_layers
from tokenloom.core.loader.resolve import resolve_model_path
from tokenloom.core.plugins import PluginManager
from tokenloom.protocols.bench.runner import StepRecorder, run_workload
from tokenloom.protocols.bench.stats import ratio
from tokenloom.protocols.bench.workload import (
    BenchRequest,
    make_workload,
    parse_range,
    token_range_for,
)


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
    return _row("llama.cpp (llama-cpp-python, 1 stream)", workload, elapsed, "sequential")


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
    return _row(f"llama.cpp (llama-server, {parallel} parallel)", workload, elapsed,
                "flash-attn on, per-slot KV" + (f"; {short} requests short" if short else ""))


def run_transformers(model_path: Path, workload, batch_size: int) -> dict | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if model_path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
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
    return _row(f"transformers generate (static batch {batch_size})", workload, elapsed, "fp32, left padding")


def run_peers(args, flags: dict, pm: PluginManager) -> dict:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    flags = merge_layers(flags, {"num_threads": threads})
    model_path = resolve_model_path(flags.get("model", "smollm2-135m"))
    first, workload = run_tokenloom(args, flags, pm)
    rows = [first]
    print(f"  {rows[-1]['system']}: {rows[-1]['output_tok_s']:.1f} output tok/s", flush=True)
    skipped = []

    def attempt(name: str, hint: str, run) -> None:
        if name in args.skip:
            return
        try:
            row = run()
        except Exception as exc:  # one broken peer must not cost the others' figures
            skipped.append(f"{name}: failed ({type(exc).__name__}: {str(exc)[:160]})")
            return
        (rows.append(row) if row else skipped.append(f"{name}: not installed ({hint})"))

    attempt("llama-cpp-python", "pip install -e '.[peers]'",
            lambda: run_llama_cpp_single(model_path, workload, threads))
    binary = find_llama_server(args.llama_server)
    attempt("llama-server", "scripts/build-llama-server.sh",
            lambda: binary and run_llama_server(binary, model_path, workload, threads, args.parallel))
    attempt("transformers", "pip install -e '.[peers]'",
            lambda: run_transformers(model_path, workload, args.hf_batch_size))
    for r in rows[1:]:
        print(f"  {r['system']}: {r['output_tok_s']:.1f} output tok/s", flush=True)
    ours = rows[0]["output_tok_s"]
    for r in rows:
        r["tokenloom_ratio"] = ratio(ours, r["output_tok_s"])
    return {"threads": threads, "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                                             "output_len": args.output_len, "seed": args.workload_seed},
            "results": rows, "skipped": skipped}


def format_peers(report: dict) -> str:
    lines = [f"{report['workload']['num_requests']} requests, prompts {report['workload']['prompt_len']}, outputs "
             f"{report['workload']['output_len']} tokens (EOS ignored), {report['threads']} threads",
             f"{'system':<44} {'out tok/s':>9} {'total tok/s':>11} {'tokenloom is':>13}  note"]
    for r in report["results"]:
        lines.append(f"{r['system']:<44} {r['output_tok_s']:>9.1f} {r['total_tok_s']:>11.1f} "
                     f"{r['tokenloom_ratio']:>12.2f}x  {r['note']}")
    for s in report["skipped"]:
        lines.append(f"skipped: {s}")
    return "\n".join(lines)
