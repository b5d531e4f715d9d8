"""The viewer lists, opens and annotates any attribution-graph JSON that Neuronpedia's graph schema
validates — a graph circuit-tracer wrote (built here in its exact format, from its source:
``circuit_tracer/frontend/graph_models.py`` and ``utils/create_graph_files.py``; circuit-tracer
is not imported) and a minimal Neuronpedia-schema file — beside one ``attribute`` wrote; it
marks which graphs are ours; it still refuses invalid JSON and schema-invalid files, with the
reason in its log; a save into a foreign graph is written, keeps the rest of the file, and
round-trips; a node id that names two nodes (circuit-tracer's error ids collide with layer-0
features) is not annotated. The schema is checked once per node while the file is parsed, so a
large graph is checked in little more memory than its text."""

from __future__ import annotations

import copy
import http.client
import json
import logging
import shutil
import threading
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_viewer import _chromium

from pyvene_causaltrace import attribute, graph_schema
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.viewer import GraphIndex, annotations, listing, make_server

STEP_S = 30
N_LAYERS = 4
TOKENS = [(2, "<bos>"), (651, "The"), (96157, " Eiffel"), (22643, " Tower"), (603, " is")]
CT = "ct/paris.json"  # circuit-tracer's <slug>.json
NP = "np/minimal.json"
OURS = "ours/graph.json"


# --- circuit-tracer's exact output (graph_models.Node / Metadata / QParams / Model) -----------

def _ct_node(node_id, feature, layer, pos, kind, js_id, *, clerp="", influence=None,
             activation=None, token_prob=0.0, target=False) -> dict:
    """A ``Node`` as pydantic dumps it: every field, in its declared order."""
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": pos,
            "feature_type": kind, "token_prob": token_prob, "is_target_logit": target,
            "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js_id, "clerp": clerp,
            "influence": influence, "activation": activation}


def _ct_feature(layer, pos, feat_idx, influence, activation) -> dict:  # Node.feature_node
    cantor = (layer + feat_idx) * (layer + feat_idx + 1) // 2 + feat_idx
    return _ct_node(f"{layer}_{feat_idx}_{pos}", cantor, str(layer), pos,
                    "cross layer transcoder", f"{layer}_{feat_idx}-0", influence=influence,
                    activation=activation)


def _ct_error(layer, pos, influence) -> dict:  # Node.error_node: its id is 0_{layer}_{pos}
    return _ct_node(f"0_{layer}_{pos}", -1, str(layer), pos, "mlp reconstruction error",
                    f"{layer}_{pos}-0", influence=influence)


def _ct_token(pos, vocab_idx, influence) -> dict:  # Node.token_node
    return _ct_node(f"E_{vocab_idx}_{pos}", pos, "E", pos, "embedding", f"E_{vocab_idx}-{pos}",
                    influence=influence)


def _ct_logit(pos, vocab_idx, token, prob, target) -> dict:  # Node.logit_node (no influence)
    layer = str(N_LAYERS + 1)
    return _ct_node(f"{layer}_{vocab_idx}_{pos}", vocab_idx, layer, pos, "logit",
                    f"L_{vocab_idx}-{pos}", clerp=f'Output "{token}" (p={prob:.3f})',
                    token_prob=prob, target=target)


