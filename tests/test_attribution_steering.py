"""Steering nodes and the closure refusal.

A user's pyvene ``IntervenableModel`` holding affine edits ``f(x) = A x + c`` (addition,
subtraction, a constant source, ``noise_add``, restores with states) is attributed with each
constant ``c`` as its own node, one per position where it is nonzero: the graph closes, the
nodes carry exactly ``sum(c * grad)`` (computed here by hand through leaves of our own), the
forward is the bare model's with the same edit made by a hand hook. That hand hook on a bare
model is something the graph cannot see: ``attribute`` refuses it (``ClosureError``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import (
    CLOSURE_TOLERANCE,
    AttributionGraph,
    Closure,
    ClosureError,
    make_target,
    run_local_replacement,
)
from pyvene_causaltrace.attribution import (
    attribute as attribute_all_logits,
)
from pyvene_causaltrace.attribution.edges import row_closures
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.interventions.restore import CleanRestore
from pyvene_causaltrace.pyvene_boundary.intervenable import preserve_hooks
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.transcoders import load_transcoder

pv = import_pyvene()
D = 32
#: One logit node (the clean argmax): these tests compare one target's row with numbers computed
#: by hand.
attribute = partial(attribute_all_logits, max_n_logits=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    model = make_tiny_model("llama", init=0.2)
    path = write_clt(tmp_path_factory.mktemp("clt") / "clt",
                     random_clt_tensors(3, D, 48, threshold=0.1))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model, load_transcoder(str(path)), ids


def _vectors(seed: int, n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(D, generator=g) * 0.5 for _ in range(n)]


def _pv_model(model, reps):
    return pv.IntervenableModel(reps, model)


def _add(output, delta):
    """``output + delta`` on a hook's output or input (a tuple's first element)."""
    if isinstance(output, tuple):
        return (output[0] + delta, *output[1:])
    return output + delta


@contextmanager
def hand_edits(model, outputs=(), inputs=()):
    """The same edits as plain forward hooks on the bare model: ``outputs`` are ``(layer,
    delta)`` added to a block's output, ``inputs`` to a block's input; a ``delta`` may be a
    leaf of the caller's (then the edit's gradient lands on it)."""
    handles = []
    try:
        for layer, delta in outputs:
            handles.append(model.model.layers[layer].register_forward_hook(
                lambda _m, _a, out, delta=delta: _add(out, delta)))
        for layer, delta in inputs:
            def pre(_m, args, kwargs, delta=delta):
                if args:
                    return (args[0] + delta, *args[1:]), kwargs
                first = next(iter(kwargs))
                return args, {**kwargs, first: kwargs[first] + delta}
            handles.append(model.model.layers[layer].register_forward_pre_hook(
                pre, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _steering_part(graph: AttributionGraph) -> torch.Tensor:
    return graph.target_row()[graph.layout.steering]


def _without_steering(graph: AttributionGraph) -> torch.Tensor:
    row, lay = graph.target_row(), graph.layout
    return torch.cat([row[:lay.steering.start], row[lay.tokens.start:]])


# ---------------------------------------------------------------------------- (a) addition


@pytest.fixture(scope="module")
def steered(setup, tokenizer):
    model, clt, ids = setup
    out_delta, in_delta = _vectors(5)
    pv_model = _pv_model(model, [
        {"layer": 1, "component": "block_output",
         "intervention": pv.AdditionIntervention(source_representation=out_delta)},
        {"layer": 2, "component": "block_input",
         "intervention": pv.AdditionIntervention(source_representation=in_delta)}])
    graph = attribute(pv_model, tokenizer, clt, PROMPT)
    return pv_model, graph, out_delta, in_delta


@pytest.mark.numerics
def test_additions_are_steering_nodes_and_the_graph_closes(setup, steered):
    model, _, ids = setup
    _, graph, _, _ = steered
    n_pos = ids.shape[1]
    assert graph.n_steering == 2 * n_pos  # the constant is nonzero at every position
    assert graph.closure.relative < 1e-6, graph.closure  # measured 4.6e-8
    assert graph.feature_closure() < 1e-5  # measured ~1e-6
    parts = graph.decomposition()
    assert abs(parts["steering"]) > 0.1 * graph.closure.scale / graph.n_pos  # it matters
    total = sum(parts[k] for k in ("features", "unexplored", "errors", "steering", "tokens",
                                   "constants"))
    assert abs(total - parts["target"]) < 1e-6 * graph.closure.scale
    # which intervention each node belongs to, in the forward's call order
    sites = [(s["component"], s["layer"], s["class"]) for s in graph.steering]
    assert sites == [("block_output", 1, "AdditionIntervention"),
                     ("block_input", 2, "AdditionIntervention")]
    assert {tuple(s["positions"]) for s in graph.steering} == {tuple(range(n_pos))}
    kinds = graph.nodes().set_index("node")["kind"]
    assert (kinds[graph.layout.steering.start:graph.layout.tokens.start] == "steering").all()
    assert graph.label(graph.layout.steering.start) == \
        f"STEER AdditionIntervention block_output L1 @0 {graph.tokens[0]!r}"
    # metadata: both interventions, their node counts and contributions
    meta = graph.metadata["steering"]
    assert [m["nodes"] for m in meta] == [n_pos, n_pos]
    assert sum(m["contribution"] for m in meta) == pytest.approx(parts["steering"], abs=1e-9)


@pytest.mark.numerics
def test_steering_nodes_carry_the_hand_computed_contribution(setup, steered, tokenizer):
    """Per position, ``sum(delta * d target / d delta)`` from leaves of our own in hand hooks
    on the bare model equals the steering nodes' edges; the target and the logits are the bare
    model's with the same edit."""
    model, clt, ids = setup
    pv_model, graph, out_delta, in_delta = steered
    n_pos = ids.shape[1]
    leaves = [delta.expand(1, n_pos, D).clone().requires_grad_(True)
              for delta in (out_delta, in_delta)]
    with hand_edits(model, outputs=[(1, leaves[0])], inputs=[(2, leaves[1])]):
        run = run_local_replacement(model, clt, ids)
        with torch.no_grad():
            hand_logits = model(input_ids=ids).logits
    goal = make_target(hand_logits, tokenizer, None, kind="demeaned", k=10)
    value = goal(run.logits)
    grads = torch.autograd.grad(value, leaves)
    by_hand = torch.cat([(leaf.detach() * grad).sum(-1)[0]
                         for leaf, grad in zip(leaves, grads, strict=True)])
    torch.testing.assert_close(_steering_part(graph), by_hand, rtol=0, atol=1e-6)
    assert abs(float(value) - graph.closure.target) < 1e-6
    with preserve_hooks(pv_model), torch.no_grad():
        pv_logits = pv_model(base={"input_ids": ids})[1].logits
    assert (pv_logits - hand_logits).abs().max() <= 1e-6


