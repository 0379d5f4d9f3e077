"""CUDA IPC through the CUDA runtime that torch loaded (ctypes, no compiled extension): device memory
allocated outside torch's caching allocator, its IPC handle, and a peer process's handle opened into
this process's address space (peer access over NVLink / PCIe).

The buffers live outside torch's allocator on purpose: CUDA graph pools, ``empty_cache`` and
expandable segments never move or share them, and their lifetime is explicit (``free`` /
``close``), so a shutdown releases them before the process group goes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from typing import Optional

HANDLE_BYTES = 64                 # sizeof(cudaIpcMemHandle_t)
_LAZY_PEER_ACCESS = 1             # cudaIpcMemLazyEnablePeerAccess


class _Handle(ctypes.Structure):
    # unsigned bytes, not c_char: ctypes reads a c_char array as a C string, cut at its first zero byte
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


def handle_bytes(h: _Handle) -> bytes:
    """All HANDLE_BYTES bytes of a handle, zeros included."""
    return bytes(h.reserved)


def handle_from_bytes(raw: bytes) -> _Handle:
    """The handle whose bytes are ``raw`` (from a peer's ``handle``)."""
    if len(raw) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(raw)}")
    return _Handle((ctypes.c_ubyte * HANDLE_BYTES).from_buffer_copy(raw))


def _loaded_cudart() -> Optional[str]:
    """The path of the libcudart this process already mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libcudart" in path and path.startswith("/"):
                    return path
    except OSError:
        pass
    return None


def _installed_cudart() -> Optional[str]:
    """A libcudart beside torch (the nvidia-cuda-runtime wheels) or the system's."""
    for base in sys.path:
        for pattern in ("nvidia/cu*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*", "torch/lib/libcudart*.so*"):
            found = sorted(glob.glob(os.path.join(base, pattern)))
            if found:
                return found[-1]
    return ctypes.util.find_library("cudart")


@functools.lru_cache(maxsize=None)
def cudart() -> ctypes.CDLL:
    """torch's CUDA runtime library (found among the mapped libraries), else an installed one (IPC
    handles are the driver's: any runtime's open the same memory)."""
    path = _loaded_cudart() or _installed_cudart()
    if path is None:
        raise RuntimeError("no CUDA runtime library (libcudart) found")
    lib = ctypes.CDLL(path)
    for name, args in (("cudaSetDevice", [ctypes.c_int]),
                       ("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
                       ("cudaFree", [ctypes.c_void_p]),
                       ("cudaMemset", [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
                       ("cudaMemset2D", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t,
                                         ctypes.c_size_t]),
                       ("cudaDeviceSynchronize", []),
                       ("cudaIpcGetMemHandle", [ctypes.POINTER(_Handle), ctypes.c_void_p]),
                       ("cudaIpcOpenMemHandle", [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]),
                       ("cudaIpcCloseMemHandle", [ctypes.c_void_p]),
                       ("cudaGetErrorString", [ctypes.c_int])):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = cudart().cudaGetErrorString(code)
        raise RuntimeError(f"{what} failed: {msg.decode() if msg else code}")


def malloc(device: int, nbytes: int) -> int:
    """``nbytes`` of zeroed device memory on GPU ``device`` (its own allocation: IPC shares it whole)."""
    lib = cudart()
    _check(lib.cudaSetDevice(device), "cudaSetDevice")
    ptr = ctypes.c_void_p()
    _check(lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
    _check(lib.cudaMemset(ptr, 0, nbytes), "cudaMemset")
    _check(lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    return int(ptr.value)


def fill_high_bytes(device: int, ptr: int, nbytes: int, value: int) -> None:
    """Set the high byte of every little-endian 16-bit word in ``[ptr, ptr + nbytes)`` to ``value`` (the
    low bytes stay: on ``malloc``'s zeroed memory, 0x80 makes every int16 0x8000)."""
    lib = cudart()
    _check(lib.cudaSetDevice(device), "cudaSetDevice")
    # rows of one byte at a pitch of two: every odd byte
    _check(lib.cudaMemset2D(ctypes.c_void_p(ptr + 1), 2, value, 1, nbytes // 2), "cudaMemset2D")
    _check(lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def free(device: int, ptr: int) -> None:
    """Free memory from ``malloc``."""
    lib = cudart()
    _check(lib.cudaSetDevice(device), "cudaSetDevice")
    _check(lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def handle(ptr: int) -> bytes:
    """The IPC handle of an allocation from ``malloc`` (64 bytes, for the peers)."""
    h = _Handle()
    _check(cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return handle_bytes(h)


def open_handle(device: int, raw: bytes) -> int:
    """Map a peer's allocation into this process (accessed from GPU ``device``); its address here."""
    lib = cudart()
    _check(lib.cudaSetDevice(device), "cudaSetDevice")
    h = handle_from_bytes(raw)
    ptr = ctypes.c_void_p()
    _check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
    return int(ptr.value)


def close_handle(device: int, ptr: int) -> None:
    """Unmap a peer's allocation opened with ``open_handle``."""
    lib = cudart()
    _check(lib.cudaSetDevice(device), "cudaSetDevice")
    _check(lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")
