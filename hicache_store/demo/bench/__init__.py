"""Benchmarks that ship with the package (run through ``hicache-store bench ...``)."""
