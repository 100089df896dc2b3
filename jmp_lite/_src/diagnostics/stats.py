"""Mixed-precision diagnostics: overflow/underflow statistics and advice.

Statistics (jit-safe, per leaf, returned as pytrees of arrays):

* :class:`TensorStats`, :func:`tensor_stats`: for every floating leaf of any
  pytree (gradients, activations, params) the share of entries that are zero,
  that would underflow or overflow in float16 and bfloat16 at a given loss
  scale, the largest magnitude and a histogram of ``floor(log2|x|)``.
* :func:`group_stats`: the same statistics per module (by path prefix).

On the host:

* :class:`Advice`, :func:`advise`: a static loss scale, float16 or bfloat16,
  and the leaves to keep in float32.
* :func:`format_table`, :func:`plot_histograms`, :func:`report`: a table, a
  plot of each leaf's magnitudes against the float16/bfloat16 ranges, both.

A silent mistake caught:

* :class:`ScaleCheck`, :func:`scale_check_init`, :func:`scale_check_update`:
  gradients handed to the loss-scaling optimizer without having been scaled.

This layer knows trees and dtypes only: no Flax, no optax, no loss-scale
classes (a loss scale is read through its ``loss_scale`` attribute; only the
valid range, ``SCALE_MIN``/``SCALE_MAX``, comes from the loss-scale module),
and matplotlib is imported inside :func:`plot_histograms` only.

How the statistics are computed: exactly, with integer operations only. Each
entry is split into an integer significand (normalised, subnormals included,
which XLA:CPU flushes to zero in float arithmetic) and an exponent with bit
operations; the significand is multiplied by the float32 loss scale's as an
exact integer product (12-bit limbs in int32, schoolbook with carries: no
float rounding, no int64, which JAX lacks without x64), and the product's
binade and top bits are compared with the thresholds as integers. float16,
bfloat16 and float32 leaves are split on their own bits; float64 leaves too
when x64 is on; NumPy float64 leaves without x64, which JAX would narrow to
float32, are split on the host with NumPy and only their int32 limbs enter
JAX. One scatter-add per leaf bins ``floor(log2(|x| * loss_scale))``; every
count is read off those bins.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import numbers
import operator
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple, Sequence, TextIO

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import tree as tree_lib
# The one valid loss-scale range (to move to the validation module).
from jmp_lite._src.loss_scale import SCALE_MAX
from jmp_lite._src.loss_scale import SCALE_MIN

# -- the float16 / bfloat16 ranges --------------------------------------------

F16_MAX = 65504.0  # (2 - 2**-10) * 2**15
F16_MIN_NORMAL = 2.0**-14
F16_MIN_SUBNORMAL = 2.0**-24
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # (2 - 2**-7) * 2**127
BF16_MIN_NORMAL = 2.0**-126
BF16_MIN_SUBNORMAL = 2.0**-133

# floor(log2) of the thresholds, and the mantissa (in [1, 2)) above which a
# value in the top binade overflows.
_F16_TOP_EXP, _F16_TOP_MANT = 15, F16_MAX / 2.0**15
_BF16_TOP_EXP, _BF16_TOP_MANT = 127, BF16_MAX / 2.0**127

_HIST_LOW, _HIST_HIGH = -150, 150

#: The binade of each histogram bin: bin ``i`` of ``TensorStats.histogram``
#: counts the nonzero finite entries with ``floor(log2(|x| * loss_scale)) ==
#: HISTOGRAM_EXPONENTS[i]``, i.e. ``2**e <= |x| * loss_scale < 2**(e + 1)``.
#: The exponents run from -150 to 149; the first bin also counts everything
#: smaller, the last everything larger (float32's whole range fits inside).
HISTOGRAM_EXPONENTS = np.arange(_HIST_LOW, _HIST_HIGH)
_NBINS = _HIST_HIGH - _HIST_LOW
# Extra bins of the raw scatter: zeros, inf/nan, and the entries of the top
# float16 / bfloat16 binade that are above the largest finite value.
_ZERO, _NONFINITE, _F16_TOP, _BF16_TOP = range(_NBINS, _NBINS + 4)

_COUNT_FIELDS = (
    "zeros", "nonfinite", "f16_underflow", "f16_subnormal", "f16_overflow",
    "bf16_underflow", "bf16_overflow",
)
_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)


# -- per-leaf statistics -------------------------------------------------------


class TensorStats(NamedTuple):
  """Precision statistics of one array (a pytree node of scalar arrays).

  Every count is over the array's entries and is measured on
  ``|x| * loss_scale`` — the magnitudes a half-precision computation holding
  the values scaled by ``loss_scale`` would see. A loss scale of 1 describes
  the values as they are (activations, or gradients without loss scaling).
  Counts and histogram bins are exact: each entry is placed by the exact real
  product of ``|x|`` and the float32 ``loss_scale``, never a rounded one.

  Attributes:
    size: int32, the number of entries.
    zeros: int32, entries exactly zero (either sign).
    nonfinite: int32, entries that are inf or NaN (counted in no other field
      but ``size``).
    f16_underflow: int32, nonzero finite entries with ``|x| * loss_scale <
      2**-24``, float16's smallest subnormal: a cast to float16 flushes them
      to zero (or, between 2**-25 and 2**-24, rounds them up to 2**-24).
    f16_subnormal: int32, nonzero finite entries with ``|x| * loss_scale <
      2**-14``, float16's smallest normal: they keep fewer than float16's 11
      significant bits (the underflowing ones included).
    f16_overflow: int32, finite entries with ``|x| * loss_scale > 65504``,
      float16's largest finite value.
    bf16_underflow: int32, nonzero finite entries with ``|x| * loss_scale <
      2**-133``, bfloat16's smallest subnormal (hardware that flushes
      subnormals, e.g. TPUs, already loses everything below 2**-126).
    bf16_overflow: int32, finite entries with ``|x| * loss_scale`` above
      bfloat16's largest finite value (about 3.39e38).
    max_abs: the largest finite ``|x|``, *without* the loss scale (0 when there
      is none); float32 (exact for float16, bfloat16 and float32 inputs), or
      float64 for float64 inputs when x64 is on. A NumPy float64 leaf without
      x64 gives a float32: the largest magnitude rounded to nearest and
      saturating — above float32's max (about 3.4e38) it reads that max, a
      nonzero value below its smallest subnormal (2**-149) reads 2**-149 —
      while the counts stay exact.
    loss_scale: float32, the loss scale the counts were measured at.
    histogram: int32 array of shape ``(300,)``: the nonzero finite entries per
      binade of ``|x| * loss_scale``; bin ``i`` holds ``floor(log2(|x| *
      loss_scale)) == HISTOGRAM_EXPONENTS[i]`` (-150 ... 149).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> s = diagnostics.tensor_stats(jnp.array([0.0, 2.0**-30, 2.0**-20, 1.0, 1e5]))
    >>> int(s.zeros), int(s.f16_underflow), int(s.f16_subnormal), int(s.f16_overflow)
    (1, 1, 2, 1)
    >>> round(s.fraction("f16_subnormal"), 2)
    0.4
  """

  size: Any
  zeros: Any
  nonfinite: Any
  f16_underflow: Any
  f16_subnormal: Any
  f16_overflow: Any
  bf16_underflow: Any
  bf16_overflow: Any
  max_abs: Any
  loss_scale: Any
  histogram: Any

  def fraction(self, field: str) -> Any:
    """The share of entries counted by ``field`` (e.g. ``"f16_underflow"``).

    A Python float for concrete statistics, a float32 array under ``jit``; 0
    for an empty array.

    Args:
      field: one of ``zeros``, ``nonfinite``, ``f16_underflow``,
        ``f16_subnormal``, ``f16_overflow``, ``bf16_underflow``,
        ``bf16_overflow``.

    Raises:
      ValueError: if ``field`` is not a count.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> diagnostics.tensor_stats(jnp.array([0.0, 1.0])).fraction("zeros")
      0.5
    """
    if field not in _COUNT_FIELDS:
      raise ValueError(
          f"TensorStats.fraction: unknown field {field!r}; choose one of "
          f"{', '.join(_COUNT_FIELDS)}."
      )
    count, size = getattr(self, field), self.size
    if _is_concrete_tree((count, size)):
      size = int(size)
      return int(count) / size if size else 0.0
    size = jnp.asarray(size, jnp.float32)
    return jnp.where(size > 0, jnp.asarray(count, jnp.float32) / jnp.maximum(size, 1.0), 0.0)

  def fractions(self) -> dict[str, float]:
    """Every count as a share of the entries, as Python floats (host only).

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> diagnostics.tensor_stats(jnp.array([0.0, 1.0, 2.0, 1e6])).fractions()["f16_overflow"]
      0.25
    """
    return {field: float(self.fraction(field)) for field in _COUNT_FIELDS}


def _is_concrete_tree(tree: Any) -> bool:
  return not any(
      isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree)
  )


def _is_stats(x: Any) -> bool:
  return isinstance(x, TensorStats)


def _check_loss_scale(loss_scale: Any, owner: str) -> jax.Array:
  """Validates a loss scale; returns it as a float32 scalar array.

  Accepts a Python or numpy number, a scalar array (tracers too) or an object
  with a ``loss_scale`` attribute such as a jmp_lite loss scale.
  """
  if hasattr(loss_scale, "loss_scale") and not tree_lib.is_array(loss_scale):
    loss_scale = loss_scale.loss_scale
  what = f"{owner}: loss_scale"
  if isinstance(loss_scale, (bool, np.bool_)) or (
      tree_lib.is_array(loss_scale) and loss_scale.dtype == np.bool_):
    raise TypeError(f"{what} must be a number, got a bool ({loss_scale!r}).")
  is_number = isinstance(loss_scale, numbers.Real)
  if not (is_number or tree_lib.is_array(loss_scale)) or (
      tree_lib.is_array(loss_scale)
      and jnp.issubdtype(loss_scale.dtype, jnp.complexfloating)):
    raise TypeError(
        f"{what} must be a real number, a scalar array or a loss scale object,"
        f" got {type(loss_scale).__name__}: {loss_scale!r}. Pass e.g. 1.0 for "
        "unscaled values or jmp_lite.get_loss_scale(opt_state)."
    )
  if np.ndim(loss_scale) != 0:
    raise ValueError(
        f"{what} must be a scalar, got shape {np.shape(loss_scale)}. Pass a "
        "single number such as 2.0**15."
    )
  if not isinstance(loss_scale, jax.core.Tracer):
    value = float(loss_scale)
    if not (math.isfinite(value) and value > 0):
      raise ValueError(
          f"{what} must be positive and finite, got {value}. Pass the factor "
          "the values were (or would be) multiplied by — 1.0 for unscaled "
          "values, e.g. jmp_lite.get_loss_scale(opt_state).loss_scale."
      )
    if not SCALE_MIN <= value <= SCALE_MAX:
      raise ValueError(
          f"{what} must lie in [2**-126, 2**126], jmp_lite's loss-scale range"
          " (where a float32 scale and its reciprocal are both normal "
          f"numbers), got {value:g}. Loss scales are typically powers of two "
          "such as 2.0**15; to describe values as they are, use 1.0."
      )
  return jnp.asarray(loss_scale).astype(jnp.float32)


# -- exact integer arithmetic on the significands ---------------------------------
#
# |x| * loss_scale is never rounded: each value is split into an integer
# significand and an exponent with bit operations, the significands are
# multiplied exactly as integers (in 12-bit limbs held in int32, schoolbook
# with carries: no int64, which JAX lacks without x64, and no float rounding,
# which XLA may contract into FMAs), and the product is compared with the
# thresholds as integers.

_LIMB = 12
_LIMB_MASK = (1 << _LIMB) - 1
# The significand widths the split normalises to: 24 bits (float32 and
# narrower) or 53 bits (float64), with the leading one on top.
_WIDTH_32, _WIDTH_64 = 24, 53
_SCALE_WIDTH = _WIDTH_32  # the loss scale is a float32

# Bit layouts: dtype -> (mantissa bits, exponent bias, sign bit position).
_LAYOUTS = {
    np.dtype(jnp.float16): (10, 15, 15),
    np.dtype(jnp.bfloat16): (7, 127, 15),
    _F32: (23, 127, 31),
    np.dtype(np.float64): (52, 1023, 63),
}


def _limb_count(width: int) -> int:
  return -(-width // _LIMB)


def _top_limit(limit: float, exponent: int) -> int:
  """``limit / 2**exponent`` (a mantissa in [1, 2)) as a 24-bit integer with
  its leading one at bit 23; exact for the float16/bfloat16 maxima."""
  value = limit / 2.0**exponent * 2**23
  if value != int(value):  # a module constant, never user input
    raise ValueError(f"{limit} has more than 24 significant bits.")
  return int(value)


# The normalised top 24 bits above which a value of the top float16 /
# bfloat16 binade overflows: 65504 = 2047 * 2**5, bf16 max = 255 * 2**120.
_F16_TOP_LIMIT = _top_limit(F16_MAX, _F16_TOP_EXP)     # 2047 << 13
_BF16_TOP_LIMIT = _top_limit(BF16_MAX, _BF16_TOP_EXP)  # 255 << 16


class _Parts(NamedTuple):
  """Floats split exactly: ``|x| = significand * 2**(exponent - width + 1)``
  with the significand an integer of ``width`` bits whose leading one is bit
  ``width - 1`` (subnormal inputs normalised too), given as int32 limbs of 12
  bits, least significant first. ``exponent`` is ``floor(log2|x|)``; the
  significand and exponent of zeros and inf/NaN are meaningless (masked)."""

  limbs: tuple[Any, ...]
  exponent: Any   # int32
  zero: Any       # bool
  finite: Any     # bool


def _split(x: jax.Array) -> tuple[_Parts, jax.Array]:
  """Splits a float16/bfloat16/float32/float64 array (other floats are
  widened to float32 first, exactly) with integer operations only, so
  subnormals — which XLA:CPU flushes to zero in float arithmetic — are exact.

  Returns the parts and the magnitude bits ``|x|`` as an integer array,
  ordered like the magnitudes."""
  dtype = np.dtype(x.dtype)
  if dtype not in _LAYOUTS:
    x, dtype = x.astype(_F32), _F32
  nmant, bias, sign = _LAYOUTS[dtype]
  if dtype.itemsize == 8:
    int_t, nbits, width = np.dtype(np.int64), 64, _WIDTH_64
    bits = lax.bitcast_convert_type(x, int_t)
  elif dtype.itemsize == 4:
    int_t, nbits, width = _I32, 32, _WIDTH_32
    bits = lax.bitcast_convert_type(x, int_t)
  else:  # 16-bit formats, zero-extended into int32
    int_t, nbits, width = _I32, 32, _WIDTH_32
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(int_t)

  def const(v):
    return np.array(v, int_t)

  mag = bits & const((1 << sign) - 1)
  biased = mag >> const(nmant)
  normal = biased > const(0)
  significand = mag & const((1 << nmant) - 1)
  significand = jnp.where(normal, significand | const(1 << nmant), significand)
  lead = const(nbits - 1) - lax.clz(significand)   # -1 for zero
  # Shift the leading one to bit width - 1 (by width for zero: still < nbits).
  significand = lax.shift_left(significand, const(width - 1) - lead)
  exponent = (jnp.where(normal, biased, const(1)) - const(bias + nmant)
              + lead).astype(jnp.int32)
  limbs = tuple(
      ((significand >> const(_LIMB * k)) & const(_LIMB_MASK)).astype(jnp.int32)
      for k in range(_limb_count(width)))
  parts = _Parts(limbs, exponent, mag == const(0),
                 biased < const(2 * bias + 1))
  return parts, mag


def _split_host_float64(x: np.ndarray) -> tuple[_Parts, float]:
  """:func:`_split` of a NumPy float64 array, on the host (JAX without x64
  cannot hold it); also returns the largest finite ``|x|`` as a Python float.

  ``np.frexp`` is exact, subnormals included, and ``mantissa * 2**53`` is an
  integer below 2**53."""
  a = np.abs(np.asarray(x, np.float64).reshape(-1))
  finite = np.isfinite(a)
  mantissa, exponent = np.frexp(np.where(finite, a, 1.0))
  significand = np.ldexp(mantissa, _WIDTH_64).astype(np.int64)
  limbs = tuple(
      jnp.asarray(((significand >> (_LIMB * k)) & _LIMB_MASK).astype(np.int32))
      for k in range(_limb_count(_WIDTH_64)))
  parts = _Parts(limbs, jnp.asarray((exponent - 1).astype(np.int32)),
                 jnp.asarray(a == 0), jnp.asarray(finite))
  largest = float(np.max(a, where=finite, initial=0.0))
  return parts, largest


def _multiply(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
  """The exact product of two integers given as 12-bit limbs (int32, least
  significant first), as ``len(a) + len(b)`` 12-bit limbs. Every partial sum
  stays below 2**26."""
  out, carry = [], None
  for k in range(len(a) + len(b)):
    terms = [a[i] * b[k - i] for i in range(len(a)) if 0 <= k - i < len(b)]
    if carry is not None:
      terms.append(carry)
    total = functools.reduce(operator.add, terms)
    out.append(total & _LIMB_MASK)
    carry = total >> _LIMB
  return out


def _bit_field(limbs: Sequence[Any], low: int, high: int) -> Any:
  """Bits ``low`` to ``high - 1`` (at most 31) of a limb integer, as int32."""
  out = None
  for k, limb in enumerate(limbs):
    start = _LIMB * k
    a, b = max(start, low), min(start + _LIMB, high)
    if a < b:
      piece = ((limb >> (a - start)) & ((1 << (b - a)) - 1)) << (a - low)
      out = piece if out is None else out | piece
  return out


def _any_bit_below(limbs: Sequence[Any], position: int) -> Any:
  """Whether any bit below ``position`` of a limb integer is set."""
  out = None
  for k, limb in enumerate(limbs):
    count = min(_LIMB, position - _LIMB * k)
    if count <= 0:
      break
    piece = limb & ((1 << count) - 1)
    out = piece if out is None else out | piece
  return out != 0


def _scaled_exponent_and_top(parts: _Parts, scale: _Parts):
  """For ``v = |x| * loss_scale``, exactly: ``floor(log2 v)`` (int32), the top
  24 bits of ``v``'s significand (leading one at bit 23) and whether any bit
  below them is set."""
  width = (_WIDTH_64 if len(parts.limbs) == _limb_count(_WIDTH_64)
           else _WIDTH_32)
  product = _multiply(parts.limbs, scale.limbs)
  # The product of two normalised significands has its leading one at bit
  # `lead` or `lead + 1`.
  lead = (width - 1) + (_SCALE_WIDTH - 1)
  high = _bit_field(product, lead - 23, lead + 2)   # 25 bits
  carry = high >> 24
  top = high >> carry
  sticky = _any_bit_below(product, lead - 23) | ((high & carry) != 0)
  return parts.exponent + scale.exponent + carry, top, sticky


def _above(top: Any, sticky: Any, limit: int) -> Any:
  """Whether a significand (top 24 bits and sticky bit) exceeds ``limit``."""
  return (top > limit) | ((top == limit) & sticky)


def _stats_from_parts(parts: _Parts, max_abs: Any, loss_scale: jax.Array,
                      size: int) -> TensorStats:
  scale, _ = _split(loss_scale)
  exponent, top, sticky = _scaled_exponent_and_top(parts, scale)
  index = jnp.clip(exponent, _HIST_LOW, _HIST_HIGH - 1) - _HIST_LOW
  index = jnp.where(
      (exponent == _F16_TOP_EXP) & _above(top, sticky, _F16_TOP_LIMIT),
      _F16_TOP, index)
  index = jnp.where(
      (exponent == _BF16_TOP_EXP) & _above(top, sticky, _BF16_TOP_LIMIT),
      _BF16_TOP, index)
  index = jnp.where(parts.zero, _ZERO,
                    jnp.where(parts.finite, index, _NONFINITE))
  raw = jnp.bincount(index, length=_NBINS + 4).astype(jnp.int32)
  bins = raw[:_NBINS]

  def below(exp):
    return jnp.sum(jnp.where(HISTOGRAM_EXPONENTS < exp, bins, 0), dtype=jnp.int32)

  def at_or_above(exp):
    return jnp.sum(jnp.where(HISTOGRAM_EXPONENTS >= exp, bins, 0), dtype=jnp.int32)

  histogram = bins.at[_F16_TOP_EXP - _HIST_LOW].add(raw[_F16_TOP])
  histogram = histogram.at[_BF16_TOP_EXP - _HIST_LOW].add(raw[_BF16_TOP])
  return TensorStats(
      size=jnp.asarray(size, jnp.int32),
      zeros=raw[_ZERO],
      nonfinite=raw[_NONFINITE],
      f16_underflow=below(-24),
      f16_subnormal=below(-14),
      f16_overflow=at_or_above(_F16_TOP_EXP + 1) + raw[_F16_TOP] + raw[_BF16_TOP],
      bf16_underflow=below(-133),
      bf16_overflow=at_or_above(_BF16_TOP_EXP + 1) + raw[_BF16_TOP],
      max_abs=max_abs,
      loss_scale=loss_scale,
      histogram=histogram,
  )


# Jitted so that eager calls compile one program per leaf shape instead of
# dispatching ~80 operations; inside a user's jit they are inlined.
@jax.jit
def _leaf_stats(x: jax.Array, loss_scale: jax.Array) -> TensorStats:
  flat = x.reshape(-1)
  parts, mag = _split(flat)
  # The largest finite magnitude, from the bits (exact for subnormals too).
  max_bits = jnp.max(jnp.where(parts.finite, mag, jnp.zeros((), mag.dtype)),
                     initial=np.array(0, mag.dtype))
  dtype = np.dtype(x.dtype)
  if dtype == np.float64 or dtype == _F32:
    max_abs = lax.bitcast_convert_type(max_bits, dtype)
  elif dtype == np.dtype(jnp.bfloat16):   # bfloat16 is float32's top half
    max_abs = lax.bitcast_convert_type(max_bits << 16, _F32)
  elif dtype == np.dtype(jnp.float16):
    max_abs = lax.bitcast_convert_type(
        max_bits.astype(jnp.uint16), jnp.float16).astype(_F32)
  else:  # other formats were widened to float32 by _split
    max_abs = lax.bitcast_convert_type(max_bits, _F32)
  return _stats_from_parts(parts, max_abs, loss_scale, x.size)


@jax.jit
def _host_leaf_stats(parts: _Parts, max_abs: jax.Array,
                     loss_scale: jax.Array) -> TensorStats:
  return _stats_from_parts(parts, max_abs, loss_scale, parts.exponent.size)


_F32_INFO = np.finfo(np.float32)


def _host_max_abs(largest: float) -> jax.Array:
  """The largest magnitude of a NumPy float64 leaf as the widest float JAX
  holds: float64 with x64; otherwise float32, rounded to nearest and
  saturating — above float32's max it is that max, and a nonzero value below
  its smallest subnormal is that subnormal (never 0 or inf)."""
  if jax.dtypes.canonicalize_dtype(np.float64) == np.float64:
    return jnp.asarray(largest, np.float64)
  with np.errstate(over="ignore", under="ignore"):
    value = np.float32(largest)
  if np.isinf(value):
    value = _F32_INFO.max
  elif value == 0 and largest > 0:
    value = _F32_INFO.smallest_subnormal
  return jnp.asarray(value, _F32)


def _is_host_float64(x: Any) -> bool:
  """A NumPy float64 leaf that JAX (without x64) would narrow to float32."""
  return (isinstance(x, (np.ndarray, np.generic))
          and x.dtype == np.float64
          and jax.dtypes.canonicalize_dtype(np.float64) != np.float64)


def tensor_stats(tree: Any, loss_scale: Any = 1.0) -> Any:
  """Precision statistics of every floating leaf of ``tree``; jit-safe.

  Works on any pytree — gradients, activations (e.g. Flax's
  ``intermediates`` collection or ``nnx.pop(model, nnx.Intermediate)``),
  params — of float16, bfloat16, float32 or float64 arrays (JAX or NumPy).
  Each floating leaf is replaced by a :class:`TensorStats` of scalar arrays
  (plus a histogram); every other leaf (ints, bools, Python numbers, objects)
  is skipped: it becomes ``None``. An empty tree gives an empty tree. A bare
  array gives one :class:`TensorStats`.

  Every count and histogram bin is exact: decided on the exact real product
  ``|x| * s``, ``s`` the loss scale as a float32 (the value
  ``TensorStats.loss_scale`` holds), computed with integer operations (see
  the module's notes). NumPy float64 leaves keep their range without x64 too
  (split on the host; only ``max_abs`` is then a float32) — as NumPy arrays:
  ``jax.jit`` narrows a NumPy argument to float32 before this function sees
  it.

  There is no host sync and no Python branch on values: call it inside a
  jitted train step — every ``N`` steps by branching the whole step with
  ``lax.cond`` (the guide, ``docs/diagnostics.md``, shows how and what it
  costs) — or from a second jitted function, and return the result: it is a
  pytree of arrays. Turn it into a table with :func:`format_table` or
  :func:`report`.

  Args:
    tree: any pytree.
    loss_scale: the factor the values are (or would be) multiplied by before
      they are held in half precision: a positive number, a scalar array
      (traced values too) or a loss scale object (its ``loss_scale`` is
      used), in [2**-126, 2**126] (jmp_lite's loss-scale range; a traced
      scale cannot be checked: any positive finite float32 gives exact
      counts). It is rounded to float32. Give *unscaled* gradients and the
      loss scale to see what a float16 backward pass at that scale holds;
      give values that already carry the scale with ``loss_scale=1``.

  Returns:
    ``tree`` with each floating leaf replaced by its :class:`TensorStats`.

  Raises:
    TypeError: if ``loss_scale`` is not a real number, scalar array or loss
      scale.
    ValueError: if a concrete ``loss_scale`` is not a scalar, not positive
      and finite, or outside [2**-126, 2**126].

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"w": jnp.array([1e-13, 1e-3, 3.0]), "step": jnp.array(7)}
    >>> stats = jax.jit(diagnostics.tensor_stats)(grads, 2.0**15)
    >>> stats["step"] is None, int(stats["w"].f16_underflow), int(stats["w"].f16_overflow)
    (True, 1, 1)
  """
  loss_scale = _check_loss_scale(loss_scale, "tensor_stats")

  def stats(x):
    if not tree_lib.is_float_array(x):
      return None
    if _is_host_float64(x):
      parts, largest = _split_host_float64(x)
      return _host_leaf_stats(parts, _host_max_abs(largest), loss_scale)
    return _leaf_stats(jnp.asarray(x), loss_scale)

  return jax.tree_util.tree_map(stats, tree)


# -- naming and grouping ---------------------------------------------------------

#: The name :func:`group_stats` gives a tree that is a single array.
ROOT_NAME = "<root>"


def _path_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or ROOT_NAME


def _named_leaves(stats: Any, what: str) -> list[tuple[str, TensorStats]]:
  """``(path, TensorStats)`` for each leaf of a tree of statistics."""
  leaves = jax.tree_util.tree_leaves_with_path(stats, is_leaf=_is_stats)
  out = []
  for path, leaf in leaves:
    if not isinstance(leaf, TensorStats):
      kind = (f"a {leaf.dtype} array" if tree_lib.is_array(leaf)
              else type(leaf).__name__)
      raise TypeError(
          f"{what} expects statistics from diagnostics.tensor_stats (a tree "
          f"of TensorStats), got {kind} at {_path_name(path)!r}. Call "
          "diagnostics.tensor_stats(tree, loss_scale) first."
      )
    out.append((_path_name(path), leaf))
  return out


def _combine(stats: Sequence[TensorStats]) -> TensorStats:
  """Sums the counts and histograms, takes the largest max_abs and scale."""
  if len(stats) == 1:
    return stats[0]
  widest = max((np.dtype(s.max_abs.dtype) for s in stats),
               key=lambda d: d.itemsize)

  def total(field):
    return sum(
        (jnp.asarray(getattr(s, field)) for s in stats[1:]),
        jnp.asarray(getattr(stats[0], field)),
    )

  return TensorStats(
      size=total("size"),
      **{field: total(field) for field in _COUNT_FIELDS},
      max_abs=jnp.max(jnp.stack([jnp.asarray(s.max_abs).astype(widest)
                                 for s in stats])),
      loss_scale=jnp.max(jnp.stack([jnp.asarray(s.loss_scale) for s in stats])),
      histogram=total("histogram"),
  )


def _group_key(by: Any) -> Callable[[str], str]:
  if by is None:
    return lambda name: name
  if callable(by):
    return by
  if isinstance(by, bool) or not isinstance(by, numbers.Integral) or by == 0:
    raise TypeError(
        "group_stats: by must be None (one entry per leaf), a nonzero int (n >"
        " 0: the first n path components; n < 0: drop the last -n) or a "
        f"function from a leaf's path to its group's name, got {by!r}."
    )
  by = int(by)

  def key(name):
    parts = name.split("/")
    kept = parts[:by] if by > 0 else parts[:max(1, len(parts) + by)]
    return "/".join(kept)

  return key


def group_stats(stats: Any, by: Any = None) -> dict[str, TensorStats]:
  """Flattens a tree of statistics into ``{path: TensorStats}``, or groups it.

  Paths are the leaves' key paths joined by ``/`` (as
  ``jax.tree_util.keystr(path, simple=True, separator="/")`` writes them),
  e.g. ``params/Dense_0/kernel``. Grouped statistics add up the counts and
  histograms and keep the largest ``max_abs``, so a module's row describes all
  of its leaves together. Jit-safe.

  Args:
    stats: the output of :func:`tensor_stats` (or of this function).
    by: ``None``: one entry per leaf; an int ``n > 0``: group by the first
      ``n`` path components (``1`` on ``{"params": {"Dense_0": ...}}`` gives
      ``params``); ``n < 0``: drop the last ``-n`` components (``-1`` turns
      ``params/Dense_0/kernel`` into the module ``params/Dense_0``; ``-2``
      turns linen's ``intermediates/Dense_0/__call__/0`` into
      ``intermediates/Dense_0``); or a function from a leaf's path to its
      group's name.

  Returns:
    A dict from path (or group name) to :class:`TensorStats`, in the order
    the leaves come; empty for an empty tree.

  Raises:
    TypeError: if ``stats`` holds something other than :class:`TensorStats`,
      or ``by`` is not one of the above.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.ones(3)}, "out": {"w": jnp.ones(1)}}
    >>> stats = diagnostics.tensor_stats(grads)
    >>> list(diagnostics.group_stats(stats))
    ['dense/b', 'dense/w', 'out/w']
    >>> {k: int(v.zeros) for k, v in diagnostics.group_stats(stats, by=1).items()}
    {'dense': 2, 'out': 0}
  """
  key = _group_key(by)
  groups: dict[str, list[TensorStats]] = {}
  for name, leaf in _named_leaves(stats, "group_stats"):
    group = key(name)
    if not isinstance(group, str):
      raise TypeError(
          f"group_stats: by({name!r}) must return a string, got "
          f"{type(group).__name__}: {group!r}."
      )
    groups.setdefault(group, []).append(leaf)
  return {group: _combine(leaves) for group, leaves in groups.items()}


# -- host side: reading statistics -------------------------------------------------


def _as_stats(tree: Any) -> Any:
  """A tree of statistics as it is, or the statistics of a tree of arrays."""
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_stats)
  if any(isinstance(leaf, TensorStats) for leaf in leaves):
    return tree
  return tensor_stats(tree)


def _host_named(tree: Any, by: Any, what: str) -> dict[str, TensorStats]:
  """``{name: TensorStats of numpy values}`` of a tree of stats or arrays."""
  grouped = group_stats(_as_stats(tree), by)
  if not _is_concrete_tree(grouped):
    raise TypeError(
        f"{what} reads statistics on the host; call it outside jax.jit, on the"
        " statistics the jitted step returned."
    )
  return {name: TensorStats(*(np.asarray(v) for v in s))
          for name, s in jax.device_get(grouped).items()}


def _bin_portions(exp: float, shift: float) -> np.ndarray:
  """Share of each binade of ``|x| * s0`` that falls below ``2**exp`` once
  multiplied by ``2**shift``: 0 or 1 when ``shift`` is an integer, linear in
  log2 within the one binade that straddles the threshold otherwise."""
  low = HISTOGRAM_EXPONENTS + shift
  return np.clip(exp - low, 0.0, 1.0)


def _count_below(stats: TensorStats, exp: float, scale: float) -> float:
  """Entries with ``|x| * scale < 2**exp``, from the histogram (measured at
  ``stats.loss_scale``): exact when ``scale / stats.loss_scale`` is a power of
  two, interpolated within one binade otherwise."""
  shift = math.log2(scale) - math.log2(float(stats.loss_scale))
  return float(np.sum(stats.histogram * _bin_portions(exp, shift)))


def _format_pow2(value: float) -> str:
  exponent = math.log2(value) if value > 0 else 0.5
  if exponent == int(exponent) and abs(exponent) >= 1:
    return f"2^{int(exponent)}"
  return f"{value:g}"


def _format_percent(share: float) -> str:
  if share == 0:
    return "0"
  if share < 0.001:
    return "<0.1"
  if share > 0.999 and share < 1:
    return ">99.9"
  return f"{100 * share:.1f}"


_TABLE_COLUMNS = (
    ("zeros", "zero"),
    ("f16_underflow", "f16 underflow (<2^-24)"),
    ("f16_subnormal", "f16 subnormal (<2^-14)"),
    ("f16_overflow", "f16 overflow (>65504)"),
    ("bf16_underflow", "bf16 underflow (<2^-133)"),
    ("bf16_overflow", "bf16 overflow"),
    ("nonfinite", "inf/nan"),
)


def _table(named: Mapping[str, TensorStats], first: str) -> str:
  lines = [
      f"| {first} | entries | max abs | loss scale | "
      + " | ".join(f"{title} %" for _, title in _TABLE_COLUMNS) + " |",
      "|---|--:|--:|--:|" + "--:|" * len(_TABLE_COLUMNS),
  ]
  rows = list(named.items())
  if len(rows) > 1:
    rows.append(("all", _combine(list(named.values()))))
  for name, s in rows:
    s = TensorStats(*(np.asarray(v) for v in s))
    cells = [name, f"{int(s.size):,}", f"{float(s.max_abs):.3g}",
             _format_pow2(float(s.loss_scale))]
    cells += [_format_percent(s.fraction(field)) for field, _ in _TABLE_COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def format_table(stats: Any, *, by: Any = None, title: str = "leaf") -> str:
  """The statistics as a markdown table (readable as plain text), one row per
  leaf or group and a last row ``all``.

  Columns: entries, largest ``|x|`` (without the loss scale), the loss scale
  the shares were measured at, then the share (%) of entries that are zero,
  underflow float16 (below 2^-24), are float16-subnormal (below 2^-14, the
  underflowing ones included), overflow float16 (above 65504), underflow or
  overflow bfloat16, and are inf/NaN. ``<0.1`` marks a share that is small
  but not zero.

  Args:
    stats: a tree of :class:`TensorStats` (from :func:`tensor_stats`), or a
      tree of arrays (measured at loss scale 1).
    by: grouping, as in :func:`group_stats`.
    title: the header of the first column.

  Returns:
    The table; a one-line note for a tree without floating leaves.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> print(diagnostics.format_table({"w": jnp.array([0.0, 1e-9, 1.0, 1e5])}))
    | leaf | entries | max abs | loss scale | zero % | f16 underflow (<2^-24) % | ...
    |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|
    | w | 4 | 1e+05 | 1 | 25.0 | 25.0 | 25.0 | 25.0 | 0 | 0 | 0 |
  """
  named = _host_named(stats, by, "format_table")
  if not named:
    return "(no floating-point leaves)"
  return _table(named, title)


# -- advice ----------------------------------------------------------------------

#: The default headroom of :func:`advise`: the recommended loss scale keeps the
#: largest scaled gradient at least this factor below float16's max (65504).
DEFAULT_HEADROOM = 8.0


@dataclasses.dataclass(frozen=True)
class Advice:
  """What :func:`advise` recommends, with the figures behind it.

  ``str(advice)`` (what :func:`report` prints) is a small table and the
  reasons.

  Attributes:
    dtype: ``"float16"`` or ``"bfloat16"``; ``None`` when the gradients hold
      no nonzero finite entry (nothing to measure).
    loss_scale: the static loss scale to use with ``dtype``: the float16 scale
      below for float16, 1.0 for bfloat16 (it has float32's range: no loss
      scaling needed); ``None`` with ``dtype``.
    f16_loss_scale: the largest power of two ``s`` with ``max_abs * s *
      headroom <= 65504``: the float16 loss scale that keeps the largest
      gradient ``headroom`` times below float16's max (clamped to 2^-126 ...
      2^126); ``None`` with ``dtype``.
    headroom: the factor asked for.
    max_abs: the largest finite gradient magnitude measured.
    f16_underflow: share of gradient entries that underflow float16 (below
      2^-24) at ``f16_loss_scale``.
    f16_subnormal: share of gradient entries below float16's smallest normal
      (2^-14) at ``f16_loss_scale``.
    unscaled_f16_underflow: share of gradient entries that underflow float16
      without loss scaling (scale 1).
    keep_f32: names of the leaves (or groups) to keep in float32.
    reasons: one sentence per decision: the dtype, then each ``keep_f32``
      entry, then warnings (non-finite gradients).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> advice = diagnostics.advise({"w": jnp.array([1e-6, 2.0**-10, 0.5])})
    >>> advice.dtype, advice.loss_scale == 2.0**13
    ('float16', True)
  """

  dtype: str | None
  loss_scale: float | None
  f16_loss_scale: float | None
  headroom: float
  max_abs: float
  f16_underflow: float
  f16_subnormal: float
  unscaled_f16_underflow: float
  keep_f32: tuple[str, ...]
  reasons: tuple[str, ...]

  def __str__(self) -> str:
    scale = "–" if self.loss_scale is None else _format_pow2(self.loss_scale)
    f16_scale = ("–" if self.f16_loss_scale is None
                 else _format_pow2(self.f16_loss_scale))
    rows = [
        ("dtype", self.dtype or "–"),
        ("static loss scale", scale),
        (f"float16 loss scale (headroom {self.headroom:g}x)", f16_scale),
        ("largest gradient magnitude", f"{self.max_abs:.3g}"),
        ("f16 underflow at that scale", f"{_format_percent(self.f16_underflow)}%"),
        ("f16 underflow without loss scaling",
         f"{_format_percent(self.unscaled_f16_underflow)}%"),
        ("keep in float32", ", ".join(self.keep_f32) or "nothing"),
    ]
    lines = ["| advice | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines.append("")
    lines += [f"- {r}" for r in self.reasons]
    return "\n".join(lines)


def _check_fraction(value: Any, what: str, low_open: bool) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"advise: {what} must be a number, got {value!r}.")
  value = float(value)
  ok = (0 < value <= 1) if low_open else (0 <= value <= 1)
  if not ok:
    interval = "(0, 1]" if low_open else "[0, 1]"
    raise ValueError(
        f"advise: {what} is a share of entries and must lie in {interval}, got"
        f" {value}; e.g. 0.01 for 1%."
    )
  return value


def _f16_scale(max_abs: float, headroom: float) -> float:
  """The largest power of two s with max_abs * s * headroom <= F16_MAX."""
  exponent = math.floor(math.log2(F16_MAX / (headroom * max_abs)))
  while max_abs * 2.0**exponent * headroom > F16_MAX:
    exponent -= 1
  while max_abs * 2.0**(exponent + 1) * headroom <= F16_MAX:
    exponent += 1
  return 2.0**min(max(exponent, -126), 126)


def advise(
    grad_stats: Any,
    activation_stats: Any = None,
    *,
    by: Any = None,
    headroom: float = DEFAULT_HEADROOM,
    max_underflow: float = 0.01,
    keep_f32_underflow: float = 0.5,
) -> Advice:
  """Recommends a static loss scale, float16 or bfloat16, and what stays f32.

  Give it statistics of *unscaled* gradients (say from a float32 step, or the
  gradients of a scaled step divided by their scale; measured at any loss
  scale, since the histogram is shifted to the scale under test). The rule:

  1. **Loss scale.** The largest power of two ``s`` with ``max|g| * s *
     headroom <= 65504``: the largest gradient stays ``headroom`` times below
     float16's max, room for gradients that grow between steps (default 8, three
     binades).
  2. **dtype.** float16 when, at ``s``, at most ``max_underflow`` of the
     gradient entries fall below float16's smallest subnormal 2^-24 (no entry
     overflows at ``s`` by construction); otherwise bfloat16, whose range is
     float32's: no scale keeps both ends of these gradients inside float16.
  3. **Keep in float32** (leaves or groups, see ``by``): with float16,
     gradients of which more than ``keep_f32_underflow`` underflow at ``s``,
     and activations with *any* entry above 65504 (a forward-pass overflow
     makes the loss inf/NaN whatever the loss scale) or with more than
     ``keep_f32_underflow`` below 2^-24; with either dtype, leaves that
     overflow bfloat16 or underflow it that much.

  Args:
    grad_stats: statistics of the gradients (a tree of :class:`TensorStats`),
      or the gradients themselves.
    activation_stats: optionally, statistics (or values) of the forward pass's
      intermediate values, measured at loss scale 1.
    by: grouping of the leaves, as in :func:`group_stats` (e.g. ``-1`` for
      parameter modules).
    headroom: factor (>= 1) kept between the largest scaled gradient and
      65504.
    max_underflow: the share of gradient entries allowed to underflow float16
      at the recommended scale, in [0, 1].
    keep_f32_underflow: the underflow share, in (0, 1], above which a leaf is
      kept in float32.

  Returns:
    An :class:`Advice`.

  Raises:
    TypeError: on statistics that are traced (call it outside ``jit``) or not
      :class:`TensorStats`, or non-numeric settings.
    ValueError: on settings out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"a": jnp.array([1e-12, 1e-3]), "b": jnp.array([1e-30, 1e-14, 1e-2])}
    >>> advice = diagnostics.advise(diagnostics.tensor_stats(grads))
    >>> advice.dtype, advice.f16_loss_scale == 2.0**19
    ('bfloat16', True)
  """
  if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real):
    raise TypeError(f"advise: headroom must be a number >= 1, got {headroom!r}.")
  headroom = float(headroom)
  if not (math.isfinite(headroom) and headroom >= 1):
    raise ValueError(
        f"advise: headroom must be a finite number >= 1, got {headroom}; it is "
        "the factor kept between the largest scaled gradient and 65504 (e.g. 8)."
    )
  max_underflow = _check_fraction(max_underflow, "max_underflow", False)
  keep_f32_underflow = _check_fraction(
      keep_f32_underflow, "keep_f32_underflow", True)
  grads = _host_named(grad_stats, by, "advise")
  acts = ({} if activation_stats is None
          else _host_named(activation_stats, by, "advise"))

  def empty(reason):
    return Advice(None, None, None, headroom, 0.0, 0.0, 0.0, 0.0, (), (reason,))

  if not grads:
    return empty("No floating-point gradient leaves: nothing to advise.")
  total = _combine(list(grads.values()))
  total = TensorStats(*(np.asarray(v) for v in total))
  size = int(total.size)
  max_abs = float(total.max_abs)
  if max_abs == 0 or not int(np.sum(total.histogram)):
    return empty("Every gradient entry is zero or non-finite: no magnitude to "
                 "choose a loss scale from.")

  s = _f16_scale(max_abs, headroom)
  underflow = _count_below(total, -24, s) / size
  subnormal = _count_below(total, -14, s) / size
  unscaled = _count_below(total, -24, 1.0) / size
  use_f16 = underflow <= max_underflow
  nonzero = np.nonzero(total.histogram)[0]
  shift = math.log2(float(total.loss_scale))
  span = HISTOGRAM_EXPONENTS[nonzero[-1]] - HISTOGRAM_EXPONENTS[nonzero[0]] + 1
  if use_f16:
    reasons = [
        f"float16 with a static loss scale of {_format_pow2(s)}: the largest "
        f"gradient ({max_abs:.3g}) times {_format_pow2(s)} is "
        f"{max_abs * s:.4g}, at least {headroom:g}x below float16's max 65504, "
        f"and {_format_percent(underflow)}% of the gradient entries underflow "
        f"(< 2^-24) at that scale (limit {_format_percent(max_underflow)}%)."
        + (f" Without loss scaling {_format_percent(unscaled)}% would."
           if unscaled > underflow else "")
    ]
  else:
    reasons = [
        f"bfloat16 (no loss scaling): even the largest safe float16 scale, "
        f"{_format_pow2(s)} (largest gradient {max_abs:.3g} x scale x "
        f"{headroom:g} <= 65504), leaves {_format_percent(underflow)}% of the "
        "gradient entries below float16's smallest subnormal 2^-24 (limit "
        f"{_format_percent(max_underflow)}%). The nonzero gradients span about "
        f"2^{span} (2^{HISTOGRAM_EXPONENTS[nonzero[0]] - shift:.0f} to "
        f"2^{HISTOGRAM_EXPONENTS[nonzero[-1]] + 1 - shift:.0f}), float16 only "
        "2^40 (2^-24 to 2^16) less the headroom; bfloat16 has float32's "
        "exponent range."
    ]

  keep: dict[str, str] = {}

  def flag(name, why):
    keep.setdefault(name, why)

  for name, st in grads.items():
    n = max(int(st.size), 1)
    if use_f16:
      share = _count_below(st, -24, s) / n
      if share > keep_f32_underflow:
        flag(name, f"{_format_percent(share)}% of its gradient entries "
             f"underflow float16 at loss scale {_format_pow2(s)}.")
    if int(st.bf16_overflow):
      flag(name, f"its gradients overflow bfloat16 ({int(st.bf16_overflow)} "
           "entries).")
    bf16_share = _count_below(st, -133, 1.0) / n
    if bf16_share > keep_f32_underflow:
      flag(name, f"{_format_percent(bf16_share)}% of its gradient entries "
           "underflow bfloat16 (< 2^-133).")
  for name, st in acts.items():
    n = max(int(st.size), 1)
    if use_f16 and int(st.f16_overflow):
      flag(name, f"its activations overflow float16 ({int(st.f16_overflow)} "
           f"of {int(st.size):,} entries above 65504; largest "
           f"{float(st.max_abs):.3g}).")
    elif use_f16 and st.fraction("f16_underflow") > keep_f32_underflow:
      flag(name, f"{_format_percent(st.fraction('f16_underflow'))}% of its "
           "activations underflow float16.")
    if int(st.bf16_overflow):
      flag(name, f"its activations overflow bfloat16 ({int(st.bf16_overflow)} "
           "entries).")
    elif st.fraction("bf16_underflow") > keep_f32_underflow:
      flag(name, f"{_format_percent(st.fraction('bf16_underflow'))}% of its "
           "activations underflow bfloat16.")
  reasons += [f"Keep {name} in float32: {why}" for name, why in keep.items()]
  if int(total.nonfinite):
    reasons.append(
        f"{int(total.nonfinite)} gradient entries are inf/NaN in the values "
        "measured: fix those first (they are not a precision problem if the "
        "gradients were computed in float32).")
  return Advice(
      dtype="float16" if use_f16 else "bfloat16",
      loss_scale=s if use_f16 else 1.0,
      f16_loss_scale=s,
      headroom=headroom,
      max_abs=max_abs,
      f16_underflow=underflow,
      f16_subnormal=subnormal,
      unscaled_f16_underflow=unscaled,
      keep_f32=tuple(keep),
      reasons=tuple(reasons),
  )


# -- the plot and the report --------------------------------------------------------


def _draw_ranges(ax, first: bool) -> None:
  f16_max = math.log2(F16_MAX)
  bf16_max = math.log2(BF16_MAX)
  ax.axvspan(-24, -14, color="tab:orange", alpha=0.15,
             label="f16 subnormal (2^-24 to 2^-14)" if first else None)
  ax.axvspan(-14, f16_max, color="tab:green", alpha=0.12,
             label="f16 normal (2^-14 to 65504)" if first else None)
  ax.axvline(-24, color="tab:red", linewidth=1.2,
             label="f16 flush to zero / max" if first else None)
  ax.axvline(f16_max, color="tab:red", linewidth=1.2)
  ax.axvspan(-133, -126, color="tab:purple", alpha=0.12,
             label="bf16 subnormal (2^-133 to 2^-126)" if first else None)
  ax.axvline(-133, color="tab:purple", linestyle="--", linewidth=1.2,
             label="bf16 smallest subnormal (2^-133) / max (2^128)"
             if first else None)
  ax.axvline(bf16_max, color="tab:purple", linestyle="--", linewidth=1.2)


def _draw_row(ax, name: str, s: TensorStats, kind: str, xlim, first: bool):
  size = max(int(s.size), 1)
  shares = np.asarray(s.histogram, np.float64) / size
  _draw_ranges(ax, first)
  # One filled step outline, not a bar per binade: ~270 bar patches per row
  # made the figure take seconds to draw.
  edges = np.append(HISTOGRAM_EXPONENTS, HISTOGRAM_EXPONENTS[-1] + 1)
  ax.stairs(shares, edges, fill=True, color="tab:blue",
            label="share of entries per binade" if first else None)
  ax.set_xlim(*xlim)
  top = float(shares.max()) if shares.size else 0.0
  ax.set_ylim(0, max(top, 0.01) * 1.3)
  scale = float(s.loss_scale)
  scale_note = "" if scale == 1 else f" x loss scale {_format_pow2(scale)}"
  notes = (f"{kind} {name}{scale_note}: zero {_format_percent(s.fraction('zeros'))}%,"
           f" f16 underflow {_format_percent(s.fraction('f16_underflow'))}%, "
           f"f16 overflow {_format_percent(s.fraction('f16_overflow'))}%")
  if int(s.nonfinite):
    notes += f", inf/nan {_format_percent(s.fraction('nonfinite'))}%"
  ax.set_title(notes, fontsize=8, loc="left")
  ax.tick_params(labelsize=7)
  ax.set_ylabel("share", fontsize=7)


def _check_path(path: Any, owner: str, optional: bool) -> None:
  """A figure's path: a str or os.PathLike (``None`` too where optional)."""
  if isinstance(path, (str, os.PathLike)) or (optional and path is None):
    return
  allowed = ("None (no figure) or a file path" if optional
             else "a file path")
  fix = ("" if optional else
         " For the table without a figure, call format_table(stats) or "
         "report(stats).")
  raise TypeError(
      f"{owner}: path must be {allowed}: a str or os.PathLike whose suffix "
      "names the format, such as 'grads.png' or pathlib.Path('grads.svg'); "
      f"got {type(path).__name__}: {path!r}.{fix}"
  )


