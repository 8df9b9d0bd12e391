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

from tokenloom.plugins.quantizers.primitives import QuantizedWeight, quantize_rtn, token_rows

__all__ = ["HessianAccumulator", "gptq_quantize", "layer_error"]


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
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if H.shape != (in_f, in_f):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match in={in_f}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    gs = in_f if group_size is None or group_size <= 0 else min(int(group_size), in_f)
    maxq = float(2**bits - 1)

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

    n_groups = -(-in_f // gs)
    Q = torch.empty(out_f, in_f, dtype=torch.uint8, device=W.device)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    scale = zero = inv_scale = None

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
                qt = quantize_rtn(cur, bits=bits, group_size=gend - j, sym=sym)
                scales.append(qt.scales[:, 0])
                zeros.append(qt.zeros[:, 0])
                scale = qt.scales[:, 0].to(torch.float32)
                zero = qt.zeros[:, 0].to(torch.float32)
                inv_scale = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
            col = W1[:, i]
            q = torch.clamp(torch.round(col * inv_scale) + zero, 0.0, maxq)
            Q[:, j] = q.to(torch.uint8)
            err = (col - (q - zero) * scale) / Hinv1[i, i]
            Err1[:, i] = err
            if i + 1 < i2 - i1:
                W1[:, i + 1:].addr_(err, Hinv1[i, i + 1:], alpha=-1.0)
        if i2 < in_f:
            W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1.0)

    assert len(scales) == n_groups
    scales_t = torch.stack(scales, dim=1).contiguous()
    zeros_t = torch.stack(zeros, dim=1).contiguous()

    g_idx = None
    if perm is not None:
        order_group = torch.arange(in_f, device=W.device, dtype=torch.int32) // gs
        g_idx = torch.empty(in_f, dtype=torch.int32, device=W.device)
        g_idx[perm] = order_group
        Q_orig = torch.empty_like(Q)
        Q_orig[:, perm] = Q
        Q = Q_orig

    return QuantizedWeight(codes=Q, scales=scales_t, zeros=zeros_t, bits=bits, group_size=gs, g_idx=g_idx)
