"""Adversarial probes of causal tracing and dataset averaging (audit 5): inputs on which a
number came out wrong without an error."""

from __future__ import annotations

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
