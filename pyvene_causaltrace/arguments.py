"""One argument check at the public boundary: every public function refuses, before its body
runs, a value its annotation does not admit.

    @checked
    def head_loadings(model: BoundModel, ..., layers: int | Sequence[int] | None = None,
                      memory_mb: MemoryMB | None = None): ...

    head_loadings(model, tc, graph, layers="12")
    # InputError: layers='12' (str): expected an int, a list of ints or None

The rules, one per annotation (nothing is coerced):

- ``int``: an ``int`` or a NumPy integer, never a ``bool``, a float or a string (a NumPy
  integer is handed on as ``int``); ``float``: an int or float, finite, never a ``bool``;
  ``bool``: ``True`` or ``False``; ``str``: text that encodes as UTF-8 (no lone surrogates, as
  undecodable bytes on a command line give); ``Path``: any ``os.PathLike``.
- ``Sequence[T]``, ``list[T]``, ``tuple[T, ...]``: a list, tuple or range (never a string) of
  ``T``; ``tuple[A, B]``: two items; ``dict``: a mapping; ``Iterable``: anything iterable but a
  string (not consumed); ``Callable``: callable; ``Literal[...]``: one of the values (``True``
  is not ``1``); ``X | Y``: either.
- Annotated constraints: :class:`Range` (``PositiveInt``, ``NonNegativeInt``, ``Seed``,
  ``PositiveFloat``, ``Fraction``, ``MemoryMB``), :data:`NONBLANK` (``Text``: not empty or
  whitespace) and :class:`Pattern` (text matching a regular expression whole).
- A class: an instance of it; :class:`~.bound.BoundModel` also takes the ``nn.Module`` the
  boundary binds. Annotations that name what this module cannot import (a TYPE_CHECKING name)
  or ``Any`` are not checked: the fuzz test (tests/test_arguments_fuzz.py) lists them and
  holds that list to what the package documents.

Ranges that depend on the model (a layer below its layer count, a position inside the prompt)
are checked in the body with :func:`check_index`, by the same message shape. Settings
dataclasses check their fields by the same rules in ``__post_init__`` (:func:`check_fields`);
the command line's converters (:func:`flag`) apply them to flags.
"""

from __future__ import annotations

import argparse
import collections.abc as abc
import functools
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from importlib import import_module
from pathlib import Path
from typing import Annotated, Any, Literal

from .errors import InputError

__all__ = ["NONBLANK", "Fraction", "MemoryMB", "NonNegativeInt", "Pattern", "Port", "PositiveFloat",
           "PositiveInt", "Probability", "Range", "Seed", "Text", "check_fields", "check_index",
           "check_value", "call_checker", "checked", "flag"]

#: The largest memory cap taken, in MB (an exabyte): a larger one is a typo, not a machine.
MAX_MEMORY_MB = 1e12


