"""Retraction helpers (SGLang's ScheduleBatch.retract_decode), pure functions over requests.

When the next decode step's pages do not fit even after evicting the radix cache, the
scheduler retracts running requests back to the waiting queue:

- victim: fewest decoded tokens first (least work lost), ties: longest prompt (most pages);
- once it retracts at all, it keeps going until the requests that stay have room for
  `steps` more tokens each (`headroom_pages`), so pressure costs one retraction round
  rather than one retraction every few steps;
- afterwards `new_token_ratio` is re-estimated from what the remaining requests have
  actually decoded (`reestimate_ratio`), instead of being reset to its initial value.
"""
from __future__ import annotations

from typing import Sequence

from minisched.sched.kv_pool import cdiv
from minisched.sched.req import Req


def pick_victim(running: Sequence[Req]) -> Req:
    return min(running, key=lambda r: (len(r.output_ids), -r.prompt_len))


def headroom_pages(running: Sequence[Req], page_size: int, steps: int) -> int:
    """Pages the running requests lack for their next `steps` tokens (at most what each may
    still generate)."""
    return sum(max(0, cdiv(r.kv_len + min(steps, r.remaining_new_tokens), page_size) - len(r.page_ids))
               for r in running)


def reestimate_ratio(running: Sequence[Req], steps: int) -> float:
    """SGLang: min(1, (decoded + steps * batch) / sum(max_new_tokens)) over the requests that stay."""
    total = sum(r.max_new_tokens for r in running)
    if total <= 0:
        return 1.0
    return min(1.0, (sum(len(r.output_ids) for r in running) + steps * len(running)) / total)
