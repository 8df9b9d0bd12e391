"""`tokenloom bench lora`: what serving many LoRA adapters in one batch costs a decode step.

One engine with ``--adapters`` random adapters loaded (PEFT's format, written to a temporary
directory: rank ``--rank`` on the ``--targets`` modules of every layer; by default PEFT's own
defaults for LLaMA, ``r = 8`` on ``q_proj`` and ``v_proj``; ``--targets all`` puts them on
q/k/v/o and gate/up/down, so every matmul of the step carries an update). A batch of ``--batch-size`` sequences is prefilled once per
variant, then its decode steps are timed straight through the decoder (as `bench decode
--profile` does): the base model alone, then the same batch with every row under one
adapter, and with the rows spread round-robin over 4 and 16 distinct adapters (each
variant's count capped at ``--adapters``). Variants are measured in interleaved rounds
(A, B, C, A, B, C, ...) so a slow spell of a shared machine hits each alike; the figure is
the median step time, and the ratio is against the base model's step.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenloom.core.config import merge_layers
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Batch, Sequence

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, cfg, rank: int, seed: int, targets: tuple[str, ...] = TARGETS) -> None:
    """A PEFT LoRA directory for a LLaMA-shaped ``cfg`` (ModelConfig) on ``targets``, random small weights."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    d, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, q), "mlp.gate_proj": (ffn, d), "mlp.up_proj": (ffn, d),
              "mlp.down_proj": (d, ffn)}
    tensors = {}
    for i in range(cfg.num_layers):
        for module, (out, inp) in shapes.items():
            if module.split(".")[-1] not in targets:
                continue
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}))


def run_lora(args, flags: dict, pm: PluginManager) -> dict:
    from tokenloom import LLM
    from tokenloom.core.loader.resolve import resolve_model_path

    n_adapters, batch, rank = args.adapters, args.batch_size, args.rank
    targets = TARGETS if args.targets == "all" else tuple(args.targets.split(","))
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        from tokenloom.core.errors import ConfigError

        raise ConfigError(f"--targets: unknown module {unknown[0]!r} (choose among {', '.join(TARGETS)}, or all)")
    with tempfile.TemporaryDirectory(prefix="tokenloom-bench-lora-") as tmp:
        # the model's shape first (a throwaway engine would cost a load: read the config only)
        from tokenloom.core import contracts
        from tokenloom.core.build import config_from_sources
        from tokenloom.core.runner import load_checkpoint

        config = config_from_sources(pm, args.config, flags)
        ckpt = load_checkpoint(resolve_model_path(config.engine.model, config.engine.revision),
                               contracts.model_formats(pm), torch.float32, models=contracts.model_registry(pm))
        cfg = ckpt.config
        del ckpt
        modules = {}
        for i in range(n_adapters):
            write_random_adapter(Path(tmp) / f"a{i}", cfg, rank, seed=i, targets=targets)
            modules[f"a{i}"] = str(Path(tmp) / f"a{i}")
        layer = {"adapter": {"name": "lora", "modules": modules, "max_loras": n_adapters, "max_lora_rank": rank},
                 "scheduler": {"max_num_seqs": batch}}
        llm = LLM(config_file=args.config, flags=merge_layers(flags, layer), plugin_manager=pm)
        try:
            variants = [("base model", 0)] + [(f"{k} adapter{'s' if k > 1 else ''}", k)
                                              for k in (1, 4, 16) if k <= n_adapters]
            times: dict[str, list[float]] = {name: [] for name, _ in variants}
            for _ in range(args.rounds):
                for name, k in variants:
                    times[name].append(_step_ms(llm, batch, args.prompt_len, args.steps, k))
            base = statistics.median(times["base model"])
            results = [{"variant": name, "adapters": k, "ms_per_step": statistics.median(times[name]),
                        "rounds_ms": times[name], "vs_base": statistics.median(times[name]) / base}
                       for name, k in variants]
            return {"batch_size": batch, "rank": rank, "targets": list(targets), "adapters_loaded": n_adapters,
                    "steps": args.steps,
                    "prompt_len": args.prompt_len, "rounds": args.rounds, "threads": torch.get_num_threads(),
                    "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
                    "captured_base": llm.engine.runner.captured, "results": results}
        finally:
            llm.close()


def _step_ms(llm, batch: int, prompt_len: int, steps: int, distinct: int) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` sequences, rows spread round-robin
    over ``distinct`` adapters (0: the base model)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    seqs = [Sequence(f"bench-lora-{i}", [(31 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)],
                     SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True,
                                    adapter=f"a{i % distinct}" if distinct else None)) for i in range(batch)]
    cache = engine.cache

    def run():
        for s in seqs:
            if not cache.allocate(s, prompt_len + steps + 2):
                raise RuntimeError(f"{batch} x {prompt_len + steps} tokens do not fit the KV cache")
        try:
            engine.executor.forward(Batch(seqs, [prompt_len] * batch, [cache.block_table(s) for s in seqs]))
            for s in seqs:
                s.num_computed_tokens = prompt_len
                s.append_token(7)
            took = []
            for i in range(steps + 2):
                t0 = time.perf_counter()
                engine.decoder.step(Batch(seqs, [1] * batch, [cache.block_table(s) for s in seqs]))
                if i >= 2:  # the first two: warm-up
                    took.append(time.perf_counter() - t0)
                for s in seqs:
                    s.num_computed_tokens += 1
                    s.append_token(7)
            return statistics.median(took) * 1e3
        finally:
            for s in seqs:
                cache.free(s)

    return engine.call_in_step_thread(run)


def format_lora(report: dict) -> str:
    lines = [f"decode step at batch {report['batch_size']}, {report['adapters_loaded']} adapters of rank "
             f"{report['rank']} loaded (on {', '.join(report['targets'])} of every layer), {report['dtype']}, "
             f"{report['threads']} "
             f"threads; median of {report['steps']} steps x {report['rounds']} interleaved rounds", "",
             "| rows under | ms / step | vs the base model |", "| --- | --- | --- |"]
    for r in report["results"]:
        lines.append(f"| {r['variant']} | {r['ms_per_step']:.1f} | {r['vs_base']:.2f}x |")
    return "\n".join(lines)
