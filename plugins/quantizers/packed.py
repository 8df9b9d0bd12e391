"""`gptq` and `awq`: load checkpoints in the layouts published models use.

AutoGPTQ / GPTQModel (``qweight``, ``qzeros`` stored minus one, ``scales``, ``g_idx``) and
AutoAWQ GEMM (``qweight`` interleaved, ``qzeros``, ``scales``); plugins/quantizers/layouts.py
documents both bit layouts. Bits and group size come from the checkpoint's
``quantization_config`` (or ``quantize_config.json`` / ``quant_config.json``); a slot the
checkpoint left unquantised (often ``lm_head``) loads dense. ``tokenloom quantize`` writes
these layouts, so its checkpoints load here and in other engines.
"""

from __future__ import annotations

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.weights import CheckpointTensors, LinearSlot, WeightSpec, dense_tensor
from tokenloom.plugins.quantizers.layouts import awq_unpack, gptq_unpack
from tokenloom.plugins.quantizers.quant_config import read_quant_config

_GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_TENSORS = ("qweight", "qzeros", "scales")


class _PackedQuantizer:
    """Shared by both layouts; a subclass names its method, its tensors and ``unpack``."""

    method = ""
    tensors: tuple[str, ...] = ()
    unpack: staticmethod

    def __init__(self, options=None):
        pass

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> WeightSpec:
        if not tensors.quant_config:
            raise ValueError(f"quantizer {self.method!r} needs a checkpoint with a {self.method} quantization config")
        cfg = read_quant_config(tensors.quant_config)
        if cfg.method != self.method:
            raise ValueError(f"the checkpoint is {cfg.method}-quantised; quantizer {self.method!r} cannot load it")
        parts = []
        for part in slot.parts:
            if not tensors.has(part + ".qweight"):
                parts.append(dense_tensor(tensors.take(part + ".weight")))  # left unquantised
                continue
            raw = {n: tensors.take(f"{part}.{n}") for n in self.tensors if n != "g_idx" or tensors.has(f"{part}.g_idx")}
            group = cfg.group_size if cfg.group_size != -1 else None
            try:
                parts.append(self.unpack(raw, cfg.bits, group))
            except ValueError as exc:
                raise ValueError(f"{part}: {exc}") from None
        return slot.fuse(parts, tensor="qweight")


class GPTQQuantizer(_PackedQuantizer):
    method, tensors = "gptq", _GPTQ_TENSORS
    unpack = staticmethod(gptq_unpack)


class AWQQuantizer(_PackedQuantizer):
    method, tensors = "awq", _AWQ_TENSORS

    @staticmethod
    def unpack(raw, bits, group_size):
        return awq_unpack(raw, group_size)  # always 4-bit


@hookimpl
def register_quantizers(register):
    register("gptq", GPTQQuantizer, description="GPTQ checkpoints (AutoGPTQ/GPTQModel layout); write with "
                                                "`tokenloom quantize --method gptq`")
    register("awq", AWQQuantizer, description="AWQ checkpoints (AutoAWQ GEMM layout); write with "
                                              "`tokenloom quantize --method awq`")
