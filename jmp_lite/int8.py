"""int8 matmuls: the recipe type, the int8 ``dot_general`` and grouped matmul.

For the hardware with int8 matrix units and no float8 ones (TPU v4, v5e,
v5p, v6e; NVIDIA A100 and other Ampere/Ada GPUs). Every product quantizes
its two operands to symmetric int8 (``[-127, 127]``, round half to even)
with float32 scales along its contracted axis, multiplies ``s8 x s8 ->
s32`` and rescales once in float32: exact on CPU against an integer
reference, and an int8 ``dot_general`` in the programs exported for TPU and
CUDA. A policy names a recipe as ``m=int8`` (all three matmuls of a linear
in int8, per-output-channel weight scales: torchao's int8 mixed-precision
training) or ``m=int8_switchback`` (SwitchBack: a tensor-wise weight scale,
the weight gradient in the compute dtype), with fields in parentheses
(``m=int8(stochastic_rounding=true)``; the preset ``mixed_int8``), and every
route (``with_policy``, ``autocast``, linen, NNX) then runs the policy's
matmuls through :func:`dot_general` and its Mixture-of-Experts
``ragged_dot``s through :func:`ragged_dot` (named as in ``jax.lax``, the
module saying the format), with float8's exclusions.
Guide: ``docs/int8.md``.

Example:
  >>> import jax.numpy as jnp, jmp_lite
  >>> from jmp_lite import int8
  >>> int8.dot_general(jnp.ones((2, 16)), jnp.ones((16, 4)),
  ...                  (((1,), (0,)), ((), ())))[0, 0]
  Array(16., dtype=float32)
  >>> jmp_lite.get_policy("mixed_int8").fp8_recipe == int8.Int8Config()
  True
"""

from jmp_lite._src import checks as _checks
from jmp_lite._src.low_precision.int8_grouped import int8_ragged_dot as ragged_dot
from jmp_lite._src.low_precision.int8_matmul import int8_dot_general as dot_general
from jmp_lite._src.low_precision.recipes import Int8Config

__all__ = (
    "Int8Config",
    "dot_general",
    "ragged_dot",
)

# The old spellings (deprecated: they go in a later release): int8.int8_dot_general etc.
__getattr__ = _checks.old_names("jmp_lite.int8", renamed={
    f"int8_{name}": (f"jmp_lite.int8.{name} (same function)", globals()[name])
    for name in ("dot_general", "ragged_dot")})
