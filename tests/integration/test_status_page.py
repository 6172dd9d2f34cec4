"""The admin endpoint's status page in a real browser, against a gateway with traffic.

A gateway with an SSMP listener ``hub``, a durable route ``archive`` from
``weather.*`` on it to ``archive.{1}`` on another SSMP listener ``store``
(so the embedded log has a stream), a direct route ``mail`` from a QMQP
listener, and an SSMP upstream ``nowhere`` that cannot connect. A thread
publishes weather on the hub (and another reads what a subscriber of
``store`` gets) while Debian's headless
Chromium (`tests.browser`) loads ``/`` refreshing every second: the tables
show the listeners, routes, upstreams and the log's stream, and the counts
and rates move from one refresh to the next. Then, as a user would, the
admin token goes into the token form (kept in sessionStorage only) and the
live tap of route ``archive`` shows envelopes as they arrive. A screenshot
of the whole page is saved in the test's temporary directory, and one of
the window where ``STATUS_PAGE_SCREENSHOT`` names (the docs' picture:
``STATUS_PAGE_SCREENSHOT=docs/images/status-page.png ./dev test
tests/integration/test_status_page.py``).

Chromium missing: skipped with the reason, failed under ``CI=true``
(``./dev test`` installs it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import Browser, BrowserUnavailable, find_chromium
from tests.integration.harness import GatewayProcess, LineClient, under_ci

pytestmark = pytest.mark.integration

TOKEN = "status-page-t0ken"
NONE = '"\\u2013"'
"""How the page shows a number it does not have yet (an en dash), as a JavaScript string."""
TRAFFIC_SECONDS = 90.0
"""The publisher stops by itself after this, whatever the test does."""

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"
data_dir = "data"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.store]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"
"""

ROUTES = {
    "archive": 'from = "hub"\nmatch = "weather.*"\nto = "store"\naddress = "archive.{1}"\n'
    "durable = true\n",
    "mail": 'from = "mail"\nmatch = "*@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
}


def _chromium() -> None:
    try:
        find_chromium()
    except BrowserUnavailable as exc:
        if under_ci():
            pytest.fail(f"{exc}: CI must run the browser test")
        pytest.skip(str(exc))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """The gateway above, with the admin token in its secrets file."""
    process = GatewayProcess(
        tmp_path / "gateway", CONFIG, routes=ROUTES, secrets=f'admin_token = "{TOKEN}"\n'
    ).start()
    yield process
    process.stop()


