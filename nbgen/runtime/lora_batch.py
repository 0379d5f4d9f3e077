"""How many LoRA adapters one running batch may hold (``max_loras_per_batch``), checked at admission
(torch-free).

As SGLang's scheduler: the running requests' adapter ids, the ones admitted in this scan and the
candidate's form a set in which the base model (``None``) counts like an adapter; a batch may hold
at most ``max_loras_per_batch`` of them, fewer free ones when pinned adapters are loaded (a pinned
adapter keeps its slot: ``required = ids - pinned ids in the batch`` must fit ``max - pinned``).
A request under an adapter that does not fit is passed over and waits; base-model requests are never
held back by the limit (SGLang: they need no adapter slot), nor are requests of an adapter the batch
holds already (they need no new slot; SGLang would re-check the whole set, base included). So a batch never holds more than
``max_loras_per_batch`` adapters besides the base model: the size of the GPU slot pool.

Starvation guard (nbgen's): SGLang passes a blocked request over for as long as requests of the
adapters already running keep arriving. Here a blocked request that has seen ``patience`` admissions
go past it stops the scan at itself: nothing behind it in the queue is admitted until the adapters
running drain and it fits.
"""
from __future__ import annotations

from typing import Container, Optional

from nbgen.core.request import Request


class LoRABatchLimit:
    """The adapter limit of one engine's batches; the pinned ids are kept by the adapter registry."""

    def __init__(self, max_loras_per_batch: int, patience: int) -> None:
        self.max_loras = max_loras_per_batch
        self.patience = patience                    # admissions a blocked request lets pass
        self.pinned: set[int] = set()               # lora ids of the pinned adapters loaded
        self._blocked_at: dict[str, int] = {}       # rid -> admission counter when first blocked

    def fits(self, ids: set[Optional[int]]) -> bool:
        """Whether a batch holding the adapters ``ids`` (None = base) fits the slots (SGLang's
        ``validate_lora_batch``)."""
        if len(ids) > self.max_loras:
            return False
        if not self.pinned:
            return True
        pinned_in = sum(1 for i in ids if i is not None and i in self.pinned)
        return len(ids) - pinned_in <= self.max_loras - len(self.pinned)

    def check(self, req: Request, ids: set[Optional[int]], admitted: int) -> str:
        """At admission: "admit", "skip" (pass it over, it waits) or "stop" (end the scan: it has
        waited long enough). ``ids``: the adapter ids of the running requests and of those admitted
        in this scan (the caller keeps it); ``admitted``: the admission counter (one per admission)."""
        if req.lora_id is None or req.lora_id in ids:
            self._blocked_at.pop(req.rid, None)
            return "admit"
        if self.fits(ids | {req.lora_id}):
            self._blocked_at.pop(req.rid, None)
            return "admit"
        first = self._blocked_at.setdefault(req.rid, admitted)
        return "stop" if admitted - first >= self.patience else "skip"

    def prune(self, live: Container[str]) -> None:
        """Forget blocked requests no longer live (aborted while waiting); called now and then."""
        if len(self._blocked_at) > 256:
            self._blocked_at = {rid: n for rid, n in self._blocked_at.items() if rid in live}

    def starving(self) -> int:
        """Requests passed over by the limit at least once and still waiting (the stats)."""
        return len(self._blocked_at)
