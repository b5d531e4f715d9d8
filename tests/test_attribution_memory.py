"""Attribution's memory on longer prompts (issue 54 item 3): the meter reads a known allocation
exactly, and at a fixed feature budget and batch the peak of live tensors during ``attribute()``
grows at most linearly with the prompt — a term quadratic in tokens (attention patterns held,
rows dense over a square) makes the same check fail."""

from __future__ import annotations

import importlib

import torch
from _support.models import CORPUS, make_tiny_model
from clt_fixtures import random_clt_tensors

from pyvene_causaltrace.attribution import attribute, run_local_replacement
from pyvene_causaltrace.meter import metered, phase
from pyvene_causaltrace.transcoders.transcoder import Transcoder

attribute_module = importlib.import_module("pyvene_causaltrace.attribution.attribute")

#: Tokens of the short prompt; the long one has four times as many.
SHORT = 48
#: Most the peak may grow from SHORT to 4 x SHORT tokens: 4 for linear growth, plus what the
#: active features' count adds above 4x (they fire per position, but not exactly as often).
LINEAR_BOUND = 5.0


def test_the_meter_reads_a_known_allocation_and_phases():
    with metered("cpu") as report:
        a = torch.empty(250_000)  # 1,000,000 bytes
        with phase("inner"):
            b = torch.empty(125_000)  # 500,000 more, then freed
            del b
        del a
    assert report.peak == 1_500_000
    assert report.end == 0
    inner = report.phases["pvct.inner"]
    assert (inner.count, inner.start, inner.peak, inner.transient) == (1, 1_000_000, 1_500_000,
                                                                      500_000)


def _setup():
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    t = random_clt_tensors(3, 32, 48, threshold=0.1)
    clt = Transcoder.from_tensors("tiny", t["W_enc"], t["b_enc"], t["threshold"], t["b_dec"],
                                  t["W_dec"])
    return model, clt


def _prompt(tokenizer, n_tokens: int) -> str:
    ids = tokenizer(" ".join(CORPUS * 8))["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def _peak(model, tokenizer, clt, n_tokens: int) -> tuple[int, int, int]:
    """(peak bytes, tokens, active features) of a 16-row graph, 8 rows per backward."""
    with metered("cpu") as report:
        graph = attribute(model, tokenizer, clt, _prompt(tokenizer, n_tokens), "Paris",
                          max_feature_nodes=16, batch_size=8)
    assert graph.n_explored == 16 and graph.closure.ok
    return report.peak, graph.n_pos, graph.n_features


def test_peak_memory_at_a_fixed_budget_grows_at_most_linearly_with_tokens(tokenizer,
                                                                            monkeypatch):
    model, clt = _setup()
    short, p_short, f_short = _peak(model, tokenizer, clt, SHORT)
    long, p_long, f_long = _peak(model, tokenizer, clt, 4 * SHORT)
    assert p_long == 4 * p_short
    assert 3 < f_long / f_short < 5  # features fire per position: the work grows 4x
    assert long / short < LINEAR_BOUND, (short, long)
    print(f"peak {short:,} -> {long:,} bytes: {long / short:.2f}x")

    # the control: the same run holding a square [P, P] buffer while each batch's rows are
    # computed (a quarter of the short run's peak there) fails the bound
    scale = short / 4 / p_short**2
    rows = attribute_module.feature_rows

    def square(run, index):
        held = torch.ones(int(scale * run.n_pos**2) // 4)  # float32: 4 bytes an entry
        out = rows(run, index)
        del held
        return out

    monkeypatch.setattr(attribute_module, "feature_rows", square)
    short_q, _, _ = _peak(model, tokenizer, clt, SHORT)
    long_q, _, _ = _peak(model, tokenizer, clt, 4 * SHORT)
    assert long_q / short_q > LINEAR_BOUND, (short_q, long_q)
    print(f"with the square: {short_q:,} -> {long_q:,} bytes: {long_q / short_q:.2f}x")


def test_the_forward_graph_keeps_no_decoder_rows(tokenizer):
    """The active features' decoder rows are gathered when needed, not saved for the backward:
    the forward graph is smaller than they are (it held them all before issue 54)."""
    model, clt = _setup()
    ids = tokenizer(_prompt(tokenizer, 4 * SHORT), return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, clt, ids)
    assert run.forward_bytes < run.decoder_bytes / 2, (run.forward_bytes, run.decoder_bytes)
