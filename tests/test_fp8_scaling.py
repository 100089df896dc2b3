"""Scaled float8 quantizers and the delayed-scaling helpers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite._src import low_precision as fp8
from jmp_lite._src.low_precision import scaling

from test_fp8_reference import codes_to_float
from test_fp8_reference import current_scale
from test_fp8_reference import e8m0_code
from test_fp8_reference import FORMATS
from test_fp8_reference import quantize_blocks_ref
from test_fp8_reference import quantize_mx_ref
from test_fp8_reference import round_codes

try:  # JAX's own MX quantizer (behind jax.nn.scaled_dot_general).
  from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_mx_quantize
except ImportError:  # pragma: no cover - JAX moved it
  jax_mx_quantize = None


def _codes(x):
  return np.asarray(x).view(np.uint8)


def _assert_same_codes(got, ref, fmt):
  """float8 codes equal, NaNs (any NaN code) in the same places."""
  got_nan = np.isnan(codes_to_float(got, fmt))
  ref_nan = np.isnan(codes_to_float(ref, fmt))
  np.testing.assert_array_equal(got_nan, ref_nan)
  np.testing.assert_array_equal(np.where(got_nan, 0, got),
                                np.where(ref_nan, 0, ref))


def _outlier_data(shape, seed=0):
  """Normal data whose magnitude spans ~2**14 across rows and columns, with a
  few outliers far above e4m3's range."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.uniform(-7, 7, shape))
  flat = x.reshape(-1)
  flat[rng.choice(flat.size, 3, replace=False)] = [3e4, -7e5, 1e7]
  return x.astype(np.float32)


@functools.partial(jax.jit, static_argnames=(
    "fmt", "granularity", "axis", "block_size", "power_of_two"))
def _quantize(x, fmt="e4m3", granularity="tensor", axis=None, block_size=None,
              power_of_two=True, scale=None):
  q = fp8.quantize(x, fmt, granularity, axis=axis, block_size=block_size,
                   power_of_two=power_of_two, scale=scale)
  return q, fp8.dequantize(q)


def _f32(x):
  return np.asarray(x).astype(np.float32)


