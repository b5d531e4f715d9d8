"""``dataset --graphs --faithfulness`` (issue 55, item 4): each fact's graph gets its
faithfulness curve, patched from the next kept fact of the same length with another answer
(whose answer is the foil), or ``null`` and the reason; the aggregate's CPR and CMD are the
per-fact values' mean with a bootstrap interval; an interrupted run resumes without losing or
recomputing a curve; the command line refuses what cannot be measured in one ``error:`` line."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from _support.models import make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_dataset import write_jsonl

import pyvene_causaltrace.dataset.graphs as dataset_graphs
from pyvene_causaltrace.attribution import AttributionGraph
from pyvene_causaltrace.attribution.faithfulness import faithfulness
from pyvene_causaltrace.attribution.settings import FaithfulnessSettings
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.dataset import GraphSettings, aggregate_schema, read_records, trace_dataset
from pyvene_causaltrace.dataset.store import GRAPHS, read_jsonl
from pyvene_causaltrace.errors import InputError, ManifestMismatchError
from pyvene_causaltrace.transcoders import load_transcoder

N_LAYERS = 3
#: Answers with distinct first tokens under the test tokenizer: f0 and f1 have as many tokens
#: (8) and other answers; f2's prompt is longer (no counterfactual); f3 has f0's length and
#: f0's answer, so the next of its length with another answer is f1 (wrapping around), and
#: f1's is f3 (f3 has another answer than f1)
FACTS = [
    {"id": "f0", "prompt": "The Eiffel Tower is in the city of", "subject": "The Eiffel Tower",
     "attribute": "France"},
    {"id": "f1", "prompt": "The Space Needle is in the city of", "subject": "The Space Needle",
     "attribute": "Seattle"},
    {"id": "f2", "prompt": "The Colosseum is in the city of", "subject": "The Colosseum",
     "attribute": "Rome"},
    {"id": "f3", "prompt": "The Louvre is in", "subject": "The Louvre", "attribute": "France"},
]
FAITH = FaithfulnessSettings(sizes=(10.0, 50.0, 100.0), draws=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("dataset-faith")
    make_tiny_model("llama", n_layers=N_LAYERS, init=0.2).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    write_jsonl(root / "facts.jsonl", FACTS)
    write_clt(root / "clt", random_clt_tensors(N_LAYERS, 32, 48, threshold=0.1))
    return root


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", n_layers=N_LAYERS, init=0.2)


def _run(files, model, tokenizer, out, **options):
    records, _ = read_records(files / "facts.jsonl")
    return trace_dataset(model, tokenizer, records, out=out, kinds=("residual",), seeds=1,
                         known="none", progress=False, n_boot=200,
                         transcoder=load_transcoder(files / "clt"),
                         graph_options=GraphSettings(save=True), **options)


def _lengths(tokenizer) -> list[int]:
    return [len(tokenizer(f["prompt"])["input_ids"]) for f in FACTS]


def test_curves_per_fact_the_aggregate_and_a_resume(files, model, tokenizer, monkeypatch):
    lengths = _lengths(tokenizer)
    assert lengths[0] == lengths[1] == lengths[3] != lengths[2]  # what the facts are for
    out = files / "run"
    measured = []
    real = dataset_graphs.measure_faithfulness

    def interrupted(*args, **kwargs):
        measured.append(args[3].prompt)
        if len(measured) == 2:  # killed while the second fact's curve is measured
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_graphs, "measure_faithfulness", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(files, model, tokenizer, out, graph_faithfulness=FAITH)
    first = list(read_jsonl(out / GRAPHS))
    assert [r["fact"] for r in first] == ["f0"]  # the first curve is kept, nothing half-written
    measured.clear()
    monkeypatch.setattr(dataset_graphs, "measure_faithfulness",
                        lambda *a, **k: measured.append(a[3].prompt) or real(*a, **k))
    result = _run(files, model, tokenizer, out, graph_faithfulness=FAITH)
    assert FACTS[0]["prompt"] not in measured and len(measured) == 2  # f1 and f3; f2 has none
    rows = {r["fact"]: r for r in read_jsonl(out / GRAPHS)}
    assert rows["f0"] == first[0]  # not recomputed, not lost
    assert sorted(rows) == ["f0", "f1", "f2", "f3"]
    assert rows["f2"]["faithfulness"] is None
    assert "no other kept fact has a" in rows["f2"]["faithfulness_skipped"]
    partners = {fact: rows[fact]["faithfulness"]["counterfactual"] for fact in ("f0", "f1", "f3")}
    assert partners == {"f0": "f1", "f1": "f3", "f3": "f1"}

    # each row's curve is faithfulness() on the saved graph, patched from its partner's prompt
    # with its partner's answer as the foil; the saved graph carries the same curve
    by_id = {f["id"]: f for f in FACTS}
    for fact in ("f0", "f1"):
        row = rows[fact]
        graph = AttributionGraph.load(out / "graphs" / f"{row['index']}.safetensors")
        partner = by_id[partners[fact]]
        foil = tokenizer(" " + partner["attribute"], add_special_tokens=False)["input_ids"][0]
        assert foil != int(graph.target["token"])
        curve = faithfulness(model, tokenizer, load_transcoder(files / "clt"), graph,
                             partner["prompt"], foil=foil, settings=FAITH)
        assert row["faithfulness"]["curve"]["f"] == pytest.approx(curve.f, abs=1e-9)
        assert row["faithfulness"]["cpr"] == pytest.approx(curve.cpr, abs=1e-9)
        assert graph.metadata["faithfulness"]["cpr"] == row["faithfulness"]["cpr"]

    # the aggregate: per fact, and the mean over the facts with a curve, by hand
    faith = result.graphs["faithfulness"]
    per_fact = {p["fact"]: p["faithfulness"] for p in result.graphs["per_fact"]}
    assert per_fact["f2"]["cpr"] is None and per_fact["f2"]["skipped"].startswith("no other")
    scored = ["f0", "f1", "f3"]
    for key in ("cpr", "cmd"):
        values = [rows[f]["faithfulness"][key] for f in scored]
        assert [per_fact[f][key] for f in scored] == values
        assert faith[key]["mean"] == pytest.approx(float(np.mean(values)), abs=1e-12)
        assert faith[key]["median"] == pytest.approx(float(np.median(values)), abs=1e-12)
        low, high = faith[key]["ci"]
        assert min(values) - 1e-12 <= low <= faith[key]["mean"] <= high <= max(values) + 1e-12
        floor = [float(np.mean(rows[f]["faithfulness"][f"random_{key}"])) for f in scored]
        assert faith[f"random_{key}"]["mean"] == pytest.approx(float(np.mean(floor)), abs=1e-12)
    assert (faith["n_facts"], faith["n_skipped"]) == (3, 1)
    assert faith["skipped"][0]["fact"] == "f2"
    jsonschema.validate(json.loads(result.to_json()), aggregate_schema())
    assert "[graphs faithfulness] 3 facts: CPR mean" in result.summary()

    # a resume with other curve settings, or without curves, is refused
    with pytest.raises(ManifestMismatchError):
        _run(files, model, tokenizer, out)
    with pytest.raises(ManifestMismatchError):
        _run(files, model, tokenizer, out, graph_faithfulness=FaithfulnessSettings(
            sizes=(10.0, 50.0, 100.0), draws=3))


def test_the_api_refuses_what_it_cannot_measure(files, model, tokenizer, tmp_path):
    with pytest.raises(InputError, match="metric: the logit difference's foil"):
        _run(files, model, tokenizer, tmp_path / "a",
             graph_faithfulness=FaithfulnessSettings(ablation="zero"))
    records, _ = read_records(files / "facts.jsonl")
    with pytest.raises(InputError, match="graph_faithfulness: a graph's curve needs the graph"):
        trace_dataset(model, tokenizer, records, out=tmp_path / "b", progress=False,
                      graph_faithfulness=FAITH)
    # only facts of different lengths: none has a counterfactual
    with pytest.raises(InputError, match="none of the 2 facts has one"):
        trace_dataset(model, tokenizer, read_records(files / "facts.jsonl")[0][1:3],
                      out=tmp_path / "c", kinds=("residual",), seeds=1, known="none",
                      progress=False, transcoder=load_transcoder(files / "clt"),
                      graph_faithfulness=FAITH)


@pytest.mark.parametrize("flags, message", [
    (["--ablation", "zero"], "error: --ablation is read only with --faithfulness"),
    # the graphs' curve flags, with --faithfulness (the traces' curves) but no graph
    (["--faithfulness", "--sizes", "10,50"], "error: --sizes is read only with --graphs"),
    (["--graphs", "--clt", "CLT", "--ablation", "zero"],
     "error: --ablation is read only with --faithfulness"),
    (["--graphs", "--clt", "CLT", "--faithfulness", "--ablation", "mean"],
     "error: --metric: the logit difference's foil"),
    (["--graphs", "--clt", "CLT", "--faithfulness", "--sizes", "0,10"],
     "error: --sizes: sizes must be percentages in (0, 100]"),
])
def test_the_command_line_refuses_in_one_line(files, tmp_path, capsys, flags, message):
    argv = ["dataset", "--data", str(files / "facts.jsonl"), "--model", str(files / "tiny"),
            "--out", str(tmp_path / "o")]
    assert main(argv + [str(files / "clt") if f == "CLT" else f for f in flags]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(message), err


def test_the_command_line_measures_the_traces_and_the_graphs(files, tmp_path, capsys):
    """``--faithfulness --graphs``: one flag, the faithfulness of everything the run builds:
    each trace's curves (faithfulness.jsonl, .json) and each graph's (graphs.jsonl)."""
    out = tmp_path / "cli"
    assert main(["dataset", "--data", str(files / "facts.jsonl"), "--model", str(files / "tiny"),
                 "--graphs", "--clt", str(files / "clt"), "--faithfulness", "--ablation", "mean",
                 "--metric", "prob", "--sizes", "50,100", "--draws", "1", "--kinds", "residual",
                 "--faith-sizes", "10,100", "--faith-top", "1", "--faith-draws", "1",
                 "--seeds", "1", "--known", "none", "--limit", "3", "--boot", "50",
                 "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[graphs faithfulness] 3 facts" in printed
    assert "trace faithfulness over facts" in printed
    traced = list(read_jsonl(out / "faithfulness.jsonl"))  # the traces' curves, by their flags
    assert sorted((r["fact"], r["kind"]) for r in traced) == [
        (f["id"], "residual") for f in FACTS[:3]]
    assert all(r["sizes"] == [10.0, 100.0] and len(r["sufficiency"]) == 2 for r in traced)
    assert json.loads((out / "faithfulness.json").read_text())["n_facts"] == {"residual": 3}
    faith = json.loads((out / "aggregate.json").read_text())["graphs"]["faithfulness"]
    assert faith["n_facts"] == 3 and faith["n_skipped"] == 0  # the mean: over the other facts
    rows = list(read_jsonl(out / GRAPHS))
    for row in rows:
        assert row["faithfulness"]["counterfactual"] is None
        others = [f["id"] for f in FACTS[:3] if f["id"] != row["fact"]]
        assert sorted(row["faithfulness"]["reference"]) == others
    assert faith["cpr"]["mean"] == pytest.approx(
        float(np.mean([r["faithfulness"]["cpr"] for r in rows])), abs=1e-12)


def test_a_fact_whose_curve_is_undefined_is_recorded_and_the_run_goes_on(files, model,
                                                                          tokenizer, monkeypatch):
    """faithfulness() refuses a curve that is rounding over rounding (UndefinedCurveError);
    in a dataset run that is the fact's, not the run's: its row says why, the other facts get
    their curves, a rerun does not try it again (it stopped the whole run)."""
    from pyvene_causaltrace.errors import UndefinedCurveError

    real, tried = dataset_graphs.measure_faithfulness, []

    def undefined_for_f1(*args, **kwargs):
        tried.append(args[3].prompt)
        if args[3].prompt == FACTS[1]["prompt"]:
            raise UndefinedCurveError("graph: the empty circuit scores as the full model does")
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_graphs, "measure_faithfulness", undefined_for_f1)
    out = files / "undefined"
    _run(files, model, tokenizer, out, graph_faithfulness=FAITH)
    rows = {r["fact"]: r for r in read_jsonl(out / GRAPHS)}
    assert rows["f1"]["faithfulness"] is None
    assert rows["f1"]["faithfulness_skipped"].startswith("graph: the empty circuit")
    assert rows["f0"]["faithfulness"]["cpr"] is not None and rows["f3"]["faithfulness"]
    tried.clear()
    _run(files, model, tokenizer, out, graph_faithfulness=FAITH)
    assert tried == []
