"""`Decision`: one step's scheduling decision in the differential harness's common terms (diff_sglang.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Decision:
    """One step's decision on either side, in the harness's common terms."""

    mode: str  # "prefill", "decode" or "idle"
    rows: list  # (rid, prefix_len, extend_len) in batch order
    chunked: str | None  # the request carried to the next round
    retracted: list  # rids, in retraction order
    ratio: float  # new_token_ratio after the step's decision
    cached_tokens: int  # tokens the radix cache holds after the step's decision
    finished: list  # rids that ended in this step
