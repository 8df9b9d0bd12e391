"""LoRA adapters, many at once over one base model (the ``adapter`` role's ``lora``).

Reads PEFT's format: a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ``target_modules``) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]). A module's update is ``scale * B @ A`` with ``scale = alpha / r``
(``alpha / sqrt(r)`` under rsLoRA), as PEFT computes it.

How a step runs them (S-LoRA's and Punica's idea, in torch ops): every matmul the model
offers (``CausalLM.linear_sites``: q/k/v fused, o, gate/up fused, down) is wrapped. Its base
runs once over every row of the step, whatever adapter each row asks for; then the rows
of each adapter present are gathered into one padded batch ``[adapters, rows, in]`` and two
batched matmuls (``bmm`` against the adapters' A, then B) give their updates, added back in
place (``index_add_``). That is ~7 ops per matmul however many adapters a step mixes. A
fused matmul's parts (q, k, v) share one A of ``parts * max_lora_rank`` columns and a B that
is block-diagonal, so one pair of matmuls covers them all; a smaller rank is padded with
zeros (exact: it adds zeros). The update is computed in the activation dtype, over any base
weight format (quantised too). Under tensor parallelism A and B are split as their base is
(``TensorParallel.shard``): B's rows for q/k/v and gate/up, A's columns for o and down.

Resident adapters live in per-matmul buffers of ``max_loras`` slots, allocated with the
first adapter. Loading past ``max_loras`` or ``max_lora_memory_mb`` evicts the least
recently used adapter that the coming step does not use (its weights are re-read from its
path when a request names it again). ``merge = true`` folds the one configured adapter into
the checkpoint's weights before the model is built (dense weights only): requests naming
it then cost nothing per step, and no other adapter may be loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import structlog
import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import AdapterInfo, CausalLM, LinearSite
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.weights import LinearWeight, LowRankStep, dense_tensor

log = structlog.get_logger("tokenloom.lora")

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoraOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # adapters loaded at start-up: name -> PEFT directory (``--lora NAME=PATH``)
    modules: dict[str, str] = msgspec.field(default_factory=dict)
    max_loras: int = 4  # adapters resident at once (a step may mix all of them)
    max_lora_rank: int = 16  # the largest rank accepted (buffers are sized by it)
    max_lora_memory_mb: int = 1024  # the resident adapters' weights, at most
    # fold the one adapter in ``modules`` into the base weights at start-up (dense base only)
    merge: bool = False


@dataclass(slots=True)
class _Module:
    """One checkpoint module's update as read: A [r, in], B [out, r], its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(slots=True)
class _Adapter:
    info: AdapterInfo
    modules: dict[str, _Module] | None  # None once evicted (re-read from info.path)
    slot: int | None = None  # its index in the resident buffers


