"""A call's settings from a settings object or keywords (one per field), shared by every
method's settings dataclass through their base :class:`Settings`:

    s = ReadingSettings.merged(settings, node_threshold=node_threshold)
"""

from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

from .arguments import check_fields
from .errors import InputError

T = TypeVar("T")

_PLAIN = (str, int, float, type(None))


def same_value(a: object, b: object) -> bool:
    """Whether two setting values are the same: equal plain values, equal sequences of them
    (a list and a tuple alike), or the same object (a tensor or target is compared by
    identity)."""
    if a is b:
        return True
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return False


class Settings:
    """The base of every method's frozen settings dataclass: its fields checked when made
    (:func:`~.arguments.check_fields`; a subclass adds its own checks after ``super()``'s)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def merged(cls: type[T], settings: T | None, **keywords: object) -> T:
        """The settings of a call given ``settings`` and its keywords (one per field of
        ``cls``): without ``settings``, ``cls(**keywords)``; with it, ``settings`` — a keyword
        left at its default defers to it, and one set to another value than ``settings``' is
        refused (:class:`~.errors.InputError` naming every such keyword)."""
        if settings is None:
            return cls(**keywords)
        name = cls.__name__
        if not isinstance(settings, cls):
            raise InputError(f"settings must be {'an' if name[0] in 'AEIOU' else 'a'} {name}, "
                             f"got {type(settings).__name__}")
        clashes = [f"{f.name}={keywords[f.name]!r} (settings.{f.name}="
                   f"{getattr(settings, f.name)!r})" for f in fields(cls)
                   if f.name in keywords and not same_value(keywords[f.name], f.default)
                   and not same_value(keywords[f.name], getattr(settings, f.name))]
        if clashes:
            raise InputError(f"pass each setting once: settings= is given and so are "
                             f"{', '.join(clashes)}; set them in the {name} "
                             "(dataclasses.replace(settings, ...)) or drop settings=")
        return settings
