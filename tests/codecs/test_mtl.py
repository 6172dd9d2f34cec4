"""Tests for `gateway.codecs.mtl`: control requests and replies, data commands.

Headers written by hand from the spec's field lists, the spec's JSON
examples (its 202 example is not valid JSON and is refused as such),
hypothesis round trips of every data command, and ill-formed input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import fieldtable, mtl


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


def test_deeply_nested_json_is_ill_formed_and_dropped() -> None:
    """A body nesting past MAX_JSON_DEPTH is dropped like invalid JSON, never a RecursionError."""
    assert mtl.parse_request([b"connection.open", b"[" * 200_000]) is None
    deep = b'{"a": ' + b"[" * (mtl.MAX_JSON_DEPTH + 1) + b"]" * (mtl.MAX_JSON_DEPTH + 1) + b"}"
    assert mtl.parse_request([b"connection.open", deep]) is None
    within = b'{"a": ' + b"[" * (mtl.MAX_JSON_DEPTH - 1) + b"]" * (mtl.MAX_JSON_DEPTH - 1) + b"}"
    assert mtl.parse_request([b"connection.open", within]) is not None


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    """Only structure nests: a string full of brackets (and escaped quotes) is fine."""
    body = json.dumps({"a": '\\"[{' * 100, "b": [[1]]}).encode()
    request = mtl.parse_request([b"connection.open", body])
    assert request is not None and request.body["b"] == [[1]]


json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}\\"ab', max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=60,
)


@given(json_texts)
def test_depth_check_agrees_with_the_structure(value: object) -> None:
    """json_depth_within measures the real nesting of any JSON value."""

    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    data = json.dumps(value).encode()
    for limit in (0, 1, 2, 5):
        assert mtl.json_depth_within(data, limit) == (depth(value) <= limit)


@given(st.lists(st.binary(max_size=60), max_size=3))
def test_arbitrary_control_frames_parse_or_are_dropped(frames: list[bytes]) -> None:
    """Any frames give a request or None (dropped); no other exception escapes."""
    request = mtl.parse_request(frames)
    assert request is None or isinstance(request.body, dict)


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


# The spec's JSON examples, as printed ("Client Authentication" to "Requesting a
# Data Lease"), with the placeholders it leaves in them.
SPEC_REQUESTS = {
    b"Connection.Open": (
        b'{\n    "protocol": {\n        "name": "MTL",\n        "version": 1\n    },\n'
        b'    "virtual-host": "test-env"\n}'
    ),
    b"Connection.Authorize": (
        b'{\n    "mechanism" : "mechanism name",\n    "response" : "BASE64-encoded blob"\n}'
    ),
    b"Connection.Profile": b'{\n    "profile" : "profile name"\n}',
    b"Connection.Reader": (
        b'{\n    "resources": [ "resource name", "resource name", ...],\n'
        b'    "confirm": "none | full"\n}'
    ),
    b"Connection.Writer": (
        b'{\n    "resources": [ "resource name", "resource name"],\n    "confirm": "none | full"\n}'
    ),
}
SPEC_REPLIES = {
    b"201": b'{\n    "status": "Ready",\n    "profiles": [ "profile name", "profile name"]\n}',
    b"401": b'{\n    "status": "Unauthorized",\n    "mechanisms": [ "mechanism name"]\n}',
    b"402": (
        b'{\n    "status": "Challenged",\n    "mechanism": "mechanism name",\n'
        b'    "challenge" : "BASE64-encoded blob"\n}'
    ),
    b"200": b'{\n    "status": "OK"\n}',
    b"202": (
        b'{\n    "status": "Data Lease",\n    "port": port number\n    "lease" : "data lease"\n}'
    ),
    b"501": b'{\n    "status": "Not implemented"\n}',
}


def test_every_spec_request_example() -> None:
    """Each request example parses, except the Reader one whose ``...`` is not JSON."""
    parsed = {name: mtl.parse_request([name, body]) for name, body in SPEC_REQUESTS.items()}
    assert parsed[b"Connection.Reader"] is None  # `...` in a list: dropped as ill-formed
    assert parsed[b"Connection.Open"] == mtl.ControlRequest(
        "connection.open", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}
    )
    assert parsed[b"Connection.Authorize"] == mtl.ControlRequest(
        "connection.authorize", {"mechanism": "mechanism name", "response": "BASE64-encoded blob"}
    )
    assert parsed[b"Connection.Profile"] == mtl.ControlRequest(
        "connection.profile", {"profile": "profile name"}
    )
    assert parsed[b"Connection.Writer"] == mtl.ControlRequest(
        "connection.writer",
        {"resources": ["resource name", "resource name"], "confirm": "none | full"},
    )
    for name, body in SPEC_REQUESTS.items():
        request = mtl.parse_request([name, body])
        if request is not None:  # our encoder says the same thing
            assert mtl.parse_request(mtl.request(name.decode(), request.body)) == request


def test_every_spec_reply_example() -> None:
    """Each reply example parses (202 is not JSON: we send valid JSON instead)."""
    parsed = {status: mtl.parse_reply([status, body]) for status, body in SPEC_REPLIES.items()}
    assert parsed[b"201"] == (201, {"status": "Ready", "profiles": ["profile name"] * 2})
    assert parsed[b"401"] == (401, {"status": "Unauthorized", "mechanisms": ["mechanism name"]})
    assert parsed[b"402"] == (
        402,
        {"status": "Challenged", "mechanism": "mechanism name", "challenge": "BASE64-encoded blob"},
    )
    assert parsed[b"200"] == (200, {"status": "OK"})
    assert parsed[b"501"] == (501, {"status": "Not implemented"})
    assert parsed[b"202"] is None
    ours = {"status": "Data Lease", "port": 5556, "lease": "data lease"}
    assert mtl.parse_reply(mtl.reply(202, ours)) == (202, ours)
    for frames in ([b"20", b"{}"], [b"2x1", b"{}"], [b"201"], [b"201", b"[]"]):
        assert mtl.parse_reply(frames) is None


def test_field_encodings_by_hand() -> None:
    """Integer 8 bytes, shortint 2 bytes (network order), boolean 0 or 1."""
    assert mtl.encode_integer(2**64 - 1) == b"\xff" * 8
    assert mtl.encode_integer(258) == b"\0" * 6 + b"\x01\x02"
    assert mtl.encode_shortint(258) == b"\x01\x02"
    assert mtl.encode_boolean(True) == b"\x01" and mtl.encode_boolean(False) == b"\x00"
    assert mtl.decode_shortint(b"x\x01\x02", 1) == (258, 3)
    assert mtl.decode_integer(b"\0" * 7 + b"\x05") == (5, 8)
    assert mtl.decode_boolean(b"\x00\x01", 1) == (True, 2)
    for bad in (-1, 2**16):
        with pytest.raises(mtl.MTLLocalError):
            mtl.encode_shortint(bad)
    with pytest.raises(mtl.MTLLocalError):
        mtl.encode_integer(2**64)
    for decode, data in ((mtl.decode_shortint, b"\x01"), (mtl.decode_integer, b"\0" * 7),
                         (mtl.decode_boolean, b""), (mtl.decode_boolean, b"\x02")):  # fmt: skip
        with pytest.raises(mtl.MTLError):
            decode(data, 0)  # type: ignore[operator]


@given(st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), st.booleans())
def test_field_round_trips(shortint: int, integer: int, flag: bool) -> None:
    """Each field encoding decodes to itself, one after another in a buffer."""
    data = mtl.encode_shortint(shortint) + mtl.encode_integer(integer) + mtl.encode_boolean(flag)
    value, offset = mtl.decode_shortint(data)
    assert value == shortint
    value, offset = mtl.decode_integer(data, offset)
    assert value == integer
    assert mtl.decode_boolean(data, offset) == (flag, len(data))


def test_content_properties_are_an_amqp_field_table() -> None:
    """Properties use the AMQP 0-9-1 field table: 4-byte size, short-string keys, typed values."""
    header, body = mtl.encode_data(mtl.Content(1, "r", {"k": "v"}, b"x"))
    table = header[1 + 8 + 2 :]
    assert table == b"\x00\x00\x00\x08" + b"\x01k" + b"S\x00\x00\x00\x01v"
    assert mtl.decode_data([header, body]) == mtl.Content(1, "r", {"k": "v"}, b"x")


# --- the fast paths against the general code ---------------------------------------------
#
# decode_data and encode_data dispatch to a decoder or encoder per command
# type that gives way, on anything it does not expect, to the general code
# (`_decode_data_general`, `_encode_data_general`): the same frames, the same
# command, or the same error.


def _outcome(run: Callable[[], object]) -> tuple[str, object]:
    """The result, or the error's type, reason, place and kind (any error, to compare)."""
    try:
        return "result", run()
    except Exception as exc:  # the very point: whatever it raises, compared
        return type(exc).__name__, (
            str(exc),
            getattr(exc, "reason", None),
            getattr(exc, "where", None),
            getattr(exc, "kind", None),
        )


