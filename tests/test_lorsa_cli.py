"""Lorsa on the command line (issue 56): ``attribute --lorsa DIR [--qk-tracing]`` writes both
kinds of nodes and the QK tracing into graph.json; ``fit-lorsa`` writes a set that ``attribute``
reads (and reuses or refuses it as ``fit`` does); a Lorsa of another model, of a layer the model
lacks, or damaged is refused with one ``error:`` line (exit 2) before any graph, and the Python
API raises the typed error; a Lorsa graph given to ``evaluate`` and the flags that splice the
transcoder alone (--validate, --faithfulness, --cross-check, --heads) are refused alike. Tiny
models; the fixture Lorsa is the tiny model's own attention (``attention_init``) written with
``save_lorsa``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _support.models import CORPUS, PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import TranscoderFormatError, TranscoderMismatchError
from pyvene_causaltrace.models import load_model
from pyvene_causaltrace.transcoders.lorsa import check_lorsa_fits, load_lorsa, save_lorsa
from pyvene_causaltrace.transcoders.lorsa_checks import names_match
from pyvene_causaltrace.transcoders.lorsa_fit import attention_init

ANSWER = " the"  # one token of the fixture tokenizer
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lorsa_cli")
    make_tiny_model("llama", init=0.2).save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    write_clt(root / "clt", random_clt_tensors(3, 32, 48, threshold=0.1))
    model, _ = load_model(str(root / "llama"))
    for layer in LAYERS:
        save_lorsa(attention_init(bind(model), layer, top_k=8), root / "lorsa" / f"L{layer}",
                   model_name=str(root / "llama"))
    (root / "texts.txt").write_text("\n".join(CORPUS))
    return root


def _refusal(capsys, argv: list[str]) -> str:
    """The one ``error:`` line of ``main(argv)``, which must exit 2 without a traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, code, err)
    return lines[0]


def _attribute(root, out, *extra) -> list[str]:
    return ["attribute", "--model", str(root / "llama"), "--clt", str(root / "clt"), "--prompt",
            PROMPT, "--answer", ANSWER, "--out", str(out), *map(str, extra)]


@pytest.fixture(scope="module")
def graph_dir(root):
    out = root / "graph"
    assert main(_attribute(root, out, "--lorsa", root / "lorsa", "--qk-tracing")) == 0
    return out


def test_attribute_with_lorsa_writes_both_kinds_and_the_qk_tracing(root, graph_dir, capsys):
    payload = json.loads((graph_dir / "graph.json").read_text())
    types = {n["feature_type"] for n in payload["nodes"]}
    assert {"lorsa", "lorsa error", "cross layer transcoder"} <= types
    traced = payload["qk_tracing_results"]
    kept_lorsa = [n["node_id"] for n in payload["nodes"] if n["feature_type"] == "lorsa"]
    assert traced and set(traced) == set(kept_lorsa)  # every kept Lorsa head, and no other
    summary = json.loads((graph_dir / "summary.json").read_text())
    assert summary["qk_tracing"] == len(traced)
    assert summary["metadata"]["lorsa"]["layers"] == list(LAYERS)
    # the control: without --qk-tracing the graph has the heads but no tracing
    out = root / "no_qk"
    assert main(_attribute(root, out, "--lorsa", root / "lorsa")) == 0
    plain = json.loads((out / "graph.json").read_text())
    assert "lorsa" in {n["feature_type"] for n in plain["nodes"]}
    assert not plain.get("qk_tracing_results")


def _copy(root, tmp_path):
    shutil.copytree(root / "lorsa", tmp_path / "lorsa")
    return tmp_path / "lorsa"


def _peer(tmp_path, **changes):
    cfg = peer_config(**changes)
    return write_peer_lorsa(tmp_path / "peer" / f"L{cfg['hook_point_in'].split('.')[1]}", cfg,
                            peer_tensors(cfg), (2.5, 0.7)).parent


def _named_other(root, tmp_path):
    path = _copy(root, tmp_path)
    for layer in LAYERS:
        (path / f"L{layer}" / "lm_config.json").write_text(
            json.dumps({"model_name": "Qwen/Qwen3-1.7B"}))
    return path


def _truncated(root, tmp_path):
    path = _copy(root, tmp_path)
    weights = path / "L2" / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-200])
    return path


def _corrupted(root, tmp_path):
    path = _copy(root, tmp_path)
    weights = path / "L0" / "sae_weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:24] = b"\xff" * 16  # the header's JSON
    weights.write_bytes(bytes(data))
    return path


def _config(change):
    def damage(root, tmp_path):
        path = _copy(root, tmp_path)
        config = path / "L2" / "config.json"
        config.write_text(change(json.loads(config.read_text())))
        return path
    return damage


