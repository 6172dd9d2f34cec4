"""QMQP streaming in both roles: the listener (server) and the upstream (client)."""
