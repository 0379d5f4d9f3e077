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
    def __init__(self, name: str, release: threading.Event, fail: bool = False, compiled: bool = False) -> None:
        self.name, self.release, self.fail, self.is_compiled = name, release, fail, compiled

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


def test_the_model_shapes_come_from_its_config_before_the_weights_load(monkeypatch, tiny_llama_dir) -> None:
    from nbgen.core.config import EngineConfig
    seen = []
    monkeypatch.setattr(jit_prebuild, "start_prebuild", lambda *a: seen.append(a) or jit_prebuild.Prebuild())
    cuda = torch.device("cuda", 0)
    jit_prebuild.start_for_config(EngineConfig(model_path=str(tiny_llama_dir), load_format="dummy"), cuda)
    jit_prebuild.start_for_config(EngineConfig(model_path=str(tiny_llama_dir), kv_cache_dtype="fp8_e4m3"), cuda)
    jit_prebuild.start_for_config(EngineConfig(model_path=str(tiny_llama_dir), attention_backend="torch"), cuda)
    jit_prebuild.start_for_config(EngineConfig(model_path=str(tiny_llama_dir)), torch.device("cpu"))
    assert jit_prebuild.start_for_config(EngineConfig(model_path="/nonexistent"), cuda).threads == []
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert seen == [(cuda, torch.bfloat16, torch.bfloat16, head_dim), (cuda, torch.bfloat16, torch.float8_e4m3fn, head_dim)]


def test_ready_only_once_a_missing_module_is_built_and_after_a_cached_ones_check(monkeypatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(jit_prebuild, "flashinfer_specs", lambda *a: [(lambda: _Spec("cold", release), ())])
    pre = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    assert not pre.ready() and not pre.ready()        # compiling: the engine prefills on the stand-in
    release.set()
    pre.wait(10)
    assert pre.ready()
    # a module already in the cache: ready waits for the no-op build instead of using the stand-in
    warm = threading.Event()
    monkeypatch.setattr(jit_prebuild, "flashinfer_specs",
                        lambda *a: [(lambda: _Spec("warm", warm, compiled=True), ())])
    pre = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    threading.Timer(0.2, warm.set).start()
    assert pre.ready() and pre.seconds.keys() == {"warm"}
    assert jit_prebuild.Prebuild().ready()            # nothing prebuilt (no flashinfer, CPU): ready


def test_a_second_engine_waits_for_the_same_running_build(monkeypatch) -> None:
    release = threading.Event()
    calls = []

    def gen() -> _Spec:
        calls.append(1)
        return _Spec("shared", release)
    monkeypatch.setattr(jit_prebuild, "flashinfer_specs", lambda *a: [(gen, ())])
    first = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    second = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    assert first.threads == second.threads and not second.ready()
    release.set()
    assert second.wait(10) == first.wait(10) and calls == [1]
    third = jit_prebuild.start_prebuild(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
    assert third.threads != first.threads     # the build ended: a later start checks again (a no-op when cached)
    third.wait(10)