@dataclass(frozen=True)
class Range:
    """A number between ``low`` and ``high`` (``None``: unbounded), ends included unless open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __str__(self) -> str:
        low = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high is None else f"<= {self.high:g}"
        return " and ".join(part for part in (low, high) if part)


@dataclass(frozen=True)
class Pattern:
    """Text that matches ``regex`` whole; ``expected`` names the forms in a refusal."""

    regex: str
    expected: str

    def admits(self, value: str) -> bool:
        return re.fullmatch(self.regex, value) is not None


#: A string constraint: not empty and not only whitespace.
NONBLANK = Pattern(r"(?s).*\S.*", "not blank")

PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
Seed = Annotated[int, Range(0, 2 ** 63 - 1)]
PositiveFloat = Annotated[float, Range(0, low_open=True)]
Fraction = Annotated[float, Range(0, 1)]
Probability = Annotated[float, Range(0, 1, low_open=True)]
Port = Annotated[int, Range(0, 65535)]
MemoryMB = Annotated[float, Range(0, MAX_MEMORY_MB, low_open=True)]
Text = Annotated[str, NONBLANK]


class _Refused(Exception):
    """Inside a checker: the value is not admitted (the checker's ``expected`` says why)."""


Checker = Callable[[Any], Any]  # the value (NumPy scalars as Python ones) or _Refused


@dataclass(frozen=True)
class _Check:
    run: Checker
    expected: str  # "an int", "a list of ints or None"


def _show(value: object) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


# ------------------------------------------------------------------------------ the rules

def _is_numpy(value: object, kind: str) -> bool:
    module = type(value).__module__
    if module != "numpy":
        return False
    import numpy as np  # only once a NumPy value is seen (its module is loaded by then)
    return isinstance(value, {"int": np.integer, "float": np.floating, "bool": np.bool_}[kind])


def _int(value):
    if isinstance(value, bool) or not (isinstance(value, int) or _is_numpy(value, "int")):
        raise _Refused
    return int(value)


def _float(value):
    if isinstance(value, int) or _is_numpy(value, "int"):
        return _int(value)  # an int stays one (a bool is refused)
    if not (isinstance(value, float) or _is_numpy(value, "float")) or not math.isfinite(value):
        raise _Refused
    return float(value)


def _bool(value):
    if not (isinstance(value, bool) or _is_numpy(value, "bool")):
        raise _Refused
    return bool(value)


def _str(value):
    if not isinstance(value, str):
        raise _Refused
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _Refused("text that encodes as UTF-8 (it holds a lone surrogate, as undecodable "
                       "bytes give)") from error
    return value


def _test(admits: Callable[[Any], bool], expected: str) -> _Check:
    """The check of values that ``admits``, handed on as they are."""
    def run(value):
        if not admits(value):
            raise _Refused
        return value
    return _Check(run, expected)


_SIMPLE: dict[object, _Check] = {
    int: _Check(_int, "an int"), float: _Check(_float, "a finite number"),
    bool: _Check(_bool, "True or False"), str: _Check(_str, "a string"),
    Path: _test(lambda value: isinstance(value, os.PathLike), "a path"),
}


def _plural(expected: str) -> str:
    for article in ("an ", "a "):
        if expected.startswith(article):
            return expected[len(article):] + "s"
    return expected


def _sequence(item: _Check | None, kinds: tuple[type, ...]) -> _Check:
    def run(value):
        if isinstance(value, str | bytes) or not isinstance(value, kinds):
            raise _Refused
        if item is None:
            return value
        out = [item.run(v) for v in value]
        return value if isinstance(value, range) else (
            tuple(out) if isinstance(value, tuple) else out)
    noun = "a tuple" if kinds == (tuple,) else "a list"
    return _Check(run, noun + (f" of {_plural(item.expected)}" if item else ""))


def _fixed_tuple(items: list[_Check | None]) -> _Check:
    def run(value):
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise _Refused
        return tuple(v if c is None else c.run(v) for c, v in zip(items, value, strict=True))
    return _Check(run, f"a pair ({', '.join(c.expected if c else 'anything' for c in items)})"
                  if len(items) == 2 else f"{len(items)} items")


def _union(members: list[_Check]) -> _Check:
    def run(value):
        reasons = []
        for member in members:
            try:
                return member.run(value)
            except _Refused as refused:
                reasons.extend(refused.args)
        raise _Refused(*reasons)
    names = [m.expected for m in members]
    expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    return _Check(run, expected)


def _constrained(base: _Check, constraints: list[object]) -> _Check:
    ranges = [c for c in constraints if isinstance(c, Range | Pattern)]

    def run(value):
        value = base.run(value)
        if any(not r.admits(value) for r in ranges):
            raise _Refused
        return value
    words = [r.expected if isinstance(r, Pattern) else str(r) for r in ranges]
    return _Check(run, f"{base.expected}, {' and '.join(words)}" if words else base.expected)


#: A model argument takes either: the public call binds a bare model, and the package hands
#: the bound one on to the public functions it calls.
_MODELS = (("torch.nn.modules.module", "Module"), (f"{__package__}.bound", "BoundModel"))


def _instance(cls: type) -> _Check | None:
    if getattr(cls, "_is_protocol", False):
        return None  # a Protocol is duck-typed: nothing to test with isinstance
    kinds: tuple[type, ...] = (cls,)
    if (cls.__module__, cls.__name__) in _MODELS:  # a bare model or one the package bound
        kinds = tuple(getattr(import_module(module), name) for module, name in _MODELS)

    def run(value):
        if not isinstance(value, kinds):
            if name == "Transcoder" and (hasattr(value, "vocab_size") or any(
                    c.__name__ == "Module" for c in type(value).__mro__)):  # a model, a tokenizer
                raise _Refused("the model comes first, then the tokenizer, then the transcoder")
            raise _Refused
        return value
    name = cls.__name__
    if kinds != (cls,):
        return _Check(run, "a model (torch.nn.Module)")
    return _Check(run, f"{'an' if name[0] in 'AEIOU' else 'a'} {name}")


def _compile(annotation: object) -> _Check | None:
    """The checker for ``annotation``, or None where it admits anything we cannot test."""
    if annotation in (Any, object, inspect.Parameter.empty) or \
            isinstance(annotation, typing.TypeVar):
        return None
    if annotation is None or annotation is type(None):
        return _test(lambda value: value is None, "None")
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        base = _compile(args[0])
        return None if base is None else _constrained(base, list(args[1:]))
    if origin in (typing.Union, types.UnionType):  # noqa: TID251 -- Optional[...] reads as Union
        members = [_compile(a) for a in args]
        return None if any(m is None for m in members) else _union(members)  # type: ignore[arg-type]
    if origin is Literal:
        return _test(lambda value: any(value == a and type(value) is type(a) for a in args),
                     "one of " + ", ".join(repr(a) for a in args))
    if origin in (list, abc.Sequence, abc.MutableSequence):
        return _sequence(_compile(args[0]) if args else None, (list, tuple, range))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(_compile(args[0]), (list, tuple))
        return _fixed_tuple([_compile(a) for a in args]) if args else _sequence(None, (tuple,))
    if origin in (dict, abc.Mapping) or annotation is dict:
        return _instance(abc.Mapping)
    if origin in (abc.Iterable, abc.Iterator, abc.Collection):
        return _sequence(None, (abc.Iterable,))
    if origin is abc.Callable or annotation is abc.Callable:
        return _test(callable, "a callable")
    if origin is type or annotation is type:
        return _instance(type)
    if origin is not None:
        return _instance(origin) if isinstance(origin, type) else None
    if annotation in (list, tuple):
        return _sequence(None, (annotation,))
    return _instance(annotation) if isinstance(annotation, type) else None


#: Package classes that modules import only for type checkers (an import cycle otherwise):
#: an annotation naming one is resolved here, at the first call, when the cycle is closed.
_DEFERRED = {"AttributionGraph": "attribution.graph", "Tracer": "tracing.tracer",
             "Transcoder": "transcoders.transcoder", "BoundModel": "bound"}


def _resolve(annotation: object, namespace: dict) -> object:
    """A string annotation (``from __future__ import annotations``) evaluated in its module (a
    name of :data:`_DEFERRED` imported now), or ``Any`` when it names something the module
    imports only for type checkers (a tokenizer is duck-typed)."""
    if not isinstance(annotation, str):
        return annotation
    names = dict(namespace)
    for _ in range(len(_DEFERRED) + 1):
        try:
            return eval(annotation, names)  # noqa: S307 -- the package's own annotations
        except NameError as missing:
            if missing.name not in _DEFERRED or missing.name in names:
                return Any  # a TYPE_CHECKING name: not checked (module docstring)
            module = import_module(f"{__package__}.{_DEFERRED[missing.name]}")
            names[missing.name] = getattr(module, missing.name)
        except Exception:  # noqa: BLE001 -- an annotation this module cannot evaluate
            return Any
    return Any


# -------------------------------------------------------------------------- the decorator

def _checks_of(function: Callable) -> dict[str, _Check]:
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    checks = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        check = _compile(_resolve(parameter.annotation, namespace))
        if check is not None:
            checks[name] = check
    return checks


def check_value(name: str, value: object, annotation: object) -> object:
    """``value`` if ``annotation`` admits it (NumPy scalars as Python ones), else an
    :class:`~.errors.InputError` naming ``name``, the value and what is allowed."""
    check = _compile(annotation)
    return value if check is None else _run(name, value, check)


def _run(name: str, value: object, check: _Check) -> object:
    try:
        return check.run(value)
    except _Refused as refused:
        extra = f" ({refused.args[0]})" if refused.args else ""
        raise InputError(f"{name}={_show(value)}: expected {check.expected}{extra}") from None


def call_checker(function: Callable) -> Callable[[inspect.BoundArguments], None]:
    """What :func:`checked` runs on a call of ``function``: every given argument checked
    against its annotation, NumPy scalars handed on as Python numbers (in the call)."""
    compiled: dict[str, _Check] | None = None

    def check(call: inspect.BoundArguments) -> None:
        nonlocal compiled
        if compiled is None:  # at the first call: the module's names all exist by then
            compiled = _checks_of(function)
        for name, value in call.arguments.items():
            rule = compiled.get(name)
            if rule is not None:
                call.arguments[name] = _run(name, value, rule)
    return check


def checked(function: Callable) -> Callable:
    """Refuse, before ``function`` runs, any argument its annotation does not admit (module
    docstring); the call goes on with NumPy scalars handed on as Python numbers."""
    signature = inspect.signature(function)
    check = call_checker(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        call = signature.bind_partial(*args, **kwargs)
        check(call)
        return function(*call.args, **call.kwargs)

    wrapper.__checked__ = True  # type: ignore[attr-defined]
    return wrapper


def check_fields(settings: object) -> None:
    """Refuse a settings dataclass whose fields' values their annotations do not admit (call
    from ``__post_init__``)."""
    namespace = vars(inspect.getmodule(type(settings)))
    for field in fields(settings):  # type: ignore[arg-type]
        check = _compile(_resolve(field.type, namespace))
        if check is not None:
            value = _run(field.name, getattr(settings, field.name), check)
            object.__setattr__(settings, field.name, value)


def check_index(name: str, value: int, size: int, what: str, *, negative: bool = False) -> int:
    """``value`` as an index into ``size`` items (``what``: "layers of the model"); with
    ``negative``, -1 is the last (the message says so). Returns the index counted from 0."""
    value = _run(name, value, _SIMPLE[int])
    low = -size if negative else 0
    if not low <= value < size:
        allowed = f"{low}..{size - 1}" + (" (negative counts from the end)" if negative else "")
        raise InputError(f"{name}={_show(value)}: expected one of the {size} {what}, {allowed}")
    return value % size


def flag(annotation: object) -> Callable[[str], object]:
    """An argparse ``type=`` converter: the flag's text read as ``annotation``'s base type and
    checked by the same rules (argparse then names the flag in its one ``error:`` line)."""
    check = _compile(annotation)
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated \
        else annotation

    def convert(text: str) -> object:
        value: object = text
        if base in (int, float):
            try:
                value = base(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is not {'an int' if base is int else 'a number'}") from None
        try:
            return check.run(value) if check is not None else value
        except _Refused as refused:
            extra = f" ({refused.args[0]})" if refused.args else ""
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected {check.expected}{extra}") from None  # type: ignore[union-attr]
    convert.__name__ = getattr(base, "__name__", "value")
    convert.annotation = annotation  # type: ignore[attr-defined]
    return convert
