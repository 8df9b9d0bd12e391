"""`none` and `gguf`: the quantizers that take a checkpoint as it is.

`none` computes with dense weights in the engine dtype (a quantised checkpoint is
dequantised: llama.cpp's reference numbers, at full memory cost). `gguf` keeps GGUF's
Q4_0/Q4_1/Q8_0 blocks as integer codes with a scale and zero point per 32 columns, so the
backend can run its 4-bit kernel on them; it is what a quantised GGUF gets by default.
"""

from __future__ import annotations

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.loader.gguf_file import GGUFTensor
from tokenloom.core.weights import CheckpointTensors, LinearSlot, WeightSpec, dense_tensor


def refuse_packed(slot: LinearSlot, tensors: CheckpointTensors, name: str) -> None:
    for part in slot.parts:
        if tensors.has(part + ".qweight"):
            raise ValueError(f"{part} is stored GPTQ/AWQ-packed (qweight); quantizer {name!r} cannot read it: "
                             "use the checkpoint's own method (gptq or awq)")


class NoQuantizer:
    """Dense weights: whatever the checkpoint holds, dequantised."""

    def __init__(self, options=None):
        pass

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> WeightSpec:
        refuse_packed(slot, tensors, "none")
        return slot.fuse([dense_tensor(tensors.take(part + ".weight")) for part in slot.parts])


class GGUFQuantizer:
    """GGUF blocks as they are stored (see core/loader/gguf_file.py ``GGUFTensor``)."""

    def __init__(self, options=None):
        pass

    def weight_spec(self, slot: LinearSlot, tensors: CheckpointTensors) -> WeightSpec:
        refuse_packed(slot, tensors, "gguf")
        parts = []
        for part in slot.parts:
            raw = tensors.take(part + ".weight")
            parts.append(raw.to_quantized() if isinstance(raw, GGUFTensor) else raw)
        return slot.fuse(parts)


@hookimpl
def register_quantizers(register):
    register("none", NoQuantizer, description="dense weights in the engine dtype (quantised checkpoints dequantised)")
    register("gguf", GGUFQuantizer, description="GGUF Q4_0/Q4_1/Q8_0 kept quantised (default for such files)")
