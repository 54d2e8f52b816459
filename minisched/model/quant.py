"""int8 weights for the CPU (`--quantize int8`): the projections and the LM head hold int8
values with one float32 scale per group of input channels, in 16-column panels (the layout of
minisched's `int8_linear`, csrc/cpu/int8_linear.cpp); norms, the embedding lookup and the KV
cache stay float32. Each projection quantizes its input rows to int16 on the fly (one scale per
row) and sums the products in int32 with the CPU's integer dot-product instructions.

Why: single-stream CPU decode reads every weight once per token, so it is bound by memory
bandwidth; int8 reads a quarter of the bytes (SmolLM2-135M: 540 MB -> ~150 MB per token).
Prefill and large batches are bound by arithmetic, where vpdpwssd (AVX-VNNI / AVX512-VNNI) does
twice the fp32 FMA rate. It is an option, not the default: fp32 matches transformers, int8 does
not exactly (the agreement with fp32 greedy output is measured in benchmarks/RESULTS.md; 16-bit
activations keep it where weight-only int8 was, 8-bit ones would not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch import nn

from minisched import ops
from minisched.model.linear import plain
from minisched.model.llama import LlamaModel
from minisched.model.packed import PackedWeight

QUANT_MODES = ("none", "int8", "bf16")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class QuantConfig:
    mode: str = "none"
    group_size: int = 64  # input channels per scale (llama.cpp's Q8_0 uses 32; 64 halves the scale bytes)

    def __post_init__(self):
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {QUANT_MODES}, got {self.mode!r}")
        if self.group_size < 32 or self.group_size % 32:
            raise ValueError(f"quantization group_size must be a positive multiple of 32, got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


class Int8Weight(nn.Module):
    """An [N, K] weight as int8 values + float32 group scales, packed for int8_linear; `linear(x)` is
    x @ W.T in float32."""

    w_packed: torch.Tensor
    s_packed: torch.Tensor

    def __init__(self, weight: torch.Tensor, group_size: int):
        super().__init__()
        self.n, self.k = weight.shape
        w_packed, s_packed = ops.pack_int8_weight(*ops.quantize_int8(weight, group_size))
        self.register_buffer("w_packed", w_packed)
        self.register_buffer("s_packed", s_packed)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_q int8 [N, K], scales float32 [N, K // G]): the quantized weight in row order."""
        return ops.reference.unpack_int8_weight(self.w_packed, self.s_packed, self.n)

    def linear(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return ops.int8_linear(
            x, self.w_packed, self.s_packed, self.n, backend="native" if backend == "native" else "torch"
        )


def group_size_for(k: int, group_size: int) -> int:
    """The configured group size when it divides K, else one group per row (per-channel scales)."""
    return group_size if k % group_size == 0 else k


def _weight(w: torch.Tensor, cfg: QuantConfig) -> Union[PackedWeight, Int8Weight]:
    if cfg.mode == "bf16":
        return PackedWeight(w, torch.bfloat16)
    return Int8Weight(w, group_size_for(w.shape[1], cfg.group_size))


def _converted(w, cfg: QuantConfig) -> bool:
    if cfg.mode == "bf16":
        return isinstance(w, PackedWeight) and w.dtype == torch.bfloat16
    return isinstance(w, Int8Weight)


@torch.no_grad()
def quantize_model(model: LlamaModel, cfg: QuantConfig) -> LlamaModel:
    """Replace the model's projection weights and LM head by Int8Weight (`int8`) or bfloat16
    PackedWeight (`bf16`: the weights rounded to bfloat16, half the bytes of float32, activations and
    sums still float32), in place (after the weights are loaded). The fp32 embedding stays for the
    token lookup; a tied LM head gets its own copy as `model.lm_head`."""
    if not cfg.enabled:
        return model
    if model.device.type != "cpu" or model.embed.dtype != torch.float32:
        raise ValueError(
            f"--quantize {cfg.mode} runs on the CPU with a float32 model (got {model.device.type}, {model.dtype})"
        )
    for layer in model.decoder_layers:
        for name in PROJECTIONS:
            w = getattr(layer, name)
            if _converted(w, cfg):
                continue
            if isinstance(w, Int8Weight):
                raise ValueError(f"--quantize {cfg.mode}: the model's weights are int8 already")
            w, k = plain(w).float(), w.shape[1]
            if k % 32:
                raise ValueError(f"--quantize {cfg.mode}: {name} has {k} input channels, not a multiple of 32")
            q = _weight(w, cfg)
            delattr(layer, name)  # (nn.Module: a parameter or a module; the new weight may be either)
            setattr(layer, name, q)
    if _converted(model.lm_head, cfg):
        return model
    head = plain(model.embed if model.lm_head is None else model.lm_head).float()
    head_q = _weight(head, cfg)
    if isinstance(model.embed, PackedWeight):  # a packed tied model: the lookup needs its own fp32 table
        del model.embed
        model.embed = nn.Parameter(head.clone(), requires_grad=False)
    del model.lm_head
    model.lm_head = head_q  # a tied model keeps its fp32 embedding for the lookup
    return model
