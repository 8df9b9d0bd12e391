"""Triton kernels of the `triton` backend (backends/triton_backend.py).

Each op is a triple, as in the Triton tutorials: ``_op_kernel`` (``@triton.jit``), the
launcher ``op(...)`` that checks shapes, strides and dtypes (a ValueError naming the
argument) and computes the grid, and ``op_ref(...)``, plain torch with the same signature,
which tests/test_triton_kernels.py compares it with:

- ``paged_decode_attention``: one query token per sequence over its paged context; GQA at
  any ratio; split-K over long contexts with a reduction kernel (decode_attention.py);
- ``paged_prefill_attention``: causal chunks over a paged context whose earlier tokens are
  cached (prefill_attention.py);
- ``write_kv``: K/V into their slots, plain or into 8-bit pools with the torch backend's
  per-slot scales, bit for bit (kv_write.py);
- ``int4_matmul``: 4-bit GPTQ-layout dequantising matmul, a GEMV and a tiled GEMM
  (int4_matmul.py);
- ``fp8_matmul``: e4m3 weights with per-channel scales (fp8_matmul.py);
- ``add_rms_norm`` / ``rms_norm``: RMSNorm fused with the residual add (norm.py);
- ``rope``: neox-style rotate-half RoPE (rope.py).

Importing this package defines the kernels, so on a machine without a GPU
``TRITON_INTERPRET=1`` must be set before (Triton reads it when a kernel is defined); the
interpreter runs them on CPU tensors, about a thousand times slower.
"""

from __future__ import annotations

from .decode_attention import paged_decode_attention, paged_decode_attention_ref
from .fp8_matmul import fp8_matmul, fp8_matmul_ref
from .int4_matmul import Int4Packed, int4_matmul, int4_matmul_ref, pack_int4
from .kv_write import write_kv, write_kv_ref
from .norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from .prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from .rope import rope, rope_ref

__all__ = [
    "Int4Packed", "add_rms_norm", "add_rms_norm_ref", "fp8_matmul", "fp8_matmul_ref", "int4_matmul",
    "int4_matmul_ref", "pack_int4", "paged_decode_attention", "paged_decode_attention_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref", "rms_norm", "rms_norm_ref", "rope", "rope_ref",
    "write_kv", "write_kv_ref",
]
