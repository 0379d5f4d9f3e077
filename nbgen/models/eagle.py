"""EAGLE / EAGLE3 draft heads (SGLang's ``LlamaForCausalLMEagle`` / ``LlamaForCausalLMEagle3`` checkpoints).

EAGLE: ``fc(cat(embed(x_{i+1}), h_i))`` -> decoder layer(s) (layer 0 without its input norm) -> ``out``
(no final norm); logits are the target's ``lm_head(out)``; ``out`` is the hidden input of the next
draft step. EAGLE3: ``h_i`` is the concat of three target layers' hidden states, reduced by ``fc``;
one ``midlayer`` whose attention reads ``cat(input_layernorm(embed), hidden_norm(h))`` [2H]; logits are
its own ``lm_head(norm(out))`` over a reduced vocabulary mapped back to target ids by ``d2t``.

Attention is eager torch over a per-request KV cache (``DraftCache``): the draft is one layer and
its cost is small next to the target's verify forward.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nbgen.models.layers import get_rope, rope_settings

EAGLE_ARCHS = ("LlamaForCausalLMEagle",)
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3",)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class _Norm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


@dataclass
class DraftCache:
    """One request's draft KV: per layer K, V [n, Hkv, D] at positions ``pos`` [n]."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def truncate(self, n: int) -> None:
        self.k = [t[:n] for t in self.k]
        self.v = [t[:n] for t in self.v]


class _Attn(nn.Module):
    def __init__(self, cfg: object, in_size: int, rope: nn.Module) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or H // self.nh
        self.q_proj = nn.Linear(in_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: DraftCache, li: int,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] of one request at positions pos [T], appended to its cache -> [T, H]; ``mask``
        [T, n] bool over the cache after the append (default causal)."""
        T = x.shape[0]
        q, k = self.rope(pos, self.q_proj(x).contiguous(), self.k_proj(x).contiguous())
        q, k = q.reshape(T, self.nh, self.hd), k.reshape(T, self.nkv, self.hd)
        v = self.v_proj(x).reshape(T, self.nkv, self.hd)
        if len(cache.k) <= li:
            cache.k.append(k)
            cache.v.append(v)
        else:
            cache.k[li] = torch.cat([cache.k[li], k])
            cache.v[li] = torch.cat([cache.v[li], v])
        K, V = cache.k[li], cache.v[li]                                    # [n, Hkv, D]
        n = K.shape[0]
        rep = self.nh // self.nkv
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        # causal: query t (the last T of n) sees keys 0 .. n - T + t
        if mask is None:
            mask = torch.ones(T, n, dtype=torch.bool, device=x.device).tril(n - T)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1), attn_mask=mask)
        return self.o_proj(o.transpose(0, 1).reshape(T, self.nh * self.hd))

    def paged(self, x: torch.Tensor, pos: torch.Tensor, meta: Any, li: int) -> torch.Tensor:
        """x [T, in] of many requests' rows (a flat step) at positions pos [T] -> [T, H], K/V written to and
        read from the paged pool of ``meta``'s backend (its layer ``li``)."""
        q, k = self.rope(pos, self.q_proj(x).contiguous(), self.k_proj(x).contiguous())    # [T, Hq*D], [T, Hkv*D]
        o = meta.backend.forward(li, q, k, self.v_proj(x).contiguous(), meta)               # [T, Hq*D]
        return self.o_proj(o)


class _MLP(nn.Module):
    def __init__(self, H: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: object, attn_in: int, rope: nn.Module, input_norm: bool, hidden_norm: bool) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attn(cfg, attn_in, rope)
        self.mlp = _MLP(H, cfg.intermediate_size)
        self.input_layernorm = _Norm(H, eps) if input_norm else None
        self.hidden_norm = _Norm(H, eps) if hidden_norm else None
        self.post_attention_layernorm = _Norm(H, eps)


