"""Plugin types: a registered plain ``pyvene.Intervention`` subclass runs in a spec exactly as a
hand-written hook makes the same edit; pyvene types that need a source are refused naming their
entry; the CLI imports plugin modules named by ``--plugins`` or ``$PVCT_PLUGINS``."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from reference import add_at, edit_output, recipe_noise

from pyvene_causaltrace.cli import main
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.interventions import registry
from pyvene_causaltrace.interventions.registry import PluginError, load_plugins, plugin_modules
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.specs import SpecError, validate_spec

pv = import_pyvene()
HIDDEN = 32  # make_tiny_model's
ALPHA = 4.0


def _direction(hidden: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, hidden)


SEEN: list[tuple[int, ...]] = []


def plain_steer(base_class: type) -> type:
    """A plain pyvene type (not Localist, not ours) on ``base_class``: adds ``alpha *
    direction`` along the last dimension, and records the shapes it is handed."""

    class PlainSteer(base_class):
        def __init__(self, alpha: float = 1.0, hidden: int = HIDDEN, **kwargs):
            super().__init__(**kwargs)
            self.alpha = alpha
            self.register_buffer("direction", _direction(hidden))

        def forward(self, base, source=None, subspaces=None, **kwargs):
            SEEN.append(tuple(base.shape))
            return base + self.alpha * self.direction.to(base.dtype)

    return PlainSteer


class NeedsSource(pv.Intervention):
    """A user type that reads the source: it cannot run in a spec."""

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return base + source


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as it is, restored after the test; plugin modules imported by the test are
    forgotten again."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    before = set(sys.modules)
    yield registry
    for name in set(sys.modules) - before:
        if name.startswith("pvct_test_plugin"):
            del sys.modules[name]


def _spec(*entries, **fields):
    return {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
            "interventions": list(entries), **fields}


def _hook_probs(model, tokenizer, answer_id, layers, seeds=(), scale=3.0, sigma=0.5,
                subject=(0, 0)):
    """P(answer) with the same edits made by hand-written hooks, one batch-1 run per seed."""
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    step = ALPHA * _direction(HIDDEN)
    probs = []
    for seed in seeds or [None]:
        with torch.no_grad(), contextlib_all(model, seed, layers, step, scale, sigma, subject):
            logits = model(input_ids=ids).logits
        probs.append(float(logits[0, -1].double().softmax(-1)[answer_id]))
    return probs


def contextlib_all(model, seed, layers, step, scale, sigma, subject):
    from contextlib import ExitStack

    stack = ExitStack()
    if seed is not None:
        positions = list(range(*subject))
        noise = recipe_noise(seed, len(positions), HIDDEN, scale, sigma)
        stack.enter_context(edit_output(model, "model.embed_tokens", add_at(noise, positions)))
    for layer in layers:
        stack.enter_context(edit_output(model, f"model.layers[{layer}].mlp",
                                        lambda out: out + step.to(out.dtype)))
    return stack


@pytest.mark.parametrize("base_class", ["Intervention", "SourcelessIntervention"])
@pytest.mark.numerics
def test_a_plain_pyvene_type_in_a_spec_equals_the_same_edit_by_hand_hooks(tokenizer,
                                                                           fresh_registry,
                                                                           base_class):
    """Registered as it is, a plain pyvene type acts at every position of its component, handed
    ``[batch, seq, hidden]`` (a ``pv.Intervention`` was skipped by pyvene for want of a source,
    a ``SourcelessIntervention`` was handed ``[batch, seq * hidden]`` and crashed): with noise
    (two seed rows) and without, every probability equals a hand-written hook's (relative 1e-5,
    i.e. ~3e-8 here; measured: identical), and the edit moves them by far more."""
    fresh_registry.register_intervention("plain_steer", plain_steer(getattr(pv, base_class)))
    model = make_tiny_model("llama")
    steer = {"type": "plain_steer", "component": "mlp_output", "layers": [0, 2], "alpha": ALPHA}
    SEEN.clear()
    alone = run_spec(_spec(steer), model, tokenizer)
    seq = len(alone.tokens)
    assert SEEN == [(1, seq, HIDDEN)] * 2  # whole states, not pyvene's [1, seq * d]
    [expected] = _hook_probs(model, tokenizer, alone.answer_id, [0, 2])
    assert alone.intervened_probs[0] == pytest.approx(expected, rel=1e-5, abs=0)
    # the edit does something: far more than the tolerance (probabilities are ~1/vocab here)
    assert abs(alone.intervened_probs[0] - alone.clean_prob) > 0.1 * alone.clean_prob

    noise = {"type": "noise_add", "seeds": [0, 1], "scale": 3.0, "sigma": 0.5}
    SEEN.clear()
    noised = run_spec(_spec(noise, steer), model, tokenizer)
    assert SEEN == [(2, seq, HIDDEN)] * 2
    expected = _hook_probs(model, tokenizer, noised.answer_id, [0, 2], seeds=[0, 1],
                           subject=noised.subject_range)
    assert noised.intervened_probs == pytest.approx(expected, rel=1e-5, abs=0)
    assert min(abs(a - b) / b for a, b in zip(noised.intervened_probs, noised.corrupt_probs,
                                              strict=True)) > 0.1


def test_pyvene_types_that_need_a_source_are_refused_at_their_entry(tokenizer, fresh_registry):
    for name, cls in (("vanilla", pv.VanillaIntervention), ("addition", pv.AdditionIntervention),
                      ("rotated", pv.RotatedSpaceIntervention),
                      ("pv_noise", pv.NoiseIntervention)):
        fresh_registry.register_intervention(name, cls)
        with pytest.raises(SpecError, match=r"^\$\.interventions\[1\]\.type: .*"
                                            r"(source run|noise_add)"):
            validate_spec(_spec({"type": "noise_add", "seeds": 1},
                                {"type": name, "component": "mlp_output", "layers": [0]}))
    fresh_registry.register_intervention("zero", pv.ZeroIntervention)  # sourceless: accepted
    validate_spec(_spec({"type": "zero", "component": "mlp_output", "layers": [0]}))


def test_a_plugin_type_that_fails_without_a_source_names_its_entry(tokenizer, fresh_registry):
    fresh_registry.register_intervention("needs_source", NeedsSource)
    model = make_tiny_model("llama")
    spec = _spec({"type": "noise_add", "seeds": 1, "sigma": 0.5},
                 {"type": "needs_source", "component": "mlp_output", "layers": [1]})
    validate_spec(spec)  # nothing says so before it runs
    with pytest.raises(SpecError, match=r"^\$\.interventions\[1\]\.type: needs_source "
                                        r"\(NeedsSource\) failed when called without a source "
                                        r"\(TypeError"):
        run_spec(spec, model, tokenizer)


def test_plugin_module_names_parse_like_the_flag():
    assert plugin_modules("a.b, c,,a.b", None, ["d,c", " e "]) == ["a.b", "c", "d", "e"]
    assert plugin_modules(None, "") == []


PLUGIN = '''
import torch
import pyvene as pv
from pyvene_causaltrace.interventions import register_intervention


@register_intervention("{name}")
class Shift(pv.Intervention):
    def __init__(self, shift=0.0, **kwargs):
        super().__init__(**kwargs)
        self.shift = shift

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return base + self.shift * torch.linspace(-1.0, 1.0, base.shape[-1])
'''


@pytest.fixture
def on_disk(tmp_path, tokenizer, monkeypatch, fresh_registry):
    """A tiny Llama saved to disk, and a writer of plugin modules on ``sys.path``."""
    make_tiny_model("llama").save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry.PLUGINS_ENV, raising=False)

    def plugin(module: str, type_name: str, source: str = PLUGIN) -> str:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source.format(name=type_name)))
        return module

    def spec(type_name: str) -> str:
        path = tmp_path / f"{type_name}.json"
        path.write_text(json.dumps(_spec({"type": "noise_add", "seeds": 2, "sigma": 0.5},
                                         {"type": type_name, "component": "mlp_output",
                                          "layers": [1], "shift": 6.0})))
        return str(path)

    return tmp_path, plugin, spec


@pytest.mark.numerics
def test_cli_run_imports_the_plugins_flag(on_disk, capsys):
    root, plugin, spec = on_disk
    path = spec("pvct_shift_a")
    plugin("pvct_test_plugin_a", "pvct_shift_a")
    assert main(["validate", path]) == 1  # unknown without the plugin
    assert "unknown intervention type 'pvct_shift_a'" in capsys.readouterr().out
    code = main(["run", path, "--model", str(root / "llama"), "--plugins",
                 "pvct_test_plugin_a", "--out", str(root / "out")])
    assert code == 0, capsys.readouterr()
    ran = json.loads((root / "out" / "result.json").read_text())
    # the same run in process, with the class the module registered
    from pyvene_causaltrace.models import load_model

    direct = run_spec(path, *load_model(str(root / "llama")))
    assert ran["intervened_probs"] == pytest.approx(direct.intervened_probs, abs=1e-12)
    assert min(abs(a - b) for a, b in zip(ran["intervened_probs"], ran["corrupt_probs"],
                                          strict=True)) > 1e-4  # the plugin's edit acted


def test_cli_reads_the_plugins_environment_variable(on_disk, capsys, monkeypatch):
    root, plugin, spec = on_disk
    path = spec("pvct_shift_b")
    plugin("pvct_test_plugin_b", "pvct_shift_b")
    monkeypatch.setenv("PVCT_PLUGINS", "pvct_test_plugin_b")
    assert main(["validate", path, "--model", str(root / "llama")]) == 0
    assert f"ok      {path} (on {root / 'llama'})" in capsys.readouterr().out
    assert main(["interventions"]) == 0
    assert "pvct_shift_b" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["flag", "env"])
@pytest.mark.parametrize("kind,needle", [("absent", "No module named 'pvct_test_plugin_gone'"),
                                          ("raises", "RuntimeError: boom")])
def test_a_plugin_that_fails_to_import_is_one_error_line(on_disk, capsys, monkeypatch, where,
                                                         kind, needle):
    root, plugin, spec = on_disk
    module = "pvct_test_plugin_gone" if kind == "absent" else plugin(
        "pvct_test_plugin_raises", "unused", "raise RuntimeError('boom')\n")
    argv = ["run", spec("pvct_shift_c"), "--model", str(root / "llama")]
    if where == "flag":
        argv += ["--plugins", f"json,{module}"]
    else:
        monkeypatch.setenv("PVCT_PLUGINS", f"json,{module}")
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1, captured.err
    source = "--plugins" if where == "flag" else "PVCT_PLUGINS"
    assert errors[0].startswith(f"error: {source}: cannot import plugin module {module!r}")
    assert needle in errors[0] and "Traceback" not in captured.err + captured.out


def test_load_plugins_raises_plugin_error_naming_the_module(fresh_registry, monkeypatch):
    monkeypatch.delenv(registry.PLUGINS_ENV, raising=False)
    assert load_plugins("json, os.path") == ["json", "os.path"]
    with pytest.raises(PluginError, match="'pvct_test_plugin_nowhere'") as error:
        load_plugins(["json", "pvct_test_plugin_nowhere"])
    assert error.value.name == "pvct_test_plugin_nowhere"
