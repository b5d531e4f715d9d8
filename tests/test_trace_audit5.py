"""Adversarial probes of causal tracing and dataset averaging (audit 5): inputs on which a
number came out wrong without an error."""

from __future__ import annotations

import pytest
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace.prompts import tokenize_prompt
from pyvene_causaltrace.tracing.noise_scale import NoiseScaleSweep, sweep_noise_scale


def test_auto_scale_is_the_smallest_that_collapses_whatever_the_order_given(tokenizer):
    """scale='auto' promises the smallest of ``scales`` that collapses every seed; scales given
    largest first chose the largest (the first in the list that collapsed)."""
    model = make_tiny_model("qwen3", n_layers=2)
    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    positions = list(range(*prompt.subject_range))
    sweep = sweep_noise_scale(model, prompt.input_ids, positions, 5, [0, 1], 0.5,
                              scales=[10.0, 1.0, 3.0], threshold=1.0)  # every scale collapses
    assert sweep.chosen == 1.0
    assert sweep.scales == [1.0, 3.0, 10.0]  # and the table reads in order
    direct = NoiseScaleSweep([5.0, 3.0, 1.0], [0], 0.8, [[0.001], [0.002], [0.5]], 0.01, 0.1,
                             "rome")
    assert direct.chosen == 3.0
    assert "smaller scales fail: 1 sigma worst 0.5000" in direct.reason()


def test_a_trace_spec_keeps_the_subjects_occurrence(tokenizer):
    """A tracer on the subject's second appearance wrote a spec without
    ``subject_occurrence``: rebuilt from it, the trace noised the first appearance."""
    from pyvene_causaltrace.tracing.tracer import Tracer, tracer_from_spec

    model = make_tiny_model("qwen3", n_layers=2)
    tracer = Tracer(model, tokenizer, "Paris and Paris again are", "Paris", occurrence=1,
                    seeds=2, sigma=0.5)
    spec = tracer.spec("residual")
    assert spec["subject_occurrence"] == 1
    again = tracer_from_spec(spec, model, tokenizer)
    assert again.noise_positions == tracer.noise_positions == [3]
    assert (again.corrupt_probs == tracer.corrupt_probs).all()
    first = Tracer(model, tokenizer, "Paris and Paris again are", "Paris", seeds=2, sigma=0.5)
    assert "subject_occurrence" not in first.spec("residual")  # the default, as before


def _row(index: int, restored: list, corrupt: float, seed: int = 0) -> dict:
    return {"index": index, "fact": f"f{index}", "kind": "residual", "seed": seed,
            "subject_range": [0, 1], "clean": 0.9, "corrupt": corrupt, "restored": restored}


def test_one_fact_has_no_interval_not_a_zero_width_one():
    """A percentile bootstrap of one fact resamples only that fact: its "95% interval" was
    [x, x], a certainty no data supports. Now null, as for a role no fact has."""
    import json

    import numpy as np

    from pyvene_causaltrace.dataset.aggregate import aggregate_rows, bootstrap_interval

    grid = [[0.5, 0.2, 0.3], [0.6, 0.1, 0.4]]  # 2 layers x 3 positions
    one = aggregate_rows([_row(0, grid, 0.1)], kinds=["residual"], n_boot=50)
    assert one.effects["residual"]["total_effect"] == 0.9 - 0.1
    assert all(np.isnan(v) for v in one.effects["residual"]["total_effect_ci"])
    first = one.roles.index("First subject token")
    assert np.isnan(one.ci_low["residual"][first]).all()
    assert one.aie["residual"][first] == [0.5 - 0.1, 0.6 - 0.1]  # the mean itself is kept
    assert json.loads(one.to_json())["effects"]["residual"]["total_effect_ci"] == [None, None]
    one.summary()
    other = [[0.7, 0.2, 0.3], [0.2, 0.1, 0.4]]
    two = aggregate_rows([_row(0, grid, 0.1), _row(1, other, 0.1)], kinds=["residual"],
                         n_boot=200)
    low, high = two.ci_low["residual"][first], two.ci_high["residual"][first]
    assert np.isfinite(low).all() and (np.asarray(high) > np.asarray(low)).all()
    # a value present in one fact of many resamples to itself too
    values = np.array([[1.0, np.nan], [2.0, np.nan], [3.0, 5.0]])
    low, high = bootstrap_interval(values, n_boot=100)
    assert np.isfinite(low[0]) and np.isnan(low[1]) and np.isnan(high[1])


