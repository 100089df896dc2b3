"""The int8 dot_general: bit for bit against an integer reference, rounding,
clipping, non-finite values, stochastic rounding, long contractions, SQNR,
errors and data parallelism."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmp_lite import fp8 as fp8_public
from jmp_lite import int8
from jmp_lite._src.low_precision import int8_matmul
from helpers import default_run_keeps

DENSE = (((1,), (0,)), ((), ()))
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
RECIPES = ["int8", "int8_switchback"]


def _normal(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
      np.float32)


def _spread(shape, seed, spread=3.0):
  """Gaussian values whose magnitudes vary by e**(+-spread) element by
  element: rows and columns with very different amaxes."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, shape))
  return x.astype(np.float32)


def _dyadic(shape, seed, unit):
  """Small multiples of a power of two: every float32 (and bfloat16) sum of
  their products is exact, in any order, so a product left in high
  precision is checked bit for bit too."""
  rng = np.random.default_rng(seed)
  return (rng.integers(-15, 16, shape) * unit).astype(np.float32)


# ---------------------------------------------------------------------------
# The independent reference (NumPy), as int8_matmul's docstring states it:
# float32 scales s = amax * float32(1/127) (1 below the smallest normal
# float32), q = clip(round(v * float32(1/s)), -127, 127) with np.round (half
# to even) and np.clip, int64 accumulation, the float32 rescale
# acc * s_lhs * s_rhs^T in that order.
# ---------------------------------------------------------------------------

INV127 = np.float32(1) / np.float32(127)
TINY = np.float32(2.0**-126)


def ref_quantize(v, per_tensor=False):
  """v (..., C) float32 -> (int64 q, float32 scale) along the last axis."""
  v = np.asarray(v, np.float32)
  axes = tuple(range(v.ndim)) if per_tensor else (v.ndim - 1,)
  with np.errstate(invalid="ignore"):
    amax = np.max(np.abs(v), axis=axes, keepdims=True, initial=np.float32(0))
  scale = (amax.astype(np.float32) * INV127).astype(np.float32)
  with np.errstate(invalid="ignore"):
    scale = np.where(scale < TINY, np.float32(1), scale).astype(np.float32)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    inverse = (np.float32(1) / scale).astype(np.float32)
    q = np.clip(np.round(v * inverse), -127, 127)
  q = np.where(np.isnan(q), 0, q).astype(np.int64)
  return q, scale


def ref_product(qa, sa, qb, sb):
  """(B, P, C) x (B, Q, C): int64 sums, then float32(acc) * sa * sb^T."""
  acc = np.einsum("bpc,bqc->bpq", qa, qb)
  with np.errstate(invalid="ignore", over="ignore"):
    return (acc.astype(np.float32) * sa * np.swapaxes(sb, 1, 2)).astype(
        np.float32)


