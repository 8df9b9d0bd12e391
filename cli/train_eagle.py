"""`tokenloom train-eagle`: an EAGLE draft for a model by self-distillation
(plugins/decoders/eagle_train.py), saved where the `eagle` decoder looks for it."""

from __future__ import annotations

import json
import sys
import time


def add_train_eagle_parser(sub) -> None:
    from tokenloom.cli.args import add_engine_args

    t = sub.add_parser("train-eagle", help="train an EAGLE draft on text the model generates (self-distillation)")
    t.add_argument("--prompts", type=int, default=1200, help="conversations the model answers for training data")
    t.add_argument("--grounded-share", type=float, default=0.25,
                   help="share of prompts asking about a documentation passage; the rest the model writes itself")
    t.add_argument("--max-tokens", type=int, default=192, help="tokens per answer")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--unroll", type=int, default=3,
                   help="draft steps trained on the draft's own features (training-time test; 1: EAGLE-1)")
    t.add_argument("--draft-vocab", type=int, default=8192, metavar="K",
                   help="the draft chooses among the K tokens most frequent in the answers (0: the whole vocabulary)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--out", help="safetensors file (default: where the eagle decoder looks for this model's draft)")
    t.add_argument("--data", metavar="FILE.jsonl",
                   help="the answered conversations: read from FILE when it exists (no generation), else written there")
    add_engine_args(t)
    t.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args) -> int:
    import torch

    from tokenloom import LLM
    from tokenloom.cli.args import flags_layer, progress_bar
    from tokenloom.cli.train_medusa import answered_conversations, checkpoint_weights
    from tokenloom.plugins.decoders.eagle import DraftShape, default_draft_path, model_fingerprint
    from tokenloom.plugins.decoders.eagle_train import collect, train_draft

    if not 0.0 <= args.grounded_share <= 1.0:
        print("error: --grounded-share must be in [0, 1]", file=sys.stderr)
        return 2
    if not 1 <= args.unroll <= 8:
        print("error: --unroll must be in 1..8", file=sys.stderr)
        return 2
    if args.epochs < 1 or args.prompts < 2:
        print("error: --epochs must be >= 1 and --prompts >= 2", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(config_file=args.config, flags=flags_layer(args), progress=progress_bar("loading model"))
    try:
        engine = llm.engine
        ids, prompt_lens = answered_conversations(llm, args, t0)
        convs = collect(llm, ids, prompt_lens, progress=progress_bar("features"))
        model = engine.runner.model
        shape = DraftShape.of(model.cfg)
        fingerprint = model_fingerprint(model)
        final_norm = model.norm.detach().float().clone()
        head, embedding = checkpoint_weights(engine)
        name = engine.model_name
        compute_dtype = torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32
    finally:
        llm.close()
    draft, report = train_draft(convs, shape, head, embedding, final_norm, epochs=args.epochs, lr=args.lr,
                                unroll=args.unroll, draft_vocab=args.draft_vocab, compute_dtype=compute_dtype,
                                progress=progress_bar("training draft"))
    out = args.out or str(default_draft_path(name))
    report.update(model=name, prompts=len(ids), grounded_share=args.grounded_share, max_tokens=args.max_tokens,
                  seconds=round(time.perf_counter() - t0, 1))
    draft.save(out, name, fingerprint, report)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in report.items()}, indent=1))
    print(f"wrote {out} (an EAGLE draft for {name}, fingerprint {fingerprint}); use it with --decoder eagle or "
          f"params decoder=\"eagle\"", file=sys.stderr)
    return 0
