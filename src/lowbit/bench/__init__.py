"""Benchmarks: ``python -m lowbit.bench [quantize|dense|grouped|all]``."""