# (granularity, axis, block_size, the reference's block shape for (6, 80)).
_CASES = [
    ("tensor", None, None, (6, 80)),
    ("row", None, None, (1, 80)),
    ("row", 0, None, (6, 1)),
    ("tile", None, 32, (1, 32)),     # 80 = 2 full tiles + a partial one
    ("tile", 0, 4, (4, 1)),
    ("block", None, 32, (32, 32)),   # 6 rows: partial blocks along axis 0
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,axis,block_size,block_shape", _CASES)
def test_quantizer_bitwise_against_reference(fmt, granularity, axis,
                                             block_size, block_shape):
  x = _outlier_data((6, 80))
  q, back = _quantize(jnp.asarray(x), fmt, granularity, axis, block_size)
  codes, scale, amax = quantize_blocks_ref(x, fmt, block_shape)
  _assert_same_codes(_codes(q.values), codes, fmt)
  np.testing.assert_array_equal(np.asarray(q.scale).reshape(scale.shape),
                                scale)
  np.testing.assert_array_equal(np.asarray(q.amax).reshape(amax.shape), amax)
  assert q.values.shape == x.shape and q.values.dtype == FORMATS[fmt][0]


def test_quantizer_without_power_of_two_scales():
  x = _outlier_data((6, 80), seed=3)
  q, back = _quantize(jnp.asarray(x), "e4m3", "row", power_of_two=False)
  scale = np.asarray(q.scale)
  # XLA:CPU divides by the constant 448 as a multiplication by its rounded
  # reciprocal: amax / 448 may differ from the exact quotient in the last bit.
  _, ref_scale, _ = quantize_blocks_ref(x, "e4m3", (1, 80), power_of_two=False)
  np.testing.assert_allclose(scale, ref_scale, rtol=2.0**-23, atol=0)
  assert not np.all(np.log2(scale) == np.round(np.log2(scale)))
  # The values are those of the scale the quantizer reports.
  codes, _, _ = quantize_blocks_ref(x, "e4m3", (1, 80), scale=scale)
  _assert_same_codes(_codes(q.values), codes, "e4m3")


def test_row_quantizer_reduces_several_axes():
  x = _outlier_data((4, 3, 10))
  q, back = _quantize(jnp.asarray(x), "e4m3", "row", (0, 2))
  assert q.scale.shape == (1, 3, 1)
  codes, scale, _ = quantize_blocks_ref(x, "e4m3", (4, 1, 10))
  _assert_same_codes(_codes(q.values), codes, "e4m3")
  np.testing.assert_array_equal(np.asarray(q.scale), scale)


# ---------------------------------------------------------------------------
# Round-trip accuracy.
# ---------------------------------------------------------------------------

def _element_scales(q):
  """Each element's scale (float64), expanded from the per-block scales."""
  scale = q.scale
  if scale.dtype == jnp.float8_e8m0fnu:
    scale = fp8.decode_e8m0(scale)
  s = np.asarray(scale, np.float64)
  if s.ndim == 0:
    return np.broadcast_to(s, q.values.shape)
  for axis, b in enumerate(q.block_shape):
    s = np.repeat(s, b, axis=axis)
  return s[tuple(slice(0, n) for n in q.values.shape)]


def _assert_within_half_ulp(x, back, s, f):
  """|back - x| <= u |x| + s * min_subnormal / 2, element by element."""
  err = np.abs(back - x.astype(np.float64))
  bound = f.unit_roundoff * np.abs(x) + 0.5 * f.min_subnormal * s
  bad = ~(err <= bound * (1 + 1e-12))
  assert not np.any(bad), (x[bad][:5], back[bad][:5], s[bad][:5])


_ROUND_TRIP = [("tensor", None, None), ("row", None, None),
               ("tile", None, 32), ("block", None, 32), ("mxfp8", None, None)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,axis,block_size", _ROUND_TRIP)
def test_round_trip_error_bound(fmt, granularity, axis, block_size):
  """Every element within half a float8 ulp of itself after scaling.

  With the block's scale s, x / s lies in [-max, max] (scales round up, so
  nothing saturates). In the normal range the rounding error is at most the
  unit roundoff 2**-(m+1) relative (e4m3: 2**-4, e5m2: 2**-3); below it the
  absolute error is at most half the smallest subnormal, times s.
  """
  f = fp8.get_format(fmt)
  x = _outlier_data((8, 96), seed=5)
  q, back = _quantize(jnp.asarray(x), fmt, granularity, axis, block_size)
  back = np.asarray(back, np.float64)
  s = _element_scales(q)
  _assert_within_half_ulp(x, back, s, f)
  # The largest element of each block is never saturated.
  assert np.all(np.abs(x) / s <= f.max)


def test_finer_granularity_is_more_accurate_with_outliers():
  # One huge row: per-tensor scaling flushes the small rows towards zero,
  # per row keeps them; tiles and MX blocks are finer still.
  rng = np.random.default_rng(7)
  x = rng.standard_normal((16, 128)).astype(np.float32) * 1e-3
  x[3] *= 1e7

  @jax.jit
  def errors(x):
    def err(granularity, block_size=None):
      q = fp8.quantize(x, "e4m3", granularity, block_size=block_size)
      return (jnp.linalg.norm((fp8.dequantize(q) - x)[4:]) /
              jnp.linalg.norm(x[4:]))
    return err("tensor"), err("row"), err("tile", 32), err("mxfp8")

  tensor, row, tile, mx = (float(e) for e in errors(jnp.asarray(x)))
  assert row < 0.05 < tensor
  assert tile <= row * 1.01 and mx <= row * 1.01


# ---------------------------------------------------------------------------
# Edge values.
# ---------------------------------------------------------------------------

_EDGE = np.array([3.4028235e38, -3.0e38, 1e30, -1e20, 500.0, 1e4, 448.0,
                  464.0, 1.0, 1e-30, 1e-45, 0.0, -0.0, 5e-39, 65504.0, 7.0],
                 np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,axis,block_size", _ROUND_TRIP)
def test_no_nan_for_finite_inputs(fmt, granularity, axis, block_size):
  x = np.tile(_EDGE, (2, 4))  # (2, 64)
  x[1] = np.roll(x[1], 5)
  q, back = _quantize(jnp.asarray(x), fmt, granularity, axis, block_size)
  values = _f32(q.values)
  back = np.asarray(back)
  assert not np.any(np.isnan(values)) and not np.any(np.isnan(back))
  assert not np.any(np.isnan(np.asarray(q.amax)))
  # Everything dequantizes finite and within half an ulp, except float32's
  # very top: a value within 2**-5 (e4m3) of 2**128 rounds up to 2**128, inf.
  ok = np.abs(x) < 3.2e38
  assert np.all(np.isfinite(back[ok]))
  _assert_within_half_ulp(x[ok], back[ok].astype(np.float64),
                          _element_scales(q)[ok], fp8.get_format(fmt))


@pytest.mark.parametrize("granularity,axis,block_size", _ROUND_TRIP)
def test_all_zero_input(granularity, axis, block_size):
  x = jnp.zeros((4, 64))
  q, back = _quantize(x, "e4m3", granularity, axis, block_size)
  assert not np.any(np.isnan(_f32(q.values)))
  np.testing.assert_array_equal(np.asarray(back), 0.0)
  np.testing.assert_array_equal(np.asarray(q.amax), 0.0)
  if granularity == "mxfp8":  # the smallest E8M0 value, as JAX's quantizer
    np.testing.assert_array_equal(_codes(q.scale), 0)
  else:
    np.testing.assert_array_equal(np.asarray(q.scale), 1.0)


def test_nan_input_stays_nan_and_poisons_its_group():
  x = np.ones((4, 64), np.float32)
  x[1, 5] = np.nan
  for granularity, nan_rows in (("tensor", [0, 1, 2, 3]), ("row", [1])):
    q, back = _quantize(jnp.asarray(x), "e4m3", granularity)
    assert np.isnan(_f32(q.values)[1, 5])
    back = np.asarray(back)
    nan_row = np.all(np.isnan(back), axis=1)
    assert list(np.flatnonzero(nan_row)) == nan_rows
  q, back = _quantize(jnp.asarray(x), "e4m3", "mxfp8")
  back = np.asarray(back)
  assert np.all(np.isnan(back[1, :32])) and not np.any(np.isnan(back[1, 32:]))
  assert _codes(q.scale)[1, 0] == 255  # E8M0 NaN


def test_infinity_becomes_nan_never_max():
  x = jnp.array([[1.0, np.inf, -2.0, 3.0]])
  for kwargs in ({}, {"scale": jnp.float32(1.0)}):
    q, back = _quantize(x, "e5m2", **kwargs)
    assert np.isnan(_f32(q.values)[0, 1])
    assert np.isnan(np.asarray(back)[0, 1])


# ---------------------------------------------------------------------------
# Delayed scaling: a given scale, the observed amax, the history helpers.
# ---------------------------------------------------------------------------


def test_given_scale_is_used_and_amax_observed():
  x = _outlier_data((4, 16), seed=11)
  for scale in (np.float32(0.25), np.float32(1e-3)):
    q, _ = _quantize(jnp.asarray(x), "e4m3", scale=jnp.asarray(scale))
    codes, _, amax = quantize_blocks_ref(x, "e4m3", x.shape, scale=scale)
    _assert_same_codes(_codes(q.values), codes, "e4m3")
    assert float(q.scale) == scale and float(q.amax) == float(amax.max())
  # A scale far too small saturates (no NaN): delayed scaling's failure mode.
  values = _f32(q.values)
  assert np.max(np.abs(values)) == 448.0 and not np.any(np.isnan(values))


def test_given_per_row_scales():
  x = _outlier_data((4, 16), seed=12)
  scale = jnp.array([[1.0], [2.0], [0.5], [8.0]])
  q, back = _quantize(jnp.asarray(x), "e4m3", "row", scale=scale)
  codes, _, _ = quantize_blocks_ref(x, "e4m3", (1, 16),
                                    scale=np.asarray(scale))
  _assert_same_codes(_codes(q.values), codes, "e4m3")


def test_scale_from_amax_matches_reference():
  # (No subnormal amax: XLA:CPU flushes it to zero, which means scale 1.)
  amax = np.array([0.0, 1e-37, 1e-3, 1.0, 447.0, 448.0, 449.0, 3e38],
                  np.float32)

  @jax.jit
  def scales(amax):
    return {(fmt, pow2): fp8.scale_from_amax(amax, fmt, power_of_two=pow2)
            for fmt in ("e4m3", "e5m2") for pow2 in (True, False)}

  for (fmt, pow2), got in scales(jnp.asarray(amax)).items():
    # Bitwise with power-of-two scales; without, XLA's amax / max may be one
    # float32 ulp off (a multiplication by the rounded reciprocal).
    np.testing.assert_allclose(
        np.asarray(got), current_scale(amax, FORMATS[fmt][1], pow2),
        rtol=0 if pow2 else 2.0**-23, atol=0)
  special = jnp.array([448.0, np.inf, np.nan, 448.0, 448.0])
  got = np.asarray(jax.jit(lambda a: jnp.concatenate([
      fp8.scale_from_amax(a[:3]),
      fp8.scale_from_amax(a[3:4], margin=2),    # TE's scale / 2**margin
      fp8.scale_from_amax(a[4:], margin=1)]))(special))
  assert got[0] == 1.0 and np.isinf(got[1]) and np.isnan(got[2])
  assert got[3] == 4.0 and got[4] == 2.0


@pytest.mark.parametrize("pow2", [True, False])
def test_scales_stay_normal_for_every_finite_amax_and_margin(pow2):
  amax = jnp.array([1e-45, 1e-38, 1.0, 3.4e38], jnp.float32)
  for margin in (0, 64):
    for fmt in ("e4m3", "e5m2"):
      s = np.asarray(jax.jit(lambda a: fp8.scale_from_amax(
          a, fmt, margin=margin, power_of_two=pow2))(amax))
      assert np.all(s >= 2.0**-126) and np.all(s <= 2.0**126), (margin, s)
      h = np.asarray(jax.jit(lambda a: fp8.scale_from_history(
          a, fmt, margin=margin, power_of_two=pow2))(amax[:, None]))
      assert 2.0**-126 <= h.item() <= 2.0**126
  # margin=64 on an amax of 448: 2**64, exact.
  assert float(fp8.scale_from_amax(jnp.float32(448.0), margin=64)) == 2.0**64


@pytest.mark.parametrize("margin", [-1, 65, 200, 1.5, np.inf, None, "1"])
def test_margin_must_be_an_integer_from_0_to_64(margin):
  error = TypeError if margin in (None, "1") else ValueError
  with pytest.raises(error, match="margin"):
    fp8.scale_from_amax(jnp.float32(1.0), margin=margin)
  with pytest.raises(error, match="margin"):
    fp8.scale_from_history(jnp.ones(4), margin=margin)
  assert float(fp8.scale_from_amax(jnp.float32(448.0), margin=2.0)) == 4.0


def test_given_scales_that_are_not_usable():
  x = jnp.asarray(_outlier_data((4, 16), seed=13))
  for bad in (0.0, -1.0, np.nan, np.inf, 1e-40):
    with pytest.raises(ValueError, match="scale must be positive, finite"):
      fp8.quantize(x, "e4m3", scale=np.float32(bad))
    with pytest.raises(ValueError, match="previous_scale must be positive"):
      fp8.scale_from_history(jnp.zeros(3), previous_scale=bad)
  # Traced (or JAX arrays): current scaling (or 1) instead.
  current = fp8.quantize(x, "e4m3", "row")
  bad_rows = jnp.array([[0.0], [np.nan], [np.inf], [-2.0]])
  q = jax.jit(lambda x, s: fp8.quantize(x, "e4m3", "row", scale=s))(
      x, bad_rows)
  np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(current.scale))
  _assert_same_codes(_codes(q.values), _codes(current.values), "e4m3")
  kept = jax.jit(lambda h, p: fp8.scale_from_history(h, previous_scale=p))(
      jnp.zeros(3), jnp.float32(0.0))
  assert float(kept) == 1.0


@pytest.mark.parametrize("call, name", [
    (lambda: fp8.quantize(None), "x"),
    (lambda: fp8.scale_from_amax(None), "amax"),
    (lambda: fp8.scale_from_history(None), "history"),
    (lambda: fp8.update_amax_history(jnp.zeros(3), None), "amax"),
    (lambda: fp8.quantize(jnp.ones(3), scale=None, granularity="tensor",
                          fmt=None), "format"),
    (lambda: fp8.saturating_cast(None), "x"),
    (lambda: fp8.encode_e8m0(None), "scale"),
])
def test_none_arguments_are_named(call, name):
  with pytest.raises(TypeError, match=name):
    call()


def test_update_amax_history():
  update = jax.jit(fp8.update_amax_history)
  h = update(jnp.array([5.0, 4.0, 3.0, 2.0]), jnp.float32(9.0))
  np.testing.assert_array_equal(np.asarray(h), [9.0, 5.0, 4.0, 3.0])
  h = update(h, jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(h), [1.0, 9.0, 5.0, 4.0])
  # Several histories side by side: (N, 2); and a history of length 1.
  h2 = update(jnp.zeros((3, 2)), jnp.array([1.0, 2.0]))
  np.testing.assert_array_equal(np.asarray(h2), [[1, 2], [0, 0], [0, 0]])
  one = update(jnp.array([7.0]), jnp.float32(3.0))
  np.testing.assert_array_equal(np.asarray(one), [3.0])


def test_scale_from_history():
  h = jnp.array([100.0, 800.0, 0.0, 3.0])
  bad = jnp.array([[0.0, np.inf, np.nan], [0.0, 1.0, 1.0]])

  @jax.jit
  def scales(h, bad):
    return dict(
        max=fp8.scale_from_history(h),
        recent=fp8.scale_from_history(h, algorithm="most_recent"),
        e5m2=fp8.scale_from_history(h, "e5m2"),
        margin=fp8.scale_from_history(h, margin=1),
        exact=fp8.scale_from_history(h, power_of_two=False),
        bad_max=fp8.scale_from_history(bad),
        bad_recent=fp8.scale_from_history(bad, algorithm="most_recent",
                                          previous_scale=jnp.float32(0.5)),
        per=fp8.scale_from_history(jnp.array([[448.0, 0.0], [896.0, 0.0]]),
                                   previous_scale=jnp.array([3.0, 3.0])))

  got = {k: np.asarray(v) for k, v in scales(h, bad).items()}
  # max: 800 / 448 = 1.79 -> 2; most recent: 100 / 448 = 0.22 -> 0.25.
  assert got["max"] == 2.0 and got["recent"] == 0.25
  assert got["e5m2"] == 2.0**-6 and got["margin"] == 4.0
  # (XLA may divide by the constant as a multiplication by its reciprocal.)
  np.testing.assert_allclose(got["exact"], 800.0 / 448.0, rtol=2.0**-23)
  # No usable amax (a fresh history, an overflow): keep the previous scale.
  np.testing.assert_array_equal(got["bad_max"], [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(got["bad_recent"], [0.5, 0.5, 0.5])
  np.testing.assert_array_equal(got["per"], [2.0, 3.0])


def test_history_helpers_errors():
  # (Shapes are the callers' own: jnp reports a history that does not fit.)
  with pytest.raises(TypeError, match="int32"):
    fp8.update_amax_history(jnp.zeros((4,), jnp.int32), jnp.float32(1.0))
  with pytest.raises(ValueError, match="'mean'.*'max', 'most_recent'"):
    fp8.scale_from_history(jnp.zeros(4), algorithm="mean")
  with pytest.raises(TypeError, match="margin must be a whole number.*str"):
    fp8.scale_from_history(jnp.zeros(4), margin="1")
  with pytest.raises(ValueError, match="margin=inf is not a whole number"):
    fp8.scale_from_amax(jnp.float32(1.0), margin=float("inf"))


# ---------------------------------------------------------------------------
# MXFP8: bit for bit JAX's quantizer.
# ---------------------------------------------------------------------------


def _mx_data(dtype, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((4, 16, 128)) * np.exp2(
      rng.uniform(-12, 12, (4, 16, 4)).repeat(32, axis=-1))
  x[0, 0, 3] = 6e4 if dtype == jnp.float16 else 1e30
  x[1, 2, 40] = -5e4 if dtype == jnp.float16 else -3e38
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _jax_mx(x, fmt):
  config = jax.nn.get_scaled_dot_general_config("mxfp8")
  config.data_type = FORMATS[fmt][0]
  return jax.jit(lambda x: jax_mx_quantize(x, config))(x)


@pytest.mark.skipif(jax_mx_quantize is None, reason="JAX moved its quantizer")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_bitwise_equal_to_jax_quantizer(dtype, fmt):
  # JAX's quantizer ends in a bare float32 -> float8 cast, which jaxlib
  # 0.10.0's XLA:CPU rounds twice (a value just above a midpoint comes out
  # one code low); jmp_lite rounds on the format's grid itself (checked
  # against the exact reference below), so there the two cannot agree.
  dt, above_midpoint, upper = {"e4m3": (jnp.float8_e4m3fn, 1.0625, 1.125),
                               "e5m2": (jnp.float8_e5m2, 1.125, 1.25)}[fmt]
  probe = jnp.asarray(np.float32(above_midpoint * (1 + 2.0**-20)))
  if float(jax.jit(lambda v: v.astype(dt))(probe).astype(jnp.float32)) != upper:
    pytest.skip(f"this jaxlib ({jax.__version__}) rounds float32 -> {fmt} "
                "twice, and JAX's quantizer with it")
  x = _mx_data(dtype, seed=21)
  jax_values, jax_scales = _jax_mx(x, fmt)
  q, back = _quantize(x, fmt, "mxfp8")
  assert q.scale.dtype == jnp.float8_e8m0fnu and q.scale.shape == (4, 16, 4)
  blocks = np.ones((4, 16, 4), bool)
  if dtype == jnp.float16:
    # JAX divides in float16 by the block's scale cast to float16; a scale
    # below float16's smallest normal (2**-14) is flushed by XLA:CPU and its
    # values saturate. Compare where JAX's scale is a normal float16 (the
    # others are checked against the reference below).
    blocks = np.asarray(jax_scales) >= 2.0**-14
    assert blocks.mean() > 0.3
  elem = blocks.repeat(32, axis=-1)
  _assert_same_codes(_codes(q.values)[elem], _codes(jax_values)[elem], fmt)
  np.testing.assert_array_equal(_codes(q.scale)[blocks],
                                _codes(jax_scales)[blocks])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_bitwise_against_reference(dtype, fmt):
  x = _mx_data(dtype, seed=22)
  q, back = _quantize(x, fmt, "mxfp8")
  xn = np.asarray(x)  # numpy float32 / ml_dtypes bfloat16 / float16
  codes, scales = quantize_mx_ref(xn, fmt)
  blocks = np.ones(scales.shape, bool)
  if dtype == jnp.float16:
    # XLA computes amax / max as amax * (1 / max), which rounds differently
    # from a division where the quotient is a float16 subnormal (below
    # 2**-14): skip those blocks here (the JAX-equality test covers them).
    ratio = np.max(np.abs(xn.reshape(4, 16, 4, 32)), -1) / np.float16(
        FORMATS[fmt][1])
    blocks = ratio >= 2.0**-14
    assert blocks.mean() > 0.3
  elem = blocks.repeat(32, axis=-1)
  _assert_same_codes(_codes(q.values)[elem], codes[elem], fmt)
  np.testing.assert_array_equal(_codes(q.scale)[blocks], scales[blocks])
  np.testing.assert_array_equal(
      np.asarray(q.amax), np.max(np.abs(xn.astype(np.float32)).reshape(
          4, 16, 4, 32), axis=-1))


def test_mx_scales_round_up_never_down():
  # amax / 448 just above a power of two must take the next power: rounding
  # down would push the block's largest element past 448.
  x = np.zeros((3, 32), np.float32)
  x[:, 0] = [448.0 * 1.001, 448.0, 448.0 * 0.999]
  q, back = _quantize(jnp.asarray(x), "e4m3", "mxfp8")
  np.testing.assert_array_equal(_codes(q.scale)[:, 0], [128, 127, 127])
  np.testing.assert_array_equal(
      _f32(q.values)[:, 0], [224.0, 448.0, 448.0])


def test_mx_axis_and_ragged_blocks():
  x = _outlier_data((70, 3), seed=4)
  q, back = _quantize(jnp.asarray(x), "e4m3", "mxfp8", 0)
  assert q.scale.shape == (3, 3) and q.block_shape == (32, 1)
  padded = np.zeros((96, 3), np.float32)
  padded[:70] = x
  codes, scales = quantize_mx_ref(padded.T, "e4m3")
  _assert_same_codes(_codes(q.values), codes.T[:70], "e4m3")
  np.testing.assert_array_equal(_codes(q.scale), scales.T)


def test_mx_tiny_float16_blocks_get_usable_scales():
  # amax / 448 underflows float16 here: JAX's quantizer gives code 0 with
  # values that do not match it; jmp_lite recomputes the scale in float32.
  x = jnp.full((1, 32), 1e-6, jnp.float16)
  q, back = _quantize(x, "e4m3", "mxfp8")
  ratio = np.float32(np.float16(1e-6)) / np.float32(448.0)
  assert _codes(q.scale)[0, 0] == e8m0_code(ratio)
  back = np.asarray(back)
  np.testing.assert_allclose(back, 1e-6, rtol=2.0**-4)


# ---------------------------------------------------------------------------
# Pytree, transformations, errors.
# ---------------------------------------------------------------------------


def test_quantized_is_a_pytree_with_static_block_shape():
  q, back = _quantize(jnp.ones((4, 8)), "e4m3", "row")
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 3
  q2 = jax.tree.unflatten(treedef, leaves)
  assert q2.block_shape == (1, 8)
  vq = jax.eval_shape(jax.vmap(lambda x: fp8.quantize(x, "e4m3")),
                      _outlier_data((3, 8)))
  assert vq.scale.shape == (3,) and vq.values.shape == (3, 8)


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(granularity="columns"), ValueError,
     "'columns'.*'tensor'.*'row'.*'tile'.*'block'.*'mxfp8'"),
    (dict(granularity=3), TypeError, "granularity must be a string"),
    (dict(fmt="e6m1"), ValueError, "'e6m1'.*'e4m3'"),
    (dict(axis=0), ValueError, "'tensor' takes 0 axis"),
    # (NumPy reports axes out of range or repeated.)
    (dict(granularity="row", axis=2), ValueError, "axis 2 is out of bounds"),
    (dict(granularity="row", axis=(0, 0)), ValueError, "repeated axis"),
    (dict(granularity="tile", axis=(0, 1)), ValueError, "takes 1 axis"),
    (dict(granularity="block", axis=1), ValueError, "takes 2 axis"),
    (dict(granularity="tile", block_size=0), ValueError,
     "block_size must be an int >= 1, got 0"),
    (dict(granularity="tile", block_size=2.5), TypeError, "float: 2.5"),
    (dict(granularity="row", block_size=32), ValueError,
     "block_size=32 with granularity 'row'"),
    (dict(granularity="mxfp8", block_size=16), ValueError, "32 elements"),
    (dict(granularity="mxfp8", block_size=32), None, None),
    (dict(granularity="mxfp8", power_of_two=False), ValueError, "E8M0"),
    (dict(granularity="mxfp8", scale=jnp.ones(())), ValueError,
     "no precomputed scale"),
    # (JAX's broadcast_to names the shapes of a scale that does not fit.)
    (dict(scale=jnp.ones((2,))), ValueError, r"arr_shape=\(2,\) shape=\(\)"),
    (dict(granularity="row", scale=jnp.ones((4,))), ValueError,
     r"float32\[4\] and requested type=float32\[4,1\]"),
])
def test_quantize_errors(kwargs, error, pattern):
  kwargs = dict(kwargs)
  args = (jnp.ones((4, 8)), kwargs.pop("fmt", "e4m3"),
          kwargs.pop("granularity", "tensor"))
  if error is None:
    fp8.quantize(*args, **kwargs)
    return
  with pytest.raises(error, match=pattern):
    fp8.quantize(*args, **kwargs)


def test_quantize_rejects_float8_and_integer_inputs():
  with pytest.raises(TypeError, match="already float8.*high-precision"):
    fp8.quantize(jnp.ones(4, jnp.float8_e4m3fn))
  with pytest.raises(TypeError, match="int32"):
    fp8.quantize(jnp.arange(4))
  with pytest.raises(ValueError, match="axis -2 is out of bounds"):
    fp8.quantize(jnp.ones(4), granularity="block")


def test_granularity_has_one_spelling():
  check = scaling.check_granularity
  assert check(" Row ") == "row" and check("MXFP8") == "mxfp8"
  # The spellings accepted before the vocabulary was unified name the one.
  for old, new in (("rowwise", "row"), ("axiswise", "row"),
                   ("Tensorwise", "tensor"), ("per_tensor", "tensor"),
                   ("mx", "mxfp8")):
    with pytest.raises(ValueError, match=f"{old!r} is now spelled {new!r}"):
      check(old)
  with pytest.raises(ValueError, match="'rowwise' is now spelled 'row'"):
    fp8.Fp8Config(granularity="rowwise")
  assert round_codes([1.0], "e4m3")[0] == 0x38
