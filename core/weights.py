"""Matmul weights through the load pipeline (see docs/architecture.md, "Start-up").

A checkpoint format returns raw tensors, quantised ones untouched. For each matmul of the
model (a :class:`LinearSlot`: ``qkv`` fuses q/k/v, ``gate_up`` fuses gate/up) the
quantizer turns those raw tensors into a weight *spec* — a dense tensor, a
:class:`QuantizedWeight` or an :class:`Fp8Weight` — and the backend packs the spec for its
kernels, returning a :class:`LinearWeight` the model calls. Nothing is dequantised and
re-quantised on the way: a 4-bit checkpoint stays 4-bit unless a quantizer is asked to
dequantise it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True, slots=True)
class LinearSlot:
    """One matmul of the model and the checkpoint tensors fused into it, in output order."""

    name: str  # the model's name, e.g. "model.layers.3.qkv"
    parts: tuple[str, ...]  # checkpoint prefixes, e.g. ("model.layers.3.self_attn.q_proj", ...)
    part_out_features: tuple[int, ...]  # rows each part contributes
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return sum(self.part_out_features), self.in_features

    def fuse(self, specs: list[WeightSpec], tensor: str = "weight") -> WeightSpec:
        """Check each part's shape (naming the tensor that is off), then fuse them."""
        for part, rows, spec in zip(self.parts, self.part_out_features, specs, strict=True):
            if tuple(spec.shape) != (rows, self.in_features):
                raise ValueError(f"checkpoint tensor {part}.{tensor} has shape {tuple(spec.shape)}, "
                                 f"the model needs {(rows, self.in_features)}")
        return fuse(specs)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Integer codes of a ``[out, in]`` weight with per-(row, group) scales and zero points.

    :ivar codes: ``uint8 [out, in]`` codes in ``[0, 2^bits - 1]``, unpacked (one code a byte).
    :ivar scales: float ``[out, n_groups]`` (float32 from every function in this package).
    :ivar zeros: ``[out, n_groups]`` zero points in code units, float or integer dtype
        (integer-valued float32 from :func:`quantize_rtn`).
    :ivar bits: code width, 1..8.
    :ivar group_size: columns per group, always positive (per-channel quantisation has
        ``group_size == in`` and one group).
    :ivar g_idx: optional ``int32 [in]``: the group of each input column. ``None`` means
        ``column // group_size``. Act-order (GPTQ ``desc_act``) forms groups in a permuted
        column order, so its ``g_idx`` is not monotonic; the codes stay in the original
        column order either way, so dequantising needs no permutation.

    ``n_groups`` must be ``ceil(in / group_size)`` when ``g_idx`` is ``None`` (the last
    group may be shorter), and ``g_idx`` values must lie in ``[0, n_groups)``.

    Dequantised weight: ``w[r, c] ≈ (codes[r, c] - zeros[r, G(c)]) * scales[r, G(c)]`` with
    ``G(c) = g_idx[c]`` (or ``c // group_size``).

    Tensors inside are not copied or frozen; "frozen" refers to the attributes only.
    Instances compare by identity (tensors have no single truth value).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        q, scales, zeros = self.codes, self.scales, self.zeros
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"QuantizedWeight: bits must be an int in 1..8, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"QuantizedWeight: group_size must be a positive int, got {self.group_size!r}")
        if q.dtype != torch.uint8 or q.ndim != 2:
            raise ValueError(f"QuantizedWeight: codes must be uint8 [out, in], got {q.dtype} {tuple(q.shape)}")
        out_f, in_f = q.shape
        if scales.ndim != 2 or scales.shape[0] != out_f or not scales.is_floating_point():
            raise ValueError(f"QuantizedWeight: scales must be float [out={out_f}, n_groups], "
                             f"got {scales.dtype} {tuple(scales.shape)}")
        if zeros.shape != scales.shape or zeros.is_complex() or zeros.dtype == torch.bool:
            raise ValueError(f"QuantizedWeight: zeros must be real [out, n_groups] = {tuple(scales.shape)}, "
                             f"got {zeros.dtype} {tuple(zeros.shape)}")
        n_groups = scales.shape[1]
        if self.g_idx is None:
            expected = -(-in_f // self.group_size)
            if n_groups != expected:
                raise ValueError(f"QuantizedWeight: in={in_f} with group_size={self.group_size} "
                                 f"needs {expected} groups, scales have {n_groups}")
        else:
            g = self.g_idx
            if g.shape != (in_f,) or g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
                raise ValueError(f"QuantizedWeight: g_idx must be an integer tensor [in={in_f}], "
                                 f"got {g.dtype} {tuple(g.shape)}")
            if in_f and (int(g.min()) < 0 or int(g.max()) >= n_groups):
                raise ValueError(f"QuantizedWeight: g_idx values must lie in [0, {n_groups}), "
                                 f"got [{int(g.min())}, {int(g.max())}]")

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def n_groups(self) -> int:
        """Groups per row (columns of :attr:`scales`)."""
        return int(self.scales.shape[1])

    def group_index(self) -> torch.Tensor:
        """``int64 [in]``: the group of each input column (``g_idx`` or ``column // group_size``)."""
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        return torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]`` of ``dtype``: ``(codes - zero) * scale`` with each column's group parameters."""
        idx = self.group_index().to(self.scales.device)
        s = self.scales.to(torch.float32).index_select(1, idx)
        z = self.zeros.to(torch.float32).index_select(1, idx)
        return ((self.codes.to(torch.float32) - z) * s).to(dtype)

    def nbytes(self) -> int:
        """Bytes as stored packed: ``bits`` per code plus a float32 scale and zero per group."""
        return self.codes.numel() * self.bits // 8 + (self.scales.numel() + self.zeros.numel()) * 4

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered (``index`` [out])."""
        return replace(self, codes=self.codes[index], scales=self.scales[index], zeros=self.zeros[index])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along the output dimension (fusing q/k/v or gate/up)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.codes.shape[1]) != (first.bits, first.group_size, first.codes.shape[1]):
                raise ValueError("fused parts must share bits, group size and input features")
            if (p.g_idx is None) != (first.g_idx is None) or (
                    p.g_idx is not None and first.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)):
                raise ValueError("fused parts must share g_idx")
        return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       zeros=torch.cat([p.zeros for p in parts]))


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """float8 e4m3 values with one scale per output row: w[o, i] = data[o, i] * scales[o]."""

    data: torch.Tensor  # float8_e4m3fn [out, in]
    scales: torch.Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scales[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 4

    def rows(self, index: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(self.data[index], self.scales[index])

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))


WeightSpec = torch.Tensor | QuantizedWeight | Fp8Weight


def dequantize(spec: WeightSpec, dtype: torch.dtype) -> torch.Tensor:
    """Any spec as a dense tensor of ``dtype``."""
    return spec.to(dtype) if isinstance(spec, torch.Tensor) else spec.dequantize(dtype)


def fuse(specs: list[WeightSpec]) -> WeightSpec:
    """Fuse the parts of a slot along the output dimension; mixed kinds are dequantised."""
    if len(specs) == 1:
        return specs[0]
    kinds = {type(s) for s in specs}
    if kinds == {QuantizedWeight}:
        return QuantizedWeight.cat(specs)  # type: ignore[arg-type]
    if kinds == {Fp8Weight}:
        return Fp8Weight.cat(specs)  # type: ignore[arg-type]
    return torch.cat([dequantize(s, torch.float32) for s in specs])


@runtime_checkable
class LinearWeight(Protocol):
    """What the model computes a matmul with: ``apply(x) = x @ W^T`` for x [..., in]. A weight
    whose kernel sums in float32 may also offer ``apply_float32(x)`` (see :func:`apply_float32`,
    which the output head goes through)."""

    out_features: int
    in_features: int
    kernel: str  # the backend op it runs, for reports: "mkl-gemv+onednn", "int4pack_mm", ...

    def apply(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int:
        """Weight bytes one call reads (one layout)."""


def apply_float32(lw: LinearWeight, x: torch.Tensor) -> torch.Tensor:
    """``lw.apply(x)`` as float32. A weight whose kernel accumulates in float32 may offer
    ``apply_float32(x)`` to hand that result over unrounded (the output head: a bfloat16
    logit of magnitude 16-32 is a multiple of 0.125, so rounding makes ties of near-ties);
    any other is applied and widened."""
    fn = getattr(lw, "apply_float32", None)
    return fn(x) if fn is not None else lw.apply(x).float()


class LowRankStep:
    """Which rows of the current step run under which low-rank adapter: one object shared by
    every :class:`LowRankUpdated` matmul of a model (an adapter manager sets it before a step
    and clears it after). Three layouts, each with its own ops (see LowRankUpdated):

    - ``SINGLE``: one adapter (resident ``slot``) over rows ``start .. start + width``;
    - ``BLOCKS``: ``n`` adapters (resident ``slots``), ``width`` rows each, one block after
      another from row ``start``;
    - ``GATHER``: anything else: ``gather`` [n * width] lists each adapter's rows, padded with
      the step's row count (a zero row), ``scatter`` the same rows with the pads at row 0
      (they add zeros).

    ``all_slots``: ``slots`` is every resident slot in order (no selection of the buffers).
    ``mirrors``: a backend's copies of this state (its captured step's), set and cleared with it."""

    GATHER, SINGLE, BLOCKS = 0, 1, 2
    __slots__ = ("active", "mode", "all_slots", "slots", "gather", "scatter", "n", "width", "start", "slot",
                 "mirrors")

    def __init__(self) -> None:
        self.active = self.all_slots = False
        self.mode = self.GATHER
        self.slots: torch.Tensor | None = None
        self.gather: torch.Tensor | None = None
        self.scatter: torch.Tensor | None = None
        self.n = self.width = self.start = self.slot = 0
        self.mirrors: list[Any] = []

    def set(self, mode: int, all_slots: bool, slots: torch.Tensor, gather: torch.Tensor, scatter: torch.Tensor,
            n: int, width: int, start: int, slot: int) -> None:
        self.mode, self.all_slots, self.slots, self.gather, self.scatter = mode, all_slots, slots, gather, scatter
        self.n, self.width, self.start, self.slot = n, width, start, slot
        self.active = True
        for m in self.mirrors:
            m.set(mode, all_slots, slots, gather, scatter, n, width, start, slot)

    def clear(self) -> None:
        self.active = False
        for m in self.mirrors:
            m.clear()


@runtime_checkable
class LowRankUpdated(Protocol):
    """A matmul with low-rank adapter updates on top (an adapter manager's wrapper): ``base``
    the packed matmul, ``lora_a`` [slots, in, R] and ``lora_b`` [slots, R, out] (scale folded
    in) in the activation dtype, ``step`` the shared :class:`LowRankStep`. For the rows of
    each adapter present, ``apply`` adds ``x @ A[slot] @ B[slot]`` to the base output ``y``,
    by exactly these ops (a backend's captured step that mirrors it runs the same ones):
    SINGLE ``y[rows].add_(mm(mm(x[rows], A[slot]), B[slot]))``; BLOCKS ``y[rows].view(n, width,
    out).add_(bmm(bmm(x[rows].view(n, width, in), A'), B'))``; GATHER ``cat([x, zeros(1,
    in)]).index_select(0, gather).view(n, width, in)``, ``bmm`` with A', ``bmm`` with B',
    ``index_add_`` at ``scatter``; where A', B' are ``index_select(0, slots)`` of the buffers
    unless ``all_slots``, and each product is cast to ``y``'s dtype before it is added."""

    base: LinearWeight
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    step: LowRankStep
    #: some resident adapter updates this matmul (its buffers are zeros otherwise: no update runs)
    used: bool
    #: a backend's copies of this matmul (its captured step's), told when ``used`` changes (``set_lora_used``)
    mirrors: list[Any]


def spec_to(spec: WeightSpec, device) -> WeightSpec:
    """Move a spec's tensors to ``device`` (before the backend packs it there)."""
    if isinstance(spec, torch.Tensor):
        return spec.to(device)
    if isinstance(spec, Fp8Weight):
        return Fp8Weight(spec.data.to(device), spec.scales.to(device))
    return replace(spec, codes=spec.codes.to(device), scales=spec.scales.to(device), zeros=spec.zeros.to(device),
                   g_idx=spec.g_idx.to(device) if spec.g_idx is not None else None)


def dense_tensor(raw) -> torch.Tensor:
    """A checkpoint tensor as a float tensor: raw quantised ones (GGUFTensor, ...) dequantised."""
    return raw if isinstance(raw, torch.Tensor) else raw.dequantize(torch.float32)


class CheckpointTensors:
    """The checkpoint's tensors by name, and its quantisation metadata; each tensor is taken
    once, and what is left at the end is an error (a tensor the model does not use)."""

    def __init__(self, tensors: dict, quant_config: dict | None = None):
        self._tensors = tensors
        self.quant_config = quant_config or {}  # what the checkpoint says of its quantisation

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str):
        try:
            return self._tensors.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    def discard(self, name: str) -> None:
        self._tensors.pop(name, None)

    def names(self) -> list[str]:
        return list(self._tensors)
