"""A spec file is read as written or refused: a duplicated key, NaN or infinity, a float where
an integer is meant; a range's negative bounds count from the end as Python's do."""

from __future__ import annotations

import copy
import json

import pytest
from _support.models import PROMPT, SUBJECT

from pyvene_causaltrace.locations import resolve_layers, resolve_positions
from pyvene_causaltrace.prompts import tokenize_prompt
from pyvene_causaltrace.specs import SpecError, load_spec

BASE = {
    "schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
    "interventions": [
        {"type": "noise_add", "seeds": [0, 1], "scale": 3.0},
        {"type": "clean_restore", "component": "block_output", "layers": 1,
         "positions": "last_subject"},
    ],
}


def test_negative_range_bounds_count_from_the_end_as_in_python(tokenizer):
    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    positions = list(range(prompt.seq_len))
    for start, stop in ((-2, -1), (0, -1), (-3, 6), (1, -2)):
        assert resolve_positions({"start": start, "stop": stop}, prompt, "$.p") \
            == positions[start:stop], (start, stop)
        assert resolve_layers({"start": start, "stop": stop}, 6, "$.l") \
            == list(range(6))[start:stop], (start, stop)
    assert resolve_layers({"start": 0, "stop": 6}, 6, "$.l") == list(range(6))
    with pytest.raises(SpecError, match="outside") as error:
        resolve_layers({"start": -7, "stop": 2}, 6, "$.l")
    assert error.value.path == "$.l.start"
    with pytest.raises(SpecError, match="empty"):
        resolve_layers({"start": -1, "stop": -1}, 6, "$.l")


def test_a_key_given_twice_is_refused(tmp_path):
    text = json.dumps(BASE).replace('"layers": 1,', '"layers": 1, "layers": 2,')
    assert text.count('"layers"') == 2
    (tmp_path / "dup.json").write_text(text)
    with pytest.raises(SpecError, match="'layers' appears twice"):
        load_spec(tmp_path / "dup.json")
    (tmp_path / "ok.json").write_text(json.dumps(BASE))
    assert load_spec(tmp_path / "ok.json").interventions[1].get("layers") == 1


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_in_a_file_are_refused(tmp_path, text):
    raw = json.dumps(BASE).replace('"scale": 3.0', f'"scale": {text}')
    (tmp_path / "x.json").write_text(raw)
    with pytest.raises(SpecError, match="finite"):
        load_spec(tmp_path / "x.json")


@pytest.mark.parametrize("where, value", [
    (["interventions", 0, "scale"], float("nan")),
    (["interventions", 0, "sigma"], float("inf")),
    (["attribution"], {"clt": "x", "node_threshold": float("nan")}),
    (["attribution"], {"clt": "x", "desired_logit_prob": float("nan")}),
])
def test_non_finite_numbers_in_a_dict_are_refused_at_their_path(where, value):
    spec = copy.deepcopy(BASE)
    if where[0] == "attribution":
        spec["interventions"] = []
        spec.pop("subject")
    target = spec
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(SpecError, match="finite") as error:
        load_spec(spec)
    assert error.value.path.startswith("$." + ".".join(map(str, where[:1])))


@pytest.mark.parametrize("change", [
    {"layers": 1.0}, {"layers": [1.0]}, {"layers": {"start": 0.0, "stop": 2}},
    {"positions": 2.0}, {"positions": [2.0]}, {"positions": {"start": 0, "stop": 2.0}},
    {"layers": True},
])
def test_a_float_or_bool_where_an_integer_is_meant_is_refused(change):
    spec = copy.deepcopy(BASE)
    spec["interventions"][1].update(change)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert error.value.path.startswith("$.interventions[1]." + next(iter(change)))


@pytest.mark.parametrize("path, value", [
    (["subject_occurrence"], 0.0), (["interventions", 0, "seeds"], 2.0),
    (["interventions", 0, "seeds"], [0.0, 1.0]), (["trace"], {"kind": "mlp", "window": 2.0}),
])
def test_floats_in_other_integer_fields_are_refused(path, value):
    spec = copy.deepcopy(BASE)
    if path[0] == "trace":
        spec["interventions"] = spec["interventions"][:1]
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(SpecError, match="integer"):
        load_spec(spec)


