"""Start-up: config layers -> EngineConfig -> model, runner and strategy objects."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from dataclasses import dataclass

import msgspec
import structlog
import torch

from tokenloom.core import contracts, env
from tokenloom.core.config import EngineConfig, build_config, load_toml
from tokenloom.core.errors import ConfigError
from tokenloom.core.executor import (
    MultiprocExecutor,
    UniprocExecutor,
    init_group,
    rank_device,
    report_load,
    serve_rank,
    start_workers,
    stop_group,
    torchrun_env,
)
from tokenloom.core.interfaces import (
    PREFIX_CACHING_OPTION,
    AdapterManager,
    Backend,
    CacheManager,
    Decoder,
    DecoderContext,
    Executor,
    Quantizer,
    Scheduler,
)
from tokenloom.core.loader.resolve import resolve_model_path
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.plugins import PluginManager
from tokenloom.core.runner import ModelRunner, load_checkpoint, pick_device, pick_dtype
from tokenloom.core.tokenizer import Tokenizer
from tokenloom.core.utils import tensor_bytes

log = structlog.get_logger("tokenloom.build")


def config_from_sources(pm: PluginManager, config_file=None, flags: dict | None = None,
                        kwargs: dict | None = None, defaults: dict | None = None) -> EngineConfig:
    """kwargs > flags > file > ``defaults`` (a command's own, e.g. serve's decoder) > defaults."""
    file_layer = load_toml(config_file) if config_file else {}
    return build_config(pm, defaults or {}, file_layer, flags or {}, kwargs or {})


@dataclass(slots=True)
class EngineParts:
    tokenizer: Tokenizer
    model_config: ModelConfig
    model_name: str
    max_model_len: int
    runner: ModelRunner  # rank 0's
    cache: CacheManager
    scheduler: Scheduler
    decoder: Decoder
    executor: Executor  # UniprocExecutor or MultiprocExecutor (core/executor.py)


@dataclass(slots=True)
class SecondModel:
    """A model a decoder loaded beside the target (a draft model): its own runner (weights,
    KV pool, sampler) and its own cache manager over that pool (:data:`SECOND_MODEL_CACHE_MANAGER`,
    prefix caching off: :func:`cache_without_prefix_caching`)."""

    runner: ModelRunner
    cache: CacheManager
    tokenizer: Tokenizer
    name: str
    memory_bytes: int = 0  # its tensors: weights and KV pool (core.utils.tensor_bytes)


#: the registered cache manager a second model's pool gets (with prefix caching off)
SECOND_MODEL_CACHE_MANAGER = "paged"


def cache_without_prefix_caching(pm: PluginManager, name: str, num_blocks: int, block_size: int) -> CacheManager:
    """Build cache manager ``name`` from the registry with its options' defaults and prefix
    caching off, through the documented switch (:data:`PREFIX_CACHING_OPTION` in its options
    struct, see ``CacheManager``; a manager without the switch gets its defaults). A draft
    model needs this: its tokens past the agreed prefix are rolled back and overwritten, so
    no block of it may be registered for reuse. Raises ConfigError when the manager built
    still says ``prefix_caching``."""
    entry = pm.get("cache_manager", name)
    options = None
    if entry.options is not None:
        try:
            options = msgspec.convert({PREFIX_CACHING_OPTION: False}, entry.options)
        except msgspec.ValidationError:  # no such switch: its defaults, checked below
            options = msgspec.convert({}, entry.options)
    cache = entry.factory(options, num_blocks, block_size)
    if cache.prefix_caching:
        raise ConfigError(f"cache manager {name!r} cannot turn prefix caching off (its options need a "
                          f"bool {PREFIX_CACHING_OPTION!r} field)")
    return cache


def load_second_model(config: EngineConfig, pm: PluginManager, backend, device, *, model: str | None = None,
                      quantizer: str | None = None, dtype: str = "auto", num_kv_blocks: int = 512,
                      num_layers: int | None = None) -> SecondModel:
    """Load ``model`` (default: the engine's) with ``quantizer`` (default: what its checkpoint
    says) on the engine's device and backend, with a KV pool of ``num_kv_blocks`` blocks of
    the engine's block size. ``num_layers`` keeps only the first N transformer layers (a
    layer-truncated draft of the same model). Call it on the step thread (a decoder's
    constructor is)."""
    e = config.engine
    if e.batch_invariant:
        # A draft only proposes tokens, which the target verifies (greedy: its own argmax
        # either way): it needs no invariance, so it gets a backend of its own without the
        # mode (any weights; its captured step on).
        assert config.backend.options is not None  # (a backend with the mode has options)
        options = msgspec.structs.replace(config.backend.options, batch_invariant=False)
        backend = contracts.build(pm.get("backend", config.backend.name), options, device)
    torch_dtype = pick_dtype(dtype, device)
    ckpt = load_checkpoint(resolve_model_path(model or e.model, None if model else e.revision),
                           contracts.model_formats(pm), torch_dtype, models=contracts.model_registry(pm))
    if num_layers is not None:
        if not 1 <= num_layers <= ckpt.config.num_layers:
            raise ValueError(f"num_layers must be in 1..{ckpt.config.num_layers}, got {num_layers}")
        keep = {f"model.layers.{i}." for i in range(num_layers)}
        ckpt.weights = {k: v for k, v in ckpt.weights.items()
                        if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
        ckpt.config = dataclasses.replace(ckpt.config, num_layers=num_layers)
    method = quantizer or ckpt.quant_method or "none"
    q = contracts.build(pm.get("quantizer", method), None)
    max_len = min(e.max_model_len or ckpt.config.max_position_embeddings, ckpt.config.max_position_embeddings)
    runner = ModelRunner(ckpt, backend=backend, quantizer=q, dtype=torch_dtype, device=device,
                         block_size=e.block_size, max_model_len=max_len, seed=e.seed + 1, capture=e.capture)
    runner.allocate_kv_cache(num_kv_blocks)
    cache = cache_without_prefix_caching(pm, SECOND_MODEL_CACHE_MANAGER, num_kv_blocks, e.block_size)
    held = tensor_bytes(runner.model, runner.kv_caches)
    log.info("second_model_loaded", model=ckpt.name, num_kv_blocks=num_kv_blocks, memory_bytes=held)
    return SecondModel(runner, cache, ckpt.tokenizer, ckpt.name, held)


@dataclass(slots=True)
class LoadedRunner:
    runner: ModelRunner
    tokenizer: Tokenizer
    model_config: ModelConfig  # the whole model's (the runner's cfg is this rank's share)
    name: str
    format: str
    quantization: str
    max_model_len: int


def build_runner(config: EngineConfig, pm: PluginManager, tp: TensorParallel, device, progress=None) -> LoadedRunner:
    """Load the checkpoint and build this rank's runner (its share of every matmul); every
    rank of a tensor-parallel group calls this with its own ``tp``. No KV pool yet."""
    e = config.engine
    dtype = pick_dtype(e.dtype, device)
    backend_entry = pm.get("backend", config.backend.name)
    ckpt = load_checkpoint(resolve_model_path(e.model, e.revision), contracts.model_formats(pm), dtype, progress,
                           models=contracts.model_registry(pm))
    mcfg, tokenizer, name, fmt = ckpt.config, ckpt.tokenizer, ckpt.name, ckpt.format
    max_model_len = min(e.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    backend: Backend = contracts.build(backend_entry, batch_invariant_options(config, device, tp), device)
    # The quantisation method: [quantizer] if given, else what the checkpoint says it is.
    method = config.quantizer.name if config.quantizer is not None else (ckpt.quant_method or "none")
    quantizer: Quantizer = contracts.build(pm.get("quantizer", method),
                                           config.quantizer.options if config.quantizer else None)
    adapters: AdapterManager | None = None
    if config.adapter is not None:
        adapters = contracts.build(pm.get("adapter", config.adapter.name), config.adapter.options)
        if adapters.merged:  # one adapter folded into the checkpoint's tensors, before the model is built
            adapters.merge(ckpt.weights)
    runner = ModelRunner(ckpt, backend=backend, quantizer=quantizer, dtype=dtype, device=device,
                         block_size=e.block_size, max_model_len=max_model_len, seed=e.seed, tp=tp,
                         capture=e.capture)
    if adapters is not None:
        runner.attach_adapters(adapters)
    return LoadedRunner(runner, tokenizer, mcfg, name, fmt, method, max_model_len)


def batch_invariant_options(config: EngineConfig, device, tp: TensorParallel) -> msgspec.Struct | None:
    """The backend's options, with ``batch_invariant`` set from ``engine.batch_invariant``: a
    backend takes part through a bool ``batch_invariant`` field in its options struct (the
    torch backend has one). Raises ConfigError, naming it, for what the mode cannot make
    invariant: a backend without the field, tensor parallelism, a CUDA device. The mode in
    force is written back to ``engine.batch_invariant``, which the rest of start-up reads."""
    options = config.backend.options
    if not (config.engine.batch_invariant or getattr(options, "batch_invariant", False)):
        return options  # (the backend's own field set directly is the same request, checked alike)
    name = config.backend.name
    if options is None or "batch_invariant" not in type(options).__struct_fields__:
        raise ConfigError(f"batch_invariant: backend {name!r} has no batch-invariant mode (the torch backend has)")
    if tp.enabled or config.engine.tensor_parallel_size > 1:
        raise ConfigError("batch_invariant: not with tensor parallelism (tensor_parallel_size > 1): the "
                          "all-reduced partial sums and the sharded kernels are not checked for it")
    if config.adapter is not None:
        raise ConfigError("batch_invariant: not with adapters (their steps run op by op, through other kernels "
                          "than the mode's)")
    if torch.device(device).type != "cpu":
        raise ConfigError(f"batch_invariant: not on device {str(device)!r}: the mode's kernels are CPU ones")
    config.engine.batch_invariant = True
    return msgspec.structs.replace(options, batch_invariant=True)


def _start_executor(config: EngineConfig, pm: PluginManager, device, threads: int | None,
                    progress) -> tuple[LoadedRunner, Executor, TensorParallel]:
    """One rank (uniproc), ranks started here (multiproc), or this process as rank 0 of a
    group torchrun started. Under torchrun every other rank serves rank 0 from here and
    exits when rank 0 stops: it never becomes an engine."""
    loaded: LoadedRunner | None  # rank 0's runner: None while a group's ranks load
    workers: list[subprocess.Popen]  # the ranks this process started (none under torchrun)
    e = config.engine
    launched = torchrun_env()
    if launched is not None and launched[1] == 1:
        launched = None  # torchrun with one process: this process starts its own ranks
    world = launched[1] if launched is not None else e.tensor_parallel_size
    if launched is not None and e.tensor_parallel_size not in (1, world):
        raise ConfigError(f"tensor_parallel_size is {e.tensor_parallel_size} but torchrun started {world} processes")
    if world == 1:
        loaded = build_runner(config, pm, TensorParallel(), device, progress)
        return loaded, UniprocExecutor(loaded.runner), TensorParallel()
    before = torch.get_num_threads()
    # each rank its share of the cores (torchrun already set OMP_NUM_THREADS per process)
    per_rank = max(1, threads or (before if launched else (os.cpu_count() or before) // world))
    torch.set_num_threads(per_rank)
    if launched is not None:
        rank, workers, init_method = launched[0], [], "env://"
        if rank > 0:
            ok = serve_rank(rank, world, init_method, config, e.distributed_timeout_s, per_rank, pm)
            raise SystemExit(0 if ok else 1)
    else:
        init_method, workers = start_workers(world, config, e.distributed_timeout_s, per_rank)
    device = rank_device(device, 0)
    try:
        groups = init_group(0, world, init_method, e.distributed_timeout_s, device)
    except Exception as exc:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        gone = [f"rank {r} exited with code {p.returncode}" for r, p in enumerate(workers, start=1)
                if p.poll() is not None]  # before the rest are killed: those exited on their own
        for p in workers:
            p.kill()
            p.wait()
        raise ConfigError(f"tensor parallelism: the {world} ranks did not meet within {e.distributed_timeout_s:g} s "
                          f"({'; '.join(gone) or type(exc).__name__}): {exc}") from exc
    tp = TensorParallel(0, world, groups.model)
    loaded, status = None, "ok"
    try:
        loaded = build_runner(config, pm, tp, device, progress)
    except Exception as exc:  # noqa: BLE001 - the other ranks hear of it, then it is raised
        status, error = f"rank 0: {type(exc).__name__}: {exc}", exc
    try:
        failed = [s for s in report_load(status, groups.startup) if s != "ok"]
    except Exception as exc:  # a rank died while loading: its socket closed
        failed = [f"a rank exited while loading ({type(exc).__name__})"]
    if failed or loaded is None:  # every rank heard it and leaves; so does this one (no runner: rank 0 failed)
        stop_group(groups.commands, workers, healthy=False, threads_before=before)
        if loaded is None:
            raise error
        raise ConfigError(f"tensor parallelism: a rank could not load the model: {failed[0]}")
    log.info("tensor_parallel_started", world_size=world, init_method=init_method, threads_per_rank=per_rank)
    return loaded, MultiprocExecutor(loaded.runner, tp, groups.commands, workers, e.distributed_timeout_s,
                                     threads_before=before), tp


def per_request_decoders(config: EngineConfig, pm: PluginManager) -> tuple[tuple[str, ...], dict[str, str]]:
    """The decoders a request may name besides the engine's own (built at start-up), and those
    it may not, with the reason: one that loads a second model unless ``enable_decoders``
    lists it. Raises ConfigError for a listed name that is no registered decoder."""
    entries = pm.entries("decoder")
    enabled = config.engine.enable_decoders
    for name in enabled:
        pm.get("decoder", name)  # UnknownPluginError (a ConfigError) naming the known ones
    own = config.decoder.name
    allowed = tuple(n for n, entry in entries.items() if n != own and (not entry.loads_model or n in enabled))
    disabled = {n: (f"it loads a second model and this server did not enable it at start-up "
                    f"(--enable-decoder {n}, or enable_decoders = [\"{n}\"] in the config)")
                for n, entry in entries.items() if n != own and entry.loads_model and n not in enabled}
    return allowed, disabled


def build_engine_parts(config: EngineConfig, pm: PluginManager, progress=None) -> EngineParts:
    e = config.engine
    threads = e.num_threads or env.num_threads()
    if threads:
        torch.set_num_threads(threads)
    loaded, executor, tp = _start_executor(config, pm, pick_device(e.device), threads, progress)
    try:
        return _build_rest(config, pm, loaded, executor, tp)
    except BaseException:
        executor.close()  # the other ranks stop too
        raise


def _build_rest(config: EngineConfig, pm: PluginManager, loaded: LoadedRunner, executor, tp) -> EngineParts:
    e = config.engine
    runner, mcfg, name = loaded.runner, loaded.model_config, loaded.name
    dtype, device, backend = runner.dtype, runner.device, runner.backend
    # Last, the KV pool: sized from what is left once the weights are in place (for the rank
    # with the most KV heads: every rank holds the same number of blocks).
    num_blocks = e.num_kv_blocks or ModelRunner.num_blocks_for(backend, tp.largest_config(mcfg), dtype, e.block_size,
                                                               e.kv_cache_memory_mb, e.kv_cache_dtype)
    executor.allocate_kv_cache(num_blocks, e.kv_cache_dtype)
    cache: CacheManager = contracts.build(pm.get("cache_manager", config.cache_manager.name),
                                          config.cache_manager.options, num_blocks, e.block_size)
    # scheduler.max_num_seqs / max_num_batched_tokens left at 0 (auto): from this pool and machine
    from tokenloom.planner.serving import resolve_auto

    options, chosen = resolve_auto(config.scheduler.options, num_blocks, e.block_size,
                                   max_model_len=loaded.max_model_len, device_type=device.type,
                                   cores=torch.get_num_threads())
    if chosen is not None:
        config.scheduler.options = options  # engine.config shows the values in force
        log.info("scheduler_limits", scheduler=config.scheduler.name, max_num_seqs=options.max_num_seqs,
                 max_num_batched_tokens=options.max_num_batched_tokens, why=chosen)
    scheduler: Scheduler = contracts.build(pm.get("scheduler", config.scheduler.name), config.scheduler.options,
                                           cache, config)
    per_request, disabled = per_request_decoders(config, pm)
    context = DecoderContext(config=config, plugin_manager=pm, model_config=mcfg, cache=cache, runner=runner,
                             load_model=lambda **kw: load_second_model(config, pm, backend, device, **kw),
                             model_name=name, executor=executor, per_request_decoders=per_request,
                             disabled_decoders=disabled)
    decoder: Decoder = contracts.build(pm.get("decoder", config.decoder.name), config.decoder.options, context)
    log.info("engine_built", model=name, format=loaded.format, quantization=loaded.quantization, device=str(device),
             dtype=str(dtype), num_kv_blocks=num_blocks, block_size=e.block_size, max_model_len=loaded.max_model_len,
             tensor_parallel_size=executor.world_size, captured_step=runner.captured,
             batch_invariant=e.batch_invariant,
             **{role: strategy for role, strategy in config.selection().items()})
    return EngineParts(loaded.tokenizer, mcfg, name, loaded.max_model_len, runner, cache, scheduler, decoder, executor)
