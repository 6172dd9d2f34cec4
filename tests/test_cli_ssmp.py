"""Tests of `gateway.cli.ssmp`'s pure parts: answers as outcomes, events as JSON objects.

The commands against a real gateway are in tests/integration/test_cli_ssmp.py.
"""

from __future__ import annotations

import pytest

from gateway.cli.ssmp import _event_record, outcome_of
from gateway.codecs import ssmp


@pytest.mark.parametrize(
    ("response", "outcome"),
    [
        (ssmp.Response(code=200), "accepted"),
        (ssmp.Response(code=400, payload=b"retry: upstream hub is not connected"), "retry"),
        (ssmp.Response(code=400, payload=b"rejected: no route"), "rejected"),
        (ssmp.Response(code=405, payload=b"anonymous peers cannot SUBSCRIBE"), "rejected"),
    ],
)
def test_outcome_of_an_answer(response: ssmp.Response, outcome: str) -> None:
    """200 is accepted, the gateway's ``400 retry: ...`` retry later, anything else rejected."""
    assert outcome_of(response) == outcome


def test_events_as_json_objects() -> None:
    """Each verb keeps its fields; payloads become body (or body_base64)."""
    mcast = ssmp.Event(source=b"alice", message=ssmp.Mcast(topic=b"news", payload=b"hi"))
    assert _event_record(mcast) == {
        "source": "alice", "verb": "MCAST", "topic": "news", "body": "hi",
    }  # fmt: skip
    ucast = ssmp.Event(source=b"bob", message=ssmp.Ucast(to=b"alice", payload=b"\xff"))
    assert _event_record(ucast) == {
        "source": "bob", "verb": "UCAST", "to": "alice", "body_base64": "/w==",
    }  # fmt: skip
    joined = ssmp.Event(source=b"carol", message=ssmp.Subscribe(topic=b"news", presence=True))
    assert _event_record(joined) == {
        "source": "carol", "verb": "SUBSCRIBE", "topic": "news", "presence": True,
    }  # fmt: skip
