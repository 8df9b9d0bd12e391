"""Every dense family from GGUF, as llama.cpp's converter writes it, against transformers.

For each family the tiny random model of tests/test_models_dense.py is saved as an HF
directory and written to GGUF here the way llama.cpp's ``convert_hf_to_gguf.py`` does it
(its tensor names through gguf-py's own name map, its metadata keys per family, its
transformations: LLaMA's q/k row permutation, Gemma's norms stored as ``1 + w`` and its
``lm_head`` dropped, Phi-3's fused ``attn_qkv`` / ``ffn_up``, Llama 3's ``rope_freqs``
table in place of its rope parameters), then served from the file: prefill logits match
transformers to 1e-4 relative and the greedy ids for 32 tokens are the same, for a batch of
three prompts. What a GGUF cannot carry is set in the model so that the file is complete
(``GGUF_OVERRIDES``). Where ``make peers`` has fetched llama.cpp, its converter writes the
files too (``--outtype f32``): they serve the same ids (``test_llama_cpp_converter``) and
are, key for key and tensor for tensor, what this file's writer writes
(``test_writer_writes_what_the_converter_writes``); elsewhere those tests skip, saying why.
Below them, llama.cpp's rules for what a file leaves out (Gemma's query scale and layer
pattern, the window default) and the RoPE tables, read from metadata alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from test_models_dense import COMMON, FAMILIES, PROMPTS, hf_greedy, make_family_model

from tokenloom import LLM, SamplingParams

from conftest import CHAT_TEMPLATE, EOS_ID, _byte_tokenizer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from tokenloom.core.errors import ConfigError  # noqa: E402
from tokenloom.core.models.registry import default_registry  # noqa: E402

#: what each family's GGUF cannot carry, set in the tiny model so that the file says it all
GGUF_OVERRIDES: dict[str, dict] = {
    # Gemma 2: the converter stores no query scale; llama.cpp (and so this engine) scales by
    # head_dim, by hidden / heads for the 27B only
    "gemma2": {"query_pre_attn_scalar": 32},
    # Gemma 3: nor the layer pattern; llama.cpp's is every 6th layer global: six layers show both kinds
    # (and hidden 96 for 3 heads: transformers 5.24's Gemma3TextConfig wants hidden a multiple of the heads)
    "gemma3": {"num_hidden_layers": 6, "layer_types": None, "hidden_size": 96},
}
#: the converter writes Mistral as `llama` without its window; this writer adds
#: `llama.attention.sliding_window` (what the engine honours where a file has it)
WINDOW_KEY = {"mistral"}
#: HF architecture -> (GGUF architecture, gguf-py MODEL_ARCH name)
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
        "Phi3ForCausalLM": "phi3"}
CONVERTER = Path(__file__).resolve().parents[1] / ".peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp"


def make_model(path: Path, family: str, **more):
    """``make_family_model`` with the family's GGUF overrides (and ``more``) applied."""
    config_cls, model_cls, extra = FAMILIES[family]
    over = {**GGUF_OVERRIDES.get(family, {}), **more}
    with mock.patch.dict(COMMON, {k: v for k, v in over.items() if k in COMMON}), \
            mock.patch.dict(FAMILIES, {family: (config_cls, model_cls,
                                                {**extra, **{k: v for k, v in over.items() if k not in COMMON}})}):
        return make_family_model(path, family)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's ``LlamaModel.permute``: q/k rows reordered for llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, dim: int) -> np.ndarray:
    """The converter's ``LlamaModel.generate_extra_tensors``: each frequency's divisor."""
    import math

    base, factor = rope.get("rope_theta", 10000.0), rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(out, dtype=np.float32)


