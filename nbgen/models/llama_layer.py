"""The Llama decoder layer, shared by Qwen2 and Qwen3 (they override its class attributes and small
hooks): attention (qkv projection, RoPE, attention, o_proj) and the MLP, with the norms either as
modules or folded into the projections (``models/norm_fold.py``; o_proj / down_proj then add into the
residual stream, all-reduced there at tp > 1)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from nbgen.attention.base import Attention
from nbgen.kernels import qk_norm_rope as fused_rope
from nbgen.kernels import fp8_qkv_rope, fp8_row_gemv, small_gemm
from nbgen.kernels.gpu_ops import fused_enabled
from nbgen.kernels.fp8_quant import QuantizedRows
from nbgen.kernels.silu_scaled import (rms_scale, silu_mul_quant, silu_mul_quant_usable, silu_mul_scaled,
                                      silu_mul_scaled_quant)
from nbgen.models.fp8_scaled import qkv_rope_usable, scaled_silu_mul
from nbgen.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    """Explicit ``head_dim`` when the config has one (Qwen3, Mistral), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# a layer's x output: a tensor still to be added to the stream, or (folded layers) None / QuantizedRows
LayerOut = Union[torch.Tensor, QuantizedRows, None]


def in_hand(x: LayerOut) -> bool:
    """A layer's x output still to be added to the residual stream (a tensor); folded layers leave theirs
    in the stream (None, or its rows quantized for the next layer's qkv)."""
    return isinstance(x, torch.Tensor)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gate_up.bias is None and not gate_up.lora_active and small_gemm.usable(x, gate_up.weight):
            # decode of a few rows: SiLU-and-mul in the matmul's epilogue ([T, 2I] never stored)
            return self.down_proj(small_gemm.small_gemm(x, gate_up.weight, silu_mul=True))
        gu = gate_up(x)                                                # [T, H] -> [T, 2I]
        if self.down_proj.takes_quantized(gu) and silu_mul_quant_usable(gu):   # fp8 down_proj: SiLU writes e4m3
            return self.down_proj(silu_mul_quant(gu))
        return self.down_proj(self.act_fn(gu))                         # [T, 2I] -> [T, I] -> [T, H]

    def forward_folded(self, h: torch.Tensor, eps: float, hq: Optional[QuantizedRows] = None,
                       then: Optional[nn.Module] = None) -> Optional[QuantizedRows]:
        """Folded post-attention norm (nbgen.models.norm_fold): h [T, H] is the raw residual stream and the
        norm weight is in gate|up; the MLP's output is added into h in place. ``hq``: h's rows already
        quantized for gate|up (``LinearBase.accumulate_quantized``). ``then``: the next layer's qkv
        projection -> the updated rows quantized for it where down_proj's residual add can do that too,
        else None."""
        w = self.gate_up_proj.weight
        if hq is None and not self.gate_up_proj.lora_active and small_gemm.usable(h, w):   # SiLU in the epilogue
            act = small_gemm.small_gemm(h, w, silu_mul=True, row_scale_eps=eps)
        else:   # fp8 at one row: SiLU in the one-row kernel's epilogue
            one_row = hq is None and not self.gate_up_proj.lora_active
            act = scaled_silu_mul(h, self.gate_up_proj.fp8, eps) if one_row else None
            if act is None:
                gate_up = self.gate_up_proj(h if hq is None else hq)          # [T, 2I]
                # down_proj quantizes its input for cuBLAS: the SiLU kernel writes it so ([T, I] e4m3)
                fused = self.down_proj.takes_quantized(gate_up) and gate_up.stride(1) == 1 and h.stride(1) == 1
                act = silu_mul_scaled_quant(gate_up, h, eps) if fused else silu_mul_scaled(gate_up, h, eps)
        if then is not None:
            return self.down_proj.accumulate_quantized(act, h, then)
        self.down_proj.accumulate(act, h)
        return None


