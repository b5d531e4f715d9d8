"""Feature interventions and steering with generation (``intervene_features``, ``steer``).

Against an independent reference: plain torch hooks on the bare model and the fixture CLT's raw
tensors (no pyvene, no package transcoder code) — each layer's MLP output becomes the
reconstruction of the set features plus the clean run's error at the prompt's positions when
errors are held, and the model's own output plus ``(value - activation) * decoder`` elsewhere
(generated positions, or everywhere with live errors). Generation is greedy on the whole
sequence each step. The splice starts at the first position the BOS rule gives: 0 on the tiny
tokenizer, which adds no BOS (``bos="auto"``), 1 under ``bos="always"``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from transcoder_fixtures import random_set, write_circuit_tracer

from pyvene_causaltrace import intervene_features
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import InputError, NonFiniteError, PyveneModelError, SpecError
from pyvene_causaltrace.execute import build_interventions, run_spec
from pyvene_causaltrace.interventions.feature_ablate import FeatureAblate
from pyvene_causaltrace.models import get_adapter, get_module
from pyvene_causaltrace.prompts import first_position
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.specs import load_spec, validate_spec
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.hooks import transcoder_states

L, D, F = 3, 32, 48
BIG = 1e4  # a value whose decoder write dominates the residual stream


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """A tiny Llama whose MLPs matter, a fixture CLT (raw tensors and loaded), the prompt."""
    root = tmp_path_factory.mktemp("steer")
    tensors = random_clt_tensors(L, D, F, threshold=0.0)
    clt = load_transcoder(str(write_clt(root / "clt", tensors)))
    model = make_tiny_model("llama", init=0.2)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model, tokenizer, clt, tensors, ids, root


# ------------------------------------------------------------------------------ the reference

def _reference_forward(model, tensors, ids, items, errors, first=0):
    """Logits ``[1, S, V]`` of the intervened forward with plain hooks, and the clean-style
    captures ``(outputs, encoded)`` per layer. ``items``: ``(layer, position, feature,
    value)``; ``errors``: per-layer ``[1, P, D]`` held at positions ``first..P-1``, or None;
    positions before ``first`` (BOS) are never spliced."""
    adapter = get_adapter(model)
    encoded, now, outputs, handles = {}, {}, {}, []

    def decoder(source, target):
        return tensors["W_dec"][source][:, target - source]

    for layer in range(L):
        def encode(_m, args, _layer=layer):
            x = args[0]
            z = x @ tensors["W_enc"][_layer].T + tensors["b_enc"][_layer]
            a = torch.where(z > tensors["threshold"][_layer], z, torch.zeros(()))
            a[:, :first] = 0
            encoded[_layer] = a
            changed = a.clone()
            for item_layer, position, feature, value in items:
                if item_layer == _layer:
                    where = slice(first, None) if position == "all" else position
                    changed[0, where, feature] = value
            now[_layer] = changed

        def decode(_m, _args, out, _layer=layer):
            outputs[_layer] = out.detach().clone()
            recon = tensors["b_dec"][_layer].expand_as(out).clone()
            change = torch.zeros_like(out)
            for source in range(_layer + 1):
                recon = recon + now[source] @ decoder(source, _layer)
                change = change + (now[source] - encoded[source]) @ decoder(source, _layer)
            new = out + change
            if errors is not None:
                n = errors[_layer].shape[1]
                new[:, first:n] = recon[:, first:n] + errors[_layer][:, first:n]
            new[:, :first] = out[:, :first]
            return new

        handles.append(get_module(model, adapter.module_path("pre_mlp_norm", layer))
                       .register_forward_pre_hook(encode))
        handles.append(get_module(model, adapter.module_path("mlp", layer))
                       .register_forward_hook(decode))
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits, outputs, encoded
    finally:
        for handle in handles:
            handle.remove()


def _reference_errors(model, tensors, ids, first=0):
    """The clean run's ``out - recon`` per layer, ``[1, P, D]`` each."""
    _, outputs, encoded = _reference_forward(model, tensors, ids, [], None, first)
    errors = []
    for layer in range(L):
        recon = tensors["b_dec"][layer] + sum(
            encoded[s] @ tensors["W_dec"][s][:, layer - s] for s in range(layer + 1))
        errors.append(outputs[layer] - recon)
    return errors


