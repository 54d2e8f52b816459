"""The host tier under the radix cache (SGLang's HiCache L2): room for N x the device pool's pages
in host memory, and the mover that copies pages between the tiers.

The radix tree (radix_cache.py) keeps, per node, where its pages live: on the device (`pages`),
on the host (`host`, a copy handle the mover made), or both. Device eviction writes a node back
to the host (or finds it already there) instead of dropping it; a prefix match that reaches
host-only nodes gives them fresh device pages and a load to run before the forward that reads
them (`Batch.loads`: the runner runs them first, on the forward's worker, in step order). Host
eviction is LRU over host-only leaves and drops for good.

`HostTier` does the accounting (pages in use against `capacity`) and the statistics; the copies are
the `KVMover`'s, which the engine provides (engine/kv_tier.py: `gather_kv_pages` /
`scatter_kv_pages`). Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class KVMover(Protocol):
    def to_host(self, pages: list[int]) -> Any:
        """Copy these device pages out; returns the host copy (a handle)."""

    def to_device(self, handle: Any, pages: list[int]) -> None:
        """Copy a host copy into these device pages."""

    def split(self, handle: Any, n_pages: int) -> tuple[Any, Any]:
        """The first n pages of a host copy and the rest, as two copies."""

    def free(self, handle: Any) -> None: ...


@dataclass
class TierStats:
    write_backs: int = 0  # device evictions that copied a node to the host
    write_back_pages: int = 0
    kept: int = 0  # device evictions of nodes already on the host (no copy)
    loads: int = 0  # host-only nodes brought back to the device
    load_pages: int = 0
    host_hit_tokens: int = 0  # prefix tokens admitted requests found on the host
    dropped_pages: int = 0  # host evictions (LRU) and pages dropped for want of host room


class HostTier:
    def __init__(self, capacity_pages: int, mover: KVMover, *, write_through: bool = False):
        if capacity_pages < 1:
            raise ValueError(f"the host tier needs capacity_pages >= 1, got {capacity_pages}")
        self.capacity, self.mover, self.write_through = capacity_pages, mover, write_through
        self.used = 0
        self.stats = TierStats()

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def take(self, n: int) -> None:
        if n > self.free:
            raise RuntimeError(f"host tier: {n} pages do not fit ({self.free} free)")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n
        if self.used < 0:
            raise RuntimeError("host tier: more pages given back than taken")
