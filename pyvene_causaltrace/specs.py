"""JSON experiment specs: schema, validation, load and save.

A spec is plain data — nothing pickled — so a file reproduces the same run anywhere (the noise
is seeded). The schema ships as ``spec.schema.json`` beside this module (``SCHEMA_PATH``);
errors name the JSON path of the bad field and what was expected. A user's pyvene
interventions go in ``model_interventions`` (:mod:`~pyvene_causaltrace.model_interventions`),
big tensors in a safetensors file :func:`save_spec` writes beside the JSON.

    spec = load_spec("intervention_specs/residual_trace.json")
    save_spec(spec, "copy.json")          # byte-for-byte the same data back"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from .arguments import checked
from .atomic import replacing, write_text
from .errors import NonFiniteError, SpecError
from .interventions import get_intervention, list_interventions
from .interventions.spec_entry import SpecEntry, entry_of, generic_schema
from .spec_tensors import externalize
from .strict_json import loads

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("spec.schema.json")
#: The deepest nesting a spec may have: real specs are under 10 levels, and validating a deeper
#: one would only hit Python's recursion limit.
MAX_DEPTH = 64


def check_depth(data: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON data nested deeper than ``limit``, naming the path where it gets too deep
    (iterative: the check itself cannot hit the recursion limit), or holding NaN or an
    infinity (Python's ``json`` reads them; a NaN passes every JSON Schema bound)."""
    stack = [(data, "$", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > limit:
            raise SpecError(path, f"nested too deeply (a spec is at most {limit} levels deep)")
        if isinstance(value, float) and not math.isfinite(value) \
                and not path.startswith("$.model_interventions"):  # tensors: saved to a file
            raise SpecError(path, f"must be finite, got {value} (NaN and infinities are not "
                            "JSON)")
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}", depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


@dataclass(frozen=True)
class InterventionSpec:
    """One entry of ``interventions``: its registered ``type`` and the rest of its fields."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.fields}


#: A spec's data fields, in the order a written spec lists them (after ``schema_version``).
_KEYS = ("name", "description", "model", "prompt", "subject", "subject_occurrence", "answer",
         "interventions", "trace", "attribution", "model_interventions")


@dataclass(frozen=True)
class ExperimentSpec:
    """A validated spec. ``to_dict()`` gives back exactly the JSON it came from."""

    prompt: str
    interventions: tuple[InterventionSpec, ...]
    subject: str | None = None
    subject_occurrence: int | None = None  # None: first occurrence, field absent
    answer: str | None = None
    model: str | None = None
    name: str | None = None
    description: str | None = None
    schema_version: int = SCHEMA_VERSION
    trace: dict[str, Any] | None = None  # {"kind", "window"}: a whole causal trace
    attribution: dict[str, Any] | None = None  # {"clt", "target", ...}: an attribution graph
    extra: dict[str, Any] = field(default_factory=dict)  # "$schema" and the like
    #: The pyvene interventions of the model the run was made on (model_interventions.py):
    #: rebuilt around the bare model, they act in every run.
    model_interventions: list[dict[str, Any]] | None = None
    #: The folder of the file the spec was read from: where its tensor files are (not data).
    base_dir: Path | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base_dir: str | Path | None = None
                  ) -> ExperimentSpec:
        """Validate ``data`` and wrap it; ``base_dir`` is the folder its tensor files are
        relative to (set by :func:`load_spec`)."""
        validate_spec(data)
        return cls(
            interventions=tuple(
                InterventionSpec(item["type"], {k: v for k, v in item.items() if k != "type"})
                for item in data["interventions"]
            ),
            schema_version=data["schema_version"],
            extra={k: v for k, v in data.items() if k.startswith("$")},
            base_dir=Path(base_dir) if base_dir is not None else None,
            **{key: data.get(key) for key in _KEYS if key != "interventions"},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.extra, "schema_version": self.schema_version}
        for key in _KEYS:
            value = getattr(self, key)
            if key == "interventions":
                value = [item.to_dict() for item in value]
            if value is not None:
                out[key] = value
        return out

    @property
    def noise(self) -> InterventionSpec | None:
        """The spec's ``noise_add`` entry, if any (it defines the batch rows: one per seed)."""
        return next((item for item in self.interventions if item.type == "noise_add"), None)


@lru_cache(maxsize=1)
def spec_schema() -> dict[str, Any]:
    """The JSON Schema of a spec, as shipped for editors: the spec's own fields, the shared
    ``$defs``, and one branch per built-in intervention type, written from each type's
    ``spec_schema()`` (``tools/write_schema.py`` writes them)."""
    return json.loads(SCHEMA_PATH.read_text())


def _spec_level_schema() -> dict[str, Any]:
    """The schema without the per-type branches: entries are checked through the registry."""
    schema = json.loads(json.dumps(spec_schema()))
    schema["$defs"]["intervention"] = {"type": "object", "required": ["type"],
                                       "properties": {"type": {"type": "string",
                                                               "minLength": 1}}}
    return schema


def entry_schemas() -> dict[str, Any]:
    """``$defs.intervention`` as written from the registered types: one if/then branch per
    type (a refused type's branch says why), the rest open to third-party types."""
    names = list_interventions()
    branches = []
    for name in names:
        entry = entry_of(get_intervention(name))
        then = ({"not": True, "description": entry.spec_refusal} if entry.spec_refusal
                else entry.spec_schema())
        branches.append({"if": {"properties": {"type": {"const": name}}}, "then": then})
    branches.append({"if": {"properties": {"type": {"not": {"enum": names}}}},
                     "then": generic_schema()})
    return {"type": "object", "required": ["type"],
            "properties": {"type": {"type": "string", "minLength": 1}}, "allOf": branches}


def validate_spec(data: Any) -> None:
    """Raise :class:`SpecError` for the first problem in ``data``, naming its JSON path: the
    spec's fields against the schema, each intervention against its registered type's
    ``spec_schema()`` and rules, so a plugin's type is checked exactly as a built-in is."""
    check_depth(data)
    _check_schema(_spec_level_schema(), data, "$")
    entries = [(f"$.interventions[{i}]", item, _entry(item["type"], f"$.interventions[{i}].type"))
               for i, item in enumerate(data["interventions"])]
    defs = spec_schema()["$defs"]
    for path, item, entry in entries:
        _check_schema({"type": "object", **entry.spec_schema(), "$defs": defs}, item, path)
    types = [item["type"] for item in data["interventions"]]
    for path, item, entry in entries:
        if entry.spec_unique and types.count(item["type"]) > 1:
            later = [p for p, other, _ in entries if other["type"] == item["type"]][1]
            raise SpecError(later, f"a spec has at most one {item['type']}")
        for needed in entry.spec_requires:
            if needed not in types:
                raise SpecError(path, f"{item['type']} acts inside a {needed}: add one")
        entry.check_spec(item, data, path)
    if "trace" in data and types != ["noise_add"]:
        raise SpecError("$.interventions", "a trace spec holds exactly one noise_add; the trace "
                        "makes the restores")
    if "attribution" in data:
        if data["interventions"]:
            raise SpecError("$.interventions", "an attribution spec holds no interventions; the "
                            "method builds the local replacement model")
        if "trace" in data:
            raise SpecError("$.attribution", "a spec is a trace or an attribution, not both")
        if data["attribution"].get("target") == "difference" and \
                "other" not in data["attribution"]:
            raise SpecError("$.attribution.other", "a 'difference' target needs 'other'")
        if "direction" in data["attribution"] and data.get("answer") is not None:
            raise SpecError("$.attribution.direction", "a direction target explains a "
                            "projection, 'answer' a logit: give one of them")
        if data.get("model_interventions"):
            raise SpecError("$.model_interventions", "an attribution spec cannot carry its "
                            "model's pyvene interventions yet: attribute the IntervenableModel "
                            "in Python (attribute(pv_model, ...))")
    if "subject_occurrence" in data and "subject" not in data:
        raise SpecError("$.subject_occurrence", "picks an occurrence of the subject, and the "
                        "spec has no subject")
    uses_subject = _mentions_subject([(item, entry) for _, item, entry in entries])
    if uses_subject and "subject" not in data:
        raise SpecError("$.subject", f"required by the position name {uses_subject!r}")


def _entry(kind: str, path: str) -> SpecEntry:
    """The spec questions' answerer for type ``kind``; an unknown type names the closest
    registered ones, a type no spec can hold says why."""
    known = list_interventions()
    if kind not in known:
        close = difflib.get_close_matches(kind, known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise SpecError(path, f"unknown intervention type {kind!r}; {hint}registered: "
                              f"{', '.join(known)} (a plugin registers its types when imported "
                              "or through the 'pyvene_causaltrace.interventions' entry point)")
    entry = entry_of(get_intervention(kind))
    if entry.spec_refusal:
        raise SpecError(path, entry.spec_refusal)
    return entry


def _check_schema(schema: dict[str, Any], data: Any, path: str) -> None:
    """Raise the deepest violation of ``schema`` by ``data`` (found at JSON path ``path``)."""
    import jsonschema  # slow to import: only validation needs it

    # an "integer" is an int: JSON Schema's 1.0 would reach a layer or range index as a float
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool))
    validator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                             type_checker=checker)
    errors = sorted(validator(schema).iter_errors(data),
                    key=lambda e: -len(e.absolute_path))
    if errors:
        error = _most_specific(errors[0])
        raise SpecError(path + error.json_path[1:], _expected(error))


