"""Attention heads in the viewer, in headless Chromium: a link that attention moved (it carries
``heads``, from ``attention_annotations``) is marked in the node's lists; clicking it lists the
heads carrying it with their parts and shares of the weight, as the file gives them; clicking a
head shows its QK terms from ``attention.qk`` (at the link's positions, else the head's other
positions, said so, else that there are none). File text is shown as text, never as markup.
Control: the same graph exported without heads marks no link and shows no Heads panel."""

from __future__ import annotations

import copy
import json

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_viewer import _chromium
from test_viewer_annotations import _browser, _click
from test_viewer_server import running

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.attention import attention_annotations
from pyvene_causaltrace.transcoders import load_from_disk

TOP_EDGES = 8  # the strongest inputs the page lists per node (index.html)
LOADED = "() => !document.querySelector('.node.selected')"  # a graph (re)loads unselected
HOSTILE = '<img src=x onerror="window.pwned = 1">'


@pytest.fixture(scope="module")
def graphs(tmp_path_factory, tokenizer):
    """heads/graph.json (with heads and QK terms), plain/graph.json (the same graph without)
    and hostile/graph.json (heads with a head the QK list lacks, a malformed entry, and a label
    that is markup)."""
    root = tmp_path_factory.mktemp("heads-graphs")
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    clt = load_from_disk(str(write_clt(root.parent / f"{root.name}-clt", tensors)))
    graph = attribute(model, tokenizer, clt, PROMPT)
    annotations = attention_annotations(model, clt, graph)
    for name in ("heads", "plain"):
        (root / name).mkdir()
    payload = graph.to_json(root / "heads" / "graph.json", attention=annotations)
    graph.to_json(root / "plain" / "graph.json")
    hostile = copy.deepcopy(payload)
    link = hostile["links"][hostile["links"].index(_chosen(payload))]
    link["heads"] += [[0, 99, 0.001], ["x"]]
    entry = _entry(hostile, *link["heads"][0][:2], *_positions(hostile, link))
    entry["labels"][entry["pair_wise_contributors"][0][0]] = HOSTILE
    (root / "hostile").mkdir()
    (root / "hostile" / "graph.json").write_text(json.dumps(hostile))
    return root


def _positions(payload: dict, link: dict) -> tuple[int, int]:
    """(query, key) positions of a link: its target's and its source's ``ctx_idx``."""
    where = {n["node_id"]: n["ctx_idx"] for n in payload["nodes"]}
    return where[link["target"]], where[link["source"]]


def _entry(payload: dict, layer: int, head: int, query: int, key: int) -> dict | None:
    return next((e for e in payload["attention"]["qk"] if (e["layer"], e["head"], e["query_pos"],
                                                           e["key_pos"]) == (layer, head,
                                                                             query, key)), None)


def _chosen(payload: dict) -> dict:
    """A link with heads among its target's strongest inputs (so the page lists it) whose
    leading head has QK terms at the link's positions and another head only elsewhere."""
    for link in payload["links"]:
        if "heads" not in link:
            continue
        inputs = sorted((x for x in payload["links"] if x["target"] == link["target"]),
                        key=lambda x: -abs(x["weight"]))
        if inputs.index(link) >= TOP_EDGES:
            continue
        (layer, head, _), *others = link["heads"]
        query, key = _positions(payload, link)
        elsewhere = [h for h in others if _entry(payload, h[0], h[1], query, key) is None
                     and any((e["layer"], e["head"]) == tuple(h[:2])
                             for e in payload["attention"]["qk"])]
        if _entry(payload, layer, head, query, key) and elsewhere:
            return link
    raise AssertionError("no link with heads fits the test")


def _fmt(page, x: float) -> str:
    """``x`` as the page prints numbers (``fmt``: three significant digits)."""
    return page.evaluate("x => Number(x).toPrecision(3)", x)


def _item(page, link: dict, where: str = "#inputs"):
    return page.locator(f'{where} li[data-source="{link["source"]}"]'
                        f'[data-target="{link["target"]}"]')


