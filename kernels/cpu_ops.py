"""C++ ops for CPUs: decode attention that reads the KV blocks where they lie, matmuls over
quantised weights, the residual add fused with RMSNorm, RoPE over a prefill's rows and the
sampler's greedy argmax.

The torch path (``TorchBackend._decode``) gathers every sequence's padded context into a
new tensor in every layer, converts it, and runs ~20 small ops; at batch 1 on the embedded
model that is ~40% of a decode step's non-matmul time. This op walks each sequence's block
table instead: for each (sequence, KV head) it scores the group's query heads against the
keys in place, takes a softmax in float32 and sums the values, with no copy of the cache.

The C++ lives in ``kernels/csrc/`` (shipped as package data):

- ``attention.h``: ``paged_decode_attention``, and ``decode_layer_attention`` (RoPE, the
  KV write and that attention for one layer, from its fused qkv projection); the first (and
  ``slot_attention``) also take a sliding ``window`` (keys before ``context_len - window``
  skipped) and a score ``softcap``, 0 for none;
- ``quant_matmul.h``: ``quant_matmul``, few-row matmuls over 4-bit and symmetric 8-bit
  weights in their stored groups (float32 activations and sums; backends/torch_linear.py
  ``QuantMatmulLinear`` packs the weights for it);
- ``amx_matmul.h``: ``amx_matmul``, many-row matmuls over the same packed weights on Intel
  AMX (bfloat16 tiles widened from the codes per 16-column block), what a bfloat16 step
  above the quantised kernel's row threshold runs instead of a dense copy where
  ``amx_ready()``;
- ``q8_matmul.h``: ``q8_matmul``, many-row matmuls over 4-bit and symmetric 8-bit codes with
  each row's activations rounded to 8 bits in blocks of 32 (AVX512-VNNI byte dot products,
  ``q8_ready()``): what ``backend.quant_dense = "q8"`` runs above the row threshold
  (``Q8Linear``);
- ``rms_norm.h``: ``add_rms_norm``, the residual add fused with RMSNorm;
- ``elementwise.h``: ``rope_rows`` (RoPE over strided rows, rounded once to the output
  dtype: the same values as ``apply_rope(...).to(dtype)``, in one pass instead of ~8 torch
  ops and two copies), ``argmax_rows`` (torch's index: the first maximum, the first NaN) and
  ``silu_mul`` (SwiGLU, rounded as ``F.silu(g) * up`` is; no faster than torch's two ops,
  so only the batch-invariant mode uses it);
- ``common.h``: what they all use: rows to and from float32, a vector ``exp``, rounding to
  a dtype;
- ``cpu_ops.cpp``: the captured decode step (``StepLinear``, ``DecodeStep``), which calls
  the ops above, and the Python bindings of everything (``PYBIND11_MODULE``). It includes
  the headers: one translation unit, since torch's headers are most of the compile time
  (three separate ones took ~50% more CPU time and were slower to build on two cores).

This module only builds them: on first use, ``csrc/*.cpp`` with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; ~30 s once),
compiled for the CPU it runs on (``-march=native``; ``TOKENLOOM_CPU_OPS_CFLAGS`` adds
flags). The extension's name carries a hash of the C++ in ``csrc/`` (sources and
headers), the flags, the CPU's features and torch's version, so a build is cached once per
machine under torch's extension folder (``TORCH_EXTENSIONS_DIR``) and any change to the
C++ or the flags builds afresh. :func:`load` returns None, with the reason (:func:`unavailable_reason`),
where it cannot be built; the backend then keeps the torch path. Reference and test:
``tests/test_cpu_kernels.py`` against the torch path at odd shapes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
from pathlib import Path

import structlog
import torch

from tokenloom.core import env

log = structlog.get_logger("tokenloom.kernels")

_CSRC = Path(__file__).resolve().parent / "csrc"

_lock = threading.Lock()
_state: dict = {}


def _cflags() -> list[str]:
    """Compiled for this CPU; ``TOKENLOOM_CPU_OPS_CFLAGS`` adds flags after ours, e.g.
    ``-mno-avx512f`` builds the AVX2 paths on an AVX-512 machine (the tests do)."""
    return ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", *env.cpu_ops_cflags()]


def _source_files() -> tuple[list[Path], list[Path]]:
    """The translation units to compile (``csrc/*.cpp``) and the headers they include."""
    sources, headers = sorted(_CSRC.glob("*.cpp")), sorted(_CSRC.glob("*.h"))
    if not sources:
        raise FileNotFoundError(f"no C++ sources in {_CSRC} (an install without the package data?)")
    return sources, headers


def _machine_tag(files: list[Path]) -> str:
    """Compiled with -march=native: a build is only good for CPUs with the same flags; and
    it is stale once the C++ (``files``, headers included) or the flags change."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    key = hashlib.sha1()
    for path in files:
        key.update(f"{path.name}\0".encode())
        key.update(path.read_bytes())
    key.update(f"{flags}{torch.__version__}{_cflags()}".encode())
    return key.hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """torch looks for ``ninja`` on PATH; the pip package (a dependency) puts its binary in
    its own folder, which a venv's PATH may lack (``make test`` runs .venv/bin/python)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load():
    """The compiled module (``paged_decode_attention``, ``decode_layer_attention``,
    ``quant_matmul``, ``add_rms_norm``, ``StepLinear``, ``DecodeStep``, ``simd_path``), built
    on the first call, or None (the reason logged once, then :func:`unavailable_reason`) where it cannot
    be built."""
    with _lock:
        if "op" not in _state:
            _state["op"], _state["error"] = None, None
            try:
                from torch.utils.cpp_extension import load as load_extension

                _put_ninja_on_path()
                sources, headers = _source_files()
                module = load_extension(name=f"tokenloom_cpu_ops_{_machine_tag(sources + headers)}",
                                        sources=[str(path) for path in sources], verbose=False,
                                        extra_cflags=_cflags(), extra_ldflags=["-fopenmp"])
                _state["op"] = module
            except Exception as exc:  # no compiler, no ninja, no headers: keep the torch path
                _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
                log.warning("cpu_ops_unavailable", reason=_state["error"],
                            hint="the torch backend keeps its torch ops")
        return _state["op"]


def unavailable_reason() -> str | None:
    return _state.get("error")
