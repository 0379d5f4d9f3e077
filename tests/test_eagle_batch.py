"""The batched EAGLE head (models/eagle_batch.py): requests with different committed caches (one empty: a
restarted draft cache) and ragged waiting rows drafted in one batch equal each request drafted alone
(outputs, greedy draft tokens, the committed caches left behind); EAGLE and EAGLE3 heads."""
from __future__ import annotations

import pytest
import torch

from nbgen.models.eagle import DraftCache, load_eagle, save_random_head
from nbgen.models.eagle_batch import BatchedCache


def _head(target_dir: str, path: str, eagle3: bool):
    emb = torch.nn.Embedding(384, 64)
    return load_eagle(save_random_head(target_dir, path, eagle3, 200 if eagle3 else 0), 64, emb,
                      torch.float32, torch.device("cpu"))


def _copy(c: DraftCache) -> DraftCache:
    return DraftCache(list(c.k), list(c.v))


@pytest.mark.parametrize("eagle3", [False, True])
def test_batched_draft_matches_per_request(tiny_llama_dir, tmp_path, eagle3):
    torch.manual_seed(0)
    head = _head(tiny_llama_dir, str(tmp_path / "head"), eagle3)
    lm = torch.randn(384, 64)
    target_head = lambda x: x @ lm.T                                     # noqa: E731
    fin = 3 * 64 if eagle3 else 64
    committed, new, steps = [5, 0, 2, 9], [1, 4, 7, 2], 3
    caches, rows = [], []
    for c, m in zip(committed, new):
        cache = DraftCache()
        if c:
            head.step(torch.randint(0, 300, (c,)), torch.randn(c, fin), torch.arange(c), cache)
        caches.append(cache)
        rows.append((torch.randint(0, 300, (m,)), torch.randn(m, fin), torch.arange(c, c + m)))

    ref_out, ref_toks, ref_caches = [], [], []
    for cache, (ids, feats, pos) in zip(caches, rows):
        cache = _copy(cache)
        o = head.step(ids, feats, pos, cache)
        n0 = cache.length
        h, q, toks = o[-1:], int(pos[-1]) + 1, []
        for j in range(steps):
            t = head.logits_to_tokens(h, target_head)
            toks.append(int(t[0]))
            if j + 1 < steps:
                h = head.step(t, h, torch.tensor([q + j]), cache)
        cache.truncate(n0)
        ref_out.append(o)
        ref_toks.append(toks)
        ref_caches.append(cache)

    mine = [_copy(c) for c in caches]
    bc = BatchedCache(mine, new, steps - 1, torch.device("cpu"))
    o = head.step(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows]), bc)
    bc.commit()
    torch.testing.assert_close(o, torch.cat(ref_out), atol=1e-5, rtol=1e-5)
    ends = torch.tensor(new).cumsum(0) - 1
    h, q, toks = o[ends], torch.tensor([c + m for c, m in zip(committed, new)]), []
    for j in range(steps):
        t = head.logits_to_tokens(h, target_head)
        toks.append(t)
        if j + 1 < steps:
            bc.draft_step(j)
            h = head.step(t, h, q + j, bc)
    assert torch.stack(toks, 1).tolist() == ref_toks
    for a, b in zip(mine, ref_caches):
        assert a.length == b.length
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