def _reference(model, tensors, ids, items, steps, hold_errors=True, first=0):
    """First-step logits ``[V]`` and ``steps`` greedy tokens of the reference."""
    errors = _reference_errors(model, tensors, ids, first) if hold_errors else None
    logits_1, generated = None, []
    for _ in range(steps):
        logits = _reference_forward(model, tensors, ids, items, errors, first)[0][0, -1]
        logits_1 = logits if logits_1 is None else logits_1
        token = int(logits.argmax())
        generated.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return logits_1, generated


def _dominant_feature(world):
    """A last-layer feature whose decoder direction, read by the final norm and unembedding,
    has an argmax token other than the clean next token — and whose prompt-only steering
    continues with a different token (so 'all' is visible at generated positions)."""
    model, _, _, tensors, ids, _ = world
    with torch.no_grad():
        clean_next = int(model(input_ids=ids).logits[0, -1].argmax())
        limit = model.lm_head(model.model.norm(tensors["W_dec"][L - 1][:, 0] * BIG))  # [F, V]
    top2 = limit.topk(2, dim=-1)
    for feature in (top2.values[:, 0] - top2.values[:, 1]).argsort(descending=True).tolist():
        token = int(top2.indices[feature, 0])
        if token == clean_next:
            continue
        _, tokens = _reference(model, tensors, ids, [(L - 1, ids.shape[1] - 1, feature, BIG)], 3)
        if tokens[0] == token and tokens[1] != token:
            return feature, token, clean_next
    pytest.fail("no last-layer feature of the fixture CLT steers visibly")


# ---------------------------------------------------------------------------------- the tests

def _every_active_feature(tc, model, ids, shift: float = 0.0):
    states = transcoder_states(model, tc, ids)
    acts = tc.encode_all(states["input"].to(tc.dtype), zero_bos=False)  # no BOS: 0 spliced
    layer, position, feature = acts.nonzero(as_tuple=True)
    return [(int(l_), int(p), int(f), float(acts[l_, p, f]) + shift)
            for l_, p, f in zip(layer, position, feature, strict=True)]


@pytest.mark.parametrize("kind", ["clt", "per_layer_skip"])
@pytest.mark.numerics
def test_every_feature_at_its_clean_value_gives_the_clean_logits(kind, world, tmp_path):
    """Every active feature at every position set to its own clean value: with the errors
    held (and with the attention frozen, and with live errors) the logits are the clean ones;
    each value moved by 0.5 moves them. Measured: max |diff| ~1e-6."""
    model, tokenizer, clt, _, ids, _ = world
    if kind == "clt":
        tc = clt
    else:
        path = write_circuit_tracer(tmp_path / "set", random_set(L, D, F, skip=True,
                                                                  threshold=0.05, seed=1))
        tc = load_transcoder(path)
        assert tc.cfg.skip and not tc.cfg.cross_layer
    items = _every_active_feature(tc, model, ids)
    assert first_position(tokenizer, "auto") == 0  # the tiny tokenizer adds no BOS: 0 is spliced
    assert len(items) > 100 and {p for _, p, _, _ in items} == set(range(ids.shape[1]))
    for hold, freeze in ((True, False), (True, True), (False, False)):
        result = intervene_features(model, tokenizer, tc, PROMPT, items, hold_errors=hold,
                                    freeze_attention=freeze)
        assert result.max_abs_logit_diff < 1e-4, (hold, freeze, result.max_abs_logit_diff)
    moved = intervene_features(model, tokenizer, tc, PROMPT,
                               _every_active_feature(tc, model, ids, shift=0.5))
    assert moved.max_abs_logit_diff > 1e-2


@pytest.mark.parametrize("bos", ["auto", "always"])
@pytest.mark.numerics
def test_a_boosted_feature_changes_the_greedy_text_as_the_reference_does(world, bos):
    """A last-layer feature set far above its range at the last prompt position writes its
    decoder direction over the residual stream: the first generated token is that direction's
    argmax through the final norm and unembedding, not the clean one; every token and the
    first-step logits equal the reference's (held errors, live past the prompt)."""
    model, tokenizer, clt, tensors, ids, _ = world
    feature, token, clean_next = _dominant_feature(world)
    first = first_position(tokenizer, bos)  # 0 under auto (no BOS added), 1 under always
    items = [(L - 1, -1, feature, BIG), (1, 3, 5, 4.0)] + ([(1, 0, 5, 4.0)] if not first else [])
    result = intervene_features(model, tokenizer, clt, PROMPT, items, max_new_tokens=4, bos=bos)
    assert result.interventions[0][1] == ids.shape[1] - 1  # -1 made absolute
    assert result.generated_ids[0] == token != clean_next == result.clean_generated_ids[0]
    assert result.generated_text != result.clean_generated_text
    logits, tokens = _reference(model, tensors, ids, result.interventions, 4, first=first)
    assert result.generated_ids == tokens
    torch.testing.assert_close(result.logits, logits, atol=1e-4 * float(logits.abs().max()),
                               rtol=0)
    table = result.to_dataframe()
    assert set(table["run"]) == {"clean", "intervened"} and len(table) == 20
    top = table[(table["run"] == "intervened") & (table["rank"] == 0)]
    assert int(top["token_id"].iloc[0]) == token


