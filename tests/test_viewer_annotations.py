"""Annotations in the viewer: pin nodes, group them into named supernodes, edit labels, save them
into the graph file and find them again on reload — in headless Chromium — and what the file then
holds, in the fields circuit-tracer's and Neuronpedia's viewers read (``qParams.pinnedIds`` a
list of node ids, ``qParams.supernodes`` lists ``[name, id, ...]``, labels in the nodes'
``clerp``). The save endpoint over plain HTTP: it refuses, with a 4xx and one JSON line, a foreign
``Host`` or ``Origin``, a non-JSON content type, a missing or oversize body, a graph it does not
list, and malformed annotations — and leaves the file as it was. A saved graph is still listed,
and served anew. A graph with three logit nodes draws three labelled logits, none overlapping.
Every browser step runs under a time limit."""

from __future__ import annotations

import copy
import errno
import http.client
import json
import os
import shutil
import socket
import stat

import pytest
from test_viewer import _chromium
from test_viewer_server import STEP_S, get, graph_file, listed, running  # noqa: F401

from pyvene_causaltrace.viewer import GraphIndex, annotations
from pyvene_causaltrace.viewer.annotations import AnnotationError, save

FEATURE = "cross layer transcoder"
NAME = "eiffel/graph.json"


def post(port: int, path: str, body: bytes | None, host: str = "", *,
         kind: str | None = "application/json", length: int | None = None,
         **headers: str) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` (``host`` "": this server's own address; ``length``: the
    Content-Length claimed, None for the body's own, -1 for none). Extra headers by keyword,
    ``_`` for ``-`` (``Sec_Fetch_Site``)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
    try:
        connection.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", host or f"127.0.0.1:{port}")
        if kind is not None:
            connection.putheader("Content-Type", kind)
        if length != -1:
            connection.putheader("Content-Length", str(len(body or b"") if length is None
                                                        else length))
        for key, value in headers.items():
            connection.putheader(key.replace("_", "-"), value)
        connection.endheaders()
        if body and length is None:
            connection.send(body)
        response = connection.getresponse()
        post.etag = response.getheader("ETag")  # the last answer's
        return response.status, response.read()
    finally:
        connection.close()


def etag(port: int, name: str) -> str:
    """The version (``ETag``) the server gives graph ``name`` with its bytes."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
    try:
        connection.request("GET", f"/api/graph?name={name}")
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        return response.getheader("ETag")
    finally:
        connection.close()


def _ids(payload: dict) -> tuple[str, str, str]:
    """Two features joined by a link (else any two) and the logit."""
    kinds = {n["node_id"]: n["feature_type"] for n in payload["nodes"]}
    joined = [(link["source"], link["target"]) for link in payload["links"]
              if kinds[link["source"]] == kinds[link["target"]] == FEATURE]
    features = [i for i, kind in kinds.items() if kind == FEATURE]
    a, b = joined[0] if joined else features[:2]
    logit = next(i for i, kind in kinds.items() if kind == "logit")
    return a, b, logit


def _body(**qparams) -> bytes:
    clerps = qparams.pop("clerps", [])
    return json.dumps({"qParams": qparams, "clerps": clerps}).encode()


@pytest.fixture
def served(tmp_path, graph_file):  # noqa: F811 - the fixture imported above
    """A directory with one graph (``eiffel/graph.json``) beside a secret and a graph outside."""
    root = tmp_path / "served"
    (root / "eiffel").mkdir(parents=True)
    shutil.copy(graph_file, root / NAME)
    (root / "secrets.json").write_text(json.dumps({"nodes": [], "links": []}))
    (tmp_path / "outside").mkdir()
    shutil.copy(graph_file, tmp_path / "outside" / "graph.json")
    return root


def test_a_save_writes_neuronpedias_fields_and_the_graph_stays_listed(served):
    payload = json.loads((served / NAME).read_text())
    payload["qParams"]["hiddenIds"] = ["kept-as-it-was"]  # a field of another viewer
    (served / NAME).write_text(json.dumps(payload))
    a, b, logit = _ids(payload)
    with running(served) as port:
        loaded = etag(port, NAME)
        status, reply = post(port, f"/api/save?name={NAME}", _body(
            pinnedIds=[a, b, logit], supernodes=[["capital", a, b]], clickedId=a,
            linkType="both", sg_pos="", pruningThreshold=0.5, clerps=[[a, "says Paris ✓"]]),
            If_Match=loaded)
        assert status == 200, reply
        assert json.loads(reply) == {"saved": NAME, "pinned": 3, "supernodes": 1, "labels": 1}
        saved = json.loads((served / NAME).read_text())
        assert listed(port) == [NAME]
        status, body = get(port, f"/api/graph?name={NAME}")  # the new file, not a cached one
        assert status == 200 and json.loads(body) == saved
        assert post.etag == etag(port, NAME) != loaded
        # a page that loaded the graph before this save may not save over it
        status, reply = post(port, f"/api/save?name={NAME}", _body(pinnedIds=[], supernodes=[]),
                             If_Match=loaded)
        assert status == 412 and b"changed on disk since the page loaded it" in reply
        assert json.loads((served / NAME).read_text()) == saved
    assert saved["qParams"] == {"pinnedIds": [a, b, logit], "supernodes": [["capital", a, b]],
                                "linkType": "both", "clickedId": a, "sg_pos": "",
                                "pruningThreshold": 0.5, "hiddenIds": ["kept-as-it-was"]}
    labels = {n["node_id"]: n["clerp"] for n in saved["nodes"]}
    assert labels[a] == "says Paris ✓"
    assert {k: v for k, v in labels.items() if k != a} == {
        n["node_id"]: n["clerp"] for n in payload["nodes"] if n["node_id"] != a}
    assert saved["links"] == payload["links"] and saved["metadata"] == payload["metadata"]


def _refusals(a: str, b: str, logit: str) -> list[tuple[bytes, str]]:
    """Malformed save bodies and a word of the reason each is refused with (400)."""
    ok = {"pinnedIds": [a, b], "supernodes": []}
    return [
        (b"not json", "not JSON"), (b"\xff\xfe", "not UTF-8"), (b"[1, 2]", "JSON object"),
        (b"[" * 50_000 + b"]" * 50_000, "nests too deeply"),
        (json.dumps({"qParams": ok, "extra": 1}).encode(), "unknown key 'extra'"),
        (json.dumps({"qParams": [1]}).encode(), "JSON object"),
        (_body(**ok, hiddenIds=[]), "qParams.hiddenIds: not a field"),
        (_body(supernodes=[]), "pinnedIds is missing"),
        (_body(pinnedIds=f"{a},{b}", supernodes=[]), "a list expected"),
        (_body(pinnedIds=[a, "99_99_99"], supernodes=[]), '"99_99_99" is not a node'),
        (_body(pinnedIds=[a, a], supernodes=[]), "pinned twice"),
        (_body(pinnedIds=[a, 3], supernodes=[]), "3 is not a node"),
        (_body(pinnedIds=[a, b], supernodes=[["g", a, "nope"]]), '"nope" is not a node'),
        (_body(pinnedIds=[a], supernodes=[["g", a, b]]), "is not pinned"),
        (_body(pinnedIds=[a, b], supernodes=[["g", a], ["h", a, b]]), "already in supernode"),
        (_body(pinnedIds=[a, b], supernodes=[["g"]]), "one member at least"),
        (_body(pinnedIds=[a, b], supernodes=[[" ", a]]), "empty"),
        (_body(pinnedIds=[a, b], supernodes=[["x" * 201, a]]), "201 characters"),
        (_body(pinnedIds=[a, b], supernodes="[]"), "a list expected"),
        (_body(**ok, clickedId="nope"), "qParams.clickedId"),
        (_body(**ok, linkType="sideways"), "not one of input, output, either, both"),
        (_body(**ok, sg_pos="1 2; rm"), "space-separated numbers"),
        (_body(**ok, pruningThreshold=2), "from 0 to 1"),
        (_body(**ok, pruningThreshold=True), "from 0 to 1"),
        (json.dumps({"qParams": {**ok, "pruningThreshold": float("nan")}}).encode(),
         "NaN is not a finite number"),
        (_body(**ok, clerps=[[logit, "renamed"]]), "only feature labels"),
        (_body(**ok, clerps=[[a]]), "[node_id, text] expected"),
        (_body(**ok, clerps=[[a, "x"], [a, "y"]]), "labelled twice"),
        (_body(**ok, clerps=[[a, 5]]), "text expected"),
        (_body(**ok, clerps=[[a, "x" * 2001]]), "2001 characters"),
        (b'{"qParams": {"pinnedIds": [], "supernodes": []}, "clerps": [["' + a.encode()
         + b'", "\\ud800"]]}', "lone surrogate"),
    ]


def test_the_save_endpoints_refusals(served, tmp_path):
    before = (served / NAME).read_bytes()
    payload = json.loads(before)
    a, b, logit = _ids(payload)
    good = _body(pinnedIds=[a], supernodes=[])
    with running(served, max_save_bytes=4096) as port:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.2"):  # rebinding
            assert post(port, f"/api/save?name={NAME}", good, host) == (403, b""), host
            assert get(port, "/annotate.js", host) == (403, b""), host
        status, script = get(port, "/annotate.js")
        assert status == 200 and b"function saveNotes" in script
        said = []
        for headers, expected in [
                ({"Origin": "http://evil.example"}, 403), ({"Origin": "null"}, 403),
                ({"Origin": f"https://127.0.0.1:{port}"}, 403),
                ({"Sec_Fetch_Site": "cross-site"}, 403),
                ({"Sec_Fetch_Site": "same-site"}, 403),
                ({"kind": "text/plain"}, 415), ({"kind": None}, 415),
                ({"kind": "application/x-www-form-urlencoded"}, 415),
                ({"length": -1}, 411), ({"length": -1, "Transfer_Encoding": "chunked"}, 411),
                ({"length": 4097}, 413), ({"length": 10**12}, 413)]:
            status, reply = post(port, f"/api/save?name={NAME}", good, **headers)
            assert status == expected, (headers, status, reply)
            said.append(reply)
        status, reply = post(port, f"/api/save?name={NAME}", b"{" + b" " * 5000 + b"}")
        assert status == 413 and b"4096-byte limit" in reply
        for name in ["secrets.json", "../outside/graph.json", ".env", "eiffel", "nope.json",
                     f"/{NAME}", ""]:
            status, reply = post(port, f"/api/save?name={name}", good)
            assert status == 404 and b"not a graph the viewer lists" in reply, name
            said.append(reply)
        status, reply = post(port, "/api/graphs", good)
        assert status == 404 and reply.endswith(b"\n")
        for body, reason in _refusals(a, b, logit):
            if len(body) > 4096:
                continue
            status, reply = post(port, f"/api/save?name={NAME}", body)
            assert status == 400 and reason in json.loads(reply)["error"], (body[:80], reply)
            said.append(reply)
        assert listed(port) == [NAME]
    assert all(reply.count(b"\n") == 1 and reply.endswith(b"\n") and b"Traceback" not in reply
               for reply in said), said
    assert (served / NAME).read_bytes() == before  # nothing refused was written
    index = GraphIndex(served)
    for body, reason in _refusals(a, b, logit):  # the long ones too, without the size cap
        with pytest.raises(AnnotationError, match="") as refused:
            save(index, NAME, body)
        assert refused.value.status == 400 and reason in str(refused.value), reason
    assert (served / NAME).read_bytes() == before
    assert (tmp_path / "outside" / "graph.json").read_bytes() == before


def test_a_graph_changed_on_disk_meanwhile_is_not_overwritten(served):
    index = GraphIndex(served)
    before = (served / NAME).read_bytes()
    a, _, _ = _ids(json.loads(before))
    load = index.load

    def load_then_change(name):
        loaded = load(name)
        st = os.stat(served / NAME)
        os.utime(served / NAME, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return loaded

    index.load = load_then_change
    with pytest.raises(AnnotationError, match="changed on disk") as refused:
        save(index, NAME, _body(pinnedIds=[a], supernodes=[]))
    assert refused.value.status == 409 and (served / NAME).read_bytes() == before


def test_an_annotated_graph_over_the_size_cap_is_not_saved(served):
    before = (served / NAME).read_bytes()
    a, _, _ = _ids(json.loads(before))
    index = GraphIndex(served, max_bytes=len(before) + 100)
    with pytest.raises(AnnotationError, match="over the viewer's") as refused:
        save(index, NAME, _body(pinnedIds=[], supernodes=[], clerps=[[a, "x" * 500]]))
    assert refused.value.status == 413 and (served / NAME).read_bytes() == before
    assert save(index, NAME, _body(pinnedIds=[a], supernodes=[]))[0]["pinned"] == 1
    assert index.names() == [NAME]


def test_a_save_keeps_the_files_mode_and_writes_through_a_link(served):
    os.chmod(served / NAME, 0o640)
    os.symlink("eiffel/graph.json", served / "link.json")
    a, _, _ = _ids(json.loads((served / NAME).read_text()))
    index = GraphIndex(served)
    assert index.names() == ["eiffel/graph.json", "link.json"]
    save(index, "link.json", _body(pinnedIds=[a], supernodes=[]))
    assert (served / "link.json").is_symlink()
    assert json.loads((served / NAME).read_text())["qParams"]["pinnedIds"] == [a]
    assert stat.S_IMODE(os.stat(served / NAME).st_mode) == 0o640
    assert index.names() == ["eiffel/graph.json", "link.json"]
    assert not [p.name for p in (served / "eiffel").iterdir()  # no temporary file left
                if p.name.startswith(".") and p.name != ".graph.json.lock"]


def test_a_full_disk_is_one_line_and_the_file_as_it_was(served, monkeypatch):
    before = (served / NAME).read_bytes()
    a, _, _ = _ids(json.loads(before))

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(annotations, "replacing", full)
    with running(served) as port:
        status, reply = post(port, f"/api/save?name={NAME}",
                             _body(pinnedIds=[a], supernodes=[]))
    assert status == 500 and json.loads(reply) == {
        "error": f"could not write {NAME}: No space left on device"}
    assert (served / NAME).read_bytes() == before


def test_a_stalled_body_does_not_hold_the_server(served, monkeypatch):
    monkeypatch.setattr("pyvene_causaltrace.viewer.REQUEST_TIMEOUT_S", 1)
    with running(served) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=STEP_S) as stalled:
            stalled.sendall(f"POST /api/save?name={NAME} HTTP/1.1\r\nHost: 127.0.0.1:{port}"
                            "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                            "\r\n{".encode())
            assert listed(port) == [NAME]  # served meanwhile
            assert stalled.recv(100) == b""  # closed after the timeout, unanswered


# -- in the browser -------------------------------------------------------------------------


def _browser(p, chromium):
    browser = p.chromium.launch(executable_path=chromium, timeout=STEP_S * 1000,
                                args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(STEP_S * 1000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return browser, page, errors


def _click(page, node_id: str, **modifiers) -> None:
    page.locator(f'#svg .node[data-id="{node_id}"]').dispatch_event("click", modifiers)


def _pinned(page) -> list[str]:
    return page.eval_on_selector_all("#pinned li", "items => items.map(i => i.dataset.id)")


def _links_between(payload: dict, groups: list[set[str]]) -> int:
    """How many (ordered) pairs of the groups have a link between their members."""
    owner = {node: i for i, group in enumerate(groups) for node in group}
    return len({(owner[link["source"]], owner[link["target"]]) for link in payload["links"]
                if link["source"] in owner and link["target"] in owner
                and owner[link["source"]] != owner[link["target"]]})


@pytest.mark.browser
def test_pin_group_label_save_and_reload_in_headless_chromium(served):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    payload = json.loads((served / NAME).read_text())
    a, b, logit = _ids(payload)
    with running(served) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#svg .node")
            _click(page, a)
            page.click("#pin-toggle")
            assert page.locator("#pin-toggle").inner_text() == "Unpin"
            _click(page, b, ctrlKey=True)  # Ctrl-click pins too
            _click(page, logit)
            assert page.locator("#label-editor").is_hidden()  # a logit's label is the viewers'
            page.click("#pin-toggle")
            assert _pinned(page) == [a, b, logit]
            assert page.locator("#svg .node.pinned").count() == 3
            assert page.locator("#subgraph .sg-node").count() == 3
            assert page.locator("#subgraph .sg-link").count() == _links_between(
                payload, [{a}, {b}, {logit}])
            # group a and b under a name, then rename it
            page.locator(f'#pinned li[data-id="{a}"] .pick').check()
            page.locator(f'#pinned li[data-id="{b}"] .pick').check()
            page.fill("#group-name", "capital")
            page.click("#group")
            assert page.locator("#supernodes li").count() == 1
            assert page.locator("#subgraph .sg-node").count() == 2
            assert page.locator("#subgraph .sg-node.supernode text").text_content() == "capital"
            assert page.locator("#subgraph .sg-link").count() == _links_between(
                payload, [{a, b}, {logit}])
            page.locator("#supernodes .sn-name").fill("capital city")
            page.locator("#supernodes .sn-name").press("Enter")
            assert page.locator("#subgraph .sg-node.supernode text").text_content() == \
                "capital city"
            # edit a's label
            _click(page, a)
            page.fill("#label-input", "says Paris")
            page.click("#label-save")
            assert page.locator(f'#pinned li[data-id="{a}"] .name').inner_text() == "says Paris"
            page.locator("#threshold").fill("0.5")
            assert page.locator("#save-status").inner_text() == "unsaved changes"
            page.click("#save")
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent.startsWith('saved')")
            assert page.locator("#save-status").inner_text() == \
                "saved: 3 pinned, 1 supernodes, 1 label(s)"
            page.click("#save")  # again: the page sends the version its last save wrote
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent === "
                "'saved: 3 pinned, 1 supernodes, 0 label(s)'")
            saved = json.loads((served / NAME).read_text())
            assert saved["qParams"] == {"pinnedIds": [a, b, logit],
                                        "supernodes": [["capital city", a, b]], "clickedId": a,
                                        "linkType": "both", "sg_pos": "",
                                        "pruningThreshold": 0.5}
            assert next(n["clerp"] for n in saved["nodes"] if n["node_id"] == a) == \
                "says Paris"
            # reload: everything comes back from the file
            page.reload()
            page.wait_for_selector("#pinned li")
            assert _pinned(page) == [a, b, logit]
            assert page.locator("#supernodes .sn-name").input_value() == "capital city"
            assert page.locator("#subgraph .sg-node.supernode text").text_content() == \
                "capital city"
            assert page.locator(f'#pinned li[data-id="{a}"] .name').inner_text() == "says Paris"
            assert page.locator("#svg .node.selected").get_attribute("data-id") == a
            assert page.locator("#threshold-value").inner_text() == "0.50"
            assert page.locator("#save-status").inner_text() == ""
            # ungroup and unpin: saved as such
            page.click("#supernodes .ungroup")
            page.locator(f'#pinned li[data-id="{logit}"] .unpin').click()
            assert page.locator("#subgraph .sg-node").count() == 2
            page.keyboard.press("Control+s")
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent.startsWith('saved')")
            q = json.loads((served / NAME).read_text())["qParams"]
            assert (q["pinnedIds"], q["supernodes"]) == ([a, b], [])
            # the file changes on disk behind the page: its next save is refused, not written
            st = (served / NAME).stat()
            os.utime(served / NAME, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            before = (served / NAME).read_bytes()
            page.click("#save")
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent.startsWith('not')")
            assert "changed on disk since the page loaded it" in page.locator(
                "#save-status").inner_text()
            assert (served / NAME).read_bytes() == before
        finally:
            browser.close()
    refused = [e for e in errors if "status of 412" in e]  # Chromium logs the refused save
    assert len(refused) == 1 and not [e for e in errors if e not in refused], errors


def _three_logits(payload: dict) -> dict:
    """``payload`` with two more logit nodes beside its target (what multi-logit attribution
    writes): their own token_prob, not the target, fed by the target's sources."""
    payload = copy.deepcopy(payload)
    target = next(n for n in payload["nodes"] if n["feature_type"] == "logit")
    layer, _, pos = target["node_id"].split("_")
    for token, word, prob in ((401, " Rome", 0.21), (402, " London", 0.07)):
        node = {**target, "node_id": f"{layer}_{token}_{pos}", "feature": token,
                "jsNodeId": f"L_{token}-{pos}", "token_prob": prob, "is_target_logit": False,
                "clerp": f'Output "{word}" (p={prob:.3f})'}
        payload["nodes"].append(node)
        payload["links"] += [{**link, "target": node["node_id"], "weight": link["weight"] / 2}
                             for link in payload["links"] if link["target"] == target["node_id"]]
    return payload


@pytest.mark.browser
def test_three_logits_and_circuit_tracers_own_qparams_forms(served):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    payload = json.loads((served / NAME).read_text())
    a, b, logit = _ids(payload)
    multi = _three_logits(payload)
    (served / "multi").mkdir()
    (served / "multi" / "graph.json").write_text(json.dumps(multi))
    # what circuit-tracer's own Save writes: its URL's strings
    ct = copy.deepcopy(payload)
    ct["qParams"] = {"pinnedIds": f"{a},{b},no_such_node", "linkType": "either",
                     "supernodes": json.dumps([["grp", a, b]]), "sg_pos": "10 20 30 40",
                     "clickedId": "", "pruningThreshold": "0.8"}
    (served / "ct").mkdir()
    (served / "ct" / "graph.json").write_text(json.dumps(ct))
    with running(served) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#pinned li")  # ct/graph.json, first in the picker
            assert _pinned(page) == [a, b]
            assert page.locator("#supernodes .sn-name").input_value() == "grp"
            assert "1 annotation id(s)" in page.locator("#note-status").inner_text()
            assert page.locator("#threshold-value").inner_text() == "0.80"
            page.click("#save")
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent.startsWith('saved')")
            q = json.loads((served / "ct" / "graph.json").read_text())["qParams"]
            assert q == {"pinnedIds": [a, b], "supernodes": [["grp", a, b]],
                         "linkType": "either", "sg_pos": "10 20 30 40", "clickedId": "",
                         "pruningThreshold": 0.8}  # unchanged pins: its positions kept
            # three logits: each drawn and labelled, the target marked, no label overlapping
            page.select_option("#picker", "multi/graph.json")
            page.wait_for_function("() => document.querySelectorAll('.logit-label').length === 3")
            assert page.locator("#svg .node.logit").count() == 3
            assert page.locator("#svg .node.logit.target").get_attribute("data-id") == logit
            texts = page.locator(".logit-label").all_text_contents()
            assert any('" Rome" p=0.210' in t for t in texts), texts
            assert any('" London" p=0.070' in t for t in texts), texts
            assert sum("(target)" in t for t in texts) == 1
            boxes = page.eval_on_selector_all(".logit-label", """labels => labels.map(l => {
                const b = l.getBBox(); return [b.x, b.y, b.x + b.width, b.y + b.height]; })""")
            assert all(b[0] >= 0 and b[1] >= 0 for b in boxes), boxes
            assert not any(p[0] < q[2] and q[0] < p[2] and p[1] < q[3] and q[1] < p[3]
                           for i, p in enumerate(boxes) for q in boxes[i + 1:]), boxes
            width = float(page.locator("#svg").get_attribute("width"))
            assert max(b[2] for b in boxes) <= width, (boxes, width)
            # an unsaved pin survives a trip to another graph and back
            rome = f"{logit.rsplit('_', 2)[0]}_401_{logit.rsplit('_', 1)[1]}"
            _click(page, rome, ctrlKey=True)
            assert _pinned(page) == [rome]
            page.select_option("#picker", NAME)
            page.wait_for_function("() => document.querySelectorAll('#pinned li').length === 0")
            page.select_option("#picker", "multi/graph.json")
            page.wait_for_function("() => document.querySelectorAll('#pinned li').length === 1")
            assert page.locator("#save-status").inner_text() == "unsaved changes"
            page.click("#save")
            page.wait_for_function(
                "() => document.querySelector('#save-status').textContent.startsWith('saved')")
            assert json.loads((served / "multi" / "graph.json").read_text())["qParams"][
                "pinnedIds"] == [rome]
        finally:
            browser.close()
    assert not errors, errors
