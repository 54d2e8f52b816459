"""The KV page pool: a free list over `num_pages` pages of `page_size` tokens.

The pool only hands out page indices; the K/V tensor itself
(`kv_cache[num_layers, 2, num_pages, page_size, Hkv, D]`, docs/architecture.md) belongs to the
engine. A request's page table is `Req.page_ids` (page i holds its tokens
`[i*page_size, (i+1)*page_size)`); a token's slot is `page * page_size + offset`.

- `alloc(n)` / `free(pages)`: all-or-nothing allocation; double frees raise.
- `alloc_for_extend(req, n_tokens)` / `alloc_for_decode(reqs)`: grow requests' page
  tables for their next tokens, filling the partly filled last page first. They
  return False (allocating nothing) when the free list is too short; the caller
  evicts the radix cache or retracts and retries.

Pure Python + numpy; no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minisched.base.values import cdiv
from minisched.sched.req import Req


class KVPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KVPool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low pages first
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or self._is_free[p]:
                raise RuntimeError(f"KVPool: double free or bad page {p}")
            self._is_free[p] = 1
            self._free.append(p)

    def check_partition(self, cached: list[int], held: list[int]) -> None:
        """free + cached + held pages == total, every page owned exactly once."""
        free = self._free
        assert len(free) + len(cached) + len(held) == self.num_pages, (
            f"free {len(free)} + cached {len(cached)} + held {len(held)} != total {self.num_pages}"
        )
        assert sorted(free + cached + held) == list(range(self.num_pages)), "a page is owned twice or lost"
        assert all(self._is_free[p] for p in free), "free-list flags out of sync"

    # -- request page tables --------------------------------------------------
    def pages_needed(self, req: Req, n_tokens: int) -> int:
        """Pages `req` still lacks to hold `n_tokens` more tokens after its `kv_len`."""
        return cdiv(req.kv_len + n_tokens, self.page_size) - len(req.page_ids)

    def alloc_for_extend(self, req: Req, n_tokens: int) -> bool:
        pages = self.alloc(max(0, self.pages_needed(req, n_tokens)))
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def decode_pages_needed(self, reqs: Sequence[Req]) -> int:
        ps = self.page_size
        return sum(1 for r in reqs if len(r.page_ids) * ps <= r.kv_len)

    def alloc_for_decode(self, reqs: Sequence[Req]) -> bool:
        """One more token per request; a new page only where the last page is full."""
        ps = self.page_size
        needy = [r for r in reqs if len(r.page_ids) * ps <= r.kv_len]
        pages = self.alloc(len(needy))
        if pages is None:
            return False
        for r, p in zip(needy, pages):
            r.page_ids.append(p)
        return True

    def slots(self, req: Req, start: int, end: int) -> list[int]:
        ps, pages = self.page_size, req.page_ids
        return [pages[i // ps] * ps + i % ps for i in range(start, end)]
