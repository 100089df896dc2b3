"""Grouped (``ragged_dot``) matmuls in float8: per-group scales, group-aligned
blocks, safe empty groups.

A Mixture-of-Experts layer sorts its tokens by expert and multiplies them with
``jax.lax.ragged_dot(x[M, K], w[G, K, N], group_sizes[G])``: the rows of
group ``g`` (``group_sizes[g]`` consecutive rows) by expert ``g``'s weight.
:func:`fp8_ragged_dot` is that product under a float8 recipe
(:class:`~jmp_lite._src.low_precision.recipes.Fp8Config`), forward and backward, with
the numerics of the dense recipe applied to each group: the grouped result is
the per-group loop of :func:`~jmp_lite._src.low_precision.fp8_matmul.fp8_dot_general`,
computed in one pass (``docs/fp8.md``, grouped matmuls).

What "per group" means for each operand and product:

* **Tensor-wise scales are per group**: the activation's scale of group ``g``
  comes from the amax of its rows (a segment maximum of the row amaxes), the
  weight's from expert ``g``'s ``[K, N]`` slice, the incoming gradient's from
  the group's rows. Multiplying one expert's tokens by 1000 changes no other
  expert's result. ``per_group_scales=False`` shares one scale over all
  groups (qwix's choice), as an option.
* **Scales along the contracting axis stay inside a group.** In the forward
  product and the input gradient the contracting axis is K or N (the rows are
  independent, grouped or not): rows, tiles and MX blocks are the dense
  recipe's. In the weight gradient ``dw[g] = x_g^T @ dy_g`` the contracting
  axis is the token axis, cut by group: per row, the scale of each column is
  the amax over the group's tokens; in blocks (128 blockwise, 32 MX) the
  tokens are laid out so that every group starts at a multiple of the block
  size (zero rows between groups: static shapes, no host sync), as the dense
  recipe zero-pads one group's tokens. No block holds two groups' tokens.
* **Empty groups**: a group of size 0 has amax 0 and scale 1 (finite), and an
  exactly zero weight gradient.

The products are ``jax.lax.ragged_dot_general`` on the quantized operands
with float32 accumulation (float8 operands per tensor, row and block; the MX
emulation's dequantized float32 operands for MXFP8, as the dense recipe's
emulation), the scales applied to the float32 result as the dense recipe
applies them. Rows past ``sum(group_sizes)`` belong to no group (as for
``jax.lax.ragged_dot``): their result and gradient are zero.

**What "bit for bit" can mean on CPU.** Quantized operands and scales are the
per-group loop's bit for bit. The float32 sums of the products are XLA's, and
XLA:CPU's ``dot`` does not sum in one order for every shape: even the dense
recipe's rows differ in the last bits between ``dot(x)[:m]`` and
``dot(x[:m])`` (``docs/fp8.md`` gives the measurement). So the grouped
product equals the per-group loop bit for bit wherever the float32 sums are
exact, and to float32 rounding of the accumulation otherwise (tested both
ways).

**Delayed scaling** (per tensor): ``scales=DelayedScales(lhs, rhs, grad)``
with one float32 scale per group (shape ``[G]``), whose cotangent holds the
per-group amaxes this call observed (maximum over ``config.axis_name``, or
without one over every bound mapped axis, as the dense recipe's, except the
``shard_map`` axes the scales vary over: sharded with their experts, each
shard's scales are other experts').

Second derivatives are refused with a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import fp8_matmul as matmul_lib
from jmp_lite._src.low_precision import scaling as scaling_lib

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
Fp8Config = config_lib.Fp8Config
DelayedScales = matmul_lib.DelayedScales
_DEFAULT_CONFIG = Fp8Config()

RAGGED_FORM = (
    "The grouped matmul takes jax.lax.ragged_dot's operands: lhs [M, K] (the "
    "tokens, sorted by group), rhs [G, K, N] (one weight per group) and "
    "group_sizes [G] (integers, the number of consecutive rows of each "
    "group, summing to M)."
)
SECOND_ORDER_HELP = (
    "The grouped float8/FP4 matmul has no second derivative: its backward "
    "pass quantizes the gradient and the operands, so differentiating it "
    "would silently give zero. Compute gradient penalties and Hessian-vector "
    "products of this part of the model in high precision "
    "(jax.lax.ragged_dot), or stop the gradient through it."
)


# ---------------------------------------------------------------------------
# The layout of rows by group.
# ---------------------------------------------------------------------------


class Groups(NamedTuple):
  """Where each row of a ``[M, ...]`` operand belongs (traced arrays).

  Attributes:
    sizes: int32 ``[G]``, the group sizes.
    ids: int32 ``[M]``, each row's group; ``G`` for rows past the sum.
    starts: int32 ``[G]``, the first row of each group.
  """

  sizes: jax.Array
  ids: jax.Array
  starts: jax.Array

  @property
  def count(self) -> int:
    return self.sizes.shape[0]


def groups_of(group_sizes: jax.Array, m: int) -> Groups:
  """The :class:`Groups` of ``m`` rows cut by ``group_sizes``."""
  sizes = group_sizes.astype(_I32)
  ends = jnp.cumsum(sizes)
  rows = jax.lax.iota(_I32, m)
  ids = jnp.searchsorted(ends, rows, side="right").astype(_I32)
  return Groups(sizes, ids, ends - sizes)


def per_row(per_group: jax.Array, groups: Groups, fill: Any) -> jax.Array:
  """``per_group[ids]`` (leading axis ``G``) for every row; ``fill`` for rows
  that belong to no group."""
  pad = jnp.full((1,) + per_group.shape[1:], fill, per_group.dtype)
  return jnp.concatenate([per_group, pad])[groups.ids]


def segment_amax(x: jax.Array, groups: Groups) -> jax.Array:
  """float32 ``[G, ...]``: the maximum of ``|x|`` (``[M, ...]``) over each
  group's rows; 0 for an empty group. One read of ``x``. (A maximum from 0,
  not ``segment_max``'s -inf: no intermediate inf, as under
  ``jax_debug_infs``.)"""
  amax = jnp.zeros((groups.count + 1,) + x.shape[1:], _F32)
  amax = amax.at[groups.ids].max(jnp.abs(x.astype(_F32)))
  return amax[:groups.count]


class Padded(NamedTuple):
  """Rows laid out so that every group starts at a multiple of ``block``.

  Attributes:
    positions: int32 ``[M]``, each row's padded position (``rows`` for rows
      of no group: dropped).
    sizes: int32 ``[G]``, the group sizes rounded up to ``block``.
    block_ids: int32 ``[rows // block]``, each block's group (``G``: none).
    rows: the static padded row count, a multiple of ``block``.
  """

  positions: jax.Array
  sizes: jax.Array
  block_ids: jax.Array
  rows: int


def padded_layout(groups: Groups, block: int) -> Padded:
  """:class:`Padded` for blocks of ``block`` rows: each group's rows followed
  by zero rows up to the next multiple of ``block``. The static row count
  bounds every split of M rows into G groups: ``M + G * (block - 1)``,
  rounded up to ``block``."""
  m, g = groups.ids.shape[0], groups.count
  rows = -(-(m + g * (block - 1)) // block) * block
  sizes = (groups.sizes + (block - 1)) // block * block
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  ids = jnp.minimum(groups.ids, g - 1)
  offset = jax.lax.iota(_I32, m) - groups.starts[ids]
  positions = jnp.where(groups.ids < g, starts[ids] + offset, rows)
  block_starts = jax.lax.iota(_I32, rows // block) * block
  block_ids = jnp.searchsorted(ends, block_starts, side="right").astype(_I32)
  return Padded(positions.astype(_I32), sizes, block_ids, rows)


def to_padded(x: jax.Array, padded: Padded) -> jax.Array:
  """``x`` (``[M, ...]``) in the padded layout, zeros between groups."""
  out = jnp.zeros((padded.rows,) + x.shape[1:], x.dtype)
  return out.at[padded.positions].set(x, mode="drop", unique_indices=True)


# ---------------------------------------------------------------------------
# Products (float32 results; the scales applied as the dense recipe does).
# ---------------------------------------------------------------------------


def _ragged_rows(lhs, rhs, sizes, rhs_contract, precision=None):
  """``[M, C] x [G, *, *] -> [M, Q]``: each row times its group's matrix,
  contracting ``rhs_contract`` (1 or 2) of the rhs; float32 accumulation
  (``precision``: as ``jax.lax.ragged_dot_general``'s)."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (rhs_contract,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims, precision=precision,
                                    preferred_element_type=_F32)


def _ragged_tokens(lhs, rhs, sizes, precision=None):
  """``[M, P] x [M, Q] -> [G, P, Q]``: per group, the product contracting
  the group's rows; float32 accumulation, zeros for an empty group."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims, precision=precision,
                                    preferred_element_type=_F32)


def _isolated(values, contract):
  """``values`` (a per-group operand ``[G, *, *]``) with its non-finite
  elements zeroed, and, per group and output column (``[G, Q]``), the sum
  of those along the contraction ``contract`` (0 where there is none).
  XLA's expansion of ``ragged_dot`` (CPU) multiplies every row by every
  group's matrix, masking the rows, not the matrices: a NaN in one expert's
  weight would reach every group's rows (0 * NaN). Zeroed, it reaches none;
  the sum puts it back where the per-group loop has it (no NaN or inf is
  made where there was none: ``jax_debug_nans``)."""
  bad = ~jnp.isfinite(values)
  zero = jnp.zeros((), values.dtype)
  sums = jnp.sum(jnp.where(bad, values, zero).astype(_F32), axis=contract)
  return jnp.where(bad, zero, values), sums


def _poisoned(out, sums, groups):
  """``out`` ``[M, Q]`` NaN where a row's group has a non-finite element in
  that output column's contraction (``sums`` ``[G, Q]`` from
  :func:`_isolated`)."""
  rows = per_row(sums, groups, 0.0)                          # [M, Q]
  return jnp.where(jnp.isfinite(rows), out, out + rows * 0.0)


def _rows_product(a, b, groups, rhs_contract):
  """float32 ``[M, Q]``: the grouped product of the row-grouped operand ``a``
  (an ``_Operand`` ``[1, M, C]`` whose row scales are ``[1, M, 1]``, kinds
  "row", "kblock" or "mx") and the per-group operand ``b`` (``[G, Q, C]``, or
  per tensor ``[G, C, Q]`` with ``rhs_contract=1``)."""
  av = a.values[0]
  if a.kind == "row":
    values, flags = _isolated(b.values, rhs_contract)
    acc = _ragged_rows(av, values, groups.sizes, rhs_contract)
    # b's scales: per tensor [G, 1, 1], per row [G, Q, 1]: one row per group.
    b_scale = per_row(b.scale.reshape(b.scale.shape[0], -1), groups, 1.0)
    out = matmul_lib._scaled(acc, a.scale[0], b_scale)  # pylint: disable=protected-access
    return _poisoned(out, flags, groups)
  if a.kind == "kblock":
    m, c = av.shape
    nk = a.scale.shape[-1]
    t = c // nk
    g, q = b.values.shape[:2]
    values, flags = _isolated(b.values, 2)
    lhs = jnp.swapaxes(av.reshape(m, nk, t), 0, 1)             # [nk, M, t]
    rhs = jnp.swapaxes(values.reshape(g, q, nk, t), 1, 2)      # [G, nk, Q, t]
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (3,)), ((0,), (1,))),
        lhs_ragged_dimensions=[1], rhs_group_dimensions=[0])
    acc = jax.lax.ragged_dot_general(lhs, rhs, groups.sizes, dims,
                                     preferred_element_type=_F32)  # [nk, M, Q]
    a_scale = jnp.swapaxes(a.scale[0], 0, 1)[:, :, None]       # [nk, M, 1]
    b_scale = jnp.transpose(per_row(jnp.swapaxes(b.scale, 1, 2), groups, 1.0),
                            (1, 0, 2))                         # [nk, M, Q]
    out = jnp.sum(matmul_lib._scaled(acc, a_scale, b_scale), axis=0)  # pylint: disable=protected-access
    return _poisoned(out, flags, groups)
  assert a.kind == b.kind == "mx", (a.kind, b.kind)
  c = av.shape[-1]
  lhs = matmul_lib._dequantized(a, c)[0]  # pylint: disable=protected-access
  rhs, flags = _isolated(matmul_lib._dequantized(b, c), 2)  # pylint: disable=protected-access
  return _poisoned(_ragged_rows(lhs, rhs, groups.sizes, 2), flags, groups)


# ---------------------------------------------------------------------------
# Quantizers of row-grouped operands.
# ---------------------------------------------------------------------------


def _check_shape(scale, g, what):
  if scale is not None and scale.shape not in ((), (g,)):
    raise ValueError(
        f"jmp_lite.fp8.ragged_dot: scales.{what} must hold one scale per "
        f"group, shape "
        f"({g},) (or a scalar), got shape {scale.shape}.")


def _tensor_scaled(x32, amax, fmt, config, scale, per_group, expand):
  """Quantizes ``x32`` with one tensor scale per group (``amax`` ``[G]``;
  all alike unless ``per_group``), from the amaxes or the given ``scale``
  as the dense recipe's per-tensor quantizer does; ``expand`` broadcasts
  ``[G]`` scales against ``x32``. Returns the values, the expanded scales,
  the amaxes and the ``[G]`` scales."""
  if not per_group:
    amax = jnp.broadcast_to(jnp.max(amax, initial=0.0), amax.shape)
  amax = scaling_lib.global_amax(amax, config.axis_name)
  current = scaling_lib._scale_from_amax(  # pylint: disable=protected-access
      amax, fmt, 0, config.power_of_two_scales)
  given = scale is not None
  scale = (scaling_lib.usable_scale(jnp.broadcast_to(scale, amax.shape),
                                    current) if given else current)
  full = expand(scale)
  values = scaling_lib._cast_scaled(x32, full, fmt, given)  # pylint: disable=protected-access
  return values, full, amax, scale


def _group_tensor_quantize(x, fmt, groups, config, scale, per_group):
  """Per-group tensor scales of a row-grouped ``[M, C]`` operand: the
  ``_Operand`` ``[1, M, C]`` (row kind, per-row scales), the amaxes and the
  scales ``[G]``."""
  x32 = x.astype(_F32)
  amax = segment_amax(jnp.max(jnp.abs(x32), axis=1, initial=0.0), groups)
  values, rows, amax, scale = _tensor_scaled(
      x32, amax, fmt, config, scale, per_group,
      lambda s: per_row(s, groups, 1.0)[:, None])
  op = matmul_lib._Operand(values[None], rows[None], "row")  # pylint: disable=protected-access
  return jax.lax.stop_gradient(op), amax, scale


def _expert_tensor_quantize(w, fmt, config, scale, per_group):
  """Per-expert tensor scales of ``[G, P, C]``: the ``_Operand`` (scales
  ``[G, 1, 1]``), the amaxes and the scales ``[G]``."""
  w32 = w.astype(_F32)
  amax = jnp.max(jnp.abs(w32), axis=(1, 2), initial=0.0)
  values, full, amax, scale = _tensor_scaled(
      w32, amax, fmt, config, scale, per_group, lambda s: s.reshape(-1, 1, 1))
  op = matmul_lib._Operand(values, full, "row")  # pylint: disable=protected-access
  return jax.lax.stop_gradient(op), amax, scale


def _quantize(x, fmt, kind, config):
  """The dense recipe's quantizer of a ``[B, P, C]`` operand along C."""
  return matmul_lib._quantize_operand(x, fmt, kind, config)[0]  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# The weight gradient: contracting the grouped token axis.
