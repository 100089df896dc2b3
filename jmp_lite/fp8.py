"""Float8 matmuls: the recipe type and the float8 ``dot_general``.

Most users never import this module: a policy names a float8 recipe
(``get_policy("mixed_fp8")``, ``"p=f32,c=bf16,o=f32,m=fp8_rowwise"``) and
``autocast``, ``with_policy`` and the Flax policies run its matmuls in float8
(e4m3 operands, float32 accumulation, e5m2 or e4m3 gradients). Import it to
change a recipe's fields (:class:`Fp8Config`) or to call the float8 matmul
yourself: :func:`dot_general` (e.g. as a Flax layer's ``dot_general``),
:func:`ragged_dot` (a Mixture-of-Experts layer's ``jax.lax.ragged_dot``) and
:func:`all_to_all` (its token dispatch across devices in float8) are named
as in ``jax.lax``, the module saying the format.
Guide: ``docs/fp8.md``.

Example:
  >>> import jax.numpy as jnp, jmp_lite
  >>> from jmp_lite import fp8
  >>> config = fp8.Fp8Config(granularity="row", gradient_format="e4m3")
  >>> print(jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(config))
  p=full,c=bf16,o=full,m=fp8_rowwise
  >>> fp8.dot_general(jnp.ones((2, 16)), jnp.ones((16, 4)),
  ...                 (((1,), (0,)), ((), ())), config=config)[0, 0]
  Array(16., dtype=float32)
"""

from jmp_lite._src import checks as _checks
from jmp_lite._src.low_precision.collectives import fp8_all_to_all as all_to_all
from jmp_lite._src.low_precision.fp8_grouped import fp8_ragged_dot as ragged_dot
from jmp_lite._src.low_precision.fp8_matmul import DelayedScales
from jmp_lite._src.low_precision.fp8_matmul import fp8_dot_general as dot_general
from jmp_lite._src.low_precision.recipes import Fp8Config

__all__ = ("DelayedScales", "Fp8Config", "all_to_all", "dot_general",
           "ragged_dot")

# The old spellings (deprecated: they go in a later release): fp8.fp8_dot_general etc.
__getattr__ = _checks.old_names("jmp_lite.fp8", renamed={
    f"fp8_{name}": (f"jmp_lite.fp8.{name} (same function)", globals()[name])
    for name in ("all_to_all", "dot_general", "ragged_dot")})
