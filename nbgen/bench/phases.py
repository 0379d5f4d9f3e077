"""Where a loop step's host time goes, by phase: ``PhaseTimer`` wraps the stepper's public calls.

Wall time of each call on the engine's loop thread, summed over a run: scheduling, the batch
update (``apply``), the inputs and attention plan of a graph step (``stage``, inside ``prepare``
or ``forward``), the forward's launch, the sampling's launch and, inside it, the wait for the
grammar bitmask fill (the fill on the critical path), the wait for the device (``resolve``),
the fill's start, the grammar accepts and jumps (``settle``); and parts of those: the decode page
tables and the shared-prefix plan (in ``stage``), the graph replay and the LM head (in ``forward``),
the attention calls of every layer and the prefill plan or the chunk tables the piecewise graphs read
(in ``forward``, for a step with prompt chunks), the sampler's call or the masked greedy head's replay
(in ``sample``). Cheap (a clock read per call), so the run's throughput barely moves, unlike under
cProfile. Install once the engine has stepped (the decode graphs exist), on an engine without other
wrappers on these calls, or close in reverse order. ``RunPhases`` pairs it with ``StepTimer`` for ``python -m nbgen.bench --phases``,
and counts the run's steps on the piecewise graphs and those whose decode rows / chunks were attended inside them
(the others ran that attention eagerly).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from nbgen.bench.profiling import StepTimer
from nbgen.runtime.fill_worker import FillJob
from nbgen.runtime.grammar_batch import StepGrammar
from nbgen.runtime.sampler import Sampler

# label -> (path from the loop to the object, method name); "" as path: a class (see _CLASSES)
_CALLS: dict[str, tuple[str, str]] = {
    "schedule": ("scheduler", "schedule"),
    "apply": ("scheduler", "update"),
    "prepare": ("runner", "prepare"),
    "forward": ("runner", "forward"),
    "stage": ("runner.graphs", "stage"),
    "sample": ("runner", "sample"),
    "resolve": ("runner", "resolve"),
    "fill_start": ("runner.sampler.constraints", "fill_async"),
    # parts of the phases above: the decode page tables and the shared-prefix plan (inside stage), the
    # graph replay and the LM head (inside forward)
    "tables": ("runner.backend.tables", "fill"),
    "cascade_plan": ("runner.graphs.cascade", "plan"),
    "replay": ("runner.graphs", "replay"),
    "logits": ("runner.model", "compute_logits"),
    "masked_head": ("runner.graphs", "masked_ids"),   # inside sample: a greedy constrained step's head replay
    # inside forward: the attention calls of every layer (eager ones: a step with prompt chunks, the
    # piecewise graphs' layers), and the prefill plan (in prepare / stage, inside forward for those steps)
    "attention": ("runner.backend", "forward"),
    "plan_prefill": ("runner.backend", "plan_prefill"),
    # inside prepare: a mixed step's chunk tables staged for the piecewise graphs (runtime/mixed_chunks.py)
    "stage_chunks": ("runner.prefill_graphs.chunks", "stage"),
    # a step with prompt chunks run as the piecewise graphs (its call count: such steps; see piece_counts)
    "pieces": ("runner.prefill_graphs", "run"),
}
_CLASSES: dict[str, tuple[type, str]] = {
    "fill_wait": (FillJob, "wait"),
    "settle": (StepGrammar, "settle"),
    "sampler": (Sampler, "__call__"),         # inside sample
}


def _resolve_path(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class PhaseTimer:
    """Per-phase wall time on an engine's loop thread while open (see the module docstring)."""

    def __init__(self, eng: Any) -> None:
        self._loop = eng.loop
        self.totals: dict[str, float] = {k: 0.0 for k in (*_CALLS, *_CLASSES)}
        self.calls: dict[str, int] = {k: 0 for k in self.totals}
        self._undo: list[Callable[[], None]] = []
        self._loop.call(self._install)

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        totals, calls, clock = self.totals, self.calls, time.perf_counter

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                totals[label] += clock() - t0
                calls[label] += 1
        return timed

    def _install(self) -> None:
        for label, (path, name) in _CALLS.items():
            obj = _resolve_path(self._loop, path)
            if obj is None or not hasattr(obj, name):
                continue
            own = name in vars(obj)                 # an instance attribute already (another wrapper)
            prev = vars(obj)[name] if own else None
            setattr(obj, name, self._wrap(label, getattr(obj, name)))
            self._undo.append((lambda o=obj, n=name, p=prev: setattr(o, n, p)) if own
                              else (lambda o=obj, n=name: delattr(o, n)))
        for label, (cls, name) in _CLASSES.items():
            orig = vars(cls)[name]
            setattr(cls, name, self._wrap(label, orig))
            self._undo.append(lambda c=cls, n=name, f=orig: setattr(c, n, f))

    def reset(self) -> None:
        def zero() -> None:
            for k in self.totals:
                self.totals[k], self.calls[k] = 0.0, 0
        self._loop.call(zero)

    def summary(self, steps: int) -> dict[str, float]:
        """ms per step of each phase (``steps``: the run's loop steps, e.g. StepTimer's)."""
        return self._loop.call(lambda: {k: 1e3 * v / max(steps, 1) for k, v in self.totals.items()})

    def line(self, steps: int) -> str:
        """One printable line of ``summary``."""
        return "phases ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in self.summary(steps).items())

    def close(self) -> None:
        def undo() -> None:
            for fn in reversed(self._undo):
                fn()
            self._undo.clear()
        self._loop.call(undo)


def piece_counts(loop: Any) -> tuple[int, int, int]:
    """Steps so far whose decode rows, whose chunks the piecewise graphs attended, and steps replayed as one
    graph (runtime/prefill_graphs.py's counters); zeros without piecewise graphs."""
    pg = getattr(loop.runner, "prefill_graphs", None)
    if pg is None:
        return 0, 0, 0
    return (pg.decodes.staged if pg.decodes is not None else 0, pg.chunks.staged if pg.chunks is not None else 0,
            pg.whole_replays)


class RunPhases:
    """A timed run's loop steps (``StepTimer``: device wait and host time a step) and its host time by phase
    (``PhaseTimer``), installed together; ``reset`` before a run, ``report`` after it, ``close`` at the end."""

    def __init__(self, eng: Any) -> None:
        self.steps = StepTimer(eng)
        self.phases = PhaseTimer(eng)        # installed second: its wrappers sit on top
        self._loop = eng.loop
        self._base = (0, 0, 0)

    def reset(self) -> None:
        self.steps.reset()
        self.phases.reset()
        self._base = self._loop.call(lambda: piece_counts(self._loop))

    def report(self, label: str, seconds: float) -> None:
        """Print the run's step line and phase line, each starting with ``label``."""
        st = self.steps.summary()
        print(f"{label}: {seconds:.2f} s, {st['steps']} steps: {st['step_ms']:.2f} ms/step, "
              f"device wait {st['wait_ms']:.2f}, host {st['host_ms']:.2f}", flush=True)
        print(f"{label}: {self.phases.line(st['steps'])}", flush=True)
        pieces, now = self._loop.call(lambda: (self.phases.calls["pieces"], piece_counts(self._loop)))
        if pieces:
            d, c, w = (a - b for a, b in zip(now, self._base))
            print(f"{label}: {pieces} steps on the piecewise graphs: decode rows attended in them {d}, chunks {c}, "
                  f"one graph a step {w}", flush=True)

    def close(self) -> None:
        self.phases.close()                  # before the step timer: its wrappers are on top
        self.steps.close()
