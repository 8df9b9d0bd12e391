"""Backend-neutral description of one step's attention work, built by the runner, and the
reference RoPE (:func:`apply_rope`) the backends implement and the conformance kit checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSpan:
    """One sequence whose ``q_len`` new tokens (rows q_start:q_end) attend to ``context_len``
    cached-plus-new tokens; ``q_len < context_len`` when earlier chunks or a prefix hit
    are already in the cache."""

    q_start: int
    q_end: int
    context_len: int
    block_table: list[int]
    # A draft tree in the span's last len(tree_parents) rows (see Batch.draft_parents): a
    # node attends to the context before the tree and to its ancestors and itself only.
    tree_parents: list[int] | None = None

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


@dataclass(slots=True)
class AttentionInputs:
    """One step's attention work. A decode row is one query that attends to the first
    ``decode_context_lens[i]`` tokens of its block table, itself last. Decode rows may share a
    block table: a sequence's last token and its draft chain are verified as consecutive
    decode rows, row j seeing the context up to and including draft j (each a plain decode
    row would, token for token). So a backend writes every new token's KV
    (``slot_mapping``) before any row of the step attends.

    ``single_sequence``: every row is one sequence's decode row or draft chain (a batch-1
    verification step, or a plain batch-1 decode step). A backend whose kernel choice depends
    on the row count may read it to choose as for one row, so that each of these rows gets
    the logits a plain decode step would and greedy verification emits ``standard``'s
    tokens. The torch backend does, for its quantised matmuls' row threshold (above which a
    dense copy rounds differently); the triton backend does not (its GPU GEMMs are not
    row-invariant to begin with)."""

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot of each new token
    block_size: int
    decode_rows: list[int] = field(default_factory=list)  # rows of one query each (see above)
    decode_context_lens: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    single_sequence: bool = False  # (see above)
    step: StepTensors | None = None  # the same as tensors; see tensors()

    def tensors(self, device: torch.device | str = "cpu") -> StepTensors:
        """The step's tables and lengths as tensors on ``device``, built once: the runner
        builds them from its persistent buffers before the backend's ``prepare`` asks; an
        AttentionInputs made elsewhere (tests, the backend kit) gets fresh ones here."""
        if self.step is None:
            self.step = StepBuffers(device).build(self)
        return self.step


@dataclass(slots=True)
class StepTensors:
    """One step's per-sequence attention inputs as int64 tensors on the device, built once
    (by the runner, from its :class:`StepBuffers`) and read by every layer: what a kernel
    takes instead of Python lists. Block tables are padded with block 0 to the widest
    context's block count; ``None`` where the step has no decode rows / no prefill spans."""

    decode_rows: torch.Tensor | None = None  # [B] rows of q that decode one token
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_block_tables: torch.Tensor | None = None  # [B, W]
    prefill_q_starts: torch.Tensor | None = None  # [S] first row of each span
    prefill_q_lens: torch.Tensor | None = None  # [S]
    prefill_context_lens: torch.Tensor | None = None  # [S]
    prefill_block_tables: torch.Tensor | None = None  # [S, W]


class StepBuffers:
    """Persistent host buffers for :class:`StepTensors`: each step writes its tables and
    lengths into them in place (through numpy views, no per-step allocation) and takes
    views; on a GPU the views are copied to the device from pinned memory. Capacity grows
    (doubling) when a step needs more. On a CPU the tensors *are* views of the buffers:
    valid until the next step builds its own."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._host: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, size: int) -> torch.Tensor:
        buf = self._host.get(name)
        if buf is None or buf.numel() < size:
            buf = torch.zeros(max(size, 2 * buf.numel() if buf is not None else 64), dtype=torch.long,
                              pin_memory=self.device.type == "cuda")
            self._host[name] = buf
        return buf

    def _vector(self, name: str, values: list[int]) -> torch.Tensor:
        buf = self._buffer(name, len(values))
        buf.numpy()[:len(values)] = values
        return self._to_device(buf[:len(values)])

    def _table(self, name: str, tables: list[list[int]], lens: list[int], block_size: int) -> torch.Tensor:
        """``[len(tables), W]``, a contiguous view of the flat buffer (no copy on a CPU)."""
        width = max(1, max((n + block_size - 1) // block_size for n in lens))
        view = self._buffer(name, len(tables) * width)[:len(tables) * width].view(len(tables), width)
        rows = view.numpy()
        for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
            used = (n + block_size - 1) // block_size
            rows[i, :used] = table[:used]
            rows[i, used:] = 0
        return self._to_device(view)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # (a blocking copy: the next step rewrites the same host memory)
        return t if self.device.type == "cpu" else t.to(self.device)

    def build(self, inp: AttentionInputs) -> StepTensors:
        out = StepTensors()
        bs = inp.block_size
        if inp.decode_rows:
            out.decode_rows = self._vector("decode_rows", inp.decode_rows)
            out.decode_context_lens = self._vector("decode_lens", inp.decode_context_lens)
            out.decode_block_tables = self._table("decode_tables", inp.decode_block_tables,
                                                  inp.decode_context_lens, bs)
        if inp.prefills:
            spans = inp.prefills
            lens = [s.context_len for s in spans]
            out.prefill_q_starts = self._vector("prefill_starts", [s.q_start for s in spans])
            out.prefill_q_lens = self._vector("prefill_q_lens", [s.q_len for s in spans])
            out.prefill_context_lens = self._vector("prefill_lens", lens)
            out.prefill_block_tables = self._table("prefill_tables", [s.block_table for s in spans], lens, bs)
        return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half (neox) form, as ``Backend.rope`` defines it: ``x [T, heads,
    head_dim]`` in the weight dtype, ``cos``/``sin [T, 1, head_dim]`` float32, so the result is
    float32 whatever ``x`` is."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
