"""Tensor parallelism (core/parallel.py, core/executor.py): the sharding is exact, two gloo
ranks give one rank's greedy tokens, and a rank that dies or hangs fails the engine's
requests with an error within the stated bound instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.parallel import TensorParallel, split_evenly, take_columns
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.weights import QuantizedWeight

from conftest import TINY_VOCAB, _byte_tokenizer, start_serve_process, tiny_engine_kwargs

CFG = ModelConfig(vocab_size=101, hidden_size=96, intermediate_size=70, num_layers=1, num_heads=6, num_kv_heads=3,
                  head_dim=16)


@pytest.fixture(autouse=True)
def _keep_threads():
    yield
    torch.set_num_threads(2)  # rank 0 of a group runs with its share of the threads


def test_split_evenly_covers_everything_once():
    for n in (1, 3, 7, 70):
        for world in range(1, min(n, 4) + 1):
            parts = [split_evenly(n, world, r) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_sharded_matmuls_add_up_to_the_whole_one():
    """Column shards concatenate, row shards sum, to the unsplit matmuls (uneven heads: 3 KV
    heads over 2 ranks)."""
    torch.manual_seed(0)
    hd, d = CFG.head_dim, CFG.hidden_size
    x = torch.randn(5, d, dtype=torch.float64)
    qkv = torch.randn(CFG.q_size + 2 * CFG.kv_size, d, dtype=torch.float64)
    o = torch.randn(d, CFG.q_size, dtype=torch.float64)
    down = torch.randn(d, CFG.intermediate_size, dtype=torch.float64)
    head = torch.randn(CFG.vocab_size, d, dtype=torch.float64)
    world = 2
    attn = torch.randn(5, CFG.q_size, dtype=torch.float64)
    ffn = torch.randn(5, CFG.intermediate_size, dtype=torch.float64)
    o_sum = torch.zeros(5, d, dtype=torch.float64)
    down_sum = torch.zeros(5, d, dtype=torch.float64)
    heads_seen, logits = [], []
    for r in range(world):
        tp = TensorParallel(r, world)
        local = tp.local_config(CFG)
        q_rows = tp.heads(CFG)
        part = x @ tp.shard("qkv", "qkv", qkv, CFG, "none").T
        q, k, v = part.split([local.q_size, local.kv_size, local.kv_size], dim=1)
        full = x @ qkv.T
        torch.testing.assert_close(q, full[:, q_rows.start * hd:q_rows.stop * hd])
        kv = tp.kv_heads(CFG)
        torch.testing.assert_close(k, full[:, CFG.q_size + kv.start * hd:CFG.q_size + kv.stop * hd])
        heads_seen += list(q_rows)
        o_sum += attn[:, q_rows.start * hd:q_rows.stop * hd] @ tp.shard("o", "o", o, CFG, "none").T
        f = tp.ffn(CFG)
        down_sum += ffn[:, f.start:f.stop] @ tp.shard("down", "down", down, CFG, "none").T
        logits.append(x @ tp.shard("lm_head", "lm_head", head, CFG, "none").T)
    assert heads_seen == list(range(CFG.num_heads))
    assert [len(TensorParallel(r, 2).kv_heads(CFG)) for r in range(2)] == [2, 1]
    torch.testing.assert_close(o_sum, attn @ o.T)
    torch.testing.assert_close(down_sum, ffn @ down.T)
    torch.testing.assert_close(torch.cat(logits, dim=1), x @ head.T)


def test_quantised_columns_split_only_at_group_boundaries():
    torch.manual_seed(1)
    w = QuantizedWeight(torch.randint(0, 16, (8, 64), dtype=torch.uint8), torch.rand(8, 4) + 0.1,
                        torch.full((8, 4), 8.0), bits=4, group_size=16)
    part = take_columns(w, 16, 48, "model.layers.0.o", "GPTQQuantizer")
    torch.testing.assert_close(part.dequantize(), w.dequantize()[:, 16:48])
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.o \(quantizer GPTQQuantizer\).*column 24"):
        take_columns(w, 24, 64, "model.layers.0.o", "GPTQQuantizer")
    act_order = QuantizedWeight(w.codes, w.scales, w.zeros, bits=4, group_size=16,
                                g_idx=torch.randperm(64).div(16, rounding_mode="floor").int())
    with pytest.raises(ConfigError, match="act-order"):
        take_columns(act_order, 0, 32, "model.layers.0.down", "GPTQQuantizer")


def test_more_ranks_than_kv_heads_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 exceeds the model's 3 KV heads"):
        TensorParallel(0, 4).check(CFG)


def _three_kv_head_model(path):
    """A tiny LLaMA whose 3 KV heads do not split evenly over 2 ranks (like SmolLM2's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=257,
                      eos_token_id=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)  # sharper logits: greedy near-ties are rare
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


