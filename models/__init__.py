"""Models, data and output plumbing shared by the examples and the benchmarks.

Not part of the jmp_lite library (and not installed with it); importable from
the repository root:

* :mod:`models.flax_models`: ordinary, unmodified Flax models and the small
  datasets the examples train and the benchmarks measure;
* :mod:`models.jax_models`: the plain-JAX models of the benchmark workloads;
* :mod:`models.results`: where results are written (scratch folder or, with
  ``--update-results``, the committed one), JSON, the machine and versions.
"""
