"""Tracing meets attribution (``cross_check``): sites beside traces, features' linear prediction
beside a patch.

The machinery is pinned on a model that is linear in the patched quantity: the local replacement
model itself (attention patterns and norm scales held at the clean run's, the transcoder's errors
held) with a transcoder whose features never switch off (thresholds far below every
pre-activation, so each activation is its pre-activation). There, a feature's activation change
times its total effect (summed from the graph's rows) must equal the patch's effect to float
error. In the spliced model (attention and norms live) the two are only reported, and must
differ — else the linear test would be vacuous.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from transcoder_fixtures import random_set, write_circuit_tracer

from pyvene_causaltrace import Tracer
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.heads import head_loadings
from pyvene_causaltrace.crosscheck import (
    CrossCheckResult,
    cross_check,
    cross_check_schema,
    site_influence,
    spearman,
    total_effects,
)
from pyvene_causaltrace.crosscheck.sites import reachable_cells, top_cells, top_k_overlap
from pyvene_causaltrace.errors import InputError, PyveneModelError
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.transcoders import load_transcoder

ANSWER = " the"
L, D, F = 3, 32, 48


def _linear_clt(root, seed=0):
    """Thresholds far below every pre-activation: each feature is its pre-activation."""
    tensors = random_clt_tensors(L, D, F, seed=seed, threshold=-1e4)
    return load_transcoder(str(write_clt(root, tensors)))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def world(request, tmp_path_factory, tokenizer):
    """A tiny model (RMSNorm Llama, LayerNorm GPT-2) whose MLPs matter, a linear fixture CLT,
    its graph and a tracer with 3 seeds."""
    root = tmp_path_factory.mktemp(f"cross_{request.param}")
    model = make_tiny_model(request.param, init=0.2)
    clt = _linear_clt(root / "clt")
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, answer=ANSWER, seeds=3)
    graph = attribute(model, tokenizer, clt, PROMPT, ANSWER)
    return model, tokenizer, clt, tracer, graph, root


@pytest.mark.numerics
def test_in_the_local_replacement_model_the_prediction_is_the_patch(world):
    """Every (feature, seed): predicted == measured to 1e-5 of the largest effect."""
    _, _, clt, tracer, graph, _ = world
    assert graph.n_explored == graph.n_features  # every path is in the graph
    result = cross_check(graph, tracer, clt, top_n=12, modes=("replacement", "spliced"))
    predicted = np.array([f["predicted"] for f in result.features])
    measured = np.array([f["modes"]["replacement"]["measured"] for f in result.features])
    scale = np.abs(measured).max()
    assert scale > 1e-2  # the noise moves these features, and they move the target
    assert np.abs(predicted - measured).max() <= 1e-5 * scale
    assert result.feature_stats["replacement"]["n_sign_disagree"] == 0
    assert result.feature_stats["replacement"]["mean_crossings"] == 0  # nothing switches
    # with attention and norms live the model is not linear: the check can fail
    spliced = np.array([f["modes"]["spliced"]["measured"] for f in result.features])
    assert np.abs(predicted - spliced).max() > 1e-3 * scale
    # the unpatched spliced model is the clean run: its target is the graph's
    for f in result.features:
        for m in f["modes"].values():
            assert m["baseline_target"] == pytest.approx(graph.closure.target, abs=1e-5)


@pytest.mark.numerics
def test_a_per_layer_set_with_skip_is_linear_too(world, tmp_path):
    """The skip path is a linear route the total effects must include."""
    model, tokenizer, _, tracer, _, _ = world
    tensors = random_set(L, D, F, seed=3, skip=True, threshold=-1e4)
    transcoder = load_transcoder(str(write_circuit_tracer(tmp_path / "set", tensors)))
    graph = attribute(model, tokenizer, transcoder, PROMPT, ANSWER)
    result = cross_check(graph, tracer, transcoder, top_n=8, modes=("replacement",))
    predicted = np.array([f["predicted"] for f in result.features])
    measured = np.array([f["modes"]["replacement"]["measured"] for f in result.features])
    assert np.abs(measured).max() > 1e-2
    assert np.abs(predicted - measured).max() <= 1e-5 * np.abs(measured).max()


@pytest.mark.numerics
def test_total_effects_equal_the_dense_path_sum(world):
    """``total_effects`` from the sparse rows equals ``w (I - D)^-1`` from the dense matrix of
    derivatives (edges divided by the source's activation), in float64."""
    _, _, _, _, graph, _ = world
    lay, n = graph.layout, graph.n_features
    rows = graph.rows.dense(torch.arange(graph.rows.n_rows)).double()  # [rows, columns]
    nodes = graph.rows.nodes
    A = torch.zeros(n, n, dtype=torch.float64)
    feature_rows = nodes < n
    A[nodes[feature_rows]] = rows[feature_rows, :n]
    logit = rows[(nodes == lay.logits.start).nonzero().item(), :n]
    derivative = A / graph.activation.double()[None]
    expected = torch.linalg.solve((torch.eye(n, dtype=torch.float64) - derivative).T,
                                  logit / graph.activation.double())
    assert torch.allclose(total_effects(graph), expected, rtol=1e-6,
                          atol=1e-9 * float(expected.abs().max()))


@pytest.mark.numerics
def test_site_grids_add_up_and_compare_the_reachable_cells(world):
    _, _, _, tracer, graph, _ = world
    influence = graph.influence().double()
    lay = graph.layout
    grid = site_influence(graph)
    features = float(influence[:lay.n_features].sum())
    errors = float(influence[lay.errors].sum())
    assert grid.sum() == pytest.approx(features + errors, rel=1e-9)
    assert site_influence(graph, "features").sum() == pytest.approx(features, rel=1e-9)
    share = site_influence(graph, share=True)
    assert share.sum() == pytest.approx((features + errors)
                                        / float(influence[:lay.logits.start].sum()), rel=1e-9)
    i = int(influence[:lay.n_features].argmax())  # a hand sum of one cell
    layer, pos = int(graph.feature_layer[i]), int(graph.feature_position[i])
    here = (graph.feature_layer == layer) & (graph.feature_position == pos)
    cell = float(influence[:lay.n_features][here].sum()) \
        + float(influence[lay.n_features + layer * graph.n_pos + pos])
    assert grid[layer, pos] == pytest.approx(cell, rel=1e-9)

    result = cross_check(graph, tracer, top_n=0)
    trace = tracer.trace("residual")
    assert np.allclose(result.trace_grids["residual"], trace.indirect_effect.mean(0))
    mask = reachable_cells(graph.n_layers, graph.n_pos, tracer.prompt.subject_range[0])
    expected = spearman(share[mask], trace.indirect_effect.mean(0)[mask])
    assert result.sites["residual"]["all"]["spearman"] == pytest.approx(expected)
    assert result.sites["residual"]["all"]["n_cells"] == int(mask.sum())
    assert result.features == [] and result.feature_stats == {}


def test_rank_statistics_by_hand():
    a = np.array([1.0, 5.0, 3.0, 4.0])
    b = np.array([10.0, 40.0, 30.0, 20.0])
    # ranks a: 1 4 2 3; b: 1 4 3 2 -> d^2 = 0+0+1+1 -> 1 - 6*2/(4*15) = 0.8
    assert spearman(a, b) == pytest.approx(0.8)
    grid_a = np.arange(6.0).reshape(2, 3)
    grid_b = grid_a[::-1].copy()
    assert top_k_overlap(top_cells(grid_a, 2), top_cells(grid_a, 2)) == 1.0
    assert top_k_overlap(top_cells(grid_a, 2), top_cells(grid_b, 2)) == 0.0
    mask = np.array([[False, True, True], [False, True, True]])
    assert top_k_overlap(top_cells(grid_a, 10, mask), top_cells(grid_a, 10, mask)) == 1.0
    assert np.isnan(top_k_overlap([], []))


def test_the_json_follows_its_schema_and_round_trips(world, tmp_path):
    _, _, clt, tracer, graph, _ = world
    result = cross_check(graph, tracer, clt, top_n=3, modes=("spliced", "replacement"))
    path = tmp_path / "cross_check.json"
    result.to_json(path)
    data = json.loads(path.read_text())
    schema = cross_check_schema()
    jsonschema.validate(data, schema)
    again = CrossCheckResult.from_json(path.read_text())
    assert again.to_dict() == result.to_dict()
    assert list(result.to_dataframe()["mode"]) == ["spliced", "replacement"] * 3
    for broken in ({k: v for k, v in data.items() if k != "sites"},
                   {**data, "n_layers": "three"},
                   {**data, "features": [{**data["features"][0], "modes": {"other": {}}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    figure = result.plot(tmp_path / "cross_check.png")
    assert (tmp_path / "cross_check.png").stat().st_size > 10_000
    assert len(figure.axes) >= 5  # 3 heat maps (+ colour bars) and 2 scatter panels


def test_mismatched_inputs_are_refused(world, tokenizer):
    model, _, clt, tracer, graph, root = world
    other = attribute(model, tokenizer, clt, PROMPT + " the", ANSWER)
    with pytest.raises(InputError, match="one prompt"):
        cross_check(other, tracer)
    answer = attribute(model, tokenizer, clt, PROMPT, " city")
    with pytest.raises(InputError, match="answer"):
        cross_check(answer, tracer)
    with pytest.raises(InputError, match="attention"):
        cross_check(graph, tracer, kinds=("attn",))
    with pytest.raises(InputError, match="modes"):
        cross_check(graph, tracer, clt, modes=("linear",))
    with pytest.raises(InputError, match="top_n"):
        cross_check(graph, tracer, clt, top_n=-1)
    # a transcoder of the same shape but other weights: the activations give it away
    with pytest.raises(InputError, match="another model or transcoder"):
        cross_check(graph, tracer, _linear_clt(root / "other", seed=9), top_n=2)
    wrapped = intervenable_model_class()([], model)
    with pytest.raises(PyveneModelError):
        cross_check(graph, Tracer(wrapped, tokenizer, PROMPT, SUBJECT, answer=ANSWER, seeds=1))


@pytest.mark.numerics
def test_batched_patches_equal_one_forward_each(world, monkeypatch):
    """Rows of one batch (each its own feature and value) equal one forward per row."""
    from pyvene_causaltrace.crosscheck import features as module

    model, _, clt, tracer, graph, _ = world
    coefficients = module.target_coefficients(graph, int(tracer.engine.clean_probs.numel()))
    order = graph.influence()[:graph.n_features].argsort(descending=True)[:5]
    rows = [None] + [(int(graph.feature_layer[i]), int(graph.feature_position[i]),
                      int(graph.feature_id[i]), 0.5 * k) for k, i in enumerate(order)]
    runner = module.PatchRunner(model, clt, tracer.prompt.input_ids, coefficients,
                                tracer.answer_id, "replacement")
    batched = runner.run(rows)
    monkeypatch.setattr(module, "ROWS", 1)
    single = runner.run(rows)
    for a, b in zip(batched, single, strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
    assert (batched[0][1:] - batched[0][0]).abs().max() > 1e-3  # the patches do something


@pytest.mark.numerics
def test_in_the_replacement_model_only_threshold_crossings_break_the_prediction(world,
                                                                                  tmp_path):
    """A JumpReLU CLT whose features do switch: every patch that switches none is predicted
    exactly; the ones that switch some are where the gaps are."""
    model, tokenizer, _, tracer, _, _ = world
    clt = load_transcoder(str(write_clt(tmp_path / "jump",
                                        random_clt_tensors(L, D, F, seed=1, threshold=0.3))))
    graph = attribute(model, tokenizer, clt, PROMPT, ANSWER)
    result = cross_check(graph, tracer, clt, top_n=15, modes=("replacement",))
    predicted = np.array([f["predicted"] for f in result.features])
    measured = np.array([f["modes"]["replacement"]["measured"] for f in result.features])
    crossings = np.array([f["modes"]["replacement"]["crossings"] for f in result.features])
    scale = np.abs(measured).max()
    assert (crossings == 0).any() and (crossings > 0).any()
    assert np.abs(predicted - measured)[crossings == 0].max() <= 1e-5 * scale
    assert np.abs(predicted - measured)[crossings > 0].max() > 1e-5 * scale


@pytest.mark.numerics
def test_heads_put_loadings_beside_per_head_restores(world, tmp_path):
    """``heads=True``: each head's loading (the graph's head loadings summed over the sources
    at the subject's positions, or over all) beside its per-head indirect effect, and their
    rank statistics, all recomputed here by hand; the JSON keeps to its schema."""
    _, _, clt, tracer, graph, _ = world
    result = cross_check(graph, tracer, clt, top_n=0, kinds=("residual",), heads=True)
    heads = result.heads
    assert heads["layers"] == [0, 1, 2] and heads["n_heads"] == 4
    assert heads["position"] == tracer.prompt.seq_len - 1
    assert result.settings["heads"] == [0, 1, 2]
    loadings = head_loadings(tracer.model, clt, graph)
    assert heads["target"] == loadings.target_label == graph.label(graph.logit_node)
    positions = torch.tensor(graph.nodes()["position"].to_numpy()[:len(loadings.edges)])
    start, stop = tracer.prompt.subject_range
    parts = loadings.parts.double()
    subject = parts[:, :, (positions >= start) & (positions < stop)].sum(-1).numpy()
    every = parts.sum(-1).numpy()
    assert np.abs(subject).max() > 0 and not np.allclose(subject, every)
    assert np.allclose(heads["loadings"]["subject"], subject, rtol=1e-9, atol=0)
    assert np.allclose(heads["loadings"]["all"], every, rtol=1e-9, atol=0)
    effects = tracer.trace_heads(progress=False).grid("ie")
    assert np.allclose(heads["effects"], effects, rtol=1e-6, atol=1e-12)
    assert np.abs(effects).max() > 1e-6
    for part, grid in (("subject", subject), ("all", every)):
        stats = heads["stats"][part]
        assert stats["n_heads"] == 12
        assert stats["spearman"] == pytest.approx(spearman(grid, effects))
        assert stats["per_layer"] == pytest.approx([spearman(grid[i], effects[i])
                                                    for i in range(3)], nan_ok=True)
    frame = result.heads_dataframe()
    assert len(frame) == 12 and frame["effect"].tolist() == pytest.approx(effects.ravel())
    assert "heads, loading (subject sources)" in result.summary()

    path = tmp_path / "cross_check.json"
    result.to_json(path)
    data = json.loads(path.read_text())
    schema = cross_check_schema()
    jsonschema.validate(data, schema)
    assert CrossCheckResult.from_json(path.read_text()).to_dict() == result.to_dict()
    broken = {**data, "heads": {k: v for k, v in data["heads"].items() if k != "stats"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    # one layer asked for; without heads the section is empty and still valid
    one = cross_check(graph, tracer, clt, top_n=0, kinds=("residual",), heads=1)
    assert one.heads["layers"] == [1]
    assert np.allclose(one.heads["effects"], effects[1:2], rtol=1e-6, atol=1e-12)
    none = cross_check(graph, tracer, top_n=0, kinds=("residual",))
    assert none.heads == {} and none.settings["heads"] is None
    jsonschema.validate(json.loads(none.to_json()), schema)
    assert none.heads_dataframe().empty


def test_heads_need_the_transcoder_and_real_layers(world):
    _, _, clt, tracer, graph, _ = world
    with pytest.raises(InputError, match="transcoder"):
        cross_check(graph, tracer, heads=True)
    with pytest.raises(InputError, match="heads"):
        cross_check(graph, tracer, clt, top_n=0, heads=[7])
    with pytest.raises(InputError, match="heads"):
        cross_check(graph, tracer, clt, top_n=0, heads="all")
