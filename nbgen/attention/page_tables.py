"""Page tables of a step for the paged attention kernels (torch-free; numpy for decode batches).

``page_tables`` flattens any seqs' page lists (prefill chunks and mixed steps). ``DecodeTables`` builds
the tables of one-token rows from int32 copies of the requests' page lists kept in one arena, extended
as pages are added, so a decode step's tables come from a few vectorised numpy calls over the batch
instead of per-row Python (only the rows that crossed a page boundary copy their new page).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from nbgen.core.batch import ScheduledBatch, SeqWork



def page_tables(seqs: Sequence[SeqWork], page_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(qo_indptr [B+1], kv_indptr [B+1], kv_indices [nnz], last_page_len [B]) of a batch's seqs."""
    qo, kv_ptr, idx, last = [0], [0], [], []
    for s in seqs:
        n = s.kv_len
        n_pages = (n + page_size - 1) // page_size
        idx.extend(s.pages[:n_pages])
        qo.append(qo[-1] + s.q_len)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        last.append(n - (n_pages - 1) * page_size)
    return qo, kv_ptr, idx, last


@dataclass
class DecodeRows:
    """What ``DecodeTables.fill`` computed besides the tables it wrote: per row (B rows) int64 arrays."""

    nnz: int                 # kv_indices written
    positions: np.ndarray    # [B] the new token's position (start_pos; the KV cache then holds start_pos + 1)
    slots: np.ndarray        # [B] its KV slot: page * page_size + offset in the page


