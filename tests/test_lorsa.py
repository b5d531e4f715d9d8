"""Lorsa (issue 56 items 1-2): llamascopium's layout read as its own code reads it, the pairing
check, the ``lorsa_splice`` intervention (exact with its error, in specs, beside clt_splice),
the head control, refusals, and the fit's start being the attention layer itself."""

from __future__ import annotations

import json

import pytest
import torch
from _support.models import CORPUS, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_forward, peer_tensors, write_peer_lorsa

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError, SpecError, TranscoderFormatError
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.interventions.lorsa_splice import (
    LorsaSplice,
    clean_lorsa_errors,
    lorsa_splice_representations,
)
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.specs import load_spec
from pyvene_causaltrace.transcoders.lorsa import (
    LorsaConfig,
    LorsaSet,
    check_lorsa_fits,
    load_lorsa,
    lorsa_fvu,
    lorsa_states,
    save_lorsa,
)
from pyvene_causaltrace.transcoders.lorsa_fit import attention_init, fit_lorsa

NORMS = (2.5, 0.7)  # dataset-wise average norms of the input and output hooks

VARIANTS = {
    "topk, dataset-wise": ({}, None),
    "qk-norm, NeoX rotary over half, fewer stored QK heads": (
        {"use_post_qk_ln": True, "normalization_type": "RMS", "rotary_adjacent_pairs": False,
         "rotary_dim": 4}, 2),
    "relu, inference, no decoder norm": (
        {"act_fn": "relu", "norm_activation": "inference",
         "sparsity_include_decoder_norm": False, "positional_embedding_type": "none"}, None),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_their_layout_reads_back_to_their_forward(tmp_path, name):
    changes, qk_heads = VARIANTS[name]
    cfg = peer_config(layer=1, **changes)
    tensors = peer_tensors(cfg, qk_heads=qk_heads)
    norms = NORMS if cfg["norm_activation"] == "dataset-wise" else None
    lorsa = load_lorsa(write_peer_lorsa(tmp_path / "peer", cfg, tensors, norms))
    assert list(lorsa.layers) == [1] and not lorsa.layers[1]._loaded  # lazy: header only
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    acts, want = peer_forward(cfg, tensors, x, norms)
    ours = lorsa[1].encode(x)
    assert torch.equal(ours != 0, acts != 0)
    assert (ours != 0).sum(-1).max() <= cfg["top_k"] or cfg["act_fn"] == "relu"
    torch.testing.assert_close(lorsa[1].decode(ours), want, atol=2e-6, rtol=1e-5)
    save_lorsa(lorsa[1], tmp_path / "ours")  # our writer, their names: read back the same
    again = load_lorsa(tmp_path / "ours")
    torch.testing.assert_close(again[1](x), lorsa[1](x), atol=1e-6, rtol=1e-6)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["norm_activation"] == "inference" and written["use_triton_kernel"] is False


def _set(tmp_path, layers=(0, 2), d_model=32, **changes):
    for layer in layers:
        cfg = peer_config(layer=layer, d_model=d_model, **changes)
        write_peer_lorsa(tmp_path / f"L{layer}", cfg, peer_tensors(cfg, seed=layer), NORMS)
    return load_lorsa(tmp_path)


def test_splice_with_its_error_is_the_model_and_without_it_is_not(tmp_path):
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    bound = bind(model)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        runs = {}
        for name, kw in (("error", {"add_error": True}), ("bare", {}),
                         ("clean", {"errors": clean_lorsa_errors(model, lorsa, ids[:1])})):
            with intervened(bound, lorsa_splice_representations(model, lorsa, **kw)) as m:
                runs[name] = m(input_ids=ids[:1] if name == "clean" else ids).logits
    torch.testing.assert_close(runs["error"], plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(runs["clean"], plain[:1], atol=1e-5, rtol=0)
    assert (runs["bare"] - plain).abs().max() > 1e-2


def test_a_head_turned_off_takes_away_exactly_what_it_wrote(tmp_path):
    """The control: with the clean error held, turning OV head h off changes layer 2's
    attention output by -act_h * W_O[h] and nothing else; a head whose OV weights are zeroed in
    the file never fires, so its W_O is never read."""
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (1, 9), generator=torch.Generator().manual_seed(0))
    states = lorsa_states(model, lorsa, ids)
    acts = lorsa[2].encode(states["input"][2][None])
    acts[:, :1] = 0
    head = int(acts.abs().sum((0, 1)).argmax())
    errors = clean_lorsa_errors(model, lorsa, ids)
    outs = {}
    for off in ([], [head]):
        reps = lorsa_splice_representations(model, lorsa, layers=[2], errors=errors,
                                            heads_off=off)
        bound = bind(model)
        site = bound.site_of(reps[-1]["component"])
        with torch.no_grad(), intervened(bound, reps) as m:
            from pyvene_causaltrace.capture import capture
            outs[tuple(off)] = capture(m, {"input_ids": ids}, [reps[-1]["component"]],
                                       run=lambda m=m: m(input_ids=ids))
    key = reps[-1]["component"]
    change = outs[(head,)][key][0] - outs[()][key][0]
    want = -acts[0, :, head, None] * lorsa[2].W_O[head]
    torch.testing.assert_close(change, want, atol=1e-5, rtol=1e-4)
    assert want.abs().max() > 1e-3
    del site
    tensors = {k: v.clone() for k, v in lorsa[2].tensors().items()}
    tensors["W_V"][head], tensors["b_V"][head] = 0, 0
    zeroed = type(lorsa[2])(lorsa[2].cfg, tensors)
    x = states["input"][2][None]
    assert not zeroed.encode(x)[..., head].any()
    tensors["W_O"][head] = 1e6
    torch.testing.assert_close(type(lorsa[2])(lorsa[2].cfg, tensors)(x), zeroed(x))


def test_refusals_name_the_file_and_the_field(tmp_path):
    model = make_tiny_model("llama")
    wide = _set(tmp_path / "wide", layers=(0,), d_model=48)
    with pytest.raises(InputError, match=r"L0/config\.json: d_model is 48.*another model"):
        lorsa_splice_representations(model, wide)
    with pytest.raises(InputError, match=r"L0/config\.json: d_model is 48"):
        check_lorsa_fits(bind(model), wide)
    deep = _set(tmp_path / "deep", layers=(5,))
    with pytest.raises(InputError, match=r"L5/config\.json: hook_point_in names layer 5; "
                                         r"the model has 3 layers"):
        lorsa_fvu(model, None, deep, ["x"])
    cfg = peer_config(layer=0)
    folder = write_peer_lorsa(tmp_path / "bad", cfg, peer_tensors(cfg), NORMS)
    weights = folder / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(TranscoderFormatError, match=r"sae_weights\.safetensors is not a "
                                                    "readable safetensors file"):
        load_lorsa(folder)
    tensors = peer_tensors(cfg)
    tensors["W_V"] = tensors["W_V"][:, :16].contiguous()
    write_peer_lorsa(folder, cfg, tensors, NORMS)
    with pytest.raises(TranscoderFormatError, match=r"tensor W_V has shape \[64, 16\]; the "
                                                    r"config\.json gives \[64, 32\]"):
        load_lorsa(folder)
    for change, message in ((dict(sae_type="sae"), "sae_type is 'sae'"),
                            (dict(act_fn="jumprelu"), "act_fn 'jumprelu'"),
                            (dict(hook_point_out="blocks.1.hook_attn_out"), "different layers"),
                            (dict(hook_point_in="blocks.0.hook_resid_mid"),
                             "hook_point_in must be blocks.<layer>.ln1.hook_normalized")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(TranscoderFormatError, match=rf"config\.json: .*{message}"):
            load_lorsa(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(TranscoderFormatError, match=r"config\.json is not JSON"):
        load_lorsa(folder)


def _spec(path, **entry):
    return {"schema_version": 1, "name": "lorsa", "prompt": CORPUS[0], "answer": " city",
            "interventions": [{"type": "lorsa_splice", "lorsa": str(path), **entry}]}


def test_spec_splices_composes_with_clt_splice_and_writes_itself_back(tmp_path, tokenizer):
    lorsa = _set(tmp_path / "lorsa")
    model = make_tiny_model("llama", init=0.2)
    exact = run_spec(load_spec(_spec(tmp_path / "lorsa", add_error=True)), model, tokenizer)
    assert exact.intervened_probs[0] == pytest.approx(exact.clean_prob, abs=1e-5)
    bare = run_spec(load_spec(_spec(tmp_path / "lorsa")), model, tokenizer)
    assert bare.intervened_probs[0] != pytest.approx(bare.clean_prob, abs=1e-4)
    held = run_spec(load_spec(_spec(tmp_path / "lorsa", error="clean")), model, tokenizer)
    assert held.intervened_probs[0] == pytest.approx(held.clean_prob, abs=1e-5)
    off = run_spec(load_spec(_spec(tmp_path / "lorsa", error="clean", heads_off=[0, 1, 2])),
                   model, tokenizer)
    assert off.intervened_probs[0] != pytest.approx(held.clean_prob, abs=1e-7)
    clt = write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 16, threshold=0.0))
    both = _spec(tmp_path / "lorsa", add_error=True)
    both["interventions"].append({"type": "clt_splice", "clt": str(clt), "add_error": True})
    joint = run_spec(load_spec(both), model, tokenizer)
    assert joint.intervened_probs[0] == pytest.approx(joint.clean_prob, abs=1e-5)
    with pytest.raises(SpecError) as error:
        run_spec(load_spec(_spec(tmp_path / "lorsa", layers=[1])), model, tokenizer)
    assert error.value.path == "$.interventions[0].layers"
    with pytest.raises(SpecError) as error:
        run_spec(load_spec(_spec(tmp_path / "missing")), model, tokenizer)
    assert error.value.path == "$.interventions[0].lorsa"
    reps = lorsa_splice_representations(model, lorsa, layers=[2], add_error=True)
    assert reps[0]["intervention"].to_spec(None) == {
        "type": "lorsa_splice", "lorsa": str(tmp_path / "lorsa"), "layers": [2],
        "from_position": 1, "add_error": True}


def test_a_saved_splice_loads_back_by_its_path(tmp_path):
    """Serialised like clt_splice: the configuration (the Lorsa's path, the session id) in the
    state dict; loaded, the pair finds its Lorsa by path and splices the same."""
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (1, 7), generator=torch.Generator().manual_seed(3))
    reps = lorsa_splice_representations(model, lorsa, layers=[0])
    loaded = []
    for rep in reps:
        made = LorsaSplice.__new__(LorsaSplice)
        LorsaSplice.__init__(made, role="encode", lorsa_layer=0, source="x")
        made.load_state_dict(rep["intervention"].state_dict())
        assert made.config() == rep["intervention"].config()
        loaded.append({"component": rep["component"], "intervention": made})
    bound = bind(model)
    with torch.no_grad():
        with intervened(bound, reps) as m:
            want = m(input_ids=ids).logits
        with intervened(bound, loaded) as m:
            got = m(input_ids=ids).logits
    assert torch.equal(got, want)


