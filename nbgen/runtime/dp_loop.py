"""Data parallelism: ``dp_size`` replicas behind one Engine, each a whole LoopThread (its own
scheduler, prefix cache, model; on CUDA its own GPUs from ``base_gpu_id``), presenting the
LoopThread interface the Engine facade uses. Requests are routed by ``dp_router.Router``; stats are
summed with the per-replica numbers under ``"replicas"``.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
from typing import Any, Callable, Optional, Union

from nbgen.core.config import EngineConfig
from nbgen.core.multimodal import settle_all
from nbgen.core.request import Request
from nbgen.runtime.delivery import Sink
from nbgen.runtime.dp_router import PlanItem, Router, request_cost
from nbgen.runtime.engine_parts import weight_bytes
from nbgen.runtime.loop import LoopThread
from nbgen.runtime.profiler import ProfileOptions, ProfileResult
from nbgen.runtime.stream_buffer import StreamBuffer
from nbgen.runtime.tracker import Update

# stats keys that are not summed over replicas: the same everywhere, or the newest / longest
_SAME = ("page_size",)
_MAX = ("uptime_s", "time")


def replica_config(cfg: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s config: one replica, its GPUs after the previous replicas' ones."""
    out = copy.copy(cfg)
    out.dp_size = 1
    out.base_gpu_id = cfg.base_gpu_id + index * cfg.tp_size
    return out


def _sum(values: list[Any]) -> Any:
    """Numbers summed; dicts (per-priority counts) summed key by key; anything else: the first."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    return values[0]


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's stats from its replicas': counts and rates summed, per-replica detail kept."""
    out: dict[str, Any] = {}
    for key, value in parts[0].items():
        values = [p.get(key) for p in parts]
        if key in _SAME:
            out[key] = value
        elif key in _MAX:
            out[key] = max(values)
        else:
            out[key] = _sum(values)
    out["dp_size"] = len(parts)
    out["replicas"] = parts
    return out


