"""lm-eval's log-likelihood path against ``tokenloom serve``, checked against tokenloom's own.

Scores the local multiple-choice task ``scripts/lm_eval/tokenloom_mc.yaml`` (data in
``scripts/lm_eval/tokenloom_mc.jsonl``) twice and asserts the two agree:

1. **In process** with tokenloom's Python API: ``LLM(dtype=...)`` and, for every
   (context, continuation) pair, ``SamplingParams(prompt_logprobs=1)`` over
   context + continuation; the pair's log-likelihood is the sum of the continuation tokens'
   logprobs. The pair is tokenised the way lm-eval 0.4.13's ``local-completions`` model
   tokenises it (``TemplateLM._encode_pair``): trailing spaces of the context move to the
   front of the continuation, context + continuation is encoded whole (no special tokens),
   the context alone is encoded, and the continuation's tokens are the whole encoding's
   tokens after the first ``len(context_ids)``. lm-eval's request is ``echo: true, logprobs:
   1, max_tokens: 1, temperature: 0, seed: 1234`` with the ids as ``prompt: [[ids]]``; it
   reads ``token_logprobs[ctxlen:-1]`` of the echoed prompt + the one generated token, i.e.
   the continuation tokens' logprobs (is_greedy: each equals its position's top-1 logprob).
   The prompt's logprobs are computed before any generation, so the in-process requests
   score alone (``max_tokens=0``): the same numbers without the dropped token's decode.
   acc = argmax of the choices' log-likelihoods == gold, acc_norm = argmax of
   log-likelihood / len(choice in characters) == gold (lm-eval's definitions, first index
   on ties).
2. **lm-eval** (its own CLI, from the venv given by ``--lm-eval``) with ``--model
   local-completions`` against a ``tokenloom serve`` this script starts (``--port 0
   --openai-port <free port> --dtype <dtype>``), ``--log_samples`` so the per-choice
   log-likelihoods can be compared, not just the accuracies.

Kernels pinned: by default the torch backend times, at load, whether each quantised weight's
int4/int8 kernel (bf16 activations) or its dense float32 copy is faster at 1..32 rows
(``backend.quant_max_rows = -1``), so two processes on a loaded machine can pick different
kernels for the same prompt length and score it differently (measured here: up to 0.45 nats
on a continuation, mean 0.07, between this script's process and the server's; accuracies
happened to agree). Both sides therefore run with ``backend.quant_max_rows = 0`` (the
quantised kernels at every row count, nothing timed; ``--quant-max-rows`` to change it),
the server via ``--set backend.quant_max_rows=0``. With that, the server's prompt scoring
(one prefill of the prompt alone on scratch blocks, ``AsyncEngine._score_prompts``) and the
in-process one are the same computation, and the log-likelihoods agree bit for bit.

Tokenizer for lm-eval: it needs one on its side to split context from continuation (with
``tokenizer_backend=None`` its loglikelihood path asserts a tokenizer is present, so text-only
requests are not an option for this task type), and the hub is not reachable. The script
writes the engine's own tokenizer (``LLM.tokenizer.tok``, built from the embedded GGUF) as a
local Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``) and
passes ``tokenizer_backend=huggingface,tokenizer=<folder>``; lm-eval then sends token ids
(``prompt: [[ids]]``) and tokenloom scores exactly those ids. The script checks that this
folder, loaded with ``transformers`` as lm-eval loads it, encodes every string as tokenloom's
tokenizer does.

Run (from anywhere; lm-eval is run from the repository root, where the task's relative
data path points)::

    .venv/bin/python scripts/lm_eval_check.py --lm-eval /tmp/lmeval/bin/lm_eval

``--base-url http://127.0.0.1:8000/v1/completions`` uses a server already running instead
of starting one (it must serve the same model with the same dtype and kernel settings:
``tokenloom serve --port 0 --openai-port 8000 --dtype float32 --set backend.quant_max_rows=0``).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import numpy as np
import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "scripts" / "lm_eval"
TASK_YAML = TASK_DIR / "tokenloom_mc.yaml"
MODEL = "smollm2-135m"


# ---- the task, rendered as lm-eval renders it --------------------------------------------
def load_task() -> tuple[dict, list[dict]]:
    cfg = yaml.safe_load(TASK_YAML.read_text())
    data_file = ROOT / cfg["dataset_kwargs"]["data_files"]["test"]
    docs = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
    return cfg, docs


def render(template: str, doc: dict) -> str:
    return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template).render(**doc)


def task_requests(cfg: dict, docs: list[dict]) -> list[dict]:
    """One entry per doc: its context, choices, gold index and (context, continuation) pairs."""
    delim = cfg.get("target_delimiter", " ")
    out = []
    for i, doc in enumerate(docs):
        ctx = render(cfg["doc_to_text"], doc)
        choices = ast.literal_eval(render(cfg["doc_to_choice"], doc))
        gold = int(render(cfg["doc_to_target"], doc))
        out.append({"doc_id": i, "context": ctx, "choices": choices, "gold": gold,
                    "pairs": [(ctx, f"{delim}{c}") for c in choices]})
    return out


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair for a causal model."""
    assert context, "an empty context takes lm-eval's prefix-token path, not used by this task"
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx_ids = encode(context)
    return ctx_ids, whole[len(ctx_ids):]