class LoraLinear:
    """A site's base matmul plus the step's adapter updates (a LinearWeight, and a
    ``LowRankUpdated`` that the torch backend's captured step mirrors)."""

    __slots__ = ("base", "out_features", "in_features", "kernel", "lora_a", "lora_b", "step", "slots_used",
                 "mirrors")

    def __init__(self, base: LinearWeight, step: LowRankStep, lora_a: torch.Tensor, lora_b: torch.Tensor):
        self.base, self.step = base, step
        self.out_features, self.in_features = base.out_features, base.in_features
        self.kernel = base.kernel + " + lora"
        self.lora_a = lora_a  # [slots, in, R] (this rank's in for o/down)
        self.lora_b = lora_b  # [slots, R, out] (this rank's out for qkv/gate_up), scale folded in
        self.slots_used: set[int] = set()  # resident slots whose adapter updates this matmul
        self.mirrors: list = []  # the captured step's copies (set_lora_used)

    @property
    def used(self) -> bool:
        return bool(self.slots_used)

    def mark(self, slot: int, used: bool) -> None:
        before = self.used
        (self.slots_used.add if used else self.slots_used.discard)(slot)
        if self.used != before:
            for m in self.mirrors:
                m.set_lora_used(self.used)

    def nbytes(self) -> int:
        return self.base.nbytes()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(x)
        st = self.step
        if not (st.active and self.slots_used):
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if st.mode == LowRankStep.SINGLE:  # one adapter over rows start .. start + width
            xs, ys = x2.narrow(0, st.start, st.width), y2.narrow(0, st.start, st.width)
            ys.add_(torch.mm(torch.mm(xs, self.lora_a.select(0, st.slot)), self.lora_b.select(0, st.slot)).to(y.dtype))
            return y
        a, b = self.lora_a, self.lora_b
        if not st.all_slots:
            a, b = a.index_select(0, st.slots), b.index_select(0, st.slots)
        if st.mode == LowRankStep.BLOCKS:  # n adapters, width rows each, back to back from start
            xs = x2.narrow(0, st.start, st.n * st.width).view(st.n, st.width, x2.shape[1])
            ys = y2.narrow(0, st.start, st.n * st.width).view(st.n, st.width, y2.shape[1])
            ys.add_(torch.bmm(torch.bmm(xs, a), b).to(y.dtype))
            return y
        xz = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
        u = torch.bmm(xz.index_select(0, st.gather).view(st.n, st.width, x2.shape[1]), a)
        d = torch.bmm(u, b)
        y2.index_add_(0, st.scatter, d.view(-1, d.shape[-1]).to(y2.dtype))
        return y


def read_adapter(name: str, path: str, max_rank: int, itemsize: int = 4) -> tuple[AdapterInfo, dict[str, _Module]]:
    """A PEFT LoRA directory as module -> (A, B, scale) in float32, checked; ``itemsize``: the
    bytes of one weight once resident (the activation dtype's), for ``AdapterInfo.nbytes``."""
    root = Path(path)
    cfg_path, w_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg_path.is_file():
        raise ConfigError(f"adapter {name!r}: no {CONFIG_FILE} in {path!r}")
    if not w_path.is_file():
        other = " (adapter_model.bin is not read: save it with safe_serialization)" if (root / "adapter_model.bin").exists() else ""
        raise ConfigError(f"adapter {name!r}: no {WEIGHTS_FILE} in {path!r}{other}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"adapter {name!r}: {cfg_path} is not JSON: {exc}") from None
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ConfigError(f"adapter {name!r}: peft_type {kind!r} is not served (only LORA)")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) is bad:
            raise ConfigError(f"adapter {name!r}: {key} = true is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"adapter {name!r}: bias = {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise ConfigError(f"adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
                          "(whole replaced modules, not low-rank updates)")
    alpha, rslora = float(cfg.get("lora_alpha", cfg.get("r", 8))), bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(w_path))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which, as a ConfigError
        raise ConfigError(f"adapter {name!r}: {w_path} cannot be read as safetensors: {exc}") from None
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ConfigError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight (DoRA magnitudes, "
                              "embedding adapters and saved modules are not supported)")
        found.setdefault(m.group(1), {})[m.group(2)] = t
    modules: dict[str, _Module] = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"adapter {name!r}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} without "
                              f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ConfigError(f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)}, not [r, in] and [out, r]")
        if r > max_rank:
            raise ConfigError(f"adapter {name!r}: module {module!r} has rank {r}, above max_lora_rank {max_rank} "
                              "(--max-lora-rank)")
        mod_alpha = float(_pattern(alpha_pattern, module, alpha))
        expected_r = int(_pattern(rank_pattern, module, cfg.get("r", r)))
        if expected_r != r:
            raise ConfigError(f"adapter {name!r}: module {module!r} has rank {r}, its config says {expected_r}")
        modules[module] = _Module(a, b, mod_alpha / (math.sqrt(r) if rslora else r))
    if not modules:
        raise ConfigError(f"adapter {name!r}: {w_path} holds no LoRA weights")
    digest = hashlib.sha256(w_path.read_bytes()).hexdigest()[:16]
    nbytes = sum((m.a.numel() + m.b.numel()) for m in modules.values()) * itemsize
    info = AdapterInfo(name=name, path=str(root), rank=max(m.a.shape[0] for m in modules.values()),
                       targets=tuple(sorted({k.rsplit(".", 1)[-1] for k in modules})), nbytes=nbytes,
                       resident=False, fingerprint=digest)
    return info, modules


