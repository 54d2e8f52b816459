"""The KV layout both sides of a transfer must share, and the error when they do not.

A page on the wire is `kv_cache[:, :, page]` of the pool (docs/architecture.md, "The paged KV cache"):
[num_layers, 2, page_size, num_kv_heads, head_dim] in `dtype`, contiguous. The decode side scatters
the bytes into its own pool as they are, so every one of these fields (and the model, whose weights
made the values) must be equal on both sides; the bootstrap handshake checks them before any room.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    model: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"KVLayout.model must be a non-empty string, got {self.model!r}")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        """The layout of a pool [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"a KV pool is [L, 2, num_pages, page_size, Hkv, D], got shape {tuple(kv_cache.shape)}")
        name = next((n for n, dt in DTYPES.items() if dt == kv_cache.dtype), None)
        if name is None:
            raise ValueError(f"KV pool dtype {kv_cache.dtype} is not one of {sorted(DTYPES)}")
        L, _, _, P, H, D = kv_cache.shape
        return cls(model, L, P, H, D, name)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One page of every layer, K and V: the pool's [L, 2, -, P, Hkv, D] without the page axis."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> KVLayout:
        """A peer's layout; ValueError when it is not one (a peer of another protocol or a broken one)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict) or sorted(d) != sorted(names):
            raise ValueError(f"not a KV layout: {d!r}")
        return cls(**d)

    def differences(self, other: KVLayout) -> list[tuple[str, Any, Any]]:
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


class KVLayoutMismatch(ValueError):
    """The two sides of a transfer hold different KV layouts: the message names each differing field
    with both sides' values."""

    def __init__(self, prefill: KVLayout, decode: KVLayout, prefill_addr: str):
        self.prefill, self.decode = prefill, decode
        diffs = "; ".join(f"{name} {p!r} (prefill) != {d!r} (decode)" for name, p, d in prefill.differences(decode))
        super().__init__(
            f"KV layout mismatch between the prefill worker at {prefill_addr} and the decode worker: {diffs}"
        )
