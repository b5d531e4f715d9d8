"""Dataset runs: ROME's role buckets, records and their errors, aggregation, resume after a
kill, two-process sharding, and the built-in tasks (tiny models; SmolLM2 in
test_real_model_dataset.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _support.data import known_facts
from _support.models import make_tiny_model

from pyvene_causaltrace.dataset import (
    TASKS,
    aggregate_rows,
    bootstrap_interval,
    read_records,
    role_curves,
    trace_dataset,
)
from pyvene_causaltrace.dataset.run import load_dataset_result, target_split
from pyvene_causaltrace.tracing.roles import role_positions

SUBJECTS = ["The Space Needle", "Miles Davis", "Danielle Darrieux", "Toko Yasuda", "Paris",
            "The Eiffel Tower", "The keys", "Two plus three"]
TEMPLATES = ["{} is in the city of", "{} plays the", "The mother tongue of {} is",
             "{} speaks"]


def tiny_records(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        template = TEMPLATES[(i // len(SUBJECTS)) % len(TEMPLATES)]
        rows.append({"id": f"f{i}", "prompt": template.format(subject), "subject": subject,
                     "attribute": "France"})
    return rows


def assert_same_aggregate(a: dict, b: dict) -> None:
    """Bit-identical AIE, intervals and effects (NaN marks roles no fact has)."""
    for key in ("aie", "ci_low", "ci_high"):
        assert a[key].keys() == b[key].keys()
        for kind in a[key]:
            assert np.array_equal(np.array(a[key][kind], dtype=float),
                                  np.array(b[key][kind], dtype=float), equal_nan=True), (key, kind)
    assert a["effects"] == b["effects"] and a["n_facts"] == b["n_facts"]


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# ------------------------------------------------------------------------- role buckets

@pytest.mark.parametrize("layout, seq_len, expected", [
    # subject at the start: (0, 3) in 7 tokens
    ((0, 3), 7, {"Before subject": [], "First subject token": [0],
                 "Middle subject tokens": [1], "Last subject token": [2],
                 "First subsequent token": [3], "Further tokens": [4, 5], "Last token": [6]}),
    # subject in the middle: (2, 5) in 9 tokens
    ((2, 5), 9, {"Before subject": [0, 1], "First subject token": [2],
                 "Middle subject tokens": [3], "Last subject token": [4],
                 "First subsequent token": [5], "Further tokens": [6, 7], "Last token": [8]}),
    # single-token subject: first and last subject token are the same position
    ((1, 2), 6, {"Before subject": [0], "First subject token": [1],
                 "Middle subject tokens": [], "Last subject token": [1],
                 "First subsequent token": [2], "Further tokens": [3, 4], "Last token": [5]}),
    # subject ending right before the last token: that token is also the first subsequent one
    ((0, 4), 5, {"Before subject": [], "First subject token": [0],
                 "Middle subject tokens": [1, 2], "Last subject token": [3],
                 "First subsequent token": [4], "Further tokens": [], "Last token": [4]}),
])
def test_role_buckets_on_hand_made_layouts(layout, seq_len, expected):
    assert role_positions(layout, seq_len) == expected


def test_role_buckets_refuse_a_subject_at_the_last_token():
    with pytest.raises(ValueError, match="before the last"):
        role_positions((3, 5), 5)


def test_role_curves_average_within_a_role_then_nan_for_empty_roles():
    restored = np.arange(2 * 6, dtype=float).reshape(2, 6) / 100  # [layers, positions]
    curves = role_curves(restored, 0.01, (1, 2))
    roles = list(role_positions((1, 2), 6))
    further = roles.index("Further tokens")
    assert np.allclose(curves[further], restored[:, 3:5].mean(1) - 0.01, atol=1e-15)
    assert np.isnan(curves[roles.index("Middle subject tokens")]).all()
    assert np.array_equal(curves[roles.index("First subject token")],
                          curves[roles.index("Last subject token")])


def test_bootstrap_interval_brackets_the_mean_and_ignores_missing():
    rng = np.random.default_rng(1)
    values = rng.normal(0.3, 0.1, size=(200, 2))
    values[:50, 1] = np.nan
    low, high = bootstrap_interval(values, n_boot=500)
    mean = np.nanmean(values, axis=0)
    assert (low < mean).all() and (mean < high).all()
    # the half-width is about 1.96 standard errors
    se = np.nanstd(values, axis=0) / np.sqrt([200, 150])
    assert np.allclose((high - low) / 2, 1.96 * se, rtol=0.2)


# ------------------------------------------------------------------------------ records

def test_project_facts_read_as_known_1000_does():
    from _support.data import PROJECT_FACTS

    records, errors = read_records(PROJECT_FACTS)
    assert len(records) == 1200 and not errors
    assert (records[0].id, records[0].subject, records[0].target) == (
        "0", "Anqui Lake", " Egypt")


def test_known_1000_reads_without_errors():
    records, errors = read_records(known_facts())
    assert len(records) == 1209 and not errors
    first = records[0]
    assert (first.id, first.subject, first.target) == ("0", "Vinson Massif", " Antarctica")


def test_malformed_records_are_named_and_the_run_goes_on(tmp_path, tokenizer):
    good = tiny_records(3)
    path = tmp_path / "facts.jsonl"
    write_jsonl(path, [
        good[0],
        {"id": "no-subject", "prompt": "x is y", "attribute": "z"},
        "{not json",
        {"id": "absent", "prompt": "Paris is nice", "subject": "Rome", "attribute": "Italy"},
        good[1],
        {"id": "f0", "prompt": "dup", "subject": "dup", "attribute": "a"},
        {"id": "at-end", "prompt": "It is Miles Davis", "subject": "Miles Davis",
         "attribute": "France"},
        good[2],
    ])
    records, errors = read_records(path)
    assert [str(e).split(": ", 1)[0] for e in errors] == [
        f"{path}:2 (id no-subject)", f"{path}:3", f"{path}:4 (id absent)", f"{path}:6 (id f0)"]
    assert "'subject'" in errors[0].reason and "does not occur" in errors[2].reason
    model = make_tiny_model("llama")
    result = trace_dataset(model, tokenizer, records, out=tmp_path / "run", kinds=["residual"],
                           seeds=1, known="none", errors=errors, progress=False, n_boot=50)
    assert result.effects["residual"]["n_facts"] == 3
    assert result.screen == {"kept": 3, "malformed": 5}
    screen = [json.loads(line) for line in (tmp_path / "run" / "screen.jsonl").open()]
    at_end = next(line for line in screen if line["fact"] == "at-end")
    assert "last token" in at_end["reason"]


def test_target_whitespace_token_moves_into_the_prompt(smollm2):
    _, tokenizer = smollm2
    assert target_split(tokenizer, "2 + 3 =", " 5")[0] == "2 + 3 = "
    prompt, target_id, n = target_split(tokenizer, "Paris is in", " France")
    assert prompt == "Paris is in" and n == 1
    assert tokenizer.decode([target_id]) == " France"


# ------------------------------------------------------------------ runs and aggregation

def _run(tokenizer, tmp_path, name, n=4, **options):
    model = make_tiny_model("gpt2")
    records, _ = read_records(_facts_file(tmp_path, n))
    return trace_dataset(model, tokenizer, records, out=tmp_path / name, known="none",
                         progress=False, n_boot=100, **options)


def _facts_file(tmp_path, n):
    path = tmp_path / f"facts{n}.jsonl"
    if not path.exists():
        write_jsonl(path, tiny_records(n))
    return path


@pytest.mark.numerics
def test_aggregate_matches_a_direct_computation_and_ignores_row_order(tmp_path, tokenizer):
    result = _run(tokenizer, tmp_path, "run", kinds=["residual", "mlp"], seeds=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").open()]
    assert len(rows) == 4 * 2 * 2
    # direct: AIE of "Last token" for mlp = mean over facts of mean over seeds of IE
    last = result.roles.index("Last token")
    per_fact = {}
    for row in rows:
        if row["kind"] == "mlp":
            ie = np.array(row["restored"])[:, -1] - row["corrupt"]
            per_fact.setdefault(row["index"], []).append(ie)
    direct = np.mean([np.mean(v, axis=0) for v in per_fact.values()], axis=0)
    assert np.allclose(result.aie["mlp"][last], direct, atol=1e-12)
    te = np.mean([r["clean"] - r["corrupt"] for r in rows if r["kind"] == "mlp"])
    assert abs(result.effects["mlp"]["total_effect"] - te) < 1e-12
    shuffled = aggregate_rows(reversed(rows), kinds=["residual", "mlp"], n_boot=100)
    assert_same_aggregate(vars(shuffled), vars(result))
    again = load_dataset_result(tmp_path / "run", n_boot=100)
    assert again.to_json() == result.to_json()


def test_outputs_tables_json_and_figures(tmp_path, tokenizer):
    from pyvene_causaltrace.dataset import DatasetResult

    result = _run(tokenizer, tmp_path, "run", kinds=["residual", "attn"], seeds=1)
    frame = result.to_dataframe()
    assert set(frame.columns) >= {"kind", "role", "layer", "aie", "ci_low", "ci_high"}
    present = sum(n > 0 for n in result.n_facts["residual"])  # a role no fact has: no rows
    assert len(frame) == 2 * present * result.n_layers and not frame["aie"].isna().any()
    peaks = result.peaks()
    assert set(peaks["kind"]) == {"residual", "attn"}
    text = result.to_json()
    assert "NaN" not in text and json.loads(text)["aie"]["residual"][0][0] is None
    back = DatasetResult.from_json(text)
    assert back.to_json() == text
    assert_same_aggregate(vars(back), vars(result))
    result.plot(tmp_path / "fig.png")
    result.plot_curves(tmp_path / "curves.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_limit_stops_the_screen_and_a_finished_run_reruns_as_a_no_op(tmp_path, tokenizer):
    first = _run(tokenizer, tmp_path, "run", n=6, kinds=["residual"], seeds=1, limit=2)
    assert first.effects["residual"]["n_facts"] == 2
    screen = tmp_path / "run" / "screen.jsonl"
    results = tmp_path / "run" / "results.jsonl"
    assert sum(1 for _ in screen.open()) == 2  # the screen stops once the limit is kept
    before = (screen.read_text(), results.read_text())
    again = _run(tokenizer, tmp_path, "run", n=6, kinds=["residual"], seeds=1, limit=2)
    assert (screen.read_text(), results.read_text()) == before
    assert again.to_json() == first.to_json()


def test_resume_with_other_settings_is_refused(tmp_path, tokenizer):
    _run(tokenizer, tmp_path, "run", kinds=["residual"], seeds=1)
    with pytest.raises(ValueError, match="seeds"):
        _run(tokenizer, tmp_path, "run", kinds=["residual"], seeds=2)


def _cli(*args, env=None):
    return [sys.executable, "-m", "pyvene_causaltrace.cli", *map(str, args)]


def _env(threads=1):
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    make_tiny_model("llama", n_layers=4).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _dataset_args(model_dir, facts, out):
    return ["dataset", "--model", model_dir, "--data", facts, "--known", "none",
            "--kinds", "residual,mlp", "--seeds", "2", "--boot", "100", "--out", out]


@pytest.mark.process
def test_resume_after_kill_gives_the_uninterrupted_aggregate(tmp_path, model_dir):
    facts = _facts_file(tmp_path, 24)
    full = subprocess.run(_cli(*_dataset_args(model_dir, facts, tmp_path / "full")),
                          env=_env(), capture_output=True, text=True)
    assert full.returncode == 0, full.stderr
    total = sum(1 for _ in (tmp_path / "full" / "results.jsonl").open())
    assert total == 24 * 2 * 2

    killed = tmp_path / "killed"
    process = subprocess.Popen(_cli(*_dataset_args(model_dir, facts, killed)), env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = killed / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if results.exists() and sum(1 for _ in results.open()) >= 8:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    partial = sum(1 for _ in results.open())
    assert 8 <= partial < total

    resumed = subprocess.run(_cli(*_dataset_args(model_dir, facts, killed)), env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in results.open()]
    keys = [(r["fact"], r["kind"], r["seed"]) for r in rows]
    assert len(keys) == len(set(keys)) == total  # nothing recomputed, nothing missing
    a = json.loads((tmp_path / "full" / "aggregate.json").read_text())
    b = json.loads((killed / "aggregate.json").read_text())
    assert_same_aggregate(a, b)


@pytest.mark.process
def test_two_process_shards_merge_to_the_single_process_aggregate(tmp_path, model_dir):
    facts = _facts_file(tmp_path, 10)
    single = subprocess.run(_cli(*_dataset_args(model_dir, facts, tmp_path / "single")),
                            env=_env(), capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    sharded = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "pyvene_causaltrace.cli", *map(str, _dataset_args(model_dir, facts,
                                                                  tmp_path / "sharded"))],
        env=_env(), capture_output=True, text=True)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("shard-*"))
    assert shards == ["shard-00-of-02", "shard-01-of-02"]
    per_shard = [sum(1 for _ in (tmp_path / "sharded" / s / "results.jsonl").open())
                 for s in shards]
    assert per_shard == [5 * 2 * 2, 5 * 2 * 2]
    a = json.loads((tmp_path / "single" / "aggregate.json").read_text())
    b = json.loads((tmp_path / "sharded" / "aggregate.json").read_text())
    assert_same_aggregate(a, b)


# -------------------------------------------------------------------------------- tasks

def test_task_spans_are_the_last_occurrence():
    for task in TASKS.values():
        assert len(task.records) >= 6
        for record in task.records:
            assert record.prompt.count(record.subject) == record.occurrence + 1, record


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.numerics
def test_each_task_runs_on_a_tiny_model(task, tmp_path, tokenizer):
    model = make_tiny_model("qwen3")
    result = trace_dataset(model, tokenizer, TASKS[task].records, out=tmp_path / task,
                           kinds=["residual", "attn"], seeds=1, known="none", progress=False,
                           n_boot=50)
    assert result.effects["residual"]["n_facts"] == len(TASKS[task].records)
    last = result.roles.index("Last token")
    # restoring the last position at the last layer gives the clean P back exactly
    te = result.effects["residual"]["total_effect"]
    assert abs(result.aie["residual"][last][-1] - te) < 1e-6


def test_cli_runs_a_task_and_a_user_task_file(tmp_path, model_dir):
    from pyvene_causaltrace.cli import main

    # arithmetic screens with known="none" unless told otherwise: all six prompts are traced
    assert main(["dataset", "--model", str(model_dir), "--task", "arithmetic",
                 "--kinds", "residual", "--seeds", "1", "--boot", "50",
                 "--out", str(tmp_path / "task")]) == 0
    traced = json.loads((tmp_path / "task" / "aggregate.json").read_text())
    assert traced["effects"]["residual"]["n_facts"] == len(TASKS["arithmetic"].records)
    assert json.loads((tmp_path / "task" / "manifest.json").read_text())["known"] == "none"
    user = tmp_path / "user.jsonl"
    write_jsonl(user, [{"prompt": "The keys to the cabinet", "subject": "keys",
                        "attribute": "are"}])
    assert main(["dataset", "--model", str(model_dir), "--data", str(user), "--known", "none",
                 "--kinds", "attn", "--seeds", "1", "--boot", "50",
                 "--out", str(tmp_path / "user")]) == 0
    for name in ("aggregate.json", "aie.csv", "peaks.csv", "figure1.png", "curves.png"):
        assert (tmp_path / "user" / name).exists()
    assert main(["aggregate", str(tmp_path / "user"), "--boot", "50"]) == 0
