"""JSON as the standard defines it: every number finite.

Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity`` (and turns ``1e400`` into inf)
by default. A row of ours holding one is damage, and read leniently it would enter a mean as a
silent NaN (dropped by a nan-mean, moving a statistic without a word). Every reader of the
package's row and manifest files parses through :func:`loads`, which refuses them; the caller
names the file and line.
"""

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


def loads(data: str | bytes) -> object:
    """``json.loads(data)`` refusing NaN, ±Infinity and numbers that overflow a float with
    :class:`~pyvene_causaltrace.errors.NonFiniteError` (a ``ValueError``, as a syntax error
    is)."""
    return json.loads(data, parse_constant=_constant, parse_float=_number)