def score_docs(items: list[dict], lls: list[list[float]]) -> dict:
    acc, acc_norm = [], []
    for item, ll in zip(items, lls, strict=True):
        ll = np.array(ll)
        lens = np.array([float(len(c)) for c in item["choices"]])
        acc.append(float(int(np.argmax(ll)) == item["gold"]))
        acc_norm.append(float(int(np.argmax(ll / lens)) == item["gold"]))
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm),
            "per_doc_acc": acc, "per_doc_acc_norm": acc_norm}


# ---- 1. tokenloom in process -------------------------------------------------------------
def in_process(items: list[dict], dtype: str, quant_max_rows: int, tok_dir: Path
               ) -> tuple[list[list[float]], list[list[bool]], list]:
    from tokenloom.core.llm import LLM
    from tokenloom.core.sampling_params import SamplingParams

    llm = LLM(dtype=dtype, backend={"name": "torch", "quant_max_rows": quant_max_rows})
    try:
        tok = llm.tokenizer
        export_tokenizer(tok, tok_dir)

        def encode(text: str) -> list[int]:  # lm-eval: the HF tokenizer, add_special_tokens=False
            return tok.encode(text, add_bos=False, parse_special_tokens=True)

        check_tokenizer_export(tok_dir, encode, items)
        flat = []  # (doc index, ids, ctxlen)
        for d, item in enumerate(items):
            for ctx, cont in item["pairs"]:
                ctx_ids, cont_ids = encode_pair(encode, ctx, cont)
                assert cont_ids and len(ctx_ids) + len(cont_ids) < 2047  # lm-eval's max_length 2048 - 1: no cut
                flat.append((d, ctx_ids + cont_ids, len(ctx_ids)))
        # lm-eval asks for one generated token too (max_tokens 1) and drops it ([ctxlen:-1]); the
        # prompt's logprobs come from the prompt scored alone before any generation, so scoring
        # alone (max_tokens 0) computes the same numbers without 125 needless decodes
        params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1, seed=1234)
        t0 = time.perf_counter()
        results = llm.generate([ids for _, ids, _ in flat], params)
        print(f"in-process: {len(flat)} requests scored in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        llm.close()
    lls: list[list[float]] = [[] for _ in items]
    greedy: list[list[bool]] = [[] for _ in items]
    token_counts = []
    for (d, ids, ctxlen), res in zip(flat, results, strict=True):
        entries = res.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        cont = entries[ctxlen:]  # lm-eval: token_logprobs[ctxlen:-1] of prompt + 1 generated token
        lls[d].append(sum(e.logprob for e in cont))  # summed in token order, as lm-eval sums
        greedy[d].append(all(e.logprob == max(t.logprob for t in e.top) for e in cont))
        token_counts.append((ctxlen, len(ids) - ctxlen))
    return lls, greedy, token_counts


def export_tokenizer(tok, folder: Path) -> None:
    """tokenloom's tokenizer as a local Hugging Face tokenizer folder lm-eval can load offline."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.tok.save(str(folder / "tokenizer.json"))
    eos = sorted(tok.eos_token_ids)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
              "eos_token": tok.token(eos[0]) if eos else None,
              "bos_token": tok.token(tok.bos_token_id) if tok.bos_token_id is not None else None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def check_tokenizer_export(folder: Path, encode, items: list[dict]) -> None:
    """The exported folder, loaded as lm-eval loads it, encodes every string of the task as
    tokenloom's tokenizer does."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    n = 0
    for item in items:
        for ctx, cont in item["pairs"]:
            for text in (ctx, ctx + cont):
                want = encode(text)
                got = hf(text, add_special_tokens=False, return_attention_mask=False).input_ids
                assert got == want, f"tokenizer export differs on {text!r}: {got} vs {want}"
                n += 1
    print(f"tokenizer export: {n} strings encode identically with transformers and tokenloom", flush=True)


# ---- 2. lm-eval against tokenloom serve --------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, dtype: str, quant_max_rows: int, log_path: Path) -> subprocess.Popen:
    cli = Path(sys.executable).parent / "tokenloom"
    cmd = [str(cli), "serve", "--port", "0", "--openai-port", str(port), "--dtype", dtype,
           "--set", f"backend.quant_max_rows={quant_max_rows}"]
    print("server:", " ".join(cmd), flush=True)
    log = open(log_path, "w")  # noqa: SIM115 - kept open for the server's life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenloom serve exited with {proc.returncode}; see {log_path}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"tokenloom serve did not come up in 600 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_lm_eval(lm_eval: str, base_url: str, tok_dir: Path, out: Path) -> list[str]:
    model_args = (f"model={MODEL},base_url={base_url},tokenizer_backend=huggingface,"
                  f"tokenizer={tok_dir},tokenized_requests=True")
    cmd = [lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
           "--include_path", str(TASK_DIR.relative_to(ROOT)), "--tasks", "tokenloom_mc",
           "--batch_size", "1", "--output_path", str(out / "lm_eval"), "--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf_datasets_cache")}
    print("lm-eval:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(out / "lm_eval.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"lm-eval: done in {time.perf_counter() - t0:.1f} s (log: {out / 'lm_eval.log'})", flush=True)
    return cmd


