"""Benchmarks and device checks for cupy_flash (run from the repository root)."""
