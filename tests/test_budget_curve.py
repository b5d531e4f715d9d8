"""The feature-budget curve (KL and P(answer) with the top K features live), each point checked
against an explicit ablation forward written here; and the faithfulness and budget curves of a
model whose circuit is known (weights set by hand, tests/_support/ground_truth.py)."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
from _support.ground_truth import build_ground_truth
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import BudgetCurve, attribute, budget_curve, faithfulness
from pyvene_causaltrace.attribution.budget_curve import features_ranked, random_needed
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.clt_splice import clean_errors, clt_splice_representations
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.hooks import transcoder_states


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    """A random tiny Qwen3, a CLT, its graph of the prompt and a counterfactual prompt."""
    model = make_tiny_model("qwen3", init=0.2, n_layers=3)
    folder = tmp_path_factory.mktemp("budget")
    clt = load_from_disk(str(write_clt(folder / "clt", random_clt_tensors(3, 32, 48,
                                                                          threshold=0.1))))
    graph = attribute(model, tokenizer, clt, PROMPT)
    counterfactual = list(graph.input_ids)
    counterfactual[1:4] = counterfactual[1:4][::-1]
    return model, clt, graph, counterfactual


def _acts(model, clt, ids: list[int], start: int) -> torch.Tensor:
    inputs = transcoder_states(model, clt, torch.tensor([ids]))["input"]
    acts = torch.stack([clt.encode(inputs[layer], layer) for layer in range(clt.n_layers)])
    acts[:, :start] = 0
    return acts


def _hand_order(clt, graph, clean: torch.Tensor) -> list[tuple[int, int, int]]:
    """Every active (layer, position, feature): the graph's nodes by influence, then the rest
    by |activation| x the norm of the feature's decoder."""
    n = graph.n_features
    nodes = [(int(graph.feature_layer[i]), int(graph.feature_position[i]),
              int(graph.feature_id[i]))
             for i in graph.influence()[:n].double().argsort(descending=True, stable=True)]
    active = [tuple(t) for t in clean.nonzero().tolist()]
    nodes = [t for t in nodes if t in set(active)]
    rest = [t for t in active if t not in set(nodes)]
    norm = {t: abs(float(clean[t])) * float(clt.W_dec[t[0]][t[2]].double().norm())
            for t in rest}
    return nodes + sorted(rest, key=lambda t: -norm[t])


def _explicit(model, clt, graph, cf_acts, clean, kept: set) -> torch.Tensor:
    """Logits of one spliced forward (batch 1, clean errors): every feature from the graph's
    first position that is not ``kept`` set by a feature_ablate ``value`` list per layer and
    position: its counterfactual value where the clean run is active, else 0."""
    ids = torch.tensor([graph.input_ids])
    n_layers, n_pos, width = clean.shape
    ablations = []
    for layer in range(n_layers):
        for pos in range(graph.from_position, n_pos):
            features = [f for f in range(width) if (layer, pos, f) not in kept]
            values = [float(cf_acts[layer, pos, f]) if clean[layer, pos, f] != 0 else 0.0
                      for f in features]
            if features:
                ablations.append({"clt_layer": layer, "positions": [pos], "features": features,
                                  "value": values})
    errors = clean_errors(model, clt, ids, graph.from_position)
    reps = clt_splice_representations(model, clt, errors=errors,
                                      from_position=graph.from_position, ablations=ablations)
    with torch.no_grad(), intervened(bind(model), reps) as spliced:
        return spliced(input_ids=ids).logits[0, -1].double()


def _kl_and_prob(full: torch.Tensor, logits: torch.Tensor, answer: int) -> tuple[float, float]:
    p, q = full.log_softmax(-1), logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum()), float(q.exp()[answer])


def test_each_point_is_an_explicit_ablation_forward(setup):
    model, clt, graph, counterfactual = setup
    curve = budget_curve(model, None, clt, graph, counterfactual, budgets=(3, 40, 100), draws=2,
                         batch_size=7)
    start = graph.from_position
    clean = _acts(model, clt, graph.input_ids, start)
    cf_acts = _acts(model, clt, counterfactual, start)
    order = _hand_order(clt, graph, clean)
    n = len(order)
    assert curve.n_active == curve.n_graph == n > 100  # a graph's nodes: every active feature
    assert curve.budgets == [3, 40, 100, n] and curve.kept == [3, 40, 100, n]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([graph.input_ids])).logits[0, -1].double()
    answer = int(graph.target["token"])
    for i, k in enumerate(curve.kept):
        kl, prob = _kl_and_prob(full, _explicit(model, clt, graph, cf_acts, clean,
                                                set(order[:k])), answer)
        assert curve.kl[i] == pytest.approx(kl, abs=1e-6) and \
            curve.prob[i] == pytest.approx(prob, abs=1e-6), k
    assert curve.kl[-1] == pytest.approx(0.0, abs=1e-6)  # all live, errors held: the model
    assert curve.prob[-1] == pytest.approx(curve.prob_full, abs=1e-6)
    # the first random draw: the seeded permutation of the active features (in layer,
    # position, feature order), recomputed by hand
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    active = [tuple(t) for t in clean.nonzero().tolist()]
    for k in (2, 40, 128):
        kl, prob = _kl_and_prob(full, _explicit(model, clt, graph, cf_acts, clean,
                                                {active[j] for j in perm[:k]}), answer)
        j = curve.grid.index(k)
        assert curve.random_kl[0][j] == pytest.approx(kl, abs=1e-6)
        assert curve.random_prob[0][j] == pytest.approx(prob, abs=1e-6)
    # 1 empty + 4 ranked + 2 draws x grid circuits, 7 per forward
    assert curve.forwards == math.ceil((1 + 4 + 2 * len(curve.grid)) / 7)
    mean = torch.tensor(curve.random_kl, dtype=torch.float64).mean(0).tolist()
    for k, target, matched in zip(curve.kept[:-1], curve.kl, curve.matched, strict=False):
        assert matched == random_needed(curve.grid, mean, target), k


