"""Sans-IO codecs: bytes in, typed events out; events in, bytes out.

Nothing here imports Twisted, reads a clock or logs.
"""
