"""Mixed-precision diagnostics: which values underflow or overflow in half
precision, and what to do about it.

:func:`tensor_stats` and :func:`group_stats` measure any pytree inside a
jitted step; :func:`advise` and :func:`report` turn the statistics into a
static loss scale, float16 or bfloat16, what to keep in float32, a table and
a plot. Guide: ``docs/diagnostics.md``.

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

from jmp_lite._src.diagnostics.report import Advice
from jmp_lite._src.diagnostics.report import advise
from jmp_lite._src.diagnostics.report import report
from jmp_lite._src.diagnostics.stats import group_stats
from jmp_lite._src.diagnostics.stats import tensor_stats
from jmp_lite._src.diagnostics.stats import TensorStats

__all__ = (
    "Advice",
    "TensorStats",
    "advise",
    "group_stats",
    "report",
    "tensor_stats",
)