@pytest.mark.parametrize("hold_errors", [True, False])
@pytest.mark.numerics
def test_all_positions_reach_the_generated_tokens(world, hold_errors):
    """'all' sets the feature at every generated position too: each generated token is the
    direction's argmax, where setting it at every prompt position only lets the model go on
    with another token. Both equal the reference, with held and with live errors."""
    model, tokenizer, clt, tensors, ids, _ = world
    feature, token, _ = _dominant_feature(world)
    prompt_only = [(L - 1, p, feature, BIG) for p in range(ids.shape[1])] + [(0, 2, 7, 3.0)]
    everywhere = [(L - 1, "all", feature, BIG), (0, 2, 7, 3.0)]
    runs = {}
    for name, items in (("prompt", prompt_only), ("all", everywhere)):
        result = intervene_features(model, tokenizer, clt, PROMPT, items, max_new_tokens=4,
                                    hold_errors=hold_errors)
        logits, tokens = _reference(model, tensors, ids, items, 4, hold_errors=hold_errors)
        assert result.generated_ids == tokens, name
        torch.testing.assert_close(result.logits, logits,
                                   atol=1e-4 * float(logits.abs().max()), rtol=0)
        runs[name] = result.generated_ids
    assert runs["all"] == [token] * 4
    assert runs["prompt"][0] == token and runs["prompt"] != runs["all"]


@pytest.mark.parametrize("hold_errors,freeze", [(True, False), (False, True)])
@pytest.mark.numerics
def test_the_result_spec_reproduces_the_python_call_exactly(world, hold_errors, freeze):
    """result.spec through run_spec gives bit for bit the same answer probability; the spec
    round-trips (spec -> interventions -> spec) exactly, values per feature included."""
    model, tokenizer, clt, _, ids, _ = world
    items = [(2, -1, 11, 6.0), (2, -1, 12, 0.0), (1, "all", 3, 2.5), (0, 4, 9, -1.0)]
    result = intervene_features(model, tokenizer, clt, PROMPT, items, hold_errors=hold_errors,
                                freeze_attention=freeze)
    spec = result.spec
    assert spec["interventions"][0] == {"type": "clt_splice", "clt": clt.source,
                                        "error": "clean" if hold_errors else "live",
                                        "from_position": 0}
    ablations = [e for e in spec["interventions"] if e["type"] == "feature_ablate"]
    assert ablations[0] == {"type": "feature_ablate", "clt_layer": 2, "features": [11, 12],
                            "positions": [ids.shape[1] - 1], "value": [6.0, 0.0]}
    assert ablations[1] == {"type": "feature_ablate", "clt_layer": 1, "features": [3],
                            "value": 2.5}
    assert (spec["interventions"][-1] == {"type": "frozen_attention", "pattern": "clean"}) \
        == freeze
    assert load_spec(spec).to_dict() == spec
    ran = run_spec(spec, model, tokenizer)
    answer = int(result.clean_logits.argmax())
    assert ran.answer_id == answer
    assert ran.intervened_probs[0] == float(result.logits.double().softmax(-1)[answer])
    assert result.max_abs_logit_diff > 1e-3  # the interventions did something
    written = build_interventions(spec, model, tokenizer).to_spec()
    back = [e for e in written if e["type"] == "feature_ablate"]  # placed by layer
    assert sorted(back, key=json.dumps) == sorted(ablations, key=json.dumps)
    decoders = [e for e in written if e["type"] == "clt_splice"]
    assert {e.get("error") for e in decoders} == {"clean" if hold_errors else "live"}
    if freeze:
        assert [e for e in written if e["type"] == "frozen_attention"] == [
            {"type": "frozen_attention", "pattern": "clean", "layers": [layer]}
            for layer in range(L)]


