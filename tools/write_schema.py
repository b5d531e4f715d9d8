"""Rewrite the shipped spec schema's generated parts from the code: the component names
(``models.SITES``) and one branch per registered intervention type (``specs.entry_schemas``).

    python tools/write_schema.py

A development tool, not shipped in the wheel; tests/test_spec_registry.py checks that the
shipped ``pyvene_causaltrace/spec.schema.json`` is what it writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_schema(path: Path | None = None) -> Path:
    """Rewrite ``spec.schema.json`` (by default the package's) in place; returns its path."""
    from pyvene_causaltrace.models import SITES
    from pyvene_causaltrace.specs import SCHEMA_PATH, entry_schemas, spec_schema

    path = SCHEMA_PATH if path is None else Path(path)
    schema = json.loads(path.read_text())
    schema["$defs"]["component"]["anyOf"][0]["enum"] = list(SITES)
    schema["$defs"]["intervention"] = entry_schemas()
    path.write_text(json.dumps(schema, indent=2) + "\n")
    spec_schema.cache_clear()
    return path


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
    print(f"wrote {write_schema()}")
