"""An interactive attribution-graph viewer served on localhost.

    pyvene-causaltrace serve out/            # every graph.json under out/, in the browser

One self-contained page (``index.html`` beside this module: plain JavaScript and SVG, nothing
from a CDN, so it works offline) reads the graph JSON ``attribute`` exports — circuit-tracer's
format — and draws features, errors, tokens and the logit by layer × position, tokens along the
bottom. Hover a node for its label, activation and influence; click it to list its strongest
inputs and outputs; the slider keeps the nodes whose cumulative influence is below a threshold
(circuit-tracer's node pruning); the picker switches between the graphs in the directory.

The server answers three requests: ``/`` (the page), ``/api/graphs`` (the graph files under the
directory, relative paths) and ``/api/graph?name=PATH`` (one of them; nothing outside the
directory is served).
"""

from __future__ import annotations

import json
import logging
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from ..errors import InputError

PAGE = Path(__file__).with_name("index.html")


def find_graphs(directory: Path) -> list[str]:
    """Relative paths of the graph JSON files under ``directory`` (those with nodes and links),
    sorted."""
    found = []
    for path in sorted(directory.rglob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(payload, dict) and "nodes" in payload and "links" in payload:
            found.append(path.relative_to(directory).as_posix())
    return found


def _handler(directory: Path) -> type[BaseHTTPRequestHandler]:
    root = directory.resolve()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(PAGE.read_bytes(), "text/html; charset=utf-8")
            elif url.path == "/api/graphs":
                self._send(json.dumps(find_graphs(root)).encode(), "application/json")
            elif url.path == "/api/graph":
                name = parse_qs(url.query).get("name", [""])[0]
                path = (root / name).resolve()
                if root not in path.parents or not path.is_file():
                    self.send_error(404, f"no graph {name!r} in {root}")
                    return
                self._send(path.read_bytes(), "application/json")
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # quiet
            return

    return Handler


def make_server(directory: str | Path, port: int = 8765,
                host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """The viewer's server for ``directory`` (not yet serving); ``port=0`` picks a free port."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {directory}")
    if not find_graphs(directory):
        raise InputError(f"{directory} holds no graph JSON (write one with "
                         "`pyvene-causaltrace attribute --out DIR`)")
    return ThreadingHTTPServer((host, port), _handler(directory))


def serve(directory: str | Path, port: int = 8765, open_browser: bool = True,
          server: ThreadingHTTPServer | None = None) -> None:
    """Serve the graphs under ``directory`` until interrupted (Ctrl-C)."""
    server = server or make_server(directory, port)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    logging.getLogger(__name__).info("serving the graphs under %s at %s", directory, url)
    if open_browser:
        threading.Timer(0.3, webbrowser.open, args=(url,)).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
