"""pyvene-native from both sides: a user's pv.IntervenableModel goes into our calls, and pyvene
builds our types from their classes, through add_intervention, with unit_locations."""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from reference import edit_output

from pyvene_causaltrace import attribute, trace
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.interventions import get_intervention, list_interventions
from pyvene_causaltrace.interventions.clt_splice import CLTSplice
from pyvene_causaltrace.interventions.frozen import FrozenLayerNorm
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.interventions.restore import CleanRestore, Freeze, WindowRestore
from pyvene_causaltrace.models import PyveneModelError, get_adapter
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class, preserve_hooks
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.transcoders import load_transcoder

pv = import_pyvene()
IntervenableModel = intervenable_model_class()
#: what a type refuses with in pyvene's own class, where it needs ours
OURS = r"build the model with pyvene_causaltrace\.IntervenableModel\(\.\.\.\)"
SPEC = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "interventions": [
    {"type": "noise_add", "seeds": [0, 1], "scale": 3.0, "sigma": 0.5},
    {"type": "clean_restore", "component": "block_output", "layers": [1], "positions": "last"}]}


def _zero(output):
    return torch.zeros_like(output)


def _zeroed_mlp(model):
    """The user's pyvene model: MLP 1's output zeroed (a sourceless pyvene built-in)."""
    return pv.IntervenableModel([{"layer": 1, "component": "mlp_output",
                                  "intervention_type": pv.ZeroIntervention}], model)


@pytest.mark.numerics
def test_our_calls_take_a_pyvene_model_and_apply_its_interventions(tokenizer, tmp_path):
    """trace, Tracer, run_spec and attribute given a pv.IntervenableModel run the model with its
    interventions applied to every run: the same numbers as the plain model with the same edit
    made by a hand-written hook; afterwards the model is as it was."""
    model = make_tiny_model("llama", init=0.2)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    pv_model = _zeroed_mlp(model)
    mlp = get_adapter(model).module_path("mlp", 1)
    clt = load_transcoder(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 16))))

    got = {"trace": trace(pv_model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).recovery,
           "spec": run_spec(SPEC, pv_model, tokenizer).intervened_probs,
           "graph": attribute(pv_model, tokenizer, clt, PROMPT).target_row()}
    with edit_output(model, mlp, _zero):
        want = {"trace": trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).recovery,
                "spec": run_spec(SPEC, model, tokenizer).intervened_probs,
                "graph": attribute(model, tokenizer, clt, PROMPT).target_row()}
        with torch.no_grad():
            edited = model(input_ids=ids).logits
    for key in want:
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(want[key]),
                                   rtol=0, atol=1e-6, msg=key)
    plain = trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).recovery
    assert abs(plain - want["trace"]).max() > 1e-3  # the edit matters to the trace
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(after, before) and not torch.allclose(edited, before)


def test_a_pyvene_intervention_that_needs_a_source_is_refused(tokenizer):
    model = make_tiny_model("llama")
    pv_model = pv.IntervenableModel([{"layer": 0, "component": "block_output",
                                      "intervention_type": pv.VanillaIntervention}], model)
    for call in (lambda: trace(pv_model, tokenizer, PROMPT, SUBJECT, seeds=1, scale=3.0),
                 lambda: run_spec(SPEC, pv_model, tokenizer),
                 lambda: attribute(pv_model, tokenizer, None, PROMPT)):
        with pytest.raises(PyveneModelError, match=r"need a source at call time.*pv_model\.model"):
            call()


def test_calls_that_need_the_model_itself_say_so():
    from pyvene_causaltrace.execute import build_interventions

    model = make_tiny_model("llama")
    pv_model = _zeroed_mlp(model)
    with pytest.raises(PyveneModelError, match=r"build_interventions takes the bare model.*"
                                               r"pv_model\.model"):
        build_interventions(SPEC, pv_model, None)


# ----------------------------------------------------------------- pyvene builds our types


def _bare_buildable() -> list[str]:
    return [name for name in list_interventions()
            if get_intervention(name)._has_bare_defaults()]


