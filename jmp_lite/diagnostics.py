"""Mixed-precision diagnostics: which values underflow or overflow in half
precision, what float8 would clip or flush, and what to do about it.

:func:`tensor_stats` and :func:`group_stats` measure any pytree inside a
jitted step; :func:`advise` and :func:`report` turn the statistics into a
static loss scale, float16 or bfloat16, what to keep in float32, a table and
a plot. For float8, :func:`fp8_stats` measures what each scaling recipe
(a plain cast, per tensor, per row, blockwise, MXFP8, a delayed scale) would
clip at the format's max and flush to zero, with the quantizers the float8
matmul runs, and :func:`advise`, given those statistics, picks the cheapest
granularity per layer or keeps the layer out of float8; ``fmt="e2m1"`` and
``fmt="int8"`` measure and advise the FP4 and int8 recipes the same way (int8: the share of each
layer's values that round to zero under row-wise int8, and which layers to
keep in 16 bits). Guide: ``docs/diagnostics.md``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jmp_lite import diagnostics
  >>> grads = {"dense": {"w": jnp.array([1e-9, 1e-6, 1e-3])}}
  >>> stats = jax.jit(diagnostics.tensor_stats)(grads)      # inside a train step
  >>> round(stats["dense"]["w"].fraction("f16_underflow"), 3)
  0.333
  >>> advice = diagnostics.advise(stats)                    # on the host
  >>> advice.dtype, advice.loss_scale == 2.0**22
  ('float16', True)
  >>> acts = {"dense": jnp.ones((4, 64)).at[0].set(1e6)}    # an outlier row
  >>> fp8 = jax.jit(diagnostics.fp8_stats, static_argnums=1)(acts, "activation")
  >>> diagnostics.advise(fp8).granularity
  {'dense': 'row'}
  >>> spiky = {"dense": jnp.ones((4, 64)).at[:, 0].set(1e4)}  # an outlier feature
  >>> i8 = diagnostics.fp8_stats(spiky, "activation", fmt="int8")
  >>> i8["dense"].fraction("flushed", "int8"), diagnostics.advise(i8).keep_out
  (0.984375, ('dense',))
"""

from jmp_lite._src import checks as _checks
from jmp_lite._src.diagnostics import fp8_advice as _fp8_advice
from jmp_lite._src.diagnostics.advice import advise
from jmp_lite._src.diagnostics.fp8_advice import Fp8Advice
from jmp_lite._src.diagnostics.fp8_stats import fp8_stats
from jmp_lite._src.diagnostics.fp8_stats import Fp8Stats
from jmp_lite._src.diagnostics.report import Advice
from jmp_lite._src.diagnostics.report import report
from jmp_lite._src.diagnostics.stats import group_stats
from jmp_lite._src.diagnostics.stats import tensor_stats
from jmp_lite._src.diagnostics.stats import TensorStats

__all__ = (
    "Advice",
    "Fp8Advice",
    "Fp8Stats",
    "TensorStats",
    "advise",
    "fp8_stats",
    "group_stats",
    "report",
    "tensor_stats",
)

# The old spellings (deprecated: they go in a later release).
# advise_fp8 keeps its own signature (advise_fp8(stats, ...)) and behaviour.
__getattr__ = _checks.old_names("jmp_lite.diagnostics", renamed={
    "advise_fp8": ("jmp_lite.diagnostics.advise (the same advice, an "
                   "Fp8Advice, for float8, FP4 and int8 statistics)",
                   _fp8_advice.advise_fp8),
})
