"""``serve``: the interactive graph viewer on localhost."""

from __future__ import annotations

from ..viewer import make_server, serve


def serve_command(args) -> int:
    server = make_server(args.dir, port=args.port)
    print(f"serving the graphs under {args.dir} at "
          f"http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    serve(args.dir, open_browser=not args.no_open, server=server)
    return 0