# ---------------------------------------------------------------------------


def _token_products(g, x, groups, config, quantized=None):
  """float32 ``[G, N, K]``: per group ``dy_g^T @ x_g`` for ``g`` ``[M, N]``
  and ``x`` ``[M, K]``, quantized along the tokens as the dense recipe's
  weight gradient quantizes each group's (``quantized``: per tensor, the
  per-group float8 operands of the forward and input-gradient products)."""
  grad_fmt, fwd_fmt = config.gradient, config.forward
  granularity = config.granularity
  if granularity == "tensor":
    (g_op, g_scale), (x_op, x_scale) = quantized  # per-group scales [G]
    acc = _ragged_tokens(g_op.values[0], x_op.values[0], groups.sizes)
    return matmul_lib._scaled(acc, g_scale[:, None, None],  # pylint: disable=protected-access
                              x_scale[:, None, None])
  if granularity == "row":
    def column_quantize(v, fmt):
      v32 = v.astype(_F32)
      amax = segment_amax(v32, groups)                      # [G, C]
      scale = scaling_lib._scale_from_amax(  # pylint: disable=protected-access
          amax, fmt, 0, config.power_of_two_scales)
      rows = per_row(scale, groups, 1.0)                    # [M, C]
      return (jax.lax.stop_gradient(
          scaling_lib._cast_scaled(v32, rows, fmt, False)),  # pylint: disable=protected-access
              scale)
    gv, gs = column_quantize(g, grad_fmt)
    xv, xs = column_quantize(x, fwd_fmt)
    acc = _ragged_tokens(gv, xv, groups.sizes)
    return matmul_lib._scaled(acc, gs[:, :, None], xs[:, None, :])  # pylint: disable=protected-access
  kind = PASSES[granularity]["wgrad"][0]    # "tile" or "mx", both operands
  block = (scaling_lib.MX_BLOCK_SIZE if kind == "mx" else config.block_size)
  padded = padded_layout(groups, block)
  # [1, C, rows]: each column along the padded tokens, blocks group-aligned.
  gt = jnp.swapaxes(to_padded(g, padded), 0, 1)[None]
  xt = jnp.swapaxes(to_padded(x, padded), 0, 1)[None]
  g_op = _quantize(gt, grad_fmt, kind, config)
  x_op = _quantize(xt, fwd_fmt, kind, config)
  if kind == "mx":
    gd = matmul_lib._dequantized(g_op, padded.rows)[0].T  # pylint: disable=protected-access
    xd = matmul_lib._dequantized(x_op, padded.rows)[0].T  # pylint: disable=protected-access
    return _ragged_tokens(gd, xd, padded.sizes)
  # Blockwise: each 128-token block's float32 partial product, scaled, summed
  # into its group (the dense recipe's promotion of every block's sum).
  n, k, nb = g.shape[1], x.shape[1], padded.rows // block
  acc = jax.lax.dot_general(
      g_op.values[0].reshape(n, nb, block), x_op.values[0].reshape(k, nb, block),
      (((2,), (2,)), ((1,), (1,))), preferred_element_type=_F32)  # [nb, N, K]
  g_scale = g_op.scale[0].T[:, :, None]                    # [nb, N, 1]
  x_scale = x_op.scale[0].T[:, None, :]                    # [nb, 1, K]
  partial = matmul_lib._scaled(acc, g_scale, x_scale)  # pylint: disable=protected-access
  return jax.ops.segment_sum(partial, padded.block_ids,
                             num_segments=groups.count + 1)[:groups.count]


