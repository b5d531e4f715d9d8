"""The command line, on a tiny model saved to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PROMPT, SPEC_DIR, SUBJECT, make_tiny_model

from pyvene_causaltrace.cli import main


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    make_tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_help_is_fast_and_does_not_import_pyvene():
    code = ("import sys; from pyvene_causaltrace.cli import _parser; _parser(); "
            "print('pyvene' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False False"


def test_validate(tmp_path, capsys):
    assert main(["validate", *map(str, sorted(SPEC_DIR.glob("*.json")))]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1, "prompt": "x", "interventions": [
        {"type": "noise_add", "seeds": [0], "scale": "big"}]}))
    assert main(["validate", str(bad)]) == 1
    assert "$.interventions[0].scale" in capsys.readouterr().out


def test_interventions_lists_builtins_and_reserved(capsys):
    assert main(["interventions"]) == 0
    out = capsys.readouterr().out
    for name in ("noise_add", "clean_restore", "window_restore", "freeze", "frozen_layernorm",
                 "clt_splice"):
        assert name in out


def test_run_a_spec_and_write_json(model_dir, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
                                "interventions": [
                                    {"type": "noise_add", "seeds": 2},
                                    {"type": "clean_restore", "layers": 1,
                                     "positions": "last"}]}))
    assert main(["run", str(spec), "--model", str(model_dir), "--out", str(tmp_path / "o")]) == 0
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    assert len(result["recovery"]) == 2 and result["seeds"] == [0, 1]
    assert "recovery" in capsys.readouterr().out


def test_trace_and_clear_errors(model_dir, tmp_path, capsys):
    assert main(["trace", "--model", str(model_dir), "--seeds", "2", "--out",
                 str(tmp_path / "t")]) == 0
    trace = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert len(trace["mean_recovery"]) == 3 and len(trace["mean_recovery"][0]) == 2
    assert main(["trace", "--model", str(model_dir), "--subject", "Louvre"]) == 2
    assert "Louvre" in capsys.readouterr().err
