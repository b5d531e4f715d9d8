"""Attribution graphs on tiny GPT-2, Llama, Qwen2 and Qwen3 with fixture CLTs written in the
real on-disk layout: the local replacement model, targets, closure, batched rows against the
per-node loop, reading (influence, pruning, scores), export, pictures, bad requests."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _support.graph_ids import node_ids
from _support.models import CORE_ARCHS, PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from dense_reading import compute_influence, graph_scores, normalize_matrix, prune, square

from pyvene_causaltrace.attribution import (
    AttributionGraph,
    MemoryCapError,
    attribute,
    demeaned_logit,
    logit_difference,
    remove_checkpoint,
    run_local_replacement,
)
from pyvene_causaltrace.attribution.budget import batch_size_for
from pyvene_causaltrace.attribution.edges import (
    feature_rows,
    feature_rows_loop,
    feature_targets,
    target_row,
)
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.reading import Layout
from pyvene_causaltrace.prompts import MultiTokenAnswerError
from pyvene_causaltrace.transcoders import TranscoderMismatchError, load_from_disk


def _setup(arch, tmp_path, threshold=0.1, n_layers=3):
    model = make_tiny_model(arch, init=0.2, n_layers=n_layers)
    tensors = random_clt_tensors(n_layers, 32, 48, threshold=threshold)
    clt = load_from_disk(str(write_clt(tmp_path / f"clt-{arch}", tensors)))
    return model, clt


@pytest.mark.parametrize("arch", CORE_ARCHS + ("mistral", "gemma3_text"))
@pytest.mark.numerics
def test_local_replacement_is_the_model_and_closes(arch, tmp_path, tokenizer):
    model, clt = _setup(arch, tmp_path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    clean = model(input_ids=ids).logits
    run = run_local_replacement(model, clt, ids)
    assert run.n_features > 50
    assert run.logits.shape[1] == 1  # the last position's: every logit target reads it
    assert (run.logits.detach() - clean[:, -1:]).abs().max() < 1e-4
    target = demeaned_logit(clean, int(clean[0, -1].argmax()), 10)
    _, _, closure = target_row(run, target)
    assert closure.relative < 1e-4, closure
    # without the freezes the edges are total derivatives and miss the target
    loose = run_local_replacement(model, clt, ids, freeze=False)
    _, _, unfrozen = target_row(loose, target)
    assert unfrozen.relative > 5e-4 and abs(unfrozen.residual) > 100 * abs(closure.residual)


@pytest.mark.parametrize("arch", CORE_ARCHS)
@pytest.mark.numerics
def test_batched_rows_equal_the_per_node_loop(arch, tmp_path, tokenizer):
    model, clt = _setup(arch, tmp_path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, clt, ids)
    index = torch.randperm(run.n_features, generator=torch.Generator().manual_seed(1))[:40]
    loop_rows, loop_constants = feature_rows_loop(run, index)
    for size in (1, 7, 40):
        parts = [feature_rows(run, index[i:i + size]) for i in range(0, len(index), size)]
        rows = torch.cat([p[0] for p in parts])
        constants = torch.cat([p[1] for p in parts])
        assert torch.allclose(rows, loop_rows, atol=1e-5, rtol=1e-5)
        assert torch.allclose(constants, loop_constants, atol=1e-5)
    # each feature row closes on the feature's pre-activation
    values = feature_targets(run, index).detach()
    assert (loop_rows.double().sum(1) + loop_constants - values).abs().max() < 1e-4


@pytest.mark.numerics
def test_float64_closure_is_exact_and_batches_equal_the_loop(tmp_path, tokenizer):
    """In float64 batched rows equal the loop to rounding. (Closure stays ~1e-8: transformers'
    RMSNorm computes in float32 even for float64 inputs, so the forward value is float32-exact
    while the frozen-norm gradient is float64.)"""
    model = make_tiny_model("qwen2", init=0.2).double()
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    clt = load_from_disk(str(write_clt(tmp_path / "clt64", tensors)), dtype=torch.float64)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, clt, ids)
    target = demeaned_logit(run.logits.detach(), 5, 10)
    _, _, closure = target_row(run, target)
    assert closure.relative < 1e-6
    index = torch.arange(run.n_features)
    rows, constants = feature_rows(run, index)
    assert rows.dtype == torch.float64
    loop_rows, _ = feature_rows_loop(run, index)
    assert (rows - loop_rows).abs().max() < 1e-12
    values = feature_targets(run, index).detach()
    assert (rows.sum(1) + constants - values).abs().max() < 1e-6 * values.abs().max()


@pytest.mark.numerics
def test_targets_are_the_seed_conventions():
    logits = torch.randn(1, 4, 50, generator=torch.Generator().manual_seed(0))
    last = logits[0, -1]
    target = demeaned_logit(logits, 7, k=10)
    expected = last[7] - last[last.topk(10).indices].mean()
    assert torch.allclose(target(logits), expected, atol=1e-6)
    vocab = demeaned_logit(logits, 7, None)
    assert torch.allclose(vocab(logits), last[7] - last.mean(), atol=1e-6)
    diff = logit_difference(50, 7, 3)
    assert torch.allclose(diff(logits), last[7] - last[3])
    with pytest.raises(ValueError, match="two different"):
        logit_difference(50, 3, 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        demeaned_logit(logits, 99, 10)


@pytest.mark.numerics
def test_logit_difference_graph_closes(tmp_path, tokenizer):
    model, clt = _setup("llama", tmp_path)
    graph = attribute(model, tokenizer, clt, PROMPT, " the", target="difference",
                      other=" city")
    assert graph.target["name"].startswith("logit difference")
    assert graph.closure.relative < 1e-4
    assert graph.feature_closure() < 1e-4


@pytest.fixture(scope="module", params=("gpt2", "llama", "qwen3"))
def graph(request, tmp_path_factory, tokenizer):
    model, clt = _setup(request.param, tmp_path_factory.mktemp("g"))
    graph = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    graph.metadata["arch"] = request.param
    return graph


@pytest.mark.numerics
def test_attribute_builds_the_full_adjacency(graph, tokenizer, tmp_path):
    assert graph.rows.n_rows == graph.n_features + graph.n_logits and graph.explored.all()
    assert graph.n_logits > 1  # no answer: the salient logits
    assert graph.closure.relative < 1e-4 and graph.feature_closure() < 1e-4
    # a feature only reads earlier layers: no edge from a same-or-later-layer feature
    full = square(graph)
    layers = graph.feature_layer
    same_or_later = layers[None, :] >= layers[:, None]
    assert full[:graph.n_features, :graph.n_features][same_or_later].abs().max() == 0
    # the store keeps exactly the nonzero entries
    assert graph.rows.nnz == int((full != 0).sum())
    # memory-capped batching and the loop give the same matrix
    model, clt = _setup(graph.metadata["arch"], tmp_path)
    looped = attribute(model, tokenizer, clt, PROMPT, loop=True)
    assert torch.allclose(full, square(looped), atol=1e-5, rtol=1e-5)
    parts = graph.decomposition()
    total = parts["features"] + parts["errors"] + parts["tokens"] + parts["constants"]
    assert abs(total - parts["target"]) < 1e-4 * abs(parts["target"])


def test_memory_cap_sets_the_batch_and_refuses_a_prompt_that_cannot_fit(tmp_path, tokenizer):
    model, clt = _setup("llama", tmp_path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, clt, ids)
    small, large = (batch_size_for(run, mb, max_batch=4096) for mb in (5, 50))
    assert 1 <= small < large
    assert batch_size_for(run, 500) == 32  # the CPU default's ceiling
    with pytest.raises(MemoryCapError, match="memory cap"):
        attribute(model, tokenizer, clt, PROMPT * 4, memory_mb=0.5)


def test_a_graph_runs_two_forwards_and_counts_active_features_in_the_clean_one(tmp_path,
                                                                              tokenizer):
    """The clean forward also counts the active features for the memory check (no third
    forward); the counts are those a separate count gives."""
    from pyvene_causaltrace.attribution.budget import active_counts
    from pyvene_causaltrace.attribution.replacement_model import ReplacementModel
    from pyvene_causaltrace.prompts import first_position as prepared_from

    model, clt = _setup("llama", tmp_path)
    calls = []
    handle = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        attribute(model, tokenizer, clt, PROMPT, " the")
        assert len(calls) == 2  # the clean forward, the local replacement forward
    finally:
        handle.remove()
    prepared = ReplacementModel(model, tokenizer, clt).prepare(PROMPT, " the")
    assert torch.equal(prepared.active_counts, active_counts(
        model, clt, prepared.input_ids, from_position=prepared_from(tokenizer, "auto")))
    assert int(prepared.active_counts.sum()) > 0


@pytest.mark.numerics
def test_dense_reference_follows_circuit_tracer():
    # features 0, 1; errors 2; tokens 3, 4; logit 5 -- a DAG
    lay = Layout(n_features=2, n_errors=1, n_tokens=2)
    adj = torch.zeros(6, 6)
    adj[0, 3], adj[0, 4] = 2.0, -1.0
    adj[1, 0], adj[1, 2] = 1.0, 1.0
    adj[5, 1], adj[5, 0], adj[5, 4] = 3.0, -1.0, 0.001
    norm = normalize_matrix(adj)
    weights = torch.zeros(6)
    weights[5] = 1
    series = compute_influence(norm, weights)
    closed = weights @ (torch.linalg.inv(torch.eye(6) - norm) - torch.eye(6))
    assert torch.allclose(series, closed, atol=1e-6)
    result = prune(adj, lay, node_threshold=0.8, edge_threshold=0.98)
    assert result.node_mask[3:].all()  # tokens and the logit always stay
    assert not result.edge_mask[5, 4]  # a negligible edge goes
    everything = prune(adj, lay, node_threshold=1.0, edge_threshold=1.0)
    assert torch.equal(everything.edge_mask, adj != 0)
    scores = graph_scores(adj, lay)
    assert 0 < scores["replacement"] < 1 and 0 < scores["completeness"] < 1
    no_errors = adj.clone()
    no_errors[:, 2] = 0
    assert graph_scores(no_errors, lay) == {"replacement": 1.0, "completeness": 1.0}


def test_reading_tables_export_and_round_trip(graph, tmp_path):
    top = graph.direct_attributions(5)
    assert list(top.columns) == ["node", "label", "edge"]
    assert top["edge"].abs().is_monotonic_decreasing
    nodes = graph.nodes()
    assert len(nodes) == graph.layout.n_nodes
    assert set(nodes["kind"]) == {"feature", "error", "token", "logit"}
    edges = graph.to_dataframe(pruned=True)
    assert 0 < len(edges) < len(graph.to_dataframe()) == graph.rows.nnz
    payload = graph.to_json(tmp_path / "graph.json", slug="tiny")
    check_graph_json(payload)
    assert set(payload) == {"metadata", "qParams", "nodes", "links"}
    assert json.loads((tmp_path / "graph.json").read_text()) == payload
    ids = {n["node_id"] for n in payload["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in payload["links"])
    # the field order and id formats of circuit-tracer's own fixture graphs
    assert list(payload["nodes"][0]) == [
        "node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob",
        "is_target_logit", "run_idx", "reverse_ctx_idx", "jsNodeId", "clerp", "influence",
        "activation"]
    for node in payload["nodes"]:
        kind, node_id = node["feature_type"], node["node_id"]
        pattern = {"cross layer transcoder": r"\d+_\d+_\d+", "mlp reconstruction error":
                   r"\d+_-1_\d+", "embedding": r"E_\d+_\d+", "logit": r"\d+_\d+_\d+"}[kind]
        assert re.fullmatch(pattern, node_id), node_id
    kinds = {n["feature_type"] for n in payload["nodes"]}
    assert {"cross layer transcoder", "embedding", "logit"} <= kinds
    assert len(set(node_ids(graph))) == graph.layout.n_nodes  # ids never collide
    logit = [n for n in payload["nodes"] if n["feature_type"] == "logit"][0]
    assert logit["node_id"] == f"{graph.n_layers + 1}_{graph.target['token']}_{graph.n_pos - 1}"
    graph.save(tmp_path / "graph.safetensors")
    back = AttributionGraph.load(tmp_path / "graph.safetensors")
    assert torch.equal(square(back), square(graph)) and back.closure == graph.closure
    for name, tensor in graph.rows.state().items():
        assert torch.equal(back.rows.state()[name], tensor), name
    assert back.target == graph.target and back.tokens == graph.tokens
    assert torch.equal(back.influence(), graph.influence())
    graph.plot(tmp_path / "graph.png")
    assert (tmp_path / "graph.png").stat().st_size > 10_000


def test_bad_requests_get_clear_errors(tmp_path, tokenizer):
    model, clt = _setup("llama", tmp_path)
    with pytest.raises(MultiTokenAnswerError, match="single-token"):
        attribute(model, tokenizer, clt, PROMPT, " Paris is lovely")
    other_model = make_tiny_model("llama", n_layers=4)
    with pytest.raises(TranscoderMismatchError, match="model has 4 layers"):
        attribute(other_model, tokenizer, clt, PROMPT)
    with pytest.raises(ValueError, match="prompt='' .*not blank"):
        attribute(model, tokenizer, clt, "")


def test_an_interrupted_graph_resumes_from_its_checkpoint(tmp_path, tokenizer, monkeypatch):
    import copy
    import importlib

    from pyvene_causaltrace.attribution.checkpoint import CheckpointMismatchError

    attribute_module = importlib.import_module("pyvene_causaltrace.attribution.attribute")

    model, clt = _setup("llama", tmp_path)
    whole = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    monkeypatch.setattr(attribute_module, "SAVE_EVERY_S", 0.0)
    real, calls, interrupt = attribute_module.feature_rows, [], [True]

    def failing(run, index):
        calls.append(len(index))
        if len(calls) == 4 and interrupt:
            interrupt.clear()
            raise RuntimeError("interrupted")
        return real(run, index)

    monkeypatch.setattr(attribute_module, "feature_rows", failing)
    checkpoint = tmp_path / "rows.partial"
    with pytest.raises(RuntimeError, match="interrupted"):
        attribute(model, tokenizer, clt, PROMPT, batch_size=16, checkpoint=checkpoint)
    saved = json.loads((checkpoint / "manifest.json").read_text())
    from safetensors.torch import load_file

    nodes = [load_file(str(checkpoint / name))["rows.nodes"] for name in saved["shards"]]
    assert sum(len(n) for n in nodes) == whole.n_logits + 48  # logit rows, 3 batches of 16
    assert not list(checkpoint.glob("*.pt"))  # safetensors and JSON only
    # rows of this graph are not rows of another model's: refused, naming what differs
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.1)
    with pytest.raises(CheckpointMismatchError, match=r"holds rows of another graph \(model"):
        attribute(other, tokenizer, clt, PROMPT, batch_size=16, checkpoint=checkpoint)
    calls.clear()
    resumed = attribute(model, tokenizer, clt, PROMPT, batch_size=16, checkpoint=checkpoint)
    assert sum(calls) == whole.n_features - 48  # only the missing rows were computed
    assert torch.equal(square(resumed), square(whole))
    assert checkpoint.exists()  # kept until the caller has saved the graph
    remove_checkpoint(checkpoint)
    assert not checkpoint.exists()


@pytest.mark.numerics
def test_ablation_test_runs_in_the_spliced_model_with_the_clean_error(tmp_path, tokenizer):
    from pyvene_causaltrace.attribution.validate import ablation_test, answer_prob
    from pyvene_causaltrace.bound import bind
    from pyvene_causaltrace.interventions.clt_splice import clean_errors

    model, clt = _setup("qwen3", tmp_path)
    graph = attribute(model, tokenizer, clt, PROMPT)
    result = ablation_test(model, clt, graph, sizes=(3, 1000), draws=2)
    assert abs(result.spliced_prob - result.clean_prob) < 1e-5
    everything = graph.n_features
    assert set(result.top) == {3, everything}  # sizes are capped at the active features
    # ablating every active feature leaves b_dec + the clean error: one number, any order
    assert result.random[everything][0] == pytest.approx(result.top[everything], abs=1e-6)
    ids = torch.tensor([graph.input_ids])
    one = answer_prob(bind(model), clt, ids, clean_errors(model, clt, ids),
                      graph.target["token"], [0], graph)
    assert one != pytest.approx(result.spliced_prob, abs=1e-9)
    assert list(result.to_dataframe().columns)[:3] == ["n_ablated", "top_prob", "random_mean"]
