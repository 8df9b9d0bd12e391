"""argparse flags shared by every command that builds an engine, and their mapping onto
config layers (flags sit between the TOML file and Python keyword arguments); the loading
progress bar and the API key that several commands use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tokenloom.core.config import merge_layers, nested, parse_override

# flag dest -> dotted config key
ENGINE_FLAGS = {
    "model": "model",
    "revision": "revision",
    "dtype": "dtype",
    "device": "device",
    "max_model_len": "max_model_len",
    "block_size": "block_size",
    "kv_cache_memory_mb": "kv_cache_memory_mb",
    "num_kv_blocks": "num_kv_blocks",
    "seed": "seed",
    "threads": "num_threads",
    "scheduler": "scheduler.name",
    "cache_manager": "cache_manager.name",
    "decoder": "decoder.name",
    "enable_decoder": "enable_decoders",
    "backend": "backend.name",
    "quantizer": "quantizer.name",
    "kv_cache_dtype": "kv_cache_dtype",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "chunked_prefill": "scheduler.enable_chunked_prefill",
    "overlap": "overlap",
    "capture": "capture",
    "engine_process": "process",
    "batch_invariant": "batch_invariant",
    "tensor_parallel_size": "tensor_parallel_size",
    "tool_call_parser": "tool_call_parser",
    "grammar_backend": "grammar_backend",
    "max_loras": "adapter.max_loras",
    "max_lora_rank": "adapter.max_lora_rank",
    "lora_merge": "adapter.merge",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (flags override --config; see `tokenloom config`)")
    g.add_argument("--config", metavar="FILE", help="TOML config file")
    g.add_argument("--model", "-m", help="smollm2-135m (default), a .gguf file, a Hugging Face directory, or a "
                                          "Hugging Face id: org/name, org/name:Q4_K_M (one GGUF), org/name/file.gguf")
    g.add_argument("--revision", help="the Hugging Face id's branch, tag or commit hash (default: main)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--block-size", type=int)
    g.add_argument("--kv-cache-memory-mb", type=int)
    g.add_argument("--num-kv-blocks", type=int, help="fix the KV pool size (overrides the memory budget)")
    g.add_argument("--seed", type=int)
    g.add_argument("--threads", type=int, help="torch intra-op threads")
    g.add_argument("--scheduler", help="continuous, static, ...")
    g.add_argument("--cache-manager", help="paged, contiguous, ...")
    g.add_argument("--decoder", help="standard, ...")
    g.add_argument("--enable-decoder", action="append", metavar="NAME",
                   help="load a decoder that needs a second model (speculative) at start-up, so that "
                        "requests may name it (repeatable)")
    g.add_argument("--backend", help="torch, ...")
    g.add_argument("--quantizer", help="gguf, none, int8, rtn, fp8, gptq, awq (default: what the checkpoint says)")
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="how the model writes tool calls: auto (by the chat template), hermes, mistral, llama3_json")
    g.add_argument("--grammar-backend", metavar="NAME", help="structured outputs: xgrammar (default) or llguidance")
    g.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter under NAME (repeatable); requests name it in `model`")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="adapters may be loaded at run time (POST /v1/load_lora_adapter) without any at start-up")
    g.add_argument("--max-loras", type=int, help="adapters resident at once (least recently used evicted)")
    g.add_argument("--max-lora-rank", type=int, help="the largest adapter rank accepted")
    g.add_argument("--lora-merge", action=argparse.BooleanOptionalAction, default=None,
                   help="fold the one --lora adapter into the base weights (a single-adapter deployment)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], help="KV cache storage (auto: the dtype)")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="publish each step's output while the next step runs (default on)")
    g.add_argument("--capture", action=argparse.BooleanOptionalAction, default=None,
                   help="run a decode step as the backend's captured step, no Python between ops "
                        "(default on; --no-capture is vLLM's --enforce-eager)")
    g.add_argument("--engine-process", choices=["auto", "inline", "separate"],
                   help="run the engine core in this process or its own (default auto: separate for "
                        "`tokenloom serve`, inline elsewhere)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's tokens do not depend on the batch it runs in nor on the decoder "
                        "(reproducible runs; slower, see docs/quantization.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N",
                   help="split the model over N ranks (processes; gloo on CPUs, NCCL on GPUs)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set scheduler.max_num_seqs=8 (TOML value)")


def flags_layer(args: argparse.Namespace) -> dict[str, Any]:
    layers = []
    for dest, key in ENGINE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            layers.append(nested(key, value))
    loras = getattr(args, "lora", None) or []
    if loras or getattr(args, "enable_lora", None):
        modules = {}
        for item in loras:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--lora takes NAME=PATH, got {item!r}")
            modules[name] = path
        layers.append({"adapter": {"name": "lora", **({"modules": modules} if modules else {})}})
    if any(getattr(args, k, None) is not None for k in ("max_loras", "max_lora_rank", "lora_merge")) \
            and not (loras or getattr(args, "enable_lora", None)):
        layers.append({"adapter": {"name": "lora"}})
    layers += [parse_override(item) for item in args.set]
    return merge_layers(*layers)


def progress_bar(desc: str):
    """A loader's ``progress(done, total)`` callback drawing a tqdm bar on stderr."""
    from tqdm import tqdm

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def api_key_from(path: str | None) -> str | None:
    """The API key: the file's contents when ``--api-key-file`` is given, else $TOKENLOOM_API_KEY."""
    from tokenloom.core import env

    if path:
        return Path(path).read_text().strip() or None
    return env.api_key()
