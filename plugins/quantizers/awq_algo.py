"""AWQ: activation-aware per-input-channel scaling before weight quantisation.

Implements the search of Lin, Tang, Tang, Yang, Dang, Gan & Han, "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration" (2023), arXiv:2306.00978.

Idea (paper section 3.2): a few input channels carry activations much larger than the
rest, and the weights that multiply them matter most. Multiplying input column ``j`` of
``W`` by ``s_j > 1`` before round-to-nearest, and the input ``x_j`` by ``1/s_j``, keeps the
layer's function but shrinks the relative rounding error of those weights. The scales are
``s = mean|x|^α`` (per input channel), and ``α ∈ [0, 1)`` is picked by a grid search that
minimises the output error ``||x W^T - x Q(W·s)/s ^T||^2`` on calibration data (eq. 5);
``α = 0`` is plain round-to-nearest, so the search never does worse on that data.

Applying the scales (the inverse ``1/s`` is never a runtime op; it is folded into the op
that produces the layer's input):

* q_proj, k_proj, v_proj (one ``s`` shared by the three, input = attention RMSNorm):
  ``W <- W * s`` (:func:`apply_awq_scale`), ``input_layernorm.weight /= s``
  (:func:`fold_into_norm`).
* gate_proj, up_proj (input = MLP RMSNorm): ``W <- W * s``,
  ``post_attention_layernorm.weight /= s``.
* o_proj (input = attention output, linear in v): ``o_proj.W <- W * s`` and the rows of
  v_proj divided by ``s`` (:func:`fold_into_linear`). Only valid when v_proj's output
  dimension equals o_proj's input (no grouped-query attention); otherwise skip o_proj,
  as the reference implementation does.
* down_proj (input = ``act(gate) * up``, linear in up): ``down_proj.W <- W * s`` and the
  rows of up_proj (and its bias, if any) divided by ``s``.

Scale the layers in that order: the fold into v_proj / up_proj must happen *before* those
layers are themselves quantised.

Weight clipping (paper section 3.3 / the reference "auto_clip") is included as
:func:`awq_search_clip` / :func:`apply_awq_clip`: per output row and group, the clipping
threshold ``max|w| * (1 - i/grid)`` (up to ``max_shrink``) that minimises the group's
output error. Use it after scaling, on the scaled weights.
"""

from __future__ import annotations

import torch

from tokenloom.plugins.quantizers.primitives import quantize_rtn, token_rows

__all__ = [
    "ActivationStats",
    "apply_awq_clip",
    "apply_awq_scale",
    "awq_search_clip",
    "awq_search_scales",
    "fold_into_linear",
    "fold_into_norm",
    "output_error",
]


class ActivationStats:
    """Per-input-channel mean ``|x|`` over calibration batches.

    :meth:`add` takes ``x [..., in]`` (leading dimensions are tokens); :attr:`mean_abs`
    is float32 ``[in]``. Sums are kept in float64, so batching does not matter.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = int(in_features)
        self._sum = torch.zeros(self.in_features, dtype=torch.float64, device=device)
        self.n_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of activations ``x [..., in]``."""
        x = token_rows(x, self.in_features).to(self._sum.device)
        self._sum += x.abs().sum(dim=0).double()
        self.n_tokens += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        """Mean ``|x|`` per input channel, float32 ``[in]``."""
        if self.n_tokens == 0:
            raise ValueError("no activations added")
        return (self._sum / self.n_tokens).to(torch.float32)