def _most_specific(error):
    """Descend into oneOf/anyOf branches to the error that says what was expected."""
    while error.context:
        deeper = max(error.context, key=lambda e: len(e.absolute_path))
        if len(deeper.absolute_path) <= len(error.absolute_path):
            break
        error = deeper
    return error


def _expected(error) -> str:
    if error.validator in ("oneOf", "anyOf") and error.context:
        options = "; ".join(sorted({e.message for e in error.context}))
        return f"{error.instance!r} is not valid here; expected one of: {options}"
    return error.message


_SUBJECT_NAMES = ("subject", "first_subject", "last_subject", "after_subject")


def _mentions_subject(entries: list[tuple[dict[str, Any], SpecEntry]]) -> str | None:
    for item, entry in entries:
        default = entry.spec_schema().get("properties", {}).get("positions", {})
        positions = item.get("positions", default.get("default") if default else None)
        for value in positions if isinstance(positions, list) else [positions]:
            if value in _SUBJECT_NAMES:
                return value
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` keeps the last one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SpecError("$", f"the key {key!r} appears twice in one object (which one is "
                                 "meant?)")
        out[key] = value
    return out



@checked
def load_spec(path_or_dict: str | Path | dict[str, Any], *,
              base_dir: str | Path | None = None) -> ExperimentSpec:
    """Read and validate a spec from a JSON file path or an already-parsed dict. A file's
    folder is where its tensor files are found (``base_dir`` says it for a dict)."""
    if isinstance(path_or_dict, dict):
        return ExperimentSpec.from_dict(path_or_dict, base_dir=base_dir)
    path = Path(path_or_dict)
    try:
        data = loads(path.read_text(), object_pairs_hook=_unique_keys)
    except NonFiniteError as error:
        raise SpecError("$", f"{path}: {error}") from None
    except json.JSONDecodeError as error:
        raise SpecError("$", f"{path} is not valid JSON: {error}") from None
    except RecursionError:
        raise SpecError("$", f"{path} is nested too deeply to read (a spec is at most "
                             f"{MAX_DEPTH} levels deep)") from None
    except UnicodeDecodeError as error:
        raise SpecError("$", f"{path} is not UTF-8 text: {error}") from None
    return ExperimentSpec.from_dict(data, base_dir=path.absolute().parent)


def save_spec(spec: ExperimentSpec | dict[str, Any], path: str | Path, *,
              base_dir: str | Path | None = None) -> None:
    """Write ``spec`` (an :class:`ExperimentSpec` or a dict such as ``result.spec``) as
    indented JSON, whole or not at all; ``model_interventions`` tensors over
    :data:`~pyvene_causaltrace.spec_tensors.INLINE_LIMIT` elements (or non-finite) go to
    ``<name>.safetensors`` beside it, which ``load_spec(path)`` finds again. ``base_dir``: where a
    dict's existing tensor files are."""
    if not isinstance(spec, ExperimentSpec):
        spec = ExperimentSpec.from_dict(spec, base_dir=base_dir)
    path = Path(path)
    data = spec.to_dict()
    if spec.model_interventions:
        side = path.with_suffix(".safetensors")
        data["model_interventions"], tensors = externalize(spec.model_interventions,
                                                            side.name, spec.base_dir)
        if tensors:
            with replacing(side) as tmp:
                save_file(tensors, str(tmp))
    write_text(json.dumps(data, indent=2) + "\n", path)

