"""The TLS-terminating front-end: one protocol over TLS in, the same protocol in plaintext out."""
