"""Copy-on-write of a forked prompt's last page (n > 1 choices, SGLang's parallel sampling).

The choices of one prompt wait for its prefill-only request (`Req.after`, the leader) and then
reuse its full pages from the radix cache. Only full pages are shared, so each choice would
recompute the prompt's partly filled last page. Instead the leader's last page is kept when it
ends (`ForkPages.keep`), each choice copies it into a page of its own (`copy_kv_pages`, run at
the start of its first forward: `Batch.copies`) and computes the prompt's last token only -- its
logits sample the first token. When the prompt fills its last page exactly, the copy comes from
the radix cache's last page instead. The kept page is freed when the last choice has copied it
or ended. Pure Python.
"""

from __future__ import annotations

from minisched.sched.kv_pool import KVPool
from minisched.sched.req import Req


class ForkPages:
    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        self.pool, self.enabled = pool, enabled  # (without the radix cache the choices share nothing to copy onto)
        self._kept: dict[int, list[int]] = {}  # id(leader) -> [page, choices that have not copied it yet]
        self.copied = 0  # pages copied instead of recomputed (statistics)

    def keep(self, leader: Req) -> None:
        """The leader ends: keep its partly filled last page for its choices (taken off its page table) when
        copying it saves at least one token."""
        left = leader.kv_len % self.pool.page_size
        if self.enabled and leader.forks and left > 1 and leader.page_ids:
            self._kept[id(leader)] = [leader.page_ids.pop(), leader.forks]

    def reclaim(self, keep: set[int] | frozenset[int] = frozenset()) -> int:
        """The pool is short: give the kept pages back (those choices recompute the page instead), but for
        `keep` (sources of copies in the batch being built: a page copied from is no copy's destination)."""
        gone = [leader for leader, k in self._kept.items() if k[0] not in keep]
        pages = [self._kept.pop(leader)[0] for leader in gone]
        self.pool.free(pages)
        return len(pages)

    def source(self, choice: Req) -> int | None:
        """The page holding the forked prompt's partial last page, for this choice's first admission."""
        if choice.after is None or choice.forked:
            return None
        kept = self._kept.get(id(choice.after))
        return None if kept is None else kept[0]

    def release(self, choice: Req) -> int | None:
        """A choice copied the page, or ended without it: one user fewer. Returns the kept page when this was
        its last user: a caller whose batch still copies from it frees it once that batch has run (a page
        copied from must not be a copy's destination in the same launch)."""
        if choice.after is None or choice.forked:
            return None
        choice.forked = True
        kept = self._kept.get(id(choice.after))
        if kept is None:  # its leader has not ended yet (or kept nothing): one choice fewer to keep a page for
            choice.after.forks -= 1
            return None
        kept[1] -= 1
        if kept[1] > 0:
            return None
        del self._kept[id(choice.after)]
        return kept[0]

    def pages(self) -> list[int]:
        return [k[0] for k in self._kept.values()]
