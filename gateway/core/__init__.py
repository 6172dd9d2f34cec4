"""The protocol-neutral middle: messages, outcomes, routing."""
