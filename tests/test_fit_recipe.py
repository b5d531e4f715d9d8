"""The first transcoder's recipe, each fast path against a simple one: a TopK fit (its decoder
an embedding bag) beats a ReLU fit at the same L0 and round-trips through circuit-tracer's
layout to the same outputs; a fit in normalised units folds back into the weights it reports;
the chunked least-squares skip equals a direct solve; the pairs of texts generated and read
in padded batches equal a forward of each text alone."""

from __future__ import annotations

import pytest
import torch
from _support.models import make_tiny_model

from pyvene_causaltrace import fit_text, fitting
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.prompts import first_position
from pyvene_causaltrace.transcoders import load_transcoder, save_transcoder
from pyvene_causaltrace.transcoders.fit import fit_pairs, linear_skip
from pyvene_causaltrace.transcoders.hooks import hook_states, keeping_states


def _sparse_pairs(n=3000, n_layers=2, d=16, n_true=24, active=3, seed=0):
    """``y`` made of ``active`` of ``n_true`` directions per token, each gated by a ReLU of
    ``x``: a dictionary of ``n_true`` features reconstructs it exactly at L0 ``active``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_layers, d, generator=g)
    enc = torch.randn(n_layers, n_true, d, generator=g)
    dec = torch.randn(n_layers, n_true, d, generator=g)
    z = torch.einsum("nld,lfd->nlf", x, enc)
    top = z.topk(active, dim=-1)
    acts = torch.zeros_like(z).scatter(-1, top.indices, top.values.relu())
    return x, torch.einsum("nlf,lfd->nld", acts, dec)


def _fvu_l0(tc, x, y):
    inputs = x.transpose(0, 1)
    acts = tc.encode_all(inputs, zero_bos=False)
    recon = tc.reconstruct(acts, inputs).transpose(0, 1)
    fvu = ((recon - y).pow(2).sum((0, 2)) / (y - y.mean(0)).pow(2).sum((0, 2))).mean()
    return float(fvu), float((acts != 0).sum(-1).float().mean())


def test_topk_beats_relu_at_the_same_l0_and_round_trips(tmp_path):
    x, y = _sparse_pairs()
    common = {"d_transcoder": 32, "steps": 400, "kind": "per_layer", "lr": 1e-2,
              "normalize": True, "warmup": 20}
    relu, _ = fit_pairs(x, y, "m", activation="relu", l1=3.0, **common)  # L0 about 5
    relu_fvu, relu_l0 = _fvu_l0(relu, x, y)
    k = max(1, round(relu_l0))
    topk, stats = fit_pairs(x, y, "m", activation="relu_topk", k=k, **common)
    topk_fvu, topk_l0 = _fvu_l0(topk, x, y)
    assert topk_l0 <= k + 1e-6 and (topk.cfg.activation, topk.cfg.k) == ("relu_topk", k)
    assert topk_fvu < 0.6 * relu_fvu, (topk_fvu, relu_fvu, relu_l0)
    assert topk_fvu == pytest.approx(stats.train_fvu, rel=1e-3)
    save_transcoder(topk, tmp_path / "topk")
    again = load_transcoder(tmp_path / "topk")
    assert (again.cfg.activation, again.cfg.k, again.cfg.model_kind) == \
        ("relu_topk", k, "transcoder_set")
    inputs = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    outs = [tc.reconstruct(tc.encode_all(inputs, zero_bos=False), inputs) for tc in (topk, again)]
    assert torch.equal(*outs)


@pytest.mark.parametrize("kind,skip,skip_init,activation,k", [
    ("cross_layer", False, "zero", "relu", None),
    ("per_layer", True, "lstsq", "relu_topk", 4),
    ("per_layer", True, "zero", "jumprelu", None),
])
def test_normalised_units_fold_back_into_the_weights(kind, skip, skip_init, activation, k):
    """With ``normalize`` the fit runs on centred, scaled pairs (a first position hundreds of
    times the rest, as SmolLM2's); the transcoder it returns, in the model's units, scores
    the FVU the fit reported, from 16-bit pairs and with bfloat16 products too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, 3, 12, generator=g) * torch.tensor([1.0, 5.0, 30.0])[:, None] + 3
    x[::50] *= 40
    y = torch.relu(torch.einsum("nld,lod->nlo", x, torch.randn(3, 12, 12, generator=g))) + 2
    for dtype in (torch.float32, torch.bfloat16):
        xs, ys = x.to(dtype), y.to(dtype)
        tc, stats = fit_pairs(xs.clone(), ys.clone(), "m", d_transcoder=16, steps=30, kind=kind,
                              skip=skip, skip_init=skip_init, activation=activation, k=k,
                              normalize=True, consume=True, bf16=dtype == torch.bfloat16)
        fvu, _ = _fvu_l0(tc, xs.float(), ys.float())
        # 16-bit pairs are put in the fit's units in place, so its score rounds them again
        # (2**-9 relative): a wrong fold would be off by far more
        rel = 1e-3 if dtype == torch.float32 else 1e-2
        assert fvu == pytest.approx(stats.train_fvu, rel=rel, abs=1e-5)


