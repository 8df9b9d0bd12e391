#!/usr/bin/env python
"""A random-weight model of a real shape, for ``tokenloom bench decode`` against llama-bench.

    python scripts/make_shape_model.py scripts/shapes/llama-3.2-1b.json /tmp/shapes/llama-3.2-1b
    python scripts/make_shape_model.py scripts/shapes/qwen3-0.6b.json /tmp/shapes/qwen3-0.6b --gguf q4_0

CONFIG is a published ``config.json`` (scripts/shapes/). Written under OUT_DIR:

* ``hf/``: that ``config.json``, ``model.safetensors`` in bf16 with random weights of a sensible
  scale (matmuls ``N(0, 1) / sqrt(in_features)``, norms ``1 + N(0, 0.05)``, the embedding
  ``N(0, 0.02)``), and a ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE (256
  bytes, a few merges, the config's BOS/EOS as special tokens at the config's ids) padded with
  ``<unused_N>`` to ``vocab_size``, so that every id the model can emit decodes.
* ``model-q4_0.gguf`` (``--gguf q4_0``, the default; ``q8_0``; ``none`` writes no GGUF): the
  same weights quantised and written with gguf-py's ``GGUFWriter`` the way llama.cpp's
  ``convert_hf_to_gguf.py`` writes the architecture (the metadata keys of its model class,
  tensor names through gguf-py's name map, LLaMA's q/k row permutation and Llama 3's
  ``rope_freqs`` table; the logic of tests/test_models_gguf.py's ``write_gguf``, copied here
  for llama / qwen2 / qwen3), followed by llama-quantize's choice of types: the 2-D matmul
  weights in the asked type, norms F32, and ``token_embd`` (the output too, tied) in
  ``--embd-type`` (Q8_0 by default: llama-quantize's Q4_0 writes a tied embedding at Q6_K,
  which tokenloom would dequantise; Q8_0 is the closest type both engines keep quantised).
  The tokenizer is the same vocabulary as ``tokenizer.ggml.model`` ``gpt2`` with its merges,
  token types (normal, control, unused) and the pre-tokenizer llama.cpp's converter names for
  the real model (``llama-bpe``, ``qwen2``).

Memory: tensors are made, written and quantised one at a time (large ones in row chunks): for
the 1B model (2.5 GB in bf16) the process peaks at ~0.6 GB writing ``hf/`` and ~0.75 GB of its
own writing the GGUF (plus the safetensors file's pages, read through mmap: page cache).
An existing ``hf/`` with the same ``config.json`` is reused (``--force`` rewrites it); the
weights depend on ``--seed`` only (torch's seeded generator: the same bytes on the same torch).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

#: HF architecture -> GGUF architecture (the families this writer knows the converter's keys for)
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3"}
#: the pre-tokenizer llama.cpp's converter names for each architecture's real tokenizer
GGUF_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
#: Llama 3's and Qwen's pre-tokenizer regex (tokenloom's core/tokenizer.py reads both GGUF names as it)
PRE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: the real tokenizers' names for the special ids of the shapes here; others get <|special_N|>
SPECIAL_NAMES = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>",
                 128009: "<|eot_id|>", 151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
#: a few byte-level merges, each of tokens already in the vocabulary (llama.cpp wants merges)
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
          ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("in", "g"), ("Ġ", "w"), ("Ġ", "o"), ("i", "s"),
          ("Ġ", "h"), ("h", "i")]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
CHUNK_ROWS = 8192  # rows made / quantised at a time for large tensors

# ---------------------------------------------------------------------------------------------
# tensors


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes, from the transformers model built on the meta
    device (no memory); the tied ``lm_head.weight`` left out, as ``save_pretrained`` does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**copy.deepcopy(cfg))  # transformers rewrites rope_scaling in place
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = cfg.get("tie_word_embeddings", False)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()
            if not (tied and name == "lm_head.weight")]


def random_chunks(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[torch.Tensor]:
    """The tensor's random bf16 values, CHUNK_ROWS rows at a time."""
    rows = shape[0]
    for start in range(0, rows, CHUNK_ROWS):
        part = (min(CHUNK_ROWS, rows - start), *shape[1:])
        x = torch.randn(part, generator=gen, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):
            x.mul_(0.02)
        elif len(shape) == 1 and "norm" in name:
            x.mul_(0.05).add_(1.0)
        elif len(shape) == 1:  # a bias
            x.mul_(0.02)
        else:  # a matmul [out, in]
            x.mul_(shape[-1] ** -0.5)
        yield x.to(torch.bfloat16)


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """``model.safetensors`` in bf16, each tensor made and written in turn (the header first:
    every offset is known from the shapes)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (name, shape) in enumerate(specs):
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            for chunk in random_chunks(name, shape, gen):
                chunk.view(torch.int16).numpy().tofile(f)


# ---------------------------------------------------------------------------------------------
# tokenizer


def vocabulary(cfg: dict) -> tuple[list[str], list[int], list[tuple[str, str]], int | None, list[int]]:
    """(tokens, GGUF token types, merges, bos id, eos ids): ``vocab_size`` tokens; the bytes and
    merges first, the config's BOS/EOS at their ids, ``<unused_N>`` everywhere else."""
    from tokenizers import pre_tokenizers

    size = cfg["vocab_size"]
    tokens: list[str | None] = [None] * size
    types = [5] * size  # UNUSED
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        tokens[i], types[i] = ch, 1  # NORMAL
    have = set(tokens[:256])
    nxt = 256
    for a, b in MERGES:
        assert a in have and b in have and a + b not in have, (a, b)
        tokens[nxt], types[nxt] = a + b, 1
        have.add(a + b)
        nxt += 1
    bos = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    special = [i for i in dict.fromkeys([bos, *eos]) if i is not None]
    if any(not nxt <= i < size for i in special):  # no room at the config's ids: after the merges
        remap = {i: nxt + k for k, i in enumerate(special)}
        bos, eos = remap.get(bos), [remap[i] for i in eos]
        special = list(remap.values())
    for i in special:
        tokens[i], types[i] = SPECIAL_NAMES.get(i, f"<|special_{i}|>"), 3  # CONTROL
    return ([t if t is not None else f"<unused_{i}>" for i, t in enumerate(tokens)], types,
            list(MERGES), bos, eos)


