"""Attribution at the scale of published transcoders, on tiny GPT-2, Llama and Qwen3 with
fixture CLTs dense enough that a feature-node budget binds (>= 20k active features, budget
500): budgeted rows are the full graph's rows, every row closes, the sparse reading equals the
dense reference, thresholds without a sort equal the sorted ones, graph files are never
pickles, and every export carries Neuronpedia's required fields."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from dense_reading import edge_mask, node_influence, square
from dense_reading import graph_scores as dense_scores
from dense_reading import prune as dense_prune
from dense_reading import threshold_for as sorted_threshold

from pyvene_causaltrace.attribution import AttributionGraph, GraphFileError, attribute
from pyvene_causaltrace.attribution.edges import feature_rows_loop
from pyvene_causaltrace.attribution.export import check_graph_json, node_id
from pyvene_causaltrace.attribution.reading import threshold_for
from pyvene_causaltrace.attribution.replacement import run_local_replacement
from pyvene_causaltrace.transcoders import load_from_disk

LONG_PROMPT = PROMPT + " Paris, and the Space Needle is in the city of"
BUDGET = 500


def _dense_setup(arch, path):
    """4 layers, 512 features per layer with low thresholds: ~24k active features on the
    20-token prompt."""
    model = make_tiny_model(arch, init=0.2, n_layers=4)
    tensors = random_clt_tensors(4, 32, 512, threshold=-0.5)
    return model, load_from_disk(str(write_clt(path / f"dense-{arch}", tensors)))


@pytest.fixture(scope="module", params=("gpt2", "llama", "qwen3"))
def budgeted(request, tmp_path_factory, tokenizer):
    model, clt = _dense_setup(request.param, tmp_path_factory.mktemp("dense"))
    graph = attribute(model, tokenizer, clt, LONG_PROMPT, max_feature_nodes=BUDGET, loop=True)
    return model, clt, graph


@pytest.mark.numerics
def test_budgeted_rows_are_the_full_graphs_rows_and_close(budgeted, tokenizer):
    model, clt, graph = budgeted
    assert graph.n_features >= 20_000 and graph.n_explored == BUDGET
    assert graph.rows.n_rows == BUDGET + graph.n_logits  # and the logits'
    # the same rows of the unbudgeted graph: each computed on its own, exactly equal
    ids = tokenizer(LONG_PROMPT, return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, clt, ids, from_position=graph.from_position)
    assert run.n_features == graph.n_features
    explored = graph.explored.nonzero().squeeze(-1)
    reference, constants = feature_rows_loop(run, explored)
    order = graph.rows.row_of_node(graph.layout.n_nodes)[explored]
    assert torch.equal(graph.rows.dense(order), reference)
    assert torch.equal(graph.rows.constants[order], constants.double())
    # every computed row closes on its target, unexplored features included: the residual
    # against the scale of what the row sums (targets can be near zero: here down to 8e-4;
    # measured max 2.6e-7 of the scale, up to 1.5e-4 of the target)
    relative = graph.row_closures()
    assert relative.max() < 1e-5, relative.max()
    assert graph.feature_closure() == float(relative[graph.rows.nodes < graph.n_features].max())
    parts = graph.decomposition()
    total = sum(parts[k] for k in ("features", "unexplored", "errors", "steering", "tokens",
                                   "constants"))
    assert abs(total - parts["target"]) < 1e-5 * graph.closure.scale
    assert parts["unexplored"] != 0.0
    # the first queue is the features of largest partial influence through the logit rows
    # alone: each logit row's |edges| normalised to sum to 1, weighted by its probability
    rows = torch.stack([graph.target_row(j).abs().double() for j in range(graph.n_logits)])
    first = (graph.logit_weights()[:, None] * rows / rows.sum(1, keepdim=True)).sum(0)
    assert graph.explored[first[:graph.n_features].argsort(descending=True)[:100]].all()


def test_ranking_beats_a_random_choice_of_rows(budgeted):
    _, _, graph = budgeted
    influence = graph.influence()[:graph.n_features]
    explored = graph.explored
    # rows chosen by partial influence hold far more of the total influence than their count
    share = float(influence[explored].sum() / influence.sum())
    assert share > 5 * explored.float().mean()


@pytest.mark.numerics
def test_sparse_reading_equals_the_dense_reference(tmp_path, tokenizer):
    model = make_tiny_model("llama", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path / "c", random_clt_tensors(3, 32, 48, 0, 0.1))))
    full = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    part = attribute(model, tokenizer, clt, PROMPT, max_feature_nodes=60, batch_size=16)
    for graph in (full, part):
        dense, lay, weights = square(graph).double(), graph.layout, graph.logit_weights()
        assert graph.n_logits > 1  # several logit nodes, each weighted by its probability
        assert torch.allclose(graph.influence(), node_influence(dense, lay, weights), atol=1e-6)
        for thresholds in ((0.8, 0.98), (0.5, 0.9), (1.0, 1.0)):
            sparse = graph.prune(*thresholds)
            reference = dense_prune(dense, lay, *thresholds, probabilities=weights)
            assert torch.equal(sparse.node_mask, reference.node_mask), thresholds
            assert torch.equal(edge_mask(sparse), reference.edge_mask), thresholds
            assert torch.allclose(sparse.cumulative_scores, reference.cumulative_scores,
                                  atol=1e-6)
            kept = dense[sparse.edge_target, sparse.edge_source]
            assert torch.equal(sparse.edge_weight.double(), kept)
        scores, expected = graph.scores(), dense_scores(dense, lay, weights)
        for name in ("replacement", "completeness"):
            assert scores[name] == pytest.approx(expected[name], abs=1e-6)
    assert part.scores()["unexplored_influence"] > 0 == full.scores()["unexplored_influence"]
    assert graph.prune() is graph.prune()  # memoised
    # the budgeted graph's rows are the unbudgeted graph's rows, exactly (one backward each)
    full, part = (attribute(model, tokenizer, clt, PROMPT, max_feature_nodes=budget, loop=True)
                  for budget in (None, 60))
    nodes = part.explored.nonzero().squeeze(-1)
    assert len(nodes) == 60 and full.n_explored == full.n_features
    assert torch.equal(square(part)[nodes], square(full)[nodes])


@pytest.mark.parametrize("seed", range(4))
def test_threshold_without_a_sort_equals_the_sorted_threshold(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(20_000, generator=g) ** 6  # heavy-tailed
    scores[torch.rand(20_000, generator=g) < 0.3] = 0.0
    scores[:500] = scores[500]  # ties
    pieces = list(scores.split(3_001))
    for fraction in (0.0, 0.1, 0.5, 0.8, 0.98, 0.999, 1.0):
        expected = float(sorted_threshold(scores, fraction))
        assert threshold_for(scores, fraction) == expected
        assert threshold_for(lambda: iter(pieces), fraction) == expected
    assert threshold_for(torch.zeros(10), 0.5) == float("inf")
    with pytest.raises(ValueError, match="fraction"):
        threshold_for(scores, 1.5)


def test_a_budgeted_run_resumes_exactly(tmp_path, tokenizer, monkeypatch):
    import importlib

    module = importlib.import_module("pyvene_causaltrace.attribution.attribute")
    model = make_tiny_model("qwen3", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path / "c", random_clt_tensors(3, 32, 48, 0, 0.1))))
    kwargs = dict(max_feature_nodes=150, batch_size=16, update_interval=2)
    whole = attribute(model, tokenizer, clt, PROMPT, **kwargs)
    monkeypatch.setattr(module, "SAVE_EVERY_S", 0.0)
    real, calls = module.feature_rows, []

    def failing(run, index):
        calls.append(len(index))
        if len(calls) == 6:
            raise RuntimeError("interrupted")
        return real(run, index)

    monkeypatch.setattr(module, "feature_rows", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        attribute(model, tokenizer, clt, PROMPT, checkpoint=tmp_path / "ck", **kwargs)
    monkeypatch.setattr(module, "feature_rows", real)
    resumed = attribute(model, tokenizer, clt, PROMPT, checkpoint=tmp_path / "ck", **kwargs)
    assert torch.equal(resumed.explored, whole.explored)
    assert torch.equal(square(resumed), square(whole))


def test_default_budget_is_what_fits_the_memory_cap(tmp_path, tokenizer, caplog):
    model, clt = _dense_setup("llama", tmp_path)
    with caplog.at_level(logging.WARNING, logger="pyvene_causaltrace.attribution"):
        graph = attribute(model, tokenizer, clt, LONG_PROMPT, memory_mb=48)
    assert 0 < graph.n_explored < graph.n_features
    line = [r.getMessage() for r in caplog.records if "feature rows fit" in r.getMessage()]
    assert len(line) == 1 and str(graph.n_explored) in line[0]
    assert graph.rows.nbytes < 48 * 2**20


def test_graph_files_are_never_pickles(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    crafted = tmp_path / "graph.safetensors"
    crafted.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(GraphFileError, match="never loaded"):
        AttributionGraph.load(crafted)
    torch.save({"adjacency": torch.zeros(2)}, tmp_path / "old.pt")
    with pytest.raises(GraphFileError):
        AttributionGraph.load(tmp_path / "old.pt")
    assert not marker.exists()  # nothing ran
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(GraphFileError, match="not an attribution graph"):
        AttributionGraph.load(tmp_path / "other.safetensors")
    package = Path(__file__).resolve().parents[1] / "pyvene_causaltrace"
    for source in package.rglob("*.py"):
        text = source.read_text()
        assert not re.search(r"weights_only\s*=\s*False|pickle\.load", text), source


def test_exports_carry_neuronpedia_required_fields(budgeted, tmp_path):
    _, _, graph = budgeted
    payload = graph.to_json(tmp_path / "g.json", slug="dense")
    check_graph_json(payload)
    assert json.loads((tmp_path / "g.json").read_text()) == payload
    assert payload["metadata"]["info"]["feature_nodes"] == {"active": graph.n_features,
                                                            "explored": BUDGET}
    explored_ids = {f"{graph.feature_layer[i]}_{graph.feature_id[i]}_{graph.feature_position[i]}"
                    for i in graph.explored.nonzero().squeeze(-1).tolist()}
    features = [n for n in payload["nodes"] if n["feature_type"] == "cross layer transcoder"]
    assert features and all(n["node_id"] in explored_ids for n in features)
    # a link cap keeps the links of largest edge score, and says so
    pruned = graph.prune()
    capped = graph.to_json(max_links=10)
    check_graph_json(capped)
    assert len(capped["links"]) == 10 < pruned.n_edges
    assert capped["metadata"]["pruning_settings"]["max_links"] == 10
    top = pruned.edge_score.topk(10).indices
    expected = {(node_id(graph, int(pruned.edge_source[i])),
                 node_id(graph, int(pruned.edge_target[i]))) for i in top}
    assert {(link["source"], link["target"]) for link in capped["links"]} == expected
    broken = json.loads(json.dumps(payload))
    del broken["nodes"][0]["jsNodeId"]
    with pytest.raises(jsonschema.ValidationError):
        check_graph_json(broken)
    broken = json.loads(json.dumps(payload))
    broken["links"].append({"source": "nowhere", "target": broken["nodes"][0]["node_id"],
                            "weight": 1.0})
    with pytest.raises(ValueError, match="missing node"):
        check_graph_json(broken)


@pytest.mark.numerics
def test_row_store_chunks_round_trip_and_checks():
    from pyvene_causaltrace.attribution.store import RowStore

    g = torch.Generator().manual_seed(0)
    dense = torch.randn(9, 13, generator=g) * (torch.rand(9, 13, generator=g) < 0.4)
    dense[4] = 0  # a row with no entries
    store = RowStore(13)
    store.append(torch.arange(5), dense[:5], torch.zeros(5), torch.zeros(5))
    store.append(torch.arange(5, 9), dense[5:], torch.zeros(4), dense[5:].sum(1))
    assert store.nnz == int((dense != 0).sum()) and store.n_rows == 9
    for size in (1, 3, 7, 1000):  # chunks are row-aligned and cover every entry once
        rebuilt = torch.zeros_like(dense)
        seen = 0
        for rows, cols, values in store.chunks(max_entries=size):
            rebuilt[rows, cols] = values
            seen += len(values)
            assert len(values) <= max(size, int((dense != 0).sum(1).max()))
        assert torch.equal(rebuilt, dense) and seen == store.nnz
    assert torch.equal(store.dense(torch.arange(9)), dense)
    assert torch.allclose(store.abs_sums(), dense.abs().sum(1).double())
    back = RowStore.from_state(13, store.state())
    assert torch.equal(back.dense(torch.arange(9)), dense)
    state = store.state()
    state["rows.counts"][0] += 1
    with pytest.raises(ValueError, match="counts"):
        RowStore.from_state(13, state)
    with pytest.raises(ValueError, match="outside"):
        RowStore.from_state(5, store.state())
    with pytest.raises(ValueError, match="rows must be"):
        store.append(torch.tensor([0]), torch.zeros(1, 12), torch.zeros(1), torch.zeros(1))