def write_tokenizer(w) -> None:
    """The byte-level BPE as the converter's gpt2 vocabulary (tests/test_gguf.py's fields)."""
    tok = _byte_tokenizer()
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i >= 256 else 1 for _, i in vocab])
    w.add_bos_token_id(257)
    w.add_eos_token_id(EOS_ID)
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(src: Path, out: Path, qtype=Q.F32, *, window_key: bool = False) -> None:
    """Write the HF directory ``src`` to ``out`` as llama.cpp's converter would: the metadata
    of its model class for the architecture, the tensors renamed by gguf-py's name map and
    transformed as that class does. ``qtype``: F32, or Q8_0 for the 2-D tensors it fits."""
    from safetensors.torch import load_file

    hp = json.loads((src / "config.json").read_text())
    arch = ARCH[hp["architectures"][0]]
    n_layers, hidden, heads = hp["num_hidden_layers"], hp["hidden_size"], hp["num_attention_heads"]
    head_dim = hp.get("head_dim") or hidden // heads
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})  # TextModel.__init__
    full = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp.get("num_key_value_heads", heads))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(0 if qtype == Q.F32 else 7)
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters (no TextModel keys)
        original = hp.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
    elif arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no rope keys at all
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    else:  # TextModel.set_gguf_parameters (+ LlamaModel's, Gemma3Model's)
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if hp.get("head_dim") is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch == "llama":
            w.add_vocab_size(hp["vocab_size"])
            w.add_rope_dimension_count(head_dim)
            if window_key and hp.get("sliding_window"):
                w.add_sliding_window(hp["sliding_window"])
        if arch == "gemma3":
            if hp.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            w.add_sliding_window(hp["sliding_window"])
    write_tokenizer(w)

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    tensors = load_file(str(src / "model.safetensors"))
    if arch == "llama" and full.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(full, head_dim))
    for name, t in tensors.items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors
        arr = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1  # Gemma{2,3}Model.modify_tensors: the (1 + w) of Gemma's RMSNorm, stored
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _permute(arr, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _permute(arr, hp.get("num_key_value_heads", heads))
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"gguf-py maps no GGUF name for {name}"
        if qtype == Q.F32 or arr.ndim == 1 or arr.shape[-1] % 32:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model = make_model(path, request.param)
    out = path / f"{request.param}-f32.gguf"
    write_gguf(path, out, window_key=request.param in WINDOW_KEY)
    return request.param, out, model


CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "rope_theta", "max_position_embeddings", "attention_bias", "qk_norm",
                     "sliding_window", "layer_types", "attn_logit_softcap", "final_logit_softcap",
                     "query_pre_attn_scalar", "embedding_multiplier", "sandwich_norms", "hidden_act",
                     "rope_local_theta", "partial_rotary_factor")


def engine(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=128, block_size=8, **kw)


def check_matches_transformers(name: str, path: Path, model, *, hf_dir: Path | None = None) -> None:
    """Prefill logits to 1e-4 relative and batched greedy ids for 32 tokens, as transformers;
    with ``hf_dir``, the engine's configs of the GGUF and of the HF directory agree too."""
    llm = engine(path)
    try:
        ids = PROMPTS[0]
        ours = llm.engine.runner.prefill_logits(ids, block_table=[0, 1, 2, 3])
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < 1e-4, f"{name}: logits differ by {rel:.2e} relative"
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy(model, prompt, 32), name
    finally:
        llm.close()


def test_gguf_gives_transformers_greedy_ids(family):
    name, path, model = family
    check_matches_transformers(name, path, model)


def test_gguf_config_is_the_hf_config(family):
    """What the engine reads from the GGUF is what it reads from the HF directory, but for
    the fields the formats store differently (Gemma's norms carry their + 1 in the file)."""
    from tokenloom.core.loader.gguf_file import read_metadata
    from tokenloom.core.loader.gguf_reader import GGUFFile

    name, path, _ = family
    meta = read_metadata(GGUFFile(path))
    ours = default_registry().for_gguf(meta["general.architecture"]).config_from_gguf(meta)
    hf = default_registry().for_hf(json.loads((path.parent / "config.json").read_text())) \
        .config_from_hf(json.loads((path.parent / "config.json").read_text()))
    skip = {"architecture", "checkpoint_architecture", "tie_word_embeddings", "norm_offset", "rms_norm_eps",
            "rope_scaling"}  # the loader sets tie; eps is float32 in the file; llama3 is solved for (below)
    for field in CONFIG_FIELDS:
        if field not in skip:
            assert getattr(ours, field) == getattr(hf, field), f"{name}: {field}"
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.norm_offset == (0.0 if name.startswith("gemma") else hf.norm_offset)
    if name == "llama3":  # llama3 parameters that give the converter's table: the same frequencies
        from tokenloom.plugins.models.rope import inv_freq

        assert ours.rope_scaling.kind == "llama3"
        ref, _ = inv_freq(hf, hf.rope_theta, hf.rope_scaling, 512)
        got, _ = inv_freq(ours, ours.rope_theta, ours.rope_scaling, 512)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    else:
        assert ours.rope_scaling == hf.rope_scaling


