"""One headless Chromium, driven over ``--remote-debugging-pipe``.

The DevTools protocol (CDP) runs over two pipes the browser finds on file
descriptors 3 (commands in) and 4 (replies out), each message JSON ended by
a NUL byte: nothing but the standard library is needed (no Playwright, no
websocket). Every call has a deadline; a browser that misses it is killed
with its whole process group (it runs in a session of its own), so a page
hung by an endless kernel never outlives the error that reports it.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import time

from ..errors import BrowserError, BrowserTimeoutError

ENV_BINARY = "SHADERDSL_CHROMIUM"
ENV_FLAGS = "SHADERDSL_CHROMIUM_FLAGS"
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
FLAGS = ("--headless=new", "--no-sandbox", "--enable-unsafe-webgpu",
         "--enable-webgpu-developer-features", "--remote-debugging-pipe", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-sync",
         "--disable-background-networking", "--disable-component-update", "--mute-audio",
         "--disable-dev-shm-usage", "--allow-file-access-from-files")
INSTALL_HELP = (
    "no Chromium found: set SHADERDSL_CHROMIUM to a Chromium or Chrome binary, or put "
    "chromium on PATH. On Debian/Ubuntu, as root: `apt-get install chromium` "
    "(scripts/setup.sh does it); any Chrome 121 or newer with WebGPU works.")


def find_chromium() -> str | None:
    """The browser binary: $SHADERDSL_CHROMIUM, else the first of NAMES on PATH."""
    given = os.environ.get(ENV_BINARY)
    if given:
        path = shutil.which(given) or (given if os.access(given, os.X_OK) else None)
        if path is None:
            raise BrowserError(f"{ENV_BINARY}={given!r} is not an executable file")
        return path
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    path = find_chromium()
    if path is None:
        raise BrowserError(INSTALL_HELP)
    return path


class Chromium:
    """A running browser and its CDP connection; ``call`` sends one command
    and waits for its reply, ``close``/``kill`` end it (and remove its profile)."""

    def __init__(self, binary: str | None = None, *, timeout: float = 30.0):
        self.binary = binary or require_chromium()
        self.profile = tempfile.mkdtemp(prefix="shaderdsl-chromium-")
        self.log_path = os.path.join(self.profile, "chromium.log")
        self._next_id = 0
        self._parts: list[bytes] = []  # bytes read after the last whole message
        self.events: list = []  # events read while waiting for replies (kept for a page to look at)
        started = time.perf_counter()
        self.pid, self._to_browser, self._from_browser = self._spawn()
        try:
            self.version = self.call("Browser.getVersion", timeout=timeout)["product"]
        except BrowserError:
            self.kill()
            raise
        self.launch_seconds = time.perf_counter() - started

    def _spawn(self) -> tuple[int, int, int]:
        """Start the browser with its command pipe on fd 3 and reply pipe on fd 4."""
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        extra = os.environ.get(ENV_FLAGS, "").split()
        argv = [self.binary, *FLAGS, f"--user-data-dir={self.profile}", *extra, "about:blank"]
        actions = [(os.POSIX_SPAWN_DUP2, cmd_r, 3), (os.POSIX_SPAWN_DUP2, out_w, 4),
                   (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)]
        try:
            pid = os.posix_spawn(self.binary, argv, dict(os.environ), file_actions=actions,
                                 setsid=True)
        except OSError as e:
            raise BrowserError(f"cannot start {self.binary}: {e}") from e
        finally:
            for fd in (cmd_r, out_w, log):
                os.close(fd)
        for fd in (cmd_w, out_r):  # bigger pipes: fewer reads and writes per megabyte
            try:
                fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
            except OSError:
                pass
        return pid, cmd_w, out_r

    @property
    def alive(self) -> bool:
        return self._to_browser is not None

    def _pipes(self) -> tuple[int, int]:
        """The command pipe and the reply pipe; BrowserError once the browser is gone."""
        if self._to_browser is None or self._from_browser is None:
            raise BrowserError("the browser was shut down")
        return self._to_browser, self._from_browser

    def log_tail(self, lines: int = 8) -> str:
        """The end of the browser's log, without the D-Bus complaints of a headless machine."""
        try:
            with open(self.log_path, errors="replace") as f:
                kept = [line for line in f if ":ERROR:dbus/" not in line]
        except OSError:
            return ""
        return "".join(kept[-lines:]).strip() or "(nothing)"

    def call(self, method: str, params: dict | None = None, *, session: str | None = None,
             timeout: float = 30.0) -> dict:
        """Send one CDP command and return its ``result``; BrowserTimeoutError
        after ``timeout`` seconds, BrowserError if CDP answers with an error."""
        if not self.alive:
            raise BrowserError("the browser was shut down")
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._write(json.dumps(msg).encode() + b"\0")
        reply = self._wait(self._next_id, method, time.monotonic() + timeout, timeout)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')} "
                               f"{reply['error'].get('data', '')}".strip())
        return reply.get("result", {})

    def _write(self, data: bytes) -> None:
        view, to_browser = memoryview(data), self._pipes()[0]
        try:
            while view:
                view = view[os.write(to_browser, view):]
        except OSError as e:
            tail = self.log_tail()
            self.kill()
            raise BrowserError(f"the browser went away ({e}); its log ends:\n{tail}") from None

    def _wait(self, wanted: int, method: str, deadline: float, timeout: float) -> dict:
        """Read messages until the reply ``wanted``; keep the events seen meanwhile."""
        from_browser = self._pipes()[1]
        while True:
            for raw in self._messages():
                msg = json.loads(raw)
                if msg.get("id") == wanted:
                    return msg
                if "method" in msg:
                    self.events.append(msg)
                    del self.events[:-200]
            left = deadline - time.monotonic()
            ready = select.select([from_browser], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise BrowserTimeoutError(f"{method}: no answer from the browser in {timeout:g} s")
            chunk = os.read(from_browser, 1 << 20)
            if not chunk:
                tail = self.log_tail()
                self.kill()
                raise BrowserError(f"the browser exited during {method}; its log ends:\n{tail}")
            self._parts.append(chunk)

    def _messages(self) -> list[bytes]:
        """Whole messages received so far (a reply of megabytes arrives in many
        reads: the parts are joined once its end is there, not at every read)."""
        if not self._parts or b"\0" not in self._parts[-1]:
            return []
        data = b"".join(self._parts)
        *whole, rest = data.split(b"\0")
        self._parts = [rest] if rest else []
        return whole

    def close(self, grace: float = 3.0) -> None:
        """Ask the browser to quit; kill it if it has not within ``grace`` seconds."""
        if self.alive:
            try:
                self.call("Browser.close", timeout=grace)
            except BrowserError:
                pass
            if not _reaped(self.pid, grace):
                _kill_group(self.pid)
        self.kill()

    def kill(self) -> None:
        """End the browser's process group now and forget the connection."""
        if self.alive:
            _kill_group(self.pid)
            for fd in self._pipes():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._to_browser = self._from_browser = None
        shutil.rmtree(self.profile, ignore_errors=True)


def _reaped(pid: int, within: float) -> bool:
    """Wait up to ``within`` seconds for ``pid`` to exit; True once it has."""
    deadline = time.monotonic() + within
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _kill_group(pid: int) -> None:
    """SIGKILL the browser's session (its renderer and GPU processes too) and reap it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _reaped(pid, 5.0)
