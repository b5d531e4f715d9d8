"""A model shared between threads, left in train mode, or interrupted mid-run still gives the
right numbers, and keeps no hook of ours afterwards."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from _support.hooks import installed
from _support.models import PROMPT, SUBJECT, make_tiny_model, prompt_ids
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace import Tracer, attribute, run_spec, trace
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.model_guard import measuring
from pyvene_causaltrace.pyvene_boundary.intervenable import IntervenableModel
from pyvene_causaltrace.transcoders import load_from_disk

OPTIONS = {"seeds": 3, "scale": 3.0, "answer": " Paris"}


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(getattr(m, table)) for m in model.modules()
               for table in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"))


def _with_dropout(p: float = 0.5) -> torch.nn.Module:
    model = make_tiny_model("gpt2", init=0.2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    return model


def test_two_threads_on_one_model_get_the_serial_numbers(tokenizer):
    model = make_tiny_model("llama", init=0.2)
    expected = {kind: trace(model, tokenizer, PROMPT, SUBJECT, kind=kind, **OPTIONS)
                for kind in ("residual", "mlp")}
    hooks = _hook_count(model)
    start = threading.Barrier(4)
    results, failures = {}, []

    def work(index: int) -> None:
        kind = ("residual", "mlp")[index % 2]
        try:
            start.wait()
            results[index] = (kind, trace(model, tokenizer, PROMPT, SUBJECT, kind=kind,
                                          **OPTIONS))
        except Exception as error:  # noqa: BLE001 -- reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    assert len(results) == 4
    for kind, result in results.values():
        assert (result.restored_probs == expected[kind].restored_probs).all()
    assert _hook_count(model) == hooks
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()  # no stray hook fires


def test_train_mode_is_measured_in_eval_mode_and_restored(tokenizer, caplog):
    model = _with_dropout()
    model.eval()
    reference = trace(model, tokenizer, PROMPT, SUBJECT, **OPTIONS)
    model.train()
    model.transformer.h[1].eval()  # a mixed state comes back as it was
    with caplog.at_level(logging.WARNING, logger="pyvene_causaltrace.model_guard"):
        first = trace(model, tokenizer, PROMPT, SUBJECT, **OPTIONS)
        second = trace(model, tokenizer, PROMPT, SUBJECT, **OPTIONS)
    assert (first.restored_probs == reference.restored_probs).all()
    assert (second.restored_probs == reference.restored_probs).all()
    assert first.clean_prob == reference.clean_prob
    assert model.training and model.transformer.h[0].training
    assert not model.transformer.h[1].training
    assert any("train mode" in r.getMessage() for r in caplog.records)


def test_train_mode_spec_run_matches_eval(tokenizer):
    spec = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "answer": " Paris",
            "interventions": [{"type": "noise_add", "seeds": 2, "scale": 3.0},
                              {"type": "clean_restore", "component": "block_output",
                               "layers": 1, "positions": "subject"}]}
    model = _with_dropout()
    reference = run_spec(spec, model.eval(), tokenizer)
    model.train()
    again = run_spec(spec, model, tokenizer)
    assert again.intervened_probs == reference.intervened_probs
    assert model.training


def test_an_interrupted_trace_leaves_no_hook(tokenizer, monkeypatch):
    """Ctrl-C inside a restore forward (our hooks on every block): none stays, and the next
    trace of the same tracer is the uninterrupted one."""
    model = make_tiny_model("llama")
    tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, **OPTIONS)
    expected = tracer.trace("residual").restored_probs
    hooks = _hook_count(model)
    norm = model.model.norm

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(norm, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tracer.trace("residual")
    assert _hook_count(model) == hooks
    monkeypatch.undo()
    assert (tracer.trace("residual").restored_probs == expected).all()


def test_a_hook_of_ours_left_behind_is_removed(caplog):
    """Whatever a run leaves (here: a block of hooks entered and never left, its handles lost)
    is removed through its handle when the measurement ends, and said in the log."""
    model = make_tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="pyvene_causaltrace.model_guard"), \
            measuring(model):
        left = installed([(model.model.layers[0], "forward", lambda *_: None),
                          (model.model.layers[1], "forward_pre", lambda *_: None)])
        left.__enter__()  # held, never exited: its finally has not run
        assert _hook_count(model) == 2
    assert _hook_count(model) == 0
    assert any("removed 2 hook(s)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_pyvene_call_leaves_only_the_hooks_that_were_there(error):
    """Ctrl-C or an error inside an intervention during our IntervenableModel's forward: the
    hooks pyvene registered are gone; the user's and transformers' output-capturing hooks were
    never taken off, and hidden states still come back."""
    model = make_tiny_model("llama")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    model(input_ids=ids, output_hidden_states=True)  # transformers installs its hooks
    seen = []
    handle = model.model.layers[2].register_forward_hook(lambda *_: seen.append(1))
    before = _hook_count(model)

    def boom(base, source=None, subspaces=None, **kwargs):
        raise error("stop")

    pv_model = IntervenableModel([{"component": "model.layers[1].output",
                                   "intervention": boom}], model)
    with pytest.raises(error):
        pv_model(base={"input_ids": ids})
    assert _hook_count(model) == before
    out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(model.model.layers) + 1 and seen
    handle.remove()


def test_a_users_own_hook_stays(tokenizer):
    model = make_tiny_model("llama")
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda *_: seen.append(1))
    with measuring(model):
        model.model.layers[1].register_forward_hook(lambda *_: seen.append(2))
    assert _hook_count(model) == 2  # the user's hooks, registered before and inside, stay
    handle.remove()


def test_ctrl_c_during_a_trace_is_one_line_and_130(tokenizer, tmp_path, monkeypatch, capsys):
    make_tiny_model("llama").save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tracer, "trace", interrupted)
    code = main(["trace", "--model", str(tmp_path / "m"), "--scale", "3",
                 "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 130
    assert len(captured.err.strip().splitlines()[-1:]) == 1 and "interrupted" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not list((tmp_path / "out").glob("*.json"))  # nothing half-written


@pytest.mark.numerics
def test_a_graph_of_a_model_in_train_mode_is_its_eval_graph(tokenizer, tmp_path):
    """Dropout on (GPT-2's p=0.5): the graph is the eval model's, edge for edge, and closes."""
    model = _with_dropout()
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 48,
                                                                             threshold=0.1))))
    reference = attribute(model.eval(), tokenizer, clt, PROMPT)
    model.train()
    graph = attribute(model, tokenizer, clt, PROMPT)
    assert graph.closure.relative < 1e-5
    assert graph.to_dataframe().equals(reference.to_dataframe())
    assert model.training
