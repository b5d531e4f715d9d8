"""Nothing silent: a resumed run checks what produced its rows, one writer per output
directory, NaN/inf stop a run naming where they came from, numeric arguments are checked."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_dataset import _facts_file

from pyvene_causaltrace import attribute, run_spec, trace
from pyvene_causaltrace.dataset import read_records, trace_dataset
from pyvene_causaltrace.dataset.store import ManifestMismatchError
from pyvene_causaltrace.finite import NonFiniteError
from pyvene_causaltrace.models import load_model
from pyvene_causaltrace.runlock import LOCK_NAME, OutputLockedError
from pyvene_causaltrace.transcoders import load_transcoder

OPTIONS = {"kinds": ["residual"], "seeds": 1, "known": "none", "progress": False, "n_boot": 10}


def _rows(out) -> list[str]:
    return (out / "results.jsonl").read_text().splitlines()


def test_resume_knows_the_model_by_its_weights_not_its_path(tmp_path, tokenizer, monkeypatch):
    """The same model as ``./m`` resumes the run made with ``m``; other weights saved at the
    same path are refused, naming the weights."""
    make_tiny_model("llama").save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    records, _ = read_records(_facts_file(tmp_path, 3))
    model, tok = load_model("m")
    trace_dataset(model, tok, records, out="run", **OPTIONS)
    first = _rows(tmp_path / "run")
    assert len(first) == 3
    model, tok = load_model("./m")
    trace_dataset(model, tok, records, out="run", **OPTIONS)  # resumes: nothing to do
    assert _rows(tmp_path / "run") == first
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    model.save_pretrained(tmp_path / "m")
    model, tok = load_model("m")
    with pytest.raises(ManifestMismatchError, match=r"the model's weights differ"):
        trace_dataset(model, tok, records, out="run", **OPTIONS)
    assert _rows(tmp_path / "run") == first


def _hold_lock(directory):
    directory.mkdir(parents=True, exist_ok=True)
    code = ("import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
            "lock.acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory / LOCK_NAME)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.process
def test_one_writer_per_output_directory(tmp_path, tokenizer):
    """While another process writes ``out`` a run on it is refused at once and writes nothing;
    once that process is killed (-9) its lock no longer blocks."""
    model = make_tiny_model("gpt2")
    records, _ = read_records(_facts_file(tmp_path, 2))
    out = tmp_path / "run"
    holder = _hold_lock(out)
    try:
        with pytest.raises(OutputLockedError, match="being written by another run"):
            trace_dataset(model, tokenizer, records, out=out, **OPTIONS)
        assert not (out / "results.jsonl").exists()
        clt = load_transcoder(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 8))))
        with pytest.raises(OutputLockedError):
            attribute(make_tiny_model("llama"), tokenizer, clt, PROMPT, checkpoint=out)
    finally:
        holder.kill()
        holder.wait()
    trace_dataset(model, tokenizer, records, out=out, **OPTIONS)
    rows = _rows(out)
    assert len(rows) == len(set(rows)) == 2


def test_nan_in_one_weight_is_a_clear_error(tokenizer, tmp_path):
    model = make_tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    spec = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
            "interventions": [{"type": "noise_add", "seeds": 2, "sigma": 0.5}]}
    clt = load_transcoder(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 8))))
    for call in (lambda: trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0),
                 lambda: run_spec(spec, model, tokenizer),
                 lambda: attribute(model, tokenizer, clt, PROMPT)):
        with pytest.raises(NonFiniteError, match=r"weights hold NaN/inf: model\.layers\.1\."
                                                 r"mlp\.up_proj\.weight has 1 of"):
            call()


def test_overflowing_activations_and_noise_name_their_source(tokenizer):
    model = make_tiny_model("llama")
    with pytest.raises(NonFiniteError, match=r"corrupted run's probabilities hold NaN/inf: the "
                                             r"noise \(scale 1e\+38"):
        trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=1e38)
    with torch.no_grad():  # finite weights whose logits overflow float32
        model.model.norm.weight.fill_(1e30)
        model.lm_head.weight.mul_(1e12)
    with pytest.raises(NonFiniteError, match="clean run's probabilities hold NaN/inf: the "
                                             "weights are finite, so the activations overflow"):
        trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0)


@pytest.mark.parametrize("options,message", [
    ({"scale": float("nan")}, "scale"), ({"scale": -1.0}, "scale"),
    ({"sigma": float("nan")}, "sigma"), ({"sigma": float("inf")}, "sigma"),
    ({"memory_budget_mb": -5}, "memory_budget_mb"), ({"seeds": [1, 1]}, "seeds repeat")])
def test_numeric_arguments_are_checked_at_the_boundary(tokenizer, options, message):
    model = make_tiny_model("gpt2")
    with pytest.raises(ValueError, match=message):
        trace(model, tokenizer, PROMPT, SUBJECT, **{"seeds": 2, "scale": 3.0, **options})


def test_a_prompt_past_the_trained_positions(tokenizer):
    """Past a rotary model's max_position_embeddings the run warns; past GPT-2's absolute
    position table it is refused before it runs."""
    long = " ".join(["tower"] * 300)
    spec = {"schema_version": 1, "prompt": long, "subject": "tower",
            "interventions": [{"type": "noise_add", "seeds": 1, "sigma": 0.5}]}
    with pytest.warns(UserWarning, match=r"tokens, beyond the 256 positions llama was trained"):
        run_spec(spec, make_tiny_model("llama"), tokenizer)
    with pytest.raises(ValueError, match=r"gpt2 has a table of 256 positions"):
        run_spec(spec, make_tiny_model("gpt2"), tokenizer)


def test_pruning_thresholds_are_fractions(tokenizer, tmp_path):
    clt = load_transcoder(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 8))))
    graph = attribute(make_tiny_model("llama"), tokenizer, clt, PROMPT)
    for bad in (float("nan"), -0.1, 1.5):
        with pytest.raises(ValueError, match="node_threshold=.*expected a finite number, >= 0"):
            graph.prune(bad, 0.9)
    assert graph.prune(0.8, 0.98).n_nodes > 0


def test_a_weight_written_after_a_passed_check_is_checked_again(monkeypatch):
    """The bound model scans its weights once and again only after one is written; the stamp
    lives on the bound object, not on the user's model (control: a second bound model scans)."""
    import pyvene_causaltrace.bound as bound_module
    from pyvene_causaltrace.bound import bind
    from pyvene_causaltrace.finite import check_weights

    scans = []
    monkeypatch.setattr(bound_module, "check_weights",
                        lambda model: scans.append(1) or check_weights(model))
    model = make_tiny_model("llama")
    bound = bind(model)
    bound.check_weights()
    bound.check_weights()  # unchanged: not scanned again
    assert len(scans) == 1 and not any(k.startswith("_pvct") for k in vars(model))
    bind(model).check_weights()
    assert len(scans) == 2
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="lm_head.weight"):
        bound.check_weights()
    with pytest.raises(NonFiniteError, match="lm_head.weight"):
        check_weights(model)
