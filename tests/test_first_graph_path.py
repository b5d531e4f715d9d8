"""The README's path from the Quickstart to a first graph, in order, against a tiny stand-in:
``pyvene-causaltrace fit`` writes the transcoder where every README and docs block loads it, the
blocks then run with the real ``load_transcoder`` (a block naming a path nothing wrote fails),
a second fit reuses only a transcoder fitted with the same settings, and a missing transcoder's
error says how to get one."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from _support.data import PROJECT_FACTS, ROOT, fetch_file_urls
from _support.docs_world import PAGES
from _support.docs_world import stand_in as docs_stand_in

import pyvene_causaltrace
from pyvene_causaltrace import fit_output, fitting
from pyvene_causaltrace import models as model_module
from pyvene_causaltrace.cli import attribute as cli_attribute
from pyvene_causaltrace.cli import main as cli
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.dataset import sources
from pyvene_causaltrace.errors import InputError, TranscoderFormatError
from pyvene_causaltrace.interventions import registry
from pyvene_causaltrace.transcoders import load_transcoder

BLOCK = re.compile(r"```python\n(.*?)```", re.S)
CACHED = re.compile(r"~/\.cache/pyvene_causaltrace/(?:clts|transcoders)/[\w.<>|-]+")
DEFAULT = "~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16"
FEW = ["--steps", "5", "--texts", "8", "--no-progress"]  # a fit of a second or two


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    return docs_stand_in(tmp_path_factory)


@pytest.fixture
def fresh_home(stand_in, tmp_path, monkeypatch):
    """An empty home (so ``~`` and the cache directory are new), and ``load_model`` giving the
    tiny stand-in wherever the README's path calls it."""
    model, tokenizer = stand_in
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("PYVENE_CAUSALTRACE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def load_model(*args, **kwargs):
        return model, tokenizer

    for module in (model_module, pyvene_causaltrace, fitting, cli_attribute):
        monkeypatch.setattr(module, "load_model", load_model, raising=False)
    return home


def test_the_fit_writes_where_the_docs_load(fresh_home):
    """Every ``~/.cache/pyvene_causaltrace/...`` transcoder the README, docs and examples name
    is the one ``fit`` writes by default (the old ``clts/smollm2-135m-fitted-256`` was written by
    nothing the Quickstart runs)."""
    places = [*PAGES, *sorted((ROOT / "examples").glob("*.py"))]
    named = {m for page in places for m in CACHED.findall(page.read_text())
             if "<" not in m}  # fit_smollm2_clt.py's pattern for the larger fits it writes
    assert named == {DEFAULT}, sorted(named)
    assert fitting.transcoder_dir() == Path(DEFAULT).expanduser()
    assert fitting.transcoder_dir(fitting.FitSettings(features=64)).name == \
        "smollm2-135m-skip-plt-64-top16"  # named by what it is, not "quick" whatever it holds


def test_readme_blocks_run_in_order_after_the_fit(fresh_home, tmp_path, monkeypatch, capsys):
    # 8 features a layer (into the default's folder: test_the_fit_writes_where_the_docs_load
    # shows the default is written there): the blocks' graphs stay small on the stand-in
    path = Path(DEFAULT).expanduser()
    assert cli(["fit", *FEW, "--features", "8", "--out", str(path)]) == 0
    assert "held-out pairing FVU" in capsys.readouterr().out
    assert (path / fit_output.RECORD).is_file()
    data = PROJECT_FACTS.read_bytes()  # known_1000 by name: the project's facts, no network
    monkeypatch.setitem(sources.DATASETS, "known_1000", sources.DatasetSource(
        PROJECT_FACTS.as_uri(), hashlib.sha256(data).hexdigest(), "known_1000.json",
        "PVCT_DOCS_UNUSED", "test"))
    fetch_file_urls(monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    Path("intervention_specs").symlink_to(ROOT / "intervention_specs")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.syspath_prepend(str(work))
    readme = (ROOT / "README.md").read_text()
    blocks = BLOCK.findall(readme[readme.index("## Quickstart"):])
    loading = [b for b in blocks if "load_transcoder(" in b]
    assert len(loading) >= 3 and all(DEFAULT in b for b in loading)
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md[{index}]", "exec"), {"__name__": "__docs__"})
    assert not any(name.startswith("__docs__") for name in sys.modules)


def test_a_second_fit_reuses_only_the_same_settings(fresh_home, capsys):
    report = fitting.fit_transcoder(steps=5, texts=8, progress=False)
    assert not report.reused and report.path == Path(DEFAULT).expanduser()
    weights = {p.name: p.stat().st_mtime_ns for p in report.path.iterdir()}
    again = fitting.fit_transcoder(steps=5, texts=8, progress=False)
    assert again.reused and again.record == report.record
    assert {p.name: p.stat().st_mtime_ns for p in report.path.iterdir()} == weights
    with pytest.raises(InputError, match=r"other settings: steps 5 \(asked 6\)"):
        fitting.fit_transcoder(steps=6, texts=8, progress=False)
    assert cli(["fit", "--steps", "6", "--texts", "8", "--no-progress"]) == 2
    assert "--refit" in capsys.readouterr().err
    refitted = fitting.fit_transcoder(steps=6, texts=8, progress=False, refit=True)
    assert not refitted.reused and refitted.record["settings"]["steps"] == 6
    # a directory this command did not write is never taken for a fit
    other = fitting.transcoder_dir(fitting.FitSettings(kind="plt"))
    other.mkdir()
    with pytest.raises(InputError, match="no fit.json"):
        fitting.fit_transcoder(kind="plt", steps=5, texts=8, progress=False)


def test_fitted_settings_are_refused_before_any_model_loads(fresh_home):
    for changes, match in (({"kind": "sae"}, "kind must be"), ({"features": 0}, "features"),
                           ({"data": "nowhere.txt"}, "no file at"),
                           # the TopK fields: a bool, float or string is never a count
                           ({"k": True}, "k must be"), ({"k": 2.0}, "k must be"),
                           ({"k": "16"}, "k must be"), ({"k": 0}, "k must be"),
                           ({"activation": 1}, "activation must be"),
                           ({"activation": "topk"}, "activation must be"),
                           ({"kind": "clt"}, "--activation relu")):
        with pytest.raises(InputError, match=match):
            fitting.fit_transcoder(progress=False, **changes)


def test_a_missing_transcoder_says_how_to_get_one(fresh_home, capsys):
    with pytest.raises(TranscoderFormatError, match="pyvene-causaltrace fit"):
        load_transcoder(DEFAULT)
    assert cli(["attribute", "--clt", DEFAULT, "--out", os.fspath(fresh_home / "g")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make attribute" in err and DEFAULT.rsplit("/")[-1] in err


def _readme_runner():
    """examples/readme_in_order.py, which runs the README's blocks on the real model."""
    spec = importlib.util.spec_from_file_location("readme_in_order",
                                                  ROOT / "examples" / "readme_in_order.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_readme_shell_command_parses_as_written(monkeypatch):
    """The README's shell lines, as ``examples/readme_in_order.py`` runs them on the real model:
    each ``pyvene-causaltrace`` command parses (no placeholder like DIR, no stale flag), each
    variable is set in its block before use, and each ``make`` target exists."""
    runner = _readme_runner()
    readme = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    parser, ours, makes = build_parser(), 0, 0
    for language, text in runner.blocks(readme):
        if language != "bash":
            continue
        variables = {}
        for command in runner.commands(text):
            assignment = re.fullmatch(r"(\w+)=(\S+)", command)
            if assignment:
                variables[assignment[1]] = os.path.expanduser(assignment[2])
                continue
            words = shlex.split(command)
            for word in words:
                for name in re.findall(r"\$(\w+)", word):
                    assert name in variables, f"${name} is not set before: {command}"
            words = [re.sub(r"\$(\w+)", lambda m, known=variables: known[m[1]], w)
                     for w in words]
            assert words[0] in ("pyvene-causaltrace", "make"), command
            if words[0] == "make":
                makes += 1
                assert set(words[1:]) <= targets, command
                continue
            assert "DIR" not in words, f"a placeholder in: {command}"
            try:
                parser.parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"README's command does not parse: {command}")
            ours += 1
    assert ours >= 9 and makes >= 3
    # a control: a stale flag is caught
    with pytest.raises(SystemExit):
        parser.parse_args(["dataset", "--data", "x", "--no-such-flag"])