def test_features_beyond_the_graph_rank_after_its_nodes(setup):
    """A graph that holds only some active features (40 of them, their influence kept): those
    first, in its order, then the others by |activation| x decoder norm."""
    model, clt, graph, _ = setup
    clean = _acts(model, clt, graph.input_ids, graph.from_position)
    chosen = torch.randperm(graph.n_features, generator=torch.Generator().manual_seed(3))[:40]
    influence = graph.influence()[chosen]
    part = SimpleNamespace(n_features=40, influence=lambda: influence,
                           feature_layer=graph.feature_layer[chosen],
                           feature_position=graph.feature_position[chosen],
                           feature_id=graph.feature_id[chosen])
    order, n_graph = features_ranked(clt, part, clean, "influence")
    width, n_pos = clean.shape[2], clean.shape[1]
    got = [(i // (n_pos * width), i // width % n_pos, i % width) for i in order.tolist()]
    assert n_graph == 40 and got == _hand_order(clt, part, clean)
    assert len(got) == len(set(got)) == int((clean != 0).sum())


def test_random_needed_interpolates_on_log_k():
    grid, mean = [1, 2, 4, 8], [1.0, 0.8, 0.4, 0.1]
    assert random_needed(grid, mean, 0.6) == pytest.approx(2 * 2 ** 0.5)  # halfway, in log K
    assert random_needed(grid, mean, 0.4) == pytest.approx(4.0)
    assert random_needed(grid, mean, 1.5) == 1.0
    assert random_needed(grid, mean, 0.05) is None  # "> all"
    assert random_needed([1, 2, 4], [1.0, 0.3, 0.5], 0.4) == pytest.approx(2 ** (6 / 7))


def test_results_read_back_and_refusals(setup, tmp_path):
    model, clt, graph, counterfactual = setup
    curve = budget_curve(model, None, clt, graph, ablation="zero", budgets=(5, 50), draws=2)
    frame = curve.to_dataframe()
    assert list(frame.K) == ["5", "50", "all"] and list(frame.kept) == curve.kept
    assert frame.random_kl_min.le(frame.random_kl_max).all()
    assert BudgetCurve.from_json(curve.to_json(tmp_path / "b.json")) == curve
    assert BudgetCurve.from_json(tmp_path / "b.json") == curve
    curve.plot(tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    for budgets in ((0, 10), (-5,), (10, 10), (50, 20), ()):
        with pytest.raises(InputError, match="budgets"):
            budget_curve(model, None, clt, graph, ablation="zero", budgets=budgets)
    with pytest.raises(InputError, match="counterfactual: it is 7 tokens"):
        budget_curve(model, None, clt, graph, counterfactual[:-1])


# ------------------------------------------------------------------------- ground truth


@pytest.fixture(scope="module")
def truth(tokenizer):
    gt = build_ground_truth(tokenizer, PROMPT)
    graph = attribute(gt.model, tokenizer, gt.transcoder, PROMPT, tokenizer.decode([gt.answer]))
    return gt, graph


def _node(graph, at: tuple[int, int, int]) -> int:
    hits = ((graph.feature_layer == at[0]) & (graph.feature_position == at[1])
            & (graph.feature_id == at[2])).nonzero()
    return int(hits[0, 0])


def test_ground_truth_model_is_its_circuit(truth):
    """The construction itself: the transcoder is the MLPs (errors are rounding), the answer is
    the model's top token, and the graph ranks B then A first."""
    gt, graph = truth
    ids = torch.tensor([gt.ids])
    assert clean_errors(gt.model, gt.transcoder, ids, 0).abs().max() < 1e-5
    with torch.no_grad():
        probs = gt.model(input_ids=ids).logits[0, -1].softmax(-1)
    assert float(probs[gt.answer]) > 0.99
    top = graph.influence()[:graph.n_features].argsort(descending=True)[:2].tolist()
    assert top == [_node(graph, gt.b), _node(graph, gt.a)]


def _sizes(n: int) -> tuple[float, ...]:
    """Sizes that keep 1 and 2 nodes, then 10 % steps up to one node short of all."""
    return (150 / n, 250 / n, *range(10, 100, 10), 100 * (n - 1) / n + 1e-9, 100.0)


def test_ground_truth_faithfulness_and_the_reversed_ranking(truth, monkeypatch):
    gt, graph = truth
    n = graph.n_features
    kwargs = {"foil": gt.foil, "ablation": "zero", "sizes": _sizes(n), "draws": 5,
              "batch_size": 64}
    good = faithfulness(gt.model, None, gt.transcoder, graph, **kwargs)
    assert good.counts[:2] == [1, 2]
    assert abs(good.f[0]) < 1e-3  # B alone: A ablated, so B does not fire
    assert good.f[1] == pytest.approx(1.0, abs=0.05)  # {A, B}: the whole answer
    assert all(f == pytest.approx(1.0, abs=0.05) for f in good.f[1:])
    random_at_2 = [curve[1] for curve in good.random]
    assert max(abs(f) for f in random_at_2) < 0.05  # random pairs stay near 0
    assert good.cpr > 0.95 and good.cmd < 0.05 and good.cpr > max(good.random_cpr)
    module = sys.modules["pyvene_causaltrace.attribution.faithfulness"]
    ranked = module.node_order
    monkeypatch.setattr(module, "node_order", lambda g, r: ranked(g, r).flip(0))
    bad = faithfulness(gt.model, None, gt.transcoder, graph, **kwargs)
    assert bad.random_cpr == good.random_cpr
    assert bad.below_random() and bad.cpr < 0.01


def test_ground_truth_budget_curve(truth, monkeypatch):
    gt, graph = truth
    kwargs = {"ablation": "zero", "budgets": (1, 2, 4, 8), "draws": 5}
    curve = budget_curve(gt.model, None, gt.transcoder, graph, **kwargs)
    assert curve.n_active == graph.n_features  # every active feature is a graph node here
    assert curve.prob_full > 0.99 and curve.prob_empty < 0.01
    assert curve.prob[0] < 0.01  # B alone
    assert all(p > 0.99 * curve.prob_full for p in curve.prob[1:])  # A and B in: all of it
    band = curve.to_dataframe()
    assert band.random_prob_max[:4].max() < 0.01  # 8 random features miss the pair
    assert curve.kl[1] < 1e-3 < band.random_kl_min[1]
    module = sys.modules["pyvene_causaltrace.attribution.budget_curve"]
    ranked = module.node_order
    monkeypatch.setattr(module, "node_order", lambda g, r: ranked(g, r).flip(0))
    reversed_ = budget_curve(gt.model, None, gt.transcoder, graph, **kwargs)
    assert max(reversed_.prob[:4]) < 0.01 and reversed_.random_prob == curve.random_prob


# ------------------------------------------------------------------------- the results page


def test_the_results_page_json_reads_back():
    """examples/results/faithfulness/*.json: each budget curve reads back and its "random
    features needed" are what its own random draws give."""
    from pathlib import Path

    folder = Path(__file__).parent.parent / "examples" / "results" / "faithfulness"
    for name in ("budget_zero", "budget_counterfactual"):
        curve = BudgetCurve.from_json(folder / f"{name}.json")
        mean = torch.tensor(curve.random_kl, dtype=torch.float64).mean(0).tolist()
        assert curve.matched[:-1] == [random_needed(curve.grid, mean, t)
                                      for t in curve.kl[:-1]]
        assert curve.kl[-1] < 1e-6 and curve.kept[-1] == curve.n_active


def test_smollm2_budget_curve_points_are_explicit_forwards(smollm2, tmp_path):
    """On the real model (a fixture CLT of its shape): two points recomputed by explicit
    ablation forwards, and all features live is the model."""
    model, tokenizer = smollm2
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(
        30, 576, 64, threshold=0.6, seed=3), model_name="smollm2-135m")))
    graph = attribute(model, tokenizer, clt, PROMPT, " Paris", max_feature_nodes=40)
    counterfactual = tokenizer("The Colosseum is in the city of")["input_ids"]
    curve = budget_curve(model, tokenizer, clt, graph, "The Colosseum is in the city of",
                         budgets=(10, 50), draws=1)
    start = graph.from_position
    clean = _acts(model, clt, graph.input_ids, start)
    cf_acts = _acts(model, clt, counterfactual, start)
    order = _hand_order(clt, graph, clean)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([graph.input_ids])).logits[0, -1].double()
    answer = int(graph.target["token"])
    for i, k in enumerate(curve.kept[:2]):
        kl, prob = _kl_and_prob(full, _explicit(model, clt, graph, cf_acts, clean,
                                                set(order[:k])), answer)
        assert curve.kl[i] == pytest.approx(kl, abs=1e-5)
        assert curve.prob[i] == pytest.approx(prob, abs=1e-6)
    # float32 through 30 layers, a random CLT's reconstruction and its error cancelling: the
    # spliced model is the model to ~1e-4 in P (2.7e-4 on another CPU, KL 2.8e-7)
    assert curve.kl[-1] < 1e-6 and curve.prob[-1] == pytest.approx(curve.prob_full, abs=5e-4)
