"""Every user mistake on the command line ends in one ``error:`` line and exit 2 — no traceback.
One table per command: missing and malformed files, wrong paths, out-of-range and non-finite
numbers, inputs longer than the model allows, a busy output directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.cli import main
from pyvene_causaltrace.cli.dataset import DATASET_FLAGS
from pyvene_causaltrace.cli.trace import TRACE_FLAGS


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
    spec = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT}
    (root / "no_interventions.json").write_text(json.dumps({**spec, "interventions": []}))
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "deep_spec.json").write_text(  # loads, but 400 levels deep
        json.dumps({**spec, "interventions": []})[:-1] + ', "x": ' + "[" * 400 + "]" * 400 + "}")
    (root / "globals_path.json").write_text(json.dumps({**spec, "interventions": [
        {"type": "noise_add", "seeds": 2, "sigma": 0.5},
        {"type": "clean_restore", "component": "model.__init__.__globals__.output",
         "positions": "subject"}]}))
    (root / "list.json").write_text("[1, 2]")
    (root / "future.json").write_text(json.dumps({**spec, "schema_version": 99,
                                                  "interventions": []}))
    (root / "a_dir.json").mkdir()
    (root / "no_attribute.json").write_text(json.dumps([{"prompt": PROMPT}]))
    (root / "float_labels.csv").write_text("layer,feature,label\n0,1,real\n1.9,6.7,fake\n")
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "config.json").write_text("{}")
    run = root / "lost_manifest"  # rows of a run whose manifest.json was deleted
    run.mkdir()
    (run / "results.jsonl").write_text(json.dumps({"index": 0, "kind": "residual"}) + "\n")
    run = root / "bad_manifest"
    run.mkdir()
    (run / "manifest.json").write_text('{"scale": "3\x01"}')
    splice = {"type": "clt_splice", "clt": str(root / "clt"), "error": "clean"}
    steer = {"schema_version": 1, "prompt": PROMPT}
    (root / "scale_steer.json").write_text(json.dumps({**steer, "interventions": [
        splice, {"type": "feature_ablate", "clt_layer": 1, "features": [2], "scale": 3.0}]}))
    (root / "no_error_steer.json").write_text(json.dumps({**steer, "interventions": [
        {"type": "clt_splice", "clt": str(root / "clt")},
        {"type": "feature_ablate", "clt_layer": 1, "features": [2], "value": 3.0}]}))
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
        (["--model", "{root}/llama", "--seeds", "100000000"], "seeds"),
        (["--model", "{root}/llama", "--seeds", "-5"], "seeds"),
        (["--model", "{root}/llama", "--scale", "big"], "scale"),
        (["--model", "{root}/llama", "--sigma", "loud"], "sigma"),
        (["--model", "{root}/llama", "--budget-mb", "nan"], "budget"),
        (["--model", "{root}/llama", "--subject", ""], "subject"),
        (["--model", "{root}/llama", "--prompt", "", "--subject", "x"], "prompt"),
        (["--model", "{root}/llama", "--answer", ""], "answer"),
        (["--model", "{root}/llama", "--kind", "residual,"], "kind"),
        (["--model", "{root}/a_file"], "a_file"),
        (["--model", "{root}/not_a_model"], "not_a_model"),
        (["--spec", "{root}/deep.json"], "deep"),
        (["--spec", "{root}/a_dir.json"], "a_dir.json"),
    ],
    "run": [
        (["{root}/absent.json"], "absent.json"),
        (["{root}/broken.json"], "not valid JSON"),
        (["{root}/unknown_type.json", "--model", "{root}/llama"], "clean_restore"),
        (["{root}/nan_scale.json", "--model", "{root}/llama"], "scale"),
        (["{root}/spec.json", "--model", "{root}/absent"], "absent"),
        (["{root}/spec.json", "--model", "{root}/llama", "--out", "{root}/a_file"], "a_file"),
        (["{root}/no_interventions.json", "--model", "{root}/llama"], "interventions"),
        (["{root}/deep.json", "--model", "{root}/llama"], "deep"),
        (["{root}/deep_spec.json", "--model", "{root}/llama"], "deep"),
        (["{root}/globals_path.json", "--model", "{root}/llama"], "__init__"),
        (["{root}/list.json"], "object"),
        (["{root}/future.json"], "schema_version"),
        (["{root}/a_dir.json"], "a_dir.json"),
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
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--seeds", "100000000",
          "--out", "{root}/d8"], "seeds"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--kinds", "residul",
          "--out", "{root}/d9"], "residul"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--window", "0",
          "--out", "{root}/d10"], "window"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama", "--scale", "5",
          "--seeds", "2", "--out", "{root}/lost_manifest"], "manifest"),
        (["--data", "{root}/facts.json", "--model", "{root}/llama",
          "--out", "{root}/bad_manifest"], "manifest.json"),
    ],
    "aggregate": [
        (["{root}/absent_run"], "absent_run"),
        (["{root}/empty_run"], "manifest"),
        (["{root}/bad_manifest"], "manifest.json"),
        (["{root}/lost_manifest"], "manifest"),
        (["{root}/empty_run", "--boot", "-1"], "boot"),
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
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--data",
          "{root}/no_attribute.json"], "no_attribute.json"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--data", "{root}/broken.json"],
         "broken.json"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--format", "bogus", "--data",
          "{root}/texts.txt"], "bogus"),
    ],
    "attribute": [
        (["--model", "{root}/llama", "--clt", "{root}/absent", "--out", "{root}/g1"], "absent"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--memory-mb", "-1",
          "--out", "{root}/g2"], "memory"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--max-feature-nodes", "-3",
          "--out", "{root}/g3"], "--max-feature-nodes"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--node-threshold", "nan",
          "--out", "{root}/g4"], "threshold"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--labels", "{root}/absent.csv",
          "--out", "{root}/g5"], "absent.csv"),
        (["--spec", "{root}/spec.json", "--model", "{root}/llama", "--clt", "{root}/clt",
          "--out", "{root}/g6"], "attribution"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--out", "{root}/a_file"], "a_file"),
        (["--model", "{root}/gpt2", "--clt", "{root}/clt", "--prompt", LONG,
          "--out", "{root}/g7"], "position"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--max-links", "-1",
          "--out", "{root}/g8"], "max-links"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--k", "0",
          "--out", "{root}/g9"], "k"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--target", "difference",
          "--out", "{root}/g10"], "other"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--edge-threshold", "2",
          "--out", "{root}/g11"], "threshold"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--labels",
          "{root}/float_labels.csv", "--out", "{root}/g12"], "float_labels.csv"),
        (["--model", "{root}/llama", "--clt", "{root}/a_file", "--out", "{root}/g13"],
         "a_file"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--format", "bogus",
          "--out", "{root}/g14"], "bogus"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "{root}/not_yaml/config.yaml",
          "--out", "{root}/g15"], "config.yaml"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--max-n-logits", "0",
          "--out", "{root}/g16"], "--max-n-logits"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--desired-logit-prob", "1.5",
          "--out", "{root}/g17"], "--desired-logit-prob"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--bos-errors", "zero",
          "--out", "{root}/g18"], "invalid choice"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--direction",
          "{root}/absent.json", "--out", "{root}/g19"], "absent.json"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--direction",
          "{root}/texts.txt", "--out", "{root}/g20"], "texts.txt"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--direction",
          "{root}/spec.json", "--answer", " the", "--out", "{root}/g21"], "one of them"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--prompt", "Miles Davis plays the",
          "--answer", " the", "--cross-check", "--out", "{root}/g22"], "--subject"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check", "--subject",
          "Louvre", "--out", "{root}/g23"], "not in the prompt"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--prompt", "Miles Davis plays the",
          "--subject", "Miles Davis", "--cross-check", "--out", "{root}/g24"], "--answer"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check", "--check-modes",
          "linear", "--out", "{root}/g25"], "check-modes"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check", "--seeds", "0",
          "--out", "{root}/g26"], "seeds"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check", "--scale", "-1",
          "--out", "{root}/g27"], "scale"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check",
          "--check-features", "-1", "--out", "{root}/g28"], "check-features"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--cross-check",
          "--check-window", "0", "--out", "{root}/g29"], "check-window"),
    ],
    "steer": [
        (["--model", "{root}/llama", "--clt", "{root}/clt"], "--set"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3"],
         "LAYER:POS:FEATURE=VALUE"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:last:3=1"],
         "LAYER:POS:FEATURE=VALUE"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=nan"], "finite"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=big"],
         "not a number"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "5:2:3=1"], "layer 5"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:99=1"], "feature 99"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:0:3=1", "--bos",
          "always"], "position 0 is BOS here"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:99:3=1"],
         "position 99"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=1", "--set",
          "1:all:3=2"], "already sets"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=1",
          "--max-new-tokens", "-1"], "max-new-tokens"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=1", "--top-k", "0"],
         "top-k"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=1", "--prompt", ""],
         "prompt"),
        (["--model", "{root}/llama", "--set", "1:2:3=1"], "transcoder"),
        (["--model", "{root}/llama", "--clt", "{root}/absent", "--set", "1:2:3=1"], "absent"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--format", "bogus", "--set",
          "1:2:3=1"], "bogus"),
        (["--model", "{root}/llama", "--clt", "{root}/clt", "--set", "1:2:3=1", "--out",
          "{root}/a_file"], "a_file"),
        (["--model", "{root}/gpt2", "--clt", "{root}/clt", "--set", "1:2:3=1", "--prompt", LONG],
         "position"),
        (["--spec", "{root}/scale_steer.json", "--model", "{root}/llama", "--set", "1:2:3=1"],
         "drop --set"),
        (["--spec", "{root}/scale_steer.json", "--model", "{root}/llama"], "scales features"),
        (["--spec", "{root}/no_error_steer.json", "--model", "{root}/llama"], "error"),
        (["--spec", "{root}/spec.json", "--model", "{root}/llama"], "clt_splice"),
        (["--spec", "{root}/broken.json"], "not valid JSON"),
    ],
    "interventions": [(["--bogus"], "unrecognized"),
                      (["--plugins", "no_such_plugin_module"], "no_such_plugin_module")],
    "serve": [(["{root}/absent"], "absent"), (["{root}/empty_run"], "no graph"),
              (["{root}/empty_run", "--port", "70000", "--no-open"], "port"),
              (["{root}/empty_run", "--port", "-1", "--no-open"], "port")],
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


#: One bad value for each ``trace`` and ``dataset`` flag that sets a settings field (argparse
#: dest -> value; ``dataset``'s graph flags need ``--graphs --clt``): argparse or the settings
#: refuse it, and either way the error names the flag.
SETTINGS_FLAG_MISTAKES = {
    "trace": {"seeds": "0", "scale": "big", "sigma": "loud", "window": "0", "budget_mb": "-1"},
    "dataset": {"kinds": "residul", "seeds": "0", "scale": "nan", "sigma": "loud", "window": "0",
                "known": "some", "limit": "0", "budget_mb": "0", "boot": "0",
                "max_feature_nodes": "-3", "graph_memory_mb": "nan", "bos": "sometimes"},
}
GRAPH_DESTS = {"max_feature_nodes", "graph_memory_mb", "bos"}  # save_graphs: a switch


def test_every_settings_flag_has_a_mistake():
    assert set(SETTINGS_FLAG_MISTAKES["trace"]) == set(TRACE_FLAGS)
    assert set(SETTINGS_FLAG_MISTAKES["dataset"]) == set(DATASET_FLAGS) | GRAPH_DESTS


@pytest.mark.parametrize("command,dest,value", [
    (command, dest, value) for command, rows in SETTINGS_FLAG_MISTAKES.items()
    for dest, value in rows.items()])
def test_a_refused_setting_names_its_flag(root, capsys, command, dest, value):
    flag = "--" + dest.replace("_", "-")
    argv = [command, flag, value]
    if command == "dataset":
        argv += ["--data", str(root / "facts.json"), "--out", str(root / f"flag_{dest}")]
        argv += ["--graphs", "--clt", str(root / "clt")] if dest in GRAPH_DESTS else []
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and flag in errors[0], err


def test_validate_reports_every_file(root, capsys):
    code = main(["validate", str(root / "spec.json"), str(root / "broken.json"),
                 str(root / "absent.json"), str(root / "unknown_type.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("invalid") == 3 and f"ok      {root / 'spec.json'}" in out


@pytest.mark.process
def test_a_bug_still_shows_its_traceback(root):
    """Only user mistakes are caught: an internal error keeps its traceback."""
    code = ("import sys; import pyvene_causaltrace.cli as cli, pyvene_causaltrace.cli.trace as t; "
            "t.interventions_command = lambda args: 1 / 0; sys.exit(cli.main(['interventions']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1 and "ZeroDivisionError" in done.stderr and \
        "Traceback" in done.stderr
