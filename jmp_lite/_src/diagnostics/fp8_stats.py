"""Jit-side float8, FP4 and int8 statistics: what each float8 scaling recipe,
each FP4 recipe (NVFP4, MXFP4) and each int8 recipe (``int8``,
``int8_switchback``) would clip, flush to zero and round away, per leaf of
any pytree.

:class:`Fp8Stats` and :func:`fp8_stats`. Every recipe runs the quantizers of
:mod:`jmp_lite._src.low_precision` themselves (the ones the float8 and FP4 matmuls
run, and the int8 matmul's :func:`~jmp_lite._src.low_precision.int8_matmul.\
quantize`), so the counts are what those matmuls would do to the values. The host side (the
advice per layer) is :mod:`jmp_lite._src.diagnostics.fp8_advice`. Guide:
``docs/diagnostics.md`` (Float8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from numpy.lib.array_utils import normalize_axis_tuple

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.low_precision import recipes as fp8_config
from jmp_lite._src.low_precision import formats as fp8_formats
from jmp_lite._src.low_precision import fp4 as fp4_lib
from jmp_lite._src.low_precision import fp4_matmul as fp4_matmul_lib
from jmp_lite._src.low_precision import int8_matmul as int8_matmul_lib
from jmp_lite._src.low_precision import scaling as fp8_scaling

#: The roles a tensor plays in a float8 matmul, as :func:`fp8_stats` names them.
ROLES: tuple[str, ...] = ("activation", "weight", "gradient")
# The float8 matmul's defaults: e4m3 forward operands, e5m2 incoming gradients.
_ROLE_FORMAT = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}

#: The float8 matmul's granularities, cheapest first: the order in which
#: :func:`advise` tries them.
GRANULARITIES: tuple[str, ...] = fp8_config.MATMUL_GRANULARITIES
#: Every recipe :func:`fp8_stats` measures: ``"cast"`` (no scaling), the
#: matmul granularities with current scaling, and ``"delayed"`` (a given
#: per-tensor scale) when a scale is given.
RECIPES: tuple[str, ...] = ("cast",) + GRANULARITIES + ("delayed",)

#: The FP4 element format's name, as ``fmt=`` takes it (E2M1).
FP4_FORMAT = "e2m1"
_FP4_NAMES = ("e2m1", "fp4", "float4_e2m1fn")
#: What :func:`fp8_stats` measures with ``fmt="e2m1"``: each FP4 recipe as
#: the FP4 matmul quantizes an operand of the role.
FP4_STAT_RECIPES: tuple[str, ...] = fp4_matmul_lib.FP4_RECIPES
#: E2M1's unit roundoff (1 mantissa bit): the most rounding alone costs a
#: value between two normal E2M1 values.
E2M1_UNIT_ROUNDOFF = 2.0**-2

#: The int8 format's name, as ``fmt=`` takes it.
INT8_FORMAT = "int8"
_INT8_NAMES = ("int8", "s8")
#: What :func:`fp8_stats` measures with ``fmt="int8"``: each int8 recipe as
#: the int8 matmul quantizes an operand of the role (symmetric int8 along the
#: contracting axes, ``scale = amax / 127`` per row; SwitchBack's weight: one
#: scale per tensor), and ``"delayed"`` (a given per-tensor scale) when a
#: scale is given.
INT8_STAT_RECIPES: tuple[str, ...] = fp8_config.INT8_RECIPES
#: Why the int8 recipes are measured on their own.
INT8_FORMAT_HELP = (
    "fmt='int8' measures the int8 recipes ('int8', 'int8_switchback': "
    "symmetric int8 with float32 scales, amax / 127 per row along the "
    "contracting axes, as int8.dot_general quantizes each operand; "
    "SwitchBack scales the weight per tensor), and 'delayed' with scale=; "
    "measure them in a call of their own (e.g. fp8_stats(x, role, "
    "fmt='int8'))."
)

#: Why FP4 is measured on its own.
FP4_FORMAT_HELP = (
    "fmt='e2m1' measures the FP4 recipes ('nvfp4', 'mxfp4': E2M1 elements "
    "with their block scales, as fp4.dot_general quantizes each operand), "
    "whose recipes differ from float8's; measure float8 formats and FP4 in "
    "separate calls (e.g. fp8_stats(x, role) and fp8_stats(x, role, "
    "fmt='e2m1')). FP4 has no delayed scaling: leave scale=None."
)

#: What ``role`` means, for :func:`fp8_stats`' error messages.
ROLE_HELP = (
    "role says which operand of a float8 matmul the values are, which sets "
    "the format and the contracting axis: 'activation' (the matmul's input: "
    "e4m3, contracting the last axis), 'weight' (a kernel: e4m3, "
    "contracting every axis but the last, as for Flax's Dense (in, out) and "
    "Conv (..., in, out) kernels) or 'gradient' (the gradient flowing into "
    "the matmul's output: e5m2, contracting the last axis)."
)

#: What ``axis`` takes, for :func:`fp8_stats`' error messages.
AXIS_HELP = (
    "axis names the contracting axes of every leaf of rank >= 1 (rows, tiles "
    "and MX blocks run along them): an int (e.g. axis=-1, the last axis) or "
    "a tuple of ints (e.g. axis=(0, 1)); None (the default): the role's, the "
    "last axis, or every axis but the last for weights."
)

#: What ``scale`` means.
SCALE_HELP = (
    "scale is the per-tensor dequantization scale of delayed scaling "
    "(x ~ float8 value * scale), e.g. computed from an amax history as "
    "delayed scaling does: a positive scalar for every leaf, or a tree of "
    "scalars with the structure of the values (a prefix of it). It is "
    "measured as the recipe 'delayed'."
)

_F32 = np.dtype(np.float32)
_ROW_MIN = 2.0**-126   # rows whose largest magnitude is below: no error
_COUNTS = ("clipped", "flushed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Stats:
  """What float8 or FP4 would do to one array, per recipe (a pytree of arrays).

  The array is viewed as a matrix of *rows* (every axis that is not
  contracted) by the contracting axes, as the float8 matmul views an operand.
  For each measured format and recipe (``formats[i]``, ``recipes[j]``):

  Attributes:
    size: int32, the number of entries.
    zeros: int32, entries exactly zero (either sign; float32 subnormals are
      not zero).
    nonfinite: int32, inf or NaN entries: counted here only, and measured as
      zeros everywhere else (so one NaN does not hide the other entries).
    max_abs: float32, the largest finite ``|x|``.
    rows: int32, the rows with a nonzero finite entry of at least 2**-126:
      the rows the error is averaged over.
    clipped: int32 ``(formats, recipes)``, finite entries with ``|x / scale|``
      above the format's max (448 for e4m3, 57344 for e5m2, 6 for e2m1;
      for int8, ``|x / scale|`` rounding to 128 or more): saturated to it.
    flushed: int32 ``(formats, recipes)``, nonzero finite entries that
      quantize to zero.
    error_sum: float32 ``(formats, recipes)``, the sum over rows of each
      row's relative quantization error ``||x - dequantize(quantize(x))|| /
      ||x||``.
    error_max: float32 ``(formats, recipes)``, the largest such row error.
    role: static, ``"activation"``, ``"weight"`` or ``"gradient"``.
    formats: static, the format names measured, e.g. ``("e4m3",)``, or
      ``("e2m1",)`` for FP4, ``("int8",)`` for int8.
    recipes: static, the recipes measured: ``"cast"`` (a saturating cast,
      no scaling), ``"tensor"``, ``"row"``, ``"blockwise"``, ``"mxfp8"``
      (current scaling) and ``"delayed"`` (a given per-tensor scale); for
      FP4, ``"nvfp4"`` and ``"mxfp4"``; for int8, ``"int8"``,
      ``"int8_switchback"`` (and ``"delayed"``).
    block_size: static, the tile/block edge of ``"blockwise"``.

  See ``docs/diagnostics.md`` (Float8) for each recipe and count.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> s = diagnostics.fp8_stats(jnp.array([[1e4, 1.0, 1e-4, 0.0]]), "activation")
    >>> s.formats, int(s.clipped[0, s.recipes.index("cast")])
    (('e4m3',), 1)
  """

  size: Any
  zeros: Any
  nonfinite: Any
  max_abs: Any
  rows: Any
  clipped: Any
  flushed: Any
  error_sum: Any
  error_max: Any
  role: str = dataclasses.field(metadata={"static": True})
  formats: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  recipes: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  block_size: int = dataclasses.field(metadata={"static": True})

  def _index(self, recipe: str, fmt: Any) -> tuple[int, int]:
    """The (format, recipe) position of a measurement these stats hold."""
    if fmt is None:
      name = self.formats[0] if len(self.formats) == 1 else None
    else:
      name = _format_name(fmt)
    if recipe not in self.recipes:
      problem = (
          f"recipe {recipe!r} was not measured; these statistics hold "
          f"{', '.join(map(repr, self.recipes))} ('delayed' only when "
          "fp8_stats was given a scale).")
    elif name is None:
      problem = (f"these statistics hold the formats {self.formats}; say "
                 "which with fmt=, e.g. fmt='e4m3'.")
    elif name not in self.formats:
      problem = (
          f"format {name!r} was not measured (measured: {self.formats}). "
          f"Pass fmt=({', '.join(map(repr, self.formats))}, {name!r}) to "
          "fp8_stats to measure it.")
    else:
      return self.formats.index(name), self.recipes.index(recipe)
    raise ValueError(f"Fp8Stats: {problem}")

  def fraction(self, count: str, recipe: str, fmt: Any = None) -> Any:
    """The share of entries clipped or flushed by one recipe.

    Args:
      count: ``"clipped"`` or ``"flushed"``.
      recipe: one of :attr:`recipes`.
      fmt: the format; may be left out when one format was measured.

    Returns:
      A Python float for concrete statistics, a float32 array under ``jit``;
      0 for an empty array.

    Raises:
      TypeError: for a count that is not a string.
      ValueError: for another count, or a recipe or format not measured.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> x = jnp.concatenate([jnp.full(32, 1e6), jnp.ones(32)])
      >>> s = diagnostics.fp8_stats(x, "activation")
      >>> s.fraction("flushed", "tensor"), s.fraction("flushed", "mxfp8")
      (0.5, 0.0)
    """
    count = checks.choice(
        count, "count", "Fp8Stats.fraction", _COUNTS,
        f"count must be one of {_COUNTS}; use Fp8Stats.error for the "
        "quantization error.")
    i, j = self._index(recipe, fmt)
    return _ratio(getattr(self, count)[i, j], self.size)

  def error(self, recipe: str, fmt: Any = None, *, worst: bool = False) -> Any:
    """The relative quantization error of a recipe, averaged over rows.

    Each row's error is ``||x - dequantize(quantize(x))|| / ||x||`` over its
    finite entries; a row that lies in the format's normal range has an error
    of at most the format's unit roundoff (2**-4 for e4m3, 2**-3 for e5m2).

    Args:
      recipe: one of :attr:`recipes`.
      fmt: the format; may be left out when one format was measured.
      worst: the largest row error instead of the mean.

    Returns:
      A Python float for concrete statistics, a float32 array under ``jit``;
      0 when no row has a nonzero entry.

    Raises:
      ValueError: for a recipe or format not measured.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> s = diagnostics.fp8_stats(jnp.array([[3.0, 5.0], [17.0, 0.0]]), "activation")
      >>> s.error("row"), s.error("row", worst=True)  # 17 is stored as 16
      (0.029411764815449715, 0.05882352963089943)
    """
    i, j = self._index(recipe, fmt)
    if worst:
      value = self.error_max[i, j]
      return float(value) if checks.is_concrete(value) else value
    return _ratio(self.error_sum[i, j], self.rows)

  def snr(self, recipe: str, fmt: Any = None) -> Any:
    """The signal-to-noise ratio of a recipe in dB, ``-20 log10(error)``.

    The mean relative row error of :meth:`error` as a ratio of norms, in
    decibels: FP4 papers report quantization quality this way (NVFP4 keeps
    random normal data at about 20 dB, MXFP4 at about 19 dB).

    Args:
      recipe: one of :attr:`recipes`.
      fmt: the format; may be left out when one format was measured.

    Returns:
      A Python float for concrete statistics (``inf`` when the error is 0),
      a float32 array under ``jit``.

    Raises:
      ValueError: for a recipe or format not measured.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> x = jnp.array([[3.0, 5.0], [17.0, 0.0]])
      >>> round(diagnostics.fp8_stats(x, "activation").snr("row"), 1)
      30.6
    """
    error = self.error(recipe, fmt)
    if isinstance(error, float):
      return float("inf") if error == 0 else -20.0 * float(np.log10(error))
    return -20.0 * jnp.log10(error)

  def summary(self) -> dict[str, dict[str, dict[str, float]]]:
    """Every figure as Python floats (host only).

    Returns:
      ``{format: {recipe: {"clipped": share, "flushed": share, "error":
      mean row error, "worst_error": largest row error}}}``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> s = diagnostics.fp8_stats(jnp.array([600.0, 1.0]), "weight")
      >>> s.summary()["e4m3"]["cast"]["clipped"]
      0.5
    """
    return {
        fmt: {recipe: {"clipped": float(self.fraction("clipped", recipe, fmt)),
                       "flushed": float(self.fraction("flushed", recipe, fmt)),
                       "error": float(self.error(recipe, fmt)),
                       "worst_error": float(self.error(recipe, fmt,
                                                       worst=True))}
              for recipe in self.recipes}
        for fmt in self.formats
    }


def _ratio(count: Any, size: Any) -> Any:
  if checks.is_concrete((count, size)):
    size = float(size)
    return float(count) / size if size else 0.0
  size = jnp.asarray(size, _F32)
  return jnp.where(size > 0,
                   jnp.asarray(count, _F32) / jnp.maximum(size, 1.0), 0.0)


def is_fp8_stats(x: Any) -> bool:
  """Whether ``x`` is an :class:`Fp8Stats` (a leaf of a statistics tree)."""
  return isinstance(x, Fp8Stats)


def combine_fp8_stats(stats: Sequence[Fp8Stats], group: str) -> Fp8Stats:
  """Sums counts and row errors, keeps the largest max_abs and row error.

  Raises:
    ValueError: if the statistics differ in role, formats, recipes or block
      size (they measure different things).
  """
  first = stats[0]
  key = (first.role, first.formats, first.recipes, first.block_size)
  for s in stats[1:]:
    other = (s.role, s.formats, s.recipes, s.block_size)
    if other != key:
      raise ValueError(
          f"group {group!r} combines float8 statistics that measure different"
          f" things: (role, formats, recipes, block_size) {key} and {other}."
          " Group each role's statistics on their own (or by= a function that"
          " keeps them apart); advise keeps roles apart itself.")
  if len(stats) == 1:
    return first

  def total(field):
    return sum((jnp.asarray(getattr(s, field)) for s in stats[1:]),
               jnp.asarray(getattr(first, field)))

  def largest(field):
    return functools.reduce(jnp.maximum,
                            (jnp.asarray(getattr(s, field)) for s in stats))

  return Fp8Stats(
      size=total("size"), zeros=total("zeros"), nonfinite=total("nonfinite"),
      max_abs=largest("max_abs"), rows=total("rows"),
      clipped=total("clipped"), flushed=total("flushed"),
      error_sum=total("error_sum"), error_max=largest("error_max"),
      role=first.role, formats=first.formats, recipes=first.recipes,
      block_size=first.block_size)


# -- arguments ----------------------------------------------------------------------


def _format_name(fmt: Any) -> str:
  """The canonical name of a float8 format, of FP4's E2M1 or of int8."""
  if isinstance(fmt, str) and fmt.strip().lower() in _FP4_NAMES:
    return FP4_FORMAT
  if isinstance(fmt, str) and fmt.strip().lower() in _INT8_NAMES:
    return INT8_FORMAT
  if (not isinstance(fmt, (str, bool, int, float)) and fmt is not None
      and not isinstance(fmt, fp8_formats.Fp8Format)):
    try:
      if np.dtype(fmt) == fp4_lib.E2M1_DTYPE:
        return FP4_FORMAT
      if np.dtype(fmt) == np.int8:
        return INT8_FORMAT
    except TypeError:
      pass
  try:
    return fp8_formats.get_format(fmt, "fmt").name
  except (TypeError, ValueError) as err:
    raise type(err)(
        f"{err} For FP4, fmt='e2m1' (or jnp.float4_e2m1fn); for int8, "
        "fmt='int8' (or jnp.int8).") from None


