"""Every public function, method and CLI flag refuses a value its documented type does not admit
with the package's own error naming the argument — fuzzed (issue 51).

The public surface is read, not listed: every name in every public module's ``__all__``
(``api_doc.public_modules``), each public class's public methods and its constructor, every flag
of every command. A new public function is covered without editing this file, and fails
``test_every_public_callable_is_checked`` until it goes through :func:`~pyvene_causaltrace.
arguments.checked` (or this file says why not).

Which values are wrong is decided here, by :func:`admits`, a plain reading of the annotation
written apart from the package's checker: the fuzz draws values from every Python kind
(bools, huge ints, NaN, lone surrogates, lists of the wrong items, NumPy scalars, tensors, …),
keeps the ones ``admits`` says the annotation does not allow, and calls the function with that
one argument. The default tier draws :data:`EXAMPLES` values per callable; the extra tier
(``slow``) draws :data:`EXAMPLES_LONG`.
"""

from __future__ import annotations

import argparse
import collections.abc as abc
import dataclasses
import inspect
import math
import os
import re
import types
import typing
from importlib import import_module
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pytest
import torch
from _support.arguments import unchecked
from _support.data import tool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyvene_causaltrace._settings import Settings
from pyvene_causaltrace.arguments import NONBLANK, Pattern, Range, _resolve
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.errors import CausalTraceError

api_doc = tool("api_doc")

EXAMPLES = 25
EXAMPLES_LONG = 400

#: Public callables that take arguments but are not checked at the boundary, and why.
EXEMPT = {
    # the transcoder's and the engines' numeric kernels: called per batch inside a run, on
    # tensors the package made; their inputs were checked where the run began
    "Transcoder.shard": "machinery: called by the loaders with a checked shard",
    "Transcoder.save_model": "checked by save_transcoder, which it calls",
    "Transcoder.encoder_weight": "kernel, per layer inside a run",
    "Transcoder.preactivation": "kernel, per batch inside a run",
    "Transcoder.encode": "kernel, per batch inside a run",
    "Transcoder.joint_selection": "kernel, per batch inside a run",
    "Transcoder.encode_all": "kernel, per batch inside a run",
    "Transcoder.decoder_rows": "kernel, per batch inside a run",
    "Transcoder.skip": "kernel, per batch inside a run",
    "Transcoder.reconstruct": "kernel, per batch inside a run",
    "TranscoderConfig.n_targets": "kernel: a layer index from the transcoder's own loop",
    "TranscoderConfig.sources": "kernel: a layer index from the transcoder's own loop",
    "TranscoderConfig.hf_hooks": "kernel: a layer index from the transcoder's own loop",
    "TraceEngine.__init__": "made by Tracer from checked arguments",
    "TraceEngine.restore_layers": "machinery of Tracer.trace",
    "TraceEngine.rows_per_chunk": "machinery of Tracer.trace",
    "TraceEngine.run": "machinery of Tracer.trace",
    "HeadRestorer.__init__": "made by Tracer.trace_heads from checked arguments",
    "HeadRestorer.position": "machinery of Tracer.trace_heads",
    "HeadRestorer.run": "machinery of Tracer.trace_heads",
    "ReplacementModel.__init__": "made by attribute() from checked arguments",
    "ReplacementModel.tokenize": "machinery of attribute()",
    "ReplacementModel.prepare": "machinery of attribute()",
    "ReplacementModel.check_memory": "machinery of attribute()",
    "ReplacementModel.run": "machinery of attribute()",
    "ReplacementModel.check_bos_errors": "machinery of attribute()",
    "ReplacementModel.describe": "machinery of attribute()",
    "ReplacementRun.output": "machinery: a target's output name from the run's own targets",
    "Target.value": "kernel: called per forward on the run's own tensors",
    "Target.seed": "kernel: called per forward on the run's own tensors",
    "PatchRunner.__init__": "made by cross_check from checked arguments",
    "PatchRunner.run": "machinery of cross_check",
    "AttentionAnnotations.annotate": "machinery of AttributionGraph.to_json(attention=...)",
    "IntervenableModel.__init__": "pyvene's constructor (its config and model are pyvene's)",
    "IntervenableModel.named_parameters": "pyvene's signature",
    "IntervenableModel.count_parameters": "pyvene's signature",
    "IntervenableModel.forward": "pyvene's signature (its own argument checks)",
    "IntervenableModel.generate": "pyvene's signature (its own argument checks)",
    "DatasetSettings.trace": "returns TraceSettings, which checks its fields when made",
    "AttributionSettings.check_answer": "called by attribute() with its checked answer",
    "Transcoder.__init__": "made by the loaders (load_transcoder), which check their files",
    "GraphIndex.__init__": "made by find_graphs from a checked directory",
    "LayoutDetector.__init__": "a loader registry entry (plain data)",
    "TranscoderLoader.__init__": "a loader registry entry (plain data)",
}

