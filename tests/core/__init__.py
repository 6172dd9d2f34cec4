"""Tests of the core: messages and outcomes, addressing, routing and secrets."""