def _formats(fmt: Any, role: str, scaled: bool) -> tuple[str, ...]:
  """The measured format names; with ``scaled`` (a delayed scale given), one
  float8 format or int8. FP4 and int8 are measured on their own."""
  if fmt is None:
    return (_ROLE_FORMAT[role],)
  many = fmt if isinstance(fmt, (tuple, list)) else (fmt,)
  names = []
  for f in many:
    name = _format_name(f)
    if name not in names:
      names.append(name)
  alone = [n for n in (FP4_FORMAT, INT8_FORMAT) if n in names]
  mixed = bool(alone) and len(names) > 1
  if not names or mixed or (scaled and (len(names) > 1 or FP4_FORMAT in names)):
    kind = "FP4" if FP4_FORMAT in alone else "int8"
    others = "int8" if len(alone) == 2 else "float8 formats"
    problem = ("must name at least one format" if not names
               else f"mixes {kind} with {others}" if mixed
               else "was given with scale=: a delayed scale belongs to one "
               "format; measure each with its own scale (one call each)")
    raise ValueError(f"fp8_stats: fmt={fmt!r} {problem}. "
                     f"{fp8_formats.FORMAT_HELP} {FP4_FORMAT_HELP} "
                     f"{INT8_FORMAT_HELP}")
  return tuple(names)


