"""What a graph explains, as circuit-tracer users expect it: several logit nodes (the salient
logits, each weighted by its probability), direction targets on the residual stream, and the BOS
error convention — on tiny Llama and GPT-2 models with fixture CLTs, against independent
references (a plain forward, a dense float64 influence)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from dense_reading import compute_influence, normalize_matrix, square
from dense_reading import logit_weights as dense_weights
from dense_reading import prune as dense_prune

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.replacement import state_module
from pyvene_causaltrace.attribution.targets import direction_target
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.capture import capture
from pyvene_causaltrace.errors import InputError, SpecError
from pyvene_causaltrace.models import get_adapter
from pyvene_causaltrace.specs import validate_spec
from pyvene_causaltrace.transcoders import load_from_disk

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # closure, relative to the scale of what a row sums (edges.CLOSURE_TOLERANCE)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request, tmp_path_factory):
    model = make_tiny_model(request.param, init=0.2, n_layers=3)
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    path = write_clt(tmp_path_factory.mktemp(f"clt-{request.param}"), tensors)
    return model, load_from_disk(str(path))


@pytest.fixture(scope="module")
def salient(setup, tokenizer):
    model, clt = setup
    return attribute(model, tokenizer, clt, PROMPT, max_n_logits=6, desired_logit_prob=0.5,
                     batch_size=16)


def _clean_logits(model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


@pytest.mark.numerics
def test_salient_logits_are_circuit_tracers_choice_each_a_closing_row(setup, tokenizer,
                                                                       salient):
    model, _ = setup
    _, logits = _clean_logits(model, tokenizer)
    probs = logits[0, -1].softmax(-1)
    top_p, top_i = probs.topk(6)
    cutoff = int((top_p.cumsum(0) < 0.5).sum()) + 1  # up to the first reaching 0.5
    graph = salient
    assert graph.n_logits == min(cutoff, 6) and graph.n_logits > 1
    assert [t["token"] for t in graph.targets] == top_i[:graph.n_logits].tolist()
    for j, goal in enumerate(graph.targets):
        assert goal["prob"] == pytest.approx(float(top_p[j]), abs=1e-6)
        assert goal["weight"] == goal["prob"]
        # the row's target is the demeaned logit (top-10 mean) read off a plain forward
        token = goal["token"]
        expected = logits[0, -1, token] - logits[0, -1].topk(10).values.mean()
        row = int(graph.rows.row_of_node(graph.layout.n_nodes)[graph.layout.logits.start + j])
        assert float(graph.rows.targets[row]) == pytest.approx(float(expected), abs=1e-4)
    logit_rows = graph.rows.row_of_node(graph.layout.n_nodes)[graph.layout.logits]
    assert (logit_rows >= 0).all()
    assert float(graph.row_closures()[logit_rows].max()) < TOL
    assert graph.feature_closure() < TOL
    assert graph.metadata["targets"]["chosen"] == graph.n_logits


@pytest.mark.numerics
def test_probability_weighted_influence_and_pruning_equal_a_dense_reference(salient):
    graph = salient
    adjacency = square(graph).double()
    weights = dense_weights(graph.layout, graph.logit_weights()).double()
    dense = compute_influence(normalize_matrix(adjacency), weights)
    assert torch.allclose(graph.influence(), dense, rtol=1e-6, atol=1e-9)
    # weighting matters: equal weights give another ranking of the features
    flat = compute_influence(normalize_matrix(adjacency), dense_weights(graph.layout).double())
    assert not torch.allclose(flat / flat.sum(), dense / dense.sum(), rtol=1e-3)
    reference = dense_prune(adjacency, graph.layout, probabilities=graph.logit_weights())
    assert torch.equal(graph.prune().node_mask, reference.node_mask)
    # the weighted mean target's decomposition adds up to the mean of the logit targets
    parts = graph.decomposition()
    total = sum(parts[k] for k in ("features", "unexplored", "errors", "steering", "tokens",
                                   "constants"))
    assert total == pytest.approx(parts["target"], rel=1e-4, abs=1e-5)
    rows = graph.rows.row_of_node(graph.layout.n_nodes)[graph.layout.logits]
    weights = graph.logit_weights() / graph.logit_weights().sum()
    assert parts["target"] == pytest.approx(
        float((weights * graph.rows.targets[rows]).sum()), rel=1e-9)
    mean_row = sum(float(w) * graph.target_row(j).double() for j, w in enumerate(weights))
    assert torch.allclose(graph.target_row().double(), mean_row, atol=1e-6)


@pytest.mark.numerics
def test_logit_nodes_in_the_node_table_and_the_export(salient, tmp_path):
    graph = salient
    nodes = graph.nodes()
    logits = nodes[nodes.kind == "logit"]
    assert len(logits) == graph.n_logits
    assert logits.token_prob.tolist() == pytest.approx([t["prob"] for t in graph.targets])
    assert logits.feature.tolist() == [t["token"] for t in graph.targets]
    assert nodes[nodes.kind != "logit"].token_prob.isna().all()
    payload = graph.to_json(tmp_path / "graph.json")
    check_graph_json(payload)
    exported = [n for n in payload["nodes"] if n["feature_type"] == "logit"]
    assert [n["node_id"] for n in exported] == [
        f"{graph.n_layers + 1}_{t['token']}_{graph.n_pos - 1}" for t in graph.targets]
    assert [n["token_prob"] for n in exported] == pytest.approx(
        [t["prob"] for t in graph.targets], abs=1e-6)
    assert [n["is_target_logit"] for n in exported] == [True] + [False] * (graph.n_logits - 1)


def test_multi_logit_graph_round_trips_exactly(salient, tmp_path):
    graph = salient
    graph.save(tmp_path / "g.safetensors")
    back = AttributionGraph.load(tmp_path / "g.safetensors")
    assert back.targets == graph.targets and back.n_logits == graph.n_logits
    assert back.to_dataframe().equals(graph.to_dataframe())
    assert torch.equal(back.influence(), graph.influence())
    assert torch.equal(back.prune().node_mask, graph.prune().node_mask)


@pytest.mark.numerics
def test_an_answer_keeps_the_single_target_of_weight_one(setup, tokenizer, salient):
    model, clt = setup
    readable = [j for j, t in enumerate(salient.targets) if j and tokenizer(
        t["text"], add_special_tokens=False)["input_ids"] == [t["token"]]]
    assert readable, "no salient token that its own text tokenizes back to"
    j = readable[0]
    graph = attribute(model, tokenizer, clt, PROMPT, salient.targets[j]["text"], batch_size=16)
    assert graph.n_logits == 1 and graph.targets[0]["weight"] == 1.0
    assert graph.target["token"] == salient.targets[j]["token"]
    # its row is the salient graph's row of the same token (same target, same leaves)
    row = graph.target_row()
    assert torch.allclose(row, salient.target_row(j), atol=1e-5 * float(row.abs().max()))


@pytest.mark.numerics
def test_a_direction_target_explains_its_projection(setup, tokenizer):
    model, clt = setup
    d_model = bind(model).d_model
    direction = torch.randn(d_model, generator=torch.Generator().manual_seed(3))
    ids, _ = _clean_logits(model, tokenizer)
    unembed = get_adapter(model).module_path("unembed")
    norm = get_adapter(model).module_path("pre_attn_norm", 2)
    states = capture(model, {"input_ids": ids}, [f"{unembed}.input", f"{norm}.input"])
    for goal, state, position in (
            (direction, states[f"{unembed}.input"], -1),
            (direction_target(direction, output="resid_pre.2", position=3, name="probe"),
             states[f"{norm}.input"], 3)):
        graph = attribute(model, tokenizer, clt, PROMPT, target=goal, batch_size=16)
        assert graph.n_logits == 1 and graph.targets[0]["prob"] is None
        expected = float(state[0, position] @ direction / direction.norm())  # unit direction
        assert graph.closure.target == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert graph.closure.relative < TOL and graph.feature_closure() < TOL
        assert graph.targets[0]["token"] == model.config.vocab_size  # circuit-tracer's virtual id
        if position == 3:  # nothing after position 3 reaches it
            later = graph.feature_position > 3
            assert later.any() and graph.target_row()[:graph.n_features][later].abs().max() == 0
    check_graph_json(graph.to_json())


@pytest.mark.numerics
def test_a_demeaned_unembedding_direction_is_the_demeaned_vocab_logit(tokenizer, tmp_path):
    """circuit-tracer's logit targets are directions ``W_U[t] - mean(W_U)`` on the unembedding's
    input: the same row as our vocabulary-demeaned logit (Llama: no unembedding bias)."""
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 48,
                                                                            threshold=0.1))))
    logit = attribute(model, tokenizer, clt, PROMPT, max_n_logits=1, target="demeaned_vocab",
                      batch_size=16)
    w_u = model.get_output_embeddings().weight.detach()
    vector = w_u[logit.target["token"]] - w_u.mean(0)
    direction = attribute(model, tokenizer, clt, PROMPT, target=vector, batch_size=16)
    a, b = logit.target_row(0), direction.target_row() * float(vector.norm())  # unit direction
    assert torch.allclose(a, b, atol=1e-5 * float(a.abs().max()))


@pytest.mark.numerics
def test_bos_errors_drop_moves_the_bos_errors_into_the_constants(setup, tokenizer):
    model, clt = setup
    # circuit-tracer's convention: position 0 is BOS (the tiny tokenizer adds none)
    kept = attribute(model, tokenizer, clt, PROMPT, max_n_logits=3, batch_size=16,
                     bos="always")
    dropped = attribute(model, tokenizer, clt, PROMPT, max_n_logits=3, batch_size=16,
                        bos_errors="drop", bos="always")
    assert "drop" in dropped.metadata["bos_errors"] and "kept" in kept.metadata["bos_errors"]
    lay = kept.layout
    bos = torch.arange(lay.errors.start, lay.errors.stop, kept.n_pos)  # error (layer, 0)
    a = kept.rows.dense(torch.arange(kept.rows.n_rows)).double()
    b = dropped.rows.dense(torch.arange(dropped.rows.n_rows)).double()
    assert torch.equal(kept.rows.nodes, dropped.rows.nodes)
    assert a[:, bos].abs().sum() > 0 and b[:, bos].abs().sum() == 0
    others = torch.ones(a.shape[1], dtype=torch.bool)
    others[bos] = False
    assert torch.allclose(a[:, others], b[:, others], atol=1e-6 * float(a.abs().max()))
    moved = dropped.rows.constants - kept.rows.constants
    assert torch.allclose(moved, a[:, bos].sum(1), atol=1e-5 * float(a.abs().sum(1).max()))
    assert float(dropped.row_closures().max()) < TOL  # rows still close
    assert dropped.influence()[bos].abs().sum() == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"max_n_logits": 0}, "max_n_logits"),
    ({"desired_logit_prob": 0.0}, "desired_logit_prob"),
    ({"desired_logit_prob": 1.5}, "desired_logit_prob"),
    ({"bos_errors": "zero"}, "bos_errors"),
    ({"target": torch.ones(5)}, "residual stream has"),
    ({"target": torch.ones(2, 2)}, "1-D"),
    ({"target": torch.zeros(64)}, "zero"),
    ({"target": torch.full((64,), float("nan"))}, "NaN"),
    ({"target": "logits"}, "target must be"),
])
def test_bad_target_settings_are_refused(setup, tokenizer, kwargs, message):
    model, clt = setup
    if "target" in kwargs and isinstance(kwargs["target"], torch.Tensor) \
            and kwargs["target"].shape == (64,):
        kwargs = {"target": kwargs["target"][:bind(model).d_model]}
    with pytest.raises(InputError, match=message):
        attribute(model, tokenizer, clt, PROMPT, **kwargs)


def test_a_direction_and_an_answer_together_are_refused(setup, tokenizer):
    model, clt = setup
    d_model = bind(model).d_model
    with pytest.raises(InputError, match="pass one of them"):
        attribute(model, tokenizer, clt, PROMPT, " the", target=torch.ones(d_model))
    with pytest.raises(InputError, match="resid_pre"):
        direction_target(torch.ones(d_model), output="mlp_out.1")
    with pytest.raises(InputError, match="position"):
        attribute(model, tokenizer, clt, PROMPT,
                  target=direction_target(torch.ones(d_model), position=99))


def test_spec_fields_for_logits_directions_and_bos_errors():
    spec = json.loads((ROOT / "intervention_specs" / "attribution_graph.json").read_text())
    spec.pop("$schema", None)
    spec["attribution"].update(max_n_logits=3, desired_logit_prob=0.5, bos_errors="drop")
    validate_spec(spec)
    direction = {**spec, "answer": None,
                 "attribution": {**spec["attribution"], "direction": {
                     "vector": [0.5, -1.0], "output": "resid_pre.3", "position": -1}}}
    direction.pop("answer")
    validate_spec(direction)
    for path, change in (("$.attribution.direction", {"answer": " Paris"}),
                         ("bos_errors", {"attribution": {**spec["attribution"],
                                                         "bos_errors": "zero"}}),
                         ("desired_logit_prob", {"attribution": {**spec["attribution"],
                                                                 "desired_logit_prob": 0}}),
                         ("output", {"attribution": {**direction["attribution"], "direction": {
                             "vector": [1.0], "output": "mlp_out.3"}}})):
        with pytest.raises(SpecError, match=re.escape(path)):
            validate_spec({**direction, **change})


def test_a_residual_state_whose_layer_is_a_digit_but_no_number_is_refused(setup):
    """``resid_pre.²``: ``str.isdigit`` said yes and ``int()`` raised a bare ValueError."""
    model, _ = setup
    with pytest.raises(InputError, match="unknown residual state"):
        state_module(bind(model), "resid_pre.\u00b2")
