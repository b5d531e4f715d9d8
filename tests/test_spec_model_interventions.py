"""A spec written from a run on a user's pv.IntervenableModel carries its interventions
(``model_interventions``): rerun on the bare model — tracer_from_spec, run_spec, the CLI's
``run`` — it gives the same numbers to the last bit, in this process (default tier) and in a
fresh one (``process`` tier: nothing carried over in memory). What a spec cannot
rebuild exactly is refused, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _support.data import ROOT
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace import spec_tensors
from pyvene_causaltrace.execute import build_interventions, check_on_model, run_spec
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.models import PyveneModelError
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.specs import SpecError, load_spec, save_spec, validate_spec
from pyvene_causaltrace.tracing.tracer import Tracer, trace, tracer_from_spec

pv = import_pyvene()
TRACE = {"seeds": 2, "scale": 3.0}
SPEC = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "interventions": [
    {"type": "noise_add", "seeds": [0, 1], "scale": 3.0, "sigma": 0.5},
    {"type": "clean_restore", "component": "block_output", "layers": [1], "positions": "last"}]}


class Project(pv.ConstantSourceIntervention):
    """A user's own type: adds ``alpha * (x M^T) M`` — a big buffer and a JSON setting."""

    def __init__(self, matrix: torch.Tensor | None = None, alpha: float = 0.01, **kwargs):
        kwargs.setdefault("keep_last_dim", True)
        super().__init__(**kwargs)
        self.alpha = alpha
        self.register_buffer("matrix", matrix if matrix is not None else torch.zeros(1, 1))

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return base + self.alpha * (base @ self.matrix.T) @ self.matrix


class Unsaved(pv.ConstantSourceIntervention, pv.LocalistRepresentationIntervention):
    """Its offset is a non-persistent buffer: not in its state dict, so no spec can hold it."""

    def __init__(self, offset: torch.Tensor | None = None, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("offset", offset if offset is not None else torch.zeros(1),
                             persistent=False)

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return base + self.offset


class Squash(pv.ConstantSourceIntervention, pv.LocalistRepresentationIntervention):
    """Holds a function: not JSON, not a tensor."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.function = torch.tanh

    def forward(self, base, source=None, subspaces=None, **kwargs):
        return self.function(base)


def _delta(scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(32, generator=torch.Generator().manual_seed(5))


def _user_model(model, extra: list[dict] | None = None):
    """The issue's pv model: MLP 1's output zeroed and a constant added to block 2's output,
    built with pyvene's own class as a user would."""
    representations = [
        {"layer": 1, "component": "mlp_output", "intervention_type": pv.ZeroIntervention},
        {"layer": 2, "component": "block_output",
         "intervention": pv.AdditionIntervention(source_representation=_delta())},
        *(extra or [])]
    return pv.IntervenableModel(representations, model)


@pytest.fixture(params=["here", pytest.param("fresh", marks=pytest.mark.process)])
def rerun(request) -> str:
    """Where a saved spec is rerun: in this process on a new bare model, or in a fresh
    Python process (what a colleague who was sent the file does)."""
    return request.param


def _fresh(tmp_path, body: str, where: str = "fresh") -> None:
    """Run ``body`` in a new Python process (``where="here"``: in this one, with a namespace of
    its own), with the repository and tests/ importable and ``tmp_path`` as working directory."""
    script = textwrap.dedent("""
        import sys
        sys.path[:0] = [{root!r}, {tests!r}]
        import numpy as np
        import torch
        from transformers import AutoTokenizer
        from _support.models import make_tiny_model
        from pyvene_causaltrace.specs import load_spec
        from pyvene_causaltrace.tracing.tracer import tracer_from_spec
        from pyvene_causaltrace.execute import run_spec
        tokenizer = AutoTokenizer.from_pretrained({tok!r})
    """).format(root=str(ROOT), tests=str(ROOT / "tests"), tok=str(tmp_path / "tokenizer"))
    if where == "here":
        before, cwd = list(sys.path), os.getcwd()
        os.chdir(tmp_path)
        try:
            exec(compile(script + textwrap.dedent(body), "<rerun>", "exec"), {})
        finally:
            os.chdir(cwd)
            sys.path[:] = before
        return
    done = subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]


