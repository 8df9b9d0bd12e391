"""Memory planner: what a model needs before it is loaded -- its weights in each format
(weights.py), its KV cache per token, block and request, an overhead estimate, and how many
requests a memory budget admits. Everything comes from the checkpoint's header
(checkpoint.py): no weight is read, nothing is dequantised. ``tokenloom plan`` prints it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenloom.core.config import EngineOptions
from tokenloom.core.errors import ClientError
from tokenloom.core.interfaces import Backend
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.runner import DTYPES, ModelRunner, pick_device, pick_dtype
from tokenloom.core.utils import cdiv
from tokenloom.planner.checkpoint import CheckpointInfo, GGUFTensorInfo, read_checkpoint
from tokenloom.planner.serving import serving_defaults
from tokenloom.planner.weights import (
    FORMATS,
    KNOWN_QUANTIZERS,
    WeightRow,
    num_params,
    weight_rows,
)
from tokenloom.plugins.decoders.speculative import SpeculativeOptions

__all__ = ["FORMATS", "KNOWN_QUANTIZERS", "CheckpointInfo", "GGUFTensorInfo", "MemoryPlan", "Overhead",
           "PlanOptions", "WeightRow", "num_params", "overhead", "plan", "read_checkpoint", "weight_rows"]

MiB, GiB = 1 << 20, 1 << 30
#: A fixed allowance for the runtime itself: the CUDA context and allocator slack on a GPU,
#: the interpreter and torch's own resident memory on a CPU. A round estimate, not measured.
RUNTIME_OVERHEAD_BYTES = 512 * MiB
_ENGINE, _DRAFT = EngineOptions(), SpeculativeOptions()  # the defaults
#: a pool too large to bind: serving_defaults then gives the machine's caps
_UNBOUNDED_BLOCKS = 1 << 40


@dataclass(slots=True)
class Overhead:
    """An estimate (see :func:`overhead`), at the scheduler limits it names."""

    activation_bytes: int
    attention_bytes: int
    logits_bytes: int
    rope_bytes: int
    runtime_bytes: int
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0

    @property
    def total(self) -> int:
        return self.activation_bytes + self.attention_bytes + self.logits_bytes + self.rope_bytes + self.runtime_bytes


def overhead(cfg: ModelConfig, dtype_bytes: int, *, max_num_batched_tokens: int, max_num_seqs: int,
             context: int, max_model_len: int) -> Overhead:
    """An estimate of the memory beside weights and KV cache, with T = max_num_batched_tokens
    (the largest step), b the compute dtype's bytes:

    - activations of the largest step, the live set inside one layer:
      ``T * (2 * hidden * 4 + (q + 2 kv) * 4 + 3 * inter * b)`` -- the float32 residual
      stream and its delta, q/k/v after RoPE (float32), the gate_up output and silu*up;
    - attention scores of a prefill chunk over a whole request: ``heads * T * context * 4``;
    - logits: ``max_num_seqs`` rows ``* vocab * 4`` (float32);
    - RoPE tables: ``2 * max_model_len * head_dim * 4``;
    - a fixed runtime allowance, :data:`RUNTIME_OVERHEAD_BYTES`.
    """
    t = max_num_batched_tokens
    act = t * (2 * cfg.hidden_size * 4 + (cfg.q_size + 2 * cfg.kv_size) * 4 + 3 * cfg.intermediate_size * dtype_bytes)
    return Overhead(act, cfg.num_heads * t * context * 4, max_num_seqs * cfg.vocab_size * 4,
                    2 * max_model_len * cfg.head_dim * 4, RUNTIME_OVERHEAD_BYTES, max_num_seqs, max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What to plan for; defaults are the engine's (EngineOptions, ContinuousOptions).
    ``dtype`` ``auto`` resolves as the engine does on this machine. The KV pool: ``memory``
    (GiB for weights + overhead + KV), else ``kv_cache_memory_mb``, else the engine's default.
    ``max_num_seqs`` / ``max_num_batched_tokens`` 0: auto, as the engine picks them for the
    pool on this machine (planner/serving.py)."""

    quantizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = _ENGINE.block_size
    context: int | None = None  # tokens per request; None: min(1024, max_model_len)
    max_model_len: int = 0  # 0: the model's context length
    memory: float | None = None
    kv_cache_memory_mb: int | None = None
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


