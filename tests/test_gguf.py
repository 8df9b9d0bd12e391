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
