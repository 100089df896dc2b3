"""Jit-side precision statistics: what would underflow or overflow in half
precision, per leaf of any pytree, and grouped per module.

:class:`TensorStats`, :func:`tensor_stats` (exact counts and a histogram of
binades for every floating leaf) and :func:`group_stats` (which groups the
float8 statistics of :mod:`~jmp_lite._src.diagnostics.fp8_stats` too). The
host side (advice, table, plot, report) is
:mod:`jmp_lite._src.diagnostics.report`. This module knows trees, dtypes,
argument checks and the float8 statistics' type only. Guide:
``docs/diagnostics.md``.
"""

from __future__ import annotations

import functools
import numbers
import operator
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.diagnostics.fp8_stats import combine_fp8_stats
from jmp_lite._src.diagnostics.fp8_stats import Fp8Stats
from jmp_lite._src.diagnostics.fp8_stats import scale_value

# -- the float16 / bfloat16 ranges --------------------------------------------

F16_MAX = 65504.0  # (2 - 2**-10) * 2**15
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # (2 - 2**-7) * 2**127

# floor(log2) of the float16 / bfloat16 maxima: the binades in which some
# values overflow and some do not.
_F16_TOP_EXP, _BF16_TOP_EXP = 15, 127

_HIST_LOW, _HIST_HIGH = -150, 150
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


def _read_only(array: np.ndarray) -> np.ndarray:
  array.flags.writeable = False
  return array


# -- per-leaf statistics -------------------------------------------------------


