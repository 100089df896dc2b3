"""Tests of jmp_lite.diagnostics: precision statistics, advice and report.

Statistics are checked against hand-computed counts on constructed arrays
(subnormals, exact powers of two at every threshold, inf/NaN, zeros) for
float16, bfloat16, float32 and float64 inputs, and against a reference in
exact rationals (``fractions.Fraction``): random arrays spanning float32's
whole range, random bit patterns, and values at and one or two ulps either
side of every threshold at non-power-of-two scales — for float16, bfloat16,
float32, float64 with x64 and NumPy float64 without x64.
"""

from fractions import Fraction
import inspect
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import flax.linen as nn
from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import diagnostics
from jmp_lite._src import checks
# Helpers behind diagnostics.report, tested directly.
from jmp_lite._src.diagnostics.report import DEFAULT_HEADROOM
from jmp_lite._src.diagnostics.report import format_table
from jmp_lite._src.diagnostics.report import plot_histograms
from jmp_lite._src.diagnostics.stats import ROOT_NAME

from helpers import JIT
from helpers import default_run_keeps
from helpers import ROOT
from helpers import maybe_jit

F16, BF16, F32, F64 = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16),
                       np.dtype(jnp.float32), np.dtype(jnp.float64))
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
COUNTS = ("zeros", "nonfinite", "f16_underflow", "f16_subnormal",
          "f16_overflow", "bf16_underflow", "bf16_overflow")


def counts(stats):
  return {field: int(getattr(stats, field)) for field in COUNTS}


def below(value, dtype=np.float32):
  """The largest ``dtype`` number below ``value``."""
  return np.nextafter(dtype(value), dtype(-np.inf))


def above(value, dtype=np.float32):
  return np.nextafter(dtype(value), dtype(np.inf))


# The thresholds as exact rationals (independent of the library's constants).
Q_F16_SUBNORMAL = Fraction(1, 2**24)
Q_F16_NORMAL = Fraction(1, 2**14)
Q_F16_MAX = Fraction(65504)                  # 2047 * 2**5
Q_BF16_SUBNORMAL = Fraction(1, 2**133)
Q_BF16_MAX = Fraction(255 * 2**120)          # (2 - 2**-7) * 2**127
assert Q_BF16_MAX == Fraction(BF16_MAX)


def floor_log2(q):
  """``floor(log2(q))`` of a positive Fraction, exactly."""
  n, d = q.numerator, q.denominator
  e = n.bit_length() - d.bit_length()
  if (n if e >= 0 else n << -e) < (d << e if e >= 0 else d):
    e -= 1
  return e


def as_floats(x):
  """The entries of an array of any float dtype as Python floats (exact)."""
  with np.errstate(invalid="ignore"):   # signalling NaNs
    return np.asarray(x).astype(np.float64).reshape(-1).tolist()


def reference(x, scale):
  """The statistics from exact rationals (``fractions.Fraction``): every
  count and bin is decided on the exact real product ``|x| * s``, ``s`` the
  loss scale as a float32 (as ``TensorStats.loss_scale`` holds it)."""
  s = Fraction(float(np.float32(scale)))
  out = dict.fromkeys(COUNTS, 0)
  hist = np.zeros(len(diagnostics.TensorStats.HISTOGRAM_EXPONENTS), int)
  max_abs = 0.0
  for value in as_floats(x):
    if not math.isfinite(value):
      out["nonfinite"] += 1
      continue
    max_abs = max(max_abs, abs(value))
    if value == 0:
      out["zeros"] += 1
      continue
    v = abs(Fraction(value)) * s
    out["f16_underflow"] += v < Q_F16_SUBNORMAL
    out["f16_subnormal"] += v < Q_F16_NORMAL
    out["f16_overflow"] += v > Q_F16_MAX
    out["bf16_underflow"] += v < Q_BF16_SUBNORMAL
    out["bf16_overflow"] += v > Q_BF16_MAX
    hist[min(max(floor_log2(v), -150), 149) + 150] += 1
  return out, hist, max_abs


def assert_matches_reference(stats, x, scale):
  expected, hist, max_abs = reference(x, scale)
  assert counts(stats) == expected
  np.testing.assert_array_equal(np.asarray(stats.histogram), hist)
  assert int(stats.size) == np.size(x)
  return max_abs


# ---------------------------------------------------------------------------
# Hand-computed statistics on constructed arrays.
# ---------------------------------------------------------------------------


@JIT
def test_float32_thresholds_exactly(jit):
  x = np.array([
      0.0, -0.0,                           # zeros
      2.0**-24, below(2.0**-24),           # f16 smallest subnormal: on / under
      -(2.0**-14), below(2.0**-14),        # f16 smallest normal: on / under
      65504.0, above(65504.0), -65520.0,   # f16 max: on / over / over
      2.0**-133, below(2.0**-133),         # bf16 smallest subnormal (f32 subnormals)
      2.0**-149,                           # f32's smallest subnormal
      BF16_MAX, above(BF16_MAX),           # bf16 max: on / over
      np.inf, -np.inf, np.nan, 1.0,
  ], np.float32)
  stats = maybe_jit(diagnostics.tensor_stats, jit)(jnp.asarray(x))
  assert counts(stats) == dict(
      zeros=2, nonfinite=3,
      f16_underflow=4,    # below(2^-24), 2^-133, below(2^-133), 2^-149
      f16_subnormal=6,    # ... and 2^-24, below(2^-14)
      f16_overflow=4,     # above(65504), 65520, BF16_MAX, above(BF16_MAX)
      bf16_underflow=2,   # below(2^-133), 2^-149
      bf16_overflow=1,
  )
  assert int(stats.size) == x.size
  assert float(stats.max_abs) == float(above(BF16_MAX))
  assert int(jnp.sum(stats.histogram)) == x.size - 2 - 3
  hist = dict(zip(diagnostics.TensorStats.HISTOGRAM_EXPONENTS.tolist(),
                  np.asarray(stats.histogram).tolist()))
  assert hist[-24] == 1 and hist[-25] == 1 and hist[-15] == 1
  assert hist[15] == 3 and hist[-149] == 1 and hist[127] == 2
  assert hist[-133] == 1 and hist[-134] == 1


@JIT
def test_float16_inputs_subnormals_and_max(jit):
  x = jnp.array([0.0, 2.0**-24, 3 * 2.0**-24, 2.0**-15, 2.0**-14, 65504.0,
                 -65504.0, jnp.inf, 1.0], F16)
  assert float(x[1]) == 2.0**-24  # a float16 subnormal, kept exactly
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x)
  assert counts(stats) == dict(
      zeros=1, nonfinite=1, f16_underflow=0, f16_subnormal=3,
      f16_overflow=0, bf16_underflow=0, bf16_overflow=0)
  assert stats.max_abs.dtype == F32 and float(stats.max_abs) == 65504.0
  # At a loss scale of 2: the subnormals move up, the max overflows.
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x, 2.0)
  assert counts(stats)["f16_overflow"] == 2
  assert counts(stats)["f16_subnormal"] == 2
  assert float(stats.max_abs) == 65504.0  # max_abs is of the values themselves
  subnormals = maybe_jit(diagnostics.tensor_stats, jit)(x[1:4])
  assert float(subnormals.max_abs) == 2.0**-15   # float16 subnormals, exact


