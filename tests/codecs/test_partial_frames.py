"""Every listener codec says whether it holds part of a frame (`pending_bytes`).

The listeners time out a frame that never completes (``frame_timeout_seconds``);
they ask the codec. For each codec a session's bytes are fed one byte at a
time: ``pending_bytes`` is zero exactly where a frame ends and counts the bytes
held everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from gateway.codecs import amqp091, dmp, qmqp, ssmp
from gateway.codecs import stream as sp


def _boundaries(frames: Sequence[bytes]) -> set[int]:
    """The offsets in the joined frames where a frame ends (and 0)."""
    ends = {0}
    offset = 0
    for frame in frames:
        offset += len(frame)
        ends.add(offset)
    return ends


def _check(codec: Any, frames: Sequence[bytes]) -> None:
    """Feed ``frames`` a byte at a time; ``pending_bytes`` is the bytes since the last end."""
    data = b"".join(frames)
    ends = _boundaries(frames)
    last_end = 0
    assert codec.pending_bytes == 0
    for offset in range(1, len(data) + 1):
        codec.receive_data(data[offset - 1 : offset])
        if offset in ends:
            last_end = offset
        assert codec.pending_bytes == offset - last_end, offset


def _qmqp() -> tuple[Any, list[bytes]]:
    block = qmqp.MessageBlock(id=b"1", message=b"hello", sender=b"a@b", recipients=(b"c@d",))
    frames = [qmqp.encode(block), qmqp.encode(qmqp.AuthBlock(username=b"u", password=b"p"))]
    return qmqp.QMQPCodec(qmqp.Role.SERVER), frames


def _ssmp() -> tuple[Any, list[bytes]]:
    return ssmp.SSMPCodec(ssmp.Role.SERVER), [b"LOGIN alice open\n", b"MCAST news hello\n"]


def _stream() -> tuple[Any, list[bytes]]:
    frames = [
        sp.encode(sp.PeerProperties(correlation_id=1, properties={"product": "test"})),
        sp.encode(sp.Heartbeat()),
        sp.encode(sp.SaslHandshake(correlation_id=2)),
    ]
    return sp.StreamCodec(sp.Role.SERVER, frame_max=0), frames


def _dmp() -> tuple[Any, list[bytes]]:
    envelope = dmp.Envelope(exchange="s", routing_key="k", body=b"payload")
    frames = [
        dmp.PROTOCOL_HEADER,
        dmp.DMPCodec(dmp.Role.CLIENT).send(dmp.Lease("lease")),
        dmp.encode_envelope(envelope),
        dmp.HEARTBEAT_BYTES,
    ]
    return dmp.DMPCodec(dmp.Role.SERVER), frames


def _amqp091() -> tuple[Any, list[bytes]]:
    frames = [amqp091.encode_heartbeat(), amqp091.encode_heartbeat()]
    return amqp091.FrameCodec(), frames


CODECS: dict[str, Callable[[], tuple[Any, list[bytes]]]] = {
    "qmqp": _qmqp,
    "ssmp": _ssmp,
    "stream": _stream,
    "dmp": _dmp,
    "amqp091": _amqp091,
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_pending_bytes_is_zero_exactly_between_frames(name: str) -> None:
    """Fed a byte at a time, a codec holds the bytes of the frame under way, none at its end."""
    codec, frames = CODECS[name]()
    _check(codec, frames)


def test_qmqp_an_oversized_block_is_pending_until_skipped() -> None:
    """A block over the limit is skipped unbuffered, but counts as incomplete until its end."""
    codec = qmqp.QMQPCodec(qmqp.Role.SERVER, max_message_bytes=10)
    block = qmqp.encode(
        qmqp.MessageBlock(id=b"1", message=b"x" * 100, sender=b"a@b", recipients=(b"c@d",))
    )
    codec.receive_data(block[:-1])
    assert codec.pending_bytes > 0
    [refused] = codec.receive_data(block[-1:])
    assert isinstance(refused, qmqp.InvalidBlock)
    assert codec.pending_bytes == 0
