"""Tests of the fleet: the node id."""