def _check_dpi(dpi: Any, owner: str) -> None:
  what = f"{owner}: dpi must be a positive number of dots per inch (e.g. 100)"
  if isinstance(dpi, (bool, np.bool_)) or not isinstance(dpi, numbers.Real):
    raise TypeError(f"{what}, got {type(dpi).__name__}: {dpi!r}.")
  if not (math.isfinite(dpi) and dpi > 0):
    raise ValueError(f"{what}, got {dpi!r}.")


_FILE_HELP = ("file must be a writable text stream, such as sys.stdout or "
              "open('out.txt', 'w'); to write a figure give path=")


def _check_file(file: Any, owner: str) -> None:
  """``file`` for ``print``: None or a writable, open text stream."""
  if file is None:
    return
  if not callable(getattr(file, "write", None)):
    raise TypeError(
        f"{owner}: {_FILE_HELP}. Got {type(file).__name__}: {file!r}.")
  if isinstance(file, (io.RawIOBase, io.BufferedIOBase)):
    raise TypeError(
        f"{owner}: {_FILE_HELP}. Got a binary stream ({type(file).__name__}):"
        " open the file in text mode ('w', not 'wb').")
  if getattr(file, "closed", False):
    raise ValueError(f"{owner}: {_FILE_HELP}. Got a closed {type(file).__name__}.")
  writable = getattr(file, "writable", None)
  if callable(writable) and not writable():
    raise ValueError(
        f"{owner}: {_FILE_HELP}. Got a {type(file).__name__} that is not "
        "writable (opened for reading?).")


