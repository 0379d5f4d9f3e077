"""Length-bounded JSON strings in a form whose bitmask fill is cheap (xgrammar's EBNF, rewritten).

xgrammar turns a JSON-schema string with ``maxLength`` into a counted repetition,
``"\\"" chars{lo, hi} "\\""``. Its matcher cannot precompute the token masks of the states inside
such a repetition: every fill there checks the vocabulary's tokens one by one at run time, about
0.1-20 ms a row against ~3 us inside an unbounded string (measured with SmolLM2's 49k vocabulary
on record-extraction outputs; a batch of 256 rows then spends tens of ms per step in xgrammar).

The rewrite expresses the same language the way xgrammar writes its own unbounded strings: a
right-recursive rule per remaining length ``k`` that either closes the string or takes one more
character, each with the lookahead assertion "then a JSON separator" (``,`` ``}`` ``]`` or ``:``
after optional whitespace). With that assertion xgrammar decides at compile time which tokens may
close the string, so fills inside it are table lookups again. The assertion holds wherever a
string can stand inside an object or an array, so it is applied only to schemas whose top level is
an object or an array (a top-level string is followed by the end of the output instead).
One change on purpose: xgrammar's bounded strings admit raw control characters (a tab, ``\x01``),
which are not valid JSON (``json.loads`` refuses them); the rewritten ones take JSON's string
characters. Otherwise the masks are unchanged (tests/test_grammar_rewrite.py compares both grammars
token by token).
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

MAX_UNROLL = 1024   # longest bound rewritten (one grammar rule per character of room)
# xgrammar's print of a bounded string rule: name ::= (("\"" chars{lo, hi} "\""))
_BOUNDED = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.M)
_FOLLOW = r'(=([ \n\r\t]* [,}\]:]))'   # what follows a string inside JSON structure
# one unescaped character of a JSON string: xgrammar's bounded strings use [^"\\\r\n], which lets raw
# control characters (a tab, \x01) through, and json.loads refuses those
_CHAR = r'[^\0-\x1f\"\\]'


def nested_only(schema_text: str) -> bool:
    """True when the schema's top level is an object or an array (its strings are all nested)."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return False
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind in ("object", "array"):
        return True
    return kind is None and "properties" in schema and not any(
        k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "enum", "const"))


def unroll_bounded_strings(ebnf: str) -> Optional[str]:
    """The EBNF with its bounded string rules rewritten (see the module docstring), or None when it
    has none to rewrite."""
    extra: list[str] = []

    def rewrite(m: re.Match) -> str:
        name, lo, hi = m.group(1), int(m.group(3)), int(m.group(4))
        if hi < lo or hi > MAX_UNROLL:
            return m.group(0)
        rest = f"{name}_nbgen_room"
        # rest{k}: the closing quote, or one more character and rest{k-1}
        extra.append(f'{rest}0 ::= (("\\"")) {_FOLLOW}')
        extra.extend(f'{rest}{k} ::= (("\\"") | ({_CHAR} {rest}{k - 1})) {_FOLLOW}' for k in range(1, hi - lo + 1))
        return f'{name} ::= (("\\""{f" {_CHAR}" * lo} {rest}{hi - lo}))'

    out = _BOUNDED.sub(rewrite, ebnf)
    if not extra:
        return None
    return out.rstrip("\n") + "\n" + "\n".join(extra) + "\n"


def fast_json_grammar(schema_text: str, any_whitespace: bool = False) -> Optional[Any]:
    """xgrammar Grammar of a JSON schema with its bounded strings rewritten, or None where nothing
    applies (then compile the schema as usual)."""
    if not nested_only(schema_text):
        return None
    import xgrammar as xgr

    ebnf = unroll_bounded_strings(str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace)))
    return None if ebnf is None else xgr.Grammar.from_ebnf(ebnf)
