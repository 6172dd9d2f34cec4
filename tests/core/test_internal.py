"""Tests for `gateway.core.internal`: the gateway's own namespace, hop counts, the tally."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from gateway.core.durable import producer_reference, route_stream_name
from gateway.core.internal import (
    FINAL_REJECTIONS,
    GATEWAY_REFERENCE,
    HOP_LIMIT,
    INTERNAL_STREAM,
    MAX_HOPS,
    OUTCOME_STREAM,
    Tally,
    hop_limit_refusal,
    hops,
    internal_refusal,
    is_internal,
    is_internal_reference,
    names_internal,
)
from gateway.core.message import HeaderValue, Status


def test_the_gateways_streams_are_internal() -> None:
    """A route's stream, the outcomes and the dead letters are in the namespace; clients' not."""
    for name in (route_stream_name("mail"), OUTCOME_STREAM, "msggateway.dead-letter"):
        assert is_internal(name), name
    for name in ("orders", "msggateway", "amq.msggateway.x", "msggateway-x", "Msggateway.x"):
        assert not is_internal(name), name


def test_the_gateways_references_are_internal_an_upstreams_default_is_not() -> None:
    """Forwarder, feed and route-producer references are reserved; ``msggateway.NAME`` is not."""
    for reference in (
        "msggateway.forwarder.mail",
        "msggateway.routes.streams",
        producer_reference(GATEWAY_REFERENCE, "mail"),
        producer_reference(GATEWAY_REFERENCE, "r" * 300),  # hashed, still reserved
    ):
        assert is_internal_reference(reference), reference
    for reference in ("msggateway.gw1", "msggateway.gw1.route.mail", "app", ""):
        assert not is_internal_reference(reference), reference


def test_only_literal_patterns_name_the_namespace() -> None:
    """``msggateway.#`` names it; ``#`` and ``*.route.*`` only happen to match its names."""
    assert names_internal("msggateway.#")
    assert names_internal("msggateway.route.mail")
    assert not names_internal("#")
    assert not names_internal("*.route.*")


@pytest.mark.parametrize(
    ("value", "count"),
    [
        (None, 0),
        (3, 3),
        (0, 0),
        (-5, 0),
        ("7", 7),
        (b"12", 12),
        ("x", 0),
        (2.5, 0),
        (True, 0),
        ("9" * 20, 0),
    ],
)
def test_hops_reads_what_a_header_can_hold(value: HeaderValue | None, count: int) -> None:
    """Integers count, digits count, anything else (or a negative count) is 0."""
    assert hops(value) == count


def test_refusals_are_final_rejections_with_their_codes() -> None:
    """Both refusals are rejections no retry fixes, and say what to look at."""
    internal = internal_refusal("stream listener s", "msggateway.outcomes")
    looped = hop_limit_refusal("stream listener s", "echo")
    assert (internal.status, internal.code) == (Status.REJECTED, INTERNAL_STREAM)
    assert (looped.status, looped.code) == (Status.REJECTED, HOP_LIMIT)
    assert {internal.code, looped.code} == FINAL_REJECTIONS
    assert "internal namespace" in internal.reason
    assert f"{MAX_HOPS} times" in looped.reason and "loop" in looped.reason


def test_a_tally_logs_the_first_then_once_in_a_while() -> None:
    """The first occurrence is due at once; the rest are gathered for the next line."""
    clock = Clock()
    tally = Tally(clock, seconds=10)
    assert tally.add() == 1
    assert tally.add(5) == 0
    clock.advance(9)
    assert tally.add() == 0
    clock.advance(1)
    assert tally.add() == 7
    assert (tally.total, tally.pending) == (8, 0)