def test_the_chunked_skip_equals_a_direct_solve():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 2, 10, generator=g) * 3 + 1
    y = torch.einsum("nld,lod->nlo", x, torch.randn(2, 6, 10, generator=g)) \
        + torch.randn(5000, 2, 6, generator=g)
    W, b = linear_skip(x, y, ridge=0.0, chunk=700)
    for layer in range(2):
        design = torch.cat([x[:, layer], torch.ones(5000, 1)], 1).double()
        solution = torch.linalg.lstsq(design, y[:, layer].double()).solution
        assert torch.allclose(W[layer].double(), solution[:-1].T, atol=1e-4)
        assert torch.allclose(b[layer].double(), solution[-1], atol=1e-4)
    held = linear_skip(x.to(torch.bfloat16), y.to(torch.bfloat16), ridge=0.0)[0]  # 16-bit pairs
    assert (held - W).abs().max() < 0.05


def test_pairs_of_batched_generation_and_forwards_equal_each_text_alone(tokenizer, monkeypatch):
    """Texts sampled together (starts of different lengths padded on the left, through the KV
    cache) and the pairs read from those forwards, or again from right-padded batches of whole
    texts stopped after a group's last layer, equal a forward of each text alone, text by text
    in order; greedy texts sampled together equal each sampled alone."""
    model = make_tiny_model("llama")
    bound = bind(model)
    monkeypatch.setattr(fit_text, "STARTS", ("The city of", "A", "The river", "In 1990,"))
    lengths = [len(tokenizer(fit_text.STARTS[i % 4])["input_ids"]) for i in range(7)]
    assert len(set(lengths)) > 1  # the batches mix lengths: padding is exercised
    first = first_position(tokenizer, "auto")
    ids, x, y = fit_text.generate_ids(bound, tokenizer, 7, 5, seed=3, first=first, keep=[0, 2],
                                      record=5, dtype=torch.float32, batch=4)
    assert [len(row) for row in ids] == [n + 5 for n in lengths]
    assert all(row[:n] == tokenizer(fit_text.STARTS[i % 4])["input_ids"]
               for i, (row, n) in enumerate(zip(ids, lengths, strict=True)))
    alone = [hook_states(model, torch.tensor([row[:-1]]),
                         {"x": "hook_resid_mid", "y": "hook_mlp_out"}) for row in ids]

    def want(layers, texts):
        return [torch.cat([s[key][layers].transpose(0, 1)[first:] for s in alone[:texts]])
                for key in ("x", "y")]

    want_x, want_y = want([0, 2], 5)
    assert x.shape == want_x.shape and x.dtype == torch.float32
    assert torch.allclose(x, want_x, atol=1e-5) and torch.allclose(y, want_y, atol=1e-5)
    for layers, batch_tokens in (([1], 16), ([0, 1, 2], 10**4)):  # stopped early; one forward
        x, y = fit_text.read_pairs(bound, ids, layers, first=first, dtype=torch.float32,
                                   batch_tokens=batch_tokens)
        want_x, want_y = want(layers, 7)
        assert torch.allclose(x, want_x, atol=1e-5) and torch.allclose(y, want_y, atol=1e-5)
    greedy = {"do_sample": False, "top_k": None, "temperature": None}
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: generate(**{**kw, **greedy}),
                        raising=False)
    together = fit_text.generate_ids(bound, tokenizer, 4, 5, seed=0, batch=4)[0]
    assert together == [fit_text.generate_ids(bound, tokenizer, i + 1, 5, seed=0, batch=1)[0][i]
                        for i in range(4)]
    with keeping_states(bound, {"x": "hook_resid_mid"}) as take, torch.no_grad():
        model(input_ids=torch.tensor([ids[0]]))
        model(input_ids=torch.tensor([ids[1]]))
        joined = take()["x"]
    assert joined.shape == (1, len(ids[0]) + len(ids[1]), 3, x.shape[-1])  # along positions


