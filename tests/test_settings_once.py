"""Each setting's default is written once (issue 40): the attribution settings'
(:class:`~pyvene_causaltrace.attribution.AttributionSettings`' fields), the tracing ones
(:class:`~pyvene_causaltrace.tracing.TraceSettings`'), the dataset ones
(:class:`~pyvene_causaltrace.dataset.DatasetSettings`') and those of reading a graph
(:mod:`pyvene_causaltrace.defaults`: pruning thresholds, links, the cross-check's, steering's top
tokens). A function parameter, a dataclass field or an argparse flag of one of these names
anywhere in the package defaults to a name, never to a literal of its own; the spec schema's
defaults (data) and the command line's help texts say the same values; the ``trace`` and
``dataset`` flags are the settings' fields; and ``attribute``, ``Tracer``/``trace`` and
``trace_dataset`` with ``settings=...`` run as with the keywords, refusing a keyword that
contradicts the settings object."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

import pyvene_causaltrace
from pyvene_causaltrace import defaults
from pyvene_causaltrace.attribution import AttributionSettings, attribute
from pyvene_causaltrace.attribution.export import graph_json
from pyvene_causaltrace.attribution.graph import AttributionGraph
from pyvene_causaltrace.attribution.plots import plot_graph
from pyvene_causaltrace.attribution.reading import prune
from pyvene_causaltrace.attribution.replacement_model import BOS_ERRORS
from pyvene_causaltrace.attribution.settings import settings_from
from pyvene_causaltrace.attribution.targets import TARGET_KINDS
from pyvene_causaltrace.cli.common import number_or_name
from pyvene_causaltrace.cli.dataset import DATASET_FLAGS, dataset_settings
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.cli.trace import TRACE_FLAGS, trace_settings
from pyvene_causaltrace.crosscheck import cross_check
from pyvene_causaltrace.dataset import DatasetSettings, trace_dataset
from pyvene_causaltrace.dataset.graphs import GraphSettings
from pyvene_causaltrace.dataset.records import FactRecord
from pyvene_causaltrace.dataset.settings import KNOWN_RULES
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.noise import DISTRIBUTIONS, SIGMA_METHODS
from pyvene_causaltrace.prompts import BOS_MODES
from pyvene_causaltrace.steering import intervene_features
from pyvene_causaltrace.tracing import Tracer, TraceSettings, trace
from pyvene_causaltrace.tracing.settings import trace_settings_from
from pyvene_causaltrace.transcoders import load_from_disk

PACKAGE = Path(pyvene_causaltrace.__file__).parent
SETTINGS = {f.name for f in dataclasses.fields(AttributionSettings)}
#: The tracing settings and the constants that hold their defaults.
TRACING = {"scale": (defaults.NOISE_SCALE,), "window": (defaults.WINDOW,),
           "seeds": (defaults.TRACE_SEEDS, defaults.DATASET_SEEDS)}
TRACE_FIELDS = {f.name: f.default for f in dataclasses.fields(TraceSettings)}
DATASET_FIELDS = {f.name: f.default for f in dataclasses.fields(DatasetSettings)}
#: Settings of reading a graph and checking it, by the name their parameters and flags use.
READING = {"node_threshold": defaults.NODE_THRESHOLD, "edge_threshold": defaults.EDGE_THRESHOLD,
           "max_links": defaults.MAX_LINKS, "check_window": defaults.CROSS_CHECK_WINDOW,
           "top_n": defaults.CROSS_CHECK_FEATURES,
           "top_k": (defaults.CROSS_CHECK_TOP_K, defaults.STEER_TOP_K)}
#: Every name the scan reads.
SCANNED = SETTINGS | set(TRACING) | set(TRACE_FIELDS) | set(DATASET_FIELDS) | set(READING)
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
    ("attribution/edges.py", "scale"): "Closure.scale, what a closure residual is relative to, "
                                       "not noise",
    ("interventions/noise.py", "seeds"): "a bare noise_add's seed list ([0]), not a trace's "
                                         "count of seeds",
    ("interventions/noise.py", "sigma"): "a bare noise_add's unit (1: the scale is the size), "
                                         "not a trace's sigma method",
    ("cli/parser.py", "limit"): "clt-check --limit: held-out texts, not a dataset run's facts "
                                "(whose default is None, all)",
    ("transcoders/formats/__init__.py", "limit"): "files named in an error message, not facts",
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
            ("attribution/targets.py", "target", "parameter"),
            ("attribution/replacement.py", "bos_errors", "field"),
            ("dataset/graphs.py", "k", "field"),
            ("cli/parser.py", "k", "flag"), ("cli/parser.py", "memory_mb", "flag"),
            ("tracing/tracer.py", "scale", "parameter"), ("cli/parser.py", "seeds", "flag"),
            ("dataset/graph_aggregate.py", "window", "parameter"),
            ("tracing/settings.py", "memory_budget_mb", "field"),
            ("tracing/settings.py", "sigma", "field"),
            ("tracing/tracer.py", "distribution", "parameter"),
            ("tracing/engine.py", "reuse_prefix", "parameter"),
            ("dataset/settings.py", "kinds", "field"), ("dataset/settings.py", "n_boot", "field"),
            ("dataset/run.py", "known", "parameter"), ("dataset/tasks.py", "known", "field"),
            ("cli/parser.py", "memory_budget_mb", "flag"), ("cli/parser.py", "n_boot", "flag"),
            ("cli/parser.py", "kinds", "flag"), ("cli/parser.py", "node_threshold", "flag"),
            ("cli/parser.py", "top_k", "flag"), ("cli/parser.py", "top_n", "flag"),
            ("cli/parser.py", "check_window", "flag"),
            ("attribution/reading.py", "edge_threshold", "parameter"),
            ("attribution/export.py", "max_links", "parameter"),
            ("crosscheck/check.py", "window", "parameter"),
            ("steering.py", "top_k", "parameter")} <= seen
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


def test_the_reading_defaults_are_one_constant_each():
    def default(function, name):
        return inspect.signature(function).parameters[name].default

    for function in (prune, graph_json, plot_graph, AttributionGraph.prune):
        assert default(function, "node_threshold") == READING["node_threshold"] == 0.8
        assert default(function, "edge_threshold") == READING["edge_threshold"] == 0.98
    assert default(graph_json, "max_links") == READING["max_links"] == 400_000
    assert (default(cross_check, "window"), default(cross_check, "top_k"),
            default(cross_check, "top_n")) == (1, 10, 20) \
        == (READING["check_window"], READING["top_k"][0], READING["top_n"])
    assert default(intervene_features, "top_k") == READING["top_k"][1] == 10


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
        == (READING["node_threshold"], READING["edge_threshold"])


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
    assert settings_from(given, memory_mb=4096.0, k=10) is given  # defaults defer
    assert settings_from(given, memory_mb=512, max_feature_nodes=3) is given  # the same values
    assert settings_from(None, k=3) == AttributionSettings(k=3)
    with pytest.raises(InputError, match=r"k=3 \(settings.k=10\), memory_mb=1024 "
                                         r"\(settings.memory_mb=512\)"):
        settings_from(given, memory_mb=1024, k=3)
    with pytest.raises(InputError, match="must be an AttributionSettings"):
        settings_from({"memory_mb": 512})
    direction = torch.ones(4)
    with_direction = AttributionSettings(target=direction)
    assert settings_from(with_direction, target=direction) is with_direction
    with pytest.raises(InputError, match="target="):
        settings_from(with_direction, target=torch.ones(4))  # another tensor: not the same
    with pytest.raises(InputError, match="bos_errors must be one of keep, drop"):
        AttributionSettings(bos_errors="omit").check()
    with pytest.raises(InputError, match="drop them, or drop the answer"):
        AttributionSettings(max_n_logits=3).check(answer=" Paris")
    assert AttributionSettings(max_n_logits=3).check() == AttributionSettings(max_n_logits=3)


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


#: The flags of ``trace`` and ``dataset`` that are not a setting of the run: inputs, outputs,
#: display (and, for ``dataset``, the graphs' flags: GraphSettings' or the transcoder's).
FLAG_INPUTS = {
    "trace": {"help", "plugins", "spec", "model", "prompt", "subject", "answer", "kind",
              "controls", "no_progress", "out"},
    "dataset": {"help", "data", "task", "model", "no_progress", "out", "graphs", "clt", "format",
                "max_feature_nodes", "graph_memory_mb", "bos", "save_graphs"},
}
#: The flags of the graph-reading settings: (command, dest) -> the default.
READING_FLAGS = {("attribute", "node_threshold"): READING["node_threshold"],
                 ("attribute", "edge_threshold"): READING["edge_threshold"],
                 ("attribute", "max_links"): READING["max_links"],
                 ("attribute", "check_window"): READING["check_window"],
                 ("attribute", "check_features"): READING["top_n"],
                 ("steer", "top_k"): READING["top_k"][1]}


def _said(value: object) -> str:
    """A default as a help text states it (a tuple of kinds as the flag's comma list)."""
    return ",".join(value) if isinstance(value, tuple) else _text(value)


@pytest.mark.parametrize("command, flags, settings", [
    ("trace", TRACE_FLAGS, TraceSettings), ("dataset", DATASET_FLAGS, DatasetSettings)])
def test_the_trace_and_dataset_flags_are_the_settings_fields(command, flags, settings):
    parser = _commands()[command]
    fields = {f.name: f.default for f in dataclasses.fields(settings)}
    mapped = dict(flags)
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


def test_the_reading_flags_state_their_one_default():
    commands = _commands()
    for (command, dest), expected in READING_FLAGS.items():
        action = next(a for a in commands[command]._actions if a.dest == dest)
        assert action.default == expected, (command, dest)
        assert _stated(action.help) == _text(expected), (command, action.help)


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
    assert trace_settings_from(given, seeds=10, scale=3.0, window=10) is given  # defaults defer
    assert trace_settings_from(given, seeds=4) is given
    assert trace_settings_from(TraceSettings(seeds=[0, 1]), seeds=(0, 1)).seeds == [0, 1]
    assert trace_settings_from(None, window=4) == TraceSettings(window=4)
    with pytest.raises(InputError, match=r"seeds=5 \(settings.seeds=4\)"):
        trace_settings_from(given, seeds=5)
    with pytest.raises(InputError, match="settings must be a TraceSettings"):
        trace_settings_from(DatasetSettings())


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
