"""Causal tracing on the real SmolLM2-135M: the structure measured runs show (README,
examples/results/summary.md), asserted with margins, plus the engine against the batch-1 loop."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _support.data import SPEC_DIR
from reference import reference_kind_cell

from pyvene_causaltrace.defaults import WINDOW
from pyvene_causaltrace.specs import load_spec
from pyvene_causaltrace.tracing.engine import KINDS
from pyvene_causaltrace.tracing.tracer import Tracer, tracer_from_spec

pytestmark = pytest.mark.real_model

PROMPT, SUBJECT = "The Eiffel Tower is in the city of", "The Eiffel Tower"
IFFEL, TOWER, OF = 2, 3, 8  # token positions: 'The', ' E', 'iffel', ' Tower', ..., ' of'


@pytest.fixture(scope="module")
def eiffel(smollm2):
    model, tokenizer = smollm2
    return Tracer(model, tokenizer, PROMPT, SUBJECT, answer=" Paris", seeds=5, scale="auto")


@pytest.fixture(scope="module")
def results(eiffel):
    return {kind: eiffel.trace(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def grids(results):
    return {kind: result.grid() for kind, result in results.items()}


@pytest.mark.numerics
def test_scale_sweep_picks_two_sigma(eiffel):
    sweep = eiffel.sweep
    assert eiffel.prompt.tokens[IFFEL] == "iffel" and eiffel.prompt.tokens[OF] == " of"
    assert sweep.clean_prob == pytest.approx(0.656, abs=0.01)
    # measured: 1 sigma leaves a seed at 0.08-0.12; from 2 sigma on every seed is below 0.03
    assert sweep.worst[0] > sweep.threshold
    assert sweep.chosen == 2.0 and eiffel.scale == 2.0
    assert max(eiffel.corrupt_probs) < sweep.threshold


def test_residual_trace_has_an_early_and_a_late_site(results, grids):
    grid = grids["residual"]
    # measured (10 seeds): 'iffel' 0.36-0.58 over layers 0-12; ' of' 0.08 or less below
    # layer 22, 0.70-0.82 from layer 23; other tokens 0.03 or less
    assert grid[:12, IFFEL].max() > 0.3
    assert grid[:, TOWER].max() < 0.1
    assert grid[:20, OF].max() < 0.15
    assert grid[23:29, OF].min() > 0.5
    assert np.abs(grid[:, [4, 6, 7]]).max() < 0.1  # ' is', ' the', ' city'
    peaks = results["residual"].peaks()
    assert max(peaks["subject_mean"]["peak_layer_per_seed"]) < 15
    assert min(peaks["last"]["peak_layer_per_seed"]) >= 20


def test_windows_split_the_work_between_mlp_and_attention(grids):
    # measured: MLP window at 'iffel' 0.45 (centres 0-3), at ' of' at most 0.09;
    # attention window at ' of' 0.65 (centres 21-24), at 'iffel' at most 0.02
    assert grids["mlp"][:4, IFFEL].max() > 0.3
    assert grids["mlp"][:, OF].max() < 0.25
    assert grids["attn"][19:25, OF].max() > 0.45
    assert grids["attn"][:, IFFEL].max() < 0.1


def test_severing_mlps_removes_the_early_site_severing_attention_does_not(grids):
    early = slice(2, 9)
    # measured: 'iffel', layers 2-8: residual 0.38, attention severed 0.46, MLP severed 0.06
    mlp_severed = grids["severed-mlp"][early, IFFEL].mean()
    attn_severed = grids["severed-attn"][early, IFFEL].mean()
    assert mlp_severed < 0.5 * attn_severed
    assert attn_severed > 0.6 * grids["residual"][early, IFFEL].mean()


def test_controls_pass(eiffel):
    report = eiffel.controls()
    assert report.passed, report.summary()


def _engine_against_loop(model, tracer) -> float:
    """Largest |P(engine) - P(batch-1 loop)| over every kind, at the first and last layer and
    position and cells between, for two seeds."""
    last_layer, last = tracer.engine.n_layers - 1, tracer.prompt.seq_len - 1
    cells = [(0, 0), (0, last), (last_layer, 0), (last_layer, last), (0, IFFEL), (1, TOWER),
             (15, TOWER), (12, 5), (20, OF)]
    worst = 0.0
    for kind in KINDS.values():
        got = tracer.engine.run(kind, cells)
        for s, seed in enumerate(tracer.seeds[:2]):
            for c, (layer, pos) in enumerate(cells):
                expected = reference_kind_cell(model, tracer.engine, kind, seed, layer, pos,
                                               WINDOW)
                worst = max(worst, abs(got[s, c].item() - expected))
    return worst


@pytest.mark.numerics
def test_engine_equals_batch_one_loop(eiffel, smollm2):
    """Measured 8.9e-7 at worst (1.8e-6 before rows started at their restored layer): float32
    rounding that depends on the batch's shape, as the float64 run below shows. At scale 3
    one cell (attn, seed 0, layer 20, ' of', P = 0.39) differs by 1.3e-5 in both engines."""
    model, _ = smollm2
    assert _engine_against_loop(model, eiffel) < 1e-5


@pytest.mark.slow
@pytest.mark.numerics
def test_engine_equals_batch_one_loop_in_float64(smollm2):
    """In float64 the two paths agree to 1e-7 (measured 1.4e-8: Llama's RMSNorm still
    computes in float32)."""
    model, tokenizer = smollm2
    model = copy.deepcopy(model).double()
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, answer=" Paris", seeds=2, scale=3.0)
    assert _engine_against_loop(model, tracer) < 1e-7


def test_trace_spec_file_on_the_real_model(smollm2):
    model, tokenizer = smollm2
    spec = load_spec(SPEC_DIR / "trace_residual.json")
    tracer = tracer_from_spec(spec, model, tokenizer)
    result = tracer.trace(spec.trace["kind"], window=spec.trace["window"])
    assert result.restored_probs.shape == (10, 30, 9) and result.scale == 2.0
    assert result.grid()[23:29, OF].min() > 0.5