def test_the_fit_starts_from_the_attention_layer_itself(tokenizer):
    """Before TopK the fit's start is the layer's attention (QK the model's heads with its
    rotary and grouped keys, OV split by SVD in signed pairs): FVU ~ 0 on llama (GQA) and
    qwen2 (q/k/v biases); with TopK it is a real approximation; on another model it fails."""
    for arch in ("llama", "qwen2"):
        model = make_tiny_model(arch, init=0.2)
        start = attention_init(bind(model), 1, top_k=8)
        whole = LorsaConfig(**{**start.cfg.__dict__, "top_k": start.cfg.n_ov_heads})
        exact = LorsaSet({1: type(start)(whole, start.tensors())})
        assert lorsa_fvu(model, tokenizer, exact, CORPUS[:4])[1] < 1e-6
        sparse = lorsa_fvu(model, tokenizer, LorsaSet({1: start}), CORPUS[:4])[1]
        assert 1e-3 < sparse < 1
    other = make_tiny_model("llama", init=0.2, seed=5)
    assert lorsa_fvu(other, tokenizer, exact, CORPUS[:4])[1] > 0.5


class _TokenizerOnCpu:
    """The tokenizer, its ids made on the CPU whatever the default device (the fit moves them
    to the model's device itself)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, *args, **kwargs):
        with torch.device("cpu"):
            return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_the_fit_makes_every_tensor_on_the_models_device(tokenizer):
    """``fit-lorsa --device``: each tensor the fit makes is made on the model's device. Under
    ``torch.device("meta")`` a tensor made without ``device=`` lands on ``meta``, and torch
    refuses to mix it with the model's CPU tensors; the fit must still run and give what it
    gives without the trap. Old code: zeros, the random spare heads and the batch draws were
    made on the CPU (under a GPU model a mix or a silent copy); it fails here."""
    model = make_tiny_model("llama", init=0.2)
    per = 2 * bind(model).head_dim + 2  # two spare heads per QK head: the random start too
    kwargs = dict(layers=[0, 2], held_out=CORPUS[8:12], top_k=8, per_qk_head=per, steps=3,
                  length=6, batch=4)
    want, want_fit = fit_lorsa(model, tokenizer, CORPUS[:8], **kwargs)
    with torch.device("meta"):
        got, got_fit = fit_lorsa(model, _TokenizerOnCpu(tokenizer), CORPUS[:8], **kwargs)
    assert got_fit == want_fit
    for layer in (0, 2):
        for name, tensor in got[layer].tensors().items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, want[layer].tensors()[name])


def test_the_shipped_spec_runs_with_a_fixture_lorsa(tmp_path, tokenizer):
    from _support.data import SPEC_DIR

    data = json.loads((SPEC_DIR / "lorsa_splice.json").read_text())
    _set(tmp_path / "lorsa", layers=(1, 2))
    data["interventions"][0]["lorsa"] = str(tmp_path / "lorsa")
    data["interventions"][0]["heads_off"] = list(range(48))  # the shipped 3 may be silent here
    model = make_tiny_model("qwen3", n_layers=3, init=0.2)
    result = run_spec(load_spec(data), model, tokenizer)
    assert result.components == ["model.layers[1].input_layernorm.input",
                                 "model.layers[2].input_layernorm.input",
                                 "model.layers[1].self_attn.output",
                                 "model.layers[2].self_attn.output"]
    assert result.intervened_probs[0] != pytest.approx(result.clean_prob, rel=1e-4)
    del data["interventions"][0]["heads_off"]
    held = run_spec(load_spec(data), model, tokenizer)
    assert held.intervened_probs[0] == pytest.approx(held.clean_prob, abs=1e-5)


# -- the audit's probes (silent wrong numbers found and fixed) ---------------------------------

def test_a_head_with_a_zero_decoder_row_writes_nothing_and_is_not_nan(tmp_path):
    """A dead OV head (its W_O row zero, as a pruned checkpoint may hold) scores
    ``relu(pre * 0) = 0``: it never fires and the output is the other heads', as if its value
    row were zero (the reference). Dividing by ``|W_O| = 0`` once made every position NaN."""
    dead = [3, 7]
    for name, changes in (("topk", {}), ("relu", {"act_fn": "relu"})):
        cfg = peer_config(layer=0, **changes)
        tensors = peer_tensors(cfg)
        tensors["W_O"][dead] = 0
        lorsa = load_lorsa(write_peer_lorsa(tmp_path / name, cfg, tensors, NORMS))[0]
        x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3))
        acts = lorsa.encode(x)
        assert acts.isfinite().all() and not acts[..., dead].any()
        silent = dict(tensors, W_V=tensors["W_V"].clone(), b_V=tensors["b_V"].clone(),
                      W_O=tensors["W_O"].clone())
        silent["W_V"][dead], silent["b_V"][dead], silent["W_O"][dead] = 0, 0, 1
        torch.testing.assert_close(lorsa.decode(acts), peer_forward(cfg, silent, x, NORMS)[1],
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("norms", [(0.0, 0.7), (-2.5, 0.7), (2.5, 0.0)])
def test_a_dataset_norm_that_is_not_positive_is_refused_naming_the_tensor(tmp_path, norms):
    """An average norm of 0 divided by zero (a ZeroDivisionError); a negative one flips signs.
    Either is a damaged file: refused, naming the file and the tensor."""
    cfg = peer_config(layer=0)
    folder = write_peer_lorsa(tmp_path / "L0", cfg, peer_tensors(cfg), norms)
    hook = cfg["hook_point_in"] if norms[0] <= 0 else cfg["hook_point_out"]
    with pytest.raises(TranscoderFormatError, match=rf"sae_weights\.safetensors: "
                                                    rf"dataset_average_activation_norm\.{hook}"
                                                    r" is .*: not a positive norm"):
        load_lorsa(folder)[0]


def test_heads_off_outside_the_heads_are_refused_not_wrapped(tmp_path):
    """heads_off=[-1] once zeroed the last OV head (a negative index wraps) and one past the
    last failed inside the forward; both are refused when the splice is built."""
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    for heads in ([-1], [64]):
        with pytest.raises(InputError, match=rf"heads_off {heads[0]} is outside"):
            lorsa_splice_representations(model, lorsa, heads_off=heads)
    lorsa_splice_representations(model, lorsa, heads_off=[0, 63])  # the edges: accepted


def test_clean_errors_of_a_batch_are_refused_not_the_first_rows(tmp_path):
    """The clean errors are one prompt's ``[1, P, D]``; a batch of two prompts once gave the
    first prompt's errors (the second row silently dropped): refused. One prompt repeated (a
    row per noise seed) is that prompt's."""
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(InputError, match=r"one prompt.*2 rows, not all the same"):
        clean_lorsa_errors(model, lorsa, ids)
    same = clean_lorsa_errors(model, lorsa, ids[:1].repeat(2, 1))  # one prompt per noise seed
    assert all(torch.equal(same[k], v) for k, v in clean_lorsa_errors(model, lorsa,
                                                                      ids[:1]).items())


