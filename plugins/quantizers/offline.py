"""`tokenloom quantize`: make a quantised checkpoint offline (the second of the three layers:
primitives -> *the quantised state dict* -> runtime weights).

1. The full-precision weights: the checkpoint's own tensors, dequantised (a 4-bit GGUF
   becomes its float values, so quantising it again measures the methods on that model).
2. Calibration (GPTQ, AWQ): the dense model runs the calibration chunks once; every
   matmul's input is captured on the way (a Hessian for GPTQ, mean |x| and a row sample
   for AWQ). All layers see the full-precision model's activations (not re-captured after
   each layer is quantised: simpler, and what one forward pass gives).
3. Each slot is quantised: ``rtn`` (round to nearest), ``gptq`` (error feedback against
   the Hessian, Frantar et al. 2022), ``awq`` (activation-aware channel scales folded into
   the preceding RMSNorm or up_proj, then clipping and RTN, Lin et al. 2023), ``int8``
   (per channel), ``fp8`` (e4m3 per channel). The 8-bit methods round with GPTQ's error
   feedback by default (``rounding="gptq"``: the same grid and scales as plain rounding,
   each weight's grid point chosen so the layer's outputs on the calibration text move
   least); ``rounding="nearest"`` rounds each weight alone and needs no calibration.
   Only the transformer layers' matmuls are quantised: the embedding and the output head
   (tied in SmolLM2) stay in the checkpoint's precision, as vLLM and llm-compressor leave
   ``lm_head`` by default.
4. Written as a Hugging Face directory in the layouts other tools read: GPTQ layout
   (AutoGPTQ ``qweight``/``qzeros``/``scales``/``g_idx``) for ``gptq``, ``rtn`` and ``int8``,
   AutoAWQ GEMM for ``awq``, and ``weight`` fp8 + ``weight_scale`` for ``fp8``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenloom.core.weights import QuantizedWeight, dense_tensor
from tokenloom.plugins.quantizers.awq_algo import (
    ActivationStats,
    apply_awq_clip,
    awq_search_clip,
    awq_search_scales,
)
from tokenloom.plugins.quantizers.gptq_algo import (
    HessianAccumulator,
    gptq_quantize,
    gptq_quantize_fp8,
)
from tokenloom.plugins.quantizers.layouts import awq_pack, gptq_pack
from tokenloom.plugins.quantizers.primitives import quantize_fp8_e4m3, quantize_rtn
from tokenloom.plugins.quantizers.quant_config import awq_config, gptq_config

METHODS = ("int8", "rtn", "gptq", "awq", "fp8")
SLOTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
AWQ_SAMPLE_ROWS = 1024


@dataclass(slots=True)
class QuantizeOptions:
    method: str
    bits: int = 4
    group_size: int = 128  # halved until it divides every matmul's input width (576 -> 64)
    act_order: bool = False  # GPTQ desc_act
    damp_percent: float = 0.01
    rounding: str = "gptq"  # int8/fp8: "gptq" (error feedback against calibration Hessians) or "nearest"

    @property
    def needs_hessians(self) -> bool:
        return self.method == "gptq" or (self.method in ("int8", "fp8") and self.rounding == "gptq")


@dataclass(slots=True)
class _Capture:
    """Stands in for a layer's LinearWeight during calibration: records its inputs."""

    inner: object
    hessian: HessianAccumulator | None = None
    stats: ActivationStats | None = None
    sample: list = field(default_factory=list)
    rows: int = 0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.hessian is not None:
            self.hessian.add(x2)
        if self.stats is not None:
            self.stats.add(x2)
            if self.rows < AWQ_SAMPLE_ROWS:
                self.sample.append(x2[: AWQ_SAMPLE_ROWS - self.rows].clone())
                self.rows += self.sample[-1].shape[0]
        return self.inner.apply(x)


def model_group_size(requested: int, widths: list[int]) -> int:
    """One group size for the whole checkpoint (its config has one): ``requested`` halved
    until it divides every input width, at least 32; else one group per row (-1)."""
    g = requested
    while g >= 32 and any(w % g for w in widths):
        g //= 2
    return g if g >= 32 else -1


