"""Fuzzing shared by the robustness and malformed-connection tests and bench/fuzz.py.

- `tests.fuzzing.samples`: valid inputs of every codec (hypothesis strategies);
- `tests.fuzzing.mutation`: a fast seeded mutator over them;
- `tests.fuzzing.nesting`: deeply nested inputs for the formats that nest;
- `tests.fuzzing.targets`: each codec's decoders with their typed errors;
- `tests.fuzzing.connections`: malformed connections against a running gateway.
"""
