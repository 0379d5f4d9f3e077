"""Folded RMSNorms under tensor parallelism (``models/norm_fold.py``, ``RowParallelLinear.accumulate``).

CPU, two processes over gloo, fp32: each rank loads its shard of one tiny random checkpoint (random
norm weights, so a missing or doubled fold shows), folds its norms and prefills two sequences through
the torch backend; the gathered logits equal HF's and the unfolded tp-2 model's, on both ranks. The
row-parallel ``accumulate`` adds the ranks' summed partial products into the stream once (not once
per rank), bias included; a column-parallel linear refuses to accumulate at tp 2. The peer kernel's
own adding path is tested in ``tests/test_peer_all_reduce.py`` (interpreted) and on two GPUs.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_models import _hf_model

PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 4, 17, 250, 3], [42, 7, 199, 61, 8]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, model_dir: str, out) -> None:
    import torch.distributed as dist

    from nbgen.models.linear import set_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        set_tp(world, rank)
        out.put((rank, *_shard_results(rank, world, model_dir)))
    except BaseException as e:      # reported, so that the test fails at once instead of waiting
        out.put((rank, repr(e), None, None, None))
        raise
    finally:
        set_tp(1, 0)
        dist.destroy_process_group()


def _shard_results(rank: int, world: int, model_dir: str) -> tuple:
    """(unfolded logits, folded logits, accumulate's max error, whether a column linear refused)."""
    from nbgen.core.config import EngineConfig
    from nbgen.models import norm_fold
    from nbgen.models.linear import ColumnParallelLinear, RowParallelLinear
    from nbgen.models.loader import load_model
    from tests.test_models import _run

    loaded = load_model(EngineConfig(model_path=model_dir, dtype="float32", device="cpu"), torch.device("cpu"))
    plain = _run(loaded, PROMPTS, world)
    assert norm_fold.foldable(loaded.model)
    assert norm_fold.fold_norms(loaded.model)
    folded = _run(loaded, PROMPTS, world)
    # accumulate: into += (x @ W.T summed over the ranks) + b, the bias once
    gen = torch.Generator().manual_seed(5)
    full_w = torch.randn(16, 8 * world, generator=gen)
    x_full, into = torch.randn(3, 8 * world, generator=gen), torch.randn(3, 16, generator=gen)
    bias = torch.randn(16, generator=gen)
    row = RowParallelLinear(8 * world, 16, bias=True)
    row.weight_loader(row.weight, full_w)
    row.weight_loader(row.bias, bias)
    got = row.accumulate(x_full[:, rank * 8:(rank + 1) * 8].contiguous(), into.clone())
    want = into + x_full @ full_w.T + bias
    refused = False
    try:
        ColumnParallelLinear(8, 16).accumulate(torch.randn(1, 8), torch.zeros(1, 8))
    except RuntimeError:
        refused = True
    # by value: a shared tensor would need this process alive when the parent reads it
    return plain.numpy(), folded.numpy(), (got - want).abs().max().item(), refused


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tp2_folded_model_matches_hf(tmp_path: Path, cls_name: str) -> None:
    hf = _hf_model(cls_name, tie_word_embeddings=False)    # random norm weights
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    world, port = 2, _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(tmp_path), out)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in procs:
            r, *rest = out.get(timeout=600)
            assert not isinstance(rest[0], str), f"rank {r}: {rest[0]}"
            got[r] = rest
    finally:        # a failed rank leaves the other waiting in a collective
        for p in procs:
            p.join(60 if len(got) == world else 0)
            if p.is_alive():
                p.kill()
    for rank in range(world):
        plain, folded, acc_err, refused = got[rank]
        plain, folded = torch.from_numpy(plain), torch.from_numpy(folded)
        torch.testing.assert_close(plain, ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(folded, ref, atol=1e-4, rtol=0)
        assert torch.equal(folded.argmax(-1), ref.argmax(-1))
        assert acc_err <= 1e-5
        assert refused
    assert (got[0][1] == got[1][1]).all()             # the ranks hold the same stream and logits
    assert all(p.exitcode == 0 for p in procs)