MISMATCHES = {  # refused against the model: TranscoderMismatchError
    "another model by name": (_named_other, r"L0/lm_config\.json: model_name is "
                                            r"'Qwen/Qwen3-1\.7B'; the model is .*another model"),
    "another width": (lambda root, tmp: _peer(tmp, d_model=48),
                      r"L0/config\.json: d_model is 48; the model's is 32: a Lorsa of another"),
    "another head width": (lambda root, tmp: _peer(tmp, n_qk=2, d_qk=16),
                           r"L0/config\.json: d_qk_head is 16; the model's heads are 8 wide"),
    "a layer the model lacks": (lambda root, tmp: _peer(tmp, layer=5),
                                r"L5/config\.json: hook_point_in names layer 5; the model has 3 "
                                r"layers"),
}
DAMAGED = {  # refused when read: TranscoderFormatError naming the file (and the field)
    "truncated weights": (_truncated, r"L2/sae_weights\.safetensors is not a readable "
                                      r"safetensors file"),
    "corrupted header": (_corrupted, r"L0/sae_weights\.safetensors is not a readable "
                                     r"safetensors file"),
    "config not JSON": (_config(lambda cfg: "{\"d_model\": 32,"),
                        r"L2/config\.json is not JSON"),
    "config missing a field": (_config(lambda cfg: json.dumps(
        {k: v for k, v in cfg.items() if k != "d_qk_head"})),
        r"L2/config\.json: missing field\(s\) d_qk_head"),
    "config field of the wrong kind": (_config(lambda cfg: json.dumps({**cfg, "d_model": "32"})),
                                       r"L2/config\.json: field d_model must be a whole number"),
}


@pytest.mark.parametrize("case", [*MISMATCHES, *DAMAGED])
def test_a_lorsa_of_another_model_or_damaged_is_one_error_line(root, tmp_path, capsys, case):
    """Old code: no --lorsa flag; a config field of the wrong kind raised a bare ValueError
    (a traceback) or a TypeError's words without the field; the model's name and head width
    were not read."""
    import re

    make, message = {**MISMATCHES, **DAMAGED}[case]
    path = make(root, tmp_path)
    out = tmp_path / "out"
    line = _refusal(capsys, _attribute(root, out, "--lorsa", path))
    assert re.search(message, line), line
    assert not out.exists()  # refused before the graph
    if case in MISMATCHES:  # the API's typed error, the same words
        model, _ = load_model(str(root / "llama"))
        with pytest.raises(TranscoderMismatchError, match=message):
            check_lorsa_fits(bind(model), load_lorsa(path))
    else:
        with pytest.raises(TranscoderFormatError, match=message):
            load_lorsa(path)


def test_names_match_the_short_names_one_way_or_the_other():
    assert names_match("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")
    assert names_match("/models/llama/", "/tmp/x/llama")
    assert names_match("", "anything") and names_match("anything", "")
    assert not names_match("Qwen/Qwen3-1.7B", "smollm2-135m")


@pytest.mark.parametrize("flag", [["--validate"], ["--faithfulness"], ["--cross-check"],
                                  ["--heads"]])
def test_flags_that_splice_the_transcoder_alone_are_refused_with_lorsa(root, tmp_path, capsys,
                                                                       flag):
    """Refused before anything loads (the API refuses them after the graph)."""
    out = tmp_path / "out"
    line = _refusal(capsys, _attribute(root, out, "--lorsa", root / "lorsa", *flag))
    assert f"{flag[0]} does not apply to `attribute --lorsa`" in line, line
    assert not out.exists()
    line = _refusal(capsys, _attribute(root, out, "--qk-tracing"))
    assert "--qk-tracing is read only with --lorsa" in line


@pytest.mark.parametrize("budget", [[], ["--budget"]])
def test_evaluate_refuses_a_lorsa_graph_in_one_line(root, graph_dir, capsys, budget):
    line = _refusal(capsys, ["evaluate", str(graph_dir / "graph.safetensors"), "--model",
                             str(root / "llama"), "--clt", str(root / "clt"), "--ablation",
                             "zero", *budget])
    assert "the graph has Lorsa nodes" in line, line


def _fit(root, out, *extra) -> list[str]:
    return ["fit-lorsa", "--model", str(root / "llama"), "--layers", "0,2", "--top-k", "8",
            "--steps", "2", "--length", "6", "--texts", "8", "--data", str(root / "texts.txt"),
            "--out", str(out), *extra]


def test_fit_lorsa_writes_a_set_attribute_reads_and_reuses_or_refuses_it(root, tmp_path, capsys):
    out = tmp_path / "fitted"
    assert main(_fit(root, out)) == 0
    said = capsys.readouterr().out
    assert "Lorsa at layers 0, 2" in said and "held-out FVU" in said
    lorsa = load_lorsa(out)
    assert list(lorsa.layers) == list(LAYERS) and lorsa[0].cfg.top_k == 8
    record = json.loads((out / "fit.json").read_text())
    assert record["settings"]["layers"] == list(LAYERS) and record["settings"]["steps"] == 2
    assert main(_fit(root, out)) == 0 and "reused" in capsys.readouterr().out
    line = _refusal(capsys, _fit(root, out, "--steps", "3"))
    assert "holds a Lorsa fit with other settings: steps 2 (asked 3)" in line and "--refit" in line
    model, _ = load_model(str(root / "llama"))
    check_lorsa_fits(bind(model), lorsa)  # named for the model it was fitted on: attribute reads it
    assert lorsa.model_name == str(root / "llama")