@pytest.mark.numerics
def test_pyvene_builds_every_type_from_the_class():
    """``intervention_type=Cls`` builds each type with working defaults (the splice, which
    needs a transcoder, only from ``configured``): noise_add noises every position it is
    handed; the restores, with no stored states, take the whole source state (so the output is
    the source run's); the freezes and the leaf leave the forward value as it was. All in
    pyvene's own class but the frozen types, which recompute their module: those need ours,
    and pyvene's refuses them, naming it."""
    assert set(_bare_buildable()) == set(list_interventions()) - {"clt_splice", "feature_ablate",
                                                              "lorsa_splice"}
    model = make_tiny_model("llama", init=0.2)
    adapter = get_adapter(model)
    ids = torch.randint(1, 400, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        source_run = model(input_ids=ids.flip(0)).logits
    for name in _bare_buildable():
        component = ("model.layers[1].input_layernorm.output" if name == "frozen_layernorm"
                     else "model.layers[1].self_attn.output" if name == "frozen_attention"
                     else adapter.site("block_output", 1))
        rep = {"component": component, "intervention_type": get_intervention(name)}
        restores = name in ("clean_restore", "window_restore", "freeze")
        frozen = name.startswith("frozen_")
        if frozen:
            theirs = pv.IntervenableModel(pv.IntervenableConfig([dict(rep)]), model)
            with preserve_hooks(theirs), torch.no_grad(), pytest.raises(
                    PyveneModelError, match=f"{name} recomputes .* from its inputs.*{OURS}"):
                theirs(base={"input_ids": ids})
        pv_model = (IntervenableModel if frozen else pv.IntervenableModel)(
            pv.IntervenableConfig([dict(rep)]), model)
        with preserve_hooks(pv_model), torch.no_grad():
            sources = [{"input_ids": ids.flip(0)}] if restores else None
            _, out = pv_model(base={"input_ids": ids}, sources=sources)
        if restores:
            torch.testing.assert_close(out.logits, source_run, msg=name)
        elif name == "noise_add":
            assert not torch.allclose(out.logits, plain, atol=1e-3), name
        else:
            torch.testing.assert_close(out.logits, plain, msg=name)


@pytest.mark.numerics
def test_configured_classes_equal_instances(tokenizer, tmp_path):
    """``Cls.configured(**settings)`` given to pyvene (RepresentationConfig, intervention_types,
    add_intervention) runs exactly as the instance ``Cls(**settings)``, in our IntervenableModel
    (own positions, a frozen norm and a splice built one by one need it: pyvene's own refuses
    them, naming it)."""
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        clean = model.model(input_ids=ids).last_hidden_state
    adapter = get_adapter(model)
    clt = load_transcoder(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 16))))
    cases = [
        (NoiseAdd, {"seeds": [3, 4], "positions": [1, 2], "sigma": 0.3}, adapter.site("embed")),
        (CleanRestore, {"positions": [4], "states": clean}, adapter.site("block_output", 1)),
        (Freeze, {"positions": [[2], [5]], "states": clean}, adapter.site("block_output", 0)),
        (WindowRestore, {"positions": [3], "states": clean, "sublayer": "mlp", "window_layer": 1,
                         "center": 1, "window": 2}, adapter.site("block_output", 1)),
        (FrozenLayerNorm, {"kind": "rms"}, adapter.site("final_norm")),
    ]
    for cls, settings, component in cases:
        made = IntervenableModel([{"component": component,
                                   "intervention": cls(**settings)}], model)
        config = pv.IntervenableConfig([{"component": component,
                                         "intervention_type": cls.configured(**settings)}])
        configured = IntervenableModel(config, model)
        with torch.no_grad():
            want = made(base={"input_ids": ids})[1].logits
            got = configured(base={"input_ids": ids})[1].logits
        assert torch.equal(got, want), cls.__name__
        theirs = pv.IntervenableModel(config, model)
        with preserve_hooks(theirs), torch.no_grad(), pytest.raises(
                PyveneModelError, match=f"{cls.registered_name} (has its own positions|"
                                        f"recomputes the norm).*{OURS}"):
            theirs(base={"input_ids": ids})
    # add_intervention: pyvene refuses instances there; configured classes go in
    encode = CLTSplice.configured(clt=clt, role="encode", clt_layer=1, reset=True)
    decode = CLTSplice.configured(clt=clt, role="decode", clt_layer=1)
    hooks = clt.cfg.hf_hooks(adapter, 1)
    config = pv.IntervenableConfig([{"component": hooks["input"], "intervention_type": encode}])
    config.add_intervention({"component": hooks["output"], "intervention_type": decode})
    from pyvene_causaltrace.interventions.clt_splice import clt_splice_representations

    added = IntervenableModel(config, model)
    # one splice given its session runs in pyvene's own class too
    spliced = pv.IntervenableModel(clt_splice_representations(model, clt, layers=[1]), model)
    with preserve_hooks(spliced), torch.no_grad():
        got = added(base={"input_ids": ids})[1].logits
        want = spliced(base={"input_ids": ids})[1].logits
        plain = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, plain, atol=1e-4)
    # built one by one, its parts hold only their session's id: pyvene's own cannot bind them
    theirs = pv.IntervenableModel(config, model)
    with preserve_hooks(theirs), torch.no_grad(), pytest.raises(
            PyveneModelError, match=f"clt_splice holds only its splice's session id.*{OURS}"):
        theirs(base={"input_ids": ids})


