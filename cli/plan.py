"""`tokenloom plan`: the memory table of a model from its checkpoint's header alone
(core/planner): weights per format, KV cache per token / block / request, an overhead
estimate, and how many requests a memory budget or a KV pool admits, paged vs contiguous."""

from __future__ import annotations

import argparse
import json
import sys


def add_plan_parser(sub) -> None:
    from tokenloom.core.config import DEFAULT_MODEL

    # Defaults None: PlanOptions holds the engine's (importing it here would load torch for every command).
    p = sub.add_parser("plan", help="memory table: weights per format, KV cache, how many requests fit")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default), a .gguf file, a Hugging Face directory or its config.json, "
                        "or a Hugging Face id (org/name, org/name:Q4_K_M)")
    p.add_argument("--revision", help="the Hugging Face id's branch, tag or commit hash (default: main)")
    p.add_argument("--quantizer", help="none, gguf, int8, fp8, rtn, gptq, awq (default: what the checkpoint says)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: as the engine picks on this machine)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], help="KV cache storage (auto: the dtype)")
    p.add_argument("--context", type=int, help="tokens per request, prompt + output (default: min(1024, max_model_len))")
    p.add_argument("--max-model-len", type=int,
                   help="the engine's context cap (default: the model's); what `contiguous` reserves per request")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--memory", type=float, metavar="GIB",
                        help="device memory in GiB for weights + overhead + KV cache")
    budget.add_argument("--kv-cache-memory-mb", type=int, metavar="MB",
                        help="the KV pool itself, as the engine flag of that name (default: the engine's)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-seqs", type=int,
                   help="scheduler.max_num_seqs (logits rows; default: auto, as the engine picks it for the pool)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="scheduler.max_num_batched_tokens (the largest step; default: auto)")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="count a draft model loaded beside it (--enable-decoder speculative): its weights and "
                        "KV pool; 'same' for the model itself (speculative's default draft)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenloom.core.errors import ClientError, ConfigError
    from tokenloom.core.loader.resolve import resolve_model_path
    from tokenloom.planner import PlanOptions, plan, read_checkpoint

    given = {f: getattr(args, f) for f in PlanOptions.__dataclass_fields__}
    opts = PlanOptions(**{f: v for f, v in given.items() if v is not None})
    try:
        try:
            path = resolve_model_path(args.model, args.revision)
        except ConfigError as exc:
            raise ClientError(str(exc), param="model") from None
        draft = None
        if args.draft_model:
            try:
                draft = read_checkpoint(path if args.draft_model == "same" else resolve_model_path(args.draft_model))
            except ConfigError as exc:
                raise ClientError(str(exc), param="draft_model") from None
        result = plan(read_checkpoint(path), opts, draft)
    except ClientError as exc:  # name the flag: "context must be >= 1" -> "--context must be >= 1"
        param = exc.param or "model"
        message = str(exc)
        rest = message[len(param):] if message.startswith(param) else f": {message}"
        print(f"error: --{param.replace('_', '-')}{rest}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0


def size(n: float) -> str:
    """Binary units, as the engine's MB flags count (1 MiB = 2**20 bytes)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def render(p) -> str:
    c = p.config
    lines = [
        f"model       {p.model} ({p.format})",
        f"shape       {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads / {c.num_kv_heads} KV heads"
        f" x {c.head_dim}, intermediate {c.intermediate_size}, vocab {c.vocab_size}"
        f"{' (tied head)' if c.tie_word_embeddings else ''}, context {c.max_position_embeddings}",
        f"parameters  {p.num_params:,} ({p.num_params / 1e9:.3f} B)",
        "",
        f"weights as the engine holds them (embedding and dense head in {p.dtype}, norms float32"
        f"{'; the tied head packed as a second copy' if c.tie_word_embeddings else ''})",
        f"  {'format':<16}{'bytes':>15}{'GiB':>9}{'GB':>9}{'bits/param':>12}  note",
    ]
    for r in p.weights:
        mark = "*" if r.selected else " "
        lines.append(f"{mark} {r.format:<16}{r.bytes:>15,}{r.bytes / (1 << 30):>9.3f}{r.bytes / 1e9:>9.3f}"
                     f"{r.bits_per_param:>12.2f}  {r.note}")
    lines.append(f"  * = quantizer {p.quantizer}")
    kv_elem = f"{p.dtype}" if p.kv_cache_dtype == "auto" else f"{p.kv_cache_dtype}, 1 B + a bf16 scale per token and head"
    oh = p.overhead
    lines += [
        "",
        f"KV cache ({kv_elem}; 2 x {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim})",
        f"  per token    {p.kv_bytes_per_token:>13,} B  {size(p.kv_bytes_per_token)}",
        f"  per block    {p.kv_bytes_per_block:>13,} B  {size(p.kv_bytes_per_block)} ({p.block_size} tokens)",
        f"  per request  {p.kv_bytes_per_request:>13,} B  {size(p.kv_bytes_per_request)} "
        f"({p.context} tokens = {p.blocks_per_request} blocks)",
        "",
        f"overhead (an estimate; max_num_batched_tokens {oh.max_num_batched_tokens}, max_num_seqs {oh.max_num_seqs}"
        f"{': the most auto may pick, the pool is sized after it' if p.kv_budget_source == 'memory' else ''})",
        f"  activations  {size(oh.activation_bytes):>11}  the largest step's live set in one layer",
        f"  attention    {size(oh.attention_bytes):>11}  scores of a prefill chunk over {p.context} tokens",
        f"  logits       {size(oh.logits_bytes):>11}  {oh.max_num_seqs} rows x {c.vocab_size} x 4 B",
        f"  rope         {size(oh.rope_bytes):>11}  cos/sin tables for {p.max_model_len} positions",
        f"  runtime      {size(oh.runtime_bytes):>11}  fixed allowance (CUDA context / torch runtime)",
        f"  total        {size(oh.total):>11}",
        "",
    ]
    if p.draft_model is not None:
        lines.append(f"draft model {p.draft_model}: {size(p.draft_bytes)} (its weights and its own KV pool), "
                     f"loaded at start-up")
    if p.kv_budget_source == "memory":
        lines.append(f"KV pool: --memory {size(p.memory_bytes)} - weights {size(p.weight_bytes)} - "
                     f"{f'draft {size(p.draft_bytes)} - ' if p.draft_model is not None else ''}overhead "
                     f"{size(oh.total)} = {p.kv_cache_memory_mb} MiB (run the engine with --kv-cache-memory-mb "
                     f"{p.kv_cache_memory_mb})")
    else:
        why = "the engine's default" if p.kv_budget_source == "default" else "--kv-cache-memory-mb"
        lines.append(f"KV pool: {p.kv_cache_memory_mb} MiB ({why})")
    ratio = f"{p.paged_over_contiguous:.2f}x" if p.paged_over_contiguous is not None else "-"
    lines += [
        f"  KV blocks    {p.num_kv_blocks:,} x {p.block_size} tokens = {p.num_kv_blocks * p.block_size:,} token slots",
        f"  requests of {p.context} tokens at once:",
        f"    paged       {p.max_requests_paged:>7,}  ({p.blocks_per_request} blocks each, taken as they grow)",
        f"    contiguous  {p.max_requests_contiguous:>7,}  ({p.contiguous_blocks_per_request} blocks each: "
        f"max_model_len {p.max_model_len} reserved at admission)",
        f"    paged / contiguous  {ratio}",
    ]
    if p.max_requests_paged > p.max_num_seqs:
        lines.append(f"  (scheduler.max_num_seqs {p.max_num_seqs} caps how many run at once)")
    lines += ["", "scheduler limits (auto unless set: from this pool and this machine, as the engine picks them)",
              f"  max_num_seqs            {p.max_num_seqs:>6}  {p.limits_reasons['max_num_seqs']}",
              f"  max_num_batched_tokens  {p.max_num_batched_tokens:>6}  {p.limits_reasons['max_num_batched_tokens']}"]
    return "\n".join(lines)

