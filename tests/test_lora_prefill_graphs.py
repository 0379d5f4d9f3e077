"""LoRA rows in the CUDA graphs' static row layout: steps with prefill chunks replay the piecewise
prefill graphs' LoRA variant (``runtime/prefill_graphs.py`` + ``LoRAManager.stage``).

- CPU: ``segment_layout`` (seqs of one-row decodes and long prefill runs grouped by slot) against a
  row-by-row grouping; ``LoRASlots.stage`` fills the static buffers the graphs read, and refuses more
  rows than they hold. (The hooks reading those buffers in a multi-token forward are checked against
  the torch path in ``test_lora_kernels.py``'s interpreter test.)
- GPU (``gpu`` mark): an engine with mixed adapters and chunked prefill gives the same greedy outputs
  with piecewise graphs on, off, and run per adapter eagerly; the variant's pieces did replay.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nbgen.runtime.lora_slots import LoRASlots, segment_layout, seq_segments


def _row_by_row(ids: list, q_lens: list[int], slots: dict[int, int], S: int) -> tuple[list, list, list]:
    """The layout built one row at a time (the reference)."""
    rows: dict[int, list[int]] = {s: [] for s in range(S)}
    r = 0
    for lid, n in zip(ids, q_lens):
        if lid is not None:
            rows[slots[lid]].extend(range(r, r + n))
        r += n
    perm = [x for s in range(S) for x in rows[s]]
    length = [len(rows[s]) for s in range(S)]
    start = [sum(length[:s]) for s in range(S)]
    return perm, start, length


@pytest.mark.parametrize("seed", range(9))
def test_segment_layout_groups_rows_by_slot(seed: int) -> None:
    rng = random.Random(seed)
    S = rng.choice([1, 2, 4, 8])
    slots = {100 + i: (i * 3) % S for i in range(S)}                 # adapter id -> slot (any order)
    n = rng.choice([0, 1, 5, 40])
    ids = [rng.choice([None] + list(slots)) for _ in range(n)]
    if seed == 0:
        ids = [None] * n                                                  # base rows only
    q_lens = [rng.choice([1, 1, 3, 17, 300] if seed % 3 else [1]) for _ in range(n)]    # some: decode rows only
    perm, start, length = segment_layout(*seq_segments(ids, q_lens, slots), S)
    want = _row_by_row(ids, q_lens, slots, S)
    assert (perm.tolist(), start.tolist(), length.tolist()) == want
    assert perm.dtype == start.dtype == length.dtype == np.int32


def test_stage_fills_static_buffers_and_bounds_rows() -> None:
    lin = torch.nn.Linear(16, 8, bias=False)
    pool = LoRASlots({(0, "o_proj"): lin}, num_slots=3, rank=4, dtype=torch.float32,
                     device=torch.device("cpu"), max_graph_rows=64)
    slots = {7: 2, 9: 0}
    ids, q_lens = [7, None, 9, 7], [20, 5, 1, 30]
    pool.stage(*seq_segments(ids, q_lens, slots))
    g = pool.graph_step
    perm, start, length = _row_by_row(ids, q_lens, slots, 3)
    assert g.seg_len.tolist() == length == [1, 0, 50]
    assert g.seg_start.tolist() == start
    assert g.perm[:len(perm)].tolist() == perm
    assert g.perm.data_ptr() % 128 == pool.graph_step.seg_start.data_ptr() % 128    # perm on a 128-byte block
    pool.stage(*seq_segments([None, None], [3, 4], {}))                  # no adapter row: empty segments
    assert g.seg_len.tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="above 64"):
        pool.stage(*seq_segments([9], [65], slots))


@pytest.mark.gpu
def test_gpu_lora_prefill_graphs_equal_eager(gpu_model_dir, tmp_path: Path) -> None:
    """Mixed adapters (two and the base) under chunked prefill (prompts over several chunks, chunks
    beside decode rows): greedy outputs with the piecewise prefill graphs' LoRA variant equal the same
    engine with piecewise graphs off and each adapter's requests run alone with no CUDA graphs."""
    import nbgen
    from tests.test_lora import make_adapter
    from tests.tiny_models import GREEDY_SP, assert_close_runs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ads = [make_adapter(gpu_model_dir, str(tmp_path / f"g{i}"), seed=i, r=16, alpha=16) for i in range(2)]
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 40, 300, 700, 90, 1000, 17, 500, 260)]
    names = [["g0", "g1", None][i % 3] for i in range(len(prompts))]
    kw = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, chunked_prefill_size=256,
              max_loras_per_batch=2, lora_paths=[f"g0={ads[0]}", f"g1={ads[1]}"])

    def run(eng, idx: list[int], logprobs: bool = True) -> list[dict]:
        return eng.generate(input_ids=[prompts[i] for i in idx], sampling_params=GREEDY_SP,
                            return_logprob=logprobs, lora_path=[names[i] for i in idx], use_tqdm=False)
    every = list(range(len(prompts)))
    with nbgen.Engine(gpu_model_dir, **kw) as eng:
        assert eng.get_server_info()["piecewise_cuda_graph_tokens"]
        on = run(eng, every)
        on_overlap = run(eng, every, logprobs=False)          # the overlap path (no logprobs)
        assert eng.loop.runner.prefill_graphs.variant_replays > 0
    with nbgen.Engine(gpu_model_dir, disable_piecewise_cuda_graph=True, **kw) as eng:
        assert not eng.get_server_info()["piecewise_cuda_graph_tokens"]
        off = run(eng, every)
        off_overlap = run(eng, every, logprobs=False)
    assert_close_runs(on, off)
    a = [o["output_ids"] for o in on_overlap]
    b = [o["output_ids"] for o in off_overlap]
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(len(s) for s in a)
    assert same >= 0.9, same
    with nbgen.Engine(gpu_model_dir, disable_cuda_graph=True, **kw) as eng:
        for name in ("g0", "g1", None):
            idx = [i for i in every if names[i] == name]
            assert_close_runs([on[i] for i in idx], run(eng, idx))
    # the adapters matter: the base model's outputs differ for the adapter rows
    with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                      chunked_prefill_size=256) as eng:
        plain = eng.generate(input_ids=prompts, sampling_params=GREEDY_SP, use_tqdm=False)
    assert sum(p["output_ids"] != o["output_ids"] for p, o, n in zip(plain, on, names) if n) >= 4
