"""The step-cost model the `slo` scheduler plans with: how long will a batch take?

A step's wall time is modelled as linear in the work it holds::

    t  ≈  a  +  e·S  +  b·P  +  c·D  +  d·K

- ``P``, prefill tokens: tokens run in multi-token rows (prefill chunks, and a decode that
  verifies k draft tokens: 1 + k rows);
- ``D``, decodes: sequences running exactly one token;
- ``K``, KV tokens read: attention work; a sequence running q new tokens after c computed
  ones reads ``q·c + q(q+1)/2`` (each new token attends to its context; ``c + 1`` for a
  decode);
- ``S``, a prefill step: 1 when the step holds any multi-token row, else 0. A decode-only
  step takes the backend's fast decode path; one prefill row sends the whole step through
  the general one. Measured here (the embedded model, 2 idle cores): 2 decodes 10-12 ms,
  2 decodes beside a 16-token chunk 40-58 ms, while a prefill token costs ~0.6 ms; without
  this term the fit spreads that fixed cost over P and K and gets both kinds of step wrong;
- ``a``: the fixed cost of any step (Python, the sampler, launching the layers).

The coefficients are fitted online by exponentially weighted least squares. Each observed
step adds its features ``x = (1, S, P, D, K)`` and time ``t`` to ``A = Σ wᵢ·xᵢxᵢᵀ`` and
``v = Σ wᵢ·xᵢ·tᵢ``, a step seen n steps ago weighing ``decay**n`` (0.98: about the last 50
steps), so the model follows the machine as its load changes. The fit solves
``(A + λ·diag(A))·θ = v``, a ridge relative to each feature's own scale (λ = 1e-4) that keeps
the system solvable when recent steps all look alike, under the constraint that no
coefficient is negative (more work never predicts less time): every subset of the features
is solved, and of the solutions without a negative coefficient the one with the least
weighted squared error wins (31 solves of at most 5x5; a feature never seen stays 0). Until
``min_steps`` (8) steps were seen the model predicts 0 s: no constraint, and the scheduler
behaves like `continuous`.

Outliers: on a shared machine one step now and then takes 10-100x its usual time (another
process took the cores, or a kernel was built on first use; measured here: 8-17 s for steps
that take 0.05-0.4 s). Once the model has seen ``clip_after`` (20) steps, an observed time
above ``max_ratio`` (4) times the prediction enters the fit as ``max_ratio`` times the
prediction, so one spike
cannot wreck the plans that follow, while a lasting slowdown still raises the predictions
within a few steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tokenloom.core.sequence import Batch

NUM_FEATURES = 5  # (1, S, P, D, K)


@dataclass(slots=True)
class StepWork:
    """The features of one step, accumulated sequence by sequence."""

    num_prefill_tokens: int = 0  # P: tokens in multi-token rows
    num_decodes: int = 0  # D: sequences running one token
    num_kv_reads: int = 0  # K: KV tokens attention reads

    def add(self, num_computed: int, num_new: int) -> None:
        """A sequence with ``num_computed`` tokens in the cache runs ``num_new`` more."""
        if num_new <= 0:
            return
        if num_new == 1:
            self.num_decodes += 1
        else:
            self.num_prefill_tokens += num_new
        self.num_kv_reads += num_new * num_computed + num_new * (num_new + 1) // 2

    @property
    def is_prefill_step(self) -> bool:
        return self.num_prefill_tokens > 0

    def plus(self, num_computed: int, num_new: int) -> StepWork:
        out = StepWork(self.num_prefill_tokens, self.num_decodes, self.num_kv_reads)
        out.add(num_computed, num_new)
        return out

    @classmethod
    def of_batch(cls, batch: Batch) -> StepWork:
        """A batch's work, read before the step's results move ``num_computed_tokens``."""
        work = cls()
        for seq, n, drafts in zip(batch.seqs, batch.num_scheduled_tokens, batch.draft_tokens, strict=True):
            work.add(seq.num_computed_tokens, n + len(drafts))
        return work

    def features(self) -> tuple[float, float, float, float, float]:
        """(1, S, P, D, K), in the order of :attr:`StepCostModel.coef`."""
        return (1.0, float(self.is_prefill_step), float(self.num_prefill_tokens), float(self.num_decodes),
                float(self.num_kv_reads))


class StepCostModel:
    """``observe(work, seconds)`` after each step; ``predict(work)`` in seconds."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8, ridge: float = 1e-4, max_ratio: float = 4.0,
                 clip_after: int = 20):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay, self.min_steps, self.ridge, self.max_ratio = decay, min_steps, ridge, max_ratio
        self.clip_after = clip_after
        self._a = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._v = np.zeros(NUM_FEATURES)
        self._tt = 0.0  # Σ w·t², for the squared error of a candidate fit
        self.num_steps = 0
        self.coef = (0.0,) * NUM_FEATURES  # (a, e, b, c, d): seconds per unit of (1, S, P, D, K)
        self._stale = False

    def observe(self, work: StepWork, seconds: float) -> None:
        if self.num_steps >= self.clip_after:
            seconds = min(seconds, self.max_ratio * self.predict(work))
        x = np.array(work.features())
        self._a = self.decay * self._a + np.outer(x, x)
        self._v = self.decay * self._v + x * seconds
        self._tt = self.decay * self._tt + seconds * seconds
        self.num_steps += 1
        self._stale = True

    def fit(self) -> tuple[float, ...]:
        """Refit from the weighted sums (cheap: 31 solves of at most 5x5); returns (a, e, b, c, d)."""
        a, v = self._a, self._v
        seen = [i for i in range(NUM_FEATURES) if a[i, i] > 0.0]
        best, best_err = np.zeros(NUM_FEATURES), self._tt  # all zero: the error is Σ w·t²
        for k in range(1, len(seen) + 1):
            for cols in itertools.combinations(seen, k):
                sub = np.ix_(cols, cols)
                sol = np.linalg.solve(a[sub] + self.ridge * np.diag(np.diag(a)[list(cols)]), v[list(cols)])
                if (sol < 0.0).any():
                    continue
                theta = np.zeros(NUM_FEATURES)
                theta[list(cols)] = sol
                err = self._tt - 2.0 * theta @ v + theta @ a @ theta
                if err < best_err:
                    best, best_err = theta, err
        self.coef = tuple(float(c) for c in best)
        self._stale = False
        return self.coef

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def predict(self, work: StepWork) -> float:
        """Predicted seconds for a step of ``work``; 0 while the model is not ready."""
        if not self.ready:
            return 0.0
        if self._stale:
            self.fit()
        a, e, b, c, d = self.coef
        return (a + e * work.is_prefill_step + b * work.num_prefill_tokens + c * work.num_decodes
                + d * work.num_kv_reads)
