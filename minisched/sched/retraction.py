"""Retraction helpers (SGLang's ScheduleBatch.retract_decode), pure functions over requests.

When the next decode step's pages do not fit even after evicting the radix cache, the
scheduler retracts running requests back to the waiting queue:

- victim: fewest decoded tokens first (least work lost), ties: longest prompt (most pages);
- afterwards `new_token_ratio` is re-estimated from what the remaining requests have
  actually decoded (`reestimate_ratio`), instead of being reset to its initial value.

SGLang also keeps retracting until the rest have room for `retract_decode_steps` more
tokens each. Measured with the fake runner (benchmarks/RESULTS.md) that retracted more
requests and recomputed more tokens for no fewer steps, so only the next step is made room for.
"""
from __future__ import annotations

from typing import Sequence

from minisched.sched.req import Req


def pick_victim(running: Sequence[Req]) -> Req:
    return min(running, key=lambda r: (len(r.output_ids), -r.prompt_len))


def reestimate_ratio(running: Sequence[Req], steps: int) -> float:
    """SGLang: min(1, (decoded + steps * batch) / sum(max_new_tokens)) over the requests that stay."""
    total = sum(r.max_new_tokens for r in running)
    if total <= 0:
        return 1.0
    return min(1.0, (sum(len(r.output_ids) for r in running) + steps * len(running)) / total)
