"""Each setting's default is written once (issue 40): every method's settings object —
:class:`~pyvene_causaltrace.attribution.AttributionSettings`,
:class:`~pyvene_causaltrace.attribution.ReadingSettings` (pruning, export),
:class:`~pyvene_causaltrace.tracing.TraceSettings`,
:class:`~pyvene_causaltrace.dataset.DatasetSettings`,
:class:`~pyvene_causaltrace.dataset.graphs.GraphSettings`,
:class:`~pyvene_causaltrace.crosscheck.CrossCheckSettings`,
:class:`~pyvene_causaltrace.steering.SteeringSettings` — owns its fields' defaults (read from
:mod:`pyvene_causaltrace.defaults`, where the torch-free parser reads them too). A function
parameter, a dataclass field or an argparse flag of one of these names anywhere in the package
defaults to a name, never to a literal of its own; a public signature's default of a field's
name is None or read from a settings object (``_DEFAULT.<field>``), never from
:mod:`~pyvene_causaltrace.defaults` (whose constants only the settings modules and the parser
import); every field of each settings object is a flag of its command (or listed here as not
one, with the reason), whose default and help state the field's; the spec schema's defaults say
the same values; each settings object is checked when made; and the entry points with
``settings=...`` run as with the keywords, refusing a keyword that contradicts the settings
object."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest
import torch
from _support.data import tool
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

import pyvene_causaltrace
from pyvene_causaltrace import defaults
from pyvene_causaltrace._settings import same_value
from pyvene_causaltrace.attribution import AttributionSettings, ReadingSettings, attribute
from pyvene_causaltrace.attribution.settings import BOS_ERRORS
from pyvene_causaltrace.attribution.targets import TARGET_KINDS
from pyvene_causaltrace.cli import attribute as cli_attribute
from pyvene_causaltrace.cli import steer as cli_steer
from pyvene_causaltrace.cli.common import number_or_name
from pyvene_causaltrace.cli.dataset import DATASET_FLAGS, dataset_settings
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.cli.trace import TRACE_FLAGS, trace_settings
from pyvene_causaltrace.crosscheck import CrossCheckSettings
from pyvene_causaltrace.dataset import DatasetSettings, trace_dataset
from pyvene_causaltrace.dataset.graphs import GraphSettings
from pyvene_causaltrace.dataset.records import FactRecord
from pyvene_causaltrace.dataset.settings import KNOWN_RULES
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.noise import DISTRIBUTIONS, SIGMA_METHODS
from pyvene_causaltrace.prompts import BOS_MODES
from pyvene_causaltrace.steering import SteeringSettings
from pyvene_causaltrace.tracing import Tracer, TraceSettings, trace
from pyvene_causaltrace.transcoders import load_from_disk

PACKAGE = Path(pyvene_causaltrace.__file__).parent
#: Every method's settings object.
SETTINGS_CLASSES = (AttributionSettings, ReadingSettings, TraceSettings, DatasetSettings,
                    GraphSettings, CrossCheckSettings, SteeringSettings)
SETTINGS = {f.name for f in dataclasses.fields(AttributionSettings)}
#: The tracing settings and the constants that hold their defaults.
TRACING = {"scale": (defaults.NOISE_SCALE,), "window": (defaults.WINDOW,),
           "seeds": (defaults.TRACE_SEEDS, defaults.DATASET_SEEDS)}
TRACE_FIELDS = {f.name: f.default for f in dataclasses.fields(TraceSettings)}
DATASET_FIELDS = {f.name: f.default for f in dataclasses.fields(DatasetSettings)}
#: field name -> the settings classes that have it.
OWNERS: dict[str, list[type]] = {}
for _cls in SETTINGS_CLASSES:
    for _field in dataclasses.fields(_cls):
        OWNERS.setdefault(_field.name, []).append(_cls)
#: Every name the scan reads.
SCANNED = set(OWNERS) | set(TRACING) | {"check_window", "check_modes"}
#: What each attribution setting means when not given (``None`` for the salient-logit
#: settings means circuit-tracer's values).
EFFECTIVE = {**{f.name: f.default for f in dataclasses.fields(AttributionSettings)},
             "max_n_logits": defaults.GRAPH_MAX_N_LOGITS,
             "desired_logit_prob": defaults.GRAPH_DESIRED_LOGIT_PROB}
#: A setting spelled otherwise in one module: (module, name) -> setting.
ALIASES = {("attribution/targets.py", "kind"): "target",
           ("cli/parser.py", "graph_memory_mb"): "memory_mb",
           ("cli/parser.py", "budget_mb"): "memory_budget_mb", ("cli/parser.py", "boot"): "n_boot",
           ("cli/parser.py", "check_features"): "top_n"}
#: The same name for another setting, with its own default: (module, name) -> what it is.
OTHER_SETTINGS = {
    ("transcoders/fit.py", "batch_size"): "tokens per optimiser step of a transcoder fit, not "
                                          "attribution rows per backward",
    ("fitting.py", "k"): "FitSettings.k, the TopK features a first transcoder keeps per token, "
                         "not a graph's top features",
    ("attribution/edges.py", "scale"): "Closure.scale, what a closure residual is relative to, "
                                       "not noise",
    ("interventions/noise.py", "seeds"): "a bare noise_add's seed list ([0]), not a trace's "
                                         "count of seeds",
    ("interventions/noise.py", "sigma"): "a bare noise_add's unit (1: the scale is the size), "
                                         "not a trace's sigma method",
    ("cli/parser.py", "limit"): "clt-check --limit: held-out texts, not a dataset run's facts "
                                "(whose default is None, all)",
    ("transcoders/formats/__init__.py", "limit"): "files named in an error message, not facts",
    ("lorsa_fitting.py", "top_k"): "LorsaFitSettings.top_k, the OV heads a Lorsa keeps per "
                                   "position, not steering's top tokens",
    ("dataset/graph_aggregate.py", "kinds"): "the trace kinds a graph aggregate is ranked "
                                             "against (none unless given), not a run's kinds",
}

_NO_LITERAL = object()


def _literal(node: ast.AST | None) -> object:
    """The value of ``node`` if it is a literal other than None, else ``_NO_LITERAL``."""
    if node is None:
        return _NO_LITERAL
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return _NO_LITERAL
    return _NO_LITERAL if value is None else value


def _dest(call: ast.Call) -> str | None:
    """The argparse dest of an ``add_argument`` call (``dest=`` or its first long flag)."""
    for keyword in call.keywords:
        if keyword.arg == "dest" and isinstance(keyword.value, ast.Constant):
            return keyword.value.value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
    long = [f for f in flags if f.startswith("--")] or flags
    return long[0].lstrip("-").replace("-", "_") if long else None


def defaults_in(source: str, module: str) -> list[tuple[int, str, str, object]]:
    """Every default of a setting in ``source``: ``(line, setting, how, literal)`` for
    function parameters, class fields (``name: type = value``, ``field(default=...)``),
    ``add_argument(..., default=...)`` and, in the command-line modules, dict entries keyed by
    a setting's name (their settings dicts; elsewhere such keys are metadata and schemas),
    ``literal`` being ``_NO_LITERAL`` where the value is a name, an expression
    or None."""
    names = SCANNED
    found = []

    def setting(name: str | None) -> str | None:
        name = ALIASES.get((module, name), name)
        return name if name in names else None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults,
                             strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                      if d is not None]
            for arg, default in pairs:
                if (name := setting(arg.arg)) is not None:
                    found.append((default.lineno, name, "parameter", _literal(default)))
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                if not (isinstance(statement, ast.AnnAssign)
                        and isinstance(statement.target, ast.Name) and statement.value):
                    continue
                if (name := setting(statement.target.id)) is None:
                    continue
                value = statement.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                found.append((statement.lineno, name, "field", _literal(value)))
        elif isinstance(node, ast.Dict) and module.startswith("cli/"):  # settings dicts
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(value, ast.Constant) and value.value in SCANNED:
                    continue  # a flag table (argparse dest -> field), not a default
                if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                        and (name := setting(key.value)) is not None:
                    found.append((key.lineno, name, "dict entry", _literal(value)))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if default is not None and (name := setting(_dest(node))) is not None:
                found.append((node.lineno, name, "flag", _literal(default)))
    return found


def _package_defaults() -> dict[tuple[str, str], list[tuple[int, str, object]]]:
    out: dict[tuple[str, str], list[tuple[int, str, object]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for line, name, how, value in defaults_in(path.read_text(encoding="utf-8"), module):
            out.setdefault((module, name), []).append((line, how, value))
    return out


FOUND = _package_defaults()


def test_no_setting_default_is_a_literal_outside_its_one_place():
    written = [f"pyvene_causaltrace/{module}:{line}: {how} {name} = {value!r}"
               for (module, name), entries in sorted(FOUND.items())
               if (module, name) not in OTHER_SETTINGS
               for line, how, value in entries if value is not _NO_LITERAL]
    assert written == [], ("a setting's default written again (read it from "
                           "AttributionSettings or pyvene_causaltrace.defaults):\n"
                           + "\n".join(written))
    # the scan reads what it must: each kind of place, in the modules that hold them
    seen = {(module, name, how) for (module, name), entries in FOUND.items()
            for _, how, _ in entries}
    assert {("attribution/attribute.py", "memory_mb", "parameter"),
            ("attribution/settings.py", "memory_mb", "field"),
            ("attribution/replacement.py", "bos_errors", "field"),
            ("dataset/graphs.py", "k", "field"),
            ("cli/parser.py", "k", "flag"), ("cli/parser.py", "memory_mb", "flag"),
            ("tracing/tracer.py", "scale", "parameter"), ("cli/parser.py", "seeds", "flag"),
            ("tracing/settings.py", "memory_budget_mb", "field"),
            ("tracing/settings.py", "sigma", "field"),
            ("tracing/tracer.py", "distribution", "parameter"),
            ("tracing/engine.py", "reuse_prefix", "parameter"),
            ("dataset/settings.py", "kinds", "field"), ("dataset/settings.py", "n_boot", "field"),
            ("dataset/run.py", "known", "parameter"), ("dataset/tasks.py", "known", "field"),
            ("cli/parser.py", "memory_budget_mb", "flag"), ("cli/parser.py", "n_boot", "flag"),
            ("cli/parser.py", "kinds", "flag"), ("cli/parser.py", "node_threshold", "flag"),
            ("cli/parser.py", "top_k", "flag"), ("cli/parser.py", "top_n", "flag"),
            ("cli/parser.py", "check_window", "flag"), ("cli/parser.py", "check_modes", "flag"),
            ("cli/parser.py", "max_new_tokens", "flag"),
            ("attribution/graph.py", "edge_threshold", "parameter"),
            ("attribution/export.py", "max_links", "parameter"),
            ("attribution/settings.py", "node_threshold", "field"),
            ("crosscheck/check.py", "window", "parameter"),
            ("crosscheck/settings.py", "modes", "field"),
            ("steering/settings.py", "top_k", "field"),
            ("steering/run.py", "top_k", "parameter")} <= seen
    # every exception names a default that is still there and still a literal
    stale = [key for key in OTHER_SETTINGS
             if not any(v is not _NO_LITERAL for _, _, v in FOUND.get(key, []))]
    assert stale == []


def test_the_scan_flags_a_duplicated_default_and_only_that():
    """The control: a module that writes defaults again, beside one that reads them."""
    source = (
        "import argparse\n"
        "from dataclasses import dataclass, field\n"
        "def f(x, memory_mb=4096, *, k=10, bos=BOS, other=None, answer='x'):\n"
        "    return lambda seeds=3: seeds\n"
        "@dataclass\n"
        "class C:\n"
        "    desired_logit_prob: float = 0.95\n"
        "    update_interval: int = field(default=4)\n"
        "    target: str = AttributionSettings.target\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--bos-errors', default='keep')\n"
        "p.add_argument('-w', '--span', dest='window', default=10)\n"
        "p.add_argument('--scale', default=str(NOISE_SCALE))\n"
        "p.add_argument('--memory-mb', type=float, default=None)\n"
        "settings = {'prompt': 'x', 'bos': 'auto', 'k': args.k, 'other': None}\n")
    flagged = {(line, name) for line, name, _, value in defaults_in(source, "cli/x.py")
               if value is not _NO_LITERAL}
    assert flagged == {(3, "memory_mb"), (3, "k"), (4, "seeds"), (7, "desired_logit_prob"),
                       (8, "update_interval"), (11, "bos_errors"), (12, "window"), (15, "bos")}
    # an alias counts in its own module only
    assert defaults_in("def make_target(kind='demeaned'): ...", "attribution/targets.py")[0][3] \
        == "demeaned"
    assert defaults_in("def fit(kind='clt'): ...", "transcoders/fit.py") == []
    # the tracing, dataset and reading settings, in a dataclass, a signature and flags
    source = (
        "@dataclass(frozen=True)\n"
        "class S:\n"
        "    memory_budget_mb: float = 2048.0\n"
        "    sigma: str = SIGMA\n"
        "    kinds: tuple = ('residual',)\n"
        "def g(*, node_threshold=0.8, edge_threshold=EDGE_THRESHOLD, n_boot=1000, known=KNOWN):\n"
        "    ...\n"
        "p.add_argument('--budget-mb', type=float, default=2048.0)\n"
        "p.add_argument('--top-k', type=int, default=10)\n"
        "p.add_argument('--boot', type=int, default=N_BOOT)\n")
    flagged = {(line, name) for line, name, _, value in defaults_in(source, "cli/parser.py")
               if value is not _NO_LITERAL}
    assert flagged == {(3, "memory_budget_mb"), (5, "kinds"), (6, "node_threshold"),
                       (6, "n_boot"), (8, "memory_budget_mb"), (9, "top_k")}


def test_the_defaults_are_the_settings_and_attributes_keywords():
    signature = inspect.signature(attribute).parameters
    for f in dataclasses.fields(AttributionSettings):
        assert signature[f.name].default == f.default, f.name
    assert signature["settings"].default is None
    graph = {f.name: f.default for f in dataclasses.fields(GraphSettings)}
    assert {k: graph[k] for k in ("target", "k", "max_feature_nodes", "memory_mb", "bos")} \
        == {k: EFFECTIVE[k] for k in ("target", "k", "max_feature_nodes", "memory_mb", "bos")}
    assert (EFFECTIVE["target"], EFFECTIVE["k"], EFFECTIVE["max_n_logits"],
            EFFECTIVE["desired_logit_prob"], EFFECTIVE["memory_mb"], EFFECTIVE["bos"],
            EFFECTIVE["bos_errors"], EFFECTIVE["update_interval"]) \
        == ("demeaned", 10, 10, 0.95, 4096, "auto", "keep", 4)  # the values did not move


def test_the_defaults_are_the_trace_and_dataset_settings_and_their_keywords():
    tracer = inspect.signature(Tracer).parameters
    for name, default in TRACE_FIELDS.items():
        assert tracer[name].default == default, name
    assert tracer["settings"].default is None
    run = inspect.signature(trace_dataset).parameters
    for name, default in DATASET_FIELDS.items():
        assert run[name].default == default, name
    assert run["settings"].default is None
    # the values did not move
    assert TRACE_FIELDS == {"seeds": 10, "scale": 3.0,
                            "scales": (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0),
                            "sigma": "rome", "distribution": "gaussian", "window": 10,
                            "memory_budget_mb": 2048.0, "reuse_prefix": True,
                            "replay_layers": True}
    assert DATASET_FIELDS == {"kinds": ("residual", "mlp", "attn"), "seeds": 3, "scale": 3.0,
                              "sigma": "rome", "window": 10, "known": "argmax", "limit": None,
                              "memory_budget_mb": 2048.0, "n_boot": 1000}
    shared = set(TRACE_FIELDS) & set(DATASET_FIELDS)
    assert {name for name in shared if TRACE_FIELDS[name] != DATASET_FIELDS[name]} == {"seeds"}
    assert TRACE_FIELDS["sigma"] in SIGMA_METHODS
    assert TRACE_FIELDS["distribution"] in DISTRIBUTIONS


#: A parameter or field named like a settings field that is another setting, or a setting of
#: something without a settings object, with its own default: (module, name) -> why.
NOT_A_METHOD_SETTING = {
    ("dataset/graph_aggregate.py", "kinds"): "the trace kinds a graph aggregate ranks against",
    ("interventions/noise.py", "seeds"): "a bare noise_add's seed list, not a trace's count",
    ("interventions/noise.py", "scale"): "a bare noise_add's scale (the spec entry's default)",
    ("interventions/noise.py", "sigma"): "a bare noise_add's unit (1: the scale is the size)",
    ("interventions/noise.py", "distribution"): "a bare noise_add's (the spec entry's default: "
                                                "interventions sit below the tracing settings)",
    ("transcoders/checks.py", "bos"): "clt-check's pairing and anchor: no method settings; "
                                      "position 0's rule is defaults.BOS, as the flag's",
    ("transcoders/fit.py", "bos"): "a transcoder fit (fitting.FitSettings owns the fit's)",
    ("transcoders/fit.py", "batch_size"): "tokens per optimiser step of a fit",
    ("specs.py", "limit"): "the nesting depth a spec may reach",
    ("viewer/listing.py", "limit"): "the nesting depth a graph JSON may reach",
    ("transcoders/formats/__init__.py", "limit"): "files named in an error message",
}


def _signature_defaults_in(source: str, module: str):
    """Every function's parameter in ``source`` with a default, named like a settings field:
    ``(module, line, function, name, default expression)``."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults,
                         strict=True))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                  if d is not None]
        for arg, default in pairs:
            if arg.arg in OWNERS:
                yield module, default.lineno, node.name, arg.arg, default


