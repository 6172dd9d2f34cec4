"""Tests of the Twisted protocol adapters in gateway.protocols, in memory."""
