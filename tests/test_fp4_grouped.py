"""fp4.ragged_dot: the grouped (Mixture-of-Experts) FP4 matmul equals the
per-group loop of fp4.dot_general (forward, input gradient, weight gradient)
for jagged group sizes; per-expert isolation, empty experts, NaN per group,
stochastic rounding, SQNR, dtypes, the CUDA program, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp4
from jmp_lite import fp8
from jmp_lite._src import compat
from jmp_lite._src.low_precision import fp4 as fp4_lib
from jmp_lite._src.low_precision import fp4_grouped
from jmp_lite._src.low_precision import recipe_matmuls
from helpers import default_run_keeps

MATMUL = (((1,), (0,)), ((), ()))  # x (m, K) @ w (K, N)
F32 = np.float32
M, K, N = 256, 64, 48
#: Jagged sizes over M = 256, empty groups included (issue 37).
JAGGED = (44, 0, 84, 3, 125)
#: All tokens in one expert, every other expert empty.
ONE_EXPERT = (0, 0, 256, 0, 0)
RTN = {"nvfp4": fp4.Fp4Config("nvfp4", stochastic_rounding=False),
       "mxfp4": fp4.Fp4Config("mxfp4", stochastic_rounding=False)}


def _ints(shape, seed, low=-3, high=4):
  """Small integers: every float32 sum of their FP4 products is exact, so
  that bit equality tests the quantization, not XLA's summation order."""
  rng = np.random.default_rng(seed)
  return rng.integers(low, high, shape).astype(F32)


def _normal(shape, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * scale).astype(F32)


def _data(seed=0, kind=_ints, g=len(JAGGED)):
  return kind((M, K), seed), kind((g, K, N), seed + 1), kind((M, N), seed + 2)


@functools.partial(jax.jit, static_argnames="config")
def _grouped(x, w, sizes, dy, key=None, *, config):
  y, vjp = jax.vjp(lambda x, w: fp4.ragged_dot(
      x, w, sizes, config=config, key=key), x, w)
  return (y,) + vjp(dy)


def grouped(config, x, w, sizes, dy, key=None):
  """(y, dx, dw) of fp4.ragged_dot with cotangent dy, jitted."""
  out = _grouped(x, w, jnp.asarray(sizes, jnp.int32), dy, key, config=config)
  return [np.asarray(v) for v in out]


@functools.partial(jax.jit, static_argnames="config")
def _dense(x, w, dy, key=None, *, config):
  y, vjp = jax.vjp(lambda x, w: fp4.dot_general(
      x, w, MATMUL, config=config, key=key), x, w)
  return (y,) + vjp(dy)


def per_group_loop(config, x, w, sizes, dy, keys=None):
  """The reference: fp4.dot_general on each group's rows and its expert's
  weight (empty groups: no rows, a zero weight gradient)."""
  ys, dxs, dws = [], [], []
  start = 0
  for g, m in enumerate(sizes):
    rows = slice(start, start + m)
    start += m
    key = None if keys is None else keys[g]
    y, dx, dw = _dense(x[rows], w[g], dy[rows], key, config=config)
    ys.append(y)
    dxs.append(dx)
    dws.append(dw)
  return [np.concatenate(ys), np.concatenate(dxs), np.stack(dws)]


