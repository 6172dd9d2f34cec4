"""Tracking state: publisher sequences (deduplication) and stored consumer offsets.

Persisted the osiris way (docs/stream-protocol-notes.md, sections 8 and 9):
delta entries in user chunk trailers and tracking delta chunks, and a
snapshot chunk at the start of every rolled segment, so that the state is
rebuilt from the last snapshot plus what follows it.
"""

from __future__ import annotations

import attrs

from gateway.codecs.osiris import (
    Buffer,
    decode_tracking,
    decode_tracking_snapshot,
    encode_tracking_snapshot,
)

__all__ = ["TrackingState"]


@attrs.define
class TrackingState:
    """Last publishing id per publisher reference, stored offset per consumer reference.

    Attributes:
        sequences: Reference to (id of the chunk holding its last id, last id).
        offsets: Reference to its stored offset.
    """

    sequences: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    offsets: dict[str, int] = attrs.field(factory=dict)

    def copy(self) -> TrackingState:
        """An independent copy, for planning a commit that may fail."""
        return TrackingState(dict(self.sequences), dict(self.offsets))

    def sequence(self, reference: str) -> int:
        """The last publishing id stored for a reference, 0 if none."""
        entry = self.sequences.get(reference)
        return 0 if entry is None else entry[1]

    def update(self, chunk_id: int, sequences: dict[str, int], offsets: dict[str, int]) -> None:
        """Apply delta values written in the chunk ``chunk_id``."""
        for reference, sequence in sequences.items():
            self.sequences[reference] = (chunk_id, sequence)
        self.offsets.update(offsets)

    def apply_delta(self, chunk_id: int, data: Buffer) -> None:
        """Apply encoded delta entries (a trailer or a tracking delta chunk's body).

        Raises:
            OsirisError: The entries are malformed.
        """
        sequences, offsets = decode_tracking(data)
        self.update(chunk_id, sequences, offsets)

    def apply_snapshot(self, data: Buffer) -> None:
        """Replace the state with an encoded snapshot.

        Raises:
            OsirisError: The entries are malformed.
        """
        self.sequences, self.offsets = decode_tracking_snapshot(data)

    def snapshot(self) -> bytes:
        """The state as snapshot entries, the body of a tracking snapshot chunk."""
        return encode_tracking_snapshot(self.sequences, self.offsets)
