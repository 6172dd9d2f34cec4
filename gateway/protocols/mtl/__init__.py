"""MTL, the Message Transport Layer over ZeroMQ: control and data flows."""
