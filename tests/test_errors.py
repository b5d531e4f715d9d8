"""One error family: every error the package raises for a user's mistake is a
``CausalTraceError`` (the CLI's one-line errors rest on it), and ``errors.py`` sits at the
bottom of the house."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pyvene_causaltrace import errors

PACKAGE = Path(errors.__file__).parent
BUILTINS = {"ValueError", "TypeError", "KeyError", "IndexError", "RuntimeError",
            "NotImplementedError", "MemoryError", "AssertionError", "Exception", "LookupError"}
#: Built-in raises that are not a user's mistake (a bug or misuse of an internal API keeps its
#: traceback): (file, first words of the message) -> why.
ALLOWED = {
    ("pyvene_boundary/calls.py", "frozen_layernorm / frozen_attention must run"):
        "an intervention type called outside pyvene: a programming error",
    ("attribution/reading.py", "influence did not converge"):
        "a numerical failure of ours, not the user's input",
    ("fit_text.py", "the generation's forwards read"):
        "an invariant of ours (generate's forwards cover every position once), not the user's "
        "input",
    ("interventions/base.py", ""): "the abstract method of the base class",
    ("interventions/registry.py", "is not a pyvene Intervention"):
        "a plugin author registering a non-intervention: a programming error",
    ("attribution/replacement.py", "() got transcoder= and clt="):
        "a call giving one argument twice: Python's own TypeError convention",
    ("graph_schema.py", ":"):
        "the package's own graph.schema.json saying more than its fast check reads: a packaging "
        "error, raised at import",
}


def _builtin_raises() -> list[tuple[str, int, str, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            call = node.exc
            name = getattr(call.func if isinstance(call, ast.Call) else call, "id", None)
            if name not in BUILTINS:
                continue
            message = ""
            if isinstance(call, ast.Call) and call.args:
                first = call.args[0]
                if isinstance(first, ast.JoinedStr):
                    first = next((v for v in first.values if isinstance(v, ast.Constant)), None)
                message = first.value if isinstance(first, ast.Constant) else ""
            found.append((str(path.relative_to(PACKAGE)), node.lineno, name, str(message)))
    return found


def test_every_raise_for_a_user_mistake_is_in_the_family():
    stray = [(file, line, name, message) for file, line, name, message in _builtin_raises()
             if not any(file == f and message.strip().startswith(m) or (file == f and not m
                        and not message) for f, m in ALLOWED)]
    assert not stray, ("raise an error of pyvene_causaltrace.errors (or add the raise to "
                       f"ALLOWED with its reason): {stray}")


@pytest.mark.parametrize("name", errors.__all__)
def test_each_error_is_a_causal_trace_error_and_a_builtin(name):
    klass = getattr(errors, name)
    assert issubclass(klass, errors.CausalTraceError)
    if klass is not errors.CausalTraceError:
        assert any(base.__module__ == "builtins" and base is not Exception
                   for base in klass.__mro__[1:]), f"{name} should also be a built-in error"


def test_errors_module_imports_nothing_of_the_package():
    tree = ast.parse(Path(errors.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               for node in imports)


def test_old_import_paths_still_name_the_same_classes():
    from pyvene_causaltrace.attribution.edges import ClosureError
    from pyvene_causaltrace.dataset.store import ManifestMismatchError
    from pyvene_causaltrace.specs import SpecError

    assert (ClosureError, ManifestMismatchError, SpecError) == (
        errors.ClosureError, errors.ManifestMismatchError, errors.SpecError)
