"""The scheduler's knobs: SchedulerConfig (from the loop's resolved EngineConfig) and PriorityConfig
(priority scheduling, SGLang's server-arg names), each validated on construction."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Optional

POLICIES = ("fcfs", "lpm", "lof")


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_integral(v: Any) -> bool:
    """An integer of any type (a Python or numpy int) that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass
class PriorityConfig:
    """Priority scheduling knobs (EngineConfig's names; SGLang's server args plus the bypass guard)."""

    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False   # False: a larger value is more important
    priority_scheduling_preemption_threshold: int = 10  # preempt only when more important by more than this
    disable_priority_preemption: bool = False
    default_priority_value: Optional[int] = None        # None: the least important value there is
    abort_on_priority_when_disabled: bool = False        # priority given while disabled -> abort
    max_priority_bypass: Optional[int] = 32              # admissions passing the oldest waiting one; None: no guard

    def __post_init__(self) -> None:
        for name in ("enable_priority_scheduling", "schedule_low_priority_values_first",
                     "disable_priority_preemption", "abort_on_priority_when_disabled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        t = self.priority_scheduling_preemption_threshold
        if not is_int(t) or t < 0:
            raise ValueError(f"priority_scheduling_preemption_threshold must be an int >= 0, got {t!r}")
        d = self.default_priority_value
        if d is not None and not is_int(d):
            raise ValueError(f"default_priority_value must be None or an int, got {d!r}")
        b = self.max_priority_bypass
        if b is not None and (not is_int(b) or b < 1):
            raise ValueError(f"max_priority_bypass must be None or an int >= 1, got {b!r}")

    @property
    def preempts(self) -> bool:
        """Whether a waiting request may preempt running ones for priority."""
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @classmethod
    def of(cls, cfg: Any) -> "PriorityConfig":
        """The priority fields of an EngineConfig (or anything with those attributes), validated."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler (from the loop's resolved EngineConfig)."""

    page_size: int = 16
    num_pages: int = 1024                       # including the scratch page 0
    max_running_requests: int = 64
    chunked_prefill_size: Optional[int] = 1024  # token budget per step; None or <= 0: unlimited
    schedule_policy: str = "fcfs"               # "fcfs" | "lpm" | "lof"
    disable_radix_cache: bool = False
    context_length: Optional[int] = None        # prompt + output never exceeds it
    max_queued_requests: Optional[int] = None   # waiting requests beyond it are aborted (SGLang's)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    # jump-forward: a step's one-token rows may carry forced tokens up to this many rows
    # (runtime/forced_rows.py; the largest decode graph on CUDA); 0: forced tokens run as a chunk
    forced_token_rows: int = 0
    # decode-aware prefill pacing (runtime/prefill_pacing.py): while every queued request is due before the
    # longest running decode, a step computes at most this many tokens (the full budget otherwise); 0: off
    prefill_pacing_min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if not is_int(self.forced_token_rows) or self.forced_token_rows < 0:
            raise ValueError(f"forced_token_rows must be an int >= 0, got {self.forced_token_rows!r}")
        if not is_int(self.prefill_pacing_min_tokens) or self.prefill_pacing_min_tokens < 0:
            raise ValueError(f"prefill_pacing_min_tokens must be an int >= 0, got {self.prefill_pacing_min_tokens!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