@JIT
def test_bfloat16_inputs_subnormals_and_max(jit):
  x = jnp.array([2.0**-133, 2.0**-130, 2.0**-126, 1.0, BF16_MAX, -BF16_MAX],
                BF16)
  assert float(x[0]) == 2.0**-133  # bfloat16's smallest subnormal
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x)
  assert counts(stats) == dict(
      zeros=0, nonfinite=0, f16_underflow=3, f16_subnormal=3,
      f16_overflow=2, bf16_underflow=0, bf16_overflow=0)
  # Halved, the smallest subnormal underflows bfloat16.
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x, 0.5)
  assert counts(stats)["bf16_underflow"] == 1
  # Doubled, the max overflows it.
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x, 2.0)
  assert counts(stats)["bf16_overflow"] == 2
  assert int(stats.nonfinite) == 0  # overflow of the scaled value is not inf


def test_float64_inputs():
  with jax.enable_x64(True):
    x = jnp.array([5e-324, 1e-300, 2.0**-24, 1e300, -np.inf, 0.0], F64)
    stats = jax.jit(diagnostics.tensor_stats)(x)
    assert counts(stats) == dict(
        zeros=1, nonfinite=1, f16_underflow=2, f16_subnormal=3,
        f16_overflow=1, bf16_underflow=2, bf16_overflow=1)
    assert stats.max_abs.dtype == F64 and float(stats.max_abs) == 1e300
    assert stats.zeros.dtype == np.int32 and stats.histogram.dtype == np.int32
    hist = dict(zip(diagnostics.TensorStats.HISTOGRAM_EXPONENTS.tolist(),
                    np.asarray(stats.histogram).tolist()))
    assert hist[-150] == 2 and hist[-24] == 1 and hist[149] == 1  # clipped ends


@JIT
def test_non_power_of_two_scale_boundaries(jit):
  scale = 2047 / 1024                  # 65504 == 32768 * scale exactly
  x = jnp.array([
      32768.0, above(32768.0),         # exactly 65504 / just over
      1.5 * 2.0**-26,                  # * 1.5 ... with scale 1.5 below
      1.75 * 2.0**-25,
  ], F32)
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x[:2], scale)
  assert int(stats.f16_overflow) == 1
  # The mantissa product carries: 1.5 * 1.5 = 2.25.
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x[2:], 1.5)
  assert int(stats.f16_underflow) == 1  # 0.5625 * 2^-24 < 2^-24; 1.3125 * 2^-24 is not
  assert np.asarray(stats.histogram)[-25 + 150] == 1
  assert np.asarray(stats.histogram)[-24 + 150] == 1


@JIT
def test_max_abs_is_exact_for_subnormals(jit):
  x = jnp.array([2.0**-140, -(2.0**-145), 0.0], F32)
  stats = maybe_jit(diagnostics.tensor_stats, jit)(x)
  assert float(stats.max_abs) == 2.0**-140  # XLA:CPU flushes these in float ops
  assert int(stats.zeros) == 1 and int(stats.bf16_underflow) == 2


def test_histogram_clips_at_both_ends():
  stats = diagnostics.tensor_stats(jnp.array([2.0**-149, 2.0**127], F32), 2.0**-20)
  hist = np.asarray(stats.histogram)
  assert hist[0] == 1 and hist[107 + 150] == 1
  stats = diagnostics.tensor_stats(jnp.array([2.0**127], F32), 2.0**30)
  assert np.asarray(stats.histogram)[-1] == 1 and int(stats.bf16_overflow) == 1


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("scale", default_run_keeps([1.0, 2.0**15, 3.0, 0.7, 2.0**-20, 1e10]))
def test_matches_exact_reference_on_random_arrays(dtype, scale):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(3000) * np.exp2(rng.uniform(-150, 128, 3000))
  x[:10] = 0.0
  x[10:13] = [np.inf, -np.inf, np.nan]
  with np.errstate(over="ignore"):
    x = jnp.asarray(x.astype(np.float32)).astype(dtype)
  stats = jax.jit(diagnostics.tensor_stats)(x, scale)
  max_abs = assert_matches_reference(stats, x, scale)
  assert float(stats.max_abs) == max_abs
  assert int(jnp.sum(stats.histogram)) == (
      x.size - int(stats.zeros) - int(stats.nonfinite))


# ---------------------------------------------------------------------------
# Exact at every threshold and scale: against exact rationals.
# ---------------------------------------------------------------------------

UINT = {F16: np.uint16, BF16: np.uint16, F32: np.uint32, F64: np.uint64}
THRESHOLDS = (Q_F16_SUBNORMAL, Q_F16_NORMAL, Q_F16_MAX, Q_BF16_SUBNORMAL,
              Q_BF16_MAX)
# Loss-scale binades: small and large, up to 2^125 (so that float32
# subnormal inputs reach float16's thresholds).
SCALE_EXPONENTS = (-120, -60, -20, -3, 0, 3, 15, 40, 90, 105, 115, 125)
CASE_SIZE = 256


def random_scale(rng, exponent):
  """A float32 loss scale in ``[2**exponent, 2**(exponent + 1))`` that is not
  a power of two (a random nonzero 23-bit fraction)."""
  fraction = int(rng.integers(1, 2**23))
  value = (1 + fraction / 2**23) * 2.0**exponent
  assert float(np.float32(value)) == value
  return value


def ulps_around(x, dtype, steps=2):
  """The positive finite ``dtype`` numbers up to ``steps`` ulps either side
  of each entry of ``x`` (itself included)."""
  uint = UINT[dtype]
  top = int(np.asarray(ml_dtypes.finfo(dtype).max, dtype).view(uint))
  bits = np.asarray(x, dtype).view(uint).astype(np.int64)
  near = np.concatenate([bits + k for k in range(-steps, steps + 1)])
  return np.clip(near, 1, top).astype(uint).view(dtype)


def threshold_cases(dtype, scale, rng):
  """``CASE_SIZE`` values of ``dtype`` whose products with ``scale`` lie at
  and a few ulps either side of every threshold and of some binade edges
  (2^k, the histogram's ends included), random signs, zeros as padding."""
  finfo = ml_dtypes.finfo(dtype)
  low, high = float(finfo.smallest_subnormal), float(finfo.max)
  edges = [Fraction(2)**int(k) for k in rng.integers(-152, 153, 8)]
  edges += [Fraction(2)**k for k in (-151, -150, -149, 149, 150)]
  targets = [float(t / Fraction(scale)) for t in THRESHOLDS + tuple(edges)]
  targets = np.array([t for t in targets if low <= t <= high])
  with np.errstate(over="ignore", under="ignore"):
    x = ulps_around(targets.astype(dtype), dtype)
  x = np.where(rng.random(x.size) < 0.5, -x, x).astype(dtype)
  assert x.size <= CASE_SIZE
  return np.concatenate([x, np.zeros(CASE_SIZE - x.size, dtype)])


def exactness_cases(dtype, seed=0):
  rng = np.random.default_rng(seed)
  return [(scale, threshold_cases(dtype, scale, rng))
          for scale in (random_scale(rng, e) for e in SCALE_EXPONENTS)]


def test_the_reference_product_rounds_where_float32_does():
  """The regression: |x| * 1.1 is below 2^-24, float32 rounds it to 2^-24."""
  x = np.float32(5.418604e-08)
  scale = np.float32(1.1)
  assert Fraction(float(x)) * Fraction(float(scale)) < Q_F16_SUBNORMAL
  assert x * scale == np.float32(2.0**-24)
  for fn in (diagnostics.tensor_stats, jax.jit(diagnostics.tensor_stats)):
    stats = fn(jnp.array([x]), 1.1)
    assert int(stats.f16_underflow) == 1 and int(stats.f16_subnormal) == 1
    assert int(np.asarray(stats.histogram)[-25 + 150]) == 1


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
@JIT
def test_counts_are_exact_at_every_threshold_and_scale(dtype, jit):
  """Non-power-of-two scales, values at and one or two ulps either side of
  each threshold (subnormal inputs included); a traced scale under jit."""
  fn = jax.jit(diagnostics.tensor_stats) if jit else diagnostics.tensor_stats
  subnormal_inputs = 0
  for scale, x in exactness_cases(dtype):
    stats = fn(jnp.asarray(x), jnp.float32(scale) if jit else scale)
    assert float(stats.loss_scale) == scale
    max_abs = assert_matches_reference(stats, x, scale)
    assert float(stats.max_abs) == max_abs
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    subnormal_inputs += int(np.sum((np.abs(x.astype(F64)) < tiny) & (x != 0)))
  assert subnormal_inputs > 20