def circuit_tracer_graph() -> dict:
    """What ``create_graph_files(graph, slug="paris", output_path, scan="gemma-2-2b")`` writes
    (``model.model_dump_json(indent=2)``): ``build_model``'s metadata (no ``info``: no
    generator), its empty qParams, the used nodes — features, errors, tokens and logits, with
    feature 2 of layer 0 at position 4 and the error of layer 2 at position 4 both ``0_2_4``,
    as circuit-tracer's ids make them — and the links between them."""
    last = len(TOKENS) - 1
    nodes = [_ct_feature(0, 4, 2, 0.31, 1.5), _ct_feature(1, 3, 17, 0.12, 4.25),
             _ct_feature(2, 4, 5, 0.44, 0.75), _ct_feature(3, 4, 9, 0.05, 2.0),
             _ct_error(2, 4, 0.52), _ct_error(3, 4, 0.61),
             *[_ct_token(pos, vocab, 0.2 + 0.1 * pos) for pos, (vocab, _) in enumerate(TOKENS)],
             _ct_logit(last, 6081, " Paris", 0.8125, True),
             _ct_logit(last, 573, " the", 0.0625, False)]
    edges = [("E_96157_2", "1_17_3", 3.5), ("E_22643_3", "1_17_3", 1.25),
             ("1_17_3", "3_9_4", 2.0), ("0_2_4", "2_5_4", -0.5), ("E_603_4", "0_2_4", 0.75),
             ("2_5_4", "3_9_4", 1.0), ("3_9_4", "5_6081_4", 4.5), ("0_3_4", "5_6081_4", 0.25),
             ("3_9_4", "5_573_4", -1.5), ("E_2_0", "3_9_4", 0.125)]
    links = [{"source": s, "target": t, "weight": w} for s, t, w in edges]
    metadata = {"slug": "paris", "scan": "gemma-2-2b", "transcoder_list": [],
                "prompt_tokens": [text for _, text in TOKENS],
                "prompt": "".join(text for _, text in TOKENS[1:]), "node_threshold": 0.8,
                "schema_version": 1}
    q_params = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                "sg_pos": ""}
    return {"metadata": metadata, "qParams": q_params, "nodes": nodes, "links": links}


def write_circuit_tracer(directory: Path, graph: dict) -> Path:
    """Write ``graph`` as circuit-tracer does: ``<slug>.json`` (pydantic's ``indent=2``, UTF-8
    as it is) and the ``graph-metadata.json`` index beside it (``add_graph_metadata``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{graph['metadata']['slug']}.json"
    path.write_text(json.dumps(graph, indent=2, ensure_ascii=False), encoding="utf-8")
    (directory / "graph-metadata.json").write_text(
        json.dumps({"graphs": [graph["metadata"]]}, indent=2))
    return path


def minimal_neuronpedia_graph() -> dict:
    """Only what Neuronpedia's schema requires: no generator, no influence or activation, an
    integer layer, a null feature, an attention (``lorsa``) feature."""
    nodes = [{"node_id": "E_10_0", "feature": None, "layer": "E", "ctx_idx": 0,
              "feature_type": "embedding", "jsNodeId": "E_10-0", "clerp": ""},
             {"node_id": "1_7_0", "feature": 7, "layer": 1, "ctx_idx": 0,
              "feature_type": "lorsa", "jsNodeId": "1_7-0", "clerp": "attends to the subject"},
             {"node_id": "3_42_0", "feature": 42, "layer": "3", "ctx_idx": 0,
              "feature_type": "logit", "jsNodeId": "L_42-0", "clerp": 'Output "x" (p=0.900)'}]
    links = [{"source": "E_10_0", "target": "1_7_0", "weight": 1},
             {"source": "1_7_0", "target": "3_42_0", "weight": -0.5}]
    return {"metadata": {"slug": "tiny", "scan": "gpt2-small", "prompt_tokens": ["Hi"],
                         "prompt": "Hi"},
            "qParams": {}, "nodes": nodes, "links": links}


# --- a directory with all three, and files to refuse ------------------------------------------

@pytest.fixture(scope="module")
def ours(tmp_path_factory, tokenizer) -> Path:
    """A graph.json that ``attribute`` wrote (a tiny model, a random CLT)."""
    root = tmp_path_factory.mktemp("ours")
    model = make_tiny_model("llama", init=0.2)
    clt = load_transcoder(str(write_clt(root / "clt", random_clt_tensors(3, 32, 16))))
    attribute(model, tokenizer, clt, PROMPT, max_n_logits=1).to_json(root / "graph.json")
    return root / "graph.json"


def _without(graph: dict, where: str, key: str) -> dict:
    graph = copy.deepcopy(graph)
    target = graph["metadata"] if where == "metadata" else graph[where][3 if where == "nodes"
                                                                        else 0]
    del target[key]
    return graph


#: Files the listing refuses, and the reason its log gives.
REFUSED = {
    "broken.json": ('{"metadata": {}, "nodes": [], "links": [', "not valid JSON"),
    "ct/graph-metadata.json": (None, "not a graph JSON (no nodes and links)"),
    "no_slug.json": (_without(circuit_tracer_graph(), "metadata", "slug"),
                     "metadata: 'slug' is a required property"),
    "no_js_id.json": (_without(circuit_tracer_graph(), "nodes", "jsNodeId"),
                      "nodes[3]: 'jsNodeId' is a required property"),
    "bad_weight.json": ({**circuit_tracer_graph(), "links": [
        {"source": "E_2_0", "target": "3_9_4", "weight": "0.5"}]},
        "links[0]: weight: not of type number"),
    "no_qparams.json": ({k: v for k, v in circuit_tracer_graph().items() if k != "qParams"},
                        "'qParams' is a required property"),
    "pinned_number.json": ({**circuit_tracer_graph(), "qParams": {"pinnedIds": 5}},
                           "qParams.pinnedIds: 5 is not of type 'array'"),
}


@pytest.fixture
def served(tmp_path, ours) -> Path:
    root = tmp_path / "served"
    (root / "ours").mkdir(parents=True)
    shutil.copy(ours, root / OURS)
    write_circuit_tracer(root / "ct", circuit_tracer_graph())
    (root / "np").mkdir()
    (root / NP).write_text(json.dumps(minimal_neuronpedia_graph()))
    for name, (content, _) in REFUSED.items():
        if content is not None:
            (root / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return root


@contextmanager
def running(directory: Path, **kwargs):
    server = make_server(directory, port=0, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def request(port: int, method: str, path: str, body: bytes | None = None,
            **headers: str) -> tuple[int, bytes, str | None]:
    """``(status, body, ETag)`` of one request to the viewer on ``port``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
    try:
        if body is not None:
            headers = {"Content-Type": "application/json", **headers}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("ETag")
    finally:
        connection.close()