def plot_histograms(
    stats: Any,
    path: str | os.PathLike,
    *,
    activation_stats: Any = None,
    by: Any = None,
    title: str | None = None,
    dpi: int = 100,
) -> str:
  """Writes a figure of each leaf's magnitudes against the f16/bf16 ranges.

  One row per leaf (or group, see ``by``), gradients first, then
  activations: the share of entries per binade of ``log2(|x| * loss_scale)``
  (the :class:`TensorStats` histogram), over float16's subnormal range
  (2^-24 to 2^-14, shaded orange) and normal range (to 65504, shaded green),
  with float16's flush-to-zero edge and max as red lines, and bfloat16's
  subnormal range, smallest subnormal and max (purple, dashed) where the
  x range reaches them. Each row's title gives its zero, underflow and
  overflow shares. Zeros and inf/NaN are not in the bars.

  matplotlib is imported here, not by ``import jmp_lite``; the figure is
  drawn without pyplot (no window, no global state).

  Args:
    stats: a tree of :class:`TensorStats` (or of arrays, measured at loss
      scale 1): the gradients.
    path: the file to write, a str or os.PathLike (the format follows the
      suffix, e.g. ``.png``).
    activation_stats: optionally, statistics (or values) of activations.
    by: grouping, as in :func:`group_stats`.
    title: the figure's title.
    dpi: resolution, a positive number of dots per inch.

  Returns:
    ``path``.

  Raises:
    TypeError: if ``path`` is not a str or os.PathLike, or ``dpi`` is not a
      number (checked before anything is drawn).
    ValueError: if ``dpi`` is not positive and finite.

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> path = os.path.join(tempfile.mkdtemp(), "grads.png")
    >>> diagnostics.plot_histograms({"w": jnp.array([1e-9, 1e-3, 1.0])}, path) == path
    True
  """
  _check_path(path, "plot_histograms", optional=False)
  _check_dpi(dpi, "plot_histograms")
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = [("gradient", n, s) for n, s in
          _host_named(stats, by, "plot_histograms").items()]
  if activation_stats is not None:
    rows += [("activation", n, s) for n, s in
             _host_named(activation_stats, by, "plot_histograms").items()]
  if not rows:
    fig = Figure(figsize=(8, 1.5))
    fig.text(0.5, 0.5, "no floating-point leaves", ha="center", va="center")
    fig.savefig(path, dpi=dpi)
    return path
  used = [HISTOGRAM_EXPONENTS[np.nonzero(s.histogram)[0]] for _, _, s in rows]
  used = np.concatenate(used) if used else np.array([], int)
  low = min(-27, int(used.min()) - 1) if used.size else -27
  high = max(18, int(used.max()) + 2) if used.size else 18
  fig = Figure(figsize=(10, 1.3 + 1.3 * len(rows)), layout="constrained")
  axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
  for i, ((kind, name, s), ax) in enumerate(zip(rows, axes)):
    _draw_row(ax, name, s, kind, (low, high), first=i == 0)
  axes[-1].set_xlabel(
      "log2(|value| x loss scale): bar e counts 2^e <= |value| x scale < 2^(e+1)")
  fig.legend(loc="outside lower center", ncol=3, fontsize=7, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=dpi)
  return path


