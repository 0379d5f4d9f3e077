"""The background flashinfer JIT prebuild (runtime/jit_prebuild.py) on the CPU: which modules, threads, errors."""
from __future__ import annotations

import threading

import torch

from nbgen.runtime import jit_prebuild


def test_no_specs_off_cuda_or_in_fp32() -> None:
    assert jit_prebuild.flashinfer_specs(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 128) == []
    assert jit_prebuild.flashinfer_specs(torch.device("cuda"), torch.float32, torch.float32, 128) == []
    assert jit_prebuild.start_prebuild(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 128).wait() == {}


class _Spec:
    def __init__(self, name: str, release: threading.Event, fail: bool = False) -> None:
        self.name, self.release, self.fail = name, release, fail

    def build(self, need_lock: bool = False) -> None:
        assert need_lock                       # flashinfer's per-module file lock, shared with build_and_load
        assert self.release.wait(10)
        if self.fail:
            raise RuntimeError("ninja failed")


def test_builds_run_on_their_own_threads_and_failures_are_kept(monkeypatch) -> None:
    release = threading.Event()
    specs = [(lambda: _Spec("a", release), ()), (lambda x: _Spec(x, release, fail=True), ("b",))]
    monkeypatch.setattr(jit_prebuild, "flashinfer_specs", lambda *a: specs)
    pre = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    assert len(pre.threads) == 2 and all(t.daemon and t.is_alive() for t in pre.threads)   # both wait together
    release.set()
    assert set(pre.wait(10)) == {"a"}
    assert "ninja failed" in pre.errors["b"]


def test_an_unknown_flashinfer_builds_nothing(monkeypatch) -> None:
    def broken(*a):
        raise TypeError("determine_attention_backend() got an unexpected keyword argument")
    monkeypatch.setattr(jit_prebuild, "flashinfer_specs", broken)
    assert jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128).threads == []