def _block_size(block_size: Any) -> int:
  # The float8 matmul's own validation: the same sizes are allowed.
  return fp8_config.Fp8Config(granularity="blockwise",
                              block_size=block_size).block_size


def _leaf_axes(axis, role, shape) -> tuple[int, ...]:
  """The contracting axes of one leaf, non-negative and in the given order.

  NumPy reports an axis out of range or repeated (:func:`_check_axis` one
  that is no int).
  """
  ndim = len(shape)
  if ndim == 0:
    return ()
  if axis is None:
    if role == "weight" and ndim >= 2:
      return tuple(range(ndim - 1))
    return (ndim - 1,)
  return normalize_axis_tuple(axis, ndim, "fp8_stats: axis")


def _check_axis(axis: Any) -> Any:
  """``axis`` if it is None, an int or a tuple or list of ints (a teaching
  TypeError otherwise: NumPy's names neither the argument nor the value)."""
  if axis is not None and checks.integer_axes(axis) is None:
    raise TypeError(
        f"fp8_stats: axis must be an int, a tuple of ints or None, got "
        f"{type(axis).__name__}: {axis!r}. {AXIS_HELP}")
  return axis


def _scales(scale: Any, tree: Any) -> Any:
  """``scale`` broadcast to one float32 scalar per leaf of ``tree``."""

  def spread(s, subtree):
    s = scale_value(s, "scale", "fp8_stats", SCALE_HELP)
    return jax.tree.map(lambda _: s, subtree)

  # JAX reports a scale tree that is not a prefix of the values' tree.
  return jax.tree.map(spread, scale, tree)