def test_the_result_spec_names_the_model_it_ran_on_not_the_specs(tokenizer):
    """A spec naming smollm2-135m run on another model: the result's spec, rerun, must not
    claim smollm2-135m made these numbers."""
    from _support.models import make_tiny_model

    from pyvene_causaltrace.execute import run_spec

    spec = {**BASE, "model": "smollm2-135m"}
    model = make_tiny_model("llama")
    result = run_spec(spec, model, tokenizer)
    assert "model" not in result.spec  # a random-init model has no name
    model.pvct_source = "tiny-llama"  # what load_model records
    named = run_spec(spec, model, tokenizer)
    assert named.spec["model"] == "tiny-llama"
    assert named.spec == {**spec, "model": "tiny-llama"}
    assert named.intervened_probs == result.intervened_probs


@pytest.mark.parametrize("dtype, data", [
    ("int64", [1.7, -2.9]), ("int32", [True, 0]), ("bool", [2, 0]), ("bool", [1.0, 0.0]),
    ("float32", [True]), ("float32", [1e300]), ("float16", [1e6]), ("bfloat16", [1e39]),
])
def test_inline_tensor_data_its_dtype_would_round_is_refused(dtype, data):
    """torch.tensor truncates 1.7 to an int64 1, makes 2 a True and 1e300 a float32 inf."""
    from pyvene_causaltrace.spec_tensors import decode_tensor

    with pytest.raises(SpecError, match="cannot hold") as error:
        decode_tensor({"dtype": dtype, "shape": [len(data)], "data": data}, "$.t", None)
    assert error.value.path == "$.t.data"


def test_inline_tensors_written_by_encode_tensor_read_back_exactly():
    import torch

    from pyvene_causaltrace.spec_tensors import DTYPES, decode_tensor, encode_tensor

    source = torch.tensor([[0.1, -3.0e38, 65504.0], [1.0, 0.0, -2.5]], dtype=torch.float64)
    for name, dtype in DTYPES.items():
        tensor = (source.abs() > 0.5) if dtype == torch.bool else (
            source.clamp(-100, 100).to(dtype) if not dtype.is_floating_point
            else source.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype))
        again = decode_tensor(json.loads(json.dumps(encode_tensor(tensor))), "$.t", None)
        assert again.dtype == tensor.dtype and torch.equal(again, tensor), name
    assert decode_tensor({"dtype": "float32", "shape": [2], "data": [0.1, 1]}, "$.t",
                         None).tolist() == [torch.tensor(0.1).item(), 1.0]


def test_a_tracers_spec_keeps_the_subject_occurrence(tokenizer):
    """Tracer.spec left out ``occurrence``: its spec noised the subject's first appearance."""
    import numpy as np
    from _support.models import make_tiny_model

    from pyvene_causaltrace.tracing import Tracer, tracer_from_spec

    model = make_tiny_model("llama")
    prompt = "the cat and the dog"
    tracer = Tracer(model, tokenizer, prompt, "the", occurrence=1, seeds=2, scale=3.0)
    first = Tracer(model, tokenizer, prompt, "the", seeds=2, scale=3.0)
    assert tracer.noise_positions != first.noise_positions
    spec = tracer.spec("residual")
    assert spec["subject_occurrence"] == 1 and "subject_occurrence" not in first.spec("residual")
    again = tracer_from_spec(load_spec(json.loads(json.dumps(spec))), model, tokenizer)
    assert again.noise_positions == tracer.noise_positions
    assert np.array_equal(again.trace("residual", progress=False).restored_probs,
                          tracer.trace("residual", progress=False).restored_probs)


def test_tracer_from_spec_keeps_the_specs_window(tokenizer):
    """tracer_from_spec left the spec's trace.window out: an mlp trace ran with window 10."""
    import numpy as np
    from _support.models import make_tiny_model

    from pyvene_causaltrace.tracing import Tracer, tracer_from_spec

    model = make_tiny_model("llama", n_layers=4)
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0, window=1)
    spec = tracer.spec("mlp")
    assert spec["trace"]["window"] == 1
    again = tracer_from_spec(load_spec(json.loads(json.dumps(spec))), model, tokenizer)
    assert again.settings.window == 1
    assert np.array_equal(again.trace("mlp", progress=False).restored_probs,
                          tracer.trace("mlp", progress=False).restored_probs)


def test_a_subject_occurrence_without_a_subject_is_refused():
    spec = copy.deepcopy(BASE)
    spec.pop("subject")
    spec["interventions"] = [{"type": "noise_add", "seeds": 1, "positions": "last",
                              "sigma": 0.1}]
    assert load_spec(spec).subject is None  # control: valid without the field
    with pytest.raises(SpecError, match="no subject") as error:
        load_spec({**spec, "subject_occurrence": 1})
    assert error.value.path == "$.subject_occurrence"
