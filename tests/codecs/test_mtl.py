"""Tests for `gateway.codecs.mtl`: control requests and replies, data commands.

Headers written by hand from the spec's field lists, the spec's JSON
examples (its 202 example is not valid JSON and is refused as such),
hypothesis round trips of every data command, and ill-formed input.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import mtl


def test_control_requests_from_the_spec() -> None:
    """Command names in any case; bodies are JSON objects; anything else is dropped."""
    body = b'{"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}'
    request = mtl.parse_request([b"Connection.OPEN", body])
    assert request == mtl.ControlRequest(
        "connection.open", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}
    )
    spec_202 = b'{"status": "Data Lease", "port": port number "lease" : "data lease"}'
    for frames in ([b"Connection.Open"], [b"a", b"{}", b"c"], [b"x", b"not json"], [b"x", spec_202],
                   [b"x", b"[1, 2]"], [b"\xff", b"{}"]):  # fmt: skip
        assert mtl.parse_request(frames) is None


def test_replies() -> None:
    """Three digits, then the JSON body (valid JSON, unlike the spec's 202 example)."""
    status, body = mtl.reply(202, {"status": "Data Lease", "port": 5556, "lease": "L"})
    assert status == b"202"
    assert json.loads(body) == {"status": "Data Lease", "port": 5556, "lease": "L"}


def test_headers_by_hand() -> None:
    """Each command's header from the spec's field list."""
    seq = b"\x00\x00\x00\x00\x00\x00\x00\x07"
    assert mtl.encode_data(mtl.Lease(7, "abc")) == [b"\x01" + seq + b"\x03abc", b""]
    assert mtl.encode_data(mtl.Response(7, 403)) == [b"\x02" + seq, b"403"]
    assert mtl.encode_data(mtl.Summon(7, "resource")) == [b"\x03" + seq + b"\x08resource", b""]
    assert mtl.encode_data(mtl.Dismiss(7, "r")) == [b"\x04" + seq + b"\x01r", b""]
    assert mtl.encode_data(mtl.Content(7, "", {}, b"hi")) == [
        b"\x05" + seq + b"\x00" + b"\x00\x00\x00\x00",
        b"hi",
    ]
    assert mtl.encode_data(mtl.Confirm(7, True)) == [b"\x06" + seq + b"\x01", b""]
    assert mtl.encode_data(mtl.Reject(7, False, True)) == [b"\x07" + seq + b"\x00\x01", b""]
    assert mtl.encode_data(mtl.Ping()) == [b"\x08", b""]
    assert mtl.encode_data(mtl.Pong()) == [b"\x09", b""]


sequences = st.integers(0, 2**64 - 1)
names = st.text(max_size=30).filter(lambda t: len(t.encode()) <= 255)
values = st.none() | st.booleans() | st.integers(0, 2**40) | names
commands = st.one_of(
    st.builds(mtl.Lease, sequences, names),
    st.builds(mtl.Response, sequences, st.integers(100, 599)),
    st.builds(mtl.Summon, sequences, names),
    st.builds(mtl.Dismiss, sequences, names),
    st.builds(
        mtl.Content,
        sequences,
        names,
        st.dictionaries(
            names, st.none() | st.booleans() | st.integers(0, 2**40) | names, max_size=3
        ),
        st.binary(max_size=64),
    ),
    st.builds(mtl.Confirm, sequences, st.booleans()),
    st.builds(mtl.Reject, sequences, st.booleans(), st.booleans()),
    st.just(mtl.Ping()),
    st.just(mtl.Pong()),
)


@given(commands)
def test_round_trip(command: mtl.DataCommand) -> None:
    """Every data command decodes to itself."""
    assert mtl.decode_data(mtl.encode_data(command)) == command


@given(st.lists(st.binary(max_size=40), max_size=3))
def test_garbage_raises_only_mtl_errors(frames: list[bytes]) -> None:
    """Arbitrary frames decode or raise MTLError."""
    with contextlib.suppress(mtl.MTLError):
        mtl.decode_data(frames)


def test_ill_formed_data_commands() -> None:
    """Wrong frame counts, unknown types, cut fields, trailing bytes, bad booleans."""
    seq = b"\x00" * 8
    for frames in ([b"\x08"], [b"\x08", b"", b""], [b"\x0a", b""], [b"\x01\x00", b""],
                   [b"\x08x", b""], [b"\x06" + seq + b"\x02", b""], [b"\x02" + seq, b"20"],
                   [b"", b""]):  # fmt: skip
        with pytest.raises(mtl.MTLError):
            mtl.decode_data(frames)
    with pytest.raises(mtl.MTLLocalError):
        mtl.encode_data(mtl.Summon(-1, "x"))