@dataclass(slots=True)
class MemoryPlan:
    model: str
    format: str
    config: ModelConfig
    num_params: int
    dtype: str
    quantizer: str
    weights: list[WeightRow]
    weight_bytes: int  # the selected row's
    kv_cache_dtype: str
    block_size: int
    kv_bytes_per_token: int  # = ModelRunner.kv_bytes_per_token
    kv_bytes_per_block: int
    context: int
    blocks_per_request: int  # paged: ceil(context / block_size)
    kv_bytes_per_request: int
    max_model_len: int
    contiguous_blocks_per_request: int  # ceil(max_model_len / block_size)
    overhead: Overhead
    kv_budget_source: str  # memory | kv_cache_memory_mb | default
    kv_cache_memory_mb: int
    num_kv_blocks: int  # ModelRunner.num_blocks_for(kv_cache_memory_mb)
    max_requests_paged: int
    max_requests_contiguous: int
    paged_over_contiguous: float | None
    max_num_seqs: int  # in force: as given, or what the engine would pick for this pool (auto)
    max_num_batched_tokens: int
    # why each limit is what it is: "set", or the auto rule's reason ("KV pool holds ...")
    limits_reasons: dict[str, str]
    memory_bytes: int | None = None
    # a draft model (`--enable-decoder speculative`): its weights as its quantizer holds them
    # plus its own KV pool (speculative's draft_num_kv_blocks), loaded at start-up beside the model
    draft_model: str | None = None
    draft_bytes: int = 0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["overhead"]["total"] = self.overhead.total
        return out


def kv_layout() -> Backend:
    """The backend whose KV pool the plan sizes (``Backend.kv_bytes_per_token``): ``torch``,
    the engine's default (``triton`` keeps the same pool), built without its C++ ops."""
    from tokenloom.backends.torch_backend import TorchBackend, TorchBackendOptions

    return TorchBackend(TorchBackendOptions(decode_attention="torch", cpu_linear="mkl"))


def _at_least(param: str, value, low) -> None:
    if value is not None and value < low:
        raise ClientError.bad_value(param, value, f">= {low}")