def scale_value(x: Any, what: str, owner: str, help_text: str) -> jax.Array:
  """A scale argument as a float32 scalar: a positive real scalar (traced
  ones too; concrete ones in the loss-scale range), errors ending in
  ``help_text``. Shared by :func:`fp8_stats` and ``tensor_stats``."""
  try:
    checks.real_scalar(x, what, owner)
    checks.loss_scale_value(x, what, owner)
  except (TypeError, ValueError) as err:
    raise type(err)(f"{err} {help_text}") from None
  return jnp.asarray(x).astype(_F32)


# -- the measurement ---------------------------------------------------------------


# dtype -> (unsigned view, magnitude mask, the bits of +inf)
_BITS = {
    _F32: (np.uint32, 2**31 - 1, 0x7F800000),
    np.dtype(jnp.bfloat16): (np.uint16, 0x7FFF, 0x7F80),
    np.dtype(jnp.float16): (np.uint16, 0x7FFF, 0x7C00),
}


def _finite_and_nonzero(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Whether each entry is finite, and whether it is nonzero, from its bits
  alone: XLA:CPU treats float32 subnormals as zero in float comparisons, and
  folds a bit test next to one into a float comparison."""
  view, mask, inf = _BITS[np.dtype(x.dtype)]
  magnitude = lax.bitcast_convert_type(x, view) & view(mask)
  return magnitude < view(inf), magnitude > view(0)


def _quantized(x, fmt, recipe, role, block_size, scale):
  """The float8 quantization of a ``(rows, K)`` matrix by ``recipe``, as the
  float8 matmul quantizes that operand."""
  q = fp8_scaling.quantize
  if recipe == "cast":
    return q(x, fmt, "tensor", scale=jnp.ones((), _F32))
  if recipe == "delayed":
    return q(x, fmt, "tensor", scale=scale)
  # The operand's granularity under the matmul's, as the float8 matmul
  # quantizes it (blockwise: DeepSeek-V3's 1 x T tiles for activations and
  # gradients, T x T blocks for weights, rows x contracting).
  granularity = fp8_config.MATMUL_OPERANDS[recipe][role == "weight"]
  if granularity == "tensor":
    return q(x, fmt, "tensor")
  if granularity in ("row", "mxfp8"):
    return q(x, fmt, granularity, axis=1)
  axis = (0, 1) if granularity == "block" else 1
  return q(x, fmt, granularity, axis=axis, block_size=block_size)


def _fp4_quantized(x: jax.Array, recipe: str, role: str,
                   norm: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """FP4 of a float32 ``(rows, K)`` matrix as ``fp4.dot_general`` quantizes
  an operand of ``role`` by default (weights: NVFP4's 16x16 tiles;
  gradients: stochastic rounding with a key derived from the values, as
  ``key=None`` does): float32 ``(values, dequantized * 2**norm, limit)`` of
  ``x``'s shape (``norm``: int32 ``(rows, 1)``, each row's normalising
  exponent), ``limit`` the largest magnitude each entry's block holds
  unclipped (6 times its scale). The scales multiply as the matmul applies them
  (:func:`~jmp_lite._src.low_precision.fp4.scale_e8m0_blocks`,
  :func:`~jmp_lite._src.low_precision.fp4.lift_scale`): MXFP4's ``2**-127`` and
  NVFP4's tensor scale of a tiny tensor are float32 subnormals, which
  XLA:CPU flushes to zero."""
  rows, k = x.shape
  config = fp4_matmul_lib.Fp4Config(recipe)
  size = config.block_size
  two_d = role == "weight" and config.two_d_weights
  key = fp4_matmul_lib.data_key(x) if role == "gradient" else None
  pad_rows = -rows % size if two_d else 0
  padded = jnp.pad(x, ((0, pad_rows), (0, -k % size)))
  norm = jnp.pad(norm, ((0, pad_rows), (0, 0)))
  six = jnp.asarray(fp4_lib.E2M1_MAX, _F32)
  if recipe == "nvfp4":
    values, scales, tensor_scale = fp4_lib.nvfp4_quantize_f32(
        padded, two_d=two_d, key=key)
    # The tensor scale may be a float32 subnormal (amax below 3.2e-35):
    # applied lifted, as the matmul applies it.
    lifted, lift = fp4_lib.lift_scale(tensor_scale)
    per_entry = jnp.repeat(scales * lifted, size, axis=-1)
    dequantized = fp4_lib.mul_pow2(values * per_entry, norm - lift)
    limit = fp4_lib.mul_pow2(six * per_entry, -lift)
  else:
    values, codes = fp4_lib.mxfp4_quantize_f32(
        padded, rule=config.mx_scale_rule, key=key)
    blocks = values.reshape(values.shape[0], -1, size)
    dequantized = fp4_lib.scale_e8m0_blocks(blocks, codes, norm).reshape(
        values.shape)
    limit = jnp.repeat(fp4_lib.scale_e8m0_blocks(
        jnp.broadcast_to(six, codes.shape + (1,)), codes)[..., 0], size,
                       axis=-1)
  return values[:rows, :k], dequantized[:rows, :k], limit[:rows, :k]


_INT8_CLIP = np.float32(fp8_config.INT8_MAX + 0.5)


def _int8_quantized(x: jax.Array, recipe: str, role: str,
                    scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int8 of a float32 ``(rows, K)`` matrix as ``int8.dot_general``
  quantizes an operand of ``role`` (round half to even): float32 ``(values,
  scale per entry)``. ``"int8"``: a scale per row (a weight's rows are its
  output channels); ``"int8_switchback"``: the weight per tensor;
  ``"delayed"``: the given per-tensor dequantization ``scale``."""
  if recipe == "delayed":
    q, s = int8_matmul_lib.rounded(x, scale), scale
  else:
    per_tensor = (role == "weight" and fp8_config.Int8Config(
        recipe).weight_granularity == "tensor")
    q, s = int8_matmul_lib.quantize(x, per_tensor=per_tensor)
  return q.astype(_F32), jnp.broadcast_to(s, x.shape)


