"""The examples, run from the repository root as modules.

``python -m examples.digits_demo`` (the demo), ``python -m
examples.linen_cnn_digits``, ... -- see ``examples/README.md``. They share
:mod:`examples.common` (run bookkeeping, reports, plots, flags) and the models
and data of :mod:`models.flax_models`.
"""
