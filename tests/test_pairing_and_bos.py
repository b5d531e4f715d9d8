"""Issue 39, the transcoder side: position 0 follows the tokenizer (BOS only when the tokenizer
adds one; circuit-tracer's "always BOS" stays an option), and the pairing verdict tells a poor
fit from a mispairing, as a field of the report."""

from __future__ import annotations

import json

import pytest
import torch
from _support.data import fact_texts
from _support.models import PROMPT, make_tiny_model, make_tokenizer
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.replacement_model import ReplacementModel
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.prompts import first_position, tokenizer_adds_bos
from pyvene_causaltrace.transcoders import Transcoder, load_from_disk
from pyvene_causaltrace.transcoders.checks import PairingReport, check_pairing
from pyvene_causaltrace.transcoders.fit import collect_pairs, fit_clt
from pyvene_causaltrace.transcoders.hooks import hook_states

TOL = 1e-4  # closure, relative to the scale of what a row sums (edges.CLOSURE_TOLERANCE)


def _bos_tokenizer():
    """The tiny tokenizer, prepending its ``<bos>`` as Llama's and Gemma's do."""
    from tokenizers import processors  # tokenizers is a transformers dependency: test-only use

    tokenizer = make_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    return tokenizer


@pytest.fixture(scope="module")
def bos_tokenizer():
    return _bos_tokenizer()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    path = write_clt(tmp_path_factory.mktemp("clt"), random_clt_tensors(3, 32, 48,
                                                                         threshold=0.1))
    return model, load_from_disk(str(path))


def test_the_rule_reads_what_the_tokenizer_does(tokenizer, bos_tokenizer):
    """The tiny tokenizer, like SmolLM2's, has a ``bos_token`` and adds none: position 0 is a
    real token under ``auto``; one that prepends its BOS makes position 0 special."""
    assert tokenizer.bos_token is not None
    assert tokenizer("The")["input_ids"] == tokenizer("The", add_special_tokens=False)["input_ids"]
    assert not tokenizer_adds_bos(tokenizer) and tokenizer_adds_bos(bos_tokenizer)
    assert bos_tokenizer("The")["input_ids"][0] == bos_tokenizer.bos_token_id
    assert [first_position(tokenizer, m) for m in ("auto", "always", "never")] == [0, 1, 0]
    assert [first_position(bos_tokenizer, m) for m in ("auto", "always", "never")] == [1, 1, 0]
    with pytest.raises(InputError, match="bos must be one of auto, always, never"):
        first_position(tokenizer, "first")


def _mlp_outputs(model, clt, ids):
    return hook_states(model, ids, {"y": clt.cfg.feature_output_hook})["y"]  # [L, P, D]


@pytest.mark.numerics
def test_without_a_bos_position_0_is_spliced_attributed_and_closes(setup, tokenizer):
    """No BOS added: position 0 ('The') has features, its errors are what the transcoder misses
    (not the whole MLP output), the graph records the rule, and every row still closes exactly —
    with position 0's nodes left out (the control) it does not."""
    model, clt = setup
    graph = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    assert graph.metadata["bos"]["first_spliced_position"] == 0
    assert graph.metadata["bos"]["tokenizer_adds_bos"] is False
    assert "real token" in graph.metadata["bos"]["rule"] and "'The'" in graph.metadata["bos"][
        "rule"]
    at_0 = graph.feature_position == 0
    assert int(at_0.sum()) > 0  # features at position 0 are nodes (none before the fix)
    ids = torch.tensor([graph.input_ids])
    run = ReplacementModel(model, tokenizer, clt).run(ids)
    outputs = _mlp_outputs(model, clt, ids)
    for layer in range(clt.n_layers):  # unspliced, the error is the output less b_dec
        error, unspliced = run.errors[layer][0, 0].detach(), outputs[layer, 0] - clt.b_dec[layer]
        assert float((error - unspliced).norm()) > 0.1 * float(unspliced.norm())
    # exact closure: the target row's parts sum to the target, over every row
    assert graph.closure.ok and graph.closure.relative < TOL
    assert float(graph.row_closures().max()) < TOL
    parts = graph.decomposition()
    whole = sum(parts[k] for k in ("features", "unexplored", "errors", "steering", "tokens",
                                   "constants"))
    assert whole == pytest.approx(parts["target"], abs=TOL * graph.closure.scale)
    # control: the target row without position 0's features and errors misses by far more
    lay = graph.layout
    row = graph.target_row().double()
    position_0 = torch.zeros(row.numel(), dtype=torch.bool)
    position_0[:graph.n_features] = at_0
    position_0[torch.arange(lay.errors.start, lay.errors.stop, graph.n_pos)] = True
    c = graph.closure
    missing = abs(float(row[~position_0].sum()) + c.constant - c.target)
    assert missing > 100 * TOL * c.scale and float(row[position_0].abs().sum()) > 0


