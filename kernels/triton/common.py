"""What every launcher in this package shares: argument checks that raise ValueError
naming the argument, the interpreter switch, and the dot-operand dtype rule.

Triton's interpreter (``TRITON_INTERPRET=1``, read when a ``@triton.jit`` function is
defined) runs kernels on CPU tensors with numpy; its bfloat16 arithmetic is wrong and its
fp32 -> bf16 cast truncates, so under it every kernel loads 16-bit values and computes in
float32, dot products included (``dot_dtype``). On a GPU 16-bit operands go to ``tl.dot``
as they are (tensor cores, float32 accumulation) and float32 ones with IEEE precision.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

#: kernels run under Triton's interpreter (on CPU tensors): fixed when this package is imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
#: 8-bit KV storage the kernels dequantise: (torch dtype, qmax), as backends/torch_backend.py's KV_STORAGE
KV_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype):
    """The dtype ``tl.dot`` operands are cast to for activations of ``dtype``."""
    return tl.float32 if INTERPRET or dtype == torch.float32 else _TL[dtype]


def next_pow2(n: int, minimum: int = 1) -> int:
    """``tl.arange`` needs powers of two; ``tl.dot`` on a GPU needs 16 or more."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def check_tensor(t, name: str, *, ndim: int | None = None, dtypes=None, device: torch.device | None = None,
                 unit_last: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a tensor of that rank, dtype and device
    (``unit_last``: its last dimension has stride 1, which coalesced loads want)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of {names}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other arguments on {device}")
    if unit_last and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")


def check_shape(t: torch.Tensor, name: str, shape: tuple) -> None:
    """``shape`` entries of None match any size."""
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_kv_pool(cache: torch.Tensor, scale: torch.Tensor | None, name: str, dtype: torch.dtype,
                  device: torch.device) -> None:
    """A paged K or V pool ``[kv_heads, num_blocks, block_size, head_dim]`` in ``dtype``, or
    8-bit (float8_e4m3fn / int8) with its per-slot scales ``[kv_heads, num_blocks, block_size]``."""
    check_tensor(cache, name, ndim=4, device=device, unit_last=True)
    if cache.dtype in KV_QUANT_DTYPES:
        if scale is None:
            raise ValueError(f"{name} is {str(cache.dtype).removeprefix('torch.')}: its scales are needed "
                             f"({name.replace('cache', 'scale')} [kv_heads, num_blocks, block_size])")
        check_tensor(scale, f"{name} scale", ndim=3, dtypes=FLOAT_DTYPES, device=device)
        check_shape(scale, f"{name} scale", tuple(cache.shape[:3]))
    elif cache.dtype != dtype:
        raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')} (the query's dtype) or 8-bit, "
                         f"got {str(cache.dtype).removeprefix('torch.')}")
    elif scale is not None:
        raise ValueError(f"{name} holds {str(cache.dtype).removeprefix('torch.')}: it takes no scale")
