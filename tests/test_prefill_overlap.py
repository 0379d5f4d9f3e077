"""Prefill-only steps through the overlap stepper (forced on for a CPU engine: CPU work is synchronous,
the bookkeeping is the one CUDA runs): ``score`` and output logprobs are read one step late and
equal the plain loop's; an early close aborts the rest and the engine serves on; a step that raises
fails only its own requests — the step in flight before it is delivered, later ones run."""
from __future__ import annotations

import random

import pytest

import nbgen
from nbgen.runtime.overlap import OverlapStepper


def _engine(path: str, overlap: bool, **cfg) -> nbgen.Engine:
    eng = nbgen.Engine(path, dtype="float32", device="cpu", **cfg)
    if overlap:
        loop = eng.loop
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
    return eng


def _score_case() -> tuple[list[int], list[list[int]], list[int]]:
    """A shared 40-token query (a cached prefix after the first chunk) and items of mixed lengths."""
    rng = random.Random(7)
    query = [rng.randrange(3, 380) for _ in range(40)]
    items = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 90))] for _ in range(18)]
    return query, items, [5, 17, 101, 250]


def test_overlap_score_equals_plain_loop(tiny_llama_dir):
    query, items, labels = _score_case()
    cfg = {"chunked_prefill_size": 64, "max_running_requests": 6}
    res = {}
    for overlap in (False, True):
        with _engine(tiny_llama_dir, overlap, **cfg) as eng:
            steps = []
            if overlap:      # count the steps the stepper pipelines (they must not fall back to run_step)
                st = eng.loop._overlap
                orig = st._run_step
                st._run_step = lambda b: (steps.append(b), orig(b))[-1]
            scores = eng.score(query=query, items=items, label_token_ids=labels)
            soft = eng.score(query=query, items=items, label_token_ids=labels, apply_softmax=True)
            outs = list(eng.score_iter(query=query, items=items[:5], label_token_ids=labels))
            res[overlap] = (scores, soft, sorted(outs, key=lambda x: x[0]), steps)
    (s0, p0, o0, _), (s1, p1, o1, sync_steps) = res[False], res[True]
    assert not sync_steps                           # every score step pipelined
    for a, b in zip(s0 + p0, s1 + p1):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-9)
    assert all(sum(row) == pytest.approx(1.0) for row in p1)
    for (i, a), (j, b) in zip(o0, o1):
        assert i == j and b["scores"] == pytest.approx(a["scores"], rel=1e-5, abs=1e-9)
        for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason"):
            assert b["meta_info"][k] == a["meta_info"][k], k
    assert any(b["meta_info"]["cached_tokens"] > 0 for _, b in o1)   # the shared query was matched


