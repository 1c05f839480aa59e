"""Kernel benchmarks: each script runs on its own (see README.md here)."""
