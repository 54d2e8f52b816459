"""The AMX kernels' index math and arithmetic in torch (csrc/cpu/amx_tiles.h, int8_linear_amx.cpp,
packed_linear_amx.cpp), for machines without AMX: the relayout of a panel into B-tile rows, the split
of the activations, and the tile dot products as Intel defines them (tdpbssd / tdpbusd: C[m, j] +=
sum_i A[m, 4 r + i] B[r, 4 j + i] over the bytes of a row r; tdpbf16ps the same over bf16 pairs)."""

from __future__ import annotations

import torch

# amx_tiles.h: B-tile row unit 2 j = unit j of the first 32 bytes, 2 j + 1 = unit j of the second.
INTERLEAVE = [u for j in range(16) for u in (j, 16 + j)]


def interleave_units(rows64: torch.Tensor) -> torch.Tensor:
    """[R, 32] 16-bit units (two 32-byte rows each) -> [R, 32], the units interleaved."""
    return rows64[:, INTERLEAVE]


def int8_b_tiles(panel: torch.Tensor) -> torch.Tensor:
    """One int8_linear panel [K / 2, 32] int8 (pack_int8_weight's) -> B-tile rows [K / 4, 64] int8:
    row r holds column j's channels 4 r .. 4 r + 3 at bytes 4 j .. 4 j + 3."""
    pairs = panel.contiguous().view(torch.int16).reshape(-1, 32)  # [K / 4, 32] units of 2 bytes
    return interleave_units(pairs).contiguous().view(torch.int8).reshape(-1, 64)


def bf16_b_tiles(panel: torch.Tensor) -> torch.Tensor:
    """One bf16 panel [K, 16] (pack_linear_weight's) -> B-tile rows [K / 2, 32] bf16: row r holds
    column j's channels 2 r, 2 r + 1 at units 2 j, 2 j + 1."""
    return interleave_units(panel.contiguous().view(torch.int16).reshape(-1, 32)).view(torch.bfloat16)


def int8_split(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 activations -> (hi = q >> 8 as int8, lo = q & 255 as uint8), q = 256 hi + lo."""
    q = q.to(torch.int32)
    return (q >> 8).to(torch.int8), (q & 255).to(torch.uint8)


def bf16_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 -> three bf16 terms, hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid)."""
    hi = x.bfloat16()
    r = x - hi.float()
    mid = r.bfloat16()
    return hi, mid, (r - mid.float()).bfloat16()


def tile_dot_bytes(a: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """tdpb*d on whole K: A [M, K] bytes (int8 or uint8), B-tile rows [K / 4, 64] int8 -> int64 [M, 16]
    sums, C[m, j] = sum_r sum_i A[m, 4 r + i] B[r, 4 j + i]."""
    m, k = a.shape
    b = b_rows.to(torch.int64).view(k // 4, 16, 4)  # [r, j, i]
    return torch.einsum("mri,rji->mj", a.to(torch.int64).view(m, k // 4, 4), b)


def tile_dot_bf16(a: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """tdpbf16ps on whole K, in float64 (the products are exact): A [M, K] bf16, B-tile rows [K / 2, 32]
    bf16 -> [M, 16], C[m, j] = sum_r sum_i A[m, 2 r + i] B[r, 2 j + i]."""
    m, k = a.shape
    b = b_rows.double().view(k // 2, 16, 2)
    return torch.einsum("mri,rji->mj", a.double().view(m, k // 2, 2), b)
