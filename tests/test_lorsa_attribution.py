"""Attribution through Lorsa (issue 56 item 3): ``attribute(..., attention=lorsa)`` with a
cross-layer transcoder on a tiny Llama (and beside per-layer skip and TopK sets). The
replacement forward is the model; every row closes (the target's, a transcoder feature's, a
Lorsa head's); batched rows equal the one-backward-per-node loop; a head's row target is its
activation less ``b_V``; dropping the Lorsa error nodes breaks closure (the control); QK
tracing's sides close on the Lorsa's own score; the graph's nodes, save/load and JSON carry
the ``lorsa`` and ``lorsa error`` kinds and ``qk_tracing_results``."""

from __future__ import annotations

import warnings

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa
from transcoder_fixtures import random_set, write_circuit_tracer, write_sparsify

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.edges import (
    feature_rows,
    feature_rows_loop,
    feature_targets,
    row_closures,
    target_row,
)
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.faithfulness import faithfulness
from pyvene_causaltrace.attribution.lorsa_qk import lorsa_qk_tracing, trace_lorsa_qk
from pyvene_causaltrace.attribution.replacement import replacement_forward
from pyvene_causaltrace.attribution.targets import demeaned_logit
from pyvene_causaltrace.attribution.validate import ablation_test
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_from_disk, load_transcoder
from pyvene_causaltrace.transcoders.lorsa import load_lorsa

