"""The pyvene boundary: our types honour pyvene's subspaces, head units and generate(); they
refuse positions given twice; a user's IntervenableModel in our runs is applied as pyvene
applies it (on a clone, upstream tensors untouched); trainable-parameter counts are pyvene's."""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace import trace
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.interventions.noise import NoiseAdd, noise_recipe
from pyvene_causaltrace.interventions.restore import CleanRestore
from pyvene_causaltrace.models import PyveneModelError, get_adapter, get_module
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class, preserve_hooks
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.pyvene_boundary.user_edits import applied_interventions

pv = import_pyvene()
IntervenableModel = intervenable_model_class()
#: what a type with its own positions refuses with in pyvene's own class
OWN_POSITIONS = (r"noise_add has its own positions.*unit_locations and whether pyvene is "
                 r"generating.*build the model with pyvene_causaltrace\.IntervenableModel")


def _ids(seed: int, n: int = 6, batch: int = 2) -> torch.Tensor:
    return torch.randint(1, 400, (batch, n), generator=torch.Generator().manual_seed(seed))


def _pv(model, representations, ours: bool = False):
    if ours:
        return IntervenableModel(representations, model)
    return pv.IntervenableModel(representations, model)


# ------------------------------------------------------------------ subspaces (item 4)


@pytest.mark.parametrize("unit", ["pos", "h.pos"])
@pytest.mark.numerics
def test_clean_restore_with_subspaces_is_vanillas_bit_for_bit(unit):
    """CleanRestore from a source with pyvene's subspaces (one list, or one per row, or through
    a subspace_partition) equals VanillaIntervention exactly, and differs from the full-width
    restore."""
    model = make_tiny_model("llama", init=0.2)
    base, source = _ids(1), _ids(2)
    if unit == "pos":
        rep = {"layer": 1, "component": "block_output"}
        locations = {"sources->base": ([[[2, 4]] * 2], [[[2, 4]] * 2])}
    else:
        rep = {"layer": 1, "component": "head_attention_value_output", "unit": "h.pos"}
        heads, positions = [[0, 2]] * 2, [[1, 3]] * 2
        locations = {"sources->base": ([[heads, positions]], [[heads, positions]])}
    outputs = {}
    # pyvene's subspaces: per intervention, per row, the dimensions
    for subspaces in (None, [[[0, 1, 2, 5]] * 2], [[[0, 1], [3, 6, 7]]]):
        for cls in (CleanRestore, pv.VanillaIntervention):
            with torch.no_grad():
                pv_model = _pv(model, [{**rep, "intervention_type": cls}])
                outputs[cls, str(subspaces)] = pv_model(
                    base={"input_ids": base}, sources=[{"input_ids": source}],
                    unit_locations=locations, subspaces=subspaces)[1].logits
        assert torch.equal(outputs[CleanRestore, str(subspaces)],
                           outputs[pv.VanillaIntervention, str(subspaces)]), subspaces
    assert not torch.allclose(outputs[CleanRestore, "None"],
                              outputs[CleanRestore, str([[[0, 1, 2, 5]] * 2])], atol=1e-4)
    # a subspace partition: subspaces index its parts
    with torch.no_grad():
        parted = {}
        for cls in (CleanRestore, pv.VanillaIntervention):
            pv_model = _pv(model, [{**rep, "intervention_type": cls,
                                    "subspace_partition": [[0, 3], [3, 8]]}])
            parted[cls] = pv_model(base={"input_ids": base}, sources=[{"input_ids": source}],
                                   unit_locations=locations, subspaces=[[[1]] * 2])[1].logits
    assert torch.equal(parted[CleanRestore], parted[pv.VanillaIntervention])


