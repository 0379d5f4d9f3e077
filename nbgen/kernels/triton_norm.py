"""RMSNorm, add+RMSNorm and SiLU-and-mul on CUDA as small Triton kernels, with HF's rounding steps.

These are the model's per-token elementwise / row ops where no fused nbgen kernel covers them (the
final norm, unfolded layers, per-head norms outside the fused RoPE kernel). They compile in well
under a second each (Triton), where flashinfer's JIT norm module took 33.5 s to build on an H100 host
with an empty cache, before the first decode graph could be captured.

Numerics follow the HF modules the torch path mirrors (``models/layers.py``): the residual add is
rounded to the model dtype before the norm reads it; the norm computes in fp32, rounds the normalised
row, then multiplies by the weight (one more rounding); SiLU-and-mul rounds silu(gate) before the
product. One program per row (a row of up to 32 768 features in registers); launched with programmatic
dependent launch where the GPU has it (``kernels/pdl.py``), as the other per-layer kernels are.
"""
from __future__ import annotations

import torch

from nbgen.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

MAX_HIDDEN = 32768


def supported(x: torch.Tensor) -> bool:
    """The kernels serve this tensor: Triton, half precision, contiguous features, a row that fits."""
    return (triton is not None and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and 0 < x.shape[-1] <= MAX_HIDDEN)


if triton is not None:
    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, H, NH, sxt, sxh, srt, syt, syh, eps,
                        ADD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        # row = (token t, head h): x [T, NH, H] strided (NH = 1 for [T, H]); y likewise
        row = tl.program_id(0).to(tl.int64)
        t = row // NH
        h = row % NH
        offs = tl.arange(0, BLOCK)
        m = offs < H
        dt = y_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)     # not written by the kernel before
        if USE_PDL:   # launched early (kernels/pdl.py): wait for x (and the residual) to be written
            pdl.gdc_wait()
            pdl.gdc_launch_dependents()
        x = tl.load(x_ptr + t * sxt + h * sxh + offs, mask=m, other=0.0).to(tl.float32)
        if ADD:   # residual = x + residual, rounded as a model-dtype add; the norm reads the rounded sum
            s = (x + tl.load(r_ptr + t * srt + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
            tl.store(r_ptr + t * srt + offs, s, mask=m)
            x = s.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        y = (x * r).to(dt).to(tl.float32) * w
        tl.store(y_ptr + t * syt + h * syh + offs, y.to(dt), mask=m)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, I, sx, sy, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        if USE_PDL:
            pdl.gdc_wait()
            pdl.gdc_launch_dependents()
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < I
        tl.store(y_ptr + t * sy + offs, silu_mul_block(x_ptr + t * sx, offs, m, I, y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def rnd(x, dt: tl.constexpr):
        # round an fp32 value to the model dtype and back (one HF op's output rounding)
        return x.to(dt, fp_downcast_rounding="rtne").to(tl.float32)

    @triton.jit
    def mul_rn(a, b):
        # a * b in fp32 rounded to nearest even on its own: PTX never contracts an explicit mul.rn into an
        # FMA, and it keeps subnormals (libdevice's mul_rn is the .ftz form in Triton's build)
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def row_rms_scale(h_ptr, HID: tl.constexpr, eps, HBLK: tl.constexpr, RN: tl.constexpr = False):
        """rsqrt(mean(h^2) + eps) of one row of HID elements (fp32 math, as RMSNorm), HBLK at a time. ``RN``: each
        square rounded on its own (``mul_rn``), so a kernel compiled with FMA contraction sums what a kernel
        compiled without it sums."""
        ss = tl.zeros((HBLK,), tl.float32)
        for k0 in tl.static_range(0, HID, HBLK):
            kk = k0 + tl.arange(0, HBLK)
            x = tl.load(h_ptr + kk, mask=kk < HID, other=0.0).to(tl.float32)
            if RN:
                ss += mul_rn(x, x)
            else:
                ss += x * x
        return tl.math.rsqrt(tl.sum(ss, 0) / HID + eps)

    @triton.jit
    def silu_mul_block(x_row, offs, m, I, dt: tl.constexpr):
        """One block of a token's silu(gate) * up in dt, silu rounded before the product (HF's steps)."""
        g = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_row + I + offs, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (a * u).to(dt)


def _launch_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor, eps: float, add: bool) -> None:
    H = x.shape[-1]
    x3 = x if x.dim() == 3 else x.view(x.shape[0], 1, H)       # [T, NH, H] views
    y3 = y if y.dim() == 3 else y.view(y.shape[0], 1, H)
    T, NH = x3.shape[0], x3.shape[1]
    if T * NH == 0:
        return
    block = triton.next_power_of_2(H)
    pdl.launch(_rmsnorm_kernel, (T * NH,), (x3, r, w, y3, H, NH, x3.stride(0), x3.stride(1), r.stride(0),
                                             y3.stride(0), y3.stride(1), float(eps)), x.device,
               ADD=add, BLOCK=block, num_warps=min(16, max(1, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, H] or a strided [T, NH, H] (per-head norms) -> contiguous."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, x, weight, y, eps, add=False)
    return y


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place on contiguous [T, H] tensors: residual = x + residual (rounded), x = RMSNorm(residual)."""
    _launch_norm(x, residual, weight, x, eps, add=True)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up, rows contiguous) -> [T, I] = silu(gate) * up."""
    T, I2 = x.shape
    y = torch.empty((T, I2 // 2), dtype=x.dtype, device=x.device)
    if T:
        block = min(2048, triton.next_power_of_2(I2 // 2))
        pdl.launch(_silu_mul_kernel, (T, triton.cdiv(I2 // 2, block)), (x, y, I2 // 2, x.stride(0), y.stride(0)),
                   x.device, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return y
