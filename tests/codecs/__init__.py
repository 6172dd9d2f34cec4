"""Tests of the sans-IO codecs in gateway.codecs."""
