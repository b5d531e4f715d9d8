"""The public signatures as a Markdown page (docs/api.md), generated from the code so the page
cannot drift from it.

    python tools/api_doc.py > docs/api.md

Public means what the package and its subpackages export: ``pyvene_causaltrace.__all__``, then
each subpackage's ``__all__``. Each name gets its signature and the first line of its
docstring; a class gets its constructor's signature and its public methods and properties. The
page has no ``python`` code blocks (tests/test_docs.py would run them). A development tool:
it is not shipped in the wheel (tests/test_docs_api.py imports it from here).
"""

from __future__ import annotations

import inspect
import pkgutil
import re
import sys
from importlib import import_module
from pathlib import Path

PACKAGE = "pyvene_causaltrace"
COMMAND = "python tools/api_doc.py > docs/api.md"


def public_modules() -> list[str]:
    """The package, then each subpackage that declares ``__all__`` (alphabetical)."""
    package = import_module(PACKAGE)
    subpackages = [f"{PACKAGE}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
                   if info.ispkg]
    return [PACKAGE] + [name for name in sorted(subpackages)
                        if hasattr(import_module(name), "__all__")]


def first_line(obj: object) -> str:
    """The first sentence of ``obj``'s docstring's first paragraph, on one line ('' when it
    has none): a summary that a docstring wrapped over two lines does not cut in half."""
    doc = (inspect.getdoc(obj) or "").strip()
    paragraph = " ".join(doc.split("\n\n")[0].split())
    for end in re.finditer(r"\. (?=[A-Z(`])", paragraph):
        if paragraph[:end.start()].count("``") % 2 == 0:  # not a dot inside ``code``
            return paragraph[:end.start() + 1]
    return paragraph


class _Text:
    """An annotation kept as the source wrote it (``from __future__ import annotations``
    makes them strings; their repr would quote them)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation: object) -> object:
    return _Text(annotation) if isinstance(annotation, str) else annotation


def signature(obj: object) -> str:
    """``obj``'s call signature with unquoted annotations, or '' when inspect cannot read
    one."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation)))


def _members(cls: type) -> list[str]:
    """Lines for a class's public methods and properties defined in the class itself or in a
    private base of the package it inherits them from (a mixin such as ``_Effects``)."""
    namespace: dict = {}
    for klass in reversed(cls.__mro__):
        if klass is cls or (klass.__name__.startswith("_")
                            and klass.__module__.startswith("pyvene_causaltrace")):
            namespace.update(vars(klass))
    lines = []
    for name, member in namespace.items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            lines.append(f"  - `.{name}` (property){_dash(first_line(member.fget))}")
        elif isinstance(member, classmethod | staticmethod):  # bound: no cls in the signature
            function = getattr(cls, name)
            lines.append(f"  - `.{name}{signature(function)}`{_dash(first_line(function))}")
        elif inspect.isfunction(member):
            text = signature(member).replace("(self, ", "(", 1).replace("(self)", "()", 1)
            lines.append(f"  - `.{name}{text}`{_dash(first_line(member))}")
    return lines


def _dash(text: str) -> str:
    return f" — {text}" if text else ""


def describe(name: str, obj: object) -> list[str]:
    """The Markdown lines for one exported name."""
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        line = f"- `{name}{signature(obj) if kind == 'class' else ''}` ({kind})"
        return [line + _dash(first_line(obj)), *(_members(obj) if kind == "class" else [])]
    if callable(obj):
        return [f"- `{name}{signature(obj)}`{_dash(first_line(obj))}"]
    value = repr(obj)
    shown = value if len(value) <= 60 else f"{type(obj).__name__} of {len(obj)}" \
        if hasattr(obj, "__len__") else type(obj).__name__
    return [f"- `{name}` = `{shown}`"]


def render() -> str:
    """The whole page."""
    lines = ["# API reference", "",
             "Generated from the code; do not edit by hand. Regenerate with", "",
             "```bash", COMMAND, "```", "",
             "Every name each module exports (`__all__`), with its signature and the first line "
             "of its docstring; classes list their public methods and properties. The guide is "
             "in the other pages of [docs/](.); a first walk-through in "
             "[tutorial.md](tutorial.md).", ""]
    top = import_module(PACKAGE)
    for module_name in public_modules():
        module = import_module(module_name)
        lines += [f"## `{module_name}`", ""]
        summary = first_line(module)
        if summary:
            lines += [summary, ""]
        for name in sorted(module.__all__, key=str.lower):
            obj = getattr(module, name)
            if module is not top and name in top.__all__ and getattr(top, name) is obj:
                lines.append(f"- `{name}`: see [`{PACKAGE}`](#{PACKAGE})")
            else:
                lines += describe(name, obj)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
    sys.stdout.write(render())