def _trace_again(where: str, tmp_path, spec_path, arch: str, **model_options) -> dict:
    _fresh(tmp_path, f"""
        model = make_tiny_model({arch!r}, **{model_options!r})
        spec = load_spec({str(spec_path)!r})
        tracer = tracer_from_spec(spec, model, tokenizer)
        result = tracer.trace(spec.trace["kind"], window=spec.trace["window"])
        np.save("restored.npy", result.restored_probs)
        np.save("corrupt.npy", result.corrupt_probs)
        np.save("clean.npy", np.array(result.clean_prob))
        import json
        json.dump(result.spec, open("respec.json", "w"))
    """, where)
    return {"restored": np.load(tmp_path / "restored.npy"),
            "corrupt": np.load(tmp_path / "corrupt.npy"),
            "clean": float(np.load(tmp_path / "clean.npy")),
            "spec": json.loads((tmp_path / "respec.json").read_text())}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.numerics
def test_a_trace_spec_carries_the_pyvene_interventions_bit_for_bit(arch, tokenizer, tmp_path,
                                                                  rerun):
    model = make_tiny_model(arch, init=0.2)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    pv_model = _user_model(model)
    # pyvene lowered every requires_grad flag of the model, which moves torch's matmul in the
    # last bits; the fresh process's model has them up: our runs must not depend on them
    assert not any(p.requires_grad for p in model.parameters())
    result = trace(pv_model, tokenizer, PROMPT, SUBJECT, **TRACE)
    assert not any(p.requires_grad for p in model.parameters())  # left as they were
    entries = result.spec["model_interventions"]
    assert [e["class"] for e in entries] == ["pyvene.models.interventions.ZeroIntervention",
                                             "pyvene.models.interventions.AdditionIntervention"]
    assert [(e["component"], e["layer"]) for e in entries] == [("mlp_output", 1),
                                                               ("block_output", 2)]
    added = entries[1]["tensors"]["source_representation"]
    assert added["dtype"] == "float32" and added["shape"] == [32]
    assert torch.equal(torch.tensor(added["data"], dtype=torch.float32), _delta())
    # the interventions matter: without them (the spec as it was written before) the trace
    # is another experiment
    plain = trace(model, tokenizer, PROMPT, SUBJECT, **TRACE)
    assert np.abs(plain.restored_probs - result.restored_probs).max() > 1e-3

    save_spec(result.spec, tmp_path / "trace.json")
    assert not (tmp_path / "trace.safetensors").exists()  # small tensors stay inline
    again = _trace_again(rerun, tmp_path, tmp_path / "trace.json", arch, init=0.2)
    assert np.array_equal(again["restored"], result.restored_probs)
    assert np.array_equal(again["corrupt"], result.corrupt_probs)
    assert again["clean"] == result.clean_prob
    assert again["spec"] == result.spec  # the rerun writes the same spec back


@pytest.mark.numerics
def test_run_spec_and_the_cli_rerun_a_result_spec_bit_for_bit(tokenizer, tmp_path, rerun):
    """run_spec on the pv model (ours among pyvene's: noise_add by its registered name) →
    result.spec saved → in a fresh process run_spec and ``pyvene-causaltrace run`` on the bare
    model give the same probabilities."""
    model = make_tiny_model("llama", init=0.2)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    ours = NoiseAdd(seeds=[7], positions=[5], sigma=0.3)
    pv_model = _user_model(model, [{"layer": 0, "component": "block_output",
                                    "intervention": ours}])
    result = run_spec(SPEC, pv_model, tokenizer)
    entries = result.spec["model_interventions"]
    assert [e["class"] for e in entries][2] == "noise_add"
    assert "pvct_config" in entries[2]["tensors"]  # our types' JSON config is in their state
    plain = run_spec(SPEC, model, tokenizer)
    assert max(abs(a - b) for a, b in zip(plain.intervened_probs, result.intervened_probs,
                                          strict=True)) > 1e-4
    with pytest.raises(SpecError, match=r"\$\.model_interventions: build_interventions"):
        build_interventions(result.spec, model, tokenizer)

    save_spec(result.spec, tmp_path / "run.json")
    _fresh(tmp_path, f"""
        import json
        from pyvene_causaltrace.cli import main
        model = make_tiny_model("llama", init=0.2)
        result = run_spec(load_spec({str(tmp_path / 'run.json')!r}), model, tokenizer)
        json.dump(result.intervened_probs + result.corrupt_probs + [result.clean_prob],
                  open("api.json", "w"))
        assert main(["run", {str(tmp_path / 'run.json')!r}, "--model",
                     {str(tmp_path / 'model')!r}, "--out", "cli"]) == 0
    """, rerun)
    want = result.intervened_probs + result.corrupt_probs + [result.clean_prob]
    assert json.loads((tmp_path / "api.json").read_text()) == want
    cli = json.loads((tmp_path / "cli" / "result.json").read_text())
    assert cli["intervened_probs"] + cli["corrupt_probs"] + [cli["clean_prob"]] == want
    assert cli["spec"]["model_interventions"] == entries


