"""Start-up: config layers -> EngineConfig -> model, runner and strategy objects."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from tokenloom.core import env
from tokenloom.core.config import EngineConfig, build_config, load_toml
from tokenloom.core.interfaces import DecoderContext
from tokenloom.core.loader.resolve import resolve_model_path
from tokenloom.core.plugins import PluginManager
from tokenloom.core.runner import ModelRunner, load_checkpoint, pick_device, pick_dtype

log = structlog.get_logger("tokenloom.build")


def config_from_sources(pm: PluginManager, config_file=None, flags: dict | None = None,
                        kwargs: dict | None = None) -> EngineConfig:
    """kwargs > flags > file > defaults."""
    file_layer = load_toml(config_file) if config_file else {}
    return build_config(pm, file_layer, flags or {}, kwargs or {})


@dataclass(slots=True)
class EngineParts:
    tokenizer: Any
    model_config: Any
    model_name: str
    max_model_len: int
    runner: ModelRunner
    cache: Any
    scheduler: Any
    decoder: Any


@dataclass(slots=True)
class SecondModel:
    """A model a decoder loaded beside the target (a draft model): its own runner (weights,
    KV pool, sampler) and its own cache manager over that pool, prefix caching off."""

    runner: ModelRunner
    cache: Any
    tokenizer: Any
    name: str


def load_second_model(config: EngineConfig, pm: PluginManager, backend, device, *, model: str | None = None,
                      quantizer: str | None = None, dtype: str = "auto", num_kv_blocks: int = 512,
                      num_layers: int | None = None) -> SecondModel:
    """Load ``model`` (default: the engine's) with ``quantizer`` (default: what its checkpoint
    says) on the engine's device and backend, with a KV pool of ``num_kv_blocks`` blocks of
    the engine's block size. ``num_layers`` keeps only the first N transformer layers (a
    layer-truncated draft of the same model). Call it on the step thread (a decoder's
    constructor is)."""
    from tokenloom.plugins.cache.paged import PagedOptions

    e = config.engine
    torch_dtype = pick_dtype(dtype, device)
    formats = {name: entry.factory for name, entry in pm.entries("model_format").items()}
    ckpt = load_checkpoint(resolve_model_path(model or e.model), formats, torch_dtype)
    if num_layers is not None:
        if not 1 <= num_layers <= ckpt.config.num_layers:
            raise ValueError(f"num_layers must be in 1..{ckpt.config.num_layers}, got {num_layers}")
        keep = {f"model.layers.{i}." for i in range(num_layers)}
        ckpt.weights = {k: v for k, v in ckpt.weights.items()
                        if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
        ckpt.config = dataclasses.replace(ckpt.config, num_layers=num_layers)
    method = quantizer or ckpt.quant_method or "none"
    q = pm.get("quantizer", method).factory(None)
    max_len = min(e.max_model_len or ckpt.config.max_position_embeddings, ckpt.config.max_position_embeddings)
    runner = ModelRunner(ckpt, backend=backend, quantizer=q, dtype=torch_dtype, device=device,
                         block_size=e.block_size, max_model_len=max_len, seed=e.seed + 1)
    runner.allocate_kv_cache(num_kv_blocks)
    cache = pm.get("cache_manager", "paged").factory(PagedOptions(enable_prefix_caching=False), num_kv_blocks,
                                                     e.block_size)
    return SecondModel(runner, cache, ckpt.tokenizer, ckpt.name)


def build_engine_parts(config: EngineConfig, pm: PluginManager, progress=None) -> EngineParts:
    e = config.engine
    threads = e.num_threads or env.num_threads()
    if threads:
        torch.set_num_threads(threads)
    device = pick_device(e.device)
    dtype = pick_dtype(e.dtype, device)
    backend_entry = pm.get("backend", config.backend.name)
    path = resolve_model_path(e.model)
    formats = {name: entry.factory for name, entry in pm.entries("model_format").items()}
    ckpt = load_checkpoint(path, formats, dtype, progress)
    mcfg = ckpt.config
    max_model_len = min(e.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    backend = backend_entry.factory(config.backend.options, device)
    tokenizer, name = ckpt.tokenizer, ckpt.name
    # The quantisation method: [quantizer] if given, else what the checkpoint says it is.
    method = config.quantizer.name if config.quantizer is not None else (ckpt.quant_method or "none")
    quantizer = pm.get("quantizer", method).factory(config.quantizer.options if config.quantizer else None)
    runner = ModelRunner(ckpt, backend=backend, quantizer=quantizer, dtype=dtype, device=device,
                         block_size=e.block_size, max_model_len=max_model_len, seed=e.seed)
    # Last, the KV pool: sized from what is left once the weights are in place.
    num_blocks = e.num_kv_blocks or ModelRunner.num_blocks_for(mcfg, dtype, e.block_size, e.kv_cache_memory_mb,
                                                               e.kv_cache_dtype)
    runner.allocate_kv_cache(num_blocks, e.kv_cache_dtype)
    cache = pm.get("cache_manager", config.cache_manager.name).factory(
        config.cache_manager.options, num_blocks, e.block_size)
    scheduler = pm.get("scheduler", config.scheduler.name).factory(config.scheduler.options, cache, config)
    context = DecoderContext(config=config, plugin_manager=pm, model_config=mcfg, cache=cache, runner=runner,
                             load_model=lambda **kw: load_second_model(config, pm, backend, device, **kw),
                             model_name=name)
    decoder = pm.get("decoder", config.decoder.name).factory(config.decoder.options, context)
    log.info("engine_built", model=name, format=ckpt.format, quantization=method, device=str(device), dtype=str(dtype),
             num_kv_blocks=num_blocks, block_size=e.block_size, max_model_len=max_model_len,
             **{role: strategy for role, strategy in config.selection().items()})
    return EngineParts(tokenizer, mcfg, name, max_model_len, runner, cache, scheduler, decoder)