# ---------------------------------------------------------------------------
# The custom gradient.
# ---------------------------------------------------------------------------

# How each operand of each product is scaled, per granularity: the kinds the
# code below quantizes with ("group": one scale per group / expert; "row": one
# per row along the contracting axis; "tile": 1 x block_size tiles along it;
# "block": block_size x block_size blocks; "mx": 1x32 E8M0 blocks). Along the
# tokens (the weight gradient) rows, tiles and blocks are each group's own.
# docs/fp8.md's table is scaling_table(), checked by a test.
PASSES: dict[str, dict[str, tuple[str, str]]] = {
    "tensor": {"forward": ("group", "group"), "dgrad": ("group", "group"),
               "wgrad": ("group", "group")},
    "row": {"forward": ("row", "row"), "dgrad": ("row", "row"),
            "wgrad": ("row", "row")},
    "blockwise": {"forward": ("tile", "block"), "dgrad": ("tile", "block"),
                  "wgrad": ("tile", "tile")},
    "mxfp8": {"forward": ("mx", "mx"), "dgrad": ("mx", "mx"),
              "wgrad": ("mx", "mx")},
}
# The operands of each product, and the axis it contracts.
_OPERANDS = {"forward": (("x", "w"), "K"), "dgrad": (("dy", "w"), "N"),
             "wgrad": (("dy", "x"), "the group's tokens")}


