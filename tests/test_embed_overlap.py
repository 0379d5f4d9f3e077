"""Pipelined embedding steps (the overlap stepper forced on for a CPU engine): an early close of
``encode_iter`` aborts the rest with a step in flight, loses nothing already delivered, and the engine
keeps serving the plain loop's vectors in order, with their meta_info."""
from __future__ import annotations

import random

import pytest

import nbgen
from nbgen.runtime.overlap import OverlapStepper


def _engine(path: str, overlap: bool) -> nbgen.Engine:
    eng = nbgen.Engine(path, dtype="float32", device="cpu", is_embedding=True, chunked_prefill_size=48,
                       max_running_requests=4)
    if overlap:
        loop = eng.loop
        loop.call(lambda: setattr(loop, "_overlap", OverlapStepper.from_loop(loop)))
    return eng


def test_overlap_embeddings_abort_mid_batch_then_serve(tiny_llama_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 130))] for _ in range(14)]
    with _engine(tiny_llama_dir, False) as eng:
        ref = eng.encode(input_ids=prompts)
    with _engine(tiny_llama_dir, True) as eng:
        got = {}
        it = eng.encode_iter(input_ids=prompts)
        for i, out in it:
            got[i] = out
            if len(got) == 3:
                break
        it.close()                                  # aborts the rest; a step may be in flight
        eng.loop.call(lambda: None)                # the abort has run on the loop thread
        for i, out in got.items():
            assert out["embedding"] == pytest.approx(ref[i]["embedding"], abs=1e-6)
        s = eng.get_server_info()
        again = eng.encode(input_ids=prompts)       # the engine serves on, same vectors, same order
        stats = eng.loop.stats()
    assert s is not None and stats["running"] == 0 and stats["waiting"] == 0
    assert [o["meta_info"]["prompt_tokens"] for o in again] == [len(p) for p in prompts]
    assert [o["meta_info"]["finish_reason"] for o in again] == [o["meta_info"]["finish_reason"] for o in ref]
    for a, b in zip(again, ref):
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-6)
