"""GPTQ: one-shot weight quantisation of a linear layer with second-order error feedback.

Implements the algorithm of Frantar, Ashkboos, Hoefler & Alistarh, "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers" (2022),
arXiv:2210.17323 (Algorithm 1), for one linear layer ``y = x @ W^T``.

The layer-wise objective is ``argmin_Q ||W X^T - Q X^T||^2`` over calibration inputs
``X [n, in]``; its Hessian with respect to each row of ``W`` is ``H = 2/n X^T X``
(:class:`HessianAccumulator`). GPTQ quantises the input columns one at a time, in a fixed
order, and after rounding column ``j`` spreads its error over the columns not yet
quantised, using row ``j`` of the upper Cholesky factor of ``H^-1`` (the paper's
"Cholesky reformulation", section 3, step 3). Updates are applied lazily: inside a block
of ``block_size`` columns each column's error updates only the rest of the block, and the
accumulated block error updates the remaining columns in one matrix product (section 3,
step 2). Lazy batching changes only the order of floating-point operations, not the
result.

Grouping: with ``group_size`` g, the scale and zero point of a group of g consecutive
columns (in quantisation order) are computed when the group's first column is reached,
from the group's *current* weights, i.e. after the error feedback from every column
quantised before it (the paper's section 4, "grouping"). When a group straddles the end
of a lazy block, its columns beyond the block are brought up to date for that computation,
so the parameters never depend on ``block_size``.

Act-order (the "desc_act" heuristic of the reference implementation, paper appendix):
columns are processed in descending order of ``diag(H)`` so the most sensitive inputs are
quantised first, while most weights are still free to absorb error. Groups are then formed
in that order; ``g_idx[c]`` gives the group of *original* column ``c`` and the codes are
returned in the original column order, so :meth:`QuantizedWeight.dequantize` needs no permutation.

Scale/zero points come from :func:`quantize_rtn` applied to the group's current weights,
so GPTQ and round-to-nearest share one quantisation grid (asymmetric by default).
"""

from __future__ import annotations

import torch

from tokenloom.plugins.quantizers.primitives import (
    FP8_E4M3_MAX,
    QuantizedWeight,
    quantize_fp8_e4m3,
    quantize_rtn,
    token_rows,
)

__all__ = ["HessianAccumulator", "gptq_quantize", "gptq_quantize_fp8", "layer_error"]


class HessianAccumulator:
    """Accumulates ``H = 2/n * sum_batches x^T x`` for a linear layer's inputs.

    Feed the layer's inputs batch by batch with :meth:`add` (``x [..., in]``; leading
    dimensions are flattened into tokens). The sum is kept in float64 so the order and
    size of the batches barely matter; :attr:`hessian` returns float32 ``[in, in]``.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = int(in_features)
        self._sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float64,
                                device=device)
        self.n_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of activations ``x [..., in]`` (any float dtype)."""
        x = token_rows(x, self.in_features).to(self._sum.device)
        self._sum += (x.T @ x).double()  # one batch's product in float32 (fast), the running sum in float64
        self.n_tokens += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """``2/n * X^T X`` as float32 ``[in, in]`` (all zeros before any :meth:`add`)."""
        if self.n_tokens == 0:
            return torch.zeros_like(self._sum, dtype=torch.float32)
        return (self._sum * (2.0 / self.n_tokens)).to(torch.float32)


def layer_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> float:
    """The layer-wise objective ``tr((W - Ŵ) H (W - Ŵ)^T)``.

    With ``H = 2/n X^T X`` this equals ``2/n * ||X W^T - X Ŵ^T||_F^2`` — the output
    reconstruction error on the calibration inputs (GPTQ paper, eq. 1). Computed in float64.
    """
    d = (w.detach().to(torch.float64) - w_hat.detach().to(torch.float64))
    h = H.detach().to(d.device, torch.float64)
    return float(((d @ h) * d).sum())


