"""Body transforms: the Subject of a mail, against the regular expression it stands for."""

from __future__ import annotations

import re
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.message import Message
from gateway.core.transforms import TransformError, _subject_value, transform

# What `_subject_value` finds without a regular expression: the reference.
REFERENCE: Final = re.compile(
    rb"^subject:[ \t]*(.*(?:\r?\n[ \t].*)*)", re.IGNORECASE | re.MULTILINE
)


def subject(body: bytes) -> bytes:
    """The ``subject`` transform of a message with ``body``."""
    return transform("subject", Message(body=body, address="mail"), "mail")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"From: a@b\nSubject: weather report\n\nbody\n", b"weather report"),
        (b"Subject: first line\n\nSubject: not a header\n", b"first line"),
        (b"SUBJECT:\tshouting\n\n", b"shouting"),
        (b"subject:lower\n", b"lower"),  # no blank line: the whole body is headers
        (b"From: a\r\nSubject: over\r\n  two lines\r\nTo: b\r\n\r\nbody", b"over two lines"),
        (b"Subject: folded\n\tonce\n and twice\nX: y\n\n", b"folded once and twice"),
        (b"X-Subject: no\nSubject: yes\n\n", b"yes"),
        (b"Subject: =?utf-8?q?caf=C3=A9?= au lait\n\n", "café au lait".encode()),
        (b"From: a\n\nSubject: in the body\n", None),
        (b"Subject:   \n\n", None),
        (b"From: a\r\n\r\nx\n\nSubject: after the CRLF blank line\n", None),
        (b"", None),
    ],
)
def test_subject_of_a_mail(body: bytes, expected: bytes | None) -> None:
    """The first Subject of the header block, unfolded and decoded; none is a rejection."""
    if expected is None:
        with pytest.raises(TransformError, match="no Subject"):
            subject(body)
    else:
        assert subject(body) == expected


_pieces = st.sampled_from(
    [b"Subject:", b"subject: ", b"SUBJECT:\t", b"sUbJeCt:", b"X-Subject: ", b"From: a",
     b"\n", b"\r\n", b" ", b"\t", b"\r", b"word", b"=?utf-8?q?x?=", b":"]
)  # fmt: skip


@given(st.lists(st.one_of(_pieces, st.binary(max_size=4)), max_size=30).map(b"".join))
def test_subject_value_is_what_the_regular_expression_finds(headers: bytes) -> None:
    """Any header block: the same value as the reference (after its leading blanks)."""
    found = REFERENCE.search(headers)
    value = _subject_value(headers)
    if found is None:
        assert value is None
    else:
        assert value is not None
        assert value.lstrip(b" \t") == found.group(1)
