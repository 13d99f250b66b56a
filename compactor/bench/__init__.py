"""Benchmarks run by ``compactor bench``."""