def read_lm_eval(out: Path, items: list[dict]) -> tuple[dict, list[list[float]], list[list[bool]]]:
    [results_file] = glob.glob(str(out / "lm_eval" / "*" / "results_*.json"))
    [samples_file] = glob.glob(str(out / "lm_eval" / "*" / "samples_tokenloom_mc_*.jsonl"))
    results = json.loads(Path(results_file).read_text())
    lls: list[list[float]] = [[] for _ in items]
    greedy: list[list[bool]] = [[] for _ in items]
    seen = set()
    for line in Path(samples_file).read_text().splitlines():
        s = json.loads(line)
        d = s["doc_id"]
        seen.add(d)
        item = items[d]
        args = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        assert args == item["pairs"], f"doc {d}: lm-eval's requests {args} are not {item['pairs']}"
        for ll, is_greedy in s["filtered_resps"]:  # written as strings
            lls[d].append(float(ll))
            greedy[d].append(str(is_greedy) == "True")
    assert seen == set(range(len(items))), "lm-eval's samples do not cover every doc"
    return results, lls, greedy


# ---- main --------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default="/tmp/lmeval/bin/lm_eval", help="lm-eval's CLI (its own venv)")
    ap.add_argument("--dtype", default="float32", help="for the in-process LLM and the server (default float32)")
    ap.add_argument("--quant-max-rows", type=int, default=0,
                    help="backend.quant_max_rows for both sides (default 0: kernels pinned; -1: timed at load)")
    ap.add_argument("--openai-port", type=int, default=0, help="the server's OpenAI port (default: a free one)")
    ap.add_argument("--base-url", help="use this running server's /v1/completions instead of starting one")
    ap.add_argument("--out", default="/tmp/tokenloom_lm_eval", help="output folder (tokenizer, logs, results)")
    ap.add_argument("--tol", type=float, default=1e-6,
                    help="per-choice |log-likelihood difference| allowed (default 1e-6; 0 is measured)")
    args = ap.parse_args()

    out = Path(args.out)
    if (out / "lm_eval").exists():
        import shutil

        shutil.rmtree(out / "lm_eval")
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    cfg, docs = load_task()
    items = task_requests(cfg, docs)
    n_pairs = sum(len(i["pairs"]) for i in items)
    print(f"task tokenloom_mc: {len(items)} questions, {n_pairs} (context, continuation) pairs", flush=True)

    own_lls, own_greedy, token_counts = in_process(items, args.dtype, args.quant_max_rows, tok_dir)
    own = score_docs(items, own_lls)

    server = None
    base_url = args.base_url
    if base_url is None:
        port = args.openai_port or free_port()
        server = start_server(port, args.dtype, args.quant_max_rows, out / "server.log")
        base_url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        cmd = run_lm_eval(args.lm_eval, base_url, tok_dir, out)
    finally:
        if server is not None:
            stop_server(server)
    results, lme_lls, lme_greedy = read_lm_eval(out, items)
    lme = results["results"]["tokenloom_mc"]
    lme_scores = {"acc": lme["acc,none"], "acc_norm": lme["acc_norm,none"]}
    recomputed = score_docs(items, lme_lls)  # lm-eval's log-likelihoods through this script's scoring

    diffs = [abs(a - b) for x, y in zip(own_lls, lme_lls, strict=True) for a, b in zip(x, y, strict=True)]
    worst = int(np.argmax(diffs))
    greedy_same = sum(a == b for x, y in zip(own_greedy, lme_greedy, strict=True) for a, b in zip(x, y, strict=True))
    summary = {
        "lm_eval_version": results.get("lm_eval_version"), "task": "tokenloom_mc", "questions": len(items),
        "pairs": n_pairs, "dtype": args.dtype, "quant_max_rows": args.quant_max_rows, "model": MODEL,
        "tokens_per_pair": {"context_max": max(c for c, _ in token_counts),
                            "continuation_max": max(c for _, c in token_counts)},
        "tokenloom_in_process": {"acc": own["acc"], "acc_norm": own["acc_norm"]},
        "lm_eval_via_serve": lme_scores,
        "max_abs_loglikelihood_diff": max(diffs), "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        "identical_loglikelihoods": sum(d == 0.0 for d in diffs), "is_greedy_agree": greedy_same,
        "lm_eval_command": cmd,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    print()
    print(f"{'':28}{'acc':>8}{'acc_norm':>10}")
    print(f"{'tokenloom in-process':28}{own['acc']:8.4f}{own['acc_norm']:10.4f}")
    print(f"{'lm-eval via tokenloom serve':28}{lme_scores['acc']:8.4f}{lme_scores['acc_norm']:10.4f}")
    print(f"per-choice log-likelihoods: {len(diffs)} compared, {summary['identical_loglikelihoods']} bit-identical, "
          f"max |diff| {max(diffs):.3g} (pair {worst}), mean {summary['mean_abs_loglikelihood_diff']:.3g}; "
          f"is_greedy agrees on {greedy_same}/{len(diffs)}")
    print("lm-eval results JSON (tokenloom_mc):", json.dumps(lme))
    print(f"summary: {out / 'summary.json'}")

    assert own["per_doc_acc"] == recomputed["per_doc_acc"], "per-question acc differs"
    assert own["per_doc_acc_norm"] == recomputed["per_doc_acc_norm"], "per-question acc_norm differs"
    assert own["acc"] == lme_scores["acc"] and own["acc_norm"] == lme_scores["acc_norm"], "scores differ"
    assert max(diffs) <= args.tol, f"a log-likelihood differs by {max(diffs)} > {args.tol}"
    print("OK: lm-eval against tokenloom serve scores the same as tokenloom in process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