def _describe(kind: str, operand: str, axis: str, block: int) -> str:
  if kind == "group":
    return ("one scale per expert" if operand == "w"
            else "one scale per group")
  if kind == "row" and axis == _OPERANDS["wgrad"][1]:
    return f"one scale per column and group, along {axis}"
  what = {"row": ("one scale per row" if operand != "w"
                  else "one scale per expert and row"),
          "tile": f"1x{block} tiles", "block": f"{block}x{block} blocks",
          "mx": "1x32 E8M0 blocks"}[kind]
  return f"{what} along {axis}"


def scaling_table() -> list[str]:
  """The markdown table of what each float8 recipe scales in each product
  of the grouped matmul (``docs/fp8.md`` shows it; a test checks it)."""
  lines = ["| recipe | forward `y = x w[g]` | input gradient `dx = dy w[g]^T` "
           "| weight gradient `dw[g] = x_g^T dy_g` |", "|---|---|---|---|"]
  for name in config_lib.FP8_RECIPES:
    config = config_lib.recipe_config(name)
    cells = []
    for product, kinds in PASSES[config.granularity].items():
      operands, axis = _OPERANDS[product]
      parts = []
      for operand, kind in zip(operands, kinds):
        fmt = config.gradient_format if operand == "dy" else config.forward_format
        parts.append(f"`{operand}`: {_describe(kind, operand, axis, config.block_size)}, {fmt}")
      if config.scaling == "delayed" and product == "forward":
        parts.append("delayed (given scales, one per group)")
      cells.append("; ".join(parts))
    lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
  return lines


