"""``fit`` on a model directory, bounded and safe (issues 51 and 57): the CLI end to end, lr and
seed refused, a diverging fit saving nothing, sizes checked before allocating, a damaged
fit.json named, a user's folder never written or deleted, a refit swapped in whole (a kill at
any step leaves a loadable transcoder), a second concurrent fit refused, dropout off."""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from _support.models import CORPUS, make_tiny_model

from pyvene_causaltrace import fit_output, fitting, memory
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import (
    DamagedFileError,
    InputError,
    MemoryCapError,
    NonFiniteError,
    OutputLockedError,
)
from pyvene_causaltrace.transcoders import fit as transcoder_fit
from pyvene_causaltrace.transcoders import load_transcoder

SMALL = {"features": 8, "steps": 3, "texts": 8, "progress": False}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n".join(dict.fromkeys(CORPUS)) * 2 + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loaded(tokenizer):
    return make_tiny_model("llama"), tokenizer


@pytest.fixture
def fit(loaded, data_file):
    """``fit(out, **changes)``: a small fit of the tiny Llama on the text file."""
    model, tokenizer = loaded

    def run(out, model=model, **changes):
        return fitting.fit_transcoder(out=out, model=model, tokenizer=tokenizer,
                                      data=str(data_file), **{**SMALL, **changes})
    return run


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(fitting, "load_model", refuse)


def snapshot(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


# -- 1. the documented command, on a model directory --------------------------------------------

def test_cli_fit_on_a_model_directory_with_every_flag(tmp_path, tokenizer, data_file,
                                                      monkeypatch, capsys):
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "tc"
    flags = ["fit", "--model", str(model_dir), "--kind", "clt", "--features", "8", "--steps",
             "3", "--lr", "0.01", "--data", str(data_file), "--texts", "8", "--seed", "3",
             "--out", str(out), "--no-progress"]
    # a CLT is saved in the mntss layout (JumpReLU or ReLU): the top-k default is refused
    assert main(flags) == 2 and "--activation relu" in capsys.readouterr().err
    flags[flags.index("--kind"):flags.index("--kind")] = ["--activation", "relu", "--k", "5"]
    assert main(flags) == 0, capsys.readouterr().err
    assert "held-out pairing FVU" in capsys.readouterr().out
    settings = fit_output.read_record(out)["settings"]
    assert (settings["model"], settings["kind"], settings["features"], settings["steps"],
            settings["lr"], settings["seed"], settings["activation"], settings["k"]) == \
        (str(model_dir), "clt", 8, 3, 0.01, 3, "relu", None)  # k: unused by relu
    assert load_transcoder(out).cfg.cross_layer
    assert main(flags) == 0 and "reused" in capsys.readouterr().out
    flags[flags.index("--steps") + 1] = "4"
    assert main(flags) == 2 and "--refit" in capsys.readouterr().err
    assert main([*flags, "--refit"]) == 0
    assert fit_output.read_record(out)["settings"]["steps"] == 4
    # without --out: under the cache directory, named by the model, kind and features
    monkeypatch.setenv("PYVENE_CAUSALTRACE_CACHE", str(tmp_path / "cache"))
    assert main(["fit", "--model", str(model_dir), "--kind", "plt", "--features", "8",
                 "--k", "3", "--steps", "3", "--data", str(data_file), "--texts", "8",
                 "--no-progress"]) == 0
    default = fitting.transcoder_dir(fitting.FitSettings(model=str(model_dir), kind="plt",
                                                         features=8, k=3))
    assert default.parent == tmp_path / "cache" / "transcoders"
    saved = load_transcoder(default).cfg
    assert not saved.cross_layer and (saved.activation, saved.k) == ("relu_topk", 3)


# -- 2. lr and seed; a fit that diverges ---------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("lr", float("inf")), ("lr", float("nan")), ("lr", 0.0), ("lr", -1e-3), ("lr", 1e30),
    ("lr", "0.1"), ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("seed", True)])
def test_lr_and_seed_out_of_range_are_refused(tmp_path, no_model_load, name, value):
    with pytest.raises(InputError, match=rf"^{name} must be .*got {re.escape(repr(value))}"):
        fitting.fit_transcoder(out=tmp_path / "tc", progress=False, **{name: value})
    assert not (tmp_path / "tc").exists()


