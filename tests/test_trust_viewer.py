"""Viewer saves that cannot land on the wrong version (issue 37): two ``serve`` processes on one
directory racing saves made from one version (one is written, the other refused, nothing lost);
a write-protected graph file refused (403); numbers in a save parsed with bounds (a 400-digit
``pruningThreshold``, a 5000-digit ``Content-Length``: 4xx with a JSON reason, no traceback);
duplicate checks linear in the ids (counted, not timed); every answer a status with a JSON
reason, an unforeseen failure included; and, in headless Chromium, unsaved annotations kept
while another graph is shown are not re-applied to a graph regenerated meanwhile."""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from filelock import FileLock
from test_viewer import _chromium
from test_viewer_annotations import _browser, _click, _ids, _pinned, etag, post
from test_viewer_server import STEP_S, graph_file, running  # noqa: F401

import pyvene_causaltrace
from pyvene_causaltrace.viewer import GraphIndex, annotations, listing
from pyvene_causaltrace.viewer.annotations import AnnotationError, parse_save, save

FEATURE = "cross layer transcoder"
NAME = "run/graph.json"
RACES = 6  # rounds of the two-process race (the old code lost one in most rounds)


def _graph(n_features: int, n_links: int = 0) -> dict:
    """A graph JSON with the export's marker: ``n_features`` features (ids ``L_F_P``), a token
    and a logit, and ``n_links`` links (enough text that a save takes a while to read)."""
    nodes = [{"node_id": "E_1_0", "feature_type": "embedding", "layer": "E", "ctx_idx": 0,
              "clerp": "tok", "influence": None, "activation": None}]
    nodes += [{"node_id": f"{i % 3}_{i}_{i % 5}", "feature_type": FEATURE, "layer": str(i % 3),
               "ctx_idx": i % 5, "feature": i, "clerp": f"feature {i}", "influence": 0.5,
               "activation": 1.0} for i in range(n_features)]
    nodes.append({"node_id": "27_7_4", "feature_type": "logit", "layer": "3", "ctx_idx": 4,
                  "clerp": 'Output "x" (p=0.500)', "token_prob": 0.5, "is_target_logit": True,
                  "influence": None, "activation": None})
    ids = [n["node_id"] for n in nodes]
    links = [{"source": ids[i % len(ids)], "target": ids[(7 * i + 1) % len(ids)],
              "weight": 0.001 * (i % 97)} for i in range(n_links)]
    return {"metadata": {"info": {"generator": {"name": listing.GENERATOR}}, "prompt": "p",
                         "prompt_tokens": ["tok"] * 5},
            "qParams": {}, "nodes": nodes, "links": links}


def _features(payload: dict) -> list[str]:
    return [n["node_id"] for n in payload["nodes"] if n["feature_type"] == FEATURE]


def _body(pinned: list[str], supernodes: list | None = None, **more) -> bytes:
    clerps = more.pop("clerps", [])
    return json.dumps({"qParams": {"pinnedIds": pinned, "supernodes": supernodes or [], **more},
                       "clerps": clerps}).encode()


def _reason(reply: bytes) -> str:
    """The JSON reason of a refusal (one line, ``{"error": ...}``)."""
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1, reply[:200]
    return json.loads(reply)["error"]


def _write(root: Path, payload: dict, name: str = NAME) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return path


# -- real serve processes -------------------------------------------------------------------