def _signature_defaults():
    """:func:`_signature_defaults_in` over the package (the command line aside: its flags are
    checked against the fields below)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if not module.startswith("cli/"):
            yield from _signature_defaults_in(path.read_text(encoding="utf-8"), module)


def _rewritten(entries) -> list[str]:
    """The entries whose default neither is None nor reads the field of its name."""
    out = []
    for module, line, function, name, default in entries:
        reads_field = isinstance(default, ast.Attribute) and default.attr == name \
            and isinstance(default.value, ast.Name)
        none = isinstance(default, ast.Constant) and default.value is None
        if not (reads_field or none) and (module, name) not in NOT_A_METHOD_SETTING:
            out.append(f"{module}:{line}: {function}({name}={ast.unparse(default)})")
    return out


def test_the_signature_scan_flags_a_rewritten_default_and_only_that():
    source = ("def f(x, k=GRAPH_K, *, node_threshold=0.8, top_n=_DEFAULT.top_n, bos=None,\n"
              "      window=TraceSettings.window, modes=_DEFAULT.kinds, other_name=3): ...\n")
    assert [entry.split(": ", 1)[1] for entry in
            _rewritten(_signature_defaults_in(source, "x.py"))] \
        == ["f(k=GRAPH_K)", "f(node_threshold=0.8)", "f(modes=_DEFAULT.kinds)"]


def test_no_signature_writes_a_settings_default_again():
    """A parameter named like a settings field defaults to None or reads the field
    (``_DEFAULT.<name>``, ``TraceSettings.<name>``), never to a literal or a
    :mod:`~pyvene_causaltrace.defaults` constant; and a public callable's default equals the
    field's (of a settings class that has it)."""
    written = _rewritten(_signature_defaults())
    assert written == [], ("a settings field's default written in a signature (read it from the "
                           "settings object: _DEFAULT.<name>):\n" + "\n".join(written))
    stale = [key for key in NOT_A_METHOD_SETTING
             if not any((m, n) == key for m, _, _, n, _ in _signature_defaults())]
    assert stale == []
    values = []
    for qualname, function in public_callables():
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):  # an exception class: nothing to default
            continue
        for name, parameter in parameters.items():
            if name not in OWNERS or parameter.default in (None, inspect.Parameter.empty):
                continue
            module = inspect.getmodule(function).__name__.split(".", 1)[1].replace(".", "/")
            if (module + ".py", name) in NOT_A_METHOD_SETTING:
                continue
            fields = [{f.name: f.default for f in dataclasses.fields(c)}[name]
                      for c in OWNERS[name]]
            if not any(same_value(parameter.default, f) for f in fields):
                values.append(f"{qualname}({name}={parameter.default!r}): fields say {fields}")
    assert values == [], "\n".join(values)


