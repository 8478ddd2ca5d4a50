"""How far a parallel run may drift from raypar.reference.ReferenceTrainer, in fp32.

Gradients. Both sides do the same arithmetic but sum in other orders: micro-batches
accumulate one after another, data-parallel replicas are averaged, and GEMMs over fewer
rows block differently. Two orders of an n-term sum differ by at most 2*gamma_n ~ 2*n*u
times the sum of the terms' magnitudes (u = 2**-24; Higham, Accuracy and Stability of
Numerical Algorithms, 4.2). So at equal weights:
- the loss, a mean of n non-negative token losses, differs by at most 2*n*u*L;
- a gradient sums n per-token terms. The sum of their magnitudes is not observable, so the
  tensor's largest gradient S stands in for it: |dg| <= 2*n*u*S. This is an estimate: it
  undercounts where the terms cancel. What covers that is the gap between this worst case
  and what rounding gives in practice (at most 11 ulps of S measured at equal weights,
  against 2n = 128 to 256 here);
- the gradient norm squares and sums each tensor's elements (P at most), then at most one
  partial sum per tensor on each side (T tensors): |d norm| <= ||dg|| + gamma_(P+2T+1)*norm.
After the first step the weights differ too, and a weight difference changes the next
gradients (a Hessian term) by more than rounding does. Rather than guess that term, a
probe (a second reference) is loaded with the run's checked weights and computes the
step there. The run may then differ by the rounding above plus |probe - reference|.

Weights. Fused AdamW steps by lr * m^/(sqrt(v^) + eps), where m^ = sum_i a_i g_i and
v^ = sum_i b_i g_i^2 weight the gradients seen so far (a_i, b_i: the bias-corrected EMA
weights). With D = sqrt(v^) + eps and gradients off by |d_i| <= e_i, the update moves by
N / (D D'), where
  |N| <= sum_i e_i |D a_i - m^ b_i g_i / sqrt(v^)| + |m^| ||e||_b^2 / (2 sqrt(v^))
  (first order plus the remainder of linearising a norm), or by the triangle inequality
  |N| <= D sum_i a_i e_i + |m^| ||e||_b,   with D' >= max(D - ||e||_b, eps).
The first bound keeps the cancellation between m^ and sqrt(v^): gradients all changed by
a relative r move the update by only r*eps/D. So AdamW ignores rounding except where |g|
is near eps, and there it amplifies it by up to ~1/eps. Either side's update is at most
(1-b1)/bc1 * sqrt(bc2/(1-b2)) * sum_k (b1/sqrt(b2))^k (1 at the first step), so the
difference is capped at twice that. Each step adds lr_t times the update bound to the
weight bound, plus the optimizer's own rounding on each side: some 16 ulps of the largest
update (about 8 roundings make m, v and their quotient, and m and v do not share them)
and 4 ulps of |w| (decay, subtraction). Weight decay only shrinks a difference, so the
bound leaves it out. Clipping divides each side by its own norm; the run reports the
norm it used, so that difference is measured rather than bounded.

The probe admits whatever weight difference the run has. So the weights are checked
after every step, before that difference can widen the next step's bounds.
"""
from __future__ import annotations

import math

import torch

from raypar.model import unstacked
from raypar.optim import lr_at
from raypar.reference import ReferenceTrainer

from helpers import assert_same

U = 2.0 ** -24  # fp32 unit roundoff


def sum_rounding(n: int) -> float:
    """Relative difference of two orders of an n-term sum of same-signed terms: 2*gamma_n."""
    return 2 * n * U / (1 - n * U)


