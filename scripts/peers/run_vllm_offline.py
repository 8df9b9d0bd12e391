"""vLLM-CPU's offline ``LLM.generate`` on a token-id workload, for `tokenloom bench peers`.

Runs in vLLM's own venv (``.peers/bin/vllm-python``, which preloads tcmalloc and Intel OpenMP);
imports nothing of tokenloom. Reads one JSON object on stdin:

    {"model": HF_DIR, "workload": [[prompt_token_ids, max_tokens], ...], "concurrency": N,
     "dtype": "float32", "max_num_batched_tokens": 2048, "kv_cache_gib": 4}

and prints ``PEER_RESULT {json}`` on stdout: the workload's wall time (after a warm-up
request), the output tokens produced, vLLM's version and its start-up time. Greedy, EOS
ignored (every request produces exactly its max_tokens), ``max_num_seqs`` = concurrency,
all requests submitted at once. Threads and binding come from the environment the bench sets
(``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    import vllm
    from vllm import LLM, SamplingParams

    workload = job["workload"]
    longest = max(len(p) + n for p, n in workload)
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_num_seqs=job["concurrency"],
              max_num_batched_tokens=job.get("max_num_batched_tokens", 2048),
              max_model_len=max(512, longest + 16), seed=0, enable_prefix_caching=False)
    startup = time.perf_counter() - t0
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([{"prompt_token_ids": list(range(300, 316))}], greedy(4), use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for _, n in workload], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    print("PEER_RESULT " + json.dumps({
        "elapsed_s": elapsed, "produced": produced, "startup_s": startup, "version": vllm.__version__,
        "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "reserved": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
    }), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which re-imports this file
    main()