class TensorStats(NamedTuple):
  """Precision statistics of one array (a pytree node of scalar arrays).

  Counts are over the array's entries, measured exactly on ``|x| *
  loss_scale`` (a loss scale of 1 describes the values as they are).

  Attributes:
    size: int32, the number of entries.
    zeros: int32, entries exactly zero (either sign).
    nonfinite: int32, entries that are inf or NaN (in no other count).
    f16_underflow: int32, nonzero finite entries below ``2**-24``, float16's
      smallest subnormal.
    f16_subnormal: int32, nonzero finite entries below ``2**-14``, float16's
      smallest normal (the underflowing ones included).
    f16_overflow: int32, finite entries above 65504, float16's max.
    bf16_underflow: int32, nonzero finite entries below ``2**-133``,
      bfloat16's smallest subnormal.
    bf16_overflow: int32, finite entries above bfloat16's max (~3.39e38).
    max_abs: the largest finite ``|x|``, *without* the loss scale (0 if none);
      float32, or float64 for float64 leaves with x64 (a NumPy float64 leaf
      without x64 gives a saturating float32).
    loss_scale: float32, the loss scale the counts were measured at.
    histogram: int32, shape ``(300,)``: bin ``i`` counts the nonzero finite
      entries with ``floor(log2(|x| * loss_scale)) ==
      HISTOGRAM_EXPONENTS[i]``.

  ``TensorStats.HISTOGRAM_EXPONENTS`` (a class attribute, read-only) is the
  binade of each histogram bin: -150 ... 149; the first bin also counts
  everything smaller, the last everything larger.

  See ``docs/diagnostics.md`` (the statistics) for what each count means and
  how they are computed.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> s = diagnostics.tensor_stats(jnp.array([0.0, 2.0**-30, 2.0**-20, 1.0, 1e5]))
    >>> int(s.zeros), int(s.f16_underflow), int(s.f16_subnormal), int(s.f16_overflow)
    (1, 1, 2, 1)
    >>> diagnostics.TensorStats.HISTOGRAM_EXPONENTS[s.histogram > 0].tolist()
    [-30, -20, 0, 16]
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

  # A class attribute, not a field (no annotation); shared, so read-only.
  HISTOGRAM_EXPONENTS = _read_only(np.arange(_HIST_LOW, _HIST_HIGH))

  def fraction(self, field: str) -> Any:
    """The share of entries counted by ``field`` (e.g. ``"f16_underflow"``).

    Args:
      field: one of ``zeros``, ``nonfinite``, ``f16_underflow``,
        ``f16_subnormal``, ``f16_overflow``, ``bf16_underflow``,
        ``bf16_overflow``.

    Returns:
      A Python float for concrete statistics, a float32 array under ``jit``;
      0 for an empty array.

    Raises:
      TypeError: if ``field`` is not a string.
      ValueError: if ``field`` is not a count.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> diagnostics.tensor_stats(jnp.array([0.0, 1.0])).fraction("zeros")
      0.5
    """
    field = checks.choice(field, "field", "TensorStats.fraction",
                          _COUNT_FIELDS)
    count, size = getattr(self, field), self.size
    if checks.is_concrete((count, size)):
      size = int(size)
      return int(count) / size if size else 0.0
    size = jnp.asarray(size, jnp.float32)
    return jnp.where(size > 0, jnp.asarray(count, jnp.float32) / jnp.maximum(size, 1.0), 0.0)

  def fractions(self) -> dict[str, float]:
    """Every count as a share of the entries, as Python floats (host only).

    Returns:
      ``{field: share}`` for each count of :meth:`fraction`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jmp_lite import diagnostics
      >>> diagnostics.tensor_stats(jnp.array([0.0, 1.0, 2.0, 1e6])).fractions()["f16_overflow"]
      0.25
    """
    return {field: float(self.fraction(field)) for field in _COUNT_FIELDS}


_EXPONENTS = TensorStats.HISTOGRAM_EXPONENTS

#: What a bad ``loss_scale`` of :func:`tensor_stats` should have been.
LOSS_SCALE_HELP = (
    "loss_scale is the factor the values are (or would be) multiplied by: "
    "1.0 for the values as they are, a number such as 2.0**15, or a loss "
    "scale object such as jmp_lite.get_loss_scale(opt_state)."
)


def _loss_scale(loss_scale: Any, owner: str) -> jax.Array:
  """Validates a loss scale (:mod:`checks`' contracts, with this layer's
  help); returns it as a float32 scalar array.

  Accepts a Python or numpy number, a scalar array (tracers too: not
  range-checked) or an object with a ``loss_scale`` attribute such as a
  jmp_lite loss scale.
  """
  if hasattr(loss_scale, "loss_scale") and not checks.is_array(loss_scale):
    loss_scale = loss_scale.loss_scale
  return scale_value(loss_scale, "loss_scale", owner, LOSS_SCALE_HELP)


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
  return int(limit / 2.0**exponent * 2**23)  # module constants: exact


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
    return jnp.sum(jnp.where(_EXPONENTS < exp, bins, 0), dtype=jnp.int32)

  def at_or_above(exp):
    return jnp.sum(jnp.where(_EXPONENTS >= exp, bins, 0), dtype=jnp.int32)

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

  Each float16, bfloat16, float32 or float64 leaf (JAX or NumPy array)
  becomes a :class:`TensorStats`; every other leaf (ints, bools, Python
  numbers, objects) becomes ``None``. There is no host sync: call it inside a
  jitted train step and return the result, a pytree of arrays.

  Args:
    tree: any pytree (gradients, activations, params); a bare array gives
      one :class:`TensorStats`, an empty tree an empty tree.
    loss_scale: the factor the values are (or would be) multiplied by before
      they are held in half precision: a number, a scalar array (traced
      values too) or a loss scale object (its ``loss_scale`` is used), in
      [2**-126, 2**126]; rounded to float32. ``1.0`` describes the values as
      they are.

  Returns:
    ``tree`` with each floating leaf replaced by its :class:`TensorStats`.

  Raises:
    TypeError: if ``loss_scale`` is not a real number, a scalar array or a
      loss scale object.
    ValueError: if a concrete ``loss_scale`` is not a scalar, not positive
      and finite, or outside [2**-126, 2**126].

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"w": jnp.array([1e-13, 1e-3, 3.0]), "step": jnp.array(7)}
    >>> stats = jax.jit(diagnostics.tensor_stats)(grads, 2.0**15)
    >>> stats["step"] is None, int(stats["w"].f16_underflow), int(stats["w"].f16_overflow)
    (True, 1, 1)

  See ``docs/diagnostics.md`` for how the counts are made exact, NumPy float64
  leaves without x64, and collecting statistics every N steps.
  """
  loss_scale = _loss_scale(loss_scale, "tensor_stats")

  def stats(x):
    if not tree_lib.is_float(x):
      return None
    if _is_host_float64(x):
      parts, largest = _split_host_float64(x)
      return _host_leaf_stats(parts, _host_max_abs(largest), loss_scale)
    # Explicit sharding: partitioned as under Auto axes (a scatter of bins).
    return compat.partitioned_as_auto(
        lambda x: _leaf_stats(x, loss_scale), jax.sharding.PartitionSpec(),
        jnp.asarray(x))

  return jax.tree.map(stats, tree)


def is_stats(x: Any) -> bool:
  """Whether ``x`` is a :class:`TensorStats` or an :class:`Fp8Stats` (a leaf
  of a statistics tree)."""
  return isinstance(x, (TensorStats, Fp8Stats))


# -- naming and grouping ---------------------------------------------------------

#: The name :func:`group_stats` gives a tree that is a single array.
ROOT_NAME = "<root>"


def _path_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or ROOT_NAME


