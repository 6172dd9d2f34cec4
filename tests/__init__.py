"""msggateway tests, mirroring the gateway package (STYLE.md, section 7)."""