def product_float32_rounds_up_to_a_power_of_two(bits):
  """An odd significand ``m`` of ``bits`` bits and a 24-bit one ``s`` whose
  exact product lies just below ``2**K`` but rounds to it in float32."""
  k = bits - 1 + 24
  for m in range(2**(bits - 1) + 1, 2**bits, 2):
    s = 2**k // m
    if m * s < 2**k and float(np.float32(m) * np.float32(s)) == 2.0**k:
      return m, s, k
  raise AssertionError("no such pair")


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
@JIT
def test_counts_are_exact_where_float32_rounds_the_product_up(dtype, jit):
  """|x| * s just below 2^-24 where a float32 product rounds to 2^-24."""
  bits = ml_dtypes.finfo(dtype).nmant + 1
  m, s, k = product_float32_rounds_up_to_a_power_of_two(bits)
  x = np.array([m * 2.0**-(bits - 1)], dtype)      # in [1, 2)
  scale = s * 2.0**(-24 - k + bits - 1)            # x * scale < 2^-24
  assert Fraction(float(x[0])) * Fraction(scale) < Q_F16_SUBNORMAL
  stats = maybe_jit(diagnostics.tensor_stats, jit)(jnp.asarray(x), scale)
  assert int(stats.f16_underflow) == 1
  assert int(np.asarray(stats.histogram)[-25 + 150]) == 1
  assert_matches_reference(stats, x, scale)


def test_counts_are_exact_on_exact_products_at_non_power_of_two_scales():
  """|x| * s lands exactly on float16's and bfloat16's maxima: 65504 = 23 *
  89 * 2^5 and (2 - 2^-7) * 2^127 = 17 * 15 * 2^120. On the maximum is not
  an overflow; one ulp of x more is."""
  for dtype, a in ((F16, -10), (F16, 5), (BF16, 0), (BF16, 60), (F32, -40),
                   (F32, 90)):
    for odd_x, odd_s, total in ((23, 89, 5), (17, 15, 120)):
      x, scale = float(odd_x * 2.0**a), float(odd_s * 2.0**(total - a))
      if not (2.0**-126 <= scale <= 2.0**126
              and x <= float(ml_dtypes.finfo(dtype).max)):
        continue
      values = ulps_around(np.array([x], dtype), dtype, steps=1)
      stats = diagnostics.tensor_stats(jnp.asarray(values), scale)
      assert_matches_reference(stats, values, scale)
      which = "f16_overflow" if total == 5 else "bf16_overflow"
      extra = int(total == 120)  # bfloat16's overflow is float16's too
      assert int(getattr(stats, which)) == 1, (dtype, a, which)
      assert int(stats.f16_overflow) == 1 + 2 * extra, (dtype, a)


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["f16", "bf16", "f32"])
def test_counts_are_exact_on_random_bit_patterns(dtype):
  """Every bit pattern is as likely: all binades, subnormals, inf and NaN."""
  rng = np.random.default_rng(1)
  nbits = 8 * dtype.itemsize
  x = rng.integers(0, 2**nbits, 2000, dtype=np.uint64).astype(UINT[dtype]).view(dtype)
  fn = jax.jit(diagnostics.tensor_stats)
  for exponent in (-100, 0, 60):
    scale = random_scale(rng, exponent)
    assert_matches_reference(fn(jnp.asarray(x), jnp.float32(scale)), x, scale)


def float64_cases():
  cases = exactness_cases(F64)
  rng = np.random.default_rng(2)
  random_bits = rng.integers(0, 2**63, 1000, dtype=np.uint64)
  random_bits |= rng.integers(0, 2, 1000, dtype=np.uint64) << np.uint64(63)
  x = np.concatenate([random_bits.view(F64), np.zeros(CASE_SIZE * 4 - 1000)])
  cases.append((random_scale(rng, 7), x[:CASE_SIZE * 4]))
  return cases


def test_float64_counts_are_exact_with_x64():
  with jax.enable_x64(True):
    fn = jax.jit(diagnostics.tensor_stats)
    for scale, x in float64_cases():
      stats = fn(jnp.asarray(x), jnp.float32(scale))
      assert stats.max_abs.dtype == F64
      assert float(stats.max_abs) == assert_matches_reference(stats, x, scale)
    # NumPy float64 leaves too, eagerly: float64 max_abs with x64.
    stats = diagnostics.tensor_stats(np.array([1e-300, 1e300, 1.0]), 1.1)
    assert stats.max_abs.dtype == F64 and float(stats.max_abs) == 1e300
    assert int(stats.f16_underflow) == 1 and int(stats.bf16_overflow) == 1


def saturated_f32(value):
  """The documented max_abs of a NumPy float64 leaf without x64."""
  f32 = np.finfo(np.float32)
  with np.errstate(over="ignore", under="ignore"):
    rounded = np.float32(value)
  if np.isinf(rounded):
    return float(f32.max)
  if rounded == 0 and value > 0:
    return float(f32.smallest_subnormal)
  return float(rounded)


@pytest.mark.parametrize("jit", default_run_keeps([False, True]), ids=["eager", "jit"])
def test_numpy_float64_counts_are_exact_without_x64(jit):
  assert jnp.asarray(np.float64(1)).dtype == F32   # x64 is off here
  for scale, x in float64_cases():
    if jit:   # a traced scale; the NumPy leaf is a constant
      stats = jax.jit(lambda s, x=x: diagnostics.tensor_stats(x, s))(
          jnp.float32(scale))
    else:
      stats = diagnostics.tensor_stats(x, scale)
    max_abs = assert_matches_reference(stats, x, scale)
    assert stats.max_abs.dtype == F32
    assert float(stats.max_abs) == saturated_f32(max_abs)


@JIT
def test_numpy_float64_leaves_keep_their_range_without_x64(jit):
  x = np.array([1e-300, 1e300, 1.0])
  with np.errstate(over="ignore"):   # what JAX alone does with them
    assert np.asarray(jnp.asarray(x)).tolist() == [0.0, np.inf, 1.0]
  stats = maybe_jit(lambda s: diagnostics.tensor_stats({"w": x}, s)["w"],
                    jit)(jnp.float32(1.0))
  assert counts(stats) == dict(
      zeros=0, nonfinite=0, f16_underflow=1, f16_subnormal=1, f16_overflow=1,
      bf16_underflow=1, bf16_overflow=1)
  hist = np.asarray(stats.histogram)
  assert hist[0] == 1 and hist[150] == 1 and hist[-1] == 1 and hist.sum() == 3
  assert stats.max_abs.dtype == F32
  assert float(stats.max_abs) == float(np.finfo(np.float32).max)   # saturated
  # Passed as an argument to a jitted function, jit itself narrows it first.
  with np.errstate(over="ignore"):
    narrowed = jax.jit(diagnostics.tensor_stats)(x)
  assert int(narrowed.nonfinite) == 1 and int(narrowed.zeros) == 1
  scalar = diagnostics.tensor_stats(np.float64(1e-300), 2.0**15)
  assert int(scalar.bf16_underflow) == 1
  assert float(scalar.max_abs) == float(np.finfo(np.float32).smallest_subnormal)