def report(
    grad_stats: Any,
    path: str | os.PathLike | None = None,
    *,
    activation_stats: Any = None,
    by: Any = None,
    headroom: float = DEFAULT_HEADROOM,
    max_underflow: float = 0.01,
    keep_f32_underflow: float = 0.5,
    title: str | None = None,
    file: TextIO | None = None,
) -> Advice:
  """Prints the tables and the advice, writes the histogram plot: one call.

  Prints :func:`format_table` of the gradients (and of the activations, when
  given), then ``str(advise(...))``; writes :func:`plot_histograms` to
  ``path`` when one is given. Call it outside ``jit`` on statistics a jitted
  step returned, or directly on a tree of arrays.

  Args:
    grad_stats: statistics of the gradients (from :func:`tensor_stats`), or
      the gradients themselves (then measured at loss scale 1).
    path: where to write the figure, a str or os.PathLike (e.g.
      ``"grads.png"``); ``None``: no plot.
    activation_stats: optionally, statistics (or values) of activations.
    by: grouping, as in :func:`group_stats`.
    headroom: see :func:`advise`.
    max_underflow: see :func:`advise`.
    keep_f32_underflow: see :func:`advise`.
    title: a line printed first, and the figure's title.
    file: where to print: a writable text stream (default ``sys.stdout``).

  Returns:
    The :class:`Advice`.

  Raises:
    TypeError: if ``file`` is not a text stream (no callable ``write``, or a
      binary stream) or ``path`` is not None, a str or os.PathLike; checked
      before anything is printed or drawn.
    ValueError: if ``file`` is closed or not writable, or on bad advice
      settings (see :func:`advise`).

  Example:
    >>> import io, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> out = io.StringIO()
    >>> advice = diagnostics.report({"w": jnp.array([1e-7, 1e-3])}, file=out)
    >>> "| w |" in out.getvalue(), advice.dtype
    (True, 'float16')
  """
  _check_file(file, "report")
  _check_path(path, "report", optional=True)
  file = sys.stdout if file is None else file
  grad_stats = _as_stats(grad_stats)
  if activation_stats is not None:
    activation_stats = _as_stats(activation_stats)
  advice = advise(grad_stats, activation_stats, by=by, headroom=headroom,
                  max_underflow=max_underflow,
                  keep_f32_underflow=keep_f32_underflow)
  parts = []
  if title:
    parts.append(title)
  parts.append("Gradients:\n\n" + format_table(grad_stats, by=by))
  if activation_stats is not None:
    parts.append("Activations:\n\n" + format_table(activation_stats, by=by))
  parts.append(str(advice))
  if path is not None:
    plot_histograms(grad_stats, path, activation_stats=activation_stats, by=by,
                    title=title)
    parts.append(f"Wrote {path}")
  print("\n\n".join(parts), file=file)
  return advice


