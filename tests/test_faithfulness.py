"""Faithfulness curves (MIB's f(k), CPR, CMD) of an attribution graph, checked against explicit
ablation forwards written here, and CPR/CMD against numbers MIB's own formula gave."""

from __future__ import annotations

import sys

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.faithfulness import (
    FaithfulnessSettings,
    faithfulness,
    mib_areas,
)
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.clt_splice import clean_errors, clt_splice_representations
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.hooks import transcoder_states

FOIL = 5
SIZES = (1.0, 10.0, 50.0, 100.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    model = make_tiny_model("qwen3", init=0.2, n_layers=3)
    folder = tmp_path_factory.mktemp("faith")
    clt = load_from_disk(str(write_clt(folder / "clt", random_clt_tensors(3, 32, 48,
                                                                          threshold=0.1))))
    graph = attribute(model, tokenizer, clt, PROMPT)
    counterfactual = list(graph.input_ids)
    counterfactual[1:4] = counterfactual[1:4][::-1]
    return model, clt, graph, counterfactual


def _explicit_logit_diff(model, clt, graph, counterfactual, keep: set[int]) -> float:
    """The spliced model with the clean errors, every graph feature outside ``keep`` set to
    its value on the counterfactual prompt (one feature_ablate ``value`` per layer and
    position), batch 1: logit(answer) - logit(foil)."""
    ids = torch.tensor([graph.input_ids])
    inputs = transcoder_states(model, clt, torch.tensor([counterfactual]))["input"]
    cf_acts = [clt.encode(inputs[layer], layer) for layer in range(clt.n_layers)]
    groups: dict[tuple[int, int], list[int]] = {}
    for node in range(graph.n_features):
        if node not in keep:
            key = (int(graph.feature_layer[node]), int(graph.feature_position[node]))
            groups.setdefault(key, []).append(int(graph.feature_id[node]))
    ablations = [{"clt_layer": layer, "positions": [pos], "features": features,
                  "value": [float(cf_acts[layer][pos, f]) for f in features]}
                 for (layer, pos), features in sorted(groups.items())]
    errors = clean_errors(model, clt, ids, graph.from_position)
    reps = clt_splice_representations(model, clt, errors=errors,
                                      from_position=graph.from_position, ablations=ablations)
    with torch.no_grad(), intervened(bind(model), reps) as spliced:
        logits = spliced(input_ids=ids).logits[0, -1].double()
    return float(logits[int(graph.target["token"])] - logits[FOIL])


def _hand_curve(model, clt, graph, counterfactual, circuits: list[set[int]]) -> list[float]:
    ids = torch.tensor([graph.input_ids])
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, -1].double()
    m_full = float(full[int(graph.target["token"])] - full[FOIL])
    m_empty = _explicit_logit_diff(model, clt, graph, counterfactual, set())
    return [(_explicit_logit_diff(model, clt, graph, counterfactual, c) - m_empty)
            / (m_full - m_empty) for c in circuits]


def test_node_curve_is_explicit_ablation_forwards(setup):
    model, clt, graph, counterfactual = setup
    curve = faithfulness(model, None, clt, graph, counterfactual, foil=FOIL, sizes=SIZES, draws=1,
                         batch_size=3)
    n = graph.n_features
    assert curve.n_items == n and curve.counts == [int(s / 100 * n) for s in SIZES]
    order = graph.influence()[:n].double().argsort(descending=True, stable=True).tolist()
    hand = _hand_curve(model, clt, graph, counterfactual,
                       [set(order[:k]) for k in curve.counts])
    assert curve.f == pytest.approx(hand, abs=1e-6)
    # every node live, errors held: the model, to the float32 rounding of the spliced forward
    # over the margin's span (3.0e-6 on one CPU, under 1e-6 on another)
    assert curve.f[-1] == pytest.approx(1.0, abs=1e-5)
    # the random floor: the same seeded permutation, recomputed by hand
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    random = _hand_curve(model, clt, graph, counterfactual, [set(perm[:k]) for k in curve.counts])
    assert curve.random[0] == pytest.approx(random, abs=1e-6)
    # 1 + 2 curves x 4 sizes = 9 circuits, 3 per forward
    assert curve.forwards == 3
    assert (curve.cpr, curve.cmd) == pytest.approx(mib_areas(curve.fractions, curve.f))


