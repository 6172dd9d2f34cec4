"""End-to-end tests: real twistd processes on loopback, driven by plain sockets."""
