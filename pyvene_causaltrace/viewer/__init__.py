"""An interactive attribution-graph viewer served on localhost.

    pyvene-causaltrace serve out/            # every graph.json under out/, in the browser

One self-contained page (``index.html`` beside this module: plain JavaScript and SVG, nothing
from a CDN, so it works offline) reads the graph JSON ``attribute`` exports — circuit-tracer's
format — and draws features, errors, tokens and the logit by layer × position, tokens along the
bottom. Hover a node for its label, activation and influence; click it to list its strongest
inputs and outputs; the slider keeps the nodes whose cumulative influence is below a threshold
(circuit-tracer's node pruning); the picker switches between the graphs in the directory.

The server answers three requests: ``/`` (the page), ``/api/graphs`` (the graph files under the
directory, relative paths) and ``/api/graph?name=PATH`` (one of those listed, nothing else).
It lists only graph JSON this package wrote (see :mod:`.listing`: regular files under a size
cap and a nesting depth, carrying the export's generator marker; the rest is skipped and
logged once), and answers only requests whose ``Host`` is ``localhost``, ``127.0.0.1`` or
``[::1]`` (any other gets an empty 403: a page on another site cannot reach it by rebinding
its DNS name to this machine).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from ..errors import InputError
from .listing import GENERATOR, MAX_BYTES, MAX_DEPTH, GraphIndex, find_graphs

__all__ = ["MAX_BYTES", "MAX_DEPTH", "GraphIndex", "find_graphs", "host_allowed",
           "make_server", "serve"]

PAGE = Path(__file__).with_name("index.html")
log = logging.getLogger(__name__)

_LOCAL_HOST = re.compile(r"(?:localhost|127\.0\.0\.1|\[::1\])(?::\d{1,5})?", re.IGNORECASE)


def host_allowed(host: str | None) -> bool:
    """Whether a request's ``Host`` header names this machine by a loopback name (``localhost``,
    ``127.0.0.1`` or ``[::1]``, with or without a port)."""
    return host is not None and _LOCAL_HOST.fullmatch(host.strip()) is not None


def _handler(index: GraphIndex) -> type[BaseHTTPRequestHandler]:
    refused: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            hosts = self.headers.get_all("Host") or []
            if len(hosts) != 1 or not host_allowed(hosts[0]):
                self._refuse(", ".join(hosts))
                return
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(PAGE.read_bytes(), "text/html; charset=utf-8")
            elif url.path == "/api/graphs":
                self._send(json.dumps(index.names()).encode(), "application/json")
            elif url.path == "/api/graph":
                name = parse_qs(url.query).get("name", [""])[0]
                body = index.read(name)
                if body is None:
                    self.send_error(404, "no such graph in the served directory")
                    return
                self._send(body, "application/json")
            else:
                self.send_error(404)

        def _refuse(self, host: str) -> None:
            if host not in refused and len(refused) < 32:  # bounded: any page can vary it
                refused.add(host)
                log.warning("viewer: refused a request for Host %r (only localhost, 127.0.0.1 "
                            "and [::1] are served)", host)
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # quiet
            return

    return Handler


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"--port {port}: not a port (0 to 65535; 0 picks a free one)")
    return port


def make_server(directory: str | Path, port: int = 8765, host: str = "127.0.0.1",
                max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> ThreadingHTTPServer:
    """The viewer's server for ``directory`` (not yet serving); ``port=0`` picks a free port.
    Graph files over ``max_bytes`` bytes or nested deeper than ``max_depth`` are skipped.
    Raises :class:`InputError` for a bad port or a directory without graphs, ``OSError``
    (naming the port) when the port cannot be had."""
    port = _check_port(port)
    for name, value in (("max_bytes", max_bytes), ("max_depth", max_depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} {value!r}: a positive whole number")
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {directory}")
    index = GraphIndex(directory, max_bytes=max_bytes, max_depth=max_depth)
    if not index.names():
        raise InputError(f"{directory} holds no graph JSON written by {GENERATOR} (write one "
                         "with `pyvene-causaltrace attribute --out DIR`; skipped files are "
                         "logged)")
    try:
        return ThreadingHTTPServer((host, port), _handler(index))
    except OSError as error:
        refused = OSError(f"cannot serve on {host}:{port} (--port {port}): "
                          f"{error.strerror or error}; pick another --port (0 picks a free one)")
        refused.errno = error.errno
        raise refused from error


def serve(directory: str | Path, port: int = 8765, open_browser: bool = True,
          server: ThreadingHTTPServer | None = None) -> None:
    """Serve the graphs under ``directory`` until interrupted (Ctrl-C)."""
    server = server or make_server(directory, port)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    log.info("serving the graphs under %s at %s", directory, url)
    if open_browser:
        threading.Timer(0.3, webbrowser.open, args=(url,)).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