def test_a_set_fitted_a_group_of_layers_at_a_time_is_each_groups_own_fit(tokenizer, tmp_path,
                                                                        monkeypatch):
    """With room for one layer's pairs, each layer is fitted alone (the last one on the pairs
    read while generating, the others on forwards over the kept ids): layer by layer, the saved
    set equals a fit of that layer's pairs alone."""
    model = make_tiny_model("llama")
    monkeypatch.setattr(fitting, "fast_bf16", lambda device: False)
    monkeypatch.setattr(fitting, "GENERATED_PAIRS", torch.float32)  # no rounding to 16 bits
    room = fitting.GROUP_PAIR_BYTES // 12  # 12 layers' pairs fit: 3 even groups of 10
    assert fitting.layer_groups(30, True, room) == [list(range(a, a + 10)) for a in (0, 10, 20)]
    assert fitting.layer_groups(30, True, 1) == [list(range(30))]  # all fit: one group
    monkeypatch.setattr(fitting, "GROUP_PAIR_BYTES", 1)
    assert fitting.layer_groups(3, True, 1) == [[0], [1], [2]]
    assert fitting.layer_groups(3, False, 1) == [[0, 1, 2]]  # a cross-layer set: one group
    options = {"texts": 6, "steps": 3, "features": 8, "k": 2, "new_tokens": 4, "seed": 1}
    report = fitting.fit_transcoder(model=model, tokenizer=tokenizer, out=tmp_path / "t",
                                    progress=False, **options)
    got = load_transcoder(report.path)
    ids = fit_text.generate_ids(bind(model), tokenizer, 6 + 4, 4, seed=1)[0]  # 4 held out
    x, y = fit_text.read_pairs(bind(model), ids[:6], range(3), dtype=torch.float32,
                               first=first_position(tokenizer, "auto"))
    assert report.record["train_tokens"] == x.shape[0]
    close = {"rtol": 1e-4, "atol": 1e-4}  # pairs from the generation's forwards: float rounding
    for layer in range(3):
        want, _ = fit_pairs(x[:, [layer]].clone(), y[:, [layer]].clone(), "tiny",
                            d_transcoder=8, steps=3, seed=1, activation="relu_topk", k=2,
                            **fitting.KINDS["skip_plt"][0], **fitting.RECIPE)
        for name in ("W_enc", "b_enc", "b_dec"):
            torch.testing.assert_close(getattr(got, name)[layer], getattr(want, name)[0],
                                       **close, msg=lambda m, layer=layer: f"layer {layer}: {m}")
        torch.testing.assert_close(got.W_dec[layer], want.W_dec[0], **close)
        torch.testing.assert_close(got.W_skip[layer], want.W_skip[0], **close)