def test_the_fit_refuses_a_layer_with_a_sliding_window_shorter_than_its_context():
    """A sliding-window layer attends to its last ``window`` tokens; a Lorsa attends to every
    earlier one. The fit's start is then not the layer (FVU ~0.3 on 12 tokens, window 4):
    refused. A window as long as the Lorsa's n_ctx changes nothing: accepted."""
    import transformers

    common = dict(vocab_size=420, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, initializer_range=0.2)
    for window, refused in ((4, True), (2048, False)):
        config = transformers.MistralConfig(**common, sliding_window=window)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        if refused:
            with pytest.raises(InputError, match=r"layer 1 attends over a sliding window of "
                                                 r"4 tokens.*n_ctx 2048"):
                attention_init(bind(model), 1, top_k=8, n_ctx=2048)
        else:
            assert attention_init(bind(model), 1, top_k=8, n_ctx=2048).cfg.n_ctx == 2048


@pytest.mark.parametrize(("change", "field"), [({"attn_scale": -2.0}, "attn_scale must be > 0"),
                                               ({"attn_scale": 0}, "attn_scale must be > 0"),
                                               ({"rotary_base": -10000}, "rotary_base"),
                                               ({"eps": -1e-6}, "eps must be >= 0")])
def test_a_scale_base_or_eps_out_of_range_is_refused(tmp_path, change, field):
    """attn_scale -2 once read as a Lorsa attending to its least similar keys (no error); 0,
    a negative rotary base or eps gave NaN."""
    cfg = peer_config(layer=0, **change)
    with pytest.raises(TranscoderFormatError, match=rf"config\.json: {field}"):
        load_lorsa(write_peer_lorsa(tmp_path / "L0", cfg, peer_tensors(cfg), NORMS))