def ref_high(a, b):
  """(B, P, C) x (B, Q, C) exactly (float64), rounded to float32: equal to
  a float32-accumulating dot where all the sums are exact (the dyadic
  data)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.einsum("bpc,bqc->bpq", a, b).astype(np.float32)


def _canonical(x, batch, contract):
  """x transposed to (batch, free, contract) and flattened to (B, P, C),
  and the permutation and free shape to undo it."""
  free = [d for d in range(x.ndim) if d not in batch and d not in contract]
  perm = list(batch) + free + list(contract)
  t = np.transpose(x, perm)
  b = int(np.prod([x.shape[d] for d in batch]))
  p = int(np.prod([x.shape[d] for d in free]))
  return t.reshape(b, p, -1), perm, t.shape


def _uncanonical(c, perm, tshape):
  return np.transpose(c.reshape(tshape), np.argsort(perm))


def reference(lhs, rhs, g, dn, config):
  """(y, dlhs, drhs) in float32 as int8.dot_general computes them."""
  (lc, rc), (lb, rb) = dn
  a, aperm, ashape = _canonical(np.asarray(lhs, np.float32), lb, lc)
  b, bperm, bshape = _canonical(np.asarray(rhs, np.float32), rb, rc)
  tensor = config.weight_granularity == "tensor"
  bsz, m, n = a.shape[0], a.shape[1], b.shape[1]
  g = np.asarray(g, np.float32).reshape(bsz, m, n)
  if config.quantize_forward:
    y = ref_product(*ref_quantize(a), *ref_quantize(b, tensor))
  else:
    y = ref_high(a, b)
  if config.quantize_input_gradient:
    da = ref_product(*ref_quantize(g),
                     *ref_quantize(np.swapaxes(b, 1, 2), tensor))
  else:
    da = ref_high(g, np.swapaxes(b, 1, 2))
  if config.quantize_weight_gradient:
    db = ref_product(*ref_quantize(np.swapaxes(g, 1, 2)),
                     *ref_quantize(np.swapaxes(a, 1, 2)))
  else:
    db = ref_high(np.swapaxes(g, 1, 2), np.swapaxes(a, 1, 2))
  out_shape = ([lhs.shape[d] for d in lb] +
               [lhs.shape[d] for d in range(lhs.ndim)
                if d not in lb and d not in lc] +
               [rhs.shape[d] for d in range(rhs.ndim)
                if d not in rb and d not in rc])
  return (y.reshape(out_shape), _uncanonical(da, aperm, ashape),
          _uncanonical(db, bperm, bshape))


@functools.lru_cache(maxsize=None)
def _vjp_fn(config, dn, jit=True):
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: int8.dot_general(
        x, w, dn, config=config), x, w)
    return (y,) + vjp(g)
  return jax.jit(run) if jit else run


def _check(x, w, g, dn, config, jit=True):
  got = _vjp_fn(config, dn, jit)(x, w, g)
  want = reference(x, w, g, dn, config)
  for name, a, b, operand in zip(("y", "dlhs", "drhs"), got, want,
                                 (None, x, w)):
    dtype = np.dtype(a.dtype)
    expected = np.promote_types(x.dtype, w.dtype) if operand is None else (
        operand.dtype)
    assert dtype == expected, (name, dtype)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    np.testing.assert_array_equal(np.asarray(a), b.astype(dtype),
                                  err_msg=name)
  return got


# The per-matmul switches: (quantize_forward, quantize_input_gradient,
# quantize_weight_gradient); None keeps the recipe's default.
SWITCHES = [(None, None, None), (False, True, True), (True, False, True),
            (True, True, False), (True, True, True), (False, False, False)]


def _config(recipe, switches=(None, None, None), **kwargs):
  for name, value in zip(("quantize_forward", "quantize_input_gradient",
                          "quantize_weight_gradient"), switches):
    if value is not None:
      kwargs[name] = value
  return int8.Int8Config(recipe, **kwargs)


@pytest.mark.parametrize("jit", default_run_keeps([True, False]), ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", default_run_keeps(["float32", "bfloat16"]))
@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_dense_bit_for_bit_against_integer_reference(recipe, dtype, jit):
  """Gaussian data with row/column amaxes spread over e**6: every quantized
  product equals the integer reference exactly."""
  x = jnp.asarray(_spread((16, 96), 0), dtype)
  w = jnp.asarray(_spread((96, 48), 1), dtype)
  g = jnp.asarray(_spread((16, 48), 2, 1.0), dtype)
  # All three products quantized (SwitchBack's weight gradient too) so that
  # all three are bit for bit on non-dyadic data.
  config = _config(recipe, (True, True, True))
  _check(x, w, g, DENSE, config, jit)


@pytest.mark.parametrize("switches", SWITCHES,
                         ids=lambda s: "".join("d" if v is None else "q"
                                               if v else "h" for v in s))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_switch_bit_for_bit(recipe, dtype, switches):
  """Each product quantized or left in high precision as its switch says;
  dyadic data, so the high-precision products are exact too (and checked
  bit for bit)."""
  x = jnp.asarray(_dyadic((8, 64), 0, 2.0**-3), dtype)
  w = jnp.asarray(_dyadic((64, 32), 1, 2.0**-4), dtype)
  g = jnp.asarray(_dyadic((8, 32), 2, 2.0**-2), dtype)
  config = _config(recipe, switches)
  got = _check(x, w, g, DENSE, config)
  # The switches matter: a quantized product of this data is not the exact
  # one (so the reference would catch a product left in high precision).
  exact = reference(x, w, g, DENSE, _config(recipe, (False, False, False)))
  flags = (config.quantize_forward, config.quantize_input_gradient,
           config.quantize_weight_gradient)
  for flag, a, b in zip(flags, got, exact):
    same = np.array_equal(np.asarray(a, np.float32),
                          b.astype(a.dtype).astype(np.float32))
    assert same != flag


def test_recipe_defaults():
  assert int8.Int8Config().weight_granularity == "channel"
  assert int8.Int8Config().quantize_weight_gradient is True
  sb = int8.Int8Config("int8_switchback")
  assert sb.weight_granularity == "tensor"
  assert sb.quantize_weight_gradient is False
  assert int8.Int8Config(" INT8_SwitchBack ") == sb


_DN_CASES = [
    # batched, two contracting dimensions (in another order on the rhs)
    ((2, 6, 4, 8), (2, 8, 4, 5), (((2, 3), (2, 1)), ((0,), (0,)))),
    # two free dimensions on the lhs, contracting first on the rhs
    ((3, 4, 32), (32, 7), (((2,), (0,)), ((), ()))),
    # the weight as (N, K): contracting its last axis
    ((6, 40), (12, 40), (((1,), (1,)), ((), ()))),
    # two batch dimensions
    ((2, 3, 5, 16), (2, 3, 16, 4), (((3,), (2,)), ((0, 1), (0, 1)))),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", range(len(_DN_CASES)))
def test_general_dimension_numbers_bit_for_bit(case, recipe, dtype):
  lhs_shape, rhs_shape, dn = _DN_CASES[case]
  x = jnp.asarray(_spread(lhs_shape, 10 + case), dtype)
  w = jnp.asarray(_spread(rhs_shape, 20 + case), dtype)
  y_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), x,
                           w).shape
  g = jnp.asarray(_spread(y_shape, 30 + case, 1.0), dtype)
  _check(x, w, g, dn, _config(recipe, (True, True, True)))
  # And the recipe as named (SwitchBack: the weight gradient in high
  # precision, not bit for bit here: float32 sums of non-dyadic data).
  y, dx, dw = _vjp_fn(int8.Int8Config(recipe), dn)(x, w, g)
  ry, rdx, rdw = reference(x, w, g, dn, int8.Int8Config(recipe))
  np.testing.assert_array_equal(np.asarray(y), ry.astype(y.dtype))
  np.testing.assert_array_equal(np.asarray(dx), rdx.astype(dx.dtype))
  np.testing.assert_allclose(np.asarray(dw, np.float32),
                             rdw.astype(dw.dtype).astype(np.float32),
                             rtol=2e-2 if dtype == "bfloat16" else 1e-5,
                             atol=1e-5)


def test_preferred_element_type_and_mixed_operands():
  x = _spread((8, 32), 3)
  w = jnp.asarray(_spread((32, 16), 4), jnp.bfloat16)
  y = int8.dot_general(x, w, DENSE, preferred_element_type=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16
  ry, _, _ = reference(x, w, np.zeros((8, 16), np.float32), DENSE,
                       int8.Int8Config())
  np.testing.assert_array_equal(np.asarray(y), ry.astype(BF16))
  y = int8.dot_general(x, w, DENSE)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), ry)


# ---------------------------------------------------------------------------
# Rounding and clipping at every boundary.
# ---------------------------------------------------------------------------


def test_quantizer_rounds_half_to_even_and_never_gives_minus_128():
  # Row amax 127 -> scale exactly 1: the values are the quotients.
  row = np.array([127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 0.0,
                  -0.0, 126.5, -126.5, 0.49999997, 1.4999999, -127.0],
                 np.float32)
  q, scale = int8_matmul.quantize(jnp.asarray(row[None]))
  assert float(scale[0, 0]) == 1.0
  np.testing.assert_array_equal(
      np.asarray(q[0]),
      [127, 0, 2, 2, 4, 0, -2, -2, -4, 0, 0, 126, -126, 0, 1, -127])
  assert q.dtype == jnp.int8
  # The amax element maps to exactly +-127, whatever the amax: its quotient
  # is within four float32 roundings of 127 (above it by 2**-22 * 127 at
  # most), so that rounding half to even gives 127 with no clip (there is
  # none on that path), never 128 or -128. Rows with amaxes drawn from the
  # whole float32 range of bit patterns, as well as typical ones.
  rng = np.random.default_rng(0)
  # (from 2**-118: a smaller amax gets scale 1 and all zeros, below)
  amaxes = rng.integers(0x04800000, 0x7F7FFFFF, (256, 1), dtype=np.int64)
  adversarial = np.concatenate([
      rng.standard_normal((64, 33)) * np.exp(rng.uniform(-20, 20, (64, 1))),
      rng.uniform(0.1, 3.3, (16, 33)) * 1e38,               # near float max
      rng.standard_normal((8, 33)) * 2e-36,   # scales just above the tiny
      np.c_[np.ones(256), rng.uniform(-1, 1, (256, 32))]
      * amaxes.astype(np.uint32).view(np.float32),
  ]).astype(np.float32)
  adversarial[:, 5] = -np.abs(adversarial).max(axis=1)   # amax negative
  q, scale = int8_matmul.quantize(jnp.asarray(adversarial))
  q = np.asarray(q)
  assert np.all(np.isfinite(np.asarray(scale)))
  assert q.min() >= -127 and q.max() <= 127
  np.testing.assert_array_equal(q[:, 5], -127)
  rq, rs = ref_quantize(adversarial)
  np.testing.assert_array_equal(q, rq)
  np.testing.assert_array_equal(np.asarray(scale), rs)
  # Rows so small that their scale would be subnormal (and its reciprocal
  # could overflow): scale 1, all zeros; never +-inf clipped to +-127.
  tiny = np.array([[1e-38, -3e-39, 1.4e-45, 0.0], [1e-37, 5e-38, 0, 0]],
                  np.float32)
  q, scale = int8_matmul.quantize(jnp.asarray(tiny))
  np.testing.assert_array_equal(np.asarray(scale), 1.0)
  np.testing.assert_array_equal(np.asarray(q), 0)
  # Per tensor: only the amax element reaches the end of the range.
  q, scale = int8_matmul.quantize(jnp.asarray(adversarial[:64]),
                                  per_tensor=True)
  assert scale.shape == (1, 1)
  assert np.count_nonzero(np.abs(np.asarray(q)) == 127) >= 1
  np.testing.assert_array_equal(np.asarray(q),
                                ref_quantize(adversarial[:64], True)[0])


def test_half_integers_through_the_matmul():
  """x rows with amax 127 (scale 1) holding k + 0.5 values, times a 0/1
  weight picking single columns (channel amax 1, quantized to 127): the
  output is the rounded value times 127 * (1/127)."""
  halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -125.5],
                    np.float32)
  x = np.zeros((8, 16), np.float32)
  x[:, 0] = 127.0
  x[:, 1] = halves
  w = np.zeros((16, 2), np.float32)
  w[1, 0] = 1.0      # column 0 picks x[:, 1]
  w[0, 1] = 1.0      # column 1 picks x[:, 0]
  y = np.asarray(jax.jit(lambda a, b: int8.dot_general(a, b, DENSE))(
      x, w))
  s = np.float32(1) / np.float32(127)
  want = (np.array([0, 2, 2, 0, -2, -2, 126, -126], np.float32)
          * np.float32(127) * s).astype(np.float32)
  np.testing.assert_array_equal(y[:, 0], want)
  np.testing.assert_array_equal(y[:, 1], np.float32(127 * 127) * s)


@pytest.mark.parametrize("recipe", RECIPES)
def test_zeros_all_zero_rows_and_operands(recipe):
  config = _config(recipe, (True, True, True))
  x = _spread((8, 32), 5)
  x[2] = 0.0
  w = _spread((32, 16), 6)
  w[:, 3] = 0.0       # an all-zero output channel
  g = _spread((8, 16), 7, 1.0)
  g[4] = 0.0
  y, dx, dw = _check(x, w, g, DENSE, config)
  for v in (y, dx, dw):
    assert np.all(np.isfinite(np.asarray(v)))
  assert np.all(np.asarray(y)[2] == 0) and np.all(np.asarray(dx)[4] == 0)
  if recipe == "int8":
    assert np.all(np.asarray(y)[:, 3] == 0)
  zero = np.zeros_like(x)
  y, dx, dw = _check(zero, w, np.zeros_like(g), DENSE, config)
  assert not np.any(np.asarray(y)) and not np.any(np.asarray(dx))
  assert not np.any(np.asarray(dw))
  # All-zero rows get scale 1, not 0 (which would divide 0 by 0).
  _, scale = int8_matmul.quantize(jnp.zeros((3, 5)))
  np.testing.assert_array_equal(np.asarray(scale), 1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("k", [32, 128])
def test_a_non_finite_value_stays_in_its_row(recipe, bad, k):
  """A NaN or inf in row 3 of x: row 3 of the output is non-finite, every
  other row finite and equal to the reference (SwitchBack's per-tensor
  weight is unaffected: the bad value is in the activation). Rows of 128:
  XLA:CPU's float row maximum skips a NaN there (the quantizer takes NaN as
  inf in its maximum)."""
  x = _spread((64, k), 8)
  x[3, 7] = bad
  w = _spread((k, 16), 9)
  y = np.asarray(jax.jit(lambda a, b: int8.dot_general(
      a, b, DENSE, config=int8.Int8Config(recipe)))(x, w))
  assert not np.any(np.isfinite(y[3]))
  others = np.delete(y, 3, axis=0)
  assert np.all(np.isfinite(others))
  ry, _, _ = reference(x, w, np.zeros((64, 16), np.float32), DENSE,
                       int8.Int8Config(recipe))
  np.testing.assert_array_equal(others, np.delete(ry, 3, axis=0))
  # The same in the input gradient: a bad value in row 5 of g.
  g = _spread((64, 16), 10, 1.0)
  g[5, 2] = bad
  x[3, 7] = 1.0
  _, dx, _ = _vjp_fn(int8.Int8Config(recipe), DENSE)(x, w, g)
  dx = np.asarray(dx)
  assert not np.any(np.isfinite(dx[5]))
  assert np.all(np.isfinite(np.delete(dx, 5, axis=0)))
  _, rdx, _ = reference(x, w, g, DENSE, int8.Int8Config(recipe))
  np.testing.assert_array_equal(np.delete(dx, 5, axis=0),
                                np.delete(rdx, 5, axis=0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_row_gets_an_inf_scale_and_zeros(bad):
  """docs/int8.md's promise: a NaN or inf makes its row's scale inf (NaN
  taken as inf in the maximum), its finite values quantize to 0, and the bad
  element converts as XLA converts a NaN to int8 (0 on CPU); the other rows
  are untouched."""
  x = _spread((4, 1024), 14)
  x[2, 700] = bad
  q, scale = (np.asarray(v) for v in int8_matmul.quantize(jnp.asarray(x)))
  assert np.isposinf(scale[2, 0]) and np.all(np.isfinite(np.delete(scale, 2, 0)))
  np.testing.assert_array_equal(q[2], 0)
  rq, rs = ref_quantize(np.delete(x, 2, 0))
  np.testing.assert_array_equal(np.delete(q, 2, 0), rq)
  np.testing.assert_array_equal(np.delete(scale, 2, 0), rs)


# Op by op under jax_debug_nans/infs: a whole program's run (the slow stage).
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_finite_inputs_create_no_nan_or_inf_op_by_op(recipe,
                                                     debug_nans_and_infs):
  """Op by op (jax.disable_jit, where jax_debug_nans sees every
  intermediate): typical data, an all-zero row, an all-zero operand,
  stochastic rounding."""
  del debug_nans_and_infs
  x = _spread((4, 16), 11)
  x[0] = 0.0
  w, g = _spread((16, 8), 12), _spread((4, 8), 13, 1.0)
  cases = [(_config(recipe, (True, True, True)), x, g),
           (_config(recipe, (True, True, True)), np.zeros_like(x),
            np.zeros_like(g))]
  if recipe == "int8":
    cases.append((int8.Int8Config(stochastic_rounding=True), x, g))
  with jax.disable_jit():
    for config, lhs, cotangent in cases:
      _, vjp = jax.vjp(lambda a, b, c=config: int8.dot_general(
          a, b, DENSE, config=c), lhs, w)
      vjp(cotangent)
  # The flag is live: a NaN made inside raises.
  with pytest.raises(FloatingPointError):
    jnp.log(jnp.float32(-1.0))


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_deterministic_and_in_range():
  """dx = g I: with scale-1 rows of g (amax 127) and the identity weight
  (each channel's 1 quantized to 127, scale 1/127), dx is the quantized
  gradient itself (to a float32 rounding of 127 * (1/127)). Over 4096 equal
  rows the mean of floor(v + u) is v: the standard error of the mean is at
  most 0.5 / sqrt(4096) = 0.0078, the bound below is 5 of them."""
  values = np.array([127.0, 0.3, -0.3, 2.5, -1.7, 0.5, 0.9, -0.1, 126.6,
                     -126.6, 0.0, 50.25, -3.75, 1e-3, 7.5, -127.0],
                    np.float32)
  n = values.size
  rows = 4096
  g = np.tile(values, (rows, 1))
  x = np.ones((rows, n), np.float32)
  w = np.eye(n, dtype=np.float32)
  stochastic = int8.Int8Config(stochastic_rounding=True)
  _, dx, _ = _vjp_fn(stochastic, DENSE)(x, w, g)
  dx = np.asarray(dx)
  assert np.all(np.abs(dx) <= 127.0001)
  mean = dx.mean(axis=0)
  np.testing.assert_allclose(mean, values, atol=5 * 0.5 / np.sqrt(rows))
  # Really stochastic: both neighbours of a non-integer value occur, in
  # proportion; integers stay exact.
  col = np.round(dx[:, 1]).astype(int)
  assert set(col) == {0, 1}
  assert abs(np.mean(col) - 0.3) < 5 * np.sqrt(0.21 / rows)
  assert set(np.round(dx[:, 0]).astype(int)) == {127}
  assert set(np.round(dx[:, 15]).astype(int)) == {-127}
  # Round to nearest instead: every row the same, biased for 0.3.
  _, nearest, _ = _vjp_fn(int8.Int8Config(), DENSE)(x, w, g)
  assert np.all(np.round(np.asarray(nearest)[:, 1]) == 0)
  # Deterministic for equal inputs (jitted and eager), different for
  # different gradients.
  _, again, _ = _vjp_fn(stochastic, DENSE)(x, w, g.copy())
  np.testing.assert_array_equal(np.asarray(again), dx)
  _, eager, _ = _vjp_fn(stochastic, DENSE, False)(x, w, g)
  np.testing.assert_array_equal(np.asarray(eager), dx)
  g2 = g.copy()
  g2[0, 10] = 1.0
  _, other, _ = _vjp_fn(stochastic, DENSE)(x, w, g2)
  assert not np.array_equal(np.asarray(other)[1:], dx[1:])


def test_stochastic_rounding_stays_in_range_at_the_ends():
  """floor(127 + u) can round to 128 in float32 (u close to 1): clipped."""
  v = jnp.asarray(np.full((64, 256), 127.0, np.float32))
  for seed in range(4):
    key = jax.random.key(seed)
    q = np.asarray(int8_matmul.rounded(v, jnp.float32(1.0), key))
    assert q.min() >= -127 and q.max() == 127
    q = np.asarray(int8_matmul.rounded(-v, jnp.float32(1.0), key))
    assert q.min() == -127 and q.max() <= -126
  # The u that would reach 128 without the clip exists in float32.
  assert np.float32(127.0) + np.float32(1 - 2.0**-24) == 128.0


def test_stochastic_weight_gradient_is_bit_for_bit_given_its_bits():
  """The forward pass is unaffected by stochastic rounding (round half to
  even), the backward products differ from round-to-nearest ones."""
  x, w, g = _spread((16, 64), 14), _spread((64, 32), 15), _spread(
      (16, 32), 16, 1.0)
  y, dx, dw = _vjp_fn(int8.Int8Config(stochastic_rounding=True), DENSE)(
      x, w, g)
  ry, rdx, rdw = reference(x, w, g, DENSE, int8.Int8Config())
  np.testing.assert_array_equal(np.asarray(y), ry)
  assert not np.array_equal(np.asarray(dx), rdx)
  assert not np.array_equal(np.asarray(dw), rdw)
  # Each is still close: within one quantization step per element.
  assert np.max(np.abs(np.asarray(dx) - rdx)) < 0.05 * np.max(np.abs(rdx))


# ---------------------------------------------------------------------------
# Long contractions: chunks whose int32 sums are exact, summed in float32.
# ---------------------------------------------------------------------------


def _chunked_reference(x, w, chunk):
  """Forward y = x w as documented for a chunked contraction: per chunk the
  int64 sum (exact, as int32's), rescaled in float32, the chunks summed in
  float32 in order."""
  qa, sa = ref_quantize(x[None])
  qb, sb = ref_quantize(w.T[None])
  total = None
  for start in range(0, x.shape[1], chunk):
    part = ref_product(qa[..., start:start + chunk], sa,
                       qb[..., start:start + chunk], sb)
    total = part if total is None else (total + part).astype(np.float32)
  return total[0]


@pytest.mark.parametrize("k,chunk", default_run_keeps([(80, 48), (96, 32)], unpack=True))
def test_long_contractions_are_chunked(monkeypatch, k, chunk):
  monkeypatch.setattr(int8_matmul, "EXACT_INT32_LENGTH", 64)
  monkeypatch.setattr(int8_matmul, "CHUNK", chunk)
  jax.clear_caches()
  try:
    x, w = _spread((8, k), 17), _spread((k, 12), 18)
    y = np.asarray(jax.jit(lambda a, b: int8.dot_general(a, b, DENSE))(
        x, w))
    want = _chunked_reference(x, w, chunk)
    if k // chunk == 3:
      # Three chunks: float32 addition order is XLA's; within 1 ulp of the
      # sequential sum.
      np.testing.assert_allclose(y, want, rtol=2.0**-22, atol=0)
    else:
      np.testing.assert_array_equal(y, want)
    # Unchunked, the float32 rescale of the whole int sum: another rounding
    # (so the test tells the two apart).
    whole, _, _ = reference(x, w, np.zeros((8, 12), np.float32), DENSE,
                            int8.Int8Config())
    assert not np.array_equal(y, whole)
    np.testing.assert_allclose(y, whole, rtol=1e-5, atol=1e-5)
    # The gradients chunk too (contracting N = 12 < 64 and M = 8: not
    # chunked; dW and dx match the plain reference).
    g = _spread((8, 12), 19, 1.0)
    _, dx, dw = _vjp_fn(int8.Int8Config(), DENSE)(x, w, g)
    _, rdx, rdw = reference(x, w, g, DENSE, int8.Int8Config())
    np.testing.assert_array_equal(np.asarray(dx), rdx)
    np.testing.assert_array_equal(np.asarray(dw), rdw)
  finally:
    jax.clear_caches()


def test_a_contraction_that_would_overflow_int32(monkeypatch):
  """140,000 products of 127 * 127 sum to 2.26e9 > 2**31 - 1: chunked, the
  result is right; as one int32 sum it would wrap around."""
  k = 140_000
  assert k > int8_matmul.EXACT_INT32_LENGTH
  x, w = np.ones((1, k), np.float32), np.ones((k, 1), np.float32)
  jax.clear_caches()
  try:
    y = float(jax.jit(lambda a, b: int8.dot_general(a, b, DENSE))(x, w)[
        0, 0])
    np.testing.assert_allclose(y, k, rtol=1e-6)
    monkeypatch.setattr(int8_matmul, "EXACT_INT32_LENGTH", 2 * k)
    jax.clear_caches()
    wrong = float(jax.jit(lambda a, b: int8.dot_general(a, b, DENSE))(
        x, w)[0, 0])
    assert wrong < 0    # wrapped
  finally:
    jax.clear_caches()


# ---------------------------------------------------------------------------
# SQNR against the float32 product.
# ---------------------------------------------------------------------------


def _sqnr(ref, got):
  ref = np.asarray(ref, np.float64)
  err = np.asarray(got, np.float64) - ref
  return 10 * np.log10(np.sum(ref**2) / np.sum(err**2))


# Measured (jax 0.10.2, CPU) with
#   python -m pytest -q -n 0 tests/test_int8_matmul.py -k sqnr -s
# on Gaussian x [256, 512], w [512, 256], g [256, 256]:
#   int8             y 39.55  dx 40.15  dw 40.10
#   int8_switchback  y 38.00  dx 38.19  dw 130.86 (float32 weight gradient)
#   fp8_rowwise      y 28.46  dx 24.55  dw 24.58  (e4m3, e5m2 gradients)
_SQNR_BARS = {  # (y, dx, dw) in dB, a little below the measurements
    "int8": (38.5, 39.0, 39.0),
    "int8_switchback": (37.0, 37.0, 120.0),
    "fp8_rowwise": (27.0, 23.0, 23.0),
}


def test_sqnr_against_float32():
  x, w, g = (_normal((256, 512), 20), _normal((512, 256), 21, 512**-0.5),
             _normal((256, 256), 22))
  exact = (x.astype(np.float64) @ w, g.astype(np.float64) @ w.T,
           x.T.astype(np.float64) @ g)

  def measure(dot):
    def run(x, w, g):
      y, vjp = jax.vjp(lambda a, b: dot(a, b, DENSE), x, w)
      return (y,) + vjp(g)
    return [_sqnr(e, v) for e, v in zip(exact, jax.jit(run)(x, w, g))]

  got = {r: measure(functools.partial(int8.dot_general,
                                      config=int8.Int8Config(r)))
         for r in RECIPES}
  got["fp8_rowwise"] = measure(functools.partial(
      fp8_public.dot_general,
      config=fp8_public.Fp8Config(granularity="row")))
  print({k: [round(v, 2) for v in vs] for k, vs in got.items()})
  for name, bars in _SQNR_BARS.items():
    for what, value, bar in zip(("y", "dx", "dw"), got[name], bars):
      assert value >= bar, (name, what, value, bar)
  # int8 row-wise beats e4m3 row-wise on Gaussian data (forward: both
  # quantize the same rows and channels, with 8 bits vs 3 mantissa bits).
  for i in range(3):
    assert got["int8"][i] > got["fp8_rowwise"][i] + 8
  # SwitchBack's tensor-wise weight costs a little on the forward product.
  assert got["int8_switchback"][0] <= got["int8"][0]


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_a_config_that_is_not_an_int8_config():
  x, w = np.ones((4, 16), np.float32), np.ones((16, 8), np.float32)
  with pytest.raises(TypeError, match="Int8Config.*Fp8Config"):
    int8.dot_general(x, w, DENSE, config=fp8_public.Fp8Config())
  with pytest.raises(TypeError, match="Int8Config.*str"):
    int8.dot_general(x, w, DENSE, config="int8")


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_])
def test_integer_operands_are_refused(dtype):
  x = np.ones((4, 16), dtype)
  w = np.ones((16, 8), np.float32)
  with pytest.raises((TypeError, ValueError), match="jmp_lite.int8.dot_general's lhs"):
    int8.dot_general(x, w, DENSE)
  with pytest.raises((TypeError, ValueError), match="jmp_lite.int8.dot_general's rhs"):
    int8.dot_general(w.T, x.T, DENSE)


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"recipe": "int4"}, ValueError, r"unknown recipe 'int4'.*int8"),
    ({"recipe": 8}, TypeError, r"recipe must be a string"),
    ({"weight_granularity": "row"}, ValueError,
     r"unknown weight_granularity 'row'"),
    ({"weight_granularity": 1}, TypeError, r"weight_granularity"),
    ({"quantize_forward": 1}, TypeError,
     r"quantize_forward must be True or False"),
    ({"quantize_weight_gradient": "yes"}, TypeError,
     r"quantize_weight_gradient must be True or False"),
    ({"stochastic_rounding": None}, TypeError,
     r"stochastic_rounding must be True or False"),
    ({"dim_multiple": 0}, ValueError, r"dim_multiple"),
])
def test_config_errors_teach(kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    int8.Int8Config(**kwargs)


def test_second_derivative_is_refused():
  x, w = _spread((4, 16), 23), _spread((16, 8), 24)

  def loss(w):
    return jnp.sum(jnp.tanh(int8.dot_general(x, w, DENSE)))

  jax.grad(loss)(w)   # first order is fine
  for f in (jax.grad(lambda w: jnp.sum(jax.grad(loss)(w))),
            jax.jit(jax.hessian(loss))):
    with pytest.raises(ValueError) as info:
      f(w)
    assert int8_matmul.SECOND_ORDER_HELP in str(info.value)


def test_unbound_axis_name_teaches():
  config = int8.Int8Config("int8_switchback", axis_name="data")
  x, w = np.ones((4, 16), np.float32), np.ones((16, 8), np.float32)
  with pytest.raises(ValueError, match=r"Int8Config\(axis_name='data'\).*jax.shard_map"
                     r".*jax.jit with sharded arrays"):
    int8.dot_general(x, w, DENSE, config=config)
  with pytest.raises(TypeError, match="axis_name"):
    int8.Int8Config(axis_name=0)


# ---------------------------------------------------------------------------
# Data parallel.
# ---------------------------------------------------------------------------


def _mesh(n):
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def test_shard_map_shares_the_tensor_wise_weight_amax():
  """Column (tensor) parallel on 4 devices: each replica holds 8 of the 32
  output channels of w; the outlier sits in replica 2's slice. With
  axis_name, SwitchBack's tensor-wise weight scale is the global one and
  every replica's slice of the output equals the unsharded run's bit for
  bit; without, only replica 2's does."""
  spec = jax.sharding.PartitionSpec
  x = _spread((8, 64), 25, 1.0)
  w = _spread((64, 32), 26, 1.0)
  w[5, 19] = 500.0     # column 19: replica 2 (columns 16..23)
  g = _spread((8, 32), 27, 1.0)

  def run(config):
    def body(x, w, g):
      y, vjp = jax.vjp(lambda w: int8.dot_general(x, w, DENSE,
                                                       config=config), w)
      return y, vjp(g)[0]
    return jax.jit(jax.shard_map(
        body, mesh=_mesh(4), in_specs=(spec(), spec(None, "data"),
                                       spec(None, "data")),
        out_specs=(spec(None, "data"), spec(None, "data"))))(x, w, g)

  config = int8.Int8Config("int8_switchback")
  y_ref, dw_ref = _vjp_fn(config, DENSE)(x, w, g)[::2]
  y, dw = run(int8.Int8Config("int8_switchback", axis_name="data"))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  ry, _, _ = reference(x, w, g, DENSE, config)
  np.testing.assert_array_equal(np.asarray(y), ry)
  # The weight gradient (high precision under SwitchBack) contracts the
  # tokens, which every replica holds: equal up to float32 summation order.
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-6,
                             atol=1e-6)
  local, _ = run(config)
  local = np.asarray(local)
  np.testing.assert_array_equal(local[:, 16:24], np.asarray(y_ref)[:, 16:24])
  for cols in (slice(0, 8), slice(8, 16), slice(24, 32)):
    assert not np.array_equal(local[:, cols], np.asarray(y_ref)[:, cols])


def test_a_nan_in_one_replicas_weight_slice_stays_visible():
  """A float lax.pmax across replicas skips a NaN on CPU; the quantizer
  takes NaN as inf, which no maximum skips: the replica holding the NaN
  makes its output non-finite."""
  spec = jax.sharding.PartitionSpec
  x = _spread((8, 64), 31, 1.0)
  w = _spread((64, 32), 32, 1.0)
  w[5, 19] = np.nan     # column 19: replica 2 (columns 16..23)
  config = int8.Int8Config("int8_switchback", axis_name="data")
  y = np.asarray(jax.jit(jax.shard_map(
      lambda x, w: int8.dot_general(x, w, DENSE, config=config),
      mesh=_mesh(4), in_specs=(spec(), spec(None, "data")),
      out_specs=spec(None, "data")))(x, w))
  assert not np.any(np.isfinite(y[:, 16:24]))


def test_shard_map_data_parallel_switchback():
  """Batch sharded over 4 devices, the weight replicated, axis_name set:
  each replica's rows of y and dx are the unsharded run's."""
  spec = jax.sharding.PartitionSpec
  x, w, g = _spread((16, 64), 28), _spread((64, 32), 29), _spread(
      (16, 32), 30, 1.0)
  config = int8.Int8Config("int8_switchback", axis_name="data")

  def body(x, w, g):
    y, vjp = jax.vjp(lambda x, w: int8.dot_general(
        x, w, DENSE, config=config), x, w)
    dx, dw = vjp(g)   # dw: summed over the replicas by shard_map
    return y, dx, dw

  y, dx, dw = jax.jit(jax.shard_map(
      body, mesh=_mesh(4), in_specs=(spec("data"), spec(), spec("data")),
      out_specs=(spec("data"), spec("data"), spec())))(x, w, g)
  ref = reference(x, w, g, DENSE, int8.Int8Config("int8_switchback"))
  np.testing.assert_array_equal(np.asarray(y), ref[0])
  np.testing.assert_array_equal(np.asarray(dx), ref[1])
  np.testing.assert_allclose(np.asarray(dw), ref[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_jit_with_a_batch_sharded_over_8_devices(recipe):
  """Sharded arrays under jax.jit: the same results as unsharded. With every
  product quantized the int32 partial sums of the weight gradient add up
  exactly across devices, so all three are bit for bit."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  spec = jax.sharding.PartitionSpec
  x, w, g = _spread((32, 64), 31), _spread((64, 16), 32), _spread(
      (32, 16), 33, 1.0)
  config = _config(recipe, (True, True, True))
  rows = jax.sharding.NamedSharding(mesh, spec("data"))
  xs, gs = jax.device_put(x, rows), jax.device_put(g, rows)
  ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, spec()))
  sharded = _vjp_fn(config, DENSE)(xs, ws, gs)
  assert len(sharded[0].sharding.device_set) == 8
  plain = _vjp_fn(config, DENSE)(x, w, g)
  ref = reference(x, w, g, DENSE, config)
  for a, b, r in zip(sharded, plain, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), r)