def save(port: int, name: str, version: str, pinned: list, supernodes: list | None = None,
         clerps: list | None = None, **more) -> tuple[int, dict, str | None]:
    body = json.dumps({"qParams": {"pinnedIds": pinned, "supernodes": supernodes or [], **more},
                       "clerps": clerps or []}).encode()
    status, reply, tag = request(port, "POST", f"/api/save?name={name}", body,
                                 **{"If-Match": version})
    return status, json.loads(reply), tag


# --- the listing ------------------------------------------------------------------------------

def test_the_listing_shows_foreign_graphs_marks_ours_and_refuses_the_invalid(served, caplog):
    caplog.set_level(logging.INFO, logger="pyvene_causaltrace.viewer")
    with running(served) as port:
        status, body, _ = request(port, "GET", "/api/listing")
        assert status == 200
        assert json.loads(body) == [
            {"name": CT, "generator": None, "ours": False},
            {"name": NP, "generator": None, "ours": False},
            {"name": OURS, "generator": listing.GENERATOR, "ours": True}]
        assert json.loads(request(port, "GET", "/api/graphs")[1]) == [CT, NP, OURS]
        for name in (CT, NP):
            status, body, tag = request(port, "GET", f"/api/graph?name={name}")
            assert status == 200 and body == (served / name).read_bytes() and tag
        for name in REFUSED:
            assert request(port, "GET", f"/api/graph?name={name}")[0] == 404, name
    for name, (_, reason) in REFUSED.items():
        said = [r for r in caplog.records if f"{served / name}:" in r.getMessage()]
        assert len(said) == 1 and reason in said[0].getMessage(), (name, said)
        # a graph the schema refuses is a warning; other JSON only information
        assert said[0].levelno == (logging.INFO if "no nodes and links" in reason
                                   else logging.WARNING), name


def test_circuit_tracers_own_saved_strings_are_listed():
    """circuit-tracer's Save writes its URL's strings (pinnedIds comma-joined, supernodes a
    JSON string): listed, as the page reads them; other types are not."""
    graph = circuit_tracer_graph()
    graph["qParams"] = {"pinnedIds": "1_17_3,3_9_4", "supernodes": '[["g","1_17_3","3_9_4"]]',
                        "linkType": "both", "clickedId": "", "sg_pos": "",
                        "pruningThreshold": "0.8", "clerps": "[]"}
    assert listing.examine(json.dumps(graph).encode()) == (None, None)
    graph["qParams"]["linkType"] = ["both"]
    assert "qParams.linkType" in listing.examine(json.dumps(graph).encode()).problem