def test_edge_curve_keeps_the_features_that_reach_the_logit(setup):
    model, clt, graph, counterfactual = setup
    curve = faithfulness(model, None, clt, graph, counterfactual, foil=FOIL, sizes=(0.2, 2.0),
                         level="edges", draws=1)
    lay = graph.layout
    dense = torch.zeros(lay.n_nodes, lay.n_nodes, dtype=torch.float64)
    dense[graph.rows.nodes, :graph.rows.n_columns] = \
        graph.rows.dense(range(graph.rows.n_rows)).double()
    weights = torch.zeros(lay.n_nodes, dtype=torch.float64)
    weights[lay.logits] = graph.logit_weights().double()
    score = dense.abs() / dense.abs().sum(1, keepdim=True).clamp(min=1e-10) \
        * (graph.influence() + weights)[:, None]
    target, source = dense.nonzero(as_tuple=True)
    ranked = score[target, source].argsort(descending=True, stable=True)
    assert curve.n_items == len(target)
    circuits = []
    for k in curve.counts:
        edges = [(int(target[i]), int(source[i])) for i in ranked[:k]]
        reached, grew = set(range(lay.logits.start, lay.n_nodes)), True
        while grew:
            grew = False
            for t, s in edges:
                if t in reached and s not in reached:
                    reached.add(s)
                    grew = True
        circuits.append({node for node in reached if node < graph.n_features})
    assert 0 < len(circuits[0]) < len(circuits[1]) < graph.n_features
    hand = _hand_curve(model, clt, graph, counterfactual, circuits)
    assert curve.f == pytest.approx(hand, abs=1e-6)


# MIB's integration, cisnlp/MIB-circuit-track MIB_circuit_track/evaluation.py at commit
# 82841993b65f4f69b69ad8286b7b713800ec90f9 (evaluate_area_under_curve: area_under,
# area_from_1), transcribed into a scratch script and run on these curves at its default
# percentages; the numbers below are what it printed.
MIB_CURVES = {
    "rising": ([0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.0, 1.0], 0.9115, 0.08750000000000001),
    "overshoot": ([-0.2, 0.1, 0.4, 0.8, 1.3, 1.1, 0.95, 1.05, 1.0, 1.0], 1.00895,
                  0.030050000000000018),
    "flat_low": ([0.01, -0.03, 0.02, 0.0, 0.04, 0.1, 0.12, 0.3, 0.6, 1.0], 0.563825, 0.435175),
}


@pytest.mark.parametrize("name", sorted(MIB_CURVES))
def test_cpr_and_cmd_are_mibs_numbers(name):
    f, cpr, cmd = MIB_CURVES[name]
    fractions = [round(s / 100, 12) for s in FaithfulnessSettings().sizes]
    assert fractions == [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1]
    assert mib_areas(fractions, f) == pytest.approx((cpr, cmd), abs=1e-12)


def test_a_reversed_ranking_falls_below_the_random_band(setup, monkeypatch):
    model, clt, graph, counterfactual = setup
    # zero ablation: on this random-init model, counterfactual patching spreads the random
    # rankings' CPR over 0.05-0.94, a band no ranking can fall below
    kwargs = {"foil": FOIL, "draws": 5, "batch_size": 64, "ablation": "zero"}
    good = faithfulness(model, None, clt, graph, counterfactual, **kwargs)
    assert good.cpr > sum(good.random_cpr) / len(good.random_cpr)
    module = sys.modules["pyvene_causaltrace.attribution.faithfulness"]
    ranked = module.node_order
    monkeypatch.setattr(module, "node_order", lambda g, r: ranked(g, r).flip(0))
    bad = faithfulness(model, None, clt, graph, counterfactual, **kwargs)
    assert bad.random_cpr == good.random_cpr  # the floor does not move
    assert bad.below_random() and bad.cpr < min(bad.random_cpr)


