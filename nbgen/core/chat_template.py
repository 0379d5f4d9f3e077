"""The ``chat_template`` Engine argument (SGLang's server arg): a file, a Jinja string or a name.

- a path to an existing ``.jinja`` file (or any text file but ``.json``): its Jinja source, read as
  SGLang reads it (surrounding newlines stripped, a literal ``\\n`` turned into a newline);
- a string holding Jinja markup (``{{`` or ``{%``): that template itself;
- anything else is a name: one of the tokenizer's named templates (HF tokenizers may carry several,
  e.g. ``default`` and ``tool_use``). SGLang's own conversation-template names and its ``.json``
  conversation files are not Jinja and are refused.

``check_chat_template`` runs when the EngineConfig is made (bad values fail before the model loads);
``apply_chat_template_arg`` sets the tokenizer's template once it is loaded.
"""
from __future__ import annotations

import os
from typing import Any, Optional

_MARKUP = ("{{", "{%")


def _is_source(arg: str) -> bool:
    return any(m in arg for m in _MARKUP)


def _looks_like_path(arg: str) -> bool:
    return arg.endswith((".jinja", ".json", ".j2", ".txt")) or os.sep in arg or arg.startswith("~")


def check_chat_template(arg: Any) -> None:
    """ValueError naming chat_template when ``arg`` can never be a template (None passes)."""
    if arg is None:
        return
    if not isinstance(arg, str) or not arg.strip():
        raise ValueError(f"chat_template must be None, a .jinja file, a Jinja template string or a template "
                         f"name, got {arg!r:.80}")
    if _is_source(arg):
        return
    path = os.path.expanduser(arg)
    if os.path.isfile(path):
        if path.endswith(".json"):
            raise ValueError(f"chat_template {arg!r}: SGLang's JSON conversation templates are not supported "
                             "yet by nbgen; pass a .jinja file or a Jinja template string")
        return
    if _looks_like_path(arg):
        raise ValueError(f"chat_template file {arg!r} does not exist")


def chat_template_source(arg: str) -> Optional[str]:
    """The Jinja source ``arg`` gives (a file's or the string itself), or None when ``arg`` is a name."""
    if _is_source(arg):
        return arg
    path = os.path.expanduser(arg)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip("\n").replace("\\n", "\n")   # as SGLang's template manager reads it
    return None


def apply_chat_template_arg(tokenizer: Any, arg: Optional[str]) -> None:
    """Set ``tokenizer.chat_template`` from the Engine's ``chat_template`` (None: keep the model's).

    A name selects one of the tokenizer's named templates; ValueError naming chat_template when it
    has no template of that name."""
    if arg is None or tokenizer is None:
        return
    source = chat_template_source(arg)
    if source is not None:
        tokenizer.chat_template = source
        return
    current = getattr(tokenizer, "chat_template", None)
    named = dict(current) if isinstance(current, dict) else ({"default": current} if current else {})
    if arg not in named:
        have = ", ".join(repr(n) for n in named) or "none"
        raise ValueError(f"chat_template {arg!r} is not a file, a Jinja template or a named template of the "
                         f"tokenizer (its named templates: {have}); SGLang's built-in conversation templates "
                         "are not supported yet by nbgen")
    tokenizer.chat_template = named[arg]
