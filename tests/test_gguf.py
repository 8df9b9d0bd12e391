"""GGUF loading: names, llama.cpp's Q/K permutation and every supported tensor type,
checked against HF transformers on the same tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CHAT_TEMPLATE, EOS_ID, _byte_tokenizer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from tokenloom.core.loader.gguf_file import load_gguf, unpermute_qk  # noqa: E402
from tokenloom.core.weights import dense_tensor  # noqa: E402

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script: reorder Q/K rows for interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, qtype) -> dict[str, np.ndarray]:
    """Write ``hf_model`` as llama.cpp would; return the dequantised tensors we expect back."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(50000.0)  # make_tiny_llama's theta
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tok = _byte_tokenizer()
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i >= 256 else 1 for _, i in vocab])
    w.add_bos_token_id(257)
    w.add_eos_token_id(EOS_ID)
    w.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for name, t in hf_model.state_dict().items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.weight"
        if ".attn_q." in gname:
            arr = _permute(arr, cfg.num_attention_heads)
        elif ".attn_k." in gname:
            arr = _permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, arr.astype(np.float32))
            back = arr
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
            back = arr.astype(np.float16).astype(np.float32)
        else:
            qa = quantize(arr, qtype)
            w.add_tensor(gname, qa, raw_dtype=qtype)
            back = dequantize(qa, qtype).reshape(arr.shape)
        if ".attn_q." in gname:
            back = unpermute_qk(back, cfg.num_attention_heads)
        elif ".attn_k." in gname:
            back = unpermute_qk(back, cfg.num_key_value_heads)
        expected[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_f32_gguf_gives_transformers_logits(tmp_path, tiny_hf_model):
    from tokenloom import LLM

    path = tmp_path / "tiny-f32.gguf"
    write_gguf(path, tiny_hf_model, Q.F32)
    with LLM(model=str(path), dtype="float32", num_kv_blocks=16) as llm:
        assert llm.engine.tokenizer.eos_token_ids == {EOS_ID}
        ids = [5, 77, 3, 200, 14, 9, 9, 120]
        ours = llm.engine.runner.prefill_logits(ids, [0])
        with torch.no_grad():
            theirs = tiny_hf_model(torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max() < 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantised_tensors_dequantise_exactly(tmp_path, tiny_hf_model, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_gguf(path, tiny_hf_model, qtype)
    ckpt = load_gguf(path, torch.float32)
    assert set(ckpt.weights) == set(expected)
    for name, ref in expected.items():
        got = dense_tensor(ckpt.weights[name]).numpy()  # raw Q4_0/Q4_1/Q8_0 decoded by tokenloom itself
        assert got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=name)
    # and the quantisation error itself is what the type promises
    w = tiny_hf_model.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    err = np.abs(dense_tensor(ckpt.weights["model.layers.0.mlp.up_proj.weight"]).numpy() - w).max() / np.abs(w).max()
    assert err < {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.15}[qtype]


def test_unpermute_inverts_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    assert np.array_equal(unpermute_qk(_permute(w, 3), 3), w)
    assert not np.array_equal(_permute(w, 3), w)


def _every_kind_of_gguf(path, endianess=None) -> None:
    """A GGUF with a value of each key/value type (nested arrays included) and tensors of
    element and block types, 1-D to 3-D."""
    from gguf import GGUFEndian, GGUFValueType

    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess or GGUFEndian.LITTLE)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Ünïcödé 日本語 🙂")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3.0e-8])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ß c"])
    w.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3, 5)).astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (Q.Q4_1, Q.Q8_0):
        data = rng.standard_normal((4, 256)).astype(np.float32)
        w.add_tensor(qtype.name, quantize(data, qtype), raw_dtype=qtype)
    w.add_tensor("q4_k", rng.integers(0, 256, (4, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)  # raw blocks
    w.add_tensor("experts", quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endianess", ["little", "big"])
def test_our_reader_gives_the_packages_values_and_tensors(tmp_path, endianess):
    from gguf import GGUFEndian, GGUFReader

    from tokenloom.core.loader.gguf_reader import GGUFFile

    path = tmp_path / "kinds.gguf"
    _every_kind_of_gguf(path, GGUFEndian.BIG if endianess == "big" else GGUFEndian.LITTLE)
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    nested = expected.pop("t.nested")  # the package flattens an array of arrays; we keep its shape
    assert ours.metadata.pop("t.nested") == [[1, 2], [3]] and nested == [1, 2, 3]
    assert ours.metadata == expected
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.str"] == "Ünïcödé 日本語 🙂"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, tuple(int(x) for x in b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        np.testing.assert_array_equal(a.data, b.data)


def test_our_reader_reads_the_embedded_model_as_the_package_does():
    from gguf import GGUFReader

    from tokenloom.core.loader.gguf_reader import GGUFFile
    from tokenloom.core.loader.resolve import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(x) for x in b.shape))
        np.testing.assert_array_equal(a.data, b.data)


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    from tokenloom.core.loader.gguf_reader import GGUFFile

    path = tmp_path / "kinds.gguf"
    _every_kind_of_gguf(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ValueError, match="cut.gguf.*runs past the end"):
        GGUFFile(cut)
    cut.write_bytes(whole[:200])
    with pytest.raises(ValueError, match="cut.gguf: the header runs past the end"):
        GGUFFile(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="other.gguf: not a GGUF file"):
        GGUFFile(other)
