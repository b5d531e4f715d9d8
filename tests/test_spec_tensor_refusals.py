"""What a spec's tensors and model-intervention entries refuse, each at its JSON path: a dtype
a spec cannot hold, data that is not an array of the stated shape, a file entry outside the
spec's folder, missing, unreadable, without the key or of another dtype; a class a spec cannot
import again, a constructor that fails, a state the class does not take, and a bare model
required. Unit level, no forward runs (the reruns that must be bit-equal are in
test_spec_model_interventions)."""

from __future__ import annotations

import re

import pytest
import torch
from _support.models import make_tiny_model
from safetensors.torch import save_file

from pyvene_causaltrace import spec_tensors
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.model_interventions import describe, rebuild, resolve_class
from pyvene_causaltrace.models import PyveneModelError
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.specs import SpecError

pv = import_pyvene()
WHERE = "$.model_interventions[0].tensors.t"


def _decode(encoded, base_dir=None):
    return spec_tensors.decode_tensor(encoded, WHERE, base_dir)


def test_a_dtype_a_spec_cannot_hold_is_refused_on_the_way_in():
    with pytest.raises(InputError, match=r"complex64 tensor cannot go in a spec"):
        spec_tensors.encode_tensor(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("encoded,where,message", [
    ({"dtype": "float8", "shape": [1], "data": [0.0]}, ".dtype", "'float8' is not one of"),
    ({"dtype": "float32", "shape": [2], "data": "ab"}, ".data", "not a float32 array"),
    ({"dtype": "float32", "shape": [3], "data": [1.0, 2.0]}, ".data", r"holds shape \[2\]"),
    ({"dtype": "float32", "shape": [2]}, "", "needs 'data', or 'file' and 'key'"),
    ({"dtype": "float32", "shape": [2], "file": "/etc/t.safetensors", "key": "t"}, ".file",
     "must be a path inside the spec's folder"),
    ({"dtype": "float32", "shape": [2], "file": "../t.safetensors", "key": "t"}, ".file",
     "must be a path inside the spec's folder"),
])
def test_an_inline_or_malformed_entry_is_refused_at_its_path(encoded, where, message):
    with pytest.raises(SpecError, match="^" + re.escape(WHERE + where) + ": .*" + message):
        _decode(encoded)
    good = {"dtype": "float32", "shape": [2], "data": [1.0, 2.0]}  # control: a good entry reads
    assert torch.equal(_decode(good), torch.tensor([1.0, 2.0]))


def test_a_file_entry_is_read_only_when_its_file_key_dtype_and_shape_fit(tmp_path):
    tensor = torch.arange(4, dtype=torch.float32)
    save_file({"t": tensor}, str(tmp_path / "s.safetensors"))
    entry = {"dtype": "float32", "shape": [4], "file": "s.safetensors", "key": "t",
             "sha256": spec_tensors.digest(tensor)}
    assert torch.equal(_decode(entry, tmp_path), tensor)  # the control
    with pytest.raises(SpecError, match=r"\.file: .*load it with load_spec\(path\)"):
        _decode(entry)
    with pytest.raises(SpecError, match=r"\.key: .* holds no tensor 'u'"):
        _decode({**entry, "key": "u"}, tmp_path)
    with pytest.raises(SpecError, match=r"is float32 \[4\], the entry says float64 \[4\]"):
        _decode({**entry, "dtype": "float64"}, tmp_path)
    with pytest.raises(SpecError, match=r"is float32 \[4\], the entry says float32 \[2, 2\]"):
        _decode({**entry, "shape": [2, 2]}, tmp_path)
    with pytest.raises(SpecError, match="does not match its sha256"):
        _decode({**entry, "sha256": "0" * 64}, tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x07not a safetensors file")
    with pytest.raises(SpecError, match=r"\.file: .*not a readable safetensors file"):
        _decode({**entry, "file": "bad.safetensors"}, tmp_path)


class Scaled(pv.ConstantSourceIntervention, pv.LocalistRepresentationIntervention):
    """Multiplies by a learnt-looking buffer ``gain`` (a module-level class: importable)."""

    def __init__(self, size: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("gain", torch.ones(size))

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return base * self.gain


def _entry(**changes):
    entry = {"class": f"{__name__}.Scaled", "layer": 0, "component": "block_output",
             "init": {"size": 32}, "settings": {"training": False},
             "tensors": {"gain": spec_tensors.encode_tensor(torch.full((32,), 2.0))}}
    entry.update(changes)
    return entry


@pytest.mark.parametrize("name,message", [
    ("pyvene_causaltrace._lazy.thing", "a private or special name"),
    ("pyvene_causaltrace.no_module.Thing", "cannot import .* has no attribute 'no_module'"),
    ("no_such_package_anywhere.Thing", "cannot import .*no module of .* can be imported"),
])
def test_a_class_path_that_does_not_import_is_refused(name, message):
    with pytest.raises(SpecError, match=r"^\$\.x\.class: .*" + message):
        resolve_class(name, "$.x.class")
    assert resolve_class(f"{__name__}.Scaled", "$.x.class") is Scaled  # the control


def test_an_entry_rebuilds_or_is_refused_at_its_path():
    model = make_tiny_model("llama", init=0.2)
    pv_model = rebuild([_entry()], model)  # the control: it rebuilds, its state as written
    made = next(iter(pv_model.interventions.values()))
    made = made[0] if isinstance(made, tuple) else made
    assert isinstance(made, Scaled) and torch.equal(made.gain, torch.full((32,), 2.0))
    assert not made.training
    with pytest.raises(SpecError, match=r"^\$\.model_interventions\[0\]\.init: .*failed"):
        rebuild([_entry(init={"size": "thirty-two"})], model)
    with pytest.raises(SpecError, match=r"\[0\]\.tensors\.inner\.gain: .* no submodule 'inner'"):
        rebuild([_entry(tensors={"inner.gain": spec_tensors.encode_tensor(torch.ones(2))})],
                model)
    with pytest.raises(SpecError, match=r"\[0\]\.tensors: .* does not take this state"):
        rebuild([_entry(tensors={})], model)  # its gain left out
    with pytest.raises(SpecError, match=r"^\$\.model_interventions: pyvene cannot place"):
        rebuild([_entry(layer=99)], model)
    with pytest.raises(PyveneModelError, match="needs the bare model"):
        rebuild([_entry()], pv_model)


def test_what_describe_refuses_says_which_intervention_and_why():
    model = make_tiny_model("llama", init=0.2)

    class Hooked(Scaled):
        pass

    made = Scaled(size=32)
    made.register_forward_hook(lambda *args: None)
    pv_model = pv.IntervenableModel([{"layer": 0, "component": "block_output",
                                      "intervention": made}], model)
    with pytest.raises(PyveneModelError, match="the intervention has forward hooks of its own"):
        describe(bind(pv_model, interventions=True))
    made = Scaled(size=32)
    made.note = (1, 2)  # a tuple reads back from JSON as a list: not the same
    pv_model = pv.IntervenableModel([{"layer": 0, "component": "block_output",
                                      "intervention": made}], model)
    with pytest.raises(PyveneModelError, match=r"attribute 'note' is \(1, 2\) \(tuple\)"):
        describe(bind(pv_model, interventions=True))
    # the control: the same class, nothing odd, is described
    pv_model = pv.IntervenableModel([{"layer": 0, "component": "block_output",
                                      "intervention": Scaled(size=32)}], model)
    (entry,) = describe(bind(pv_model, interventions=True))
    assert entry["class"] == f"{__name__}.Scaled" and entry["tensors"]["gain"]["shape"] == [32]
