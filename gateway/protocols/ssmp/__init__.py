"""SSMP in both roles: the hub (server) and the upstream (client)."""
