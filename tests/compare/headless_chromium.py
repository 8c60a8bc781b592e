"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`): no port, no
websocket library, nothing downloaded. The browser reads commands on its fd 3 and writes replies and events on its
fd 4, each a JSON message ended by a NUL byte.

    with Chromium(profile_dir) as browser:
        value = browser.open_and_evaluate("file:///.../report.html", "document.title")

A plain module rather than `conftest` (see tests/tiny_models.py).
"""

import fcntl
import json
import os
import select
import shutil
import subprocess
import time

import pytest


# Debian's chromium; flags: no sandbox (root in CI), no GPU, no background traffic (updates, sync, first-run pages),
# and every host name resolved to nothing, so that the page cannot reach the network even if it tried.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-pipe"]


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


def chromium_path() -> str | None:
    return shutil.which("chromium")


NOT_INSTALLED = "chromium is not installed (optional: apt-get install -y chromium; .ci/run installs it)"


def under_ci() -> bool:
    """Whether the tests run under CI: the environment variable CI is "true" or "1" (GitHub Actions, GitLab CI and
    most others set CI=true; .ci/run sets it too)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_chromium() -> str:
    """Chromium's path. Without a browser the calling test skips with NOT_INSTALLED (the browser is optional for a
    user's `make test`), except under CI (`under_ci`), where it fails: CI must never pass without having looked at
    the page."""
    exe = chromium_path()
    if exe is None:
        if under_ci():
            pytest.fail(f"{NOT_INSTALLED}; CI=true, so the browser test must run")
        pytest.skip(NOT_INSTALLED)
    return exe


class Chromium:
    def __init__(self, profile_dir, timeout: float = 60.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise FileNotFoundError("chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
        self.timeout = timeout
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()
        # The browser's ends are moved above 9 first: as fds 3 or 4 themselves the shell line below would close them.
        commands_r, replies_w = (_above_9(fd) for fd in (commands_r, replies_w))
        # bash (dash takes single-digit fds only) moves the two pipe ends to fds 3 and 4, where the browser reads them.
        script = f'exec "$0" "$@" 3<&{commands_r} 4>&{replies_w} {commands_r}<&- {replies_w}>&-'
        self.process = subprocess.Popen(["bash", "-c", script, exe, *FLAGS, f"--user-data-dir={profile_dir}",
                                         "about:blank"], pass_fds=(commands_r, replies_w),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(commands_r)
        os.close(replies_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stderr.close()
        os.close(self._commands)
        os.close(self._replies)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from chromium")
            ready, _, _ = select.select([self._replies], [], [], left)
            if ready:
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium exited: {self.process.stderr.read().decode(errors='replace')[-2000:]}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept in `events`."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            self.events.append(self._message(deadline))

    def open_and_evaluate(self, url: str, expression: str) -> object:
        """Load `url` in a new page, wait for its load event, and return the value of `expression` (a promise is
        awaited). Every request the page made is in `requests` afterwards."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable", session=session)
        self.send("Network.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session)
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page script failed: {result['exceptionDetails']}")
        self.requests = [e["params"]["request"]["url"] for e in self.events
                         if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session]
        return result["result"].get("value")