def test_the_schema_is_written_once_and_the_item_checks_agree_with_it():
    assert graph_schema.SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert graph_schema.SCHEMA["title"] == "Anthropic Attribution Graph"
    graph_schema.validate(circuit_tracer_graph())
    graph_schema.validate(minimal_neuronpedia_graph())
    node = circuit_tracer_graph()["nodes"][0]
    link = circuit_tracer_graph()["links"][0]
    variants = [(node, graph_schema.NODE, "nodes"), (link, graph_schema.LINK, "links")]
    values = [None, True, 3, 3.0, 3.5, "3", [], {}]
    for item, check, key in variants:
        schema = jsonschema.Draft7Validator(graph_schema.SCHEMA["properties"][key]["items"])
        cases = [item, [], "x"] + [{k: v for k, v in item.items() if k != field}
                                   for field in item]
        cases += [{**item, field: value} for field in item for value in values]
        for case in cases:
            assert (check.problem(case) is None) == schema.is_valid(case), case


def test_a_large_foreign_graph_is_checked_in_little_more_than_its_text(tmp_path, monkeypatch):
    """100k links (about 6 MB): parsed whole, they take several times the text; checked link
    by link as they are parsed, little more than it (the nesting-depth scan, in chunks of a
    bounded size, left out of the count). Over the size cap: never read."""
    graph = circuit_tracer_graph()
    ids = [n["node_id"] for n in graph["nodes"]]
    graph["links"] = [{"source": ids[i % 11], "target": ids[(i * 7 + 3) % 11],
                       "weight": i * 1e-3} for i in range(100_000)]
    data = json.dumps(graph, separators=(",", ":")).encode()
    assert listing.examine(data) == (None, None)
    monkeypatch.setattr(listing, "nesting_depth", lambda data, limit: 5)
    tracemalloc.start()
    try:
        json.loads(data)
        whole = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert listing.examine(data) == (None, None)
        checked = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert whole > 4 * len(data) and checked < 2.5 * len(data), (whole, checked, len(data))
    monkeypatch.undo()
    broken = copy.deepcopy(graph)
    broken["links"][99_999]["weight"] = None  # the last link: every one is checked
    assert "links[99999]: weight: not of type number" in listing.examine(
        json.dumps(broken).encode()).problem
    (tmp_path / "big.json").write_bytes(data)
    assert GraphIndex(tmp_path, max_bytes=len(data)).names() == ["big.json"]
    assert GraphIndex(tmp_path, max_bytes=len(data) - 1).names() == []


# --- saving into a foreign graph --------------------------------------------------------------

def test_a_save_into_a_circuit_tracer_graph_round_trips(served):
    original = json.loads((served / CT).read_text())
    with running(served) as port:
        version = request(port, "GET", f"/api/graph?name={CT}")[2]
        status, reply, version = save(port, CT, version, ["1_17_3", "3_9_4", "E_96157_2"],
                                      [["Eiffel", "1_17_3", "3_9_4"]],
                                      [["3_9_4", "says Paris"]], clickedId="0_2_4",
                                      pruningThreshold=0.6)
        assert status == 200, reply
        assert reply == {"saved": CT, "pinned": 3, "supernodes": 1, "labels": 1}
        saved = json.loads((served / CT).read_text())
        expected = copy.deepcopy(original)
        expected["qParams"].update(pinnedIds=["1_17_3", "3_9_4", "E_96157_2"],
                                   supernodes=[["Eiffel", "1_17_3", "3_9_4"]],
                                   clickedId="0_2_4", pruningThreshold=0.6)
        next(n for n in expected["nodes"] if n["node_id"] == "3_9_4")["clerp"] = "says Paris"
        assert saved == expected  # everything else as circuit-tracer wrote it; no generator
        status, body, tag = request(port, "GET", f"/api/graph?name={CT}")
        assert status == 200 and json.loads(body) == expected and tag == version
        listed = json.loads(request(port, "GET", "/api/listing")[1])
        assert {"name": CT, "generator": None, "ours": False} in listed
        # again, from the version just saved: unpin one, relabel
        status, reply, version = save(port, CT, version, ["1_17_3", "3_9_4"],
                                      [["Eiffel", "1_17_3", "3_9_4"]],
                                      [["3_9_4", "Paris"]])
        assert status == 200, reply
        again = json.loads((served / CT).read_text())
        assert again["qParams"]["pinnedIds"] == ["1_17_3", "3_9_4"]
        assert [n["clerp"] for n in again["nodes"] if n["node_id"] == "3_9_4"] == ["Paris"]
        graph_schema.validate(again)
        # the minimal Neuronpedia file: an attention feature's label can be edited
        version = request(port, "GET", f"/api/graph?name={NP}")[2]
        status, reply, _ = save(port, NP, version, ["1_7_0"], clerps=[["1_7_0", "subject"]])
        assert status == 200, reply
        assert json.loads((served / NP).read_text())["nodes"][1]["clerp"] == "subject"


