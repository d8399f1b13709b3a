"""Run kernels in a real browser: WebGPU in one headless Chromium per process.

``get_device()`` gives a device with the host API of
``shaderdsl.runtime.Device`` (buffer, empty, zeros, uniform, write, read,
release, copy, dispatch, dispatch_1d, batch, sync, prepare) whose kernels run
in Chromium's WebGPU: its own Dawn, Tint and validation, and on a machine
without a GPU its SwiftShader fallback adapter. The browser starts on first
use (about a second), is shared by every caller and shut down at exit. It is
found through $SHADERDSL_CHROMIUM or on PATH (chromium, chromium-browser,
google-chrome); ``chromium_available()`` says whether one is there.

Modules: ``chromium`` (launch and the DevTools pipe), ``host_js`` (the page's
JavaScript), ``page`` (the harness page), ``device`` and ``buffers`` (the host
API), ``batch``, ``kernels`` (compile errors, overrides, uniform values).
See docs/browser.md.
"""
from __future__ import annotations

import atexit

from ..errors import BrowserError, BrowserTimeoutError
from .buffers import Buffer
from .chromium import INSTALL_HELP, find_chromium
from .device import Device

BrowserDevice = Device   # the name to use where runtime.Device is imported too
_shared: list = []


def unavailable_reason() -> str | None:
    """Why no browser can be started (None: a Chromium binary is found; it may
    still fail to start)."""
    try:
        return None if find_chromium() is not None else INSTALL_HELP
    except BrowserError as e:
        return str(e)


def chromium_available() -> bool:
    """True when a Chromium binary is found (it may still fail to start)."""
    return unavailable_reason() is None


def get_device(*, timeout: float | None = None) -> Device:
    """The process's browser device, started on first use and closed at exit.
    ``timeout`` (seconds per call) updates the shared device's deadline."""
    if not _shared:
        _shared.append(Device(timeout=timeout))
        atexit.register(_shutdown)
    elif timeout is not None:
        _shared[0].timeout = float(timeout)
    return _shared[0]


# Run in a page load_page opens before the page's own scripts: keeps what would
# otherwise reach only its console (an uncaught exception, an unhandled rejection, a
# script or module import that failed to load), so a page that stops is reported.
_PAGE_ERRORS = """
window.__shaderdslPageErrors = [];
addEventListener("error", e => __shaderdslPageErrors.push(e.error !== undefined ?
  String(e.error) : e.target?.tagName === "SCRIPT" ? "a script failed to load: " +
  (e.target.src || "an inline module script (one of its imports: a wrong path, a 404?)") :
  String(e.message)), true);
addEventListener("unhandledrejection", e => __shaderdslPageErrors.push(
  "unhandled rejection: " + String(e.reason)));
"""


def load_page(page, until: str, *, timeout: float = 120.0, screenshot=None):
    """Open ``page`` (a path or URL) in a new tab of the shared browser, wait
    until the JavaScript expression ``until`` is no longer null or undefined,
    save a PNG of the page to ``screenshot`` if given, close the tab and
    return the expression's value (JSON-able). BrowserTimeoutError after ``timeout`` s;
    BrowserError at once where the page throws (uncaught) or a script fails to load
    before ``until`` is set, with what it threw."""
    import json
    import time
    from pathlib import Path

    host = get_device().host
    url = page if "://" in str(page) else Path(page).resolve().as_uri()
    session = host.open(url, timeout, before=_PAGE_ERRORS)
    try:
        deadline = time.monotonic() + timeout
        probe = f"JSON.stringify([{until} ?? null, window.__shaderdslPageErrors ?? []])"
        while (value := json.loads(host.evaluate(probe, timeout, session)))[0] is None:
            if value[1]:
                raise BrowserError(f"{url}: the page stopped before {until} was set: "
                                   + "; ".join(value[1]))
            if time.monotonic() > deadline:
                raise BrowserTimeoutError(f"{url}: {until} still unset after {timeout:g} s")
            time.sleep(0.05)
        value = value[0]
        if screenshot:
            host.capture(session, screenshot, timeout=timeout)
        return value
    finally:
        host.close_tab(session)


def _shutdown() -> None:
    while _shared:
        _shared.pop().close()


__all__ = ["BrowserDevice", "BrowserError", "BrowserTimeoutError", "Buffer", "Device",
           "INSTALL_HELP", "chromium_available", "find_chromium", "get_device", "load_page",
           "unavailable_reason"]
