"""Every nbgen module imports on a CPU-only install (optional packages load lazily, and a name one bench
module takes from another must still exist there)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import nbgen

MODULES = sorted(m.name for m in pkgutil.walk_packages(nbgen.__path__, "nbgen.")
                 if not m.name.endswith("__main__"))


def test_modules_found() -> None:
    assert "nbgen.bench.decode_layers" in MODULES and "nbgen.runtime.scheduler" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    importlib.import_module(name)