@given(commands)
def test_the_fast_encoders_write_what_the_general_one_writes(command: mtl.DataCommand) -> None:
    """Property: any valid command, encode_data's frames are the field-by-field encoder's."""
    assert mtl.encode_data(command) == mtl._encode_data_general(command)


_odd_names = st.text(max_size=3) | st.text(min_size=250, max_size=300) | st.binary(max_size=3)
_odd_numbers = (
    st.integers(-3, 3)
    | st.integers(250, 300)
    | st.integers(2**64 - 2, 2**64 + 1)
    | st.floats(0, 2)
    | st.booleans()
    | st.none()
)
_odd_properties = (
    st.none()
    | st.just("")
    | st.just([])
    | st.dictionaries(
        st.text(max_size=3) | st.integers(),
        st.text(max_size=3) | st.integers(-(2**65), 2**65) | st.builds(object),
        max_size=2,
    )
)
_odd_commands = st.one_of(
    st.builds(mtl.Lease, _odd_numbers, _odd_names),
    st.builds(mtl.Response, _odd_numbers, _odd_numbers),
    st.builds(mtl.Summon, _odd_numbers, _odd_names),
    st.builds(mtl.Dismiss, _odd_numbers, _odd_names),
    st.builds(mtl.Content, _odd_numbers, _odd_names, _odd_properties, st.binary(max_size=3)),
    st.builds(mtl.Confirm, _odd_numbers, _odd_numbers),
    st.builds(mtl.Reject, _odd_numbers, _odd_numbers, _odd_numbers),
)


