"""RoPE tables: cos/sin ``[max_len, rotary_dim]`` float32 in HF's rotate-half layout, for
every rotary scaling kind a model config may name (``ModelConfig.rope_scaling``).

Each kind changes the inverse frequencies (and yarn / longrope the magnitude of cos and
sin); the values follow the formulas of the papers and of transformers'
``modeling_rope_utils``, which the tests compare against."""

from __future__ import annotations

import math

import torch

from tokenloom.core.models.config import ModelConfig, RopeScaling


def inv_freq(cfg: ModelConfig, theta: float, scaling: RopeScaling, max_len: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[rotary_dim / 2]`` (float64) and the cos/sin magnitude."""
    dim = cfg.rotary_dim
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = scaling.kind
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / scaling.factor, 1.0
    if kind == "llama3":
        old = scaling.original_max_position_embeddings or 8192
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / scaling.factor, base)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"rope scaling kind {kind!r}")


def rope_tables(cfg: ModelConfig, max_len: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_len, rotary_dim]`` float32 for positions ``0..max_len-1``."""
    freqs, magnitude = inv_freq(cfg, theta, scaling, max_len)
    t = torch.arange(max_len, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * magnitude).float(), (emb.sin() * magnitude).float()
