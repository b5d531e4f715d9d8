"""Dataset runs with attribution graphs (``dataset --graphs --clt DIR``): one graph row per
fact, the graphs' influence by token role x layer beside the AIE, resume (kill -9 included) and
merged shards equal to an uninterrupted run, manifests that refuse another transcoder, the
command line's flags and the aggregate's JSON schema (tiny models, fixture CLTs)."""

from __future__ import annotations

import json
import signal
import time

import jsonschema
import numpy as np
import pytest
from _support.models import make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_dataset import tiny_records, write_jsonl
from test_dataset_faults import _cli_process

import pyvene_causaltrace.cli.dataset as cli_dataset
import pyvene_causaltrace.dataset.run as dataset_run
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.crosscheck.sites import SITE_PARTS, site_influence
from pyvene_causaltrace.dataset import (
    DatasetResult,
    GraphSettings,
    aggregate_graphs,
    aggregate_schema,
    merge_shards,
    read_records,
    trace_dataset,
)
from pyvene_causaltrace.dataset.graph_aggregate import TraceGrids
from pyvene_causaltrace.dataset.run import load_dataset_result
from pyvene_causaltrace.dataset.store import GRAPHS, ROW_FIELDS, read_jsonl
from pyvene_causaltrace.errors import (
    DamagedFileError,
    InputError,
    ManifestMismatchError,
    TranscoderMismatchError,
)
from pyvene_causaltrace.tracing.roles import role_positions
from pyvene_causaltrace.tracing.tracer import Tracer
from pyvene_causaltrace.transcoders import load_transcoder

N_LAYERS, KINDS, SEEDS, WINDOW = 4, ("residual", "mlp"), 2, 2


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """A tiny Llama and a facts file on disk, and two fixture CLTs of its shape (and one of
    another depth)."""
    root = tmp_path_factory.mktemp("graphs")
    make_tiny_model("llama", n_layers=N_LAYERS, init=0.2).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    write_jsonl(root / "facts.jsonl", tiny_records(6))
    write_clt(root / "clt", random_clt_tensors(N_LAYERS, 32, 48, threshold=0.1))
    write_clt(root / "clt-other", random_clt_tensors(N_LAYERS, 32, 48, seed=1, threshold=0.1))
    write_clt(root / "clt-3", random_clt_tensors(3, 32, 48, threshold=0.1))
    return root


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", n_layers=N_LAYERS, init=0.2)


def _run(files, model, tokenizer, out, clt="clt", **options):
    records, _ = read_records(files / "facts.jsonl")
    transcoder = load_transcoder(files / clt) if clt else None
    return trace_dataset(model, tokenizer, records, out=out, kinds=KINDS, seeds=SEEDS,
                         window=WINDOW, known="none", progress=False, n_boot=100,
                         transcoder=transcoder, **options)


@pytest.fixture(scope="module")
def reference(files, model, tokenizer):
    """An uninterrupted API run with graphs: (directory, result)."""
    out = files / "reference"
    return out, _run(files, model, tokenizer, out)


def graph_rows(out) -> list[dict]:
    return list(read_jsonl(out / GRAPHS))


