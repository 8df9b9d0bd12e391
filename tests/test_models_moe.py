"""Mixtral and Qwen3-MoE (plugins/models/moe.py) against transformers' own classes, on tiny
random models saved with ``save_pretrained``: the prefill logits, greedy tokens alone and in
a batch of mixed lengths, both checkpoint layouts (per expert, and transformers 5's fused
3-D tensors), experts split over two gloo ranks, a quantizer on the experts, and the
planner's count of the experts' weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tokenloom import SamplingParams
from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.parallel import TensorParallel

from conftest import TINY_VOCAB, _byte_tokenizer, tiny_engine_kwargs

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=257, eos_token_id=256)
#: name -> (transformers class names, config, save_original_format)
MODELS = {
    # 4 experts top-2 (always renormalised), 4 query heads on 1 KV head, odd FFN
    "mixtral": ("Mixtral", dict(intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2), True),
    "mixtral-fused": ("Mixtral", dict(intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2), False),
    # 5 experts top-2 (not renormalised), 3 heads of 16 on 1 KV head, layer 1 dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3Moe", dict(intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=16, num_experts=5,
                                   num_experts_per_tok=2, mlp_only_layers=[1]), True),
    # renormalised top-3, 2 KV heads (two ranks), 5 experts (3 + 2 per rank), layer 0 dense
    "qwen3-moe-tp": ("Qwen3Moe", dict(intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=5,
                                      num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0]), True),
}


def _make(name: str, path):
    import transformers

    family, cfg_kw, original = MODELS[name]
    torch.manual_seed(7)
    cfg = getattr(transformers, f"{family}Config")(**COMMON, **cfg_kw)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # experts that matter and decisive routing: a wrong expert shows in the logits
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.mul_(6.0)
            elif n.endswith("mlp.gate.weight"):
                p.mul_(10.0)
        model.lm_head.weight.mul_(8.0)  # sharper logits: greedy near-ties are rare
    model.save_pretrained(path, save_original_format=original)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """``tiny_moe(name)`` -> (checkpoint directory, the transformers model), made once."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = (path, _make(name, path))
        return made[name]

    return get


@pytest.fixture
def llm_of():
    from tokenloom import LLM

    built = []

    def factory(path, **kw):
        llm = LLM(**tiny_engine_kwargs(path, num_kv_blocks=64, **kw))
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        llm.close()


# ---- config ---------------------------------------------------------------------------------
def test_configs_read_the_experts():
    base = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    mix = ModelConfig.from_hf({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                               "num_experts_per_tok": 2, "sliding_window": None})
    assert mix.architecture == "mixtral" and mix.moe is not None
    assert (mix.moe.num_experts, mix.moe.top_k, mix.moe.intermediate_size, mix.moe.norm_topk_prob) == (8, 2, 128, True)
    # an old config.json without `architectures`: its model_type
    assert ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 8,
                                "num_experts_per_tok": 2}).architecture == "mixtral"
    qwen = {**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg = ModelConfig.from_hf(qwen)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.norm_topk_prob) == (16, 4, 32, False)
    assert cfg.moe.dense_layers == (0, 2, 3)  # (i + 1) % 2 != 0, and layer 3 named
    # transformers 5 writes num_experts as num_local_experts
    written = {k: v for k, v in qwen.items() if k != "num_experts"} | {"num_local_experts": 16}
    assert ModelConfig.from_hf(written).moe == cfg.moe


@pytest.mark.parametrize("extra, match", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "shared_expert_intermediate_size": 64}, "shared_expert"),
    ({"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 5}, "num_experts_per_tok 5"),
])
def test_what_the_block_does_not_do_is_refused(extra, match):
    raw = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, **extra}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


