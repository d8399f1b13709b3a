"""``python -m shaderdsl.browser run PAGE --eval EXPR``: open a page of your own in
headless Chromium (the project's DevTools-pipe driver, shaderdsl.browser) and
print the value of a JavaScript expression once it is set.

A page that imports ES modules needs http: browsers refuse module scripts from
``file://``. A local PAGE is therefore served with its folder over http on
127.0.0.1 (a secure context, so ``navigator.gpu`` exists) for as long as the run
lasts, and so is a ``file://`` URL (the driver's Chromium reads files for its own
harness, so a module page opened from ``file://`` would pass here and fail in a
browser); another URL is opened as it is.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:
        """Requests are not printed: the expression's value is the output."""


@contextlib.contextmanager
def served(page: Path):
    """The URL of ``page`` served with its folder on 127.0.0.1 (a free port)."""
    handler = functools.partial(_QuietHandler, directory=str(page.parent))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{page.name}"
    finally:
        server.shutdown()
        server.server_close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shaderdsl.browser",
                                description="drive a page in headless Chromium's WebGPU")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="open PAGE, wait for --eval EXPR to be set, print it")
    run.add_argument("page", help="an HTML file (served over http with its folder) or a URL")
    run.add_argument("--eval", required=True, metavar="EXPR", dest="expression",
                     help="a JavaScript expression, polled until it is neither null nor "
                          "undefined, then printed as JSON")
    run.add_argument("--timeout", type=float, default=120.0,
                     help="seconds to wait for EXPR (default 120)")
    run.add_argument("--screenshot", metavar="PNG", help="also save a PNG of the page")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..errors import BrowserError
    from . import load_page

    args = parser().parse_args(argv)
    if args.page.startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        args.page = url2pathname(urlparse(args.page).path)
        print(f"note: serving {args.page} over http, as a browser refuses module scripts "
              f"from file://", file=sys.stderr)
    local = "://" not in args.page
    if local and not Path(args.page).is_file():
        print(f"error: {args.page}: no such file", file=sys.stderr)
        return 2
    try:
        with served(Path(args.page).resolve()) if local else contextlib.nullcontext(
                args.page) as url:
            value = load_page(url, args.expression, timeout=args.timeout,
                              screenshot=args.screenshot)
    except BrowserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