# -- catching gradients that were never scaled ----------------------------------------


class ScaleCheck(NamedTuple):
  """Running evidence that gradients reach the optimizer without loss scaling.

  The mistake: computing gradients of the *unscaled* loss and handing them to
  ``jmp_lite.loss_scaling``'s ``update``, which divides them by the loss scale
  — updates shrink by that factor and training stalls with no error. Two
  jit-safe signals, updated by :func:`scale_check_update` from the gradients
  handed to the optimizer and the scale of their step:

  * **Headroom** (any loss scale >= 2, one step): gradients that were
    multiplied by ``s`` and still fit float16 after a *second* multiplication
    by ``s`` (``max|g| * s <= 65504``) mean the scale is at least ``s`` times
    too small for them — or, far more often, that it was never applied.
    ``suspect_steps`` counts such steps in a row.
  * **Response** (dynamic loss scales): when the scale changes between two
    finite steps, scaled gradients follow it (``log2 max|g|`` moves by the
    same amount) and unscaled ones do not. ``response`` / ``scale_change``
    is near 1 for scaled gradients and near 0 for unscaled ones; batch-to-batch
    noise averages out over a few changes.

  :meth:`looks_unscaled` combines them. Keep a ``ScaleCheck`` in your train
  state (``scale_check_init()``) and update it every step.

  Attributes:
    suspect_steps: int32, finite steps in a row that failed the headroom test.
    last_log2_max: float32, ``log2`` of the largest ``|g|`` at the last finite
      step with a nonzero gradient (NaN before).
    last_log2_scale: float32, ``log2`` of that step's loss scale.
    scale_change: float32, total ``|change of log2(scale)|`` between
      consecutive such steps.
    response: float32, total change of ``log2 max|g|`` between those steps,
      signed by the direction of the scale's change.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> check = diagnostics.scale_check_init()
    >>> grads = {"w": jnp.array([0.5, -0.01])}          # never multiplied by 2**15
    >>> for _ in range(3):
    ...   check = diagnostics.scale_check_update(check, grads, 2.0**15)
    >>> int(check.suspect_steps), bool(check.looks_unscaled(min_suspect_steps=3))
    (3, True)
  """

  suspect_steps: Any
  last_log2_max: Any
  last_log2_scale: Any
  scale_change: Any
  response: Any

  @property
  def response_ratio(self) -> jax.Array:
    """``response / scale_change``: ~1 scaled, ~0 unscaled, NaN before any
    change of the scale."""
    change = jnp.asarray(self.scale_change, jnp.float32)
    return jnp.where(change > 0, jnp.asarray(self.response, jnp.float32)
                     / jnp.where(change > 0, change, 1.0), jnp.nan)

  def looks_unscaled(
      self,
      *,
      min_suspect_steps: int = 20,
      min_scale_change: float = 2.0,
      max_response: float = 0.5,
  ) -> jax.Array:
    """Whether the gradients look unscaled (a bool array, jit-safe).

    True when the scale has changed by at least ``min_scale_change`` binades
    in total and the gradients' response ratio is below ``max_response``; or,
    while the response is not yet known, when the last ``min_suspect_steps``
    finite steps in a row failed the headroom test. A response ratio of at
    least ``max_response`` clears it: the gradients follow the scale.

    Args:
      min_suspect_steps: steps in a row of the headroom test.
      min_scale_change: binades of scale change before the response decides.
      max_response: the response ratio below which gradients are unscaled.

    Example:
      >>> from jmp_lite import diagnostics
      >>> bool(diagnostics.scale_check_init().looks_unscaled())
      False
    """
    ratio = self.response_ratio
    decided = jnp.asarray(self.scale_change, jnp.float32) >= min_scale_change
    by_response = decided & (ratio < max_response)
    by_headroom = ~decided & (
        jnp.asarray(self.suspect_steps, jnp.int32) >= min_suspect_steps)
    return by_response | by_headroom


