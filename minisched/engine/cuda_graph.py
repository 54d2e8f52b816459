"""CUDA graphs for decode: capture the decode forward once per batch-size bucket, replay it per step.

On a GPU a decode step of a small model is ~30 layers x ~10 kernels, each launched from Python
(10-20 us of host work per op): more than the 50-400 us the kernels take. A captured graph
replays all of them with one launch. What capture needs, and how it is met here:

- Static shapes and addresses. One set of input buffers sized for the largest bucket (input ids,
  positions, KV slots, the CSR page table with `max_pages` pages per request, last-page lengths)
  and, per bucket B, views of their first B rows; the page-table index buffer of bucket B holds
  `B * max_pages` entries. A batch of b <= B requests is padded to B (`pad_decode`): the dummy
  rows read and write one reserved scratch page (one token of KV, position 0, token 0), so they
  never touch a real request's pages, and their logits are dropped.
- No host work that depends on values. The decode launch paths were read for it: the CUDA op
  sizes its split-KV from shapes only (`nnz * page_size / batch` with nnz the index buffer's
  length -- the bucket's capacity, so the split count is fixed per bucket: correct for any
  length, tuned for `max_pages`), its workspace comes from torch's caching allocator (a graph
  keeps its own pool); Triton's split count is the same shape formula; neither reads an index
  value on the host. The Python input checks that do (`check=True`: `.item()`, `.tolist()`)
  are off under graphs, and the Engine refuses `check=True` with `cuda_graph=True`.
- No first-call work inside the capture (Triton JIT, cudaFuncSetAttribute, the occupancy
  query): every bucket runs once eagerly before it is captured.
- Cascade decode is not captured: its groups change every step. A decode step whose batch has
  cascade groups runs eagerly; every other decode step whose batch fits a bucket replays.

Prefill and mixed steps always run eagerly. `pad_decode` and `buckets_for` are pure and tested
on the CPU (padded rows do not change the real rows' outputs, on the torch and C++ backends);
capture and replay need a GPU (tests/engine/test_cuda_graph.py, skipped without one).
"""

from __future__ import annotations

import bisect
from typing import Any, Optional

import torch

from minisched.base.values import cdiv
from minisched.model.llama import ForwardMeta, LlamaModel


def buckets_for(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to `max_batch` (SGLang's
    spacing: padding wastes at most 7 rows past 8), and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def pick_bucket(buckets: list[int], batch: int) -> Optional[int]:
    """The smallest bucket that holds `batch` rows, or None."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


def pad_decode(
    input_ids: torch.Tensor, meta: ForwardMeta, bucket: int, scratch_page: int, page_size: int
) -> tuple[torch.Tensor, ForwardMeta]:
    """A decode batch of b rows padded to `bucket` rows: row b.. reads one token of KV in
    `scratch_page` and writes its K/V there (position 0, token 0). Same devices and dtypes;
    the real rows' inputs are unchanged, so are their outputs (the ops are per row)."""
    b = input_ids.shape[0]
    pad = bucket - b
    if pad < 0:
        raise ValueError(f"a batch of {b} rows does not fit bucket {bucket}")
    indptr, indices, last = meta.page_table

    def cat(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad,), value)]) if pad else t

    tail = torch.arange(1, pad + 1, dtype=indptr.dtype, device=indptr.device) + indptr[-1]
    padded = ForwardMeta(
        positions=cat(meta.positions, 0),
        out_slots=cat(meta.out_slots, scratch_page * page_size),
        qo_indptr=torch.arange(bucket + 1, dtype=meta.qo_indptr.dtype, device=meta.qo_indptr.device),
        page_table=(torch.cat([indptr, tail]), cat(indices, scratch_page), cat(last, 1)),
        logits_indices=torch.arange(bucket, dtype=meta.logits_indices.dtype, device=meta.logits_indices.device),
        is_decode=True,
    )
    return cat(input_ids, 0), padded


class CudaGraphRunner:
    """Captured decode forwards, one per bucket; `run` replays the one that fits, or returns None."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        page_size: int,
        *,
        max_batch: int,
        max_context_len: int,
        scratch_page: int,
        backend: str,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {kv_cache.device}")
        self.model, self.kv_cache, self.page_size, self.backend = model, kv_cache, page_size, backend
        self.scratch_page = scratch_page
        self.buckets = buckets_for(max_batch)
        self.max_pages = cdiv(max_context_len, page_size)
        dev, n = kv_cache.device, self.buckets[-1]
        i32 = torch.int32
        self.ids = torch.zeros(n, dtype=i32, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), scratch_page * page_size, dtype=i32, device=dev)
        self.indptr = torch.arange(n + 1, dtype=i32, device=dev)  # (until a replay fills it: one scratch page per row)
        self.indices = torch.full((n * self.max_pages,), scratch_page, dtype=i32, device=dev)
        self.last = torch.ones(n, dtype=i32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the largest graph's memory pool (torch's opaque handle), shared by the others
        self.num_replays = 0

    def _meta(self, bucket: int) -> ForwardMeta:
        dev = self.ids.device
        return ForwardMeta(
            positions=self.positions[:bucket],
            out_slots=self.slots[:bucket],
            qo_indptr=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
            page_table=(self.indptr[: bucket + 1], self.indices[: bucket * self.max_pages], self.last[:bucket]),
            logits_indices=torch.arange(bucket, dtype=torch.int64, device=dev),
            is_decode=True,
        )

    def _forward(self, bucket: int, meta: ForwardMeta) -> torch.Tensor:
        return self.model(self.ids[:bucket], meta, self.kv_cache, backend=self.backend, check=False)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all in one memory pool (the smaller graphs reuse its blocks)."""
        stream = torch.cuda.Stream(self.kv_cache.device)
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # eager warm-up: JIT compiles and first-call setup happen here
                self._forward(bucket, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bucket] = self._forward(bucket, meta)
            self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.kv_cache.device)

    def fits(self, meta: ForwardMeta, batch: int) -> Optional[int]:
        """The bucket for this step, or None (not a plain decode step, or too large)."""
        if not meta.is_decode or meta.cascade is not None:
            return None
        return pick_bucket(self.buckets, batch)

    def run(self, input_ids: torch.Tensor, meta: ForwardMeta) -> Optional[torch.Tensor]:
        """Logits [b, vocab] of a decode step by graph replay; None when no graph fits (run eagerly).
        A request longer than `max_pages` pages cannot happen: the scheduler's max_context_len bounds it."""
        b = input_ids.shape[0]
        bucket = self.fits(meta, b)
        if (
            bucket is None
            or bucket not in self.graphs
            or meta.page_table[1].shape[0] + bucket - b > bucket * self.max_pages
        ):
            return None
        ids, padded = pad_decode(input_ids, meta, bucket, self.scratch_page, self.page_size)
        indptr, indices, last = padded.page_table
        self.ids[:bucket].copy_(ids)
        self.positions[:bucket].copy_(padded.positions)
        self.slots[:bucket].copy_(padded.out_slots)
        self.indptr[: bucket + 1].copy_(indptr)
        self.indices[: indices.shape[0]].copy_(indices)
        self.last[:bucket].copy_(last)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:b]