@pytest.mark.parametrize("values,expected", [
    ([1.1, -0.5], float(np.float32(1.1))),      # rounded to nearest
    ([1e39, 1.0], float(np.finfo(np.float32).max)),
    ([1e-300], float(np.finfo(np.float32).smallest_subnormal)),
    ([0.0, np.inf, np.nan], 0.0),
])
def test_numpy_float64_max_abs_is_float32_saturating(values, expected):
  stats = diagnostics.tensor_stats(np.array(values, np.float64))
  assert stats.max_abs.dtype == F32 and float(stats.max_abs) == expected


def test_empty_and_scalar_leaves():
  stats = diagnostics.tensor_stats({"empty": jnp.zeros((0, 3)), "scalar": jnp.float32(2.0)})
  assert int(stats["empty"].size) == 0 and float(stats["empty"].max_abs) == 0.0
  assert stats["empty"].fraction("zeros") == 0.0
  assert int(stats["scalar"].size) == 1 and float(stats["scalar"].max_abs) == 2.0


def test_dtypes_of_the_statistics_are_fixed():
  for dtype in (F16, BF16, F32):
    stats = diagnostics.tensor_stats(jnp.ones(3, dtype), 2.0**15)
    for field in ("size",) + COUNTS + ("histogram",):
      assert getattr(stats, field).dtype == np.int32, field
    assert stats.max_abs.dtype == F32 and stats.loss_scale.dtype == F32
    assert stats.histogram.shape == (300,)


# ---------------------------------------------------------------------------
# Trees: non-float leaves, empty trees, loss scales, grouping, jit.
# ---------------------------------------------------------------------------


def test_non_float_leaves_are_skipped():
  tree = {"w": jnp.ones(2), "count": jnp.array(3), "flag": jnp.array(True),
          "lr": 0.1, "name": "dense", "none": None, "np": np.ones(2, np.float32)}
  stats = diagnostics.tensor_stats(tree)
  assert isinstance(stats["w"], diagnostics.TensorStats)
  assert isinstance(stats["np"], diagnostics.TensorStats)
  for key in ("count", "flag", "lr", "name", "none"):
    assert stats[key] is None, key
  assert list(diagnostics.group_stats(stats)) == ["np", "w"]


@JIT
def test_empty_tree(jit):
  stats = maybe_jit(diagnostics.tensor_stats, jit)({})
  assert stats == {}
  assert diagnostics.group_stats(stats) == {}
  assert diagnostics.tensor_stats({"a": [1, 2]}) == {"a": [None, None]}
  assert diagnostics.group_stats(diagnostics.tensor_stats({"a": [1, 2]})) == {}
  assert format_table({}) == "(no floating-point leaves)"


def test_a_bare_array_gives_one_stats():
  stats = diagnostics.tensor_stats(jnp.ones(4))
  assert isinstance(stats, diagnostics.TensorStats)
  assert list(diagnostics.group_stats(stats)) == [ROOT_NAME]


def test_loss_scale_objects_and_traced_scales():
  x = {"w": jnp.array([2.0**-30, 1.0, 3.0])}
  by_number = diagnostics.tensor_stats(x, 2.0**15)
  for scale in (jmp_lite.StaticLossScale(2.0**15),
                jmp_lite.DynamicLossScale(2.0**15),
                jnp.float32(2.0**15), jnp.float16(2.0**15), np.float64(2.0**15),
                2**15):
    stats = diagnostics.tensor_stats(x, scale)
    assert counts(stats["w"]) == counts(by_number["w"]), scale
  assert counts(diagnostics.tensor_stats(x, jmp_lite.NoOpLossScale())["w"]) == \
      counts(diagnostics.tensor_stats(x)["w"])
  traced = jax.jit(diagnostics.tensor_stats)(x, jnp.float32(2.0**15))
  assert counts(traced["w"]) == counts(by_number["w"])
  assert int(by_number["w"].f16_overflow) == 1   # 3 * 2^15 > 65504 > 2^15
  assert int(by_number["w"].f16_subnormal) == 1  # 2^-30 * 2^15 = 2^-15


def test_no_recompilation_for_a_new_scale():
  fn = jax.jit(lambda x, scale: diagnostics.tensor_stats(x, scale))
  x = {"w": jnp.ones(3)}
  fn(x, jnp.float32(1.0))
  fn(x, jnp.float32(4.0))
  assert fn._cache_size() == 1


@pytest.mark.parametrize("jit", default_run_keeps([False, True]), ids=["eager", "jit"])
def test_group_stats_by_prefix_suffix_and_function(jit):
  grads = {"params": {"Dense_0": {"kernel": jnp.array([0.0, 1.0, 1e6]),
                                  "bias": jnp.array([0.0])},
                      "Dense_1": {"kernel": jnp.array([2.0, 2.0**-30])}}}

  def grouped(by):
    return maybe_jit(lambda g: diagnostics.group_stats(
        diagnostics.tensor_stats(g), by), jit)(grads)

  per_leaf = grouped(None)
  assert list(per_leaf) == ["params/Dense_0/bias", "params/Dense_0/kernel",
                            "params/Dense_1/kernel"]
  modules = grouped(-1)
  assert list(modules) == ["params/Dense_0", "params/Dense_1"]
  dense0 = modules["params/Dense_0"]
  assert int(dense0.size) == 4 and int(dense0.zeros) == 2
  assert int(dense0.f16_overflow) == 1 and float(dense0.max_abs) == 1e6
  np.testing.assert_array_equal(
      dense0.histogram, per_leaf["params/Dense_0/kernel"].histogram
      + per_leaf["params/Dense_0/bias"].histogram)
  assert list(grouped(1)) == ["params"]
  assert int(grouped(1)["params"].size) == 6
  assert list(grouped(2)) == ["params/Dense_0", "params/Dense_1"]
  assert list(grouped(-5)) == ["params"]   # never drops the first component
  assert list(grouped(lambda p: p.split("/")[-1])) == ["bias", "kernel"]
  # Grouping grouped statistics again works on the path strings.
  assert list(diagnostics.group_stats(modules, by=1)) == ["params"]


def test_group_stats_mixed_float32_float64_leaves():
  with jax.enable_x64(True):
    stats = diagnostics.tensor_stats({"a": jnp.ones(2, F32), "b": jnp.full(2, 3.0, F64)})
    total = diagnostics.group_stats(stats, by=lambda _: "all")["all"]
    assert total.max_abs.dtype == F64 and float(total.max_abs) == 3.0


def test_fraction_under_jit_and_on_host():
  x = jnp.array([0.0, 1.0, 2.0, 2.0**-30])
  stats = diagnostics.tensor_stats(x)
  assert stats.fraction("zeros") == 0.25
  assert stats.fractions()["f16_underflow"] == 0.25
  traced = jax.jit(lambda x: diagnostics.tensor_stats(x).fraction("zeros"))(x)
  assert traced.dtype == F32 and float(traced) == 0.25


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale,problem", [
    (0.0, "positive"), (-1.0, "positive"), (-2**15, "positive"),
    (math.inf, "finite"), (math.nan, "finite")])
def test_non_positive_or_non_finite_scale_is_a_value_error(scale, problem):
  with pytest.raises(ValueError, match=(
      rf"tensor_stats: loss_scale must be {problem}, got "
      + re.escape(str(float(scale))) + r"\..*1\.0 for the values as they are")):
    diagnostics.tensor_stats({"w": jnp.ones(2)}, scale)