def test_q8_0_gguf_runs(tmp_path):
    """Phi-3 in Q8_0 (its fused q/k/v and gate/up kept as raw blocks): loads and answers; the
    prefill logits stay within Q8_0's error of transformers'."""
    model = make_model(tmp_path, "phi3")
    path = tmp_path / "phi3-q8_0.gguf"
    write_gguf(tmp_path, path, Q.Q8_0)
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


# ---- what the file does not say: llama.cpp's rules, read the same way --------------------------

def _meta(arch: str, **keys) -> dict:
    base = {"block_count": 2, "context_length": 4096, "embedding_length": 256, "feed_forward_length": 512,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    meta = {f"{arch}.{k}": v for k, v in {**base, **keys}.items()}
    return {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 100, **meta}


def _config(meta: dict):
    return default_registry().for_gguf(meta["general.architecture"]).config_from_gguf(meta)


def test_gemma_rules_where_the_file_is_silent():
    # Gemma 2: window 4096 where none is given, even layers local, the 27B's query scale hidden / heads
    cfg = _config(_meta("gemma2", **{"attention.key_length": 128}))
    assert cfg.sliding_window == 4096 and cfg.layer_types == ("sliding", "full")
    assert cfg.query_pre_attn_scalar == 128 and cfg.norm_offset == 0.0 and cfg.embedding_multiplier == 16.0
    big = _config(_meta("gemma2", block_count=46, **{"attention.key_length": 128}))
    assert big.query_pre_attn_scalar == 256 / 4
    # Gemma 3: every 6th layer global, the local base 10000 unless given; no window key: no local layers
    cfg = _config(_meta("gemma3", block_count=12, **{"attention.sliding_window": 512, "rope.freq_base": 1e6}))
    assert cfg.layer_types == ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.qk_norm
    assert _config(_meta("gemma3")).sliding_window is None
    # a pattern in the file wins: flags per layer, or every n-th global
    flags = _config(_meta("gemma3", **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [0, 1]}))
    assert flags.layer_types == ("full", "sliding")
    every = _config(_meta("gemma2", block_count=3, **{"attention.sliding_window_pattern": 3}))
    assert every.layer_types == ("sliding", "sliding", "full")


