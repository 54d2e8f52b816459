"""The projections' one entry point: `linear(x, w)` for every weight kind the model holds.

A weight is a float tensor [N, K] (torch's F.linear), or a module with `linear(x, backend)`:
`PackedWeight` (packed.py: float32 on the CPU, or `--quantize bf16`), `Int8Weight` (quant.py, `--quantize int8`) or
`GGUFWeight` (quant.py, `--quantize gguf`: the CPU default for a block-quantized GGUF file, or `gguf-a8`).
A new weight kind implements `linear`, `shape` and, for the tied embedding, `rows`.
"""

from __future__ import annotations

from typing import Protocol, Union

import torch
import torch.nn.functional as F

from minisched.model.packed import PackedWeight


class WeightModule(Protocol):
    """A weight that runs its own kernel (PackedWeight, Int8Weight, GGUFWeight)."""

    @property
    def shape(self) -> torch.Size: ...

    def linear(self, x: torch.Tensor, backend: str) -> torch.Tensor: ...


Weight = Union[torch.Tensor, WeightModule]


def linear(x: torch.Tensor, w: Weight, backend: str = "native") -> torch.Tensor:
    """x @ W.T in the weight's own kernel (a module with `linear`), or F.linear for a plain tensor."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x, backend)


def embedding(ids: torch.Tensor, w: Weight) -> torch.Tensor:
    """The embedding lookup, from a plain [V, H] weight or a tied model's packed head."""
    if isinstance(w, PackedWeight):
        return w.rows(ids)
    return F.embedding(ids.long(), plain(w))


def plain(w: Weight) -> torch.Tensor:
    """The [N, K] float weight behind w (a packed one unpacked); an int8 weight has none (TypeError)."""
    if isinstance(w, PackedWeight):
        return w.unpacked()
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"a {type(w).__name__} has no plain float weight")
    return w


def as_tensor(w: Weight) -> torch.Tensor:
    """w itself, a plain tensor weight: checkpoints are loaded and sharded before weights are packed or
    quantized (TypeError after)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a plain tensor weight, got a {type(w).__name__} (packed or quantized)")
    return w