class _Static(NamedTuple):
  config: Fp8Config
  per_group: bool
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _part(scales, name):
  return None if scales is None else getattr(scales, name)


def _forward(x, w, group_sizes, scales, static):
  """float32 ``[M, N]`` and the residuals of the backward pass."""
  config = static.config
  groups = groups_of(group_sizes, x.shape[0])
  fmt = config.forward
  if config.granularity == "tensor":
    qx, amax_x, sx = _group_tensor_quantize(
        x, fmt, groups, config, _part(scales, "lhs"), static.per_group)
    qw, amax_w, _ = _expert_tensor_quantize(
        w, fmt, config, _part(scales, "rhs"), static.per_group)
    out = _rows_product(qx, qw, groups, 1)                  # w as [G, K, N]
    return out, (qx, sx, qw, amax_x, amax_w)
  x_kind, w_kind = PASSES[config.granularity]["forward"]
  qx = _quantize(x[None], fmt, x_kind, config)
  qw = _quantize(jnp.swapaxes(w, 1, 2), fmt, w_kind, config)  # [G, N, K]
  return _rows_product(qx, qw, groups, 2), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_matmul(x, w, group_sizes, scales, static):
  return _forward(x, w, group_sizes, scales, static)[0].astype(static.out_dtype)


def _grouped_matmul_fwd(x, w, group_sizes, scales, static):
  out, quantized = _forward(x, w, group_sizes, scales, static)
  return (out.astype(static.out_dtype),
          (x, w, group_sizes, scales, quantized))


