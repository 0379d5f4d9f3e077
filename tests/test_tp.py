"""Tensor parallelism on the CPU (gloo): tp_size=2 against tp_size=1 on tiny random models in fp32,
token for token, logprobs within 1e-4; KV heads replicated at tp_size=4; no worker outlives its
engine or its parent process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import nbgen

PROMPTS = ["Hello there, how are you today?", "def add(a, b):", "The quick brown fox jumps over",
           "Hello there, how are you doing?"]     # shares a prefix with the first: a prefix-cache hit
SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def tp_workers() -> list[psutil.Process]:
    """This process's tensor-parallel worker processes."""
    return [p for p in psutil.Process().children(recursive=True)
            if "run_from_fd" in " ".join(p.cmdline())]


def run(model_dir: str, tp: int) -> list[dict]:
    """Greedy outputs with output and prompt logprobs (small chunks so that prompts span steps), then
    seeded samples (rank 0 samples from the gathered logits)."""
    with nbgen.Engine(model_dir, dtype="float32", device="cpu", tp_size=tp, random_seed=0,
                      chunked_prefill_size=8) as eng:
        if tp > 1:
            workers = tp_workers()
            assert len(workers) == tp - 1
            for w in workers:      # a notebook's interrupt reaches the process group: workers ignore it
                w.send_signal(signal.SIGINT)
        out = eng.generate(PROMPTS, SP, return_logprob=True, logprob_start_len=0, use_tqdm=False)
        out += eng.generate(PROMPTS[:2], {**SP, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 7},
                            return_logprob=True, use_tqdm=False)
        if tp > 1:
            assert all(w.is_running() for w in workers)
    assert tp_workers() == []              # shutdown() stopped every worker
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key == "input_token_logprobs" and not x["meta_info"].get(key):
                continue           # the sampled requests did not ask for prompt logprobs
            lx = [t[0] for t in x["meta_info"][key] if t[0] is not None]
            ly = [t[0] for t in y["meta_info"][key] if t[0] is not None]
            assert len(lx) == len(ly) > 0
            assert max(abs(p - q) for p, q in zip(lx, ly)) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_tp1(family, request):
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    ref = run(model_dir, 1)
    assert all(o["meta_info"]["input_token_logprobs"] for o in ref[:len(PROMPTS)])
    assert_same(ref, run(model_dir, 2))


def test_tp4_replicates_kv_heads(tiny_llama_dir):
    # 2 KV heads over 4 ranks: each KV head on two ranks (SGLang's replication)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", random_seed=0) as eng:
        ref = eng.generate(PROMPTS[:2], SP, use_tqdm=False)
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", tp_size=4, random_seed=0) as eng:
        out = eng.generate(PROMPTS[:2], SP, use_tqdm=False)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]


def test_tp_size_checks(tiny_llama_dir):
    with pytest.raises(ValueError, match="dp_size > 1 needs tp_size 1"):
        nbgen.Engine(tiny_llama_dir, device="cpu", tp_size=2, dp_size=2)
    with pytest.raises(ValueError, match="tp_size"):
        nbgen.Engine(tiny_llama_dir, device="cpu", tp_size=0)
    with pytest.raises(ValueError, match="tp_size"):
        nbgen.Engine(tiny_llama_dir, device="cpu", tp_size=3)      # 4 heads do not split 3 ways
    assert tp_workers() == []


def test_workers_exit_when_the_parent_is_killed(tiny_llama_dir, tmp_path):
    # a plain script, no __main__ guard: the workers are fresh interpreters, not re-imports of it
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        import psutil, nbgen
        eng = nbgen.Engine({tiny_llama_dir!r}, dtype="float32", device="cpu", tp_size=2)
        eng.generate("Hello", {{"max_new_tokens": 2}}, use_tqdm=False)
        kids = [p.pid for p in psutil.Process().children(recursive=True)
                if "run_from_fd" in " ".join(p.cmdline())]
        print(" ".join(map(str, kids)), flush=True)
        sys.stdin.read()       # until the test kills this process
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        line = parent.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 1, line
        workers = [psutil.Process(pid) for pid in pids]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _gone, alive = psutil.wait_procs(workers, timeout=60)
        assert alive == []
    finally:
        parent.kill()
        parent.wait()


