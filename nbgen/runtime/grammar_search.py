"""A step's jump-forward searches in one C call: the forced text of every constrained row.

Jump-forward decoding (runtime/jump_forward.py) asks each row's matcher after every accepted token
what text its grammar forces next (xgrammar's ``find_jump_forward_string``); two searches in three
find nothing. A call from Python per row converts the matcher handle and the answer on every call and
costs several times the search (2-core CPU: 0.44 us a row against 0.07 us for the search itself
where nothing is forced, 0.65 against 0.18 where something is), on the loop thread. xgrammar's
matchers are tvm-ffi objects, so the searches run instead in nbgen's C helper
(``kernels/csrc/ffi_search.c``), which calls the same tvm-ffi Function for every row through tvm-ffi's
C ABI in one ctypes call and writes only the rows with forced text, one after another, each ended by
a NUL: one decode and one split make the strings.

Where the helper cannot be had (xgrammar without tvm-ffi matchers, no C compiler,
``NBGEN_CPU_KERNELS=0``), and for a row whose search failed, whose text did not fit the buffer or holds
a NUL, the row is asked the usual way (``GrammarState.search``): the same answers, or the same error.
Forced bytes that end inside a UTF-8 character (enum members sharing a character's first byte) are
cut to their whole characters here; asked from Python they give nothing to jump (xgrammar's str
conversion raises).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from array import array
from typing import Any, Optional

from nbgen.kernels import cpu_ops

logger = logging.getLogger("nbgen")

BYTES_PER_ROW = 64   # the output buffer's size per row (a longer text may use another row's share)


class JumpSearch:
    """The forced text of a step's rows (loop thread only); ``texts`` gives the rows that have some."""

    def __init__(self, bytes_per_row: int = BYTES_PER_ROW) -> None:
        self.bytes_per_row = max(1, bytes_per_row)
        self._ready: Optional[bool] = None       # resolved on first use: the C path can run
        self._args: tuple[int, int, int, int] = (0, 0, 0, 0)   # tvm-ffi's call / decref / error entry points, the method
        self._keep: Any = None                   # the method's Function object (keeps its handle alive)
        self._fn: Any = None                     # the library's jump_strings
        self._rows = 0                           # rows the buffers below hold
        self._buf: Any = None                    # char [rows * bytes_per_row]: the texts, '\0' after each
        self._idx: Any = None                    # int64 [rows]: the rows with text
        self._lens: Any = None                   # int64 [rows]: their byte lengths (< 0: ask again)
        self._used = ctypes.c_int64()
        # the helper's library may need a build (~1 s, once per machine): started now, so the first jump
        # step does not wait for it on the loop thread (CPU engines have it loaded already)
        threading.Thread(target=cpu_ops.load, name="nbgen-cpu-kernels", daemon=True).start()

    def texts(self, states: list[Any]) -> list[tuple[int, str]]:
        """(k, forced text) for each ``states[k]`` (GrammarStates) whose grammar forces text now, in
        order; a row whose search raises raises here, as ``GrammarState.search`` does."""
        if not states:
            return []
        handles = self._handles(states)
        if handles is None:
            return [(k, t) for k, t in enumerate(map(_ask, states)) if t]
        n = len(states)
        self._grow(n)
        m = self._fn(*self._args, handles.buffer_info()[0], n, self._buf, self._rows * self.bytes_per_row,
                     self._idx, self._lens, ctypes.byref(self._used))
        if not m:
            return []
        rows, lens = self._idx[:m], self._lens[:m]
        blob = ctypes.string_at(self._buf, self._used.value - 1)      # the last '\0' dropped
        if min(lens) > 0:
            try:
                return list(zip(rows, blob.decode().split("\0")))
            except UnicodeDecodeError:
                pass
        return self._one_by_one(states, rows, lens, blob)

    @staticmethod
    def _one_by_one(states: list[Any], rows: list[int], lens: list[int], blob: bytes) -> list[tuple[int, str]]:
        """The rows of a call where some row failed, did not fit or is not UTF-8: those asked again, or cut."""
        out: list[tuple[int, str]] = []
        at = 0
        for k, size in zip(rows, lens):
            if size > 0:
                raw = blob[at:at + size]
                try:
                    text = raw.decode()
                except UnicodeDecodeError as e:  # forced bytes that end inside a character: the whole ones
                    text = raw[:e.start].decode(errors="ignore")
            else:
                text = _ask(states[k])
            at += max(size, 0) + 1
            if text:
                out.append((k, text))
        return out

    def _handles(self, states: list[Any]) -> Optional[array]:
        """The states' matcher handles as addresses (int64), or None (the per-row path)."""
        if self._ready is None:
            self._ready = self._setup(states[0])
        if not self._ready:
            return None
        try:
            return array("q", [s.handle.__chandle__() for s in states])
        except AttributeError:                   # a state without a tvm-ffi matcher
            return None

    def _setup(self, state: Any) -> bool:
        """Find the matcher type's tvm-ffi method and tvm-ffi's C entry points; False: per row."""
        info = getattr(type(getattr(state, "handle", None)), "__tvm_ffi_type_info__", None)
        method = next((m.func for m in getattr(info, "methods", ()) if m.name == "find_jump_forward_string"), None)
        lib = cpu_ops.load()
        if method is None or lib is None or not hasattr(method, "__chandle__"):
            return False
        try:
            from tvm_ffi import libinfo

            ffi = ctypes.CDLL(libinfo.find_libtvm_ffi())      # the library xgrammar loaded already
            addr = [ctypes.cast(getattr(ffi, name), ctypes.c_void_p).value
                    for name in ("TVMFFIFunctionCall", "TVMFFIObjectDecRef", "TVMFFIErrorMoveFromRaised")]
        except Exception as e:  # noqa: BLE001 - any lookup failure means: ask each row from Python
            logger.info("jump-forward searches row by row (tvm-ffi entry points not found: %s)", e)
            return False
        self._keep, self._fn = method, lib.jump_strings
        self._args = (addr[0], addr[1], addr[2], method.__chandle__())
        return True

    def _grow(self, n: int) -> None:
        if n > self._rows:
            self._rows = max(n, 2 * self._rows, 64)
            self._buf = ctypes.create_string_buffer(self._rows * self.bytes_per_row)
            self._idx = (ctypes.c_int64 * self._rows)()
            self._lens = (ctypes.c_int64 * self._rows)()


def _ask(state: Any) -> str:
    """The state's forced text asked from Python (``GrammarState.search``); "" where the forced bytes are
    not whole UTF-8 characters (enum members that share a character's first byte), which xgrammar's str
    conversion refuses: no jump then. Other errors are raised."""
    try:
        return state.search()
    except UnicodeDecodeError:
        return ""
