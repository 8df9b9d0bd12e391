"""The roles' contracts. The hot loop calls objects that satisfy these Protocols
directly; pluggy is only used at start-up to find the factories that build them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenloom.core.outputs import Finished
from tokenloom.core.sequence import Batch, Sequence
from tokenloom.core.weights import CheckpointTensors, LinearSlot, LinearWeight, WeightSpec

if TYPE_CHECKING:  # annotations only: most of these import this module (a cycle at run time)
    import torch

    from tokenloom.core.attention import AttentionInputs
    from tokenloom.core.build import SecondModel
    from tokenloom.core.config import EngineConfig
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.engine_process import EngineClient
    from tokenloom.core.loader import LoadedCheckpoint
    from tokenloom.core.models.config import ModelConfig
    from tokenloom.core.parallel import TensorParallel
    from tokenloom.core.plugins import PluginManager
    from tokenloom.core.runner import ForwardOutput, HiddenRows, ModelRunner
    from tokenloom.core.sampling_params import Constraint
    from tokenloom.core.tools import ToolCall, ToolScan
    from tokenloom.protocols.gateway import Gateway

BLOCK_FREE, BLOCK_USED, BLOCK_CACHED = 0, 1, 2  # CacheManager.block_states() values
#: the field of a cache manager's options struct that turns its prefix caching off (see CacheManager)
PREFIX_CACHING_OPTION = "enable_prefix_caching"


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the KV block pool. Every block is in exactly one of three states,
    with the same meaning for every cache manager:

    - *used*: referenced by a live sequence's block table (or, in ``radix``, held by a tree
      node that a running sequence locked): it cannot be reclaimed;
    - *cached*: holds reusable prefix KV that no live sequence references: eviction can
      reclaim it (always 0 without prefix caching);
    - *free*: holds nothing.

    ``num_used_blocks + num_cached_blocks + num_free_blocks == num_blocks``.
    """

    num_blocks: int
    num_free_blocks: int  # blocks holding nothing
    block_size: int
    num_tokens_stored: int  # tokens whose KV lives in allocated blocks
    num_reserved_slots: int  # token slots held by allocated blocks (>= tokens stored)
    num_evictions: int = 0
    num_cached_blocks: int = 0  # blocks of reusable prefix KV no live sequence references (evictable)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # prompt tokens found there

    @property
    def num_used_blocks(self) -> int:
        """Blocks live sequences hold (neither cached nor free)."""
        return self.num_blocks - self.num_free_blocks - self.num_cached_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get without preempting anyone: free + cached (evicted)."""
        return self.num_free_blocks + self.num_cached_blocks

    @property
    def usage(self) -> float:
        """Memory pressure: the fraction of blocks in use (cached blocks are reclaimable)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        """Fraction of reserved slots that hold no token (internal + reservation waste)."""
        if not self.num_reserved_slots:
            return 0.0
        return 1.0 - self.num_tokens_stored / self.num_reserved_slots

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@runtime_checkable
class CacheManager(Protocol):
    """Owns KV block *ids* (the runner owns the tensors).

    A manager with prefix caching that can run without it declares a ``bool`` field named
    :data:`PREFIX_CACHING_OPTION` (``enable_prefix_caching``) in its registered options
    struct, and false there makes ``prefix_caching`` false (``paged`` does). A second
    model's pool (a draft model's, ``core.build.load_second_model``) is built that way."""

    block_size: int
    num_blocks: int
    prefix_caching: bool  # does claim_prefix ever find anything? (`cache-aware` requires it)

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing right now, as in :class:`CacheStats` (cheap: O(1)).
        Blocks of cached prefix KV are not free, but an allocation can still evict them:
        ``num_blocks - num_used_blocks`` blocks are allocatable."""

    @property
    def num_used_blocks(self) -> int:
        """Blocks live sequences hold right now, as in :class:`CacheStats` (cheap: O(1), the
        engine reads it every step for peak KV usage). Cached blocks are not used."""

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Could ``seq`` at its maximum length fit an otherwise empty cache?"""

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool: ...

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens +
        num_lookahead`` tokens. All or nothing: returns False (and changes nothing) when it
        cannot. Lookahead slots hold draft tokens' KV for one step: only the accepted ones
        become computed tokens (the engine advances ``num_computed_tokens`` by those), the
        rest are overwritten later, and a prefix cache registers computed tokens only."""

    def free(self, seq: Sequence) -> None: ...

    def match_prefix(self, seq: Sequence) -> int:
        """Prompt tokens a claim would find cached right now (read-only; 0 without caching)."""

    def claim_prefix(self, seq: Sequence) -> int:
        """At admission (nothing computed yet): take the longest cached prefix of ``seq``
        into its block table; returns its length in tokens (< the sequence's length)."""

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Give a new ``child`` (nothing allocated yet) the KV of ``parent``'s computed prefix,
        as far as their tokens agree and at most ``child.num_tokens - 1`` tokens; returns
        the tokens it now has KV for (0: it computes them itself). Blocks are shared by
        reference; a partial block may be copied (owed through :meth:`take_copies`). The
        engine forks the samples of an ``n > 1`` request from the first one's prefill."""

    def block_table(self, seq: Sequence) -> list[int]: ...

    def stats(self) -> CacheStats: ...

    def block_states(self) -> bytes:
        """One byte per block, in block-id order: :data:`BLOCK_FREE`, :data:`BLOCK_USED` or
        :data:`BLOCK_CACHED`, as :class:`CacheStats` defines them (its counts agree). For
        display (the playground's block map); O(num_blocks)."""

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Copy-on-write work owed since the last call, as (src block, dst block, slots):
        the runner copies those KV slots before this step's forward. A manager that never
        shares a partial block returns []."""

    def check_integrity(self) -> None:
        """Raise AssertionError when the internal bookkeeping is inconsistent."""


@runtime_checkable
class Scheduler(Protocol):
    """Decides which sequences run each step under its budgets. Per step the engine calls
    ``schedule()``, runs the batch, then ``observe(batch, step_time_s)``; at a request's end
    ``finish`` (stop/length) or ``abort``, then ``on_finished``; ``engine.stats()`` calls
    ``stats``. Every method here is required, none optional: the engine calls ``observe``
    every step and ``on_finished`` for every request without asking whether they exist, and
    start-up refuses a scheduler that lacks one (core/contracts.py). A scheduler with
    nothing to learn, count or report inherits the no-ops of ``QueueScheduler``
    (plugins/schedulers/base.py)."""

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``. Usually nothing of it is computed yet; a fork of an ``n > 1``
        request (core/engine.py) arrives holding KV already: ``num_computed_tokens > 0``
        and a block table from ``CacheManager.fork``. Schedule its remaining tokens as for
        any sequence (``claim_prefix`` is a no-op on it); freeing it is always allowed."""

    def schedule(self) -> Batch: ...

    def finish(self, seq: Sequence) -> None:
        """``seq`` is finished: drop it from the queues and give its blocks back."""

    def abort(self, request_id: str) -> Sequence | None: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def observe(self, batch: Batch, step_time_s: float) -> None:
        """After every step, with the batch that ran and the decoder's wall time for it, in
        seconds. Called before the engine applies the step's results: each sequence's
        ``num_computed_tokens`` is still where the batch started. A scheduler that plans by
        time fits its step-cost model here."""

    def on_finished(self, seq: Sequence, output: Finished) -> None:
        """Once per request that ended, for any reason, after ``finish``/``abort`` and after
        its :class:`Finished` was built: ``output.metrics`` holds the TTFT and TPOT the
        engine measured (an SLO scheduler counts targets met here)."""

    def stats(self) -> dict[str, float]:
        """Counters for ``engine.stats()`` (shown there as ``scheduler_<key>``); {} if none."""


@runtime_checkable
class Quantizer(Protocol):
    """The middle of the load pipeline: one matmul slot's raw checkpoint tensors in, a
    weight spec out (a dense tensor, QuantizedWeight or Fp8Weight), which the backend then
    packs. Chosen by the checkpoint's metadata (GGUF tensor types, quantize_config.json,
    config.json's quantization_config) or by ``[quantizer]``."""

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> WeightSpec:
        """Take the tensors of ``slot.parts`` from ``tensors`` (a CheckpointTensors: each
        part's ``.weight``, or ``.qweight``/``.qzeros``/``.scales``/``.g_idx`` for GPTQ)
        and return the fused weight [sum of the parts' out features, in features]. A
        missing or misshapen tensor raises ValueError naming it."""


@runtime_checkable
class ModelFormat(Protocol):
    """A checkpoint format (GGUF file, Hugging Face directory). The registered formats are
    asked in turn; the first whose ``claims`` is true loads the checkpoint."""

    def claims(self, path: Path) -> bool:
        """Is ``path`` a checkpoint of this format? Cheap: reads a header at most."""

    def load(self, path: Path, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None,
             models: ModelRegistry | None = None) -> LoadedCheckpoint:
        """The checkpoint's config, raw tensors (quantised ones untouched), tokenizer and
        quantisation metadata; ``progress(done, total)`` as tensors are read. ``models``:
        the registered architectures (None: those of the default plugin manager); the
        format asks it which one claims the checkpoint (``for_hf`` / ``for_gguf``), whose
        ``config_from_*`` gives the config, and sets ``LoadedCheckpoint.architecture``."""


@runtime_checkable
class CausalLM(Protocol):
    """A built model (``ModelArchitecture.build``): what the runner, the decoders and the
    tools reach. Hidden states are float32 ``[T, hidden]`` before the final norm."""

    cfg: ModelConfig  # the whole model's
    dtype: torch.dtype
    captured: CapturedStep | None  # the backend's captured decode step, after capture()

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]``; ``kv_caches`` one (k, v) pair per layer;
        ``meta`` the backend's ``prepare`` result. Returns the final hidden states. (An
        ``nn.Module`` whose ``forward`` does this; ``build`` returns it on the CPU and the
        runner moves it with ``.to(device)``.)"""

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Float32 ``[T, vocab]`` (the final norm, the head, a final soft-cap if the family
        has one); under tensor parallelism on rank 0 only (None elsewhere)."""

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on already-normed rows ``x`` (Medusa heads feed their own
        hidden states through it): float32 ``[T, this rank's vocab]``."""

    def load_weights(self, weights: dict[str, Any], quantizer: Quantizer, quant_config: dict | None = None) -> None:
        """Take every checkpoint tensor (HF names); each matmul goes through ``quantizer``
        and the backend's ``pack_linear``. A missing, misshapen or unused tensor fails
        naming it."""

    def capture(self) -> bool:
        """Ask the backend for a captured decode step where this model's structure allows
        one; True when it gave one. Logs what made it step aside otherwise."""

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step reads (every weight once; the embedding one row)."""

    def linear_layers(self) -> list[dict[str, LinearWeight]]:
        """Each transformer layer's matmuls by slot name (``qkv``, ``o``, ``gate_up``,
        ``down``, an MoE's ``experts.E.gate_up`` ...), as packed: what offline calibration
        wraps and ``tokenloom eval`` reports."""

    def linear_sites(self) -> list[LinearSite]:
        """The dense matmuls a low-rank adapter may update (an MoE's experts are not among
        them), with the checkpoint modules fused into each."""

    def set_linear(self, layer: int, slot: str, weight: LinearWeight) -> None:
        """Replace one of ``linear_sites()``' matmuls (an adapter's wrapper around it)."""


@runtime_checkable
class ModelArchitecture(Protocol):
    """A model family, registered with ``register_models`` (core/hookspecs.py): which
    checkpoints it claims, how their config reads, how their GGUF tensors are named, and
    the module it builds. Everything else in the engine reaches the model through this."""

    name: str  # the registered name, ``ModelConfig.architecture``
    hf_architectures: tuple[str, ...]  # HF ``architectures[0]`` values it claims
    gguf_architectures: tuple[str, ...]  # GGUF ``general.architecture`` values it claims

    def config_from_hf(self, raw: dict) -> ModelConfig:
        """The typed config of an HF ``config.json``; a key whose value this family does not
        implement (a rope kind, a window on a family without one) raises ValueError naming
        the key and the model."""

    def config_from_gguf(self, meta: dict) -> ModelConfig:
        """The same from GGUF metadata (``{arch}.block_count``, ...) as core/loader/gguf_file.py's
        ``read_metadata`` gives it: the key/values, and the tables llama.cpp's converter writes as
        tensors (``rope_freqs``, ``rope_factors_long``, ``rope_factors_short``) as float tuples
        under ``tensor.<name>``. The loader then sets ``tie_word_embeddings`` and ``vocab_size``
        from the tensor list."""

    def gguf_tensor_name(self, name: str, cfg: ModelConfig) -> str | None:
        """The HF name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
        ``model.layers.3.self_attn.q_proj.weight``); None: the loader drops it (a tensor
        the engine recomputes, like ``rope_freqs``). An unknown name raises naming it."""

    def gguf_permuted_qk(self) -> bool:
        """Whether llama.cpp's converter permuted this family's q/k rows for its
        interleaved RoPE (LLaMA, Mistral, Mixtral: yes; Qwen, Gemma, Phi-3: no)."""

    def build(self, cfg: ModelConfig, dtype: torch.dtype, backend: Backend, max_len: int,
              tp: TensorParallel) -> CausalLM:
        """The module, on CPU, with uninitialised weights (``load_weights`` fills them);
        ``tp``: this rank's place (its share of heads, FFN and experts). Refuses (ConfigError
        naming the feature and the model) what it cannot run with this backend or split."""


class ModelRegistry(Protocol):
    """The registered architectures (core/models/registry.py)."""

    def get(self, name: str) -> ModelArchitecture: ...

    def for_hf(self, raw: dict) -> ModelArchitecture:
        """The architecture that claims an HF config (its ``architectures[0]``), or a
        ConfigError listing the ones known."""

    def for_gguf(self, arch: str) -> ModelArchitecture: ...


@runtime_checkable
class Executor(Protocol):
    """How a step reaches the model runner(s) (core/executor.py): ``uniproc`` (one runner) or
    ``multiproc`` (a tensor-parallel group: rank 0 sends each call to every rank first)."""

    name: str
    world_size: int
    driver: ModelRunner  # rank 0's (its sampler and model: under tensor parallelism, one share)
    failed: str | None  # why the ranks cannot go on (a rank died or hung); None while healthy

    def forward(self, batch: Batch, *, return_hidden: HiddenRows = False) -> ForwardOutput:
        """The runner's ForwardOutput for ``batch``, every rank having run it; with
        ``return_hidden`` the sampled rows' final hidden states, with ``"all"`` every row's too
        (``ForwardOutput.step_hidden``)."""

    def move_kv_slots(self, src: list[int], dst: list[int]) -> None: ...

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str = "auto") -> None: ...

    def prefill_logits(self, token_ids: list[int], block_table: list[int],
                       adapter: str | None = None) -> torch.Tensor | None: ...

    def prefill_hidden(self, token_ids: list[int], block_table: list[int],
                       adapter: str | None = None) -> torch.Tensor: ...

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Every rank loads the adapter (AdapterManager.load); on the step thread, between steps."""

    def unload_adapter(self, name: str) -> None: ...

    def adapters(self) -> list[AdapterInfo]:
        """The adapters the engine knows ([] without an adapter manager)."""

    def close(self) -> None:
        """Stop every other rank; idempotent."""