def scale_check_init() -> ScaleCheck:
  """A fresh :class:`ScaleCheck` (no evidence yet).

  Example:
    >>> from jmp_lite import diagnostics
    >>> int(diagnostics.scale_check_init().suspect_steps)
    0
  """
  return ScaleCheck(
      suspect_steps=jnp.zeros([], jnp.int32),
      last_log2_max=jnp.full([], jnp.nan, jnp.float32),
      last_log2_scale=jnp.full([], jnp.nan, jnp.float32),
      scale_change=jnp.zeros([], jnp.float32),
      response=jnp.zeros([], jnp.float32),
  )


def largest_magnitude(tree: Any) -> jax.Array:
  """The largest finite ``|x|`` over the floating leaves of ``tree``; jit-safe.

  Returns a float32 scalar, 0 for a tree without floating leaves or nonzero
  finite entries.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> float(diagnostics.largest_magnitude({"a": jnp.array([1.0, -3.0, jnp.inf]), "n": 7}))
    3.0
  """
  maxima = [
      jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.zeros((), x.dtype)),
              initial=np.array(0, x.dtype)).astype(jnp.float32)
      for x in map(jnp.asarray, filter(tree_lib.is_float_array,
                                       jax.tree_util.tree_leaves(tree)))
  ]
  if not maxima:
    return jnp.zeros([], jnp.float32)
  return jnp.max(jnp.stack(maxima))


