"""Tensor parallelism: one model's matmuls, attention heads and KV cache split over ranks.

The Megatron-LM layout (Shoeybi et al. 2019, arXiv:1909.08053), as vLLM and SGLang use
it: in each layer the fused q/k/v and gate/up matmuls are *column*-parallel (each rank
computes its own heads and its own slice of the FFN), the o and down matmuls are
*row*-parallel (each rank multiplies its slice of the input; an all-reduce sums the
partial outputs), so a layer costs two all-reduces of ``[tokens, hidden]``. The
embedding and the output head are split by vocabulary: each rank looks up the ids it
holds (the others add zeros through an all-reduce) and computes its slice of the logits,
which rank 0 gathers.

Heads go with their KV head: a rank holds whole KV heads and the query heads that read
them, so attention never crosses ranks, and each rank's KV pool stores only its KV heads.
The split need not be even (SmolLM2 has 3 KV heads; on 2 ranks rank 0 holds two and rank 1
one): the first ``n % world`` ranks take one more, and every rank sizes its pool for the
largest share so that the block tables, built once on rank 0, hold on every rank.

Sharding happens at load time on each matmul's weight spec, right after the quantizer made
it and before the backend packs it: rows for column-parallel slots (any spec can give up
rows), columns for row-parallel ones (a 4-bit weight only at a quantisation-group
boundary, else start-up fails with a sentence naming the layer and the method). Sums run
in float32, whatever the weight dtype, so partial sums add up the way one rank's matmul
would (to rounding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.weights import Fp8Weight, QuantizedWeight, WeightSpec

if TYPE_CHECKING:  # torch.distributed is imported where it is used
    from torch.distributed import ProcessGroup


def split_evenly(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s share of ``n`` items over ``world`` ranks: contiguous, the first
    ``n % world`` ranks one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. ``world_size == 1`` (the default)
    changes nothing: every method is the identity and no collective is called."""

    rank: int = 0
    world_size: int = 1
    group: ProcessGroup | None = None  # the model's process group (None: the default one)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # ---- the partition ---------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """Refuse a split this model cannot take, with a sentence naming the limit."""
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a tensor-parallel group of {self.world_size}")
        if self.world_size > cfg.num_kv_heads:
            raise ConfigError(f"tensor_parallel_size {self.world_size} exceeds the model's {cfg.num_kv_heads} KV "
                              "heads: each rank holds whole KV heads (replicating them is not supported)")

    def kv_heads(self, cfg: ModelConfig, rank: int | None = None) -> range:
        return split_evenly(cfg.num_kv_heads, self.world_size, self.rank if rank is None else rank)

    def heads(self, cfg: ModelConfig, rank: int | None = None) -> range:
        kv, group = self.kv_heads(cfg, rank), cfg.num_heads // cfg.num_kv_heads
        return range(kv.start * group, kv.stop * group)

    def ffn(self, cfg: ModelConfig) -> range:
        """This rank's FFN columns, split in units of 128 (or 64, 32: the largest that divides
        the FFN into at least one unit per rank), so a row-parallel ``down`` weight quantised
        in groups of up to that many columns splits at group boundaries."""
        n = cfg.intermediate_size
        unit = next((u for u in (128, 64, 32) if n % u == 0 and n // u >= self.world_size), 1)
        units = split_evenly(n // unit, self.world_size, self.rank)
        return range(units.start * unit, units.stop * unit)

    def experts(self, num_experts: int, rank: int | None = None) -> range:
        """This rank's experts of a mixture-of-experts layer: whole experts, a contiguous share
        of the indices (the first ``num_experts % world`` ranks one more), so each expert's
        matmuls run unsplit on one rank and the layer's all-reduce adds the ranks' partial
        sums; the router is on every rank. More ranks than experts is refused."""
        if self.world_size > num_experts:
            raise ConfigError(f"tensor_parallel_size {self.world_size} exceeds the model's {num_experts} experts: "
                              "each rank holds whole experts (splitting an expert is not supported)")
        return split_evenly(num_experts, self.world_size, self.rank if rank is None else rank)

    def vocab_shard_size(self, cfg: ModelConfig) -> int:
        return -(-cfg.vocab_size // self.world_size)

    def vocab(self, cfg: ModelConfig) -> range:
        """Equal shards (the last one shorter), so that gathered logits line up."""
        s = self.vocab_shard_size(cfg)
        return range(min(self.rank * s, cfg.vocab_size), min((self.rank + 1) * s, cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """What one layer on this rank sees: its heads, KV heads and FFN slice."""
        if not self.enabled:
            return cfg
        return dataclasses.replace(cfg, num_heads=len(self.heads(cfg)), num_kv_heads=len(self.kv_heads(cfg)),
                                   intermediate_size=len(self.ffn(cfg)))

    def largest_config(self, cfg: ModelConfig) -> ModelConfig:
        """The local config of the rank with the most KV heads (rank 0): KV pools are sized by it."""
        return dataclasses.replace(self, rank=0).local_config(cfg)

    # ---- sharding weight specs -----------------------------------------------------------
    def shard(self, kind: str, name: str, spec: WeightSpec, cfg: ModelConfig, method: str) -> WeightSpec:
        """This rank's part of the full weight ``spec`` of slot ``kind`` (qkv, gate_up,
        lm_head: rows; o, down: columns)."""
        if not self.enabled:
            return spec
        hd = cfg.head_dim
        if kind in ("qkv", "gate_up", "lm_head"):
            return take_rows(spec, self.rows(kind, cfg))
        if kind == "o":
            q = self.heads(cfg)
            return take_columns(spec, q.start * hd, q.stop * hd, name, method)
        if kind == "down":
            f = self.ffn(cfg)
            return take_columns(spec, f.start, f.stop, name, method)
        raise ValueError(f"unknown slot kind {kind!r}")

    def rows(self, kind: str, cfg: ModelConfig) -> list[int]:
        """This rank's output rows of a column-parallel slot (qkv, gate_up, lm_head)."""
        hd = cfg.head_dim
        if kind == "qkv":
            q, kv = self.heads(cfg), self.kv_heads(cfg)
            k0, v0 = cfg.q_size, cfg.q_size + cfg.kv_size
            return [*range(q.start * hd, q.stop * hd), *range(k0 + kv.start * hd, k0 + kv.stop * hd),
                    *range(v0 + kv.start * hd, v0 + kv.stop * hd)]
        if kind == "gate_up":
            f, n = self.ffn(cfg), cfg.intermediate_size
            return [*f, *range(n + f.start, n + f.stop)]
        if kind == "lm_head":
            return list(self.vocab(cfg))
        raise ValueError(f"slot kind {kind!r} is not split by rows")

    def shard_bias(self, kind: str, bias: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of a column-parallel slot's bias (its output rows)."""
        if not self.enabled:
            return bias
        return bias[torch.tensor(self.rows(kind, cfg), dtype=torch.long)].contiguous()

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in float32 (a row-parallel matmul's partial outputs)."""
        if not self.enabled:
            return x
        import torch.distributed as dist

        x = x.float().contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, local_embed: torch.Tensor, input_ids: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """Vocab-parallel lookup -> float32 [T, hidden] on every rank."""
        if not self.enabled:
            return local_embed[input_ids].float()
        v = self.vocab(cfg)
        mine = (input_ids >= v.start) & (input_ids < v.stop)
        rows = (input_ids - v.start).clamp(0, max(len(v) - 1, 0))
        out = local_embed[rows].float() * mine[:, None]
        return self.all_reduce(out)

    def gather_logits(self, local: torch.Tensor, cfg: ModelConfig) -> torch.Tensor | None:
        """Each rank's vocabulary slice of the logits -> the whole ``[T, V]`` on rank 0
        (``None`` on the others)."""
        if not self.enabled:
            return local
        import torch.distributed as dist

        s = self.vocab_shard_size(cfg)
        local = torch.nn.functional.pad(local.float(), (0, s - local.shape[-1])).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :cfg.vocab_size] if parts is not None else None


def take_rows(spec: WeightSpec, rows: list[int]) -> WeightSpec:
    index = torch.tensor(rows, dtype=torch.long)
    if isinstance(spec, torch.Tensor):
        return spec[index.to(spec.device)].contiguous()
    return spec.rows(index.to(spec.scales.device))


def take_columns(spec: WeightSpec, start: int, stop: int, name: str, method: str) -> WeightSpec:
    """Input columns ``start:stop`` of a weight. A grouped-quantised weight splits only at
    a group boundary, without act-order (its groups are not contiguous columns)."""
    if isinstance(spec, torch.Tensor):
        return spec[:, start:stop].contiguous()
    if isinstance(spec, Fp8Weight):  # one scale per output row: columns split freely
        return Fp8Weight(spec.data[:, start:stop].contiguous(), spec.scales)
    assert isinstance(spec, QuantizedWeight)
    g = spec.group_size
    whole = spec.n_groups == 1 and g >= spec.shape[1]  # per-channel: one group spans the row
    if spec.g_idx is not None or (not whole and (start % g or (stop % g and stop != spec.shape[1]))):
        raise ConfigError(f"tensor parallelism cannot split {name} (quantizer {method}): its input would be cut at "
                          f"column {start if start % g else stop}, inside a {g}-column quantisation group"
                          + (" (act-order weights cannot be split at all)" if spec.g_idx is not None else "")
                          + "; choose a tensor_parallel_size that divides the layer at group boundaries")
    codes = spec.codes[:, start:stop].contiguous()
    if whole:
        return dataclasses.replace(spec, codes=codes, group_size=stop - start)
    gs = slice(start // g, -(-stop // g))
    return dataclasses.replace(spec, codes=codes, scales=spec.scales[:, gs].contiguous(),
                               zeros=spec.zeros[:, gs].contiguous())