def test_an_id_naming_two_nodes_is_not_annotated(served):
    """circuit-tracer's error 0_2_4 (layer 2, position 4) is also feature 2 of layer 0 at
    position 4: pinning or labelling it would annotate whichever node a viewer finds first."""
    before = (served / CT).read_bytes()
    with running(served) as port:
        version = request(port, "GET", f"/api/graph?name={CT}")[2]
        for pinned, supernodes, clerps in ((["0_2_4"], [], []),
                                           (["1_17_3", "0_2_4"], [["g", "1_17_3", "0_2_4"]], []),
                                           ([], [], [["0_2_4", "a label"]])):
            status, reply, _ = save(port, CT, version, pinned, supernodes, clerps)
            assert status == 400 and "0_2_4 names more than one node" in reply["error"], reply
        status, reply, _ = save(port, CT, version, [], clerps=[["0_3_4", "x"]])
        assert status == 400 and "mlp reconstruction error node" in reply["error"]
    assert (served / CT).read_bytes() == before
    assert "lorsa" in annotations.EDITABLE
    page = (Path(annotations.__file__).with_name("annotate.js")).read_text()
    assert f"new Set({json.dumps(list(annotations.EDITABLE))})" in page


def _current_ids(graph: dict) -> dict:
    """``graph`` as circuit-tracer writes it since its PRs #100/#102 (and as ``attribute``
    exports): error ids ``{layer}_-1_{pos}``; a link naming a 0.5.0 error id that no feature
    shares is renamed with it."""
    graph = copy.deepcopy(graph)
    counts: dict = {}
    for node in graph["nodes"]:
        counts[node["node_id"]] = counts.get(node["node_id"], 0) + 1
    renamed = {}
    for node in graph["nodes"]:
        if node["feature_type"] == "mlp reconstruction error":
            new = f"{node['layer']}_-1_{node['ctx_idx']}"
            if counts[node["node_id"]] == 1:
                renamed[node["node_id"]] = new
            node["node_id"] = new
    for link in graph["links"]:
        link["source"] = renamed.get(link["source"], link["source"])
        link["target"] = renamed.get(link["target"], link["target"])
    return graph


def test_every_circuit_tracer_error_id_convention_reads_the_same():
    """A 0.5.0 file (error ids ``0_{layer}_{pos}``, one equal to a layer-0 feature's) and the
    same graph with today's ids (``{layer}_-1_{pos}``) both pass ``check_graph_json``, which
    tells nodes apart by ``feature_type``; two nodes of one kind under one id, or a link to no
    node, are still refused."""
    old = circuit_tracer_graph()
    ids = [n["node_id"] for n in old["nodes"]]
    assert ids.count("0_2_4") == 2  # the collision: feature 2 of layer 0, the error of layer 2
    check_graph_json(old)
    new = _current_ids(old)
    check_graph_json(new)
    errors = [n for n in new["nodes"] if n["feature_type"] == "mlp reconstruction error"]
    assert {n["node_id"] for n in errors} == {"2_-1_4", "3_-1_4"}
    assert len({n["node_id"] for n in new["nodes"]}) == len(new["nodes"])
    twice = copy.deepcopy(old)
    twice["nodes"].append(copy.deepcopy(twice["nodes"][1]))  # a second feature 1_17_3
    with pytest.raises(InputError, match="two cross layer transcoder nodes share the id 1_17_3"):
        check_graph_json(twice)
    dangling = copy.deepcopy(new)
    dangling["links"].append({"source": "0_3_4", "target": "5_6081_4", "weight": 1.0})
    with pytest.raises(InputError, match="0_3_4 -> 5_6081_4 names a missing node"):
        check_graph_json(dangling)  # today's ids: 0_3_4 is no node (the error is 3_-1_4)


