"""nbgen.chat_session(llm): a multi-turn chat in the notebook over one engine session.

``chat.send(text)`` streams the reply into the cell (a ``ChatTurn``: the stream cell with its Stop
button, static HTML once the reply is complete) and returns at once; the next ``send`` waits for it.
The chat template renders the whole conversation each turn. When that rendering's token ids start
with the previous turn's prompt + reply ids (templates that render an assistant message exactly
as it was generated do), only the new ids are sent, continuing the previous request in the engine
session: its KV pages are reused and stay pinned while the chat is open. Otherwise the whole
rendering is sent as a new root of the session (``replace``), and the prefix cache still shares
what the two renderings have in common. ``chat.messages`` is the transcript; ``chat.close()``
closes the engine session, and the chat's own display (``chat`` as a cell's value) becomes static.
"""
from __future__ import annotations

import html
import itertools
import threading
from typing import Any, Mapping, Optional

from nbgen.notebook import _compat
from nbgen.notebook._compat import Shown
from nbgen.notebook.stream import StreamCell, StreamState


class TurnState(StreamState):
    """A stream's state that also keeps the reply's token ids (carried whole by the final chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.output_ids: Optional[list[int]] = None

    def add(self, chunk: Mapping[str, Any]) -> str:
        piece = super().add(chunk)
        if (chunk.get("meta_info") or {}).get("finish_reason"):
            self.output_ids = list(chunk.get("output_ids") or [])
        return piece


class ChatTurn(StreamCell):
    """One user message and its streamed reply. ``continued``: the prompt continued the previous
    turn's ids in the engine session (False: the whole conversation was sent)."""

    def __init__(self, engine: Any, text: str, input_ids: list[int], session_params: dict[str, Any],
                 sampling_params: Optional[dict[str, Any]], widget: Optional[bool]) -> None:
        super().__init__(engine, text, sampling_params, widget=widget, show_prompt=True)
        self.state = TurnState()
        self.input_ids = input_ids
        self.session_params = session_params
        self.continued = "rid" in session_params

    def start(self, display: bool = True) -> "ChatTurn":
        """Send the request and stream its reply on a thread; shown in the cell (IPython) or
        printed as it arrives (elsewhere) when ``display``."""
        shown = display and _compat.ipython_active()
        self._print = display and not shown
        it = self.engine.generate(None, self.sampling_params, input_ids=self.input_ids, stream=True,
                                  rid=self.rid, session_params=self.session_params)
        first = next(it)   # a refused request (closed session, bad params) raises here, in the cell
        self._thread = threading.Thread(target=self._run, args=(itertools.chain([first], it),),
                                        name="nbgen-chat", daemon=True)
        self._thread.start()
        if shown:
            self.show()
        return self

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until the reply is complete and its display final; return its text."""
        text = super().wait(timeout)
        if self._done.is_set() and self._thread is not None:
            self._thread.join(timeout)
        return text


class ChatSession(Shown):
    """A conversation over one engine session: ``send``, ``messages``, ``turns``, ``close``."""

    def __init__(self, engine: Any, system_prompt: Optional[str] = None,
                 sampling_params: Optional[dict[str, Any]] = None, widget: Optional[bool] = None) -> None:
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
        if not getattr(engine, "has_chat_template", False):
            raise ValueError("chat_session needs a model whose tokenizer has a chat template")
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.sampling_params = sampling_params
        self.widget_mode = widget
        self.turns: list[ChatTurn] = []
        self._messages: list[dict[str, str]] = ([{"role": "system", "content": system_prompt}]
                                                if system_prompt is not None else [])
        self._lock = threading.Lock()
        self._seq: Optional[list[int]] = None     # the last turn's prompt + reply ids
        self._prompt: list[int] = []              # the last turn's whole prompt ids
        self._settled = 0                         # turns whose reply is in the transcript
        self.closed = False
        self.session_id = engine.open_session(engine.get_model_info()["context_length"])

    # ---- conversation ---------------------------------------------------------------------------
    def send(self, text: str, display: bool = True) -> ChatTurn:
        """Add a user message and stream the reply; returns its ChatTurn at once (``.wait()``)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if self.closed:
            raise ValueError("this chat session is closed")
        self._wait_last()
        msgs = self._messages + [{"role": "user", "content": text}]
        ids = list(self.tokenizer.encode(self.engine.apply_chat_template(msgs)))
        prev, rid = self._seq, (self.turns[-1].rid if self.turns else None)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if prev and rid is not None and len(ids) > len(prev) and ids[:len(prev)] == prev and ids[len(prev)] != bos:
            new, sp = ids[len(prev):], {"id": self.session_id, "rid": rid}
        else:
            new, sp = ids, {"id": self.session_id, "replace": True}
        turn = ChatTurn(self.engine, text, new, sp, self.sampling_params, self.widget_mode)
        turn.start(display)
        with self._lock:
            self._messages.append({"role": "user", "content": text})
            self._prompt = ids
            self.turns.append(turn)
        return turn

    def _wait_last(self) -> None:
        """Wait for the last reply and put it in the transcript (once)."""
        if not self.turns:
            return
        turn = self.turns[-1]
        turn.wait()
        with self._lock:
            if self._settled == len(self.turns):
                return
            self._settled = len(self.turns)
            self._messages.append({"role": "assistant", "content": turn.text})
            out = turn.state.output_ids
            self._seq = self._prompt + out if out is not None and turn.state.error is None else None
        self._update_displays()

    @property
    def messages(self) -> list[dict[str, str]]:
        """The transcript as chat messages (waits for a reply still streaming)."""
        self._wait_last()
        with self._lock:
            return [dict(m) for m in self._messages]

    def close(self) -> None:
        """Wait for the last reply, close the engine session (its KV pin goes) and leave the
        chat's displays as static HTML; idempotent."""
        if self.closed:
            return
        self._wait_last()
        self.closed = True
        try:
            self.engine.close_session(self.session_id)
        except RuntimeError:   # the engine is shut down: nothing left to release
            pass
        self._finish_displays()

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- display --------------------------------------------------------------------------------
    def _text(self) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in self._messages]
        return "\n".join(lines + (["(closed)"] if self.closed else []))

    def _snapshot_html(self) -> str:
        rows = []
        for m in self._messages:
            color = {"user": "#4c78a8", "assistant": "#54a24b"}.get(m["role"], "#888")
            rows.append(f'<div class="nbgen-chat-{html.escape(m["role"])}" style="border-left:3px solid {color};'
                        f'padding-left:8px;margin:4px 0;white-space:pre-wrap"><b>{html.escape(m["role"])}</b>'
                        f'<br>{html.escape(m["content"])}</div>')
        tail = '<div style="color:#888;font-size:11px">(closed)</div>' if self.closed else ""
        return f'<div class="nbgen-chat" data-closed="{int(self.closed)}" style="font-family:monospace">' \
               f'{"".join(rows)}{tail}</div>'


def chat_session(engine: Any, system_prompt: Optional[str] = None,
                 sampling_params: Optional[dict[str, Any]] = None, *, widget: Optional[bool] = None) -> ChatSession:
    """A multi-turn chat over one engine session: ``chat.send(text)`` streams each reply into its
    cell, ``chat.messages`` is the transcript, ``chat.close()`` ends it (also ``with ... as chat``)."""
    return ChatSession(engine, system_prompt, sampling_params, widget=widget)
