"""Every codec against hostile input: only its typed errors come out, and splits do not matter.

Issue 18, "Fuzzing as a habit". For each decoding entry point of the ten
codecs (`tests.fuzzing.targets.TARGETS`: both roles of SSMP, QMQP, DMP and
the stream protocol, AMQP 0-9-1 frames, the four framing helpers, MTL data
commands and control messages, AMQP 1.0 messages and values, field tables,
osiris chunks and index files), two hypothesis properties:

- hostile input (random bytes; a valid input mutated by
  `tests.fuzzing.mutation`: truncated, bits flipped, bytes inserted or
  deleted, lengths made oversized, decimal lengths made huge, slices of
  other inputs spliced in, MTL frames dropped or added; a deeply nested
  input from `tests.fuzzing.nesting`: MTL JSON, field tables, AMQP 1.0
  compound values) gives events or the codec's typed error, nothing else
  (a `RecursionError`, `IndexError` or `UnicodeDecodeError` fails the test);
- for the byte-stream codecs, any cut of such an input, valid or not, gives
  the same events and the same error as the whole input.

A deterministic check adds nesting far past every limit (5,000 levels, past
Python's recursion limit) and just past it. bench/fuzz.py runs the same
targets with a million inputs per codec.

Related properties elsewhere, not repeated here: plain random bytes per codec
(``test_garbage_*`` in tests/codecs/test_ssmp.py, test_qmqp.py,
test_stream.py, test_dmp.py, test_amqp091.py, test_fieldtable.py,
test_mtl.py, test_osiris.py and test_amqp.py; test_framing.py
``test_split_garbage`` and ``test_reader_garbage``); nesting at its limit
(test_amqp.py ``test_nesting_is_limited``, test_mtl.py
``test_deeply_nested_json_is_ill_formed_and_dropped``); valid input
decoding the same under random cuts (the round trips of test_ssmp.py,
test_qmqp.py, test_stream.py, test_dmp.py ``test_envelope_round_trip``,
test_amqp091.py ``test_round_trip``, test_framing.py
``test_random_cuts_give_the_same_lines`` and ``test_reader_random_cuts``);
mutations compared with the general decoders (test_dmp.py, test_mtl.py) and
damaged AMQP 1.0 messages (test_amqp.py). AMQP 1.0 messages, field tables,
osiris chunks and MTL messages are decoded whole (a stream entry, a table
inside a frame, a chunk, a ZeroMQ message), so no split applies to them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.codecs import mtl
from tests.codec_checks import split_at
from tests.fuzzing import nesting
from tests.fuzzing.mutation import mutate
from tests.fuzzing.samples import Input
from tests.fuzzing.targets import CODECS, TARGETS, FuzzTarget, outcome, target

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_SAMPLES = {item.name: item.samples() for item in TARGETS}
_SEEDS = st.integers(0, 2**32 - 1)


def _hostile(data: st.DataObject, fuzz_target: FuzzTarget) -> Input:
    """Random bytes, a mutated valid input, or a deep nesting, as the test draws."""
    kinds = ["garbage", "mutated", "mutated", "mutated"]
    if fuzz_target.nested is not None:
        kinds.append("nested")
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind == "garbage":
        frames = st.lists(st.binary(max_size=64), max_size=4)
        return tuple(data.draw(frames if fuzz_target.frames else st.tuples(st.binary())))
    rng = random.Random(data.draw(_SEEDS, label="seed"))
    if kind == "nested":
        assert fuzz_target.nested is not None
        made = fuzz_target.nested(rng)
    else:
        sample = data.draw(_SAMPLES[fuzz_target.name], label="sample")
        made = mutate(rng, sample, data.draw(_SAMPLES[fuzz_target.name], label="donor"))
    return made if fuzz_target.fix is None else fuzz_target.fix(rng, made)


def test_every_codec_has_targets() -> None:
    """The targets cover the ten codecs of gateway/codecs (scram is an auth exchange, not one)."""
    assert CODECS == (
        "amqp",
        "amqp091",
        "dmp",
        "fieldtable",
        "framing",
        "mtl",
        "osiris",
        "qmqp",
        "ssmp",
        "stream",
    )


# pytest-twisted wraps a hypothesis test's inner test once per call, so one
# function cannot be both parametrized and given: each target gets its own.


def _hostile_input_test(fuzz_target: FuzzTarget) -> Callable[[], None]:
    @FUZZ
    @given(data=st.data())
    def test(data: st.DataObject) -> None:
        outcome(fuzz_target, _hostile(data, fuzz_target))

    test.__doc__ = (
        f"{fuzz_target.name}: garbage, mutated or deeply nested input gives events or"
        f" {', '.join(error.__name__ for error in fuzz_target.errors) or 'nothing'}, nothing else."
    )
    return test


def _split_test(fuzz_target: FuzzTarget) -> Callable[[], None]:
    @FUZZ
    @given(data=st.data())
    def test(data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="valid"):
            stream = data.draw(_SAMPLES[fuzz_target.name], label="sample")[0]
        else:
            stream = b"".join(_hostile(data, fuzz_target))
        points = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6), label="cuts"))
        assert outcome(fuzz_target, split_at(stream, points)) == outcome(fuzz_target, (stream,))

    test.__doc__ = (
        f"{fuzz_target.name}: valid or hostile, cut anywhere: the same events, and the same"
        " error after the same events."
    )
    return test


def _test_name(prefix: str, fuzz_target: FuzzTarget) -> str:
    return f"{prefix}_{fuzz_target.name.replace('/', '_').replace('-', '_')}"


for _target in TARGETS:
    globals()[_test_name("test_hostile_input_raises_only_typed_errors", _target)] = (
        _hostile_input_test(_target)
    )
    if _target.split:
        globals()[_test_name("test_any_split_decodes_the_same", _target)] = _split_test(_target)


_NESTING = {
    "amqp/value": (nesting.amqp_value, "AMQPDecodeError"),
    "fieldtable": (nesting.field_table, "FieldTableError"),
}


@pytest.mark.parametrize("depth", [nesting.FAR_DEPTH, 200])
@pytest.mark.parametrize("name", sorted(_NESTING))
def test_nesting_far_past_the_limit_is_a_typed_error(name: str, depth: int) -> None:
    """Thousands of nested levels: the typed error for too deep, never a RecursionError."""
    make, error = _NESTING[name]
    for index in range(20):
        assert outcome(target(name), (make(random.Random(index), depth),))[1] == error


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("depth", [nesting.FAR_DEPTH, 200, mtl.MAX_JSON_DEPTH])
def test_json_nesting_past_the_limit_is_dropped(depth: int, broken: bool) -> None:
    """An MTL control body nested past MAX_JSON_DEPTH is dropped like any ill-formed request.

    The top object is one level, so ``depth`` levels inside it are one too many.
    """
    for index in range(20):
        body = nesting.json_text(random.Random(index), depth, broken=broken)
        assert outcome(target("mtl/control"), (b"Connection.Open", body)) == ([None, None], None)


def test_json_nesting_at_the_limit_is_read() -> None:
    """MAX_JSON_DEPTH levels in all (the top object and those inside it): a request."""
    for index in range(20):
        body = nesting.json_text(random.Random(index), mtl.MAX_JSON_DEPTH - 1, broken=False)
        request = outcome(target("mtl/control"), (b"Connection.Open", body))[0][0]
        assert request is not None, body