def test_our_export_names_errors_by_layer_and_never_repeats_an_id(ours):
    """``attribute``'s export writes ``{layer}_-1_{pos}`` for every error node: ids are unique."""
    payload = json.loads(ours.read_text())
    check_graph_json(payload)
    ids = [n["node_id"] for n in payload["nodes"]]
    assert len(set(ids)) == len(ids)
    errors = [n for n in payload["nodes"] if n["feature_type"] == "mlp reconstruction error"]
    assert errors, "the fixture's graph keeps some error nodes"
    assert all(n["node_id"] == f"{n['layer']}_-1_{n['ctx_idx']}" for n in errors)


# --- the page ---------------------------------------------------------------------------------



@pytest.mark.browser
def test_the_page_opens_a_circuit_tracer_graph_and_marks_it_not_ours(served):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    for name in REFUSED:
        (served / name).unlink(missing_ok=True)
    ct, minimal = circuit_tracer_graph(), minimal_neuronpedia_graph()
    ours = json.loads((served / OURS).read_text())
    errors: list[str] = []
    with running(served) as port, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, timeout=STEP_S * 1000,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(STEP_S * 1000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#svg .node")  # ct/paris.json: first in the picker
            assert page.locator("#picker option").all_inner_texts() == [
                f"{CT} [no generator named]", f"{NP} [no generator named]", OURS]
            assert page.locator("#picker").input_value() == CT
            origin = page.locator("#origin")
            assert origin.get_attribute("data-ours") == "false"
            assert "not written by pyvene-causaltrace" in origin.inner_text()
            assert page.locator("#svg .node").count() == len(ct["nodes"])
            drawn = page.eval_on_selector_all(
                "#svg .node", "c => c.map(n => [n.dataset.id, +n.getAttribute('cx'), "
                "+n.getAttribute('cy')])")
            # 0_2_4 names two nodes (0.5.0's error ids): each drawn in its own layer's row
            shared = {key: (x, y) for key, x, y in drawn if key.startswith("0_2_4 ")}
            assert sorted(shared) == ["0_2_4 (cross layer transcoder)",
                                      "0_2_4 (mlp reconstruction error)"]
            assert len(set(shared.values())) == 2
            assert {key for key, _, _ in drawn} - set(shared) \
                == {n["node_id"] for n in ct["nodes"]} - {"0_2_4"}
            # the two links naming 0_2_4 cannot say which node they mean: not drawn, and said
            naming = [link for link in ct["links"] if "0_2_4" in (link["source"],
                                                                   link["target"])]
            assert len(naming) == 2
            assert page.locator("#svg .link").count() == len(ct["links"]) - len(naming)
            assert page.locator("#count").get_attribute("data-unresolved-links") == "2"
            assert "2 links not drawn" in page.locator("#count").inner_text()
            assert page.locator(".logit-label.target").text_content().startswith('" Paris"')
            page.locator('#svg .node[data-id="1_17_3"]').dispatch_event("click")
            assert page.locator("#inputs li").count() == 2
            assert not page.locator("#pin-toggle").is_hidden()
            page.locator('#svg .node[data-id="0_2_4 (mlp reconstruction error)"]') \
                .dispatch_event("click")
            assert page.locator("#pin-toggle").is_hidden()  # two nodes: not annotatable
            assert "its links are not drawn" in page.locator("#details").inner_text()
            page.select_option("#picker", NP)  # no influence at all: every node drawn
            page.wait_for_function("n => document.querySelectorAll('#svg .node').length === n",
                                   arg=len(minimal["nodes"]))
            assert origin.get_attribute("data-ours") == "false"
            page.select_option("#picker", OURS)
            page.wait_for_function(
                "() => document.querySelector('#origin').dataset.ours === 'true'")
            assert page.locator("#svg .node").count() == len(ours["nodes"])
            assert origin.inner_text() == "written by pyvene-causaltrace"
        finally:
            browser.close()
    assert not errors, errors
