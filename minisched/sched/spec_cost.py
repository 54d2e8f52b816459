"""Does drafting pay this step? A step-cost model fitted on the machine's own decode and verify steps
against the tokens the drafts are expected to add (spec.py's `Speculator.worth`).

- `StepCost`: seconds of a decode or verify step as `a + b * T + c * V`, T its query tokens (rows +
  drafts), V 1 for a verify step (any drafts) and 0 for a plain decode: least squares over the recent
  steps with exponential forgetting (`decay` per observation), so it follows the machine (a busy core,
  another thread count), every coefficient >= 0. `c` is what a step pays for verifying at all, whatever
  its drafts: the forward runs as an extend (the paged prefill kernel instead of the decode one, logits
  for every row, the acceptance walk). A fit without it (a + b * T alone, before this) spreads that fixed
  cost over the draft tokens, so a step of many drafts looked dear per token and one of a single draft
  cheap: it cut drafts that paid on input-grounded text (1.18x -> 1.06x at B=8) and kept single
  low-acceptance drafts on chat. The seconds are the runner's measured forward (StepOutput.seconds),
  handed to the scheduler with the step's tokens: an input of the journal, so a replay re-fits the same
  model and makes the same choices (V comes from the batch the replay rebuilds).
- Expected tokens: a row drafting k tokens with per-token acceptance a emits 1 + a + a^2 + ... + a^k
  (each draft is kept only if every one before it was; `a` is the row's running estimate, spec.py).
- `choose`: the draft tokens taken in order of expected value (a row's j-th draft is worth a^j, so
  a row's drafts are always a prefix), keeping the count m that maximises expected tokens per second,
  (B + value of the m best) / cost(B + m, verify = m > 0), m = 0 included: no drafting when even the
  best drafts do not pay for the rows they add and the verify step's own cost. Free of any clock or
  randomness. Pure Python.

Why: on a CPU a verify step's extra rows are not free once the batch is past the weight-bandwidth bound
(8 rows x 5 tokens cost more than the few drafts free chat keeps: 0.95x of plain decoding at B=8,
benchmarks/RESULTS.md "Speculative decoding"), while at one stream they are nearly free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_STEPS = 4  # observations before the model is trusted (until then drafting runs, to measure it)
MIN_SPREAD = 1.0  # tokens: the observed step sizes must differ this much (else the slope is unknown)
# A weak pull of c toward 0, in observations' weight: while only verify steps are seen (every row drafting
# for a long while) c and a are not told apart, and the fit then puts the verify cost in a -- which prices a
# plain step as dear as a verify and keeps drafting, what those steps have been doing.
C_PRIOR = 1e-3


@dataclass
class StepCost:
    """Online least squares of step seconds against (1, query tokens, is-verify), recent steps weighted most."""

    decay: float = 0.97
    n: int = 0
    # the weighted sums of x x^T (3 x 3, x = (1, T, V)), x y and y^2
    sxx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    sxy: list[float] = field(default_factory=lambda: [0.0] * 3)
    syy: float = 0.0

    def observe(self, tokens: int, seconds: float, verify: bool = False) -> None:
        if not seconds > 0:  # a bogus timing (0, negative, NaN) teaches nothing
            return
        d, x = self.decay, (1.0, float(tokens), 1.0 if verify else 0.0)
        self.n += 1
        for i in range(3):
            for j in range(3):
                self.sxx[i][j] = d * self.sxx[i][j] + x[i] * x[j]
            self.sxy[i] = d * self.sxy[i] + x[i] * seconds
        self.syy = d * self.syy + seconds * seconds

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of seconds = a + b * tokens + c * verify, each >= 0; None until the steps seen
        determine a slope."""
        if self.n < MIN_STEPS:
            return None
        s1, st, stt = self.sxx[0][0], self.sxx[0][1], self.sxx[1][1]
        if stt / s1 - (st / s1) ** 2 < MIN_SPREAD**2 / 4:
            return None
        gram = [row[:] for row in self.sxx]
        gram[2][2] += C_PRIOR
        best: tuple[float, list[float]] | None = None
        # the least-squares fit over each set of free coefficients (a always; the others fixed at 0), the
        # best one whose coefficients are all >= 0: an exact non-negative least squares for three unknowns
        for extra in ((1, 2), (1,), (2,), ()):
            free = (0, *extra)
            theta = _solve([[gram[i][j] for j in free] for i in free], [self.sxy[i] for i in free])
            if theta is None or min(theta) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, v in zip(free, theta):
                full[i] = v
            sse = self.syy - 2 * sum(full[i] * self.sxy[i] for i in range(3))
            sse += sum(full[i] * gram[i][j] * full[j] for i in range(3) for j in range(3))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, full)
        if best is None or max(best[1]) == 0.0:
            return None
        a, b, c = best[1]
        return a, b, c

    def seconds(self, tokens: int, verify: bool = False) -> float | None:
        abc = self.coefficients()
        return None if abc is None else abc[0] + abc[1] * tokens + abc[2] * verify


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v by Gaussian elimination with partial pivoting; None when m is (nearly) singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max((abs(x) for row in m for x in row), default=0.0)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


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
    abc = cost.coefficients()
    if abc is None:
        return None
    a, b, c = abc
    rows = len(ks)
    fixed = fixed or [False] * rows
    base_value = float(rows) + sum(expected_tokens(acceptance[i], k) - 1 for i, k in enumerate(ks) if fixed[i])
    base_tokens = rows + sum(k for i, k in enumerate(ks) if fixed[i])
    items = sorted(
        ((acceptance[i] ** j, i) for i, k in enumerate(ks) if not fixed[i] for j in range(1, k + 1)),
        key=lambda vi: -vi[0],
    )
    base_verify = base_tokens > rows  # a fixed (seeded) row drafts: the step verifies anyway
    best_m, best_rate, value = 0, base_value / (a + b * base_tokens + c * base_verify), base_value
    for m, (v, _) in enumerate(items, start=1):
        value += v
        rate = value / (a + b * (base_tokens + m) + c)
        if rate > best_rate:
            best_m, best_rate = m, rate
    out = [k if f else 0 for k, f in zip(ks, fixed)]
    for _, i in items[:best_m]:
        out[i] += 1
    return out
