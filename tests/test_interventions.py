"""The registered intervention types on tiny GPT-2, Llama, Qwen2 and Qwen3 models, each checked
against a plain-hook batch-1 reference."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from _support.models import ALL_ARCHS, make_tiny_model
from reference import add_at, edit_output, recipe_noise, set_positions

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.capture import capture
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.frozen import FrozenLayerNorm, frozen_norm
from pyvene_causaltrace.interventions.noise import NoiseAdd, noise_recipe
from pyvene_causaltrace.interventions.restore import (
    CleanRestore,
    Freeze,
    WindowRestore,
    window_layers,
)
from pyvene_causaltrace.models import PyveneModelError, get_adapter, get_module
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.transcoders.hooks import norm_settings

pv = import_pyvene()
SEQ = 7
#: what a type refuses with where it needs our IntervenableModel
OURS = r"build the model with pyvene_causaltrace\.IntervenableModel\(\.\.\.\)"
SCALE, SIGMA = 3.0, 0.5


def ids_for(model, rows: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.config.vocab_size, (1, SEQ), generator=g).repeat(rows, 1)


def run(model, reps, ids):
    """Logits of ``model`` on ``ids`` with ``reps`` = [(component, intervention)] applied, in
    our IntervenableModel (positions of their own need it: pyvene's own refuses them)."""
    pv_model = intervenable_model_class()(
        [{"component": c, "intervention": i} for c, i in reps], model)
    with torch.no_grad():
        return pv_model(base={"input_ids": ids})[1].logits


@pytest.mark.numerics
def test_noise_add_changes_exactly_the_chosen_positions_by_the_recipe(tiny):
    arch, model = tiny
    adapter = get_adapter(model)
    embed = adapter.embed + ".output"
    seeds, positions = [3, 11, 5], [[1, 2], [0], [2, 3, 4]]
    noise = NoiseAdd(seeds=seeds, positions=positions, scale=SCALE, sigma=SIGMA)
    ids = ids_for(model, rows=3)
    clean = capture(model, {"input_ids": ids}, [embed])[embed]
    pv_model = intervenable_model_class()([{"component": embed, "intervention": noise}], model)
    noised = capture(model, {}, [embed], run=lambda: pv_model(base={"input_ids": ids}))[embed]
    hidden = bind(model).d_model
    for row, (seed, chosen) in enumerate(zip(seeds, positions, strict=True)):
        others = [p for p in range(SEQ) if p not in chosen]
        assert torch.equal(noised[row, others], clean[row, others])
        expected = recipe_noise(seed, len(chosen), hidden, SCALE, SIGMA)
        torch.testing.assert_close(noised[row, chosen] - clean[row, chosen], expected,
                                   atol=1e-6, rtol=0)


def test_noise_recipe_uniform_and_errors():
    draw = noise_recipe(7, 4, 16, 2.0, 0.5, "uniform")
    assert draw.abs().max() <= 1.0 and draw.abs().max() > 0.5
    torch.manual_seed(0)
    assert torch.equal(draw, noise_recipe(7, 4, 16, 2.0, 0.5, "uniform"))
    with pytest.raises(ValueError, match="distribution"):
        NoiseAdd(seeds=[0], positions=[0], distribution="cauchy")
    with pytest.raises(ValueError, match="rows"):
        run(make_tiny_model("llama"), [("model.embed_tokens.output",
                                        NoiseAdd(seeds=[0, 1], positions=[0]))],
            torch.ones(3, SEQ, dtype=torch.long))
    with pytest.raises(ValueError, match="outside|sequence"):
        run(make_tiny_model("llama"), [("model.embed_tokens.output",
                                        NoiseAdd(seeds=[0], positions=[SEQ + 2]))],
            torch.ones(1, SEQ, dtype=torch.long))


def _reference_row(model, ids, seed, noise_positions, edits):
    """Batch-1 reference: recipe noise at the embeddings plus ``edits`` [(path, edit)]."""
    adapter = get_adapter(model)
    delta = recipe_noise(seed, len(noise_positions), bind(model).d_model, SCALE, SIGMA)
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(edit_output(model, adapter.embed, add_at(delta, noise_positions)))
        for path, edit in edits:
            stack.enter_context(edit_output(model, path, edit))
        return model(input_ids=ids[:1]).logits


@pytest.mark.numerics
def test_clean_restore_per_row_masks_equal_batch_one_loop(tiny):
    arch, model = tiny
    adapter = get_adapter(model)
    block = adapter.module_path("block", 1)
    ids = ids_for(model, rows=4)
    clean = capture(model, {"input_ids": ids[:1]}, [block + ".output"])[block + ".output"]
    seeds, masks, noised = [0, 1, 2, 3], [[2], [], [0, 3], [6]], [1, 2]
    reps = [(adapter.embed + ".output",
             NoiseAdd(seeds=seeds, positions=noised, scale=SCALE, sigma=SIGMA)),
            (block + ".output", CleanRestore(positions=masks, states=clean))]
    batched = run(model, reps, ids)
    for row in range(4):
        edits = [(block, set_positions(clean, masks[row]))] if masks[row] else []
        expected = _reference_row(model, ids, seeds[row], noised, edits)
        torch.testing.assert_close(batched[row:row + 1], expected, atol=1e-5, rtol=0)


@pytest.mark.numerics
def test_window_restore_per_row_masks_equal_batch_one_loop(tiny):
    arch, model = tiny
    adapter = get_adapter(model)
    ids = ids_for(model, rows=3)
    layers = window_layers(center=1, window=2, n_layers=3)
    assert layers == [0, 1]
    paths = {layer: adapter.module_path("mlp", layer) for layer in layers}
    clean = capture(model, {"input_ids": ids[:1]}, [p + ".output" for p in paths.values()])
    seeds, masks, noised = [4, 5, 6], [[1], [2, 5], []], [1, 2, 3]
    reps = [(adapter.embed + ".output",
             NoiseAdd(seeds=seeds, positions=noised, scale=SCALE, sigma=SIGMA))]
    reps += [(p + ".output", WindowRestore(positions=masks, states=clean[p + ".output"],
                                           sublayer="mlp", window_layer=layer, center=1,
                                           window=2))
             for layer, p in paths.items()]
    batched = run(model, reps, ids)
    for row in range(3):
        edits = [(p, set_positions(clean[p + ".output"], masks[row]))
                 for p in paths.values()] if masks[row] else []
        expected = _reference_row(model, ids, seeds[row], noised, edits)
        torch.testing.assert_close(batched[row:row + 1], expected, atol=1e-5, rtol=0)


def test_window_layers_follow_rome_centring():
    assert window_layers(0, 10, 30) == list(range(0, 5))
    assert window_layers(10, 10, 30) == list(range(5, 15))
    assert window_layers(29, 10, 30) == list(range(24, 30))
    assert window_layers(5, 3, 30) == [4, 5, 6]
    with pytest.raises(ValueError):
        window_layers(5, 0, 30)


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.numerics
def test_restoring_every_position_at_last_block_gives_clean_logits(arch):
    model = make_tiny_model(arch)
    adapter = get_adapter(model)
    last = adapter.module_path("block", bind(model).n_layers - 1) + ".output"
    ids = ids_for(model, rows=3)
    with torch.no_grad():
        clean_logits = model(input_ids=ids[:1]).logits
    clean = capture(model, {"input_ids": ids[:1]}, [last])[last]
    reps = [(adapter.embed + ".output",
             NoiseAdd(seeds=[0, 1, 2], positions=[0, 1, 2], scale=SCALE, sigma=SIGMA)),
            (last, CleanRestore(positions=list(range(SEQ)), states=clean))]
    noised_only = run(model, reps[:1], ids)
    restored = run(model, reps, ids)
    assert (noised_only - clean_logits).abs().max() > 1e-3  # the noise did something
    torch.testing.assert_close(restored, clean_logits.expand_as(restored), atol=1e-5, rtol=0)


def test_freeze_holds_values_from_another_run(tiny):
    arch, model = tiny
    adapter = get_adapter(model)
    mlp = adapter.module_path("mlp", 1) + ".output"
    ids, other = ids_for(model, seed=1), ids_for(model, seed=2)
    held = capture(model, {"input_ids": other}, [mlp])[mlp]
    free = capture(model, {"input_ids": ids}, [mlp])[mlp]
    pv_model = intervenable_model_class()(
        [{"component": mlp, "intervention": Freeze(positions=[0, 4], states=held, run="other")}],
        model)
    seen = capture(model, {}, [mlp], run=lambda: pv_model(base={"input_ids": ids}))[mlp]
    assert torch.equal(seen[:, [0, 4]], held[:, [0, 4]])
    # the other positions of the same layer are computed before the freeze acts
    assert torch.equal(seen[:, [1, 2, 3]], free[:, [1, 2, 3]])


@pytest.mark.numerics
def test_restore_without_states_uses_pyvene_source(tiny):
    arch, model = tiny
    adapter = get_adapter(model)
    block = adapter.module_path("block", 0) + ".output"
    ids, source = ids_for(model, seed=1), ids_for(model, seed=3)
    donor = capture(model, {"input_ids": source}, [block])[block]
    pv_model = intervenable_model_class()(
        [{"component": block, "intervention": CleanRestore(positions=[2])}], model)
    with torch.no_grad():
        _, out = pv_model(base={"input_ids": ids}, sources=[{"input_ids": source}])
    stored = run(model, [(block, CleanRestore(positions=[2], states=donor))], ids)
    torch.testing.assert_close(out.logits, stored, atol=1e-6, rtol=0)


def _frozen_norm_reference(module, kind: str):
    """A replacement forward computing the norm with its statistic detached."""
    def forward(x):
        xf = x.float()
        if kind == "layer":
            centred = xf - xf.mean(-1, keepdim=True)
            std = torch.sqrt(xf.var(-1, keepdim=True, unbiased=False) + module.eps).detach()
            return (centred / std * module.weight + module.bias).to(x.dtype)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps).detach()
        weight = module.weight.float() + (1.0 if kind == "rms_offset" else 0.0)
        return (weight * (xf / rms)).to(x.dtype)
    return forward


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.numerics
def test_frozen_layernorm_keeps_forward_and_gives_frozen_gradient(arch):
    model = make_tiny_model(arch)
    adapter = get_adapter(model)
    norms = [adapter.module_path("pre_attn_norm", 0), adapter.module_path("pre_mlp_norm", 1),
             adapter.final_norm]
    ids = ids_for(model)
    embeds = get_module(model, adapter.embed)(ids).detach()

    def grad_of_logits(make_model_call):
        leaf = embeds.clone().requires_grad_(True)
        logits = make_model_call(leaf)
        weights = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
        (logits * weights).sum().backward()
        return logits.detach(), leaf.grad

    plain_logits, plain_grad = grad_of_logits(lambda e: model(inputs_embeds=e).logits)
    pv_model = intervenable_model_class()(
        [{"component": n + ".output", "intervention": FrozenLayerNorm(kind=adapter.norm_kind)}
         for n in norms], model)
    frozen_logits, frozen_grad = grad_of_logits(
        lambda e: pv_model(base={"inputs_embeds": e})[1].logits)
    originals = {n: get_module(model, n).forward for n in norms}
    try:
        for n in norms:
            get_module(model, n).forward = _frozen_norm_reference(get_module(model, n),
                                                                   adapter.norm_kind)
        _, reference_grad = grad_of_logits(lambda e: model(inputs_embeds=e).logits)
    finally:
        for n, forward in originals.items():
            get_module(model, n).forward = forward
    torch.testing.assert_close(frozen_logits, plain_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(frozen_grad, reference_grad, atol=1e-5, rtol=1e-4)
    assert (frozen_grad - plain_grad).abs().max() > 1e-4  # freezing changes the gradient


def test_frozen_layernorm_outside_pyvene_is_a_clear_error():
    with pytest.raises(PyveneModelError, match=OURS):
        FrozenLayerNorm(kind="rms")(torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="kind"):
        FrozenLayerNorm(kind="batch")


def test_a_norm_without_an_eps_is_one_input_error_naming_it():
    """The frozen norms and a normalised hook read a norm's eps through one lookup: a norm
    without one is an InputError naming its class (the frozen norms raised an AttributeError)."""
    model = make_tiny_model("llama")
    bound = bind(model)
    norm = get_module(model, bound.adapter.module_path("pre_mlp_norm", 0))
    x = torch.randn(1, 3, bound.d_model)
    torch.testing.assert_close(frozen_norm(norm, x, norm(x), "rms"), norm(x))  # the control
    del norm.variance_epsilon
    for call in (lambda: frozen_norm(norm, x, x, "rms"),
                 lambda: norm_settings(bound, "ln2.hook_normalized", 0)):
        with pytest.raises(InputError, match="LlamaRMSNorm has no eps / variance_epsilon"):
            call()


def test_frozen_layernorm_refuses_gathered_positions():
    model = make_tiny_model("llama")
    reps = [{"component": "model.norm.output", "intervention": FrozenLayerNorm(kind="rms")}]
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="unit_locations=None"):
        intervenable_model_class()(reps, model)(base={"input_ids": ids},
                                                unit_locations={"base": [[[1]]]})
    # pyvene's own class hands it neither the norm nor its inputs: refused, naming ours
    with pytest.raises(PyveneModelError, match="frozen_layernorm recomputes the norm.*" + OURS):
        pv.IntervenableModel(reps, model)(base={"input_ids": ids})


