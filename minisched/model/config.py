"""`ModelConfig`: the shape of a Llama-family model and its family's differences, and presets for random-weight models.

The families differ from Llama in small, named pieces, each a field here (model/families.py says which family
has which; model/llama.py computes each one):
  qkv_bias      biases on the q, k and v projections (Qwen2 / Qwen2.5)
  qk_norm       an RMSNorm over each head of q and of k before RoPE, one weight [head_dim] each (Qwen3)
  rope_scaling  Llama-3.1 / 3.2's frequency-dependent RoPE scaling (`Llama3RopeScaling`), or a GGUF file's
                `rope_freqs` factors, llama.cpp's form of the same (`RopeFreqFactors`)
and rope_theta, tied or untied embeddings, any GQA ratio and a head_dim with num_heads * head_dim !=
hidden_size (Qwen3) are plain shape fields.

The presets are the shapes of real checkpoints (used with `dummy:<preset>` weights for GPU
benchmarks; tests/model/test_families.py reads each from its checkpoint's config.json) plus `tiny`, a
two-layer model for fast CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Union


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1's `rope_scaling` {"rope_type": "llama3"}: frequencies whose wavelength exceeds
    original_max_position / low_freq_factor are divided by `factor`, those below original_max_position /
    high_freq_factor are kept, and the band between is interpolated (transformers' _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position < 1 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 RoPE scaling needs factor > 0 and high_freq_factor > low_freq_factor, got {self}")


@dataclass(frozen=True)
class RopeFreqFactors:
    """A GGUF file's `rope_freqs` tensor: llama.cpp divides RoPE frequency i by factors[i] (its converter
    writes Llama-3's scaling this way; the parameters themselves are not in the file)."""

    factors: tuple[float, ...]


RopeScaling = Union[Llama3RopeScaling, RopeFreqFactors]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"  # the family (model/families.py): HF's model_type, or a GGUF's architecture
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[RopeScaling] = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("rope_theta and rms_eps must be > 0")
        if isinstance(self.rope_scaling, RopeFreqFactors) and len(self.rope_scaling.factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freqs has {len(self.rope_scaling.factors)} factors, the model {self.head_dim // 2} frequencies"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        layer += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        return self.num_layers * layer + v * h * (1 if self.tie_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


PRESETS: dict[str, ModelConfig] = {
    # two layers, head_dim 64 (what every kernel supports), GQA 2:1 -- the CPU test model
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_position=2048,
        eos_token_id=2,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_position=8192,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama3-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_position=131072,
        bos_token_id=128000,
        eos_token_id=128009,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=False,
        max_position=131072,
        bos_token_id=128000,
        eos_token_id=128009,
    ),
    "llama2-13b": ModelConfig(
        vocab_size=32000,
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tie_embeddings=False,
        max_position=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # -- the families people run (each checked against its checkpoint's config.json in tests/model/test_families.py)
    "llama3.1-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=False,
        max_position=131072,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_position=131072,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "mistral-7b": ModelConfig(  # v0.3 (v0.2's vocabulary is 32000; v0.1 slides a 4096-token window)
        vocab_size=32768,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=1000000.0,
        rms_eps=1e-5,
        tie_embeddings=False,
        max_position=32768,
        bos_token_id=1,
        eos_token_id=2,
        architecture="mistral",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tie_embeddings=True,
        max_position=32768,
        bos_token_id=151643,
        eos_token_id=151645,
        architecture="qwen2",
        qkv_bias=True,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tie_embeddings=False,
        max_position=32768,
        bos_token_id=151643,
        eos_token_id=151645,
        architecture="qwen2",
        qkv_bias=True,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tie_embeddings=True,
        max_position=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        architecture="qwen3",
        qk_norm=True,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tie_embeddings=False,
        max_position=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        architecture="qwen3",
        qk_norm=True,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset config, optionally with some fields replaced (e.g. num_layers=4)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
