"""Batched sampling: greedy, temperature, top-k and top-p, with a per-request random stream.

`sample(logits, params, generators)` picks one token per row of `logits` [B, V] (float32).
Rows with temperature 0 are greedy (argmax). The other rows are processed together: scale
by temperature, keep the top-k, keep the smallest set of tokens whose probability reaches
top-p, then draw by inverse CDF with one uniform number from the row's own
`torch.Generator` -- so a seeded request samples the same tokens whatever else shares its
batch (up to the floating-point noise of batched matmuls).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from minisched.sched.req import SamplingParams


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A CPU generator: seeded when the request has a seed, else from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B == len(params) ({len(params)}), got {tuple(logits.shape)}")
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = [params[i] for i in rows]
        drawn = _sample_rows(logits[idx].float(), sub, [generators[i] for i in rows])
        out = out.clone()
        out[idx] = drawn
    return out.tolist()


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits = logits / temp[:, None]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # top-k: drop everything after rank k (k = -1 keeps all)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp(max=vocab)
    ranks = torch.arange(vocab, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep a token if the mass strictly before it is < top_p (the first token always stays)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=g) if g is not None else torch.rand(()) for g in generators])
    u = u.to(dev) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=vocab - 1)
    # never land on a zeroed tail entry (u == total mass up to rounding)
    last_kept = (probs > 0).sum(-1, keepdim=True) - 1
    pick = torch.minimum(pick, last_kept)
    return order.gather(1, pick).squeeze(1)
