"""int8.ragged_dot: bit for bit a loop over the experts of int8.dot_general,
per-expert isolation, empty experts, non-finite values, SQNR."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import int8
from jmp_lite._src.low_precision import int8_matmul
from helpers import default_run_keeps

DENSE = (((1,), (0,)), ((), ()))
RECIPES = ["int8", "int8_switchback"]
M, K, N = 256, 32, 16


def _spread(shape, seed, spread=2.0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, shape))
  return x.astype(np.float32)


def _config(recipe, **kwargs):
  # Every product quantized (SwitchBack's weight gradient too), so that all
  # three are exact integer products; plus the recipe as named below.
  return int8.Int8Config(recipe, **kwargs)


@functools.lru_cache(maxsize=None)
def _grouped_fn(config):
  def run(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: int8.ragged_dot(
        x, w, sizes, config=config), x, w)
    return (y,) + vjp(dy)
  return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _dense_fn(config):
  def run(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: int8.dot_general(
        x, w, DENSE, config=config), x, w)
    return (y,) + vjp(dy)
  return jax.jit(run)


def _loop(x, w, sizes, dy, config):
  """The per-expert loop of int8.dot_general: (y, dx, dw) as numpy."""
  y, dx = np.zeros((x.shape[0], w.shape[2]), x.dtype), np.zeros_like(x)
  dw = np.zeros_like(w)
  start = 0
  for e, size in enumerate(sizes):
    rows = slice(start, start + size)
    if size:
      ye, dxe, dwe = _dense_fn(config)(x[rows], w[e], dy[rows])
      y[rows], dx[rows], dw[e] = ye, dxe, dwe
    start += size
  return y, dx, dw


def _operands(seed=0, m=M):
  return (_spread((m, K), seed), _spread((5, K, N), seed + 1),
          _spread((m, N), seed + 2, 1.0))


def _assert_same(got, want):
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    a = np.asarray(a)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    np.testing.assert_array_equal(a, b, err_msg=name)


SPLITS = [(44, 0, 84, 3, 125), (256, 0, 0, 0, 0), (0, 0, 256, 0, 0),
          (0, 0, 0, 0, 256), (0, 100, 56, 100, 0), (10, 20, 30, 40, 50)]


@pytest.mark.parametrize("switchback_wgrad", default_run_keeps([True, None]),
                         ids=["all_int8", "as_named"])
@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
@pytest.mark.parametrize("sizes", default_run_keeps(SPLITS), ids=lambda s: "-".join(map(str, s)))
def test_bit_for_bit_the_loop_of_dense_matmuls(sizes, recipe,
                                               switchback_wgrad):
  """Random data; the last split leaves rows past the sum (zeros there).
  As named, SwitchBack's weight gradient is a float32 dot on both sides:
  the same products, so still bit for bit."""
  config = _config(recipe, quantize_weight_gradient=switchback_wgrad)
  x, w, dy = _operands()
  got = _grouped_fn(config)(x, w, jnp.asarray(sizes, jnp.int32), dy)
  want = _loop(x, w, sizes, dy, config)
  if config.quantize_weight_gradient:
    _assert_same(got, want)
  else:
    _assert_same(got[:2], want[:2])
    np.testing.assert_allclose(np.asarray(got[2]), want[2], rtol=1e-5,
                               atol=1e-4)
  if sum(sizes) < M:
    rest = slice(sum(sizes), M)
    assert not np.any(np.asarray(got[0])[rest])
    assert not np.any(np.asarray(got[1])[rest])


@pytest.mark.parametrize("recipe", RECIPES)
def test_bfloat16_operands(recipe):
  config = _config(recipe, quantize_weight_gradient=True)
  x, w, dy = (jnp.asarray(v, jnp.bfloat16) for v in _operands(3))
  sizes = (44, 0, 84, 3, 125)
  got = _grouped_fn(config)(x, w, jnp.asarray(sizes, jnp.int32), dy)
  want = _loop(np.asarray(x), np.asarray(w), sizes, np.asarray(dy), config)
  _assert_same(got, want)


@pytest.mark.parametrize("recipe", RECIPES)
def test_per_expert_isolation(recipe):
  """Multiplying expert 2's tokens by 1000 leaves every other expert's
  outputs, dx rows and dw slices bit for bit unchanged (and changes
  expert 2's)."""
  config = _config(recipe, quantize_weight_gradient=True)
  sizes = (44, 0, 84, 3, 125)
  x, w, dy = _operands(4)
  run = functools.partial(_grouped_fn(config),
                          sizes=jnp.asarray(sizes, jnp.int32))
  base = [np.asarray(v) for v in run(x, w, dy=dy)]
  x2, dy2 = x.copy(), dy.copy()
  x2[44:128] *= 1000.0
  dy2[44:128] *= 1000.0
  moved = [np.asarray(v) for v in run(x2, w, dy=dy2)]
  others = np.r_[0:44, 128:M]
  for a, b in zip(base[:2], moved[:2]):
    np.testing.assert_array_equal(a[others], b[others])
    assert not np.array_equal(a[44:128], b[44:128])
  np.testing.assert_array_equal(np.delete(base[2], 2, 0),
                                np.delete(moved[2], 2, 0))
  assert not np.array_equal(base[2][2], moved[2][2])


def test_empty_expert_gets_zero_weight_gradient_and_no_nan():
  config = _config("int8")
  x, w, dy = _operands(5)
  sizes = (0, 128, 0, 128, 0)
  y, dx, dw = _grouped_fn(config)(x, w, jnp.asarray(sizes, jnp.int32), dy)
  for v in (y, dx, dw):
    assert np.all(np.isfinite(np.asarray(v)))
  for e in (0, 2, 4):
    np.testing.assert_array_equal(np.asarray(dw[e]), 0.0)
    assert not np.signbit(np.asarray(dw[e])).any()


# Op by op under jax_debug_nans/infs: a whole program's run (the slow stage).
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_empty_experts_and_zero_rows_under_debug_nans(recipe,
                                                      debug_nans_and_infs):
  """Op by op (jax.disable_jit): empty experts, an all-zero expert weight and
  rows of zeros create no intermediate NaN or inf."""
  del debug_nans_and_infs
  config = _config(recipe, quantize_weight_gradient=True)
  x, w, dy = _spread((24, 16), 6), _spread((4, 16, 8), 7), _spread(
      (24, 8), 8, 1.0)
  x[3] = 0.0
  dy[5] = 0.0
  w[1] = 0.0
  sizes = jnp.asarray((10, 0, 14, 0), jnp.int32)
  with jax.disable_jit():
    _, vjp = jax.vjp(lambda a, b: int8.ragged_dot(a, b, sizes,
                                                       config=config), x, w)
    _, dw = vjp(dy)
  np.testing.assert_array_equal(np.asarray(dw)[[1, 3]], 0.0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_nan_in_one_expert_weight_stays_in_its_rows(recipe):
  config = _config(recipe, quantize_weight_gradient=True)
  sizes = (44, 0, 84, 3, 125)
  x, w, dy = _operands(9)
  w[2, 5, 7] = np.nan
  y, dx, dw = (np.asarray(v) for v in _grouped_fn(config)(
      x, w, jnp.asarray(sizes, jnp.int32), dy))
  mine = slice(44, 128)
  others = np.r_[0:44, 128:M]
  # Channel scales: only column 7 of expert 2's rows; per tensor: all of
  # them.
  if recipe == "int8":
    assert np.all(np.isnan(y[mine, 7]))
    assert np.all(np.isfinite(np.delete(y[mine], 7, axis=1)))
  else:
    assert np.all(np.isnan(y[mine]))
  assert not np.any(np.isfinite(dx[mine]).all(axis=1))
  assert np.all(np.isfinite(y[others])) and np.all(np.isfinite(dx[others]))
  assert np.all(np.isfinite(dw))  # dw = x^T dy does not read w
  want = _loop(x, w, sizes, dy, config)
  np.testing.assert_array_equal(y[others], want[0][others])
  np.testing.assert_array_equal(dx[others], want[1][others])
  np.testing.assert_array_equal(dw, want[2])


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_nan_in_one_experts_token_stays_in_its_expert(recipe):
  """A NaN in a token of expert 2 (over 84 rows: XLA:CPU's scatter-max
  skips it there): that token's output row and expert 2's weight gradient
  are non-finite, every other expert's bit for bit the loop's."""
  config = _config(recipe, quantize_weight_gradient=True)
  sizes = (44, 0, 84, 3, 125)
  x, w, dy = _operands(11)
  x[60, 5] = np.nan
  y, dx, dw = (np.asarray(v) for v in _grouped_fn(config)(
      x, w, jnp.asarray(sizes, jnp.int32), dy))
  assert not np.any(np.isfinite(y[60]))
  assert not np.all(np.isfinite(dw[2]))
  want = _loop(x, w, sizes, dy, config)
  others = np.r_[0:60, 61:M]
  np.testing.assert_array_equal(y[others], want[0][others])
  np.testing.assert_array_equal(dw[[0, 1, 3, 4]], want[2][[0, 1, 3, 4]])


def test_stochastic_rounding_is_deterministic_and_close():
  config = int8.Int8Config(stochastic_rounding=True)
  sizes = jnp.asarray((44, 0, 84, 3, 125), jnp.int32)
  x, w, dy = _operands(10)
  a = _grouped_fn(config)(x, w, sizes, dy)
  b = _grouped_fn(config)(x, w, sizes, dy.copy())
  _assert_same(a, [np.asarray(v) for v in b])
  nearest = _grouped_fn(int8.Int8Config())(x, w, sizes, dy)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(nearest[0]))
  assert not np.array_equal(np.asarray(a[1]), np.asarray(nearest[1]))
  rel = np.linalg.norm(np.asarray(a[1]) - np.asarray(nearest[1])) / (
      np.linalg.norm(np.asarray(nearest[1])))
  assert rel < 0.05


def _sqnr(ref, got):
  ref = np.asarray(ref, np.float64)
  err = np.asarray(got, np.float64) - ref
  return 10 * np.log10(np.sum(ref**2) / np.sum(err**2))


# Measured (jax 0.10.2, CPU) with
#   python -m pytest -q -n 0 tests/test_int8_grouped.py -k sqnr -s
# on Gaussian x [512, 256], w [4, 256, 128], dy [512, 128], sizes
# (100, 0, 300, 112):
#   int8             y 40.16  dx 40.79  dw 40.42
#   int8_switchback  y 38.24  dx 38.44  dw 133.64 (float32 weight gradient)
_SQNR_BARS = {"int8": (38.5, 39.0, 39.0),
              "int8_switchback": (37.0, 37.0, 120.0)}


def test_sqnr_of_the_grouped_product():
  rng = np.random.default_rng(11)
  x = rng.standard_normal((512, 256)).astype(np.float32)
  w = (rng.standard_normal((4, 256, 128)) / 16).astype(np.float32)
  dy = rng.standard_normal((512, 128)).astype(np.float32)
  sizes = (100, 0, 300, 112)
  exact = [np.zeros((512, 128)), np.zeros((512, 256)), np.zeros(w.shape)]
  start = 0
  for e, s in enumerate(sizes):
    r = slice(start, start + s)
    xe, dye = x[r].astype(np.float64), dy[r].astype(np.float64)
    exact[0][r], exact[1][r], exact[2][e] = xe @ w[e], dye @ w[e].T, xe.T @ dye
    start += s
  got = {}
  for recipe in RECIPES:
    out = _grouped_fn(int8.Int8Config(recipe))(
        x, w, jnp.asarray(sizes, jnp.int32), dy)
    got[recipe] = [_sqnr(e, v) for e, v in zip(exact, out)]
  print({k: [round(v, 2) for v in vs] for k, vs in got.items()})
  for recipe, bars in _SQNR_BARS.items():
    for what, value, bar in zip(("y", "dx", "dw"), got[recipe], bars):
      assert value >= bar, (recipe, what, value, bar)


def test_errors():
  x, w = np.ones((8, 16), np.float32), np.ones((2, 16, 4), np.float32)
  sizes = jnp.asarray((4, 4), jnp.int32)
  with pytest.raises(TypeError, match="Int8Config"):
    int8.ragged_dot(x, w, sizes, config="int8")
  with pytest.raises((TypeError, ValueError)):
    int8.ragged_dot(x.astype(np.int8), w, sizes)
  with pytest.raises(ValueError, match="axis_name"):
    int8.ragged_dot(x, w, sizes,
                         config=int8.Int8Config(axis_name="data"))

  def loss(w):
    return jnp.sum(jnp.tanh(int8.ragged_dot(x, w, sizes)))

  jax.grad(loss)(w)
  with pytest.raises(ValueError) as info:
    jax.grad(lambda w: jnp.sum(jax.grad(loss)(w)))(w)
  assert int8_matmul.SECOND_ORDER_HELP in str(info.value)