@pytest.mark.parametrize("scale", ["2", True, np.bool_(True), 1 + 2j, [2.0], object()],
                         ids=["str", "bool", "np_bool", "complex", "list", "object"])
def test_wrong_scale_type_is_a_type_error(scale):
  with pytest.raises(TypeError, match=(
      r"tensor_stats: loss_scale must be .*got .*"
      r"loss scale object such as jmp_lite\.get_loss_scale\(opt_state\)")):
    diagnostics.tensor_stats({"w": jnp.ones(2)}, scale)


# jmp_lite's one loss-scale range, checks.SCALE_MIN ... checks.SCALE_MAX.
@pytest.mark.parametrize("scale", [
    1e300, 1e-50,
    2.0**127, 3e38, np.float32(3e38),                # float32, above 2**126
    2.0**-127, 1e-40, np.float32(2.0**-149),         # float32 subnormals
    float(np.nextafter(2.0**-126, 0)), float(np.nextafter(2.0**126, np.inf)),
])
def test_scale_outside_the_loss_scale_range_is_a_value_error(scale):
  match = (r"tensor_stats: loss_scale=" + re.escape(f"{float(scale):g}")
           + r" is outside \[2\*\*-126, 2\*\*126\].*powers of two.*"
           r"1\.0 for the values as they are")
  with pytest.raises(ValueError, match=match):
    diagnostics.tensor_stats({"w": jnp.ones(2)}, scale)


def test_the_loss_scale_range_is_the_one_of_checks():
  assert (checks.SCALE_MIN, checks.SCALE_MAX) == (2.0**-126, 2.0**126)
  for scale in (checks.SCALE_MIN, checks.SCALE_MAX):
    stats = diagnostics.tensor_stats(jnp.array([1.0]), scale)
    assert float(stats.loss_scale) == scale
    assert_matches_reference(stats, np.array([1.0], F32), scale)
  # A traced scale cannot be checked; any positive finite float32 is exact.
  tiny = jax.jit(diagnostics.tensor_stats)(jnp.array([2.0**100], F32),
                                           jnp.float32(3 * 2.0**-140))
  assert_matches_reference(tiny, np.array([2.0**100], F32), 3 * 2.0**-140)


def test_non_scalar_scale_is_a_value_error():
  with pytest.raises(ValueError, match=(
      r"tensor_stats: loss_scale must be a scalar, got an array of shape "
      r"\(2,\)")):
    diagnostics.tensor_stats({"w": jnp.ones(2)}, jnp.ones(2))


@pytest.mark.parametrize("by", [0, "params", 1.5, True])
def test_bad_grouping_is_a_type_error(by):
  with pytest.raises(TypeError, match="group_stats: by must be"):
    diagnostics.group_stats(diagnostics.tensor_stats({"w": jnp.ones(2)}), by)


def test_grouping_function_must_return_a_string():
  with pytest.raises(TypeError, match="must return a string"):
    diagnostics.group_stats(diagnostics.tensor_stats({"w": jnp.ones(2)}), len)


def test_group_stats_of_arrays_is_a_type_error_naming_the_fix():
  with pytest.raises(TypeError, match=r"got a float32 array at 'w'.*tensor_stats"):
    diagnostics.group_stats({"w": jnp.ones(2)})


def test_unknown_fraction_field():
  with pytest.raises(ValueError, match="unknown field 'size'"):
    diagnostics.tensor_stats(jnp.ones(2)).fraction("size")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(headroom=0.5), ValueError, "headroom must be a finite number >= 1"),
    (dict(headroom=math.inf), ValueError, "headroom"),
    (dict(headroom="8"), TypeError, "headroom must be a number"),
    (dict(max_underflow=1.5), ValueError, r"max_underflow .* \[0, 1\]"),
    (dict(max_underflow=None), TypeError, "max_underflow must be a number"),
    (dict(keep_f32_underflow=0.0), ValueError, r"keep_f32_underflow .* \(0, 1\]"),
])
def test_bad_advice_settings(kwargs, error, match):
  with pytest.raises(error, match=match):
    diagnostics.advise({"w": jnp.ones(2)}, **kwargs)


def test_host_functions_refuse_traced_statistics():
  def inside(g):
    diagnostics.advise(diagnostics.tensor_stats(g))
    return g

  with pytest.raises(TypeError, match="outside jax.jit"):
    jax.jit(inside)(jnp.ones(2))


def test_mixed_stats_and_arrays_is_a_type_error():
  tree = {"a": diagnostics.tensor_stats(jnp.ones(2)), "b": jnp.ones(2)}
  with pytest.raises(TypeError, match="at 'b'"):
    diagnostics.advise(tree)


# ---------------------------------------------------------------------------
# Advice.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_abs,headroom,exponent", [
    (1.0, 8, 12),                         # 2^12 * 8 = 32768 <= 65504 < 65536
    (1.0, 1, 15),
    (65504 / (8 * 2.0**12), 8, 12),       # exactly on the limit
    (float(above(65504 / (8 * 2.0**12))), 8, 11),
    (2.0**-20, 2, 34),
    (1e5, 8, -4),                         # a scale below 1
])
def test_loss_scale_is_the_largest_power_of_two_with_headroom(max_abs, headroom, exponent):
  grads = {"w": jnp.array([max_abs, max_abs / 4], F32)}
  advice = diagnostics.advise(grads, headroom=headroom)
  assert advice.f16_loss_scale == 2.0**exponent
  assert advice.max_abs == float(np.float32(max_abs))
  assert advice.max_abs * advice.f16_loss_scale * headroom <= 65504
  assert advice.max_abs * advice.f16_loss_scale * 2 * headroom > 65504


def test_advice_float16_when_a_scale_fits_both_ends():
  grads = {"w": jnp.array([2.0**-30, 2.0**-25, 2.0**-10, 0.0])}
  advice = diagnostics.advise(grads)
  assert advice.dtype == "float16" and advice.loss_scale == 2.0**22
  assert advice.f16_underflow == 0.0
  assert advice.unscaled_f16_underflow == 0.5
  assert advice.keep_f32 == ()
  assert "2^22" in advice.reasons[0] and "50.0% would" in advice.reasons[0]


def test_advice_bfloat16_when_the_gradients_span_more_than_float16():
  # 2^-40 ... 2^2: 43 binades; with headroom 8 the scale is 2^10 and the
  # smallest quarter stays below 2^-24.
  grads = {"w": jnp.array([2.0**-40, 2.0**-30, 2.0**-2, 2.0**2])}
  advice = diagnostics.advise(grads)
  assert advice.f16_loss_scale == 2.0**10
  assert advice.f16_underflow == 0.25
  assert advice.dtype == "bfloat16" and advice.loss_scale == 1.0
  assert "bfloat16" in advice.reasons[0] and "span" in advice.reasons[0]
  # A looser limit accepts float16.
  assert diagnostics.advise(grads, max_underflow=0.25).dtype == "float16"


def test_advice_is_the_same_whatever_scale_the_stats_were_measured_at():
  rng = np.random.default_rng(1)
  grads = {"a": jnp.asarray(rng.standard_normal(500) * 1e-6, F32),
           "b": jnp.asarray(rng.standard_normal(50) * 1e-9, F32)}
  ref = diagnostics.advise(diagnostics.tensor_stats(grads))
  for scale in (2.0**10, 2.0**-5):
    # Stats of unscaled gradients measured at another scale.
    other = diagnostics.advise(diagnostics.tensor_stats(grads, scale))
    assert other.f16_loss_scale == ref.f16_loss_scale
    assert other.f16_underflow == ref.f16_underflow
    assert other.unscaled_f16_underflow == ref.unscaled_f16_underflow


