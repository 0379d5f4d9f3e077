"""PrefixCache: a radix tree over token ids at page granularity, sharing KV pages between requests.

Each edge is a run of one or more full pages of token ids (a multiple of ``page_size`` ids) and its
node owns the KV pages holding them, so a path from the root spells a token prefix whose KV is
already computed. Children are keyed by the token ids of their first page; an edge is split where
a later insert leaves it mid-run, so every cached page sits at one place in the tree, exactly as in
a tree of one page per edge. A finished prompt new to the cache is one node (a few list copies),
not one node per page: inserting a step's prompts stays cheap for prefill-only workloads.
Only full pages are cached: a partly filled page is still being written by its request.

Reference counting (see pages.PagePool): the cache holds one ref on every page it stores; a request
that matched a prefix holds its own ref on those pages. A page is therefore *evictable* when its
count is 1 (only the cache holds it). Requests always hold a whole root path (matched prefix +
their own pages, duplicates swapped for the cached copy by ``insert_request``), so the pages in use
along a path are a prefix of it, and every count-1 page can be reached by evicting from the ends
of leaf edges.

Policies:
- ``match`` returns the longest cached full-page prefix and touches its nodes' LRU time.
- ``insert`` adds a request's full pages; for a page already cached under the same tokens the
  cached page wins and the request's copy stays the request's to free (the returned path tells
  the caller which page the tree holds at each index).
- ``evict(n)`` frees the evictable pages at the ends of least-recently-used leaf edges (a parent
  may follow its last child);
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
    __slots__ = ("key", "tokens", "pages", "parent", "children", "last")

    def __init__(self, key: tuple, tokens: list[int], pages: list[int], parent: Optional["_Node"]) -> None:
        self.key = key                              # the first page's token ids (the parent's dict key)
        self.tokens = tokens                        # len(pages) * page_size token ids of this edge
        self.pages = pages                          # the KV pages holding them, one per page of tokens
        self.parent = parent
        self.children: dict[tuple, _Node] = {}      # first page's token ids -> child
        self.last = 0                               # LRU clock of the last match/insert touching it


def _same_pages(a: list[int], b: list[int], P: int, n: int) -> int:
    """How many of the first ``n`` pages of token lists ``a`` and ``b`` agree (a mismatch is rare:
    compared page by page only then)."""
    if a[: n * P] == b[: n * P]:
        return n
    m = 0
    while m < n and a[m * P:(m + 1) * P] == b[m * P:(m + 1) * P]:
        m += 1
    return m


class PrefixCache:
    """Radix tree of full KV pages; installs itself as the pool's evictor."""

    def __init__(self, pool: PagePool, disabled: bool = False) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.disabled = disabled
        self._roots: dict[Optional[int], _Node] = {None: _Node((), [], [], None)}   # namespace -> root
        self._pages: set[int] = set()               # every page the tree holds
        self._clock = 0
        if not disabled:
            pool.evictor = self.evict_for_alloc

    # ---- queries --------------------------------------------------------------------------------
    def _root(self, ns: Optional[int]) -> _Node:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = _Node((), [], [], None)
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
        i, n = 0, len(token_ids) // P
        while i < n:
            child = node.children.get(tuple(token_ids[i * P:(i + 1) * P]))
            if child is None:
                break
            k = len(child.pages)
            m = _same_pages(token_ids[i * P:], child.tokens, P, min(k, n - i))
            if touch:
                child.last = self._clock
            pages.extend(child.pages[:m])
            i += m
            if m < k:
                break
            node = child
        return pages, i * P

    @property
    def num_cached_pages(self) -> int:
        return len(self._pages)

    def holds(self, page: int) -> bool:
        """Whether the tree holds a reference on ``page``."""
        return page in self._pages

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages referenced by nobody but the cache (O(cached pages); for stats)."""
        rc = self.pool.refcount
        return sum(1 for p in self._pages if rc[p] == 1)

    # ---- updates --------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], ns: Optional[int] = None) -> list[int]:
        """Cache the full pages of ``token_ids`` (KV in ``pages``, computed under namespace ``ns``);
        returns the tree's page per index.

        New nodes take a cache ref on the caller's page. Where the tokens were already cached the
        returned page differs from ``pages[i]`` and the caller keeps (and eventually frees) its copy.
        The pages past the cached part become one new node (one edge for the whole run).
        """
        P = self.page_size
        n = min(len(token_ids) // P, len(pages))
        if self.disabled:
            return list(pages[:n])
        self._clock += 1
        clock = self._clock
        node, path, i = self._root(ns), [], 0
        while i < n:
            key = tuple(token_ids[i * P:(i + 1) * P])
            child = node.children.get(key)
            if child is None:                       # the rest is new: one node for the run
                new = list(pages[i:n])
                assert self._pages.isdisjoint(new), f"a page of {new} is already cached elsewhere"
                child = node.children[key] = _Node(key, list(token_ids[i * P:n * P]), new, node)
                child.last = clock
                self._pages.update(new)
                self.pool.ref(new)
                path.extend(new)
                break
            k = len(child.pages)
            m = _same_pages(token_ids[i * P:], child.tokens, P, min(k, n - i))
            if m < k and i + m < n:                 # the tokens part inside the edge: split it there
                self._split(child, m)
            child.last = clock
            path.extend(child.pages[:m])
            i += m
            node = child
        return path

    def _split(self, node: _Node, m: int) -> None:
        """Cut ``node``'s edge after its first ``m`` pages; the rest becomes its only child."""
        P = self.page_size
        low = _Node(tuple(node.tokens[m * P:(m + 1) * P]), node.tokens[m * P:], node.pages[m:], node)
        low.children, low.last = node.children, node.last
        for c in low.children.values():
            c.parent = low
        node.tokens, node.pages, node.children = node.tokens[: m * P], node.pages[:m], {low.key: low}

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
        return self.evict(max(n_pages, len(self._pages) // EVICT_BATCH))

    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` least-recently-used evictable pages (from the ends of leaf edges);
        returns how many were freed."""
        if self.disabled or n_pages <= 0:
            return 0
        rc = self.pool.refcount
        heap = [(nd.last, nd.pages[0], nd) for nd in self._leaves() if rc[nd.pages[-1]] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_pages:
            _, _, node = heapq.heappop(heap)
            pages = node.pages
            k = 0                                   # evictable pages at the end of the edge
            while k < len(pages) and freed + k < n_pages and rc[pages[-1 - k]] == 1:
                k += 1
            gone = pages[len(pages) - k:]
            self._pages.difference_update(gone)
            self.pool.unref(gone)
            freed += k
            if k < len(pages):                      # a held page, or enough freed: the edge stays
                del pages[len(pages) - k:]
                del node.tokens[len(pages) * self.page_size:]
                continue
            parent = node.parent
            del parent.children[node.key]
            if parent.pages and not parent.children and rc[parent.pages[-1]] == 1:
                heapq.heappush(heap, (parent.last, parent.pages[0], parent))
        return freed

    def _leaves(self) -> list[_Node]:
        """Every node without children (roots excepted)."""
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            else:
                out.append(nd)
        return out

    def flush(self) -> bool:
        """Drop every evictable node; False if some cached pages are still used by requests."""
        self.evict(len(self._pages))
        for ns in [k for k, root in self._roots.items() if k is not None and not root.children]:
            del self._roots[ns]                  # adapters' empty roots
        return not self._pages
