"""JSON schemas the engine would not honour are refused before they reach it.

xgrammar compiles many JSON-schema keywords into the grammar, but ignores some silently: the output would
then be valid JSON that does not validate. Each keyword below was measured (xgrammar 0.2.9, a schema with
the keyword, a value that breaks it: the matcher accepted the value), so a schema using one is refused,
naming the keyword and where it is (vLLM's users report such schemas served as if the keyword were absent).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

UNENFORCED = {
    "not": "negation is not enforced",
    "if": "conditional subschemas are not enforced",
    "then": "conditional subschemas are not enforced",
    "else": "conditional subschemas are not enforced",
    "uniqueItems": "unique array items are not enforced",
    "contains": "array 'contains' is not enforced",
    "maxContains": "array 'contains' is not enforced",
    "minContains": "array 'contains' is not enforced",
    "dependentRequired": "dependent requirements are not enforced",
    "dependentSchemas": "dependent schemas are not enforced",
    "dependencies": "dependent requirements are not enforced",
    "patternProperties": "pattern properties are not supported (valid objects would be refused)",
    "$dynamicRef": "dynamic references are not supported",
}
FORMATS = frozenset({"email", "date", "date-time", "time", "uuid", "ipv4", "ipv6", "uri", "hostname", "duration"})
"""String formats xgrammar enforces (each measured); any other format would be ignored."""

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")


MAX_DEPTH = 32
"""Deepest nesting of objects and arrays a schema may have (deeper ones are refused, not recursed into)."""


def check_json_schema(schema: Any) -> None:
    """ValueError naming the problem when `schema` is not a valid JSON schema (draft 2020-12) or uses a
    keyword the engine would not enforce."""
    import jsonschema

    _check_depth(schema)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"invalid JSON schema at #/{where}: {e.message}") from None
    for path, node in subschemas(schema, "#"):
        for keyword, why in UNENFORCED.items():
            if keyword in node:
                raise ValueError(f"JSON schema keyword '{keyword}' at {path} is not supported: {why}")
        fmt = node.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"JSON schema format '{fmt}' at {path} is not supported (supported: "
                             f"{', '.join(sorted(FORMATS))})")
        _check_combinations(node, path)
        if len(node.get("allOf", ())) > 1:
            raise ValueError(f"JSON schema 'allOf' with more than one subschema at {path} is not supported: "
                             "only the first would be enforced")
        if "oneOf" in node and not _exclusive(node["oneOf"]):
            raise ValueError(f"JSON schema 'oneOf' at {path} is not supported unless its branches exclude each "
                             "other (distinct types, or a property with a distinct const in each): exactly-one "
                             "is not enforced; use anyOf")


def _check_depth(schema: Any) -> None:
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"JSON schema nests deeper than {MAX_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _check_combinations(node: dict, path: str) -> None:
    """Keyword combinations xgrammar drops a part of (each measured): length bounds beside a pattern or a
    format, or on anything but a plain string; multipleOf on non-integers; required names no property has."""
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if lengths and node.get("type") != "string":
        raise ValueError(f"JSON schema '{lengths[0]}' at {path} is supported only with \"type\": \"string\"")
    if lengths and ("pattern" in node or "format" in node):
        raise ValueError(f"JSON schema '{lengths[0]}' at {path} is not enforced together with "
                         f"'{'pattern' if 'pattern' in node else 'format'}'")
    if "multipleOf" in node and node.get("type") != "integer":
        raise ValueError(f"JSON schema 'multipleOf' at {path} is enforced only for \"type\": \"integer\"")
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [name for name in node.get("required", ()) if name not in properties]
    if missing and node.get("additionalProperties") is not True:
        raise ValueError(f"JSON schema at {path} requires {missing[0]!r}, which is not in its properties")


def subschemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in `node` (itself included) with its JSON-pointer path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            yield from subschemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or ()) if isinstance(node.get(key), list) else ():
            yield from subschemas(sub, f"{path}/{key}/{i}")
    for key in _SCHEMAS:
        yield from subschemas(node.get(key), f"{path}/{key}")


def _exclusive(branches: list) -> bool:
    """Whether no value can match two of the branches: each has a single distinct type (integer counts as a
    number), or all are objects sharing a required property whose const differs in each (pydantic's
    discriminated unions)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types):
        widened = ["number" if t == "integer" else t for t in types]
        if len(set(widened)) == len(widened):
            return True
    common = None
    for b in branches:
        consts = {name: sub["const"] for name, sub in (b.get("properties") or {}).items()
                  if isinstance(sub, dict) and "const" in sub and name in (b.get("required") or ())}
        common = set(consts) if common is None else common & set(consts)
    for name in common or ():
        values = [_json_key(b["properties"][name]["const"]) for b in branches]
        if len(set(values)) == len(values):
            return True
    return False


def _json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
