"""Every user mistake on the command line ends in one ``error:`` line and exit 2 — no traceback.
One table per command: missing and malformed files, wrong paths, out-of-range and non-finite
numbers, inputs longer than the model allows, a busy output directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from clt_fixtures import random_clt_tensors, write_clt
from conftest import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer):
    """A tiny Llama and GPT-2 on disk, a model whose vocabulary is smaller than the tokenizer's,
    a CLT, facts, a spec, and a handful of broken files."""
    root = tmp_path_factory.mktemp("cli_errors")
    for arch, name, vocab in (("llama", "llama", 420), ("gpt2", "gpt2", 420),
                              ("llama", "small_vocab", 300)):
        make_tiny_model(arch, vocab_size=vocab).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    write_clt(root / "clt", random_clt_tensors(3, 32, 8))
    (root / "facts.json").write_text(json.dumps([
        {"known_id": i, "subject": SUBJECT, "attribute": "Paris", "prompt": PROMPT}
        for i in range(3)]))
    (root / "spec.json").write_text(json.dumps({
        "schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
        "interventions": [{"type": "noise_add", "seeds": 2, "sigma": 0.5}]}))
    (root / "broken.json").write_text("{not json")
    (root / "unknown_type.json").write_text(json.dumps({
        "schema_version": 1, "prompt": PROMPT, "interventions": [{"type": "clean_restor"}]}))
    (root / "nan_scale.json").write_text(json.dumps({  # Python's json writes NaN as NaN
        "schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "interventions": [
            {"type": "noise_add", "seeds": 2, "sigma": 0.5, "scale": float("nan")}]}))
    (root / "not_yaml").mkdir()
    (root / "not_yaml" / "config.yaml").write_text("model_kind: [unclosed\n  : - :")
    (root / "a_file").write_text("x")
    (root / "texts.txt").write_text(PROMPT + " Paris\n")
    (root / "empty_run").mkdir()
    return root


LONG = " ".join(["tower"] * 300)  # past GPT-2's 256 positions in the tiny config

CASES = {
    "trace": [
        (["--model", "{root}/absent"], "absent"),
        (["--model", "{root}/llama", "--subject", "Rome"], "Rome"),
        (["--model", "{root}/llama", "--scale", "nan"], "scale"),
        (["--model", "{root}/llama", "--scale", "-2"], "scale"),
        (["--model", "{root}/llama", "--seeds", "0"], "seeds"),
        (["--model", "{root}/llama", "--window", "0"], "window"),
        (["--model", "{root}/llama", "--budget-mb", "-1"], "budget"),
        (["--model", "{root}/llama", "--kind", "residul"], "residul"),
        (["--model", "{root}/llama", "--out", "{root}/a_file", "--scale", "3"], "a_file"),
        (["--model", "{root}/gpt2", "--prompt", LONG, "--subject", "tower"], "position"),
        (["--model", "{root}/small_vocab", "--answer", " Paris", "--scale", "3"], "vocabulary"),
        (["--spec", "{root}/broken.json"], "not valid JSON"),
        (["--spec", "{root}/absent.json"], "absent.json"),
    ],
    "run": [
        (["{root}/absent.json"], "absent.json"),
        (["{root}/broken.json"], "not valid JSON"),
        (["{root}/unknown_type.json", "--model", "{root}/llama"], "clean_restore"),
        (["{root}/nan_scale.json", "--model", "{root}/llama"], "scale"),
        (["{root}/spec.json", "--model", "{root}/absent"], "absent"),
        (["{root}/spec.json", "--model", "{root}/llama", "--out", "{root}/a_file"], "a_file"),
    ],
    "validate": [  # a missing or bad spec is reported as invalid (exit 1): see below
        (["{root}/spec.json", "--model", "{root}/absent"], "absent"),
    ],
    "dataset": [
        (["--data", "{root}/absent.json", "--out", "{root}/d1"], "absent.json"),
        (["--data", "{root}/broken.json", "--out", "{root}/d2"], "broken.json"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--limit", "0",
          "--out", "{root}/d3"], "limit"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--seeds", "0",
          "--out", "{root}/d4"], "seeds"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--scale", "nan",
          "--out", "{root}/d5"], "scale"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--budget-mb", "0",
          "--out", "{root}/d6"], "budget"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--out", "{root}/a_file"],
         "a_file"),
        (["--task", "nonsense", "--out", "{root}/d7"], "nonsense"),
    ],
    "aggregate": [
        (["{root}/absent_run"], "absent_run"),
        (["{root}/empty_run"], "manifest"),
    ],
    "clt-check": [
        (["--model", "{root}/llama", "--clt", "{root}/absent", "--data", "{root}/texts.txt"],
         "absent"),
        (["--model", "{root}/llama", "--clt", "{root}/not_yaml/config.yaml", "--data",
          "{root}/texts.txt"], "config.yaml"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--data", "{root}/absent.txt"],
         "absent.txt"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--data", "{root}/texts.txt",
          "--limit", "0"], "limit"),
    ],
    "attribute": [
        (["--model", "{root}/llama", "--clt", "{root}/absent", "--out", "{root}/g1"], "absent"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--memory-mb", "-1",
          "--out", "{root}/g2"], "memory"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--max-feature-nodes", "-3",
          "--out", "{root}/g3"], "max_feature_nodes"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--node-threshold", "nan",
          "--out", "{root}/g4"], "threshold"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--labels", "{root}/absent.csv",
          "--out", "{root}/g5"], "absent.csv"),
        (["--spec", "{root}/spec.json", "--model", "{root}/llama", "--clt", "{root}/clt",
          "--out", "{root}/g6"], "attribution"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--out", "{root}/a_file"], "a_file"),
        (["--model", "{root}/gpt2", "--clt", "{root}/clt", "--prompt", LONG,
          "--out", "{root}/g7"], "position"),
    ],
    "interventions": [(["--bogus"], "unrecognized")],
    "serve": [(["{root}/absent"], "absent"), (["{root}/empty_run"], "no graph")],
}


@pytest.mark.parametrize("command,args,needle", [
    (command, args, needle) for command, rows in CASES.items() for args, needle in rows],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_a_user_mistake_is_one_error_line_and_exit_2(root, capsys, command, args, needle):
    argv = [command, *(a.replace("{root}", str(root)) for a in args)]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, (argv, captured.out, captured.err)
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_validate_reports_every_file(root, capsys):
    code = main(["validate", str(root / "spec.json"), str(root / "broken.json"),
                 str(root / "absent.json"), str(root / "unknown_type.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("invalid") == 3 and f"ok      {root / 'spec.json'}" in out


def test_a_bug_still_shows_its_traceback(root):
    """Only user mistakes are caught: an internal error keeps its traceback."""
    code = ("import sys; import pyvene_causaltrace.cli as cli, pyvene_causaltrace.cli.trace as t; "
            "t.interventions_command = lambda args: 1 / 0; sys.exit(cli.main(['interventions']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1 and "ZeroDivisionError" in done.stderr and \
        "Traceback" in done.stderr
