"""EAGLE / EAGLE3 chains batched across requests (runtime/spec_eagle_batch.py): the paged, batched head
proposes the same drafts as the per-request head over its own caches (runtime/spec_eagle.py), step after
step of a mixed batch (fp32 CPU; the one-row draft steps run eagerly here, in CUDA graphs on a GPU), and
outputs stay identical to the plain engine's."""
from __future__ import annotations

import pytest
import torch

import nbgen
from nbgen.core.batch import ScheduledBatch
from nbgen.models.eagle import save_random_head
from nbgen.runtime.spec_eagle import EagleDrafter
from nbgen.runtime.spec_eagle_batch import EagleChainDrafter, HeadRows
from nbgen.runtime.step_inputs import placeholder_patch


class EagerHeadGraphs:
    """The head's decode graphs' interface (stage / replay / padded_output, runtime/cuda_graphs.py) run
    eagerly on the CPU: ``HeadRows`` over its static feature buffer, placeholder ids resolved from ``prev``
    as the graph resolves them, outputs padded to a graph batch size."""

    max_bs = 16

    def __init__(self, rows: HeadRows, backend) -> None:
        self.rows, self.backend, self.replays = rows, backend, 0

    def stage(self, batch: ScheduledBatch, ids: list[int]):
        return batch, list(ids)

    def replay(self, staged, prev: torch.Tensor) -> torch.Tensor:
        batch, ids = staged
        patch = placeholder_patch(ids, prev, prev.device)
        assert patch is not None
        input_ids = torch.as_tensor(ids)
        patch(input_ids)
        pos = torch.as_tensor([s.start_pos for s in batch.seqs])
        out = self.rows(input_ids, pos, self.backend.prepare(batch))
        bs = next(b for b in (1, 2, 4, 8, 16) if b >= len(ids))
        self.out = torch.cat([out, torch.full((bs - len(ids), out.shape[1]), float("nan"))])   # padding rows
        self.replays += 1
        return self.out[: len(ids)]

    def padded_output(self, staged) -> torch.Tensor:
        return self.out

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7], [100, 7, 200, 9, 150, 3, 99, 17, 250, 31],
           [40, 41, 42, 43, 44] * 4, [9, 9, 9, 3, 3, 3, 3, 9, 9, 9]]
SP = [{"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
      {"temperature": 0.7, "max_new_tokens": 17, "ignore_eos": True, "sampling_seed": 5}] * 2


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama6e")), num_hidden_layers=6)


@pytest.mark.parametrize("algo, graphs", [("EAGLE", False), ("EAGLE3", False), ("EAGLE", True), ("EAGLE3", True)])
def test_batched_chain_drafts_match_per_request_head(deep_llama_dir, tmp_path, algo, graphs):
    """``graphs``: the one-row draft steps through the decode graphs' interface (EagerHeadGraphs)."""
    head = save_random_head(deep_llama_dir, str(tmp_path / "head"), algo == "EAGLE3", 200 if algo == "EAGLE3" else 0)
    with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", random_seed=0) as eng:
        plain = eng.generate(input_ids=PROMPTS, sampling_params=SP)
    with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", random_seed=0, speculative_algorithm=algo,
                      speculative_draft_model_path=head, speculative_num_steps=3) as eng:
        new = eng.loop._spec.drafter
        assert isinstance(new, EagleChainDrafter)
        if graphs:
            new.rows = HeadRows(new.head, 16)
            new.graphs = fake = EagerHeadGraphs(new.rows, new.backend)
        ref = EagleDrafter(new.target, new.head, new.steps)       # the per-request head, fed the same features
        seen: list[tuple[list[list[int]], list[list[int]]]] = []
        observe, draft = new.observe, new.draft_on_device

        def both_observe(batch, starts, hidden, order=None):
            captured = list(new.model.captured)
            observe(batch, starts, hidden, order)
            new.model.captured = captured
            ref.observe(batch, starts, hidden, order)

        def both_draft(batch, limits):
            want = ref.draft(batch, limits)
            got = draft(batch, limits)
            seen.append((want, got.lists() if got is not None else [[] for _ in batch.seqs]))
            return got

        new.observe, new.draft_on_device = both_observe, both_draft
        spec = eng.generate(input_ids=PROMPTS, sampling_params=SP)
        stats = eng.stats()
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert sum(len(d) for want, _ in seen for d in want) > 20
    assert all(want == got for want, got in seen), next((w, g) for w, g in seen if w != g)
    if graphs:
        assert fake.replays > 10 and stats["spec_draft_graph_steps"] > 5, (fake.replays, stats)


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_chain_graphs_gpu(gpu_model_dir, tmp_path, algo, request):
    """bf16 CUDA, a random head: the head's draft steps and the verify steps replayed in graphs against
    the same engine with ``disable_cuda_graph=True`` (eager head steps, eager verifies), batch 1 and 12:
    greedy outputs identical up to forks at bf16 near-ties, logprobs close."""
    from tests.test_verify_graphs import NEAR_TIE, _prompts, fork_gaps, graphs_on_off
    from tests.tiny_models import assert_close_runs, make_gpu_model

    if algo == "EAGLE3":               # three feature layers: a 6-layer target of the family
        family = request.node.callspec.params["gpu_model_dir"]
        gpu_model_dir = make_gpu_model(family, str(tmp_path / "deep"), layers=6)
    head = save_random_head(gpu_model_dir, str(tmp_path / "head"), algo == "EAGLE3")
    for prompts in (_prompts(1), _prompts(12)):
        on, off, stats = graphs_on_off(gpu_model_dir, prompts, speculative_algorithm=algo,
                                       speculative_draft_model_path=head, speculative_num_steps=3)
        assert stats.get("spec_draft_graph_steps", 0) > 0 and stats.get("spec_verify_graph_steps", 0) > 0, stats
        assert_close_runs(on, off)
        gaps = fork_gaps(on, off)
        assert all(g < NEAR_TIE for g in gaps), gaps
        assert sum(o["meta_info"]["spec_proposed_drafts"] for o in on) > 0
