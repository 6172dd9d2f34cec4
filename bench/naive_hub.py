"""A naive SSMP hub, the baseline the real hub is measured against.

What a first Twisted implementation would look like: a LineReceiver that
parses each line as it comes and writes each event and response with its own
``transport.write``. Only what ssmpload uses is implemented (LOGIN, SUBSCRIBE,
MCAST, UCAST, PING, PONG, CLOSE); it is a yardstick, not a server.

Run: ``python bench/naive_hub.py`` prints ``listening PORT`` and serves on
127.0.0.1 until killed.
"""

from __future__ import annotations

import sys

from twisted.internet import reactor
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver


class NaiveHubProtocol(LineOnlyReceiver):
    """One peer of the naive hub."""

    delimiter = b"\n"
    MAX_LENGTH = 1024

    def __init__(self, hub: NaiveHub) -> None:
        self.hub = hub
        self.identity = b""

    def connectionMade(self) -> None:
        """Disable Nagle, as the real hub does, so that only the design differs."""
        if ITCPTransport.providedBy(self.transport):
            self.transport.setTcpNoDelay(True)

    def connectionLost(self, reason: object = None) -> None:
        """Forget the peer."""
        for subscribers in self.hub.topics.values():
            subscribers.discard(self)
        if self.hub.peers.get(self.identity) is self:
            del self.hub.peers[self.identity]

    def lineReceived(self, line: bytes) -> None:
        """Handle one request, writing its answer at once."""
        verb, _, rest = line.partition(b" ")
        if verb == b"LOGIN":
            self.identity = rest.split(b" ")[0]
            self.hub.peers[self.identity] = self
            self.sendLine(b"200")
        elif verb == b"SUBSCRIBE":
            self.hub.topics.setdefault(rest.split(b" ")[0], set()).add(self)
            self.sendLine(b"200")
        elif verb == b"MCAST":
            topic, _, _payload = rest.partition(b" ")
            event = b"000 " + self.identity + b" " + line
            for peer in self.hub.topics.get(topic, ()):
                if peer is not self:
                    peer.sendLine(event)
            self.sendLine(b"200")
        elif verb == b"UCAST":
            to, _, _payload = rest.partition(b" ")
            peer = self.hub.peers.get(to)
            if peer is None:
                self.sendLine(b"404")
            else:
                peer.sendLine(b"000 " + self.identity + b" " + line)
                self.sendLine(b"200")
        elif verb == b"PING":
            self.sendLine(b"000 . PONG")
        elif verb == b"CLOSE":
            self.sendLine(b"200")
            self.transport.loseConnection()
        elif verb != b"PONG":
            self.sendLine(b"501")


class NaiveHub(Factory):
    """Peers and topics of the naive hub."""

    def __init__(self) -> None:
        self.peers: dict[bytes, NaiveHubProtocol] = {}
        self.topics: dict[bytes, set[NaiveHubProtocol]] = {}

    def buildProtocol(self, addr: object) -> NaiveHubProtocol:
        """Build a connection."""
        return NaiveHubProtocol(self)


def main() -> None:
    """Listen on a free loopback port, say which, and serve."""
    port = reactor.listenTCP(0, NaiveHub(), interface="127.0.0.1")
    sys.stdout.write(f"listening {port.getHost().port}\n")
    sys.stdout.flush()
    reactor.run()


if __name__ == "__main__":
    main()
