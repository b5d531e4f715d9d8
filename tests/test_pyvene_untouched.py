"""Importing the package and using it leaves pyvene as it is: in a fresh process, every attribute
of ``pyvene.IntervenableModel`` and of its pyvene bases is the same object after
``import pyvene_causaltrace``, a trace and a call of our ``IntervenableModel`` as before; and a
user's own ``pv.IntervenableModel`` with pyvene's own interventions, built on another model,
gives the same logits, registers the same hooks and calls the same setter as with pyvene alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

#: Run in a fresh process: pyvene alone first, then our package imported and used.
SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    import torch
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):
        import pyvene as pv
    from _support.models import PROMPT, SUBJECT, make_tiny_model, make_tokenizer

    def attributes():
        return {(klass.__qualname__, name): value for klass in pv.IntervenableModel.__mro__
                if klass.__module__.startswith("pyvene") for name, value in vars(klass).items()}

    def users_model():
        # the user's own model and interventions: pyvene's, a constant addition and a source
        model = make_tiny_model("llama", seed=3)
        made = pv.IntervenableModel([
            {"layer": 1, "component": "mlp_output", "intervention": pv.AdditionIntervention(
                source_representation=torch.full((32,), 0.5), embed_dim=32)},
            {"layer": 2, "component": "block_output", "intervention": pv.VanillaIntervention()},
        ], model)
        counts = []

        def count(module, args, output):  # hooks on the user's model while its head runs
            if module is model.lm_head:
                counts.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                                  for m in model.modules()))

        handle = torch.nn.modules.module.register_module_forward_hook(count)
        ids = torch.arange(1, 7).unsqueeze(0)
        try:
            with torch.no_grad():
                _, out = made(base={"input_ids": ids}, sources=[None, {"input_ids": ids + 7}],
                              unit_locations={"sources->base": (
                                  [None, [[2, 4]]], [None, [[2, 4]]])})
        finally:
            handle.remove()
        left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        setter = made._intervention_setter  # the function the user's instance calls
        return out.logits, counts, left, getattr(setter, "__func__", setter)

    before = attributes()
    bases = [k.__qualname__ for k in pv.IntervenableModel.__mro__]
    logits, counts, left, setter = users_model()

    import pyvene_causaltrace
    from pyvene_causaltrace import IntervenableModel, trace
    from pyvene_causaltrace.interventions.noise import NoiseAdd
    model, tokenizer = make_tiny_model("llama"), make_tokenizer()
    trace(model, tokenizer, PROMPT, SUBJECT, seeds=1, scale=3.0)
    ours = IntervenableModel([{"layer": 0, "component": "block_output",
                               "intervention": NoiseAdd(seeds=[0], positions=[1], sigma=0.5)}],
                             model)
    with torch.no_grad():
        ours(base={"input_ids": torch.arange(1, 7).unsqueeze(0)})

    after = attributes()
    logits_after, counts_after, left_after, setter_after = users_model()
    print("RESULT " + json.dumps({
        "changed": sorted(f"{k}.{n}" for (k, n) in before.keys() | after.keys()
                          if before.get((k, n)) is not after.get((k, n))),
        "bases": [bases, [k.__qualname__ for k in pv.IntervenableModel.__mro__]],
        "same_logits": torch.equal(logits, logits_after),
        "counts": [counts, counts_after], "left": [left, left_after],
        "same_setter": setter is setter_after,
        "package": pyvene_causaltrace.__file__,
    }))
""")


@pytest.fixture(scope="module")
def result() -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, cwd=TESTS,
                          env={**os.environ, "PYTHONPATH": f"{TESTS}:{TESTS.parent}"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    assert Path(found["package"]).parent.parent == TESTS.parent, found["package"]
    return found


def test_importing_and_using_the_package_changes_no_attribute_of_pyvenes_class(result):
    assert result["changed"] == [], (
        "our import or use changed these attributes of pyvene.IntervenableModel (or its pyvene "
        f"bases) for the whole process: {result['changed']}")
    assert result["bases"][0] == result["bases"][1]


def test_a_users_own_intervenable_model_behaves_as_with_pyvene_alone(result):
    assert result["same_logits"], "a user's pv.IntervenableModel gives other logits"
    before, after = result["counts"]
    assert before == after and before and before[0] > 0, f"hooks during its call: {before} "\
        f"with pyvene alone, {after} with our package"
    assert result["left"] == [0, 0]  # pyvene removes every hook after its call, as always
    assert result["same_setter"], "its _intervention_setter is not pyvene's own"


def test_the_check_sees_a_changed_attribute():
    """Control: the snapshot notices a class attribute replaced by a wrapper, as a patch
    would."""
    class Base:
        def method(self):
            return 1

    before = dict(vars(Base))
    original = Base.method
    Base.method = lambda self: original(self)
    assert [n for n in before.keys() | vars(Base).keys()
            if before.get(n) is not vars(Base).get(n)] == ["method"]