def test_a_set_whose_lorsas_name_two_models_is_refused(tmp_path):
    """One set, layers naming different models: its model_name was None, which let the set
    past check_lorsa_fits' name check on any model. Refused; one named, one not: the name."""
    for layer, name in ((0, "smollm2-135m"), (2, "qwen3-8b")):
        cfg = peer_config(layer=layer)
        folder = write_peer_lorsa(tmp_path / f"L{layer}", cfg, peer_tensors(cfg), NORMS)
        (folder / "lm_config.json").write_text(json.dumps({"model_name": name}))
    with pytest.raises(TranscoderFormatError, match=r"name different models "
                                                    r"\(qwen3-8b, smollm2-135m\)"):
        load_lorsa(tmp_path)
    (tmp_path / "L2" / "lm_config.json").unlink()
    assert load_lorsa(tmp_path).model_name == "smollm2-135m"


def test_a_bfloat16_file_is_folded_in_float32_not_in_its_own_dtype(tmp_path):
    """A bfloat16 Lorsa read as float32: the dataset-norm fold (``W * sqrt(d) / norm``) was
    done in bfloat16 before the cast, rounding every weight again (2**-9): the reconstruction
    off by 0.006 under relu and by 0.6 (as large as the output) under TopK, where the rounding
    flipped which heads were kept. The reference: their forward in float64 on the stored
    weights."""
    for name, changes in (("relu", {"act_fn": "relu"}), ("topk", {})):
        cfg = peer_config(layer=0, **changes)
        tensors = {k: v.to(torch.bfloat16) for k, v in peer_tensors(cfg).items()}
        lorsa = load_lorsa(write_peer_lorsa(tmp_path / name, cfg, tensors, (3.3, 1.7)))[0]
        x = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
        acts, want = peer_forward(cfg, {k: v.double() for k, v in tensors.items()}, x,
                                  (3.3, 1.7))
        ours = lorsa.encode(x)
        assert torch.equal(ours != 0, acts != 0)
        torch.testing.assert_close(lorsa.decode(ours).double(), want, atol=2e-6, rtol=1e-5)


