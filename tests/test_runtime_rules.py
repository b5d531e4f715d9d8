"""The package's runtime rules (issue 40), read off its source: no frame walking (nor closure
reading), no write to torch's hook tables, no module-level table of splice sessions.

A hook of ours goes on through a module's ``register_*`` method and comes off through its
handle (:mod:`pyvene_causaltrace.hooking`); reading a hook table (is it empty? is each hook
ours?) is fine, writing one is not. State an intervention shares lives with the interventions or
the run, not in a module-level table.

No frame or closure cell is read anywhere in the package: what pyvene's hook knows about a
call is announced by a wrapper of pyvene's setter that has it all as arguments
(``pyvene_boundary.calls.announcing_setter``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pyvene_causaltrace

PACKAGE = Path(pyvene_causaltrace.__file__).parent

#: torch's hook tables: per module, and global.
HOOK_TABLES = frozenset({
    "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_global_forward_hooks", "_global_forward_pre_hooks",
    "_global_backward_hooks", "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
})
_MUTATORS = frozenset({"clear", "update", "pop", "popitem", "setdefault", "move_to_end",
                       "__setitem__", "__delitem__", "__ior__"})
_FRAME_ATTRIBUTES = frozenset({"_getframe", "currentframe", "f_back", "f_locals", "tb_frame",
                               "getouterframes", "getinnerframes", "_current_frames",
                               "__closure__", "cell_contents", "co_freevars"})
_FRAME_CALLS = frozenset({"inspect.stack", "inspect.trace"})
_MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict",
                            "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "deque"})


def _is_table(node: ast.AST, aliases: set[str]) -> bool:
    """``x._forward_hooks`` (any hook table), or a name bound to one."""
    return ((isinstance(node, ast.Attribute) and node.attr in HOOK_TABLES)
            or (isinstance(node, ast.Name) and node.id in aliases))


def _aliases(scope: ast.AST) -> set[str]:
    """Names bound in ``scope`` to a hook table itself (``hooks = block._forward_hooks``,
    ``a, b = m._forward_hooks, m._forward_pre_hooks``, ``for hooks in (m._forward_hooks,)``)."""
    names: set[str] = set()

    def bind(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and _is_table(value, set()):
            names.add(target.id)
        elif isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
            for t, v in zip(target.elts, value.elts, strict=False):
                bind(t, v)

    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            bind(node.target, node.value)
        elif isinstance(node, ast.For | ast.comprehension) and isinstance(
                node.iter, ast.Tuple | ast.List):
            if any(_is_table(item, set()) for item in node.iter.elts) \
                    and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
    return found


def _functions(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the qualified name of the function (or class) around it, '' at module
    level."""
    where: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{name}.{child.name}" if name else child.name
            where[id(child)] = inner
            visit(child, inner)

    visit(tree, "")
    return where


def _hook_table_writes(tree: ast.AST) -> list[tuple[int, str]]:
    aliases = _aliases(tree)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in HOOK_TABLES \
                        and isinstance(part.ctx, ast.Store | ast.Del):
                    found.append((node.lineno, f"binds or deletes .{part.attr}"))
                elif isinstance(part, ast.Subscript) and isinstance(part.ctx, ast.Store | ast.Del) \
                        and _is_table(part.value, aliases):
                    found.append((node.lineno, f"stores into {ast.unparse(part.value)}[...]"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATORS and _is_table(node.func.value, aliases):
            found.append((node.lineno, f"calls {ast.unparse(node.func)}()"))
        if isinstance(node, ast.Constant) and node.value in HOOK_TABLES \
                and id(node) not in docstrings:
            # getattr(module, "_forward_hooks") and vars(module)["..."] escape the checks above
            found.append((node.lineno, f"names {node.value!r} in a string"))
    return found


def _frame_walks(tree: ast.AST) -> list[tuple[int, str, str]]:
    where = _functions(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRIBUTES:
            what = ast.unparse(node)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in _FRAME_CALLS:
            what = ast.unparse(node.func)
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "inspect") and any(
                alias.name in _FRAME_ATTRIBUTES | {"stack", "trace"} for alias in node.names):
            what = f"from {node.module} import ..."
        if what is not None:
            scope, up = where.get(id(node), ""), node
            while not scope and id(up) in parents:  # expressions inherit their statement's
                up = parents[id(up)]
                scope = where.get(id(up), "")
            found.append((node.lineno, scope, what))
    return found


def _session_tables(tree: ast.Module) -> list[tuple[int, str]]:
    """Module-level (or class-level) mutable containers whose name or annotation speaks of
    sessions, or of transcoders loaded (a cache of read transcoders)."""
    found = []
    scopes = [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef)]
    for scope in scopes:
        for node in scope.body:
            if isinstance(node, ast.Assign):
                names = [ast.unparse(t) for t in node.targets]
                annotation = ""
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                names, annotation = [ast.unparse(node.target)], ast.unparse(node.annotation)
            else:
                continue
            value = node.value
            mutable = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp
                                 | ast.ListComp | ast.SetComp) or (
                isinstance(value, ast.Call)
                and ast.unparse(value.func).rpartition(".")[2] in _MUTABLE_CALLS)
            about_sessions = any(word in text.lower() for text in [*names, annotation]
                                 for word in ("session", "transcoders", "loaded"))
            if mutable and about_sessions:
                found.append((node.lineno, ", ".join(names)))
    return found


