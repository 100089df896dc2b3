"""Benchmarks for jmp_lite: they report figures; the tests in ``tests/`` assert behaviour."""