def test_overlap_output_logprobs_equal_plain_loop(tiny_llama_dir):
    """Generation with output logprobs (top-k, token ids, sampled rows) pipelined: same tokens, same
    logprob lists as the plain loop, streamed chunks included."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 70))] for _ in range(8)]
    sps = [{"max_new_tokens": rng.randint(1, 12), "temperature": 0.0 if i % 2 else 0.8, "sampling_seed": i,
            "ignore_eos": True} for i in range(8)]
    kw = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[4, 9])
    got = {}
    for overlap in (False, True):
        with _engine(tiny_llama_dir, overlap, chunked_prefill_size=48) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=sps, **kw)
            chunks = list(eng.generate(input_ids=prompts[0], sampling_params=sps[0], stream=True, **kw))
            got[overlap] = (outs, chunks)
    (ref, ref_chunks), (new, new_chunks) = got[False], got[True]
    for a, b in zip(ref + ref_chunks[-1:], new + new_chunks[-1:]):
        assert b["output_ids"] == a["output_ids"]
        ma, mb = a["meta_info"], b["meta_info"]
        assert len(mb["output_token_logprobs"]) == len(mb["output_top_logprobs"]) == len(b["output_ids"])
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            fa = [(t[0], t[1]) for row in ma[key] for t in (row if isinstance(row, list) else [row])]
            fb = [(t[0], t[1]) for row in mb[key] for t in (row if isinstance(row, list) else [row])]
            assert [t for _, t in fb] == [t for _, t in fa], key
            assert [v for v, _ in fb] == pytest.approx([v for v, _ in fa], abs=1e-5), key


def test_overlap_score_early_close_then_serve(tiny_llama_dir):
    query, items, labels = _score_case()
    with _engine(tiny_llama_dir, False, chunked_prefill_size=64, max_running_requests=4) as eng:
        ref = eng.score(query=query, items=items, label_token_ids=labels)
    with _engine(tiny_llama_dir, True, chunked_prefill_size=64, max_running_requests=4) as eng:
        it = eng.score_iter(query=query, items=items, label_token_ids=labels)
        got = {}
        for i, out in it:
            got[i] = out
            if len(got) == 3:
                break
        it.close()                                  # aborts the rest; a step may be in flight
        eng.loop.call(lambda: None)
        for i, out in got.items():
            assert out["scores"] == pytest.approx(ref[i], rel=1e-5, abs=1e-9)
        again = eng.score(query=query, items=items, label_token_ids=labels)
        stats = eng.loop.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    for a, b in zip(again, ref):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("kind", ["embed", "score"])
def test_overlap_failing_step_loses_nothing(tiny_llama_dir, kind):
    """One pipelined step raises: its requests end with an abort naming the error, every other request
    (the step in flight before it included) gets the plain loop's result, and the engine serves on."""
    query, items, labels = _score_case()
    prompts = [query[: 20 + i] + it for i, it in enumerate(items)]
    embed = kind == "embed"
    cfg = dict(chunked_prefill_size=64, max_running_requests=3, is_embedding=embed)

    def run(eng: nbgen.Engine) -> list:
        if embed:
            return [o["embedding"] for o in eng.encode(input_ids=prompts)]
        return [o["scores"] for _, o in sorted(eng.score_iter(query=query, items=items, label_token_ids=labels))]

    with _engine(tiny_llama_dir, False, **cfg) as eng:
        ref = run(eng)
    with _engine(tiny_llama_dir, True, **cfg) as eng:
        runner = eng.loop.runner
        orig, calls, failed = runner.hidden_states, [0], []

        def flaky(batch, flat):
            calls[0] += 1
            if calls[0] == 4:                       # a later step: earlier ones are in flight / delivered
                failed.extend(s.req.rid for s in batch.seqs)
                raise RuntimeError("injected step failure")
            return orig(batch, flat)
        runner.hidden_states = flaky
        if embed:
            outs = eng.encode(input_ids=prompts)
            got = [o["embedding"] for o in outs]
            reasons = [o["meta_info"]["finish_reason"] for o in outs]
        else:
            pairs = sorted(eng.score_iter(query=query, items=items, label_token_ids=labels))
            got = [o["scores"] for _, o in pairs]
            reasons = [o["meta_info"]["finish_reason"] for _, o in pairs]
        runner.hidden_states = orig
        again = run(eng)
    assert failed
    bad = [i for i, r in enumerate(reasons) if r["type"] == "abort"]
    assert bad and len(bad) < len(prompts)
    assert all("injected step failure" in reasons[i]["message"] for i in bad)
    for i, (a, b) in enumerate(zip(ref, got)):
        if i in bad:
            assert b is None
        else:
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    for a, b in zip(ref, again):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


def test_bench_embed_score_mode_runs_on_cpu(tiny_llama_dir):
    """``python -m nbgen.bench.embed --score``: the same texts scored on a generative engine, every
    prompt token counted, two label probabilities per text."""
    import json
    import os

    from nbgen.bench.embed import main, make_texts

    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    argv = ["--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--num-texts", "12",
            "--min-tokens", "8", "--max-tokens", "40", "--score"]
    r = main(argv)[0]
    assert r["in_tokens"] == sum(map(len, make_texts(12, 8, 40, vocab)))
    assert r["dim"] == 2 and r["steps"]["steps"] > 0 and r["tok_s"] > 0


def test_overlap_row_with_nothing_allowed_aborts_as_plain_loop(tiny_llama_dir):
    """A row whose every token is masked (-inf biases on all but EOS, EOS banned by min_new_tokens)
    aborts its request in a pipelined step as in the plain loop; its neighbours (one with output
    logprobs) are untouched."""
    import json
    import os

    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        c = json.load(f)
    eos = c["eos_token_id"]
    plain = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    masked = {"max_new_tokens": 5, "temperature": 0.0, "min_new_tokens": 2,
              "logit_bias": {str(t): float("-inf") for t in range(c["vocab_size"]) if t != eos}}
    prompts, sps = [[5, 6, 7], [8, 9], [10, 11, 12]], [plain, masked, plain]
    outs = {}
    for overlap in (False, True):
        with _engine(tiny_llama_dir, overlap) as eng:
            outs[overlap] = eng.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
    for a, b in zip(outs[False], outs[True]):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        assert len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"])
    assert outs[True][1]["output_ids"] == [] and "no token is allowed" in outs[True][1]["meta_info"]["finish_reason"]["message"]
