"""The Qwen2-VL / Qwen2.5-VL vision tower: patch embedding, ViT blocks with 2-D rotary attention
over each image (Qwen2.5: window attention except in ``fullatt_block_indexes``, RMSNorm, SwiGLU),
and the patch merger (2x2 neighbouring patches -> one LLM token).

Input: ``pixel_values`` [N, C * tp * p * p] as the HF image processor flattens patches (grouped so that
each 2x2 merge block is 4 consecutive rows) and ``grid_thw`` [(t, h, w)] per image (patch counts).
Output: [N / merge^2, text hidden] embeddings, images in order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.kernels.vision_ops import rope_2d_, silu_and_mul
from nbgen.models.layers import RMSNorm, default_weight_loader

Grid = tuple[int, int, int]


class SegmentPlan:
    """Attention within consecutive segments of ``lengths`` rows (images, frames or windows), planned once
    per tower forward and reused by every layer: the segments of one length that lie back to back are a
    plain view [B, n, H, D] of q, k, v (no copy; a batch of equal images or full windows is one view);
    the segments of a length scattered among others are gathered by one precomputed index."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        self.total = sum(lengths)
        runs: dict[int, list[tuple[int, int]]] = defaultdict(list)      # length -> [(first row, segments)]
        pos, prev = 0, -1
        for n in lengths:
            if n:
                if n == prev and runs[n][-1][0] + runs[n][-1][1] * n == pos:
                    first, count = runs[n][-1]
                    runs[n][-1] = (first, count + 1)
                else:
                    runs[n].append((pos, 1))
            prev = n
            pos += n
        # (segment length n, segments B, first row of a back-to-back run or None, gather index [B * n] or None)
        self.groups: list[tuple[int, int, Optional[int], Optional[torch.Tensor]]] = []
        for n, rs in runs.items():
            if len(rs) == 1:
                self.groups.append((n, rs[0][1], rs[0][0], None))
                continue
            firsts = [f + j * n for f, c in rs for j in range(c)]
            idx = (torch.tensor(firsts)[:, None] + torch.arange(n)).reshape(-1).to(device)
            self.groups.append((n, len(firsts), None, idx))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention per segment; q, k, v [N, H, D] (any row stride) -> [N, H, D]."""
        N, H, D = q.shape
        if len(self.groups) == 1 and self.groups[0][2] == 0 and self.groups[0][0] * self.groups[0][1] == N:
            n, B = self.groups[0][0], self.groups[0][1]
            o = F.scaled_dot_product_attention(*(t.view(B, n, H, D).transpose(1, 2) for t in (q, k, v)))
            return o.transpose(1, 2).reshape(N, H, D)                            # [B, H, n, D] -> rows
        out = q.new_empty(N, H, D)                        # every row lies in one segment of length > 0
        for n, B, first, idx in self.groups:
            if idx is None:
                qs, ks, vs = (t[first: first + B * n].reshape(B, n, H, D).transpose(1, 2) for t in (q, k, v))
            else:
                qs, ks, vs = (t.index_select(0, idx).view(B, n, H, D).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(B * n, H, D)
            if idx is None:
                out[first: first + B * n] = o
            else:
                out.index_copy_(0, idx, o)
        return out


class GateUpLinear(nn.Linear):
    """gate | up as one linear [2I, E] with bias (replicated on every tensor-parallel rank, as the whole
    tower); ``shard_rows`` / ``weight_loader`` place the HF ``gate_proj`` (0) and ``up_proj`` (1) tensors."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__(dim, 2 * inter, bias=True)
        self.inter = inter
        self.weight.weight_loader = self.weight_loader
        self.bias.weight_loader = self.weight_loader

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of gate (0) or up (1)."""
        assert shard_id in (0, 1), "gate_up_proj loads gate (0) or up (1)"
        return int(shard_id) * self.inter, self.inter

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param if shard_id is None else param.data.narrow(0, *self.shard_rows(shard_id)), loaded)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        N = x.shape[0]
        qkv = self.qkv(x)                                                       # [N, 3 * H * Dh]
        rope_2d_(qkv, cos, sin, self.num_heads, self.head_dim)                  # q, k rotated in place (fp32 math)
        q, k, v = qkv.view(N, 3, self.num_heads, self.head_dim).unbind(1)      # [N, H, Dh] views
        return self.proj(plan.attention(q, k, v).reshape(N, -1))


class VisionBlock(nn.Module):
    """Pre-norm ViT block; ``v25`` selects Qwen2.5-VL's RMSNorm + SwiGLU MLP (with biases; gate and up
    fused into one [2I, E] linear, ``gate_up_proj``).

    ``forward(x, residual, ...)`` -> (mlp output, residual stream): the block's last residual add is
    left to the next block (Qwen2.5-VL: fused into its first RMSNorm, as the decoder layers do)."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str, v25: bool) -> None:
        super().__init__()
        norm = (lambda: RMSNorm(dim, eps=1e-6)) if v25 else (lambda: nn.LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, num_heads)
        self.v25 = v25
        self.silu = act == "silu"
        self.act = _activation(act)
        if v25:
            self.mlp = nn.ModuleDict({"gate_up_proj": GateUpLinear(dim, mlp_dim),
                                      "down_proj": nn.Linear(mlp_dim, dim)})
        else:
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, mlp_dim), "fc2": nn.Linear(mlp_dim, dim)})

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                plan: SegmentPlan) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mlp
        if not self.v25:
            if residual is not None:
                x = x + residual
            x = x + self.attn(self.norm1(x), cos, sin, plan)
            return m["fc2"](self.act(m["fc1"](self.norm2(x)))), x
        if residual is None:
            h, residual = self.norm1(x), x
        else:
            h, residual = self.norm1(x, residual)                                # x + residual, normed
        h, residual = self.norm2(self.attn(h, cos, sin, plan), residual)
        gu = m["gate_up_proj"](h)                                                # [N, 2I]
        if self.silu:
            return m["down_proj"](silu_and_mul(gu)), residual
        g, u = gu.chunk(2, dim=-1)
        return m["down_proj"](self.act(g) * u), residual

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF checkpoint name -> the tensor it loads into (gate_proj / up_proj: row halves of gate_up_proj)."""
        out = {f"{prefix}{k}": p for k, p in self.named_parameters() if ".gate_up_proj." not in k}
        if self.v25:
            gu = self.mlp["gate_up_proj"]
            for shard, name in ((0, "gate_proj"), (1, "up_proj")):
                rows = gu.shard_rows(shard)
                out[f"{prefix}mlp.{name}.weight"] = gu.weight.data.narrow(0, *rows)
                out[f"{prefix}mlp.{name}.bias"] = gu.bias.data.narrow(0, *rows)
        return out


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
        self.ln_q = RMSNorm(dim, eps=1e-6) if v25 else nn.LayerNorm(dim, eps=1e-6)
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
        """cos, sin [N, Dh / 2] fp32: each patch's (row, column) in its image, patches in merge-block order
        (frequencies: the row's then the column's; the rotary pairs column j with j + Dh / 2)."""
        m, pos = self.merge, []
        for t, h, w in grids:
            hh = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            ww = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], dim=-1)
            pos.append(hw.repeat(t, 1))
        p = torch.cat(pos).to(device)                                          # [N, 2]
        f = (p[..., None].float() * self.inv_freq).flatten(1)                  # [N, Dh / 2] = (h freqs | w freqs)
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
        frames = SegmentPlan([h * w for t, h, w in grids for _ in range(t)], x.device)   # full attention
        if not self.v25 or not self.window:
            return self.merger(self._blocks(x, cos, sin, [frames] * len(self.blocks)))
        order, win = self._windows(grids)
        windows = SegmentPlan(win, x.device)
        unit = self.merge * self.merge
        perm = torch.tensor(order, device=x.device)
        N = x.shape[0]

        def permute(t: torch.Tensor) -> torch.Tensor:                        # merge units into window order
            return t.reshape(N // unit, unit, *t.shape[1:])[perm].reshape(t.shape)
        plans = [frames if i in self.full_blocks else windows for i in range(len(self.blocks))]
        x = self._blocks(permute(x), permute(cos), permute(sin), plans)
        return self.merger(x)[torch.argsort(perm)]

    def _blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plans: list[SegmentPlan]) -> torch.Tensor:
        residual = None
        for blk, plan in zip(self.blocks, plans):
            x, residual = blk(x, residual, cos, sin, plan)
        return x + residual

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name (within ``visual.``) -> the tensor it loads into."""
        out = {k: p for k, p in self.named_parameters() if not k.startswith("blocks.")}
        for i, blk in enumerate(self.blocks):
            out.update(blk.checkpoint_tensors(f"blocks.{i}."))
        return out
