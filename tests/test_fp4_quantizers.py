"""FP4 quantizers, the random Hadamard transform and stochastic rounding,
bit for bit against the independent NumPy reference (tests/fp4_reference.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4_reference as ref
from jmp_lite._src.low_precision import fp4
from helpers import default_run_keeps


def _bits(x):
  return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _random(shape, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * scale).astype(np.float32)


def _edge_zoo():
  """Arrays of shape (4, 32): rows of the edge cases, per case."""
  base = _random((4, 32), 1)
  zoo = {"zeros": np.zeros((4, 32), np.float32)}
  with_inf = base.copy()
  with_inf[1, 5] = np.inf
  zoo["inf"] = with_inf
  with_nan = base.copy()
  with_nan[2, 17] = np.nan
  zoo["nan"] = with_nan
  neg_inf = base.copy()
  neg_inf[0, 0] = -np.inf
  zoo["-inf"] = neg_inf
  # The block holding the amax gets the largest E4M3 scale, 448.
  at_448 = base.copy()
  at_448[3, 20] = 50.0
  zoo["block at 448"] = at_448
  # Blocks 1e4 below the amax: E4M3 subnormal block scales.
  subnormal = base * 1e-4
  subnormal[0, :16] = base[0, :16] * 10
  zoo["subnormal block scales"] = subnormal.astype(np.float32)
  zoo["1e-3"] = (base * 1e-3).astype(np.float32)
  zoo["1e3"] = (base * 1e3).astype(np.float32)
  zoo["one zero block"] = np.where(np.arange(32) < 16, 0.0, base).astype(
      np.float32)
  zoo["grid midpoints"] = np.tile(
      np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32),
      (4, 4)) * np.where(np.arange(32) % 2, -1, 1).astype(np.float32)
  return zoo


ZOO = _edge_zoo()


def _same(a, b):
  """Bit for bit; any NaN equals any NaN (its sign and payload mean nothing)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
  np.testing.assert_array_equal(_bits(np.where(np.isnan(a), 0, a)),
                                _bits(np.where(np.isnan(b), 0, b)))


# ---------------------------------------------------------------------------
# Element rounding.
# ---------------------------------------------------------------------------