@pytest.mark.parametrize("extra,message", [
    (["--layers", "0,7"], "error: layers [7]: the model has 3 layers"),
    (["--layers", "0,x"], "error: --layers: give layer numbers separated by commas"),
    (["--data", "missing.txt"], "error: --data: data must be 'self', 'known_1000' or a"),
])
def test_fit_lorsa_refusals_are_one_error_line(root, tmp_path, capsys, extra, message):
    assert _refusal(capsys, _fit(root, tmp_path / "f", *extra)).startswith(message)
    assert not (tmp_path / "f").exists()


def test_fit_lorsa_will_not_write_into_a_folder_it_did_not_make(root, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    line = _refusal(capsys, _fit(root, tmp_path / "mine"))
    assert "holds other files and no fit.json" in line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_fit_lorsa_on_device_cpu_is_the_default_fit(root, tmp_path, capsys):
    """``--device cpu`` fits what the default does (the same weights, the same FVU); the API's
    ``device=`` is where it loads the model, refused beside a model already loaded."""
    from safetensors.torch import load_file

    from pyvene_causaltrace.errors import InputError
    from pyvene_causaltrace.lorsa_fitting import LorsaFitSettings, fit_lorsa_set

    default, cpu = tmp_path / "default", tmp_path / "cpu"
    assert main(_fit(root, default)) == 0 and main(_fit(root, cpu, "--device", "cpu")) == 0
    for layer in LAYERS:
        want = load_file(default / f"L{layer}" / "sae_weights.safetensors")
        got = load_file(cpu / f"L{layer}" / "sae_weights.safetensors")
        assert want.keys() == got.keys()
        assert all(torch.equal(got[name], want[name]) for name in want)
    records = [json.loads((path / "fit.json").read_text()) for path in (default, cpu)]
    assert records[0]["fit"] == records[1]["fit"]
    model, tokenizer = load_model(str(root / "llama"))
    with pytest.raises(InputError, match="a loaded model is fitted on its own device"):
        fit_lorsa_set(LorsaFitSettings(layers=(0,), model=str(root / "llama")),
                      out=tmp_path / "api", model=model, tokenizer=tokenizer, device="cpu")
    assert not (tmp_path / "api").exists()


def test_a_fitted_lorsa_is_known_by_its_models_weights_not_by_the_folders_name(root, tmp_path,
                                                                               capsys, tokenizer):
    """fit.json's fingerprint of the model it was fitted on settles it before the names: the
    same model copied to a folder of another name is accepted (old code: refused, "model_name is
    '.../llama'; the model is '.../my-copy'"). Other weights (a fine-tuned or edited copy,
    another dtype) are not refused for that alone, as no transcoder is: the names decide, as
    without a fit.json, and a model of another name is still refused."""
    fitted = tmp_path / "fitted"
    assert main(_fit(root, fitted)) == 0
    copy = tmp_path / "elsewhere" / "my-copy"
    shutil.copytree(root / "llama", copy)
    argv = ["attribute", "--clt", str(root / "clt"), "--prompt", PROMPT, "--answer", ANSWER,
            "--lorsa", str(fitted)]
    out = tmp_path / "graph"
    assert main([*argv, "--model", str(copy), "--out", str(out)]) == 0
    assert (out / "graph.json").is_file()
    model, _ = load_model(str(copy))
    check_lorsa_fits(bind(model), load_lorsa(fitted))
    check_lorsa_fits(bind(model), load_lorsa(fitted / "L2"))  # one layer's directory alike

    other = tmp_path / "other" / "llama"
    make_tiny_model("llama", init=0.2, seed=5).save_pretrained(other)
    tokenizer.save_pretrained(other)
    model, _ = load_model(str(other))
    assert bind(model).fingerprint != load_lorsa(fitted).fitted_on
    check_lorsa_fits(bind(model), load_lorsa(fitted))  # other weights under the fit's name

    same, _ = load_model(str(root / "llama"), dtype=torch.bfloat16)
    check_lorsa_fits(bind(same), load_lorsa(fitted))  # the fit's name
    shutil.copytree(other, tmp_path / "qwen")
    named_other, _ = load_model(str(tmp_path / "qwen"), dtype=torch.bfloat16)
    with pytest.raises(TranscoderMismatchError, match=r"L0/lm_config\.json: model_name is"):
        check_lorsa_fits(bind(named_other), load_lorsa(fitted))