@dataclass(frozen=True, slots=True)
class DecoderContext:
    """What a decoder factory gets besides its options: one frozen struct, so that a new need
    (a second model for drafting, a rank) becomes a field and old decoders keep working."""

    config: EngineConfig
    plugin_manager: PluginManager
    model_config: ModelConfig  # the whole model's
    cache: CacheManager
    runner: ModelRunner  # rank 0's: sampler, model (steps go through ``executor``)
    # load_model(model=None, quantizer=None, dtype="auto", num_kv_blocks=512, num_layers=None)
    # -> core.build.SecondModel: a second checkpoint (a draft) with its own KV pool and cache
    # manager, on the engine's device and backend. Call it on the step thread.
    load_model: Callable[..., SecondModel] | None = None
    model_name: str = ""  # the checkpoint's name (Medusa finds its heads by it)
    # how steps reach the runner(s): world_size > 1 under tensor parallelism, where
    # ``runner`` holds rank 0's share only. None: the runner alone (a UniprocExecutor over it)
    executor: Executor | None = None
    # the decoders a request may name besides this one, for the engine's decoder to build now
    # (at start-up, on the step thread), and those it may not, with the reason (a decoder that
    # loads a second model and is not in ``enable_decoders``). A decoder built as another's
    # per-request proposer gets both empty.
    per_request_decoders: tuple[str, ...] = ()
    disabled_decoders: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class SequenceOutput:
    """What one step produced for one sequence that reached its end.

    ``token_ids``: the new tokens, in order (the accepted drafts, then one token the target
    sampled: a recovered token where a draft was rejected, else the bonus token).
    ``num_accepted``: how many of the step's draft tokens were accepted; their KV, written
    this step, becomes computed (``num_computed_tokens`` advances by the scheduled tokens
    plus these). ``num_drafted``: draft tokens verified this step. ``logprobs``: one
    ``TokenLogprob`` per new token when the request asked for them, else ``None``.
    ``forks``: for a sequence with ``Sequence.forks`` (the other samples of an ``n > 1``
    request), each one's first token, sampled from this sequence's row (verify's plain path).
    The built-in step also enters them in the :data:`DecoderOutput` under the fork's own
    sequence, which is where the engine reads them."""

    token_ids: list[int]
    num_accepted: int = 0
    num_drafted: int = 0
    logprobs: list | None = None
    accepted_nodes: list[int] | None = None  # a tree's accepted branch, as draft indices
    forks: list[SequenceOutput] | None = None
    drafted_by: str | None = None  # the decoder that proposed the drafts verified (``auto``'s choice)