class _Traffic:
    """Weather published on the hub, and an archive subscriber reading it, until stopped."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self._stop = threading.Event()
        self.published = 0
        self.received = 0
        self._publisher = LineClient(gateway.address("hub"))
        self._subscriber = LineClient(gateway.address("store"))
        self._subscriber.send("LOGIN archivist open", "SUBSCRIBE archive.paris")
        self._subscriber.expect("200")
        self._subscriber.expect("200")
        self._publisher.send("LOGIN forecaster open")
        self._publisher.expect("200")
        self._threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._read, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _publish(self) -> None:
        deadline = time.monotonic() + TRAFFIC_SECONDS
        cities = ("paris", "oslo", "lima", "paris")
        while not self._stop.is_set() and time.monotonic() < deadline:
            lines = [f"MCAST weather.{cities[n % 4]} sunny {n}" for n in range(20)]
            self._publisher.send(*lines)
            for _ in lines:
                self._publisher.expect_code(200)
            self.published += len(lines)
            self._stop.wait(0.05)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self._subscriber.read_line()
            except (OSError, EOFError):
                return
            self.received += 1

    def stop(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=10)
        self._publisher.close()
        self._subscriber.close()
        self._threads[1].join(timeout=10)


def _cell(table: str, row: str, key: str, what: str = "dataset.value") -> str:
    """A JavaScript expression: one cell of a status table (its raw number by default)."""
    return (
        f'(document.querySelector(\'#{table} tr[data-name="{row}"] td[data-key="{key}"]\')'
        f" || {{dataset: {{}}}}).{what}"
    )


def test_status_page_shows_the_gateway_live(gateway: GatewayProcess, tmp_path: Path) -> None:
    """The page's tables fill, their counts and rates move, and the live tap shows envelopes."""
    _chromium()
    host, port = gateway.address("admin")
    traffic = _Traffic(gateway)
    try:
        with Browser(tmp_path / "profile") as browser:
            browser.open(f"http://{host}:{port}/?refresh=1")
            messages_in = _cell("listeners", "hub", "messages_in")
            first = int(browser.wait_for(messages_in))
            routed = int(browser.evaluate("document.getElementById('total-routed').dataset.value"))
            # A later refresh shows more, and a rate computed from two answers.
            browser.wait_for(f"Number({messages_in}) > {first}")
            browser.wait_for(
                f"Number(document.getElementById('total-routed').dataset.value) > {routed}"
            )
            shown_rate = _cell("listeners", "hub", "messages_in_rate", "textContent")
            rate = browser.wait_for(f"(t => t && t !== {NONE} && t !== '0' && t)({shown_rate})")
            assert float(rate.replace(",", "")) > 0
            assert browser.evaluate(_cell("listeners", "hub", "listening", "textContent")) == (
                "listening"
            )
            assert int(browser.evaluate(_cell("listeners", "hub", "connections"))) == 1
            assert int(browser.wait_for(_cell("listeners", "store", "messages_out"))) > 0
            assert int(browser.wait_for(_cell("routes", "archive", "messages"))) > 0
            none = json.loads(NONE)
            assert browser.evaluate(_cell("routes", "archive", "lag", "textContent")) != none
            assert browser.evaluate(_cell("routes", "mail", "lag", "textContent")) == none
            assert browser.evaluate(_cell("upstreams", "nowhere", "state", "textContent")) in (
                "connecting",
                "stopped",
            )
            stream = "msggateway.route.archive"
            assert int(browser.wait_for(_cell("streams", stream, "last_offset"))) >= 0
            assert browser.evaluate("document.getElementById('health').textContent") == ("degraded")
            assert browser.evaluate("document.getElementById('nodes-section').hidden") is True

            # The live tap, as a user starts it: the token first, then the route.
            browser.evaluate(
                "document.getElementById('token').value = "
                f"'{TOKEN}'; document.getElementById('token-form').requestSubmit()"
            )
            assert browser.evaluate("sessionStorage.getItem('msggateway.admin-token')") == TOKEN
            assert browser.evaluate("localStorage.length") == 0
            assert browser.evaluate("document.getElementById('token').value") == ""
            browser.evaluate(
                "document.getElementById('tap-target').value = 'route:archive';"
                " document.getElementById('tap-form').requestSubmit()"
            )
            rows = "document.querySelectorAll('#tap tbody tr[data-name]:not([data-name=\"\"])')"
            browser.wait_for(f"{rows}.length >= 3")
            assert "archive → store:archive." in browser.evaluate(f"{rows}[0].textContent")
            browser.wait_for("document.getElementById('tap-status').textContent.includes('seen')")
            shot = tmp_path / "status-page.png"
            browser.screenshot(shot)
            assert shot.read_bytes().startswith(b"\x89PNG")
            docs = os.environ.get("STATUS_PAGE_SCREENSHOT")
            if docs:  # the docs' picture: what a browser window shows
                browser.screenshot(Path(docs), full_page=False)
            browser.evaluate("document.getElementById('tap-stop').click()")
            browser.wait_for("document.getElementById('tap-status').textContent === 'Tap stopped.'")
    finally:
        traffic.stop()
    assert traffic.published > 0
    assert traffic.received > 0


def test_the_tap_asks_again_for_a_refused_token(gateway: GatewayProcess, tmp_path: Path) -> None:
    """A wrong token is refused (401): the page says so, forgets it and shows the form again."""
    _chromium()
    host, port = gateway.address("admin")
    with Browser(tmp_path / "profile") as browser:
        browser.open(f"http://{host}:{port}/")
        browser.wait_for("!!document.querySelector('#tap-target option')")
        browser.evaluate(
            "document.getElementById('token').value = 'wrong';"
            " document.getElementById('token-form').requestSubmit();"
            " document.getElementById('tap-target').value = 'listener:hub';"
            " document.getElementById('tap-form').requestSubmit()"
        )
        status = browser.wait_for(
            "(t => t.includes('401') && t)(document.getElementById('tap-status').textContent)"
        )
        assert "a valid admin token is needed" in status
        assert browser.evaluate("sessionStorage.getItem('msggateway.admin-token')") is None
        assert browser.evaluate("document.getElementById('token-form').hidden") is False
