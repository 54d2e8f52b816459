"""`ModelConfig`: the shape of a Llama-family model, and presets for random-weight models.

The presets are the shapes of real checkpoints (used with `dummy:<preset>` weights for GPU
benchmarks) plus `tiny`, a two-layer model for fast CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
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
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset config, optionally with some fields replaced (e.g. num_layers=4)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
