"""LoRA adapters (the ``adapter`` role, plugins/adapters/lora.py) against PEFT itself.

Adapters are made here with PEFT on the tiny random LLaMA (ranks 4, 8 and 16; q/k/v/o and
MLP targets; rsLoRA; a per-module alpha), saved in PEFT's format and served by tokenloom.
The reference is PEFT's own forward and greedy ``generate`` over the same base.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tokenloom import LLM
from tokenloom.core.errors import ClientError, ConfigError, NotFound
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence

from conftest import make_tiny_llama, tiny_engine_kwargs

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

ADAPTERS = {  # name: (rank, targets, extra LoraConfig arguments)
    "a1": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    "a2": (16, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "a3": (8, ["k_proj", "o_proj", "down_proj"], {"alpha_pattern": {"down_proj": 3}}),
}
PROMPTS = [[5, 17, 33, 90, 120, 7], [200, 3, 3, 41], [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]]


def _peft_model(base_dir, rank, targets, extra, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                                          **extra))
    with torch.no_grad():  # B starts at zero: make every update matter
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.4)
    return pm.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base_dir.mkdir()
    base = make_tiny_llama(base_dir).eval()
    peft_models, paths = {}, {}
    for seed, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items(), start=1):
        pm = _peft_model(base_dir, rank, targets, extra, seed)
        pm.save_pretrained(root / name)
        peft_models[name], paths[name] = pm, str(root / name)
    return {"root": root, "base_dir": base_dir, "base": base, "peft": peft_models, "paths": paths}


def _llm(setup, names=("a1", "a2", "a3"), **kw):
    modules = {n: setup["paths"][n] for n in names}
    return LLM(**tiny_engine_kwargs(setup["base_dir"], adapter={"name": "lora", "modules": modules,
                                                                "max_lora_rank": 16}, **kw))


def _greedy(n=16, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _peft_greedy(model, prompt, n=16):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def _logits(llm, prompt, adapter):
    eng = llm.engine
    scratch = Sequence("lora-logits", list(prompt), SamplingParams(max_tokens=1))
    assert eng.cache.allocate(scratch, len(prompt))
    try:
        return eng.call_in_step_thread(eng.executor.prefill_logits, list(prompt),
                                       list(eng.cache.block_table(scratch)), adapter)
    finally:
        eng.cache.free(scratch)


def test_each_adapter_gives_pefts_logits_and_greedy_ids(lora_setup):
    with _llm(lora_setup) as llm:
        for name, pm in lora_setup["peft"].items():
            for prompt in PROMPTS:
                with torch.no_grad():
                    ref = pm(torch.tensor([prompt])).logits[0]
                # fp32 sums in another order than PEFT's: |logits| ~3, so ~1e-4 apart on some CPUs.
                assert (_logits(llm, prompt, name) - ref).abs().max() < 5e-4, name
                assert llm.generate([prompt], _greedy(adapter=name))[0].token_ids == _peft_greedy(pm, prompt), name
        with torch.no_grad():  # the base is untouched beside them
            ref = lora_setup["base"](torch.tensor([PROMPTS[0]])).logits[0]
        assert (_logits(llm, PROMPTS[0], None) - ref).abs().max() < 1e-4
        infos = {a.name: a for a in llm.engine.adapters()}
        assert {n: infos[n].rank for n in infos} == {"a1": 4, "a2": 16, "a3": 8}


def test_a_batch_mixing_adapters_and_the_base_gives_each_request_its_solo_tokens(lora_setup):
    names = [None, "a1", "a2", "a3", "a2", None, "a1"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    with _llm(lora_setup, scheduler={"name": "continuous", "max_num_batched_tokens": 24}) as llm:
        solo = [llm.generate([p], _greedy(adapter=n))[0].token_ids for p, n in zip(prompts, names, strict=True)]
        mixed = [o.token_ids for o in llm.generate(prompts, [_greedy(adapter=n) for n in names])]
        assert mixed == solo
        assert len({tuple(t) for t in solo[:4]}) == 4  # each adapter changes the answer
        assert llm.engine.cache.stats().num_used_blocks == 0


def test_exact_decoders_verify_under_the_adapter(lora_setup):
    """ngram drafts are verified by the adapted model: the same greedy tokens as standard."""
    prompt = [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11]
    with _llm(lora_setup) as llm:
        for name in ("a1", "a2"):
            want = llm.generate([prompt], _greedy(24, adapter=name))[0].token_ids
            assert llm.generate([prompt], _greedy(24, adapter=name, decoder="ngram"))[0].token_ids == want
            assert want == _peft_greedy(lora_setup["peft"][name], prompt, 24)


def test_a_draft_model_decoder_steps_aside_for_adapter_requests(lora_setup):
    with _llm(lora_setup, names=("a1",), decoder={"name": "speculative"}) as llm:
        out = llm.generate([PROMPTS[0]], _greedy(adapter="a1"))[0]
        assert out.token_ids == _peft_greedy(lora_setup["peft"]["a1"], PROMPTS[0])
        with pytest.raises(ClientError) as err:
            llm.generate([PROMPTS[0]], _greedy(adapter="a1", decoder="speculative"))
        assert err.value.param == "decoder"


def test_the_prefix_cache_never_shares_blocks_across_adapters(lora_setup):
    prompt = list(range(40, 90))  # three full blocks of 16
    with _llm(lora_setup, names=("a1", "a2")) as llm:
        def cached(adapter):
            return llm.generate([prompt], _greedy(2, adapter=adapter))[0].usage.cached_tokens

        assert cached("a1") == 0
        assert cached("a2") == 0
        assert cached(None) == 0
        assert cached("a1") == 48  # the same adapter again: its own blocks
        assert cached(None) == 48


def test_unknown_adapters_and_bad_requests_are_refused_naming_them(lora_setup):
    with _llm(lora_setup, names=("a1",)) as llm:
        with pytest.raises(NotFound) as err:
            llm.generate([PROMPTS[0]], _greedy(adapter="nope"))
        assert err.value.param == "adapter" and "nope" in str(err.value)
        with pytest.raises(ClientError) as err:
            llm.generate([PROMPTS[0]], _greedy(adapter=""))
        assert err.value.param == "adapter"
    with pytest.raises(ConfigError, match="no adapters"):
        with LLM(**tiny_engine_kwargs(lora_setup["base_dir"])) as llm:
            llm.engine.call_in_step_thread(llm.engine.executor.load_adapter, "x", lora_setup["paths"]["a1"])


def _edit_adapter(src, dst, config_edit=None, tensor_edit=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    if config_edit:
        cfg.update(config_edit)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_adapters_the_engine_cannot_serve_are_refused_at_load_naming_why(lora_setup, tmp_path):
    from pathlib import Path

    src = Path(lora_setup["paths"]["a1"])
    a2 = Path(lora_setup["paths"]["a2"])
    cases = {
        "rank 16, above max_lora_rank 8": (str(a2), {"max_lora_rank": 8}),
        "use_dora": (_edit_adapter(src, tmp_path / "dora", {"use_dora": True}), {}),
        "lm_head": (_edit_adapter(src, tmp_path / "head", tensor_edit=lambda t: t.update({
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(260, 4)})), {}),
        "another base model": (_edit_adapter(src, tmp_path / "shape", tensor_edit=lambda t: t.update({
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 96)})), {}),
        "no adapter_config.json": (str(tmp_path), {}),
        "above max_lora_memory_mb 0": (str(src), {"max_lora_memory_mb": 0}),
    }
    for why, (path, options) in cases.items():
        with pytest.raises(ConfigError, match=why.split(",")[0].replace("(", r"\(")):
            LLM(**tiny_engine_kwargs(lora_setup["base_dir"], adapter={"name": "lora", "modules": {"x": path},
                                                                      **options})).close()


def test_loading_and_unloading_while_requests_run_loses_nothing(lora_setup):
    from tokenloom.core.outputs import Finished

    with LLM(**tiny_engine_kwargs(
            lora_setup["base_dir"], adapter={"name": "lora", "modules": {"a1": lora_setup["paths"]["a1"]},
                                             "max_lora_rank": 16, "max_loras": 2})) as llm:
        engine = llm.engine

        async def finished(adapter, n):
            last = None
            async for out in engine.generate(PROMPTS[0], _greedy(n, adapter=adapter)):
                last = out
            assert isinstance(last, Finished)
            return last

        async def run():
            long_a1 = asyncio.create_task(finished("a1", 1000))
            await asyncio.sleep(0.05)
            await engine.load_adapter("a2", lora_setup["paths"]["a2"])  # while a1 streams
            unload = asyncio.create_task(engine.unload_adapter("a1"))  # waits for the running a1 request
            await asyncio.sleep(0.05)
            assert not unload.done()
            with pytest.raises(NotFound):  # new requests for it are refused at once
                await finished("a1", 4)
            a2 = await finished("a2", 16)
            assert a2.token_ids == _peft_greedy(lora_setup["peft"]["a2"], PROMPTS[0])
            done = await long_a1
            assert done.finish_reason == "length" and len(done.token_ids) == 1000
            await unload
            assert [a.name for a in engine.adapters()] == ["a2"]
            with pytest.raises(NotFound):
                await engine.unload_adapter("a1")
            await engine.load_adapter("a3", lora_setup["paths"]["a3"])
            await engine.load_adapter("a1", lora_setup["paths"]["a1"])  # a third, past max_loras 2: LRU evicts
            assert sum(a.resident for a in engine.adapters()) == 2
            for name in ("a1", "a2", "a3"):  # an evicted one is read again when asked for
                got = await finished(name, 16)
                assert got.token_ids == _peft_greedy(lora_setup["peft"][name], PROMPTS[0]), name
            assert sum(a.resident for a in engine.adapters()) <= 2

        llm.run(run())
        assert engine.cache.stats().num_used_blocks == 0


def test_merged_single_adapter_gives_the_same_tokens(lora_setup):
    prompt = PROMPTS[2]
    want = _peft_greedy(lora_setup["peft"]["a2"], prompt)
    with LLM(**tiny_engine_kwargs(lora_setup["base_dir"], adapter={
            "name": "lora", "modules": {"a2": lora_setup["paths"]["a2"]}, "merge": True})) as llm:
        assert llm.generate([prompt], _greedy(adapter="a2"))[0].token_ids == want
        assert [a.name for a in llm.engine.adapters()] == ["a2"]
        assert not llm.engine.runner.adapters.begin_step([("a2", 0, 4)], 4)  # nothing per step


def test_the_lora_table_and_flags_select_the_role(lora_setup):
    import argparse

    from tokenloom.cli.args import add_engine_args, flags_layer
    from tokenloom.core.config import build_config, load_toml
    from tokenloom.core.plugins import PluginManager

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--lora", f"a1={lora_setup['paths']['a1']}", "--lora", "b=/x", "--max-loras", "3"])
    cfg = build_config(PluginManager(), flags_layer(args))
    assert cfg.adapter.name == "lora" and cfg.adapter.options.modules == {"a1": lora_setup["paths"]["a1"], "b": "/x"}
    assert cfg.adapter.options.max_loras == 3
    toml = lora_setup["root"] / "c.toml"
    toml.write_text('[lora]\nmax_lora_rank = 32\nmodules = { a1 = "/y" }\n')
    cfg = build_config(PluginManager(), load_toml(toml))
    assert (cfg.adapter.name, cfg.adapter.options.max_lora_rank, cfg.adapter.options.modules) == ("lora", 32, {"a1": "/y"})


@pytest.mark.parametrize("quantizer", ["gguf", "none"])
def test_over_a_gguf_4bit_base_adapters_stay_within_the_quantizers_tolerance(lora_setup, tmp_path, quantizer):
    """A Q4_0 GGUF of the base, each adapter against PEFT on the dequantised base in
    transformers. Dequantised at load (``none``): the base within 1e-4, an adapter 5e-4. Kept 4-bit (``gguf``: the int4
    kernel computes with bf16 activations): the base alone is within 0.5% of the logits'
    range, an adapter within 4% (a2, rsLoRA at scale 8, amplifies the rounding most: 2.7%),
    with the same greedy ids wherever the reference's top two logits are further apart."""
    gguf_mod = pytest.importorskip("gguf")
    from test_gguf import write_gguf
    from transformers import LlamaForCausalLM

    path = tmp_path / "base-q4_0.gguf"
    expected = write_gguf(path, lora_setup["base"], gguf_mod.GGMLQuantizationType.Q4_0)
    deq = LlamaForCausalLM.from_pretrained(lora_setup["base_dir"], torch_dtype=torch.float32).eval()
    deq.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    modules = {n: lora_setup["paths"][n] for n in ADAPTERS}
    with LLM(**tiny_engine_kwargs(path, adapter={"name": "lora", "modules": modules, "max_lora_rank": 16},
                                  quantizer={"name": quantizer})) as llm:
        assert ("int4" in llm.engine.runner.model.linear_layers()[0]["qkv"].kernel) == (quantizer == "gguf")
        prompt = PROMPTS[2]
        with torch.no_grad():
            ref = deq(torch.tensor([prompt])).logits[0]
        base_tol = 0.005 * ref.abs().max() if quantizer == "gguf" else 1e-4
        assert (_logits(llm, prompt, None) - ref).abs().max() <= base_tol
        for name in ADAPTERS:
            ref_model = _peft_on(deq, lora_setup["paths"][name])
            with torch.no_grad():
                ref = ref_model(torch.tensor([prompt])).logits[0]
            got = _logits(llm, prompt, name)
            tol = 0.04 * ref.abs().max() if quantizer == "gguf" else 5e-4  # (see the test above)
            assert (got - ref).abs().max() <= tol, name
            top2 = ref.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
            assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), name
            ref_model.unload()


