"""The Qwen2-VL / Qwen2.5-VL vision tower: patch embedding, ViT blocks with 2-D rotary attention
over each image (Qwen2.5: window attention except in ``fullatt_block_indexes``, RMSNorm, SwiGLU),
and the patch merger (2x2 neighbouring patches -> one LLM token).

Input: ``pixel_values`` [N, C * tp * p * p] as the HF image processor flattens patches (grouped so that
each 2x2 merge block is 4 consecutive rows) and ``grid_thw`` [(t, h, w)] per image (patch counts).
Output: [N / merge^2, text hidden] embeddings, images in order.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.kernels.vision_ops import rope_2d_, silu_and_mul
from nbgen.models.layers import RMSNorm, default_weight_loader
from nbgen.models.vision_plan import (Grid, PlanCache, SegmentPlan, TowerPlan, rotary_positions, to_device_async,
                                      vision_sdpa, window_order)


MLP_ALIGN = 64   # the MLP width is padded to a multiple of this (see VisionBlock)


def padded_width(inter: int) -> int:
    """``inter`` rounded up to a multiple of MLP_ALIGN."""
    return -(-inter // MLP_ALIGN) * MLP_ALIGN


class GateUpLinear(nn.Linear):
    """gate | up as one linear [2 Ip, E] with bias (replicated on every tensor-parallel rank, as the whole
    tower), each half padded from ``inter`` to ``Ip = padded_width(inter)`` rows of zeros;
    ``shard_rows`` / ``weight_loader`` place the HF ``gate_proj`` (0) and ``up_proj`` (1) tensors."""

    def __init__(self, dim: int, inter: int) -> None:
        self.inter, self.padded = inter, padded_width(inter)
        super().__init__(dim, 2 * self.padded, bias=True)
        self.weight.weight_loader = self.weight_loader
        self.bias.weight_loader = self.weight_loader

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first row, rows) of gate (0) or up (1)."""
        assert shard_id in (0, 1), "gate_up_proj loads gate (0) or up (1)"
        return int(shard_id) * self.padded, self.inter

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
            # Qwen2.5-VL's width 3420 leaves the down projection's rows 8 bytes short of 16-byte
            # alignment, and cuBLAS then runs an sm80 fallback GEMM at a third of the speed (38 % of
            # the 7B tower's time at 32 images): the width is padded to a multiple of 64 with zero
            # gate / up rows and zero down columns, which add exactly nothing (silu(0) * 0 = 0)
            gate_up = GateUpLinear(dim, mlp_dim)
            down = nn.Linear(gate_up.padded, dim)
            with torch.no_grad():
                for half in (0, 1):
                    first = half * gate_up.padded + mlp_dim
                    gate_up.weight[first: (half + 1) * gate_up.padded].zero_()
                    gate_up.bias[first: (half + 1) * gate_up.padded].zero_()
                down.weight[:, mlp_dim:].zero_()
            # the checkpoint's [E, I] tensor is the first I columns (weight updates and reads by HF name)
            down.weight.checkpoint_cols = (0, mlp_dim)
            down.weight.weight_loader = lambda param, loaded, shard_id=None: \
                default_weight_loader(param.data.narrow(1, 0, mlp_dim), loaded)
            self.mlp = nn.ModuleDict({"gate_up_proj": gate_up, "down_proj": down})
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
            out[f"{prefix}mlp.down_proj.weight"] = self.mlp["down_proj"].weight.data.narrow(1, 0, gu.inter)
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
        self._plans = PlanCache(self._build_plan)

    def _build_plan(self, grids: tuple[Grid, ...], device: torch.device) -> TowerPlan:
        """The plan of one grid signature (``PlanCache`` calls it on a miss): cos, sin [N, Dh / 2] fp32 of
        each patch's (row, column) (frequencies: the row's then the column's; the rotary pairs column j
        with j + Dh / 2), Qwen2.5's window order, and the blocks' attention segments."""
        p = to_device_async(rotary_positions(grids, self.merge), device)       # [N, 2]
        f = (p[..., None].float() * self.inv_freq).flatten(1)                  # [N, Dh / 2] = (h freqs | w freqs)
        cos, sin = f.cos(), f.sin()
        frames = SegmentPlan([h * w for t, h, w in grids for _ in range(t)], device)   # full attention
        if not self.v25 or not self.window:
            return TowerPlan(grids, cos, sin, [frames] * len(self.blocks), None, None)
        order, win = window_order(grids, self.merge, self.window // self.merge // self.patch)
        windows = SegmentPlan(win, device)
        perm = to_device_async(order, device)
        blocks = [frames if i in self.full_blocks else windows for i in range(len(self.blocks))]
        return TowerPlan(grids, _permute(cos, perm, self.merge), _permute(sin, perm, self.merge), blocks, perm,
                         torch.argsort(perm))

    def plan(self, grids: Sequence[Grid], device: torch.device) -> TowerPlan:
        """The plan of ``grids`` on ``device`` (cached by grid signature)."""
        return self._plans.get(grids, device)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Patches [N, C*tp*p*p] of ``grids``' images -> their merged token embeddings."""
        plan = self.plan(grids, pixel_values.device)
        x = self.patch_embed(pixel_values)                                    # [N, E]
        with vision_sdpa(x.device):
            if plan.perm is None:
                return self.merger(self._blocks(x, plan))
            x = self._blocks(_permute(x, plan.perm, self.merge), plan)        # merge units in window order
        return self.merger(x)[plan.inverse]

    def _blocks(self, x: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        residual = None
        for blk, segments in zip(self.blocks, plan.blocks):
            x, residual = blk(x, residual, plan.cos, plan.sin, segments)
        return x + residual

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF checkpoint name (within ``visual.``) -> the tensor it loads into."""
        out = {k: p for k, p in self.named_parameters() if not k.startswith("blocks.")}
        for i, blk in enumerate(self.blocks):
            out.update(blk.checkpoint_tensors(f"blocks.{i}."))
        return out


def _permute(t: torch.Tensor, perm: torch.Tensor, merge: int) -> torch.Tensor:
    """Rows of ``t`` [N, ...] moved by merge unit (merge^2 consecutive rows) into the order ``perm``."""
    unit = merge * merge
    return t.reshape(t.shape[0] // unit, unit, *t.shape[1:])[perm].reshape(t.shape)