def _gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n


def _two_gpus() -> bool:
    return _gpus(2)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
@pytest.mark.parametrize("gpu_model_dir", ["llama", "qwen2", "qwen3"], indirect=True)
def test_tp_gpu_graphs_match_tp1(gpu_model_dir):
    """tp_size=2 on two GPUs, and tp_size=4 on four where there are four (KV heads replicated: the
    model has 2), each against one GPU's run (made once): the peer all-reduce up to 512 KB, NCCL above;
    the decode graphs and the piecewise prefill graphs capture the all-reduces; overlap scheduling on;
    bf16 greedy: the same tokens up to near-ties, close logprobs; graphs were captured; Llama and
    Qwen3 run folded norms (o_proj / down_proj all-reduced into the stream), Qwen2 (biases) does not."""
    from nbgen.models import all_reduce
    from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts

    prompts = gpu_prompts()
    one = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    model_type = json.loads((Path(gpu_model_dir) / "config.json").read_text())["model_type"]
    for tp in (2, 4) if _gpus(4) else (2,):
        with nbgen.Engine(gpu_model_dir, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, tp_size=tp) as eng:
            info = eng.get_server_info()
            assert info["cuda_graph_batch_sizes"] and info["piecewise_cuda_graph_tokens"]
            assert all_reduce.active()          # rank 0 runs in this process
            assert info["norms_folded"] is (model_type != "qwen2")
            out = eng.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 32,
                                                                   "ignore_eos": True},
                               return_logprob=True, use_tqdm=False)
        assert tp_workers() == []
        assert_close_runs(one, out)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
@pytest.mark.parametrize("gpu_model_dir", ["qwen3"], indirect=True)
def test_dp2_gpu_matches_dp1(gpu_model_dir):
    """dp_size=2 puts one replica on each GPU; outputs equal one GPU's (same kernels, same batches
    per request up to batch composition: compared as close runs)."""
    from tests.tiny_models import assert_close_runs, gpu_generate, gpu_prompts

    prompts = gpu_prompts()
    one = gpu_generate(gpu_model_dir, prompts, logprobs=True)
    two = gpu_generate(gpu_model_dir, prompts, logprobs=True, dp_size=2)
    assert_close_runs(one, two)


class _Graph:
    def __init__(self) -> None:
        self.freed = False

    def reset(self) -> None:
        self.freed = True


def test_graph_runners_reset_every_kind_of_graph():
    """A tp engine's shutdown frees rank 0's graphs before the process group goes (they hold captured
    all-reduces): the decode runner's plain, LoRA-variant and shared-prefix graphs and greedy heads, the
    prefill runner's pieces of both kinds and its whole-step graphs."""
    from nbgen.runtime.cuda_graphs import CudaGraphRunner
    from nbgen.runtime.greedy_heads import GreedyHeads
    from nbgen.runtime.prefill_graphs import PrefillGraphRunner

    dec = object.__new__(CudaGraphRunner)          # the tables only: capture needs a GPU
    dec.graphs, dec.variant_graphs, dec.cascade_graphs = {1: _Graph()}, {1: _Graph()}, {8: _Graph()}
    dec.heads = object.__new__(GreedyHeads)
    dec.heads.graphs = {(1, False): _Graph(), (8, True): _Graph()}
    dec.heads.masked = {(1, False): _Graph()}
    pre = object.__new__(PrefillGraphRunner)
    pre.graphs, pre.variant_graphs = {32: [_Graph(), _Graph()]}, {32: [_Graph()]}
    pre.whole = {32: _Graph()}
    dec.reset()
    pre.reset()
    every = [*dec.graphs.values(), *dec.variant_graphs.values(), *dec.cascade_graphs.values(),
             *dec.heads.graphs.values(), *dec.heads.masked.values(),
             *(g for t in (pre.graphs, pre.variant_graphs) for gs in t.values() for g in gs), *pre.whole.values()]
    assert len(every) == 10 and all(g.freed for g in every)