class Tolerances:
    """Per-step bounds on a run's loss, gradients, norm and weights next to `ref`.

    Each step: `observe` (step_both calls it after the reference step), compare against
    `loss`, `grads` and `grad_norm`, then `check_weights` with the run's weights, which the
    probe starts the next step from.
    """

    def __init__(self, ref: ReferenceTrainer):
        self.ref = ref
        self.probe = ReferenceTrainer(ref.cfg, next(ref.model.parameters()).device)
        self.probe.optimizer.load_(ref.parameters())  # a test may have loaded weights into both
        self.loss = self.grad_norm = 0.0
        self.grads: dict[str, torch.Tensor] = {}
        self.weights = {n: torch.zeros_like(w) for n, w in ref.parameters().items()}
        self._history: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.weights}
        self._probe_current = True

    def observe(self, step: int, tokens: torch.Tensor, labels: torch.Tensor, sample_ids: list[int] | None,
                ref_loss: float, ref_grads: dict[str, torch.Tensor], run_norms: list[float]) -> None:
        """`run_norms`: the gradient norms the run clipped with (one per pipeline)."""
        # A probe left at its own update instead of the run's weights would measure nothing.
        assert self._probe_current, "check_weights after every step: the probe needs the run's weights"
        self._probe_current = False
        probe_loss, probe_grads = self.probe.step(step, tokens, labels, sample_ids=sample_ids)
        n = labels.numel()
        self.loss = sum_rounding(n) * abs(ref_loss) + abs(probe_loss - ref_loss)
        self.grads = {name: sum_rounding(n) * g.abs().max() + (probe_grads[name] - g).abs()
                      for name, g in ref_grads.items()}
        ref_norm = float(self.ref.optimizer.local_sq_norm(list(ref_grads.values())).sqrt())  # as ref.step clips
        terms = max(g.numel() for g in ref_grads.values()) + 2 * len(ref_grads) + 1
        self.grad_norm = _norm(self.grads) + sum_rounding(terms) / 2 * ref_norm
        self._advance_weights(step, ref_grads, ref_norm, run_norms)

    def check_weights(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
        assert_same(got, want, self.weights, f"{where}: weights")
        self.probe.optimizer.load_(got)
        self._probe_current = True

    def _advance_weights(self, step: int, ref_grads: dict[str, torch.Tensor], ref_norm: float,
                         run_norms: list[float]) -> None:
        tc = self.ref.cfg.train
        scale, dscale = 1.0, 0.0
        if tc.grad_clip > 0:  # AdamW sees g / max(1, norm / clip), a 1-Lipschitz function of the norm
            scale = max(1.0, (ref_norm + 1e-6) / tc.grad_clip)
            dscale = max(abs(n - ref_norm) for n in run_norms) / tc.grad_clip
        low = max(1.0, scale - dscale)
        lr = lr_at(tc, step)
        params = dict(unstacked(self.ref.model))
        for name, g in ref_grads.items():
            g = g.double() / scale
            self._history[name].append((g, (self.grads[name].double() + g.abs() * dscale) / low))
            du, most = update_bound(self._history[name], tc.beta1, tc.beta2, tc.eps)
            rounding = 2 * U * (16 * lr * most + 4 * (params[name].detach().double().abs() + lr * most))
            self.weights[name] = self.weights[name] + (lr * du + rounding).float()


def update_bound(history: list[tuple[torch.Tensor, torch.Tensor]], b1: float, b2: float,
                 eps: float) -> tuple[torch.Tensor, float]:
    """How far m^/(sqrt(v^)+eps) moves when the gradients in `history` ((g_i, e_i), oldest
    first) move by at most e_i each, and the largest it can be (the module docstring
    derives both)."""
    t = len(history)
    a = [(1 - b1) * b1 ** (t - 1 - i) / (1 - b1 ** t) for i in range(t)]
    b = [(1 - b2) * b2 ** (t - 1 - i) / (1 - b2 ** t) for i in range(t)]
    m = sum(ai * g for ai, (g, _) in zip(a, history))
    s = sum(bi * g * g for bi, (g, _) in zip(b, history)).sqrt()
    e_b = sum(bi * e * e for bi, (_, e) in zip(b, history)).sqrt()
    d = s + eps
    d_low = (d - e_b).clamp(min=eps)
    triangle = (d * sum(ai * e for ai, (_, e) in zip(a, history)) + m.abs() * e_b) / (d * d_low)
    s_safe = s.clamp(min=1e-300)
    linear = sum(e * (d * ai - m * bi * g / s_safe).abs() for ai, bi, (g, e) in zip(a, b, history))
    correlated = (linear + m.abs() * e_b ** 2 / (2 * s_safe)) / (d * d_low)
    bound = torch.where(s > 0, torch.minimum(correlated, triangle), triangle)  # s = 0: every g_i is 0
    most = (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2)) * sum((b1 / math.sqrt(b2)) ** k
                                                                              for k in range(t))
    return bound.clamp(max=2 * most), most


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))
