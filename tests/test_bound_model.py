"""The bound model (issue 40): a model's architecture is resolved once, at the API boundary,
and carried down as a :class:`~pyvene_causaltrace.bound.BoundModel`.

- Only ``bind`` resolves an architecture: a scan of the package fails on any other call of
  ``get_adapter``, and the adapter's methods no longer take the model.
- One public ``trace()`` / ``attribute()`` call resolves the adapter, checks the weights, checks
  the prompt's token ids and (a trace) the seeds' memory exactly once: counted with a profiler
  spy on the functions' code objects, so a second caller anywhere is seen, whatever name it
  imported the function under.
- Public functions take the bound model as well as the plain one, with the same numbers.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

import pyvene_causaltrace
from pyvene_causaltrace import trace
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.bound import BoundModel, bind
from pyvene_causaltrace.errors import PyveneModelError, UnsupportedModelError
from pyvene_causaltrace.finite import check_weights
from pyvene_causaltrace.models import ArchAdapter, get_adapter
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.tracing.chunks import check_seeds_fit
from pyvene_causaltrace.transcoders import load_from_disk

PACKAGE = Path(pyvene_causaltrace.__file__).parent
#: Where the package may call ``get_adapter``: (file, function) -> why.
RESOLVERS = {
    ("bound.py", "__init__"): "the binding itself",
    ("models.py", "load_model"): "refuses an unsupported checkpoint as it loads, before any "
                                 "call binds it",
}


def _calls_of(name: str) -> list[tuple[str, str, int]]:
    """``(file, innermost enclosing function or "<module>", line)`` of every call of ``name``
    (as a name or an attribute) in the package."""
    found = []

    class Visitor(ast.NodeVisitor):
        def __init__(self, file: str) -> None:
            self.file, self.stack = file, ["<module>"]

        def visit_FunctionDef(self, node) -> None:
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node: ast.Call) -> None:
            if name in (getattr(node.func, "id", None), getattr(node.func, "attr", None)):
                found.append((self.file, self.stack[-1], node.lineno))
            self.generic_visit(node)

    for path in sorted(PACKAGE.rglob("*.py")):
        Visitor(str(path.relative_to(PACKAGE))).visit(ast.parse(path.read_text(), str(path)))
    return found


def test_only_the_binding_resolves_an_architecture():
    calls = _calls_of("get_adapter")
    assert {(file, function) for file, function, _ in calls} == set(RESOLVERS), calls


def test_the_scan_sees_a_call_it_should_refuse(tmp_path, monkeypatch):
    """Control: the scan finds a stray call (here in a nested function) where there is one."""
    stray = tmp_path / "stray.py"
    stray.write_text("def outer(model):\n    def inner():\n        return get_adapter(model)\n"
                     "    return inner\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert [(f, line) for f, _, line in _calls_of("get_adapter")] == [("stray.py", 3)]


def test_adapter_methods_do_not_take_the_model():
    """The model's facts live on the bound model; the adapter only says where parts are."""
    for name, member in inspect.getmembers(ArchAdapter, inspect.isfunction):
        assert "model" not in inspect.signature(member).parameters, name


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    model = make_tiny_model("llama", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp("bound") / "clt",
                                       random_clt_tensors(3, 32, 48, threshold=0.1))))
    return model, tokenizer, clt


def count_calls(functions, call) -> Counter:
    """How often each of ``functions`` ran during ``call()`` (Python-level calls of their code
    objects, from any caller)."""
    codes = {f.__code__: f.__qualname__ for f in functions}
    counts: Counter = Counter()

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return counts


ONCE = (get_adapter, check_weights, BoundModel.check_inputs, check_seeds_fit)


def test_one_trace_call_resolves_and_checks_once(world):
    model, tokenizer, _ = world
    counts = count_calls(ONCE, lambda: trace(model, tokenizer, PROMPT, SUBJECT, seeds=2,
                                             progress=False))
    assert counts == {"get_adapter": 1, "check_weights": 1, "BoundModel.check_inputs": 1,
                      "check_seeds_fit": 1}, counts


def test_one_attribute_call_resolves_and_checks_once(world):
    """Ten salient-logit targets: their tokens are checked, the prompt's ids once."""
    model, tokenizer, clt = world
    counts = count_calls(ONCE, lambda: attribute(model, tokenizer, clt, PROMPT))
    assert counts == {"get_adapter": 1, "check_weights": 1, "BoundModel.check_inputs": 1}, \
        counts


def test_the_spy_counts_every_caller(world):
    """Control: two bindings are two resolutions, whoever calls."""
    model = world[0]
    assert count_calls(ONCE, lambda: (bind(model), bind(model)))["get_adapter"] == 2
    bound = bind(model)
    assert count_calls(ONCE, lambda: bind(bound))["get_adapter"] == 0


