"""Grouped (``ragged_dot``) matmuls in FP4 (NVFP4, MXFP4): per-group tensor
scales, group-aligned token blocks, safe empty groups.

:func:`fp4_ragged_dot` is ``jax.lax.ragged_dot(x[M, K], w[G, K, N],
group_sizes[G])`` (a Mixture-of-Experts layer's product: the rows of group
``g`` times expert ``g``'s weight) under an FP4 recipe
(:class:`~jmp_lite._src.low_precision.recipes.Fp4Config`), forward and backward, with
the numerics of the dense recipe
(:func:`~jmp_lite._src.low_precision.fp4_matmul.fp4_dot_general`) applied to each
group: the grouped result is the per-group loop of ``fp4_dot_general``,
computed in one pass (``docs/fp4.md``, grouped matmuls). The layout helpers
and the argument checks are the float8 grouped matmul's
(:mod:`~jmp_lite._src.low_precision.fp8_grouped`).

Per group:

* **Tensor statistics are per group.** NVFP4's per-tensor scale (from the
  current amax) and the NaN flag of the activation and of the incoming
  gradient are those of the group's rows (a segment maximum and a segment
  sum over the rows), the weight's those of expert ``g``'s ``[K, N]``
  slice. Multiplying one expert's tokens by 1000 changes no other expert's
  result, and a NaN or inf in one expert's tokens makes NaN only what the
  per-group loop makes NaN: that group's output rows and that expert's
  weight gradient (a NaN in the incoming gradient's rows of a group: that
  group's input gradient rows and that expert's weight gradient; in an
  expert's weight: that group's output and input gradient rows).
* **Forward and input gradient** contract K and N: the activation and the
  gradient are quantized in 1x16 (1x32) row blocks as by the dense recipe,
  the weight ``[G, N, K]`` per expert exactly as the dense recipe quantizes
  one weight (16x16 tiles with NVFP4's ``two_d_weights``; the input
  gradient's column-wise copy from the high-precision weight).
* **Weight gradient** ``dw[g] = x_g^T @ dy_g`` contracts the tokens: both
  operands are laid out with every group starting at a multiple of the
  block (16 for NVFP4, 32 for MXFP4; zero rows between groups, static
  shapes, no host sync: :func:`~jmp_lite._src.low_precision.fp8_grouped.padded_layout`),
  so no scale block and no 16-point Hadamard block holds two experts'
  tokens; the random Hadamard transform runs on each 16-token block of that
  layout, which is the dense recipe's transform of each group's tokens
  zero-padded to a multiple of 16. The tensor amax is taken after the
  transform, per group.
* **Empty groups**: amax 0 gives tensor scale 1 (finite), and the weight
  gradient of an empty group is exactly zero.

**The products** are ``jax.lax.ragged_dot_general`` on the dequantized
operands (E2M1 values times their block scales: exact in float32) with
float32 accumulation and ``precision=HIGHEST`` (no TF32 on a GPU), the
per-group tensor scales applied to the float32 result as the dense recipe's
:func:`~jmp_lite._src.low_precision.fp4_matmul.apply_tensor_scales` applies them (MXFP4's
operands lifted by ``2**2`` per group where that cannot overflow, as the dense
emulation lifts them). There is no native path: JAX has no block-scaled
grouped GEMM, so on a GPU too the grouped product is this exact emulation
(``config.native`` has no effect here). Rows past ``sum(group_sizes)``
belong to no group (as for ``jax.lax.ragged_dot``): their output and input
gradient are zero, and they add nothing to any weight gradient.

**Stochastic rounding** (``config.stochastic_rounding``) rounds the incoming
gradient of both backward products, with the random bits of ``key``
(``jax.random.fold_in(key, 0)`` for the input gradient's ``[M, N]`` and
``fold_in(key, 1)`` for the weight gradient's padded ``[N, rows]``, one draw
each over all groups, as the dense recipe folds its key); ``key=None``
derives the key from the gradient's bits, as the dense recipe does. The
per-group loop draws other bits (one draw per group, of the group's shape):
the grouped result equals it given the same bits per element (tested with a
deterministic function of each element in place of the random bytes), and
is unbiased over keys.

**What "bit for bit" can mean on CPU**: quantized values, block scales and
tensor scales are the per-group loop's bit for bit; the float32 sums are
XLA's, which on CPU does not sum in one order for every shape, so the
grouped result equals the loop bit for bit where the float32 sums are exact
and to float32 rounding of the accumulation otherwise (as the float8
grouped matmul, :mod:`~jmp_lite._src.low_precision.fp8_grouped`).

Second derivatives are refused with a ``ValueError``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.low_precision import recipes as recipes_lib
from jmp_lite._src.low_precision import fp4 as fp4_lib
from jmp_lite._src.low_precision import fp4_matmul as fp4_matmul_lib
from jmp_lite._src.low_precision import fp8_grouped as grouped_lib
from jmp_lite._src.low_precision import fp8_matmul as fp8_matmul_lib

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_HIGHEST = jax.lax.Precision.HIGHEST
Fp4Config = recipes_lib.Fp4Config
_DEFAULT_CONFIG = Fp4Config()

# pylint: disable=protected-access
_pad_axis = fp4_matmul_lib._pad_axis
_dequantized_blocks = fp4_matmul_lib._dequantized_blocks
_finite_part = fp4_lib._finite_part
_ragged_rows = grouped_lib._ragged_rows
_ragged_tokens = grouped_lib._ragged_tokens
_first_order_only = grouped_lib._first_order_only
# pylint: enable=protected-access


class _Operand(NamedTuple):
  """An FP4 operand ``(B, P, C)`` quantized along C (C padded to blocks).

  ``values`` float32 on the E2M1 grid; ``scales`` float32 E4M3 values
  (NVFP4) or uint8 E8M0 codes (MXFP4), ``(B, P, C // block)``;
  ``tensor_scale`` float32, per group: ``(1, M, 1)`` for row-grouped
  operands (one per row, its group's), ``(G, 1, 1)`` for the experts' weight,
  ``(G,)`` for the weight gradient's token-grouped operands. NVFP4's
  ``1 / S_enc``, MXFP4's 1; NaN where the group held NaN or inf.
  """

  values: jax.Array
  scales: jax.Array
  tensor_scale: jax.Array


def _mx(config: Fp4Config) -> bool:
  return config.recipe == "mxfp4"


def _segment_max(values, ids, count, floor):
  """``[count]``: the maximum of ``values`` (``[R]``: int32, or float32
  ``>= 0``) over each segment of ``ids`` (``count`` meaning none: dropped),
  at least ``floor`` (an empty segment's). Floats are compared as their
  bits (the same order for non-negative floats), so that no ``-inf`` is
  made, not even segment_max's identity (``jax_debug_infs``)."""
  floating = jnp.issubdtype(values.dtype, jnp.floating)
  if floating:
    values = jax.lax.bitcast_convert_type(values, jnp.int32)
    floor = jax.lax.bitcast_convert_type(jnp.asarray(floor, _F32), jnp.int32)
  out = jax.ops.segment_max(values, ids, num_segments=count)
  out = jnp.maximum(out, floor)
  return jax.lax.bitcast_convert_type(out, _F32) if floating else out


def _group_stats(magnitude, poison, ids, count, config):
  """Per-group amax and NaN flag (float32 ``[G]``) from per-row ones
  (``[R]``, group ``ids`` ``[R]``, ``count`` meaning none), over
  ``config.axis_name`` too, as the dense recipe reduces a tensor's."""
  amax = _segment_max(magnitude, ids, count, 0.0)
  poison = jax.ops.segment_sum(poison, ids, num_segments=count)
  return fp4_lib.global_tensor_stats(amax, poison, config.axis_name)


def _quantized(x, xf, magnitude, amax, poison, config, two_d=False, key=None):
  """The dense recipe's quantizer of ``(B, P, C)`` (finite part ``xf``,
  its ``magnitude``) under the given tensor statistics (broadcasting against
  the block scales)."""
  if _mx(config):
    values, scales = fp4_lib.mxfp4_quantize_f32(
        x, rule=config.mx_scale_rule, key=key)
    tensor_scale = jnp.ones((), _F32) + poison
  else:
    values, scales, tensor_scale = fp4_lib.nvfp4_quantize_given(
        xf, magnitude, amax, poison, two_d=two_d, key=key)
  return values, scales, tensor_scale


def _rows_operand(v, groups, config, key=None):
  """Row-grouped ``[M, C]`` quantized along C, each row under its group's
  tensor scale: ``_Operand`` ``(1, M, C')``."""
  v = _pad_axis(v.astype(_F32), -1, config.block_size)
  xf, _ = _finite_part(v)
  magnitude = jnp.abs(xf)
  amax, poison = _group_stats(
      jnp.max(magnitude, axis=1, initial=0.0),
      jnp.sum(v * jnp.zeros((), _F32), axis=1), groups.ids, groups.count,
      config)
  amax = grouped_lib.per_row(amax, groups, 0.0)[None, :, None]
  poison = grouped_lib.per_row(poison, groups, 0.0)[None, :, None]
  op = _Operand(*_quantized(v[None], xf[None], magnitude[None], amax, poison,
                            config, key=key))
  return jax.lax.stop_gradient(op)


def _experts_operand(w, config, two_d):
  """The experts' ``[G, P, C]`` quantized along C as the dense recipe
  quantizes one weight, each under its own tensor scale: ``_Operand``."""
  w = _pad_axis(w.astype(_F32), -1, config.block_size)
  if two_d:
    w = _pad_axis(w, -2, fp4_lib.NVFP4_BLOCK_SIZE)
  xf, _ = _finite_part(w)
  magnitude = jnp.abs(xf)
  amax = jnp.max(magnitude, axis=(1, 2), initial=0.0)
  poison = jnp.sum(w * jnp.zeros((), _F32), axis=(1, 2))
  amax, poison = fp4_lib.global_tensor_stats(amax, poison, config.axis_name)
  op = _Operand(*_quantized(w, xf, magnitude, amax[:, None, None],
                            poison[:, None, None], config, two_d=two_d))
  return jax.lax.stop_gradient(op)


def _tokens_operand(v, padded, count, config, key=None):
  """The weight gradient's operand: ``[M, C]`` in the padded layout,
  transposed to ``(1, C, rows)`` (Hadamard-transformed along the rows with
  ``config.rht``) and quantized along the rows, each group's blocks under
  its group's tensor scale: ``_Operand`` (tensor scales ``[G]``)."""
  t = jnp.swapaxes(grouped_lib.to_padded(v.astype(_F32), padded), 0, 1)
  if config.rht:
    t = fp4_lib.hadamard_f32(t)                  # rows: a multiple of 16
  t = t[None]                                    # (1, C, rows)
  block = config.block_size
  row_ids = jnp.repeat(padded.block_ids, block, total_repeat_length=padded.rows)
  xf, _ = _finite_part(t)
  magnitude = jnp.abs(xf)
  amax, poison = _group_stats(
      jnp.max(magnitude[0], axis=0, initial=0.0),
      jnp.sum(t[0] * jnp.zeros((), _F32), axis=0), row_ids, count, config)
  # Each block (one per group-aligned block of the rows) under its group's.
  amax_b = jnp.concatenate([amax, jnp.zeros((1,), _F32)])[padded.block_ids]
  poison_b = jnp.concatenate([poison, jnp.zeros((1,), _F32)])[
      padded.block_ids]
  values, scales, _ = _quantized(t, xf, magnitude, amax_b[None, None],
                                 poison_b[None, None], config, key=key)
  if _mx(config):
    tensor_scale = jnp.ones((), _F32) + poison
  else:
    decode = fp4_lib.nvfp4_tensor_scales(amax)[1]
    tensor_scale = jnp.where(jnp.isnan(poison), poison, decode)
  return jax.lax.stop_gradient(_Operand(values, scales, tensor_scale))


# ---------------------------------------------------------------------------
# Products (float32; the tensor scales applied as the dense recipe does).
# ---------------------------------------------------------------------------


def _dequantized(op, shift=0):
  """float32 values times their block scales (E8M0: times ``2**shift``
  too). An MXFP4 block flagged NaN (code 255) dequantizes with scale 1
  instead: the flag travels in its group's tensor scale, which makes the
  group's whole product NaN as the dense recipe's; a NaN operand element
  would reach every group (XLA's ``ragged_dot`` multiplies each group's
  matrix with every row, masked)."""
  scales = op.scales
  if np.dtype(scales.dtype) == np.dtype(np.uint8):
    scales = jnp.where(scales == 255, jnp.asarray(127, np.uint8), scales)
  return _dequantized_blocks(op.values, scales, shift)


def _log2_ceil(c: jax.Array) -> jax.Array:
  """int32 ``ceil(log2(max(c, 1)))`` of int32 ``c``."""
  return 32 - jax.lax.clz(jnp.maximum(c, 1) - 1)


def _rows_product(a, b, groups, config, q):
  """float32 ``[M, q]``: each row of ``a`` (``(1, M, C)``) times its
  expert's ``b`` (``(G, Q, C)``) over C, then the tensor scales."""
  if _mx(config):
    # The dense emulation's lift, per group (its operands and length).
    top_rows = fp4_matmul_lib.mx_top_exponent(a.scales[0], axis=-1)
    ka = _segment_max(top_rows, groups.ids, groups.count, -127)
    kb = fp4_matmul_lib.mx_top_exponent(b.scales, axis=(1, 2))
    log_c = int(np.ceil(np.log2(max(a.values.shape[-1], 1))))
    shift = fp4_matmul_lib.mx_lift(ka, kb, log_c)
    shift_rows = grouped_lib.per_row(shift, groups, 0)[:, None]   # [M, 1]
    lhs = _dequantized(a, shift_rows[None])[0]
    rhs = _dequantized(b, shift[:, None, None])
  else:
    lhs = _dequantized(a)[0]
    rhs = _dequantized(b)
  acc = _ragged_rows(lhs, rhs, groups.sizes, 2, _HIGHEST)[:, :q]
  if _mx(config):
    acc = fp4_lib.mul_pow2(acc, -2 * shift_rows)
  b_scale = grouped_lib.per_row(b.tensor_scale.reshape(-1), groups, 1.0)
  return fp4_matmul_lib.apply_tensor_scales(acc, a.tensor_scale[0],
                                            b_scale[:, None])


def _tokens_product(a, b, padded, config):
  """float32 ``[G, P, Q]``: per group, ``a`` (``(1, P, rows)``) times ``b``
  (``(1, Q, rows)``) over the group's rows, then the tensor scales."""
  count = padded.sizes.shape[0]
  if _mx(config):
    def top(op):
      per_block = fp4_matmul_lib.mx_top_exponent(op.scales[0], axis=0)
      return _segment_max(per_block, padded.block_ids, count, -127)
    shift = fp4_matmul_lib.mx_lift(top(a), top(b), _log2_ceil(padded.sizes))
    shift_b = jnp.concatenate([shift, jnp.zeros((1,), _I32)])[
        padded.block_ids][None, None]
    lhs = _dequantized(a, shift_b)[0].T
    rhs = _dequantized(b, shift_b)[0].T
  else:
    lhs = _dequantized(a)[0].T
    rhs = _dequantized(b)[0].T
  acc = _ragged_tokens(lhs, rhs, padded.sizes, _HIGHEST)       # [G, P, Q]
  if _mx(config):
    acc = fp4_lib.mul_pow2(acc, -2 * shift[:, None, None])
  return fp4_matmul_lib.apply_tensor_scales(
      acc, a.tensor_scale[:, None, None], b.tensor_scale[:, None, None])


# ---------------------------------------------------------------------------
# The custom gradient.
# ---------------------------------------------------------------------------


class _Static(NamedTuple):
  config: Fp4Config
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _forward(x, w, group_sizes, config):
  """float32 ``[M, N]``."""
  if not config.quantize_forward:   # the late switch: high precision
    if x.dtype != w.dtype:
      x, w = x.astype(_F32), w.astype(_F32)
    return _ragged_rows(x, w, group_sizes, 1)
  groups = grouped_lib.groups_of(group_sizes, x.shape[0])
  qx = _rows_operand(x, groups, config)
  qw = _experts_operand(jnp.swapaxes(w, 1, 2), config,
                        config.two_d_weights)                  # [G, N, K]
  return _rows_product(qx, qw, groups, config, w.shape[2])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_fp4(x, w, group_sizes, key, static):
  del key
  return _forward(x, w, group_sizes, static.config).astype(static.out_dtype)


def _grouped_fp4_fwd(x, w, group_sizes, key, static):
  out = _forward(x, w, group_sizes, static.config).astype(static.out_dtype)
  return out, (x, w, group_sizes, key)


def _grouped_fp4_bwd(static, residuals, dy):
  x, w, group_sizes, key = residuals
  # Whatever would differentiate the backward pass (a second derivative)
  # meets _first_order_only's refusal.
  x, w, dy = (_first_order_only(v) for v in (x, w, dy))
  dx, dw = _backward(x, w, group_sizes, key, dy, static=static)
  return dx, dw, None, None


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(x, w, group_sizes, key, dy, *, static):
  """``dx [M, K]`` and ``dw [G, K, N]`` in the operands' dtypes."""
  config = static.config
  g = dy.astype(_F32)
  if config.stochastic_rounding:
    key = fp4_matmul_lib.data_key(g) if key is None else key
    dgrad_key = jax.random.fold_in(key, 0)
    wgrad_key = jax.random.fold_in(key, 1)
  else:
    dgrad_key = wgrad_key = None
  groups = grouped_lib.groups_of(group_sizes, x.shape[0])
  # dx = dy @ w^T over N; the weight's column-wise copy from high precision.
  qg = _rows_operand(g, groups, config, key=dgrad_key)
  qw = _experts_operand(w, config, config.two_d_weights)       # [G, K, N]
  dx = _rows_product(qg, qw, groups, config, x.shape[1])
  # dw = x^T @ dy over each group's tokens, in group-aligned blocks.
  padded = grouped_lib.padded_layout(groups, config.block_size)
  qgt = _tokens_operand(g, padded, groups.count, config, key=wgrad_key)
  qxt = _tokens_operand(x, padded, groups.count, config)
  dw = _tokens_product(qgt, qxt, padded, config)               # [G, N, K]
  return (dx.astype(static.lhs_dtype),
          jnp.swapaxes(dw, 1, 2).astype(static.rhs_dtype))


_grouped_fp4.defvjp(_grouped_fp4_fwd, _grouped_fp4_bwd)


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def fp4_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any,
                   precision: Any = None, preferred_element_type: Any = None,
                   *, config: Fp4Config = _DEFAULT_CONFIG,
                   key: Any = None) -> jax.Array:
  """``jax.lax.ragged_dot`` in FP4 (NVFP4 or MXFP4), forward and backward.

  The grouped matmul of a Mixture-of-Experts layer: the rows of group ``g``
  (``group_sizes[g]`` consecutive rows of ``lhs``) times ``rhs[g]``, under
  the FP4 recipe ``config`` applied to each group as
  :func:`fp4_dot_general` applies it to one matmul (the rhs is the weight:
  16x16 tiles with NVFP4; stochastic rounding of the incoming gradient; the
  random Hadamard transform on the weight gradient's operands). NVFP4's
  tensor scales and the NaN flags are per group (expert); along the token
  axis of the weight gradient every group starts a new block, so no scale
  block or Hadamard block holds two experts' tokens; an empty group has a
  finite scale and a zero weight gradient. The products are float32
  ``ragged_dot``\\ s of the dequantized operands (exact), on every platform.
  Guide: ``docs/fp4.md``, grouped matmuls.

  Args:
    lhs: ``[M, K]`` float32, bfloat16 or float16: the tokens, sorted by
      group.
    rhs: ``[G, K, N]``, likewise: one weight per group (expert).
    group_sizes: ``[G]`` integers summing to M (checked where concrete;
      traced sizes are not read: rows past their sum get zeros, as with
      ``jax.lax.ragged_dot``).
    precision: accepted for signature compatibility and ignored.
    preferred_element_type: the result dtype; default: the operands'
      (promoted) dtype. Accumulation is float32 regardless.
    config: the static :class:`Fp4Config` (default: NVFP4 with every
      component on).
    key: a PRNG key for the backward pass's stochastic rounding, e.g.
      ``jax.random.fold_in(base_key, step)``; None derives one from the
      gradient's bits (deterministic), as :func:`fp4_dot_general` does.

  Returns:
    ``[M, N]``: the grouped product.

  Raises:
    TypeError: for non-floating, float8 or FP4 operands, non-integer
      ``group_sizes`` or a config that is not an ``Fp4Config``.
    ValueError: for shapes that are not ``[M, K]``, ``[G, K, N]``, ``[G]``,
      concrete group sizes that are negative or do not sum to M, or a
      ``config.axis_name`` that is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import fp4
    >>> x, w = jnp.ones((6, 32)), jnp.full((3, 32, 16), 0.5)
    >>> sizes = jnp.array([4, 0, 2], jnp.int32)
    >>> y = fp4.ragged_dot(x, w, sizes)
    >>> y.shape, float(y[0, 0])
    ((6, 16), 16.0)
    >>> dw = jax.grad(lambda w: fp4.ragged_dot(
    ...     x, w, sizes, key=jax.random.key(0)).sum())(w)
    >>> float(jnp.abs(dw[1]).max())   # the empty group's weight gradient
    0.0
  """
  if not isinstance(config, Fp4Config):
    raise TypeError(
        f"config must be an Fp4Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Fp4Config('nvfp4').")
  del precision
  lhs, rhs, sizes = grouped_lib.check_operands(lhs, rhs, group_sizes,
                                               "jmp_lite.fp4.ragged_dot")
  fp8_matmul_lib.check_axis_bound(config)
  out_dtype = fp8_matmul_lib.result_dtype(lhs, rhs, preferred_element_type)
  static = _Static(config, np.dtype(out_dtype), np.dtype(lhs.dtype),
                   np.dtype(rhs.dtype))
  return grouped_lib.grouped_product(lhs, rhs, sizes, key, matmul=_grouped_fp4,
                                     static=static)