@pytest.mark.parametrize("unit_locations", [None, {"base": [[[2, 3, 4]]]}])
def test_a_type_with_positions_refuses_pyvenes_own_class_and_a_direct_call(unit_locations):
    """pyvene's own IntervenableModel tells an intervention neither the call's unit_locations
    nor generate's steps, so own positions there could land on gathered or generated tokens
    (with unit_locations they did: a silent wrong number): refused, naming our class, as is a
    direct call. Without positions, noise_add in pyvene's class equals ours."""
    model = make_tiny_model("llama", init=0.2)
    embed, ids = "model.embed_tokens.output", ids_for(model)
    states = torch.zeros(1, SEQ, 32)
    for made in (NoiseAdd(seeds=[1], positions=[1], sigma=0.3),
                 CleanRestore(positions=[1], states=states), Freeze(positions=[1], states=states)):
        refused = pv.IntervenableModel([{"component": embed, "intervention": made}], model)
        with pytest.raises(PyveneModelError, match=f"{made.registered_name} has its own "
                           "positions.*unit_locations.*generating.*" + OURS):
            refused(base={"input_ids": ids}, unit_locations=unit_locations)
        with pytest.raises(PyveneModelError, match="has its own positions"):
            made(torch.zeros(1, SEQ, 32))
    reps = [{"component": embed, "intervention": NoiseAdd(seeds=[1], sigma=0.3)}]
    with torch.no_grad():
        theirs = pv.IntervenableModel(reps, model)(base={"input_ids": ids},
                                                   unit_locations=unit_locations)[1].logits
        ours = intervenable_model_class()(reps, model)(base={"input_ids": ids},
                                                       unit_locations=unit_locations)[1].logits
    assert torch.equal(theirs, ours)


def test_seed_list_is_the_one_seed_rule():
    """Traces, specs and dataset runs read seeds through one function."""
    from pyvene_causaltrace.interventions.noise import seed_list

    assert seed_list(3) == [0, 1, 2] and seed_list([5, 2]) == [5, 2]
    for bad, message in ((0, "positive count"), ([], "non-empty"), ([1, 1], "repeat")):
        with pytest.raises(ValueError, match=message):
            seed_list(bad)