def test_a_big_constant_goes_through_a_safetensors_file(tokenizer, tmp_path, rerun):
    """A user's own class by import path, with a 256 x 32 buffer (over the inline limit):
    save_spec writes it beside the JSON with its sha256; a fresh process rebuilds it exactly;
    a changed or missing file is refused at the tensor's JSON path."""
    model = make_tiny_model("llama", init=0.2)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    matrix = torch.randn(256, 32, generator=torch.Generator().manual_seed(9)) / 16
    pv_model = _user_model(model, [{"layer": 0, "component": "mlp_output",
                                    "intervention": Project(matrix, alpha=0.05)}])
    result = trace(pv_model, tokenizer, PROMPT, SUBJECT, **TRACE)
    entry = result.spec["model_interventions"][2]
    assert entry["class"] == "test_spec_model_interventions.Project"
    assert entry["settings"]["alpha"] == 0.05 and entry["settings"]["keep_last_dim"] is True

    path = tmp_path / "big" / "trace.json"
    path.parent.mkdir()
    save_spec(result.spec, path)
    written = json.loads(path.read_text())["model_interventions"][2]["tensors"]["matrix"]
    assert set(written) == {"dtype", "shape", "file", "key", "sha256"}
    assert written["file"] == "trace.safetensors" and written["shape"] == [256, 32]
    inline = json.loads(path.read_text())["model_interventions"][1]["tensors"]
    assert "data" in inline["source_representation"]  # the small one stays inline
    from safetensors.torch import load_file

    assert torch.equal(load_file(path.with_suffix(".safetensors"))[written["key"]], matrix)

    again = _trace_again(rerun, tmp_path, path, "llama", init=0.2)
    assert np.array_equal(again["restored"], result.restored_probs)
    assert np.array_equal(again["corrupt"], result.corrupt_probs)

    # save_spec of the loaded spec elsewhere copies the tensor into its own file
    copy_path = tmp_path / "copy" / "spec.json"
    copy_path.parent.mkdir()
    save_spec(load_spec(path), copy_path)
    assert torch.equal(load_file(copy_path.with_suffix(".safetensors"))[written["key"]], matrix)

    where = r"\$\.model_interventions\[2\]\.tensors\.matrix"
    from safetensors.torch import save_file

    save_file({written["key"]: matrix * 2}, str(path.with_suffix(".safetensors")))
    with pytest.raises(SpecError, match=where + r": .*does not match its sha256"):
        tracer_from_spec(load_spec(path), model, tokenizer)
    path.with_suffix(".safetensors").unlink()
    with pytest.raises(SpecError, match=where + r"\.file: .*does not exist"):
        tracer_from_spec(load_spec(path), model, tokenizer)
    with pytest.raises(SpecError, match=where + r"\.file: .*load it with load_spec\(path\)"):
        tracer_from_spec(json.loads(path.read_text()), model, tokenizer)


@pytest.mark.parametrize("name,message", [
    ("collections.OrderedDict", "is not a pyvene Intervention subclass"),
    ("os.path.join", "is not a pyvene Intervention subclass"),
    ("pyvene_causaltrace.no_such_module.Thing", "cannot import"),
    ("no_such_intervention", "is no registered intervention type"),
])
def test_a_class_that_is_not_a_pyvene_intervention_is_refused(tokenizer, name, message):
    model = make_tiny_model("llama", init=0.2)
    spec = Tracer(_user_model(model), tokenizer, PROMPT, SUBJECT, **TRACE).spec("residual")
    spec["model_interventions"][1]["class"] = name
    validate_spec(spec)  # the schema reads it; nothing is imported until the rebuild
    with pytest.raises(SpecError, match=r"^\$\.model_interventions\[1\]\.class: .*" + message):
        tracer_from_spec(spec, model, tokenizer)
    with pytest.raises(SpecError, match=r"^\$\.model_interventions\[1\]\.class: "):
        check_on_model(spec, model, tokenizer)  # what `validate --model` runs
    with pytest.raises(SpecError, match=r"^\$\.model_interventions\[1\]\.class: "):
        run_spec({**SPEC, "model_interventions": spec["model_interventions"]}, model, tokenizer)


