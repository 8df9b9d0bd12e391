"""RoPE tables: cos/sin ``[max_len, rotary_dim]`` float32 in HF's rotate-half layout, for
every rotary scaling kind a model config may name (``ModelConfig.rope_scaling``).

Each kind changes the inverse frequencies (and yarn / longrope the magnitude of cos and
sin); the values follow transformers' ``modeling_rope_utils`` (the ``_compute_*_parameters``
functions), which tests/test_rope_scaling.py compares against, computed in float64.

The engine builds one table for its whole ``max_len`` and looks a token's row up by its
position alone. Two kinds in transformers depend on the length of the sequence in the
forward pass instead, so a static table can match them only for some lengths:

* ``dynamic`` (NTK-aware): transformers keeps the plain frequencies while the sequence fits
  ``max_position_embeddings`` and raises the base to that of the current length past it.
  Here: ``max_len <= max_position_embeddings`` (what core/build.py always serves) gives the
  plain table, so every sequence is exact; a longer ``max_len`` takes one base, that of a
  ``max_len``-long sequence, for every position (vLLM's ``DynamicNTKScalingRotaryEmbedding``
  likewise builds one static table, at ``max_position_embeddings * factor``): exact for a
  ``max_len``-long forward, not for shorter sequences, which transformers turns unscaled.
* ``longrope`` (Phi-3): transformers uses ``short_factor`` while the sequence is at most
  ``original_max_position_embeddings`` and ``long_factor`` past it. Here: the short factors
  when ``max_len <= original_max_position_embeddings`` (exact for every sequence), else the
  long factors for every position (exact for sequences longer than the original context;
  shorter ones differ from transformers). vLLM does the same (``use_long_rope`` when
  ``max_model_len`` exceeds the original context), so that the cached keys of a sequence
  never change rotation as it grows past the threshold.
"""

from __future__ import annotations

import math

import torch

from tokenloom.core.models.config import ModelConfig, RopeScaling


def _exponents(dim: int) -> torch.Tensor:
    """``2i / dim`` for each of the ``dim / 2`` frequency pairs (float64)."""
    return torch.arange(0, dim, 2, dtype=torch.float64) / dim


def _yarn(dim: int, theta: float, scaling: RopeScaling, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers' ``_compute_yarn_parameters``: interpolate the
    low frequencies by ``factor``, keep the high ones, ramp linearly between the dimensions
    that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    original = scaling.original_max_position_embeddings or max_position_embeddings
    factor = scaling.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:  # DeepSeek's spelling of the magnitude
            attention = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention = mscale(factor)
    beta_fast = scaling.beta_fast or 32.0  # transformers: 0 / None mean the paper's defaults
    beta_slow = scaling.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength fits ``rotations`` times into the original context."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _exponents(dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the unscaled (extrapolated) frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope(dim: int, theta: float, scaling: RopeScaling, max_position_embeddings: int,
              max_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3), as transformers' ``_compute_longrope_parameters``: per-frequency
    divisors, short or long (see the module docstring for which), and the magnitude
    ``sqrt(1 + ln(factor) / ln(original))``."""
    original = scaling.original_max_position_embeddings or max_position_embeddings
    for name in ("short_factor", "long_factor"):
        values = getattr(scaling, name)
        if len(values) != dim // 2:
            raise ValueError(f"longrope {name} must have rotary_dim / 2 = {dim // 2} values, got {len(values)}")
    factor = scaling.factor
    attention = scaling.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(scaling.long_factor if max_len > original else scaling.short_factor, dtype=torch.float64)
    return 1.0 / (ext * theta ** _exponents(dim)), float(attention)


def inv_freq(cfg: ModelConfig, theta: float, scaling: RopeScaling, max_len: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[rotary_dim / 2]`` (float64) and the cos/sin magnitude, for a
    table of ``max_len`` positions."""
    dim = cfg.rotary_dim
    base = 1.0 / (theta ** _exponents(dim))
    kind = scaling.kind
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / scaling.factor, 1.0
    if kind == "dynamic":
        trained = cfg.max_position_embeddings
        if max_len <= trained:  # transformers' dynamic is the plain RoPE up to here
            return base, 1.0
        scaled = theta * (scaling.factor * max_len / trained - (scaling.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled ** _exponents(dim)), 1.0
    if kind == "llama3":
        old = scaling.original_max_position_embeddings or cfg.max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / scaling.factor, base)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, cfg.max_position_embeddings)
    if kind == "longrope":
        return _longrope(dim, theta, scaling, cfg.max_position_embeddings, max_len)
    raise NotImplementedError(f"rope scaling kind {kind!r}")


def rope_tables(cfg: ModelConfig, max_len: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_len, rotary_dim]`` float32 for positions ``0..max_len-1``."""
    freqs, magnitude = inv_freq(cfg, theta, scaling, max_len)
    t = torch.arange(max_len, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * magnitude).float(), (emb.sin() * magnitude).float()
