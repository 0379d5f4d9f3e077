"""M-RoPE (Qwen2-VL's multimodal rotary embedding) and the 3-D positions of a prompt with images.

Each rotary frequency of a head follows one of three position streams — temporal, height, width —
chosen by ``mrope_section`` (counts of frequencies per stream, summing to head_dim / 2). Text tokens
have the same value in all three streams, so for them M-RoPE equals plain RoPE at that position:
decode steps and text-only prompts run the ordinary 1-D path (CUDA graphs and fused kernels
included); only prefill chunks of prompts with images pass 3-D positions [3, T], whose per-step
cos|sin table (``step_table``, built once for all layers) the same fused RoPE kernel reads.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from nbgen.models.layers import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding that also takes positions [3, T] (temporal, height, width rows)."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: Sequence[int]) -> None:
        super().__init__(head_dim, max_position, base, None)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
        # stream (0, 1, 2) that each of the D/2 frequencies reads, for the cos half and the sin half: [D]
        stream = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        self.register_buffer("stream", torch.cat([stream, stream]), persistent=False)
        self._memo: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None   # (positions, table, rows)

    def step_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [T, D] fp32: row t = token t's cos | sin, each column from its stream; rows [T] = 0..T-1)
        for positions [3, T]: a per-step cos_sin_cache that 1-D RoPE (and its fused kernel) reads at
        ``rows``. Built once per step: every layer passes the same positions tensor."""
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        T = positions.shape[1]
        cs = self.cos_sin_cache[positions]                                 # [3, T, D] fp32
        idx = self.stream.to(positions.device).view(1, 1, -1).expand(1, T, -1)
        table = cs.gather(0, idx).squeeze(0)                               # [T, D]: each column from its stream
        rows = torch.arange(T, device=positions.device)
        self._memo = (positions, table, rows)
        return table, rows

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cs = self.step_table(positions)[0].to(q.dtype)                     # [T, D]
        half = self.head_dim // 2
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def mrope_positions(n_tokens: int, spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]],
                    merge: int) -> tuple[list[list[int]], int]:
    """3-D positions of a prompt of ``n_tokens`` whose images occupy token ``spans`` [(start, end)] with
    patch grids ``grids`` [(t, h, w)] (before the ``merge`` x ``merge`` patch merge), as HF's
    ``get_rope_index``: text counts on from the previous maximum + 1, an image's tokens take
    (t, row, column) offsets from where it starts, and text after it resumes past its largest offset.
    Returns (positions [3][n_tokens], rope_delta): decode position p runs at p + rope_delta."""
    rows: list[list[int]] = [[], [], []]
    cur, last = 0, 0

    def text(n: int) -> None:
        nonlocal cur
        for r in rows:
            r.extend(range(cur, cur + n))
        cur += n

    for (start, end), (t, h, w) in zip(spans, grids):
        text(start - last)
        gh, gw = h // merge, w // merge
        if (end - start) != t * gh * gw:
            raise ValueError(f"image span of {end - start} tokens does not match its grid {t}x{gh}x{gw}")
        for ti in range(t):
            for hi in range(gh):
                rows[0].extend([cur + ti] * gw)
                rows[1].extend([cur + hi] * gw)
                rows[2].extend(range(cur, cur + gw))
        cur += max(gh, gw)
        last = end
    text(n_tokens - last)
    top = max(max(r) for r in rows) if n_tokens else -1
    return rows, top + 1 - n_tokens


def step_positions(prompt_positions: Optional[list[list[int]]], n_prompt: int, rope_delta: int,
                   start: int, end: int) -> list[list[int]]:
    """Rows [3][end - start] of positions start..end-1 of one sequence: the prompt's stored 3-D
    positions, then decode positions p + rope_delta in all three streams."""
    out: list[list[int]] = []
    for r in range(3):
        row = list(prompt_positions[r][start:min(end, n_prompt)]) if prompt_positions is not None else \
            list(range(start, min(end, n_prompt)))
        row.extend(range(max(start, n_prompt) + rope_delta, end + rope_delta))
        out.append(row)
    return out