@pytest.mark.numerics
def test_with_a_bos_position_0_stays_out_and_the_errors_carry_it(setup, bos_tokenizer):
    """A tokenizer that adds BOS: no features at position 0, its error is the whole MLP output
    but ``b_dec`` (the BOS is never spliced), rows close, and the metadata says so."""
    model, clt = setup
    graph = attribute(model, bos_tokenizer, clt, PROMPT, batch_size=16)
    assert graph.input_ids[0] == bos_tokenizer.bos_token_id
    assert graph.metadata["bos"]["first_spliced_position"] == 1
    assert graph.metadata["bos"]["tokenizer_adds_bos"] is True
    assert not bool((graph.feature_position == 0).any())
    ids = torch.tensor([graph.input_ids])
    run = ReplacementModel(model, bos_tokenizer, clt).run(ids)
    outputs = _mlp_outputs(model, clt, ids)
    for layer in range(clt.n_layers):  # no feature there: the output less b_dec
        torch.testing.assert_close(run.errors[layer][0, 0].detach(),
                                   outputs[layer, 0] - clt.b_dec[layer], atol=1e-5, rtol=1e-5)
    assert graph.closure.ok and float(graph.row_closures().max()) < TOL


@pytest.mark.numerics
def test_circuit_tracers_convention_stays_an_option(setup, tokenizer, bos_tokenizer):
    """``bos="always"`` treats position 0 as BOS whatever the tokenizer does: on the no-BOS
    tokenizer it equals the BOS tokenizer's rule; ``bos_errors="drop"`` is refused where position
    0 is a spliced real token, and accepted with ``bos="always"``."""
    model, clt = setup
    with pytest.raises(InputError, match="bos='always'"):
        attribute(model, tokenizer, clt, PROMPT, bos_errors="drop")
    graph = attribute(model, tokenizer, clt, PROMPT, bos="always", bos_errors="drop",
                      batch_size=16)
    assert graph.metadata["bos"]["setting"] == "always"
    assert graph.metadata["bos"]["first_spliced_position"] == 1
    assert "circuit-tracer" in graph.metadata["bos"]["rule"]
    assert not bool((graph.feature_position == 0).any())
    assert float(graph.row_closures().max()) < TOL
    # and "never" splices position 0 even after a BOS
    never = attribute(model, bos_tokenizer, clt, PROMPT, bos="never", batch_size=16)
    assert never.metadata["bos"]["first_spliced_position"] == 0
    assert never.closure.ok


def test_fitting_and_pairing_count_position_0_unless_it_is_bos(setup, tokenizer,
                                                               bos_tokenizer):
    """``collect_pairs`` (what ``fit_clt`` fits on) and ``check_pairing`` count position 0 on a
    tokenizer that adds no BOS, and leave the BOS out on one that adds it."""
    model, clt = setup
    texts = [PROMPT, "Paris is the capital of France"]
    n_plain = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    n_bos = sum(len(bos_tokenizer(t)["input_ids"]) for t in texts)
    assert n_bos == n_plain + len(texts)
    x, y = collect_pairs(model, tokenizer, texts)
    assert x.shape[0] == y.shape[0] == n_plain  # position 0 fitted (it was dropped before)
    assert collect_pairs(model, bos_tokenizer, texts)[0].shape[0] == n_bos - len(texts)
    assert collect_pairs(model, tokenizer, texts, bos="always")[0].shape[0] == n_plain - 2
    report = check_pairing(model, tokenizer, clt, texts)
    assert report.n_tokens == n_plain and report.from_position == 0
    assert check_pairing(model, bos_tokenizer, clt, texts).n_tokens == n_bos - len(texts)
    assert check_pairing(model, tokenizer, clt, texts, bos="always").n_tokens == n_plain - 2