class EagleDraft(nn.Module):
    """An EAGLE (``eagle3=False``) or EAGLE3 draft head; ``step`` runs rows of one request."""

    def __init__(self, cfg: object, eagle3: bool, target_hidden: int) -> None:
        super().__init__()
        self.cfg, self.eagle3 = cfg, eagle3
        H = cfg.hidden_size
        theta, scaling = rope_settings(cfg)
        hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        rope = get_rope(hd, cfg.max_position_embeddings, theta, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if eagle3:
            if cfg.num_hidden_layers != 1:
                raise ValueError("speculative_draft_model_path: nbgen's EAGLE3 head has one midlayer, "
                                 f"got num_hidden_layers={cfg.num_hidden_layers}")
            self.fc = nn.Linear(3 * target_hidden, H, bias=bool(getattr(cfg, "bias", False)))
            self.midlayer = _Layer(cfg, 2 * H, rope, True, True)
            self.norm = _Norm(H, cfg.rms_norm_eps)
            self.draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
            self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        else:
            self.fc = nn.Linear(2 * H, H, bias=True)
            self.layers = nn.ModuleList(_Layer(cfg, H, rope, i > 0, False) for i in range(cfg.num_hidden_layers))

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, cache: DraftCache,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [T], hidden [T, Hin] (target features or the draft's own outputs), pos [T] -> out [T, H];
        ``mask`` [T, cache rows after the step] bool: which rows each new row attends to (tree drafts;
        default causal)."""
        return self._body(ids, hidden, lambda attn, x, li: attn(x, pos, cache, li, mask))

    def step_paged(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        """``step`` over a flat step of many requests' rows with a paged KV cache (``meta``: the head's own
        attention backend's metadata of the step) -> out [T, H]."""
        return self._body(ids, hidden, lambda attn, x, li: attn.paged(x, pos, meta, li))

    def _body(self, ids: torch.Tensor, hidden: torch.Tensor,
              attend: Callable[["_Attn", torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """The head over rows (ids [T], features [T, Hin]); ``attend(attention module, x, layer)`` -> [T, H]."""
        e = self.embed_tokens(ids)
        eps = self.cfg.rms_norm_eps
        if self.eagle3:
            h = self.fc(hidden) if hidden.shape[-1] != e.shape[-1] else hidden
            L = self.midlayer
            x = torch.cat([L.input_layernorm(e), L.hidden_norm(h)], dim=-1)
            res = h + attend(L.self_attn, x, 0)
            return res + L.mlp(L.post_attention_layernorm(res))
        x = self.fc(torch.cat([e, hidden], dim=-1))
        for i, L in enumerate(self.layers):
            x = x + attend(L.self_attn, L.input_layernorm(x) if L.input_layernorm is not None else x, i)
            x = x + L.mlp(_rms(x, L.post_attention_layernorm.weight, eps))
        return x

    def logits_to_tokens(self, out: torch.Tensor, target_head: Callable[[torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
        """Greedy draft token ids [T] (target vocabulary) from draft outputs [T, H]."""
        if self.eagle3:
            best = self.lm_head(self.norm(out)).argmax(-1)
            return best + self.d2t[best]
        return target_head(out).argmax(-1)


    def topk(self, out: torch.Tensor, target_head: Callable[[torch.Tensor], torch.Tensor], k: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely draft tokens of each row of ``out`` [T, H]: (probabilities [T, k] fp32,
        target-vocabulary ids [T, k]), most likely first."""
        if self.eagle3:
            p, best = torch.softmax(self.lm_head(self.norm(out)).float(), -1).topk(k, -1)
            return p, best + self.d2t[best]
        return torch.softmax(target_head(out).float(), -1).topk(k, -1)


def load_eagle(path: str, target_hidden: int, embed: nn.Module, dtype: torch.dtype, device: torch.device
               ) -> EagleDraft:
    """Load an EAGLE / EAGLE3 checkpoint directory (config.json + safetensors / bin); missing
    ``embed_tokens`` (and an EAGLE3 ``lm_head`` without ``draft_vocab_size``) come from the target."""
    import transformers as tf
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    arch = (raw.get("architectures") or [""])[0]
    if arch not in EAGLE_ARCHS + EAGLE3_ARCHS:
        raise ValueError(f"speculative_draft_model_path: {arch!r} is not an EAGLE head "
                         f"({EAGLE_ARCHS + EAGLE3_ARCHS})")
    cfg = tf.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    for k in ("draft_vocab_size", "bias", "target_hidden_size"):
        if k in raw:
            setattr(cfg, k, raw[k])
    model = EagleDraft(cfg, arch in EAGLE3_ARCHS, getattr(cfg, "target_hidden_size", None) or target_hidden)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
        elif name.endswith(".bin"):
            state.update(torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    state.pop("t2d", None)
    state.pop("layers.0.input_layernorm.weight", None)   # EAGLE's layer 0 has no input norm
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = embed.weight.detach()[: cfg.vocab_size]
    if model.eagle3 and "d2t" not in state:
        state["d2t"] = torch.zeros(model.draft_vocab, dtype=torch.long)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq") and "rope" not in m]
    if missing or unexpected:
        raise ValueError(f"speculative_draft_model_path: EAGLE weights do not match ({missing=}, {unexpected=})")
    vocab = getattr(embed, "num_embeddings", embed.weight.shape[0])
    if model.eagle3:          # draft id i stands for target id i + d2t[i]: it must exist in the target
        top = int((torch.arange(model.draft_vocab) + model.d2t).max())
        if top >= vocab:
            raise ValueError(f"speculative_draft_model_path: the head's d2t maps a draft token to id {top}, "
                             f"outside the target's vocabulary of {vocab}")
    model.to(device=device)
    for p in model.parameters():          # weights in the model dtype; the RoPE cache stays fp32 (flashinfer's rope
        p.data = p.data.to(dtype)         # kernel takes only an fp32 cos/sin cache)
    return model.eval()


def save_random_head(target_dir: str, path: str, eagle3: bool = False, draft_vocab: int = 0, seed: int = 7) -> str:
    """Save a random one-layer EAGLE / EAGLE3 head for the model in ``target_dir`` at ``path`` in the
    published checkpoint format (no ``embed_tokens``: shared with the target; EAGLE3: ``d2t`` maps
    draft id i to target id i + i % 3, at most the last target id). For tests and the speed machinery
    (acceptance is meaningless)."""
    import transformers as tf
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    t = t.get("text_config", t)
    raw = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "rms_norm_eps", "max_position_embeddings", "vocab_size") if k in t}
    raw.update(num_hidden_layers=1, architectures=list(EAGLE3_ARCHS if eagle3 else EAGLE_ARCHS))
    if draft_vocab:
        raw["draft_vocab_size"] = draft_vocab
    torch.manual_seed(seed)
    head = EagleDraft(tf.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}), eagle3,
                      raw["hidden_size"])
    state = {k: v.contiguous() for k, v in head.state_dict().items() if "cos_sin" not in k}
    state.pop("embed_tokens.weight")
    if eagle3:                 # i + i % 3, kept inside the target's vocabulary
        i = torch.arange(len(state["d2t"]))
        state["d2t"] = torch.minimum(i % 3, raw["vocab_size"] - 1 - i)
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return path
