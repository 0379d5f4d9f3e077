"""A JSON-schema check for the benches' outputs without the ``jsonschema`` package (the GPU host may
lack it): the keywords the bench schemas use — type, properties, required, additionalProperties
(false), enum, items, minItems / maxItems, minLength / maxLength, minimum / maximum. Unknown
keywords are refused, so a schema the check cannot judge is never passed silently."""
from __future__ import annotations

from typing import Any

KNOWN = {"type", "properties", "required", "additionalProperties", "enum", "items", "minItems", "maxItems",
         "minLength", "maxLength", "minimum", "maximum", "description", "title"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def schema_errors(doc: Any, schema: dict, path: str = "$") -> list[str]:
    """Every violation of ``schema`` by ``doc`` as 'path: message' (empty: valid)."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema keywords not checked here: {sorted(unknown)}")
    errs: list[str] = []
    kind = schema.get("type")
    if kind is not None and not _is_type(doc, kind):
        return [f"{path}: {type(doc).__name__} is not {kind}"]
    if "enum" in schema and doc not in schema["enum"]:
        errs.append(f"{path}: {doc!r} not in {schema['enum']}")
    if isinstance(doc, str):
        if len(doc) < schema.get("minLength", 0) or len(doc) > schema.get("maxLength", len(doc)):
            errs.append(f"{path}: length {len(doc)} out of bounds")
    if isinstance(doc, (int, float)) and not isinstance(doc, bool):
        if "minimum" in schema and doc < schema["minimum"] or "maximum" in schema and doc > schema["maximum"]:
            errs.append(f"{path}: {doc} out of [{schema.get('minimum')}, {schema.get('maximum')}]")
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0) or len(doc) > schema.get("maxItems", len(doc)):
            errs.append(f"{path}: {len(doc)} items out of bounds")
        if "items" in schema:
            for i, v in enumerate(doc):
                errs += schema_errors(v, schema["items"], f"{path}[{i}]")
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in doc]
        for k, v in doc.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties", True) is False:
                errs.append(f"{path}: unexpected {k!r}")
    return errs


def _is_type(doc: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(doc, int) and not isinstance(doc, bool)
    if kind == "number":
        return isinstance(doc, (int, float)) and not isinstance(doc, bool)
    if kind == "null":
        return doc is None
    return isinstance(doc, TYPES[kind])
