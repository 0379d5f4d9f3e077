"""The cyclic GC and the engine's long-lived heap: frozen after start-up, again after code loads.

A full collection walks every tracked object while holding the GIL; torch, transformers and a
model's modules are millions of them. ``freeze_heap`` (a loop finished building) moves them out of
the collector's reach; ``freeze_new_code`` (a loop went idle after steps) freezes again when modules
were imported meanwhile; ``thaw_heap`` (a loop stopped) makes everything collectable once the last
live loop is gone. vLLM and SGLang freeze after start-up too.
"""
from __future__ import annotations

import gc
import sys
import threading

_frozen_by = 0                 # live loops that froze the heap
_modules_at_freeze = 0         # len(sys.modules) at the last freeze
_frozen_lock = threading.Lock()


def freeze_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model's modules) out of the
    cyclic GC's reach. Otherwise a full collection, which a batch's many short-lived objects trigger
    every so often, walks millions of them while holding the GIL, and the GPU idles meanwhile."""
    global _frozen_by, _modules_at_freeze
    with _frozen_lock:
        _frozen_by += 1
        gc.collect()
        gc.freeze()
        _modules_at_freeze = len(sys.modules)


def freeze_new_code() -> None:
    """At an idle point after steps: freeze again if modules were imported since the last freeze.

    The first steps load code lazily (on CUDA the first prefill brings flashinfer's prefill module and
    its imports, hundreds of thousands of objects); left unfrozen, every later full collection walks
    them in the middle of a run. ``gc.freeze()`` without a collection is O(1); cyclic garbage
    alive at that moment stays uncollected until the last engine stops (bounded: only when code was
    loaded, which happens a few times per process)."""
    global _modules_at_freeze
    with _frozen_lock:
        if _frozen_by > 0 and len(sys.modules) != _modules_at_freeze:
            _modules_at_freeze = len(sys.modules)
            gc.freeze()


def thaw_heap() -> None:
    """After the last live loop stops, frozen objects become collectable again (and get finalised at
    exit: extension objects left frozen are reported as leaks there)."""
    global _frozen_by
    with _frozen_lock:
        _frozen_by = max(0, _frozen_by - 1)
        if _frozen_by == 0:
            gc.unfreeze()