def without_seconds(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def comparable(result: DatasetResult) -> dict:
    """The aggregate as JSON data, without the manifest (a merge marks its own)."""
    data = json.loads(result.to_json())
    data.pop("manifest")
    return data


# ---------------------------------------------------------------------- rows and aggregate

@pytest.mark.numerics
def test_one_graph_row_per_fact_and_the_aggregate(reference, tmp_path):
    out, result = reference
    rows = graph_rows(out)
    assert [row["index"] for row in rows] == list(range(6))
    assert set(ROW_FIELDS[GRAPHS]) <= set(rows[0])
    traces = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert len(traces) == 6 * len(KINDS) * SEEDS
    for row in rows:
        trace = next(t for t in traces if t["index"] == row["index"])
        assert row["tokens"] == trace["tokens"] and row["subject_range"] == trace["subject_range"]
        assert row["answer"] == trace["answer"] == " France"
        assert row["closure"] < 1e-4 and row["n_explored"] == row["n_features"] > 0
        grids = {part: np.array(row["influence"][part]) for part in SITE_PARTS}
        assert grids["all"].shape == (N_LAYERS, len(row["tokens"]))
        assert np.allclose(grids["all"], grids["features"] + grids["errors"], atol=1e-12)
        assert 0 < grids["all"].sum() <= 1 + 1e-9  # a share of every source node's influence

    graphs = result.graphs
    assert graphs["n_facts"] == 6 and graphs["parts"] == list(SITE_PARTS)
    assert set(graphs["spearman"]) == {"residual", "mlp"}
    for summary in graphs["spearman"].values():
        assert summary["n_facts"] + summary["n_undefined"] == 6
        assert -1 <= summary["ci"][0] <= summary["mean"] <= summary["ci"][1] <= 1
    assert graphs["quality"]["closure_max"] == max(row["closure"] for row in rows)
    frame = result.graph_dataframe()
    present = sum(n > 0 for n in graphs["n_role_facts"])  # a role no fact has: no rows
    assert len(frame) == len(SITE_PARTS) * present * N_LAYERS
    assert set(frame.columns) >= {"part", "role", "layer", "influence", "ci_low", "ci_high"}
    assert "[graphs vs residual] Spearman over" in result.summary()
    # JSON round trip, reading again, and the figures with their graph panels
    text = result.to_json()
    assert DatasetResult.from_json(text).to_json() == text
    assert load_dataset_result(out, n_boot=100).to_json() == text
    titles = [ax.get_title() for ax in result.plot(tmp_path / "figure1.png").axes
              if ax.get_title()]
    assert len(titles) == len(KINDS) + 1 and titles[0] == "residual: AIE over 6 facts"
    assert titles[-1] == "graph: influence share over 6 facts"
    curves = result.plot_curves(tmp_path / "curves.png")
    assert curves.axes[-1].get_title() == "graph: MLP features + errors, 6 facts"
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_a_row_holds_the_graph_its_fact_gives(reference, files, model, tokenizer):
    """The stored grids are those of the fact's graph built directly (same prompt, answer and
    target as the trace scores)."""
    out, _ = reference
    row = graph_rows(out)[1]
    screen = next(line for line in read_jsonl(out / "screen.jsonl") if line["index"] == 1)
    graph = attribute(model, tokenizer, load_transcoder(files / "clt"), screen["prompt"],
                      screen["target"])
    for part in SITE_PARTS:
        assert np.array_equal(np.array(row["influence"][part]),
                              site_influence(graph, part, share=True))
    assert row["n_features"] == graph.n_features and row["closure"] == graph.closure.relative


def test_role_aggregation_and_spearman_equal_a_hand_computation(reference):
    """One fact: each role's curve is the mean of the grid over the role's positions; two
    facts: the mean of their curves; Spearman of the graph's grid and the mean IE over the
    cells from the subject on (the mlp side summed over each restore's window)."""
    out, result = reference
    rows = graph_rows(out)
    one = aggregate_graphs(rows[:1], n_layers=N_LAYERS, window=WINDOW, n_boot=50)
    grid = np.array(rows[0]["influence"]["all"])
    buckets = role_positions(tuple(rows[0]["subject_range"]), grid.shape[1])
    for r, role in enumerate(result.roles):
        got = np.array(one["influence"]["all"][r], dtype=float)
        if not buckets[role]:
            assert np.isnan(got).all() and one["n_role_facts"][r] == 0
            continue
        assert np.array_equal(got, grid[:, buckets[role]].mean(1))
        # one fact: no interval (a bootstrap of one value resamples only to itself)
        assert np.isnan(np.array(one["ci_low"]["all"][r], dtype=float)).all()
    last = result.roles.index("Last token")
    by_hand = np.mean([np.array(row["influence"]["errors"])[:, -1] for row in rows[:2]], axis=0)
    two = aggregate_graphs(rows[:2], n_layers=N_LAYERS, window=WINDOW, n_boot=50)
    assert np.allclose(two["influence"]["errors"][last], by_hand, rtol=0, atol=1e-15)

    traces = [json.loads(line) for line in (out / "results.jsonl").open()]
    fact = result.graphs["per_fact"][0]
    start = rows[0]["subject_range"][0]
    for kind in KINDS:
        ie = np.mean([np.array(t["restored"]) - t["corrupt"] for t in traces
                      if t["index"] == 0 and t["kind"] == kind], axis=0)
        side = grid if kind == "residual" else np.stack(
            [grid[max(0, layer - 1):layer + 1].sum(0) for layer in range(N_LAYERS)])
        expected = spearmanr(side[:, start:].ravel(), ie[:, start:].ravel())
        assert abs(fact["spearman"][kind] - expected) < 1e-12, kind


def test_the_aggregate_ignores_row_order_and_refuses_disagreeing_twins(reference):
    out, result = reference
    rows = graph_rows(out)
    manifest = json.loads((out / "manifest.json").read_text())

    def aggregate(graph_rows):
        traces = TraceGrids([row["index"] for row in graph_rows], manifest["seeds"])
        for _ in traces.watch(reversed(list(read_jsonl(out / "results.jsonl")))):
            pass
        return aggregate_graphs(graph_rows, n_layers=N_LAYERS, kinds=KINDS, traces=traces,
                                window=WINDOW, n_boot=100)

    shuffled = aggregate(rows[::-1] + [{**rows[2], "seconds": 99.0}])  # a twin may differ in time
    assert json.dumps(shuffled) == json.dumps(result.graphs)
    twin = {**rows[2], "closure": rows[2]["closure"] * 2}
    with pytest.raises(InputError, match="two graph rows with different values"):
        aggregate(rows + [twin])


# ------------------------------------------------------------------------------ resume

def test_a_finished_run_computes_no_graph_and_a_missing_graph_alone_is_built(
        reference, files, model, tokenizer, tmp_path, monkeypatch):
    out, result = reference
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("manifest.json", "screen.jsonl", "results.jsonl", GRAPHS):
        (copy / name).write_bytes((out / name).read_bytes())
    calls = []
    real_row = dataset_run.graph_row

    def counted(*args, **kwargs):
        calls.append(args[3]["fact"])
        return real_row(*args, **kwargs)

    def no_trace(*_args, **_kwargs):
        raise AssertionError("a finished trace was traced again")

    monkeypatch.setattr(dataset_run, "graph_row", counted)
    monkeypatch.setattr(Tracer, "trace", no_trace)
    again = _run(files, model, tokenizer, copy)
    assert calls == [] and again.to_json() == result.to_json()
    # traces done, the last graph missing (and half of it written): only that graph is built
    lines = (out / GRAPHS).read_text().splitlines()
    (copy / GRAPHS).write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1][:50])
    again = _run(files, model, tokenizer, copy)
    assert calls == ["f5"]
    assert without_seconds(graph_rows(copy)) == without_seconds(graph_rows(out))
    assert again.to_json() == result.to_json()


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties given their mean rank (Spearman's convention)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    _, group = np.unique(values, return_inverse=True)
    return (np.bincount(group, ranks) / np.bincount(group))[group]


def spearmanr(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's correlation by hand: Pearson's of the average ranks."""
    return float(np.corrcoef(_average_ranks(a), _average_ranks(b))[0, 1])


@pytest.mark.process
def test_resume_after_kill_9_gives_the_uninterrupted_aggregate(files, tmp_path):
    """``kill -9`` mid-run, then a rerun: the rows, the graph rows (their timings aside) and
    aggregate.json (graphs included) equal an uninterrupted run's, made by the same process
    after the rerun."""
    n_facts = 8
    write_jsonl(tmp_path / "facts.jsonl", tiny_records(n_facts))

    def argv(out):
        return ["dataset", "--model", str(files / "tiny"), "--data", str(tmp_path / "facts.jsonl"),
                "--known", "none", "--kinds", ",".join(KINDS), "--seeds", str(SEEDS),
                "--window", str(WINDOW), "--boot", "20", "--graphs", "--clt", str(files / "clt"),
                "--out", str(out)]

    killed = tmp_path / "killed"
    process = _cli_process(argv(killed))
    graphs, deadline = killed / GRAPHS, time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if graphs.exists() and graphs.read_bytes().count(b"\n") >= 2:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert 2 <= graphs.read_bytes().count(b"\n") < n_facts
    again = _cli_process(argv(killed), argv(tmp_path / "full"))
    assert again.wait(timeout=300) == 0, again.stderr.read()
    full = tmp_path / "full"
    assert (killed / "results.jsonl").read_bytes() == (full / "results.jsonl").read_bytes()
    assert without_seconds(graph_rows(killed)) == without_seconds(graph_rows(full))
    assert len(graph_rows(full)) == n_facts
    aggregate = (killed / "aggregate.json").read_text()
    assert aggregate == (full / "aggregate.json").read_text()
    assert json.loads(aggregate)["graphs"]["n_facts"] == n_facts
    assert (killed / "graphs.csv").read_text() == (full / "graphs.csv").read_text()


def test_shards_merge_to_the_single_process_aggregate(files, model, tokenizer, tmp_path,
                                                      reference):
    _, single = reference
    out = tmp_path / "sharded"
    for rank in range(2):
        _run(files, model, tokenizer, out, shard=(rank, 2),
             graph_options=GraphSettings(save=True))
    merged = merge_shards(out, 2, n_boot=100)
    assert comparable(merged) == comparable(single)
    assert sorted(p.name for p in (out / "graphs").iterdir()) == \
        [f"{i}.safetensors" for i in range(6)]
    assert [row["index"] for row in graph_rows(out)] == [0, 2, 4, 1, 3, 5]


# --------------------------------------------------------------------------- manifests

def test_another_transcoder_or_settings_or_no_graphs_is_refused(reference, files, model,
                                                                tokenizer, tmp_path):
    out = tmp_path / "run"
    _run(files, model, tokenizer, out)
    with pytest.raises(ManifestMismatchError, match="transcoder"):
        _run(files, model, tokenizer, out, clt="clt-other")
    with pytest.raises(ManifestMismatchError, match="max_feature_nodes"):
        _run(files, model, tokenizer, out, graph_options=GraphSettings(max_feature_nodes=5))
    with pytest.raises(ManifestMismatchError, match="a run without graphs"):
        _run(files, model, tokenizer, out, clt=None)
    plain = tmp_path / "plain"
    _run(files, model, tokenizer, plain, clt=None)
    with pytest.raises(ManifestMismatchError, match="a run without graphs"):
        _run(files, model, tokenizer, plain)
    assert not (plain / GRAPHS).exists()


def test_a_transcoder_of_another_model_is_refused_before_anything_is_written(
        files, model, tokenizer, tmp_path):
    with pytest.raises(TranscoderMismatchError, match="3 layers"):
        _run(files, model, tokenizer, tmp_path / "run", clt="clt-3")
    assert not (tmp_path / "run").exists()
    with pytest.raises(InputError, match="graph_options without a transcoder"):
        _run(files, model, tokenizer, tmp_path / "run", clt=None,
             graph_options=GraphSettings())
    with pytest.raises(InputError, match="graph target"):
        _run(files, model, tokenizer, tmp_path / "run",
             graph_options=GraphSettings(target="difference"))


def test_a_damaged_graph_row_is_named(reference, files, model, tokenizer, tmp_path):
    out, _ = reference
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("manifest.json", "screen.jsonl", "results.jsonl"):
        (copy / name).write_bytes((out / name).read_bytes())
    rows = graph_rows(out)
    del rows[1]["influence"]
    write_jsonl(copy / GRAPHS, rows)
    with pytest.raises(DamagedFileError, match=r"graphs.jsonl, line 2, is damaged: no "
                                               r"'influence' field"):
        load_dataset_result(copy, n_boot=50)


# --------------------------------------------------------------------------- command line

def dataset_argv(files, out, *extra) -> list[str]:
    return ["dataset", "--model", str(files / "tiny"), "--data", str(files / "facts.jsonl"),
            "--known", "none", "--kinds", ",".join(KINDS), "--seeds", str(SEEDS),
            "--window", str(WINDOW), "--boot", "50", "--out", str(out), *extra]


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the mistake was found")
    monkeypatch.setattr(cli_dataset, "load_model", refuse)


@pytest.mark.parametrize("extra, message", [
    (["--graphs"], "--graphs needs a transcoder: --clt DIR"),
    (["--clt", "DIR"], "--clt is read only with --graphs"),
    (["--max-feature-nodes", "5"], "--max-feature-nodes is read only with --graphs"),
    (["--save-graphs"], "--save-graphs is read only with --graphs"),
    (["--graphs", "--clt", "DIR", "--max-feature-nodes", "-1"], "--max-feature-nodes"),
    (["--graphs", "--clt", "DIR", "--graph-memory-mb", "0"], "--graph-memory-mb"),
    (["--graphs", "--clt", "{root}/no-such-clt"], "no-such-clt"),
])
def test_graph_flags_are_checked_before_the_model_loads(files, tmp_path, capsys, no_model_load,
                                                        extra, message):
    extra = [e.replace("{root}", str(files)) for e in extra]
    code, err = run_cli(dataset_argv(files, tmp_path / "run", *extra), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert message in errors[0], errors[0]
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_transcoder_that_does_not_fit_in_one_line(files, tmp_path, capsys):
    code, err = run_cli(dataset_argv(files, tmp_path / "run", "--graphs", "--clt",
                                     str(files / "clt-3")), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "3 layers" in errors[0] and "the model has 4 layers" in errors[0]
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_cli_writes_graph_outputs_and_aggregate_rewrites_them(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(dataset_argv(files, out, "--graphs", "--clt", str(files / "clt"),
                             "--max-feature-nodes", "20")) == 0
    printed = capsys.readouterr().out
    assert "[graphs] 6 facts" in printed and "graphs.csv" in printed
    for name in ("aggregate.json", "graphs.csv", "aie.csv", "figure1.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "aggregate.json").read_text())
    assert data["manifest"]["graphs"]["max_feature_nodes"] == 20
    assert all(row["n_explored"] <= 20 for row in graph_rows(out))
    jsonschema.validate(data, aggregate_schema(), cls=jsonschema.Draft202012Validator)
    table = (out / "graphs.csv").read_text().splitlines()
    assert table[0] == "part,role,layer,depth,influence,ci_low,ci_high,n_facts"
    present = sum(n > 0 for n in data["graphs"]["n_role_facts"])  # absent roles: no rows
    assert 0 < present < 7 and len(table) == 1 + len(SITE_PARTS) * present * N_LAYERS
    before = (out / "aggregate.json").read_text()
    (out / "aggregate.json").unlink()
    (out / "graphs.csv").unlink()
    assert main(["aggregate", str(out), "--boot", "50"]) == 0
    assert (out / "aggregate.json").read_text() == before
    assert (out / "graphs.csv").exists()


# --------------------------------------------------------------------------------- schema

def test_the_schema_takes_real_outputs_and_refuses_broken_ones(reference, files, model,
                                                               tokenizer, tmp_path):
    schema = aggregate_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    _, with_graphs = reference
    plain = _run(files, model, tokenizer, tmp_path / "plain", clt=None)
    assert plain.graphs is None
    for result in (with_graphs, plain):
        validator.validate(json.loads(result.to_json()))
    good = json.loads(with_graphs.to_json())

    def broken(edit) -> dict:
        data = json.loads(json.dumps(good))
        edit(data)
        return data

    for bad in (broken(lambda d: d.pop("aie")),
                broken(lambda d: d.update(n_layers="4")),
                broken(lambda d: d["effects"]["residual"].update(total_effect="0.1")),
                broken(lambda d: d["graphs"].pop("spearman")),
                broken(lambda d: d["graphs"]["influence"].update(all="grid")),
                broken(lambda d: d["graphs"]["per_fact"][0].update(index=1.5)),
                broken(lambda d: d["graphs"]["quality"].pop("closure_max")),
                broken(lambda d: d.update(extra=1))):
        assert not validator.is_valid(bad)


def test_the_bos_rule_is_in_the_manifest(reference, files, model, tokenizer, tmp_path, capsys):
    """Each graph's position-0 rule is part of the run: another rule, or a run written before
    the rule existed (no ``bos`` in its manifest: its graphs took position 0 as BOS on every
    tokenizer), is refused on resume, never mixed."""
    out, _ = reference
    assert json.loads((out / "manifest.json").read_text())["graphs"]["bos"] == "auto"
    run = tmp_path / "run"
    _run(files, model, tokenizer, run, limit=2)
    with pytest.raises(ManifestMismatchError, match="bos"):
        _run(files, model, tokenizer, run, limit=2, graph_options=GraphSettings(bos="always"))
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["graphs"]["bos"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestMismatchError, match="bos"):
        _run(files, model, tokenizer, run, limit=2)
    with pytest.raises(InputError, match="bos must be one of"):
        GraphSettings(bos="first")
    # the rule reaches each graph: "always" on this tokenizer (it adds no BOS) leaves position
    # 0 out of the spliced positions, as the same call of attribute does
    always = tmp_path / "always"
    _run(files, model, tokenizer, always, limit=1,
         graph_options=GraphSettings(bos="always", save=True))
    saved = next((always / "graphs").iterdir())
    from pyvene_causaltrace.attribution import AttributionGraph
    assert AttributionGraph.load(saved).from_position == 1
    assert main(["dataset", "--data", str(files / "facts.jsonl"), "--bos", "never",
                 "--out", str(tmp_path / "cli")]) == 2
    assert "--bos is read only with --graphs" in capsys.readouterr().err