def public_callables():
    """The public API's functions, classes' constructors and public methods."""
    api_doc = tool("api_doc")
    seen = {}
    for module_name in api_doc.public_modules():
        module = import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                seen.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
            elif inspect.isclass(obj) and obj not in SETTINGS_CLASSES:
                if not dataclasses.is_dataclass(obj):  # a result's fields are data (the
                    seen.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)  # scan above)
                for member_name, member in vars(obj).items():
                    if not member_name.startswith("_") and inspect.isfunction(member):
                        seen.setdefault(f"{obj.__module__}.{obj.__qualname__}.{member_name}",
                                        member)
    return sorted(seen.items())


#: The settings modules, the one command-line module that reads defaults.py (flag defaults and
#: help, checked against the fields below), and the one setting used beyond a method.
READS_DEFAULTS = {"attribution/settings.py", "tracing/settings.py", "dataset/settings.py",
                  "dataset/graphs.py",
                  "crosscheck/settings.py", "steering/settings.py", "cli/parser.py"}
#: A constant a module other than those imports, and why: (module, constant) -> why.
DEFAULTS_ELSEWHERE = {
    ("interventions/noise.py", "NOISE_SCALE"): NOT_A_METHOD_SETTING[("interventions/noise.py",
                                                                    "scale")],
    ("interventions/noise.py", "SIGMA"): NOT_A_METHOD_SETTING[("interventions/noise.py",
                                                              "sigma")],
    ("interventions/noise.py", "DISTRIBUTION"): NOT_A_METHOD_SETTING[("interventions/noise.py",
                                                                     "distribution")],
    ("transcoders/checks.py", "BOS"): NOT_A_METHOD_SETTING[("transcoders/checks.py", "bos")],
    ("transcoders/fit.py", "BOS"): NOT_A_METHOD_SETTING[("transcoders/fit.py", "bos")],
    ("fitting.py", "BOS"): "the first transcoder's generated pairs leave out position 0 as "
                           "collect_pairs' default does (transcoders/fit.py)",
}