class DPLoop:
    """``dp_size`` LoopThreads behind the LoopThread interface."""

    def __init__(self, cfg: EngineConfig, on_stage: Optional[Callable[[str], None]] = None) -> None:
        self.cfg = cfg
        # only the first replica reports start-up stages (they all pass the same ones)
        self.replicas = [LoopThread(replica_config(cfg, i), on_stage=on_stage if i == 0 else None)
                         for i in range(cfg.dp_size)]
        self.router = Router(cfg.dp_size)

    # ---- the LoopThread interface ---------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the first replica alone (its imports are not thread-safe the first time: transformers
        loads lazily), then the others in parallel."""
        try:
            info = self.replicas[0].start()
        except BaseException:
            self.shutdown()
            raise
        with cf.ThreadPoolExecutor(max(1, len(self.replicas) - 1), thread_name_prefix="nbgen-dp-start") as pool:
            futures = [pool.submit(r.start) for r in self.replicas[1:]]
            cf.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self.shutdown()
            raise errors[0]
        # a decode step reads all the weights whatever its rows: its fixed part, in KV tokens read
        first = self.replicas[0]
        wb, kv = first.call(lambda: (weight_bytes(first.runner), first.runner.kv_spec))
        self.router.step_cost = wb * kv.page_size // max(kv.bytes_per_page(), 1)
        return info

    def submit(self, reqs: list[Request], sink: Sink, stream: bool) -> None:
        """Route each request (a sample group or session together) and submit per replica."""
        settle_all(reqs)     # image ids still hashed on the caller's pool: routing reads the prompt
        groups: dict[str, int] = {}
        parts: dict[int, list[Request]] = {}
        routed: list[str] = []
        steps = [max(r.params.max_new_tokens or 0, 1) for r in reqs]
        costs = [request_cost(len(r.prompt_ids), n) for r, n in zip(reqs, steps)]
        plan = self.router.plan([PlanItem(c, n) for c, n in zip(costs, steps)])
        try:
            for r, c, n, p in zip(reqs, costs, steps, plan):
                i = self.router.route(r.rid, r.prompt_ids, r.group,
                                      r.session.id if r.session is not None else None, groups,
                                      cost=c, steps=n, planned=p)
                routed.append(r.rid)
                parts.setdefault(i, []).append(r)
        except ValueError:
            for rid in routed:
                self.router.done(rid)
            raise

        def tracked(update: Update) -> None:
            if update.finished:
                self.router.done(update.rid)
            sink(update)

        target: Sink = tracked
        if isinstance(sink, StreamBuffer):   # passed on as itself: the replica hands it ids only
            sink.finish_hooks.append(self.router.done)
            target = sink
        ordered = sorted(parts.items())
        for n, (i, part) in enumerate(ordered):
            try:
                self.replicas[i].submit(part, target, stream)
            except (RuntimeError, ValueError) as e:
                for _j, rest in ordered[n:]:
                    for r in rest:
                        self.router.done(r.rid)
                sent = [r.rid for _j, rest in ordered[:n] for r in rest]
                if sent:     # the call is refused as a whole: its requests already on other replicas end too
                    self.abort(sent, f"another request of the same call was refused: {e}")
                raise

    def abort(self, rids: list[str], message: str = "aborted by the caller", wait: bool = False) -> None:
        """Abort requests on the replicas holding them (unknown ids go to every replica)."""
        per: dict[int, list[str]] = {}
        for rid in rids:
            i = self.router.where(rid)
            for j in ([i] if i is not None else range(len(self.replicas))):
                per.setdefault(j, []).append(rid)
        for i, part in per.items():
            self.replicas[i].abort(part, message, wait)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the first replica's loop thread (engine-wide calls use the methods below)."""
        return self.replicas[0].call(fn)

    def call_exclusive(self, fn: Callable[[], Any]) -> Any:
        return self.replicas[0].call_exclusive(fn)

    def stats(self) -> dict[str, Any]:
        out = merge_stats([r.stats() for r in self.replicas])
        out["dp_prefix_routed"] = self.router.prefix_routed
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.replicas)

    @property
    def runner(self) -> Any:
        return self.replicas[0].runner

    @property
    def weights(self) -> Any:
        """The first replica's weights (for ``weight_version``; updates need dp_size 1)."""
        return self.replicas[0].weights

    @property
    def memory(self) -> Any:
        return self.replicas[0].memory

    # ---- LoopControl's calls ----------------------------------------------------------------------
    def open_session(self, capacity: int, session_id: str, streaming: bool,
                     timeout: Optional[float]) -> Optional[str]:
        """Open a session on the least-loaded replica; its requests go there. An id already bound
        goes back to its replica, which refuses it while open: another replica must not open it too."""
        i = self.router.session_replica(session_id)
        if i is None:
            i = self.router.least_loaded()
        sid = self.replicas[i].open_session(capacity, session_id, streaming, timeout)
        if sid is not None:
            self.router.bind_session(sid, i)
        return sid

    def close_session(self, session_id: str) -> None:
        i = self.router.unbind_session(session_id)
        self.replicas[i if i is not None else 0].close_session(session_id)

    def start_profile(self, opts: ProfileOptions) -> None:
        """Profile the first replica's loop thread."""
        self.replicas[0].start_profile(opts)

    def stop_profile(self) -> ProfileResult:
        return self.replicas[0].stop_profile()

    def flush_cache(self) -> bool:
        return all([r.flush_cache() for r in self.replicas])

    def server_info(self) -> dict[str, Any]:
        """The first replica's runner facts, each replica's under ``"replicas"``."""
        infos = [r.server_info() for r in self.replicas]
        return {**infos[0], "dp_size": len(infos), "replicas": infos}


def make_loop(cfg: EngineConfig, on_stage: Optional[Callable[[str], None]] = None) -> Union[LoopThread, DPLoop]:
    """The Engine's loop: a LoopThread, or ``dp_size`` of them behind a DPLoop."""
    return DPLoop(cfg, on_stage) if cfg.dp_size > 1 else LoopThread(cfg, on_stage)