def test_e2m1_grid_and_the_reference_agree_with_ml_dtypes():
  values = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
  assert sorted(set(np.abs(values.astype(np.float32)))) == list(
      ref.E2M1_VALUES)
  x = np.linspace(-6, 6, 4801, dtype=np.float32)  # every multiple of 1/400
  x = np.concatenate([x, np.array([0.25, 0.75, 2.5, 5.0, -5.0, -0.25],
                                  np.float32)])
  _same(ref.e2m1_nearest_even(x),
        x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e2m1_rounding_bit_for_bit():
  x = np.concatenate([np.linspace(-7, 7, 5601, dtype=np.float32),
                      np.nextafter(np.float32([0.25, 0.75, 2.5, 5.0]),
                                   np.float32(9)),
                      np.nextafter(np.float32([0.25, 0.75, 2.5, 5.0]),
                                   np.float32(-9))])
  got = jax.jit(lambda v: fp4.round_e2m1(jnp.clip(v, -6, 6)))(x)
  _same(got, ref.e2m1_nearest_even(x))


def test_e4m3_block_scale_rounding_bit_for_bit():
  x = np.concatenate([np.geomspace(2.0**-12, 448, 3001).astype(np.float32),
                      np.float32([0, 2.0**-10, 3 * 2.0**-11, 464 - 1e-3])])
  x = np.minimum(x, np.float32(448))
  _same(jax.jit(fp4.round_e4m3)(x), ref.e4m3(x))


# ---------------------------------------------------------------------------
# NVFP4.
# ---------------------------------------------------------------------------


def _check_nvfp4(x, two_d):
  q = jax.jit(lambda v: fp4.quantize_nvfp4(v, two_d=two_d))(x)
  values, scales, tensor_scale = ref.nvfp4(x, two_d=two_d)
  assert q.values.dtype == jnp.float4_e2m1fn
  assert q.block_scales.dtype == jnp.float8_e4m3fn
  assert q.tensor_scale.dtype == jnp.float32
  np.testing.assert_array_equal(_bits(q.values),
                                _bits(values.astype(ml_dtypes.float4_e2m1fn)))
  _same(q.block_scales.astype(jnp.float32), scales)
  _same(q.tensor_scale, tensor_scale)
  return q


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_random_tensors_bit_for_bit(two_d):
  for seed, shape in enumerate([(32, 64), (2, 16, 48)]):
    _check_nvfp4(_random(shape, seed, scale=3.0), two_d)


@pytest.mark.parametrize("case", default_run_keeps(sorted(ZOO)))
def test_nvfp4_edge_zoo_bit_for_bit(case):
  x = np.tile(ZOO[case], (4, 1))  # (16, 32): whole 16x16 tiles too
  for two_d in (False, True):
    q = _check_nvfp4(x, two_d)
  out = np.asarray(fp4.dequantize_fp4(q))
  finite = np.isfinite(x).all()
  assert np.isnan(out).all() if not finite else np.isfinite(out).all()
  if case == "zeros":
    assert np.all(out == 0) and float(q.tensor_scale) == 1.0
  if case == "block at 448":
    assert float(jnp.max(q.block_scales.astype(jnp.float32))) == 448.0
  if case == "subnormal block scales":
    scales = np.asarray(q.block_scales.astype(jnp.float32))
    assert ((scales > 0) & (scales < 2.0**-6)).any()
  if case in ("1e-3", "1e3"):
    # Not flushed: the tensor scale follows the amax.
    err = np.linalg.norm(out - x) / np.linalg.norm(x)
    assert err < 0.15, err


def test_nvfp4_nonfinite_values_are_those_of_the_zeroed_tensor():
  x = np.tile(ZOO["inf"], (4, 1))
  zeroed = np.where(np.isfinite(x), x, 0).astype(np.float32)
  a, b = fp4.quantize_nvfp4(x), fp4.quantize_nvfp4(zeroed)
  np.testing.assert_array_equal(_bits(a.values), _bits(b.values))
  np.testing.assert_array_equal(_bits(a.block_scales), _bits(b.block_scales))
  assert np.isnan(float(a.tensor_scale)) and np.isfinite(float(b.tensor_scale))


def test_nvfp4_2d_tiles_quantize_a_matrix_and_its_transpose_alike():
  w = _random((32, 48), 3)
  # Compiled (eager NVFP4 quantization and dequantization:
  # test_nvfp4_nonfinite_values_..., test_nvfp4_edge_zoo_bit_for_bit).
  round_trip = jax.jit(lambda v: fp4.dequantize_fp4(
      fp4.quantize_nvfp4(v, two_d=True)))
  np.testing.assert_array_equal(np.asarray(round_trip(w)),
                                np.asarray(round_trip(w.T)).T)


def test_nvfp4_in_bfloat16_and_float16_inputs():
  x = _random((16, 32), 4)
  for dtype in (jnp.bfloat16, jnp.float16):
    xd = jnp.asarray(x, dtype)
    q = fp4.quantize_nvfp4(xd)
    values, _, _ = ref.nvfp4(np.asarray(xd.astype(jnp.float32)))
    np.testing.assert_array_equal(
        _bits(q.values), _bits(values.astype(ml_dtypes.float4_e2m1fn)))


# ---------------------------------------------------------------------------
# MXFP4.
# ---------------------------------------------------------------------------


def _check_mxfp4(x, rule):
  q = jax.jit(lambda v: fp4.quantize_mxfp4(v, scale_rule=rule))(x)
  values, codes = ref.mxfp4(x, rule)
  assert q.scales.dtype == jnp.float8_e8m0fnu
  np.testing.assert_array_equal(_bits(q.values),
                                _bits(values.astype(ml_dtypes.float4_e2m1fn)))
  np.testing.assert_array_equal(_bits(q.scales), codes)
  return q


@pytest.mark.parametrize("rule", default_run_keeps(fp4.MX_SCALE_RULES))
def test_mxfp4_random_and_edge_zoo_bit_for_bit(rule):
  for seed, shape in enumerate([(8, 64), (2, 4, 96)]):
    _check_mxfp4(_random(shape, seed, scale=5.0), rule)
  for case, x in sorted(ZOO.items()):
    q = _check_mxfp4(x, rule)
    out = np.asarray(fp4.dequantize_fp4(q))
    bad_rows = ~np.isfinite(x).all(-1)
    assert np.isnan(out[bad_rows]).all(), case
    assert np.isfinite(out[~bad_rows]).all(), case
    if case == "zeros":
      assert np.all(out == 0)


def test_mxfp4_scale_rules_differ_as_specified():
  # amax 7 = 1.75 * 4: round_up takes 2**1 (7/2 = 3.5 -> 4), floor 2**0 (7
  # clips to 6); amax 6 = 1.5 * 4 fits 2**0 under both.
  x = np.zeros((2, 32), np.float32)
  x[0, 0], x[1, 0] = 7.0, 6.0
  # Compiled (eager MXFP4: test_stochastic_rounding_keeps_grid_values, and
  # test_fp4_matmul.py's test_finite_inputs_create_no_nan_or_inf_anywhere).
  quantize = jax.jit(fp4.quantize_mxfp4, static_argnames="scale_rule")
  up = quantize(x, scale_rule="round_up")
  floor = quantize(x, scale_rule="floor")
  np.testing.assert_array_equal(_bits(up.scales)[:, 0], [128, 127])
  np.testing.assert_array_equal(_bits(floor.scales)[:, 0], [127, 127])
  dequantize = jax.jit(fp4.dequantize_fp4)
  assert float(dequantize(up)[0, 0]) == 8.0
  assert float(dequantize(floor)[0, 0]) == 6.0


def _tiny_normal(shape, seed, high=1.2e-38):
  """Normal float32 values in [2**-126, high] with random signs (no float32
  subnormal: XLA:CPU flushes those as inputs, NumPy does not)."""
  rng = np.random.default_rng(seed)
  tiny = np.float32(2.0**-126)
  return (np.where(rng.random(shape) < 0.5, -1, 1) *
          rng.uniform(tiny, high, shape)).astype(np.float32)


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_tiny_tensors_bit_for_bit(two_d):
  """Below an amax of 2688 * 2**-126 (3.2e-35) the tensor scale 1 / S_enc
  is a float32 subnormal, and so is a block scale times it for blocks of
  amax below 7e-38: XLA:CPU flushed both to zero (every value saturated,
  then dequantized to 0). Values, block scales and the tensor scale's bits
  equal the reference's (which keeps subnormals, as the GPU does), and so
  does every dequantized value that is a normal float32."""
  quantize = jax.jit(fp4.quantize_nvfp4, static_argnames="two_d")
  dequantize = jax.jit(fp4.dequantize_fp4)
  cases = ((1.3e-38, 1), (1e-37, 100), (1e-36, 1), (2e-37, 100))
  for seed, (high, rows) in enumerate(cases):
    x = _tiny_normal((32, 64), 20 + seed, high)
    x[:2] *= np.float32(rows)   # the other blocks' scale products: subnormal
    x[5, :16] = np.float32(2.0**-126)
    q = quantize(x, two_d=two_d)
    with np.errstate(over="ignore"):   # the reference's 1 / subnormal
      values, scales, tensor_scale = ref.nvfp4(x, two_d=two_d)
    assert 0 < tensor_scale < 2.0**-126
    _same(q.values.astype(jnp.float32), values)
    _same(q.block_scales.astype(jnp.float32), scales)
    _same(q.tensor_scale, tensor_scale)
    want = ref.dequantize_nvfp4(values, scales, tensor_scale)
    normal = np.abs(want) >= 2.0**-126
    # (Below ~1.5e-38 NVFP4 itself dequantizes to subnormals: S_enc is
    # capped at the largest float32.)
    assert normal.sum() > 100 or high < 2e-38, high
    _same(np.asarray(dequantize(q))[normal], want[normal])


@pytest.mark.parametrize("rule", fp4.MX_SCALE_RULES)
def test_mxfp4_smallest_scale_is_not_flushed(rule):
  """Blocks whose amax is near 1e-38 (scale 2**-127 or 2**-126) and the
  smallest normal float32, 2**-126: dequantized exactly wherever the value
  is a normal float32 (code 0's 2**-127 is a float32 subnormal, which
  XLA:CPU flushes to zero in a product)."""
  x = _tiny_normal((4, 64), 11)
  x[0] = np.float32(2.0**-126) * np.where(np.arange(64) % 2, -1, 1)
  x[1, :32] = np.float32(2.0**-126) * (1 + np.arange(32) / 32)
  x[3] = _tiny_normal((64,), 12, high=7e-38)    # scale 2**-126
  q = jax.jit(fp4.quantize_mxfp4, static_argnames="scale_rule")(
      x, scale_rule=rule)
  values, codes = ref.mxfp4(x, rule)
  np.testing.assert_array_equal(_bits(q.scales), codes)
  assert (codes == 0).any() and (codes == 1).any()
  want = ref.dequantize_mxfp4(values, codes)
  got = np.asarray(jax.jit(fp4.dequantize_fp4)(q))
  normal = np.abs(want) >= 2.0**-126
  assert normal.sum() > 100 and np.all(np.abs(want[0]) == 2.0**-126)
  _same(got[normal], want[normal])


def test_mxfp4_round_up_matches_jax_quantizer_where_it_has_one():
  try:
    from jax._src.cudnn import scaled_matmul_stablehlo as jax_mx  # pylint: disable=g-import-not-at-top
    config = jax_mx.BlockScaleConfig(
        mode="mxfp4", block_size=32, data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e8m0fnu, global_scale=None,
        infer_only=False)
  except (ImportError, AttributeError, TypeError):
    pytest.skip("this jax has no MXFP4 quantizer")
  x = _random((1, 8, 128), 7, scale=4.0)
  try:
    values, scales = jax_mx.quantize(jnp.asarray(x), config)
  except ValueError as err:  # jax < 0.11: "Unrecognized mode: mxfp4."
    pytest.skip(f"this jax has no MXFP4 quantizer: {err}")
  q = fp4.quantize_mxfp4(x)
  np.testing.assert_array_equal(_bits(q.scales), _bits(scales))
  np.testing.assert_array_equal(_bits(q.values), _bits(values))


# ---------------------------------------------------------------------------
# The random Hadamard transform.
# ---------------------------------------------------------------------------


def test_rht_signs_are_transformer_engines():
  assert fp4.RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1,
                           -1, -1)


