"""Dataset runs at the edges: rows without a manifest, a damaged manifest or row, a disk that
fills up, Ctrl-C, a kill mid-batch, sizes that cannot fit. Each ends in one ``error:`` line
(or exit 130), leaves the directory consistent, and a resumed run ends equal, bit for bit, to an
uninterrupted one (tiny models)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest
from _support.models import make_tiny_model
from test_dataset import tiny_records, write_jsonl

import pyvene_causaltrace.cli.dataset as cli_dataset
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.dataset import aggregate_rows, read_records, store, trace_dataset
from pyvene_causaltrace.dataset.store import check_run_directory
from pyvene_causaltrace.errors import DamagedFileError, ManifestMismatchError, MemoryCapError
from pyvene_causaltrace.tracing.tracer import Tracer

N_FACTS, SEEDS, KINDS = 6, 3, ("residual", "mlp")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """A tiny Llama on disk and a facts file."""
    root = tmp_path_factory.mktemp("faults")
    make_tiny_model("llama", n_layers=4).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    write_jsonl(root / "facts.jsonl", tiny_records(N_FACTS))
    return root


def dataset_argv(files, out, *extra) -> list[str]:
    return ["dataset", "--model", str(files / "tiny"), "--data", str(files / "facts.jsonl"),
            "--known", "none", "--kinds", ",".join(KINDS), "--seeds", str(SEEDS),
            "--boot", "50", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def reference(files):
    """An uninterrupted run: the directory every resumed run must end equal to."""
    out = files / "reference"
    assert main(dataset_argv(files, out)) == 0
    assert len(lines(out)) == N_FACTS * len(KINDS) * SEEDS
    return out


def lines(out) -> list[str]:
    return (out / "results.jsonl").read_text().splitlines()


def run(argv, capsys) -> tuple[int, str]:
    """``main(argv)``: exit code and stderr (argparse's own errors included)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def one_error(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def assert_equal_runs(a, b) -> None:
    """Same rows in the same order, byte for byte, and the same aggregate.json."""
    assert (a / "results.jsonl").read_bytes() == (b / "results.jsonl").read_bytes()
    assert (a / "aggregate.json").read_text() == (b / "aggregate.json").read_text()


def consistent(out) -> list[dict]:
    """Every line of results.jsonl a complete row, each key once, whole (fact, kind) batches."""
    data = (out / "results.jsonl").read_bytes()
    assert not data or data.endswith(b"\n")
    rows = [json.loads(line) for line in data.splitlines()]
    keys = [(r["fact"], r["kind"], r["seed"]) for r in rows]
    assert len(keys) == len(set(keys))
    return rows


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the command loads a model."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the mistake was found")
    monkeypatch.setattr(cli_dataset, "load_model", refuse)


# ------------------------------------------------------------------ manifests and rows

def test_rows_without_a_manifest_are_refused_not_resumed(files, reference, tmp_path, capsys,
                                                         no_model_load):
    """The deleted-manifest trap: a rerun with other settings used to keep the old rows and
    exit 0. Now any rerun is refused before the model loads, naming the directory and how to
    start afresh, and the rows are left as they were."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "manifest.json").unlink()
    before = (out / "results.jsonl").read_bytes()
    for extra in (["--scale", "5", "--seeds", "2"], []):  # other settings, or the same
        code, err = run(dataset_argv(files, out, *extra), capsys)
        line = one_error(err)
        assert code == 2 and str(out) in line and "no manifest.json" in line, line
        assert f"remove {out}" in line and "another --out" in line
    code, err = run(["aggregate", str(out)], capsys)
    assert code == 2 and str(out) in one_error(err) and "manifest" in one_error(err)
    assert (out / "results.jsonl").read_bytes() == before
    assert not (out / "manifest.json").exists()


def test_rows_without_a_manifest_are_refused_by_the_api_too(files, reference, tmp_path,
                                                            tokenizer):
    out = tmp_path / "run"
    (out / "shard-00-of-02").mkdir(parents=True)
    with pytest.raises(ManifestMismatchError, match="shard-00-of-02"):
        check_run_directory(out)
    shutil.rmtree(out)
    shutil.copytree(reference, out)
    (out / "manifest.json").unlink()
    records, _ = read_records(files / "facts.jsonl")
    with pytest.raises(ManifestMismatchError, match="no manifest.json"):
        trace_dataset(make_tiny_model("llama", n_layers=4), tokenizer, records, out=out,
                      kinds=KINDS, seeds=SEEDS, known="none", progress=False)
    check_run_directory(tmp_path / "fresh")  # absent, or empty: a fresh start
    (tmp_path / "empty").mkdir()
    check_run_directory(tmp_path / "empty")


def test_a_damaged_manifest_is_named_with_what_to_do(files, reference, tmp_path, capsys,
                                                     no_model_load):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    manifest = out / "manifest.json"
    manifest.write_text('{"kinds": "\x01"}')  # json: "Invalid control character at ..."
    for argv in (dataset_argv(files, out), ["aggregate", str(out)]):
        code, err = run(argv, capsys)
        line = one_error(err)
        assert code == 2 and str(manifest) in line and "Invalid control character" in line
        assert "restore it" in line and f"remove {out}" in line and "another --out" in line
    manifest.write_text("[1, 2]")
    with pytest.raises(DamagedFileError, match="not a JSON object"):
        check_run_directory(out)


@pytest.mark.parametrize("damage, problem", [
    ('{"index": 0, "fact": "f0", "kind": "resid', "not a complete JSON row"),
    ('{"index": 0, "fact": "f0", "kind": "residual"}', "no 'seed' field"),
    ("\x00\x00\x00\x00", "not a complete JSON row"),
])
def test_a_broken_row_is_named_by_file_and_line(files, reference, tmp_path, capsys,
                                                damage, problem):
    """A damaged line that is not the last is refused by a resume and by ``aggregate``,
    naming the file and line; the file is left alone."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    rows = lines(out)
    rows[2] = damage
    write_jsonl(out / "results.jsonl", rows)
    before = (out / "results.jsonl").read_bytes()
    for argv in (dataset_argv(files, out), ["aggregate", str(out), "--boot", "50"]):
        code, err = run(argv, capsys)
        line = one_error(err)
        assert code == 2 and f"{out / 'results.jsonl'}, line 3, is damaged" in line, line
        assert problem in line and "delete that line" in line
    assert (out / "results.jsonl").read_bytes() == before


