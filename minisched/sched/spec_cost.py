"""Does drafting pay this step? A step-cost model fitted on the machine's own decode and verify steps
against the tokens the drafts are expected to add (spec.py's `Speculator.worth`).

- `StepCost`: seconds of a decode or verify step as `a + b * T`, T its query tokens (rows + drafts),
  least squares over the recent steps with exponential forgetting (`decay` per observation), so it
  follows the machine (a busy core, another thread count). The seconds are the runner's measured
  forward (StepOutput.seconds), handed to the scheduler with the step's tokens: an input of the
  journal, so a replay re-fits the same model and makes the same choices.
- Expected tokens: a row drafting k tokens with per-token acceptance a emits 1 + a + a^2 + ... + a^k
  (each draft is kept only if every one before it was; `a` is the row's running estimate, spec.py).
- `choose`: the draft tokens taken in order of expected value (a row's j-th draft is worth a^j, so
  a row's drafts are always a prefix), keeping the count m that maximises expected tokens per second,
  (B + value of the m best) / cost(B + m), m = 0 included: no drafting when even the best draft does
  not pay for the rows it adds. Free of any clock or randomness. Pure Python.

Why: on a CPU a verify step's extra rows are not free once the batch is past the weight-bandwidth bound
(8 rows x 5 tokens cost more than the few drafts free chat keeps: 0.95x of plain decoding at B=8,
benchmarks/RESULTS.md "Speculative decoding"), while at one stream they are nearly free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_STEPS = 4  # observations before the model is trusted (until then drafting runs, to measure it)
MIN_SPREAD = 1.0  # tokens: the observed step sizes must differ this much (else the slope is unknown)


@dataclass
class StepCost:
    """Online least squares of step seconds against query tokens, recent steps weighted most."""

    decay: float = 0.97
    n: int = 0
    s1: float = 0.0
    st: float = 0.0
    stt: float = 0.0
    sy: float = 0.0
    sty: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if not seconds > 0:  # a bogus timing (0, negative, NaN) teaches nothing
            return
        d, t = self.decay, float(tokens)
        self.n += 1
        self.s1 = d * self.s1 + 1.0
        self.st = d * self.st + t
        self.stt = d * self.stt + t * t
        self.sy = d * self.sy + seconds
        self.sty = d * self.sty + t * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * tokens, both >= 0; None until the steps seen determine a slope."""
        if self.n < MIN_STEPS:
            return None
        var = self.stt / self.s1 - (self.st / self.s1) ** 2
        if var < MIN_SPREAD**2 / 4:
            return None
        mean_t, mean_y = self.st / self.s1, self.sy / self.s1
        b = max(0.0, (self.sty / self.s1 - mean_t * mean_y) / var)
        a = max(0.0, mean_y - b * mean_t)
        if a == 0.0 and b == 0.0:
            return None
        return a, b

    def seconds(self, tokens: int) -> float | None:
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * tokens


def expected_tokens(acceptance: float, k: int) -> float:
    """What a row drafting k tokens emits on average: 1 + a + ... + a^k."""
    return 1.0 + sum(acceptance**j for j in range(1, k + 1))


def choose(
    cost: StepCost, ks: Sequence[int], acceptance: Sequence[float], fixed: Sequence[bool] | None = None
) -> list[int] | None:
    """Each row's draft length (at most ks[i]) that maximises expected tokens per second, or None when
    the model is not fitted yet (the caller keeps its lengths). All zeros: plain decoding pays best.
    `fixed` rows keep ks[i] whatever it costs (a seeded sampled row: its random stream, and so its
    output, must not depend on the machine's timings)."""
    ab = cost.coefficients()
    if ab is None:
        return None
    a, b = ab
    rows = len(ks)
    fixed = fixed or [False] * rows
    base_value = float(rows) + sum(expected_tokens(acceptance[i], k) - 1 for i, k in enumerate(ks) if fixed[i])
    base_tokens = rows + sum(k for i, k in enumerate(ks) if fixed[i])
    items = sorted(
        ((acceptance[i] ** j, i) for i, k in enumerate(ks) if not fixed[i] for j in range(1, k + 1)),
        key=lambda vi: -vi[0],
    )
    best_m, best_rate, value = 0, base_value / (a + b * base_tokens), base_value
    for m, (v, _) in enumerate(items, start=1):
        value += v
        rate = value / (a + b * (base_tokens + m))
        if rate > best_rate:
            best_m, best_rate = m, rate
    out = [k if f else 0 for k, f in zip(ks, fixed)]
    for _, i in items[:best_m]:
        out[i] += 1
    return out