class DecodeTables:
    """Page tables of one-token rows (decode-only steps, the leading decode rows of mixed steps), from
    int32 copies of the requests' page lists.

    Each page list object gets a slot: a range of the arena holding the first ``count`` pages of the
    list. A slot is trusted while the request keeps the same list object and only appends to it, which
    is all the scheduler does between decode steps; the prefix cache rewrites pages in place only after
    a step that computed prompt tokens, and those steps drop the slot (``forget``, or a row still at its
    last prompt token here), so the next decode step copies the list again. A list that got shorter is
    copied again too.
    """

    def __init__(self, page_size: int, arena: int = 1 << 14) -> None:
        """``arena``: int32 entries reserved at first (the arena doubles as needed)."""
        self.P = page_size
        self._slot: dict[int, int] = {}                 # id(pages list) -> slot
        self._lists: list[Optional[list[int]]] = []     # slot -> its list (keeps the id taken), None: free
        self._free: list[int] = []
        self._off = np.zeros(0, dtype=np.int64)        # slot -> first arena entry
        self._cap = np.zeros(0, dtype=np.int64)        # slot -> arena entries reserved
        self._count = np.zeros(0, dtype=np.int64)      # slot -> pages copied
        self._plen = np.zeros(0, dtype=np.int64)       # slot -> prompt length of its request
        self._arena = np.zeros(arena, dtype=np.int32)
        self._top = 0                                   # arena entries handed out
        self._keys: list[int] = []                      # the previous fill's row keys and slots
        self._rows = np.zeros(0, dtype=np.int64)
        self._shared = False                            # some rows of the previous fill share a slot
        # changes whenever a fill's leading rows (its first ``lead`` rows, or all) are not the previous fill's
        # leading page lists in order (the shared-prefix plan over them is reused until it changes)
        self.version = 0
        self._head: Optional[list[int]] = None          # the previous fill's leading row keys
        self._ramp = np.arange(1 << 14, dtype=np.int64)

    def forget(self, batch: ScheduledBatch) -> None:
        """Drop the slots of seqs whose pages may be rewritten in place after this step."""
        for s in batch.seqs:
            if s.q_len > 1 or s.start_pos < len(s.req.prompt_ids):
                self._drop(id(s.pages))

    def _drop(self, key: int) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._lists[slot] = None
            self._free.append(slot)
            self._keys = []
            self._head = None

    # ---- slots --------------------------------------------------------------------------------
    def _new_slot(self, s: SeqWork) -> int:
        if not self._free:
            n = len(self._lists)
            grow = max(64, n)
            self._off, self._cap, self._count, self._plen = (
                np.concatenate([a, np.zeros(grow, dtype=np.int64)])
                for a in (self._off, self._cap, self._count, self._plen))
            self._lists.extend([None] * grow)
            self._free.extend(range(n + grow - 1, n - 1, -1))
        slot = self._free.pop()
        self._lists[slot] = s.pages
        self._slot[id(s.pages)] = slot
        self._cap[slot] = self._count[slot] = 0
        self._plen[slot] = len(s.req.prompt_ids)
        return slot

    def _reserve(self, slot: int, need: int) -> None:
        """Move a slot to a fresh arena range of at least ``need`` entries, its pages with it."""
        cap = max(2 * need, 64)
        if self._top + cap > len(self._arena):
            self._compact(cap)
        o, c = int(self._off[slot]), int(self._count[slot])
        self._arena[self._top: self._top + c] = self._arena[o: o + c]
        self._off[slot], self._cap[slot] = self._top, cap
        self._top += cap

    def _compact(self, extra: int) -> None:
        """Copy the live slots' pages to the front of a (larger, if needed) arena."""
        live = np.flatnonzero(np.array([x is not None for x in self._lists], dtype=bool))
        used = int(self._cap[live].sum())
        size = len(self._arena)
        while used + extra > size // 2:
            size *= 2
        arena = np.zeros(size, dtype=np.int32)
        top = 0
        for slot in live.tolist():
            o, c, cap = int(self._off[slot]), int(self._count[slot]), int(self._cap[slot])
            arena[top: top + c] = self._arena[o: o + c]
            self._off[slot] = top
            top += cap
        self._arena, self._top = arena, top

    def _prune(self, keep: set[int]) -> None:
        """Free the slots of page lists not in ``keep`` (finished or preempted requests)."""
        for key in [k for k in self._slot if k not in keep]:
            self._drop(key)

    # ---- tables -------------------------------------------------------------------------------
    def fill(self, seqs: Sequence[SeqWork], indptr: np.ndarray, indices: np.ndarray, last: np.ndarray,
             lead: int = 0) -> DecodeRows:
        """Write the page tables of one-token seqs: ``indptr`` [B + 1], ``indices`` [nnz], ``last`` [B]
        (page lengths), int32 arrays at least that long; returns the row values besides them. ``lead``: the
        rows ``version`` follows (0: all; a step's sampling rows, its forced rows after them)."""
        P, B = self.P, len(seqs)
        keys = [id(s.pages) for s in seqs]
        head = keys[:lead] if lead else keys
        if head != self._head:
            self.version += 1
            self._head = head
        start = np.fromiter([s.start_pos for s in seqs], dtype=np.int64, count=B)
        npages = start // P + 1                              # pages of start_pos + 1 tokens
        fresh = None
        if keys == self._keys:          # the previous fill's rows: none is at its last prompt token (see below)
            rows = self._rows
            count = self._count[rows]
        else:
            found = list(map(self._slot.get, keys))
            if None in found:
                for i, f in enumerate(found):
                    if f is None:
                        f = self._slot.get(keys[i])             # a second row of the same list
                        found[i] = self._new_slot(seqs[i]) if f is None else f
            rows = np.array(found, dtype=np.int64)
            self._shared = len(set(found)) < B                  # rows of one request (forced rows)
            count = self._count[rows]
            fresh = start < self._plen[rows]                    # a last prompt token: swap may follow
            if fresh.any():
                count[fresh] = 0                                # copied again, the slot dropped below
            else:
                fresh = None
        grow = np.flatnonzero(npages > count)
        if len(grow):
            self._copy_new(seqs, grow, rows, count, npages)
        indptr[0] = 0
        np.cumsum(npages, out=indptr[1: B + 1])
        nnz = int(indptr[B])
        if nnz > len(self._ramp):
            self._ramp = np.arange(2 * nnz, dtype=np.int64)
        # entry j of row b is arena[off[b] + j]: the arena offsets minus the row's start in indices
        src = np.repeat(self._off[rows] - indptr[:B], npages)
        src += self._ramp[:nnz]
        np.take(self._arena, src, out=indices[:nnz])
        offset = start % P                                  # the new token's place in its last page
        np.add(offset, 1, out=last[:B])
        slots = indices[indptr[1: B + 1] - 1] * np.int64(P) + offset
        if fresh is not None:
            for key in {keys[i] for i in np.flatnonzero(fresh).tolist()}:
                self._drop(key)                             # also resets _keys: the next fill checks again
        else:
            self._keys, self._rows = keys, rows
        if len(self._slot) > 2 * B + 256:
            self._prune(set(keys))
        return DecodeRows(nnz, start, slots)

    def _copy_new(self, seqs: Sequence[SeqWork], grow: np.ndarray, rows: np.ndarray, count: np.ndarray,
                  npages: np.ndarray) -> None:
        """Copy the pages rows ``grow`` need that their slots lack (``count``: pages each slot holds)."""
        g, slots, c, m = grow.tolist(), rows[grow], count[grow], npages[grow]
        if not self._shared and (m <= self._cap[slots]).all() and (m == c + 1).all():
            # the usual step: rows crossed into one new page each, room for it in their slots
            self._arena[self._off[slots] + c] = [seqs[i].pages[j] for i, j in zip(g, c.tolist())]
            self._count[slots] = m
            return
        todo: dict[int, tuple[int, int, int]] = {}          # slot -> (row, pages held, pages needed)
        for i, slot, ci, mi in zip(g, slots.tolist(), c.tolist(), m.tolist()):
            t = todo.get(slot)                              # rows of one request (forced rows): the most
            if t is None or mi > t[2]:
                todo[slot] = (i, ci, mi)
        moved = False
        for slot, (_i, _c, m) in todo.items():              # moves first: a compaction moves every slot
            if m > self._cap[slot]:
                self._reserve(slot, m)
                moved = True
        offs = self._off[list(todo)].tolist() if moved or len(todo) > 8 else None
        dst: list[int] = []
        vals: list[int] = []
        for k, (slot, (i, c, m)) in enumerate(todo.items()):
            pages = seqs[i].pages
            assert len(pages) >= m, "a decode row's page list misses its pages"
            o = offs[k] if offs is not None else int(self._off[slot])
            if m == c + 1:
                dst.append(o + c)
                vals.append(pages[c])
            else:
                dst.extend(range(o + c, o + m))
                vals.extend(pages[c:m])
        self._arena[dst] = vals
        self._count[list(todo)] = [t[2] for t in todo.values()]

    def build(self, seqs: Sequence[SeqWork]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(kv_indptr [B+1] i32, kv_indices [nnz] i32, last_page_len [B] i32, positions [B] i64, slots [B] i64)
        of one-token seqs (a decode batch, or the leading decode rows of a mixed one)."""
        B = len(seqs)
        P = self.P
        cap = sum((s.start_pos + P) // P for s in seqs)
        indptr = np.zeros(B + 1, dtype=np.int32)
        indices = np.zeros(cap, dtype=np.int32)
        last = np.zeros(B, dtype=np.int32)
        r = self.fill(seqs, indptr, indices, last)
        return indptr, indices[: r.nnz], last, r.positions, r.slots
