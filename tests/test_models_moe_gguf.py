"""Mixtral and Qwen3-MoE from GGUF, as llama.cpp's converter writes them, against transformers.

The tiny random models of tests/test_models_moe.py (per-expert checkpoints) are written to
GGUF here the way ``convert_hf_to_gguf.py`` does it: Mixtral as ``llama`` with
``llama.expert_count`` / ``expert_used_count`` and its q/k rows permuted (LlamaModel),
Qwen3-MoE as ``qwen3moe`` with ``expert_feed_forward_length`` (Qwen2MoeModel); the router as
``blk.N.ffn_gate_inp`` and each layer's experts stacked into 3-D ``ffn_{gate,up,down}_exps``
tensors ([experts, out, in] in numpy order). Served from the file: prefill logits to 1e-4
relative and the greedy ids for 32 tokens as transformers. llama.cpp runs every Qwen3-MoE
layer sparse with the top-k weights renormalised, so the Qwen3-MoE model here is that one
(``norm_topk_prob``, no dense layers). Where ``make peers`` has fetched llama.cpp, its
converter writes the files too (``test_llama_cpp_converter``); elsewhere that test skips,
saying why. A Q8_0 file keeps each expert's slice of the stacked blocks raw."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import test_models_moe
import torch
from test_models_dense import PROMPTS
from test_models_gguf import (
    CONVERTER,
    DRIVER,
    _permute,
    check_matches_transformers,
    engine,
    write_tokenizer,
)

from tokenloom import SamplingParams

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

#: name -> test_models_moe.MODELS entry (transformers class names, config, save_original_format)
MODELS = {
    "mixtral": test_models_moe.MODELS["mixtral"],
    # llama.cpp's Qwen3-MoE: every layer sparse, top-k renormalised
    "qwen3-moe": ("Qwen3Moe", dict(intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=16, num_experts=5,
                                   num_experts_per_tok=2, norm_topk_prob=True), True),
    # experts 64 wide: gate, up and down all Q8_0 blocks
    "qwen3-moe-q8": ("Qwen3Moe", dict(intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True), True),
}
ARCH = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe"}
#: HF per-expert names -> the stacked GGUF tensor (gguf-py's FFN_*_EXP)
EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def make(name: str, path: Path):
    with mock.patch.dict(test_models_moe.MODELS, {name: MODELS[name]}):
        return test_models_moe._make(name, path)


def write_moe_gguf(src: Path, out: Path, qtype=Q.F32) -> None:
    """The HF directory ``src`` as llama.cpp's converter writes it: TextModel's keys (+
    LlamaModel's vocab size and rope dimension, Qwen2MoeModel's expert width), the experts of
    each layer stacked ([experts, out, in]), other tensors renamed by gguf-py's name map.
    ``qwen`` Q8_0: every tensor whose rows are whole blocks, as the converter quantises."""
    from safetensors.torch import load_file

    hp = json.loads((src / "config.json").read_text())
    arch = ARCH[hp["architectures"][0]]
    n_layers, hidden, heads = hp["num_hidden_layers"], hp["hidden_size"], hp["num_attention_heads"]
    kv_heads = hp.get("num_key_value_heads", heads)
    head_dim = hp.get("head_dim") or hidden // heads
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    n_experts = hp.get("num_local_experts") or hp.get("num_experts")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(0 if qtype == Q.F32 else 7)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    else:  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    write_tokenizer(w)

    def add(gname: str, arr: np.ndarray) -> None:
        if qtype == Q.F32 or arr.ndim == 1 or arr.shape[-1] % 32:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(gname, quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), raw_dtype=qtype)

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, n_layers)
    tensors = load_file(str(src / "model.safetensors"))
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        arr = t.float().numpy()
        parts = name.split(".")
        if ".experts." in name:  # model.layers.N.<block>.experts.E.<part>.weight
            layer, e, part = int(parts[2]), int(parts[5]), parts[6]
            experts.setdefault((layer, part), {})[e] = arr
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, kv_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"gguf-py maps no GGUF name for {name}"
        add(gname, arr)
    for (layer, part), by_expert in sorted(experts.items()):
        assert sorted(by_expert) == list(range(n_experts))
        add(f"blk.{layer}.{EXPERT_PARTS[part]}.weight", np.stack([by_expert[e] for e in range(n_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"moe-gguf-{request.param}")
    model = make(request.param, path)
    out = path / f"{request.param}-f32.gguf"
    write_moe_gguf(path, out)
    return request.param, out, model


def test_gguf_gives_transformers_greedy_ids(family):
    name, path, model = family
    check_matches_transformers(name, path, model)


def test_gguf_config_reads_the_experts(family):
    from tokenloom.core.loader.gguf_file import load_gguf, read_metadata
    from tokenloom.core.loader.gguf_reader import GGUFFile
    from tokenloom.core.models.registry import default_registry

    name, path, _ = family
    hf = json.loads((path.parent / "config.json").read_text())
    meta = read_metadata(GGUFFile(path))
    cfg = default_registry().for_gguf(meta["general.architecture"]).config_from_gguf(meta)
    assert cfg.architecture == ("mixtral" if name == "mixtral" else "qwen3_moe")
    assert cfg.moe is not None and cfg.moe.norm_topk_prob and cfg.moe.dense_layers == ()
    assert cfg.moe.num_experts == (hf.get("num_local_experts") or hf.get("num_experts"))
    assert cfg.moe.top_k == hf["num_experts_per_tok"]
    assert cfg.moe.intermediate_size == hf.get("moe_intermediate_size", hf["intermediate_size"])
    loaded = load_gguf(path, torch.float32)
    assert loaded.architecture.name == cfg.architecture
    block, gate = ("block_sparse_moe", "w1") if name == "mixtral" else ("mlp", "gate_proj")
    w = loaded.weights[f"model.layers.1.{block}.experts.{cfg.moe.num_experts - 1}.{gate}.weight"]
    assert tuple(w.shape) == (cfg.moe.intermediate_size, cfg.hidden_size)


def test_mixtral_gguf_without_used_count_is_refused():
    from tokenloom.core.errors import ConfigError
    from tokenloom.core.models.registry import default_registry

    meta = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a"] * 100,
            **{f"llama.{k}": v for k, v in {"block_count": 2, "context_length": 4096, "embedding_length": 256,
                                             "feed_forward_length": 512, "attention.head_count": 4,
                                             "expert_count": 8}.items()}}
    with pytest.raises(ConfigError, match="expert_used_count"):
        default_registry().for_gguf("llama").config_from_gguf(meta)
    cfg = default_registry().for_gguf("llama").config_from_gguf({**meta, "llama.expert_used_count": 2})
    assert cfg.architecture == "mixtral" and (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) \
        == (8, 2, 512)


def test_q8_0_experts_stay_raw_and_run(tmp_path):
    """Qwen3-MoE in Q8_0: each expert's slice of the stacked blocks is its raw tensor (the
    same values as the whole tensor's dequantised slice); the model loads and answers."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from tokenloom.core.loader.gguf_file import GGUFTensor, load_gguf

    model = make("qwen3-moe-q8", tmp_path)
    path = tmp_path / "qwen3-moe-q8_0.gguf"
    write_moe_gguf(tmp_path, path, Q.Q8_0)
    loaded = load_gguf(path, torch.float32)
    stacked = {t.name: t for t in GGUFReader(str(path)).tensors}
    for gname, part in (("ffn_gate_exps", "gate_proj"), ("ffn_down_exps", "down_proj")):
        t = stacked[f"blk.1.{gname}.weight"]
        assert t.tensor_type == Q.Q8_0
        whole = dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        for e in range(whole.shape[0]):
            w = loaded.weights[f"model.layers.1.mlp.experts.{e}.{part}.weight"]
            assert isinstance(w, GGUFTensor) and w.qtype == "Q8_0"
            np.testing.assert_array_equal(w.dequantize().numpy(), whole[e])
    llm = engine(path)
    try:
        ids = PROMPTS[0]
        ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2, 3])
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]
        assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 0.05
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        assert len(out.token_ids) == 32
    finally:
        llm.close()


