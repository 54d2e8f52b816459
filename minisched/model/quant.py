"""The projections' and the LM head's weights on the CPU (`--quantize`): none (float32, packed:
model/packed.py), gguf, gguf-a8, int8 or bf16; norms, the embedding lookup and the KV cache stay float32. The
default, `auto`, is resolved in one place, engine/options.py `pick_quantize`: gguf for a float32 model
the engine loads from a GGUF file whose projections are block-quantized (the bundled SmolLM2's Q4_1),
on the CPU with the native kernels and no tensor parallelism -- where it loses nothing --, else none
(never gguf-a8, below).

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

`--quantize gguf-a8` keeps the same blocks (the same projections, the same `weights.gguf_blocks`) in
the layout of `gguf_a8_linear` (csrc/cpu/gguf_a8_linear.cpp), which rounds each block of 32 input
channels of the activations to 8 bits (one float32 scale, max |x| / 127) and sums their products with
the weights' quants in int32 (VNNI's vpdpbusd): llama.cpp's Q8 trade. The weights are still the file's, but the
activations are not fp32's, so the logits are close to the float32 model's, not its bits, and greedy
output can differ where two tokens nearly tie (the speed and the agreement are measured in
benchmarks/RESULTS.md). It is opt-in only: `auto` never picks it, because auto loses nothing against
fp32 and this does.

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

# the resolved modes (EngineConfig's choices, with "auto", which engine/options.py pick_quantize resolves)
QUANT_MODES = ("none", "int8", "bf16", "gguf", "gguf-a8")
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

    @property
    def keeps_gguf_blocks(self) -> bool:
        """gguf and gguf-a8: the file's blocks kept (keep_gguf_blocks), not the float32 weights converted;
        they need the model's GGUF file, and the file's float tensors are packed as fp32's are."""
        return self.mode in ("gguf", "gguf-a8")


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
    """An [N, K] weight kept in GGUF blocks (qtype: GGML's type id, ops.GGUF_QTYPES); `linear(x)` is
    x @ W.T in float32 on the weight dequantized as gguf does. `a8`, fixed when it is built, picks the op
    and so the packing: False (`--quantize gguf`) gguf_linear, float32 activations, the fp32 path's
    bits; True (`--quantize gguf-a8`) gguf_a8_linear, activations rounded to 8 bits per 32 channels."""

    w_packed: torch.Tensor

    def __init__(self, blocks: torch.Tensor, qtype: int, k: int, a8: bool = False):
        super().__init__()
        self.n, self.k, self.qtype, self.a8 = blocks.shape[0], k, qtype, a8
        pack = ops.pack_gguf_a8_weight if a8 else ops.pack_gguf_weight
        self.register_buffer("w_packed", pack(blocks, qtype))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def mode(self) -> str:
        """The --quantize mode that runs this weight."""
        return _gguf_mode(self.a8)

    def blocks(self) -> torch.Tensor:
        """The GGUF blocks, uint8 [N, K / 32 * block bytes], as weights.gguf_blocks gave them."""
        unpack = ops.reference.unpack_gguf_a8_weight if self.a8 else ops.reference.unpack_gguf_weight
        return unpack(self.w_packed, self.qtype, self.n)

    def unpacked(self) -> torch.Tensor:
        """The float32 [N, K] weight the blocks hold (gguf's dequantization), whichever the layout."""
        return ops.reference.dequantize_gguf(self.blocks(), self.qtype)

    def linear(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        op = ops.gguf_a8_linear if self.a8 else ops.gguf_linear
        return op(x, self.w_packed, self.qtype, self.n, backend="native" if backend == "native" else "torch")


# The HF names of each fused projection's parts, in the order LlamaModel.load_hf_state_dict concatenates them.
_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def _gguf_weight(blocks: dict[str, tuple[int, torch.Tensor]], names: list[str], shape: torch.Size, a8: bool):
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
            f"--quantize {_gguf_mode(a8)}: the blocks of {names} have shape {tuple(rows.shape)}, "
            f"which does not hold the model's {tuple(shape)} weight (a model other than the file?)"
        )
    return GGUFWeight(rows, qtype, shape[1], a8)


def _gguf_mode(a8: bool) -> str:
    return "gguf-a8" if a8 else "gguf"


def _kept(w, a8: bool) -> bool:
    """w is a GGUFWeight of this layout already (a model converted before: left as it is). One of the
    other layout is an error, not repacked: the model is converted in place, and an engine built on it
    before would run the new layout while its config names the old one."""
    if not isinstance(w, GGUFWeight):
        return False
    if w.a8 != a8:
        raise ValueError(
            f"--quantize {_gguf_mode(a8)}: the model's weights are --quantize {w.mode}'s blocks already (a model "
            f"is converted once, in place); load the model again for --quantize {_gguf_mode(a8)}"
        )
    return True


@torch.no_grad()
def keep_gguf_blocks(model: LlamaModel, blocks: dict[str, tuple[int, torch.Tensor]], a8: bool = False) -> LlamaModel:
    """`--quantize gguf` (gguf-a8 with `a8`): replace the projections and the LM head whose tensors the file
    holds in a block format (weights.gguf_blocks) by GGUFWeight, in place; the rest stays as it is (float32,
    packed later). A tied model keeps its float32 embedding for the lookup, the head runs on the blocks."""
    for idx, layer in enumerate(model.decoder_layers):
        for name, parts in _PARTS.items():
            w = getattr(layer, name)
            if _kept(w, a8):
                continue
            q = _gguf_weight(blocks, [f"model.layers.{idx}.{p}.weight" for p in parts], w.shape, a8)
            if q is not None:
                delattr(layer, name)
                setattr(layer, name, q)
    if _kept(model.lm_head, a8):
        return model
    tied = model.lm_head is None
    head_shape = model.embed.shape if tied else model.lm_head.shape  # type: ignore[union-attr]
    q = _gguf_weight(blocks, ["model.embed_tokens.weight" if tied else "lm_head.weight"], head_shape, a8)
    if q is not None:
        if isinstance(model.embed, PackedWeight):  # a packed tied model: the lookup needs its own fp32 table
            table = plain(model.embed).clone()
            del model.embed
            model.embed = nn.Parameter(table, requires_grad=False)
        del model.lm_head
        model.lm_head = q
    return model


def held_mode(model: LlamaModel) -> str:
    """The --quantize mode the model's projections and LM head are in now (quantize_model converts them in
    place, so a model object an engine was built on keeps its mode): "none" for float32 weights."""
    for w in [getattr(layer, n) for layer in model.decoder_layers for n in PROJECTIONS] + [model.lm_head]:
        if isinstance(w, GGUFWeight):
            return w.mode
        if isinstance(w, Int8Weight):
            return "int8"
        if isinstance(w, PackedWeight) and w.dtype == torch.bfloat16:
            return "bf16"
    return "none"


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
    token lookup; a tied LM head gets its own copy as `model.lm_head`. gguf and gguf-a8 keep the file's
    `blocks` instead (keep_gguf_blocks)."""
    if not cfg.enabled:
        return model
    if model.device.type != "cpu" or model.embed.dtype != torch.float32:
        raise ValueError(
            f"--quantize {cfg.mode} runs on the CPU with a float32 model (got {model.device.type}, {model.dtype})"
        )
    if cfg.keeps_gguf_blocks:
        if blocks is None:
            raise ValueError(f"--quantize {cfg.mode} needs the model's GGUF blocks (weights.gguf_blocks of its file)")
        return keep_gguf_blocks(model, blocks, a8=cfg.mode == "gguf-a8")
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