def test_results_read_back(setup, tmp_path):
    model, clt, graph, counterfactual = setup
    curve = faithfulness(model, None, clt, graph, ablation="zero", metric="prob",
                         sizes=(50.0, 100.0), draws=2)
    frame = curve.to_dataframe()
    assert list(frame.k) == curve.counts and frame.random_min.le(frame.random_max).all()
    assert curve.to_json(tmp_path / "c.json")["cpr"] == curve.cpr
    curve.plot(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_refusals_name_the_argument(setup):
    model, clt, graph, counterfactual = setup
    with pytest.raises(InputError, match="counterfactual: it is 7 tokens"):
        faithfulness(model, None, clt, graph, counterfactual[:-1], foil=FOIL)
    with pytest.raises(InputError, match="counterfactual: ablation='counterfactual'"):
        faithfulness(model, None, clt, graph, foil=FOIL)
    for sizes in ((0.0, 10.0), (10.0, 100.5), (-1.0,), (10.0, 5.0)):
        with pytest.raises(InputError, match="sizes"):
            faithfulness(model, None, clt, graph, counterfactual, foil=FOIL, sizes=sizes)
    moved = type(graph)(**{**{f: getattr(graph, f) for f in graph.__dataclass_fields__
                              if f != "_memo"},
                           "metadata": {**graph.metadata, "fingerprints": {
                               **graph.metadata["fingerprints"], "transcoder": "elsewhere"}}})
    with pytest.raises(InputError, match="graph: it was built with another transcoder"):
        faithfulness(model, None, clt, moved, counterfactual, foil=FOIL)
    other = make_tiny_model("qwen3", init=0.2, n_layers=3, seed=1)
    with pytest.raises(InputError, match="graph: it was built on another model"):
        faithfulness(other, None, clt, graph, counterfactual, foil=FOIL)


def test_each_setting_default_is_one_constant_of_defaults():
    import dataclasses

    from pyvene_causaltrace import defaults

    constants = {name: value for name, value in vars(defaults).items()
                 if name.startswith("FAITH_")}
    fields = dataclasses.fields(FaithfulnessSettings)
    assert sorted(f"FAITH_{f.name.upper()}".replace("BATCH_SIZE", "BATCH") for f in fields) \
        == sorted(constants)
    for f in fields:
        name = f"FAITH_{f.name.upper()}".replace("BATCH_SIZE", "BATCH")
        assert f.default is constants[name], f.name


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, tokenizer):
    """A tiny Llama (and another, seed 1) and two CLTs on disk, and a graph of the first pair."""
    from pyvene_causaltrace.models import load_model

    root = tmp_path_factory.mktemp("faith_cli")
    for name, seed in (("llama", 0), ("other", 1)):
        make_tiny_model("llama", seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    for name, seed in (("clt", 0), ("other_clt", 1)):
        write_clt(root / name, random_clt_tensors(3, 32, 48, seed=seed, threshold=0.1))
    model, tok = load_model(str(root / "llama"))
    attribute(model, tok, load_from_disk(str(root / "clt")), PROMPT).save(root / "g.safetensors")
    return root


CF = "The Space Needle is in the city of"  # as many tokens as PROMPT


def test_evaluate_writes_the_curve(on_disk, tmp_path, capsys):
    from pyvene_causaltrace.cli import main

    out = tmp_path / "faith"
    assert main(["evaluate", str(on_disk / "g.safetensors"), "--model", str(on_disk / "llama"),
                 "--clt", str(on_disk / "clt"), "--counterfactual", CF, "--draws", "2",
                 "--sizes", "10,50,100", "--out", str(out)]) == 0
    assert "CPR" in capsys.readouterr().out
    for name in ("faithfulness.json", "faithfulness.csv", "faithfulness.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize("change, message", [
    ({"--counterfactual": "The city of"}, "error: counterfactual: it is"),
    ({"--sizes": "0,10"}, "error: --sizes: sizes must be percentages in (0, 100]"),
    ({"--sizes": "10,100.5"}, "error: --sizes: sizes must be percentages in (0, 100]"),
    ({"--sizes": "100"}, "error: --sizes: sizes: CPR and CMD integrate between sizes"),
    ({"--counterfactual": PROMPT, "--metric": "prob"},
     "error: graph: the empty circuit scores as the full model"),
    ({"--model": "other"}, "error: graph: it was built on another model"),
    ({"--clt": "other_clt"}, "error: graph: it was built with another transcoder"),
])
def test_evaluate_refusals_are_one_error_line(on_disk, capsys, change, message):
    from pyvene_causaltrace.cli import main

    flags = {"--model": "llama", "--clt": "clt", "--counterfactual": CF, **change}
    for name in ("--model", "--clt"):
        flags[name] = str(on_disk / flags[name])
    argv = ["evaluate", str(on_disk / "g.safetensors"), "--draws", "1"]
    assert main(argv + [x for pair in flags.items() for x in pair]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(message), err
    assert "Traceback" not in err


def test_attribute_faithfulness_carries_the_scores_into_graph_json(on_disk, tmp_path, capsys):
    import json

    from pyvene_causaltrace.cli import main

    out = tmp_path / "graph"
    base = ["attribute", "--model", str(on_disk / "llama"), "--clt", str(on_disk / "clt"),
            "--prompt", PROMPT, "--answer", " the", "--out", str(out)]
    assert main(base + ["--counterfactual", CF]) == 2  # read only with --faithfulness
    assert "--counterfactual is read only with --faithfulness" in capsys.readouterr().err
    assert main(base + ["--faithfulness", "--counterfactual", CF, "--draws", "2",
                        "--sizes", "10,50,100"]) == 0
    curve = json.loads((out / "faithfulness.json").read_text())
    info = json.loads((out / "graph.json").read_text())["metadata"]["info"]
    assert info["faithfulness"]["cpr"] == curve["cpr"] and len(curve["random_cpr"]) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metadata"]["faithfulness"]["cmd"] == curve["cmd"]


def test_evaluate_budget_writes_the_curve(on_disk, tmp_path, capsys):
    import json

    from pyvene_causaltrace.attribution import BudgetCurve
    from pyvene_causaltrace.cli import main

    out = tmp_path / "budget"
    assert main(["evaluate", str(on_disk / "g.safetensors"), "--model", str(on_disk / "llama"),
                 "--clt", str(on_disk / "clt"), "--budget", "--counterfactual", CF,
                 "--budgets", "5,50", "--draws", "2", "--out", str(out)]) == 0
    assert "active features" in capsys.readouterr().out
    curve = BudgetCurve.from_json(json.loads((out / "budget_curve.json").read_text()))
    assert curve.budgets[:2] == [5, 50] and curve.settings["ablation"] == "counterfactual"
    for name in ("budget_curve.csv", "budget_curve.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize("extra, message", [
    (["--budget", "--budgets", "0,50"], "error: --budgets: budgets must be whole numbers of "
                                        "features K > 0"),
    (["--budget", "--budgets", "-5"], "error: --budgets: budgets must be whole numbers"),
    (["--budget", "--budgets", "100,50"], "error: --budgets: budgets must increase"),
    (["--budget", "--budgets", "ten"], "error: --budgets: give whole numbers"),
    (["--budget", "--metric", "kl"], "error: --metric"),
    (["--budgets", "50"], "error: --budgets does not apply to `evaluate` (--budgets sets"),
])
def test_evaluate_budget_refusals_are_one_error_line(on_disk, capsys, extra, message):
    from pyvene_causaltrace.cli import main

    argv = ["evaluate", str(on_disk / "g.safetensors"), "--model", str(on_disk / "llama"),
            "--clt", str(on_disk / "clt"), "--counterfactual", CF, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(message), err
    assert "Traceback" not in err


# ------------------------------------------------------------------- edge cases (audit)


def test_one_size_is_refused_it_has_no_area():
    # CPR and CMD integrate between sizes: one size gave CPR 0 and CMD 0 (a "perfect" CMD)
    for sizes in ((100.0,), (10.0,)):
        with pytest.raises(InputError, match="sizes: CPR and CMD integrate between sizes"):
            FaithfulnessSettings(sizes=sizes)


@pytest.mark.parametrize("metric", ["logit_diff", "prob", "kl"])
def test_an_empty_circuit_that_scores_as_the_model_is_refused(setup, metric):
    # the prompt as its own counterfactual: every ablation is the clean value, so m(empty) is
    # m(full) up to the splice's rounding, and f(k) was rounding over rounding (f = -13.75)
    model, clt, graph, _ = setup
    with pytest.raises(InputError, match="the empty circuit scores as the full model does"):
        faithfulness(model, None, clt, graph, list(graph.input_ids), foil=FOIL, metric=metric,
                     sizes=(10.0, 50.0, 100.0), draws=1)
    # control: a counterfactual that moves the metric is measured
    faithfulness(model, None, clt, graph, setup[3], foil=FOIL, metric=metric,
                 sizes=(10.0, 100.0), draws=1)


def test_a_foil_outside_the_vocabulary_is_refused(setup, tokenizer):
    # foil=-1 read the last token's logit (a wrong number), foil=vocab an IndexError
    model, clt, graph, counterfactual = setup
    vocab = model.config.vocab_size
    for foil in (-1, vocab):
        with pytest.raises(InputError, match="foil: token id"):
            faithfulness(model, None, clt, graph, counterfactual, foil=foil, sizes=(10.0, 100.0),
                         draws=1)
    with pytest.raises(InputError, match="tokenizes to nothing"):
        faithfulness(model, tokenizer, clt, graph, counterfactual, foil="", sizes=(10.0, 100.0),
                     draws=1)
    with pytest.warns(UserWarning, match="tokens"):  # only its first token is the foil
        faithfulness(model, tokenizer, clt, graph, counterfactual, foil=" Paris is a city",
                     sizes=(10.0, 100.0), draws=1)


def test_a_reference_prompt_with_no_spliced_position_is_refused(setup, tokenizer):
    # with position 0 as BOS (bos="always") one-token reference prompts have no position the
    # mean reads: the mean was NaN and so was every f(k), without an error
    model, clt, _, _ = setup
    graph = attribute(model, tokenizer, clt, PROMPT, bos="always")
    assert graph.from_position == 1
    first = tokenizer.decode(graph.input_ids[:1])
    with pytest.raises(InputError, match="reference: .* a token at or after .* position .1"):
        faithfulness(model, tokenizer, clt, graph, reference=[first], ablation="mean",
                     foil=FOIL, sizes=(10.0, 100.0), draws=1)
    with pytest.raises(InputError, match="reference: ablation='mean' needs"):
        faithfulness(model, tokenizer, clt, graph, ablation="mean", foil=FOIL, draws=1)
    # a short prompt beside others adds no token to the mean: the mean is the others'
    curves = [faithfulness(model, tokenizer, clt, graph, reference=refs, ablation="mean",
                           foil=FOIL, sizes=(10.0, 100.0), draws=1)
              for refs in ([PROMPT], [first, PROMPT])]
    assert all(torch.isfinite(torch.tensor(curves[0].f))) and curves[0] == curves[1]