def test_llama_window_and_rope_keys():
    cfg = _config(_meta("llama", **{"attention.sliding_window": 1024}))
    assert cfg.sliding_window == 1024 and cfg.window(0) == cfg.window(1) == 1024
    assert _config(_meta("llama", **{"attention.sliding_window": 4096})).sliding_window is None  # never applies
    linear = _config(_meta("llama", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}))
    assert (linear.rope_scaling.kind, linear.rope_scaling.factor) == ("linear", 4.0)
    yarn = _config(_meta("qwen3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                     "rope.scaling.original_context_length": 1024}))
    assert (yarn.rope_scaling.kind, yarn.rope_scaling.factor, yarn.rope_scaling.original_max_position_embeddings) \
        == ("yarn", 4.0, 1024)
    with pytest.raises(ConfigError, match="expert_count"):
        _config(_meta("llama", expert_count=8))


def test_llama3_parameters_come_back_from_rope_freqs():
    """Llama 3.1's own setting (factor 8, 1 and 4 over 8192) from the converter's table."""
    rope = {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    meta = _meta("llama", **{"attention.key_length": 128, "embedding_length": 512, "rope.freq_base": 500000.0})
    meta["tensor.rope_freqs"] = tuple(float(v) for v in _llama3_rope_freqs(rope, 128))
    s = _config(meta).rope_scaling
    assert s.kind == "llama3" and s.original_max_position_embeddings == 8192 and s.factor == 8.0
    assert s.low_freq_factor == pytest.approx(1.0, rel=1e-4) and s.high_freq_factor == pytest.approx(4.0, rel=1e-4)


def test_phi3_longrope_tables_and_partial_rotary():
    meta = _meta("phi3", **{"rope.dimension_count": 32, "context_length": 131072,
                            "rope.scaling.original_context_length": 4096, "rope.scaling.attn_factor": 1.19})
    meta["tensor.rope_factors_long"] = tuple(1.0 + i for i in range(16))
    meta["tensor.rope_factors_short"] = (1.0,) * 16
    cfg = _config(meta)
    assert cfg.head_dim == 64 and cfg.partial_rotary_factor == 0.5 and cfg.rotary_dim == 32
    s = cfg.rope_scaling
    assert (s.kind, s.original_max_position_embeddings, s.factor, s.attention_factor) == ("longrope", 4096, 32.0, 1.19)
    assert s.long_factor == tuple(1.0 + i for i in range(16)) and s.short_factor == (1.0,) * 16
    names = [default_registry().get("phi3").gguf_tensor_name(n, cfg) for n in
             ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "rope_factors_long.weight")]
    assert names == ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", None]


# ---- llama.cpp's own converter -------------------------------------------------------------------

DRIVER = r'''
"""convert_hf_to_gguf.py over (src, out) pairs in one process, vocabularies written as gpt2
BPE: the tiny models' byte-level tokenizer is none the converter recognises, and the
vocabulary is not what is tested. Tensors and metadata go through the converter untouched."""
import runpy, sys, types
root, pairs = sys.argv[1], sys.argv[2:]
sys.path[:0] = [root + "/gguf-py", root]
from conversion.base import TextModel

prepare = TextModel.prepare_metadata


def prepare_metadata(self, vocab_only):
    self.set_vocab = types.MethodType(lambda self: self._set_vocab_gpt2(), self)
    prepare(self, vocab_only)


TextModel.prepare_metadata = prepare_metadata
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt2"
main = runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="convert")["main"]
for src, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", "f32", "--outfile", out]
    main()
'''


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every family through llama.cpp's converter (``--outtype f32``): {family: (gguf, model)}."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER} (`make peers` fetches it)")
    root = tmp_path_factory.mktemp("converted")
    models, args = {}, []
    for name in sorted(FAMILIES):
        src = root / name
        src.mkdir()
        # the converter drops Mistral's window (LlamaModel writes none): a Mistral without one
        models[name] = make_model(src, name, **({"sliding_window": None} if name == "mistral" else {}))
        # the converter reads the vocabulary with AutoTokenizer: the plain tokenizer.json, not the
        # family's tokenizer class (Gemma's adds tokens of its own)
        config = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
        args += [str(src), str(root / f"{name}.gguf")]
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(CONVERTER), *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: (root / f"{name}.gguf", model) for name, model in models.items()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_llama_cpp_converter(converted, name):
    path, model = converted[name]
    check_matches_transformers(name, path, model)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_writer_writes_what_the_converter_writes(converted, name, tmp_path):
    """This file's writer against llama.cpp's converter on the same directory: the same model
    keys with the same values, the same tensors with the same values."""
    from tokenloom.core.loader.gguf_file import read_metadata
    from tokenloom.core.loader.gguf_reader import GGUFFile

    path, _ = converted[name]
    ours = tmp_path / "ours.gguf"
    write_gguf(path.parent / name, ours)
    readers = GGUFFile(path), GGUFFile(ours)
    theirs_meta, ours_meta = (
        {k: v for k, v in read_metadata(r).items() if not k.startswith(("general.", "tokenizer."))} for r in readers)
    assert ours_meta == theirs_meta
    theirs_t, ours_t = ({t.name: np.asarray(t.data) for t in r.tensors} for r in readers)
    assert sorted(ours_t) == sorted(theirs_t)
    for tname, data in theirs_t.items():
        np.testing.assert_array_equal(ours_t[tname], data, err_msg=f"{name}: {tname}")