def _upper_cholesky_of_inverse(H: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λI)^-1`` (``U^T U = (H + λI)^-1``).

    ``λ = damp_percent * mean(diag H)``. If ``H + λI`` is still not numerically positive
    definite, λ is raised tenfold (up to four times) before giving up.
    """
    n = H.shape[0]
    mean_diag = float(torch.diagonal(H).mean())
    damp = damp_percent * mean_diag
    eye = torch.eye(n, dtype=H.dtype, device=H.device)
    for _ in range(5):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
        damp = max(damp * 10.0, 1e-6 * max(mean_diag, 1.0))
    raise torch.linalg.LinAlgError(
        "GPTQ: Hessian is not positive definite even after damping; "
        "use more calibration data or a larger damp_percent")


class _IntGrid:
    """``bits``-wide integer codes with a scale and zero point per group (:func:`quantize_rtn`'s grid)."""

    code_dtype = torch.uint8

    def __init__(self, bits: int, sym: bool):
        self.bits, self.sym, self.maxq = bits, sym, float(2**bits - 1)
        self.scales: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def start_group(self, current: torch.Tensor) -> None:
        qt = quantize_rtn(current, bits=self.bits, group_size=current.shape[1], sym=self.sym)
        self.scales.append(qt.scales[:, 0])
        self.zeros.append(qt.zeros[:, 0])
        self.scale, self.zero = qt.scales[:, 0].float(), qt.zeros[:, 0].float()
        self.inv_scale = torch.where(self.scale > 0, 1.0 / self.scale, torch.zeros_like(self.scale))

    def round(self, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.clamp(torch.round(col * self.inv_scale) + self.zero, 0.0, self.maxq)
        return q.to(torch.uint8), (q - self.zero) * self.scale


class _Fp8Grid:
    """float8 e4m3 codes with one scale per row (:func:`quantize_fp8_e4m3`'s grid)."""

    code_dtype = torch.float8_e4m3fn

    def start_group(self, current: torch.Tensor) -> None:
        _, self.scale = quantize_fp8_e4m3(current)

    def round(self, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.clamp(col / self.scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q, q.float() * self.scale


def _check(w: torch.Tensor, H: torch.Tensor, block_size: int) -> None:
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if H.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match in={w.shape[1]}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _error_feedback(w: torch.Tensor, H: torch.Tensor, grid, *, group_size: int, damp_percent: float,
                    act_order: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GPTQ's column loop on any rounding ``grid``: ``(codes [out, in] in the original
    column order, perm or None)``. ``grid.start_group(current)`` is called at each group's
    first column with the group's up-to-date weights; ``grid.round(col)`` returns a column's
    codes and the values they stand for."""
    out_f, in_f = w.shape
    gs = group_size
    W = w.detach().to(torch.float32).clone()
    H = H.detach().to(W.device, torch.float32).clone()

    # Dead inputs: H_jj = 0 makes H singular; their weights never reach the output.
    dead = torch.diagonal(H) == 0
    if bool(dead.any()):
        H[dead, dead] = 1.0
        W[:, dead] = 0.0

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]

    Hinv = _upper_cholesky_of_inverse(H, damp_percent)
    del H

    Q = torch.empty(out_f, in_f, dtype=grid.code_dtype, device=W.device)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if j % gs == 0:
                # New group: parameters from its current (error-updated) weights.
                gend = min(j + gs, in_f)
                cur = W1[:, i:min(gend, i2) - i1]
                if gend > i2:  # the rest of the group lies beyond this block
                    tail = W[:, i2:gend] - Err1[:, :i] @ Hinv[i1:j, i2:gend]
                    cur = torch.cat([cur, tail], dim=1)
                grid.start_group(cur)
            col = W1[:, i]
            q, value = grid.round(col)
            Q[:, j] = q
            err = (col - value) / Hinv1[i, i]
            Err1[:, i] = err
            if i + 1 < i2 - i1:
                W1[:, i + 1:].addr_(err, Hinv1[i, i + 1:], alpha=-1.0)
        if i2 < in_f:
            W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1.0)

    if perm is not None:
        Q_orig = torch.empty_like(Q)
        Q_orig[:, perm] = Q
        Q = Q_orig
    return Q, perm


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    damp_percent: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    sym: bool = False,
) -> QuantizedWeight:
    """Quantise ``w [out, in]`` with GPTQ against the Hessian ``H [in, in]``.

    :param w: the layer weight (any float dtype; the algorithm runs in float32 on its device).
    :param H: ``2/n X^T X`` from :class:`HessianAccumulator` (any positive scale works).
    :param bits: code width, 2..8.
    :param group_size: columns per scale/zero group; ``None`` or ``<= 0`` means one group
        per row. The last group may be shorter when it does not divide ``in``.
    :param damp_percent: ``λ = damp_percent * mean(diag H)`` is added to ``diag(H)``.
    :param act_order: process columns by descending ``diag(H)``; sets ``g_idx``.
    :param block_size: lazy-batch width; affects speed only, never the result.
    :param sym: symmetric grid (as :func:`quantize_rtn` defines it) instead of zero points.
    :returns: a :class:`QuantizedWeight` with codes in the original column order; ``g_idx`` is
        ``None`` unless ``act_order``.

    Columns with ``H_jj == 0`` ("dead" inputs: always zero in the calibration data) have
    no effect on the objective; their weights are set to 0 and quantised as such.
    """
    _check(w, H, block_size)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    in_f = w.shape[1]
    gs = in_f if group_size is None or group_size <= 0 else min(int(group_size), in_f)
    grid = _IntGrid(bits, sym)
    Q, perm = _error_feedback(w, H, grid, group_size=gs, damp_percent=damp_percent, act_order=act_order,
                              block_size=block_size)
    assert len(grid.scales) == -(-in_f // gs)
    g_idx = None
    if perm is not None:
        order_group = torch.arange(in_f, device=Q.device, dtype=torch.int32) // gs
        g_idx = torch.empty(in_f, dtype=torch.int32, device=Q.device)
        g_idx[perm] = order_group
    return QuantizedWeight(codes=Q, scales=torch.stack(grid.scales, dim=1).contiguous(),
                           zeros=torch.stack(grid.zeros, dim=1).contiguous(), bits=bits, group_size=gs, g_idx=g_idx)


def gptq_quantize_fp8(w: torch.Tensor, H: torch.Tensor, *, damp_percent: float = 0.01, act_order: bool = False,
                      block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's error feedback on the float8 e4m3 grid: ``(q float8_e4m3fn [out, in], scales
    float32 [out])``, the layout :func:`quantize_fp8_e4m3` returns (one scale per row,
    ``max|w_row| / 448`` of the original row; a weight that error feedback pushes past it
    is clamped to ±448). Only the rounding changes: each column's rounding error is spread
    over the columns not yet quantised, as for the integer grid, so a row's dot product
    with the calibration inputs is kept rather than each weight on its own. Act-order only
    changes the processing order (fp8 has no groups to re-index)."""
    _check(w, H, block_size)
    grid = _Fp8Grid()
    Q, _ = _error_feedback(w, H, grid, group_size=w.shape[1], damp_percent=damp_percent, act_order=act_order,
                           block_size=block_size)
    return Q, grid.scale.float()
