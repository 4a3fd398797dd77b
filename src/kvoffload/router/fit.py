"""The TTFT model's fit and its noise: robust recursive least squares, residual life.

:class:`Fit` is the deployment's one fit of the step-time coefficients θ
(multipliers of the priors' units), learned in relative terms with Huber
weights and slow forgetting, and the running spread of its answers (the σ
of a prefill's time about its estimate, log scale). :func:`residual_life`
and :func:`attention_left` are what the queue model
(:mod:`kvoffload.router.model`) takes from that noise and from chunked
prefill's order.
"""

from __future__ import annotations

import math

__all__ = ["NF", "SIGMA0", "Fit", "attention_left", "residual_life"]

#: Features: steps, tokens, attention work, decode-steps.
NF = 4
_CLAMP = 16.0
_FORGET = 0.998
_HUBER = 2.0
_SPREAD = 4.0  # prior variance of each θ: the priors may be several times off
SIGMA0 = 0.25  # prior σ of a prefill's time about its estimate (log scale)
_SIGMA_RATE = 0.05  # weight of one answer in the learned σ


def residual_life(x: float, sigma: float) -> float:
    """Expected time left of a prefill already ``x`` of its estimate in, over its estimate.

    A prefill's time is its estimate × ``f``, ``f`` lognormal with mean 1 and
    log-σ ``sigma`` (what the fit's residuals say). ``E[f − x | f > x]``: 1 at
    the start; at ``sigma = 0`` it is ``1 − x``; with noise a prefill that
    overran its estimate is most likely a long one and still has a good part
    left (σ = 0.5: half its estimate once it is past it).
    """
    if x <= 0:
        return 1.0
    if sigma < 1e-3:
        return max(0.0, 1.0 - x)
    mu = -0.5 * sigma * sigma
    lx = math.log(x)
    z_tail = (mu - lx) / sigma  # P(f > x) = Φ(z_tail)
    den = math.erfc(-z_tail / math.sqrt(2.0))
    if den < 1e-300:
        # Far in the tail: the lognormal's mean excess, x·σ²/(ln x − μ).
        return x * sigma * sigma / max(lx - mu, 1e-9)
    num = math.erfc(-(z_tail + sigma) / math.sqrt(2.0))
    return max(0.0, num / den - x)


def attention_left(m: int, attn: float, left: float) -> float:
    """The attention work of a prompt's last ``left`` of its ``m`` uncached tokens.

    ``attn = m · (2k + m)`` for ``k`` cached tokens before them (the sum over the
    prompt's chunks of ``n · (2c + n)``); its last ``left`` tokens come after
    ``k + m − left`` others: ``left · (2(k + m − left) + left)``, more than their
    token share of it (a long prompt's last chunks attend to the most context).
    """
    if m <= 0 or left <= 0:
        return 0.0
    left = min(left, float(m))
    k = max(0.0, (attn / m - m) / 2.0)
    return left * (2.0 * (k + m - left) + left)


def _clamp(t: float, low: float) -> float:
    return min(_CLAMP, max(low, t))


class Fit:
    """Recursive least squares over θ (multipliers of the priors), relative and robust."""

    __slots__ = ("abs_log", "count", "low", "p", "scale", "theta")

    def __init__(self, start: tuple[float, ...] = (1.0,) * NF) -> None:
        # θ stays within [1/16, 16] of its prior; a term whose prior is 0 starts
        # at 0 and may stay there (nothing said it exists; the data may).
        self.low = [1.0 / _CLAMP if t > 0 else 0.0 for t in start]
        self.theta = [_clamp(t, lo) for t, lo in zip(start, self.low, strict=True)]
        # Prior covariance: a wide spread (the priors may be off several times).
        self.p = [[_SPREAD if i == j else 0.0 for j in range(NF)] for i in range(NF)]
        self.scale = 0.3  # running mean |relative residual|
        self.abs_log = SIGMA0 * math.sqrt(2.0 / math.pi)  # running mean |log residual|
        self.count = 0

    @property
    def sigma(self) -> float:
        """The learned log-σ of a prefill's time about its estimate (noise and misfit)."""
        return self.abs_log * math.sqrt(math.pi / 2.0)

    def observe_spread(self, log_ratio: float, weight: float) -> None:
        """One answer's log(measured / estimated): the running spread the queue uses."""
        a = _SIGMA_RATE * weight
        self.abs_log = (1 - a) * self.abs_log + a * min(abs(log_ratio), 3.0)

    def predict(self, z: tuple[float, ...]) -> float:
        if len(z) != NF:
            raise ValueError(f"{len(z)} features, not {NF}")
        t = self.theta
        # Term by term from 0, as ``sum`` adds them (the same float).
        return 0.0 + t[0] * z[0] + t[1] * z[1] + t[2] * z[2] + t[3] * z[3]

    def update(self, z: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        pred = self.predict(z)
        if pred <= 0 or y <= 0 or weight <= 0:
            return
        zz = [x / pred for x in z]  # relative: the prediction scales to 1
        e = y / pred - 1.0
        lim = _HUBER * self.scale
        w = weight * (1.0 if abs(e) <= lim or self.count < 8 else lim / abs(e))
        self.scale = 0.9 * self.scale + 0.1 * min(abs(e), 4.0)
        p = self.p
        pz = [sum(p[i][j] * zz[j] for j in range(NF)) for i in range(NF)]
        denom = _FORGET + w * sum(zz[i] * pz[i] for i in range(NF))
        if denom <= 0:
            return
        k = [w * x / denom for x in pz]
        self.theta = [
            _clamp(t + ki * e, lo) for t, ki, lo in zip(self.theta, k, self.low, strict=True)
        ]
        self.p = [[(p[i][j] - k[i] * pz[j]) / _FORGET for j in range(NF)] for i in range(NF)]
        # Forgetting inflates unexcited directions without bound: keep them sane.
        for i in range(NF):
            if self.p[i][i] > _SPREAD:
                f = math.sqrt(_SPREAD / self.p[i][i])
                for j in range(NF):
                    self.p[i][j] *= f
                    self.p[j][i] *= f
        self.count += 1
