"""Weight bytes per format, as this engine holds them once loaded (core/models/llama.py
``load_weights``):

- the embedding table, dense in the compute dtype (a quantised GGUF's is dequantised);
- the RMSNorm weights in float32: ``(2 * layers + 1) * hidden`` (Gemma's sandwich norms two
  more per layer, Qwen3's per-head q/k norms ``2 * head_dim`` per layer);
- a mixture-of-experts layer's router ``[experts, hidden]``, dense in the compute dtype;
- every matmul in the weight format: per layer ``qkv [q + 2 kv, hidden]``, ``o [hidden, q]``,
  ``gate_up [2 * inter, hidden]``, ``down [hidden, inter]`` -- in a mixture-of-experts layer
  those two for every expert (all are held, though a token reads ``top_k``) -- and the output
  head ``[vocab, hidden]``, which the engine packs on its own even when it is tied to the
  embedding (a second copy), and which some formats leave dense (``head_dense``).

These are format sizes (what a kernel reading that format holds). The torch backend may hold
more: on CPU a dense copy beside a quantised weight (``backend.quant_max_rows``) and two
layouts of each float32 weight (``backend.cpu_linear = "dual"``), and it dequantises fp8
everywhere and quantised weights on CUDA to the compute dtype at load.
GPTQ's ``g_idx`` (4 bytes per input column) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.core.errors import ClientError
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.utils import cdiv
from tokenloom.planner.checkpoint import CheckpointInfo, GGUFTensorInfo
from tokenloom.plugins.quantizers.online import fit_group

#: GGUF block types the engine keeps quantised: (weights per block, bytes per block)
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """``kind``: dense | int8 | fp8 | int (``bits`` per code, a float16 scale and a ``bits``
    zero point per ``group_size`` inputs) | one of :data:`GGUF_BLOCKS`."""

    name: str
    kind: str
    note: str
    head_dense: bool = False  # the output head stays in the compute dtype
    dense_bytes: int = 0  # dense: bytes per weight (0: the compute dtype's)
    bits: int = 4
    group_size: int = 128


FORMATS = {f.name: f for f in (
    WeightFormat("fp32", "dense", "float32", dense_bytes=4),
    WeightFormat("bf16/fp16", "dense", "2 bytes a weight", dense_bytes=2),
    WeightFormat("int8", "int8", "int8 + a 16-bit scale per output channel"),
    WeightFormat("fp8", "fp8", "e4m3 + a float32 scale per output channel; head dense", head_dense=True),
    WeightFormat("int4-g128", "int", "GPTQ/AWQ: packed int4, fp16 scale + 4-bit zero per 128 (halved to divide); head dense",
                 head_dense=True),
    WeightFormat("q4_1", "Q4_1", "GGUF Q4_1: 20 bytes per 32 weights"),
    WeightFormat("q8_0", "Q8_0", "GGUF Q8_0: 34 bytes per 32 weights"),
)}


KNOWN_QUANTIZERS = ("none", "gguf", "int8", "fp8", "rtn", "gptq", "awq")


def matmul_bytes(fmt: WeightFormat, out: int, inp: int, dtype_bytes: int) -> int:
    """Bytes of one ``[out, inp]`` matmul weight:

    - dense: ``out * inp * b``; int8: ``out * inp + 2 * out``; fp8: ``out * inp + 4 * out``;
    - int (GPTQ/AWQ/RTN): ``ceil(out * inp * bits / 8)`` codes, and per row and group a
      2-byte scale and a ``bits``-bit zero; the group is ``group_size`` halved until it
      divides ``inp`` (the engine's rule, ``fit_group``), ``-1`` one group per row;
    - GGUF blocks: ``out * ceil(inp / 32) * block_bytes`` (20 for Q4_1, 34 for Q8_0, 18 for Q4_0).
    """
    if fmt.kind == "dense":
        return out * inp * (fmt.dense_bytes or dtype_bytes)
    if fmt.kind == "int8":
        return out * inp + 2 * out
    if fmt.kind == "fp8":
        return out * inp + 4 * out
    if fmt.kind == "int":
        groups = cdiv(inp, fit_group(fmt.group_size, inp))
        return cdiv(out * inp * fmt.bits, 8) + out * groups * 2 + cdiv(out * groups * fmt.bits, 8)
    per, nbytes = GGUF_BLOCKS[fmt.kind]
    return out * cdiv(inp, per) * nbytes


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe is not None and layer not in cfg.moe.dense_layers


def layer_matmuls(cfg: ModelConfig, layer: int = 0) -> list[tuple[int, int]]:
    """``(out, in)`` of layer ``layer``'s fused matmuls: qkv, o, gate_up, down; in a
    mixture-of-experts layer gate_up and down once per expert."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    if cfg.moe is not None and is_moe_layer(cfg, layer):
        f = cfg.moe.intermediate_size
        return [(q + 2 * kv, h), (h, q)] + [(2 * f, h), (h, f)] * cfg.moe.num_experts
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def norm_params(cfg: ModelConfig) -> int:
    """Every RMSNorm weight: two per layer (four with sandwich norms), q/k norms, the final one."""
    per_layer = (4 if cfg.sandwich_norms else 2) * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.num_layers * per_layer + cfg.hidden_size


def router_params(cfg: ModelConfig) -> int:
    """The mixture-of-experts layers' routers, ``[experts, hidden]`` each."""
    if cfg.moe is None:
        return 0
    return sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers)) * cfg.moe.num_experts * cfg.hidden_size


