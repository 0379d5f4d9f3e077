"""EAGLE tree drafts (``speculative_eagle_topk > 1``): greedy and seeded sampling identical to the plain
engine, the tree's acceptance predictable with a 'copy' head, the tree-verify rule's statistics, tree
attention against running each path plainly, node selection and masks, config errors."""
from __future__ import annotations

import pytest
import torch

import nbgen
from nbgen.attention.tree_mask import ancestor_matrix, chunk_mask
from nbgen.core.batch import ScheduledBatch, SeqWork
from nbgen.core.config import EngineConfig
from nbgen.core.request import Request
from nbgen.core.sampling import SamplingParams
from nbgen.models.eagle import save_random_head
from nbgen.runtime.engine_parts import build_engine_parts
from nbgen.runtime.sampler import Sampler
from nbgen.runtime.spec_tree import DraftTree, chain, select_nodes, verify_trees, walk
from nbgen.runtime.step_inputs import flatten
from tests.test_spec import _chi2
from tests.tiny_models import make_copy_head

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7], [100, 7, 200, 9, 150, 3, 99, 17, 250, 31],
           [7] * 12, [40, 41, 42, 43, 44] * 4]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tree_llama6")), num_hidden_layers=6)


@pytest.fixture(scope="module")
def copy_head(deep_llama_dir, tmp_path_factory) -> str:
    return make_copy_head(deep_llama_dir, str(tmp_path_factory.mktemp("copy_head")))


def _gen(path: str, prompts, params, **kw) -> list[dict]:
    with nbgen.Engine(path, dtype="float32", device="cpu", random_seed=0, **kw) as eng:
        return eng.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)


def _tree(head: str, algo: str, steps: int, topk: int, n: int) -> dict:
    return {"speculative_algorithm": algo, "speculative_draft_model_path": head, "speculative_num_steps": steps,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": n}


@pytest.mark.parametrize("algo, shape", [("EAGLE", (5, 4, 8)), ("EAGLE", (2, 3, 12)), ("EAGLE3", (3, 2, 6))])
def test_tree_greedy_identical(deep_llama_dir, tmp_path, algo, shape):
    """Random heads (SGLang's test setting 5 / 4 / 8 among them): token-identical to plain greedy."""
    head = save_random_head(deep_llama_dir, str(tmp_path / "head"), algo == "EAGLE3", 200 if algo == "EAGLE3" else 0)
    plain = _gen(deep_llama_dir, PROMPTS, GREEDY)
    spec = _gen(deep_llama_dir, PROMPTS, GREEDY, **_tree(head, algo, *shape))
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    m = spec[0]["meta_info"]
    assert m["spec_proposed_drafts"] >= m["spec_verify_ct"] > 0        # a tree every decode step


def test_tree_copy_head_greedy_and_sampled(deep_llama_dir, copy_head, monkeypatch):
    """The copy head's trees are accepted often, also through later siblings (KV moved into place):
    greedy and seeded sampling (temperature, top-p, repetition penalty) give the plain engine's tokens."""
    from nbgen.attention.torch_backend import TorchAttentionBackend

    moved = []
    copy = TorchAttentionBackend.copy_slots
    monkeypatch.setattr(TorchAttentionBackend, "copy_slots",
                        lambda self, src, dst: (moved.append(len(src)), copy(self, src, dst))[1])
    kw = _tree(copy_head, "EAGLE", 3, 3, 10)
    sampled = {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 24,
               "ignore_eos": True, "sampling_seed": 11}
    params = [GREEDY, GREEDY, sampled, sampled]
    plain = _gen(deep_llama_dir, PROMPTS, params)
    spec = _gen(deep_llama_dir, PROMPTS, params, **kw)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert all(o["meta_info"]["spec_accepted_drafts"] > 0 for o in spec)
    assert sum(moved) > 0, "no path through a later sibling: the KV move went untested"


def _expected_tree_counts(out: list[int], tops: list[list[int]]) -> tuple[int, int, int]:
    """(verify steps, proposed, accepted) of the copy head with topk 2, 3 steps, every candidate in the
    tree: below the root out[n - 1] every node's children are S = tops[n - 1] (the target's two most
    likely tokens there, s1 first); levels 1 and 2 hold all of S and S x S, level 3 the children of the
    two best level-2 nodes (s1 s1, then s1 s2: equal scores go to the earlier candidate)."""
    n, verifies, proposed, accepted = 1, 0, 0, 0
    while n < len(out):
        depth = min(3, len(out) - n - 1)
        s = tops[n - 1]
        a = 0
        while a < depth and out[n + a] in s and (a < 2 or (out[n], out[n + 1]) in ((s[0], s[0]), (s[0], s[1]))):
            a += 1
        verifies, proposed, accepted = verifies + 1, proposed + (0, 2, 6, 10)[depth], accepted + a
        n += a + 1
    return verifies, proposed, accepted


def test_tree_copy_head_counts_predictable(deep_llama_dir, copy_head):
    """With every candidate verified, the copy head's acceptance follows from the plain run's top-2
    tokens alone: the features, positions, tree mask and the walk line up."""
    with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu") as eng:
        plain = eng.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 30},
                             return_logprob=True, top_logprobs_num=2, use_tqdm=False)
    spec = _gen(deep_llama_dir, PROMPTS, {**GREEDY, "max_new_tokens": 30}, **_tree(copy_head, "EAGLE", 3, 2, 11))
    total = 0
    for p, o in zip(plain, spec):
        assert o["output_ids"] == p["output_ids"]
        tops = [[t for _lp, t, _s in row] for row in p["meta_info"]["output_top_logprobs"]]
        m = o["meta_info"]
        v, prop, a = _expected_tree_counts(o["output_ids"], tops)
        assert (m["spec_verify_ct"], m["spec_proposed_drafts"], m["spec_accepted_drafts"]) == (v, prop, a)
        total += a
    assert total > 10


