"""A bench's results as a JSON file: the shared ``--json FILE`` option and its writer.

Every bench that keeps its numbers for later (docs tables, comparisons across calls) takes the same
option; ``write_json`` does nothing when it was not given, so a bench's tail is one call.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Optional


def add_json_option(ap: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json FILE``: where the bench writes ``what`` (nothing written without it)."""
    ap.add_argument("--json", default=None, metavar="FILE", help=f"write {what} to this file")


def write_json(path: Optional[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path``; no-op when ``path`` is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
