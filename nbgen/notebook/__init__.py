"""Notebook helpers: live dashboard, streamed output cells, sampling playground, chat sessions.

ipywidgets is imported only when a widget is built; without it the helpers fall back to
updating HTML outputs (dashboard, stream) or a one-shot view (playground).
"""
from nbgen.notebook.chat_session import ChatSession, ChatTurn, chat_session
from nbgen.notebook.dashboard import Dashboard, dashboard
from nbgen.notebook.playground import Playground, playground
from nbgen.notebook.profile import Profile, profile
from nbgen.notebook.stream import StreamCell, stream

__all__ = ["ChatSession", "ChatTurn", "chat_session", "Dashboard", "dashboard", "StreamCell", "stream", "Playground", "playground", "Profile", "profile"]