def _inverse_power_of_two(v: jax.Array) -> jax.Array:
  """``2**-floor(log2(v))`` for normal float32 ``v > 0``, the exponent
  clamped to [-126, 126] so that the result is a normal float32 too."""
  exponent = (lax.bitcast_convert_type(v, jnp.int32) >> 23) - 127
  exponent = jnp.clip(exponent, -126, 126)
  return lax.bitcast_convert_type((127 - exponent) << 23, _F32)


def _scale_per_entry(q) -> jax.Array:
  scale = q.scale
  if np.dtype(scale.dtype) == fp8_formats.E8M0_DTYPE:
    scale = fp8_formats.decode_e8m0(scale)
  return fp8_scaling.broadcast_blocks(scale.astype(_F32), q.block_shape,
                                      q.values.shape)


@functools.partial(jax.jit, static_argnames=("contract", "role", "formats",
                                              "recipes", "block_size"))
def _leaf_fp8_stats(x, scale, *, contract, role, formats, recipes,
                    block_size) -> Fp8Stats:
  if np.dtype(x.dtype) not in _BITS:   # float8 (exact) and float64 leaves
    x = x.astype(_F32)                 # go through float32, as a cast does
  free = [d for d in range(x.ndim) if d not in contract]
  rows = int(np.prod([x.shape[d] for d in free], dtype=np.int64))
  k = int(np.prod([x.shape[d] for d in contract], dtype=np.int64))
  x = jnp.transpose(x, free + list(contract)).reshape(rows, k)
  finite, nonzero = _finite_and_nonzero(x)
  nonzero = nonzero & finite
  x = jnp.where(finite, x, jnp.zeros((), x.dtype))   # non-finite: measured as 0
  x32 = x.astype(_F32)
  magnitude = jnp.abs(x32)
  row_max = jnp.max(magnitude, axis=1, initial=0.0)
  valid = row_max >= _ROW_MIN
  # Rows are normalised (their squares would overflow) by an exact power of
  # two near their largest entry: multiplications, no rounding, no division.
  inv = _inverse_power_of_two(jnp.where(valid, row_max, 1.0))[:, None]
  norm = (lax.bitcast_convert_type(inv, jnp.int32) >> 23) - 127   # log2(inv)
  row_norm2 = jnp.sum(jnp.square(x32 * inv), axis=1)

  clipped, flushed, error_sum, error_max = [], [], [], []
  for name in formats:
    counts = {c: [] for c in ("clipped", "flushed", "error_sum", "error_max")}
    for recipe in recipes:
      if name == FP4_FORMAT:
        values, dequantized, limit = _fp4_quantized(x32, recipe, role, norm)
        over = magnitude > limit
      elif name == INT8_FORMAT:
        values, per_entry = _int8_quantized(x32, recipe, role, scale)
        # Rounding |x / scale| (as the quantizer computes it: times the
        # reciprocal) to 128 or more: the clip changed the value (half to
        # even: 127.5 rounds to 128). Current absmax scaling puts each row's
        # (tensor's) largest entry at 127: it never clips.
        over = (magnitude * (np.float32(1) / per_entry)) >= _INT8_CLIP
        dequantized = (values * per_entry) * inv
      else:
        fmt = fp8_formats.get_format(name)
        q = _quantized(x, fmt, recipe, role, block_size, scale)
        per_entry = _scale_per_entry(q)
        top = jnp.asarray(fmt.max, _F32)
        if recipe == "delayed":   # any scale: the quantizer's own division
          over = (magnitude / per_entry) > top
        else:                     # powers of two: the product is exact
          over = magnitude > top * per_entry
        values = q.values.astype(_F32)
        dequantized = (values * per_entry) * inv
      counts["clipped"].append(jnp.sum(over, dtype=jnp.int32))
      counts["flushed"].append(jnp.sum(nonzero & (values == 0),
                                       dtype=jnp.int32))
      # Both sides normalised (exactly) before the difference: the values
      # near 2**-126 and their differences may be float32 subnormals, which
      # XLA:CPU flushes.
      err2 = jnp.sum(jnp.square(x32 * inv - dequantized), axis=1)
      rel = jnp.where(valid, jnp.sqrt(err2 / jnp.maximum(row_norm2, 1.0)), 0.0)
      counts["error_sum"].append(jnp.sum(rel))
      counts["error_max"].append(jnp.max(rel, initial=0.0))
    clipped.append(jnp.stack(counts["clipped"]))
    flushed.append(jnp.stack(counts["flushed"]))
    error_sum.append(jnp.stack(counts["error_sum"]))
    error_max.append(jnp.stack(counts["error_max"]))
  return Fp8Stats(
      size=jnp.asarray(rows * k, jnp.int32),
      zeros=jnp.sum(finite & ~nonzero, dtype=jnp.int32),
      nonfinite=jnp.sum(~finite, dtype=jnp.int32),
      max_abs=jnp.max(magnitude, initial=0.0),
      rows=jnp.sum(valid, dtype=jnp.int32),
      clipped=jnp.stack(clipped), flushed=jnp.stack(flushed),
      error_sum=jnp.stack(error_sum), error_max=jnp.stack(error_max),
      role=role, formats=formats, recipes=recipes, block_size=block_size)


