"""Benchmarks: each prints its numbers and writes a JSON report."""