@pytest.mark.parametrize("model", ["tiny", "uneven"])
def test_two_gloo_ranks_give_one_ranks_greedy_tokens(model, tiny_model_dir, tmp_path):
    """Greedy, fp32: plain decoding, chunked prefill, a shared prefix (prefix cache) and
    speculative drafts (n-gram, a draft model on rank 0) in one mixed batch."""
    from tokenloom import LLM

    path = tiny_model_dir if model == "tiny" else _three_kv_head_model(tmp_path)
    prompts = ["hello world, hello world, hello", "the quick brown fox " * 6, "abc", "the quick brown fox jumps"]
    decoders = ["standard", "ngram", "speculative", "standard"]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, decoder=d) for d in decoders]
    outs = {}
    for tp in (1, 2):
        llm = LLM(**tiny_engine_kwargs(path, tensor_parallel_size=tp, enable_decoders=["speculative"],
                                       scheduler={"name": "continuous", "max_num_batched_tokens": 32}))
        try:
            assert llm.engine.executor.world_size == tp
            outs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.engine.cache.stats().num_used_blocks == 0
        finally:
            llm.close()
    assert outs[1] == outs[2]


def test_medusa_refuses_tensor_parallelism(tiny_model_dir):
    from tokenloom import LLM

    with pytest.raises(ConfigError, match="medusa.*tensor_parallel_size 2"):
        LLM(**tiny_engine_kwargs(tiny_model_dir, tensor_parallel_size=2, decoder={"name": "medusa"}))


async def _run_until_rank_fails(engine, fail_rank, bound_s: float):
    """Start three long requests, break rank 1 once they stream, and check every request
    ends with one error within ``bound_s``."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    reqs = [engine.submit(p, params) for p in ("one", "two two", "three three three")]
    finals, started = {}, asyncio.Event()

    async def consume(req):
        async for item in engine.stream(req):
            started.set()
            if hasattr(item, "finish_reason"):
                finals[req.seq.request_id] = item

    tasks = [asyncio.create_task(consume(r)) for r in reqs]
    await asyncio.wait_for(started.wait(), 30)
    t0 = time.monotonic()
    fail_rank(engine.executor.workers[0])
    await asyncio.wait_for(asyncio.gather(*tasks), bound_s)
    elapsed = time.monotonic() - t0
    assert len(finals) == 3 and all(f.finish_reason == "error" for f in finals.values())
    assert all(f.usage.completion_tokens < 400 for f in finals.values())
    return finals, elapsed


@pytest.mark.parametrize("how", ["killed", "hung"])
async def test_a_failed_rank_ends_every_request_with_an_error_within_the_bound(how, tiny_model_dir):
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.plugins import PluginManager

    timeout_s = 4.0
    pm = PluginManager(load_entry_points=False)
    engine = AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(
        tiny_model_dir, tensor_parallel_size=2, distributed_timeout_s=timeout_s)), plugin_manager=pm)
    worker = engine.executor.workers[0]
    try:
        if how == "killed":
            finals, elapsed = await _run_until_rank_fails(engine, lambda p: p.kill(), bound_s=timeout_s + 6)
            assert "rank" in next(iter(finals.values())).error
        else:
            finals, elapsed = await _run_until_rank_fails(engine, lambda p: os.kill(p.pid, signal.SIGSTOP),
                                                          bound_s=timeout_s + 6)
            assert elapsed >= timeout_s * 0.5  # it waited for the timeout, then gave up
        report = engine.health_report()
        assert report.status == "dead" and "cannot be retried" in report.reason
        assert engine.cache.stats().num_used_blocks == 0
        with pytest.raises(Exception, match="cannot serve"):
            engine.submit("again", SamplingParams(max_tokens=2))
    finally:
        worker.kill()
        await engine.shutdown()
        engine.close()


async def test_the_server_keeps_answering_health_after_a_rank_dies(make_server):
    from tokenloom.protocols.websocket.client import Client

    from conftest import collect

    server, url = await make_server(engine={"tensor_parallel_size": 2, "distributed_timeout_s": 4.0})
    async with Client(url) as client:
        text, final, _ = await collect(client, "warm", params={"max_tokens": 4})
        assert final.finish_reason in ("length", "stop")
        task = asyncio.create_task(collect(client, "long one", params={"max_tokens": 400, "ignore_eos": True}))
        await asyncio.sleep(0.5)
        server.engine.executor.workers[0].kill()
        _, final, _ = await asyncio.wait_for(task, 15)
        assert final.finish_reason == "error"
    health_url = url.replace("ws://", "http://") + "/health"
    body = await asyncio.to_thread(lambda: _get(health_url))
    assert json.loads(body)["status"] == "dead"


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:  # 503 while dead: still an answer
        return e.read().decode()


def test_torchrun_starts_the_same_group(tiny_model_dir):
    """Under torchrun (here both ranks on this machine) every rank runs the same command;
    rank 0 generates, rank 1 serves it, and the text is one rank's."""
    args = ["generate", "hello world", "--raw", "--temperature", "0", "--max-tokens", "16", "--model",
            str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64"]
    env = {**os.environ, "TOKENLOOM_LOG_LEVEL": "ERROR"}
    one = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", *args], capture_output=True, text=True,
                         env=env, timeout=120)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "tokenloom.cli.main", *args, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    assert one.stdout.strip() and one.stdout == two.stdout


