"""A trace's faithfulness (``tracing/faithfulness.py``): k = 0 and every cell are the noised and
clean runs exactly, each point equals a batch-1 forward with plain torch hooks, refusals, the
result's round trip; on SmolLM2 the reversed ranking falls below the trace's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from reference import _all, add_at, corrupted_states, recipe_noise, set_positions

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.cli.trace import faithfulness_settings
from pyvene_causaltrace.dataset import read_records, trace_dataset
from pyvene_causaltrace.dataset.faithfulness import DatasetFaithfulness, load_faithfulness
from pyvene_causaltrace.errors import InputError, ManifestMismatchError
from pyvene_causaltrace.models import get_adapter
from pyvene_causaltrace.tracing import Tracer
from pyvene_causaltrace.tracing.engine import get_kind
from pyvene_causaltrace.tracing.faithfulness import (
    TraceFaithfulness,
    TraceFaithfulnessSettings,
    circuit_probs,
    trace_faithfulness,
)


@pytest.fixture(scope="module")
def traced(tokenizer):
    """``traced(arch)``: a tiny model's tracer (2 seeds) and its residual and mlp traces."""
    made = {}

    def get(arch: str):
        if arch not in made:
            model = make_tiny_model(arch, init=0.2)
            tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2, window=2)
            made[arch] = (model, tracer, {kind: tracer.trace(kind, progress=False)
                                          for kind in ("residual", "mlp")})
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_no_cell_is_the_noised_run_and_every_cell_the_clean_run_exactly(traced, arch):
    _, tracer, _ = traced(arch)
    engine = tracer.engine
    n = engine.n_layers * engine.seq_len
    circuits = torch.stack([torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])
    clean = engine.clean_probs[engine.answer_id].expand(len(engine.seeds))
    noised = engine.corrupt_probs[:, engine.answer_id]
    suff, nec, forwards = circuit_probs(engine, get_kind("residual"), None, circuits,
                                        rows_per_forward=3)
    assert forwards == 0  # both are known without a forward, as the engine's corners are
    assert torch.equal(suff[0], noised) and torch.equal(nec[0], clean)
    assert torch.equal(suff[1], clean) and torch.equal(nec[1], noised)
    # and the forwards give them too (float32 rounding of another batch size apart)
    for rows in (3, 64):
        suff, nec, forwards = circuit_probs(engine, get_kind("residual"), None, circuits,
                                            rows_per_forward=rows, shortcut=False)
        assert forwards == -(-4 * len(engine.seeds) // rows)
        for got, want in ((suff[0], noised), (nec[0], clean), (suff[1], clean),
                          (nec[1], noised)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _reference(model, engine, kind, window, cells, seed_index: int) -> tuple[float, float]:
    """P(answer) with ``cells`` restored in the seed's noised run, and noised in the clean run:
    batch 1, plain torch hooks, recipe noise, states captured by plain hooks."""
    adapter, n_layers = get_adapter(model), bind(model).n_layers
    seed = engine.seeds[seed_index]
    scale, sigma = engine.noise.config()["scale"], engine.noise.config()["sigma"]
    paths = [adapter.module_path(kind.restore, layer) for layer in range(n_layers)]
    clean = corrupted_states(model, engine.ids, seed, [], scale, sigma, paths)  # no noise
    noised = corrupted_states(model, engine.ids, seed, engine.noise_positions, scale, sigma,
                              paths)
    sites = {(layer, position) for layer, position in cells
             for layer in engine.restore_layers(kind, layer, window or 1)}

    def run(states: dict, noise: bool) -> float:
        edits = [(paths[layer], set_positions(states[paths[layer]], [position]))
                 for layer, position in sorted(sites)]
        if noise:
            delta = recipe_noise(seed, len(engine.noise_positions), bind(model).d_model,
                                 scale, sigma)
            edits.insert(0, (adapter.embed, add_at(delta, list(engine.noise_positions))))
        with torch.no_grad(), _all(model, edits):
            logits = model(input_ids=engine.ids).logits
        return float(logits[0, -1].double().softmax(-1)[engine.answer_id])

    return run(clean, True), run(noised, False)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("kind, cells", [("residual", "subject"), ("mlp", "all")])
def test_each_point_equals_plain_hooks_batch_one(traced, arch, kind, cells):
    # every residual circuit over all cells holds the last layer's last position (the top
    # cell): known without a forward; the subject's cells make it run forwards
    model, tracer, results = traced(arch)
    result = results[kind]
    curve = trace_faithfulness(tracer, result, sizes=(10, 50), top=(1, 3), draws=1,
                               rows_per_forward=5, cells=cells)
    assert curve.forwards > 0
    engine = tracer.engine
    n_pos = engine.seq_len
    total = curve.clean_prob - np.asarray(curve.corrupt_probs)
    for point, k in enumerate(curve.counts):
        cells = [(c // n_pos, c % n_pos) for c in curve.ranking[:k]]
        for s in range(len(engine.seeds)):
            restored, noised = _reference(model, engine, get_kind(kind), result.window, cells, s)
            want_f = (restored - curve.corrupt_probs[s]) / total[s]
            want_lost = (curve.clean_prob - noised) / total[s]
            assert abs(curve.sufficiency_per_seed[s][point] - want_f) * abs(total[s]) < 1e-6
            assert abs(curve.necessity_per_seed[s][point] - want_lost) * abs(total[s]) < 1e-6


def test_curve_reads_the_ranking_and_the_result_round_trips(traced, tmp_path):
    _, tracer, results = traced("llama")
    result = results["residual"]
    curve = trace_faithfulness(tracer, result, draws=2)
    grid = result.grid("ie").reshape(-1)
    assert np.all(np.diff(grid[curve.ranking]) <= 0)  # best first
    assert curve.counts[-len(curve.settings["top"]):] == [1, 2, 5, 10, 20]
    # every cell restored: the clean run (f = 1), noised: the noised run (lost = 1)
    assert curve.sufficiency[curve.counts.index(curve.n_cells)] == pytest.approx(1, abs=1e-12)
    assert curve.necessity[curve.counts.index(curve.n_cells)] == pytest.approx(1, abs=1e-12)
    assert len(curve.random_sufficiency) == 2 and len(curve.random_cpr) == 2
    # the curve: the seeds' mean P over their mean total effect
    total = curve.clean_prob - np.array(curve.corrupt_probs)
    for name in ("sufficiency", "necessity"):
        shares = np.array(getattr(curve, f"{name}_per_seed"))  # [seed, point]
        np.testing.assert_allclose(getattr(curve, name),
                                   (shares * total[:, None]).mean(0) / total.mean(), atol=1e-12)
    again = TraceFaithfulness.from_json(curve.to_json(tmp_path / "f.json"))
    assert again == curve and json.loads((tmp_path / "f.json").read_text())["kind"] == "residual"
    frame = curve.to_dataframe()
    assert list(frame.k) == curve.counts and frame.in_area.sum() == len(curve.fractions)
    curve.plot(tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    subject = trace_faithfulness(tracer, result, cells="subject", draws=1)
    start, stop = result.subject_range
    assert subject.n_cells == tracer.engine.n_layers * (stop - start)
    assert all(start <= c % len(result.tokens) < stop for c in subject.ranking)
    assert set(subject.top_roles(3)) <= {"First subject token", "Middle subject tokens",
                                         "Last subject token"}


def test_refusals(traced, tokenizer):
    _, tracer, results = traced("llama")
    severed = tracer.trace("severed-mlp", progress=False)
    with pytest.raises(InputError, match="result: a severed-mlp trace"):
        trace_faithfulness(tracer, severed)
    other = Tracer(make_tiny_model("llama", init=0.2), tokenizer, PROMPT, SUBJECT, seeds=3)
    with pytest.raises(InputError, match="not this tracer's trace"):
        trace_faithfulness(other, results["residual"])
    for bad, match in (({"sizes": (0,)}, "sizes"), ({"sizes": (5, 2)}, "increase"),
                       ({"top": (3, 2)}, "top"), ({"draws": 0}, "draws"),
                       ({"cells": "some"}, "cells")):
        with pytest.raises(InputError, match=match):
            TraceFaithfulnessSettings(**bad)


def test_one_size_and_a_noise_that_does_not_move_p_are_refused(traced, tokenizer):
    # one size has no area (CPR 0, CMD 0: a "perfect" CMD); a noise that leaves P(answer) as it
    # is (total effect ~1e-9) made every share rounding over rounding (CPR 0.9, CMD 2e-10)
    for sizes in ((100.0,), (10.0,)):
        with pytest.raises(InputError, match="sizes: CPR and CMD integrate between sizes"):
            TraceFaithfulnessSettings(sizes=sizes)
    model, tracer, results = traced("llama")
    quiet = Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2, window=2, scale=1e-7)
    with pytest.raises(InputError, match="result: the noise barely moves P"):
        trace_faithfulness(quiet, quiet.trace("residual", progress=False), draws=1)
    trace_faithfulness(tracer, results["residual"], draws=1)  # control: the usual noise


@pytest.mark.real_model
def test_reversed_ranking_falls_below_the_trace_on_smollm2(smollm2):
    model, tokenizer = smollm2
    tracer = Tracer(model, tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower",
                    answer=" Paris", seeds=3)
    result = tracer.trace("residual", progress=False)
    # the mirrored trace: every indirect effect negated, so its ranking is the trace's reversed
    mirrored = dataclasses.replace(
        result, restored_probs=2 * result.corrupt_probs[:, None, None] - result.restored_probs)
    for cells in ("all", "subject"):
        curve = trace_faithfulness(tracer, result, cells=cells, draws=2)
        reverse = trace_faithfulness(tracer, mirrored, cells=cells, draws=2)
        assert reverse.cpr < curve.cpr - 0.05
        # over every cell the trace's ranking also beats random ones (its top cells sit at the
        # last position, late); over the subject's cells alone it need not: its top cells are
        # one token's adjacent layers, which carry the same information (the results page)
        assert curve.cpr > max(curve.random_cpr) or cells == "subject"


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    make_tiny_model("llama", init=0.2).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_trace_faithfulness_flag_writes_the_curves(model_dir, tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["trace", "--model", str(model_dir), "--seeds", "2", "--kind", "residual,mlp",
                 "--window", "2", "--no-progress", "--faithfulness", "--faith-draws", "2",
                 "--faith-top", "1,3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "residual trace faithfulness" in printed and "sufficiency CPR" in printed
    for kind in ("residual", "mlp"):
        curve = TraceFaithfulness.from_json((out / f"faithfulness_{kind}.json").read_text())
        assert curve.kind == kind and len(curve.random_cpr) == 2
        assert curve.counts[-2:] == [1, 3]
        assert (out / f"faithfulness_{kind}.csv").exists()
        assert (out / f"faithfulness_{kind}.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--faithfulness", "--kind", "severed-mlp"], "--faithfulness: a severed-mlp trace"),
    (["--faithfulness", "--faith-sizes", "0,50"], "sizes"),
    (["--faithfulness", "--faith-sizes", "100"], "sizes: CPR and CMD integrate between"),
    (["--faithfulness", "--faith-sizes", "5,x"], "--faith-sizes: give numbers"),
    (["--faithfulness", "--faith-top", "3,2"], "top"),
    (["--faith-draws", "3"], "--faithfulness"),
])
def test_trace_faithfulness_refusals_exit_2(model_dir, capsys, args, message):
    assert main(["trace", "--model", str(model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def _facts(tmp_path, n: int):
    subjects = ["The Space Needle", "Miles Davis", "Danielle Darrieux", "The Eiffel Tower"]
    path = tmp_path / "facts.jsonl"
    path.write_text("".join(json.dumps({"id": f"f{i}", "prompt": f"{s} is in the city of",
                                        "subject": s, "attribute": "France"}) + "\n"
                            for i, s in enumerate(subjects[:n])))
    return path


def test_dataset_faithfulness_rows_aggregate_and_resume(tmp_path, tokenizer):
    model = make_tiny_model("llama", init=0.2)
    records, _ = read_records(_facts(tmp_path, 3))
    faith = TraceFaithfulnessSettings(draws=2, top=(1,))
    out = tmp_path / "run"
    trace_dataset(model, tokenizer, records, out=out, known="none", progress=False,
                  n_boot=50, seeds=2, kinds=("residual", "severed-mlp"), faithfulness=faith)
    rows = [json.loads(line) for line in (out / "faithfulness.jsonl").open()]
    assert sorted((r["fact"], r["kind"]) for r in rows) == [(f"f{i}", "residual")
                                                           for i in range(3)]
    assert all(r["n_cells"] == 3 * len(tokenizer(records[r["index"]].prompt)["input_ids"])
               for r in rows)  # every cell of the fact's trace
    for row in rows:
        # the roles split each size's top cells (none at a size of 0 cells)
        assert np.allclose(np.sum(row["roles"], 0), np.array(row["counts"]) > 0)
    agg = load_faithfulness(out, n_boot=50)
    assert agg.kinds == ["residual"] and agg.n_facts == {"residual": 3}
    cpr = np.array([r["cpr"] for r in sorted(rows, key=lambda r: r["index"])])
    assert agg.scores["residual"]["cpr"]["mean"] == pytest.approx(cpr.mean())
    low, high = agg.scores["residual"]["cpr"]["low"], agg.scores["residual"]["cpr"]["high"]
    assert cpr.min() - 1e-12 <= low <= high <= cpr.max() + 1e-12
    assert DatasetFaithfulness.from_json(agg.to_json()) == agg
    assert set(agg.to_dataframe().what) >= {"sufficiency", "necessity", "role:Last token"}
    # a resumed run with the rows written does nothing; a lost row is made again, the same
    (out / "faithfulness.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    trace_dataset(model, tokenizer, records, out=out, known="none", progress=False,
                  n_boot=50, seeds=2, kinds=("residual", "severed-mlp"), faithfulness=faith)
    again = [json.loads(line) for line in (out / "faithfulness.jsonl").open()]
    assert len(again) == 3
    assert {k: v for k, v in again[2].items() if k != "seconds"} == \
        {k: v for k, v in rows[2].items() if k != "seconds"}
    with pytest.raises(ManifestMismatchError):  # other faithfulness settings: another run
        trace_dataset(model, tokenizer, records, out=out, known="none", progress=False,
                      n_boot=50, seeds=2, kinds=("residual", "severed-mlp"),
                      faithfulness=TraceFaithfulnessSettings(draws=3))


def test_dataset_faithfulness_flag(model_dir, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["dataset", "--model", str(model_dir), "--data", str(_facts(tmp_path, 2)),
                 "--known", "none", "--kinds", "residual", "--seeds", "2", "--boot", "50",
                 "--no-progress", "--faithfulness", "--faith-draws", "2", "--out",
                 str(out)]) == 0
    assert "trace faithfulness over facts" in capsys.readouterr().out
    agg = DatasetFaithfulness.from_json((out / "faithfulness.json").read_text())
    assert agg.n_facts == {"residual": 2} and (out / "faithfulness.csv").exists()
    assert main(["dataset", "--model", str(model_dir), "--data", str(_facts(tmp_path, 2)),
                 "--faith-cells", "subject", "--out", str(tmp_path / "e")]) == 2
    assert "--faithfulness" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["trace", "dataset"])
def test_the_flags_defaults_are_the_settings(command):
    extra = ["--data", "x", "--out", "o"] if command == "dataset" else []
    args = build_parser().parse_args([command, *extra, "--faithfulness"])
    assert faithfulness_settings(args) == TraceFaithfulnessSettings()
    args = build_parser().parse_args([command, *extra])
    assert faithfulness_settings(args) is None


def test_dataset_records_a_fact_whose_trace_curve_is_undefined(tmp_path, tokenizer, monkeypatch):
    """A fact whose noise barely moves P(answer) (UndefinedCurveError) gets a row with the
    reason instead of a curve; the run goes on (it stopped), the aggregate counts it apart, a
    rerun does not try it again."""
    import pyvene_causaltrace.dataset.run as dataset_run
    from pyvene_causaltrace.errors import UndefinedCurveError

    real, tried = dataset_run.trace_faithfulness, []

    def undefined_for_f1(tracer, result, **kwargs):
        tried.append(tracer.prompt.text)
        if tracer.prompt.text.startswith("Miles Davis"):
            raise UndefinedCurveError("result: the noise barely moves P(answer)")
        return real(tracer, result, **kwargs)

    monkeypatch.setattr(dataset_run, "trace_faithfulness", undefined_for_f1)
    model = make_tiny_model("llama", init=0.2)
    records, _ = read_records(_facts(tmp_path, 3))
    options = dict(out=tmp_path / "run", known="none", progress=False, n_boot=50, seeds=2,
                   kinds=("residual",), faithfulness=TraceFaithfulnessSettings(draws=2, top=(1,)))
    trace_dataset(model, tokenizer, records, **options)
    rows = {r["fact"]: r for r in map(json.loads, (tmp_path / "run" / "faithfulness.jsonl").open())}
    assert rows["f1"] == {"index": 1, "fact": "f1", "kind": "residual",
                          "skipped": "result: the noise barely moves P(answer)"}
    agg = load_faithfulness(tmp_path / "run", n_boot=50)
    assert agg.n_facts == {"residual": 2} and agg.skipped == {"residual": 1}
    assert "(2 facts, no curve for 1)" in agg.summary()
    assert DatasetFaithfulness.from_json(agg.to_json()) == agg
    tried.clear()
    trace_dataset(model, tokenizer, records, **options)
    assert tried == []
