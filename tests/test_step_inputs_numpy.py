"""The prefill graphs' staging inputs written with numpy (``positions_into``, ``slot_mapping_into``)
equal the list versions (``flatten``, ``slot_mapping``) on mixed batches: decode rows, prefill chunks
starting mid-page, M-RoPE offsets."""
from __future__ import annotations

import random

import numpy as np
import pytest

from nbgen.attention.base import AttentionBackend, KVCacheSpec
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.runtime.step_inputs import flatten, positions_into


class _Backend:
    """Just the page size: the slot methods read nothing else."""

    def __init__(self, page_size: int) -> None:
        self.spec = KVCacheSpec.__new__(KVCacheSpec)
        self.spec.page_size = page_size

    slot_mapping = AttentionBackend.slot_mapping
    slot_mapping_into = AttentionBackend.slot_mapping_into


def _batch(rng: random.Random, P: int) -> ScheduledBatch:
    seqs, next_page = [], 1
    for k in range(rng.randint(1, 12)):
        n_prompt = rng.randint(1, 90)
        req = Request(rid=str(k), prompt_ids=[rng.randrange(100) for _ in range(n_prompt)], params=SamplingParams())
        req.output_ids = [rng.randrange(100) for _ in range(rng.randint(0, 5))]
        req.rope_delta = rng.choice([0, 0, -7, 13])
        total = n_prompt + len(req.output_ids)
        start = rng.randrange(total)
        end = start + 1 if rng.random() < 0.4 else rng.randint(start + 1, total)
        n_pages = (end + P - 1) // P
        pages = rng.sample(range(next_page, next_page + 3 * n_pages), n_pages)
        next_page += 3 * n_pages
        req.pages = pages
        tree = None
        if end - start > 1 and rng.random() < 0.3:          # a draft tree's verify chunk (parents first)
            tree = [-1] + [rng.randrange(i) for i in range(1, end - start)]
        seqs.append(SeqWork(req, req.all_ids[start:end], start, pages, False, tree_parents=tree))
    return ScheduledBatch(seqs=seqs, page_size=P)


@pytest.mark.parametrize("seed", range(20))
def test_numpy_staging_matches_lists(seed: int) -> None:
    rng = random.Random(seed)
    P = rng.choice([1, 4, 16])
    batch = _batch(rng, P)
    flat = flatten(batch)
    n = len(flat.ids)
    pos = np.full(n + 5, -1, dtype=np.int64)
    slots = np.full(n + 5, -1, dtype=np.int64)
    positions_into(batch, pos)
    be = _Backend(P)
    be.slot_mapping_into(batch, slots)
    assert pos[:n].tolist() == flat.positions and (pos[n:] == -1).all()
    assert slots[:n].tolist() == be.slot_mapping(batch) and (slots[n:] == -1).all()
