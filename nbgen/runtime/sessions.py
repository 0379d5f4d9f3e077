"""Engine sessions on the loop thread: SGLang's ``open_session`` / ``session_params`` / ``close_session``.

A session keeps the requests sent in it as a tree (``SessionNode``: each request points at the one
it continued). ``attach`` gives a new request of the session its real prompt before the scheduler
sees it: the continued request's prompt + output ids (``SessionParams.offset`` trims them,
``drop_previous_output`` leaves the output out), then the request's own ids, without a leading BOS.
Semantics follow SGLang's session controller:

- ``rid`` None starts a new root (the prompt is the request's own ids); a streaming session
  (``streaming=True``) instead always continues its latest request that finished without an abort,
  takes one request at a time and refuses ``offset`` / ``replace`` / ``drop_previous_output``;
- ``replace=True`` aborts what is still running of the replaced part and forgets it: with ``rid``,
  the other continuations of ``rid`` (and ``rid`` itself if it still runs); without, the whole tree;
- continuing a request that has not finished, an unknown ``rid`` or a closed session is a
  ValueError (SGLang answers them with an abort).

KV reuse: a finished request's full pages are in the prefix cache, so the next turn matches its
prompt + output there. While the session is open its latest finished sequence is *pinned*
(``on_finish``, called by the scheduler as the request finishes): the session holds one reference
on each of its cached pages, so cache pressure and preemptions of other requests cannot evict them.
A session pins at most ``capacity_of_str_len`` tokens (its sequence's leading full pages), and all
sessions together at most half of the KV pages. ``close`` (or the engine's shutdown, or ``timeout``
seconds without a new request) drops the pin: the pages become ordinary evictable cache pages.
Flushing the prefix cache (``flush_cache``, a weight update, a memory release) drops every pin; the
sessions stay open and their next turn recomputes its prompt.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nbgen.core.finish import ABORT
from nbgen.core.request import Request
from nbgen.core.session import SessionParams
from nbgen.runtime.scheduler import Scheduler

logger = logging.getLogger("nbgen")

Later = Callable[[float, Callable[[], None]], Any]    # later(delay_s, fn): run fn on the loop thread


@dataclass
class SessionNode:
    """One request of a session and the request it continued."""

    req: Request
    parent: Optional["SessionNode"] = None
    children: list["SessionNode"] = field(default_factory=list)


@dataclass
class Session:
    """An open session: its request tree and the KV pages it pins."""

    id: str
    capacity: int                            # capacity_of_str_len: at most this many tokens pinned
    streaming: bool = False
    timeout: Optional[float] = None
    nodes: dict[str, SessionNode] = field(default_factory=dict)
    pending: Optional[SessionNode] = None    # streaming: the request in flight (or not settled yet)
    pinned: list[int] = field(default_factory=list)
    active_at: float = field(default_factory=time.monotonic)


def continued_ids(prev: Request, new_ids: list[int], sp: SessionParams, bos_id: Optional[int]) -> list[int]:
    """The prompt of a request continuing ``prev``: prev's prompt + output (or prompt only with
    ``drop_previous_output``), cut at ``offset``, then ``new_ids`` without a leading BOS."""
    if bos_id is not None and new_ids and new_ids[0] == bos_id:
        new_ids = new_ids[1:]
    base = list(prev.prompt_ids) if sp.drop_previous_output else prev.prompt_ids + prev.output_ids
    if sp.offset:
        base = base[:sp.offset]
    return base + list(new_ids)


class SessionTable:
    """The open sessions of one engine (loop thread only)."""

    def __init__(self, scheduler: Scheduler, abort: Callable[[str, str], None], bos_id: Optional[int],
                 allow_context_overflow: bool, later: Later) -> None:
        self._pool, self._cache = scheduler.pool, scheduler.cache
        self._context_length = scheduler.cfg.context_length
        self._abort = abort                  # abort(rid, message): a running request of a replaced part
        self._bos_id = bos_id
        self._overflow = allow_context_overflow
        self._later = later
        self._sessions: dict[str, Session] = {}
        self._max_pinned = self._pool.num_total // 2
        self.pinned_pages = 0                # pages pinned by all sessions

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    # ---- open / close ---------------------------------------------------------------------------
    def open(self, capacity: int, session_id: str, streaming: bool, timeout: Optional[float]) -> Optional[str]:
        """Open a session; None (and a warning) when one with that id is open already, as SGLang."""
        if session_id in self._sessions:
            logger.warning("session id %s is already open, cannot open it again", session_id)
            return None
        s = self._sessions[session_id] = Session(session_id, capacity, streaming, timeout)
        if timeout is not None:
            self._later(timeout, lambda: self._expire(s))
        return session_id

    def close(self, session_id: str) -> bool:
        """Close a session and drop its pin; requests of it still running finish normally."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            logger.warning("session id %s is not open, cannot close it", session_id)
            return False
        self._pin(s, [])
        return True

    def close_all(self) -> None:
        for sid in list(self._sessions):
            self.close(sid)

    def unpin_all(self) -> None:
        """Drop every session's pin (the prefix cache is being flushed: after a weight update or a
        memory release its contents are stale); the sessions stay open and pin their next turn."""
        for s in self._sessions.values():
            self._pin(s, [])

    def _expire(self, s: Session) -> None:
        """Close ``s`` after ``timeout`` s without a new request (later, while a request runs)."""
        if self._sessions.get(s.id) is not s:
            return
        idle = time.monotonic() - s.active_at
        busy = any(not n.req.finished for n in s.nodes.values()) or (s.pending is not None
                                                                    and not s.pending.req.finished)
        if idle >= s.timeout and not busy:
            logger.info("session %s closed after %.1f s without a request", s.id, idle)
            self.close(s.id)
            return
        self._later(s.timeout - idle if idle < s.timeout else min(s.timeout, 1.0), lambda: self._expire(s))

    # ---- requests -------------------------------------------------------------------------------
    def attach(self, req: Request) -> None:
        """Give a session request its full prompt and enter it in the session's tree; ValueError
        (nothing changed) for a closed session, an unknown or unfinished ``rid``, or a prompt past
        the context length. Output ids must be final (the overlap stepper flushed)."""
        sp = req.session
        s = self._sessions.get(sp.id)
        if s is None:
            raise ValueError(f"session {sp.id!r} is not open (closed, timed out or never opened)")
        parent = self._parent(s, sp)
        ids = continued_ids(parent.req, req.prompt_ids, sp, self._bos_id) if parent is not None else req.prompt_ids
        self._check_length(s, ids, req)
        if sp.replace:
            self._drop(s, parent)
        node = SessionNode(req, parent)
        if parent is not None:
            parent.children.append(node)
        if s.streaming:
            s.pending = node                         # the latest once it finishes without an abort
        else:
            s.nodes[req.rid] = node
        req.prompt_ids = ids
        s.active_at = time.monotonic()

    def _parent(self, s: Session, sp: SessionParams) -> Optional[SessionNode]:
        """The node a request continues (None: a new root); ValueError for a bad ``rid``."""
        if s.streaming:
            for name, on in (("replace", sp.replace), ("drop_previous_output", sp.drop_previous_output),
                             ("offset", sp.offset)):
                if on:
                    raise ValueError(f"streaming session {s.id!r} does not support {name}")
            p = s.pending
            if p is not None and not p.req.finished:
                raise ValueError(f"streaming session {s.id!r} already has a request in flight ({p.req.rid!r})")
            if p is not None:                        # finished: the latest now, unless it aborted
                s.pending = None
                if not _aborted(p.req):
                    s.nodes = {p.req.rid: p}
            return next(iter(s.nodes.values()), None)
        if sp.rid is None:
            return None
        node = s.nodes.get(sp.rid)
        if node is None:
            raise ValueError(f"request {sp.rid!r} is not in session {s.id!r} (unknown, or dropped by replace)")
        if not sp.replace and not node.req.finished:
            raise ValueError(f"request {sp.rid!r} of session {s.id!r} has not finished: wait for its output "
                             "before continuing it (or pass replace=True)")
        return node

    def _check_length(self, s: Session, ids: list[int], req: Request) -> None:
        ctx = self._context_length
        if ctx is None:
            return
        n, mnt = len(ids), req.params.max_new_tokens
        if n >= ctx:
            raise ValueError(f"the prompt in session {s.id!r} has {n} tokens, over the context length {ctx}")
        if mnt is not None and n + mnt > ctx and not self._overflow:
            raise ValueError(f"max_new_tokens={mnt} with the {n}-token prompt in session {s.id!r} exceeds the "
                             f"context length {ctx} (pass a smaller max_new_tokens or "
                             "Engine(allow_context_overflow=True) to cut generation at the context length)")

    def _drop(self, s: Session, keep: Optional[SessionNode]) -> None:
        """replace: forget ``keep``'s continuations (all nodes when None), aborting running ones."""
        doomed = list(s.nodes.values()) if keep is None else _descendants(keep)
        if keep is not None:
            keep.children = []
            doomed.append(keep)                      # aborted if it still runs, but kept
        for n in doomed:
            if not n.req.finished:
                self._abort(n.req.rid, f"replaced by a later request of session {s.id!r}")
            if n is not keep:
                s.nodes.pop(n.req.rid, None)

    # ---- KV pin ---------------------------------------------------------------------------------
    def on_finish(self, req: Request) -> None:
        """The scheduler finished ``req`` (its full pages are in the prefix cache): a request of an
        open session pins its sequence there, in place of the session's earlier pin."""
        sp = req.session
        if sp is None:
            return
        s = self._sessions.get(sp.id)
        if s is None:
            return                                   # closed meanwhile
        node = s.pending if s.streaming else s.nodes.get(req.rid)
        if node is None or node.req is not req or (s.streaming and _aborted(req)):
            return                                   # dropped by replace, or not a streaming session's latest
        pages, _ = self._cache.match(req.all_ids[:min(req.num_computed, s.capacity)], touch=False,
                                     ns=req.lora_id)
        room = self._max_pinned - (self.pinned_pages - len(s.pinned))
        self._pin(s, pages[:max(room, 0)])

    def _pin(self, s: Session, pages: list[int]) -> None:
        self._pool.ref(pages)                        # first: pages shared with the old pin stay allocated
        self._pool.unref(s.pinned)
        self.pinned_pages += len(pages) - len(s.pinned)
        s.pinned = pages


def _aborted(req: Request) -> bool:
    fr = req.finish_reason
    return fr is not None and fr.type == ABORT


def _descendants(node: SessionNode) -> list[SessionNode]:
    out, todo = [], list(node.children)
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(n.children)
    return out
