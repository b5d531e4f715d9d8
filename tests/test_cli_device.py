"""``--device`` (issue 54 item 5): every command that loads a model or a transcoder takes it,
hands it to both loaders, and refuses a value or a device the machine lacks (exit 2, one
``error:`` line naming ``--device``) before anything loads. The loaders are spies here: what
they would load is not the point, where they are told to put it is."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _support.data import PROJECT_FACTS, SPEC_DIR
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace import lorsa_fitting
from pyvene_causaltrace.cli import attribute, dataset, evaluate, fit, main, steer, trace


class _Loaded(Exception):
    """The spy of ``load_model``: the command got as far as loading its model."""


@pytest.fixture
def loads(monkeypatch):
    """``[(loader, device)]``: each loader call of the command line's modules. The transcoder's
    returns a stand-in, the model's stops the command (:class:`_Loaded`)."""
    calls = []

    def load_transcoder(*args, **kwargs):
        calls.append(("transcoder", kwargs.get("device")))
        return SimpleNamespace(n_layers=1, cfg=SimpleNamespace(d_transcoder=1))

    def load_model(*args, **kwargs):
        calls.append(("model", kwargs.get("device")))
        raise _Loaded

    for module in (trace, attribute, dataset, steer, evaluate, fit, lorsa_fitting):
        if hasattr(module, "load_transcoder"):
            monkeypatch.setattr(module, "load_transcoder", load_transcoder)
        monkeypatch.setattr(module, "load_model", load_model)
    monkeypatch.setattr(evaluate, "AttributionGraph", SimpleNamespace(
        load=lambda path: SimpleNamespace(lorsa_layers=[])))  # a graph without Lorsa nodes
    monkeypatch.setattr(fit, "fit_transcoder", lambda *a, **kw: (_ for _ in ()).throw(_Loaded))
    return calls


@pytest.fixture
def cuda(monkeypatch):
    """This machine, seen with one CUDA device (the spies load nothing onto it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def files(tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("The Eiffel Tower is in the city of Paris\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The Eiffel Tower is in the city of"}) + "\n")
    return SimpleNamespace(tmp=tmp_path, texts=texts, prompts=prompts)


#: command -> (argv after the command, the loaders it calls, in order).
def _commands(f) -> dict[str, tuple[list[str], list[str]]]:
    out = str(f.tmp / "out")
    return {
        "trace": (["--model", "m"], ["model"]),
        "trace --spec": (["--spec", str(SPEC_DIR / "trace_residual.json")], ["model"]),
        "run": ([str(SPEC_DIR / "residual_trace.json")], ["model"]),
        "validate --model": ([str(SPEC_DIR / "residual_trace.json"), "--model", "m"], ["model"]),
        "clt-check": (["--clt", "c", "--data", str(f.texts)], ["transcoder", "model"]),
        "dataset": (["--data", str(PROJECT_FACTS), "--graphs", "--clt", "c", "--out", out],
                    ["transcoder", "model"]),
        "attribute": (["--clt", "c", "--out", out], ["transcoder", "model"]),
        "attribute --prompts": (["--clt", "c", "--prompts", str(f.prompts), "--out", out],
                                ["transcoder", "model"]),
        "steer": (["--clt", "c", "--set", "0:-1:0=1"], ["transcoder", "model"]),
        "evaluate": (["g.safetensors", "--clt", "c"], ["transcoder", "model"]),
        "fit": (["--out", out], ["model"]),
        "fit-lorsa": (["--layers", "0", "--out", out], ["model"]),
    }


NAMES = ["trace", "trace --spec", "run", "validate --model", "clt-check", "dataset", "attribute",
         "attribute --prompts", "steer", "evaluate", "fit", "fit-lorsa"]


def _run(name: str, argv: list[str], device: str | None) -> None:
    full = [name.split()[0], *argv] + ([] if device is None else ["--device", device])
    with pytest.raises(_Loaded):
        main(full)


@pytest.mark.parametrize("name", NAMES)
def test_the_device_reaches_both_loaders(name, loads, files, cuda):
    """Old code: no --device; every command loaded onto the CPU."""
    argv, loaders = _commands(files)[name]
    _run(name, argv, "cuda:0")
    assert loads == [(loader, "cuda:0") for loader in loaders]


@pytest.mark.parametrize("name", ["trace", "attribute", "steer", "dataset"])
def test_cpu_by_default_and_auto_is_cuda_only_where_there_is_one(name, loads, files,
                                                                  monkeypatch):
    argv, loaders = _commands(files)[name]
    _run(name, argv, None)
    assert loads == [(loader, "cpu") for loader in loaders]
    loads.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _run(name, argv, "auto")
    assert loads == [(loader, "cpu") for loader in loaders]
    loads.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _run(name, argv, "auto")
    assert loads == [(loader, "cuda") for loader in loaders]


def test_fit_on_the_cpu_leaves_the_load_to_fit_transcoder(loads, files):
    """``fit --device cpu`` (the default): fit_transcoder loads the model, as before."""
    argv, _ = _commands(files)["fit"]
    _run("fit", argv, "cpu")
    assert loads == []


def _refusal(capsys, argv: list[str]) -> str:
    code = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, (argv, code, lines)
    return lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_device_this_machine_lacks_is_refused_before_anything_loads(name, loads, files,
                                                                      capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv, _ = _commands(files)[name]
    line = _refusal(capsys, [name.split()[0], *argv, "--device", "cuda"])
    assert "--device cuda" in line and "no CUDA device" in line, line
    assert loads == []


def test_a_cuda_index_past_the_devices_is_refused(loads, files, capsys, cuda):
    argv, _ = _commands(files)["attribute"]
    line = _refusal(capsys, ["attribute", *argv, "--device", "cuda:3"])
    assert "--device cuda:3" in line and "1 CUDA device" in line, line
    assert loads == []


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "", "CPU"])
def test_a_bad_value_is_refused_by_the_parser(value, loads, files, capsys):
    argv, _ = _commands(files)["trace"]
    line = _refusal(capsys, ["trace", *argv, "--device", value])
    assert "argument --device" in line and "cpu, cuda, cuda:N, mps or auto" in line, line
    assert loads == []


def test_validate_reads_the_device_only_with_a_model(capsys):
    line = _refusal(capsys, ["validate", str(SPEC_DIR / "residual_trace.json"), "--device", "cpu"])
    assert "--device is read only with --model" in line, line


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_tiny_trace_runs_on_the_device_asked_for(device, tmp_path, tokenizer, capsys):
    """The real loaders, end to end (``auto`` is the CPU on a machine without CUDA)."""
    make_tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    code = main(["trace", "--model", str(tmp_path / "tiny"), "--prompt", PROMPT, "--subject",
                 SUBJECT, "--seeds", "1", "--window", "1", "--no-progress",
                 "--device", device])
    assert code == 0 and "residual trace" in capsys.readouterr().out


def test_load_model_refuses_a_device_this_machine_lacks_before_loading(monkeypatch, tmp_path):
    """The API's ``load_model(device=...)`` refuses as ``--device`` does (it raised torch's
    AssertionError after loading the weights); ``"auto"`` is the CPU without CUDA."""
    import transformers

    from pyvene_causaltrace import load_model
    from pyvene_causaltrace.errors import InputError

    def never(*args, **kwargs):
        raise AssertionError("loaded before the device was checked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", never)
    with pytest.raises(InputError, match=r"^device=cuda:1: no CUDA device"):
        load_model(str(tmp_path), device="cuda:1")
    with pytest.raises(InputError, match="loaded before"):  # the control: auto goes on to load
        load_model(str(tmp_path), device="auto")
