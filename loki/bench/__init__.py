"""Benchmarks of the decode kernels (``loki.bench.harness``: add_arguments / run for a ``loki bench`` CLI)."""