def test_embedding_matrix_sigma_is_in_the_units_the_noise_is_added_in():
    """Gemma's embedding scales its rows by sqrt(hidden) and the noise is added to its output:
    sigma 'embedding_matrix' was the raw weights' std, sqrt(hidden) times too small (on
    Gemma-2-2B, 3 sigma acted as 1/16 of one). Unscaled embeddings are unchanged."""
    import torch

    from pyvene_causaltrace.bound import bind
    from pyvene_causaltrace.interventions.noise import resolve_sigma

    for arch in ("gemma3_text", "gemma2", "llama"):
        bound = bind(make_tiny_model(arch, n_layers=2))
        assert bound.d_model == 32
        weight = bound.module("embed").weight.detach().float()
        method, sigma = resolve_sigma("embedding_matrix", bound, None, None)
        assert method == "embedding_matrix"
        outputs = bound.module("embed")(torch.arange(weight.shape[0])).detach().float()
        assert sigma == pytest.approx(float(outputs.std()), rel=1e-4), arch  # the outputs' own
        # the control: Gemma 3's embedding module scales its rows by sqrt(hidden) (Gemma 2's
        # too from transformers 5; in 4.57 its model scales after the module, noise included)
        if arch == "gemma3_text":
            assert float(outputs.std()) == pytest.approx(float(weight.std()) * 32 ** 0.5,
                                                         rel=1e-4)
        if arch == "llama":
            assert sigma == pytest.approx(float(weight.std()), rel=1e-5)


def test_a_shard_that_stopped_early_is_not_merged(tmp_path, tokenizer):
    """A rank killed after its screen left a shard with a manifest and fewer rows: merged, the
    aggregate covered fewer facts than the run, without an error."""
    import json

    from test_dataset import tiny_records, write_jsonl

    from pyvene_causaltrace.dataset import read_records, trace_dataset
    from pyvene_causaltrace.dataset.run import merge_shards, shard_dir

    facts = tmp_path / "facts.jsonl"
    write_jsonl(facts, tiny_records(4))
    records, _ = read_records(facts)
    model = make_tiny_model("gpt2")
    out = tmp_path / "sharded"
    for rank in range(2):
        trace_dataset(model, tokenizer, records, out=out, shard=(rank, 2), known="none",
                      kinds=("residual",), seeds=2, progress=False, n_boot=20)
    whole = merge_shards(out, 2, n_boot=20)
    assert whole.effects["residual"]["n_facts"] == 4
    results = shard_dir(out, 1, 2) / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) == 2 * 2  # two facts, two seeds
    results.write_text("".join(lines[:2]))  # its second fact never written
    with pytest.raises(ValueError, match="shard-01-of-02 is incomplete: 2 of its 4 rows"):
        merge_shards(out, 2, n_boot=20)
    assert json.loads((out / "manifest.json").read_text())["merged"] == 2  # left as it was


def test_a_null_known_id_falls_back_to_the_index(tmp_path):
    """``"known_id": null`` made a record whose id was None: the whole run traced it and then
    refused its own results file as damaged (``fact`` must be a string)."""
    import json

    from pyvene_causaltrace.dataset import read_records

    path = tmp_path / "odd.json"
    path.write_text(json.dumps([
        {"known_id": None, "prompt": "Paris is in the city of", "subject": "Paris",
         "attribute": "France"},
        {"known_id": None, "id": "x", "prompt": "Paris is in", "subject": "Paris",
         "attribute": "France"},
        {"known_id": 0, "prompt": "Paris is", "subject": "Paris", "attribute": "France"}]))
    records, errors = read_records(path)
    assert [r.id for r in records] == ["0", "x"]
    assert [(e.id, e.reason) for e in errors] == [("0", "duplicate id")]


def test_a_tracer_from_a_spec_traces_with_the_specs_window(tokenizer):
    """``tracer_from_spec(spec).trace(kind)`` used the default window (10), not the spec's
    ``trace.window``: an mlp trace over other layers than the spec names."""
    from pyvene_causaltrace.tracing.tracer import Tracer, tracer_from_spec

    model = make_tiny_model("qwen3", n_layers=4)
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2, sigma=0.5)
    spec = tracer.spec("mlp", window=1)
    again = tracer_from_spec(spec, model, tokenizer)
    got = again.trace("mlp", progress=False)
    assert got.window == 1
    expected = tracer.trace("mlp", window=1, progress=False)
    assert (got.restored_probs == expected.restored_probs).all()
