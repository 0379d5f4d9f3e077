"""The prefix cache's run-length edges hold what a tree of one page per edge holds: random inserts,
matches and evictions against a reference model (a dict from every cached token prefix to its page)."""
from __future__ import annotations

import random

import pytest

from nbgen.runtime.pages import PagePool
from nbgen.runtime.prefix_cache import PrefixCache


class PageTable:
    """Reference: (ns, token prefix of i + 1 full pages) -> the page caching page i."""

    def __init__(self, P: int) -> None:
        self.P, self.pages = P, {}

    def insert(self, ids: list[int], pages: list[int], ns: int | None) -> list[int]:
        path = []
        for i in range(min(len(ids) // self.P, len(pages))):
            path.append(self.pages.setdefault((ns, tuple(ids[:(i + 1) * self.P])), pages[i]))
        return path

    def match(self, ids: list[int], ns: int | None) -> tuple[list[int], int]:
        out = []
        for i in range(len(ids) // self.P):
            p = self.pages.get((ns, tuple(ids[:(i + 1) * self.P])))
            if p is None:
                break
            out.append(p)
        return out, len(out) * self.P


def _seq(rng: random.Random, base: list[list[int]]) -> list[int]:
    """A token list that often shares a prefix with an earlier one (small alphabet: branching)."""
    if base and rng.random() < 0.7:
        b = rng.choice(base)
        head = b[: rng.randint(0, len(b))]
    else:
        head = []
    return head + [rng.randrange(3) for _ in range(rng.randint(0, 14))]


def _drop_evicted(cache: PrefixCache, ref: PageTable, pool: PagePool, rc_before: dict[int, int]) -> int:
    """Remove the pages the cache evicted from the reference; check they were the cache's alone
    (count 1) and
    that what stays is prefix-closed. Returns how many went."""
    gone = {k: p for k, p in ref.pages.items() if not cache.holds(p)}
    assert all(rc_before[p] == 1 for p in gone.values())
    for k in gone:
        del ref.pages[k]
    for (ns, key) in ref.pages:
        assert len(key) == ref.P or (ns, key[:-ref.P]) in ref.pages
    return len(gone)


@pytest.mark.parametrize("seed", range(30))
def test_random_inserts_matches_evictions_agree_with_page_table(seed: int) -> None:
    rng = random.Random(seed)
    P = rng.choice([1, 2, 4])
    pool = PagePool(400, P)
    cache, ref = PrefixCache(pool), PageTable(P)
    seqs: list[list[int]] = []
    held: list[list[int]] = []                      # pages still referenced by "running requests"
    for _ in range(120):
        op = rng.random()
        ns = rng.choice([None, None, 1])
        if op < 0.5:
            ids = _seq(rng, seqs)
            seqs.append(ids)
            rc_before = {p: pool.refcount[p] for p in ref.pages.values()}
            pages = pool.alloc(len(ids) // P + rng.randint(0, 1))    # may evict (the pool's evictor)
            _drop_evicted(cache, ref, pool, rc_before)
            if pages is None:
                continue
            path = cache.insert(ids, pages, ns)
            assert path == ref.insert(ids, pages, ns)
            if rng.random() < 0.3:
                held.append(path)                   # a request holding a whole root path of tree pages
                pool.ref(path)
            pool.unref(pages)
        elif op < 0.8:
            ids = _seq(rng, seqs)
            assert cache.match(ids, touch=rng.random() < 0.5, ns=ns) == ref.match(ids, ns)
        elif op < 0.9 and held:
            pool.unref(held.pop(rng.randrange(len(held))))
        else:
            rc_before = {p: pool.refcount[p] for p in ref.pages.values()}
            n = rng.randint(0, 12)
            freed = cache.evict(n)
            assert all(pool.refcount[p] == 0 for p in rc_before if not cache.holds(p))
            assert freed == _drop_evicted(cache, ref, pool, rc_before) <= n
        assert cache.num_cached_pages == len(ref.pages)
        assert all(cache.holds(p) and pool.refcount[p] >= 1 for p in ref.pages.values())
    for ids in seqs:
        for ns in (None, 1):
            assert cache.match(ids, touch=False, ns=ns) == ref.match(ids, ns)
    for path in held:
        pool.unref(path)
    assert cache.flush() and pool.num_used == 0


def test_a_run_is_split_where_a_later_prompt_leaves_it() -> None:
    pool = PagePool(32, 2)
    cache = PrefixCache(pool)
    a = pool.alloc(4)
    assert cache.insert([1, 1, 2, 2, 3, 3, 4, 4], a) == a               # one edge of 4 pages
    b = pool.alloc(4)
    assert cache.insert([1, 1, 2, 2, 9, 9, 8, 8], b) == a[:2] + b[2:]  # split after 2 pages
    assert cache.match([1, 1, 2, 2, 3, 3, 5, 5]) == (a[:3], 6)
    assert cache.match([1, 1, 2, 2, 9, 9, 8, 8, 7]) == (a[:2] + b[2:], 8)
    assert cache.match([1, 1, 2]) == (a[:1], 2)
    pool.unref(a + b)
    assert cache.num_cached_pages == 6 and pool.refcount[b[0]] == 0
    assert cache.evict(3) == 3 and cache.num_cached_pages == 3        # from the ends of leaf edges
    assert cache.match([1, 1, 2, 2, 3, 3])[1] + cache.match([1, 1, 2, 2, 9, 9])[1] == 4 + 6
    assert cache.flush() and pool.num_used == 0