def _named_leaves(stats: Any, what: str) -> list[tuple[str, Any]]:
  """``(path, statistics)`` for each leaf of a tree of :class:`TensorStats`
  or :class:`Fp8Stats`."""
  leaves = jax.tree.leaves_with_path(stats, is_leaf=is_stats)
  out = []
  for path, leaf in leaves:
    if not is_stats(leaf):
      kind = (f"a {leaf.dtype} array" if checks.is_array(leaf)
              else type(leaf).__name__)
      raise TypeError(
          f"{what} expects statistics from diagnostics.tensor_stats (a tree "
          f"of TensorStats), got {kind} at {_path_name(path)!r}. Call "
          "diagnostics.tensor_stats(tree, loss_scale) first."
      )
    out.append((_path_name(path), leaf))
  return out


def combine_stats(stats: Sequence[TensorStats]) -> TensorStats:
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


def host_stats(stats: Any, what: str) -> None:
  """Raises unless ``stats`` can be read on the host (no leaf is traced)."""
  if not checks.is_concrete(stats):
    raise TypeError(
        f"{what} reads statistics on the host; call it outside jax.jit, on the"
        " statistics the jitted step returned."
    )


def _group_key(by: Any, owner: str = "group_stats") -> Callable[[str], str]:
  """A leaf's path name -> its group's name, for ``by=``; a function's
  results are checked to be strings."""
  if by is None:
    return lambda name: name
  if callable(by):
    def checked(name: str) -> str:
      group = by(name)
      if not isinstance(group, str):
        raise TypeError(
            f"{owner}: by({name!r}) must return a string, got "
            f"{type(group).__name__}: {group!r}.")
      return group
    return checked
  if isinstance(by, bool) or not isinstance(by, numbers.Integral) or by == 0:
    raise TypeError(
        f"{owner}: by must be None (one entry per leaf), a nonzero int (n >"
        " 0: the first n path components; n < 0: drop the last -n) or a "
        f"function from a leaf's path to its group's name, got {by!r}."
    )
  by = int(by)

  def key(name):
    parts = name.split("/")
    kept = parts[:by] if by > 0 else parts[:max(1, len(parts) + by)]
    return "/".join(kept)

  return key


def group_stats(stats: Any, by: Any = None) -> dict[str, Any]:
  """Flattens a tree of statistics into ``{path: TensorStats}``, or groups it.

  Paths are the leaves' key paths joined by ``/`` (``params/Dense_0/kernel``;
  a bare array is ``<root>``). A group adds up its leaves' counts and
  histograms and keeps the largest ``max_abs``. Jit-safe. Float8 statistics
  (:class:`Fp8Stats`) group the same way: counts and row errors add up, the
  largest row error is kept; a group holds one kind and one role.

  Args:
    stats: the output of :func:`tensor_stats` or :func:`fp8_stats` (or of
      this function).
    by: ``None``: one entry per leaf; an int ``n > 0``: the first ``n`` path
      components; ``n < 0``: drop the last ``-n`` components (``-1`` gives a
      parameter's module, ``-2`` a linen intermediate's module); or a
      function from a leaf's path to its group's name.

  Returns:
    A dict from path (or group name) to :class:`TensorStats` (or
    :class:`Fp8Stats`), in the order the leaves come; empty for an empty
    tree.

  Raises:
    TypeError: if ``stats`` holds something other than statistics, a group
      mixes :class:`TensorStats` and :class:`Fp8Stats`, or ``by`` is not one
      of the above.
    ValueError: if a group mixes float8 statistics of different roles,
      formats, recipes or block sizes.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.ones(3)}, "out": {"w": jnp.ones(1)}}
    >>> stats = diagnostics.tensor_stats(grads)
    >>> list(diagnostics.group_stats(stats))
    ['dense/b', 'dense/w', 'out/w']
    >>> {k: int(v.zeros) for k, v in diagnostics.group_stats(stats, by=1).items()}
    {'dense': 2, 'out': 0}

  See ``docs/diagnostics.md`` (per leaf and per module) for grouping linen
  and NNX activations.
  """
  key = _group_key(by)
  groups: dict[str, list[Any]] = {}
  for name, leaf in _named_leaves(stats, "group_stats"):
    group = key(name)
    groups.setdefault(group, []).append(leaf)
  out = {}
  for group, leaves in groups.items():
    kinds = {type(leaf) for leaf in leaves}
    if kinds == {Fp8Stats}:
      out[group] = combine_fp8_stats(leaves, group)
    elif kinds == {TensorStats}:
      out[group] = combine_stats(leaves)
    else:
      raise TypeError(
          f"group_stats: group {group!r} mixes half-precision statistics "
          "(TensorStats) with float8 statistics (Fp8Stats); group each tree "
          "on its own.")
  return out