def num_params(cfg: ModelConfig) -> int:
    """Embedding + (an untied head) + every layer's matmuls (all experts) and routers + the norms."""
    matmuls = sum(o * i for layer in range(cfg.num_layers) for o, i in layer_matmuls(cfg, layer))
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + head + matmuls + router_params(cfg) + norm_params(cfg)


def dense_parts_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """The embedding and the routers in ``dtype_bytes``, the norms in float32."""
    return (cfg.vocab_size * cfg.hidden_size + router_params(cfg)) * dtype_bytes + norm_params(cfg) * 4


def weight_bytes(cfg: ModelConfig, fmt: WeightFormat, dtype_bytes: int) -> int:
    """What the engine holds in ``fmt``: dense parts + layers' matmuls (every expert) + the head."""
    b = fmt.dense_bytes or dtype_bytes
    head = cfg.vocab_size * cfg.hidden_size * b if fmt.head_dense else \
        matmul_bytes(fmt, cfg.vocab_size, cfg.hidden_size, b)
    layers = sum(matmul_bytes(fmt, o, i, b) for layer in range(cfg.num_layers) for o, i in layer_matmuls(cfg, layer))
    return dense_parts_bytes(cfg, b) + layers + head


def gguf_file_bytes(cfg: ModelConfig, tensors: list[GGUFTensorInfo], dtype_bytes: int) -> int:
    """A GGUF file as the `gguf` quantizer loads it: Q4_0/Q4_1/Q8_0 matmuls (and head) kept
    as stored, any other matmul type dequantised to the compute dtype, the embedding dense,
    norms float32. A tied head is the embedding tensor once more, at its stored type."""
    def held(t: GGUFTensorInfo) -> int:
        return t.num_bytes if t.qtype in GGUF_BLOCKS else t.num_elements * dtype_bytes

    names = {t.name: t for t in tensors}
    total = dense_parts_bytes(cfg, dtype_bytes) + held(names.get("output.weight") or names["token_embd.weight"])
    return total + sum(held(t) for t in tensors if t.name.startswith("blk.") and t.name.endswith(".weight")
                       and "norm" not in t.name)


@dataclass(slots=True)
class WeightRow:
    format: str
    bytes: int
    bits_per_param: float
    note: str
    selected: bool = False


def weight_rows(info: CheckpointInfo, quantizer: str | None, dtype_bytes: int) -> list[WeightRow]:
    """One row per format of :data:`FORMATS` (plus the GGUF file as stored, and the selected
    quantizer's own variant where it differs from every row), the selected one marked:
    ``quantizer``, else the checkpoint's own method, else ``none`` -- as core/build.py picks.

    :raises ClientError: (param ``quantizer``) an unknown name, or one the engine would
        refuse for this checkpoint (GPTQ/AWQ-packed weights read only by their own method).
    """
    cfg, own = info.config, info.quant_method
    method = quantizer or own or "none"
    if method not in KNOWN_QUANTIZERS:
        raise ClientError(f"quantizer {method!r} is unknown to the planner; known: {', '.join(KNOWN_QUANTIZERS)}",
                          param="quantizer", value=method)
    if own in ("gptq", "awq") and method != own:
        raise ClientError(f"quantizer {method!r} cannot read this checkpoint's {own}-packed weights; use {own}",
                          param="quantizer", value=method)
    if method in ("gptq", "awq") and own != method:
        raise ClientError(f"quantizer {method!r} needs a {method} checkpoint; this one is {own or 'dense'}",
                          param="quantizer", value=method)
    n = num_params(cfg)

    def row(name: str, nbytes: int, note: str) -> WeightRow:
        return WeightRow(name, nbytes, round(nbytes * 8 / n, 3), note)

    rows = [row(f.name, weight_bytes(cfg, f, dtype_bytes), f.note) for f in FORMATS.values()]
    native = [t for t in info.gguf_tensors if t.qtype in GGUF_BLOCKS]
    if native:
        head = next(t for t in info.gguf_tensors if t.name in ("output.weight", "token_embd.weight")
                    and (t.name == "output.weight" or cfg.tie_word_embeddings))
        layer_types = sorted({t.qtype for t in info.gguf_tensors if t.name.startswith("blk.") and "norm" not in t.name})
        rows.append(row("gguf file", gguf_file_bytes(cfg, info.gguf_tensors, dtype_bytes),
                        f"as stored: {'/'.join(layer_types)} layers, {head.qtype} head"))
    selected = {"none": "fp32" if dtype_bytes == 4 else "bf16/fp16", "int8": "int8", "fp8": "fp8",
                "gguf": "gguf file" if native else ("fp32" if dtype_bytes == 4 else "bf16/fp16")}.get(method)
    if method == "rtn":
        fmt = WeightFormat("rtn int4-g128", "int", "round-to-nearest at load; the head quantised too")
        rows.append(row(fmt.name, weight_bytes(cfg, fmt, dtype_bytes), fmt.note))
        selected = fmt.name
    elif method in ("gptq", "awq"):
        from tokenloom.plugins.quantizers.quant_config import read_quant_config

        try:
            qc = read_quant_config(info.quant_config or {})
        except ValueError as exc:
            raise ClientError(f"model: {exc}", param="model") from None
        selected = "int4-g128"
        if (qc.bits, qc.group_size) != (4, 128):
            group = f"g{qc.group_size}" if qc.group_size != -1 else "per-channel"
            fmt = WeightFormat(f"{method} int{qc.bits}-{group}", "int", "this checkpoint's layout; head dense",
                               head_dense=True, bits=qc.bits, group_size=qc.group_size)
            rows.append(row(fmt.name, weight_bytes(cfg, fmt, dtype_bytes), fmt.note))
            selected = fmt.name
    for r in rows:
        r.selected = r.format == selected
    return rows
