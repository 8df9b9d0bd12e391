"""ModelRunner: a Batch in, logits out. Owns the model, the KV tensors and the sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from tokenloom.core.attention import AttentionInputs, PrefillSpan, StepBuffers
from tokenloom.core.interfaces import AdapterInfo, AdapterManager, Backend, CausalLM, ModelRegistry
from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.models.registry import default_registry
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.sampler import Sampler
from tokenloom.core.sequence import Batch, Sequence, draft_depths


@dataclass(slots=True)
class ForwardOutput:
    """What :meth:`ModelRunner.forward` returns for the sequences that sample this step.

    ``logits [R, V]`` float32: for each sequence in ``seqs``, ``num_rows[i] = 1 + k`` rows in
    order: its last scheduled token, then its k draft tokens (row j predicts the token after
    draft j). ``hidden [R, H]``: the same rows' final hidden states (before the final norm),
    only when asked (Medusa heads read them).

    Asked with ``return_hidden="all"`` (an EAGLE draft reads the target's features at every
    position, prompt chunks included), ``step_hidden [N, H]`` holds every row the step ran,
    in the step's row order, and ``first_row[seq_id]`` says where each scheduled sequence's
    rows begin (its scheduled tokens, from position ``num_computed_tokens``, then its
    drafts). Sequences that do not sample this step (a prompt chunk) appear there too."""

    logits: torch.Tensor | None
    seqs: list[Sequence]
    num_rows: list[int]
    hidden: torch.Tensor | None = None
    step_hidden: torch.Tensor | None = None
    first_row: dict[int, int] = field(default_factory=dict)


#: which final hidden states a forward returns: none, the sampled rows', or every row's
HiddenRows = bool | Literal["all"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA, or a CPU with
    AVX512-BF16/AMX), else float32 -- on an AVX2-only CPU bf16 matmuls are emulated and
    2-4x slower than fp32 at batch sizes above one."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if native else torch.float32


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    def __init__(self, checkpoint: LoadedCheckpoint, *, backend, quantizer, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int, seed: int = 0,
                 tp: TensorParallel | None = None, capture: bool = True):
        """Build the model on ``device`` and load it (each matmul through ``quantizer``,
        packed by ``backend``; with ``tp``, this rank's share of it); with ``capture``, ask
        the backend for a captured decode step. The KV pool comes after:
        :meth:`allocate_kv_cache`."""
        self.tp = tp or TensorParallel()
        self.cfg = self.tp.local_config(checkpoint.config)  # this rank's heads: its KV pool's shape
        self.backend, self.dtype, self.device = backend, dtype, device
        self.block_size, self.max_model_len = block_size, max_model_len
        arch = checkpoint.architecture or default_registry().get(checkpoint.config.architecture)
        self.model: CausalLM = arch.build(checkpoint.config, dtype, backend, max_model_len, self.tp)
        cast(torch.nn.Module, self.model).to(device)
        self.model.load_weights(checkpoint.weights, quantizer, checkpoint.quant_config)  # takes (empties) the checkpoint's tensors
        if capture:
            self.model.capture()
        self.num_blocks = 0
        self.kv_caches: list = []
        self.sampler = Sampler(seed, device, backend.argmax)
        self.step_buffers = StepBuffers(device)  # the step's tables and lengths, written in place
        self.adapters: AdapterManager | None = None  # attach_adapters

    def attach_adapters(self, manager: AdapterManager) -> None:
        """Let ``manager`` wrap the model's matmuls (each rank its own share) and load its
        start-up adapters."""
        manager.attach(self.model, self.tp)
        self.adapters = manager
        if self.model.captured is not None:  # again, over the wrapped matmuls: the backend may mirror them
            self.model.capture()

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        if self.adapters is None:
            from tokenloom.core.errors import ConfigError

            raise ConfigError("this engine serves no adapters (start it with --lora NAME=PATH or --enable-lora)")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unload(name)

    @property
    def captured(self) -> bool:
        """Whether pure decode steps run as the backend's captured step."""
        return self.model.captured is not None

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str = "auto") -> None:
        """``kv_cache_dtype``: ``auto`` (the model dtype) or an 8-bit storage, ``fp8`` or ``int8``."""
        self.num_blocks = num_blocks
        self.kv_caches = self.backend.allocate_kv_cache(self.cfg.num_layers, num_blocks, self.block_size,
                                                        self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype,
                                                        kv_cache_dtype)

    @staticmethod
    def kv_bytes_per_token(backend: Backend, cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """KV pool bytes one token of ``cfg`` takes over all layers in ``backend``'s pool
        (``Backend.kv_bytes_per_token``: the layout, 8-bit scales included, is the backend's)."""
        return backend.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, kv_cache_dtype)

    @staticmethod
    def num_blocks_for(backend: Backend, cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_mb: int,
                       kv_cache_dtype: str = "auto") -> int:
        """The blocks of ``block_size`` tokens a ``memory_mb`` MiB pool of ``backend`` holds (at least one)."""
        per_block = ModelRunner.kv_bytes_per_token(backend, cfg, dtype, kv_cache_dtype) * block_size
        return max(1, (memory_mb << 20) // per_block)

    def plan(self, batch: Batch) -> tuple[StepPlan, list[Sequence], list[int]]:
        """Flatten the batch into a :class:`StepPlan`, and say which sequences sample this
        step and how many logit rows each gets (``1 + len(drafts)`` consecutive rows)."""
        bs = self.block_size
        plan = StepPlan([], [], [], AttentionInputs(slot_mapping=None, block_size=bs), [], batch.copies,  # type: ignore[arg-type]
                        [])
        input_ids, positions, slots, attn, sample_rows = (plan.input_ids, plan.positions, plan.slots, plan.attn,
                                                          plan.sample_rows)
        sample_seqs: list[Sequence] = []
        row_counts: list[int] = []
        drafts_of = batch.draft_tokens or [[]] * len(batch.seqs)
        parents_of = batch.draft_parents or [None] * len(batch.seqs)
        items = list(zip(batch.seqs, batch.num_scheduled_tokens, batch.block_tables, drafts_of, parents_of,
                         strict=True))
        if self.adapters is not None and any(seq.params.adapter is not None for seq in batch.seqs):
            # rows grouped by adapter (base first, then by resident slot; stable): each adapter's rows
            # one contiguous span, which its updates read and write as views (the returned seqs
            # follow this order)
            order = self.adapters.row_order
            items.sort(key=lambda item: -1 if item[0].params.adapter is None else order(item[0].params.adapter))
        for seq, n, table, drafts, parents in items:
            start, row = seq.num_computed_tokens, len(input_ids)
            plan.first_row[seq.seq_id] = row
            end = start + n
            k = len(drafts)
            if seq.params.adapter is not None:  # its rows, drafts included, run under its adapter
                plan.adapter_rows.append((seq.params.adapter, row, row + n + k))
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            # a tree node sits at the position of its depth; its KV in lookahead slot end + i
            positions.extend(range(end, end + k) if parents is None else (end - 1 + d for d in draft_depths(parents)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end + k))
            if n == 1 and start > 0 and (k == 0 or parents is None):
                # a decode row, or a last token and its draft chain: k + 1 decode rows over one
                # block table, row j seeing the context up to draft j, as plain decode steps would
                # (and as one: the captured step, the decode attention op, its kernels)
                for j in range(k + 1):
                    attn.decode_rows.append(row + j)
                    attn.decode_context_lens.append(end + j)
                    attn.decode_block_tables.append(table)
            else:  # a prompt chunk, its drafts, or a draft tree: causal over the context
                attn.prefills.append(PrefillSpan(row, row + n + k, end + k, table, parents if k else None))
            if end == seq.num_tokens:  # reached the end: this sequence samples (and verifies its drafts)
                sample_rows.extend(range(row + n - 1, row + n + k))
                sample_seqs.append(seq)
                row_counts.append(k + 1)
        attn.single_sequence = len(items) == 1 and not attn.prefills
        return plan, sample_seqs, row_counts

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs, list[int], list[Sequence],
                                              list[int]]:
        """:meth:`plan` as tensors: input ids, positions, attention inputs (with the step's
        tensors built), the rows whose logits are wanted, their sequences and row counts."""
        plan, seqs, counts = self.plan(batch)
        input_ids, positions, attn = self._tensors(plan)
        return input_ids, positions, attn, plan.sample_rows, seqs, counts

    def _tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        dev, attn = self.device, plan.attn
        attn.slot_mapping = torch.tensor(plan.slots, dtype=torch.long, device=dev)
        attn.step = self.step_buffers.build(attn)
        return (torch.tensor(plan.input_ids, dtype=torch.long, device=dev),
                torch.tensor(plan.positions, dtype=torch.long, device=dev), attn)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, return_hidden: HiddenRows = False
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run a plan: the logits of its sample rows (``None`` when it has none, and on every
        rank but 0 under tensor parallelism) and, if asked, those rows' hidden states (every
        row's with ``"all"``). Every rank of a tensor-parallel group runs the same plan
        (core/executor.py)."""
        if plan.copies:
            self.backend.copy_blocks(self.kv_caches, plan.copies)
        input_ids, positions, attn = self._tensors(plan)
        hidden = self._run_model(plan, input_ids, positions, attn)
        rows = plan.sample_rows
        if not rows:
            return None, hidden if return_hidden == "all" else None
        picked = hidden[torch.tensor(rows, device=self.device)] if len(rows) < hidden.shape[0] else hidden
        return self.model.compute_logits(picked), hidden if return_hidden == "all" else picked if return_hidden else None

    def _run_model(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn: AttentionInputs) -> torch.Tensor:
        """The model over a plan's rows; rows under an adapter get its update (the adapter
        manager brackets the step), and such a step runs op by op: the captured step holds
        the base matmuls only."""
        meta = self.backend.prepare(attn)
        if self.adapters is None or not self.adapters.begin_step(plan.adapter_rows, len(plan.input_ids)):
            return self.model(input_ids, positions, self.kv_caches, meta)
        captured = self.model.captured
        if captured is not None and not captured.low_rank:
            self.model.captured = None  # a captured step that holds the base matmuls only
        try:
            return self.model(input_ids, positions, self.kv_caches, meta)
        finally:
            self.model.captured = captured
            self.adapters.end_step()

    def forward(self, batch: Batch, *, return_hidden: HiddenRows = False) -> ForwardOutput:
        """Run the batch (scheduled and draft tokens); return the logits of each sampling
        sequence's last scheduled token and of its drafts (see :class:`ForwardOutput`).
        One rank only: an engine goes through its executor (core/executor.py)."""
        if self.tp.enabled:
            raise RuntimeError("ModelRunner.forward under tensor parallelism would run rank 0 alone; "
                               "use the engine's executor (engine.executor.forward)")
        plan, seqs, counts = self.plan(batch)
        return forward_output(plan, seqs, counts, *self.execute(plan, return_hidden), return_hidden)

    def move_kv_slots(self, src: list[int], dst: list[int]) -> None:
        self.backend.move_kv_slots(self.kv_caches, src, dst)

    @staticmethod
    def score_plan(token_ids: list[int], block_table: list[int], block_size: int, all_rows: bool,
                   adapter: str | None = None) -> StepPlan:
        """A plan that prefills one prompt (scoring, calibration, Medusa's features): every
        row's logits (``all_rows``) or none, the hidden states kept; under ``adapter`` if named."""
        n, bs = len(token_ids), block_size
        attn = AttentionInputs(slot_mapping=None, block_size=bs)  # type: ignore[arg-type]
        attn.prefills.append(PrefillSpan(0, n, n, block_table))
        return StepPlan(list(token_ids), list(range(n)), [block_table[p // bs] * bs + p % bs for p in range(n)], attn,
                        list(range(n)) if all_rows else [], [], [(adapter, 0, n)] if adapter is not None else [])

    @torch.inference_mode()
    def prefill_hidden(self, token_ids: list[int], block_table: list[int], adapter: str | None = None) -> torch.Tensor:
        """Final hidden states (before the last norm) for every position of one prompt."""
        plan = self.score_plan(token_ids, block_table, self.block_size, False, adapter)
        input_ids, positions, attn = self._tensors(plan)
        return self._run_model(plan, input_ids, positions, attn)

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], block_table: list[int],
                       adapter: str | None = None) -> torch.Tensor | None:
        """Logits for every position of one prompt (tests and scoring)."""
        return self.execute(self.score_plan(token_ids, block_table, self.block_size, True, adapter))[0]


def forward_output(plan: StepPlan, seqs: list[Sequence], counts: list[int], logits: torch.Tensor | None,
                   hidden: torch.Tensor | None, return_hidden: HiddenRows) -> ForwardOutput:
    """A plan's :class:`ForwardOutput` from what :meth:`ModelRunner.execute` returned."""
    if return_hidden != "all":
        return ForwardOutput(logits, seqs, counts, hidden) if plan.sample_rows else ForwardOutput(None, [], [], None)
    picked = None
    if plan.sample_rows and hidden is not None:
        picked = hidden[torch.tensor(plan.sample_rows, device=hidden.device)]
    return ForwardOutput(logits if plan.sample_rows else None, seqs, counts, picked, hidden, plan.first_row)


@dataclass(slots=True)
class StepPlan:
    """One step's inputs as plain lists: what :meth:`ModelRunner.execute` runs. Built on
    rank 0 from the scheduler's batch; under tensor parallelism sent as is to every rank."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # the flat KV slot of each row
    attn: AttentionInputs  # its slot_mapping and step tensors are filled in by each rank
    sample_rows: list[int]  # rows whose logits are wanted
    copies: list  # copy-on-write block copies to make first
    adapter_rows: list[tuple[str, int, int]]  # (adapter, first row, end row): rows under an adapter
    first_row: dict[int, int] = field(default_factory=dict)  # seq_id -> the first row of its span


def load_checkpoint(path, registry_formats: dict[str, Callable], dtype: torch.dtype, progress=None,
                    models: ModelRegistry | None = None) -> LoadedCheckpoint:
    """The first registered format that claims ``path`` loads it; the model plugin that
    builds it (``ckpt.architecture``) comes from ``models`` (default: the default plugin
    manager's)."""
    from tokenloom.core.models.registry import default_registry

    models = models or default_registry()
    for factory in registry_formats.values():
        fmt = factory()
        if fmt.claims(path):
            ckpt = fmt.load(path, dtype, progress, models)
            if ckpt.architecture is None:
                ckpt.architecture = models.get(ckpt.config.architecture)
            return ckpt
    from tokenloom.core.errors import ConfigError

    raise ConfigError(f"no model format claims {str(path)!r}; known formats: {', '.join(registry_formats)}")
