"""The host tier's mover: device KV pages to host memory and back, through the KV kernels.

The host pool is allocated whole when the engine starts: one buffer [L, 2, capacity, page_size, Hkv,
D] (pinned memory on CUDA), zero-filled so that its memory is resident from the start -- a server's
footprint then does not creep up by the tier's size as the tier fills (377 MB for SmolLM2's 512 pages,
read as a leak by anyone watching RSS), and a machine too small for the tier fails at start-up, not
hours later. A host copy (the radix tree's handle) is a list of the pool's slots: `gather_kv_pages`
reads a node's device pages on device eviction (write-back) and the copy lands in free slots;
`scatter_kv_pages` writes them into fresh device pages when a prefix match reaches them (the runner
runs these loads first in the forward's step, on its worker: a page freed under a running forward is
never written before that forward ends). Slots are taken and given back on the scheduler's thread
only (write-back, split, free); a load reads slots the radix tree keeps locked until it has run. On
CUDA the copies are ordered on the current stream with the forwards (not a side stream yet); on the
CPU the host tier is a capacity tier.
"""

from __future__ import annotations

import time

import torch

from minisched import ops


class HostKVMover:
    def __init__(self, kv_cache: torch.Tensor, backend: str, capacity_pages: int):
        if capacity_pages < 1:
            raise ValueError(f"the host KV pool needs capacity_pages >= 1, got {capacity_pages}")
        self.kv_cache = kv_cache
        self.backend: ops.Backend = "native" if backend == "native" else "torch"
        pin = kv_cache.device.type == "cuda"
        c = kv_cache
        self.pool = torch.zeros((*c.shape[:2], capacity_pages, *c.shape[3:]), dtype=c.dtype, pin_memory=pin)
        self.free_slots = list(range(capacity_pages - 1, -1, -1))  # popped from the end: low slots first
        self.bytes_per_page = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.load_seconds = 0.0
        self.write_back_seconds = 0.0

    def _pages(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int32, device=self.kv_cache.device)

    def to_host(self, pages: list[int]) -> list[int]:
        t0 = time.perf_counter()
        if len(pages) > len(self.free_slots):
            raise RuntimeError(f"host KV pool: {len(pages)} pages do not fit ({len(self.free_slots)} slots free)")
        slots = [self.free_slots.pop() for _ in pages]
        c = self.kv_cache
        buf = torch.empty((*c.shape[:2], len(pages), *c.shape[3:]), dtype=c.dtype, device=c.device)
        ops.gather_kv_pages(c, self._pages(pages), buf, backend=self.backend, check=False)
        self.pool[:, :, slots] = buf.to(self.pool.device)
        self.write_back_seconds += time.perf_counter() - t0
        return slots

    def to_device(self, handle: list[int], pages: list[int]) -> None:
        t0 = time.perf_counter()
        src = self.pool[:, :, handle].to(self.kv_cache.device)
        ops.scatter_kv_pages(src, self.kv_cache, self._pages(pages), backend=self.backend, check=False)
        self.load_seconds += time.perf_counter() - t0

    def split(self, handle: list[int], n_pages: int) -> tuple[list[int], list[int]]:
        return handle[:n_pages], handle[n_pages:]

    def free(self, handle: list[int]) -> None:
        self.free_slots.extend(handle)
