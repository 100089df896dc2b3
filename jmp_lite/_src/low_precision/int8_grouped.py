"""The int8 grouped matmul (``jax.lax.ragged_dot`` of a Mixture-of-Experts
layer) as integer products, forward and backward.

:func:`int8_ragged_dot` takes ``jax.lax.ragged_dot``'s operands (tokens
``[M, K]`` sorted by expert, expert weights ``[G, K, N]``, ``group_sizes``
``[G]``) and a static :class:`~jmp_lite._src.low_precision.recipes.Int8Config`.
Each product is ``jax.lax.ragged_dot_general`` on int8 operands with an
int32 result, then one float32 rescale, with the scales of the dense int8
matmul (:mod:`~jmp_lite._src.low_precision.int8_matmul`) taken per expert:

============  ===========================  =================================
product       operand                      scale (along the contracted axis)
============  ===========================  =================================
forward       tokens ``x``                 per token, along K
forward       expert weights ``w``         per expert and output channel
                                           along K (or per expert: tensor)
input grad    incoming gradient ``dy``     per token, along N
input grad    expert weights ``w``         per expert and input channel
                                           along N (or per expert)
weight grad   tokens ``x``, ``dy``         per expert and column, along the
                                           expert's own tokens
============  ===========================  =================================

A row scale never crosses an expert: the weight gradient's column scales
are segment maxima over each expert's tokens, so no scale mixes two experts
and no padding is needed. An empty expert gets scale 1 and an exact zero
weight gradient. Because every int32 sum is exact, the result equals a loop
over the experts of :func:`~jmp_lite._src.low_precision.int8_matmul.
int8_dot_general` on each expert's tokens **bit for bit**, on any data
(stochastic rounding aside: its bits come from the whole gradient). A
non-finite value makes only its own expert's (or token's) scale non-finite:
the int8 values are finite, so nothing leaks into another expert.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.low_precision import fp4_matmul as fp4_matmul_lib
from jmp_lite._src.low_precision import fp8_grouped as grouped_lib
from jmp_lite._src.low_precision import fp8_matmul as fp8_matmul_lib
from jmp_lite._src.low_precision import int8_matmul as int8_lib
from jmp_lite._src.low_precision import recipes as recipes_lib

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
Int8Config = recipes_lib.Int8Config
_DEFAULT_CONFIG = Int8Config()


def _rows(lhs, rhs, sizes, rhs_contract, out=_I32):
  """``[M, C] x [G, *, *] -> [M, Q]``: each row times its group's matrix,
  contracting ``rhs_contract`` of the rhs."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (rhs_contract,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims,
                                    preferred_element_type=out)