@given(_odd_commands)
def test_the_fast_encoders_refuse_what_the_general_one_refuses(command: mtl.DataCommand) -> None:
    """Property: with any values, in range or not, encode_data ends as the general encoder.

    The same frames, or the same error (MTLLocalError with the same reason
    for what MTL cannot carry).
    """
    assert _outcome(lambda: mtl.encode_data(command)) == _outcome(
        lambda: mtl._encode_data_general(command)
    )


@given(
    _odd_numbers | st.integers(0, 2**64 - 1),
    _odd_names | st.text(max_size=8),
    _odd_properties | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.binary(max_size=3),
)
def test_encode_content_is_encode_data_of_the_content(
    sequence: object, resource: object, properties: object, body: bytes
) -> None:
    """Property: any values: encode_data's frames of that Content, or its error."""
    assert _outcome(
        lambda: mtl.encode_content(sequence, resource, properties, body)  # type: ignore[arg-type]
    ) == _outcome(
        lambda: mtl.encode_data(mtl.Content(sequence, resource, properties, body))  # type: ignore[arg-type]
    )


@given(
    _odd_numbers | st.integers(0, 2**64 - 1),
    _odd_names | st.text(max_size=8),
    st.text(max_size=40) | st.text(min_size=300, max_size=400) | st.just("\ud800"),
    st.binary(max_size=3),
)
def test_encode_content_with_id_is_encode_content_of_the_id(
    sequence: object, resource: object, message_id: str, body: bytes
) -> None:
    """Property: any values: encode_content's frames with the id as only property, or its error."""
    assert _outcome(
        lambda: mtl.encode_content_with_id(sequence, resource, message_id, body)  # type: ignore[arg-type]
    ) == _outcome(
        lambda: mtl.encode_content(sequence, resource, {"message-id": message_id}, body)  # type: ignore[arg-type]
    )


@given(
    st.binary(min_size=10, max_size=10)
    | st.builds(
        lambda sequence, multiple: mtl._CONFIRM.pack(mtl.CONFIRM, sequence, multiple),
        st.integers(0, 2**64 - 1),
        st.integers(0, 3),
    )
    | st.binary(max_size=12),
    st.binary(max_size=3),
)
def test_confirm_fields_are_the_decoded_confirm(header: bytes, body: bytes) -> None:
    """Property: any header: confirm_fields reads a Confirm where decode_data decodes one."""
    _agree_with_decode_data(mtl.confirm_fields(header), header, body, mtl.Confirm, mtl.Confirm)