@pytest.mark.numerics
def test_without_steering_nodes_the_same_edit_misses_exactly_their_share(setup, steered,
                                                                          tokenizer):
    """The bare model with the edits as hand hooks: the graph cannot see them, so it is
    refused; forced out (check_closure=False) it misses exactly what the steering nodes carry,
    and every other edge is the same."""
    model, clt, _ = setup
    _, graph, out_delta, in_delta = steered
    with hand_edits(model, outputs=[(1, out_delta)], inputs=[(2, in_delta)]):
        with pytest.raises(ClosureError, match=r"does not close(.|\n)*hook(.|\n)*"
                                               r"check_closure=False") as refused:
            attribute(model, tokenizer, clt, PROMPT)
        blind = attribute(model, tokenizer, clt, PROMPT, check_closure=False)
    assert isinstance(refused.value, ValueError)
    assert "1.0e-04" in str(refused.value) or "0.0001" in str(refused.value)
    assert blind.closure.relative > 100 * CLOSURE_TOLERANCE  # measured 0.11
    assert blind.metadata["closure_checked"] is False and blind.n_steering == 0
    assert blind.closure.target == pytest.approx(graph.closure.target, abs=1e-6)
    missing = -blind.closure.residual
    assert missing == pytest.approx(float(_steering_part(graph).double().sum()), abs=1e-5)
    torch.testing.assert_close(blind.target_row(), _without_steering(graph), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- (b) other affine edits


@pytest.mark.numerics
def test_subtraction_is_addition_of_the_negated_vector(setup, tokenizer):
    model, clt, _ = setup
    (delta,) = _vectors(7, 1)
    graphs = [attribute(_pv_model(model, [{"layer": 1, "component": "block_output",
                                           "intervention": cls(source_representation=v)}]),
                        tokenizer, clt, PROMPT)
              for cls, v in ((pv.SubtractionIntervention, delta),
                             (pv.AdditionIntervention, -delta))]
    sub, add = graphs
    assert sub.n_steering == add.n_steering == len(sub.input_ids)
    assert sub.closure.relative < 1e-6
    torch.testing.assert_close(sub.target_row(), add.target_row(), rtol=0, atol=1e-6)
    assert abs(sub.decomposition()["steering"]) > 1e-3
    assert sub.steering[0]["class"] == "SubtractionIntervention"


@pytest.mark.numerics
def test_zero_ablation_adds_no_node(setup, tokenizer):
    """ZeroIntervention has no constant part: no steering node (zeroing a block's output would
    zero the logits of this bias-free model: MLP 1's output it is)."""
    model, clt, _ = setup
    pv_model = _pv_model(model, [{"layer": 1, "component": "mlp_output",
                                  "intervention": pv.ZeroIntervention()},
                                 {"layer": 0, "component": "block_input",
                                  "intervention": pv.AdditionIntervention(
                                      source_representation=_vectors(3, 1)[0])}])
    graph = attribute(pv_model, tokenizer, clt, PROMPT)
    add, zero = graph.metadata["steering"]  # in the forward's call order
    assert zero["class"] == "ZeroIntervention" and zero["nodes"] == 0
    assert "no constant part" in zero["note"]
    assert add["nodes"] == graph.n_steering == len(graph.input_ids)
    assert {s["class"] for s in graph.steering} == {"AdditionIntervention"}
    assert graph.closure.relative < 1e-6


@pytest.mark.numerics
def test_noise_add_and_restores_are_nodes_at_their_positions(setup, tokenizer):
    """noise_add at two positions of the residual stream: two nodes, carrying what the bare
    model with the same noise as a hand hook misses; a clean_restore with states: one node,
    at the restored position."""
    model, clt, ids = setup
    noise = NoiseAdd(seeds=[3], positions=[2, 3], sigma=0.5)
    with torch.no_grad():
        states = model.model(input_ids=ids.flip(1)).last_hidden_state
    pv_model = _pv_model(model, [
        {"layer": 0, "component": "block_output", "intervention": noise},
        {"layer": 1, "component": "block_output",
         "intervention": CleanRestore(positions=[5], states=states)}])
    graph = attribute(pv_model, tokenizer, clt, PROMPT)
    assert [s["positions"] for s in graph.steering] == [[2, 3], [5]]
    assert [s["class"] for s in graph.steering] == ["NoiseAdd", "CleanRestore"]
    assert graph.closure.relative < 1e-6 and graph.feature_closure() < 1e-5
    # the noise alone, as a hand hook: the graph misses what the two noise nodes carry
    with torch.no_grad():
        drawn = noise.noise(1, ids.shape[1], D)  # what it adds
    assert drawn[0, [0, 1, 4]].abs().max() == 0 and drawn[0, [2, 3]].abs().min() > 0
    only_noise = attribute(_pv_model(model, [{"layer": 0, "component": "block_output",
                                              "intervention": NoiseAdd(
                                                  seeds=[3], positions=[2, 3], sigma=0.5)}]),
                           tokenizer, clt, PROMPT)
    with hand_edits(model, outputs=[(0, drawn)]):
        blind = attribute(model, tokenizer, clt, PROMPT, check_closure=False)
    assert only_noise.n_steering == 2
    assert -blind.closure.residual == pytest.approx(
        float(_steering_part(only_noise).double().sum()), abs=1e-5)
    assert abs(blind.closure.residual) > 1e-3


@pytest.mark.numerics
def test_edits_of_replaced_outputs_are_inside_their_node_or_refused(setup, tokenizer):
    """Where the local replacement model replaces a module's output by its own leaf (token
    embeddings) the edit's constant is inside the token nodes: no steering node, the graph
    closes and equals the bare model's with the same hand hook. Attention's output is
    recomputed with the value kept but not the edit's gradient: refused, naming the
    intervention and what to do."""
    model, clt, ids = setup
    noise = NoiseAdd(seeds=[4], positions=[1, 2], sigma=0.5)
    graph = attribute(_pv_model(model, [{"component": "model.embed_tokens.output",
                                         "intervention": noise}]), tokenizer, clt, PROMPT)
    assert graph.n_steering == 0 and graph.closure.relative < 1e-6
    assert graph.metadata["steering"][0]["nodes"] == 0
    assert "replaces" in graph.metadata["steering"][0]["note"]
    with torch.no_grad():
        drawn = noise.noise(1, ids.shape[1], D)  # what it adds
    with ExitStack() as stack:
        stack.enter_context(_embedding_edit(model, drawn))
        same = attribute(model, tokenizer, clt, PROMPT)
    torch.testing.assert_close(graph.target_row(), same.target_row(), rtol=0, atol=1e-6)
    (delta,) = _vectors(9, 1)
    attention = _pv_model(model, [{"layer": 1, "component": "attention_output",
                                   "intervention": pv.AdditionIntervention(
                                       source_representation=delta)}])
    with pytest.raises(ClosureError, match=r"attention_output(.|\n)*block_output"):
        attribute(attention, tokenizer, clt, PROMPT)


@contextmanager
def _embedding_edit(model, delta):
    handle = model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out + delta)
    try:
        yield
    finally:
        handle.remove()


