"""nbgen's own CPU kernels (``nbgen/kernels/csrc/cpu_ops.c``, ``cpu_q8.c``: one library): built with the system C compiler on first
use, cached, called through ctypes — the CPU counterpart of ``gpu_ops`` (flashinfer on CUDA). The same library
holds a host helper of any device's engine: ``ffi_search.c``, a step's jump-forward searches in one call
(runtime/grammar_search.py).

The build is plain C with no torch headers (about a second with gcc), so it happens inside the
first ``Engine()`` rather than at install time. The shared library is cached under the nbgen cache
dir keyed by the sources, the compiler and this CPU (it is built with ``-march=native``). It links
libgomp by its soname, so inside a torch process it shares torch's OpenMP runtime and thread pool.

When there is no compiler, the build fails, or ``NBGEN_CPU_KERNELS=0`` is set, ``available()`` is
False and callers use their torch code path (same results up to float rounding, slower).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from nbgen.kernels.envs import cache_dir, cpu_kernels_enabled

logger = logging.getLogger("nbgen")

SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("cpu_ops.c", "cpu_q8.c", "cpu_q4.c", "cpu_layers.c", "cpu_attn_bf16.c", "ffi_search.c")]
HEADERS = [Path(__file__).resolve().parent / "csrc" / name for name in ("bf16.h", "sum16.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "paged_decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int, _int, _int, _int, _i64, _i64,
                               _f32, _int, _ptr, _ptr, _i64, _i64, _ptr],
    "rmsnorm": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _int, _int, _f32, _int],
    "rope": [_ptr, _i64, _int, _ptr, _i64, _int, _ptr, _ptr, _int, _i64, _int],
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _int, _int],
    "argmax_rows": [_ptr, _i64, _i64, _i64, _ptr, _int],
    "q4_grid": [_ptr, _i64, _i64, _ptr, _ptr, _f32],
    "apply_token_bitmask": [_ptr, _i64, _int, _ptr, _i64, _ptr, _i64, _i64],
    "q8_grid": [_ptr, _i64, _i64, _ptr, _ptr, _f32],
    "q8_gemv": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _i64, _i64, _int],
    "q4_gemv": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _int, _i64, _i64, _int],
    "q4_vnni": [],
    "q4_decode_layers": [_int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int, _int, _int, _int,
                         _int, _f32, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _f32, _ptr],
    "decode_layer_ptrs": [],
    "jump_strings": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr],
}
_RESTYPES = {"q4_grid": _int, "q8_grid": _int, "q4_vnni": _int, "decode_layer_ptrs": _int, "jump_strings": _i64}                     # the others return nothing
_DTYPES = (torch.bfloat16, torch.float32)
_checked_positions: Optional[torch.Tensor] = None   # the last positions tensor range-checked by rope_inplace


def _cpu_key() -> str:
    """Identifies this CPU's instruction set (the library is built with -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    src = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])   # a header change rebuilds too
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode() + _cpu_key().encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    lib = out_dir / f"cpu_ops-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:   # build aside, then rename: never half a file
        tmp_lib = Path(tmp) / lib.name
        res = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(tmp_lib), "-lm"],
                             capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp_lib, lib)
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, building it on first call; None when it cannot be had (logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not cpu_kernels_enabled():
            return None
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            logger.warning("nbgen: no C compiler found; the CPU kernels (and jump-forward's one-call search) "
                           "use their slower torch / Python paths")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, _RESTYPES.get(name)
            _lib = lib
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
            logger.warning("nbgen: CPU kernels unavailable (%s); using the torch path", str(e)[:500])
        return _lib


def available() -> bool:
    """True when the C kernels are built and loaded (building them now if needed)."""
    return (_lib is not None) if _tried else load() is not None


def fused_enabled(x: torch.Tensor) -> bool:
    """True when ``x`` should go through a C kernel (CPU bf16/fp32 tensor, inference, kernels built):
    the CPU counterpart of ``gpu_ops.fused_enabled`` at the same call sites in nbgen.models.layers."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and not x.requires_grad and available()


def supports_decode(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether ``paged_decode_attention`` handles this dtype (of q and the KV cache) / head configuration."""
    return dtype in _DTYPES and num_q_heads % num_kv_heads == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           table: torch.Tensor, lens: torch.Tensor, page_size: int, scale: float,
                           out: Optional[torch.Tensor] = None,
                           new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """One query token per sequence against its pages, read in place (no gather).

    q [B, Hq, D] (rows may be strided; heads and dims contiguous); k_cache / v_cache [Hkv, S, D]
    contiguous head-major caches of one layer; table [B, max_pages] int64 page ids; lens [B] int64
    cached tokens per sequence, the new one included. Returns out [B, Hq, D] in q's dtype.
    ``new_kv`` = (k [B, Hkv * D], v [B, Hkv * D], slots [B] int64): the new tokens' K / V (rows may be
    strided views of the qkv projection, in the cache's dtype), written into their slots first.
    """
    lib = load()
    assert lib is not None, "cpu_ops.paged_decode_attention called without the kernels (check available())"
    B, Hq, D = q.shape
    Hkv, S, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == D and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert table.dtype == torch.int64 and lens.dtype == torch.int64 and table.is_contiguous()
    if out is None:
        out = torch.empty((B, Hq, D), dtype=q.dtype)
    kn = vn = sl = None
    k_stride = v_stride = 0
    if new_kv is not None:
        k, v, slots = new_kv
        assert k.dtype == v.dtype == k_cache.dtype and k.shape == v.shape == (B, Hkv * D) and k.stride(1) == 1 \
            and v.stride(1) == 1 and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == B
        kn, vn, sl, k_stride, v_stride = k.data_ptr(), v.data_ptr(), slots.data_ptr(), k.stride(0), v.stride(0)
    lib.paged_decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                               table.data_ptr(), lens.data_ptr(), B, Hq, Hkv, D, page_size, table.shape[1], S,
                               scale, int(q.dtype == torch.bfloat16), kn, vn, k_stride, v_stride, sl)
    return out


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(row stride, rows) of a [T, W] tensor whose last dim is contiguous."""
    assert x.dim() == 2 and x.stride(1) == 1, "expected [T, W] with a contiguous last dim"
    return x.stride(0), x.shape[0]


def _same_dtype(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w if w.dtype == x.dtype else w.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim -> a new contiguous tensor. x: [T, H] or a per-head [T, Hh, D] view
    (Qwen3's q/k norm on the qkv projection; heads contiguous, rows strided)."""
    if x.dim() == 3:
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "per-head rows must be contiguous"
        T, H, D = x.shape
        y = torch.empty((T, H, D), dtype=x.dtype)
    else:
        x = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        _, T = _rows(x)
        H, D = 1, x.shape[1]
        y = torch.empty((T, D), dtype=x.dtype)
    load().rmsnorm(x.data_ptr(), x.stride(0), None, 0, _same_dtype(weight, x).data_ptr(), y.data_ptr(),
                   H * D, T, H, D, eps, int(x.dtype == torch.bfloat16))
    return y


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one pass, in place: residual gets the sum, x the norm
    (both are scratch, as with flashinfer's fused_add_rmsnorm)."""
    xs, T = _rows(x)
    rs, _ = _rows(residual)
    load().rmsnorm(x.data_ptr(), xs, residual.data_ptr(), rs, _same_dtype(weight, x).data_ptr(), x.data_ptr(),
                   xs, T, 1, x.shape[1], eps, int(x.dtype == torch.bfloat16))
    return x, residual


def check_positions(positions: torch.Tensor, max_pos: int) -> None:
    """ValueError unless every position is in [0, max_pos) (the RoPE table's rows); once per positions
    tensor (all layers of a step share one)."""
    global _checked_positions
    if _checked_positions is not positions:
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < max_pos:
            raise ValueError(f"positions must be in [0, {max_pos}) (the model's max_position_embeddings)")
        _checked_positions = positions


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in place on q [T, Hq*D] and k [T, Hkv*D] (rows may be strided views of the
    qkv projection); cos_sin_cache [max_pos, D] fp32 (cos | sin); positions [T] int64 in range."""
    qs, T = _rows(q)
    ks, _ = _rows(k)
    assert positions.dtype == torch.int64 and positions.is_contiguous() and cos_sin_cache.dtype == torch.float32
    check_positions(positions, cos_sin_cache.shape[0])
    load().rope(q.data_ptr(), qs, q.shape[1] // head_dim, k.data_ptr(), ks, k.shape[1] // head_dim,
                positions.data_ptr(), cos_sin_cache.data_ptr(), head_dim, T, int(q.dtype == torch.bfloat16))
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I]: silu(gate) * up in one pass."""
    xs, T = _rows(x)
    inter = x.shape[1] // 2
    out = torch.empty((T, inter), dtype=x.dtype)
    load().silu_and_mul(x.data_ptr(), xs, out.data_ptr(), T, inter, int(x.dtype == torch.bfloat16))
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[T, V] -> [T] int64 first index of each row's max (torch.argmax(-1) semantics incl. NaN).
    On a CPU torch's bf16 argmax is ~2x slower than widening to fp32 first, and both are scalar."""
    xs, T = _rows(x)
    out = torch.empty(T, dtype=torch.int64)
    load().argmax_rows(x.data_ptr(), xs, T, x.shape[1], out.data_ptr(), int(x.dtype == torch.bfloat16))
    return out


def q4_grid(w: torch.Tensor, tol: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(q [N, K] int32, (scale, zero) [K/32, N, 2] fp32) of a bf16 weight on a 4-bit grid (groups of
    32 along K: see ``nbgen.models.cpu_int4``), None when it is off the grid. Needs ``available()``."""
    w = w.contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int32)
    sz = torch.empty(k // 32, n, 2, dtype=torch.float32)
    ok = _lib.q4_grid(w.data_ptr(), n, k, q.data_ptr(), sz.data_ptr(), tol)
    return (q, sz) if ok else None


def q8_grid(w: torch.Tensor, tol: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(q [N, K] int8, d [N, K/32] fp32) of a bf16 weight on an 8-bit grid (GGUF Q8_0: per group of 32
    along K, q in [-127, 127] times d = max|w| / 127), None when it is off the grid. Needs ``available()``."""
    w = w.contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // 32, dtype=torch.float32)
    return (q, d) if _lib.q8_grid(w.data_ptr(), n, k, q.data_ptr(), d.data_ptr(), tol) else None


def q8_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [T, K] (T <= 4, bf16 / fp32, contiguous last dim) @ (q * d).T -> [T, N] in x's dtype, fp32
    accumulation; q, d as ``q8_grid`` returns them."""
    xs, T = _rows(x)
    assert T <= 4 and q.is_contiguous() and d.is_contiguous() and x.shape[1] == q.shape[1]
    n = q.shape[0]
    y = torch.empty((T, n), dtype=x.dtype)
    _lib.q8_gemv(x.data_ptr(), xs, q.data_ptr(), d.data_ptr(), y.data_ptr(), n, T, n, q.shape[1],
                 int(x.dtype == torch.bfloat16))
    return y


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, width: int, rows: Optional[list[int]]) -> bool:
    """logits [B, V] (CPU, fp32 / bf16, unit stride along V) of ``rows`` (None: all) get -inf at the
    ids in [0, width) that the int32 ``bitmask`` [>= B, ceil(V / 32)] (xgrammar's layout) does not
    allow, in place. False (nothing done) when the C kernels or these layouts are not available."""
    if not available() or logits.dtype not in _DTYPES or logits.dim() != 2 or logits.stride(1) != 1 \
            or bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1 \
            or bitmask.shape[1] * 32 < width:
        return False
    idx = torch.arange(logits.shape[0], dtype=torch.int64) if rows is None else torch.tensor(rows, dtype=torch.int64)
    _lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16),
                             bitmask.data_ptr(), bitmask.stride(0), idx.data_ptr(), idx.numel(), width)
    return True