def test_defaults_are_imported_only_by_the_settings_and_the_parser():
    """The constants of defaults.py are the settings' fields' values: the settings modules
    read them (and the torch-free parser, for its flags' defaults and help); a function takes
    the settings object's instead, so no default is re-defaulted in a signature."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("defaults") \
                    and module not in READS_DEFAULTS:
                found |= {(module, alias.name) for alias in node.names}
    assert found == set(DEFAULTS_ELSEWHERE), sorted(found ^ set(DEFAULTS_ELSEWHERE))
    # and every settings field's default is one of its constants (or None)
    constants = {name: value for name, value in vars(defaults).items() if name.isupper()}
    loose = [f"{cls.__name__}.{f.name}" for cls in SETTINGS_CLASSES if cls is not GraphSettings
             for f in dataclasses.fields(cls)
             if f.default is not None and not any(f.default is v or same_value(f.default, v)
                                                  for v in constants.values())]
    assert loose == []


def test_the_spec_schema_states_the_same_defaults():
    schema = json.loads((PACKAGE / "spec.schema.json").read_text(encoding="utf-8"))
    checked = set()
    for name, entry in schema["properties"]["attribution"]["properties"].items():
        if name in SETTINGS and "default" in entry:
            assert entry["default"] == EFFECTIVE[name], name
            assert type(entry["default"]) is not bool or type(EFFECTIVE[name]) is bool, name
            checked.add(name)
    assert checked == {"target", "k", "max_n_logits", "desired_logit_prob", "bos_errors", "bos",
                       "memory_mb"}
    assert schema["properties"]["attribution"]["properties"]["target"]["enum"] \
        == list(TARGET_KINDS)
    assert schema["properties"]["trace"]["properties"]["window"]["default"] == defaults.WINDOW
    noise = [branch["then"]["properties"] for branch in schema["$defs"]["intervention"]["allOf"]
             if branch["if"]["properties"]["type"].get("const") == "noise_add"]
    assert [n["scale"]["default"] for n in noise] == [defaults.NOISE_SCALE]
    assert [(n["sigma"]["default"], n["distribution"]["default"]) for n in noise] \
        == [(TRACE_FIELDS["sigma"], TRACE_FIELDS["distribution"])]
    attribution = schema["properties"]["attribution"]["properties"]
    assert (attribution["node_threshold"]["default"], attribution["edge_threshold"]["default"]) \
        == (ReadingSettings.node_threshold, ReadingSettings.edge_threshold)


def _commands() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    return sub.choices


def _stated(help_text: str | None) -> str | None:
    found = re.findall(r"\(default:? ([^),;]+)", help_text or "")
    return found[-1] if found else None


def _text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


#: The flags whose help states an attribution setting's default, by command.
HELP_SETTINGS = {"attribute": SETTINGS, "dataset": {"memory_mb", "max_feature_nodes", "bos"},
                 "clt-check": {"bos"}, "steer": {"bos"}}


def test_the_command_lines_help_states_the_same_defaults():
    stated = set()
    for command, parser in _commands().items():
        for action in parser._actions:
            name = ALIASES.get(("cli/parser.py", action.dest), action.dest)
            if name in HELP_SETTINGS.get(command, ()):
                if action.default is not None:
                    assert action.default == EFFECTIVE[name], (command, name)
                said = _stated(action.help)
                if said is not None and EFFECTIVE[name] is not None:
                    assert said == _text(EFFECTIVE[name]), (command, action.help)
                    stated.add((command, name))
                choices = {"target": TARGET_KINDS, "bos": BOS_MODES, "bos_errors": BOS_ERRORS}
                if name in choices:
                    assert tuple(action.choices) == choices[name], (command, name)
            if name in TRACING and action.default is not None:
                value = number_or_name(action.default) if isinstance(action.default, str) \
                    else action.default
                expected = {"dataset": defaults.DATASET_SEEDS}.get(command, defaults.TRACE_SEEDS) \
                    if name == "seeds" else TRACING[name][0]
                assert value == expected, (command, name)
                said = _stated(action.help)
                assert said is None or number_or_name(said) == expected, (command, action.help)
    assert {("attribute", "k"), ("attribute", "max_n_logits"),
            ("attribute", "desired_logit_prob"), ("attribute", "bos_errors"),
            ("attribute", "bos"), ("attribute", "memory_mb"), ("dataset", "memory_mb"),
            ("dataset", "bos"), ("clt-check", "bos"), ("steer", "bos")} <= stated


def test_docstrings_state_the_same_defaults():
    stated = {}
    for doc in (attribute.__doc__, AttributionSettings.__doc__, GraphSettings.__doc__):
        for name, value in re.findall(r"``(\w+)``\s*\(default ([^),;]+)\)", doc or ""):
            if name in SETTINGS:
                stated[name] = value
                assert value == _text(EFFECTIVE[name]), (name, value)
    assert {"max_n_logits", "desired_logit_prob"} <= set(stated)


def test_a_settings_object_and_keywords_must_agree():
    given = AttributionSettings(memory_mb=512, max_feature_nodes=3)
    merged = AttributionSettings.merged
    assert merged(given, memory_mb=4096.0, k=10) is given  # defaults defer
    assert merged(given, memory_mb=512, max_feature_nodes=3) is given  # the same values
    assert merged(None, k=3) == AttributionSettings(k=3)
    with pytest.raises(InputError, match=r"k=3 \(settings.k=10\), memory_mb=1024 "
                                         r"\(settings.memory_mb=512\)"):
        AttributionSettings.merged(given, memory_mb=1024, k=3)
    with pytest.raises(InputError, match="must be an AttributionSettings"):
        AttributionSettings.merged({"memory_mb": 512})
    direction = torch.ones(4)
    with_direction = AttributionSettings(target=direction)
    assert AttributionSettings.merged(with_direction, target=direction) is with_direction
    with pytest.raises(InputError, match="target="):
        merged(with_direction, target=torch.ones(4))  # another tensor: not the same
    with pytest.raises(InputError, match="bos_errors must be one of keep, drop"):
        AttributionSettings(bos_errors="omit")
    with pytest.raises(InputError, match="drop them, or drop the answer"):
        AttributionSettings(max_n_logits=3).check_answer(" Paris")
    assert AttributionSettings(max_n_logits=3).check_answer(None) \
        == AttributionSettings(max_n_logits=3)
    with pytest.raises(InputError, match="pass one of them"):
        AttributionSettings(target=torch.ones(4)).check_answer(" Paris")


@pytest.mark.parametrize("cls, options, message", [
    (AttributionSettings, {"target": "difference"}, "needs the other token"),
    (AttributionSettings, {"target": "difference", "other": " x", "max_n_logits": 3},
     "would be ignored"),
    (AttributionSettings, {"target": torch.ones(4), "desired_logit_prob": 0.5},
     "would be ignored"),
    (AttributionSettings, {"other": " x"}, "only read by target='difference'"),
    (AttributionSettings, {"target": "logit"}, "target must be one of"),
    (AttributionSettings, {"k": 0}, r"k=0 \(int\)"),
    (AttributionSettings, {"desired_logit_prob": 1.5}, "desired_logit_prob"),
    (AttributionSettings, {"memory_mb": float("inf")}, "memory_mb"),
    (AttributionSettings, {"bos": "first"}, "bos must be one of"),
    (ReadingSettings, {"node_threshold": 1.5}, "node_threshold"),
    (ReadingSettings, {"edge_threshold": float("nan")}, "edge_threshold"),
    (ReadingSettings, {"max_links": 0}, "max_links"),
    (CrossCheckSettings, {"modes": ("linear",)}, "modes must list some of"),
    (CrossCheckSettings, {"modes": ["spliced", "spliced"]}, "modes repeat"),
    (CrossCheckSettings, {"kinds": ("attn",)}, "attention nodes"),
    (CrossCheckSettings, {"kinds": ()}, "kinds must list"),
    (CrossCheckSettings, {"top_n": -1}, "top_n"), (CrossCheckSettings, {"window": 0}, "window"),
    (CrossCheckSettings, {"heads": "all"}, "heads"),
    (SteeringSettings, {"max_new_tokens": -1}, "max_new_tokens"),
    (SteeringSettings, {"top_k": 0}, "top_k"), (SteeringSettings, {"memory_mb": 0}, "memory_mb"),
    (SteeringSettings, {"bos": "first"}, "bos must be one of"),
    (GraphSettings, {"target": "difference"}, "graph target"),
    (GraphSettings, {"memory_mb": -1}, "memory_mb")])
def test_every_settings_object_is_checked_when_made(cls, options, message):
    with pytest.raises(InputError, match=message):
        cls(**options)


def test_the_settings_objects_merge_with_keywords_alike():
    for cls, field, value in ((ReadingSettings, "node_threshold", 0.5),
                              (CrossCheckSettings, "top_n", 3), (SteeringSettings, "top_k", 4)):
        merge = cls.merged
        given = cls(**{field: value})
        default = {f.name: f.default for f in dataclasses.fields(cls)}[field]
        assert merge(given, **{field: default}) is given  # a default defers
        assert merge(None, **{field: value}) == given
        with pytest.raises(InputError, match=rf"{field}=.*\(settings.{field}="):
            merge(given, **{field: value * 2})
        with pytest.raises(InputError, match=f"must be a {cls.__name__}"):
            merge(object())
    assert CrossCheckSettings(modes=["replacement"], heads=[1, 2]) \
        == CrossCheckSettings(modes=("replacement",), heads=(1, 2))


def test_attribute_with_settings_builds_the_keywords_graph(tokenizer, tmp_path):
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt = load_from_disk(str(write_clt(tmp_path, random_clt_tensors(3, 32, 48,
                                                                    threshold=0.1))))
    settings = AttributionSettings(max_feature_nodes=5, batch_size=4, update_interval=1)
    by_keywords = attribute(model, tokenizer, clt, PROMPT, max_feature_nodes=5, batch_size=4,
                            update_interval=1)
    by_settings = attribute(model, tokenizer, clt, PROMPT, settings=settings)
    assert by_settings.n_explored == by_keywords.n_explored == 5
    assert by_settings.metadata["batch_size"] == 4
    assert torch.equal(by_settings.explored, by_keywords.explored)
    for node in [*by_keywords.explored.nonzero().flatten().tolist(), by_keywords.logit_node]:
        assert torch.equal(by_settings.row(node), by_keywords.row(node))
    with pytest.raises(InputError, match="max_feature_nodes=6"):
        attribute(model, tokenizer, clt, PROMPT, max_feature_nodes=6, settings=settings)
    # reading the graph: a ReadingSettings or its fields as keywords, alike
    reading = ReadingSettings(node_threshold=0.5, edge_threshold=0.9, max_links=3)
    assert by_settings.prune(settings=reading) is by_settings.prune(0.5, 0.9)
    assert by_settings.to_json(settings=reading) \
        == by_settings.to_json(node_threshold=0.5, edge_threshold=0.9, max_links=3)
    with pytest.raises(InputError, match=r"node_threshold=0.6 \(settings.node_threshold=0.5\)"):
        by_settings.prune(0.6, settings=reading)
    with pytest.raises(InputError, match="node_threshold"):
        by_settings.prune(1.5)


#: The flags of ``trace`` and ``dataset`` that are not a setting of the run: inputs, outputs,
#: display (and, for ``dataset``, the graphs' flags: GraphSettings' or the transcoder's, and
#: the graphs' faithfulness curves': FaithfulnessSettings', as ``evaluate``'s).
#: ``--faithfulness`` and its flags: TraceFaithfulnessSettings' fields (their defaults are
#: checked in tests/test_trace_faithfulness.py).
TRACE_FAITH_FLAGS = {"faithfulness", "faith_sizes", "faith_top", "faith_draws", "faith_seed",
                     "faith_rows", "faith_cells"}
FLAG_INPUTS = {
    "trace": {"help", "plugins", "spec", "model", "device", "prompt", "subject", "answer",
              "kind", "controls", "no_progress", "out", *TRACE_FAITH_FLAGS},
    "dataset": {"help", "data", "task", "model", "device", "no_progress", "out", "graphs", "clt",
                "format", "max_feature_nodes", "graph_memory_mb", "bos", "save_graphs",
                "sizes", "level", "rank_by", "ablation", "errors", "metric", "draws", "seed",
                "circuits_per_forward", *TRACE_FAITH_FLAGS},
}
def _said(value: object) -> str:
    """A default as a help text states it (a tuple of kinds as the flag's comma list)."""
    return ",".join(value) if isinstance(value, tuple) else _text(value)


@pytest.mark.parametrize("command, flags, settings", [
    ("trace", TRACE_FLAGS, TraceSettings), ("dataset", DATASET_FLAGS, DatasetSettings)])
def test_the_trace_and_dataset_flags_are_the_settings_fields(command, flags, settings):
    parser = _commands()[command]
    fields = {f.name: f.default for f in dataclasses.fields(settings)}
    mapped = flags
    assert set(mapped.values()) <= set(fields)  # each mapped flag is a field
    dests = {action.dest for action in parser._actions}
    assert set(mapped) <= dests
    assert dests - set(mapped) == FLAG_INPUTS[command]  # and every other flag is an input
    stated = set()
    for action in parser._actions:
        if action.dest not in mapped:
            continue
        expected = fields[mapped[action.dest]]
        value = action.default
        if action.dest == "known":  # None: the task's rule, else the settings' default
            assert value is None and tuple(action.choices) == KNOWN_RULES
        elif action.dest == "kinds":  # a comma list: the help's default is read whole
            assert tuple(value.split(",")) == expected
            assert f"(default {','.join(expected)})" in action.help
            stated.add(action.dest)
            continue
        else:
            assert (number_or_name(value) if isinstance(value, str) else value) == expected, \
                (command, action.dest)
        said = _stated(action.help)
        assert said == (None if expected is None else _said(expected)), (command, action.help)
        stated.add(action.dest)
    assert stated == set(mapped)
    # the flags' defaults make the settings' defaults
    args = build_parser().parse_args(
        [command, *(["--data", "x", "--out", "o"] if command == "dataset" else [])])
    made = trace_settings(args) if command == "trace" else dataset_settings(args, defaults.KNOWN)
    assert made == settings()


#: Each command's settings objects: ``(class, {argparse dest: field}, {field: why it is not a
#: flag})``; every field is one or the other.
COMMAND_SETTINGS = {
    "trace": [(TraceSettings, TRACE_FLAGS, {
        "scales": "the auto sweep's scales: a Python-level choice",
        "distribution": "uniform noise is a Python-level and spec option",
        "reuse_prefix": "an exact engine shortcut, turned off only to compare (benchmarks)",
        "replay_layers": "an exact engine shortcut, turned off only to compare (benchmarks)"})],
    "dataset": [
        (DatasetSettings, DATASET_FLAGS, {}),
        (GraphSettings, {"max_feature_nodes": "max_feature_nodes",
                         "graph_memory_mb": "memory_mb", "bos": "bos", "save_graphs": "save"},
         {"target": "a dataset graph explains the fact's answer, demeaned by the top k",
          "k": "the top-k of that target, as attribute's default"})],
    "aggregate": [(DatasetSettings, {"boot": "n_boot"},
                   {name: "aggregate reads rows a dataset run traced with it"
                    for name in DATASET_FIELDS if name != "n_boot"})],
    "attribute": [
        (AttributionSettings, cli_attribute.ATTRIBUTION_FLAGS, {
            "batch_size": "engine tuning (rows per backward): Python-level",
            "max_batch": "engine tuning (a cap on rows per backward): Python-level",
            "update_interval": "engine tuning (re-ranking cadence): Python-level",
            "freeze": "freeze=False is a control of the method, Python-level",
            "loop": "the one-backward-per-node reference, for tests and benchmarks",
            "check_closure": "a graph that does not close is always refused by the command"}),
        (ReadingSettings, cli_attribute.READING_FLAGS, {}),
        (CrossCheckSettings, cli_attribute.CROSS_CHECK_FLAGS, {
            "kinds": "the command compares both trace kinds a graph can be compared with",
            "top_k": "the cells of the top-k overlap: the summary reads the default's",
            "heads": "attribute --heads annotates the graph's own heads instead; the heads "
                     "comparison is Python-level (it costs a restore per head and seed)"}),
        (TraceSettings, cli_attribute.CROSS_CHECK_TRACE_FLAGS, {
            name: "the cross-check's tracer takes the noise's seeds and scale from flags, the "
                  "rest at the trace defaults" for name in TRACE_FIELDS
            if name not in ("seeds", "scale")})],
    "steer": [(SteeringSettings, cli_steer.STEERING_FLAGS, {})],
}
#: A flag whose default is None though its field's is not, and whose help does not state the
#: field's default: (command, dest) -> why.
UNSTATED = {("dataset", "known"): "None is the task's rule; the help states both"}


def _flag_value(value: object, default: object) -> object:
    """A flag's default as the field holds it (a comma list as a tuple, a number's text as a
    number)."""
    if isinstance(value, str) and isinstance(default, tuple):
        return tuple(value.split(","))
    return number_or_name(value) if isinstance(value, str) else value


@pytest.mark.parametrize("command", sorted(COMMAND_SETTINGS))
def test_every_settings_field_is_a_flag_stating_its_default(command):
    """Each field of each settings object a command builds is one of its flags (or named above
    as not one, with the reason); each such flag's default is the field's (a switch: off is the
    field's default, ``--no-...`` inverted), its help states the field's default where the
    flag's own default is None, and its choices are the field's allowed values."""
    actions = {a.dest: a for a in _commands()[command]._actions}
    choices = {"target": TARGET_KINDS, "bos": BOS_MODES, "bos_errors": BOS_ERRORS,
               "known": KNOWN_RULES}
    for cls, flags, not_flags in COMMAND_SETTINGS[command]:
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        assert set(flags.values()) | set(not_flags) == set(fields), cls.__name__
        assert not set(flags.values()) & set(not_flags), cls.__name__
        for dest, name in flags.items():
            action, expected = actions[dest], fields[name]
            if isinstance(action, argparse._StoreTrueAction):
                assert expected is dest.startswith("no_"), (command, dest)
                continue
            if action.default is not None:
                assert same_value(_flag_value(action.default, expected), expected), \
                    (command, dest, action.default, expected)
            said = _stated(action.help)
            if isinstance(expected, tuple):
                assert f"(default {','.join(expected)})" in action.help, (command, dest)
            elif said is not None and expected is not None:
                assert same_value(number_or_name(said), expected) or said == _text(expected), \
                    (command, dest, said, expected)
            elif action.default is None and expected is not None:
                assert (command, dest) in UNSTATED, f"{command} --{dest}: help states no default"
            if name in choices and action.choices is not None:
                assert tuple(action.choices) == choices[name], (command, dest)


def test_settings_from_flags_name_the_flag():
    """A settings object refused while built from flags names the flag."""
    args = build_parser().parse_args(["steer", "--set", "1:2:3=1", "--clt", "c"])
    args.top_k = 0  # past argparse's own check: the settings' refusal is named by flag
    with pytest.raises(InputError, match=r"^--top-k: top_k=0"):
        cli_steer.steer_request(args)
    args = build_parser().parse_args(["attribute", "--out", "o", "--clt", "c", "--cross-check",
                                      "--check-modes", "spliced,linear"])
    with pytest.raises(InputError, match=r"^--check-modes: modes must list some of"):
        cli_attribute.attribute_request(args)
    made = cli_attribute.attribute_request(build_parser().parse_args(
        ["attribute", "--out", "o", "--clt", "c", "--cross-check"]))
    assert made.attribution == AttributionSettings() and made.reading == ReadingSettings()
    assert made.cross_check.settings == CrossCheckSettings()
    assert made.cross_check.trace == TraceSettings()
    steer = cli_steer.steer_request(build_parser().parse_args(
        ["steer", "--set", "1:2:3=1", "--clt", "c"]))
    assert steer.settings == SteeringSettings()


@pytest.mark.parametrize("options, message", [
    ({"seeds": 0}, "seeds must be a positive count"), ({"seeds": [1, 1]}, "seeds repeat"),
    ({"scale": -1.0}, r"scale \(or 'auto'\)"), ({"scale": float("nan")}, "scale"),
    ({"sigma": "loud"}, "sigma must be a number or one of"), ({"sigma": float("inf")}, "sigma"),
    ({"distribution": "cauchy"}, "distribution must be one of"),
    ({"window": 0}, r"window \(--window\) must be a positive integer"),
    ({"window": 2.5}, "window"),
    ({"memory_budget_mb": 0}, r"memory_budget_mb \(--budget-mb\)")])
def test_trace_settings_are_checked_when_made(options, message):
    with pytest.raises(InputError, match=message):
        TraceSettings(**options)
    if "distribution" not in options:  # the same check where a dataset run takes them
        with pytest.raises(InputError, match=next(iter(options))):
            DatasetSettings(**options)


def test_dataset_settings_are_checked_when_made():
    for options, message in (({"scale": "auto"}, "scale='auto'"),
                             ({"kinds": ()}, "at least one trace kind"),
                             ({"kinds": ["residual", "residual"]}, "kinds repeat"),
                             ({"kinds": ["residul"]}, "residul"),
                             ({"known": "all"}, "known must be one of"),
                             ({"limit": 0}, "limit must be a positive integer"),
                             ({"n_boot": 0}, r"n_boot \(--boot")):
        with pytest.raises(InputError, match=message):
            DatasetSettings(**options)
    settings = DatasetSettings(kinds=["residual", "mlp"], seeds=[4, 2])
    assert settings.kinds == ("residual", "mlp") and settings.n_seeds == 2
    assert settings == DatasetSettings(kinds=("residual", "mlp"), seeds=[4, 2])
    assert settings.trace(sigma=0.5) == TraceSettings(seeds=[4, 2], sigma=0.5)
    assert TraceSettings(seeds=10**9).n_seeds == 10**9  # a count is not expanded
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seeds = 3


def test_trace_settings_and_keywords_must_agree():
    given = TraceSettings(seeds=4, scale="auto")
    assert TraceSettings.merged(given, seeds=10, scale=3.0, window=10) is given  # defaults defer
    assert TraceSettings.merged(given, seeds=4) is given
    assert TraceSettings.merged(TraceSettings(seeds=[0, 1]), seeds=(0, 1)).seeds == [0, 1]
    assert TraceSettings.merged(None, window=4) == TraceSettings(window=4)
    with pytest.raises(InputError, match=r"seeds=5 \(settings.seeds=4\)"):
        TraceSettings.merged(given, seeds=5)
    with pytest.raises(InputError, match="settings must be a TraceSettings"):
        TraceSettings.merged(DatasetSettings())


def test_tracer_with_settings_traces_as_the_keywords(tokenizer):
    model = make_tiny_model("llama", n_layers=4)
    keywords = {"seeds": 2, "scale": 2.0, "sigma": 0.5, "window": 3}
    settings = TraceSettings(**keywords)
    by_keywords = trace(model, tokenizer, PROMPT, SUBJECT, kind="mlp", progress=False,
                        **keywords)
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, settings=settings)
    assert tracer.settings is settings
    by_settings = tracer.trace("mlp", progress=False)
    assert by_settings.window == by_keywords.window == 3  # the settings' window
    assert by_settings.spec == by_keywords.spec and by_settings.spec["trace"]["window"] == 3
    assert np.array_equal(by_settings.restored_probs, by_keywords.restored_probs)
    assert tracer.trace("mlp", window=1, progress=False).window == 1  # given: it wins
    with pytest.raises(InputError, match="window"):
        tracer.trace("mlp", window=0)
    with pytest.raises(InputError, match=r"scale=4.0 \(settings.scale=2.0\)"):
        Tracer(model, tokenizer, PROMPT, SUBJECT, settings=settings, scale=4.0)
    with pytest.raises(InputError, match="window"):  # before the model runs
        trace(model, tokenizer, PROMPT, SUBJECT, window=0)