def test_more_ranks_than_experts_is_refused():
    from tokenloom.plugins.models.moe import Mixtral

    assert [list(TensorParallel(r, 2).experts(5)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    cfg = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "vocab_size": 300, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
                               "num_key_value_heads": 8, "num_local_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ConfigError, match="tensor_parallel_size 5 exceeds the model's 4 experts"):
        Mixtral().build(cfg, torch.float32, SimpleNamespace(batch_invariant=False), 64, TensorParallel(0, 5))


# ---- against transformers -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "mixtral-fused", "qwen3-moe"])
def test_prefill_logits_match_transformers(name, tiny_moe, llm_of):
    path, hf = tiny_moe(name)
    llm = llm_of(path)
    blocks = [layer.mlp for layer in llm.engine.runner.model.decoder_layers if hasattr(layer.mlp, "router")]
    for block in blocks:
        block.gate_up = [_Spy(w) for w in block.gate_up]
    ids = list(range(3, 60, 2)) + [200, 17, 5]
    ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative diff {rel:.2e}"
    # tokens grouped by expert: each expert ran once, on its rows; and the routing is not
    # trivial: every expert of every MoE layer got some of these tokens
    assert len(blocks) == 2  # (Qwen3-MoE's layer 1 is dense)
    for block in blocks:
        assert [s.calls for s in block.gate_up] == [1] * block.moe.num_experts
        assert sum(s.rows for s in block.gate_up) == len(ids) * block.moe.top_k


class _Spy:
    """Stands in for an expert's gate_up: counts its calls and rows."""

    def __init__(self, inner):
        self.inner, self.calls, self.rows = inner, 0, 0

    def apply(self, x):
        self.calls += 1
        self.rows += x.shape[0]
        return self.inner.apply(x)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_greedy_tokens_match_transformers_alone_and_batched(name, tiny_moe, llm_of):
    path, hf = tiny_moe(name)
    llm = llm_of(path)
    prompts = [[5, 9, 100, 42, 7], list(range(40, 90)), list(b"mixture of experts"), [11]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == alone
    for prompt, out in zip(prompts, batched, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_the_model_kit_passes(name, tiny_moe):
    """tokenloom.testing.check_model: logits, batching, chunked prefill behind a cached prefix."""
    from tokenloom.testing import check_model

    path, hf = tiny_moe(name)
    report = check_model(path, reference=lambda ids: hf(torch.tensor([ids])).logits[0])
    assert report["max_rel_logit_diff"] < 1e-4


# ---- tensor parallelism ---------------------------------------------------------------------
def test_two_gloo_ranks_give_one_ranks_greedy_tokens(tiny_moe):
    """Experts split 3 + 2 over two ranks (each whole), the dense layer split by FFN columns."""
    from tokenloom import LLM

    path, _ = tiny_moe("qwen3-moe-tp")
    prompts = ["hello world, hello world, hello", "the quick brown fox " * 4, "abc"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(**tiny_engine_kwargs(path, num_kv_blocks=64, tensor_parallel_size=tp))
        try:
            assert llm.engine.executor.world_size == tp
            outs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outs[1] == outs[2]


# ---- quantizers and accounting --------------------------------------------------------------
@pytest.mark.parametrize("quantizer", ["int8", "rtn"])
def test_a_quantizer_packs_every_expert(quantizer, tiny_moe, llm_of):
    from tokenloom.backends.torch_linear import _QuantisedLinear

    path, _ = tiny_moe("qwen3-moe")
    ids = list(b"quantised experts route the same")
    dense = llm_of(path).engine.runner.prefill_logits(ids, block_table=[0, 1, 2])
    llm = llm_of(path, quantizer={"name": quantizer})
    model = llm.engine.runner.model
    experts = [w for layer in model.linear_layers() for slot, w in layer.items() if slot.startswith("experts.")]
    assert len(experts) == 2 * 2 * 5  # two MoE layers of 5 experts, gate_up and down each
    # each expert went through the quantizer: its kernel, or its weight dequantised where the
    # 4-bit kernel does not take the shape (48 columns: no 4-bit group size divides them)
    assert all(isinstance(w, _QuantisedLinear) or w.kernel.startswith("dequantised") for w in experts)
    assert quantizer != "int8" or all(isinstance(w, _QuantisedLinear) for w in experts)
    ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2])
    assert torch.isfinite(ours).all()
    if quantizer == "int8":  # (4-bit on these 48-column random experts is too coarse to compare)
        # close where the routing stays; a token whose top-k flips on a near-tie moves further
        rel = (ours - dense).abs().amax(-1) / dense.abs().max()
        assert (rel < 0.05).float().mean() >= 0.9, rel
        assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_planner_counts_every_expert_and_a_step_reads_top_k(name, tiny_moe, llm_of):
    from tokenloom.planner.weights import FORMATS, num_params, weight_bytes

    path, hf = tiny_moe(name)
    llm = llm_of(path)
    model = llm.engine.runner.model
    cfg = model.cfg
    assert num_params(cfg) == sum(p.numel() for p in hf.parameters())
    # float32: the planner's bytes are what the engine holds (one layout of each matmul)
    held = model.embed.numel() * 4 + model.lm_head.nbytes() + model.norm.numel() * 4
    for layer, linears in zip(model.decoder_layers, model.linear_layers(), strict=True):
        held += sum(w.nbytes() for w in linears.values())
        held += sum(p.numel() * 4 for p in layer.parameters())  # norms and routers
    assert weight_bytes(cfg, FORMATS["fp32"], 4) == held
    # a decode step reads the router and top_k of the experts, not all of them
    for layer in model.decoder_layers:
        block = layer.mlp
        if hasattr(block, "router"):
            experts = sum(w.nbytes() for w in block.linears().values())
            assert block.bytes_per_token() == block.router.numel() * 4 + experts * cfg.moe.top_k // cfg.moe.num_experts