@pytest.mark.numerics
def test_noise_add_with_subspaces_noises_only_those_dimensions():
    model = make_tiny_model("llama", init=0.2)
    embed = get_adapter(model).site("embed")
    ids = _ids(3, batch=1)
    seen = {}
    module = get_module(model, embed.rsplit(".", 1)[0])
    handle = module.register_forward_hook(lambda m, a, out: seen.setdefault("clean", out.clone()))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    noise = NoiseAdd(seeds=[5], positions=[1, 2], sigma=0.4)
    got = {}
    pv_model = _pv(model, [{"component": embed, "intervention": noise}], ours=True)
    layer0 = get_module(model, get_adapter(model).module_path("block", 0))
    handle = layer0.register_forward_pre_hook(lambda m, a: got.setdefault("x", a[0].clone()))
    with torch.no_grad():
        pv_model(base={"input_ids": ids}, subspaces=[0, 7, 9])
    handle.remove()
    delta = got["x"] - seen["clean"]
    draw = noise_recipe(5, 2, delta.shape[-1], 3.0, 0.4)
    want = torch.zeros_like(delta)
    want[0, 1:3, [0, 7, 9]] = draw[:, [0, 7, 9]]
    torch.testing.assert_close(delta, want, rtol=0, atol=1e-6)
    assert (delta[..., [c for c in range(delta.shape[-1]) if c not in (0, 7, 9)]] == 0).all()


# ------------------------------------------------------------------ head units (item 5)


@pytest.mark.numerics
def test_noise_add_at_head_units_is_the_noise_of_the_heads_concatenation():
    """noise_add at unit h.pos on the attention value output (o_proj's input) of heads [0, 1]
    at positions [1, 2] adds, head by head, the draw the same seed gives the concatenated heads
    (the recipe unchanged)."""
    model = make_tiny_model("llama", init=0.2)
    ids = _ids(4, batch=1)
    o_proj = get_module(model, "model.layers.1.self_attn.o_proj")
    inputs = []
    handle = o_proj.register_forward_hook(lambda m, args, out: inputs.append(args[0].clone()))
    rep = {"layer": 1, "component": "head_attention_value_output", "unit": "h.pos",
           "intervention": NoiseAdd(seeds=[3], sigma=0.5)}
    with torch.no_grad():
        model(input_ids=ids)
        pv_model = _pv(model, [rep], ours=True)
        pv_model(base={"input_ids": ids},
                 unit_locations={"sources->base": (None, [[[[0, 1]], [[1, 2]]]])})
    handle.remove()
    delta = (inputs[-1] - inputs[0]).reshape(1, ids.shape[1], 4, 8)  # [b, s, heads, d_head]
    draw = noise_recipe(3, 2, 16, 3.0, 0.5).reshape(2, 2, 8)  # [pos, heads 0-1, d_head]
    want = torch.zeros_like(delta)
    want[0, 1:3, :2] = draw
    torch.testing.assert_close(delta, want, rtol=0, atol=1e-6)


def test_types_that_need_whole_states_refuse_subspaces_and_head_units():
    from pyvene_causaltrace.interventions.leaf import GradientLeaf

    leaf = GradientLeaf()
    with pytest.raises(ValueError, match="subspaces are not supported"):
        leaf(torch.zeros(1, 3, 4), None, [[0]])
    with pytest.raises(ValueError, match="head units are not supported"):
        leaf(torch.zeros(1, 2, 3, 4), None)


# --------------------------------------------------- positions and unit_locations (item 6)


def test_positions_and_unit_locations_together_are_refused():
    model = make_tiny_model("llama", init=0.2)
    embed = get_adapter(model).site("embed")
    reps = [{"component": embed, "intervention": NoiseAdd(seeds=[1], positions=[1], sigma=0.3)}]
    pv_model = _pv(model, reps, ours=True)
    with pytest.raises(ValueError, match="both its own positions and pyvene unit_locations"):
        pv_model(base={"input_ids": _ids(5, batch=1)}, unit_locations={"base": [[[2, 3, 4]]]})
    # pyvene's own class cannot tell gathered positions from the whole output (it would noise
    # the gathered index: a silent wrong number): refused, naming our class
    with pytest.raises(PyveneModelError, match=OWN_POSITIONS):
        _pv(model, reps)(base={"input_ids": _ids(5, batch=1)},
                         unit_locations={"base": [[[2, 3, 4]]]})
    # either one alone is fine, and they agree
    with torch.no_grad():
        alone = pv_model(base={"input_ids": _ids(5, batch=1)})[1].logits
        located = _pv(model, [{"component": embed, "intervention": NoiseAdd(
            seeds=[1], sigma=0.3)}])(base={"input_ids": _ids(5, batch=1)},
                                     unit_locations={"base": [[[1]]]})[1].logits
    assert torch.equal(alone, located)


