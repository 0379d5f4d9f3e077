"""PrefixCache: a radix tree over token ids at page granularity, sharing KV pages between requests.

Each edge is exactly one full page of token ids (``page_size`` ids) and each node owns the KV page
holding them, so a path from the root spells a token prefix whose KV is already computed. Only
full pages are cached: a partly filled page is still being written by its request.

Reference counting (see pages.PagePool): the cache holds one ref on every page it stores; a request
that matched a prefix holds its own ref on those pages. A node is therefore *evictable* when its
page's count is 1 (only the cache holds it). Requests always hold a whole root path (matched
prefix + their own pages, duplicates swapped for the cached copy by ``insert_request``), so an ancestor
of an in-use node is in use too, and every count-1 node can be reached by evicting leaves.

Policies:
- ``match`` returns the longest cached full-page prefix and touches its nodes' LRU time.
- ``insert`` adds a request's full pages; for a page already cached under the same tokens the
  cached page wins and the request's copy stays the request's to free (the returned path tells
  the caller which page the tree holds at each index).
- ``evict(n)`` frees least-recently-used evictable leaves (a parent may follow its last child);
  the pool's allocations evict in batches (``evict_for_alloc``).
- ``flush()`` drops every evictable node and reports whether the cache is now empty.
- ``disabled=True`` (``disable_radix_cache``): match finds nothing, insert stores nothing.

Namespaces: KV computed under a LoRA adapter differs from the base model's, so each adapter id
(``Request.lora_id``; ``ns``) has a tree root of its own; None is the base model's. A prefix computed
under adapter A is never served to B or to the base model.
"""
from __future__ import annotations

import heapq
from typing import Optional

from nbgen.runtime.pages import PagePool
from nbgen.core.request import Request

EVICT_BATCH = 16   # an allocation that must evict frees at least 1/16 of the cached pages


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last")

    def __init__(self, key: tuple, page: int, parent: Optional["_Node"]) -> None:
        self.key = key                              # page_size token ids of this edge
        self.page = page                            # KV page holding them (-1 for the root)
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.last = 0                               # LRU clock of the last match/insert touching it


class PrefixCache:
    """Radix tree of full KV pages; installs itself as the pool's evictor."""

    def __init__(self, pool: PagePool, disabled: bool = False) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.disabled = disabled
        self._roots: dict[Optional[int], _Node] = {None: _Node((), -1, None)}   # namespace -> root
        self._nodes: dict[int, _Node] = {}          # page -> node
        self._clock = 0
        if not disabled:
            pool.evictor = self.evict_for_alloc

    # ---- queries --------------------------------------------------------------------------------
    def _root(self, ns: Optional[int]) -> _Node:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = _Node((), -1, None)
        return root

    def match(self, token_ids: list[int], touch: bool = True, ns: Optional[int] = None) -> tuple[list[int], int]:
        """Pages of the longest cached full-page prefix of ``token_ids`` (under namespace ``ns``: a
        LoRA adapter id, None for the base model) and its length in tokens."""
        if self.disabled:
            return [], 0
        P = self.page_size
        node, pages = self._roots.get(ns), []
        if node is None:
            return [], 0
        self._clock += 1
        for i in range(len(token_ids) // P):
            child = node.children.get(tuple(token_ids[i * P:(i + 1) * P]))
            if child is None:
                break
            if touch:
                child.last = self._clock
            pages.append(child.page)
            node = child
        return pages, len(pages) * P

    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    def holds(self, page: int) -> bool:
        """Whether the tree holds a reference on ``page``."""
        return page in self._nodes

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages referenced by nobody but the cache (O(cached pages); for stats)."""
        rc = self.pool.refcount
        return sum(1 for p in self._nodes if rc[p] == 1)

    # ---- updates --------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], ns: Optional[int] = None) -> list[int]:
        """Cache the full pages of ``token_ids`` (KV in ``pages``, computed under namespace ``ns``);
        returns the tree's page per index.

        New nodes take a cache ref on the caller's page. Where the tokens were already cached the
        returned page differs from ``pages[i]`` and the caller keeps (and eventually frees) its copy.
        """
        P = self.page_size
        n = min(len(token_ids) // P, len(pages))
        if self.disabled:
            return list(pages[:n])
        self._clock += 1
        clock, nodes = self._clock, self._nodes
        node, path, new = self._root(ns), [], []
        for i in range(n):
            key = tuple(token_ids[i * P:(i + 1) * P])
            child = node.children.get(key)
            if child is None:
                page = pages[i]
                assert page not in nodes, f"page {page} is already cached elsewhere"
                child = node.children[key] = nodes[page] = _Node(key, page, node)
                new.append(page)
            child.last = clock
            path.append(child.page)
            node = child
        if new:
            self.pool.ref(new)
        return path

    def insert_request(self, req: Request, swap: bool) -> None:
        """Insert req's computed full pages (those not cached yet); ``req.num_cached_pages`` follows.

        ``swap=True`` (request keeps running): where the tree already held a page for the same
        tokens, the request switches to the cached copy and frees its own, so that it holds a
        whole root path of tree pages (see module doc). At finish, no swap is needed.
        """
        P = self.page_size
        full = min(req.num_computed // P, len(req.pages))
        if self.disabled or full <= req.num_cached_pages:
            return
        n, n_prompt = full * P, len(req.prompt_ids)
        ids = req.prompt_ids[:n] if n <= n_prompt else req.prompt_ids + req.output_ids[: n - n_prompt]
        path = self.insert(ids, req.pages[:full], req.lora_id)
        if swap:
            for i in range(req.num_cached_pages, full):
                if path[i] != req.pages[i]:
                    self.pool.ref([path[i]])
                    self.pool.unref([req.pages[i]])
                    req.pages[i] = path[i]
        req.num_cached_pages = full

    def evict_for_alloc(self, n_pages: int) -> int:
        """The pool's evictor: frees at least ``n_pages``, and at least 1/``EVICT_BATCH`` of the cached
        pages. One eviction scans every cached node, and a stream of admissions short of a few pages
        each (a batch of prefill-only requests filling the cache) would otherwise scan the whole tree
        per request; freeing the least-recently-used tail in batches keeps that cost amortised."""
        return self.evict(max(n_pages, len(self._nodes) // EVICT_BATCH))

    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` least-recently-used evictable pages; returns how many were freed."""
        if self.disabled or n_pages <= 0:
            return 0
        rc = self.pool.refcount
        heap = [(nd.last, p, nd) for p, nd in self._nodes.items() if not nd.children and rc[p] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_pages:
            _, page, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            del self._nodes[page]
            self.pool.unref([page])
            freed += 1
            if parent.page >= 0 and not parent.children and rc[parent.page] == 1:
                heapq.heappush(heap, (parent.last, parent.page, parent))
        return freed

    def flush(self) -> bool:
        """Drop every evictable node; False if some cached pages are still used by requests."""
        self.evict(len(self._nodes))
        for ns in [k for k, root in self._roots.items() if k is not None and not root.children]:
            del self._roots[ns]                  # adapters' empty roots
        return not self._nodes
