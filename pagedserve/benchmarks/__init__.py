"""Benchmarks behind `pagedserve bench ...` (see pagedserve.benchmarks.throughput)."""
