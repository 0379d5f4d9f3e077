"""The Qwen2-VL / Qwen2.5-VL vision tower: patch embedding, ViT blocks with 2-D rotary attention
over each image (Qwen2.5: window attention except in ``fullatt_block_indexes``, RMSNorm, SwiGLU),
and the patch merger (2x2 neighbouring patches -> one LLM token).

Input: ``pixel_values`` [N, C * tp * p * p] as the HF image processor flattens patches (grouped so that
each 2x2 merge block is 4 consecutive rows) and ``grid_thw`` [(t, h, w)] per image (patch counts).
Output: [N / merge^2, text hidden] embeddings, images in order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Grid = tuple[int, int, int]


class VisionRMSNorm(nn.Module):
    """RMSNorm in fp32, cast back, then scaled (Qwen2.5-VL's vision norms)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Non-causal attention within consecutive segments of ``lengths`` rows; q, k, v [N, H, D] -> [N, H, D].
    Segments of equal length run as one batched SDPA (every image of a batch, every full window)."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = defaultdict(list)
    pos = 0
    for n in lengths:
        if n:
            starts[n].append(pos)
        pos += n
    for n, firsts in starts.items():
        idx = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        B = len(firsts)
        qs, ks, vs = (t.index_select(0, idx).view(B, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)                       # [B, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(B * n, *q.shape[1:]))
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)    # [N, H, Dh] each
        # 2-D rotary in fp32 (as HF), cos/sin [N, 1, Dh]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(varlen_attention(q, k, v, lengths).reshape(N, -1))


class VisionBlock(nn.Module):
    """Pre-norm ViT block; ``v25`` selects Qwen2.5-VL's RMSNorm + SwiGLU MLP (with biases)."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str, v25: bool) -> None:
        super().__init__()
        norm = (lambda: VisionRMSNorm(dim)) if v25 else (lambda: nn.LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, num_heads)
        self.v25 = v25
        self.act = _activation(act)
        if v25:
            self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(dim, mlp_dim), "up_proj": nn.Linear(dim, mlp_dim),
                                      "down_proj": nn.Linear(mlp_dim, dim)})
        else:
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, mlp_dim), "fc2": nn.Linear(mlp_dim, dim)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h, m = self.norm2(x), self.mlp
        if self.v25:
            return x + m["down_proj"](self.act(m["gate_proj"](h)) * m["up_proj"](h))
        return x + m["fc2"](self.act(m["fc1"](h)))


def _activation(name: str) -> Any:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"vision hidden_act {name!r} is not supported (quick_gelu, silu, gelu)")


class PatchMerger(nn.Module):
    """merge^2 neighbouring patch states -> one LLM token: norm, concat, MLP (Linear, GELU, Linear)."""

    def __init__(self, out_dim: int, dim: int, merge: int, v25: bool) -> None:
        super().__init__()
        self.inner = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim) if v25 else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.inner, self.inner), nn.GELU(), nn.Linear(self.inner, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.inner))


class PatchEmbed(nn.Module):
    """A Conv3d with stride = kernel over flattened patches, i.e. one matmul: [N, C*tp*p*p] -> [N, E]."""

    def __init__(self, in_dim: tuple[int, int, int], dim: int) -> None:
        super().__init__()
        c, tp, p = in_dim
        self.proj = nn.Conv3d(c, dim, kernel_size=(tp, p, p), stride=(tp, p, p), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1))


class VisionTower(nn.Module):
    """``visual``: pixel patches of several images -> their LLM-token embeddings (one forward)."""

    def __init__(self, vc: Any, text_hidden: int, v25: bool) -> None:
        super().__init__()
        self.v25 = v25
        self.merge = int(vc.spatial_merge_size)
        self.patch = int(vc.patch_size)
        dim = int(vc.hidden_size if v25 else vc.embed_dim)
        heads = int(vc.num_heads)
        mlp_dim = int(vc.intermediate_size) if v25 else int(dim * vc.mlp_ratio)
        out_dim = int(getattr(vc, "out_hidden_size", None) or text_hidden) if v25 else int(vc.hidden_size)
        self.window = int(getattr(vc, "window_size", 0) or 0)
        self.full_blocks = set(getattr(vc, "fullatt_block_indexes", None) or []) if v25 else None
        self.patch_embed = PatchEmbed((int(vc.in_channels), int(vc.temporal_patch_size), self.patch), dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, mlp_dim, vc.hidden_act, v25) for _ in range(vc.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, v25)
        hd = dim // heads
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, hd // 2, 2, dtype=torch.float) / (hd // 2)),
                             persistent=False)

    def _cos_sin(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, Dh]: each patch's (row, column) in its image, patches in merge-block order."""
        m, pos = self.merge, []
        for t, h, w in grids:
            hh = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            ww = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], dim=-1)
            pos.append(hw.repeat(t, 1))
        p = torch.cat(pos).to(device)                                          # [N, 2]
        f = (p[..., None].float() * self.inv_freq).flatten(1)                  # [N, Dh / 2] = (h freqs | w freqs)
        f = torch.cat([f, f], dim=-1)[:, None, :]
        return f.cos(), f.sin()

    def _windows(self, grids: Sequence[Grid]) -> tuple[list[int], list[int]]:
        """(merge-unit order that makes each window contiguous, window lengths in patches)."""
        ws = self.window // self.merge // self.patch
        unit = self.merge * self.merge
        order, lengths, base = [], [], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            for ti in range(t):
                for r0 in range(0, gh, ws):
                    for c0 in range(0, gw, ws):
                        ids = [base + ti * gh * gw + r * gw + c for r in range(r0, min(r0 + ws, gh))
                               for c in range(c0, min(c0 + ws, gw))]
                        order.extend(ids)
                        lengths.append(len(ids) * unit)
            base += t * gh * gw
        return order, lengths

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.patch_embed(pixel_values)                                    # [N, E]
        cos, sin = self._cos_sin(grids, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]               # full attention: per frame
        if not self.v25 or not self.window:
            for blk in self.blocks:
                x = blk(x, cos, sin, frames)
            return self.merger(x)
        order, win = self._windows(grids)
        unit = self.merge * self.merge
        perm = torch.tensor(order, device=x.device)
        N = x.shape[0]

        def permute(t: torch.Tensor) -> torch.Tensor:                        # merge units into window order
            return t.reshape(N // unit, unit, *t.shape[1:])[perm].reshape(t.shape)
        x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in self.full_blocks else win)
        return self.merger(x)[torch.argsort(perm)]