def _grouped_matmul_bwd(static, residuals, dy):
  x, w, group_sizes, scales, quantized = residuals
  x, w, dy = (_first_order_only(v) for v in (x, w, dy))
  dx, dw, amax_g = _backward(x, w, group_sizes, scales, quantized, dy,
                             static=static)
  if scales is None:
    return dx, dw, None, None
  amax_x, amax_w = quantized[3], quantized[4]
  return dx, dw, None, DelayedScales(amax_x, amax_w, amax_g)


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(x, w, group_sizes, scales, quantized, dy, *, static):
  """float ``dx [M, K]``, ``dw [G, K, N]`` and the gradient's amaxes."""
  config = static.config
  groups = groups_of(group_sizes, x.shape[0])
  grad_fmt, fwd_fmt = config.gradient, config.forward
  amax_g = None
  if config.granularity == "tensor":
    qx, sx, qw = quantized[:3]
    g_op, amax_g, sg = _group_tensor_quantize(
        dy, grad_fmt, groups, config, _part(scales, "grad"), static.per_group)
    if scales is None or scales.grad is None:
      amax_g = None
    dx = _rows_product(g_op, qw, groups, 2)                 # over N of [G, K, N]
    dw = _token_products(dy, x, groups, config, ((g_op, sg), (qx, sx)))
  else:
    g_kind, w_kind = PASSES[config.granularity]["dgrad"]
    g_op = _quantize(dy[None], grad_fmt, g_kind, config)
    w_op = _quantize(w, fwd_fmt, w_kind, config)            # [G, K, N] along N
    dx = _rows_product(g_op, w_op, groups, 2)
    dw = _token_products(dy, x, groups, config)
  dw = jnp.swapaxes(dw, 1, 2)                               # [G, K, N]
  # Rows past the sum belong to no group: no gradient (JAX's ragged_dot).
  return (dx.astype(static.lhs_dtype), dw.astype(static.rhs_dtype), amax_g)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


