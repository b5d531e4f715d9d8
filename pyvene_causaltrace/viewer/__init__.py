"""An interactive attribution-graph viewer served on localhost, with annotations saved into the
graph file.

    pyvene-causaltrace serve out/            # every graph.json under out/, in the browser

One self-contained page (``index.html``, ``annotate.js``: works offline) draws the graphs
:mod:`.listing` serves and saves annotations (:mod:`.annotations`). Only a loopback ``Host`` is
answered (no DNS rebinding); routes and refusals: docs/attribution.md, "The viewer"."""

from __future__ import annotations

import json
import logging
import re
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from ..arguments import PositiveInt, checked
from ..errors import InputError
from .annotations import MAX_SAVE_BYTES, AnnotationError, save, version
from .listing import MAX_BYTES, MAX_DEPTH, GraphIndex, find_graphs

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_SAVE_BYTES", "GraphIndex", "find_graphs",
           "host_allowed", "make_server", "serve"]

PAGE = Path(__file__).with_name("index.html")
STATIC = {"/annotate.js": (Path(__file__).with_name("annotate.js"),
                           "text/javascript; charset=utf-8")}
#: Seconds a connection may take to send its request (a stalled body does not hold a thread).
REQUEST_TIMEOUT_S = 30
#: Bytes of a refused save's body read and dropped at most before the connection closes.
DISCARD_BYTES = 64 * 1024 * 1024
log = logging.getLogger(__name__)

#: Longest Content-Length read as a number (more digits: over any limit, not parsed).
_MAX_LENGTH_DIGITS = 18
_LOCAL_HOST = re.compile(r"(?:localhost|127\.0\.0\.1|\[::1\])(?::\d{1,5})?", re.IGNORECASE)


@checked
def host_allowed(host: str | None) -> bool:
    """Whether a request's ``Host`` header names this machine by a loopback name (``localhost``,
    ``127.0.0.1`` or ``[::1]``, with or without a port)."""
    return host is not None and _LOCAL_HOST.fullmatch(host.strip()) is not None


def _origin_allowed(origin: str | None) -> bool:
    """Whether an ``Origin`` header (absent: a non-browser client) names a loopback origin."""
    if origin is None:
        return True
    return origin.startswith("http://") and host_allowed(origin[len("http://"):])


def _content_length(value: str | None) -> int | None:
    """A ``Content-Length`` header's bytes, or None when it is missing or not a number; parsed
    with a bound (``int()`` raises on a 5000-digit value), more digits read as 10**18."""
    value = (value or "").strip()
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value) if len(value) <= _MAX_LENGTH_DIGITS else 10**_MAX_LENGTH_DIGITS


