"""A third-party model family through the hook: the example plugin's parallel block,
against a plain-torch forward written here, with the model kit (tokenloom.testing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tokenloom.testing import ConformanceError, check_model

pytest.importorskip("tokenloom_example_plugin")  # installed by `make` (editable, examples/)

CFG = {"architectures": ["ExampleParallelForCausalLM"], "model_type": "example_parallel", "vocab_size": 40,
       "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 3,
       "num_key_value_heads": 1, "head_dim": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
       "max_position_embeddings": 256, "eos_token_id": 39}


def make_checkpoint(path, seed=0) -> dict[str, torch.Tensor]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    g = torch.Generator().manual_seed(seed)
    d, f, hd, V = CFG["hidden_size"], CFG["intermediate_size"], CFG["head_dim"], CFG["vocab_size"]
    q, kv = CFG["num_attention_heads"] * hd, CFG["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d)}
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (q, d),
                       p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (f, d),
                       p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
    sd = {n: (1 + 0.2 * torch.randn(s, generator=g)) if len(s) == 1 else torch.randn(s, generator=g) * s[-1] ** -0.5
          for n, s in shapes.items()}
    sd["lm_head.weight"] *= 4
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CFG))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{V - 1}"}))
    return sd


def reference_forward(sd: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The parallel block in plain torch: h + attention(norm(h)) + mlp(norm(h))."""
    H, KVH, hd, eps = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"], CFG["rms_norm_eps"]
    T = len(ids)
    inv = 1.0 / (CFG["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def rope(x):  # [heads, T, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    h = sd["model.embed_tokens.weight"][ids]
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1))
        k = rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(T, KVH, hd).transpose(0, 1))
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(T, KVH, hd).transpose(0, 1)
        k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H * hd)
        mlp = (F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
        h = h + a @ sd[p + "self_attn.o_proj.weight"].T + mlp
    return norm(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_the_example_family_passes_the_model_kit(tmp_path):
    import tokenloom_example_plugin

    sd = make_checkpoint(tmp_path / "parallel")
    report = check_model(tmp_path / "parallel", plugins=[tokenloom_example_plugin],
                         reference=lambda ids: reference_forward(sd, ids))
    assert report["max_rel_logit_diff"] < 1e-4


def test_the_kit_catches_a_wrong_forward(tmp_path):
    """The kit fails a model whose logits are not the reference's (here: the reference of a
    different checkpoint)."""
    import tokenloom_example_plugin

    make_checkpoint(tmp_path / "parallel", seed=0)
    other = make_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(ConformanceError, match="logits: prompt 0 differs"):
        check_model(tmp_path / "parallel", plugins=[tokenloom_example_plugin],
                    reference=lambda ids: reference_forward(other, ids))


def test_the_family_is_listed_through_its_entry_point():
    env = {k: v for k, v in os.environ.items() if k != "TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", "plugins"], capture_output=True, text=True,
                         check=True, env=env).stdout
    line = next(ln for ln in out.splitlines() if "example-parallel" in ln)
    assert "tokenloom-example-plugin" in line
