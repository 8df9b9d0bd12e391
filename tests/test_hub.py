"""`--model org/name`: a Hugging Face hub id resolved through huggingface_hub's cache
(core/loader/hub.py), with no network: each test fills a hub cache in tmp_path itself, in the
hub's layout (models--org--name/snapshots/<commit>/..., refs/<branch or tag>), and runs with
HF_HUB_OFFLINE=1. Also the sharded-checkpoint index (core/loader/hf.py) and
generation_config.json's list of EOS ids (core/tokenizer.py)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.core.errors import ConfigError
from tokenloom.core.loader.hf import load_hf_dir
from tokenloom.core.loader.hub import HubRef, parse_hub_id, pick_gguf
from tokenloom.core.loader.resolve import resolve_model_path

from conftest import CHAT_TEMPLATE, EOS_ID, TINY_VOCAB, _byte_tokenizer

MAIN = "1" * 40
TAGGED = "2" * 40
PROMPT = "Hello, hub"
N = 8


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """conftest's tiny LLaMA, saved in shards of at most 200 KB plus model.safetensors.index.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-sharded")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_theta=50000.0, rms_norm_eps=1e-5, bos_token_id=257, eos_token_id=EOS_ID)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the default init, so greedy ties are rare
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, max_shard_size="200KB")
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))
    assert len(list(path.glob("*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(scope="module")
def local_ids(sharded_dir) -> list[int]:
    """Greedy ids from the local directory: what the hub id must answer too."""
    with LLM(**_engine_kwargs(str(sharded_dir))) as llm:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == N  # (no EOS on the way)
    return list(out.token_ids)


@pytest.fixture
def hub_home(tmp_path, monkeypatch) -> Path:
    """An empty hub cache under HF_HOME, offline; returns the cache (HF_HOME/hub)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf-home" / "hub"


def _engine_kwargs(model: str, **kw):
    return {"model": model, "dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 16,
            "capture": False, "overlap": False, **kw}


def fill_cache(cache: Path, repo: str, files: dict[str, Path | str], commit: str = MAIN,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``files`` (name in the repo -> a file to copy, or text) in the cache as ``repo``'s
    snapshot at ``commit``, with ``refs`` pointing at it; returns the snapshot directory."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for name, src in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, Path):
            shutil.copyfile(src, snapshot / name)
        else:
            (snapshot / name).write_text(src)
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def dir_files(path: Path) -> dict[str, Path | str]:
    return {p.name: p for p in path.iterdir() if p.is_file()}


# ---- the id's shape ------------------------------------------------------------------------

@pytest.mark.parametrize("model, expected", [
    ("org/name", HubRef("org/name", "org/name")),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", HubRef("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                   "HuggingFaceTB/SmolLM2-135M-Instruct")),
    ("org/name-GGUF:Q4_K_M", HubRef("org/name-GGUF:Q4_K_M", "org/name-GGUF", quant="Q4_K_M")),
    ("org/name/sub/f.Q8_0.gguf", HubRef("org/name/sub/f.Q8_0.gguf", "org/name", filename="sub/f.Q8_0.gguf")),
    ("smollm2-135m", None), ("./org/name", None), ("/abs/org/name", None), ("org/name/extra", None),
    ("org--x/name", None), ("org/na..me", None), ("models/missing.gguf", None), ("org/name:", None),
])
def test_hub_id_shape(model, expected):
    assert parse_hub_id(model) == expected


def test_a_missing_path_that_is_no_hub_id_says_so():
    with pytest.raises(ConfigError, match=r"'\./nowhere/model' is neither a known name .* an existing path nor a "
                                          r"Hugging Face id"):
        resolve_model_path("./nowhere/model")


# ---- resolution through the cache ------------------------------------------------------------

def test_id_resolves_to_its_snapshot_and_a_revision_to_its_own(hub_home, sharded_dir, monkeypatch):
    main = fill_cache(hub_home, "org/tiny", dir_files(sharded_dir))
    tagged = fill_cache(hub_home, "org/tiny", {"config.json": sharded_dir / "config.json"}, TAGGED, ("v1",))
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", "main") == main
    assert resolve_model_path("org/tiny", "v1") == tagged
    assert resolve_model_path("org/tiny", TAGGED) == tagged  # a commit hash needs no ref
    # HF_HUB_CACHE wins over HF_HOME, read when the model is resolved (not when huggingface_hub was imported)
    moved = hub_home.parent.parent / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(moved))
    with pytest.raises(ConfigError, match=rf"not in the Hugging Face cache \({moved}\)"):
        resolve_model_path("org/tiny")
    fill_cache(moved, "org/tiny", dir_files(sharded_dir))
    assert resolve_model_path("org/tiny") == moved / "models--org--tiny" / "snapshots" / MAIN


def test_uncached_id_offline_is_one_clear_sentence(hub_home, sharded_dir):
    with pytest.raises(ConfigError) as exc:
        resolve_model_path("org/missing")
    assert str(exc.value) == (
        f"model 'org/missing' is not in the Hugging Face cache ({hub_home}) and the hub cannot be reached "
        "(HF_HUB_OFFLINE=1); download it where there is network with `hf download org/missing` or pass "
        "a local path")
    fill_cache(hub_home, "org/tiny", dir_files(sharded_dir))
    with pytest.raises(ConfigError, match=r"model 'org/tiny' at revision 'v9' is not in the Hugging Face cache "
                                          r".*`hf download org/tiny --revision v9`"):
        resolve_model_path("org/tiny", "v9")


def test_a_revision_needs_a_hub_id(sharded_dir):
    with pytest.raises(ConfigError, match="revision 'v1' applies to a Hugging Face id; .* is a local path"):
        resolve_model_path(str(sharded_dir), "v1")
    with pytest.raises(ConfigError, match="is an embedded model"):
        resolve_model_path("smollm2-135m", "v1")


def test_a_repository_without_config_json_points_at_the_gguf_forms(hub_home):
    fill_cache(hub_home, "org/tiny-GGUF", {"tiny-Q8_0.gguf": "GGUF"})
    with pytest.raises(ConfigError, match=r"has no config.json.*org/tiny-GGUF:QUANT"):
        resolve_model_path("org/tiny-GGUF")


def test_gguf_file_by_quant_or_by_name(hub_home):
    snap = fill_cache(hub_home, "org/tiny-GGUF", {
        "tiny-Q4_K_M.gguf": "GGUF", "tiny-q8_0.gguf": "GGUF", "mmproj-tiny-Q8_0.gguf": "GGUF",
        "sub/tiny-F16.gguf": "GGUF", "README.md": "# tiny"})
    assert resolve_model_path("org/tiny-GGUF:Q4_K_M") == snap / "tiny-Q4_K_M.gguf"
    assert resolve_model_path("org/tiny-GGUF:Q8_0") == snap / "tiny-q8_0.gguf"  # any case; not the mmproj
    assert resolve_model_path("org/tiny-GGUF:f16") == snap / "sub" / "tiny-F16.gguf"
    assert resolve_model_path("org/tiny-GGUF/sub/tiny-F16.gguf") == snap / "sub" / "tiny-F16.gguf"
    with pytest.raises(ConfigError, match=r"no .gguf file for 'Q5_K_M' \(the cached copy's GGUF files: "
                                          r"sub/tiny-F16.gguf, tiny-Q4_K_M.gguf, tiny-q8_0.gguf\)$"):
        resolve_model_path("org/tiny-GGUF:Q5_K_M")
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_model_path("org/tiny-GGUF/tiny-Q2_K.gguf")


def test_gguf_pick_refuses_ambiguous_and_split_files():
    ref = HubRef("org/x:Q4_K_M", "org/x", quant="Q4_K_M")
    with pytest.raises(ConfigError, match="2 .gguf files match 'Q4_K_M'.*org/x/<file>.gguf"):
        pick_gguf(ref, ["a-Q4_K_M.gguf", "b/a-Q4_K_M.gguf"], None)
    with pytest.raises(ConfigError, match="split into 2 files.*llama-gguf-split --merge"):
        pick_gguf(ref, ["a-Q4_K_M-00001-of-00002.gguf", "a-Q4_K_M-00002-of-00002.gguf"], None)
    assert pick_gguf(ref, ["a-IQ4_K_M.gguf", "a.Q4_K_M.gguf"], None) == "a.Q4_K_M.gguf"


# ---- the sharded index -------------------------------------------------------------------------

def test_sharded_checkpoint_loads_the_shards_its_index_names(sharded_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    d = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, d)
    # a stray .safetensors the index does not name (Mistral repos ship a consolidated copy) is not read
    save_file({"stray.weight": torch.zeros(2)}, str(d / "consolidated.safetensors"))
    ckpt = load_hf_dir(d, torch.float32)
    assert "stray.weight" not in ckpt.weights
    hf = LlamaForCausalLM.from_pretrained(sharded_dir, dtype=torch.float32).state_dict()
    assert set(ckpt.weights) == set(hf)
    assert all(torch.equal(ckpt.weights[k], hf[k]) for k in hf)

    shards = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (d / shards[-1]).unlink()
    with pytest.raises(ValueError, match=rf"shard {shards[-1]} named by model.safetensors.index.json is missing"):
        load_hf_dir(d, torch.float32)


# ---- end to end ------------------------------------------------------------------------------

def test_llm_from_hub_id_answers_as_the_local_directory(hub_home, sharded_dir, local_ids):
    fill_cache(hub_home, "org/tiny", dir_files(sharded_dir))
    # revision "eos": generation_config.json lists a second EOS id, the token the model answers third
    k = next(i for i in range(1, N) if local_ids[i] not in local_ids[:i])
    stop = local_ids[k]
    gen = {**json.loads((sharded_dir / "generation_config.json").read_text()), "eos_token_id": [EOS_ID, stop]}
    fill_cache(hub_home, "org/tiny", {**dir_files(sharded_dir), "generation_config.json": json.dumps(gen)},
               TAGGED, ("eos",))
    greedy = SamplingParams(temperature=0, max_tokens=N)

    with LLM(**_engine_kwargs("org/tiny")) as llm:
        assert llm.engine.model_name == "tiny"  # the repository's name, not the snapshot's commit
        assert llm.tokenizer.eos_token_ids == {EOS_ID}
        out = llm.generate(PROMPT, greedy)[0]
    assert list(out.token_ids) == local_ids and out.finish_reason == "length"

    with LLM(**_engine_kwargs("org/tiny", revision="eos")) as llm:
        assert llm.tokenizer.eos_token_ids == {EOS_ID, stop}
        out = llm.generate(PROMPT, greedy)[0]
        ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    assert list(out.token_ids) == local_ids[:k + 1] and out.finish_reason == "stop"
    assert list(ignored.token_ids) == local_ids  # the same weights: only the stop set differs


# ---- config and flags ---------------------------------------------------------------------------

def test_revision_flag_and_config_key():
    from tokenloom.cli.args import add_engine_args, flags_layer
    from tokenloom.core.config import build_config
    from tokenloom.core.plugins import PluginManager

    p = argparse.ArgumentParser()
    add_engine_args(p)
    layer = flags_layer(p.parse_args(["--model", "org/tiny", "--revision", "v1"]))
    assert layer == {"model": "org/tiny", "revision": "v1"}
    pm = PluginManager()
    config = build_config(pm, layer)
    assert config.engine.revision == "v1"
    assert 'revision = "v1"' in config.to_toml()
    assert build_config(pm, {}).engine.revision is None
    assert "revision" not in build_config(pm, {}).to_toml()  # TOML has no null: left out


def test_a_chat_template_json_is_read(tmp_path):
    """A checkpoint whose template sits in chat_template.json (processors' spelling), not in
    tokenizer_config.json, still chats with it."""
    from tokenloom.core.tokenizer import Tokenizer

    from conftest import _byte_tokenizer

    _byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    tok = Tokenizer.from_hf_dir(tmp_path, {})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
