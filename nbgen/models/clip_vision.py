"""CLIP vision encoder (``CLIPVisionModel``) as LLaVA uses it: patch and position embeddings, the
pre-LayerNorm, and the encoder layers up to the one whose hidden states feed the projector.

Only the layers the selected feature layer needs are built (``vision_feature_layer=-2`` skips the last
layer and ``post_layernorm``); their checkpoint tensors are skipped on load (``skipped``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.models.vision_plan import vision_sdpa


def activation(name: str) -> Any:
    """An HF activation name (CLIP: ``quick_gelu``; projector: ``gelu``) -> a tensor function."""
    acts = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
    if name not in acts:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(acts)})")
    return acts[name]


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, D] -> [N, S, D]: full bidirectional attention within each image."""
        n, s, d = x.shape
        q, k, v = (p(x).view(n, s, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))          # [N, heads, S, hd]
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(n, s, d))


class CLIPMLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, inner), nn.Linear(inner, dim), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(d, cfg.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(d, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, kernel_size=p, stride=p, bias=False)
        self.num_positions = (cfg.image_size // p) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] -> [N, 1 + (S/p)^2, D]: CLS token first, then the patches row by row."""
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)   # [N, P, D]
        if patches.shape[1] + 1 != self.num_positions:
            raise ValueError(f"image of {tuple(pixel_values.shape[-2:])} pixels gives {patches.shape[1]} patches; "
                             f"the vision tower takes {self.num_positions - 1} (resize to its image_size)")
        cls = self.class_embedding.to(w.dtype).expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(nn.Module):
    """``vision_model.*`` of a CLIPVisionModel; ``forward`` returns the hidden states of layer
    ``feature_layer`` (HF's ``hidden_states[feature_layer]``: index 0 is the embeddings output)."""

    def __init__(self, cfg: Any, feature_layer: int) -> None:
        super().__init__()
        total = cfg.num_hidden_layers
        self.depth = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
        if not 0 <= self.depth <= total:
            raise ValueError(f"vision_feature_layer {feature_layer} is outside the tower's {total} layers")
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(self.depth))

    def skipped(self, name: str) -> bool:
        """True for checkpoint tensors (names under ``vision_model.``) the selected layer never reads."""
        if name.startswith(("post_layernorm.", "embeddings.position_ids")):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= self.depth
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> hidden states [N, 1 + P, D] of the feature layer."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        with vision_sdpa(x.device):                    # no per-batch-size cuDNN plans
            for layer in self.encoder.layers:
                x = layer(x)
        return x