class LlamaAttention(nn.Module):
    """q/k/v projection, RoPE, attention and o_proj; the decoder layer calls ``project``, ``attn`` and
    ``o_proj`` in turn (split there so that piecewise prefill graphs can cut at attention)."""

    def __init__(self, config: PretrainedConfig, layer_id: int, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.q_size = self.qkv_proj.num_heads * self.head_dim          # local (this tp rank)
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias)
        # its weights stream during batch-1 decode attention (latency-bound) in the fp8 one-row kernel
        self.o_proj.early_tiles = fp8_row_gemv.EARLY_TILES_AFTER_ATTENTION
        self.rotary_emb = rotary_emb     # one cos/sin cache per model, shared by all layers
        self.attn = Attention(layer_id)

    def biases(self, config: PretrainedConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias); Llama uses ``attention_bias`` for both."""
        b = bool(getattr(config, "attention_bias", False))
        return b, b

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (identity here; Qwen3 normalises each head)."""
        return q, k

    def qk_norm_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        """(q weight, k weight, eps) of ``qk_norm`` for the fused kernel; (None, None, 0) = no norm."""
        return None, None, 0.0

    def project(self, positions: torch.Tensor, x: torch.Tensor, meta: Any,
                qkv_out: Optional[torch.Tensor] = None, fold_eps: Optional[float] = None,
                xq: Optional[QuantizedRows] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Everything before attention: qkv projection (into ``qkv_out`` when given), (q/k norm,) RoPE,
        and where the backend allows it the K/V write -> (q, k, v, whether K/V are written).
        ``fold_eps``: x is the raw residual stream and the input norm is folded into qkv (its weight in
        the projection, its row scale applied here). ``xq``: x's rows already quantized for qkv."""
        proj = self.qkv_proj
        if xq is None and qkv_out is None and not proj.lora_active and self.qk_norm_weights()[0] is None:
            qkv = self._project_one_row(positions, x, meta, fold_eps)
            if qkv is not None:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                return q, k, v, True
        qkv = proj(x if xq is None else xq, out=qkv_out)              # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if fused_enabled(qkv) and fused_rope.supported(qkv, self.head_dim):
            # one kernel, in place on qkv (q and k stay its strided views): (the folded norm's row
            # scale,) q/k norm (Qwen3), RoPE, and where the backend allows it the K/V write
            kv = self.attn.kv_target(meta)
            fused_rope.qk_norm_rope_(qkv, positions, *self.qk_norm_weights(), self.rotary_emb.cos_sin_cache,
                                     proj.num_heads, proj.num_kv_heads, self.head_dim, kv=kv,
                                     row_scale=None if fold_eps is None else (x, fold_eps))
            return q, k, v, kv is not None
        if fold_eps is not None:
            qkv.mul_(rms_scale(x, fold_eps))               # in place: q, k, v are its views
        q, k = self.rotary_emb(positions, *self.qk_norm(q, k))
        return q, k, v, False

    def _project_one_row(self, positions: torch.Tensor, x: torch.Tensor, meta: Any,
                         fold_eps: Optional[float]) -> Optional[torch.Tensor]:
        """One row (batch-1 decode) against a per-feature fp8 weight, with a K/V target: the projection, (the
        folded norm's row scale,) RoPE and the K/V write in one kernel -> qkv [1, (Hq + 2 Hkv) * D]; None where
        that kernel does not serve it."""
        proj, w8 = self.qkv_proj, self.qkv_proj.fp8
        kv = self.attn.kv_target(meta) if qkv_rope_usable(x, w8, self.head_dim) else None
        if kv is None:
            return None
        return fp8_qkv_rope.qkv_rope(x, w8.q, w8.scale_row, proj.bias, w8.col_scale, positions,
                                     self.rotary_emb.cos_sin_cache, proj.num_heads, proj.num_kv_heads,
                                     self.head_dim, kv, row_scale_eps=fold_eps)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # norms folded into qkv / gate|up (nbgen.models.norm_fold.fold_norms): the layer then passes the raw
    # residual stream on (its x outputs are None, or the stream's rows quantized for the next layer's qkv)
    # and o_proj / down_proj accumulate into it
    folded: bool = False
    # folded layers: (the next layer's qkv projection,) set by norm_fold.fold_norms, for which down_proj's
    # residual add also quantizes the stream where it is fp8; a tuple, so torch does not register the next
    # layer's module as this one's child (its parameters would get a second name)
    next_qkv: tuple[nn.Module, ...] = ()
    # weights kept in host memory (nbgen.models.cpu_offload): copies them to the GPU before the layer runs
    stage_in: Optional[Callable[[], None]] = None

    def __init__(self, config: PretrainedConfig, layer_id: int, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def pre_attention(self, positions: torch.Tensor, x: LayerOut, residual: Optional[torch.Tensor], meta: Any,
                      qkv_out: Optional[torch.Tensor] = None) -> tuple[tuple, torch.Tensor]:
        """x: the previous layer's output (not yet added to the residual stream) -> ((q, k, v, K/V written),
        residual). The residual is updated in place where the fused add+RMSNorm runs."""
        if self.stage_in is not None:
            self.stage_in()
        if self.folded:     # x: None or quantized rows (already in the stream) or, before layer 0, the embeddings
            xq = x if isinstance(x, QuantizedRows) else None
            residual = x if residual is None else residual
            eps = self.input_layernorm.eps
            return self.self_attn.project(positions, residual, meta, qkv_out, fold_eps=eps, xq=xq), residual
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(positions, x, meta, qkv_out), residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[LayerOut, torch.Tensor]:
        """attention output [T, Hq * D] -> (out, residual): o_proj, add+RMSNorm, MLP. Folded: both
        outputs go into the residual stream in place -> (None or the stream's rows quantized for the next
        layer's qkv, residual)."""
        if self.folded:     # o_proj's residual add also quantizes the stream for gate|up where it can
            hq = self.self_attn.o_proj.accumulate_quantized(attn, residual, self.mlp.gate_up_proj)
            eps = self.post_attention_layernorm.eps
            return self.mlp.forward_folded(residual, eps, hq, *self.next_qkv), residual
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return self.mlp(x), residual

    def forward(self, positions: torch.Tensor, x: LayerOut, residual: Optional[torch.Tensor],
                meta: Any) -> tuple[LayerOut, torch.Tensor]:
        """x: the previous layer's output (not yet added to the residual stream) -> (out, residual).
        The same three parts that piecewise CUDA graphs replay around an eager attention."""
        (q, k, v, written), residual = self.pre_attention(positions, x, residual, meta)
        return self.post_attention(self.self_attn.attn(q, k, v, meta, kv_written=written), residual)
