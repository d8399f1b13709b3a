"""The harness page: a file:// page (a secure context, so WebGPU is on) in
the browser, with ``window.sd`` (``host_js``) loaded and a GPUDevice made.

``Host.call(name, *args)`` runs ``sd.call`` there and returns its result;
the error kinds the page reports come back as :class:`PageError` for the
device to turn into the library's exceptions. ``Host.restart`` throws the
whole browser away and starts a fresh one: the only way out of a page hung
by a kernel that never ends (WebGPU has no way to cancel one).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import BrowserError, BrowserTimeoutError
from .chromium import Chromium
from .host_js import HOST_HTML, HOST_JS

# Features the device asks for whenever the adapter has them (WebGPU's spellings).
WANTED = ("shader-f16", "subgroups", "timestamp-query", "chromium-experimental-subgroup-matrix")


class PageError(BrowserError):
    """An error the page reported: ``kind`` is compile, pipeline, validation,
    out-of-memory, lost, webgpu or js; ``detail`` is what came with it."""

    def __init__(self, kind: str, message: str, detail: dict):
        self.kind, self.detail = kind, detail
        super().__init__(f"browser {kind} error: {message}")


class Host:
    """One browser, one harness page, one GPUDevice."""

    def __init__(self, binary: str | None = None, *, timeout: float = 30.0):
        self.binary = binary
        self.launch_timeout = timeout
        self.browser: Chromium | None = None
        self.session = None
        self.generation = 0      # bumped at each (re)start: buffers of an older one are gone
        self.info: dict = {}
        self._targets: dict = {}  # session id -> target id of the tabs ``open`` made
        self.start()

    def start(self) -> None:
        """Launch the browser, open the harness page, make the GPUDevice."""
        started = time.perf_counter()
        self.browser = Chromium(self.binary, timeout=self.launch_timeout)
        try:
            self.session = self.open(self._harness_url(), self.launch_timeout)
            self.evaluate(HOST_JS, self.launch_timeout)
            self.info = self.call("init", list(WANTED), timeout=self.launch_timeout)
        except BrowserError:
            self.browser.kill()
            raise
        self.generation += 1
        self.launch_seconds = time.perf_counter() - started

    @property
    def chromium(self) -> Chromium:
        """The running browser; BrowserError once the device was closed."""
        if self.browser is None:
            raise BrowserError("the browser device was closed")
        return self.browser

    def _harness_url(self) -> str:
        path = os.path.join(self.chromium.profile, "shaderdsl-host.html")
        with open(path, "w") as f:
            f.write(HOST_HTML)
        return "file://" + path

    def open(self, url: str, timeout: float, before: str = "") -> str:
        """A new tab at ``url``, loaded; its CDP session id. ``before``: a script run in
        the page before any of its own (the tab is opened blank, then navigated)."""
        target = self.chromium.call("Target.createTarget", {"url": "about:blank" if before
                                                            else url}, timeout=timeout)
        session = self.chromium.call("Target.attachToTarget", {"targetId": target["targetId"],
                                                               "flatten": True},
                                     timeout=timeout)["sessionId"]
        self._targets[session] = target["targetId"]
        if before:
            self.chromium.call("Page.enable", session=session, timeout=timeout)
            self.chromium.call("Page.addScriptToEvaluateOnNewDocument", {"source": before},
                               session=session, timeout=timeout)
            self.chromium.call("Page.navigate", {"url": url}, session=session, timeout=timeout)
        deadline = time.monotonic() + timeout
        check = "location.href !== 'about:blank' && document.readyState === 'complete'"
        while not self.evaluate(check, timeout, session):
            if time.monotonic() > deadline:
                raise BrowserTimeoutError(f"page {url} did not load in {timeout:g} s")
            time.sleep(0.01)
        return session

    def close_tab(self, session: str) -> None:
        """Close a tab opened with ``open``."""
        target = self._targets.pop(session, None)
        if target is not None and self.browser is not None and self.browser.alive:
            self.browser.call("Target.closeTarget", {"targetId": target})

    def capture(self, session: str, path, width: int = 900, timeout: float = 30.0) -> None:
        """A PNG of the whole page in tab ``session`` (Page.captureScreenshot)."""
        import base64

        height = self.evaluate("document.documentElement.scrollHeight", timeout, session)
        self.chromium.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
            session=session, timeout=timeout)
        shot = self.chromium.call("Page.captureScreenshot", {"format": "png"},
                                  session=session, timeout=timeout)
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))

    def evaluate(self, expression: str, timeout: float, session: str | None = None) -> Any:
        """The value of a JavaScript expression (promises awaited), returned by value."""
        result = self.chromium.call("Runtime.evaluate", {
            "expression": expression, "awaitPromise": True, "returnByValue": True},
            session=session or self.session, timeout=timeout)
        if "exceptionDetails" in result:
            ex = result["exceptionDetails"]
            text = ex.get("exception", {}).get("description") or ex.get("text")
            raise BrowserError(f"JavaScript error in the page: {text}")
        return result["result"].get("value")

    def call(self, name: str, *args, timeout: float = 30.0) -> Any:
        """``sd.call(name, args)`` in the harness page; PageError for a reported error."""
        out = self.evaluate(f"sd.call({json.dumps(name)}, {json.dumps(args)})", timeout)
        if isinstance(out, dict) and "error" in out:
            err = out["error"]
            raise PageError(err.get("kind", "js"), err.get("message", ""), err)
        return out

    def restart(self) -> None:
        """Kill the browser (whatever it is doing) and start a fresh one."""
        if self.browser is not None:
            self.browser.kill()
        self.start()

    def close(self) -> None:
        if self.browser is not None:
            self.browser.close()
            self.browser = None
