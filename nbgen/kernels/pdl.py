"""Programmatic dependent launch (PDL) for nbgen's Triton kernels on Hopper and newer.

A batch-1 decode step is ~300 small kernels; between two of them the GPU idles for the next
launch. Launched with PDL, a kernel's programs start while the previous kernel drains, do what
does not depend on it (load weights, page tables), then ``gdc_wait`` for its results; each kernel
calls ``gdc_launch_dependents`` once its own programs are all resident, so the next one may start.
A kernel that uses this takes a ``USE_PDL`` constexpr and calls ``gdc_wait()`` before it reads
anything the previous kernel writes. Inside CUDA graphs the launches become programmatic edges.
Chosen by capability: a Triton without PDL support, or a GPU before Hopper, gets plain launches.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

try:
    from triton.language.extra import cuda as _tl_cuda   # gdc_wait / gdc_launch_dependents
except ImportError:   # pragma: no cover - no Triton, or an older one: kernels launch plainly
    _tl_cuda = None

_ok: dict[int, bool] = {}     # device index -> launch with PDL


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (Triton support, compute capability >= 9)."""
    ok = _ok.get(device.index or 0)
    if ok is None:
        ok = _ok[device.index or 0] = (_tl_cuda is not None and device.type == "cuda"
                                       and torch.cuda.get_device_capability(device)[0] >= 9)
    return ok


def launch(kernel: Any, grid: Sequence[int], args: Sequence[Any], device: torch.device, **kw: Any) -> None:
    """``kernel[grid](*args, **kw)`` with ``USE_PDL`` set: PDL where ``enabled``, else a plain launch.

    A failing PDL launch (a Triton without ``launch_pdl``) switches PDL off for the device and
    relaunches plainly, so a kernel still runs exactly once.
    """
    if enabled(device):
        try:
            kernel[grid](*args, USE_PDL=True, launch_pdl=True, **kw)
            return
        except Exception as e:   # noqa: BLE001 - any Triton-side refusal of the PDL launch
            if _kernel_fault(e):
                raise        # this kernel's own fault (a config over the SM's limits): PDL stays on
            logger.warning("nbgen: programmatic dependent launch unavailable (%s); plain launches", e)
            _ok[device.index or 0] = False
    kernel[grid](*args, USE_PDL=False, **kw)


def _kernel_fault(e: Exception) -> bool:
    """Errors that a plain launch would raise as well (Triton's OutOfResources: shared memory or
    registers over the limit), so they say nothing about PDL support."""
    return type(e).__name__ in ("OutOfResources", "OutOfResourcesError") or "out of resource" in str(e)


if _tl_cuda is not None:
    gdc_wait = _tl_cuda.gdc_wait
    gdc_launch_dependents = _tl_cuda.gdc_launch_dependents
else:   # pragma: no cover - kernels only reference these under USE_PDL=True, which needs Triton's
    gdc_wait = gdc_launch_dependents = None