def test_bad_inputs_are_refused(world):
    model, tokenizer, clt, _, ids, _ = world
    n = ids.shape[1]
    cases = [
        ([], InputError, "no feature interventions"),
        (5, InputError, "interventions=5 .*expected a list"),
        ("0:1:2=3", InputError, "interventions='0:1:2=3' .*expected a list"),
        ([(0, 1, 2)], InputError, r"interventions\[0\] must be \(layer"),
        ([(3, 1, 2, 1.0)], InputError, "layer 3 is outside"),
        ([(-1, 1, 2, 1.0)], InputError, "layer -1 is outside"),
        ([(0, 1, F, 1.0)], InputError, f"feature {F} is outside"),
        ([(0, n, 2, 1.0)], InputError, f"position {n} is outside"),
        ([(0, "last", 2, 1.0)], InputError, "position"),
        ([(0, 1, 2, float("nan"))], NonFiniteError, "not finite"),
        ([(0, 1, 2, float("inf"))], NonFiniteError, "not finite"),
        ([(0, 1, 2, "big")], InputError, "must be a number"),
        ([(True, 1, 2, 1.0)], InputError, "layer must be an integer"),
        ([(0, 1, 2, 1.0), (0, 1, 2, 3.0)], InputError, r"where interventions\[0\] already"),
        ([(0, 1, 2, 1.0), (0, "all", 2, 3.0)], InputError, r"interventions\[0\] already"),
    ]
    for items, error, match in cases:
        with pytest.raises(error, match=match):
            intervene_features(model, tokenizer, clt, PROMPT, items)
    # position 0 only where the BOS rule makes it BOS (the tiny tokenizer adds none)
    with pytest.raises(InputError, match="position 0 is BOS here, never spliced"):
        intervene_features(model, tokenizer, clt, PROMPT, [(0, 0, 2, 1.0)], bos="always")
    with pytest.raises(InputError, match="bos must be one of"):
        intervene_features(model, tokenizer, clt, PROMPT, [(0, 1, 2, 1.0)], bos="first")
    with pytest.raises(InputError, match="max_new_tokens"):
        intervene_features(model, tokenizer, clt, PROMPT, [(0, 1, 2, 1.0)], max_new_tokens=-1)
    pv_model = intervenable_model_class()([], model)
    with pytest.raises(PyveneModelError, match="bare model"):
        intervene_features(pv_model, tokenizer, clt, PROMPT, [(0, 1, 2, 1.0)])
    with pytest.raises(InputError, match="scale or value, not both"):
        FeatureAblate(clt=clt, clt_layer=0, features=[1], scale=2.0, value=1.0)
    with pytest.raises(NonFiniteError):
        FeatureAblate(clt=clt, clt_layer=0, features=[1], value=float("nan"))
    with pytest.raises(InputError, match="one value per feature"):
        FeatureAblate(clt=clt, clt_layer=0, features=[1, 2], value=[1.0])
    with pytest.raises(InputError, match="one feature twice"):
        FeatureAblate(clt=clt, clt_layer=0, features=[1, 1], value=[1.0, 2.0])
    with pytest.raises(InputError, match="non-empty"):
        FeatureAblate(clt=clt, clt_layer=0, features=[], value=1.0)


def test_bad_spec_entries_are_refused_at_their_path(world):
    model, tokenizer, clt, _, _, _ = world

    def spec(*ablations, splice=None):
        return {"schema_version": 1, "prompt": PROMPT, "interventions": [
            {"type": "clt_splice", "clt": clt.source, **(splice or {})}, *ablations]}

    def entry(**fields):
        return {"type": "feature_ablate", "clt_layer": 1, "features": [2], **fields}

    with pytest.raises(SpecError, match=r"\$\.interventions\[1\]\.value: scale and value "
                                        "exclude each other"):
        validate_spec(spec(entry(scale=2.0, value=1.0)))
    with pytest.raises(SpecError, match=r"\$\.interventions\[1\]\.value: must be finite"):
        validate_spec(spec(entry(value=float("nan"))))
    with pytest.raises(SpecError, match=r"\$\.interventions\[1\]\.value: 2 values"):
        validate_spec(spec(entry(value=[1.0, 2.0])))
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.error: add_error"):
        validate_spec(spec(splice={"add_error": True, "error": "clean"}))
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.error"):
        validate_spec(spec(splice={"error": "held"}))
    for fields, where, match in (({"clt_layer": 7}, "clt_layer", "not spliced"),
                                 ({"features": [F]}, "features", "outside"),
                                 ({"positions": [0]}, "positions", "before the splice"),
                                 ({"positions": [99]}, "positions", "outside the prompt")):
        with pytest.raises(SpecError, match=rf"\$\.interventions\[1\]\.{where}: .*{match}"):
            build_interventions(spec(entry(value=1.0, **fields)), model, tokenizer)