def test_advice_keeps_underflowing_gradients_and_overflowing_activations_in_f32():
  grads = {"params": {"big": {"w": jnp.array([1.0, 0.5] * 150)},
                      "tiny": {"w": jnp.array([1e-15, 2e-15])}}}
  acts = {"big": jnp.array([1.0, 7e4]), "fine": jnp.array([3.0, 0.25]),
          "small": jnp.full(4, 1e-9)}
  advice = diagnostics.advise(grads, acts, by=-1)
  assert advice.dtype == "float16" and advice.loss_scale == 2.0**12
  assert advice.keep_f32 == ("params/tiny", "big", "small")
  text = "\n".join(advice.reasons)
  assert "Keep params/tiny in float32: 100.0% of its gradient entries underflow" in text
  assert "Keep big in float32: its activations overflow float16 (1 of 2" in text
  # Per leaf rather than per module.
  assert diagnostics.advise(grads, by=None).keep_f32 == ("params/tiny/w",)


def test_advice_keeps_bfloat16_overflow_in_f32_even_for_bfloat16():
  grads = {"w": jnp.array([2.0**-40, 2.0**-2])}
  acts = {"huge": jnp.array([3.4e38], F32), "ok": jnp.array([1.0])}
  advice = diagnostics.advise(grads, acts)
  assert advice.dtype == "bfloat16" and advice.keep_f32 == ("huge",)


def test_advice_on_empty_zero_and_non_finite_gradients():
  empty = diagnostics.advise({})
  assert empty.dtype is None and empty.loss_scale is None and empty.keep_f32 == ()
  assert "No floating-point gradient leaves" in empty.reasons[0]
  zeros = diagnostics.advise({"w": jnp.zeros(3), "n": jnp.array(1)})
  assert zeros.dtype is None and "zero or non-finite" in zeros.reasons[0]
  nan = diagnostics.advise({"w": jnp.array([1.0, jnp.nan])})
  assert nan.dtype == "float16" and "inf/NaN" in nan.reasons[-1]


def test_advice_str_is_a_table_and_the_reasons():
  advice = diagnostics.advise({"w": jnp.array([1e-7, 1e-3])})
  assert advice.headroom == DEFAULT_HEADROOM == 8.0   # the default
  text = str(advice)
  assert text.startswith("| advice | |\n|---|---|\n| dtype | float16 |")
  assert "| static loss scale | 2^22 |" in text
  assert "\n- float16 with a static loss scale of 2^22" in text


# ---------------------------------------------------------------------------
# Table, plot and report.
# ---------------------------------------------------------------------------


def test_format_table_rows_and_all():
  stats = diagnostics.tensor_stats(
      {"a": jnp.array([0.0, 1.0]), "b": jnp.array([1e-9, 1e5, 2.0, 3.0])}, 1.0)
  table = format_table(stats, title="grad")
  lines = table.splitlines()
  assert lines[0].startswith("| grad | entries | max abs | loss scale | zero % |")
  assert len(lines) == 5
  assert lines[2] == "| a | 2 | 1 | 1 | 50.0 | 0 | 0 | 0 | 0 | 0 | 0 |"
  assert lines[3] == "| b | 4 | 1e+05 | 1 | 0 | 25.0 | 25.0 | 25.0 | 0 | 0 | 0 |"
  assert lines[4].startswith("| all | 6 | 1e+05 |")
  tiny = format_table({"w": jnp.concatenate([jnp.zeros(1), jnp.ones(9999)])})
  assert "| <0.1 |" in tiny
  assert "| 2^15 |" in format_table(diagnostics.tensor_stats(jnp.ones(2), 2.0**15))


def assert_png(path):
  data = open(path, "rb").read()
  assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1_000


def test_report_prints_the_tables_and_advice_and_writes_a_png(tmp_path):
  grads = {"dense": {"w": jnp.asarray(np.random.default_rng(0).standard_normal(256) * 1e-6, F32),
                     "b": jnp.zeros(4)}}
  acts = {"dense_out": jnp.array([1.0, 1e5])}
  out = io.StringIO()
  path = tmp_path / "report.png"
  advice = diagnostics.report(diagnostics.tensor_stats(grads), str(path),
                              activation_stats=acts, title="my model", file=out)
  text = out.getvalue()
  assert text.startswith("my model\n\nGradients:\n\n| leaf |")
  assert "| dense/b | 4 |" in text and "| dense/w | 256 |" in text
  assert "Activations:\n\n| leaf |" in text and "| dense_out | 2 |" in text
  assert str(advice) in text
  assert f"Wrote {path}" in text
  assert advice.keep_f32 == ("dense_out",)
  assert_png(path)


def test_report_without_a_path_writes_nothing(tmp_path):
  out = io.StringIO()
  diagnostics.report({"w": jnp.ones(3)}, file=out)
  assert "Wrote" not in out.getvalue()
  assert list(tmp_path.iterdir()) == []


def test_report_of_an_empty_tree(tmp_path):
  out = io.StringIO()
  advice = diagnostics.report({}, str(tmp_path / "empty.png"), file=out)
  assert advice.dtype is None
  assert "(no floating-point leaves)" in out.getvalue()
  assert_png(tmp_path / "empty.png")


def test_plot_grouped_activations_only_rows(tmp_path):
  stats = diagnostics.tensor_stats({"m": {"a": jnp.ones(3), "b": jnp.full(2, 1e-30)}})
  path = plot_histograms(stats, str(tmp_path / "g.png"), by=1)
  assert path == str(tmp_path / "g.png")
  assert_png(tmp_path / "g.png")


@pytest.mark.parametrize("path", [None, 3, b"x.png", ["x.png"]],
                         ids=["none", "int", "bytes", "list"])
def test_plot_histograms_path_must_be_a_path(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(TypeError, match=(
      r"plot_histograms: path must be a file path \(a str or os\.PathLike "
      r"such as 'grads\.png'\), got " + type(path).__name__ + ": "
      + re.escape(repr(path)))):
    plot_histograms({"w": jnp.ones(2)}, path)
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dpi,error", [
    ("x", TypeError), (None, TypeError), (True, TypeError),
    (0, ValueError), (-72, ValueError), (math.nan, ValueError),
    (math.inf, ValueError),
])
def test_plot_histograms_dpi_must_be_a_positive_number(dpi, error, tmp_path):
  with pytest.raises(error, match=(
      r"plot_histograms: dpi \(dots per inch\) must be a (finite )?number"
      r"( > 0)?, got .*" + re.escape(repr(dpi)))):
    plot_histograms({"w": jnp.ones(2)}, str(tmp_path / "x.png"), dpi=dpi)
  assert list(tmp_path.iterdir()) == []   # checked before drawing


def test_plot_histograms_takes_a_pathlib_path_and_a_float_dpi(tmp_path):
  path = tmp_path / "p.png"
  assert plot_histograms({"w": jnp.ones(2)}, path, dpi=50.5) == path
  assert_png(path)


@pytest.mark.parametrize("file, error", [
    (3, TypeError), (io.BytesIO(), TypeError), ("closed", ValueError),
    ("read_only", io.UnsupportedOperation)],
    ids=["int", "binary", "closed", "read_only"])
def test_report_file_print_cannot_write_to_draws_nothing(file, error,
                                                         tmp_path):
  # print's own error, raised before the figure is drawn.
  if file == "closed":
    file = io.StringIO()
    file.close()
  elif file == "read_only":
    (tmp_path / "in.txt").write_text("")
    file = open(tmp_path / "in.txt")  # pylint: disable=consider-using-with
  with pytest.raises(error):
    diagnostics.report({"w": jnp.ones(2)}, str(tmp_path / "r.png"), file=file)
  assert not (tmp_path / "r.png").exists()   # nothing drawn


