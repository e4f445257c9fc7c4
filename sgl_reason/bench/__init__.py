"""Benchmarks behind ``sgl-reason bench``: each runs its baseline in the same process and run."""
