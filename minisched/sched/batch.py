"""`Batch`: what one forward step computes, and the arrays the engine needs for it.

For request b: `prefix_lens[b]` tokens already have K/V in the pool, `extend_lens[b]`
new tokens are computed this step (1 for decode), at positions
`prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1`. Pages for the new tokens are
already allocated. The engine: stores the new K/V at `out_slots()`, runs paged
attention with `qo_indptr()` and `page_table()` (which covers prefix + new tokens),
samples one token per request at `logits_indices()` and passes the tokens, in batch
order, to `Scheduler.process_batch_result`. Rows with `sample_mask()` False are
chunks that do not finish their prompt; their sampled token is ignored.

A VERIFY batch (speculative decoding, spec.py) is a decode batch whose row b also feeds
`drafts[b]`: `extend_lens[b] = 1 + len(drafts[b])`, computed like a prefill extend; the
runner returns the accepted run of each row (`StepOutput.more_tokens`).

Helpers read the requests' current state: call them before `process_batch_result`.
All arrays are numpy int32 (bool for the mask). No torch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from minisched.base.page_table import build_csr
from minisched.sched.req import Req


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prefill chunk(s) first, then decode requests (extend_len 1)
    VERIFY = "verify"  # decode requests, each with its draft tokens (extend_len 1 + drafts)


@dataclass(kw_only=True)
class Batch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_size: int
    sampled: list[bool] = field(default_factory=list)  # does row b produce a kept token?
    num_decode: int = 0  # decode requests (the last rows of a MIXED batch; all of a DECODE one)
    future_ids: list[int] = field(default_factory=list)  # overlap: placeholder of each row's token (launch)
    loads: list = field(default_factory=list)  # host tier: (host copy, device pages) to copy in before the forward
    copies: list = field(default_factory=list)  # n > 1: (source page, page) copy-on-write before the forward
    free_after: list = field(default_factory=list)  # pages freed when it resolves (its copies' last sources)
    drafts: list[list[int]] = field(default_factory=list)  # VERIFY: each row's draft tokens (after its last token)
    draft_futures: list[int] = field(default_factory=list)  # VERIFY: the drafts' placeholders (launch)

    def __post_init__(self) -> None:
        if not self.sampled:
            self.sampled = [p + e >= r.seq_len for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens)]

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def input_ids(self) -> np.ndarray:
        out: list[int] = []
        drafts: Sequence[Sequence[int]] = self.drafts or [()] * len(self.reqs)
        for r, p, e, d in zip(self.reqs, self.prefix_lens, self.extend_lens, drafts):
            if e == 1 or d:
                out.append(r.token_at(p))
                out.extend(d)
            elif p + e <= len(r.prompt_ids):
                out.extend(r.prompt_ids[p : p + e])
            else:
                out.extend(r.fill_ids[p : p + e])
        return np.asarray(out, dtype=np.int32)

    def positions(self) -> np.ndarray:
        ext = np.asarray(self.extend_lens, dtype=np.int64)
        qo = self.qo_indptr()
        shift = np.asarray(self.prefix_lens, dtype=np.int64) - qo[:-1]
        out: np.ndarray = (np.arange(int(qo[-1]), dtype=np.int64) + np.repeat(shift, ext)).astype(np.int32)
        return out

    def qo_indptr(self) -> np.ndarray:
        out = np.zeros(len(self.reqs) + 1, dtype=np.int32)
        np.cumsum(self.extend_lens, out=out[1:])
        return out

    def out_slots(self) -> np.ndarray:
        ps, parts, single = self.page_size, [], []
        for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens):
            if e == 1:
                single.append(r.page_ids[p // ps] * ps + p % ps)
                continue
            if single:
                parts.append(np.asarray(single, dtype=np.int64))
                single = []
            first = p // ps
            pages = np.asarray(r.page_ids[first : (p + e - 1) // ps + 1], dtype=np.int64)
            pos = np.arange(p, p + e, dtype=np.int64)
            parts.append(pages[pos // ps - first] * ps + pos % ps)
        parts.append(np.asarray(single, dtype=np.int64))
        return np.concatenate(parts).astype(np.int32)

    def page_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kv_indptr, kv_indices, kv_last_page_len) over prefix + new tokens."""
        kv_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        return build_csr([r.page_ids for r in self.reqs], kv_lens, self.page_size)

    def logits_indices(self) -> np.ndarray:
        """Row of each request's last new token in the flattened new tokens."""
        return self.qo_indptr()[1:] - 1

    def sample_mask(self) -> np.ndarray:
        return np.asarray(self.sampled, dtype=bool)
