"""A real browser for tests: Debian's headless Chromium, driven over the DevTools protocol.

``./dev test`` installs Debian's ``chromium`` when it is missing (as root);
nothing here installs anything. `find_chromium` says where it is, or raises
`BrowserUnavailable`. `Browser` runs it headless with
``--remote-debugging-pipe``: DevTools protocol messages, JSON each ended by a
NUL byte, go to the browser on its file descriptor 3 and come back on 4, so
no port is opened and no WebSocket library is needed. Every wait has a
deadline; the browser's profile lives in a temporary directory the caller
gives, and the process is killed on `close`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

__all__ = ["Browser", "BrowserError", "BrowserUnavailable", "find_chromium"]

CANDIDATES: Final = ("chromium", "chromium-browser")
COMMAND_TIMEOUT_SECONDS: Final = 30.0


class BrowserUnavailable(Exception):  # noqa: N818  # named like tests.rabbitmq's
    """No Chromium on this machine."""


class BrowserError(Exception):
    """The browser answered a command with an error, or did not answer in time."""


def find_chromium() -> str:
    """The path of Debian's chromium.

    Raises:
        BrowserUnavailable: It is not installed.
    """
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable(
        "chromium is not installed (./dev test installs Debian's package when run as root)"
    )


_LAUNCHER: Final = """
import fcntl, os, sys
given = [int(fd) for fd in sys.argv[1:3]]
moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in given]
for fd in given:
    os.close(fd)
for target, fd in zip((3, 4), moved):
    os.dup2(fd, target)
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""
"""Puts the pipes' ends at 3 (commands) and 4 (answers), then runs the browser."""


class Browser:
    """A headless Chromium with one page, driven over the DevTools protocol.

    Args:
        profile: An empty directory for the browser's profile.
        width: The page's width in CSS pixels.
        height: The page's height.
    """

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000) -> None:
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        executable = find_chromium()
        # The browser reads commands on fd 3 and writes answers on fd 4: a small
        # launcher puts the pipes there, then becomes the browser.
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _LAUNCHER,
                str(to_browser_read),
                str(from_browser_write),
                executable,
                "--headless",
                "--no-sandbox",  # root, in a container: the sandbox cannot start
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(to_browser_read, from_browser_write),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._session = ""
        try:
            target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})
            self._session = attached["sessionId"]
            self.call("Page.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
        except BaseException:
            self.close()
            raise

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a command to the page and return its result.

        Raises:
            BrowserError: An error answer, or none within `COMMAND_TIMEOUT_SECONDS`.
        """
        return self._call(method, params, self._session)

    def _call(
        self, method: str, params: dict[str, Any] | None = None, session: str = ""
    ) -> dict[str, Any]:
        self._next_id += 1
        number = self._next_id
        message: dict[str, Any] = {"id": number, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_SECONDS
        while True:
            answer = self._read(deadline)
            if answer.get("id") != number:
                self._events.append(answer)
                continue
            if "error" in answer:
                raise BrowserError(f"{method}: {answer['error']}")
            result: dict[str, Any] = answer.get("result", {})
            return result

    def _read(self, deadline: float) -> dict[str, Any]:
        """The next message from the browser."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._from_browser, selectors.EVENT_READ)
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise BrowserError("the browser did not answer in time")
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError("the browser exited")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        found: dict[str, Any] = json.loads(raw)
        return found

    def open(self, url: str) -> None:
        """Load ``url`` and wait until its load event."""
        self._events.clear()
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + COMMAND_TIMEOUT_SECONDS
        while not any(event.get("method") == "Page.loadEventFired" for event in self._events):
            self._events.append(self._read(deadline))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited).

        Raises:
            BrowserError: It threw.
        """
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = COMMAND_TIMEOUT_SECONDS) -> Any:
        """Evaluate ``expression`` until it is truthy; return its value.

        Raises:
            BrowserError: It stayed falsy for ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path, *, full_page: bool = True) -> None:
        """Save a PNG of the page (all of it, or the viewport)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {
                "x": 0,
                "y": 0,
                "width": size["width"],
                "height": size["height"],
                "scale": 1,
            }
        data = self.call("Page.captureScreenshot", params)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        """End the browser."""
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(timeout=10)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