@pytest.mark.parametrize("as_str", [True, False], ids=["str", "pathlib"])
def test_report_file_may_be_a_path(as_str, tmp_path):
  """file="out.txt" (an AttributeError before) writes the report there."""
  target = tmp_path / "out.txt"
  target.write_text("old")
  stream = io.StringIO()
  diagnostics.report({"w": jnp.ones(2)}, file=stream)
  with contextlib.redirect_stdout(io.StringIO()) as stdout:
    advice = diagnostics.report({"w": jnp.ones(2)},
                                file=str(target) if as_str else target)
  assert target.read_text(encoding="utf-8") == stream.getvalue()
  assert "| w |" in stream.getvalue() and stdout.getvalue() == ""
  assert advice.dtype


def test_report_file_errors_name_it_and_touch_no_file(tmp_path):
  target = tmp_path / "out.txt"
  target.write_text("old")
  with pytest.raises(TypeError, match=(
      r"report: file must be a writable text stream or a file path, got "
      r"int: 3\. Pass a writable text stream .* or a file path \(a str or "
      r"os\.PathLike such as 'report\.txt'")):
    diagnostics.report({"w": jnp.ones(2)}, file=3)
  with pytest.raises(ValueError):   # a bad setting: the file is not opened
    diagnostics.report({"w": jnp.ones(2)}, file=target, headroom=-1.0)
  assert target.read_text() == "old"


@pytest.mark.parametrize("path", [3, b"r.png"], ids=["int", "bytes"])
def test_report_path_must_be_none_or_a_path(path, tmp_path):
  out = io.StringIO()
  with pytest.raises(TypeError, match=(
      r"report: path must be a file path \(a str or os\.PathLike such as "
      r"'grads\.png'\), got " + type(path).__name__ + ": " + re.escape(repr(path))
      + r"\. Leave path=None .* without a figure")):
    diagnostics.report({"w": jnp.ones(2)}, path, file=out)
  assert out.getvalue() == ""   # checked before printing


@pytest.mark.parametrize("title", [3, b"t", ["a"]], ids=["int", "bytes", "list"])
def test_report_title_must_be_a_str_checked_before_anything_is_written(
    title, tmp_path):
  """It was a bare TypeError after the figure file was written."""
  out, path = io.StringIO(), tmp_path / "grads.png"
  with pytest.raises(TypeError, match=(
      r"report: title must be a str .* got " + type(title).__name__ + ": "
      + re.escape(repr(title)) + r"\. Pass a string")):
    diagnostics.report({"w": jnp.ones(2)}, path, title=title, file=out)
  assert out.getvalue() == "" and not path.exists()