def draft_bytes(draft: CheckpointInfo, opts: PlanOptions) -> int:
    """What a draft model takes beside the target (`speculative`, with its default options):
    its weights as ``draft_quantizer`` holds them, and its KV pool of ``draft_num_kv_blocks``."""
    dtype = pick_dtype(_DRAFT.draft_dtype, pick_device("auto"))
    rows = weight_rows(draft, _DRAFT.draft_quantizer if draft.format == "gguf" else None, torch.finfo(dtype).bits // 8)
    kv = ModelRunner.kv_bytes_per_token(kv_layout(), draft.config, dtype, opts.kv_cache_dtype)
    return next(r for r in rows if r.selected).bytes + kv * opts.block_size * _DRAFT.draft_num_kv_blocks


def plan(info: CheckpointInfo, opts: PlanOptions = PlanOptions(), draft: CheckpointInfo | None = None) -> MemoryPlan:
    """The memory plan. KV per token is ``ModelRunner.kv_bytes_per_token`` in the torch
    backend's pool (:func:`kv_layout`: 2 * layers * kv heads * head_dim * bytes, plus the
    8-bit pools' bfloat16 scales); the pool holds
    ``ModelRunner.num_blocks_for(kv_cache_memory_mb)`` blocks, the engine's own rule; with
    ``memory``, kv_cache_memory_mb is what is left after the weights and the overhead
    estimate, in whole MiB. A request of ``context`` tokens takes ``ceil(context / block_size)``
    blocks when paged (allocated as it grows), while `contiguous` (plugins/cache/contiguous.py)
    reserves ``ceil((prompt + max_tokens) / block_size)`` at admission -- ``max_model_len`` for a
    request that leaves max_tokens open (the OpenAI API's default): pass the declared length as
    ``max_model_len`` to plan for another. Each count is ``num_kv_blocks // blocks per request``.
    ``draft``: a draft model loaded beside it (:func:`draft_bytes`), counted before the KV pool.

    :raises ClientError: naming the option at fault (``param``).
    """
    for param, low in (("block_size", 1), ("context", 1), ("max_model_len", 0), ("kv_cache_memory_mb", 1),
                       ("max_num_seqs", 0), ("max_num_batched_tokens", 0)):
        _at_least(param, getattr(opts, param), low)
    if opts.memory is not None and not opts.memory > 0:
        raise ClientError.bad_value("memory", opts.memory, "> 0 (GiB)")
    if opts.memory is not None and opts.kv_cache_memory_mb is not None:
        raise ClientError("memory and kv_cache_memory_mb exclude each other: give one", param="memory")
    if opts.kv_cache_dtype not in ("auto", "fp8", "int8"):
        raise ClientError.bad_value("kv_cache_dtype", opts.kv_cache_dtype, "auto, fp8 or int8")
    if opts.dtype != "auto" and opts.dtype not in DTYPES:
        raise ClientError.bad_value("dtype", opts.dtype, f"auto or one of {', '.join(DTYPES)}")
    cfg, bs = info.config, opts.block_size
    dtype = pick_dtype(opts.dtype, pick_device("auto"))
    db = torch.finfo(dtype).bits // 8
    max_len = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    context = opts.context or min(1024, max_len)
    if context > max_len:
        raise ClientError(f"context ({context}) is longer than max_model_len ({max_len})", param="context", value=context)
    rows = weight_rows(info, opts.quantizer, db)
    weights = next(r for r in rows if r.selected).bytes
    layout = kv_layout()
    kv_token = ModelRunner.kv_bytes_per_token(layout, cfg, dtype, opts.kv_cache_dtype)
    device_type, cores = pick_device("auto").type, torch.get_num_threads()

    def limits(num_blocks: int) -> tuple[int, int, dict[str, str]]:
        """The scheduler limits for a pool of ``num_blocks``: given, else the engine's auto rule."""
        auto = serving_defaults(num_blocks=num_blocks, block_size=bs, max_model_len=max_len,
                                device_type=device_type, cores=cores)
        seqs, toks = opts.max_num_seqs or auto.max_num_seqs, opts.max_num_batched_tokens or auto.max_num_batched_tokens
        return seqs, toks, {"max_num_seqs": "set" if opts.max_num_seqs else auto.seqs_reason,
                            "max_num_batched_tokens": "set" if opts.max_num_batched_tokens else auto.tokens_reason}

    # With --memory the pool is what the overhead leaves, so the overhead is estimated at the
    # most the auto rule may pick (the machine's caps); otherwise at what it picks for the pool.
    seqs, toks, _ = limits(_UNBOUNDED_BLOCKS)
    oh = overhead(cfg, db, max_num_batched_tokens=toks, max_num_seqs=seqs, context=context, max_model_len=max_len)
    memory_bytes = None
    extra = draft_bytes(draft, opts) if draft is not None else 0
    if opts.memory is not None:
        memory_bytes = int(opts.memory * GiB)
        if memory_bytes < weights + extra:
            raise ClientError(f"memory ({memory_bytes / GiB:.2f} GiB) is less than the weights "
                              f"({weights / GiB:.2f} GiB)", param="memory", value=opts.memory)
        kv_mb, source = (memory_bytes - weights - extra - oh.total) // MiB, "memory"
        if kv_mb < 1:
            raise ClientError(f"memory ({memory_bytes / GiB:.2f} GiB) leaves no room for a KV cache after the weights "
                              f"({weights / GiB:.2f} GiB) and the overhead estimate ({oh.total / GiB:.2f} GiB)",
                              param="memory", value=opts.memory)
    elif opts.kv_cache_memory_mb is not None:
        kv_mb, source = opts.kv_cache_memory_mb, "kv_cache_memory_mb"
    else:
        kv_mb, source = _ENGINE.kv_cache_memory_mb, "default"
    num_blocks = ModelRunner.num_blocks_for(layout, cfg, dtype, bs, kv_mb, opts.kv_cache_dtype)
    seqs, toks, why = limits(num_blocks)
    if opts.memory is None:
        oh = overhead(cfg, db, max_num_batched_tokens=toks, max_num_seqs=seqs, context=context, max_model_len=max_len)
    per_req, per_req_contig = cdiv(context, bs), cdiv(max_len, bs)
    paged, contiguous = num_blocks // per_req, num_blocks // per_req_contig
    return MemoryPlan(
        model=info.name, format=info.format, config=cfg, num_params=num_params(cfg),
        dtype=str(dtype).removeprefix("torch."), quantizer=opts.quantizer or info.quant_method or "none",
        weights=rows, weight_bytes=weights, kv_cache_dtype=opts.kv_cache_dtype, block_size=bs,
        kv_bytes_per_token=kv_token, kv_bytes_per_block=kv_token * bs, context=context,
        blocks_per_request=per_req, kv_bytes_per_request=per_req * kv_token * bs, max_model_len=max_len,
        contiguous_blocks_per_request=per_req_contig, overhead=oh, kv_budget_source=source,
        kv_cache_memory_mb=kv_mb, num_kv_blocks=num_blocks, max_requests_paged=paged,
        max_requests_contiguous=contiguous, paged_over_contiguous=paged / contiguous if contiguous else None,
        max_num_seqs=seqs, max_num_batched_tokens=toks, limits_reasons=why,
        memory_bytes=memory_bytes, draft_model=draft.name if draft is not None else None, draft_bytes=extra)
