"""RoPE's inverse frequencies for a ModelConfig: plain (theta ** (-2i / d)), Llama-3's scaling, or a GGUF file's factors.

The arithmetic is transformers' (float32, `_compute_llama3_parameters` for "llama3"), so the cos/sin the model
takes are the reference's; a GGUF file's `rope_freqs` divides each frequency as llama.cpp does (its
converter computed the factors from the same parameters, so the two agree to float32 rounding).
"""

from __future__ import annotations

import math

import torch

from minisched.model.config import Llama3RopeScaling, ModelConfig, RopeFreqFactors


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """float32 [head_dim / 2]: the angle per position of each rotated pair."""
    d = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return base
    if isinstance(s, RopeFreqFactors):
        return base / torch.tensor(s.factors, dtype=torch.float32)
    return llama3_inv_freq(base, s)


def llama3_inv_freq(base: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, the band between interpolated (Llama-3.1)."""
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / s.factor, base)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