#: a step's result: an entry for each sequence that sampled (partial prefill chunks have none),
#: and one for each fork that took its first token from a sequence's row (``SequenceOutput.forks``).
#: A decoder that gives forks none is still exact: the engine then has each fork compute its
#: last prompt token itself.
DecoderOutput = dict[Sequence, SequenceOutput]


@runtime_checkable
class Decoder(Protocol):
    """Turns a scheduled batch into new tokens. The built-in decoders share one step
    (plugins/decoders/base.py): the target model runs every scheduled and draft token, the
    drafts are verified with rejection sampling (exact: the output distribution is the
    target's), and each sequence's proposer drafts its next step's tokens into
    ``seq.draft_token_ids``; the scheduler reserves KV slots for them."""

    def step(self, batch: Batch) -> DecoderOutput:
        """Run one step; return a :class:`SequenceOutput` for each sequence that sampled."""

    def release(self, seq: Sequence) -> None:
        """``seq`` finished (any reason): drop per-sequence state (sampler generators, draft KV)."""

    def stats(self) -> dict[str, float]:
        """Counters for ``engine.stats()`` (speculation: drafted, accepted, ...); {} if none."""

    #: decoder names a request may not ask for here, with the reason (not enabled, or it could
    #: not be built at start-up): the engine refuses requests naming them
    unavailable: dict[str, str]