def _same(a, b):
  """Bit for bit; any NaN equals any NaN."""
  a, b = np.asarray(a, F32), np.asarray(b, F32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
  np.testing.assert_array_equal(np.where(np.isnan(a), 0, a).view(np.uint32),
                                np.where(np.isnan(b), 0, b).view(np.uint32))


def _all_same(got, want):
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    try:
      _same(a, b)
    except AssertionError as e:
      raise AssertionError(f"{name} differs") from e


def _starts(sizes):
  return np.concatenate([[0], np.cumsum(sizes)]).astype(int)


# ---------------------------------------------------------------------------
# The per-group loop of the dense recipe.
# ---------------------------------------------------------------------------


# The default run keeps jagged-nvfp4; the rest of the grid runs in the slow
# stage (pytest -m slow).
@pytest.mark.parametrize("recipe", [
    "nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sizes", [
    JAGGED, pytest.param(ONE_EXPERT, marks=pytest.mark.slow),
    pytest.param((0, 0, 0, 0, 256), marks=pytest.mark.slow)],
                         ids=["jagged", "one_expert", "last_expert"])
def test_equals_the_per_group_loop_bit_for_bit(recipe, sizes):
  config = RTN[recipe]
  x, w, dy = _data()
  _all_same(grouped(config, x, w, sizes, dy),
            per_group_loop(config, x, w, sizes, dy))


# The default run keeps nvfp4_late_switch; the rest of the grid runs in the
# slow stage.
@pytest.mark.parametrize("name,config", [
    pytest.param("nvfp4_no_rht",
                 fp4.Fp4Config(stochastic_rounding=False, rht=False),
                 marks=pytest.mark.slow),
    pytest.param("nvfp4_1d_weights",
                 fp4.Fp4Config(stochastic_rounding=False, two_d_weights=False),
                 marks=pytest.mark.slow),
    ("nvfp4_late_switch", fp4.Fp4Config(stochastic_rounding=False,
                                        quantize_forward=False)),
    pytest.param("mxfp4_floor_no_rht",
                 fp4.Fp4Config("mxfp4", stochastic_rounding=False,
                               mx_scale_rule="floor", rht=False),
                 marks=pytest.mark.slow),
], ids=lambda v: v if isinstance(v, str) else "")
def test_every_switch_equals_the_per_group_loop(name, config):
  del name
  x, w, dy = _data(3)
  _all_same(grouped(config, x, w, JAGGED, dy),
            per_group_loop(config, x, w, JAGGED, dy))


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
def test_close_to_the_per_group_loop_on_normal_data(recipe):
  """Random normal data: the float32 sums are XLA's (no order is promised
  for every shape), so within 1e-6 of the largest element."""
  config = RTN[recipe]
  x, w, dy = _data(6, _normal)
  got = grouped(config, x, w, JAGGED, dy)
  want = per_group_loop(config, x, w, JAGGED, dy)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


@pytest.mark.slow  # ~8 s on 2 cores
def test_partial_blocks_and_unaligned_dimensions():
  """K and N that are not multiples of 16 (zero-padded as the dense recipe
  pads them), groups of 1, 15, 17 and 33 rows."""
  config = RTN["nvfp4"]
  sizes = (1, 15, 17, 0, 33)
  m, k, n = sum(sizes), 40, 24
  x, w, dy = _ints((m, k), 9), _ints((5, k, n), 10), _ints((m, n), 11)
  _all_same(grouped(config, x, w, sizes, dy),
            per_group_loop(config, x, w, sizes, dy))
  config = RTN["mxfp4"]
  _all_same(grouped(config, x, w, sizes, dy),
            per_group_loop(config, x, w, sizes, dy))


def test_recipe_ragged_dot_picks_the_grouped_matmul_by_recipe():
  """The routes' one entry: an Fp4Config runs fp4.ragged_dot, an Fp8Config
  fp8.ragged_dot."""
  x, w, _ = _data(12)
  sizes = jnp.asarray(JAGGED, jnp.int32)
  for config in RTN.values():
    got = recipe_matmuls.recipe_ragged_dot(x, w, sizes, config=config)
    _same(got, fp4.ragged_dot(x, w, sizes, config=config))
  config = fp8.Fp8Config(granularity="row")
  _same(recipe_matmuls.recipe_ragged_dot(x, w, sizes, config=config),
        fp8.ragged_dot(x, w, sizes, config=config))


# ---------------------------------------------------------------------------
# Per group: isolation, empty experts, NaN.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [
    "nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow)])  # rest: slow stage
def test_one_experts_outliers_change_no_other_expert(recipe):
  """Expert 2's tokens, its incoming gradient and its weight times 1000:
  every other group's output, input gradient and weight gradient are bit
  for bit unchanged (stochastic rounding on, with a key: the same bits)."""
  config = fp4.Fp4Config(recipe)
  x, w, dy = _data(15, _normal)
  key = jax.random.key(3)
  base = grouped(config, x, w, JAGGED, dy, key)
  start = _starts(JAGGED)
  rows = slice(start[2], start[3])
  x2, w2, dy2 = x.copy(), w.copy(), dy.copy()
  x2[rows] *= 1000
  dy2[rows] *= 1000
  w2[2] *= 1000
  changed = grouped(config, x2, w2, JAGGED, dy2, key)
  others = np.ones(M, bool)
  others[rows] = False
  for i in (0, 1):
    _same(changed[i][others], base[i][others])
    assert not np.array_equal(changed[i][rows], base[i][rows])
  _same(np.delete(changed[2], 2, axis=0), np.delete(base[2], 2, axis=0))


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
def test_empty_experts_are_finite_with_exactly_zero_weight_gradients(recipe):
  config = fp4.Fp4Config(recipe)
  x, w, dy = _data(18, _normal)
  for sizes in (JAGGED, ONE_EXPERT, (0, 0, 0, 0, 256)):
    y, dx, dw = grouped(config, x, w, sizes, dy, jax.random.key(0))
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    assert np.isfinite(dw).all()
    for g, m in enumerate(sizes):
      if m == 0:
        _same(dw[g], np.zeros_like(dw[g]))      # +0.0 exactly
      else:
        assert np.abs(dw[g]).max() > 0
  # No rows at all: zeros, zero gradients.
  y, dx, dw = grouped(config, x[:0], w, (0,) * 5, dy[:0])
  assert y.shape == (0, N) and dx.shape == (0, K)
  _same(dw, np.zeros_like(dw))


# Op by op under the debug flags: ~25 s on 2 cores, the slow stage's.
@pytest.mark.slow
def test_empty_experts_create_no_nan_or_inf_anywhere():
  """Op by op under jax_debug_nans/jax_debug_infs (jax.disable_jit): empty
  groups, all-zero tokens and tiny magnitudes make no intermediate NaN or
  inf (an empty segment's maximum would be -inf; none is made)."""
  sizes = jnp.asarray((5, 0, 27), jnp.int32)
  x, w, dy = _normal((32, 32), 19, 1e-3), _normal((3, 32, 16), 20), \
      _normal((32, 16), 21)
  x[:5] = 0.0
  with jax.debug_nans(True), jax.debug_infs(True), jax.disable_jit():
    for recipe in ("nvfp4", "mxfp4"):
      config = fp4.Fp4Config(recipe)
      _, vjp = jax.vjp(lambda x, w: fp4.ragged_dot(
          x, w, sizes, config=config), x, w)
      vjp(dy)


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
@pytest.mark.parametrize("where", ["x", "dy", "w"])
def test_nan_or_inf_in_one_expert_poisons_that_group_only(recipe, where):
  """As the per-group loop: a NaN in group 2's tokens makes NaN its output
  rows and its weight gradient; in its incoming gradient, its input-gradient
  rows and its weight gradient; an inf in expert 2's weight, the group's
  output and input-gradient rows. Everything else is finite and unchanged."""
  config = RTN[recipe]
  x, w, dy = _data(24, _normal)
  base = grouped(config, x, w, JAGGED, dy)
  start = _starts(JAGGED)
  rows = np.zeros(M, bool)
  rows[start[2]:start[3]] = True
  bad = {"x": x.copy(), "dy": dy.copy(), "w": w.copy()}
  if where == "w":
    bad["w"][2, 5, 7] = np.inf
  else:
    bad[where][start[2] + 10, 3] = np.nan
  got = grouped(config, bad["x"], bad["w"], JAGGED, bad["dy"])
  want = per_group_loop(config, bad["x"], bad["w"], JAGGED, bad["dy"])
  poisoned = {"x": ("y", "dw"), "dy": ("dx", "dw"), "w": ("y", "dx")}[where]
  for i, name in enumerate(("y", "dx", "dw")):
    group = rows if name != "dw" else np.arange(5) == 2
    if name in poisoned:
      assert np.isnan(got[i][group]).all(), name
    _same(got[i][~group], base[i][~group])
    assert np.array_equal(np.isnan(got[i]), np.isnan(want[i])), name


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------


@pytest.fixture
def value_derived_random_bytes(monkeypatch):
  """Stochastic rounding's random bytes replaced by a hash of each element's
  value (both the grouped matmul and the per-group loop quantize with
  fp4.py's one element quantizer): the same bits per element in both."""
  def quantize_elements(scaled, key):
    clipped = jnp.clip(scaled, -fp4_lib.E2M1_MAX, fp4_lib.E2M1_MAX)
    if key is None:
      return fp4_lib.round_e2m1(clipped)
    bits = jax.lax.bitcast_convert_type(clipped, jnp.uint32)
    hashed = (bits * jnp.uint32(0x9E3779B1)) >> 24
    return fp4_lib.stochastic_round_e2m1(clipped, hashed.astype(jnp.uint8))

  jax.clear_caches()   # no program traced with the real bytes is reused
  monkeypatch.setattr(fp4_lib, "_quantize_elements", quantize_elements)
  yield
  monkeypatch.undo()
  jax.clear_caches()   # nor one traced with these


@pytest.mark.slow  # ~9 s for both recipes
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_equals_the_loop_given_the_same_bits(
    recipe, value_derived_random_bytes):
  del value_derived_random_bytes
  config = fp4.Fp4Config(recipe)
  # Integers up to 7 (an amax of 7 scaled to 6: off the E2M1 grid, so that
  # rounding has work to do; the float32 sums stay exact).
  x, w = _ints((M, K), 27, -7, 8), _ints((5, K, N), 28, -7, 8)
  dy = _ints((M, N), 29, -7, 8)
  got = grouped(config, x, w, JAGGED, dy, jax.random.key(0))
  _all_same(got, per_group_loop(config, x, w, JAGGED, dy,
                                [jax.random.key(0)] * 5))
  rtn = grouped(RTN[recipe], x, w, JAGGED, dy)
  _same(got[0], rtn[0])                 # the forward never rounds randomly
  assert not np.array_equal(got[1], rtn[1])
  assert not np.array_equal(got[2], rtn[2])


def test_stochastic_rounding_keys():
  config = fp4.Fp4Config()
  x, w, dy = _data(30, _normal)
  a = grouped(config, x, w, JAGGED, dy, jax.random.key(1))
  b = grouped(config, x, w, JAGGED, dy, jax.random.key(2))
  c = grouped(config, x, w, JAGGED, dy, jax.random.key(1))
  rtn = grouped(RTN["nvfp4"], x, w, JAGGED, dy)
  _same(a[0], b[0])
  _same(a[0], rtn[0])
  assert not np.array_equal(a[1], b[1]) and not np.array_equal(a[2], b[2])
  _all_same(a, c)
  # key=None: bits derived from the gradient's, deterministic.
  d = grouped(config, x, w, JAGGED, dy)
  _all_same(d, grouped(config, x, w, JAGGED, dy))
  assert not np.array_equal(d[2], rtn[2])


#: Keys of the unbiasedness test.
BIAS_SEEDS = 64


@pytest.mark.slow  # 64 keys: ~5 s
def test_stochastic_rounding_is_unbiased_per_group():
  """Over 64 keys, the mean grouped gradients (one draw over all groups)
  and the mean per-group-loop gradients (one draw per group) estimate the
  same expectation: every element within 5 sigma of the two means'
  difference; round-to-nearest's bias is far larger."""
  config = fp4.Fp4Config()
  x, w, dy = _data(33, _normal)
  sizes = jnp.asarray(JAGGED, jnp.int32)
  keys = jax.random.split(jax.random.key(7), BIAS_SEEDS)
  # A loop over keys: jax.lax.ragged_dot's batching rule takes batched
  # operands only on their leading axis (NotImplementedError otherwise).
  draws = [np.stack(d) for d in zip(*(
      _grouped(x, w, sizes, dy, k, config=config)[1:] for k in keys))]
  loop = [np.stack(d) for d in zip(*(
      per_group_loop(config, x, w, JAGGED, dy,
                     [jax.random.fold_in(k, g) for g in range(5)])[1:]
      for k in keys))]
  rtn = grouped(RTN["nvfp4"], x, w, JAGGED, dy)[1:]
  for ours, theirs, rtn_value in zip(draws, loop, rtn):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    diff = ours.mean(0) - theirs.mean(0)
    sigma = np.sqrt((ours.var(0) + theirs.var(0)) / BIAS_SEEDS)
    assert np.all(np.abs(diff) <= 5 * sigma + 1e-6 * np.abs(ours).max())
    target = theirs.mean(0)
    sr_bias = np.linalg.norm(ours.mean(0) - target)
    rtn_bias = np.linalg.norm(rtn_value - target)
    assert sr_bias < 0.5 * rtn_bias, (sr_bias, rtn_bias)


# ---------------------------------------------------------------------------
# Accuracy, transformations, dtypes, the program.
# ---------------------------------------------------------------------------


def _sqnr_db(signal, approx):
  signal = np.asarray(signal, np.float64)
  noise = signal - np.asarray(approx, np.float64)
  return 10 * np.log10(np.sum(signal ** 2) / np.sum(noise ** 2))


#: Bars for the SQNR (dB) of (output, input gradient, weight gradient)
#: against the float32 ragged_dot of the same operands, the default recipes
#: (stochastic rounding and RHT on), normal data, (512, 128) tokens in groups
#: of (100, 0, 300, 112), 4 experts (128, 64). NVFP4's are issue 37's
#: (measured: 16.7 / 15.1 / 15.5 dB, the lowest over keys 0-4); MXFP4's are
#: its measured 15.7 / 13.9 / 14.0 dB (lowest over keys 0-4) less about
#: 1 dB. (Round to nearest gradients: NVFP4 16.8 / 17.5, MXFP4 15.8 / 15.9.)
SQNR_BARS = {"nvfp4": (15.0, 14.0, 12.0), "mxfp4": (14.5, 13.0, 13.0)}


@pytest.mark.parametrize("recipe", [
    "nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow)])  # rest: slow stage
def test_sqnr_against_the_float32_ragged_dot(recipe):
  x, w, dy = _normal((512, 128), 36), _normal((4, 128, 64), 37), \
      _normal((512, 64), 38)
  sizes = jnp.asarray((100, 0, 300, 112), jnp.int32)
  exact_y, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(
      x, w, sizes, precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32), x, w)
  exact = (exact_y,) + vjp(dy)
  got = grouped(fp4.Fp4Config(recipe), x, w, sizes, dy, jax.random.key(0))
  sqnr = [_sqnr_db(e, g) for e, g in zip(exact, got)]
  assert all(s >= bar for s, bar in zip(sqnr, SQNR_BARS[recipe])), sqnr


def test_jit_and_eager_agree():
  config = fp4.Fp4Config()
  x, w, dy = _data(39, _normal)
  sizes = jnp.asarray(JAGGED, jnp.int32)
  key = jax.random.key(4)
  eager_y, vjp = jax.vjp(lambda x, w: fp4.ragged_dot(
      x, w, sizes, config=config, key=key), x, w)
  _all_same([eager_y, *vjp(dy)], grouped(config, x, w, JAGGED, dy, key))


def test_traced_group_sizes_leave_rows_past_their_sum_at_zero():
  """Traced sizes are not read on the host (no sync): rows past their sum
  belong to no group, as with jax.lax.ragged_dot."""
  config = RTN["nvfp4"]
  x, w, dy = _data(42)
  sizes = (44, 0, 84, 3, 100)    # 25 rows past the sum
  y, dx, dw = grouped(config, x, w, sizes, dy)
  _same(y[231:], np.zeros_like(y[231:]))
  _same(dx[231:], np.zeros_like(dx[231:]))
  want = per_group_loop(config, x[:231], w, sizes, dy[:231])
  _all_same([y[:231], dx[:231], dw], want)


@pytest.mark.parametrize("dtype", [
    jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])  # rest: slow stage
def test_half_operands(dtype):
  """Half operands give a half result and half gradients: the float32
  computation on the same (exactly widened) values, rounded once."""
  config = RTN["nvfp4"]
  x, w, dy = _data(45, _normal)
  xh, wh, dyh = (jnp.asarray(v, dtype) for v in (x, w, dy))
  got = grouped(config, xh, wh, JAGGED, dyh)
  assert [v.dtype for v in got] == [np.dtype(dtype)] * 3
  wide = grouped(config, *(np.asarray(v, F32) for v in (xh, wh)), JAGGED,
                 np.asarray(dyh, F32))
  for a, b in zip(got, wide):
    _same(np.asarray(a, F32), np.asarray(jnp.asarray(b).astype(dtype), F32))
  y = fp4.ragged_dot(xh, wh, jnp.asarray(JAGGED, jnp.int32),
                         preferred_element_type=jnp.float32, config=config)
  assert y.dtype == jnp.float32
  _same(y, wide[0])


def _ragged_dots(jaxpr):
  """(operand dtypes, preferred_element_type, precision) of every
  ragged_dot_general in a jaxpr, nested ones too."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is compat.primitive("ragged_dot_general_p"):
        found.append((tuple(str(v.aval.dtype) for v in eqn.invars[:2]),
                      eqn.params["preferred_element_type"],
                      eqn.params["precision"]))
      for param in eqn.params.values():
        for inner in (param if isinstance(param, (tuple, list)) else [param]):
          inner = getattr(inner, "jaxpr", inner)
          if hasattr(inner, "eqns"):
            visit(inner)
  visit(jaxpr.jaxpr)
  return found


def test_every_product_is_a_float32_ragged_dot_at_highest_precision():
  x, w = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((4, 32, 16), jnp.bfloat16)
  sizes = jnp.asarray((10, 0, 50, 4), jnp.int32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp4.ragged_dot(
      x, w, sizes).astype(jnp.float32).sum(), (0, 1)))(x, w)
  dots = _ragged_dots(jaxpr)
  assert len(dots) == 3, dots    # forward, input gradient, weight gradient
  highest = jax.lax.Precision.HIGHEST
  for operands, preferred, precision in dots:
    assert operands == ("float32", "float32"), dots
    assert preferred == jnp.float32, dots
    assert precision in (highest, (highest, highest)), dots


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
def test_cuda_program_lowers_the_grouped_step(recipe):
  """jax.export for CUDA (on a CPU machine): the grouped FP4 step lowers,
  its three products are ragged dots of float32 operands at HIGHEST
  precision accumulating in float32 (no block-scaled grouped GEMM exists in
  JAX: the GPU runs the exact emulation)."""
  config = fp4.Fp4Config(recipe)
  sizes = jnp.asarray((40, 0, 60, 28), jnp.int32)

  def step(x, w, key):
    return jax.value_and_grad(lambda x, w: fp4.ragged_dot(
        x, w, sizes, config=config, key=key).sum(), (0, 1))(x, w)

  exported = jax.export.export(jax.jit(step), platforms=["cuda"])(
      jnp.ones((128, 64)), jnp.ones((4, 64, 32)), jax.random.key(0))
  text = exported.mlir_module()
  calls = [line for line in text.splitlines()
           if 'stablehlo.composite "chlo.ragged_dot"' in line]
  assert len(calls) == 3, calls
  for line in calls:
    assert '"HIGHEST", "HIGHEST"' in line, line
    signature = line.rsplit(":", 1)[1]
    assert signature.count("xf32>") == 3, line   # two operands, the result
  # The program's operations, not its location table: a #loc line may name
  # another test's function (JAX's caches keep the source locations of the
  # first trace), e.g. test_fp4_matmul's
  # test_cuda_program_runs_fp4_operands_through_the_block_scaled_dot when it
  # ran earlier in the same process.
  ops = "\n".join(line for line in text.splitlines()
                  if not line.startswith("#loc"))
  assert "block_scaled_dot" not in ops


def test_axis_name_makes_per_group_tensor_scales_global():
  """Data parallel under shard_map: two replicas, each with its own tokens
  of the same 5 experts. With axis_name each group's NVFP4 tensor amax and
  NaN flag are reduced over the replicas, so the output and the input
  gradient equal those of one call on both replicas' tokens, each group's
  rows together, bit for bit (the weight gradient's token blocks are each
  replica's, its sum over replicas another quantization: held to the SQNR
  bar)."""
  config = fp4.Fp4Config(stochastic_rounding=False, axis_name="data")
  local_sizes = np.array([(20, 0, 50, 3, 55), (30, 7, 1, 0, 90)], np.int32)
  x, w, dy = _ints((256, K), 48), _ints((5, K, N), 49), _ints((256, N), 50)
  x[:128] *= 5  # replica 0's groups have the larger amaxes (not by 2**k)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  spec = jax.sharding.PartitionSpec

  def run(config):
    def replica(x, sizes, dy):
      y, vjp = jax.vjp(lambda x, w: fp4.ragged_dot(
          x, w, sizes[0], config=config), x, w)
      return (y,) + vjp(dy)   # dw of the replicated w: summed over replicas
    return jax.jit(jax.shard_map(
        replica, mesh=mesh,
        in_specs=(spec("data"), spec("data"), spec("data")),
        out_specs=(spec("data"), spec("data"), spec())))(x, local_sizes, dy)

  y, dx, dw = run(config)
  # The unsharded call: group g's rows of replica 0, then of replica 1.
  order = []
  for g in range(5):
    for r in range(2):
      start = 128 * r + int(local_sizes[r, :g].sum())
      order.extend(range(start, start + int(local_sizes[r, g])))
  order = np.array(order)
  want = grouped(RTN["nvfp4"], x[order], w, local_sizes.sum(0), dy[order])
  _same(np.asarray(y)[order], want[0])
  _same(np.asarray(dx)[order], want[1])
  # Without axis_name each replica scales by its own tokens' amaxes.
  local_y = run(RTN["nvfp4"])[0]
  assert not np.array_equal(np.asarray(local_y)[order], want[0])
  # The weight gradient: each replica's own token blocks, summed; a
  # quantization of its own, as accurate as the bar of the SQNR test.
  _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(
      x[order], w, jnp.asarray(local_sizes.sum(0)),
      precision=jax.lax.Precision.HIGHEST), w)
  assert _sqnr_db(vjp(dy[order])[0], dw) >= SQNR_BARS["nvfp4"][2]


def test_second_derivatives_are_refused():
  x, w = jnp.ones((32, 32)), jnp.ones((2, 32, 16))
  sizes = jnp.asarray((16, 16), jnp.int32)
  loss = lambda x, w: fp4.ragged_dot(x, w, sizes).sum()
  with pytest.raises(ValueError, match="no second derivative"):
    jax.grad(lambda x: jax.grad(loss, 1)(x, w).sum())(x)


# ---------------------------------------------------------------------------
# Errors: grouped.check_operands' contract reaches fp4.ragged_dot.
# ---------------------------------------------------------------------------


def test_errors_name_the_value():
  x, w = jnp.ones((6, 32)), jnp.ones((3, 32, 16))
  sizes = jnp.asarray((4, 0, 2), jnp.int32)
  with pytest.raises(TypeError, match="jmp_lite.fp4.ragged_dot: group_sizes must be "
                     "an integer array, got dtype float32"):
    fp4.ragged_dot(x, w, jnp.asarray((4.0, 0.0, 2.0)))
  with pytest.raises(ValueError, match=r"group_sizes \[4, 0, 1\] sum to 5, "
                     r"but lhs has 6 rows"):
    fp4.ragged_dot(x, w, jnp.asarray((4, 0, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"non-negative, got \[7, -1, 0\]"):
    fp4.ragged_dot(x, w, jnp.asarray((7, -1, 0), jnp.int32))
  with pytest.raises(ValueError, match=r"group_sizes has shape \(2,\), but "
                     r"rhs holds 3 groups"):
    fp4.ragged_dot(x, w, jnp.asarray((4, 2), jnp.int32))
  with pytest.raises(ValueError, match=r"lhs of shape \(6, 32, 1\) and rhs "
                     r"of shape \(3, 32, 16\)"):
    fp4.ragged_dot(x[..., None], w, sizes)
  with pytest.raises(ValueError, match=r"different K \(32 != 16\)"):
    fp4.ragged_dot(x, w[:, :16], sizes)
  with pytest.raises(TypeError, match="lhs is already float8"):
    fp4.ragged_dot(x.astype(jnp.float8_e4m3fn), w, sizes)
  with pytest.raises(TypeError, match="rhs must be a floating array, got "
                     "dtype int32"):
    fp4.ragged_dot(x, w.astype(jnp.int32), sizes)
  with pytest.raises(TypeError, match="config must be an Fp4Config, got str"):
    fp4.ragged_dot(x, w, sizes, config="nvfp4")
  with pytest.raises(ValueError, match="preferred_element_type"):
    fp4.ragged_dot(x, w, sizes, preferred_element_type=jnp.int8)
  with pytest.raises(ValueError, match="axis_name"):
    fp4.ragged_dot(x, w, sizes, config=fp4.Fp4Config(axis_name="data"))