def _walk_first_child(tree: DraftTree, targets: list[int]) -> list[int]:
    """A wrong rule: always accepts the root's first child."""
    return [0] + walk(tree, [tree.tokens[0]] + targets[1:])[1:] if len(tree) else []


def _walk_wrong_row(tree: DraftTree, targets: list[int]) -> list[int]:
    """A wrong rule: a child is checked against its own row instead of its parent's."""
    return walk(tree, targets[1:] + targets[:1])


@pytest.mark.parametrize("wrong", [None, "first_child", "wrong_row"])
def test_tree_rule_chi_square(wrong):
    """The first two emitted tokens of a tree verify over 4000 seeds follow the target's p (first
    token) and the row after the accepted child (second): chi-square, p = 0.001; wrong rules are caught."""
    torch.manual_seed(1)
    V = 6
    logits = torch.randn(4, V) * 1.2                  # rows: after the root, after node 0, node 1, node 2
    order = logits[0].argsort(descending=True).tolist()
    tree = DraftTree([order[1], order[2], 3], [-1, -1, 0])   # the root's 2nd and 3rd likeliest, a grandchild
    n = 4000
    sampler = Sampler(V, torch.device("cpu"))
    seqs, trees = [], []
    for seed in range(n):
        req = Request(f"r{seed}", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=10), seed=seed)
        req.output_ids = [3]
        seqs.append(SeqWork(req, [3] + tree.tokens, 2, [], True, tree_parents=tree.chunk_parents()))
        trees.append(tree)
    rule = {None: walk, "first_child": _walk_first_child, "wrong_row": _walk_wrong_row}[wrong]
    res = verify_trees(sampler, logits.repeat(n, 1), seqs, trees, rule)
    p = torch.softmax(logits, -1).tolist()
    probs: dict[tuple, float] = {}
    for a in range(V):
        child = tree.tokens.index(a) if a in tree.tokens[:2] else -1
        for b in range(V) if child >= 0 else [None]:
            probs[(a, b)] = p[0][a] * (p[child + 1][b] if child >= 0 else 1.0)
    got = []
    for v, _path in res:
        toks = v.accepted + [v.token]
        got.append((toks[0], toks[1] if len(toks) > 1 and toks[0] in tree.tokens[:2] else None))
    keys = list(probs)
    chi2 = _chi2([got.count(k) for k in keys], [probs[k] for k in keys])
    assert (chi2 < 37.7) == (wrong is None), (chi2, wrong)     # 15 degrees of freedom, p = 0.001


