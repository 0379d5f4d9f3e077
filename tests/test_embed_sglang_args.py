"""encode / async_encode arguments as SGLang's Engine takes them: numpy integers for ``dimensions``."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import nbgen


def test_numpy_integer_dimensions(tiny_llama_dir, tmp_path):
    d = str(tmp_path / "mat")
    shutil.copytree(tiny_llama_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [8, 16, 64]}, f)
    with nbgen.Engine(d, dtype="float32", device="cpu", is_embedding=True) as eng:
        ref = eng.encode("hello there", dimensions=16)["embedding"]
        got = eng.encode("hello there", dimensions=np.int64(16))["embedding"]
        assert len(got) == 16 and got == pytest.approx(ref, abs=1e-6)
        with pytest.raises(ValueError, match=r"dimensions=32.*\[8, 16, 64\]"):
            eng.encode("hello there", dimensions=np.int32(32))
        for bad in (np.float64(16.0), True):
            with pytest.raises(ValueError, match="dimensions must be an int"):
                eng.encode("hello there", dimensions=bad)
