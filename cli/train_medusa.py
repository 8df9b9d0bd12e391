"""`tokenloom train-medusa`: Medusa heads for a model by self-distillation
(plugins/decoders/medusa_train.py), saved where the `medusa` decoder looks for them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_train_medusa_parser(sub) -> None:
    from tokenloom.cli.args import add_engine_args

    t = sub.add_parser("train-medusa", help="train Medusa heads on text the model generates (self-distillation)")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--prompts", type=int, default=1200, help="conversations the model answers for training data")
    t.add_argument("--grounded-share", type=float, default=0.25,
                   help="share of prompts asking about a documentation passage; the rest the model writes itself")
    t.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--draft-vocab", type=int, default=8192, metavar="K",
                   help="the heads choose among the K tokens most frequent in the answers (0: the whole vocabulary)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--out", help="safetensors file (default: where the medusa decoder looks for this model's heads)")
    t.add_argument("--data", metavar="FILE.jsonl",
                   help="the answered conversations: read from FILE when it exists (no generation), else written there")
    t.add_argument("--token-input", action=argparse.BooleanOptionalAction, default=True,
                   help="heads also read the token their hidden state produced (default); off: Medusa's plain heads")
    t.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="head i also reads the i draft tokens before its guess (Hydra; default); needs --token-input")
    add_engine_args(t)
    t.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args: argparse.Namespace) -> int:
    import torch

    from tokenloom import LLM
    from tokenloom.cli.args import flags_layer, progress_bar
    from tokenloom.plugins.decoders.medusa import best_tree, default_heads_path, expected_accepted
    from tokenloom.plugins.decoders.medusa_train import (
        collect_features,
        train_heads,
    )

    if not 1 <= args.num_heads <= 16:
        print("error: --num-heads must be in 1..16", file=sys.stderr)
        return 2
    if not 0.0 <= args.grounded_share <= 1.0:
        print("error: --grounded-share must be in [0, 1]", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(config_file=args.config, flags=flags_layer(args), progress=progress_bar("loading model"))
    try:
        engine = llm.engine
        ids, prompt_lens = answered_conversations(llm, args, t0)
        feats = collect_features(llm, ids, prompt_lens, args.num_heads, progress=progress_bar("hidden states"))
        model = engine.runner.model
        head, embedding = checkpoint_weights(engine)
        name = engine.model_name
        compute_dtype = model.dtype if model.dtype in (torch.float32, torch.bfloat16) else torch.float32
    finally:
        llm.close()
    torch.manual_seed(0)
    heads, report = train_heads(feats, head, args.num_heads, embedding=embedding if args.token_input else None,
                                epochs=args.epochs, lr=args.lr, draft_vocab=args.draft_vocab,
                                sequential=args.sequential and args.token_input,
                                batch_size=args.batch_size, compute_dtype=compute_dtype,
                                progress=progress_bar("training heads"))
    out = args.out or str(default_heads_path(name))
    report.update(model=name, prompts=len(ids), grounded_share=args.grounded_share, token_input=args.token_input,
                  sequential=args.sequential and args.token_input,
                  max_tokens=args.max_tokens, seconds=time.perf_counter() - t0)
    acc = report["heldout_rank_accuracy"]
    report["expected_tokens_per_step"] = {n: round(1 + expected_accepted(acc, best_tree(acc, n)), 3)
                                          for n in (1, 2, 4, 8, 16, 32)}
    heads.save(out, name, report)
    shown = {k: v for k, v in report.items() if k != "heldout_rank_accuracy"}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else
                          [round(a, 3) for a in v] if isinstance(v, list) else v) for k, v in shown.items()}, indent=1))
    print(f"wrote {out} ({args.num_heads} heads for {name}, hidden size {model.cfg.hidden_size}); use them with "
          f"--decoder medusa or params decoder=\"medusa\"", file=sys.stderr)
    return 0


def answered_conversations(llm, args, t0: float) -> tuple[list[list[int]], list[int]]:
    """The training conversations (token ids, where each answer starts): read from
    ``args.data`` when it exists, else written by the model (self-written and passage prompts,
    answered greedily) and saved there when named. Shared by train-medusa and train-eagle."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.plugins.decoders.medusa_train import distillation_prompts

    if args.data and Path(args.data).exists():
        ids, prompt_lens = read_conversations(args.data)
        print(f"read {len(ids)} answered conversations from {args.data}", file=sys.stderr)
        return ids, prompt_lens
    conversations = distillation_prompts(args.prompts, llm, grounded_share=args.grounded_share)
    print(f"{len(conversations)} prompts ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    outs = llm.generate(messages=conversations, params=SamplingParams(temperature=0, max_tokens=args.max_tokens))
    prompt_ids = [llm.engine.prompt_ids(messages=m) for m in conversations]
    ids = [p + o.token_ids for p, o in zip(prompt_ids, outs, strict=True)]
    prompt_lens = [len(p) for p in prompt_ids]
    print(f"generated {sum(len(o.token_ids) for o in outs)} tokens for {len(outs)} conversations "
          f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.data:
        write_conversations(args.data, ids, prompt_lens)
    return ids, prompt_lens


def checkpoint_weights(engine):
    """The output head's and the input embedding's weights, dense float32, from the
    checkpoint (tied: the same tensor)."""
    import torch

    from tokenloom.core import contracts
    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.core.runner import load_checkpoint
    from tokenloom.core.weights import dense_tensor

    e = engine.config.engine
    ckpt = load_checkpoint(resolve_model_path(e.model, e.revision), contracts.model_formats(engine.pm),
                           torch.float32, models=contracts.model_registry(engine.pm))
    embedding = dense_tensor(ckpt.weights["model.embed_tokens.weight"]).float()
    if ckpt.config.tie_word_embeddings:
        return embedding, embedding
    return dense_tensor(ckpt.weights["lm_head.weight"]).float(), embedding


def write_conversations(path, ids: list[list[int]], prompt_lens: list[int]) -> None:
    """One JSON line per answered conversation: its token ids and where the answer starts."""
    with open(path, "w") as f:
        for conv, n in zip(ids, prompt_lens, strict=True):
            f.write(json.dumps({"ids": conv, "prompt_len": n}) + "\n")


def read_conversations(path) -> tuple[list[list[int]], list[int]]:
    ids, lens = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                ids.append(row["ids"])
                lens.append(row["prompt_len"])
    return ids, lens
