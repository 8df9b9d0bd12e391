"""OpenVINO GenAI's ``ContinuousBatchingPipeline`` on a token-id workload, for `tokenloom bench peers`.

Runs in OpenVINO's own venv (``.peers/openvino-venv/bin/python``); imports nothing of
tokenloom. Reads one JSON object on stdin:

    {"model": OV_DIR, "workload": [[prompt_token_ids, max_tokens], ...], "concurrency": N,
     "threads": T, "dtype": "float32", "max_num_batched_tokens": 2048, "kv_cache_gib": 2}

and prints ``PEER_RESULT {json}`` on stdout: the workload's wall time (after a warm-up
request), the output tokens produced (per request, in workload order), OpenVINO GenAI's version,
its start-up time and the compute precision. Greedy, EOS ignored with ``min_new_tokens`` =
``max_new_tokens`` (every request produces exactly its max_tokens), dynamic split-fuse (chunked
prefill), no prefix caching. ``dtype`` float32 asks the CPU plugin for f32 inference (its default
on a CPU with bf16 is bf16); the weights are the export's (int4 or int8).

Concurrency is capped here, on the client side, as for the other peers: at most N requests are
in flight, submitted in workload order through the request API (``add_request``, then ``step()``
until one finishes, whose place the next request takes). ``max_num_seqs`` = N is set as well, but
it does not cap the running sequences under dynamic split-fuse: with ``max_num_seqs`` 1 and four
requests added at once (openvino_genai 2026.4.1), every step scheduled all four (PipelineMetrics
``scheduled_requests`` 4; 1 without split-fuse), and ``generate()`` with the whole 64-request
workload at "concurrency 1" ran at 505-593 output tok/s on 2 cores, against ~121 for tokenloom's
batch 1 and ~97 for OpenVINO's own single stream.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = job["concurrency"]
    sched.max_num_batched_tokens = job.get("max_num_batched_tokens", 2048)
    sched.cache_size = job.get("kv_cache_gib", 2)
    sched.dynamic_split_fuse = True
    sched.enable_prefix_caching = False
    props = {"INFERENCE_NUM_THREADS": int(job["threads"])}
    precision = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(job.get("dtype", ""))
    if precision:
        props["INFERENCE_PRECISION_HINT"] = precision
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(job["model"], sched, "CPU", props)
    startup = time.perf_counter() - t0

    def greedy(n: int):
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = n
        cfg.min_new_tokens = n
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def ids(tokens: list[int]):
        return ov.Tensor(np.asarray([tokens], dtype=np.int64))

    pipe.generate([ids(list(range(300, 316)))], [greedy(4)])  # warm-up
    workload, level = job["workload"], max(1, int(job["concurrency"]))
    inputs = [ids(p) for p, _ in workload]
    configs = [greedy(n) for _, n in workload]
    produced = [0] * len(workload)
    running: dict[int, object] = {}  # request index -> GenerationHandle
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(workload) or running:
        while nxt < len(workload) and len(running) < level:
            running[nxt] = pipe.add_request(nxt, inputs[nxt], configs[nxt])
            nxt += 1
        pipe.step()
        for i in [i for i, h in running.items() if h.get_status() != ov_genai.GenerationStatus.RUNNING]:
            outs = running.pop(i).read_all()  # the whole output once the request has stopped
            produced[i] = len(outs[0].generated_ids) if outs else 0
    elapsed = time.perf_counter() - t0
    print("PEER_RESULT " + json.dumps({
        "elapsed_s": elapsed, "produced": produced, "startup_s": startup, "version": ov_genai.__version__,
        "precision": precision or "plugin default",
    }), flush=True)


if __name__ == "__main__":
    main()
