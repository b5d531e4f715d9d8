"""The graph viewer in a real browser: headless Chromium driven by Playwright. The page loads the
graphs the server lists, draws as many nodes as the exported (pruned) graph has, lists a clicked
node's strongest edges, prunes further with the slider, and logs no console error."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace import attribute
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.viewer import find_graphs, make_server


def _kept(nodes: list[dict], threshold: float) -> int:
    """How many nodes the page shows at a node threshold: tokens, the logit, and the rest while
    their cumulative influence is within it."""
    return sum(n["feature_type"] in ("embedding", "logit") or n["influence"] is None
               or n["influence"] <= threshold + 1e-9 for n in nodes)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("needs Chromium (Debian: apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("needs Playwright for Python (pip install playwright)")
    return path


@pytest.fixture(scope="module")
def graphs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("graphs")
    model = make_tiny_model("llama", init=0.2)
    clt = load_transcoder(str(write_clt(root / "clt", random_clt_tensors(3, 32, 16))))
    for name, prompt in (("eiffel", PROMPT), ("space", "The Space Needle is in the city of")):
        graph = attribute(model, tokenizer, clt, prompt)
        (root / name).mkdir()
        graph.to_json(root / name / "graph.json")
    shutil.rmtree(root / "clt")
    return root


def test_the_server_lists_and_serves_only_graphs(graphs):
    (graphs / "notes.json").write_text("[1, 2]")
    assert find_graphs(graphs) == ["eiffel/graph.json", "space/graph.json"]


@pytest.mark.browser
def test_the_page_in_headless_chromium(graphs):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    payload = json.loads((graphs / "eiffel" / "graph.json").read_text())
    server = make_server(graphs, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_selector(".node")
            assert page.locator("#picker option").all_inner_texts() == [
                "eiffel/graph.json", "space/graph.json"]
            assert page.locator(".node").count() == len(payload["nodes"])
            # click a feature with inputs: its strongest inputs are listed, largest first
            targets = {link["target"] for link in payload["links"]}
            feature = next(n["node_id"] for n in payload["nodes"]
                           if n["feature_type"] == "cross layer transcoder"
                           and n["node_id"] in targets)
            page.locator(f'.node[data-id="{feature}"]').click()
            incoming = sorted((abs(link["weight"]) for link in payload["links"]
                               if link["target"] == feature), reverse=True)
            assert page.locator("#inputs li").count() == min(8, len(incoming)) > 0
            assert page.locator(".node.selected").count() == 1
            # the slider prunes: fewer features at a lower cumulative-influence threshold
            page.locator("#threshold").fill("0.3")
            assert page.locator(".node").count() == _kept(payload["nodes"], 0.3) < len(
                payload["nodes"])
            other = json.loads((graphs / "space" / "graph.json").read_text())
            page.select_option("#picker", "space/graph.json")
            page.wait_for_function("n => document.querySelectorAll('.node').length === n",
                                   arg=_kept(other["nodes"], 0.3))
            browser.close()
    finally:
        server.shutdown()
    assert not errors, errors


def test_a_graph_laid_out_for_circuit_tracers_local_server(graphs, tmp_path):
    """circuit-tracer's server (frontend/local_server.py) serves DIR/<slug>.json and its page
    reads DIR/graph-metadata.json ({"graphs": [{slug, scan, prompt, ...}]}); a second graph
    joins the index, the same slug replaces its entry."""
    from pyvene_causaltrace.attribution.export import write_circuit_tracer_dir

    payload = json.loads((graphs / "eiffel" / "graph.json").read_text())
    path = write_circuit_tracer_dir(payload, tmp_path / "ct")
    other = {**payload, "metadata": {**payload["metadata"], "slug": "second"}}
    write_circuit_tracer_dir(other, tmp_path / "ct")
    write_circuit_tracer_dir(payload, tmp_path / "ct")
    index = json.loads((tmp_path / "ct" / "graph-metadata.json").read_text())
    assert path.name == f"{payload['metadata']['slug']}.json"
    assert sorted(g["slug"] for g in index["graphs"]) == sorted(
        [payload["metadata"]["slug"], "second"])
    assert json.loads(path.read_text()) == payload
    assert all(isinstance(n["feature"], int) for n in payload["nodes"])  # its page needs them
