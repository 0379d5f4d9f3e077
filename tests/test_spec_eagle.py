"""EAGLE / EAGLE3 draft heads: tiny random heads saved in SGLang's checkpoint format draft for a tiny
Llama target; greedy and seeded sampling identical to the plain engine; the head's forward against a
torch reference; config errors."""
from __future__ import annotations

import pytest
import torch

import nbgen
from nbgen.models.eagle import DraftCache, load_eagle, save_random_head

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7], [100, 7, 200, 9, 150, 3, 99, 17, 250, 31]]
SP = [{"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
      {"temperature": 0.7, "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 5}]


def _save_head(path: str, target_dir: str, eagle3: bool, draft_vocab: int = 0) -> str:
    return save_random_head(target_dir, path, eagle3, draft_vocab)


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_llama6")), num_hidden_layers=6)


def _run(path: str, **kw):
    with nbgen.Engine(path, dtype="float32", device="cpu", random_seed=0, **kw) as eng:
        return eng.generate(input_ids=PROMPTS, sampling_params=SP)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_identical(deep_llama_dir, tmp_path, algo):
    head = _save_head(str(tmp_path / "head"), deep_llama_dir, algo == "EAGLE3", 200 if algo == "EAGLE3" else 0)
    plain = _run(deep_llama_dir)
    spec = _run(deep_llama_dir, speculative_algorithm=algo, speculative_draft_model_path=head,
                speculative_num_steps=3)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    m = spec[0]["meta_info"]
    assert 0 < m["spec_verify_ct"] <= 24 and m["spec_accept_length"] >= 1.0
    assert m["spec_proposed_drafts"] > 0          # the head drafted (lossless whatever it proposes)


def test_eagle_head_matches_reference(deep_llama_dir, tmp_path):
    """Rows run one at a time through the cache equal one batched causal pass (the KV plumbing)."""
    path = _save_head(str(tmp_path / "head"), deep_llama_dir, False)
    emb = torch.nn.Embedding(384, 64)
    head = load_eagle(path, 64, emb, torch.float32, torch.device("cpu"))
    ids, feats = torch.randint(0, 300, (6,)), torch.randn(6, 64)
    pos = torch.arange(10, 16)
    full = head.step(ids, feats, pos, DraftCache())
    c = DraftCache()
    parts = [head.step(ids[i:i + 1], feats[i:i + 1], pos[i:i + 1], c) for i in range(6)]
    assert torch.allclose(torch.cat(parts), full, atol=1e-5)
    assert torch.equal(head.embed_tokens.weight, emb.weight)


def test_eagle_config_errors(deep_llama_dir, tiny_llama_dir, tmp_path):
    head = _save_head(str(tmp_path / "head"), deep_llama_dir, False)
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="speculative_algorithm"):
        nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=head)
    with pytest.raises(ValueError, match="not an EAGLE head"):
        nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=tiny_llama_dir)


def test_eagle3_d2t_inside_target_vocab(deep_llama_dir, tmp_path):
    """The random EAGLE3 head's d2t stays inside the target's vocabulary even with a full-size draft
    vocabulary; a head mapping a draft id past it is refused at load (a draft id past the vocabulary
    would index the embedding out of range on the GPU)."""
    from safetensors.torch import load_file, save_file

    path = save_random_head(deep_llama_dir, str(tmp_path / "h3"), True)      # draft vocab = target vocab
    emb = torch.nn.Embedding(384, 64)
    head = load_eagle(path, 64, emb, torch.float32, torch.device("cpu"))
    assert int((torch.arange(head.draft_vocab) + head.d2t).max()) == head.draft_vocab - 1
    f = str(tmp_path / "h3" / "model.safetensors")
    state = load_file(f)
    state["d2t"] = torch.arange(len(state["d2t"])) % 3
    save_file(state, f)
    with pytest.raises(ValueError, match="d2t"):
        load_eagle(path, 64, emb, torch.float32, torch.device("cpu"))


def _expected_copy_counts(out: list[int], steps: int) -> tuple[int, int, int]:
    """(verify steps, proposed, accepted) of a head that always drafts the last token ``steps`` times."""
    n, verifies, proposed, accepted = 1, 0, 0, 0
    while n < len(out):
        k = min(steps, len(out) - n - 1)
        a = 0
        while a < k and out[n + a] == out[n - 1]:
            a += 1
        verifies, proposed, accepted, n = verifies + 1, proposed + k, accepted + a, n + a + 1
    return verifies, proposed, accepted


def test_eagle_features_aligned(deep_llama_dir, tmp_path):
    """A 'copy' head (fc passes the target's feature through, the layer adds nothing) drafts
    argmax lm_head(h_{n-1}) = the last token, for every step: only when feature j meets token j + 1
    at position j. Its acceptance counts are then predictable from the output alone."""
    from tests.tiny_models import make_copy_head

    path = make_copy_head(deep_llama_dir, str(tmp_path / "head"))
    prompts = [[7] * 12, [9, 9, 9, 3, 3, 3, 3, 9, 9, 9], [40, 41, 42, 43, 44] * 4, [100, 7, 200, 9, 150]]
    sp = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    with nbgen.Engine(deep_llama_dir, dtype="float32", device="cpu", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=path, speculative_num_steps=3) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
    total = 0
    for o in outs:
        m = o["meta_info"]
        v, p, a = _expected_copy_counts(o["output_ids"], 3)
        assert (m["spec_verify_ct"], m["spec_proposed_drafts"], m["spec_accepted_drafts"]) == (v, p, a)
        total += a
    assert total > 0, "no repeated tokens: the check would not see a misaligned feature"


@pytest.mark.parametrize("fold", [False, True])
def test_eagle3_capture_matches_hf_hidden_states(tmp_path, fold):
    """The target's EAGLE3 features: the residual stream at the inputs of layers 2, L // 2, L - 3
    equals HF's ``hidden_states[i]`` (plain and norm-folded layers; two sequences in one flat batch)."""
    from nbgen.core.config import EngineConfig
    from nbgen.models import norm_fold
    from nbgen.models.loader import load_model
    from nbgen.runtime.spec_eagle import eagle3_layers
    from tests.test_models import _hf_model, _run

    hf = _hf_model("LlamaForCausalLM", num_hidden_layers=8)
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu"), torch.device("cpu"))
    if fold:
        assert norm_fold.fold_norms(loaded.model)
    layers = eagle3_layers(8)
    assert layers == (2, 4, 5)
    loaded.model.model.capture_layers = layers
    a, b = [5, 9, 2, 77, 31, 8, 100], [3, 44, 12]
    _run(loaded, [a, b])
    got = loaded.model.model.captured
    with torch.no_grad():
        hs = [hf(torch.tensor([s]), output_hidden_states=True).hidden_states for s in (a, b)]
    assert len(got) == 3
    for k, i in enumerate(layers):
        torch.testing.assert_close(got[k], torch.cat([h[i][0] for h in hs]), atol=1e-4, rtol=0)
