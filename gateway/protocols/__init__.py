"""Thin Twisted adapters: feed a codec, dispatch its events to the core."""