def _log2(x: jax.Array) -> jax.Array:
  """log2 of a float32 scalar, exact for powers of two (-inf for 0)."""
  parts, _ = _split(x)
  low, high = parts.limbs
  mantissa = ((high << _LIMB) | low).astype(jnp.float32) * np.float32(2.0**-23)
  value = parts.exponent.astype(jnp.float32) + jnp.log2(mantissa)
  value = jnp.where(parts.finite, value, jnp.inf)
  return jnp.where(parts.zero, -jnp.inf, value)


def scale_check_update(check: ScaleCheck, scaled_grads: Any,
                       loss_scale: Any) -> ScaleCheck:
  """Adds one step's evidence to a :class:`ScaleCheck`; jit-safe.

  Costs one reduction over the gradients (the largest magnitude, NaN counted
  as inf, which also tells whether they are finite). Non-finite steps (skipped
  by the optimizer) and all-zero gradients leave the check as it was.

  Args:
    check: the state so far (from :func:`scale_check_init`).
    scaled_grads: the gradients handed to the loss-scaling optimizer, which it
      will divide by ``loss_scale``.
    loss_scale: the loss scale of this step's forward pass: a number, scalar
      array or loss scale object (e.g. ``jmp_lite.get_loss_scale(opt_state)``
      before ``update``).

  Returns:
    The updated :class:`ScaleCheck`.

  Raises:
    TypeError: if ``check`` is not a :class:`ScaleCheck` or ``loss_scale`` is
      not a number, scalar array or loss scale.
    ValueError: if a concrete ``loss_scale`` is not a scalar in [2**-126,
      2**126] (jmp_lite's loss-scale range).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> check = diagnostics.scale_check_init()
    >>> g = jnp.array([0.25, 1e-3])
    >>> check = diagnostics.scale_check_update(check, g * 2.0**15, 2.0**15)
    >>> check = diagnostics.scale_check_update(check, g * 2.0**16, 2.0**16)
    >>> float(check.response_ratio), int(check.suspect_steps)
    (1.0, 0)
  """
  _check_scale_check(check, "scale_check_update")
  scale = _check_loss_scale(loss_scale, "scale_check_update")
  # One reduction gives both the largest magnitude and finiteness: NaN counts
  # as inf (XLA's vectorised max does not propagate NaN reliably).
  maxima = [
      jnp.max(jnp.where(jnp.isnan(x), jnp.full((), jnp.inf, x.dtype), jnp.abs(x)),
              initial=np.array(0, x.dtype)).astype(jnp.float32)
      for x in map(jnp.asarray, filter(tree_lib.is_float_array,
                                       jax.tree_util.tree_leaves(scaled_grads)))
  ]
  largest = (jnp.max(jnp.stack(maxima)) if maxima
             else jnp.zeros([], jnp.float32))
  return _record(check, largest, scale)


