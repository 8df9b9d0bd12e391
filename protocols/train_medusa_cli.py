"""`tokenloom train-medusa`: Medusa heads for a model by self-distillation
(plugins/decoders/medusa_train.py), saved where the `medusa` decoder looks for them."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_train_medusa_parser(sub) -> None:
    from tokenloom.protocols.cli_args import add_engine_args

    t = sub.add_parser("train-medusa", help="train Medusa heads on text the model generates (self-distillation)")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--prompts", type=int, default=1200, help="conversations the model answers for training data")
    t.add_argument("--grounded-share", type=float, default=0.25,
                   help="share of prompts asking about a documentation passage; the rest the model writes itself")
    t.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--out", help="safetensors file (default: where the medusa decoder looks for this model's heads)")
    add_engine_args(t)
    t.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args: argparse.Namespace) -> int:
    import torch

    from tokenloom import LLM
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.weights import dense_tensor
    from tokenloom.plugins.decoders.medusa import best_tree, default_heads_path, expected_accepted
    from tokenloom.plugins.decoders.medusa_train import (
        collect_features,
        distillation_prompts,
        train_heads,
    )
    from tokenloom.protocols.cli import _progress_bar
    from tokenloom.protocols.cli_args import flags_layer

    if not 1 <= args.num_heads <= 16:
        print("error: --num-heads must be in 1..16", file=sys.stderr)
        return 2
    if not 0.0 <= args.grounded_share <= 1.0:
        print("error: --grounded-share must be in [0, 1]", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(config_file=args.config, flags=flags_layer(args), progress=_progress_bar("loading model"))
    try:
        engine = llm.engine
        conversations = distillation_prompts(args.prompts, llm, grounded_share=args.grounded_share)
        print(f"{len(conversations)} prompts ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        outs = llm.generate(messages=conversations, params=SamplingParams(temperature=0, max_tokens=args.max_tokens))
        prompt_ids = [engine.prompt_ids(messages=m) for m in conversations]
        ids = [p + o.token_ids for p, o in zip(prompt_ids, outs, strict=True)]
        gen_s = time.perf_counter() - t0
        print(f"generated {sum(len(o.token_ids) for o in outs)} tokens for {len(outs)} conversations "
              f"in {gen_s:.0f} s", file=sys.stderr)
        feats = collect_features(llm, ids, [len(p) for p in prompt_ids], args.num_heads,
                                 progress=_progress_bar("hidden states"))
        model = engine.runner.model
        head = dense_tensor(_head_weight(engine)).float()
        name = engine.model_name
        compute_dtype = model.dtype if model.dtype in (torch.float32, torch.bfloat16) else torch.float32
    finally:
        llm.close()
    torch.manual_seed(0)
    heads, report = train_heads(feats, head, args.num_heads, epochs=args.epochs, lr=args.lr,
                                batch_size=args.batch_size, compute_dtype=compute_dtype,
                                progress=_progress_bar("training heads"))
    out = args.out or str(default_heads_path(name))
    report.update(model=name, prompts=len(conversations), grounded_share=args.grounded_share,
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


def _head_weight(engine):
    """The output head's weights, dense, from the checkpoint (tied: the embedding)."""
    import torch

    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.core.runner import load_checkpoint

    formats = {n: e.factory for n, e in engine.pm.entries("model_format").items()}
    ckpt = load_checkpoint(resolve_model_path(engine.config.engine.model), formats, torch.float32)
    name = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    return ckpt.weights[name]
