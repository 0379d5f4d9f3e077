"""Weight updates at their edges, against SGLang's answers: tensors without data, the version in the
success message, a checkpoint read failing midway (prefix cache flushed, rollback to the checkpoint
last loaded) and get_server_info() after a disk update."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import pytest
import torch

import nbgen
import nbgen.runtime.weights as weights_mod
from tests.test_weights import SP, _greedy, _hf, _hf_greedy
from tests.tiny_models import make_tiny_model

PROMPT = list(range(3, 60))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[str, str, str]:
    """Three tiny Llamas of one config, different weights."""
    return tuple(make_tiny_model("llama", str(tmp_path_factory.mktemp(f"m{s}")), seed=s)   # type: ignore[return-value]
                 for s in (11, 12, 13))


@pytest.fixture
def read_fails(monkeypatch) -> Callable[[str], None]:
    """``read_fails(dir)``: reading that checkpoint raises OSError after three tensors (a disk error
    midway, after its headers were checked); other checkpoints read as usual."""
    real = weights_mod.iter_safetensors

    def arm(bad_dir: str) -> None:
        def reader(model_dir: str, keep: Optional[Callable[[str], bool]] = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(real(model_dir, keep)):
                if model_dir == bad_dir and i == 3:
                    raise OSError("simulated read error")
                yield item
        monkeypatch.setattr(weights_mod, "iter_safetensors", reader)
    return arm


def _cached(eng: nbgen.Engine) -> int:
    return eng.generate(input_ids=PROMPT, sampling_params=SP)["meta_info"]["cached_tokens"]


def test_tensors_without_data_refused(tiny_llama_dir):
    """A meta or sparse tensor is refused up front (ValueError naming its index): nothing is written,
    the good tensors sent with it included."""
    name = "model.layers.0.self_attn.o_proj.weight"
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        before, out = eng.get_weights_by_name(name, 1000), _greedy(eng)
        good = (name, torch.zeros(64, 64))
        for bad in (torch.empty(64, device="meta"), torch.ones(64).to_sparse()):
            with pytest.raises(ValueError, match=r"named_tensors\[1\].*dense tensor with data"):
                eng.update_weights_from_tensor([good, ("model.norm.weight", bad)])
        assert eng.get_weights_by_name(name, 1000) == before
        assert _greedy(eng) == out                        # and the engine serves as before


def test_weight_version_in_success_message(ckpts):
    a, b, _ = ckpts
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        params = list(_hf(b).named_parameters())
        assert eng.update_weights_from_tensor(params) == (True, "Success")
        assert eng.update_weights_from_tensor(params, weight_version="t1") == \
            (True, "Success Weight version updated to t1.")
        assert eng.update_weights_from_disk(a, weight_version="d1") == \
            (True, "Succeeded to update model weights. Weight version updated to d1.", 0)
        assert eng.weight_version == "d1"


def test_partial_disk_update_flushes_cache(tiny_llama_dir, ckpts, read_fails):
    """Dummy weights (no checkpoint to roll back to): a read failing midway leaves the weights partly
    updated, so the prefix cache (K/V of the weights before) is dropped."""
    _, b, _ = ckpts
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", load_format="dummy") as eng:
        _cached(eng)
        assert _cached(eng) > 0
        read_fails(b)
        ok, msg, paused = eng.update_weights_from_disk(b, weight_version="b")
        assert (ok, paused) == (False, 0) and "partially updated" in msg and "simulated read error" in msg
        assert eng.weight_version == "default" and eng.get_server_info()["load_format"] == "dummy"
        assert _cached(eng) == 0


def test_failed_disk_update_rolls_back_to_last_checkpoint(tiny_llama_dir, ckpts, read_fails):
    """A dummy engine that loaded checkpoint b rolls back to b when the next load fails midway; the
    engine reports b's path and format."""
    _, b, c = ckpts
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu", load_format="dummy") as eng:
        assert eng.update_weights_from_disk(b)[0]
        info = eng.get_server_info()
        read_fails(c)
        ok, msg, _ = eng.update_weights_from_disk(c)
        assert not ok and "Rolling back to original weights" in msg, msg
        assert _greedy(eng) == _hf_greedy(_hf(b))
        assert (info["model_path"], info["load_format"]) == (b, "auto")
        assert eng.get_server_info()["model_path"] == b


def test_rollback_after_tensor_update_flushes_cache(ckpts, read_fails):
    """Rolling back reloads the checkpoint on disk, not the tensors sent since: the prefix cache built
    with those tensors is dropped and outputs are the checkpoint's."""
    a, b, c = ckpts
    with nbgen.Engine(a, dtype="float32", device="cpu") as eng:
        assert eng.update_weights_from_tensor(list(_hf(b).named_parameters()))[0]
        _cached(eng)
        assert _cached(eng) > 0
        read_fails(c)
        ok, msg, _ = eng.update_weights_from_disk(c)
        assert not ok and "Rolling back" in msg
        assert _cached(eng) == 0
        assert _greedy(eng) == _hf_greedy(_hf(a))


def test_group_name_of_wrong_kind(tiny_llama_dir):
    """A group_name that is not a non-empty str raises ValueError naming it (not a (False, ...) answer
    quoting a KeyError); the engine serves as before."""
    with nbgen.Engine(tiny_llama_dir, dtype="float32", device="cpu") as eng:
        out = _greedy(eng)
        for bad in (3, "", None):
            with pytest.raises(ValueError, match="group_name"):
                eng.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], group_name=bad)
            with pytest.raises(ValueError, match="group_name"):
                eng.destroy_weights_update_group(bad)
            with pytest.raises(ValueError, match="group_name"):
                eng.init_weights_update_group("127.0.0.1", 29500, 1, 2, bad)
        with pytest.raises(ValueError, match="master_address"):
            eng.init_weights_update_group("", 29500, 1, 2, "g")
        assert _greedy(eng) == out
