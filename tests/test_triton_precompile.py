"""Triton variants recorded in a dry run and compiled in worker processes (kernels/triton_precompile.py,
triton_pool.py, triton_variants.py). Without a GPU, Triton compiles for an H100 (sm_90) offline: a
driver that only names the target stands in for CUDA's, and the real kernels of nbgen are recorded."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from nbgen.kernels import small_gemm
from nbgen.kernels.triton_pool import CompilePool
from nbgen.kernels.triton_precompile import Precompile
from nbgen.kernels.triton_variants import Recorder, Variant
from nbgen.runtime.sampler import Sampler
from tests.test_sampler import seq

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import DriverConfig  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CUDA = torch.device("cuda", 0)     # what Precompile is told; every tensor here is on the CPU


class _Sm90:
    """Triton's driver for compiling without a GPU: device 0 is an H100; launching is not possible."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int = 0) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 64)


def forget_loaded_kernels() -> None:
    """Drop every nbgen Triton kernel's per-device state in this process (binders, loaded variants), as
    in a fresh process; the on-disk cache stays."""
    for name, module in list(sys.modules.items()):
        if name.startswith("nbgen.kernels."):
            for obj in vars(module).values():
                if isinstance(obj, JITFunction):
                    obj.device_caches.clear()


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    """An empty Triton cache (this process and its children) and the offline H100 driver; the kernels'
    per-device state is dropped afterwards, so later tests see Triton as it was."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setattr(DriverConfig, "active", property(lambda self: _Sm90()))
    yield cache
    forget_loaded_kernels()


def _steps() -> list:
    """Two launches of the streaming matmul that are two variants (1 row; 4 rows: a tensor-core tile)."""
    w = torch.zeros(256, 512, dtype=torch.bfloat16)
    return [lambda: small_gemm.small_gemm(torch.zeros(4, 512, dtype=torch.bfloat16), w),
            lambda: small_gemm.small_gemm(torch.zeros(1, 512, dtype=torch.bfloat16), w)]


def _entries(cache) -> set[str]:
    return set(os.listdir(cache)) if cache.exists() else set()


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` still runs (zombies not counted: nobody may reap them)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":   # fields: state, ppid, pgrp, ...
            return True
    return False


def _wait_gone(pgid: int, timeout: float = 30.0) -> bool:
    """Whether every process of the group ``pgid`` exited within ``timeout`` s."""
    end = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _group_alive(pgid)


def test_workers_write_the_cache_entries_the_jit_then_reads(sm90, monkeypatch) -> None:
    steps = _steps()
    hits: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    with Precompile(CUDA, n_workers=2) as pre:
        marks = pre.record(steps)
        assert marks == [1, 2] and knobs.runtime.jit_cache_hook is None
        assert hits == []                                 # the dry run compiled nothing in this process
        pre.wait(marks[-1])
        pool = pre.pool
        assert pool.errors == {} and len(pool.seconds) == 2
    assert pool.proc.poll() is not None and _wait_gone(pool.proc.pid)
    written = _entries(sm90)
    assert len(written) == 2
    # the JIT's own compile of the same launches: cache hits on what the workers wrote, nothing new
    for step in steps:
        try:
            step()
        except Exception:   # noqa: BLE001 - compiled, then the launch needs a GPU
            pass
    assert hits == [True, True] and _entries(sm90) == written


def test_a_warm_cache_starts_no_process_and_skips_the_other_steps(sm90) -> None:
    steps = _steps()
    with Precompile(CUDA, n_workers=1) as pre:
        pre.wait(pre.record(steps[:1])[0])
    ran: list[int] = []
    with Precompile(CUDA, n_workers=1) as pre:
        marks = pre.record([lambda: (ran.append(0), steps[0]()), lambda: ran.append(1)])
        assert marks == [0, 0] and ran == [0] and pre.pool is None
    with Precompile(CUDA, n_workers=1) as pre:         # the first step warm: the others are not dry-run
        assert pre.record([steps[0], steps[1]]) == [0, 0] and pre.pool is None
    with Precompile(torch.device("cpu")) as pre:       # off CUDA: nothing runs
        assert pre.record([lambda: ran.append(2)]) == [0] and ran == [0]


def test_other_threads_launch_as_usual_and_a_failing_step_is_only_logged(sm90) -> None:
    answers: list = []
    with Precompile(CUDA, n_workers=1) as pre:
        def step() -> None:
            t = threading.Thread(target=lambda: answers.append(knobs.runtime.jit_cache_hook(
                key="k", fn=None, compile={})))
            t.start()
            t.join()
            _steps()[0]()
            raise RuntimeError("garbage left by a skipped kernel")
        assert pre.record([step]) == [1]
        pre.wait(1)
    assert answers == [False] and knobs.runtime.jit_cache_hook is None
    with Recorder(lambda v: None) as outer, Recorder(lambda v: None) as inner:   # someone else's hook stays
        assert outer.installed and not inner.installed
    assert knobs.runtime.jit_cache_hook is None


def test_a_worker_that_dies_fails_its_job_and_nothing_hangs(tmp_path, monkeypatch) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pool = CompilePool(1)
    try:
        pool.submit(Variant("dies_on_import", "kernel", ("cuda", 90, 64), "{}"))
        assert pool.wait(1, idle_s=120)                   # answered: the pool reports the worker's death
        assert "BrokenProcessPool" in pool.errors[0]
        pool.submit(Variant("dies_on_import", "kernel", ("cuda", 90, 64), "{}"))
        assert pool.wait(2, idle_s=120) and 1 in pool.errors
        pool.proc.kill()                                  # the helper gone: its jobs end the wait at once
        pool.submit(Variant("dies_on_import", "kernel", ("cuda", 90, 64), "{}"))
        t0 = time.monotonic()
        assert not pool.wait(3, idle_s=120) and pool.gone and time.monotonic() - t0 < 60
    finally:
        pool.close()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_no_process_outlives_close_or_the_engine_process(sm90) -> None:
    steps = _steps()
    pre = Precompile(CUDA, n_workers=2)
    pre.record(steps)                                     # two compiles running
    pgid = pre.pool.proc.pid
    pre.close()
    assert _wait_gone(pgid)
    # the engine's process ends mid-compile without closing anything: the helper and its workers die with it
    code = ("import sys, torch, types\n"
            "from tests.test_triton_precompile import _Sm90, _steps\n"
            "from triton.runtime.driver import DriverConfig\n"
            "DriverConfig.active = property(lambda self: _Sm90())\n"
            "from nbgen.kernels.triton_precompile import Precompile\n"
            "pre = Precompile(torch.device('cuda', 0), n_workers=2)\n"
            "pre.record(_steps())\n"
            "print(pre.pool.proc.pid, flush=True)\n"
            "import os; os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert _wait_gone(int(out.stdout.split()[-1]))


def test_variant_round_trips_through_json() -> None:
    v = Variant("nbgen.kernels.small_gemm", "_small_gemm_kernel", ("cuda", 90, 64), '{"name": "x"}')
    assert Variant.from_json(v.to_json()) == v


@pytest.mark.gpu
def test_on_a_gpu_the_dry_run_launches_nothing_and_the_run_loads_the_workers_binary(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    forget_loaded_kernels()                                  # no variant of this process in memory either
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    w = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    y = torch.zeros(4, 256, dtype=torch.bfloat16, device="cuda")
    hits: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))

    def step() -> None:
        small_gemm.small_gemm(x, w, accumulate=y)

    with Precompile(x.device) as pre:
        pre.wait(pre.record([step])[0])
        assert pre.recorded == 1 and pre.pool is not None and pre.pool.errors == {}
    torch.cuda.synchronize()
    assert hits == [] and int(y.abs().sum()) == 0            # the dry run compiled and launched nothing
    step()
    assert hits == [True]                                    # loaded from what the worker wrote
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
def test_the_logits_warm_up_meets_every_argmax_variant_the_sampler_uses(monkeypatch, tmp_path) -> None:
    """``Sampler.warm`` (the start-up's logits warm-up, recorded by the precompile) meets the argmax variants
    a greedy, a temperature-only and a top-k draw use: after it, those draws compile nothing."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    forget_loaded_kernels()
    compiles: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: compiles.append(kw["cache_hit"]))
    V = 151936
    sampler = Sampler(V, torch.device("cuda"))
    sampler.warm(torch.zeros(4, V, device="cuda", dtype=torch.bfloat16))
    assert compiles == [False, False, False]                  # greedy, tempered, after top-k: compiled now
    logits = torch.randn(4, V, device="cuda").to(torch.bfloat16)
    for params in ({"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 0.7, "top_k": 20}):
        sampler(logits, [seq(params, seed=i) for i in range(4)])
    torch.cuda.synchronize()
    assert compiles == [False, False, False]
