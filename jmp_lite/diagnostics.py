"""Mixed-precision diagnostics: which values underflow or overflow in half
precision, and what to do about it.

Jit-safe statistics for any pytree (gradients, activations), per leaf or per
module; advice (a static loss scale, float16 or bfloat16, what to keep in
float32); a table, a histogram plot against the float16/bfloat16 ranges, and a
check that catches gradients handed to ``jmp_lite.loss_scaling`` without
having been scaled. Guide: ``docs/diagnostics.md``.

This module imports neither Flax nor matplotlib (the plot imports it when
called).

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
"""

from jmp_lite._src.diagnostics.stats import Advice
from jmp_lite._src.diagnostics.stats import advise
from jmp_lite._src.diagnostics.stats import DEFAULT_HEADROOM
from jmp_lite._src.diagnostics.stats import format_table
from jmp_lite._src.diagnostics.stats import group_stats
from jmp_lite._src.diagnostics.stats import HISTOGRAM_EXPONENTS
from jmp_lite._src.diagnostics.stats import largest_magnitude
from jmp_lite._src.diagnostics.stats import plot_histograms
from jmp_lite._src.diagnostics.stats import report
from jmp_lite._src.diagnostics.stats import ROOT_NAME
from jmp_lite._src.diagnostics.stats import scale_check_init
from jmp_lite._src.diagnostics.stats import scale_check_record
from jmp_lite._src.diagnostics.stats import scale_check_update
from jmp_lite._src.diagnostics.stats import ScaleCheck
from jmp_lite._src.diagnostics.stats import tensor_stats
from jmp_lite._src.diagnostics.stats import TensorStats

__all__ = (
    "Advice",
    "DEFAULT_HEADROOM",
    "HISTOGRAM_EXPONENTS",
    "ROOT_NAME",
    "ScaleCheck",
    "TensorStats",
    "advise",
    "format_table",
    "group_stats",
    "largest_magnitude",
    "plot_histograms",
    "report",
    "scale_check_init",
    "scale_check_record",
    "scale_check_update",
    "tensor_stats",
)
