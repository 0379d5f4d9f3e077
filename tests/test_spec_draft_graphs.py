"""STANDALONE draft steps with the drafts on the device (runtime/spec_draft_graphs.py).

CPU (fp32): the graph path's logic — catch-up through padded verify rows, one-token draft steps whose ids
are placeholders resolved from the previous step's sampled ids, the drafts written into the target's
verify ids on the device and read on the host once — run eagerly (the graphs' replays replaced by the
same padded forwards): outputs and logprobs equal the plain engine's, and with the target as its own draft
every draft is accepted. GPU (``-m gpu``): the engine with graphs against ``disable_cuda_graph=True``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import nbgen
from nbgen.core.batch import ScheduledBatch
from nbgen.runtime.spec_draft_graphs import DraftGraphs, pending_drafts
from nbgen.runtime.step_inputs import placeholder_patch
from tests.test_verify_graphs import EagerPaddedVerify


class EagerDraftGraphs(DraftGraphs):
    """DraftGraphs whose decode-graph replays run eagerly (CPU): placeholders resolved from ``prev`` as
    the graph resolves them."""

    def decode(self, batch: ScheduledBatch, ids: list[int], prev: torch.Tensor) -> torch.Tensor:
        ids = list(ids)
        patch = placeholder_patch(ids, prev, prev.device)
        assert patch is not None                  # every draft step's input is the previous step's draft
        input_ids = torch.as_tensor(ids)
        patch(input_ids)
        pos = torch.as_tensor([s.start_pos for s in batch.seqs])
        return self.runner.model(input_ids, pos, self.runner.backend.prepare(batch))


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama6d")), num_hidden_layers=6)


def test_pending_drafts_patch():
    """Seq i's draft j lands at flat row i * q + 1 + j; rows without drafts untouched; lists cut to counts."""
    toks = torch.tensor([[5, 6, 7], [0, 0, 0], [8, 9, 0]])
    p = pending_drafts(toks, [3, 0, 2])
    ids = torch.full((4 * 4,), -1)
    p.patch(4)(ids)
    want = np.full(16, -1)
    want[[1, 2, 3, 9, 10]] = [5, 6, 7, 8, 9]
    assert ids.tolist() == want.tolist()
    assert p.lists() == [[5, 6, 7], [], [8, 9]]


@pytest.mark.parametrize("self_draft", [True, False])
def test_draft_graph_path_in_engine(deep_llama_dir, tiny_llama_dir, self_draft):
    """fp32 CPU: every decode step drafts through the graph path (run eagerly) and verifies through the
    padded verify path with the drafts patched in on the device: greedy and seeded-sampling outputs and
    logprobs as the plain engine's; the target as its own draft has every draft accepted."""
    draft = deep_llama_dir if self_draft else tiny_llama_dir
    kw = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, speculative_num_steps=3)
    prompts = [[7] * 12, [9, 9, 9, 3, 3, 3, 3, 9, 9, 9], [40, 41, 42, 43, 44] * 4, [100, 7, 200, 9, 150]]
    sps = [{"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True},
           {"temperature": 0.8, "max_new_tokens": 23, "ignore_eos": True, "sampling_seed": 11}] * 2
    outs = []
    for spec in (False, True):
        with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", random_seed=0, **(kw if spec else {})) as eng:
            if spec:
                stepper = eng.loop._spec
                q = stepper.spec.num_draft_tokens
                stepper.verify_graphs = EagerPaddedVerify(stepper.runner, q)
                dr = stepper.drafter
                dr.graphs = fake = EagerDraftGraphs(dr.runner, EagerPaddedVerify(dr.runner, q))
            outs.append(eng.generate(input_ids=prompts, sampling_params=sps, return_logprob=True))
            if spec:
                stats = eng.stats()
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]
    for a, b in zip(*outs):
        la = [lp for lp, _t, _s in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _t, _s in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    assert fake.steps > 0 and stats["spec_draft_graph_steps"] == fake.steps
    prop = sum(o["meta_info"]["spec_proposed_drafts"] for o in outs[1])
    acc = sum(o["meta_info"]["spec_accepted_drafts"] for o in outs[1])
    assert prop > 0
    if self_draft:                    # the same model, the same seeded noise: every draft is the target's token
        assert acc == prop, (acc, prop)


# ---- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 12])
def test_draft_graphs_gpu(gpu_model_dir, batch):
    """bf16 CUDA, STANDALONE with the target as its own draft: draft steps and verify steps replayed in
    graphs against the same engine with ``disable_cuda_graph=True`` (eager drafts and verifies): greedy
    outputs identical up to forks at bf16 near-ties, logprobs close; nearly every draft accepted."""
    from tests.test_verify_graphs import NEAR_TIE, _prompts, fork_gaps, graphs_on_off
    from tests.tiny_models import assert_close_runs

    on, off, stats = graphs_on_off(gpu_model_dir, _prompts(batch), speculative_algorithm="STANDALONE",
                                   speculative_draft_model_path=gpu_model_dir, speculative_num_steps=3)
    assert stats.get("spec_draft_graph_steps", 0) > 0 and stats.get("spec_verify_graph_steps", 0) > 0, stats
    assert_close_runs(on, off)
    gaps = fork_gaps(on, off)
    assert all(g < NEAR_TIE for g in gaps), gaps
    prop = sum(o["meta_info"]["spec_proposed_drafts"] for o in on)
    acc = sum(o["meta_info"]["spec_accepted_drafts"] for o in on)
    assert prop > 0 and acc / prop > 0.8, (acc, prop)
