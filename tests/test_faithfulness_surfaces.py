"""Where users see a faithfulness curve (issue 55, item 4): the graph JSON carries the curve
(sizes, f, the random band, CPR/CMD) under ``metadata.info``, still Neuronpedia's schema and
listed by the viewer; the graph file reads it back; the viewer draws one panel per curve (f on a
log axis, the band, CPR/CMD in the legend), and none for a graph without one."""

from __future__ import annotations

import json
import math

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.faithfulness import curve_json, faithfulness
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.viewer.listing import examine

SIZES = (10.0, 50.0, 100.0)


@pytest.fixture(scope="module")
def made(tmp_path_factory, tokenizer):
    """faith/graph.json (a graph with its curve), plain/graph.json (the same graph without),
    faith/graph.safetensors, and the curve."""
    root = tmp_path_factory.mktemp("faith-surfaces")
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt_dir = write_clt(root.parent / f"{root.name}-clt",
                        random_clt_tensors(3, 32, 48, threshold=0.1))
    from pyvene_causaltrace.transcoders import load_from_disk

    clt = load_from_disk(str(clt_dir))
    graph = attribute(model, tokenizer, clt, PROMPT)
    for name in ("faith", "plain"):
        (root / name).mkdir()
    graph.to_json(root / "plain" / "graph.json")
    curve = faithfulness(model, None, clt, graph, ablation="zero", metric="prob", sizes=SIZES,
                         draws=3)
    graph.metadata["faithfulness"] = curve.summary()
    graph.to_json(root / "faith" / "graph.json")
    graph.save(root / "faith" / "graph.safetensors")
    return root, curve


def test_the_graph_json_carries_the_curve_and_stays_a_graph(made):
    root, curve = made
    data = (root / "faith" / "graph.json").read_bytes()
    payload = json.loads(data)
    check_graph_json(payload)  # Neuronpedia's schema tolerates the extra metadata
    assert examine(data).problem is None  # the viewer lists it
    entry = payload["metadata"]["info"]["faithfulness"]
    assert (entry["cpr"], entry["cmd"]) == (curve.cpr, curve.cmd)
    drawn = entry["curve"]
    frame = curve.to_dataframe()
    assert drawn["sizes"] == list(SIZES) and drawn["f"] == curve.f
    assert drawn["counts"] == curve.counts and drawn["random"]["draws"] == 3
    for key in ("min", "mean", "max"):  # the band is the random draws', per size
        assert drawn["random"][key] == pytest.approx(list(frame[f"random_{key}"]), abs=1e-12)
    by_hand = [min(d[i] for d in curve.random) for i in range(len(SIZES))]
    assert drawn["random"]["min"] == pytest.approx(by_hand, abs=1e-12)
    assert (drawn["cpr"], drawn["cmd"]) == (curve.cpr, curve.cmd)
    assert drawn["random_cpr"] == curve.random_cpr
    # the graph file reads it back, whole
    back = AttributionGraph.load(root / "faith" / "graph.safetensors")
    assert back.metadata["faithfulness"] == json.loads(json.dumps(curve.summary()))
    assert "faithfulness" not in \
        json.loads((root / "plain" / "graph.json").read_text())["metadata"]["info"]


def test_a_curve_of_the_wrong_length_is_refused():
    with pytest.raises(InputError, match="curve: 2 sizes"):
        curve_json("t", [1.0, 2.0], [0.5], [], cpr=0.0, cmd=0.0, x_label="x", y_label="y")
    plain = curve_json("t", [1.0, 2.0], [0.5, 1.0], [], cpr=0.0, cmd=0.0, x_label="x",
                       y_label="y")
    assert plain["random"] == {"draws": 0, "min": [], "mean": [], "max": []}


def test_the_page_has_a_curves_panel_hidden_until_a_graph_carries_one():
    from pyvene_causaltrace.viewer import PAGE

    page = PAGE.read_text(encoding="utf-8")
    assert '<div id="curves" hidden></div>' in page
    assert "showCurves(state.graph);" in page and "function curvesOf(graph)" in page


@pytest.mark.browser
def test_the_faithfulness_panel_in_headless_chromium(made):
    from test_viewer import _chromium
    from test_viewer_annotations import _browser
    from test_viewer_server import running

    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    root, curve = made
    with running(root) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            page.select_option("#picker", "faith/graph.json")
            page.wait_for_selector("#curves .curve-panel")
            assert page.locator("#curves").is_visible()
            assert page.locator("#curves .curve-panel").count() == 1
            panel = page.locator('#curves .curve-panel[data-key="faithfulness"]')
            assert panel.locator("h3").inner_text() == "faithfulness f(k) (MIB)"
            legend = panel.locator(".legend-graph").inner_text()
            assert f"CPR {curve.cpr:.3f}" in legend and f"CMD {curve.cmd:.3f}" in legend
            random = panel.locator(".legend-random").inner_text()
            assert "3 draws" in random and f"{min(curve.random_cpr):.3f}" in random
            assert panel.locator("polygon.band").count() == 1
            assert panel.locator("path.random-mean").count() == 1
            # the points: x on a log axis (equal ratios, equal steps), y falls as f rises
            xs = page.eval_on_selector_all("#curves .graph-point",
                                           "ps => ps.map(p => Number(p.getAttribute('cx')))")
            ys = page.eval_on_selector_all("#curves .graph-point",
                                           "ps => ps.map(p => Number(p.getAttribute('cy')))")
            assert len(xs) == len(SIZES)
            logs = [math.log10(s) for s in SIZES]
            steps = [(xs[i + 1] - xs[i]) / (logs[i + 1] - logs[i]) for i in range(len(xs) - 1)]
            assert steps[0] == pytest.approx(steps[1], rel=1e-3) and steps[0] > 0
            for i in range(len(ys) - 1):
                a, b = curve.f[i], curve.f[i + 1]
                if abs(a - b) > 1e-6:
                    assert (ys[i] > ys[i + 1]) == (b > a)
            # a graph without a curve: no panel; back to the first: the panel again
            page.select_option("#picker", "plain/graph.json")
            page.wait_for_function("() => document.querySelector('#curves').hidden")
            assert page.locator("#curves .curve-panel").count() == 0
            page.select_option("#picker", "faith/graph.json")
            page.wait_for_selector("#curves .curve-panel")
            assert not errors, errors
        finally:
            browser.close()