_first_order_only = matmul_lib.first_order_only(SECOND_ORDER_HELP)


# ---------------------------------------------------------------------------
# Argument checking (shared with the FP4 grouped matmul).
# ---------------------------------------------------------------------------


def check_operands(lhs: Any, rhs: Any, group_sizes: Any, owner: str
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The operands of a grouped matmul, checked: float lhs ``[M, K]`` and rhs
  ``[G, K, N]``, integer ``group_sizes`` ``[G]``; concrete group sizes must
  be non-negative and sum to M (traced ones cannot be read without a host
  sync: as for ``jax.lax.ragged_dot``, rows past their sum get zeros)."""
  lhs = checks.float_array(lhs, f"{owner}'s lhs")
  rhs = checks.float_array(rhs, f"{owner}'s rhs")
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(
        f"{owner}: got lhs of shape {lhs.shape} and rhs of shape "
        f"{rhs.shape}. {RAGGED_FORM}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        f"{owner}: lhs [M, K] = {lhs.shape} and rhs [G, K, N] = {rhs.shape} "
        f"have different K ({lhs.shape[1]} != {rhs.shape[1]}). {RAGGED_FORM}")
  concrete = checks.is_concrete(group_sizes)
  try:
    sizes = jnp.asarray(group_sizes)
  except (TypeError, ValueError):
    sizes = None
  if sizes is None or not jnp.issubdtype(sizes.dtype, jnp.integer):
    got = ("dtype " + np.dtype(sizes.dtype).name if sizes is not None
           else type(group_sizes).__name__)
    raise TypeError(
        f"{owner}: group_sizes must be an integer array, got {got}. Pass "
        f"e.g. jnp.bincount(expert_ids, length=G).astype(jnp.int32). "
        f"{RAGGED_FORM}")
  if sizes.shape != (rhs.shape[0],):
    raise ValueError(
        f"{owner}: group_sizes has shape {sizes.shape}, but rhs holds "
        f"{rhs.shape[0]} groups (shape {rhs.shape}): give one size per "
        f"group, shape ({rhs.shape[0]},). {RAGGED_FORM}")
  if concrete:
    host = np.asarray(sizes)
    if (host < 0).any():
      raise ValueError(
          f"{owner}: group_sizes must be non-negative, got {host.tolist()}. "
          f"{RAGGED_FORM}")
    if int(host.sum()) != lhs.shape[0]:
      raise ValueError(
          f"{owner}: group_sizes {host.tolist()} sum to {int(host.sum())}, "
          f"but lhs has {lhs.shape[0]} rows: every row must belong to one "
          f"group (pad the token batch with a group of its own, or drop "
          f"rows). {RAGGED_FORM}")
  return lhs, rhs, sizes.astype(_I32)


def _check_scales(scales, config, g):
  """Delayed scaling's per-group scales, float32 ``[G]`` (a scalar is
  broadcast), checked as the dense recipe's."""
  def per_group(value, name):
    _check_shape(value, g, name)
    return jnp.broadcast_to(value.astype(_F32), (g,))
  return matmul_lib.check_scales(
      scales, config, per_group,
      f" The grouped matmul takes one scale per group: shape ({g},).")


