"""The model tests' shared pieces: the backends a forward runs on here, and a paged forward over a ragged batch."""

from __future__ import annotations

import numpy as np
import torch

from minisched import ops
from minisched.base.page_table import build_csr, slots_of
from minisched.model.llama import ForwardMeta

BACKENDS = ["torch"] + (["native"] if ops.native_available() else [])


def paged_logits(model, seqs, cached, page_size, backend):
    """Prefill seqs[b][:cached[b]] first, then the rest of every sequence as one ragged batch;
    returns the second pass's logits for every new token."""
    kv = model.new_kv_cache(sum(-(-len(s) // page_size) for s in seqs) + 2, page_size)
    perm = np.random.default_rng(0).permutation(kv.shape[2]).tolist()
    pages, at = [], 0
    for s in seqs:
        n = -(-len(s) // page_size)
        pages.append(perm[at : at + n])
        at += n

    def run(batch, starts, ends):
        ids = torch.tensor([t for b, a, e in zip(batch, starts, ends) for t in seqs[b][a:e]])
        qo = np.concatenate([[0], np.cumsum([e - a for a, e in zip(starts, ends)])]).astype(np.int32)
        meta = ForwardMeta(
            positions=torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)]),
            out_slots=torch.from_numpy(
                np.concatenate([slots_of(pages[b], a, e, page_size) for b, a, e in zip(batch, starts, ends)])
            ),
            qo_indptr=torch.from_numpy(qo),
            page_table=tuple(torch.from_numpy(a) for a in build_csr([pages[b] for b in batch], ends, page_size)),
            logits_indices=torch.arange(int(qo[-1])),
        )
        return model(ids, meta, kv, backend=backend)

    first = [b for b, c in enumerate(cached) if c > 0]
    if first:
        run(first, [0] * len(first), [cached[b] for b in first])
    return run(list(range(len(seqs))), cached, [len(s) for s in seqs])
