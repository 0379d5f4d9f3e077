"""Triton variants compiled in parallel during a dry run (kernels/triton_precompile.py)."""
from __future__ import annotations

import tempfile
import threading
import types

import pytest
import torch

from nbgen.kernels import triton_precompile as tp

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def _add_k(x_ptr, y_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + K, mask=i < n)


class _JitFunction:
    def __init__(self) -> None:
        self.preloaded: list[str] = []
        self.threads: set[int] = set()

    def preload(self, data: str) -> None:
        self.threads.add(threading.get_ident())
        self.preloaded.append(data)


def _fake_triton(monkeypatch) -> types.SimpleNamespace:
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(jit_cache_hook=None))
    monkeypatch.setattr(tp, "knobs", knobs)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    return knobs


def test_dry_run_skips_launches_and_compiles_each_variant_once_on_the_pool(monkeypatch) -> None:
    knobs = _fake_triton(monkeypatch)
    jf, other = _JitFunction(), []
    info = types.SimpleNamespace(jit_function=jf)

    def launch(key: str) -> bool:          # what Triton's JITFunction.run asks on a cache miss
        return knobs.runtime.jit_cache_hook(key=key, repr="", fn=info, compile={"specialization_data": key},
                                            is_manual_warmup=False, already_compiled=False)

    def forward() -> None:
        assert launch("a") and launch("b") and launch("a")        # skipped (not launched)
        t = threading.Thread(target=lambda: other.append(launch("c")))
        t.start()
        t.join()

    assert tp.precompiled([forward], torch.device("cuda", 0)) == 2
    assert sorted(jf.preloaded) == ["a", "b"] and threading.get_ident() not in jf.threads
    assert other == [False]                # another thread's launch is left to Triton
    assert knobs.runtime.jit_cache_hook is None


def test_a_failing_dry_run_or_compile_is_only_counted(monkeypatch) -> None:
    knobs = _fake_triton(monkeypatch)
    jf = _JitFunction()
    jf.preload = lambda data: (_ for _ in ()).throw(RuntimeError("ptxas failed"))
    info = types.SimpleNamespace(jit_function=jf)

    def forward() -> None:
        knobs.runtime.jit_cache_hook(key="k", fn=info, compile={"specialization_data": "k"})
        raise ValueError("garbage from a skipped kernel")

    assert tp.precompiled([forward], torch.device("cuda", 0)) == 0
    assert knobs.runtime.jit_cache_hook is None
    assert tp.precompiled([forward], torch.device("cpu")) == 0       # off CUDA: nothing to do


def test_a_warm_first_step_skips_the_rest(monkeypatch) -> None:
    knobs = _fake_triton(monkeypatch)
    jf = _JitFunction()
    info = types.SimpleNamespace(jit_function=jf)
    ran = []

    def step(name: str, launches: list[str]):
        def run() -> None:
            ran.append(name)
            for key in launches:
                knobs.runtime.jit_cache_hook(key=key, fn=info, compile={"specialization_data": key})
        return run

    assert tp.precompiled([step("bs256", []), step("bs1", ["small"])], torch.device("cuda", 0)) == 0
    assert ran == ["bs256"]                                          # nothing missing at the first: warm
    ran.clear()
    assert tp.precompiled([step("bs256", ["big"]), step("bs1", ["small", "big"])], torch.device("cuda", 0)) == 2
    assert ran == ["bs256", "bs1"] and sorted(jf.preloaded) == ["big", "small"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_kernel_variants_compile_on_the_pool_and_run_after(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", tempfile.mkdtemp())   # nothing compiled yet
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    ys = [torch.zeros_like(x) for _ in range(3)]

    def launches() -> None:
        for k, y in enumerate(ys):
            _add_k[(1,)](x, y, 100, K=k, BLOCK=128)

    assert tp.precompiled([launches], x.device) == 3
    torch.cuda.synchronize()
    assert all(int(y.abs().sum()) == 0 for y in ys)            # the dry run launched nothing
    launches()
    for k, y in enumerate(ys):
        assert torch.equal(y, x + k)