#: Parameters that stay unchecked, and why: a tokenizer is duck-typed (any Hugging Face
#: tokenizer, or one of a user's with the same calls), a matplotlib Axes likewise.
DUCK_TYPED = {"tokenizer", "ax"}


def _qualname(obj) -> str:
    return obj.__qualname__


def public_callables() -> dict[str, object]:
    """Every public function, public class's constructor and public method, by qualified
    name (a settings dataclass: the class itself, whose fields ``__post_init__`` checks)."""
    found: dict[str, object] = {}
    for module_name in api_doc.public_modules():
        module = import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) and inspect.signature(obj).parameters:
                found.setdefault(_qualname(obj), obj)
            elif inspect.isclass(obj) and obj.__module__.startswith("pyvene_causaltrace") \
                    and not issubclass(obj, BaseException):
                if dataclasses.is_dataclass(obj) and obj.__name__.endswith("Settings"):
                    found[obj.__qualname__] = obj
                for attr, value in vars(obj).items():
                    if (attr == "__init__" or not attr.startswith("_")) \
                            and inspect.isfunction(value) \
                            and len(inspect.signature(value).parameters) > 1 \
                            and not (attr == "__init__" and dataclasses.is_dataclass(obj)):
                        found[f"{obj.__name__}.{attr}"] = value
    return found


PUBLIC = public_callables()
CHECKED = {name: obj for name, obj in PUBLIC.items() if name not in EXEMPT}


def _annotations(obj) -> dict[str, object]:
    """The parameters' (a settings class: the fields') annotations, resolved in their module."""
    if inspect.isclass(obj):
        namespace = vars(inspect.getmodule(obj))
        return {f.name: _resolve(f.type, namespace) for f in dataclasses.fields(obj)}
    namespace = inspect.unwrap(obj).__globals__
    return {name: _resolve(p.annotation, namespace)
            for name, p in inspect.signature(obj).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in ("self", "cls")}


# ---------------------------------------------------------- what an annotation admits (plain)

def _number(value) -> bool:
    return not isinstance(value, bool | np.bool_) and isinstance(
        value, int | float | np.integer | np.floating)