# ---- llama.cpp's own converter -------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both families through llama.cpp's converter (``--outtype f32``): {name: (gguf, model)}."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER} (`make peers` fetches it)")
    root = tmp_path_factory.mktemp("moe-converted")
    models, args = {}, []
    for name in ("mixtral", "qwen3-moe"):
        src = root / name
        src.mkdir()
        models[name] = make(name, src)
        config = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
        args += [str(src), str(root / f"{name}.gguf")]
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(CONVERTER), *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: (root / f"{name}.gguf", model) for name, model in models.items()}


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_llama_cpp_converter(converted, name):
    path, model = converted[name]
    check_matches_transformers(name, path, model)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_writer_writes_what_the_converter_writes(converted, name, tmp_path):
    """This file's writer against llama.cpp's converter: the same model keys and tensors."""
    from tokenloom.core.loader.gguf_file import read_metadata
    from tokenloom.core.loader.gguf_reader import GGUFFile

    path, _ = converted[name]
    ours = tmp_path / "ours.gguf"
    write_moe_gguf(path.parent / name, ours)
    readers = GGUFFile(path), GGUFFile(ours)
    theirs_meta, ours_meta = (
        {k: v for k, v in read_metadata(r).items() if not k.startswith(("general.", "tokenizer."))} for r in readers)
    assert ours_meta == theirs_meta
    theirs_t, ours_t = ({t.name: np.asarray(t.data) for t in r.tensors} for r in readers)
    assert sorted(ours_t) == sorted(theirs_t)
    for tname, data in theirs_t.items():
        np.testing.assert_array_equal(ours_t[tname], data, err_msg=f"{name}: {tname}")