def _tokens(lhs, rhs, sizes, out=_I32):
  """``[M, P] x [M, Q] -> [G, P, Q]``: per group, contracting its rows."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims,
                                    preferred_element_type=out)


def _common(*xs):
  dtype = functools.reduce(jnp.promote_types, [x.dtype for x in xs])
  return [x.astype(dtype) for x in xs]


def _experts(w: jax.Array, config: Int8Config):
  """``w`` ``[G, Q, C]`` quantized along C per expert and row (channel) or
  per expert (tensor): int8 ``[G, Q, C]`` and the scale ``[G, Q]`` or
  ``[G, 1]``."""
  g = w.shape[0]
  if config.weight_granularity == "tensor":
    q, scale = int8_lib.quantize(w.reshape(g, -1), axis_name=config.axis_name)
    return q.reshape(w.shape), scale                          # [G, 1]
  q, scale = int8_lib.quantize(w)
  return q, scale[..., 0]                                     # [G, Q]


def _rows_product(x, w, groups, config, key=None):
  """float32 ``[M, Q]``: row-grouped ``x`` ``[M, C]`` times the experts
  ``w`` ``[G, Q, C]``, both quantized along C."""
  qx, sx = int8_lib.quantize(x, key=key)                      # [M, 1]
  qw, sw = _experts(w, config)
  acc = _rows(qx, qw, groups.sizes, 2)
  return acc.astype(_F32) * sx * grouped_lib.per_row(sw, groups, 1.0)


def _columns(x, groups, key=None):
  """``x`` ``[M, P]`` quantized per group and column along the group's
  rows: int8 ``[M, P]`` and the scale ``[G, P]``."""
  # The amax per group and column: the maximum of the magnitudes with NaN
  # taken as inf (int8_matmul.magnitude: a float scatter-max can skip a
  # NaN, never an inf); 0 for an empty group.
  amax = jnp.zeros((groups.count + 1,) + x.shape[1:], jnp.float32).at[
      groups.ids].max(int8_lib.magnitude(x))[:groups.count]
  scale = int8_lib.scale_from_amax(amax)
  rows = grouped_lib.per_row(scale, groups, 1.0)
  return int8_lib.rounded(x, rows, key), scale


class _Static(NamedTuple):
  config: Int8Config
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _forward(x, w, group_sizes, config):
  """float32 ``[M, N]``."""
  if not config.quantize_forward:
    x, w = _common(x, w)
    return _rows(x, w, group_sizes, 1, _F32)
  groups = grouped_lib.groups_of(group_sizes, x.shape[0])
  return _rows_product(x, jnp.swapaxes(w, 1, 2), groups, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_int8(x, w, group_sizes, extra, static):
  del extra
  return _forward(x, w, group_sizes, static.config).astype(static.out_dtype)


def _grouped_int8_fwd(x, w, group_sizes, extra, static):
  del extra
  out = _forward(x, w, group_sizes, static.config).astype(static.out_dtype)
  return out, (x, w, group_sizes)


def _grouped_int8_bwd(static, residuals, dy):
  x, w, group_sizes = residuals
  x, w, dy = (_first_order_only(v) for v in (x, w, dy))
  dx, dw = _backward(x, w, group_sizes, dy, static=static)
  return dx, dw, None, None


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(x, w, group_sizes, dy, *, static):
  """``dx [M, K]`` and ``dw [G, K, N]`` in the operands' dtypes."""
  config = static.config
  if config.stochastic_rounding:
    key = fp4_matmul_lib.data_key(dy)
    dgrad_key, wgrad_key = (jax.random.fold_in(key, 0),
                            jax.random.fold_in(key, 1))
  else:
    dgrad_key = wgrad_key = None
  groups = grouped_lib.groups_of(group_sizes, x.shape[0])
  # dx = dy @ w^T, contracting N: w [G, K, N] per expert and input channel.
  if config.quantize_input_gradient:
    dx = _rows_product(dy, w, groups, config, key=dgrad_key)
  else:
    lhs, rhs = _common(dy, w)
    dx = _rows(lhs, rhs, group_sizes, 2, _F32)
  # dw = x^T @ dy per expert, contracting its tokens; computed as the dense
  # recipe's (dy^T x, the gradient's scale first), then transposed.
  if config.quantize_weight_gradient:
    qg, sg = _columns(dy, groups, wgrad_key)                  # [G, N]
    qx, sx = _columns(x, groups)                              # [G, K]
    acc = _tokens(qg, qx, group_sizes)                        # [G, N, K]
    dw = acc.astype(_F32) * sg[:, :, None] * sx[:, None, :]
  else:
    lhs, rhs = _common(dy, x)
    dw = _tokens(lhs, rhs, group_sizes, _F32)
  return (dx.astype(static.lhs_dtype),
          jnp.swapaxes(dw, 1, 2).astype(static.rhs_dtype))


_grouped_int8.defvjp(_grouped_int8_fwd, _grouped_int8_bwd)

_first_order_only = fp8_matmul_lib.first_order_only(int8_lib.SECOND_ORDER_HELP)


def int8_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any,
                    precision: Any = None, preferred_element_type: Any = None,
                    *, config: Int8Config = _DEFAULT_CONFIG) -> jax.Array:
  """``jax.lax.ragged_dot`` as int8 integer products, forward and backward.

  A Mixture-of-Experts layer's expert matmul: tokens ``[M, K]`` sorted by
  expert, expert weights ``[G, K, N]``, ``group_sizes`` ``[G]``. Every
  product multiplies int8 operands into int32 and rescales once in float32,
  with scales per token and per expert (never across two experts); it
  equals a loop over the experts of :func:`int8_dot_general` bit for bit.
  Guide: ``docs/int8.md``.

  Args:
    lhs: ``[M, K]`` float32, bfloat16 or float16 tokens.
    rhs: ``[G, K, N]`` expert weights.
    group_sizes: ``[G]`` integers summing to at most M (rows past the sum
      give zeros).
    precision: accepted for signature compatibility and ignored.
    preferred_element_type: the result dtype; default the operands'.
    config: the static :class:`Int8Config`.

  Returns:
    ``[M, N]``, as ``jax.lax.ragged_dot``'s.

  Raises:
    TypeError: for a config that is not an ``Int8Config``, non-floating
      operands or a non-integer ``group_sizes``.
    ValueError: for shapes that do not fit, or group sizes that are
      negative or sum past M (when known).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import int8
    >>> x, w = jnp.ones((6, 32)), jnp.full((3, 32, 16), 0.5)
    >>> y = int8.ragged_dot(x, w, jnp.array([2, 0, 4]))
    >>> y.shape, float(y[0, 0])
    ((6, 16), 16.0)
  """
  del precision
  if not isinstance(config, Int8Config):
    raise TypeError(
        f"config must be an Int8Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Int8Config('int8').")
  lhs, rhs, sizes = grouped_lib.check_operands(lhs, rhs, group_sizes,
                                               "jmp_lite.int8.ragged_dot")
  fp8_matmul_lib.check_axis_bound(config)
  out_dtype = fp8_matmul_lib.result_dtype(lhs, rhs, preferred_element_type)
  static = _Static(config, np.dtype(out_dtype), np.dtype(lhs.dtype),
                   np.dtype(rhs.dtype))
  return grouped_lib.grouped_product(lhs, rhs, sizes, None,
                                     matmul=_grouped_int8, static=static)