# -------------------------------------------------------------- generate (item 7)


def _generate_by_hand(model, ids, edit_embeddings, steps):
    """Greedy decoding with a KV cache, ``edit_embeddings`` applied to the prompt's forward."""
    embed = get_module(model, get_adapter(model).module_path("embed"))
    calls = []

    def hook(_module, _args, output):
        calls.append(output.shape[1])
        return edit_embeddings(output) if len(calls) == 1 else output

    handle = embed.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False,
                                  attention_mask=torch.ones_like(ids))
    finally:
        handle.remove()


@pytest.mark.parametrize("ours", [False, True])
def test_noise_add_in_generate_noises_the_prompt_once(ours):
    """generate(intervene_on_prompt=True) with noise_add at prompt positions [1, 2, 3]: the
    prompt is noised, the generated tokens are not: the same tokens as a hand-made decode
    that noises only the prompt's forward (and other tokens than the plain model's). pyvene's
    own class cannot tell generate's steps apart: refused there, naming ours."""
    model = make_tiny_model("llama", init=0.2)
    model.generation_config.pad_token_id = 0
    ids = _ids(6, n=7, batch=2)
    embed = get_adapter(model).site("embed")
    noise = NoiseAdd(seeds=[0, 1], positions=[1, 2, 3], sigma=0.5)
    pv_model = _pv(model, [{"component": embed, "intervention": noise}], ours=ours)
    if not ours:
        with torch.no_grad(), pytest.raises(PyveneModelError, match=OWN_POSITIONS):
            pv_model.generate({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              intervene_on_prompt=True, max_new_tokens=5, do_sample=False)
        return
    with torch.no_grad():
        _, got = pv_model.generate({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                   intervene_on_prompt=True, max_new_tokens=5, do_sample=False)
    delta = noise.noise(2, 7, 32, 0)
    want = _generate_by_hand(model, ids, lambda out: out + delta, 5)
    plain = _generate_by_hand(model, ids, lambda out: out, 5)
    assert torch.equal(got, want)
    assert not torch.equal(want, plain)
    # pyvene's default (intervene_on_prompt=False) puts unit_locations on generated tokens
    with pytest.raises(ValueError, match="intervene_on_prompt=True"):
        pv_model.generate({"input_ids": ids}, max_new_tokens=2, do_sample=False)


def test_clt_splice_in_generate_is_the_whole_sequences_or_refused(tmp_path):
    """A splice rewrites every position from its from_position on: generate(...,
    intervene_on_prompt=True, use_cache=False) runs each step on the whole sequence and equals
    greedy spliced forwards of the grown sequence. A cached step (the newest token alone, read
    as position 0) left the generated tokens unspliced ([296, 377, ...] against [296, 394,
    ...]), and pyvene's default put unit location 0 on each step, splicing nothing (the plain
    model's tokens): both refused."""
    from clt_fixtures import random_clt_tensors, write_clt

    from pyvene_causaltrace import IntervenableModel
    from pyvene_causaltrace.errors import InputError
    from pyvene_causaltrace.interventions.clt_splice import clt_splice_representations
    from pyvene_causaltrace.runtime import intervened
    from pyvene_causaltrace.transcoders import load_transcoder

    model = make_tiny_model("llama", init=0.2)
    clt = load_transcoder(write_clt(tmp_path / "clt", random_clt_tensors(
        n_layers=model.config.num_hidden_layers, d_model=model.config.hidden_size)))
    ids = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    want = ids
    for _ in range(4):
        with torch.no_grad(), intervened(bind(model), clt_splice_representations(model, clt)) as m:
            want = torch.cat([want, m(input_ids=want).logits[:, -1].argmax(-1, True)], 1)
    plain = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert not torch.equal(want, plain)  # the control: the splice changes the tokens

    def generate(**options):
        pv = IntervenableModel(clt_splice_representations(model, clt), model)
        with torch.no_grad():
            return pv.generate({"input_ids": ids}, max_new_tokens=4, do_sample=False,
                               **options)[1]

    assert torch.equal(generate(intervene_on_prompt=True, use_cache=False), want)
    with pytest.raises(InputError, match=r"handed 1 position\(s\) after a forward of 6"):
        generate(intervene_on_prompt=True, use_cache=True)
    for cache in (True, False):
        with pytest.raises(InputError, match="unit_locations on each new token"):
            generate(use_cache=cache)


# ------------------------------------- a user's model in our runs: clones (item 1)


@pytest.mark.numerics
def test_a_users_edit_at_a_pre_hook_site_leaves_the_upstream_output_alone(tokenizer):
    """AdditionIntervention at block_input (a pre-hook) in our runs: the previous block's
    output tensor is not written; the trace equals the same edit made by a hand hook that
    returns a new tensor."""
    model = make_tiny_model("llama", init=0.2)
    delta = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 0.5
    pv_model = _pv(model, [{"layer": 2, "component": "block_input",
                            "intervention": pv.AdditionIntervention(source_representation=delta,
                                                                    embed_dim=32)}])
    layer1 = get_module(model, get_adapter(model).module_path("block", 1))
    kept = {}

    def keep(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        kept["ref"], kept["copy"] = hidden, hidden.clone()

    handle = layer1.register_forward_hook(keep)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with applied_interventions(bind(pv_model, interventions=True)) as inner, torch.no_grad():
        inner(input_ids=ids)
    handle.remove()
    assert torch.equal(kept["ref"], kept["copy"])  # upstream untouched

    got = trace(pv_model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).restored_probs
    layer2 = get_module(model, get_adapter(model).module_path("block", 2))
    handle = layer2.register_forward_pre_hook(lambda m, a: (a[0] + delta, *a[1:]))
    try:
        want = trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).restored_probs
    finally:
        handle.remove()
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("build,match", [
    (lambda: pv.NoiseIntervention(embed_dim=32), "4 positions"),
    (lambda: pv.VanillaIntervention(), "need a source at call time"),
    (lambda: pv.SkipIntervention(), "need a source at call time"),
])
def test_interventions_our_runs_cannot_apply_are_refused(tokenizer, build, match):
    model = make_tiny_model("llama")
    pv_model = _pv(model, [{"layer": 1, "component": "block_output", "intervention": build()}])
    with pytest.raises(PyveneModelError, match=match):
        run_spec({"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
                  "interventions": [{"type": "noise_add", "seeds": [0], "sigma": 0.5}]},
                 pv_model, tokenizer)


def test_head_unit_interventions_of_a_users_model_are_refused(tokenizer):
    model = make_tiny_model("llama")
    pv_model = _pv(model, [{"layer": 1, "component": "head_attention_value_output",
                            "unit": "h.pos", "intervention_type": pv.ZeroIntervention}])
    with pytest.raises(PyveneModelError, match="picks heads through unit_locations"):
        trace(pv_model, tokenizer, PROMPT, SUBJECT, seeds=1, scale=3.0)


# -------------------------------------------------- trainable parameters (item 3)


def test_trainable_parameters_are_pyvenes_and_the_model_keeps_its_flags():
    """pyvene's DAS recipe: our IntervenableModel trains only the intervention (the same
    parameters as pv.IntervenableModel), records no gradient for the model's weights, and
    leaves the user's requires_grad flags and train/eval mode as they were."""
    def config():
        return pv.IntervenableConfig(
            [{"layer": 1, "component": "block_output", "low_rank_dimension": 4}],
            intervention_types=pv.LowRankRotatedSpaceIntervention)

    ours_model, theirs_model = make_tiny_model("llama"), make_tiny_model("llama")
    ours, theirs = IntervenableModel(config(), ours_model), _pv(theirs_model, config())
    assert all(p.requires_grad for p in ours_model.parameters())
    assert not any(p.requires_grad for p in theirs_model.parameters())  # pyvene's side effect
    count = [sum(p.numel() for p in m.get_trainable_parameters()) for m in (ours, theirs)]
    assert count[0] == count[1] == 32 * 4
    assert ours.count_parameters(include_model=True) == theirs.count_parameters(
        include_model=True) == 32 * 4
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    ids = _ids(7)
    locations = {"sources->base": ([[[1]] * 2], [[[1]] * 2])}
    _, out = ours(base={"input_ids": ids}, sources=[{"input_ids": ids.flip(0)}],
                  unit_locations=locations)
    out.logits.sum().backward()
    assert all(p.grad is None for p in ours_model.parameters())
    assert all(p.grad is not None for p in ours.get_trainable_parameters())
    assert all(p.requires_grad for p in ours_model.parameters())
    # enable_model_gradients: the model trains too, as in pyvene
    ours.enable_model_gradients()
    theirs.enable_model_gradients()
    assert ours.count_parameters(include_model=True) == theirs.count_parameters(
        include_model=True) > 32 * 4


def test_an_instance_placed_by_layer_and_component_saves_and_loads(tmp_path):
    """pyvene's load builds the type with embed_dim (a buffer the saved instance lacked): the
    load (our class's: pyvene's gives its own class, which refuses own positions) still
    restores the settings and gives the same logits."""
    model = make_tiny_model("llama", init=0.2)
    ids = _ids(8)
    noise = NoiseAdd(seeds=[4, 5], positions=[1, 2], sigma=0.4)
    pv_model = _pv(model, [{"layer": 1, "component": "block_output", "intervention": noise}],
                   ours=True)
    with torch.no_grad():
        want = pv_model(base={"input_ids": ids})[1].logits
    pv_model.save(str(tmp_path / "saved"))
    loaded = IntervenableModel.load(str(tmp_path / "saved"), model)
    assert type(loaded) is IntervenableModel
    with torch.no_grad():
        got = loaded(base={"input_ids": ids})[1].logits
    assert torch.equal(got, want)
    theirs = pv.IntervenableModel.load(str(tmp_path / "saved"), model)
    with preserve_hooks(theirs), torch.no_grad(), pytest.raises(PyveneModelError,
                                                                match=OWN_POSITIONS):
        theirs(base={"input_ids": ids})


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_an_edit_of_a_residual_norms_input_is_refused_not_computed_otherwise(arch, tokenizer):
    """pyvene writes an input edit in place, so at a Llama block's norm it reaches the residual
    stream too; our runs replace the norm's input. The two differ (the control below), so the
    trace refuses (on every architecture: which tensors alias is the architecture code's
    business) rather than trace another model than the user's; a block-input edit, where both
    agree, runs."""
    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
    from pyvene_causaltrace.pyvene_boundary.user_edits import applied_interventions

    pv = import_pyvene()
    model = make_tiny_model(arch, init=0.2)
    norm = {"llama": "model.layers[1].post_attention_layernorm",
            "gpt2": "transformer.h[1].ln_2"}[arch]
    block = {"llama": "model.layers[1]", "gpt2": "transformer.h[1]"}[arch]
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def edit(component):
        add = pv.AdditionIntervention(source_representation=torch.full((32,), 0.5),
                                      embed_dim=32)
        return pv.IntervenableModel([{"component": component, "intervention": add}], model)

    at_norm = edit(norm + ".input")
    with torch.no_grad():
        theirs = at_norm(base={"input_ids": ids})[1].logits
        replaced_input = get_module(model, norm).register_forward_pre_hook(
            lambda _m, args: (args[0] + 0.5, *args[1:]))
        try:
            replaced = model(input_ids=ids).logits
        finally:
            replaced_input.remove()
    if arch == "llama":  # control: there the in-place write is another model (GPT-2's agree)
        assert (theirs - replaced).abs().max() > 1e-2
    with pytest.raises(PyveneModelError, match=norm.replace("[", ".").replace("]", "")):
        trace(at_norm, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    at_block = edit(block + ".input")
    with torch.no_grad(), applied_interventions(bind(at_block, interventions=True)) as inner:
        ours = inner(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(ours, at_block(base={"input_ids": ids})[1].logits)