def _handler(index: GraphIndex, max_save_bytes: int) -> type[BaseHTTPRequestHandler]:
    refused: set[str] = set()
    listings = {"/api/graphs": index.names, "/api/listing": index.entries,
                "/api/skipped": index.skipped}

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self._guarded(self._get)

        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            self._guarded(self._post)

        def _guarded(self, handle) -> None:
            """``handle()`` of a request for a loopback ``Host`` (:meth:`_host_ok`); an exception
            it lets out is answered 500 with a JSON reason (not an empty reply) and logged with
            its traceback: a bug, not a user's mistake."""
            self._answered = False
            try:
                if self._host_ok():
                    handle()
            except Exception as error:
                log.error("viewer: %s %s failed", self.command, self.path, exc_info=True)
                if self._answered:
                    self.close_connection = True
                    return
                try:
                    self._fail(500, f"the viewer failed on this request ({type(error).__name__}:"
                                    f" {error}); see the server's log")
                except OSError:
                    self.close_connection = True

        def _get(self) -> None:
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(PAGE.read_bytes(), "text/html; charset=utf-8")
            elif url.path in STATIC:
                path, kind = STATIC[url.path]
                self._send(path.read_bytes(), kind)
            elif url.path in listings:
                self._send(json.dumps(listings[url.path]()).encode(), "application/json")
            elif url.path == "/api/graph":
                name = parse_qs(url.query).get("name", [""])[0]
                loaded = index.load(name)
                if loaded is None:
                    self._fail(404, "no such graph in the served directory")
                    return
                self._send(loaded[0], "application/json", etag=version(loaded[1]))
            else:
                self._fail(404, f"nothing here ({url.path})")

        def _post(self) -> None:
            url = urlparse(self.path)
            if url.path != "/api/save":
                self._fail(404, "nothing to POST to here (saves go to /api/save?name=PATH)")
                self._discard_body()
                return
            refusal = self._save_refusal()
            if refusal is not None:
                self._fail(*refusal)
                self._discard_body()
                return
            try:
                body = self.rfile.read(_content_length(self.headers["Content-Length"]))
            except OSError:  # a stalled or broken client: nobody left to answer
                self.close_connection = True
                return
            name = parse_qs(url.query).get("name", [""])[0]
            try:
                summary, tag = save(index, name, body, self.headers.get("If-Match"))
            except AnnotationError as error:
                self._fail(error.status, str(error))
                return
            except OSError as error:
                log.warning("viewer: could not save %s: %s", name, error)
                self._fail(500, f"could not write {name}: {error.strerror or error}")
                return
            log.info("viewer: saved the annotations of %s (%s)", name, summary)
            self._send(json.dumps({"saved": name, **summary}).encode(), "application/json",
                       etag=tag)

        def _save_refusal(self) -> tuple[int, str] | None:
            """Why a save request is refused before its body is read, or None."""
            headers = self.headers
            if not _origin_allowed(headers.get("Origin")) or headers.get(
                    "Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
                return 403, "a save must come from the viewer's own page"
            kind = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, "a save is a JSON body (Content-Type: application/json)"
            if headers.get("Transfer-Encoding"):
                return 411, "send the body with a Content-Length, not chunked"
            length = _content_length(headers.get("Content-Length"))
            if length is None:
                return 411, "a save needs a Content-Length"
            if length > max_save_bytes:
                size = f"{length} bytes" if length < 10**_MAX_LENGTH_DIGITS else "huge"
                return 413, (f"the body is {size}, over the {max_save_bytes}-byte limit "
                             "(max_save_bytes)")
            return None

        def _discard_body(self) -> None:
            """Read (up to :data:`DISCARD_BYTES`) and drop the body of a request refused
            unread, so the client reads the refusal instead of a reset connection; the client
            closing after the answer ends it early."""
            left = min(_content_length(self.headers.get("Content-Length")) or 0, DISCARD_BYTES)
            try:
                while left > 0:
                    chunk = self.rfile.read1(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass

        def _host_ok(self) -> bool:
            """Whether the one ``Host`` header is a loopback name; else an empty 403 sent."""
            hosts = self.headers.get_all("Host") or []
            if len(hosts) == 1 and host_allowed(hosts[0]):
                return True
            host = ", ".join(hosts)
            if host not in refused and len(refused) < 32:  # bounded: any page can vary it
                refused.add(host)
                log.warning("viewer: refused a request for Host %r (only localhost, 127.0.0.1 "
                            "and [::1] are served)", host)
            self._answered = True
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            return False

        def _fail(self, status: int, message: str) -> None:
            """A refusal: ``status`` and ``{"error": message}`` on one line of JSON; the
            connection closes (a body left unread must not be taken for the next request)."""
            reason = json.dumps({"error": " ".join(message.split())}, ensure_ascii=False)
            self._send((reason + "\n").encode("utf-8", errors="replace"), "application/json",
                       status)
            self.close_connection = True

        def send_error(self, code: int, message: str | None = None,
                       explain: str | None = None) -> None:
            """http.server's own refusals (a malformed request line, an unsupported method,
            headers too long) in the same JSON form as ours."""
            reason = message or self.responses.get(code, ("error",))[0]
            if getattr(self, "command", None) == "HEAD" or code < 200 or code in (204, 304):
                super().send_error(code, message, explain)
                return
            self._fail(code, reason)

        def _send(self, body: bytes, kind: str, status: int = 200,
                  etag: str | None = None) -> None:
            self._answered = True
            self.send_response(status)
            self.send_header("Content-Type", kind)
            if etag is not None:
                self.send_header("ETag", etag)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            if status != 200:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # quiet
            return

    return Handler


@checked
def make_server(directory: str | Path, port: int = 8765, host: str = "127.0.0.1",
                max_bytes: PositiveInt = MAX_BYTES, max_depth: PositiveInt = MAX_DEPTH,
                max_save_bytes: PositiveInt = MAX_SAVE_BYTES) -> ThreadingHTTPServer:
    """The viewer's server for ``directory`` (not yet serving); ``port=0`` picks a free port.
    Graph files over ``max_bytes`` bytes or nested deeper than ``max_depth`` are skipped; a
    save request over ``max_save_bytes`` is refused (413). Raises :class:`InputError` for a bad
    port or a directory without graphs, ``OSError`` (naming the port) when the port cannot be
    had."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port {port}: not a port (0 to 65535; 0 picks a free one)")
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {directory}")
    index = GraphIndex(directory, max_bytes=max_bytes, max_depth=max_depth)
    if not index.names():
        raise InputError(f"{directory} holds no graph JSON (a file that Neuronpedia's graph "
                         "schema validates, as circuit-tracer and `pyvene-causaltrace attribute "
                         "--out DIR` write; skipped files are logged with their reason)")
    try:
        return ThreadingHTTPServer((host, port), _handler(index, max_save_bytes))
    except OSError as error:
        refused = OSError(f"cannot serve on {host}:{port} (--port {port}): "
                          f"{error.strerror or error}; pick another --port (0 picks a free one)")
        refused.errno = error.errno
        raise refused from error


@checked
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
