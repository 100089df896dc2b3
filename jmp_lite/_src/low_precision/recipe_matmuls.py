"""The routes' one entry to the quantized matmuls: the recipe object picks
the ``dot_general`` and the grouped matmul (``ragged_dot``).

What every route calls for a product its recipe quantizes (the autocast
interpreter's rules, the Flax layers' hook, the linen/NNX grouped route):
an ``Fp8Config`` runs the float8 matmuls (with delayed-scaling ``scales``
if given), an ``Fp4Config`` the FP4 ones (no PRNG key: stochastic rounding
derives its bits from the gradient's, ``key=None``), an ``Int8Config`` the
int8 ones. FP4 and int8 recipes scale from current amaxes: the routes hand
them no delayed-scaling scales.
"""

from __future__ import annotations

from typing import Any

import jax

from jmp_lite._src.low_precision import fp4_grouped as fp4_grouped_lib
from jmp_lite._src.low_precision import fp4_matmul as fp4_matmul_lib
from jmp_lite._src.low_precision import fp8_grouped as fp8_grouped_lib
from jmp_lite._src.low_precision import fp8_matmul as fp8_matmul_lib
from jmp_lite._src.low_precision import int8_grouped as int8_grouped_lib
from jmp_lite._src.low_precision import int8_matmul as int8_matmul_lib
from jmp_lite._src.low_precision import recipes as recipes_lib


def recipe_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, *,
                       config: Any, preferred_element_type: Any = None,
                       scales: Any = None,
                       out_sharding: Any = None) -> jax.Array:
  """The quantized ``dot_general`` of a policy's recipe object.

  Args:
    lhs: the activation.
    rhs: the weight.
    dimension_numbers: as for ``jax.lax.dot_general``.
    config: the recipe object (``Fp8Config``, ``Fp4Config`` or
      ``Int8Config``).
    preferred_element_type: the result dtype.
    scales: delayed scaling's precomputed scales (float8 only).
    out_sharding: the result's sharding, as ``jax.lax.dot_general`` takes it.

  Returns:
    The product.
  """
  if isinstance(config, recipes_lib.Fp4Config):
    return fp4_matmul_lib.fp4_dot_general(
        lhs, rhs, dimension_numbers,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding, config=config)
  if isinstance(config, recipes_lib.Int8Config):
    return int8_matmul_lib.int8_dot_general(
        lhs, rhs, dimension_numbers,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding, config=config)
  return fp8_matmul_lib.fp8_dot_general(
      lhs, rhs, dimension_numbers,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding, config=config, scales=scales)


def recipe_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, *, config: Any,
                      preferred_element_type: Any = None,
                      scales: Any = None) -> jax.Array:
  """The quantized grouped matmul of a policy's recipe object; operands as
  ``jax.lax.ragged_dot``'s, ``scales`` as :func:`recipe_dot_general`'s."""
  if isinstance(config, recipes_lib.Fp4Config):
    return fp4_grouped_lib.fp4_ragged_dot(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
        config=config)
  if isinstance(config, recipes_lib.Int8Config):
    return int8_grouped_lib.int8_ragged_dot(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
        config=config)
  return fp8_grouped_lib.fp8_ragged_dot(
      lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
      config=config, scales=scales)