def admits(annotation, value) -> bool:  # noqa: PLR0911 -- one branch per form
    """Whether ``value`` is one the annotation documents (the rules of arguments.py's
    docstring, read plainly)."""
    if annotation in (Any, object, inspect.Parameter.empty):
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        if not admits(args[0], value):
            return False
        for constraint in args[1:]:
            if isinstance(constraint, Range):
                if constraint.low is not None and (
                        value <= constraint.low if constraint.low_open else value < constraint.low):
                    return False
                if constraint.high is not None and value > constraint.high:
                    return False
            if constraint is NONBLANK and not value.strip():
                return False
            if isinstance(constraint, Pattern) and re.fullmatch(constraint.regex, value) is None:
                return False
        return True
    if origin in (typing.Union, types.UnionType):  # noqa: TID251
        return any(admits(a, value) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is int:
        return isinstance(value, int | np.integer) and not isinstance(value, bool)
    if annotation is float:
        return _number(value) and math.isfinite(value)
    if annotation is bool:
        return isinstance(value, bool | np.bool_)
    if annotation is str:
        if not isinstance(value, str):
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if annotation is Path:
        return isinstance(value, os.PathLike)
    if origin in (list, tuple, abc.Sequence, abc.MutableSequence):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple | range):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(
                admits(a, v) for a, v in zip(args, value, strict=True))
        return not args or all(admits(args[0], v) for v in value)
    if origin in (dict, abc.Mapping) or annotation is dict:
        return isinstance(value, abc.Mapping)
    if origin in (abc.Iterable, abc.Iterator, abc.Collection):
        return isinstance(value, abc.Iterable) and not isinstance(value, str | bytes)
    if origin is abc.Callable or annotation is abc.Callable:
        return callable(value)
    if origin is type or annotation is type:
        return isinstance(value, type)
    if isinstance(annotation, type):
        if annotation.__name__ == "BoundModel":
            return isinstance(value, annotation | torch.nn.Module)
        return isinstance(value, annotation)
    return True  # a form this reading does not know: never counted as wrong


SCALARS = st.one_of(
    st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.sampled_from(["", "  ", "\udcff", "a\ud800b", "12", "nan", "auto", "-1"]),
    st.none())
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3), st.tuples(SCALARS, SCALARS),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from([object(), np.int64(-3), np.int64(10 ** 12), np.float64("nan"),
                     np.bool_(True), b"bytes", torch.tensor(1.0), Path("/nonexistent"),
                     [1.7], [True], [-0.5], (1,), range(3), {1, 2}]))


def _wrong(annotation):
    return VALUES.filter(lambda value: not admits(annotation, value))


def _call(obj, name: str, value) -> object:
    return obj(**{name: value})


# ------------------------------------------------------------------------------- the tests

def test_every_public_callable_is_checked():
    """Every public callable goes through the one check (or is listed in EXEMPT, with why),
    and EXEMPT names nothing that is gone."""
    missing = [name for name, obj in CHECKED.items()
               if not inspect.isclass(obj) and not getattr(obj, "__checked__", False)]
    assert not missing, f"public callables without @checked (or an EXEMPT reason): {missing}"
    stale = sorted(set(EXEMPT) - set(PUBLIC))
    assert not stale, f"EXEMPT names callables that are not public: {stale}"
    settings_classes = [obj for obj in CHECKED.values() if inspect.isclass(obj)]
    assert len(settings_classes) >= 4  # Attribution, Trace, Dataset, Graph (Fit: fitting.py)
    for cls in settings_classes:  # check_fields, or the base that calls it (_settings.Settings)
        source = inspect.getsource(cls.__post_init__)
        assert "check_fields" in source or issubclass(cls, Settings) and (
            "super().__post_init__()" in source or cls.__post_init__ is Settings.__post_init__), cls


def test_every_parameter_has_a_checkable_annotation():
    """A public parameter whose annotation admits anything is a hole in the boundary: only
    duck-typed ones (a tokenizer, an Axes) may be unchecked."""
    holes = {}
    for name, obj in CHECKED.items():
        if inspect.isclass(obj):
            continue
        extra = set(unchecked(obj)) - DUCK_TYPED
        if extra:
            holes[name] = sorted(extra)
    assert not holes, f"parameters the boundary cannot check: {holes}"


def _cases() -> list[tuple[str, str]]:
    return [(name, parameter) for name, obj in CHECKED.items()
            for parameter in _annotations(obj) if parameter not in DUCK_TYPED]


def _has_wrong_value(annotation) -> bool:
    """Whether the pool holds a value the annotation does not admit (``bool | int | ...``
    unions can admit every scalar kind: the pool's lists and objects are still wrong)."""
    probe = [True, 1, 1.5, float("nan"), "x", "\udcff", None, [1], (1, 2), {}, object(),
             np.int64(1), torch.tensor(1.0), Path("/x"), b"x"]
    return any(not admits(annotation, value) for value in probe)