def test_unit_locations_choose_the_positions_as_for_pyvenes_builtins():
    """Without their own positions our types act where pyvene's ``unit_locations`` say, in
    pyvene's own class too: noise_add at locations [1, 2, 3] is noise_add(positions=[1, 2, 3])
    on the whole output (in ours: pyvene's refuses own positions), and clean_restore from a
    source equals pyvene's VanillaIntervention."""
    model = make_tiny_model("qwen3", init=0.2)
    embed = get_adapter(model).site("embed")
    ids = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(2))
    source = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(3))
    positioned = [{"component": embed, "intervention": NoiseAdd(seeds=[7], positions=[1, 2, 3],
                                                                 sigma=0.3)}]
    located = [{"component": embed, "intervention": NoiseAdd(seeds=[7], sigma=0.3)}]
    theirs = pv.IntervenableModel(located, model)
    at = {"base": [[[1, 2, 3]]]}
    with preserve_hooks(theirs), torch.no_grad():
        want = IntervenableModel(positioned, model)(base={"input_ids": ids})[1].logits
        got = theirs(base={"input_ids": ids}, unit_locations=at)[1].logits
        ours = IntervenableModel(located, model)(base={"input_ids": ids}, unit_locations=at)
    assert torch.equal(got, want) and torch.equal(ours[1].logits, want)
    with pytest.raises(PyveneModelError, match=f"noise_add has its own positions.*{OURS}"):
        pv.IntervenableModel(positioned, model)(base={"input_ids": ids})
    for cls in (CleanRestore, pv.VanillaIntervention):
        pv_model = pv.IntervenableModel(
            [{"layer": 1, "component": "block_output", "intervention_type": cls}], model)
        with preserve_hooks(pv_model), torch.no_grad():
            out = pv_model(base={"input_ids": ids}, sources=[{"input_ids": source}],
                           unit_locations={"sources->base": ([[[2, 4]]], [[[2, 4]]])})[1]
        if cls is CleanRestore:
            ours = out.logits
    assert torch.equal(ours, out.logits)


@pytest.mark.parametrize("arch,kind", [("gpt2", "layer"), ("llama", "rms"),
                                       ("gemma2", "rms_offset")])
def test_frozen_layernorm_reads_its_kind_off_the_module(arch, kind):
    model = make_tiny_model(arch)
    norm = get_adapter(model).site("final_norm")
    made = FrozenLayerNorm()
    ids = torch.tensor([[1, 2, 3, 4]])
    theirs = pv.IntervenableModel([{"component": norm, "intervention": made}], model)
    with preserve_hooks(theirs), torch.no_grad(), pytest.raises(
            PyveneModelError, match=f"frozen_layernorm recomputes the norm.*{OURS}"):
        theirs(base={"input_ids": ids})
    assert made.config()["kind"] is None  # refused before it read anything
    with torch.no_grad():
        IntervenableModel([{"component": norm, "intervention": made}], model)(
            base={"input_ids": ids})
    assert made.config()["kind"] == kind