def test_a_cached_generation_step_is_refused_and_an_uncached_one_is_the_whole_run(tmp_path):
    """generate(intervene_on_prompt=True) with a KV cache hands each step's attention the
    newest token alone: the Lorsa attended over that one position (tokens 2-4 of 4 differed
    from the spliced forward on the whole sequence). Refused; without the cache every step
    is the whole run (the reference: greedy spliced forwards on the grown sequence)."""
    from pyvene_causaltrace import IntervenableModel

    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    ids = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    want = ids
    for _ in range(4):
        with torch.no_grad(), intervened(bind(model), lorsa_splice_representations(
                model, lorsa)) as m:
            want = torch.cat([want, m(input_ids=want).logits[:, -1].argmax(-1, True)], 1)
    for cache in (True, False):
        pv = IntervenableModel(lorsa_splice_representations(model, lorsa), model)
        run = lambda pv=pv, cache=cache: pv.generate(  # noqa: E731
            {"input_ids": ids}, intervene_on_prompt=True, max_new_tokens=4, do_sample=False,
            use_cache=cache)[1]
        if cache:
            with pytest.raises(InputError, match=r"handed 1 position\(s\) after a forward of 6 "
                                                 r".*KV cache"):
                run()
        else:
            assert torch.equal(run(), want)
    with pytest.raises(InputError, match=r"unit_locations on each new token"):  # pyvene's default
        IntervenableModel(lorsa_splice_representations(model, lorsa), model).generate(
            {"input_ids": ids}, max_new_tokens=2, do_sample=False, use_cache=False)