def _agree_with_decode_data(
    fields: tuple[Any, ...] | None,
    header: bytes,
    body: bytes,
    kind: type,
    build: Callable[..., object],
) -> None:
    """A fast reader's ``fields``: decode_data gives ``build(*fields)``, or (None) no ``kind``."""
    decoded = _outcome(lambda: mtl.decode_data([header, body]))
    if fields is None:
        assert decoded[0] != "result" or not isinstance(decoded[1], kind)
    else:
        assert decoded == ("result", build(*fields))


def test_encode_content_with_id_past_its_layouts_cache() -> None:
    """More lengths than the layouts kept: each still encodes as encode_content does."""
    for length in range(300):
        message_id = "i" * length
        assert mtl.encode_content_with_id(length, "news", message_id, b"b") == mtl.encode_content(
            length, "news", {"message-id": message_id}, b"b"
        )
    assert 0 < len(mtl._WITH_ID) <= 256


def _content_header(sequence: int, resource: bytes, table: bytes, kind: int = mtl.CONTENT) -> bytes:
    return mtl._NAMED.pack(kind, sequence, len(resource)) + resource + table


@given(
    st.builds(
        _content_header,
        st.integers(0, 2**64 - 1),
        st.binary(max_size=4) | st.text(max_size=4).map(str.encode) | st.just(b"\xff\xfe"),
        st.just(b"\0\0\0\0")
        | st.dictionaries(
            st.text(max_size=4), st.text(max_size=4) | st.integers(-(2**31), 2**31), max_size=3
        ).map(fieldtable.encode_table)
        | st.binary(max_size=8),
        st.just(mtl.CONTENT) | st.integers(0, 255),  # the same layout under another type
    )
    | st.binary(max_size=20).map(lambda tail: bytes([mtl.CONTENT]) + tail)
    | st.binary(max_size=20),
    st.binary(max_size=3),
)
def test_content_fields_are_the_decoded_content(header: bytes, body: bytes) -> None:
    """Property: any header: content_fields reads a Content as decode_data decodes it."""
    fields = mtl.content_fields(header)
    _agree_with_decode_data(fields, header, body, mtl.Content, lambda *f: mtl.Content(*f, body))


def test_content_fields_of_the_spec_example() -> None:
    """A Content with an empty table, and one with a property, read without the command built."""
    assert mtl.content_fields(_content_header(7, b"orders", b"\0\0\0\0")) == (7, "orders", {})
    table = fieldtable.encode_table({"message-id": "m1"})
    assert mtl.content_fields(_content_header(8, b"", table)) == (8, "", {"message-id": "m1"})
    assert mtl.content_fields(mtl._CONFIRM.pack(mtl.CONFIRM, 1, 0)) is None


def test_confirms_made_through_the_slots_are_the_dataclass() -> None:
    """The decoder's Confirm constructor sets every field there is: equal to the dataclass's."""
    assert tuple(field.name for field in dataclasses.fields(mtl.Confirm)) == (
        "sequence",
        "multiple",
    )
    for multiple in (False, True):
        made = mtl.decode_data(mtl._encode_data_general(mtl.Confirm(9, multiple)))
        assert made == mtl.Confirm(9, multiple)
        assert repr(made) == repr(mtl.Confirm(9, multiple))
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.sequence = 1  # type: ignore[misc]


def _mutated(frames: list[bytes], data: st.DataObject) -> list[bytes]:
    """The frames with a few octets changed, cut short or grown."""
    out = []
    for frame in frames:
        changed = bytearray(frame)
        for _ in range(data.draw(st.integers(0, 2))):
            if changed:
                changed[data.draw(st.integers(0, len(changed) - 1))] = data.draw(
                    st.integers(0, 255)
                )
        if data.draw(st.booleans()):
            del changed[data.draw(st.integers(0, len(changed))) :]
        changed += data.draw(st.binary(max_size=2))
        out.append(bytes(changed))
    return out


@given(commands, st.data())
def test_decoding_gives_the_general_decoders_command_or_error(
    command: mtl.DataCommand, data: st.DataObject
) -> None:
    """Property: valid, mutated or garbage frames: the general decoder's command or MTLError.

    Garbage includes headers that start with a known command type, so that
    each fast decoder meets what it must leave to the general one.
    """
    frames = mtl.encode_data(command)
    shape = data.draw(st.sampled_from(["valid", "mutated", "garbage", "typed"]))
    if shape == "mutated":
        frames = _mutated(frames, data)
    elif shape == "garbage":
        frames = data.draw(st.lists(st.binary(max_size=24), max_size=3))
    elif shape == "typed":
        header = bytes((data.draw(st.integers(0, 10)),)) + data.draw(st.binary(max_size=24))
        frames = [header, data.draw(st.sampled_from([b"", b"200", b"2x0", b"x"]))]
    assert _outcome(lambda: mtl.decode_data(frames)) == _outcome(
        lambda: mtl._decode_data_general(frames)
    )
    if shape == "valid":
        assert mtl.decode_data(frames) == command


