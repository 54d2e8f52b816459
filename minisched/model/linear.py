"""The projections' one entry point: `linear(x, w)` for every weight kind the model holds.

A weight is a float tensor [N, K] (torch's F.linear), or a module with `linear(x, backend)`:
`PackedWeight` (packed.py, the CPU float32 default) or `Int8Weight` (quant.py, `--quantize int8`).
A new weight kind implements `linear`, `shape` and, for the tied embedding, `rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisched.model.packed import PackedWeight


def linear(x: torch.Tensor, w, backend: str = "native") -> torch.Tensor:
    """x @ W.T in the weight's own kernel (a module with `linear`), or F.linear for a plain tensor."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x, backend)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """The embedding lookup, from a plain [V, H] weight or a tied model's packed head."""
    if isinstance(w, PackedWeight):
        return w.rows(ids)
    return F.embedding(ids.long(), w)


def plain(w) -> torch.Tensor:
    """The [N, K] float weight behind w (a packed one unpacked)."""
    return w.unpacked() if isinstance(w, PackedWeight) else w