def _check_scale_check(check: Any, owner: str) -> None:
  if not isinstance(check, ScaleCheck):
    raise TypeError(
        f"{owner}: check must be a ScaleCheck (start from "
        f"diagnostics.scale_check_init()), got {type(check).__name__}."
    )


def scale_check_record(check: ScaleCheck, largest: Any,
                       loss_scale: Any) -> ScaleCheck:
  """:func:`scale_check_update` from an already computed largest magnitude.

  For code that reduces the gradients anyway — an optimizer checking their
  finiteness can take ``max(where(isnan(g), inf, |g|))`` per leaf instead of
  ``all(isfinite(g))`` and get both answers from one reduction — so that the
  check costs no extra pass. Jit-safe.

  Args:
    check: the state so far.
    largest: the largest ``|g|`` of the scaled gradients handed to the
      optimizer, as a scalar; inf (or NaN) when any entry is inf or NaN.
    loss_scale: the loss scale of this step's forward pass (number, scalar
      array or loss scale object).

  Returns:
    The updated :class:`ScaleCheck`.

  Raises:
    TypeError: if ``check`` is not a :class:`ScaleCheck`, or on a bad
      ``loss_scale``.
    ValueError: if a concrete ``loss_scale`` is not a scalar in [2**-126,
      2**126] (jmp_lite's loss-scale range).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> check = diagnostics.scale_check_record(
    ...     diagnostics.scale_check_init(), jnp.float32(0.5), 2.0**15)
    >>> int(check.suspect_steps)   # 0.5 * 2**15 <= 65504: looks unscaled
    1
  """
  _check_scale_check(check, "scale_check_record")
  scale = _check_loss_scale(loss_scale, "scale_check_record")
  largest = jnp.asarray(largest).astype(jnp.float32)
  if largest.ndim != 0:
    raise ValueError(
        f"scale_check_record: largest must be a scalar, got shape "
        f"{largest.shape}; reduce the gradients first (max of |g|).")
  return _record(check, largest, scale)


def _record(check: ScaleCheck, largest: jax.Array,
            scale: jax.Array) -> ScaleCheck:
  """The update of :func:`scale_check_record` on validated float32 scalars."""
  log2_max = _log2(jnp.where(jnp.isnan(largest), jnp.inf, largest))
  log2_scale = _log2(scale)
  valid = (largest > 0) & jnp.isfinite(log2_max)
  suspect = (log2_scale >= 1) & (largest * scale <= F16_MAX)
  suspect_steps = jnp.where(
      valid,
      jnp.where(suspect, check.suspect_steps + 1, jnp.zeros([], jnp.int32)),
      check.suspect_steps)
  delta_scale = log2_scale - check.last_log2_scale
  # Scales are powers of two in practice (exact here); others move by more
  # than rounding error.
  pair = (valid & jnp.isfinite(check.last_log2_max)
          & (jnp.abs(delta_scale) > 1e-3))
  zero = jnp.zeros([], jnp.float32)
  scale_change = check.scale_change + jnp.where(pair, jnp.abs(delta_scale), zero)
  response = check.response + jnp.where(
      pair, (log2_max - check.last_log2_max) * jnp.sign(delta_scale), zero)
  return ScaleCheck(
      suspect_steps=suspect_steps,
      last_log2_max=jnp.where(valid, log2_max, check.last_log2_max),
      last_log2_scale=jnp.where(valid, log2_scale, check.last_log2_scale),
      scale_change=scale_change,
      response=response,
  )
