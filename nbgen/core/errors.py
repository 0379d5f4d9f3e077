"""The error an argument of the wrong kind raises.

nbgen's rule is that bad input raises ``ValueError`` naming the parameter. Python's habit (and several
SGLang checks) for a value of the wrong *type* is ``TypeError``. ``ArgumentTypeError`` is both, so
``except ValueError`` and ``except TypeError`` each catch it.
"""
from __future__ import annotations


class ArgumentTypeError(ValueError, TypeError):
    """An argument of the wrong type; the message names the parameter."""