def test_duplicate_rows_that_disagree_are_refused(reference):
    rows = [json.loads(line) for line in lines(reference)]
    twin = {**rows[0], "corrupt": rows[0]["corrupt"] + 1e-9}
    aggregate_rows(rows + [rows[0]], kinds=KINDS, n_boot=10)  # an exact repeat is harmless
    with pytest.raises(ValueError, match="two rows with different values"):
        aggregate_rows(rows + [twin], kinds=KINDS, n_boot=10)


# ------------------------------------------------------------- interruptions and resume

def fail_after(monkeypatch, n_rows: int, error: BaseException) -> None:
    """The row writer writes ``n_rows`` result rows, then half of the next one, then raises
    ``error`` (a full disk; Ctrl-C mid-write)."""
    real, written = store._write_all, [0]

    def write(fd, data):
        if b'"restored"' not in data:  # screen lines
            return real(fd, data)
        room = n_rows - written[0]
        if data.count(b"\n") <= room:
            written[0] += data.count(b"\n")
            return real(fd, data)
        cut = 0
        for _ in range(room):
            cut = data.index(b"\n", cut) + 1
        real(fd, data[:cut + (data.index(b"\n", cut) - cut) // 2])
        raise error

    monkeypatch.setattr(store, "_write_all", write)


@pytest.mark.parametrize("n_rows", [4, 9, 20])
def test_resume_after_a_full_disk_is_bit_for_bit(files, reference, tmp_path, capsys,
                                                 monkeypatch, n_rows):
    """ENOSPC mid-batch: one ``error:`` line naming results.jsonl, the batch cut back off (the
    file ends at a whole (fact, kind)), and the resumed run equals the uninterrupted one byte
    for byte: rows and aggregate.json."""
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        fail_after(patch, n_rows, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        code, err = run(dataset_argv(files, out), capsys)
    line = one_error(err)
    assert code == 2 and "results.jsonl: No space left on device" in line, line
    rows = consistent(out)
    assert len(rows) == n_rows - n_rows % SEEDS
    assert lines(out) == lines(reference)[:len(rows)]
    assert main(dataset_argv(files, out)) == 0
    assert_equal_runs(out, reference)


@pytest.mark.parametrize("cut", [1, 2, 8, 17, 35])
def test_a_kill_mid_batch_resumes_bit_for_bit(files, reference, tmp_path, cut):
    """``kill -9`` inside a write can leave part of a (fact, kind)'s seeds and half a line. The
    half line is dropped, and the fact is traced again with all its seeds (as the uninterrupted
    run did: same batches, same rounding), writing only the missing rows. Tracing only the
    missing seeds used to differ by ~1e-10: another batch size, another float32 reduction."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for name in ("aggregate.json", "aie.csv", "peaks.csv", "figure1.png", "curves.png"):
        (out / name).unlink()
    rows = lines(reference)
    (out / "results.jsonl").write_text("".join(r + "\n" for r in rows[:cut])
                                       + rows[cut][:len(rows[cut]) // 2])
    assert main(dataset_argv(files, out)) == 0
    assert_equal_runs(out, reference)


@pytest.mark.parametrize("where", ["write", "trace"])
def test_ctrl_c_exits_130_and_the_rerun_resumes_bit_for_bit(files, reference, tmp_path, capsys,
                                                             monkeypatch, where):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        if where == "write":
            fail_after(patch, 7, KeyboardInterrupt())
        else:
            real, calls = Tracer.trace, [0]

            def trace(self, *args, **kwargs):
                calls[0] += 1
                if calls[0] == 5:
                    raise KeyboardInterrupt
                return real(self, *args, **kwargs)

            patch.setattr(Tracer, "trace", trace)
        code, err = run(dataset_argv(files, out), capsys)
    assert code == 130 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("interrupted")], err
    rows = consistent(out)
    assert len(rows) == (6 if where == "write" else 4 * SEEDS)
    assert main(dataset_argv(files, out)) == 0
    assert_equal_runs(out, reference)


def _cli_process(*argvs, **options):
    """A Python process running the command line once per argument list, in order (the first
    that fails ends it)."""
    code = ("import json, sys; from pyvene_causaltrace.cli import main\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    code = main(argv)\n"
            "    if code:\n"
            "        sys.exit(code)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PVCT_TORCH_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(argvs)], env=env, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **options)


@pytest.mark.process
def test_sigint_to_a_real_run(files, tmp_path):
    """SIGINT to a command-line run: exit 130, one line and no traceback, whole batches on
    disk; the rerun ends equal to an uninterrupted run in the same setting (made by the same
    process, after the rerun)."""
    n_facts = 16
    write_jsonl(tmp_path / "facts.jsonl", tiny_records(n_facts))

    def argv(out):
        return ["dataset", "--model", str(files / "tiny"), "--data", str(tmp_path / "facts.jsonl"),
                "--known", "none", "--kinds", "residual,mlp", "--seeds", "2", "--boot", "50",
                "--out", str(out)]

    out = tmp_path / "run"
    process = _cli_process(argv(out))
    results, deadline = out / "results.jsonl", time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if results.exists() and results.read_bytes().count(b"\n") >= 8:
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.005)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 130, ("the run ended before it could be interrupted", err)
    assert "interrupted" in err and "Traceback" not in err, err
    # the batch being appended when the signal came is cut back: fewer than the 8 rows seen
    assert 0 < len(consistent(out)) < n_facts * 2 * 2
    again = _cli_process(argv(out), argv(tmp_path / "full"))
    assert again.wait(timeout=300) == 0, again.stderr.read()
    assert_equal_runs(out, tmp_path / "full")


# --------------------------------------------------------------------------------- sizes

def test_seeds_that_cannot_fit_are_refused_before_allocating(files, tmp_path, capsys):
    """``--seeds 100000000``: one ``error:`` line naming the seeds, at once, without building
    the list of seeds (or anything else large); nothing is written."""
    start = time.time()
    tracemalloc.start()
    try:
        code, err = run(dataset_argv(files, tmp_path / "run", "--seeds", "100000000"), capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = one_error(err)
    assert code == 2 and "seeds" in line and "100000000" in line, line
    assert peak < 200 * 2**20 and time.time() - start < 60
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_a_bootstrap_that_cannot_fit_is_refused(files, reference, tmp_path, capsys, tokenizer):
    code, err = run(dataset_argv(files, tmp_path / "run", "--boot", str(10**13)), capsys)
    assert code == 2 and "--boot" in one_error(err)
    assert not (tmp_path / "run" / "results.jsonl").exists()
    code, err = run(["aggregate", str(reference), "--boot", str(10**13)], capsys)
    assert code == 2 and "--boot" in one_error(err)
    records, _ = read_records(files / "facts.jsonl")
    with pytest.raises(MemoryCapError, match="n_boot"):
        trace_dataset(make_tiny_model("llama", n_layers=4), tokenizer, records,
                      out=tmp_path / "api", kinds=KINDS, seeds=1, known="none", progress=False,
                      n_boot=10**13)


@pytest.mark.parametrize("flags, needle", [
    (["--seeds", "0"], "seeds"),
    (["--seeds", "-3"], "seeds"),
    (["--limit", "0"], "limit"),
    (["--window", "0"], "window"),
    (["--scale", "nan"], "scale"),
    (["--scale", "-1"], "scale"),
    (["--sigma", "-1"], "sigma"),
    (["--sigma", "inf"], "sigma"),
    (["--sigma", "bogus"], "bogus"),
    (["--kinds", "residul"], "residul"),
    (["--kinds", "residual,residual"], "repeat"),
    (["--budget-mb", "0"], "budget"),
    (["--boot", "0"], "boot"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_flag_is_checked_before_the_model_loads(files, tmp_path, capsys, no_model_load,
                                                      flags, needle):
    code, err = run(dataset_argv(files, tmp_path / "run") + flags, capsys)
    assert code == 2 and needle in one_error(err)
    assert not (tmp_path / "run").exists()