def _rtn_dequant(w: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    return quantize_rtn(w, bits=bits, group_size=group_size, sym=False).dequantize().to(w.dtype)


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """``||x W^T - x Ŵ^T||_F^2`` (float64), for ``x [tokens, in]``, ``w, w_hat [out, in]``."""
    x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    d = w.detach().to(torch.float64) - w_hat.detach().to(torch.float64)
    return float((x @ d.T).pow(2).sum())


def _error_fn(x: torch.Tensor):
    """``d -> ||x d^T||^2`` using ``x`` or its Gram matrix, whichever is smaller."""
    x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    if x.shape[0] > x.shape[1]:
        gram = (x.T.to(torch.float64) @ x.to(torch.float64)).to(torch.float32)
        return lambda d: float(((d @ gram) * d).sum(dtype=torch.float64))
    return lambda d: float((x @ d.T).pow(2).sum(dtype=torch.float64))


def apply_awq_scale(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``w * s`` over input columns: ``w [out, in]``, ``s [in]``; returns a new tensor."""
    return w * s.to(w.dtype).reshape(1, -1)


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The RMSNorm/LayerNorm weight that absorbs ``1/s``: ``norm_weight / s``.

    For LayerNorm the bias must be divided by ``s`` too (``fold_into_norm(bias, s)``).
    """
    return norm_weight / s.to(norm_weight.dtype)


def fold_into_linear(
    prev_w: torch.Tensor, s: torch.Tensor, prev_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold ``1/s`` into the output rows of the previous linear layer.

    ``prev_w [in, k] / s[:, None]`` (and ``prev_bias / s``): v_proj for o_proj, up_proj
    for down_proj. Returns ``(weight, bias)``.
    """
    w = prev_w / s.to(prev_w.dtype).reshape(-1, 1)
    b = None if prev_bias is None else prev_bias / s.to(prev_bias.dtype)
    return w, b


def awq_search_scales(
    weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    x: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    grid: int = 20,
    mean_abs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search AWQ's per-input-channel scales for layers sharing one input.

    :param weights: ``[out_k, in]`` weights that all read ``x`` (q/k/v, or gate/up).
    :param x: calibration activations ``[tokens, in]`` (a sample is enough).
    :param bits: RTN code width (asymmetric, zero points, grouped).
    :param group_size: RTN group size.
    :param grid: number of α values, ``α = i / grid`` for ``i = 0 .. grid-1``.
    :param mean_abs: per-channel mean ``|x|`` (e.g. :attr:`ActivationStats.mean_abs` over
        more data); defaults to that of ``x``.
    :returns: ``(s [in] float32, best α, errors)`` where ``errors[i]`` is the summed output
        error ``Σ_k ||x W_k^T - x (Q(W_k·s)/s)^T||^2`` for ``α = i / grid``; ``errors[0]``
        is plain RTN. Apply with :func:`apply_awq_scale` and fold ``1/s`` upstream.
    """
    if not weights:
        raise ValueError("no weights given")
    in_f = weights[0].shape[1]
    for w in weights:
        if w.ndim != 2 or w.shape[1] != in_f:
            raise ValueError("all weights must be 2-D with the same input dimension")
    if x.shape[-1] != in_f:
        raise ValueError(f"activations have {x.shape[-1]} features, weights take {in_f}")
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    ws = [w.detach().to(torch.float32) for w in weights]
    if mean_abs is None:
        mean_abs = x.detach().reshape(-1, in_f).to(torch.float32).abs().mean(dim=0)
    mean_abs = mean_abs.detach().to(ws[0].device, torch.float32).clamp_min(1e-4)
    err_of = _error_fn(x.to(ws[0].device))

    errors: list[float] = []
    best = (float("inf"), 0.0, torch.ones(in_f, dtype=torch.float32, device=ws[0].device))
    for i in range(grid):
        alpha = i / grid
        s = mean_abs.pow(alpha)
        s = s / torch.sqrt(s.max() * s.min())
        err = 0.0
        for w in ws:
            w_hat = _rtn_dequant(w * s, bits, group_size) / s
            err += err_of(w - w_hat)
        errors.append(err)
        if err < best[0]:
            best = (err, alpha, s)
    return best[2], best[1], errors


def awq_search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """Per (row, group) clipping threshold minimising that group's output error.

    For each output row and input group, tries ``t = max|w_group| * (1 - i/grid)`` for
    ``i < max_shrink * grid``; the weights are clamped to ``[-t, t]``, quantised with RTN
    and scored by ``||x_g w_g^T - x_g ŵ_g^T||^2`` over the tokens of ``x``. Returns
    ``t [out, n_groups]`` for :func:`apply_awq_clip`. ``i = 0`` means no clipping.
    Cost: ``grid * max_shrink`` RTN passes and products of ``x`` with ``w``; pass a sample.
    """
    out_f, in_f = w.shape
    gs = in_f if group_size is None or group_size <= 0 else min(int(group_size), in_f)
    if in_f % gs:
        raise ValueError(f"clip search needs in={in_f} divisible by group_size={gs}")
    ng = in_f // gs
    w32 = w.detach().to(torch.float32)
    xg = x.detach().reshape(-1, in_f).to(w32.device, torch.float32).reshape(-1, ng, gs)
    wg = w32.reshape(out_f, ng, gs)
    org_out = torch.einsum("tgc,ogc->tog", xg, wg)  # [tokens, out, ng]
    org_max = wg.abs().amax(dim=2)  # [out, ng]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))
    for i in range(max(1, int(max_shrink * grid))):
        t = org_max * (1.0 - i / grid)
        cur = torch.maximum(torch.minimum(wg, t[..., None]), -t[..., None])
        q = _rtn_dequant(cur.reshape(out_f, in_f), bits, gs).reshape(out_f, ng, gs)
        err = (torch.einsum("tgc,ogc->tog", xg, q) - org_out).pow(2).mean(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, t, best_max)
    return best_max


def apply_awq_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int | None = 128
                   ) -> torch.Tensor:
    """Clamp each (row, group) of ``w [out, in]`` to ``[-max_val, max_val]``."""
    out_f, in_f = w.shape
    gs = in_f if group_size is None or group_size <= 0 else min(int(group_size), in_f)
    ng = in_f // gs
    t = max_val.to(w.dtype).reshape(out_f, ng, 1)
    wg = w.reshape(out_f, ng, gs)
    return torch.maximum(torch.minimum(wg, t), -t).reshape(out_f, in_f)