def test_a_padded_batch_is_refused_and_an_unpadded_mask_is_not(tmp_path):
    """Left-padded, the second prompt's real tokens were reconstructed by a Lorsa that also
    attended to its pads, its first token spliced as if past BOS (its logits differed from
    the prompt run alone by 5.5, as large as they are; the model's own by 2e-6).
    Refused; an all-ones mask (sdpa: no mask; eager: the causal one) splices as before."""
    lorsa = _set(tmp_path)
    ids = torch.randint(1, 400, (2, 7), generator=torch.Generator().manual_seed(0))
    pads = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    for attention in ("sdpa", "eager"):
        model = make_tiny_model("llama", init=0.2)
        model.config._attn_implementation = attention
        with torch.no_grad(), intervened(bind(model),
                                         lorsa_splice_representations(model, lorsa)) as m:
            with pytest.raises(InputError, match=r"mask hides earlier positions \(padding\)"
                                                 r".*run each prompt alone, unpadded"):
                m(input_ids=ids, attention_mask=pads)
            both = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            alone = m(input_ids=ids[1:]).logits
        torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=0)
    # a model's sliding window (3 of 7 positions) is the model's: the Lorsa's splice runs
    import transformers

    config = transformers.MistralConfig(
        vocab_size=420, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
        attn_implementation="eager")
    windowed = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad(), intervened(bind(windowed),
                                     lorsa_splice_representations(windowed, lorsa)) as m:
        assert m(input_ids=ids).logits.isfinite().all()
        with pytest.raises(InputError, match=r"\(padding\)"):
            m(input_ids=ids, attention_mask=pads)


def test_lorsa_fvu_refuses_a_negative_from_position(tmp_path, tokenizer):
    """from_position=-1 once measured the last position alone (a slice from the end)."""
    lorsa = _set(tmp_path)
    model = make_tiny_model("llama", init=0.2)
    with pytest.raises(InputError, match="from_position"):
        lorsa_fvu(model, tokenizer, lorsa, CORPUS[:2], from_position=-1)