LAYERS = (0, 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("lorsa-attr")
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt = load_from_disk(str(write_clt(tmp / "clt", random_clt_tensors(3, 32, 48,
                                                                       threshold=0.1))))
    for layer in LAYERS:
        cfg = peer_config(layer=layer)
        write_peer_lorsa(tmp / "lorsa" / f"L{layer}", cfg, peer_tensors(cfg, seed=layer),
                         (2.5, 0.7))
    lorsa = load_lorsa(tmp / "lorsa")
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model, clt, lorsa, ids


@pytest.mark.numerics
def test_the_lorsa_replacement_is_the_model_and_every_row_closes(setup):
    model, clt, lorsa, ids = setup
    clean = model(input_ids=ids).logits
    run = replacement_forward(bind(model), clt, ids, lorsa=lorsa)
    n_tc = run.n_transcoder_features
    assert run.lorsa_layers == list(LAYERS) and run.n_features - n_tc > 20
    assert (run.logits.detach() - clean[:, -1:]).abs().max() < 1e-5
    target = demeaned_logit(clean, int(clean[0, -1].argmax()), 10)
    row, constant, closure = target_row(run, target)
    assert closure.relative < 1e-6, closure
    # the control: the Lorsa error nodes (after the MLP errors) carry what Lorsa misses;
    # without them the row does not close
    start = run.n_features + run.n_layers * run.n_pos
    dropped = row.clone()
    dropped[start:start + len(LAYERS) * run.n_pos] = 0
    assert float(row_closures(dropped[None], torch.tensor([constant]),
                              torch.tensor([closure.target]))[0]) > 1e-3
    # rows of transcoder features and Lorsa heads: batched == loop, each closes
    index = torch.cat([torch.arange(n_tc - 6, n_tc),
                       torch.arange(n_tc, run.n_features, 3)])
    loop_rows, loop_constants = feature_rows_loop(run, index)
    rows, constants = feature_rows(run, index)
    torch.testing.assert_close(rows, loop_rows, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(constants, loop_constants, atol=1e-5, rtol=0)
    values = feature_targets(run, index).detach()
    assert (rows.double().sum(1) + constants - values).abs().max() < 1e-5
    # a head's target is its activation less b_V (the pattern's rows sum to 1)
    heads = index[index >= n_tc]
    b_v = torch.stack([lorsa[int(run.feature_layer[i])].b_V[int(run.feature_id[i])]
                       for i in heads])
    torch.testing.assert_close(run.activation[heads] - values[-len(heads):], b_v,
                               atol=1e-5, rtol=1e-4)
    # a Lorsa head at layer 2 reads the layer-0 Lorsa heads (through the residual stream)
    layer0 = (run.feature_layer[n_tc:] == 0).nonzero().squeeze(-1) + n_tc
    late = heads[run.feature_layer[heads] == 2]
    assert rows[-len(heads):][run.feature_layer[heads] == 2][:, layer0].abs().sum() > 0
    assert len(late) > 0
    # QK tracing: each side's parts close on the score, which is the Lorsa's own
    for node in (n_tc, int(late[0]), run.n_features - 1):
        traced = lorsa_qk_tracing(run, lorsa, node, n_top=5)
        one, slot = lorsa[traced["layer"]], LAYERS.index(traced["layer"])
        q, k = one.queries_keys(run.lorsa_inputs[slot].detach())
        h, p, kp = traced["qk_head"], traced["position"], traced["key_position"]
        score = float(q[0, p, h] @ k[0, kp, h]) / one.cfg.attn_scale
        assert abs(traced["score"] - score) < 1e-5 * max(1.0, abs(score))
        assert abs(traced["q_total"] - score) < 1e-5 * max(1.0, abs(score))
        assert abs(traced["k_total"] - score) < 1e-5 * max(1.0, abs(score))
        assert kp == int(run.lorsa_heads[slot].pattern[h, p].argmax())
        assert 0 < len(traced["q_marginal"]) <= 5 and 0 < len(traced["pairs"]) <= 5
        # causal: nothing at a later position or layer feeds the query
        for column, _ in traced["q_marginal"] + traced["k_marginal"]:
            if 0 <= column < run.n_features:
                assert int(run.feature_position[column]) <= p
                assert int(run.feature_layer[column]) <= traced["layer"]


@pytest.mark.numerics
def test_attribute_with_attention_lorsa_builds_a_closed_graph_with_both_kinds(setup, tokenizer,
                                                                             tmp_path):
    model, clt, lorsa, _ = setup
    graph = attribute(model, tokenizer, clt, PROMPT, attention=lorsa, max_feature_nodes=60,
                      batch_size=16)
    n_heads = graph.n_features - graph.first_lorsa_node
    assert n_heads > 20 and graph.n_explored == 60
    assert float(graph.row_closures().max()) < 1e-4
    nodes = graph.nodes()
    kinds = nodes["kind"].value_counts()
    assert kinds["lorsa"] == n_heads
    assert kinds["lorsa error"] == len(LAYERS) * graph.n_pos
    assert set(nodes.loc[nodes["kind"] == "lorsa error", "layer"]) == set(LAYERS)
    explored = nodes[nodes["explored"] & nodes["kind"].isin(["feature", "lorsa"])]
    assert set(explored["kind"]) == {"feature", "lorsa"}  # the budget ranks both kinds
    for check in (ablation_test, faithfulness):  # they splice the transcoder alone: refused
        with pytest.raises(InputError, match="Lorsa"):
            check(model, clt, graph) if check is ablation_test else check(model, tokenizer,
                                                                            clt, graph)
    graph.save(tmp_path / "g.safetensors")
    again = AttributionGraph.load(tmp_path / "g.safetensors")
    assert again.nodes()["kind"].tolist() == nodes["kind"].tolist()
    traced = trace_lorsa_qk(model, clt, lorsa, graph, n_top=4)
    assert traced and graph.metadata["qk_tracing_results"] is traced
    payload = graph.to_json(node_threshold=0.9, edge_threshold=0.99)
    check_graph_json(payload)
    types = {n["feature_type"] for n in payload["nodes"]}
    assert {"lorsa", "cross layer transcoder"} <= types
    ids = [n["node_id"] for n in payload["nodes"]]
    assert len(ids) == len(set(ids))
    layers = {n["feature_type"]: set() for n in payload["nodes"]}
    for n in payload["nodes"]:
        layers[n["feature_type"]].add(n["layer"])
    assert all(int(x) % 2 == 0 for x in layers["lorsa"])  # OpenMOSS sublayers
    assert all(int(x) % 2 == 1 for x in layers["cross layer transcoder"])
    shown = set(ids)
    assert set(payload["qk_tracing_results"]) <= shown
    named = {n for r in payload["qk_tracing_results"].values()
             for n, _ in r["top_q_marginal_contributors"]}
    assert named - {"constants"} <= shown | set(payload["qk_only_nodes"])
    info = payload["metadata"]["info"]
    assert info["source_sets"]["lorsa"] == "lorsa" and info["lorsa"]["layers"] == list(LAYERS)


@pytest.mark.parametrize("layout", ["set_skip", "topk"])
@pytest.mark.numerics
def test_lorsa_beside_per_layer_skip_and_topk_transcoders_closes(setup, layout, tmp_path):
    """The same with a per-layer set with a skip path (circuit-tracer JumpReLU) and a sparsify
    TopK set with a skip path: the model's logits, the target row and mixed rows close."""
    model, _, lorsa, ids = setup
    if layout == "set_skip":
        tensors = random_set(3, 32, 48, skip=True, threshold=0.05, seed=1)
        path = write_circuit_tracer(tmp_path / "ct", tensors)
    else:
        tensors = random_set(3, 32, 48, activation="relu_topk", k=8, skip=True, seed=3)
        path = write_sparsify(tmp_path / "sp", tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transcoder = load_transcoder(path)
    clean = model(input_ids=ids).logits
    run = replacement_forward(bind(model), transcoder, ids, lorsa=lorsa)
    assert (run.logits.detach() - clean[:, -1:]).abs().max() < 1e-5
    _, _, closure = target_row(run, demeaned_logit(clean, int(clean[0, -1].argmax()), 10))
    assert closure.relative < 1e-6, closure
    n_tc = run.n_transcoder_features
    index = torch.cat([torch.arange(max(0, n_tc - 4), n_tc),
                       torch.arange(n_tc, run.n_features, 5)])
    rows, constants = feature_rows(run, index)
    values = feature_targets(run, index).detach()
    assert float(row_closures(rows, constants, values).max()) < 1e-5


@pytest.mark.numerics
def test_qk_tracing_through_a_post_qk_norm_closes_on_the_score(setup, tmp_path):
    """A Lorsa with a per-head RMS norm on q and k (frozen at its clean statistic) and NeoX
    rotary over half the head: each side's parts still close, on the Lorsa's own score."""
    model, clt, _, ids = setup
    cfg = peer_config(layer=1, use_post_qk_ln=True, normalization_type="RMS",
                      rotary_adjacent_pairs=False, rotary_dim=4)
    lorsa = load_lorsa(write_peer_lorsa(tmp_path / "qkln", cfg, peer_tensors(cfg, seed=5),
                                        (2.5, 0.7)))
    run = replacement_forward(bind(model), clt, ids, lorsa=lorsa)
    one = lorsa[1]
    q, k = one.queries_keys(run.lorsa_inputs[0].detach())
    for node in range(run.n_transcoder_features, run.n_features, 9):
        traced = lorsa_qk_tracing(run, lorsa, node, key_pos=0)
        h, p = traced["qk_head"], traced["position"]
        score = float(q[0, p, h] @ k[0, 0, h]) / one.cfg.attn_scale
        for value in (traced["score"], traced["q_total"], traced["k_total"]):
            assert abs(value - score) < 1e-5 * max(1.0, abs(score))


@pytest.mark.browser
def test_the_viewer_draws_lorsa_nodes(setup, tokenizer, tmp_path):
    """The viewer lists a graph with Lorsa nodes, draws every node (``lorsa`` as features,
    ``lorsa error`` as errors) and lists a Lorsa node's inputs when it is clicked."""
    import threading

    from test_viewer import _chromium

    from pyvene_causaltrace.viewer import make_server

    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    model, clt, lorsa, _ = setup
    graph = attribute(model, tokenizer, clt, PROMPT, attention=lorsa)
    (tmp_path / "g").mkdir()
    payload = graph.to_json(tmp_path / "g" / "graph.json", node_threshold=0.9)
    lorsa_ids = [n["node_id"] for n in payload["nodes"] if n["feature_type"] == "lorsa"]
    targets = {link["target"] for link in payload["links"]}
    clicked = next(i for i in lorsa_ids if i in targets)
    server = make_server(tmp_path, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector(".node")
            assert page.locator(".node").count() == len(payload["nodes"])
            page.locator(f'.node[data-id="{clicked}"]').click()
            assert page.locator("#inputs li").count() > 0
            browser.close()
    finally:
        server.shutdown()
    assert not errors, errors
