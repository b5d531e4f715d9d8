"""The viewer's server in front of a hostile directory: it lists and serves only the graph JSON
this package wrote; it skips (and logs once) FIFOs, links to devices or out of the directory,
files over the size cap and deeply nested JSON, without hanging; it answers only loopback
``Host`` names; it reads an unchanged file once; a bad or busy port is one ``error:`` line.
Checked with plain HTTP and in headless Chromium. Every step runs under a time limit."""

from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import shutil
import socket
import threading
from contextlib import contextmanager

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from test_viewer import _chromium

from pyvene_causaltrace import attribute
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.viewer import GraphIndex, host_allowed, listing, make_server

SECRET = "hunter2-must-not-leave"
STEP_S = 30  # every server start, listing and request must finish within this


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, failing the test if it has not returned within ``seconds``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as error:  # re-raised in the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds} s (hung)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextmanager
def running(directory, **kwargs):
    """A viewer server for ``directory`` on a free port, serving in a thread; yields the port."""
    server = _within(STEP_S, make_server, directory, port=0, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def get(port: int, path: str, host: str | None = "", *more_hosts: str) -> tuple[int, bytes]:
    """GET ``path`` with ``Host: host`` ("": this server's own address; None: no Host)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STEP_S)
    try:
        connection.putrequest("GET", path, skip_host=True)
        for value in ([f"127.0.0.1:{port}"] if host == "" else [] if host is None
                      else [host]) + list(more_hosts):
            connection.putheader("Host", value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def listed(port: int) -> list[str]:
    """What ``/api/graphs`` lists."""
    status, body = get(port, "/api/graphs")
    assert status == 200
    return json.loads(body)


def _marked_deep(levels: int) -> str:
    """JSON carrying the graph marker and the keys of a graph, ``levels`` arrays deep."""
    meta = {"info": {"generator": {"name": listing.GENERATOR}}}
    return (f'{{"metadata":{json.dumps(meta)},"links":[],"nodes":' + "[" * levels
            + "]" * levels + "}")


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory, tokenizer):
    """A graph.json that ``attribute`` wrote (a tiny model and a random CLT)."""
    root = tmp_path_factory.mktemp("made")
    model = make_tiny_model("llama", init=0.2)
    clt = load_transcoder(str(write_clt(root / "clt", random_clt_tensors(3, 32, 16))))
    # one logit node: the annotation tests add logits of their own
    attribute(model, tokenizer, clt, PROMPT, max_n_logits=1).to_json(root / "graph.json")
    return root / "graph.json"


@pytest.fixture
def hostile(tmp_path, graph_file):
    """One good graph among files a hostile user left: a secret, a look-alike without the
    marker, deep JSON (plain and marked), a FIFO, a socket, links to /dev/zero, out of the
    directory and back to the directory itself; hidden files (a graph being written) and folders."""
    root = tmp_path / "served"
    (root / "eiffel").mkdir(parents=True)
    shutil.copy(graph_file, root / "eiffel" / "graph.json")
    (root / ".env").write_text(f"SECRET={SECRET}\n")
    (root / "secrets.json").write_text(json.dumps({"nodes": [], "links": [], "key": SECRET}))
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "deep_marked.json").write_text(_marked_deep(100_000))
    os.mkfifo(root / "x.json")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(root / "socket.json"))
    os.symlink("/dev/zero", root / "zero.json")
    (tmp_path / "outside").mkdir()
    shutil.copy(graph_file, tmp_path / "outside" / "graph.json")
    os.symlink(tmp_path / "outside" / "graph.json", root / "outside.json")
    os.symlink(root, root / "loop")
    (root / ".graph.tmp.json").write_bytes(graph_file.read_bytes()[:1000])  # being written
    (root / ".git").mkdir()
    shutil.copy(graph_file, root / ".git" / "graph.json")
    return root


SKIPPED = {"secrets.json": "not a graph", "deep.json": "not a graph",
           "deep_marked.json": "nested deeper than 64", "x.json": "not a regular file",
           "socket.json": "not a regular file", "zero.json": "not a regular file",
           "outside.json": "outside the directory"}


def test_a_hostile_directory_serves_only_the_graph(hostile, graph_file, caplog):
    caplog.set_level(logging.INFO, logger="pyvene_causaltrace.viewer")
    with running(hostile) as port:
        for _ in range(3):
            assert listed(port) == ["eiffel/graph.json"]
        status, body = get(port, "/api/graph?name=eiffel/graph.json")
        assert status == 200 and body == graph_file.read_bytes()
        for name in [".env", ".graph.tmp.json", ".git/graph.json", *SKIPPED,
                     "../outside/graph.json",
                     "eiffel/../.env", "/etc/passwd", "loop/eiffel/graph.json", ""]:
            status, body = get(port, f"/api/graph?name={name}")
            assert status == 404 and SECRET.encode() not in body, name
        status, body = get(port, "/")
        assert status == 200 and b"<svg" in body
    for name, reason in SKIPPED.items():  # once each, though listed four times
        said = [r.getMessage() for r in caplog.records if f"{name}:" in r.getMessage()]
        assert len(said) == 1 and reason in said[0], (name, said)
    assert not any(hidden in r.getMessage() for r in caplog.records
                   for hidden in (".env", ".graph.tmp", ".git"))


FOREIGN_HOSTS = ["evil.example", "evil.example:{port}", "localhost.evil.example",
                 "127.0.0.1.nip.io", "localhost@evil.example", "127.0.0.2", "0.0.0.0",
                 "localhost:{port}.evil.example", "[::2]:{port}", "", None]


def test_a_foreign_host_gets_403_and_nothing(hostile):
    with running(hostile) as port:
        for host in FOREIGN_HOSTS:
            for path in ("/", "/api/graphs", "/api/graph?name=eiffel/graph.json", "/nothing"):
                sent = None if host is None else host.format(port=port) or " "
                assert get(port, path, sent) == (403, b""), (host, path)
        assert get(port, "/api/graphs", "localhost", "evil.example") == (403, b"")


def test_loopback_host_names_are_served(hostile):
    with running(hostile) as port:
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}",
                     "[::1]", f"[::1]:{port}", "LocalHost:8765"):
            assert get(port, "/api/graphs", host)[0] == 200, host
    assert not host_allowed("[::1]:") and not host_allowed("localhost:123456")


def test_the_listing_reads_an_unchanged_file_once(hostile, monkeypatch):
    parsed: list[str] = []
    judge = listing.examine

    def counting(data: bytes, max_depth: int = listing.MAX_DEPTH) -> listing.Verdict:
        parsed.append(data[:20].decode(errors="replace"))
        return judge(data, max_depth)

    monkeypatch.setattr(listing, "examine", counting)
    index = GraphIndex(hostile)
    assert _within(STEP_S, index.names) == ["eiffel/graph.json"]
    assert len(parsed) == 4  # the graph, secrets, deep and deep_marked: FIFO and links unread
    assert _within(STEP_S, index.names) == ["eiffel/graph.json"]
    assert index.load("eiffel/graph.json") is not None
    assert len(parsed) == 4
    graph = hostile / "eiffel" / "graph.json"
    stat = graph.stat()
    os.utime(graph, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime
    assert index.names() == ["eiffel/graph.json"] and len(parsed) == 5
    with open(hostile / "secrets.json", "a") as handle:  # a new size
        handle.write(" ")
    assert index.names() == ["eiffel/graph.json"] and len(parsed) == 6
    assert index.names() == ["eiffel/graph.json"] and len(parsed) == 6


def test_files_that_change_while_serving(hostile, graph_file):
    with running(hostile) as port:
        (hostile / "later").mkdir()
        (hostile / "later" / "deep.json").write_text(_marked_deep(200_000))
        os.mkfifo(hostile / "later" / "fifo.json")
        shutil.copy(graph_file, hostile / "later" / "graph.json")
        assert listed(port) == ["eiffel/graph.json", "later/graph.json"]
        assert get(port, "/api/graph?name=later/graph.json")[0] == 200
        (hostile / "later" / "graph.json").write_text(json.dumps({"nodes": [], "links": [],
                                                                  "key": SECRET}))
        status, body = get(port, "/api/graph?name=later/graph.json")
        assert status == 404 and SECRET.encode() not in body
        assert listed(port) == ["eiffel/graph.json"]


def test_the_size_cap(hostile, graph_file, caplog):
    size = graph_file.stat().st_size
    assert GraphIndex(hostile, max_bytes=size).names() == ["eiffel/graph.json"]
    assert GraphIndex(hostile, max_bytes=size - 1).names() == []
    assert any("over the" in r.getMessage() and "cap" in r.getMessage() for r in caplog.records)
    with pytest.raises(InputError, match="no graph JSON"):
        _within(STEP_S, make_server, hostile, port=0, max_bytes=size - 1)


@pytest.mark.parametrize(("text", "depth"), [
    (b"1", 0), (b"[]", 1), (b'{"a":[1,{"b":"]]]"}]}', 3), (b'["\\"[[[", "\\\\"]', 1),
    (b'{"a":"}}}{{{"}', 1), (b"[[]", None), (b'["open', None), (b"[" * 65 + b"]" * 65, 65),
    (b"[[],[[]],[[[]]]]", 4), (b"[" * 1000 + b"]" * 1000, 65)])
def test_nesting_depth_without_recursion(text, depth):
    assert listing.nesting_depth(text) == depth


def test_only_the_export_marker_or_the_schema_makes_a_graph(graph_file):
    payload = json.loads(graph_file.read_text())
    assert listing.examine(graph_file.read_bytes()).problem is None
    elsewhere = {"nodes": [], "links": [], "note": listing.GENERATOR}
    assert "not a graph" in listing.examine(json.dumps(elsewhere).encode()).problem
    payload["metadata"]["info"]["generator"]["name"] = "circuit-tracer"  # valid: listed
    assert listing.examine(json.dumps(payload).encode()) == (None, "circuit-tracer")
    del payload["metadata"]["slug"]  # neither ours nor valid (tests/test_viewer_any_graph.py)
    assert "not a graph" in listing.examine(json.dumps(payload).encode()).problem
    assert "deeper than 8" in listing.examine(_marked_deep(9).encode(), max_depth=8).problem


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_bad_port_is_one_error_line(hostile, port, capsys):
    assert _within(STEP_S, main, ["serve", str(hostile), "--port", port, "--no-open"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"--port: '{port}'" in err[0], err
    with pytest.raises(InputError, match="--port"):
        make_server(hostile, port=int(port))


def test_a_port_in_use_is_one_error_line(hostile, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _within(STEP_S, main, ["serve", str(hostile), "--port", str(port),
                                      "--no-open"]) == 2
        with pytest.raises(OSError) as raised:
            make_server(hostile, port=port)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"--port {port}" in err[0], err
    assert raised.value.errno == errno.EADDRINUSE


@pytest.mark.browser
def test_a_hostile_directory_in_headless_chromium(hostile, graph_file):
    chromium = _chromium()
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    payload = json.loads(graph_file.read_text())
    errors: list[str] = []
    with running(hostile) as port, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, timeout=STEP_S * 1000, args=[
            "--no-sandbox", "--host-resolver-rules=MAP evil.example 127.0.0.1"])
        try:
            page = browser.new_page()
            page.set_default_timeout(STEP_S * 1000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector(".node")
            assert page.locator("#picker option:enabled").all_inner_texts() == [
                "eiffel/graph.json"]  # the skipped ones are named, disabled, with the reason
            assert page.locator("#picker option.skipped:disabled").count() == len(
                json.loads(get(port, "/api/skipped")[1]))
            assert page.locator(".node").count() == len(payload["nodes"])
            assert not errors, errors
            probes = page.evaluate("""async names => Promise.all(names.map(async name => {
                const r = await fetch("api/graph?name=" + encodeURIComponent(name));
                return [r.status, await r.text()];
            }))""", [".env", ".git/graph.json", *SKIPPED, "../outside/graph.json"])
            assert all(status == 404 and SECRET not in text for status, text in probes), probes
            # DNS rebinding: a name that resolves to this machine is refused (Chromium shows
            # its own error page for an empty 403)
            refused: list = []
            page.on("response", lambda r: refused.append((r.url, r.status)))
            for path in ("", "api/graphs", "api/graph?name=eiffel/graph.json"):
                with pytest.raises(PlaywrightError, match="ERR_HTTP_RESPONSE_CODE_FAILURE"):
                    page.goto(f"http://evil.example:{port}/{path}")
                assert refused[-1] == (f"http://evil.example:{port}/{path}", 403)
                assert page.locator(".node").count() == 0
                assert "nodes" not in page.content()
        finally:
            browser.close()
