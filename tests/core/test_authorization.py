"""Tests for `gateway.core.authorization`: per-listener publish and consume allow-lists."""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address
from twisted.logger import capturedLogs

from gateway.core.addressing import PatternError
from gateway.core.authorization import UNRESTRICTED, Action, Authorization, check, check_internal


def _table() -> Authorization:
    return Authorization.from_lists(
        {
            "alice": (("orders", "weather.*"), ("orders",)),
            "bob": (("news.#",), ()),
            "*": ((), ("public.#",)),
        }
    )


def test_unrestricted_allows_everyone_everything() -> None:
    """Without an ``authorize`` table every identity, and none, may do anything."""
    assert not UNRESTRICTED.restricted
    assert UNRESTRICTED.may_publish(None, "anything")
    assert UNRESTRICTED.may_consume("carol", "x.y")
    assert UNRESTRICTED.knows(None)


def test_publish_and_consume_are_separate() -> None:
    """An identity allowed to publish to an address is not thereby allowed to consume it."""
    authz = _table()
    assert authz.may_publish("bob", "news.sport")
    assert not authz.may_consume("bob", "news.sport")
    assert authz.may_publish("alice", "orders")
    assert authz.may_consume("alice", "orders")


def test_patterns_use_the_route_language() -> None:
    """``*`` is one word, ``#`` any run of words, anything else exact."""
    authz = _table()
    assert authz.may_publish("alice", "weather.paris")
    assert not authz.may_publish("alice", "weather.paris.today")
    assert not authz.may_publish("alice", "weather")
    assert not authz.may_publish("alice", "orders2")
    assert authz.may_publish("bob", "news")
    assert authz.may_publish("bob", "news.a.b.c")


def test_star_identity_adds_to_every_identity() -> None:
    """Patterns under ``*`` go to every authenticated identity, listed or not."""
    authz = _table()
    assert authz.may_consume("alice", "public.notes")
    assert authz.may_consume("zed", "public.notes")
    assert not authz.may_publish("zed", "public.notes")
    assert authz.knows("zed")


def test_no_identity_gets_nothing() -> None:
    """A peer that did not authenticate is refused everything, even what ``*`` grants."""
    authz = _table()
    assert not authz.knows(None)
    assert not authz.may_consume(None, "public.notes")
    assert not authz.allows(Action.PUBLISH, None, "orders")


def test_unknown_identity_without_star() -> None:
    """Without a ``*`` entry an identity not listed knows nothing and may do nothing."""
    authz = Authorization.from_lists({"alice": (("#",), ("#",))})
    assert authz.restricted
    assert not authz.knows("mallory")
    assert not authz.may_publish("mallory", "orders")
    assert authz.may_publish("alice", "any.thing@example.com")


def test_empty_table_refuses_everything() -> None:
    """An ``authorize`` table with no identities is restrictive, not open."""
    authz = Authorization({})
    assert authz.restricted
    assert not authz.may_publish("alice", "x")


def test_bad_pattern_is_refused() -> None:
    """A pattern the route language cannot use raises `PatternError` with the reason."""
    with pytest.raises(PatternError, match="mixes wildcards"):
        Authorization.from_lists({"alice": (("news*",), ())})


def test_check_counts_and_logs_refusals_only() -> None:
    """`check` counts a refusal by action and logs who, from where, what and where to grant it."""
    counted: list[str] = []
    authz = _table()
    peer = IPv4Address("TCP", "192.0.2.7", 4242)
    with capturedLogs() as events:
        assert check(
            authz, Action.PUBLISH, "bob", "news.x", listener="hub", count_error=counted.append
        )
        assert not check(
            authz,
            Action.CONSUME,
            "bob",
            "news.x",
            listener="hub",
            count_error=counted.append,
            peer=peer,
        )
    assert counted == ["forbidden-consume"]
    [event] = events
    assert (event["listener"], event["identity"], event["peer"]) == ("hub", "bob", "192.0.2.7:4242")
    assert (event["action"], event["address"]) == ("consume", "news.x")
    assert "[listeners.{listener}.authorize]" in event["log_format"]


def test_only_a_literal_own_pattern_grants_reading_internal_streams() -> None:
    """``msggateway.#`` under the identity grants it; ``#``, ``*.route.*`` and ``*``'s do not."""
    authz = Authorization.from_lists(
        {
            "ops": ((), ("msggateway.route.*",)),
            "all": (("#",), ("#", "*.route.*")),
            "*": ((), ("msggateway.#",)),
        }
    )
    assert authz.may_read_internal("ops", "msggateway.route.mail")
    assert not authz.may_read_internal("ops", "msggateway.outcomes")
    assert not authz.may_read_internal("all", "msggateway.route.mail")
    assert not authz.may_read_internal("carol", "msggateway.route.mail")  # only "*" grants
    assert not authz.may_read_internal(None, "msggateway.route.mail")
    assert not UNRESTRICTED.may_read_internal("ops", "msggateway.route.mail")


def test_check_internal_refuses_writes_and_ungranted_reads() -> None:
    """Writes to internal streams or as the gateway's references are refused; granted reads pass."""
    counted: list[str] = []
    authz = Authorization.from_lists({"ops": ((), ("msggateway.#",))})

    def allowed(identity: str | None, stream: str, **how: object) -> bool:
        return check_internal(
            authz,
            "do",
            identity,
            stream,
            listener="streams",
            count_error=counted.append,
            **how,  # type: ignore[arg-type]
        )

    assert allowed("ops", "msggateway.route.r", read=True)
    assert not allowed("ops", "msggateway.route.r")
    assert not allowed("bob", "msggateway.route.r", read=True)
    assert not allowed("ops", "orders", reference="msggateway.route.r")
    assert not allowed("ops", "orders", reference="msggateway.forwarder.r")
    assert not allowed("ops", "orders", reference="msggateway.routes.streams")
    assert allowed("ops", "orders", reference="msggateway.upstream-name")
    assert allowed("bob", "orders", reference="app")
    assert allowed("bob", "orders")
    assert counted == ["internal-stream"] * 5
    with capturedLogs() as events:
        assert not check_internal(
            UNRESTRICTED,
            "delete",
            None,
            "msggateway.outcomes",
            listener="streams",
            count_error=counted.append,
            peer=IPv4Address("TCP", "192.0.2.7", 4242),
            shown_identity="anonymous",
        )
    [event] = events
    assert (event["identity"], event["peer"]) == ("anonymous", "192.0.2.7:4242")
    assert event["what"] == "delete 'msggateway.outcomes'"
