"""Cascade decode attention on flashinfer (CUDA): a decode step's rows split by a ``CascadePlan``.

Level 0: each group's query rows against its shared prefix pages, one non-causal paged prefill call
over all groups (``qo_indptr`` = the groups' row bounds): the prefix KV is read once per group
instead of once per row. Level 1: every row against its own remaining pages, flashinfer's paged
decode (tensor-core variant for grouped-query models, as the backend's plain decode). Both return
their log-sum-exps; ``merge_state_in_place`` combines the grouped rows' two parts (flashinfer's
MultiLevelCascadeAttentionWrapper does the same with a prefill call per level; level 1 as a decode
call reads one-query rows at the decode kernel's bandwidth).

The two wrappers share the backend's float workspace (their runs are sequential on one stream, as
in flashinfer's own cascade wrapper) and have their own int workspaces, so both are planned in the
same step. Cascade steps run outside the decode CUDA graphs, since the plan's shapes (groups, rows per
group) change from step to step: through the piecewise graphs (runtime/prefill_graphs.py: each layer's
attention launched between graph pieces) where the model has them, else eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from nbgen.attention.base import KVCacheSpec
from nbgen.attention.page_tables import DecodeTables
from nbgen.core.batch import ScheduledBatch
from nbgen.core.cascade_plan import CascadePlan, plan_cascade

try:
    import flashinfer
except ImportError:  # pragma: no cover - CPU installs
    flashinfer = None


@dataclass
class CascadeStep:
    """A planned cascade step: the grouped rows (level 0's query order) on the device."""

    rows: torch.Tensor           # [R] long, level-0 query rows (group after group) in the batch


def _pinned(values: Any, dtype: type = np.int32) -> torch.Tensor:
    """A pinned host tensor of ``values`` (numpy array or list)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype)).pin_memory()


class FlashInferCascade:
    """The two wrappers of cascade decode steps: chosen per step (``choose``), planned (``plan``), run per
    layer (``run``)."""

    # A decode step runs as cascade when sharing saves at least this many bytes of KV reads per layer
    # (None: never). A cascade step leaves the decode CUDA graphs for the piecewise ones: each layer's
    # attention is launched from the host (two flashinfer runs, the gathers and the merge: ~150 us,
    # an estimate), so the reads it saves per layer must take at least as long on the GPU: 448 MiB
    # is ~160 us at 2.9 TB/s. Then a cascade step is never slower than the plain one. W-prefix's
    # first steps save ~2 GB a layer (Qwen3-0.6B: 8 prefixes x 2,000 tokens x 31 rows x 4 KiB).
    min_saved_layer_bytes: Optional[int] = 448 << 20

    def __init__(self, spec: KVCacheSpec, workspace: torch.Tensor, kv_layout: str, use_tensor_cores: bool,
                 scale: float, tables: DecodeTables) -> None:
        self.spec = spec
        self.scale = scale
        self.tables = tables            # the backend's page tables of decode rows
        # fa2: a prefill kernel that returns the log-sum-exp with the output on every architecture
        self.prefix = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend="fa2")
        self.suffix = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout,
                                                                    use_tensor_cores=use_tensor_cores)
        # plan() stages its scheduling data in the wrapper's pinned host buffer and copies it
        # asynchronously: a wrapper's next plan waits for its previous copy (one event each)
        self._done: dict[int, torch.cuda.Event] = {}
        self._memo: tuple[Optional[ScheduledBatch], Optional[CascadePlan], Any] = (None, None, None)
        self.steps = 0                  # decode steps planned as cascade (the bench reports it)

    def choose(self, batch: ScheduledBatch) -> Optional[CascadePlan]:
        """The plan of a decode-only batch when cascade pays for it (``min_saved_layer_bytes``), else None;
        computed once per batch (the runner asks before choosing the graph path, ``prepare`` again)."""
        if self._memo[0] is batch:
            return self._memo[1]
        plan, slots, sp, seqs = None, None, self.spec, batch.seqs
        if self.min_saved_layer_bytes is not None and len(seqs) > 1 and batch.is_decode_only:
            # first pages of the rows with a full page before their new token's: a repeat is needed
            first = [s.pages[0] for s in seqs if s.start_pos >= sp.page_size]
            if len(set(first)) < len(first):
                ptr, idx, last, _pos, slots = self.tables.build(seqs)
                per_token = sp.bytes_per_page() // (sp.page_size * sp.num_layers)     # K and V of one layer
                plan = plan_cascade(ptr, idx, last, sp.page_size, -(-self.min_saved_layer_bytes // per_token))
        self._memo = (batch, plan, slots)
        return plan

    def slots(self, batch: ScheduledBatch) -> np.ndarray:
        """[B] int64 cache slots of the new tokens of the batch ``choose`` last planned."""
        assert self._memo[0] is batch and self._memo[2] is not None
        return self._memo[2]

    def _planning(self, wrapper: Any) -> None:
        ev = self._done.get(id(wrapper))
        if ev is not None:
            ev.synchronize()

    def _planned(self, wrapper: Any) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self._done[id(wrapper)] = ev

    def plan(self, plan: CascadePlan) -> CascadeStep:
        """Plan both levels of a decode step (host page tables, asynchronous copies)."""
        sp = self.spec
        self.steps += 1
        self._planning(self.suffix)
        self.suffix.plan(_pinned(plan.suffix_kv_indptr), _pinned(plan.suffix_kv_indices),
                         _pinned(plan.suffix_last_page_len), sp.num_q_heads, sp.num_kv_heads, sp.head_dim,
                         sp.page_size, pos_encoding_mode="NONE", q_data_type=sp.dtype, kv_data_type=sp.dtype,
                         sm_scale=self.scale, non_blocking=True)
        self._planned(self.suffix)
        self._planning(self.prefix)
        groups = len(plan.groups)
        self.prefix.plan(_pinned(plan.level0_qo_indptr), _pinned(plan.level0_kv_indptr),
                         _pinned(plan.level0_kv_indices), _pinned([sp.page_size] * groups),   # full pages
                         sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.page_size, causal=False,
                         sm_scale=self.scale, q_data_type=sp.dtype, kv_data_type=sp.dtype, non_blocking=True)
        self._planned(self.prefix)
        return CascadeStep(_pinned(plan.level0_rows, np.int64).to(sp.device, non_blocking=True))

    def run(self, step: CascadeStep, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of the step's one-token rows q [B, Hq, D] -> [B, Hq, D] (``out`` itself when given)."""
        o, lse = self.suffix.run(q, kv, out=out, return_lse=True)        # [B, Hq, D], [B, Hq] fp32
        o0, lse0 = self.prefix.run(q.index_select(0, step.rows), kv, return_lse=True)   # [R, Hq, D], [R, Hq]
        og, lg = o.index_select(0, step.rows), lse.index_select(0, step.rows)
        flashinfer.merge_state_in_place(og, lg, o0, lse0)
        o.index_copy_(0, step.rows, og)
        return o
