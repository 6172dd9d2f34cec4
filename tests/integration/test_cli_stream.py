"""``msggateway stream publish|consume`` against a real gateway process.

One gateway serves the stream protocol over its embedded log, on plain TCP
and on TLS (a test PKI, client certificates optional; guest may log in from
loopback). The command runs in-process through `gateway.cli.main` (blocking
sockets against the twistd subprocess); each test uses streams of its own.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator

import pytest

from gateway.cli import main
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.secure]
protocol = "stream"
endpoint = "{tls}"
guest = true
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with a plain and a TLS stream listener."""
    config = CONFIG.format(tls=mtls_endpoint(pki, verify="optional"))
    process = GatewayProcess(tmp_path_factory.mktemp("cli-stream"), config).start()
    yield process
    process.stop()


def run(*argv: str) -> tuple[int, str, str]:
    """Run the command line; its status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err, io.BytesIO())
    return status, out.getvalue(), err.getvalue()


def address(gateway: GatewayProcess, listener: str = "streams") -> str:
    """``HOST:PORT`` of a listener."""
    host, port = gateway.address(listener)
    return f"{host}:{port}"


def test_publish_then_consume(gateway: GatewayProcess) -> None:
    """Three messages confirmed in order, then read back from the first offset and from 1."""
    where = ("--stream", "s-basic", "-a", address(gateway))
    status, out, err = run("stream", "publish", *where, "--create", "one", "two", "three four")
    assert (status, out, err) == (0, "1 accepted\n2 accepted\n3 accepted\n", "")
    assert run("stream", "consume", *where) == (0, "0 one\n1 two\n2 three four\n", "")
    status, out, _ = run("stream", "consume", *where, "--offset", "1", "--json", "--count", "1")
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert status == 0
    assert (record["stream"], record["offset"], record["body"]) == ("s-basic", 1, "two")
    assert run("stream", "consume", *where, "--offset", "next") == (0, "", "")


def test_publisher_name_continues_its_ids(gateway: GatewayProcess) -> None:
    """With --publisher the ids go on from the stored sequence; --header lands in the entry."""
    where = ("--stream", "s-dedup", "-a", address(gateway), "--publisher", "cli", "--json")
    status, out, _ = run("stream", "publish", *where, "--create", "a", "b")
    assert status == 0
    assert [json.loads(line)["publishing_id"] for line in out.splitlines()] == [1, 2]
    status, out, _ = run("stream", "publish", *where, "--header", "k=v", "c")
    assert status == 0 and json.loads(out)["publishing_id"] == 3
    status, out, _ = run("stream", "consume", "--stream", "s-dedup", "-a", address(gateway),
                         "--json", "--offset", "last")  # fmt: skip
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert (record["body"], record["headers"]) == ("c", {"k": "v"})


def test_follow_waits_for_new_messages(gateway: GatewayProcess) -> None:
    """Consume --follow from the offset after the end prints what is published next."""
    where = ("--stream", "s-follow", "-a", address(gateway))
    assert run("stream", "publish", *where, "--create", "old")[0] == 0
    got: list[tuple[int, str, str]] = []
    follow = ("--offset", "1", "--follow", "--count", "2", "--timeout", "20")
    reader = threading.Thread(target=lambda: got.append(run("stream", "consume", *where, *follow)))
    reader.start()
    assert run("stream", "publish", *where, "new", "newer")[0] == 0
    reader.join(30)
    [(status, out, err)] = got
    assert (status, out, err) == (0, "1 new\n2 newer\n", "")


def test_refusals(gateway: GatewayProcess) -> None:
    """A missing stream: exit 1 and the server's reason, for either direction."""
    where = ("--stream", "s-missing", "-a", address(gateway))
    status, out, err = run("stream", "publish", *where, "x")
    assert (status, out) == (1, "")
    assert err == "msggateway: cannot publish to s-missing (stream does not exist)\n"
    status, _, err = run("stream", "consume", *where)
    assert status == 1 and "stream does not exist" in err


def test_over_tls_with_a_client_certificate(gateway: GatewayProcess, pki: Pki) -> None:
    """--cafile, --cert and --key: the same publish and consume over TLS."""
    where = ("--stream", "s-tls", "-a", address(gateway, "secure"), "--cafile", str(pki.ca_cert),
             "--cert", str(pki.alice_cert), "--key", str(pki.alice_key))  # fmt: skip
    assert run("stream", "publish", *where, "--create", "secret") == (0, "1 accepted\n", "")
    assert run("stream", "consume", *where) == (0, "0 secret\n", "")
