"""Quantisation configs of published checkpoints: AutoGPTQ's ``quantize_config.json``,
AutoAWQ's ``quant_config.json`` and Transformers' ``quantization_config`` (the tensor layouts
they describe are in layouts.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from tokenloom.plugins.quantizers.layouts import GPTQ_BITS


def _check_group_size(group_size: Any, key: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (
        group_size != -1 and group_size < 1
    ):
        raise ValueError(f"unsupported {key}={group_size!r} (a positive int, or -1 per-channel)")
    return group_size


def gptq_config(
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    *,
    damp_percent: float = 0.01,
    static_groups: bool = False,
    true_sequential: bool = True,
    model_name_or_path: str | None = None,
    model_file_base_name: str | None = "model",
) -> dict[str, Any]:
    """A ``quantize_config.json`` dict with AutoGPTQ's keys, ``checkpoint_format="gptq"`` (v1)."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"unsupported bits={bits!r} for gptq (supported: {GPTQ_BITS})")
    return {
        "bits": bits,
        "group_size": _check_group_size(group_size, "group_size"),
        "damp_percent": float(damp_percent),
        "desc_act": bool(desc_act),
        "static_groups": bool(static_groups),
        "sym": bool(sym),
        "true_sequential": bool(true_sequential),
        "model_name_or_path": model_name_or_path,
        "model_file_base_name": model_file_base_name,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
    }


def awq_config(bits: int = 4, group_size: int = 128) -> dict[str, Any]:
    """An HF-style AWQ ``quantization_config`` dict for the GEMM layout (zero points on)."""
    if bits != 4:
        raise ValueError(f"unsupported bits={bits!r} for awq (supported: 4)")
    return {
        "quant_method": "awq",
        "bits": bits,
        "group_size": _check_group_size(group_size, "group_size"),
        "zero_point": True,
        "version": "gemm",
    }


class QuantConfig(NamedTuple):
    """What :func:`read_quant_config` found; a tuple ``(method, bits, group_size, ...)``."""

    method: str  #: "gptq" or "awq"
    bits: int
    group_size: int  #: as on disk: -1 means per-channel
    desc_act: bool  #: GPTQ act-order (its g_idx is a permutation); always False for AWQ
    sym: bool  #: GPTQ "sym"; AWQ: not zero_point, so always False here
    fmt: str  #: "gptq" (GPTQ v1 checkpoint_format) or "gemm" (AWQ version)


_AWQ_ONLY_KEYS = ("w_bit", "q_group_size", "zero_point", "version")


def _int_key(cfg: Mapping[str, Any], *keys: str) -> tuple[str, int]:
    for key in keys:
        if key in cfg:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"unsupported {key}={value!r} (expected an int)")
            return key, value
    raise ValueError(f"quantization config lacks {' / '.join(keys)}")


def read_quant_config(cfg: Mapping[str, Any]) -> QuantConfig:
    """Read a GPTQ or AWQ config into a :class:`QuantConfig`.

    Accepts a ``quantize_config.json`` (AutoGPTQ / GPTQModel), an AutoAWQ
    ``quant_config.json`` (``w_bit``, ``q_group_size``, ``zero_point``, ``version``), an HF
    ``config.json``'s ``quantization_config`` (``quant_method`` plus ``bits``,
    ``group_size``, ...), or a whole ``config.json`` holding one. Without ``quant_method``
    the method is AWQ if an AWQ-only key is present, else GPTQ. Keys that do not change
    the layout (``damp_percent``, ``true_sequential``, ``modules_to_not_convert``, ...)
    are ignored.

    :raises ValueError: naming the key and value that this engine cannot load: another
        ``quant_method``; GPTQ ``bits`` outside 2/4/8, ``checkpoint_format``/``format`` other
        than ``"gptq"`` (``gptq_v2``, ``marlin``, ...), ``is_marlin_format``, a ``pack_dtype``
        other than int32; AWQ ``bits`` other than 4, ``zero_point`` false, ``version``
        other than ``"gemm"``; a non-int ``bits``/``group_size`` or a ``group_size`` that
        is neither positive nor -1; or a missing ``bits``/``group_size``.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"quantization config must be a dict, got {type(cfg).__name__}")
    inner = cfg.get("quantization_config")
    if isinstance(inner, Mapping):
        cfg = inner
    method = cfg.get("quant_method")
    if method is None:
        method = "awq" if any(key in cfg for key in _AWQ_ONLY_KEYS) else "gptq"
    if not isinstance(method, str) or method.lower() not in ("gptq", "awq"):
        raise ValueError(f"unsupported quant_method={method!r} (supported: 'gptq', 'awq')")
    method = method.lower()

    if method == "gptq":
        _, bits = _int_key(cfg, "bits")
        if bits not in GPTQ_BITS:
            raise ValueError(f"unsupported bits={bits!r} for gptq (supported: {GPTQ_BITS})")
        key, group_size = _int_key(cfg, "group_size")
        _check_group_size(group_size, key)
        fmt_key = "checkpoint_format" if "checkpoint_format" in cfg else "format"
        fmt = cfg.get(fmt_key) or "gptq"
        if not isinstance(fmt, str) or fmt.lower() != "gptq":
            raise ValueError(f"unsupported {fmt_key}={fmt!r} (supported: 'gptq', the v1 layout)")
        if cfg.get("is_marlin_format"):
            raise ValueError(f"unsupported is_marlin_format={cfg['is_marlin_format']!r}")
        pack_dtype = cfg.get("pack_dtype", "int32")
        if str(pack_dtype) not in ("int32", "torch.int32"):
            raise ValueError(f"unsupported pack_dtype={pack_dtype!r} (supported: 'int32')")
        return QuantConfig("gptq", bits, group_size, bool(cfg.get("desc_act", False)),
                           bool(cfg.get("sym", True)), "gptq")

    key, bits = _int_key(cfg, "w_bit", "bits")
    if bits != 4:
        raise ValueError(f"unsupported {key}={bits!r} for awq (supported: 4)")
    key, group_size = _int_key(cfg, "q_group_size", "group_size")
    _check_group_size(group_size, key)
    if not cfg.get("zero_point", True):
        raise ValueError(f"unsupported zero_point={cfg['zero_point']!r} (AWQ GEMM needs zero points)")
    ver_key = "version" if "version" in cfg else "format"
    version = cfg.get(ver_key) or "gemm"
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"unsupported {ver_key}={version!r} for awq (supported: 'gemm')")
    return QuantConfig("awq", bits, group_size, False, False, "gemm")