def write_hf_tokenizer(out: Path, tokens: list[str], types: list[int], merges: list[tuple[str, str]],
                       bos: int | None, eos: list[int], add_bos: bool) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == 3])
    tok.save(str(out / "tokenizer.json"))
    tcfg = {"chat_template": CHAT_TEMPLATE, "add_bos_token": add_bos, "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 131072}
    if bos is not None:
        tcfg["bos_token"] = tokens[bos]
    if eos:
        tcfg["eos_token"] = tokens[eos[0]]
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# GGUF (tests/test_models_gguf.py's write_gguf: llama.cpp's converter, for llama / qwen2 / qwen3)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's ``LlamaModel.permute``: q/k rows reordered for llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, base: float, dim: int) -> np.ndarray:
    """The converter's ``LlamaModel.generate_extra_tensors``: each frequency's divisor."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(out, dtype=np.float32)


def write_gguf(hf: Path, out: Path, qtype_name: str, embd_name: str, name: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape, quantize
    from safetensors import safe_open

    qtype, embd_qtype = Q[qtype_name.upper()], Q[embd_name.upper()]
    hp = json.loads((hf / "config.json").read_text())
    arch = ARCH[hp["architectures"][0]]
    n_layers, hidden, heads = hp["num_hidden_layers"], hp["hidden_size"], hp["num_attention_heads"]
    kv_heads = hp.get("num_key_value_heads", heads)
    head_dim = hp.get("head_dim") or hidden // heads
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})  # TextModel.__init__
    theta = rope.get("rope_theta", hp.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == Q.Q4_0 else gguf.LlamaFileType.MOSTLY_Q8_0)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(theta)
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges, bos, eos = vocabulary(hp)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(GGUF_PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos:
        w.add_eos_token_id(eos[0])
    w.add_add_bos_token(arch == "llama")
    w.add_chat_template(CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    extra: dict[str, np.ndarray] = {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(rope, theta, head_dim)
    plan: list[tuple[str, str, Q]] = []  # (hf name, gguf name, type)
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        for hname in f.keys():
            shape = tuple(f.get_slice(hname).get_shape())
            gname = names.get_name(hname, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise SystemExit(f"gguf-py maps no GGUF name for {hname}")
            if len(shape) == 1 or shape[-1] % 32:
                t = Q.F32
            elif gname in ("token_embd.weight", "output.weight"):
                t = embd_qtype
            else:
                t = qtype
            plan.append((hname, gname, t))
            nbytes = math.prod(shape) * 4 if t == Q.F32 else math.prod(quant_shape_to_byte_shape(shape, t))
            if t == Q.F32:
                w.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes)
            else:
                w.add_tensor_info(gname, quant_shape_to_byte_shape(shape, t), np.dtype(np.uint8), nbytes, raw_dtype=t)
        for gname, arr in extra.items():
            w.add_tensor_info(gname, arr.shape, arr.dtype, arr.nbytes)

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for hname, _gname, t in plan:
            sl = f.get_slice(hname)
            rows = sl.get_shape()[0]
            parts = []
            for start in range(0, rows, CHUNK_ROWS):
                arr = sl[start:start + CHUNK_ROWS].float().numpy()
                parts.append(arr if t == Q.F32 else quantize(arr, t))
            arr = np.concatenate(parts) if len(parts) > 1 else parts[0]
            del parts
            if arch == "llama" and hname.endswith(("q_proj.weight", "k_proj.weight")):
                # whole rows move, so the permutation commutes with the row-wise quantisation
                arr = _permute(arr, heads if "q_proj" in hname else kv_heads)
            w.write_tensor_data(np.ascontiguousarray(arr))
            del arr
        for arr in extra.values():
            w.write_tensor_data(arr)
    w.close()


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, help="a published config.json (scripts/shapes/*.json)")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", choices=["q4_0", "q8_0", "none"], default="q4_0",
                    help="type of the GGUF's 2-D matmul weights (none: write no GGUF)")
    ap.add_argument("--embd-type", choices=["q8_0", "q4_0"], default="q8_0",
                    help="type of the GGUF's token_embd (and untied output) (default q8_0)")
    ap.add_argument("--force", action="store_true", help="rewrite the HF directory even if it is there")
    args = ap.parse_args(argv)

    cfg = json.loads(args.config.read_text())
    arch = ARCH.get((cfg.get("architectures") or ["?"])[0])
    if arch is None:
        raise SystemExit(f"{args.config}: architecture {cfg.get('architectures')} not one of {sorted(ARCH)}")
    hf = args.out_dir / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fresh = (hf / "model.safetensors").exists() and (hf / "config.json").exists() \
        and json.loads((hf / "config.json").read_text()) == cfg
    if args.force or not fresh:
        specs = tensor_specs(cfg)
        params = sum(math.prod(s) for _, s in specs)
        print(f"{args.config.name}: {len(specs)} tensors, {params / 1e9:.3f}B parameters "
              f"({params * 2 / 2**30:.2f} GiB bf16)", flush=True)
        (hf / "config.json").unlink(missing_ok=True)
        write_safetensors(hf / "model.safetensors", specs, args.seed)
        tokens, types, merges, bos, eos = vocabulary(cfg)
        write_hf_tokenizer(hf, tokens, types, merges, bos, eos, add_bos=arch == "llama")
        (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")  # last: marks the directory done
        print(f"  wrote {hf} ({time.perf_counter() - t0:.1f} s)", flush=True)
    else:
        print(f"  {hf} is there (--force rewrites it)", flush=True)
    if args.gguf != "none":
        t1 = time.perf_counter()
        out = args.out_dir / f"model-{args.gguf}.gguf"
        write_gguf(hf, out, args.gguf, args.embd_type, name=f"random {args.config.stem}")
        print(f"  wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t1:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