def fp8_stats(tree: Any, role: str, *, fmt: Any = None, axis: Any = None,
              scale: Any = None, block_size: int | None = None) -> Any:
  """What float8 or FP4 would clip, flush and round in each leaf; jit-safe.

  Each floating leaf becomes an :class:`Fp8Stats`, every other leaf ``None``.
  For each format, the leaf is quantized as the float8 matmul quantizes an
  operand of that ``role`` — by a saturating cast without scaling
  (``"cast"``), with current scaling per tensor, per row, blockwise and
  MXFP8, and with ``scale`` when given (``"delayed"``) — and the entries
  clipped at the format's max, the nonzero entries flushed to zero and each
  row's relative error are counted. With ``fmt="e2m1"`` the recipes are
  FP4's instead, ``"nvfp4"`` and ``"mxfp4"``, each quantizing the leaf as
  :func:`jmp_lite.fp4.dot_general` quantizes an operand of that role
  (weights in NVFP4's 16x16 tiles, gradients rounded stochastically). With
  ``fmt="int8"`` the recipes are int8's, ``"int8"`` and
  ``"int8_switchback"`` (and ``"delayed"`` with ``scale``), each quantizing
  the leaf as :func:`jmp_lite.int8.dot_general` quantizes an operand of
  that role: symmetric int8, round half to even, ``amax / 127`` per row
  along the contracting axes (SwitchBack: the weight per tensor). No
  host sync: call it inside a jitted step and return the result.

  Args:
    tree: any pytree: params (``role="weight"``), a matmul's inputs
      (``"activation"``), the gradients flowing into its outputs
      (``"gradient"``).
    role: ``"activation"``, ``"weight"`` or ``"gradient"``: sets the default
      format (e4m3, e4m3, e5m2), the default contracting axes (the last axis;
      every axis but the last for weights) and the blockwise shape (1 x 128
      tiles; 128 x 128 blocks for weights).
    fmt: a format (``"e4m3"``, ``"e5m2"``) or a tuple of formats to measure;
      ``"e2m1"`` measures the FP4 recipes, ``"int8"`` the int8 recipes
      (each on its own); None: the role's.
    axis: the contracting axes, an int or a tuple of ints, for every leaf of
      rank >= 1 (a scalar is one entry); None: the role's. Rows, tiles and
      MX blocks run along them.
    scale: per-tensor dequantization scales to measure as ``"delayed"``
      (e.g. from an amax history): a positive scalar, or a tree of scalars
      that is a prefix of ``tree``; traced values are fine. One format
      only (a float8 format or int8; FP4 has none).
    block_size: the tile/block edge of ``"blockwise"`` (default 128, a
      multiple of 16, as :class:`Fp8Config` takes it).

  Returns:
    ``tree`` with each floating leaf replaced by its :class:`Fp8Stats`.

  Raises:
    TypeError: for a role, format, axis (e.g. ``axis="last"``: write
      ``axis=-1``) or scale of the wrong type.
    ValueError: for an unknown role or format, an axis out of range for a
      leaf or repeated (NumPy's errors), a block size that is not a positive
      multiple of 16, a scale that is not positive and finite or does not
      fit ``tree`` (JAX's error), a scale with several formats or with FP4,
      or FP4 or int8 mixed with other formats.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> x = jnp.array([[2e4, 3e4, 1e4], [1e-3, 2e-3, 3e-3]])
    >>> s = jax.jit(diagnostics.fp8_stats, static_argnums=1)(x, "activation")
    >>> s.fraction("clipped", "cast"), s.fraction("flushed", "tensor"), s.fraction("flushed", "row")
    (0.5, 0.5, 0.0)

  See ``docs/diagnostics.md`` (Float8; FP4) for the recipes, the counts,
  how to capture a model's matmul inputs and gradients, and the advice.
  """
  role = checks.choice(role, "role", "fp8_stats", ROLES, ROLE_HELP)
  axis = _check_axis(axis)
  formats = _formats(fmt, role, scale is not None)
  block_size = _block_size(block_size)
  fp4 = formats == (FP4_FORMAT,)
  if fp4:
    recipes = FP4_STAT_RECIPES
  elif formats == (INT8_FORMAT,):
    recipes = INT8_STAT_RECIPES + (("delayed",) if scale is not None else ())
  else:
    recipes = RECIPES if scale is not None else RECIPES[:-1]

  def stats(x, s):
    if not tree_lib.is_float(x):
      return None
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype == np.float64:
      with np.errstate(over="ignore", under="ignore"):   # inf, 0: measured
        x = np.asarray(x, _F32)                           # as float32 is
    x = jnp.asarray(x)
    contract = _leaf_axes(axis, role, x.shape)
    leaf = functools.partial(_leaf_fp8_stats, contract=contract, role=role,
                             formats=formats, recipes=recipes,
                             block_size=block_size)
    # Explicit sharding: the blocks partitioned as under Auto axes.
    return compat.partitioned_as_auto(leaf, jax.sharding.PartitionSpec(), x, s)

  if scale is None:
    one = jnp.ones((), _F32)
    return jax.tree.map(lambda x: stats(x, one), tree)
  return jax.tree.map(stats, tree, _scales(scale, tree))