# --------------------------------------------------------------------- (d) export, files


def test_a_steered_graph_exports_and_saves(steered, tmp_path):
    _, graph, _, _ = steered
    payload = graph.to_json(node_threshold=1.0, edge_threshold=1.0)
    check_graph_json(payload)
    steering = [n for n in payload["nodes"] if n["feature_type"] == "steering"]
    assert len(steering) == graph.n_steering
    assert {n["node_id"] for n in steering} == {
        f"S{j}_{p}" for j, s in enumerate(graph.steering) for p in s["positions"]}
    ids = [n["node_id"] for n in payload["nodes"]]
    assert len(set(ids)) == len(ids)
    assert {n["layer"] for n in steering} == {"1"}  # block 1's output; block 2's input
    assert all(n["clerp"].startswith("steering: AdditionIntervention") for n in steering)
    sources = {link["source"] for link in payload["links"]}
    assert any(n["node_id"] in sources for n in steering)
    info = payload["metadata"]["info"]["steering"]
    assert [(s["id"], s["class"], s["component"]) for s in info] == [
        ("S0", "AdditionIntervention", "block_output"),
        ("S1", "AdditionIntervention", "block_input")]
    # the default pruning keeps what matters and the payload still checks
    check_graph_json(graph.to_json())
    graph.save(tmp_path / "g.safetensors")
    back = AttributionGraph.load(tmp_path / "g.safetensors")
    assert back.steering == graph.steering and back.closure == graph.closure
    assert torch.equal(back.target_row(), graph.target_row())
    assert back.labels(torch.arange(back.layout.n_nodes)) == \
        graph.labels(torch.arange(graph.layout.n_nodes))
    graph.plot(tmp_path / "g.png")


