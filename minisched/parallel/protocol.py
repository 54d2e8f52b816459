"""What rank 0 tells the other ranks: a fixed-size header, then (for a step) ONE packed int32 tensor.

Header, int64 [HEADER_LEN]: `op`, four op arguments, then the length of each packed field.

- STEP   args: is_decode, has_cascade. Followed by the payload: the step's input ids and every
         index tensor of its `ForwardMeta` (positions, KV slots, page table, logits rows, the
         cascade groups), concatenated as int32 in the order of `FIELDS`.
- SETUP  args: num_pages, page_size, backend (index in `ops.BACKENDS`), check. A new engine: the
         ranks allocate their KV pool (their own heads, the same pages).
- NOOP   nothing (rank 0's heartbeat while idle, so that a waiting rank's bounded wait never ends).
- STOP   the workers leave their loop and exit.

Two broadcasts per step (header, payload) whatever the batch: the payload's length is only known
to rank 0, and the other ranks must size their buffer before receiving it.
"""

from __future__ import annotations

from typing import Optional

import torch

from minisched.model.llama import CascadeMeta, ForwardMeta

STEP, SETUP, NOOP, STOP = 1, 2, 3, 4
NUM_ARGS = 4
FIELDS = (
    "input_ids",
    "positions",
    "out_slots",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "logits_indices",
    # cascade decode only
    "rows",
    "group_indptr",
    "prefix_indptr",
    "prefix_indices",
    "prefix_last",
    "suffix_indptr",
    "suffix_indices",
    "suffix_last",
    "plain_rows",
    "plain_indptr",
    "plain_indices",
    "plain_last",
)
INT64_FIELDS = {"positions", "logits_indices", "rows", "plain_rows"}  # the rest stay int32
HEADER_LEN = 1 + NUM_ARGS + len(FIELDS)


def header(op: int, *args: int, lengths=(), device="cpu") -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = op
    h[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    h[1 + NUM_ARGS : 1 + NUM_ARGS + len(lengths)] = torch.tensor(list(lengths), dtype=torch.int64)
    return h.to(device)


def _fields(input_ids: torch.Tensor, meta: ForwardMeta) -> list[torch.Tensor]:
    out = [input_ids, meta.positions, meta.out_slots, meta.qo_indptr, *meta.page_table, meta.logits_indices]
    c = meta.cascade
    if c is not None:
        out += [c.rows, c.group_indptr, *c.prefix_table, *c.suffix_table, c.plain_rows, *c.plain_table]
    return out


def pack_step(input_ids: torch.Tensor, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) for one step, on the tensors' device."""
    parts = [t.reshape(-1).to(torch.int32) for t in _fields(input_ids, meta)]
    payload = torch.cat(parts)
    h = header(
        STEP,
        int(meta.is_decode),
        int(meta.cascade is not None),
        lengths=[p.numel() for p in parts],
        device=payload.device,
    )
    return h, payload


def payload_len(h: list[int]) -> int:
    return sum(h[1 + NUM_ARGS :])


def unpack_step(h: list[int], payload: torch.Tensor) -> tuple[torch.Tensor, ForwardMeta]:
    """The inverse of `pack_step` (h: the header as a list of ints). The tensors are views or copies
    of `payload`, on its device."""
    lengths = h[1 + NUM_ARGS :]
    got: dict[str, torch.Tensor] = {}
    at = 0
    for name, n in zip(FIELDS, lengths):
        t = payload[at : at + n]
        got[name] = t.long() if name in INT64_FIELDS else t
        at += n
    cascade: Optional[CascadeMeta] = None
    if h[2]:
        cascade = CascadeMeta(
            rows=got["rows"],
            group_indptr=got["group_indptr"],
            prefix_table=(got["prefix_indptr"], got["prefix_indices"], got["prefix_last"]),
            suffix_table=(got["suffix_indptr"], got["suffix_indices"], got["suffix_last"]),
            plain_rows=got["plain_rows"],
            plain_table=(got["plain_indptr"], got["plain_indices"], got["plain_last"]),
        )
    meta = ForwardMeta(
        positions=got["positions"],
        out_slots=got["out_slots"],
        qo_indptr=got["qo_indptr"],
        page_table=(got["kv_indptr"], got["kv_indices"], got["kv_last_page_len"]),
        logits_indices=got["logits_indices"],
        is_decode=bool(h[1]),
        cascade=cascade,
    )
    return got["input_ids"], meta