FUZZABLE = {name: {p for p, a in _annotations(obj).items() if _has_wrong_value(a)}
            for name, obj in CHECKED.items()}
CASES = [(name, p) for name, p in _cases() if p in FUZZABLE[name]]


def _fuzz(name: str, data, examples_note: str) -> None:
    obj = CHECKED[name]
    annotations = _annotations(obj)
    parameters = [p for p in annotations if p not in DUCK_TYPED and p in FUZZABLE[name]]
    parameter = data.draw(st.sampled_from(parameters), label="parameter")
    annotation = annotations[parameter]
    value = data.draw(_wrong(annotation), label="value")
    try:
        result = _call(obj, parameter, value)
    except CausalTraceError as error:
        assert parameter in str(error), (name, parameter, value, error)
        return
    except Exception as error:  # noqa: BLE001 -- the point: nothing but our errors
        pytest.fail(f"{name}({parameter}={value!r}) raised {type(error).__name__}: {error} "
                    f"(expected the package's InputError) [{examples_note}]")
    pytest.fail(f"{name}({parameter}={value!r}) returned {result!r}: the annotation "
                f"{annotation} does not admit it")


@pytest.mark.parametrize("name", sorted({n for n, _ in CASES}))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_wrong_values_are_refused_by_name(name, data):
    _fuzz(name, data, "default tier")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted({n for n, _ in CASES}))
@settings(max_examples=EXAMPLES_LONG, deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_wrong_values_are_refused_by_name_long(name, data):
    _fuzz(name, data, "extra tier")


def test_coverage_is_reported(capsys):
    """The count the closing note quotes: callables x arguments fuzzed."""
    with capsys.disabled():
        print(f"\nfuzzed: {len({n for n, _ in CASES})} callables, {len(CASES)} arguments")
    assert len(CASES) > 200


# ------------------------------------------------------------------------------------ the CLI

def _flags() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [(command, action) for command, subparser in sub.choices.items()
            for action in subparser._actions if action.option_strings or action.dest != "help"]


FLAGS = _flags()
TYPED = [(c, a) for c, a in FLAGS if a.type is not None and a.type is not Path]


def test_every_typed_flag_reads_through_the_argument_rules():
    """A typed flag is a path or reads through arguments.flag (never a bare int/float, which
    would take NaN, 1e400 or True's spelling); prompts and answers through Text."""
    bare = [f"{c} {a.option_strings or a.dest}" for c, a in TYPED
            if not hasattr(a.type, "annotation")]
    assert not bare, f"flags typed without the argument rules: {bare}"
    texts = [f"{c} {a.option_strings}" for c, a in FLAGS
             if set(a.option_strings) & {"--prompt", "--answer", "--subject", "--other"}
             and not hasattr(a.type, "annotation")]
    assert not texts, texts
    assert len(TYPED) >= 30


def _parsed(annotation, text: str):
    """The flag's text as its annotation's base type reads it (None: not even that)."""
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated \
        else annotation
    try:
        return int(text) if base is int else float(text) if base is float else text
    except ValueError:
        return None


FLAG_TEXTS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-1", "0", "1.5", "abc", "", " ",
                     "\udcff", "True", "70000", "2e12", "1e-400"]),
    st.integers(min_value=-(10 ** 15), max_value=10 ** 15).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=3))


@pytest.mark.parametrize("command,action", TYPED,
                         ids=[f"{c}{a.option_strings[0] if a.option_strings else a.dest}"
                              for c, a in TYPED])
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_wrong_flag_values_exit_2_with_one_error_line(command, action, data, capsys):
    annotation = action.type.annotation
    text = data.draw(FLAG_TEXTS.filter(
        lambda t: (v := _parsed(annotation, t)) is None or not admits(annotation, v)),
        label="text")
    flag_name = action.option_strings[0]
    capsys.readouterr()
    code = main([command, f"{flag_name}={text}"])  # "--k" as a value, not an option
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and flag_name in lines[0], err
    assert "Traceback" not in err
