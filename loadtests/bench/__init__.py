"""Helpers of the overhead benchmark (`python -m loadtests.bench_overhead`), one concern each."""