def test_the_verdict_is_a_field_with_three_values():
    """``status`` is a dataclass field (in ``to_dict``), decided by the FVU against the controls:
    only a mispairing stops a pipeline."""
    def report(fvu, hook, layer):
        return PairingReport([fvu], fvu, 3.0, hook, 4.0, layer, 10)

    good, poor, wrong = report(0.2, 215.0, 3.3), report(0.9, 6.0, 3.0), report(1.2, 1.1, 3.0)
    assert [r.status for r in (good, poor, wrong)] == ["paired", "poor_fit", "mispaired"]
    assert report(0.7, 0.75, 1.4).status == "poor_fit"  # below FVU 1: both controls worse
    assert report(0.7, 0.75, 0.7).status == "mispaired"  # the next layer fits as well
    assert report(1.3, 5.0, 3.0).status == "poor_fit"  # at FVU >= 1: controls twice as bad
    assert report(2.0, 2.5, 9.0).status == "mispaired"  # "nearly as well" is no pairing there
    assert "nearly as well" in report(2.0, 2.5, 9.0).verdict()
    assert poor.verdict().startswith("paired, poor fit: FVU 0.900")
    assert "MISPAIRED" in wrong.verdict() and "earlier hook fits as well or better" in \
        wrong.verdict()
    assert good.to_dict()["status"] == "paired" and poor.to_dict()["paired"] is True
    # the pooled FVU weighs each layer by its variance (SmolLM2's first transcoder: 0.013
    # pooled, median layer 0.58): the median layer's decides a poor fit too
    spread = PairingReport([0.9, 0.8, 0.01], 0.05, 3.0, 2.0, 4.0, 3.0, 10)
    assert spread.status == "poor_fit" and spread.median_layer_fvu == 0.8
    assert "median 0.800, worst layer 0 0.900, 2 of 3 at 0.5 or more" in spread.verdict()
    assert spread.to_dict()["median_layer_fvu"] == 0.8
    assert PairingReport([0.3, 0.2, 0.01], 0.05, 3.0, 2.0, 4.0, 3.0, 10).status == "paired"
    poor.raise_if_mispaired()
    with pytest.raises(InputError, match="MISPAIRED"):
        wrong.raise_if_mispaired()
    with pytest.raises(TypeError):
        PairingReport([0.1], 0.1, 1.0, 2.0, 1.0, 2.0, 10, 1, "paired")  # not an argument


def _layers_permuted(clt: Transcoder, order: list[int]) -> Transcoder:
    """``clt`` with layer ``l`` holding layer ``order[l]``'s encoder, biases and decoder (cut or
    zero-padded to the target layers ``l`` writes): read at the wrong layers."""
    n = clt.n_layers

    def decoder(layer):
        w = clt.W_dec[order[layer]]
        width = n - layer
        if w.shape[1] >= width:
            return w[:, :width]
        return torch.cat([w, w.new_zeros(w.shape[0], width - w.shape[1], w.shape[2])], 1)

    return Transcoder.from_tensors(
        clt.cfg.model_name, clt.W_enc[order], clt.b_enc[order], clt.threshold[order],
        clt.b_dec[order], [decoder(layer) for layer in range(n)],
        activation=clt.cfg.activation)


@pytest.mark.numerics
def test_pairing_tells_a_poor_fit_from_a_mispairing(tokenizer, trained_tiny, fitted_clt,
                                                    tmp_path):
    """On a trained tiny model: the fitted CLT is paired, an under-fitted one (correctly
    paired, a few steps) a poor fit, the fitted one read at permuted layers mispaired; the CLI
    says the same as the API and writes the status."""
    model, folder = trained_tiny("llama")
    good, _ = fitted_clt("llama")
    held_out = fact_texts()[1000:1020]
    paired = check_pairing(model, tokenizer, good, held_out)
    assert paired.status == "paired", paired.verdict()
    # measured: FVU 0.60, controls 0.70 (earlier hook: attention moves a 3-layer model's
    # residual little) and 1.38 (next layer); the fitted CLT 0.05, 0.34 and 1.52
    weak, _ = fit_clt(model, tokenizer, fact_texts()[:150], d_transcoder=32, steps=15)
    poor = check_pairing(model, tokenizer, weak, held_out)
    assert poor.status == "poor_fit", poor.verdict()
    assert poor.verdict().startswith("paired, poor fit")
    wrong = check_pairing(model, tokenizer, _layers_permuted(good, [1, 2, 0]), held_out)
    assert wrong.status == "mispaired", wrong.verdict()
    # the CLI: the same verdict, the status in clt_check.json, exit 0 for a poor fit
    weak.save_model(str(tmp_path / "weak"))
    data = tmp_path / "held_out.txt"
    data.write_text("\n".join(held_out))
    code = main(["clt-check", "--model", str(folder), "--clt", str(tmp_path / "weak"),
                 "--data", str(data), "--prompt", PROMPT, "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "clt_check.json").read_text())["pairing"]
    assert code == 0 and written["status"] == "poor_fit"
    assert written["fvu"] == pytest.approx(poor.fvu, rel=1e-6)