def test_rht_bit_for_bit_and_equal_to_its_matrix():
  x = np.concatenate([_random((6, 48), 8), ZOO["1e3"][:, :16].repeat(3, 1)])
  got = np.asarray(jax.jit(fp4.hadamard_f32)(x))
  _same(got, ref.rht(x))
  blocks = x.reshape(-1, 16).astype(np.float64) @ ref.rht_matrix()
  np.testing.assert_allclose(got.reshape(-1, 16), blocks, rtol=0,
                             atol=1e-6 * np.abs(x).max())
  # Orthogonal: dot products along the transformed axis are kept.
  np.testing.assert_allclose(got @ got.T, x.astype(np.float64) @ x.T,
                             rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------


def test_stochastic_rounding_bit_for_bit_given_the_random_bits():
  key = jax.random.key(3)
  x = _random((16, 64), 9, scale=2.0)
  # Compiled (eager stochastic rounding: test_stochastic_rounding_keeps_...,
  # and test_fp4_matmul.py's test_finite_inputs_create_no_nan_or_inf_...).
  q, qm = jax.jit(lambda x, key: (fp4.quantize_nvfp4(x, key=key),
                                  fp4.quantize_mxfp4(x, key=key)))(x, key)
  random_bytes = np.asarray(jax.random.bits(key, x.shape, jnp.uint8))
  values, scales, ts = ref.nvfp4(x, random_bytes=random_bytes)
  np.testing.assert_array_equal(
      _bits(q.values), _bits(values.astype(ml_dtypes.float4_e2m1fn)))
  _same(q.block_scales.astype(jnp.float32), scales)
  mx_values, codes = ref.mxfp4(x, random_bytes=random_bytes)
  np.testing.assert_array_equal(
      _bits(qm.values), _bits(mx_values.astype(ml_dtypes.float4_e2m1fn)))
  np.testing.assert_array_equal(_bits(qm.scales), codes)


#: Draws per value in the unbiasedness test, and the allowed deviation of
#: their mean in standard deviations (a false alarm has probability < 1e-5
#: per value; 28 values).
SR_DRAWS = 4096
SR_SIGMAS = 5.0


def test_stochastic_rounding_is_unbiased_on_every_grid_interval():
  """For every interval [lo, hi] of E2M1 (both signs), the mean of 4096
  draws of a value inside it lies within 5 sigma of the value (sigma =
  (hi - lo) sqrt(p (1 - p) / 4096)); values whose fraction is not a multiple
  of 1/256 are low by at most (hi - lo) / 256 more (8 random bits)."""
  grid = ref.E2M1_VALUES
  lows, highs = grid[:-1], grid[1:]
  gaps = highs - lows
  fractions = np.array([77 / 256, 0.3])  # on the 8-bit lattice, and not
  values = (lows[:, None] + fractions * gaps[:, None]).ravel()
  values = np.concatenate([values, -values]).astype(np.float32)
  gap = np.concatenate([np.repeat(gaps, 2)] * 2)
  p = np.concatenate([np.tile(fractions, 7)] * 2)
  x = jnp.broadcast_to(jnp.asarray(values)[:, None], (values.size, SR_DRAWS))
  bits = jax.random.bits(jax.random.key(11), x.shape, jnp.uint8)
  draws = np.asarray(jax.jit(fp4.stochastic_round_e2m1)(x, bits),
                     np.float64)
  means = draws.mean(axis=1)
  sigma = gap * np.sqrt(p * (1 - p) / SR_DRAWS)
  truncation = np.where(np.isclose(p * 256, np.round(p * 256)), 0, gap / 256)
  deviation = np.abs(means - values)
  assert np.all(deviation <= SR_SIGMAS * sigma + truncation), (
      deviation / sigma)
  # Each draw is one of the two neighbours.
  lo = np.repeat(lows, 2)
  lo = np.concatenate([lo, -lo])
  hi = np.concatenate([np.repeat(highs, 2), -np.repeat(highs, 2)])
  assert np.all((draws == lo[:, None]) | (draws == hi[:, None]))


def test_stochastic_rounding_keeps_grid_values():
  x = np.tile(np.concatenate([ref.E2M1_VALUES, -ref.E2M1_VALUES]),
              (1, 2)).astype(np.float32)
  q = fp4.quantize_mxfp4(x, key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(fp4.dequantize_fp4(q)), x)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_unknown_scale_rule_is_refused():
  with pytest.raises(ValueError, match="Unknown MXFP4 scale rule 'ceil'"):
    fp4.quantize_mxfp4(jnp.ones((32,)), scale_rule="ceil")


def test_raw_uint32_keys_work_like_typed_keys():
  x = _random((16,), 5)
  # Compiled (eager NVFP4 stochastic rounding: test_fp4_matmul.py's
  # test_finite_inputs_create_no_nan_or_inf_anywhere, its backward pass).
  quantize = jax.jit(lambda x, key: fp4.quantize_nvfp4(x, key=key))
  a = quantize(x, jax.random.PRNGKey(1))
  b = quantize(x, jax.random.key(1))
  np.testing.assert_array_equal(_bits(a.values), _bits(b.values))
