"""Packed float32 weights for the CPU (the default there; `--no-pack-weights` turns it off): the
projections and the LM head are stored in panels of 16 output columns, the layout of minisched's
`packed_linear` kernel (csrc/cpu/packed_linear.cpp), instead of running through ATen's sgemm.

Why: a decode step multiplies a few activation rows by wide, short weights, which ATen's sgemm runs
at a fraction of the FMA peak; the packed kernel runs them 1.2-3.5x faster (benchmarks/RESULTS.md,
"Packed fp32 linear"). The values are the same float32 weights; only the order of the additions
differs from ATen's, so outputs agree with the unpacked model to float32 rounding.

A tied model keeps one copy: the embedding lookup reads its rows out of the packed LM head.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
from torch import nn

from minisched import ops

PROJECTIONS = ("qkv", "o", "gate_up", "down")


class PackedWeight(nn.Module):
    """An [N, K] weight packed as [ceil(N / 16), K, 16], float32 or (`dtype=torch.bfloat16`, `--quantize
    bf16`) bfloat16; `linear(x)` is x @ W.T with float32 activations and sums."""

    w_packed: torch.Tensor

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.n, self.k = weight.shape
        self.register_buffer("w_packed", ops.pack_linear_weight(weight.to(dtype)))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def dtype(self) -> torch.dtype:
        return self.w_packed.dtype

    @property
    def device(self) -> torch.device:
        return self.w_packed.device

    def linear(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return ops.packed_linear(x, self.w_packed, self.n, backend="native" if backend == "native" else "torch")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] ([T, K]): the embedding lookup of a tied model, gathered from the panels."""
        ids = ids.long()
        return self.w_packed[ids // 16, :, ids % 16].float()

    def unpacked(self) -> torch.Tensor:
        return ops.reference.unpack_linear_weight(self.w_packed, self.n)


def want_packed(
    pack_weights: Optional[bool],
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    quantized: bool,
    tensor_parallel: bool,
) -> bool:
    """None: packed on the CPU for a float32 model with the native kernels, unless its projections were
    converted (`quantized`: --quantize int8 or bf16) or tensor parallel (the ranks shard plain weights); True
    where that cannot be is an error."""
    if pack_weights is not None and not isinstance(pack_weights, bool):
        raise ValueError(f"pack_weights must be True, False or None (the device's default), got {pack_weights!r}")
    why = (
        "the projections are quantized (--quantize int8 / bf16)"
        if quantized
        else "tensor-parallel ranks shard plain weights"
        if tensor_parallel
        else f"the device is {device}"
        if device.type != "cpu"
        else f"the model is {dtype}, not float32"
        if dtype != torch.float32
        else f"the backend is {backend!r}"
        if backend != "native"
        else ""
    )
    if pack_weights and why:
        raise ValueError(f"pack_weights=True needs a float32 model on the CPU with the native kernels: {why}")
    return not why if pack_weights is None else pack_weights


def layers_of(model: nn.Module) -> Iterator[nn.Module]:
    """A LlamaModel's decoder layers (typed as plain modules: model/llama.py imports this file)."""
    return model.get_submodule("layers").children()


@torch.no_grad()
def pack_model(model: nn.Module) -> nn.Module:
    """Replace the model's float projection weights and LM head by PackedWeight, in place (weights
    already packed or int8 stay as they are). A tied model's embedding becomes the same PackedWeight
    (one copy, looked up by `rows`)."""
    for layer in layers_of(model):
        for name in PROJECTIONS:
            w = getattr(layer, name)
            if not isinstance(w, torch.Tensor):
                continue
            packed = PackedWeight(w)
            delattr(layer, name)  # (nn.Module: out of its parameters, so a module may take the name)
            setattr(layer, name, packed)
    if not isinstance(model.lm_head, (torch.Tensor, type(None))):
        return model
    if model.lm_head is None:  # tied: the head is the embedding
        packed = PackedWeight(model.embed)
        del model.embed
        model.embed = packed
    else:
        packed = PackedWeight(model.lm_head)
        del model.lm_head
    model.lm_head = packed
    return model