def calibrate(llm, chunks: list[list[int]], *, hessian: bool, awq: bool,
              progress: Callable[[int, int], None] | None = None) -> dict[str, _Capture]:
    """Run ``chunks`` through ``llm`` (dense weights), capturing every layer matmul's inputs.
    On one rank: the captures must see whole matmuls."""
    if llm.engine.executor.world_size > 1:
        from tokenloom.core.errors import ConfigError

        raise ConfigError("tokenloom quantize calibrates on one rank; drop --tensor-parallel-size "
                          f"({llm.engine.executor.world_size})")
    model = llm.engine.runner.model
    captures: dict[str, _Capture] = {}
    if model.cfg.architecture not in CALIBRATED_ARCHITECTURES:
        from tokenloom.core.errors import ConfigError

        raise ConfigError(f"tokenloom quantize calibrates {', '.join(CALIBRATED_ARCHITECTURES)} models; "
                          f"{model.cfg.checkpoint_architecture or model.cfg.architecture} is not one yet (its "
                          "checkpoint names differ): quantize it online instead (--quantizer int8 / rtn / fp8)")
    for i, layer in enumerate(model.layers):
        for slot in SLOTS:
            inner = getattr(_owner(layer, slot), slot)
            cap = _Capture(inner, HessianAccumulator(inner.in_features) if hessian else None,
                           ActivationStats(inner.in_features) if awq else None)
            captures[f"model.layers.{i}.{slot}"] = cap
            setattr(_owner(layer, slot), slot, cap)
    try:
        for n, ids in enumerate(chunks):
            prefill(llm, ids)
            if progress is not None:
                progress(n + 1, len(chunks))
    finally:
        for i, layer in enumerate(model.layers):
            for slot in SLOTS:
                setattr(_owner(layer, slot), slot, captures[f"model.layers.{i}.{slot}"].inner)
    return captures


#: the architectures whose checkpoint names are SLOTS' (LLaMA's): what calibration writes back
CALIBRATED_ARCHITECTURES = ("llama", "mistral")


def _owner(layer, slot: str):
    """The module holding ``slot``: the layer (qkv, o) or its MLP (gate_up, down)."""
    return layer if slot in ("qkv", "o") else layer.mlp


def prefill(llm, ids: list[int]) -> torch.Tensor:
    """Logits for every position of ``ids``, with KV blocks borrowed from the cache manager."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    engine = llm.engine
    seq = Sequence("calibration", list(ids), SamplingParams(max_tokens=1))
    if not engine.cache.allocate(seq, len(ids)):
        raise ValueError(f"{len(ids)} tokens do not fit the KV cache; use shorter chunks or more blocks")
    try:
        return engine.call_in_step_thread(engine.executor.prefill_logits, ids, engine.cache.block_table(seq))
    finally:
        engine.cache.free(seq)


def quantize_state_dict(dense: dict[str, torch.Tensor], num_layers: int, opts: QuantizeOptions,
                        captures: dict[str, _Capture] | None,
                        progress: Callable[[int, int], None] | None = None) -> tuple[dict, dict]:
    """The quantised checkpoint's tensors (HF names) and its ``quantization_config``."""
    out = dict(dense)  # norms, embedding (and anything not quantised) stay as they are
    widths = [dense[f"model.layers.0.{parts[0]}.weight"].shape[1] for parts in SLOTS.values()]
    group = model_group_size(opts.group_size, widths) if opts.method in ("rtn", "gptq", "awq") else -1
    for i in range(num_layers):
        p = f"model.layers.{i}."
        if opts.method == "awq":
            _awq_scale_layer(out, p, captures, opts.bits, group)
        for slot, parts in SLOTS.items():
            names = [p + part + ".weight" for part in parts]
            w = torch.cat([out.pop(n).float() for n in names])
            rows = [dense[n].shape[0] for n in names]
            for part, spec in zip(parts, _split(_quantize(w, opts, group, captures, p + slot), rows), strict=True):
                out.update({f"{p}{part}.{k}": v for k, v in _pack(spec, opts.method).items()})
        if progress is not None:
            progress(i + 1, num_layers)
    bits = 8 if opts.method in ("int8", "fp8") else opts.bits
    if opts.method == "awq":
        config = {**awq_config(bits, group), "quant_method": "awq"}
    elif opts.method == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_scheme": "per_channel",
                  "tokenloom_rounding": opts.rounding}
    else:
        config = {**gptq_config(bits, group, opts.act_order and opts.method == "gptq", opts.method == "int8",
                                true_sequential=False, damp_percent=opts.damp_percent),
                  "quant_method": "gptq", "tokenloom_method": opts.method}
    return out, config