# ------------------------------------------------------------------------ closure itself


def test_closure_is_relative_to_what_is_summed():
    """A near-zero target with large terms: rounding-sized residuals pass, and ``relative``
    is the residual over sum |edges| + |constants| + |target|."""
    tiny = Closure(target=1e-6, edges=2e-6 - 1e-6, constant=1e-12, scale=10.0)
    assert tiny.relative == pytest.approx(1e-13, rel=1e-3) and tiny.ok
    off = Closure(target=1.0, edges=1.5, constant=0.0, scale=4.0)
    assert off.relative == pytest.approx(0.125) and not off.ok
    assert off.to_dict()["tolerance"] == CLOSURE_TOLERANCE
    assert issubclass(ClosureError, ValueError)
    # per row, as attribute checks each batch of feature rows
    rows = torch.tensor([[1.0, -2.0, 3.0], [0.25, -0.5, 0.0]])  # row 2: a target near 0
    tiny = 2.0 ** -20
    relative = row_closures(rows, torch.tensor([0.5, 0.0]), torch.tensor([2.4, -0.25 + tiny]))
    want = torch.tensor([0.1 / 8.9, tiny / (1.0 - tiny)], dtype=torch.float64)
    torch.testing.assert_close(relative, want, rtol=1e-5, atol=0)


def test_a_graph_file_without_the_scale_reads_back_with_it(setup, tokenizer, tmp_path):
    """Files written before ``Closure.scale`` existed (schema 2, no ``scale``): the scale is
    recomputed from the stored logit row, so ``relative`` means the same as for a new graph."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    model, clt, _ = setup
    graph = attribute(model, tokenizer, clt, PROMPT)
    graph.save(tmp_path / "new.safetensors")
    with safe_open(str(tmp_path / "new.safetensors"), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    assert meta["schema_version"] == "2"  # no steering: readable by older versions
    header = json.loads(meta["graph"])
    for key in ("scale", "relative", "tolerance"):
        del header["closure"][key]
    del header["steering"]
    save_file(tensors, str(tmp_path / "old.safetensors"),
              metadata={**meta, "graph": json.dumps(header)})
    old = AttributionGraph.load(tmp_path / "old.safetensors")
    assert old.closure.scale == pytest.approx(graph.closure.scale, rel=1e-9)
    assert old.closure.relative == pytest.approx(graph.closure.relative, rel=1e-6)
    assert old.n_steering == 0 and old.layout == graph.layout