def _bound_axes(config, scales):
  """``scaling_lib.with_bound_axes`` less the ``shard_map`` axes the given
  per-group scales vary over: under expert parallelism each shard holds its
  own experts' scales, and their amaxes are not those of another shard's
  experts (nor, typed as invariant, a cotangent of the sharded scales)."""
  bound = scaling_lib.with_bound_axes(config)
  if bound is config or scales is None:
    return bound
  varying = frozenset().union(
      *(compat.varying_axes(s) for s in scales if s is not None))
  names = (bound.axis_name if isinstance(bound.axis_name, tuple)
           else (bound.axis_name,))
  kept = tuple(n for n in names if n not in varying)
  if kept == names:
    return bound
  return dataclasses.replace(
      config, axis_name=(kept[0] if len(kept) == 1 else kept) or None)


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def fp8_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any,
                   precision: Any = None, preferred_element_type: Any = None,
                   *, config: Fp8Config = _DEFAULT_CONFIG,
                   scales: DelayedScales | None = None,
                   per_group_scales: bool = True) -> jax.Array:
  """``jax.lax.ragged_dot`` in float8, forward and backward, per group.

  The grouped matmul of a Mixture-of-Experts layer: the rows of group ``g``
  (``group_sizes[g]`` consecutive rows of ``lhs``) times ``rhs[g]``, under
  the float8 recipe ``config`` applied to each group as
  :func:`fp8_dot_general` applies it to one matmul: float8 operands, float32
  accumulation, the backward pass in float8. Tensor-wise scales are per
  group; no scale block along the token axis (weight gradient) holds two
  groups' tokens; an empty group has a finite scale and a zero weight
  gradient. Guide: ``docs/fp8.md``, grouped matmuls.

  Args:
    lhs: ``[M, K]`` float32, bfloat16 or float16: the tokens, sorted by
      group.
    rhs: ``[G, K, N]``, likewise: one weight per group (expert).
    group_sizes: ``[G]`` integers summing to M (checked where concrete;
      traced sizes are not read: rows past their sum get zeros, as with
      ``jax.lax.ragged_dot``).
    precision: accepted for signature compatibility and ignored.
    preferred_element_type: the result dtype; default ``config.compute_dtype``
      if set, else the operands' (promoted) dtype. Accumulation is float32.
    config: the static :class:`Fp8Config`.
    scales: with ``config.scaling="delayed"``: :class:`DelayedScales` with one
      float32 scale per group (shape ``[G]``) for ``lhs`` and ``rhs`` (and
      ``grad``, or None for current-scaled gradients); its cotangent holds
      the per-group amaxes observed.
    per_group_scales: per tensor, one scale per group (default) or one shared
      by all groups (``False``, qwix's choice: one expert's outliers then
      coarsen every expert's quantization).

  Returns:
    ``[M, N]``: the grouped product.

  Raises:
    TypeError: for non-floating or float8 operands, non-integer
      ``group_sizes``, a config that is not an ``Fp8Config`` or malformed
      delayed-scaling scales.
    ValueError: for shapes that are not ``[M, K]``, ``[G, K, N]``, ``[G]``,
      concrete group sizes that are negative or do not sum to M, scales
      given to current scaling or of the wrong shape, or an unbound
      ``config.axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import fp8
    >>> x, w = jnp.ones((6, 32)), jnp.ones((3, 32, 16))
    >>> sizes = jnp.array([4, 0, 2], jnp.int32)
    >>> y = fp8.ragged_dot(x, w, sizes,
    ...                        config=fp8.Fp8Config(granularity="row"))
    >>> y.shape, float(y[0, 0])
    ((6, 16), 32.0)
  """
  if not isinstance(config, Fp8Config):
    raise TypeError(
        f"config must be an Fp8Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Fp8Config(granularity='row').")
  del precision
  lhs, rhs, sizes = check_operands(lhs, rhs, group_sizes,
                                   "jmp_lite.fp8.ragged_dot")
  per_group = checks.flag(per_group_scales, "per_group_scales",
                          "jmp_lite.fp8.ragged_dot")
  scales = _check_scales(scales, config, rhs.shape[0])
  config = _bound_axes(config, scales)
  matmul_lib.check_axis_bound(config)
  out_dtype = matmul_lib.result_dtype(lhs, rhs, preferred_element_type,
                           config.compute_dtype)
  static = _Static(config, per_group, np.dtype(out_dtype),
                   np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  return grouped_product(lhs, rhs, sizes, scales, matmul=_grouped_matmul,
                         static=static)


@functools.partial(jax.jit, inline=True,
                   static_argnames=("matmul", "static"))
def grouped_product(lhs, rhs, sizes, extra, *, matmul, static):
  """``matmul(lhs, rhs, sizes, extra, static)`` (a custom-gradient grouped
  matmul and its hashable static arguments), one jitted function per
  shapes: zeros for an empty operand; under ``shard_map`` every operand
  varying over the axes any one varies over
  (:func:`~jmp_lite._src.low_precision.fp8_matmul.same_varying_axes`)."""
  m, n = lhs.shape[0], rhs.shape[2]
  if 0 in lhs.shape or 0 in rhs.shape:
    return jnp.zeros((m, n), static.out_dtype)
  lhs, rhs, sizes = matmul_lib.same_varying_axes(lhs, rhs, sizes)
  return matmul(lhs, rhs, sizes, extra, static)
