"""What an append keeps for the writer thread (`gateway.core.log.commit.kept_entries`)."""

from __future__ import annotations

import pytest

from gateway.codecs import osiris
from gateway.core.log.commit import kept_entries


def test_frozen_entries_are_kept_as_they_are() -> None:
    """Views the codec vouches for (FrozenEntries) are the same objects, not copies."""
    frame = b"..abcdef"
    view = memoryview(frame)
    entries = osiris.FrozenEntries([view[2:5], view[5:8], b"raw"])
    kept = kept_entries(entries, sub_batches=False)
    assert all(a is b for a, b in zip(kept, entries, strict=True))
    assert type(kept) is list  # a list of its own: the caller's may change


def test_other_views_are_asked_one_by_one() -> None:
    """Views into bytes are kept; views into anything that may change are copied."""
    frame = b"abc"
    buffer = bytearray(b"def")
    immutable, mutable = memoryview(frame), memoryview(buffer)
    kept = kept_entries([immutable, mutable, b"raw"], sub_batches=False)
    assert kept[0] is immutable
    assert type(kept[1]) is bytes
    buffer[:] = b"xyz"
    assert [bytes(k) for k in kept if not isinstance(k, osiris.SubBatch)] == [
        b"abc",
        b"def",
        b"raw",
    ]


class _Huge:
    """Stands for an entry of 2 GiB (its length is all that is asked)."""

    def __len__(self) -> int:
        return osiris.MAX_ENTRY_BYTES + 1


def test_a_frozen_entry_over_the_limit_is_refused() -> None:
    """The size limit holds for FrozenEntries too (not asked one by one)."""
    entries = osiris.FrozenEntries([b"small", _Huge()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at most"):
        kept_entries(entries, sub_batches=False)