@runtime_checkable
class Backend(Protocol):
    """The hot ops the model calls. ``torch`` is the reference implementation."""

    name: str

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype, kv_cache_dtype: str = "auto") -> list:
        """One (k, v) pair per layer; their layout is the backend's business. ``kv_cache_dtype``
        "auto" stores ``dtype``; "fp8" / "int8" store 8 bits with scales, and ``write_kv`` /
        ``attention`` quantise and dequantise (the model always hands them ``dtype``)."""

    def kv_bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype,
                           kv_cache_dtype: str = "auto") -> int:
        """The bytes one token's K and V take, over all ``num_layers`` layers, in the pool
        :meth:`allocate_kv_cache` builds from the same arguments: its data and anything else it
        keeps per token (an 8-bit pool's scales), so that a pool of ``num_blocks`` blocks is
        ``kv_bytes_per_token(...) * num_blocks * block_size`` bytes. The engine sizes its pool
        with it (``kv_cache_memory_mb``), and so does the planner; the conformance kit checks
        it against the tensors a pool really holds. Raises as ``allocate_kv_cache`` does for an
        unknown ``kv_cache_dtype``."""

    def prepare(self, meta: AttentionInputs) -> Any:  # Any: the metadata is the backend's own
        """Build per-step attention metadata once, before the layers run, from an
        ``AttentionInputs`` (core/attention.py): ``meta.tensors(device)`` gives the step's
        block tables, context lengths and query starts as tensors (the runner writes them into
        persistent buffers); the per-span Python fields say what is cached and where a draft
        tree's mask applies."""

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None: ...

    def copy_blocks(self, kv_caches, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first n slots of block src into block dst, in every layer."""

    def move_kv_slots(self, kv_caches, src: list[int], dst: list[int]) -> None:
        """Copy the KV of flat slots ``src`` (block * block_size + offset) to ``dst``, every
        layer, reading all before writing: a draft tree's accepted branch moves from its
        lookahead slots into the positions it now holds."""

    def attention(self, q, k, v, k_cache, v_cache, meta, scale: float, window: int | None = None,
                  softcap: float | None = None):
        """Attention of this step's queries over the cache; ``k``/``v`` are this step's own
        keys and values (already written by ``write_kv``), for backends that use them directly.
        ``window``: a query at position p sees keys at positions > p - window only (sliding-
        window layers); ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before
        the softmax (Gemma 2). A backend without them raises ConfigError at its first call."""

    def decode_attention_block(self, qkv, cos, sin, k_cache, v_cache, meta: Any, num_heads: int,  # meta: prepare's
                               scale: float) -> torch.Tensor | None:
        """A fast path of a decode step's attention, from a layer's fused qkv output
        ``[T, (H + 2 KVH) * D]`` and float32 ``cos``/``sin`` of the positions: RoPE on q and
        k, the KV write and attention in one call; returns ``[T, H * D]`` in qkv's dtype, or
        None when it does not apply (the model then calls ``write_kv`` and ``attention``).
        Required like every method here (the model calls it every decode step, on layers
        without a window or a soft-cap); a backend without such a path returns None. Decode
        rows may share a block table (a draft chain: ``AttentionInputs``), so every row's K/V
        is written before any row attends."""

    def rope(self, x, cos, sin, out_dtype: torch.dtype | None = None):
        """Rotary embedding, rotate-half (neox) form: ``x [T, heads, head_dim]`` (q and k heads
        together, any float dtype; rows may be strided views of the qkv projection) by float32
        ``cos``/``sin`` ``[T, 1, head_dim]`` of each token's position, computed in float32;
        returns ``[T, heads, head_dim]`` rounded to ``out_dtype`` (None: float32; the model
        calls it with its dtype: the q and k it attends with)."""

    def rms_norm(self, x, weight, eps: float): ...

    def argmax(self, x) -> torch.Tensor:
        """``torch.argmax(x, dim=-1)`` of ``x [B, V]`` (logits, or a sampler's scores): per
        row the first index of its maximum, a row with a NaN its first NaN; int64 ``[B]``.
        The sampler picks every greedy token (and every sampled one, from p / E) with it."""

    def add_rms_norm(self, h, delta, weight, eps: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next RMSNorm together: ``(rms_norm(h + delta) in dtype,
        h + delta)``; ``delta`` None adds nothing. ``h`` is the float32 residual stream, which
        the model owns: a backend may update it in place."""

    def pack_linear(self, spec: WeightSpec, dtype) -> LinearWeight:
        """Called once per matmul at load time, with the spec already on the device: lay
        it out for this machine's kernels (a 4-bit spec stays 4-bit where a kernel exists,
        else it is dequantised to ``dtype``) and return the object the model calls."""

    def silu_mul(self, gate, up): ...

    def gelu_tanh_mul(self, gate, up):
        """GeGLU's ``gelu(gate, approximate="tanh") * up`` (Gemma's MLP)."""

    def capture_decode(self, model: DecodeModel) -> CapturedStep | None:
        """Called once after the weights are packed (and not under tensor parallelism, nor
        with the engine's ``capture`` off): a whole decode step this backend runs without
        Python between ops (a C++ step on CPU; CUDA graphs would belong here), or None where
        it has none. Its output must equal the op-by-op path's."""


@dataclass(frozen=True, slots=True)
class DecodeLayer:
    """One LLaMA layer's weights as the backend packed them (``LinearWeight``s) and its two
    float32 RMSNorm weights; optionally what Qwen2 and Qwen3 add to its attention, in
    ``DecoderLayer.attend``'s order (plugins/models/decoder.py): ``qkv_bias`` (model dtype,
    ``[q + 2 kv]``) added to the qkv matmul's output, then ``q_norm`` / ``k_norm`` (float32
    ``[head_dim]``, both or neither): each head of q and of k RMS-normed in float32 (eps the
    model's ``rms_norm_eps``), concatenated with v and cast back to the model dtype, before
    RoPE. A backend whose captured step does not implement a field that is set returns None
    from ``capture_decode`` (the conformance kit's captured-step check has a model of each)."""

    input_norm: torch.Tensor
    qkv: LinearWeight
    o: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """What a backend needs to run a LLaMA model's decode step itself: the embedding (model
    dtype), float32 RoPE tables ``[max_len, head_dim]``, the layers and their shapes. The
    step adds the residual stream in float32 and returns it before the final norm, as
    ``DecoderModel.forward`` (plugins/models/decoder.py) does."""

    embed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    layers: tuple[DecodeLayer, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    dtype: torch.dtype


class CapturedStep(Protocol):
    #: whether it mirrors low-rank adapter updates (``LowRankUpdated`` matmuls in its layers): the
    #: runner steps aside from a step without them for steps whose rows run under adapters
    low_rank: bool

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor | None:
        """The final hidden states ``[T, hidden]`` float32 of a step, or None when this step
        is not one it covers (a prefill in it, an 8-bit KV pool): the model then runs op by op."""


@dataclass(frozen=True, slots=True)
class FrontendContext:
    """What a frontend factory gets besides its options (frozen; new needs become fields).

    ``gateway`` (``tokenloom.protocols.gateway.Gateway``) is shared by every frontend of one
    server, so the rules hold across all of them: ``bearer_authorized(header)`` /
    ``authorized(token)`` check the API key, ``origin_allowed(origin, host)`` a browser's
    Origin; admission is ``reserve()`` (a queue slot, or ``Refused``: full or shutting down),
    ``take_request(limiter)`` (the request rate; ``release()`` the slot if it raises
    ``RateLimited``), then ``await admit(..., reserved=True)`` (tokenise off the event loop,
    charge the token rate, submit; the slot is given back whatever happens); ``metrics`` is
    the one Prometheus registry (``observe_finished`` each request's end)."""

    # the engine every frontend serves: in this process, or (`tokenloom serve`'s default) a
    # client of the engine core in its own; the same calls either way: prompt_ids_async,
    # stream(handle) (the handle gateway.admit returns; its ``request_id``), abort,
    # ``await refresh_stats()`` then stats(), health_report(), num_unfinished
    engine: AsyncEngine | EngineClient
    host: str  # the address every frontend binds
    gateway: Gateway


@runtime_checkable
class Frontend(Protocol):
    """A way in to a served engine, on its own port. Lifecycle: ``start`` binds and serves;
    ``stop_accepting`` refuses new requests (running ones go on); ``close`` aborts what still
    runs (each request still ends with its one final message, its KV blocks come back) and
    closes the connections. Every accepted request ends with exactly one final message."""

    name: str

    async def start(self) -> None: ...

    def urls(self) -> list[str]:
        """Where it listens, for the start-up banner (after ``start``)."""

    def stop_accepting(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class GrammarMatcher(Protocol):
    """One sequence's position in a compiled grammar (structured outputs). Tokens are the
    model's ids; the bitmask is xgrammar's layout: an int32 tensor of ``ceil(V / 32)``
    words per row, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Write the tokens allowed at the next position into row ``index`` of ``bitmask``
        (a terminated matcher allows only the stop tokens)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a rejected draft)."""

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles a request's :class:`~tokenloom.core.sampling_params.Constraint` against the
    model's vocabulary and gives each sequence a :class:`GrammarMatcher` (see
    ``register_grammars``). ``compile`` may be slow: the engine calls it on a worker thread
    and caches the result per constraint; it raises ``ClientError`` naming the request
    parameter (``response_format``, ``guided_regex``, ...) for a constraint it cannot compile."""

    name: str

    def compile(self, constraint: Any) -> Any:
        """The compiled grammar of ``constraint`` (opaque to the engine)."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


@runtime_checkable
class ToolParser(Protocol):
    """Reads one model family's tool-call format (see ``register_tool_parsers`` and
    :mod:`tokenloom.core.tools`): what the model writes when it calls a function, how
    calls and results in history are written back, and the grammar that forces the format.

    ``arguments_key`` names the arguments in the format's call object (``arguments``;
    Llama 3's JSON calls say ``parameters``)."""

    name: str
    arguments_key: str

    def scan(self, text: str, final: bool) -> ToolScan:
        """What ``text`` (an answer so far; ``final``: all of it) holds: the content that is
        surely content and the calls read whole. For any text that extends ``text``, the
        scan extends this one: its content starts with this content and its calls with these
        calls (so hold back what a call marker may still turn into; a call whose text does
        not parse makes the rest content, never a call). Never raises on model output."""

    def constraint(self, call_schema: dict[str, Any], *, min_calls: int, max_calls: int) -> Constraint:
        """The constraint (usually ``tagged_json``) under which the model writes ``min_calls``
        to ``max_calls`` calls in this format, each a JSON object valid under ``call_schema``."""

    def render_calls(self, calls: list[ToolCall]) -> str:
        """``calls`` as the model writes them (an assistant turn in history, for a chat
        template that does not render ``tool_calls``)."""

    def render_result(self, content: str) -> str:
        """A ``tool`` message's content as this family reads it in a user turn (for a chat
        template that does not render ``tool`` messages)."""

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        """The system-message text that shows the model ``functions`` (OpenAI's function
        objects) and its call format, for a chat template that does not read ``tools``."""


@dataclass(frozen=True, slots=True)
class LinearSite:
    """One matmul a low-rank adapter may update, as a model exposes it (``CausalLM.linear_sites``).

    ``layer`` and ``slot`` name it (``qkv``, ``o``, ``gate_up``, ``down``: the keys of
    ``linear_layers()``); ``parts`` are the checkpoint modules fused into it, in output order
    (``model.layers.3.self_attn.q_proj``, ``...k_proj``, ``...v_proj``), ``rows`` each part's
    output rows in the whole (unsharded) model, ``in_features`` the whole input width.
    ``kind`` is how tensor parallelism splits it (``TensorParallel.shard``: qkv and gate_up by
    rows, o and down by columns), so an adapter's A and B are split the way its base is."""

    layer: int
    slot: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    in_features: int
    kind: str


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter the engine knows (``AdapterManager.adapters``): its name (what a request's
    ``SamplingParams.adapter`` and the OpenAI ``model`` field say), where it was read from,
    its largest rank, the checkpoint modules it updates, the bytes its weights take once
    resident, whether it is resident now, and a fingerprint of its contents (the prefix cache
    keys blocks by it: two adapters never share KV, nor an adapter and the base)."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    nbytes: int
    resident: bool
    fingerprint: str


@runtime_checkable
class AdapterManager(Protocol):
    """Low-rank adapters over the base model's matmuls, chosen per request and mixed in one
    step (role ``adapter``, ``register_adapters`` in core/hookspecs.py). Each rank of a
    tensor-parallel group holds one, over its own share of the model; every method but
    :meth:`adapters` runs on the step thread, between steps, on every rank alike."""

    merged: bool  # one adapter folded into the base weights at start-up: requests name it, nothing per step
    max_loras: int  # adapters resident at once: a step mixes at most this many (the engine admits by it)

    def merge(self, weights: dict[str, Any]) -> None:
        """Only when ``merged``: fold the one adapter into the checkpoint's tensors (HF names)
        before the model is built; a tensor it cannot fold (stored quantised) is a
        ConfigError naming it."""

    def attach(self, model: CausalLM, tp: TensorParallel) -> None:
        """Called once, after the weights are loaded: take over the matmuls of
        ``model.linear_sites()`` (``model.set_linear``) so that the rows of a step that name an
        adapter get its update. Raises ConfigError naming what it cannot adapt."""

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read and check an adapter (a ConfigError naming the file, key or module it cannot
        take: a rank above the limit, a target the model has no matmul for, ...), make it
        resident, evicting the least recently used resident ones past the limits; replacing
        a name is refused (unload it first)."""

    def unload(self, name: str) -> None:
        """Forget ``name`` (KeyError when unknown); its weights are freed."""

    def adapters(self) -> list[AdapterInfo]:
        """Every adapter known, loaded at start-up or since (resident or evicted)."""

    def row_order(self, name: str) -> int:
        """Where ``name``'s rows go in a step (the runner groups a step's rows by adapter in
        this order, the base first): its resident slot, so that the rows' order is the slots'."""

    def begin_step(self, rows: list[tuple[str, int, int]], num_rows: int) -> bool:
        """The coming step's rows ``[start, end)`` that run under each named adapter (the
        rest run the base); makes each resident. True when any row has an adapter: the model
        then runs op by op (a captured step has no adapter in it)."""

    def end_step(self) -> None:
        """The step is over: every row runs the base again until the next ``begin_step``."""
