"""The projections' and the LM head's weights on the CPU (`--quantize`): none (float32, packed:
model/packed.py), gguf, int8 or bf16; norms, the embedding lookup and the KV cache stay float32. The
default, `auto`, is resolved in one place, engine/options.py `pick_quantize`: gguf for a float32 model
the engine loads from a GGUF file whose projections are block-quantized (the bundled SmolLM2's Q4_1),
on the CPU with the native kernels and no tensor parallelism -- where it loses nothing --, else none.

`--quantize gguf` keeps a GGUF model's own block-quantized tensors (Q4_0, Q4_1, Q8_0) in their
blocks, repacked for minisched's `gguf_linear` (csrc/cpu/gguf_linear.cpp), which dequantizes them to
float32 in registers: the float32 model (which is that file dequantized) computed from the file's
bytes -- SmolLM2's Q4_1 projections and Q8_0 head read ~96 MB per token instead of 540 MB -- with the
same bits (every output the same FMA chain as packed_linear's), so greedy output is the fp32 path's.
Tensors in other formats, and a fused projection whose parts differ in format, stay float32
(packed). It needs the model's GGUF file (`weights.gguf_blocks`): a model object only with its file named
(EngineConfig.model), else a ValueError at construction (engine/options.py pick_quantize). Measured
(benchmarks/RESULTS.md): one stream decodes 1.7-2.4x and batches of 8-64 1.1-1.5x faster than fp32;
the 512-token prefill, where each call dequantizes panels before packed_linear's kernel, is level
(quiet medians 1.01x and 1.27x, 0.94x under load). `--quantize none` keeps the float32 weights (5.6x
the weight bytes).

int8 (`--quantize int8`): the projections and the LM head hold int8 values with one float32 scale
per group of input channels, in 16-column panels (the layout of minisched's `int8_linear`,
csrc/cpu/int8_linear.cpp). Each projection quantizes its input rows to int16 on the fly (one scale
per row) and sums the products in int32 with the CPU's integer dot-product instructions.

Why: single-stream CPU decode reads every weight once per token, so it is bound by memory
bandwidth; int8 reads a quarter of the bytes (SmolLM2-135M: 540 MB -> ~150 MB per token).
Prefill and large batches are bound by arithmetic, where vpdpwssd (AVX-VNNI / AVX512-VNNI) does
twice the fp32 FMA rate, and on AMX machines from 32 rows on int8 tile dot products do more (the
same bits: csrc/cpu/int8_linear_amx.cpp). It is an option, not the default: fp32 (and gguf, which
computes its bits) matches transformers, int8 does not exactly (the agreement with fp32 greedy
output is measured in benchmarks/RESULTS.md; 16-bit activations keep it where weight-only int8 was,
8-bit ones would not). bf16 (`--quantize bf16`, an option too) rounds the weights to bfloat16 (quantize_model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from minisched import ops
from minisched.model.linear import plain
from minisched.model.llama import LlamaModel
from minisched.model.packed import PackedWeight

QUANT_MODES = ("none", "int8", "bf16", "gguf")  # the resolved modes: EngineConfig's "auto" is pick_quantize's
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


class GGUFWeight(nn.Module):
    """An [N, K] weight kept in GGUF blocks (qtype: GGML's type id, ops.GGUF_QTYPES), packed for
    gguf_linear; `linear(x)` is x @ W.T in float32 on the weight dequantized as gguf does."""

    w_packed: torch.Tensor

    def __init__(self, blocks: torch.Tensor, qtype: int, k: int):
        super().__init__()
        self.n, self.k, self.qtype = blocks.shape[0], k, qtype
        self.register_buffer("w_packed", ops.pack_gguf_weight(blocks, qtype))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def unpacked(self) -> torch.Tensor:
        """The float32 [N, K] weight the blocks hold (gguf's dequantization)."""
        blocks = ops.reference.unpack_gguf_weight(self.w_packed, self.qtype, self.n)
        return ops.reference.dequantize_gguf(blocks, self.qtype)

    def linear(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return ops.gguf_linear(
            x, self.w_packed, self.qtype, self.n, backend="native" if backend == "native" else "torch"
        )


# The HF names of each fused projection's parts, in the order LlamaModel.load_hf_state_dict concatenates them.
_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def _gguf_weight(blocks: dict[str, tuple[int, torch.Tensor]], names: list[str], shape: torch.Size):
    """The GGUFWeight of the parts `names` concatenated (rows), or None when one is not in blocks or
    their formats differ (the projection stays float32)."""
    found = [blocks[n] for n in names if n in blocks]
    if len(found) != len(names) or len({qtype for qtype, _ in found}) != 1:
        return None
    qtype = found[0][0]
    rows = torch.cat([b for _, b in found])
    size = ops.reference.GGUF_BLOCK_BYTES[qtype]
    if rows.shape != (shape[0], shape[1] // ops.reference.GGUF_BLOCK * size) or shape[1] % ops.reference.GGUF_BLOCK:
        raise ValueError(
            f"--quantize gguf: the blocks of {names} have shape {tuple(rows.shape)}, which does not hold the "
            f"model's {tuple(shape)} weight (a model other than the file?)"
        )
    return GGUFWeight(rows, qtype, shape[1])


@torch.no_grad()
def keep_gguf_blocks(model: LlamaModel, blocks: dict[str, tuple[int, torch.Tensor]]) -> LlamaModel:
    """`--quantize gguf`: replace the projections and the LM head whose tensors the file holds in a
    block format (weights.gguf_blocks) by GGUFWeight, in place; the rest stays as it is (float32, packed
    later). A tied model keeps its float32 embedding for the lookup, the head runs on the blocks."""
    for idx, layer in enumerate(model.decoder_layers):
        for name, parts in _PARTS.items():
            w = getattr(layer, name)
            if isinstance(w, GGUFWeight):
                continue
            q = _gguf_weight(blocks, [f"model.layers.{idx}.{p}.weight" for p in parts], w.shape)
            if q is not None:
                delattr(layer, name)
                setattr(layer, name, q)
    if isinstance(model.lm_head, GGUFWeight):
        return model
    tied = model.lm_head is None
    head_shape = model.embed.shape if tied else model.lm_head.shape  # type: ignore[union-attr]
    q = _gguf_weight(blocks, ["model.embed_tokens.weight" if tied else "lm_head.weight"], head_shape)
    if q is not None:
        if isinstance(model.embed, PackedWeight):  # a packed tied model: the lookup needs its own fp32 table
            table = plain(model.embed).clone()
            del model.embed
            model.embed = nn.Parameter(table, requires_grad=False)
        del model.lm_head
        model.lm_head = q
    return model


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
def quantize_model(
    model: LlamaModel, cfg: QuantConfig, blocks: Optional[dict[str, tuple[int, torch.Tensor]]] = None
) -> LlamaModel:
    """Replace the model's projection weights and LM head by Int8Weight (`int8`) or bfloat16
    PackedWeight (`bf16`: the weights rounded to bfloat16, half the bytes of float32, activations and
    sums still float32; on AMX machines 16 rows and more sum in tile order, not the FMA chain's, so a
    row's last bits there can depend on its batch: csrc/cpu/packed_linear_amx.cpp), in place (after the weights are loaded). The fp32 embedding stays for the
    token lookup; a tied LM head gets its own copy as `model.lm_head`."""
    if not cfg.enabled:
        return model
    if model.device.type != "cpu" or model.embed.dtype != torch.float32:
        raise ValueError(
            f"--quantize {cfg.mode} runs on the CPU with a float32 model (got {model.device.type}, {model.dtype})"
        )
    if cfg.mode == "gguf":
        if blocks is None:
            raise ValueError("--quantize gguf needs the model's GGUF blocks (weights.gguf_blocks of its file)")
        return keep_gguf_blocks(model, blocks)
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