def _quantize(w: torch.Tensor, opts: QuantizeOptions, group: int, captures, slot: str):
    if opts.method == "gptq":
        return gptq_quantize(w, captures[slot].hessian.hessian, bits=opts.bits, group_size=group,
                             damp_percent=opts.damp_percent, act_order=opts.act_order)
    if opts.method == "int8":
        if opts.rounding == "gptq":
            return gptq_quantize(w, captures[slot].hessian.hessian, bits=8, group_size=-1, sym=True,
                                 damp_percent=opts.damp_percent, act_order=opts.act_order)
        return quantize_rtn(w, bits=8, group_size=-1, sym=True)
    if opts.method == "fp8":
        if opts.rounding == "gptq":
            return gptq_quantize_fp8(w, captures[slot].hessian.hessian, damp_percent=opts.damp_percent,
                                     act_order=opts.act_order)
        return quantize_fp8_e4m3(w)
    if opts.method == "awq":
        x = torch.cat(captures[slot].sample)
        w = apply_awq_clip(w, awq_search_clip(w, x, bits=opts.bits, group_size=group if group > 0 else None),
                           group_size=group if group > 0 else None)
    return quantize_rtn(w, bits=opts.bits, group_size=group)


def _awq_scale_layer(sd: dict, p: str, captures, bits: int, group: int) -> None:
    """Search and fold AWQ's input-channel scales: q/k/v into input_layernorm, gate/up into
    post_attention_layernorm, down_proj into up_proj's rows. o_proj is left unscaled: with
    grouped-query attention v_proj's rows do not line up with o_proj's columns."""
    g = group if group > 0 else None
    for slot, parts, prev in (("qkv", SLOTS["qkv"], "input_layernorm"), ("gate_up", SLOTS["gate_up"],
                                                                         "post_attention_layernorm"),
                              ("down", SLOTS["down"], "mlp.up_proj")):
        cap = captures[p + slot]
        ws = [sd[f"{p}{part}.weight"].float() for part in parts]
        s, _, _ = awq_search_scales(ws, torch.cat(cap.sample), bits=bits, group_size=g, mean_abs=cap.stats.mean_abs)
        for part, w in zip(parts, ws, strict=True):
            sd[f"{p}{part}.weight"] = w * s[None, :]
        prev_name = f"{p}{prev}.weight"
        prev_w = sd[prev_name].float()
        sd[prev_name] = prev_w / s if prev_w.dim() == 1 else prev_w / s[:, None]


def _split(spec, rows: list[int]) -> list:
    """A fused slot's spec back into its checkpoint parts (rows are independent)."""
    out, start = [], 0
    for n in rows:
        index = torch.arange(start, start + n)
        out.append(spec.rows(index) if isinstance(spec, QuantizedWeight) else (spec[0][index], spec[1][index]))
        start += n
    return out


def _pack(spec, method: str) -> dict[str, torch.Tensor]:
    if method == "fp8":
        data, scales = spec
        return {"weight": data, "weight_scale": scales.float()}
    return awq_pack(spec) if method == "awq" else gptq_pack(spec)


def dense_weights(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as float32 (quantised GGUF blocks dequantised)."""
    return {name: dense_tensor(t).float() for name, t in checkpoint.weights.items()}


def save_hf_dir(out: Path, checkpoint, tensors: dict[str, torch.Tensor], quant_config: dict | None) -> None:
    """A Hugging Face directory: config.json (with quantization_config), model.safetensors,
    tokenizer.json and tokenizer_config.json (chat template, EOS) — loadable by tokenloom,
    and by tools that read the same layouts."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg, tok = checkpoint.config, checkpoint.tokenizer
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": tok.bos_token_id,
        "eos_token_id": sorted(tok.eos_token_ids), "torch_dtype": "float16",
        **({"quantization_config": quant_config} if quant_config else {})}, indent=2))
    if quant_config and quant_config.get("quant_method") == "gptq":
        (out / "quantize_config.json").write_text(json.dumps(
            {k: v for k, v in quant_config.items() if k != "tokenloom_method"}, indent=2))
    floats = {k: (v.half() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn and not k.endswith(
        ("scales", "weight_scale")) else v).contiguous() for k, v in tensors.items()}
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.tok.save(str(out / "tokenizer.json"))
    eos = tok.token(min(tok.eos_token_ids)) if tok.eos_token_ids else None
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "eos_token": eos, "add_bos_token": tok.add_bos,
        "bos_token": tok.token(tok.bos_token_id) if tok.bos_token_id is not None else None}, indent=2))