def test_select_nodes_mask_walk():
    # candidates: root children a(.6) b(.3); a's children c(.3) d(.2); b's child e(.25)
    scores, tokens, parents = [.6, .3, .3, .2, .25], [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1]
    t = select_nodes(scores, tokens, parents, 4)
    assert (t.tokens, t.parents) == ([10, 11, 12, 14], [-1, -1, 0, 1])      # ties to the earlier candidate
    assert t.path(3) == [1, 3] and t.chunk_parents() == [-1, 0, 0, 1, 2]
    assert walk(t, [11, 0, 14, 0, 0]) == [1, 3] and walk(t, [9, 0, 0, 0, 0]) == []
    assert (chain([4, 5]).tokens, chain([4, 5]).parents) == ([4, 5], [-1, 0])
    m = ancestor_matrix(t.chunk_parents())
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    s = SeqWork(None, [1] * 5, 3, [], True, tree_parents=t.chunk_parents())
    assert s.tree_depths() == [0, 1, 1, 2, 2]
    assert chunk_mask(s)[:, :3].all() and torch.equal(chunk_mask(s)[:, 3:], m)


def tree_vs_paths(model_dir: str, device: str, dtype: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n + 1, V] of a tree verify chunk after a 37-token prompt, and of the same rows run plainly
    (the root + the path to each node as a causal chunk over the same prefix)."""
    parts = build_engine_parts(EngineConfig(model_path=model_dir, device=device, dtype=dtype,
                                            attention_backend=backend, disable_cuda_graph=True,
                                            mem_fraction_static=0.3))
    runner, P = parts.runner, parts.scheduler.cfg.page_size
    prompt = [(7 * i + 3) % 300 + 2 for i in range(37)]
    tree = DraftTree([11, 12, 13, 14, 15, 16, 17], [-1, -1, 0, 0, 1, 2, 4])
    pages = list(range(1, 1 + (len(prompt) + 8) // P + 2))
    req = Request("t", prompt, SamplingParams(max_new_tokens=4))
    with torch.inference_mode():
        pre = ScheduledBatch([SeqWork(req, prompt, 0, pages, False)], P)
        runner.hidden_states(pre, flatten(pre))
        s = SeqWork(req, [9] + tree.tokens, len(prompt), pages, True, tree_parents=tree.chunk_parents())
        b = ScheduledBatch([s], P)
        got = runner.model.compute_logits(runner.hidden_states(b, flatten(b)).clone())
        want = []
        for j in range(-1, len(tree)):
            c = SeqWork(req, [9] + [tree.tokens[x] for x in tree.path(j)], len(prompt), pages, True)
            b = ScheduledBatch([c], P)
            want.append(runner.model.compute_logits(runner.hidden_states(b, flatten(b))[-1:].clone()))
    return got.float().cpu(), torch.cat(want).float().cpu()


def test_tree_attention_matches_paths(deep_llama_dir):
    """CPU torch backend (fp32): each tree row's logits equal the root + its path run plainly."""
    got, want = tree_vs_paths(deep_llama_dir, "cpu", "float32", "torch")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kw, word", [
    ({"speculative_eagle_topk": 4}, "speculative_num_draft_tokens"),
    ({"speculative_eagle_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 8},
     "speculative_num_draft_tokens"),
    ({"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8, "speculative_algorithm": "NGRAM",
      "speculative_draft_model_path": None}, "speculative_eagle_topk"),
])
def test_tree_config_errors(deep_llama_dir, copy_head, kw, word):
    cfg = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": copy_head, **kw}
    with pytest.raises(ValueError, match=word):
        nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", **cfg)