def _pattern(patterns: dict[str, Any], module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that names ``module`` (its full
    name, its tail after a dot, or a regex over the full name)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


class LoraManager:
    """The ``lora`` adapter manager (see the module docstring)."""

    def __init__(self, options: LoraOptions | None = None):
        self.options = options = options or LoraOptions()
        if options.max_loras < 1:
            raise ConfigError(f"adapter.max_loras must be at least 1, got {options.max_loras}")
        if options.max_lora_rank < 1:
            raise ConfigError(f"adapter.max_lora_rank must be at least 1, got {options.max_lora_rank}")
        if options.merge and len(options.modules) != 1:
            raise ConfigError(f"adapter.merge folds exactly one adapter into the base weights; "
                              f"{len(options.modules)} are configured (adapter.modules / --lora)")
        self.merged = options.merge
        self.max_loras = options.max_loras
        self._step = LowRankStep()
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()  # least recently used first
        self._wrappers: dict[str, tuple[LinearSite, LoraLinear]] = {}  # part module -> (site, wrapper)
        self._sites: list[tuple[LinearSite, LoraLinear]] = []
        self._tp = TensorParallel()
        self._cfg = None
        self._dtype = torch.float32
        self._device = torch.device("cpu")
        self._free_slots: list[int] = list(range(self.options.max_loras))
        self._merged_info: AdapterInfo | None = None

    # ---- start-up ---------------------------------------------------------------------
    def merge(self, weights: dict[str, Any]) -> None:
        """``merge = true``: fold the configured adapter into the checkpoint's tensors
        (``weights``, HF names) before the model is built. A quantised tensor is refused."""
        (name, path), = self.options.modules.items()
        info, modules = read_adapter(name, path, self.options.max_lora_rank)
        for module, m in modules.items():
            key = module + ".weight"
            if key not in weights:
                raise ConfigError(f"adapter {name!r}: module {module!r} is not in the base checkpoint")
            raw = weights[key]
            if not isinstance(raw, torch.Tensor):
                raise ConfigError(f"adapter.merge: {key} is stored quantised ({type(raw).__name__}); merging needs "
                                  "dense weights: serve the adapter unmerged, or load the base with --quantizer none")
            w = dense_tensor(raw)
            if tuple(w.shape) != (m.b.shape[0], m.a.shape[1]):
                raise ConfigError(f"adapter {name!r}: module {module!r} updates a {m.b.shape[0]}x{m.a.shape[1]} "
                                  f"weight, the base's is {tuple(w.shape)}")
            weights[key] = (w.float() + m.scale * (m.b @ m.a)).to(w.dtype)
        self._merged_info = dataclasses.replace(info, nbytes=0, resident=True)
        log.info("lora_merged", adapter=name, modules=len(modules))

    def attach(self, model: CausalLM, tp: TensorParallel) -> None:
        self._tp, self._cfg, self._dtype = tp, model.cfg, model.dtype
        self._device = next(cast(torch.nn.Module, model).parameters()).device
        if self.merged:
            return
        sites = model.linear_sites()
        if not sites:
            raise ConfigError(f"adapter lora: model {type(model).__name__} offers no matmul to adapt")
        current = {(i, slot): lw for i, layer in enumerate(model.linear_layers()) for slot, lw in layer.items()}
        n, rank = self.options.max_loras, self.options.max_lora_rank
        for site in sites:
            base = current[(site.layer, site.slot)]
            r = rank * len(site.parts)  # each part its own rank block
            wrapper = LoraLinear(base, self._step,
                                 torch.zeros(n, base.in_features, r, dtype=self._dtype, device=self._device),
                                 torch.zeros(n, r, base.out_features, dtype=self._dtype, device=self._device))
            model.set_linear(site.layer, site.slot, wrapper)
            self._sites.append((site, wrapper))
            for part in site.parts:
                self._wrappers[part] = (site, wrapper)
        for name, path in self.options.modules.items():
            self.load(name, path)

    # ---- adapters -----------------------------------------------------------------------
    def adapters(self) -> list[AdapterInfo]:
        if self._merged_info is not None:
            return [self._merged_info]
        return [a.info for a in self._adapters.values()]

    def load(self, name: str, path: str) -> AdapterInfo:
        if self.merged:
            raise ConfigError(f"adapter {self._merged_info.name if self._merged_info else ''!r} is merged into the "
                              "base weights: no other adapter can be loaded (adapter.merge)")
        if name in self._adapters:
            raise ConfigError(f"adapter {name!r} is already loaded (unload it first)")
        info, modules = read_adapter(name, path, self.options.max_lora_rank, self._dtype.itemsize)
        self._check_targets(name, modules)
        if info.nbytes > self.options.max_lora_memory_mb << 20:
            raise ConfigError(f"adapter {name!r} needs {info.nbytes >> 20} MiB, above "
                              f"max_lora_memory_mb {self.options.max_lora_memory_mb}")
        entry = _Adapter(info, modules)
        self._adapters[name] = entry
        self._make_resident(entry, keep=set())
        log.info("lora_loaded", adapter=name, path=path, rank=info.rank, targets=list(info.targets))
        return entry.info

    def unload(self, name: str) -> None:
        if self.merged:
            raise ConfigError("the merged adapter cannot be unloaded (adapter.merge)")
        entry = self._adapters.pop(name)  # KeyError when unknown
        self._evict(entry)
        log.info("lora_unloaded", adapter=name)

    def _check_targets(self, name: str, modules: dict[str, _Module]) -> None:
        for module, m in modules.items():
            if module not in self._wrappers:
                known = sorted({p.rsplit(".", 1)[-1] for p in self._wrappers})
                raise ConfigError(f"adapter {name!r}: module {module!r} is not a matmul this model adapts "
                                  f"(targets it can take: {', '.join(known)})")
            site, _ = self._wrappers[module]
            part = site.parts.index(module)
            if tuple(m.b.shape[0:1]) != (site.rows[part],) or m.a.shape[1] != site.in_features:
                raise ConfigError(f"adapter {name!r}: module {module!r} updates a {m.b.shape[0]}x{m.a.shape[1]} "
                                  f"weight, the model's is {site.rows[part]}x{site.in_features} (another base model?)")

    def _resident(self) -> list[_Adapter]:
        return [a for a in self._adapters.values() if a.slot is not None]

    def _make_resident(self, entry: _Adapter, keep: set[str]) -> None:
        """Give ``entry`` a slot, evicting least recently used adapters not in ``keep``."""
        self._adapters.move_to_end(entry.info.name)
        if entry.slot is not None:
            return
        if entry.modules is None:  # evicted earlier: read again
            _, entry.modules = read_adapter(entry.info.name, entry.info.path, self.options.max_lora_rank)
        budget = self.options.max_lora_memory_mb << 20
        while True:
            resident = self._resident()
            used = sum(a.info.nbytes for a in resident)
            if len(resident) < self.options.max_loras and used + entry.info.nbytes <= budget:
                break
            victims = [a for a in resident if a.info.name not in keep]
            if not victims:
                raise ConfigError(f"adapter {entry.info.name!r} cannot be made resident: the step already uses "
                                  f"{len(resident)} adapters (max_loras {self.options.max_loras}, "
                                  f"max_lora_memory_mb {self.options.max_lora_memory_mb})")
            self._evict(victims[0])
            log.info("lora_evicted", adapter=victims[0].info.name, for_adapter=entry.info.name)
        entry.slot = self._free_slots.pop(0)
        self._write(entry)
        entry.info = dataclasses.replace(entry.info, resident=True)

    def _evict(self, entry: _Adapter) -> None:
        if entry.slot is not None:
            for _, w in self._sites:
                w.lora_a[entry.slot].zero_()
                w.lora_b[entry.slot].zero_()
                w.mark(entry.slot, False)
            self._free_slots.append(entry.slot)
            self._free_slots.sort()
            entry.slot = None
        entry.modules = None
        entry.info = dataclasses.replace(entry.info, resident=False)

    def _write(self, entry: _Adapter) -> None:
        """The adapter's modules into its slot: per site, A [in, R] and B [R, out] with each
        part in its own rank block (B block-diagonal), scale folded into B, split for this
        rank as the base is."""
        assert entry.modules is not None and entry.slot is not None
        rank, tp, cfg = self.options.max_lora_rank, self._tp, self._cfg
        for site, w in self._sites:
            parts = [entry.modules.get(p) for p in site.parts]
            if not any(parts):
                continue
            r = rank * len(site.parts)
            a_full = torch.zeros(r, site.in_features)  # weight orientation: [R, in]
            b_full = torch.zeros(sum(site.rows), r)  # [out, R]
            row = 0
            for i, (m, rows) in enumerate(zip(parts, site.rows, strict=True)):
                if m is not None:
                    k = m.a.shape[0]
                    a_full[i * rank:i * rank + k] = m.a
                    b_full[row:row + rows, i * rank:i * rank + k] = m.b * m.scale
                row += rows
            if site.kind in ("qkv", "gate_up"):
                b_full = tp.shard(site.kind, f"{entry.info.name}:{site.parts[0]}", b_full, cfg, "lora")
            else:
                a_full = tp.shard(site.kind, f"{entry.info.name}:{site.parts[0]}", a_full, cfg, "lora")
            w.lora_a[entry.slot].copy_(a_full.t())
            w.lora_b[entry.slot].copy_(b_full.t())
            w.mark(entry.slot, True)

    # ---- steps ----------------------------------------------------------------------------
    def row_order(self, name: str) -> int:
        entry = self._adapters.get(name)
        return entry.slot if entry is not None and entry.slot is not None else self.options.max_loras

    def begin_step(self, rows: list[tuple[str, int, int]], num_rows: int) -> bool:
        if not rows or self.merged:
            return False
        by_name: dict[str, list[int]] = {}
        for name, start, end in rows:
            by_name.setdefault(name, []).extend(range(start, end))
        for name in by_name:
            entry = self._adapters.get(name)
            if entry is None:
                raise KeyError(f"adapter {name!r} is not loaded")
            self._make_resident(entry, keep=set(by_name))
        slots = [self._adapters[name].slot for name in by_name]
        spans = list(by_name.values())
        width = max(len(r) for r in spans)
        contiguous = all(r == list(range(r[0], r[0] + len(r))) for r in spans)
        device, st = self._device, self._step
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        all_slots = slots == list(range(self.options.max_loras))
        if contiguous and len(spans) == 1:
            st.set(st.SINGLE, all_slots, slot_t, slot_t, slot_t, 1, width, spans[0][0], slots[0])
        elif contiguous and all(len(r) == width for r in spans) and all(
                b[0] == a[0] + width for a, b in zip(spans, spans[1:], strict=False)):
            st.set(st.BLOCKS, all_slots, slot_t, slot_t, slot_t, len(spans), width, spans[0][0], 0)
        else:
            gather = torch.tensor([r + [num_rows] * (width - len(r)) for r in spans], dtype=torch.long,
                                  device=device).view(-1)
            st.set(st.GATHER, all_slots, slot_t, gather, torch.where(gather == num_rows, 0, gather), len(spans),
                   width, 0, 0)
        return True

    def end_step(self) -> None:
        self._step.clear()


@hookimpl
def register_adapters(register):
    register("lora", LoraManager, options=LoraOptions,
             description="PEFT LoRA adapters, many resident, mixed per step (segmented gather + bmm)")