def test_steer_command_round_trips_through_its_spec(world, tmp_path, capsys):
    """`steer` with --set writes steering.json (the Python call's numbers) and spec.json;
    `steer --spec spec.json` gives the same result file."""
    model, tokenizer, clt, _, _, _ = world
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    common = ["--model", str(tmp_path / "model"), "--clt", clt.source, "--max-new-tokens", "3"]
    assert main(["steer", *common, "--prompt", PROMPT, "--set", "2:-1:11=6", "--set",
                 "1:all:3=2.5", "--freeze-attention", "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "a" / "steering.json").read_text())
    expected = intervene_features(model, tokenizer, clt, PROMPT, [(2, -1, 11, 6.0),
                                                                  (1, "all", 3, 2.5)],
                                  max_new_tokens=3, freeze_attention=True)
    assert written["generated_ids"] == expected.generated_ids
    assert written["top"] == json.loads(expected.to_json())["top"]
    last = len(written["tokens"]) - 1
    assert written["interventions"] == [[2, last, 11, 6.0], [1, "all", 3, 2.5]]
    assert expected.generated_text in printed and "intervened" in printed
    spec_path = tmp_path / "a" / "spec.json"
    assert json.loads(spec_path.read_text()) == written["spec"]
    assert main(["steer", *common, "--spec", str(spec_path), "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "steering.json").read_text())
    assert again == written
    # circuit-tracer's convention: the spec says where the splice starts, whatever the
    # tokenizer, and --bos beside --spec is refused
    assert main(["steer", *common, "--set", "2:-1:11=6", "--bos", "always", "--out",
                 str(tmp_path / "c")]) == 0
    spec_path = tmp_path / "c" / "spec.json"
    assert json.loads(spec_path.read_text())["interventions"][0]["from_position"] == 1
    assert main(["steer", *common, "--spec", str(spec_path), "--out", str(tmp_path / "d")]) == 0
    always = json.loads((tmp_path / "c" / "steering.json").read_text())
    assert json.loads((tmp_path / "d" / "steering.json").read_text()) == always
    assert always["top"] != written["top"]
    capsys.readouterr()
    assert main(["steer", *common, "--spec", str(spec_path), "--bos", "never"]) == 2
    assert "drop --bos" in capsys.readouterr().err


@pytest.mark.numerics
def test_a_held_attention_pattern_mixes_live_values_by_the_held_weights(world):
    """frozen_attention with a pattern: the attention output at the pattern's query positions is
    o_proj(pattern @ values) of the live values (grouped-query heads repeated), computed here by
    hand with a uniform causal pattern; later positions (generated tokens) attend as the model
    does. Freezing the clean patterns changes a steered run."""
    from pyvene_causaltrace.capture import capture
    from pyvene_causaltrace.interventions.frozen import FrozenAttention

    model, tokenizer, clt, _, ids, _ = world
    attn = model.model.layers[1].self_attn
    n, longer = ids.shape[1], torch.cat([ids, torch.tensor([[5, 9, 11]])], dim=1)
    heads, kv_heads, d_head = 4, 2, 8
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    pattern = uniform.expand(1, heads, n, n).contiguous()
    site = "model.layers[1].self_attn.output"
    pv_model = intervenable_model_class()(
        [{"component": site, "intervention": FrozenAttention(pattern=pattern)}], model)
    states = capture(model, {}, [site, "model.layers[1].input_layernorm.output"],
                     run=lambda: pv_model(base={"input_ids": longer}))
    clean = capture(model, {"input_ids": longer}, [site])[site]
    x = states["model.layers[1].input_layernorm.output"]
    with torch.no_grad():
        values = attn.v_proj(x).view(1, -1, kv_heads, d_head).transpose(1, 2)
        values = values.repeat_interleave(heads // kv_heads, dim=1)[:, :, :n]
        expected = attn.o_proj((pattern @ values).transpose(1, 2).reshape(1, n, -1))
    torch.testing.assert_close(states[site][:, :n], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[site][:, n:], clean[:, n:], atol=1e-5, rtol=1e-5)
    assert (states[site][:, 1:n] - clean[:, 1:n]).abs().max() > 1e-3  # not the live pattern
    items = [(0, 2, 5, 8.0), (0, 3, 9, 8.0)]
    live = intervene_features(model, tokenizer, clt, PROMPT, items)
    frozen = intervene_features(model, tokenizer, clt, PROMPT, items, freeze_attention=True)
    assert (live.logits - frozen.logits).abs().max() > 1e-4
