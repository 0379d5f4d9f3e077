"""SGLang's server arguments, every one by one rule: implemented, accepted with no effect, or refused.

- **implemented**: an ``EngineConfig`` field with SGLang's meaning.
- **accepted, no effect**: the argument has nothing to act on in an in-process, single-process engine
  (the HTTP server, API keys, request logs, metrics exporters, tokenizer workers, ...).
  ``Engine(...)`` takes it, and one warning names every such argument passed.
- **refused**: ``ValueError("<name> is not supported yet by nbgen ...")``: anything that would change
  outputs or speed is never ignored. Passing SGLang's default value asks for nothing nbgen lacks,
  so a refused argument is accepted with that value (and with the few values listed in
  ``ALSO_ACCEPTED``, which are what nbgen does anyway).

A name that is neither SGLang's nor nbgen's raises with the closest known name. The names are the
fields of SGLang's ``ServerArgs`` (``server_args_data.py``); ``markdown_table()`` is
docs/server_args.md.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable

from nbgen.core.server_args_data import (ALSO_ACCEPTED, HINTS, IMPLEMENTED, NO_EFFECT, REFUSED,
                                         SGLANG_DEFAULTS, SGLANG_RELEASES)

STATUS_IMPLEMENTED = "implemented"
STATUS_NO_EFFECT = "accepted, no effect"
STATUS_REFUSED = "refused"


@dataclass(frozen=True)
class ServerArg:
    """One SGLang server argument: its status in nbgen, why, and (refused ones) the values accepted."""

    name: str
    status: str
    note: str
    accepted_values: tuple[Any, ...] = ()   # refused: SGLang's default, then ALSO_ACCEPTED's values

    def accepts(self, value: Any) -> bool:
        """Whether a refused argument passed with ``value`` asks for nothing nbgen lacks."""
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) and (value is None) == (v is None)
                   for v in self.accepted_values)


def _build() -> dict[str, ServerArg]:
    table: dict[str, ServerArg] = {}
    for name, note in IMPLEMENTED.items():
        table[name] = ServerArg(name, STATUS_IMPLEMENTED, note)
    for note, names in NO_EFFECT.items():
        for name in names:
            table[name] = ServerArg(name, STATUS_NO_EFFECT, note)
    for note, names in REFUSED.items():
        for name in names:
            values = (SGLANG_DEFAULTS.get(name),) + ALSO_ACCEPTED.get(name, ())
            table[name] = ServerArg(name, STATUS_REFUSED, note, values)
    return table


# every SGLang server argument -> its status in nbgen
SERVER_ARGS: dict[str, ServerArg] = _build()


def _shown(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else f"'{value}'"


def refusal(name: str) -> ValueError:
    """The ValueError for a refused argument: what it belongs to and the values nbgen accepts."""
    arg = SERVER_ARGS[name]
    hint = f"; {HINTS[name]}" if name in HINTS else ""
    values = " or ".join(_shown(v) for v in arg.accepted_values)
    return ValueError(f"{name} is not supported yet by nbgen ({arg.note}{hint}); "
                      f"leave it out{' or pass ' + values if values else ''}")


def unknown_key_error(kind: str, key: str, known: Iterable[str]) -> ValueError:
    """A ValueError naming an unknown keyword, with the closest known name when there is one."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {kind} {key!r}{hint}")


def split_engine_kwargs(kwargs: dict[str, Any], own: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Engine(**kwargs) sorted by the rule: (the kwargs of ``own`` fields, the no-effect names passed).

    Raises ValueError for a refused argument passed with a value nbgen cannot honour, and for a name
    that is neither in ``own`` nor SGLang's."""
    mine: dict[str, Any] = {}
    ignored: list[str] = []
    for name, value in kwargs.items():
        arg = SERVER_ARGS.get(name)
        if name in own:
            mine[name] = value
        elif name == "server_args":   # SGLang's Engine(server_args=ServerArgs(...)): no ServerArgs here
            raise ValueError("server_args (a ServerArgs object) is not taken by nbgen: pass its fields as "
                             "keyword arguments, e.g. Engine(model_path=..., mem_fraction_static=...)")
        elif arg is None:
            raise unknown_key_error("Engine argument", name, list(own) + list(SERVER_ARGS))
        elif arg.status == STATUS_NO_EFFECT:
            ignored.append(name)
        elif not arg.accepts(value):
            raise refusal(name)
    return mine, ignored


def no_effect_message(names: list[str]) -> str:
    """The one warning for the no-effect arguments passed, grouped by reason."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(SERVER_ARGS[name].note, []).append(name)
    parts = "; ".join(f"{', '.join(ns)} ({note})" for note, ns in groups.items())
    return f"nbgen accepts these SGLang arguments but they have no effect here: {parts}"


def markdown_table() -> str:
    """docs/server_args.md: every SGLang server argument with its status and note."""
    counts = {s: sum(a.status == s for a in SERVER_ARGS.values())
              for s in (STATUS_IMPLEMENTED, STATUS_NO_EFFECT, STATUS_REFUSED)}
    lines = [
        "# SGLang server arguments in nbgen",
        "",
        f"Every field of SGLang's `ServerArgs` (releases {' and '.join(SGLANG_RELEASES)}, "
        f"{len(SERVER_ARGS)} names) under one rule (`nbgen/core/server_args.py`; this page is "
        "`markdown_table()` of that module):",
        "",
        f"- **implemented** ({counts[STATUS_IMPLEMENTED]}): an `Engine` argument with SGLang's meaning "
        "([api.md](api.md) has the details).",
        f"- **accepted, no effect** ({counts[STATUS_NO_EFFECT]}): nothing to act on in an in-process, "
        "single-process engine; `Engine(...)` takes it and one `UserWarning` names every such argument passed.",
        f"- **refused** ({counts[STATUS_REFUSED]}): `ValueError(\"<name> is not supported yet by nbgen ...\")` "
        "unless passed with SGLang's default value (or a value the note names): nothing that would change "
        "outputs or speed is ignored.",
        "",
        "A name that is neither SGLang's nor nbgen's raises `ValueError` with the closest known name.",
        "",
        "| name | status | note |",
        "|---|---|---|",
    ]
    for name in sorted(SERVER_ARGS):
        arg = SERVER_ARGS[name]
        note = arg.note
        if arg.status == STATUS_REFUSED:
            hint = f"; {HINTS[name]}" if name in HINTS else ""
            note = f"{note}{hint}; accepted: {', '.join(f'`{_shown(v)}`' for v in arg.accepted_values)}"
        lines.append(f"| `{name}` | {arg.status} | {note} |")
    return "\n".join(lines) + "\n"