@pytest.mark.browser
def test_the_heads_of_a_link_and_their_qk_terms_in_headless_chromium(graphs):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    payload = json.loads((graphs / "heads" / "graph.json").read_text())
    link = _chosen(payload)
    query, key = _positions(payload, link)
    labels = {n["node_id"]: n for n in payload["nodes"]}
    with running(graphs) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            page.select_option("#picker", "heads/graph.json")
            # the first graph's load (the page opens on it) may end after this one's
            page.wait_for_function("() => state.name === 'heads/graph.json'")
            page.wait_for_selector("#svg .node")
            _click(page, link["target"])
            assert page.locator("#heads-panel").is_hidden()
            # the target's listed inputs that carry heads, and only those, are marked
            listed = page.eval_on_selector_all(
                "#inputs li", "items => items.map(i => [i.dataset.source, "
                              "i.classList.contains('has-heads')])")
            with_heads = {x["source"] for x in payload["links"]
                          if x["target"] == link["target"] and "heads" in x}
            assert [marked for _, marked in listed] == [s in with_heads for s, _ in listed]
            assert link["source"] in with_heads and any(m for _, m in listed)

            _item(page, link).click()
            assert page.locator("#heads-panel").is_visible()
            assert page.locator(f'#svg .link.chosen[data-source="{link["source"]}"]').count() == 1
            items = page.locator("#heads li")
            assert items.count() == len(link["heads"])
            for i, (layer, head, part) in enumerate(link["heads"]):
                text = items.nth(i).inner_text()
                share = page.evaluate("([p, w]) => (100 * p / w).toFixed(1)",
                                      [part, link["weight"]])
                assert text.startswith(f"L{layer} H{head}"), text
                assert f"{_fmt(page, part)} ({share}% of the weight)" in text, text
                assert float(items.nth(i).get_attribute("data-part")) == part

            # the leading head: its QK terms at the link's positions
            layer, head, _ = link["heads"][0]
            entry = _entry(payload, layer, head, query, key)
            items.nth(0).click()
            assert page.locator("#qk").is_visible()
            assert page.locator("#qk .qk-other").count() == 0
            assert f"score {_fmt(page, entry['score'])}" in page.inner_text("#qk .qk-score")

            def name(node_id):
                return entry["labels"].get(node_id) or labels[node_id]["clerp"]

            pairs = entry["pair_wise_contributors"][:TOP_EDGES]
            assert page.locator("#qk .qk-pairs li").all_inner_texts() == [
                f"{name(q)} × {name(k)}: {_fmt(page, term)}" for q, k, term in pairs]
            for css, field in ((".qk-queries", "top_q_marginal_contributors"),
                               (".qk-keys", "top_k_marginal_contributors")):
                assert page.locator(f"#qk {css} li").all_inner_texts() == [
                    f"{name(n)}: {_fmt(page, v)}" for n, v in entry[field][:TOP_EDGES]]
            assert page.locator("#heads li.chosen").count() == 1

            # a head decomposed only at other positions: those, said so
            other = next(h for h in link["heads"][1:]
                         if _entry(payload, h[0], h[1], query, key) is None
                         and any((e["layer"], e["head"]) == tuple(h[:2])
                                 for e in payload["attention"]["qk"]))
            fallback = next(e for e in payload["attention"]["qk"]
                            if (e["layer"], e["head"]) == tuple(other[:2]))
            items.nth(link["heads"].index(other)).click()
            assert page.locator("#qk .qk-other").count() == 1
            assert (page.get_attribute("#qk", "data-query-pos"),
                    page.get_attribute("#qk", "data-key-pos")) == (
                str(fallback["query_pos"]), str(fallback["key_pos"]))
            assert f"score {_fmt(page, fallback['score'])}" in page.inner_text("#qk .qk-score")

            # a node the link does not touch: the panel closes
            unrelated = next(n["node_id"] for n in payload["nodes"]
                             if n["feature_type"] == "embedding"
                             and n["node_id"] != link["source"])
            _click(page, unrelated)
            assert page.locator("#heads-panel").is_hidden()

            # hostile: markup in a label stays text; a head without QK terms says so; an entry
            # that is not [layer, head, part] is left out
            page.select_option("#picker", "hostile/graph.json")
            page.wait_for_function(LOADED)
            _click(page, link["target"])
            _item(page, link).click()
            assert page.locator("#heads li").count() == len(link["heads"]) + 1
            page.locator("#heads li").nth(0).click()
            assert HOSTILE in page.inner_text("#qk .qk-pairs li >> nth=0")
            assert page.locator("#qk img").count() == 0
            assert page.evaluate("() => window.pwned") is None
            page.locator("#heads li").nth(len(link["heads"])).click()
            assert page.locator("#qk .qk-missing").count() == 1
            assert "L0 H99" in page.inner_text("#qk")

            # control: the same graph without heads marks no link and shows no Heads panel
            page.select_option("#picker", "plain/graph.json")
            page.wait_for_function(LOADED)
            _click(page, link["target"])
            assert _item(page, link).count() == 1
            assert page.locator("#inputs li.has-heads, #outputs li.has-heads").count() == 0
            _item(page, link).click()
            assert page.locator("#heads-panel").is_hidden()
            assert page.locator("#heads li").count() == 0
        finally:
            browser.close()
    assert not errors, errors


@pytest.mark.browser
def test_the_graph_picked_last_is_shown_when_an_earlier_load_ends_after_it(graphs):
    """The page opens on its first graph; a graph picked while that one still loads is the one
    shown, even when the first one's answer arrives after it (held back here)."""
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    held = []

    def hold_the_first(route):
        if not held:
            held.append(route)  # answered below, after the picked graph's
        else:
            route.continue_()

    with running(graphs) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.route("**/api/graph?*", hold_the_first)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("() => document.querySelectorAll('#picker option').length > 2")
            first = page.eval_on_selector("#picker", "p => p.options[0].value")
            other = next(n for n in ("plain/graph.json", "heads/graph.json") if n != first)
            page.select_option("#picker", other)
            page.wait_for_function(f"() => state.name === '{other}'")
            held[0].continue_()
            page.wait_for_timeout(500)  # its answer arrives and is dropped
            assert page.evaluate("state.name") == other
            assert page.eval_on_selector("#picker", "p => p.value") == other
            assert not errors
        finally:
            browser.close()
