"""pyvene's causal-tracing tutorial setup with our types swapped in gives the same numbers as
the same run written as a JSON spec (examples/pyvene_tutorial_causal_tracing.py), on SmolLM2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pyvene_causaltrace import run_spec

pytestmark = pytest.mark.real_model
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pyvene_tutorial_causal_tracing.py"


def _example():
    spec = importlib.util.spec_from_file_location("pyvene_tutorial_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stream,layer,pos", [("mlp_output", 10, 3), ("attention_output", 4, 6),
                                              ("mlp_output", 0, 1)])
@pytest.mark.numerics
def test_tutorial_setup_equals_its_json_spec(smollm2, stream, layer, pos):
    model, tokenizer = smollm2
    example = _example()
    noise = example.noise_type(model, tokenizer)
    theirs = example.tutorial_cell(model, tokenizer, noise, stream, layer, pos)
    result = run_spec(example.cell_spec(stream, layer, pos), model, tokenizer)
    assert result.corrupt_probs[0] < 0.5 * result.clean_prob  # the noise does corrupt
    assert abs(result.intervened_probs[0] - theirs) < 1e-6, (result.intervened_probs[0], theirs)
