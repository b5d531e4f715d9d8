"""JSON as the standard defines it: every number finite.

Python's ``json`` reads ``NaN`` and ``Infinity`` and turns ``1e400`` into inf; a browser reads
``1e400`` and a 400-digit integer as ``Infinity``. In our rows such a value is damage, which a
lenient read would let into a mean as a silent NaN; every reader of the package's row and
manifest files parses through :func:`loads`, which refuses them."""

from __future__ import annotations

import json
import math

from .errors import NonFiniteError


def _constant(name: str) -> float:
    raise NonFiniteError(f"{name} is not a finite number (NaN and infinities are not JSON)")


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteError(f"{text} overflows a float (non-finite numbers are refused)")
    return value


def _integer(text: str) -> int:
    value = int(text)
    if len(text) > 308:  # shorter ones are within a float's range
        try:
            float(value)
        except OverflowError:
            raise NonFiniteError(f"{text[:20]}... ({len(text)} digits) overflows a float "
                                 "(non-finite numbers are refused)") from None
    return value


def loads(data: str | bytes, object_pairs_hook=None) -> object:
    """``json.loads(data)`` refusing NaN, ±Infinity and numbers (integers too) that overflow a
    float with :class:`~pyvene_causaltrace.errors.NonFiniteError` (a ``ValueError``, as a
    syntax error is); ``object_pairs_hook`` as ``json.loads`` takes it."""
    return json.loads(data, parse_constant=_constant, parse_float=_number, parse_int=_integer,
                      object_pairs_hook=object_pairs_hook)
