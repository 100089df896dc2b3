"""Models and data shared by the examples and the benchmarks.

Not part of the jmp_lite library (and not installed with it): ordinary,
unmodified Flax models and small datasets that the examples train and the
benchmarks measure, importable from the repository root
(``from models import flax_models``).
"""