def _peft_on(model, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).eval()


def test_two_gloo_ranks_split_the_adapters_as_their_base(lora_setup):
    names = ["a1", None, "a2", "a3"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = {}
    for tp in (1, 2):
        with _llm(lora_setup, tensor_parallel_size=tp) as llm:
            assert llm.engine.executor.world_size == tp
            outs[tp] = [o.token_ids for o in llm.generate(prompts, [_greedy(adapter=n) for n in names])]
            if tp == 2:
                info = llm.run(llm.engine.load_adapter("late", lora_setup["paths"]["a1"]))  # on both ranks
                assert info.name == "late"
                late = llm.generate([PROMPTS[0]], _greedy(adapter="late"))[0].token_ids
                assert late == outs[2][0]
    assert outs[1] == outs[2]
    assert outs[1][0] == _peft_greedy(lora_setup["peft"]["a1"], prompts[0])


def test_a_request_for_one_adapter_more_than_max_loras_in_use_waits_its_turn(lora_setup):
    """A step mixes at most max_loras adapters: while that many are in use by live requests, a
    request naming another is refused as busy (503-like, retry later), never failing the step."""
    from tokenloom.core.errors import AdaptersBusy

    with LLM(**tiny_engine_kwargs(lora_setup["base_dir"], adapter={
            "name": "lora", "modules": {n: lora_setup["paths"][n] for n in ADAPTERS}, "max_lora_rank": 16,
            "max_loras": 2})) as llm:
        engine = llm.engine

        async def run():
            running = [engine.submit(PROMPTS[0], _greedy(600, adapter=n)) for n in ("a1", "a2")]
            more_a1 = engine.submit(PROMPTS[1], _greedy(4, adapter="a1"))  # an adapter already in use: fine
            with pytest.raises(AdaptersBusy) as err:
                engine.submit(PROMPTS[0], _greedy(4, adapter="a3"))
            assert "max_loras = 2" in str(err.value) and err.value.retry_after_ms
            finals = []
            for req in [*running, more_a1]:
                async for out in engine.stream(req):
                    last = out
                finals.append(last)
            assert [f.finish_reason for f in finals] == ["length"] * 3
            async for out in engine.generate(PROMPTS[0], _greedy(8, adapter="a3")):  # their turn is over
                last = out
            assert last.token_ids == _peft_greedy(lora_setup["peft"]["a3"], PROMPTS[0], 8)

        llm.run(run())


def test_bench_lora_runs_on_the_tiny_model(lora_setup):
    import argparse

    from tokenloom.bench.lora import format_lora, run_lora
    from tokenloom.core.plugins import PluginManager

    args = argparse.Namespace(adapters=4, rank=4, targets="all", batch_size=8, prompt_len=8, steps=2, rounds=1,
                              config=None)
    report = run_lora(args, tiny_engine_kwargs(lora_setup["base_dir"]), PluginManager())
    assert [r["adapters"] for r in report["results"]] == [0, 1, 4]
    assert all(r["ms_per_step"] > 0 for r in report["results"]) and report["results"][0]["vs_base"] == 1.0
    assert "| 4 adapters |" in format_lora(report)