@contextmanager
def serving(directory: Path, log: Path):
    """``pyvene-causaltrace serve directory --port 0`` in a process of its own (stderr into
    ``log``); yields its port."""
    env = dict(os.environ)  # the package these tests import, first on the path
    source = str(Path(pyvene_causaltrace.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "pyvene_causaltrace.cli", "serve", str(directory),
             "--port", "0", "--no-open"], stdout=subprocess.PIPE, stderr=stderr, env=env)
    try:
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(process.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(STEP_S)
        assert line and b"http://127.0.0.1:" in line[0], (line, log.read_text())
        yield int(line[0].split(b"http://127.0.0.1:")[1].split(b"/")[0])
    finally:
        process.terminate()
        process.wait(STEP_S)
        process.stdout.close()


def _race(bodies: dict[int, bytes], tag: str) -> dict[int, tuple[int, bytes]]:
    """Each save body POSTed to its port at once (threads released together), all made from
    version ``tag``; the answers by port."""
    start = threading.Barrier(len(bodies), timeout=STEP_S)
    outcome: dict[int, tuple[int, bytes]] = {}

    def send(port: int, body: bytes) -> None:
        start.wait()
        outcome[port] = post(port, f"/api/save?name={NAME}", body, If_Match=tag)

    threads = [threading.Thread(target=send, args=item) for item in bodies.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * STEP_S)
    return outcome


@pytest.mark.process
def test_two_serve_processes_racing_one_version_write_one_save(tmp_path):
    """Two saves made from one version, one to each of two ``serve`` processes on one
    directory, at once: exactly one is written (200), the other refused (412, or 409), and the
    file holds the winner's annotation; the rounds chain, so no round's winner is lost."""
    root = tmp_path / "served"
    payload = _graph(1500, 15_000)  # ~1.5 MB: a save reads, parses and writes for a while
    _write(root, payload)
    features = _features(payload)
    winners: list[tuple[str, str]] = []
    with serving(root, tmp_path / "one.log") as one, serving(root, tmp_path / "two.log") as two:
        for race in range(RACES):
            tag = etag(one, NAME)
            assert etag(two, NAME) == tag  # one file, one version, whoever serves it
            mine = {one: features[2 * race], two: features[2 * race + 1]}
            outcome = _race({port: _body([node], clerps=[[node, f"race {race} {port}"]])
                             for port, node in mine.items()}, tag)
            statuses = {port: status for port, (status, _) in outcome.items()}
            assert sorted(statuses.values())[0] == 200 and len(statuses) == 2, outcome
            assert sorted(statuses.values())[1] in (409, 412), (race, outcome)
            won = next(port for port, status in statuses.items() if status == 200)
            lost = one if won == two else two
            assert "changed on disk" in _reason(outcome[lost][1])
            saved = json.loads((root / NAME).read_text())
            assert saved["qParams"]["pinnedIds"] == [mine[won]], race
            winners.append((mine[won], f"race {race} {won}"))
    labels = {n["node_id"]: n["clerp"] for n in saved["nodes"]}
    assert [labels[node] for node, _ in winners] == [label for _, label in winners]
    refused = set(features[:2 * RACES]) - {node for node, _ in winners}
    assert all(labels[node].startswith("feature ") for node in refused)  # never written
    for log in ("one.log", "two.log"):
        assert "Traceback" not in (tmp_path / log).read_text()


def test_a_save_waits_for_the_file_lock_and_reads_the_file_again_under_it(tmp_path):
    """While another process holds the graph's lock file and replaces the graph, a save made
    from the version before waits, then reads the new version and is refused (412); with the
    lock held past :data:`LOCK_WAIT_S`, a save is refused (503) and nothing is written."""
    root = tmp_path / "served"
    payload = _graph(20)
    path = _write(root, payload)
    index = GraphIndex(root)
    old = annotations.version(index.load(NAME)[1])
    node = _features(payload)[0]
    outcome: dict = {}

    def saving() -> None:
        try:
            outcome["saved"] = save(index, NAME, _body([node]), if_match=old)
        except AnnotationError as error:
            outcome["refused"] = error

    other = FileLock(root / "run" / ".graph.json.lock")  # what another process's save holds
    with other:
        thread = threading.Thread(target=saving, daemon=True)
        thread.start()
        time.sleep(0.5)  # let it reach the lock (the outcome does not depend on this)
        regenerated = path.with_name("new.tmp")
        regenerated.write_text(json.dumps({**payload, "links": []}))
        os.replace(regenerated, path)
    thread.join(STEP_S)
    assert "saved" not in outcome, outcome
    assert outcome["refused"].status == 412
    assert json.loads(path.read_text())["qParams"] == {}
    before = path.read_bytes()
    annotations_wait = annotations.LOCK_WAIT_S
    annotations.LOCK_WAIT_S = 0.2
    try:
        with other, pytest.raises(AnnotationError, match="being saved by another process") as busy:
            save(index, NAME, _body([node]))
    finally:
        annotations.LOCK_WAIT_S = annotations_wait
    assert busy.value.status == 503 and path.read_bytes() == before


@pytest.mark.process
def test_a_write_protected_graph_is_refused_403(tmp_path):
    root = tmp_path / "served"
    path = _write(root, _graph(20))
    node = _features(json.loads(path.read_text()))[0]
    os.chmod(path, 0o444)  # root (these tests' user) could write it anyway: the bits decide
    before = path.read_bytes()
    with serving(root, tmp_path / "serve.log") as port:
        status, reply = post(port, f"/api/save?name={NAME}", _body([node]),
                             If_Match=etag(port, NAME))
        assert status == 403, reply
        assert "write-protected (mode 0444)" in _reason(reply)
        assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o444
        os.chmod(path, 0o644)  # made writable: saved, its mode kept
        status, reply = post(port, f"/api/save?name={NAME}", _body([node]))
        assert status == 200, reply
    assert json.loads(path.read_text())["qParams"]["pinnedIds"] == [node]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


@pytest.mark.process
def test_huge_numbers_are_refused_with_a_json_reason_and_no_traceback(tmp_path):
    root = tmp_path / "served"
    path = _write(root, _graph(20))
    node = _features(json.loads(path.read_text()))[0]
    with serving(root, tmp_path / "serve.log") as port:
        for threshold in (10**400, -(10**400)):
            status, reply = post(port, f"/api/save?name={NAME}",
                                 _body([node], pruningThreshold=threshold))
            assert status == 400 and "overflows a float" in _reason(reply), reply[:200]
        status, reply = post(port, f"/api/save?name={NAME}", _body([node]),
                             length="9" * 5000)  # a Content-Length no int() reads
        assert status == 413 and "over the" in _reason(reply), reply[:200]
        status, reply = post(port, f"/api/save?name={NAME}", _body([node], pruningThreshold=1))
        assert status == 200, reply  # the server still answers, and the bound is inclusive
        for path_ in ("/nope", f"/api/graph?name=..%2F{NAME}"):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
            connection.request("GET", path_)
            response = connection.getresponse()
            assert response.status == 404 and _reason(response.read())
            connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
        connection.request("PUT", "/api/save")  # http.server's own refusal, JSON too
        response = connection.getresponse()
        assert response.status == 501 and _reason(response.read())
        connection.close()
    assert json.loads(path.read_text())["qParams"]["pruningThreshold"] == 1
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_an_unforeseen_failure_is_answered_500_with_a_reason(tmp_path, monkeypatch):
    root = tmp_path / "served"
    _write(root, _graph(20))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("pyvene_causaltrace.viewer.save", broken)
    with running(root) as port:
        status, reply = post(port, f"/api/save?name={NAME}", _body([]))
    assert status == 500 and "RuntimeError: a bug" in _reason(reply)


@pytest.mark.process
def test_a_save_of_20k_pinned_ids_is_answered(tmp_path):
    root = tmp_path / "served"
    payload = _graph(20_001)
    _write(root, payload)
    ids = _features(payload)[:20_000]
    with serving(root, tmp_path / "serve.log") as port:
        status, reply = post(port, f"/api/save?name={NAME}", _body(ids))
        assert status == 200 and json.loads(reply)["pinned"] == 20_000, reply[:200]
        status, reply = post(port, f"/api/save?name={NAME}", _body([*ids, ids[123]]))
        assert status == 400 and f"pinnedIds[20000]: {ids[123]} is pinned twice" in _reason(
            reply)
    assert json.loads((root / NAME).read_text())["qParams"]["pinnedIds"] == ids


class _Id(str):
    """A node id that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Id.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _counting(value):
    """``value`` (parsed JSON) with every string in a list an :class:`_Id`."""
    if isinstance(value, list):
        return [_Id(v) if isinstance(v, str) else _counting(v) for v in value]
    if isinstance(value, dict):
        return {key: _counting(v) for key, v in value.items()}
    return value


def test_the_duplicate_checks_are_linear_in_the_ids(monkeypatch):
    """Each pinned id and supernode member is compared a bounded number of times, not once per
    id before it (a list's ``in``): counted, for 1500 ids pinned and grouped."""

    class CountingJson:
        dumps = staticmethod(json.dumps)

        @staticmethod
        def loads(text, **kwargs):
            return _counting(json.loads(text, **kwargs))

    n = 1500
    ids = [f"{i % 3}_{i}_{i % 5}" for i in range(n)]
    kinds = dict.fromkeys(ids, FEATURE)
    monkeypatch.setattr(annotations, "json", CountingJson)
    _Id.compared = 0
    fields, _ = parse_save(_body(ids, [["all", *ids]]), kinds)
    assert _Id.compared <= 5 * n, f"{_Id.compared} comparisons for {n} ids"
    assert fields["pinnedIds"] == ids and fields["supernodes"] == [["all", *ids]]
    _Id.compared = 0
    with pytest.raises(AnnotationError, match=r"pinnedIds\[1500\]: 0_0_0 is pinned twice"):
        parse_save(_body([*ids, ids[0]], []), kinds)
    assert _Id.compared <= 5 * n, f"{_Id.compared} comparisons for {n} ids"


# -- in the browser -------------------------------------------------------------------------


@pytest.mark.browser
def test_a_draft_is_not_reapplied_to_a_graph_regenerated_meanwhile(tmp_path, graph_file):  # noqa: F811
    """Pin a node on graph A, switch to B, regenerate A on disk (same node ids), switch back:
    the pin is not re-applied to the new file, the page says A changed, and Save does not
    write it into the new graph."""
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "served"
    payload = json.loads(graph_file.read_text())
    for name in ("a", "b"):
        _write(root, payload, f"{name}/graph.json")
    node, _, _ = _ids(payload)
    with running(root) as port, sync_playwright() as p:
        browser, page, errors = _browser(p, chromium)
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector(".node")
            assert page.evaluate("state.name") == "a/graph.json"
            _click(page, node, ctrlKey=True)
            assert _pinned(page) == [node]
            page.select_option("#picker", "b/graph.json")
            page.wait_for_function("() => state.name === 'b/graph.json'")
            assert _pinned(page) == []
            # A regenerated: a new file, the same node ids
            regenerated = root / "a" / "new.tmp"
            regenerated.write_text(json.dumps({**payload, "links": payload["links"][::-1]},
                                              indent=1))
            os.replace(regenerated, root / "a" / "graph.json")
            page.select_option("#picker", "a/graph.json")
            page.wait_for_function("() => state.name === 'a/graph.json'")
            assert _pinned(page) == []
            shown = page.locator("#note-status").inner_text()
            assert "a/graph.json changed on disk since you left it" in shown, shown
            assert "1 pinned" in shown and "dropped" in shown
            page.click("#save")
            page.wait_for_function(
                "() => /^(saved|not saved)/.test(document.querySelector('#save-status')"
                ".textContent)")
            q = json.loads((root / "a" / "graph.json").read_text()).get("qParams", {})
            assert node not in q.get("pinnedIds", []), q
            # an unchanged graph still gets its draft back
            _click(page, node, ctrlKey=True)
            page.select_option("#picker", "b/graph.json")
            page.wait_for_function("() => state.name === 'b/graph.json'")
            page.select_option("#picker", "a/graph.json")
            page.wait_for_function("() => state.name === 'a/graph.json'")
            assert _pinned(page) == [node]
            assert page.locator("#save-status").inner_text() == "unsaved changes"
        finally:
            browser.close()
    assert not errors, errors
