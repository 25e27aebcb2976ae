"""Benchmarks: each prints a table and writes JSON + a PNG."""
