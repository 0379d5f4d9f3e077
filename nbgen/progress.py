"""tqdm.auto progress for long batch calls: requests done plus input/output tok/s."""
from __future__ import annotations

import time
from typing import Any


class BatchProgress:
    """A progress bar over a batch's requests (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool, desc: str = "generate") -> None:
        self.bar = None
        self.t0 = time.perf_counter()
        self.n_in = self.n_out = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)

    def update(self, output: dict[str, Any]) -> None:
        if self.bar is None:
            return
        meta = output["meta_info"]
        self.n_in += meta["prompt_tokens"]
        self.n_out += meta["completion_tokens"]
        dt = max(time.perf_counter() - self.t0, 1e-6)
        self.bar.set_postfix_str(f"in {self.n_in / dt:,.0f} tok/s, out {self.n_out / dt:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
