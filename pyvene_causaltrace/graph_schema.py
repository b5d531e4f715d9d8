"""The attribution-graph JSON schema, written once in ``graph.schema.json``: Neuronpedia's
"Anthropic Attribution Graph" 1.0.0 (draft-07), the format circuit-tracer writes.

``attribute``'s export is checked against it (:func:`validate`), and the viewer lists any file
that validates. A parsed payload of millions of links is several times the file in memory, so
:data:`NODE` and :data:`LINK` check one node or link against the schema's ``items`` (the viewer
keeps only each verdict as it parses) and :func:`outer_problem` checks the rest."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("graph.schema.json")
#: The schema (a JSON Schema, draft-07).
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))

#: The Python types that ``json`` parses each JSON Schema type into (exactly: a bool is no
#: integer); jsonschema's draft-07 checker also takes an integral float for an integer.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "null": (type(None),),
    "boolean": (bool,), "object": (dict,), "array": (list,)}
_NOTES = {"description", "examples", "title"}
class ItemCheck:
    """One node's or link's check: its required keys and each known key's type, read from the
    schema's ``items`` (which may say no more than that: anything else raises at import)."""

    def __init__(self, subschema: dict[str, Any], where: str) -> None:
        unknown = set(subschema) - {"type", "required", "properties"} - _NOTES
        if subschema.get("type") != "object" or unknown:
            raise ValueError(f"{SCHEMA_PATH.name}: {where} says more than type, required and "
                             f"properties ({sorted(unknown)}): check it with jsonschema")
        self.required = tuple(subschema.get("required", ()))
        #: (key, the Python types it admits, whether an integral float is one, its words)
        self.types: list[tuple[str, frozenset[type], bool, str]] = []
        for key, sub in subschema.get("properties", {}).items():
            kinds = sub.get("type")
            kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds or ())
            if set(sub) - {"type"} - _NOTES or not kinds or set(kinds) - set(_TYPES):
                raise ValueError(f"{SCHEMA_PATH.name}: {where}.{key} is not a plain type")
            admits = frozenset(t for kind in kinds for t in _TYPES[kind])
            self.types.append((key, admits, "integer" in kinds,
                               f"{key}: not of type {' or '.join(kinds)}"))

    def problem(self, item: object) -> str | None:
        """Why ``item`` does not match, in words that never quote its values (so the verdicts
        of a million items are a handful of distinct strings), or None."""
        if type(item) is not dict:  # noqa: E721 - exactly: what json parses an object into
            return "not an object"
        for key in self.required:
            if key not in item:
                return f"{key!r} is a required property"
        for key, admits, integral, words in self.types:  # called per node and link: kept lean
            if key in item:
                value = item[key]
                if type(value) not in admits \
                        and not (integral and type(value) is float and value.is_integer()):
                    return words
        return None


NODE = ItemCheck(SCHEMA["properties"]["nodes"]["items"], "nodes.items")
LINK = ItemCheck(SCHEMA["properties"]["links"]["items"], "links.items")

#: The schema without the nodes' and links' items (those are :data:`NODE` and :data:`LINK`).
OUTER: dict[str, Any] = copy.deepcopy(SCHEMA)
del OUTER["properties"]["nodes"]["items"], OUTER["properties"]["links"]["items"]


def outer_problem(payload: object) -> str | None:
    """The first violation of the schema outside the nodes' and links' items (where, and
    what), or None."""
    import jsonschema  # slow to import: loads when a file that may be a graph is checked

    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(OUTER)
                                             .iter_errors(payload))
    if error is None:
        return None
    where = ".".join(str(part) for part in error.absolute_path)
    message = error.message if len(error.message) <= 160 else error.message[:157] + "..."
    return f"{where or 'the top level'}: {message}"


def validate(payload: object) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``payload`` matches the whole schema:
    jsonschema outside the nodes' and links' items, :data:`NODE` and :data:`LINK` on each of
    those (the same verdicts; jsonschema alone took 5 s for a graph of 113k links)."""
    import jsonschema  # slow to import: loads when a graph is checked

    jsonschema.validate(payload, OUTER, cls=jsonschema.Draft7Validator)
    for key, check in (("nodes", NODE), ("links", LINK)):
        for index, item in enumerate(payload.get(key, ())):
            problem = check.problem(item)
            if problem is not None:
                raise jsonschema.ValidationError(f"{key}[{index}]: {problem}")