def test_import_stays_light():
  """jmp_lite and jmp_lite.diagnostics import neither matplotlib nor flax."""
  code = (
      "import sys, jmp_lite, jmp_lite.diagnostics\n"
      "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
      "('matplotlib', 'flax'))\n"
      "assert not heavy, heavy\n"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------
# Inside a train step; activations from Flax models.
# ---------------------------------------------------------------------------


def test_every_n_steps_with_lax_cond_in_a_jitted_train_step():
  params = {"w": jnp.full((3, 2), 0.5, F32), "b": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.01), jmp_lite.StaticLossScale(2.0**10))

  def loss_fn(p, x):
    return jnp.sum((x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
                    + p["b"].astype(jnp.float16)).astype(jnp.float32) ** 2)

  @jax.jit
  def train_step(params, state, x, step):
    loss_scale = jmp_lite.get_loss_scale(state)
    _, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(params, x)

    def collect(g):  # the unscaled gradients, measured at this step's scale
      return diagnostics.tensor_stats(loss_scale.unscale(g), loss_scale)

    stats = lax.cond(step % 3 == 0, collect,
                     lambda g: jax.tree.map(jnp.zeros_like, collect(g)), grads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, stats

  state = opt.init(params)
  x = jnp.array([[1.0, 2.0, 3.0]])
  seen = []
  for step in range(4):
    before = params
    params, state, stats = train_step(params, state, x, jnp.int32(step))
    seen.append(stats)
    if step % 3 == 0:
      _, grads = jax.value_and_grad(loss_fn)(before, x)
      direct = diagnostics.tensor_stats(grads, 2.0**10)
      assert float(stats["w"].loss_scale) == 2.0**10
      assert float(stats["w"].max_abs) == float(direct["w"].max_abs)
      assert counts(stats["w"]) == counts(direct["w"])
      assert int(stats["w"].size) == 6 and int(stats["w"].nonfinite) == 0
    else:
      assert int(stats["w"].size) == 0
  assert train_step._cache_size() == 1


class OverflowingMLP(nn.Module):
  """A linen MLP whose second layer's output exceeds float16's range."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, name="hidden")(x))
    x = nn.Dense(8, name="huge", kernel_init=nn.initializers.constant(1e6))(x)
    return nn.Dense(2, name="out", kernel_init=nn.initializers.constant(1e-6))(x)


def test_linen_activations_via_capture_intermediates(tmp_path):
  model = OverflowingMLP()
  x = jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)

  @jax.jit
  def activation_stats(variables, x):
    _, state = model.apply(variables, x, capture_intermediates=True,
                           mutable=["intermediates"])
    return diagnostics.tensor_stats(state["intermediates"])

  stats = activation_stats(variables, x)
  layers = diagnostics.group_stats(stats, by=-2)   # drop "__call__/0"
  # The model's own output ("__call__/0") keeps its first component.
  assert list(layers) == ["__call__", "hidden", "huge", "out"]
  assert int(layers["huge"].f16_overflow) > 0
  assert int(layers["hidden"].f16_overflow) == 0
  grads = {"params": {"hidden": {"kernel": jnp.full((3, 8), 1e-3)}}}
  out = io.StringIO()
  advice = diagnostics.report(grads, str(tmp_path / "linen.png"),
                              activation_stats=stats, by=-2, file=out)
  assert "huge" in advice.keep_f32 and "hidden" not in advice.keep_f32
  assert "| huge |" in out.getvalue()
  assert_png(tmp_path / "linen.png")


class SowingMLP(nnx.Module):
  """An NNX MLP that sows each layer's output as an ``nnx.Intermediate``."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.huge = nnx.Linear(8, 8, kernel_init=nnx.initializers.constant(1e6), rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.hidden(x))
    self.sow(nnx.Intermediate, "hidden_out", h)
    y = self.huge(h)
    self.sow(nnx.Intermediate, "huge_out", y)
    return y


def _nnx_capture(model, x, **kwargs):
  """The model's output and its sown ``nnx.Intermediate`` values: with
  ``nnx.capture`` (Flax >= 0.12.8), else ``nnx.pop`` after the call."""
  if hasattr(nnx, "capture"):
    return nnx.capture(model, nnx.Intermediate, **kwargs)(x)
  if kwargs:
    pytest.skip("method_outputs needs nnx.capture")
  y = model(x)
  return y, nnx.pop(model, nnx.Intermediate)


def test_nnx_activations_via_sow():
  model = SowingMLP(nnx.Rngs(0))

  @nnx.jit
  def activation_stats(model, x):
    _, intermediates = _nnx_capture(model, x)
    return diagnostics.tensor_stats(intermediates)

  stats = activation_stats(model, jnp.ones((4, 3)))
  layers = diagnostics.group_stats(stats, by=-2)   # drop "value/0"
  assert list(layers) == ["hidden_out", "huge_out"]
  assert int(layers["huge_out"].f16_overflow) > 0
  assert int(layers["hidden_out"].f16_overflow) == 0
  advice = diagnostics.advise({"w": jnp.array([1e-3, 1.0])}, stats, by=-2)
  assert advice.keep_f32 == ("huge_out",)


def test_nnx_every_layer_output_via_capture_method_outputs():
  model = SowingMLP(nnx.Rngs(0))
  _, intermediates = _nnx_capture(model, jnp.ones((4, 3)),
                                  method_outputs=nnx.Intermediate)
  layers = diagnostics.group_stats(diagnostics.tensor_stats(intermediates), by=-3)
  assert {"hidden", "huge", "__call__"} <= set(layers)   # each module's __call__
  assert int(layers["huge"].f16_overflow) > 0


# ---------------------------------------------------------------------------
# docs/diagnostics.md: every code block runs; every cost figure is committed.
# ---------------------------------------------------------------------------

DOC = ROOT / "docs" / "diagnostics.md"
RESULTS = ROOT / "benchmarks" / "results" / "diagnostics_overhead.md"


def committed_results():
  """``{(workload, variant): row}`` of the committed results table, each row
  its cells as written."""
  rows = {}
  header = None
  for line in RESULTS.read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[0] == "workload":
      header = cells
    elif header and len(cells) == len(header) and not cells[0].startswith("-"):
      row = dict(zip(header, cells))
      rows[row["workload"].split(":")[0], row["variant"]] = row
  assert len(rows) == 6  # 2 workloads x 3 variants
  return rows


def test_every_cost_figure_of_the_guide_is_in_the_committed_results():
  rows = committed_results()
  text = DOC.read_text()
  cost = text[text.index("**Cost**"):text.index("## Per leaf and per module")]
  variants = {"`tensor_stats` of the gradients every step": "stats",
              "`lax.cond` around the whole step": "cond_step",
              "`lax.cond` around the statistics only": "cond_stats"}
  seen = set()
  for line in cost.splitlines():
    for label, variant in variants.items():
      if line.startswith("| " + label):
        f16, bf16 = [c.strip() for c in line.strip().strip("|").split("|")][-2:]
        assert f16 == rows["mlp-f16", variant]["ratio to plain"], line
        assert bf16 == rows["mlp-bf16", variant]["ratio to plain"], line
        seen.add(variant)
  assert seen == set(variants.values())
  # Every ratio ("1.159x") and time ("25.55 ms") quoted anywhere in the guide.
  ratios = {r["ratio to plain"] for r in rows.values()}
  quoted = re.findall(r"(\d+\.\d+)x\b", text)
  assert quoted and set(quoted) <= ratios, set(quoted) - ratios
  times = {r[k] for r in rows.values() for k in ("plain ms/step", "ms/step")}
  quoted = re.findall(r"(\d+\.\d+) ms\b", text)
  derived = {f"{float(rows[w, 'stats']['ms/step']) - float(rows[w, 'stats']['plain ms/step']):.2f}"
             for w in ("mlp-f16", "mlp-bf16")}
  assert quoted and set(quoted) <= times | derived, set(quoted) - times - derived
  per_entry = {f"{float(d) / 1.863690:.1f}" for d in derived}   # ms / 1e6 entries
  quoted = set(re.findall(r"(\d+\.\d) (?:and (\d+\.\d) )?ns per entry", cost)[0])
  assert quoted == per_entry, (quoted, per_entry)
  entries = json.loads(RESULTS.with_suffix(".json").read_text())["results"]
  assert {r["param_count"] for r in entries} == {1_863_690}
  assert {r["gradient_leaves"] for r in entries} == {6}
  assert "1,863,690" in cost and "6 gradient leaves" in cost
  assert "41 interleaved blocks of 4" in cost
  assert "over 41 blocks of 4 steps" in RESULTS.read_text()
  # No percentage of a step's cost that the results file does not give.
  assert not re.search(r"\d+(-\d+)?% (of|per) (the|a)? ?(MLP )?step", text)


# ---------------------------------------------------------------------------
# The public surface.
# ---------------------------------------------------------------------------


def test_the_public_names_are_the_nine_a_user_calls():
  assert sorted(diagnostics.__all__) == sorted(
      ["tensor_stats", "group_stats", "TensorStats", "advise", "Advice",
       "report", "fp8_stats", "Fp8Stats", "Fp8Advice"])
  public = {n for n in vars(diagnostics) if not n.startswith("_")}
  assert public == set(diagnostics.__all__)


def test_the_guide_uses_public_names_only():
  text = DOC.read_text()
  assert "jmp_lite._src" not in text
  used = set(re.findall(r"diagnostics\.(\w+)", "\n".join(
      re.findall(r"```python\n(.*?)```", text, re.DOTALL))))
  assert used and used <= set(diagnostics.__all__), used - set(diagnostics.__all__)


def test_the_layer_imports_trees_dtypes_checks_and_fp8_only():
  """No loss-scale module (its range comes from checks), no matplotlib at
  module level, no Flax or optax; the float8 quantizers (the layer above)
  for the float8 statistics."""
  import ast  # pylint: disable=g-import-not-at-top
  allowed = {"jmp_lite._src.checks", "jmp_lite._src.tree",
             "jmp_lite._src.compat",  # foundations (explicit sharding)
             "jmp_lite._src.dtypes", "jmp_lite._src.low_precision",
             "jmp_lite._src.diagnostics.stats",
             "jmp_lite._src.diagnostics.report",
             "jmp_lite._src.diagnostics.fp8_stats",
             "jmp_lite._src.diagnostics.fp8_advice"}
  package = ROOT / "jmp_lite" / "_src" / "diagnostics"
  for path in sorted(package.glob("*.py")):
    tree = ast.parse(path.read_text())
    for node in tree.body:   # module level only: the plot imports lazily
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module if node.module != "jmp_lite._src" else
                 f"jmp_lite._src.{a.name}" for a in node.names]
      else:
        continue
      for name in names:
        assert not name.startswith(("matplotlib", "flax", "optax")), (path, name)
        if name.startswith("jmp_lite"):
          assert name in allowed, (path.name, name)


def test_histogram_exponents_are_a_read_only_class_attribute():
  exponents = diagnostics.TensorStats.HISTOGRAM_EXPONENTS
  assert exponents.tolist() == list(range(-150, 150))
  assert "HISTOGRAM_EXPONENTS" not in diagnostics.TensorStats._fields
  stats = diagnostics.tensor_stats(jnp.ones(2))
  assert stats.HISTOGRAM_EXPONENTS is exponents
  assert len(stats.histogram) == len(exponents)
  with pytest.raises(ValueError, match="read-only"):
    exponents[0] = 7


def test_public_names_are_documented_with_examples():
  source = inspect.getsource(inspect.getmodule(diagnostics.TensorStats))
  for name in diagnostics.__all__:
    obj = getattr(diagnostics, name)
    if callable(obj):
      doc = inspect.getdoc(obj) or ""
      assert "Example" in doc and ">>>" in doc, name
      if inspect.isclass(obj):
        for attr, value in vars(obj).items():
          if not attr.startswith("_") and inspect.isfunction(value):
            assert ">>>" in (inspect.getdoc(value) or ""), f"{name}.{attr}"
    else:
      assert re.search(rf"^#:.*\n(#:.*\n)*{name} = ", source, re.MULTILINE), name


def test_stats_are_a_pytree_of_arrays_that_jit_returns():
  stats = jax.jit(diagnostics.tensor_stats)({"w": jnp.ones(3, F16)})
  leaves = jax.tree_util.tree_leaves(stats)
  assert len(leaves) == len(diagnostics.TensorStats._fields)
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