def _local_class():
    class Local(pv.ZeroIntervention):
        pass

    return Local


@pytest.mark.parametrize("made,reason", [
    (Unsaved(torch.ones(32)), r"buffer offset is not in its state dict"),
    (Squash(), r"attribute 'function' is <built-in method tanh.*not JSON data"),
    (_local_class()(), r"defined inside a function"),
])
def test_an_intervention_a_spec_cannot_rebuild_is_refused_with_the_reason(tokenizer, made,
                                                                          reason):
    model = make_tiny_model("llama", init=0.2)
    pv_model = _user_model(model, [{"layer": 0, "component": "mlp_output",
                                    "intervention": made}])
    tracer = Tracer(pv_model, tokenizer, PROMPT, SUBJECT, **TRACE)  # the runs themselves work
    with pytest.raises(PyveneModelError, match=r"layer_0_comp_mlp_output.*" + reason):
        tracer.spec("residual")
    with pytest.raises(PyveneModelError, match=reason):  # refused before the trace runs
        tracer.trace("residual")
    with pytest.raises(PyveneModelError, match=reason):
        run_spec(SPEC, pv_model, tokenizer)


def test_a_pv_model_given_with_such_a_spec_must_hold_the_same_interventions(tokenizer):
    model = make_tiny_model("llama", init=0.2)
    pv_model = _user_model(model)
    result = trace(pv_model, tokenizer, PROMPT, SUBJECT, **TRACE)
    same = tracer_from_spec(result.spec, pv_model, tokenizer).trace("residual")
    assert np.array_equal(same.restored_probs, result.restored_probs)
    other = pv.IntervenableModel([{"layer": 0, "component": "mlp_output",
                                   "intervention_type": pv.ZeroIntervention}], model)
    with pytest.raises(PyveneModelError, match=r"ambiguous.*pv_model\.model"):
        tracer_from_spec(result.spec, other, tokenizer)
    with pytest.raises(PyveneModelError, match="ambiguous"):
        run_spec({**SPEC, "model_interventions": result.spec["model_interventions"]}, other,
                 tokenizer)


def test_the_entries_schema_names_the_json_path(tokenizer):
    model = make_tiny_model("llama", init=0.2)
    spec = Tracer(_user_model(model), tokenizer, PROMPT, SUBJECT, **TRACE).spec("residual")
    entries = spec["model_interventions"]
    bad = json.loads(json.dumps(spec))
    bad["model_interventions"][1]["tensors"]["source_representation"]["dtype"] = "float8"
    with pytest.raises(SpecError, match=r"\$\.model_interventions\[1\]\.tensors\."
                                        r"source_representation\.dtype"):
        validate_spec(bad)
    bad = json.loads(json.dumps(spec))
    bad["model_interventions"][1]["tensors"]["source_representation"]["data"].pop()
    with pytest.raises(SpecError, match=r"\$\.model_interventions\[1\]\.tensors\."
                                        r"source_representation\.data: holds shape \[31\]"):
        tracer_from_spec(bad, model, tokenizer)
    bad = json.loads(json.dumps(spec))
    del bad["model_interventions"][0]["component"]
    with pytest.raises(SpecError, match=r"\$\.model_interventions\[0\]"):
        validate_spec(bad)
    attribution = {"schema_version": 1, "prompt": PROMPT, "interventions": [],
                   "attribution": {"clt": "x"}, "model_interventions": entries}
    with pytest.raises(SpecError, match=r"\$\.model_interventions: an attribution spec"):
        validate_spec(attribution)


def test_a_float32_survives_json_to_the_last_bit():
    values = torch.tensor([1e-45, -0.0, 3.4028234663852886e38, 0.1, -1 / 3, 2 ** -126],
                          dtype=torch.float32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        tensor = values.to(dtype)
        encoded = json.loads(json.dumps(spec_tensors.encode_tensor(tensor)))
        back = spec_tensors.decode_tensor(encoded, "$.t", None)
        assert back.dtype == dtype and spec_tensors.digest(back) == spec_tensors.digest(tensor)
