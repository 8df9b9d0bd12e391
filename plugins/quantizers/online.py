"""`int8`, `rtn` and `fp8`: quantise a full-precision checkpoint while it loads.

Each takes a slot's dense weights (a quantised checkpoint is dequantised first: asking for
int8 on a 4-bit file re-quantises, which only makes sense to measure the methods) and
returns the spec the backend packs:

- `int8`: symmetric int8 per output channel, scale = max|w| / 127 (weight-only; the torch
  backend runs ``_weight_int8pack_mm`` on CPU);
- `rtn`: round-to-nearest, asymmetric with zero points, ``bits`` (4) per weight in groups of
  ``group_size`` (128) input columns — the baseline GPTQ and AWQ are measured against;
- `fp8`: float8 e4m3 with one scale per output channel, scale = max|w| / 448. The output
  head stays dense (``lm_head = true`` quantises it too): vLLM's fp8 leaves ``lm_head``
  alone, and on SmolLM2 the tied head alone costs as much perplexity as all 30 layers.
  Rounded to nearest here; `tokenloom quantize --method fp8` rounds with GPTQ's error
  feedback, which is what brings fp8 within 1% (README, Quantization).
"""

from __future__ import annotations

import msgspec
import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.weights import (
    CheckpointTensors,
    Fp8Weight,
    LinearSlot,
    QuantizedWeight,
    WeightSpec,
    dense_tensor,
)
from tokenloom.plugins.quantizers.native import refuse_packed
from tokenloom.plugins.quantizers.primitives import (
    quantize_fp8_e4m3,
    quantize_int8_per_channel,
    quantize_rtn,
)


def _dense(slot: LinearSlot, tensors: CheckpointTensors, name: str) -> torch.Tensor:
    refuse_packed(slot, tensors, name)
    return slot.fuse([dense_tensor(tensors.take(part + ".weight")).float() for part in slot.parts])


class Int8Quantizer:
    def __init__(self, options=None):
        pass

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> QuantizedWeight:
        q, scales = quantize_int8_per_channel(_dense(slot, tensors, "int8"))
        out, inp = q.shape
        return QuantizedWeight(codes=(q.to(torch.int16) + 128).to(torch.uint8), scales=scales[:, None].float(),
                               zeros=torch.full((out, 1), 128.0), bits=8, group_size=inp)


def fit_group(group_size: int, in_features: int) -> int:
    """The group size to use for ``in_features`` columns: ``group_size`` halved until it
    divides them (SmolLM2's 576 = 4.5 x 128 gets 64); below 32, one group per row."""
    if group_size == -1:
        return in_features
    while group_size >= 32 and in_features % group_size:
        group_size //= 2
    return group_size if group_size >= 32 else in_features


class RTNOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bits: int = 4
    group_size: int = 128  # -1: one group per output row


class RTNQuantizer:
    def __init__(self, options: RTNOptions | None = None):
        o = options or RTNOptions()
        if not 2 <= o.bits <= 8:
            raise ConfigError(f"quantizer.bits must be in 2..8, got {o.bits}")
        if o.group_size != -1 and o.group_size < 1:
            raise ConfigError(f"quantizer.group_size must be -1 or >= 1, got {o.group_size}")
        self.bits, self.group_size = o.bits, o.group_size

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> QuantizedWeight:
        w = _dense(slot, tensors, "rtn")
        return quantize_rtn(w, bits=self.bits, group_size=fit_group(self.group_size, w.shape[1]))


class FP8Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lm_head: bool = False  # quantise the output head too (vLLM and llm-compressor leave it)


class FP8Quantizer:
    def __init__(self, options: FP8Options | None = None):
        self.lm_head = (options or FP8Options()).lm_head

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> WeightSpec:
        """An fp8 checkpoint (``weight`` e4m3 + ``weight_scale``) loads as it is; anything
        else is quantised here, except the output head (dense, unless ``lm_head``)."""
        if slot.name == "lm_head" and not self.lm_head and not tensors.has(slot.parts[0] + ".weight_scale"):
            return slot.fuse([dense_tensor(tensors.take(part + ".weight")) for part in slot.parts])
        if all(tensors.has(part + ".weight_scale") for part in slot.parts):
            parts = [Fp8Weight(tensors.take(part + ".weight"), tensors.take(part + ".weight_scale").float().flatten())
                     for part in slot.parts]
            return slot.fuse(parts)
        data, scales = quantize_fp8_e4m3(_dense(slot, tensors, "fp8"))
        return Fp8Weight(data, scales.float())


@hookimpl
def register_quantizers(register):
    register("int8", Int8Quantizer, description="weight-only int8 per output channel, quantised at load")
    register("rtn", RTNQuantizer, options=RTNOptions,
             description="round-to-nearest grouped 4-bit with zero points (the baseline), quantised at load")
    register("fp8", FP8Quantizer, options=FP8Options,
             description="float8 e4m3 weights with a scale per output channel (output head kept dense)")