def test_trace_dataset_with_settings_runs_as_the_keywords(tokenizer, tmp_path):
    model = make_tiny_model("gpt2")
    records = [FactRecord(f"f{i}", PROMPT, SUBJECT, " Paris") for i in range(2)]
    keywords = {"kinds": ["residual"], "seeds": 2, "known": "none", "n_boot": 10}
    settings = DatasetSettings(**keywords)
    by_keywords = trace_dataset(model, tokenizer, records, out=tmp_path / "k", progress=False,
                                **keywords)
    by_settings = trace_dataset(model, tokenizer, records, out=tmp_path / "s", progress=False,
                                settings=settings)
    assert (tmp_path / "k" / "results.jsonl").read_text() \
        == (tmp_path / "s" / "results.jsonl").read_text()
    assert json.loads((tmp_path / "k" / "manifest.json").read_text()) \
        == json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert by_settings.to_dataframe().equals(by_keywords.to_dataframe())
    assert max(by_settings.n_facts["residual"]) == 2
    with pytest.raises(InputError, match=r"seeds=5 \(settings.seeds=2\)"):  # before any row
        trace_dataset(model, tokenizer, records, out=tmp_path / "x", settings=settings, seeds=5)
    # a keyword at its default defers to the settings
    assert trace_dataset(model, tokenizer, records, out=tmp_path / "s", progress=False,
                         settings=settings, seeds=3).to_dataframe().equals(
                             by_settings.to_dataframe())
    assert not (tmp_path / "x").exists()
