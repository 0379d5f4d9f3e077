"""PagePool: a torch-free allocator of KV-cache pages with reference counts.

The KV cache is one big tensor per layer cut into ``num_pages`` pages of ``page_size`` token
slots; this module only hands out page *numbers*. A page is free when its reference count is 0.
Holders of a reference are running requests (their page tables) and the prefix cache (one ref per
cached page), so a page shared by the cache and three requests has count 4.

Page 0 is reserved and never handed out: it is the scratch page. CUDA-graph replay runs a padded
batch (fixed batch size), and the padding slots still write KV somewhere; their page tables point at
page 0 so those writes land in a page nobody reads. The torch backend uses it the same way for
padded page tables. Hence ``num_total == num_pages - 1``.
"""
from __future__ import annotations

from typing import Callable, Optional

SCRATCH_PAGE = 0


class PagePool:
    """Free list + per-page ref counts over pages ``1 .. num_pages-1`` (page 0 is scratch)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount: list[int] = [0] * num_pages
        self.refcount[SCRATCH_PAGE] = 1  # pinned forever
        # popped from the end: low page numbers first (nice for debugging, irrelevant otherwise)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        # called with the number of missing pages when alloc runs short (the prefix cache's evict)
        self.evictor: Optional[Callable[[int], int]] = None

    @property
    def num_total(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with at least one reference (requests or prefix cache)."""
        return self.num_total - len(self._free)

    def alloc(self, n: int) -> Optional[list[int]]:
        """``n`` fresh pages with ref count 1, or None if not enough even after eviction.

        On None nothing is allocated (but the prefix cache may have evicted some pages, which
        is harmless: they were unreferenced).
        """
        if n <= 0:
            return []
        short = n - len(self._free)
        if short > 0 and self.evictor is not None:
            self.evictor(short)
        if n > len(self._free):
            return None
        out = self._free[-n:][::-1]
        del self._free[-n:]
        rc = self.refcount
        for p in out:
            rc[p] = 1
        return out

    def ref(self, pages: list[int]) -> None:
        """Add one reference to each (allocated) page."""
        rc = self.refcount
        for p in pages:
            assert rc[p] > 0 and p != SCRATCH_PAGE, f"ref of free or scratch page {p}"
            rc[p] += 1

    def unref(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching 0 go back to the free list."""
        rc = self.refcount
        for p in pages:
            assert rc[p] > 0 and p != SCRATCH_PAGE, f"unref of free or scratch page {p}"
            rc[p] -= 1
            if rc[p] == 0:
                self._free.append(p)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.page_size)