def test_public_calls_take_the_bound_model_with_the_same_numbers(world):
    model, tokenizer, clt = world
    bound = bind(model)
    plain = trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    given = trace(bound, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    assert torch.equal(torch.as_tensor(plain.restored_probs),
                       torch.as_tensor(given.restored_probs))
    a = attribute(model, tokenizer, clt, PROMPT)
    b = attribute(bound, tokenizer, clt, PROMPT)
    state_a, state_b = a.rows.state(), b.rows.state()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_bound_facts_are_the_configs(world):
    model = world[0]
    bound = bind(model)
    config = model.config
    assert (bound.n_layers, bound.d_model, bound.n_heads, bound.head_dim) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
        config.head_dim)
    assert bound.kv_width == config.num_key_value_heads * config.head_dim
    assert bound.max_positions == config.max_position_embeddings
    assert bound.module("mlp", 1) is model.model.layers[1].mlp
    assert bound.blocks == list(model.model.layers)
    gpt2 = bind(make_tiny_model("gpt2"))
    assert (gpt2.n_layers, gpt2.d_model, gpt2.max_positions, gpt2.d_mlp) == (3, 32, 256, 128)


def test_binding_refuses_what_it_cannot_carry(world):
    model = world[0]
    with pytest.raises(PyveneModelError, match="pv_model.model"):
        bind(intervenable_model_class()([], model))
    other = make_tiny_model("llama")
    other.config.model_type = "unknown-arch"
    with pytest.raises(UnsupportedModelError, match="supported"):
        bind(other)


def _added(model, amount: float):
    """A user's ``pv.IntervenableModel`` adding ``amount`` to layer 1's MLP output."""
    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

    pv = import_pyvene()
    add = pv.AdditionIntervention(source_representation=torch.full((32,), amount))
    return pv.IntervenableModel([{"component": "model.layers[1].mlp.output",
                                  "intervention": add}], model)


def test_a_pyvene_model_is_bound_with_its_interventions_which_act_only_in_a_measurement(world):
    """The public calls bind a ``pv.IntervenableModel`` with its interventions (``given``) and
    apply them in :func:`measurement`; the same numbers from the pv model and from the model
    bound from it; outside a measurement such a bound model is refused (it would run without
    them). Control: the interventions do change the trace."""
    from pyvene_causaltrace.attribution import ReplacementModel
    from pyvene_causaltrace.model_guard import measurement

    model, tokenizer, clt = world
    pv_model = _added(model, 0.5)
    bound = bind(pv_model, interventions=True)
    assert bound.model is model and bound.given is pv_model and bound.carries_interventions
    assert not bind(model).carries_interventions

    def restored(given):
        return torch.as_tensor(trace(given, tokenizer, PROMPT, SUBJECT, seeds=2,
                                     progress=False).restored_probs)

    assert torch.equal(restored(pv_model), restored(bound))
    assert not torch.equal(restored(pv_model), restored(model))  # control: they act
    with pytest.raises(PyveneModelError, match="carries a pv.IntervenableModel"):
        ReplacementModel(bound, tokenizer, clt)
    with pytest.raises(PyveneModelError, match="carries a pv.IntervenableModel"):
        bind(bound)
    with measurement(bound):
        assert bind(bound) is bound  # inside its measurement, the interventions act
        ReplacementModel(bound, tokenizer, clt)
    assert bound.applying == 0


def test_calls_that_apply_their_own_interventions_refuse_a_pyvene_model(world):
    from pyvene_causaltrace.attribution.validate import ablation_test
    from pyvene_causaltrace.transcoders.checks import check_pairing

    model, tokenizer, clt = world
    for given in (_added(model, 0.5), bind(_added(model, 0.5), interventions=True)):
        with pytest.raises(PyveneModelError, match="check_pairing takes the bare model"):
            check_pairing(given, tokenizer, clt, [PROMPT])
        with pytest.raises(PyveneModelError, match="ablation_test takes the bare model"):
            ablation_test(given, clt, None)
    assert check_pairing(model, tokenizer, clt, [PROMPT]).n_tokens > 0


def test_the_model_comes_first_and_a_transcoder_in_its_place_is_named(world):
    """One argument order (model, tokenizer, transcoder): another is refused by name."""
    from pyvene_causaltrace.errors import InputError
    from pyvene_causaltrace.transcoders.checks import check_pairing

    model, tokenizer, clt = world
    for order in ((model, clt, tokenizer), (clt, model, tokenizer)):  # the old order, reversed
        with pytest.raises(InputError, match="the model comes first, then the tokenizer"):
            check_pairing(*order, [PROMPT])


#: The one place a transcoder is still ``clt``: the splice interventions' constructor keyword,
#: which is their spec entry's field (``{"type": "clt_splice", "clt": PATH}``) and what pyvene
#: saves and loads them with.
CLT_KEYWORD = {("interventions/splice_session.py", "__init__")}


def test_the_transcoder_is_named_transcoder_and_comes_after_the_model_and_tokenizer():
    """Every function calls its transcoder parameter ``transcoder`` (the splice interventions'
    spec keyword aside), and one that takes the model and the tokenizer takes them first:
    ``(model, tokenizer, transcoder, ...)``."""
    named_clt, order = [], []
    package = Path(pyvene_causaltrace.__file__).parent
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            if "clt" in args and (module, node.name) not in CLT_KEYWORD:
                named_clt.append(f"{module}:{node.lineno} {node.name}")
            if "transcoder" in args:
                before = args[:args.index("transcoder")]
                for first in ("model", "tokenizer"):
                    if first in args and first not in before:
                        order.append(f"{module}:{node.lineno} {node.name}({', '.join(args)})")
    assert named_clt == [] and order == [], (named_clt, order)