@pytest.mark.slow
def test_embedded_model_two_ranks_equal_one_fp32():
    from tokenloom import LLM

    msgs = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                       "Explain what a hash table is in two sentences.")]
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = {}
    for tp in (1, 2):
        llm = LLM(dtype="float32", quantizer={"name": "none"}, num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            outs[tp] = [llm.generate(messages=[m], params=params)[0] for m in msgs]
        finally:
            llm.close()
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[2]]
    assert outs[2][0].text.startswith("The capital of France is Paris")


@pytest.mark.parametrize("quantizer", ["int8", "rtn", "fp8"])
def test_quantised_layers_shard(quantizer, tiny_model_dir):
    """Each online quantizer's weights split over two ranks: the same logits as one rank,
    to the kernels' rounding (the 4-bit kernel takes bf16 activations: ~0.4% of the range;
    a wrong split is off by the whole range)."""
    from tokenloom import LLM
    from tokenloom.core.sequence import Sequence

    ids = list(b"quantised layers shard too")
    logits = {}
    for tp in (1, 2):
        llm = LLM(**tiny_engine_kwargs(tiny_model_dir, tensor_parallel_size=tp, quantizer={"name": quantizer}))
        try:
            engine = llm.engine
            seq = Sequence("q", ids, SamplingParams(max_tokens=1))
            assert engine.cache.allocate(seq, len(ids))
            logits[tp] = engine.call_in_step_thread(engine.executor.prefill_logits, ids, engine.cache.block_table(seq))
            engine.cache.free(seq)
        finally:
            llm.close()
    assert logits[2].shape == (len(ids), TINY_VOCAB)
    torch.testing.assert_close(logits[2], logits[1], atol=1e-2 * float(logits[1].abs().max()), rtol=0)
    assert (logits[2].argmax(-1) == logits[1].argmax(-1)).float().mean() > 0.9


async def test_a_rank_lost_while_idle_shows_in_health_at_once(tiny_model_dir):
    """No request needed: the watcher's exit code reaches health; the engine closes twice."""
    from tokenloom.core.build import config_from_sources
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.plugins import PluginManager

    pm = PluginManager(load_entry_points=False)
    engine = AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir, tensor_parallel_size=2)),
                         plugin_manager=pm)
    try:
        assert engine.health_report().status == "ok"
        engine.executor.workers[0].kill()
        for _ in range(100):
            if engine.health_report().status == "dead":
                break
            await asyncio.sleep(0.05)
        report = engine.health_report()
        assert report.status == "dead" and "rank 1 exited" in report.reason
        assert engine.dead_event.is_set()
    finally:
        await engine.shutdown()
        engine.close()
        engine.close()


async def test_serve_with_two_ranks_answers_and_leaves_no_rank_behind(tiny_model_dir):
    """`tokenloom serve --tensor-parallel-size 2` as a real process: it answers over the
    WebSocket, exits 0 on SIGTERM, and its rank-1 process is gone after."""

    from tokenloom.protocols.websocket.client import Client

    from conftest import collect

    proc, url = start_serve_process("--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
                                    "--port", "0", "--frontends", "websocket", "--tensor-parallel-size", "2",
                                    "--shutdown-deadline", "0.2")
    try:
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 1
        async with Client(url) as client:
            _, final, _ = await collect(client, "two ranks", params={"temperature": 0, "max_tokens": 6})
            assert final.finish_reason in ("length", "stop") and final.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, lambda: proc.wait(timeout=60)) == 0
        assert not _alive(ranks[0])  # (an orphan would have a new parent: look it up by pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_processes(parent: int) -> list[int]:
    """Live `python -m tokenloom.core.executor` children of ``parent`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == parent and stat[0] != "Z" and b"tokenloom.core.executor" in cmd:
            found.append(int(entry))
    return found
