"""The host tier's mover: device KV pages to host memory and back, through the KV kernels.

A host copy is a contiguous buffer [L, 2, n, page_size, Hkv, D] (pinned memory on CUDA):
`gather_kv_pages` writes a node's pages into it on device eviction (write-back), and
`scatter_kv_pages` copies it into fresh device pages when a prefix match reaches it (the runner
runs these loads first in the forward's step, on its worker: a page freed under a running forward
is never written before that forward ends). On CUDA the copies are ordered on the current stream
with the forwards (not a side stream yet); on the CPU the host tier is a capacity tier.
"""

from __future__ import annotations

import time

import torch

from minisched import ops


class HostKVMover:
    def __init__(self, kv_cache: torch.Tensor, backend: str):
        self.kv_cache = kv_cache
        self.backend: ops.Backend = "native" if backend == "native" else "torch"
        self.pin = kv_cache.device.type == "cuda"
        self.bytes_per_page = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.load_seconds = 0.0
        self.write_back_seconds = 0.0

    def _pages(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int32, device=self.kv_cache.device)

    def to_host(self, pages: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        c = self.kv_cache
        out = torch.empty((*c.shape[:2], len(pages), *c.shape[3:]), dtype=c.dtype, pin_memory=self.pin)
        ops.gather_kv_pages(c, self._pages(pages), out, backend=self.backend, check=False)
        self.write_back_seconds += time.perf_counter() - t0
        return out

    def to_device(self, handle: torch.Tensor, pages: list[int]) -> None:
        t0 = time.perf_counter()
        ops.scatter_kv_pages(handle, self.kv_cache, self._pages(pages), backend=self.backend, check=False)
        self.load_seconds += time.perf_counter() - t0

    def split(self, handle: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        return handle[:, :, :n_pages].contiguous(), handle[:, :, n_pages:].contiguous()

    def free(self, handle: torch.Tensor) -> None:
        pass  # the buffer goes when its last reference does