def test_lr_refused_on_the_command_line(tmp_path, no_model_load, capsys):
    assert main(["fit", "--lr", "inf", "--out", str(tmp_path / "tc"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lr" in err and "inf" in err


def test_a_diverging_fit_stops_and_saves_nothing(fit, tmp_path, monkeypatch):
    x, y = torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    with pytest.raises(NonFiniteError, match="diverged.*lower lr"):
        transcoder_fit.fit_pairs(x, y, "m", d_transcoder=4, steps=30, lr=1e30)
    with pytest.raises(NonFiniteError, match="NaN"):  # a poisoned batch
        transcoder_fit.fit_pairs(x, y.index_fill(0, torch.tensor([5]), float("nan")), "m")

    real = transcoder_fit.fit_pairs
    monkeypatch.setattr(fitting, "fit_pairs", lambda *a, **k: real(*a, **{**k, "lr": 1e30}))
    with pytest.raises(NonFiniteError):
        fit(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(fitting, "fit_pairs", real)
    fit(tmp_path / "old")
    before = snapshot(tmp_path / "old")
    monkeypatch.setattr(fitting, "collect_pairs",
                        lambda *a, **k: (torch.full((4, 3, 32), float("nan")),) * 2)
    with pytest.raises(NonFiniteError):
        fit(tmp_path / "old", steps=4, refit=True)
    assert snapshot(tmp_path / "old") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new.fit.lock", ".old.fit.lock",
                                                          "old"]


# -- 3. sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [("texts", 10**8), ("steps", 10**9),
                                         ("features", 10**8), ("new_tokens", 10**6)])
def test_sizes_past_their_bound_are_refused(tmp_path, no_model_load, name, value):
    with pytest.raises(InputError, match=rf"{name} must be an integer from 1 to [\d,]+, got"):
        fitting.fit_transcoder(out=tmp_path / "tc", progress=False, **{name: value})


def test_a_fit_past_memory_is_refused_before_allocating(fit, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fitting, "device_bytes", lambda device: 50 * 2**20)

    def no_collect(*args, **kwargs):
        raise AssertionError("collected before the memory check")
    monkeypatch.setattr(fitting, "collect_pairs", no_collect)
    with pytest.raises(MemoryCapError, match=r"about [\d,.]+ GB .* 50 MB is available: lower "
                                             "features"):
        fit(tmp_path / "tc", features=2**19)
    assert not (tmp_path / "tc").exists()
    with pytest.raises(MemoryCapError, match="MB"):
        transcoder_fit.fit_pairs(torch.randn(64, 2, 8), torch.randn(64, 2, 8), "m",
                                 d_transcoder=10**5, memory_bytes=2**20)
    with pytest.raises(MemoryCapError, match="GB"):  # the machine's memory by default
        transcoder_fit.fit_pairs(torch.randn(64, 2, 8), torch.randn(64, 2, 8), "m",
                                 d_transcoder=2**40)


def test_a_control_groups_limit_bounds_every_size_check(monkeypatch):
    """A container's limit, not the machine's memory, is what a direct fit_pairs (as well as
    fit, a bootstrap and steering) may use: fit_pairs once read the machine's physical memory
    and passed fits the container would kill."""
    pairs = torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    size = 2**17  # a fit of about 16 MB: far below any machine's memory
    transcoder_fit.fit_pairs(*pairs, "m", d_transcoder=size, steps=1)  # the control: it runs
    read_text = Path.read_text

    def limited(path, *args, **kwargs):
        if path.name in ("memory.max", "memory.limit_in_bytes"):
            return f"{2**20}\n"  # a 1 MB control group
        return read_text(path, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", limited)
    assert memory.device_bytes() == memory.device_bytes(torch.device("cpu")) == 2**20
    with pytest.raises(MemoryCapError, match="MB"):
        transcoder_fit.fit_pairs(*pairs, "m", d_transcoder=size, steps=1)


def test_progress_says_the_estimate_and_counts_steps(fit, tmp_path, capsys):
    fit(tmp_path / "tc", progress=True)
    err = capsys.readouterr().err
    assert "MB of the" in err and "MB available" in err and "3/3" in err


# -- 4. a damaged fit.json -----------------------------------------------------------------------

@pytest.mark.parametrize("text, reason", [("{not json", "not JSON"), ("[1, 2]", "holds list"),
                                          ("", "not JSON"), ('{"a": 1}', "no settings")])
def test_a_damaged_fit_record_is_named(fit, tmp_path, no_model_load, capsys, text, reason):
    out = tmp_path / "tc"
    out.mkdir()
    (out / "fit.json").write_text(text)
    with pytest.raises(DamagedFileError, match=f"{out / 'fit.json'}.*{reason}"):
        fit(out)
    assert main(["fit", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fit.json" in err


# -- 5. a user's folder, the swap, a concurrent fit ----------------------------------------------

def test_a_users_folder_is_never_written_or_deleted(fit, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "canary.txt").write_text("keep me")
    for refit in (False, True):
        with pytest.raises(InputError, match="holds other files and no fit.json") as caught:
            fit(folder, refit=refit)
        assert "refit" not in str(caught.value)
        assert main(["fit", "--out", str(folder), "--no-progress"]
                    + ["--refit"] * refit) == 2
        assert "refit" not in capsys.readouterr().err
    monkeypatch.chdir(folder)
    with pytest.raises(InputError, match="no fit.json"):
        fit(".", refit=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty directory"):
        fit(tmp_path / "empty", refit=True)
    fit(folder / "tc")
    fit(folder / "tc", steps=4, refit=True)
    assert fit_output.read_record(folder / "tc")["settings"]["steps"] == 4
    assert (folder / "canary.txt").read_text() == "keep me"
    assert sorted(p.name for p in folder.iterdir()) == [".tc.fit.lock", "canary.txt", "tc"]
    assert (tmp_path / "empty").is_dir()


def test_a_kill_at_any_step_of_a_refit_leaves_a_transcoder(fit, tmp_path, monkeypatch):
    """Every filesystem change the save makes (mkdir, rename, unlink, rmdir) is a point where
    kill -9 may land: the tree as it is just before each is what a killed run leaves. Each such
    tree, handed to the next call, holds a complete transcoder, old or new, at D."""
    parent = tmp_path / "work"
    parent.mkdir()
    (parent / "canary.txt").write_text("keep me")
    out = parent / "tc"
    fit(out)
    trees, taking = [], []
    real = {name: getattr(os, name) for name in ("mkdir", "rename", "unlink", "rmdir")}

    def before(name):
        def call(*args, **kwargs):
            if not taking:
                taking.append(1)
                image = tmp_path / f"kill{len(trees)}"
                shutil.copytree(parent, image / "work", symlinks=True)
                trees.append(image / "work")
                taking.clear()
            return real[name](*args, **kwargs)
        return call

    def commit(self, write, record):
        with monkeypatch.context() as patch:
            for name in real:
                patch.setattr(os, name, before(name))
            real_commit(self, write, record)

    real_commit = fit_output.FitOutput.commit
    monkeypatch.setattr(fit_output.FitOutput, "commit", commit)
    fit(out, steps=4, refit=True)
    monkeypatch.undo()
    assert len(trees) >= 8  # mkdtemp, the save's files, both renames, the old one's removal
    seen = set()
    for tree in trees:
        with fit_output.fit_output(tree / "tc"):  # what the next call does first
            pass
        steps = fit_output.read_record(tree / "tc")["settings"]["steps"]
        seen.add(steps)
        load_transcoder(tree / "tc")
        assert sorted(p.name for p in tree.iterdir()) == [".tc.fit.lock", "canary.txt", "tc"]
    assert seen == {3, 4}  # killed before the swap: the old one; after: the new one


def test_a_failed_save_leaves_the_old_transcoder(fit, tmp_path, monkeypatch):
    out = tmp_path / "tc"
    fit(out)
    before = snapshot(out)

    def broken(transcoder, path):
        (Path(path) / "config.yaml").write_text("half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fitting, "save_transcoder", broken)
    with pytest.raises(OSError, match="No space"):
        fit(out, steps=4, refit=True)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tc.fit.lock", "tc"]


def test_a_second_concurrent_fit_is_refused(fit, loaded, tmp_path, monkeypatch):
    out = tmp_path / "tc"
    inside, release, results = threading.Event(), threading.Event(), []
    real = transcoder_fit.collect_pairs

    def slow_collect(*args, **kwargs):
        assert not inside.is_set(), "a second fit ran beside the first"
        inside.set()
        assert release.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(fitting, "collect_pairs", slow_collect)
    first = threading.Thread(target=lambda: results.append(fit(out)))
    first.start()
    try:
        assert inside.wait(30)
        with pytest.raises(OutputLockedError, match="another run"):
            fit(out, model=make_tiny_model("llama"))
    finally:
        release.set()
        first.join(60)
    assert len(results) == 1 and not results[0].reused
    load_transcoder(out)


# -- 6. dropout off ------------------------------------------------------------------------------

def test_a_model_in_train_mode_is_fitted_in_eval_mode(tokenizer, data_file, tmp_path,
                                                     monkeypatch):
    model = make_tiny_model("gpt2")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    texts = CORPUS[:3]
    x_eval, y_eval = transcoder_fit.collect_pairs(model.eval(), tokenizer, texts)
    model.train()
    x, y = transcoder_fit.collect_pairs(model, tokenizer, texts)
    assert torch.equal(x, x_eval) and torch.equal(y, y_eval)
    assert all(m.training for m in model.modules())

    modes, real = [], transcoder_fit.collect_pairs

    def spy(model, *args, **kwargs):
        modes.append(any(m.training for m in model.modules()))
        return real(model, *args, **kwargs)
    monkeypatch.setattr(fitting, "collect_pairs", spy)
    fitting.fit_transcoder(out=tmp_path / "tc", model=model, tokenizer=tokenizer,
                           data=str(data_file), **SMALL)
    assert modes == [False] and all(m.training for m in model.modules())