def _sources() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text()))
            for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_frame_walk():
    found = [f"{name}:{line} ({scope or 'module level'}): {what}" for name, tree in _sources()
             for line, scope, what in _frame_walks(tree)]
    assert found == [], "frames are read in the package:\n" + "\n".join(found)


def test_no_write_to_a_hook_table():
    found = [f"{name}:{line}: {what}" for name, tree in _sources()
             for line, what in _hook_table_writes(tree)]
    assert found == [], ("torch's hook tables are written (add hooks through register_*, "
                         "remove them through their handles):\n" + "\n".join(found))


def test_no_module_level_table_of_sessions():
    found = [f"{name}:{line}: {names}" for name, tree in _sources()
             for line, names in _session_tables(tree)]
    assert found == [], ("sessions or loaded transcoders are kept in a module-level table:\n"
                         + "\n".join(found))


# ------------------------------------------------------------- the checks catch what they name


def _writes(source: str) -> list[str]:
    return [what for _, what in _hook_table_writes(ast.parse(source))]


def test_the_hook_table_check_sees_each_kind_of_write():
    writes = [
        "block._forward_hooks.clear()",
        "block._forward_pre_hooks.update(saved)",
        "del module._forward_hooks[key]",
        "module._backward_hooks[key] = hook",
        "module._forward_hooks_with_kwargs.pop(key, None)",
        "module._forward_hooks = {}",
        "hooks, pre = block._forward_hooks, block._forward_pre_hooks\nhooks[k] = gated(hooks[k])",
        "hooks = block._forward_pre_hooks\ndel hooks[k]",
        "for table in (m._forward_hooks, m._forward_pre_hooks):\n    table.clear()",
        "getattr(module, '_forward_hooks').clear()",
        "torch.nn.modules.module._global_forward_hooks.clear()",
    ]
    for source in writes:
        assert _writes(source), source
    reads = [
        "if block._forward_hooks or block._forward_pre_hooks: pass",
        "n = len(module._forward_hooks)",
        "ours = all(is_ours(h) for h in module._forward_hooks.values())",
        "copy = dict(block._forward_hooks)\ncopy.clear()",
        "handle = module.register_forward_hook(fn)\nhandle.remove()",
    ]
    for source in reads:
        assert not _writes(source), source


def test_the_frame_check_sees_each_kind_of_walk():
    walks = {
        "import sys\ndef f():\n    return sys._getframe(1)": "f",
        "import inspect\nclass A:\n    def g(self):\n        return inspect.currentframe()": "A.g",
        "def h(frame):\n    return frame.f_back": "h",
        "import inspect\nx = inspect.stack()": "",
        "from sys import _getframe": "",
        "def c(fn):\n    return [cell.cell_contents for cell in fn.__closure__]": "c",
    }
    for source, scope in walks.items():
        found = _frame_walks(ast.parse(source))
        assert found and found[0][1] == scope, source
    assert not _frame_walks(ast.parse("import sys\nsys.exit(0)"))


def test_the_session_check_sees_a_table():
    tables = [
        "_SESSIONS: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()",
        "_sessions = {}",
        "live: dict[str, SpliceSession] = dict()",
        "class Holder:\n    sessions = []",
        "_TRANSCODERS: dict[tuple, Any] = {}",
    ]
    for source in tables:
        assert _session_tables(ast.parse(source)), source
    assert not _session_tables(ast.parse("SESSION_HELP = 'a splice session'\n_cache = {}"))


def test_the_pyvene_boundary_is_one_small_module_a_job():
    """pyvene_boundary/ holds every module that knows pyvene's internals, none over 500 lines."""
    sizes = {path.name: len(path.read_text().splitlines())
             for path in (PACKAGE / "pyvene_boundary").glob("*.py")}
    assert sizes and max(sizes.values()) <= 500, sizes
    assert not (PACKAGE / "pyvene_compat.py").exists()
