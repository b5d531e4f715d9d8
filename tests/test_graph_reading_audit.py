"""Adversarial probes of reading and exporting a graph (audit 6): comparing two graphs matches
logit nodes by their token, not only by the target's kind name (every salient logit is named
"demeaned logit (top-10)"), and Lorsa heads apart from transcoder features; a circuit-tracer
directory's slug must be a file name."""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.compare import graph_deviation
from pyvene_causaltrace.attribution.export import write_circuit_tracer_dir
from pyvene_causaltrace.attribution.store import RowStore
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.lorsa import load_lorsa


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    return model, load_from_disk(str(write_clt(tmp_path_factory.mktemp("clt") / "clt", tensors)))


def test_graphs_of_different_answers_are_not_compared(world, tokenizer):
    """Two graphs of one prompt explaining different answers have targets of one name: they
    were compared as if one target (deviation 0.40, no error); now refused."""
    model, clt = world
    the = attribute(model, tokenizer, clt, PROMPT, answer=" the")
    city = attribute(model, tokenizer, clt, PROMPT, answer=" city")
    assert the.targets[0]["name"] == city.targets[0]["name"]  # the name alone cannot tell
    assert graph_deviation(the, the)["edges"]["graph"] == 0
    with pytest.raises(InputError, match="same prompt and targets"):
        graph_deviation(the, city)


def test_salient_logits_in_another_order_are_matched_by_token(world, tokenizer):
    """A graph against the same graph with its logit nodes in another order (as a bfloat16
    model's salient logits can come): every logit row is matched to its own token's, so the
    deviation is 0 (it was the rows of other tokens, all matched to the first)."""
    model, clt = world
    graph = attribute(model, tokenizer, clt, PROMPT)
    assert graph.n_logits > 2
    mirrored = attribute(model, tokenizer, clt, PROMPT)
    lay, store = mirrored.layout, mirrored.rows
    flip = list(range(mirrored.n_logits))[::-1]  # logit node j: the target n_logits - 1 - j
    mirrored.targets = [mirrored.targets[j] for j in flip]
    nodes = store.nodes
    where = store.row_of_node(lay.n_nodes)
    inner = (nodes < lay.logits.start).nonzero().squeeze(-1)
    order = torch.cat([inner, where[lay.logits][flip]])  # the logit rows flipped
    mirrored.rows = RowStore(store.n_columns)
    mirrored.rows.append(torch.cat([nodes[inner], torch.arange(lay.n_nodes)[lay.logits]]),
                         store.dense(order),
                         store.constants[order], store.targets[order],
                         store.magnitudes[order])
    mirrored._memo.clear()
    assert graph.targets[0]["token"] != mirrored.targets[0]["token"]
    deviation = graph_deviation(mirrored, graph)
    assert deviation["edges"]["graph"] == 0 and deviation["edges"]["row_max"] == 0, deviation


@pytest.mark.parametrize("slug", ["../escaped", "sub/graph", "", "<absolute>"])
def test_a_slug_that_is_not_a_file_name_is_refused_for_circuit_tracers_dir(slug, tmp_path):
    """circuit-tracer serves DIR/<slug>.json: a slug with a separator wrote the graph outside
    DIR (``../escaped.json`` beside it, an absolute path) or where its server never looks, and
    an empty one a hidden ``.json``, silently."""
    slug = str(tmp_path / "abs") if slug == "<absolute>" else slug
    payload = {"metadata": {"slug": slug, "scan": "s", "prompt": "p", "prompt_tokens": ["p"],
                            "node_threshold": 0.8, "transcoder_list": []},
               "qParams": {}, "nodes": [], "links": []}
    with pytest.raises(InputError, match="slug"):
        write_circuit_tracer_dir(payload, tmp_path / "ct")
    assert sorted(p.name for p in tmp_path.rglob("*")) in ([], ["ct"])


def test_a_lorsa_head_and_a_feature_of_one_coordinate_stay_two_nodes(tmp_path, tokenizer):
    """A Lorsa head (layer, position, head h) and a transcoder feature (layer, position,
    feature h) had one key: the deviation of a Lorsa graph from itself merged them (its
    'features' union one short per such pair, their rows written over each other)."""
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 48,
                                                                            threshold=0.1))))
    for name, layers in (("02", (0, 2)), ("01", (0, 1))):
        for layer in layers:
            cfg = peer_config(layer=layer)
            write_peer_lorsa(tmp_path / name / f"L{layer}", cfg, peer_tensors(cfg, seed=layer),
                             (2.5, 0.7))
    graph = attribute(model, tokenizer, clt, PROMPT, attention=load_lorsa(tmp_path / "02"),
                      batch_size=16)
    first = graph.first_lorsa_node
    heads = {tuple(int(t[i]) for t in (graph.feature_layer, graph.feature_position,
                                        graph.feature_id)) for i in range(first, graph.n_features)}
    features = {tuple(int(t[i]) for t in (graph.feature_layer, graph.feature_position,
                                           graph.feature_id)) for i in range(first)}
    assert heads & features  # the coordinates coincide: only the kind tells them apart
    same = graph_deviation(graph, graph)
    assert same["features"]["only_in_graph"] == 0 == same["features"]["only_in_reference"]
    assert same["edges"]["graph"] == 0 and same["edges"]["with_unshared"] == 0
    # Lorsa at layers 0 and 1: as many error nodes, but layer 1's matched to layer 2's
    other = attribute(model, tokenizer, clt, PROMPT, attention=load_lorsa(tmp_path / "01"),
                      batch_size=16)
    assert other.layout.n_nodes - other.n_features == graph.layout.n_nodes - graph.n_features
    with pytest.raises(InputError, match="same prompt and targets"):
        graph_deviation(other, graph)
