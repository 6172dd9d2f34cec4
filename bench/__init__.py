"""Benchmarks: slow measurements that never run in the timed test suite."""