def test_an_empty_properties_table_decodes_to_a_dict_of_its_own() -> None:
    """Content without properties: {} each time, never one dict shared between commands."""
    frames = mtl.encode_data(mtl.Content(3, "in", {}, b"body"))
    assert frames[0].endswith(b"\x00\x00\x00\x00")
    first, second = mtl.decode_data(frames), mtl.decode_data(frames)
    assert first == second == mtl.Content(3, "in", {}, b"body")
    assert isinstance(first, mtl.Content) and isinstance(second, mtl.Content)
    assert first.properties is not second.properties


def test_contents_made_through_the_slots_are_the_dataclass() -> None:
    """The decoder's Content constructor sets every field there is: equal to the dataclass's."""
    assert tuple(field.name for field in dataclasses.fields(mtl.Content)) == mtl._CONTENT_FIELDS
    made = mtl._new_content(7, "r", {"k": "v"}, b"x")
    assert made == mtl.Content(7, "r", {"k": "v"}, b"x")
    assert repr(made) == repr(mtl.Content(7, "r", {"k": "v"}, b"x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.body = b"y"  # type: ignore[misc]


@given(
    st.dictionaries(
        st.text(max_size=6),
        st.text(max_size=6) | st.binary(max_size=4) | st.integers(-(2**63), 2**63 - 1) | st.none(),
        max_size=4,
    ),
    st.data(),
)
def test_properties_tables_decode_as_the_general_reader_reads_them(
    properties: dict[str, object], data: st.DataObject
) -> None:
    """Property: text read where its name is, other values the general way: the same table.

    Compared with a table read pair by pair with the field-table value reader
    only, on valid tables and on mutated ones (the same error, reason and place).
    """
    table = fieldtable.encode_table(properties)
    if data.draw(st.booleans()):
        table = _mutated([table], data)[0]
    offset = data.draw(st.integers(0, 2))
    table = b"\x00" * offset + table
    assert _outcome(lambda: fieldtable.decode_table(table, offset)) == _outcome(
        lambda: _table_pair_by_pair(table, offset)
    )


def _table_pair_by_pair(data: bytes, pos: int) -> tuple[dict[str, object], int]:
    """A top-level field table read with `decode_short_string` and `_value` for every pair."""
    if pos + 4 > len(data):
        raise fieldtable.FieldTableError(
            "field table length cut short", where=f"byte {pos}", kind="truncated"
        )
    size = int.from_bytes(data[pos : pos + 4], "big")
    start, end = pos + 4, pos + 4 + size
    if end > len(data):
        raise fieldtable.FieldTableError(
            f"field table of {size} bytes cut short", where=f"byte {start}", kind="truncated"
        )
    table: dict[str, object] = {}
    pos = start
    while pos < end:
        if data[pos] + pos + 1 > end:
            raise fieldtable.FieldTableError("field name runs past its table", where=f"byte {pos}")
        raw_name, pos = fieldtable.decode_short_string(data, pos)
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise fieldtable.FieldTableError(
                "a field name is not UTF-8", where=f"byte {pos}"
            ) from None
        table[name], pos = fieldtable._value(data, pos, end, 1)
    return table, end


@given(
    st.dictionaries(
        st.text(max_size=6) | st.text(min_size=255, max_size=257),
        st.text(max_size=6) | st.integers() | st.none(),
        max_size=4,
    )
)
def test_text_tables_are_written_as_the_general_writer_writes_them(
    properties: dict[str, object],
) -> None:
    """Property: a table written in one pass (text only) or pair by pair: same bytes or error."""

    def pair_by_pair() -> bytes:
        out = bytearray(4)
        fieldtable._put_pairs(out, properties, 1)
        out[:4] = (len(out) - 4).to_bytes(4, "big")
        return bytes(out)

    assert _outcome(lambda: fieldtable.encode_table(properties)) == _outcome(pair_by_pair)
