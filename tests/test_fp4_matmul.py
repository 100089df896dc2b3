"""fp4.dot_general: forward and both gradients against the NumPy reference
(tests/fp4_reference.py), NaN visibility, padding, stochastic rounding's
gradient bias, the CUDA program, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4_reference as ref
import jmp_lite
from jmp_lite import fp4
from jmp_lite._src.low_precision import fp4 as fp4_lib
from jmp_lite._src.low_precision import fp4_matmul
from helpers import default_run_keeps

MATMUL = (((1,), (0,)), ((), ()))  # x (M, K) @ w (K, N)
_DN = (((2,), (2,)), ((0,), (0,)))
F32 = np.float32


def _random(shape, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * scale).astype(F32)


@functools.partial(jax.jit, static_argnames="config")
def _jitted_value_and_grads(x, w, g, key, *, config):
  y, vjp = jax.vjp(lambda x, w: fp4.dot_general(
      x, w, MATMUL, config=config, key=key), x, w)
  return (y,) + vjp(g)


def _value_and_grads(config, x, w, g, key=None):
  """(y, dx, dw) of fp4.dot_general with cotangent g, jitted (one program
  per config, shapes and key-or-None, shared by the tests)."""
  return [np.asarray(v)
          for v in _jitted_value_and_grads(x, w, g, key, config=config)]


# ---------------------------------------------------------------------------
# The reference matmul: quantized operands from the NumPy reference, the
# platform's float32 dot of the dequantized blocks, the tensor scales.
# ---------------------------------------------------------------------------


def _quantized(x, recipe, two_d=False):
  """(dequantized blocks float32 (P, C), tensor scale) of (P, C) along C."""
  if recipe == "nvfp4":
    values, scales, ts = ref.nvfp4(x, two_d=two_d)
    return ref.dequantize_nvfp4(values, scales), ts
  rule = "floor" if recipe == "mxfp4_floor" else "round_up"
  values, codes = ref.mxfp4(x, rule)
  ts = F32(np.nan) if (codes == 255).any() else F32(1)
  return ref.dequantize_mxfp4(values, codes), ts


def _product(a, b):
  """float32 (P, C) x (Q, C) -> (P, Q) with the platform's float32 dot."""
  a, ts_a = a
  b, ts_b = b
  acc = jax.lax.dot_general(jnp.asarray(a)[None], jnp.asarray(b)[None], _DN,
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
  return ref.alpha_product(np.asarray(acc)[0], ts_a, ts_b)


def _reference(recipe, x, w, g, *, two_d, rht):
  y = _product(_quantized(x, recipe), _quantized(w.T, recipe, two_d))
  dx = _product(_quantized(g, recipe), _quantized(w, recipe, two_d))
  gt, xt = g.T, x.T
  if rht:
    gt, xt = ref.rht(gt), ref.rht(xt)
  dw = _product(_quantized(gt, recipe), _quantized(xt, recipe)).T
  return y, dx, dw


RECIPES = {
    "nvfp4": fp4.Fp4Config("nvfp4", stochastic_rounding=False),
    "nvfp4_1d_no_rht": fp4.Fp4Config("nvfp4", stochastic_rounding=False,
                                     two_d_weights=False, rht=False),
    "mxfp4": fp4.Fp4Config("mxfp4", stochastic_rounding=False),
    "mxfp4_floor": fp4.Fp4Config("mxfp4", stochastic_rounding=False,
                                 mx_scale_rule="floor", rht=False),
}


def _same(a, b):
  """Bit for bit; any NaN equals any NaN (its sign and payload mean nothing)."""
  a, b = np.asarray(a, F32), np.asarray(b, F32)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
  np.testing.assert_array_equal(np.where(np.isnan(a), 0, a).view(np.uint32),
                                np.where(np.isnan(b), 0, b).view(np.uint32))


@pytest.mark.parametrize("name", default_run_keeps(sorted(RECIPES)))
def test_forward_and_both_gradients_bit_for_bit(name):
  config = RECIPES[name]
  recipe = name if name == "mxfp4_floor" else config.recipe
  x, w, g = _random((32, 64), 1, 2.0), _random((64, 32), 2, 0.1), _random(
      (32, 32), 3, 1e-3)
  got = _value_and_grads(config, x, w, g)
  want = _reference(recipe, x, w, g, two_d=config.two_d_weights,
                    rht=config.rht)
  for part, a, b in zip(("y", "dx", "dw"), got, want):
    assert a.dtype == np.float32, part
    _same(a, b)


def test_edge_zoo_through_the_matmul_bit_for_bit():
  """Operands with a block at 448, E4M3-subnormal blocks, magnitudes 1e-3
  and 1e3, an all-zero block: forward and gradients equal the reference."""
  x = _random((32, 64), 4)
  x[0, 3] = 40.0                 # the block holding the amax: scale 448
  x[1:4] *= 1e-5                 # subnormal block scales
  x[5, :16] = 0.0                # an all-zero block
  w = _random((64, 32), 5, 1e3)
  g = _random((32, 32), 6, 1e-3)
  config = RECIPES["nvfp4"]
  got = _value_and_grads(config, x, w, g)
  want = _reference("nvfp4", x, w, g, two_d=True, rht=True)
  for a, b in zip(got, want):
    _same(a, b)


def test_close_to_the_exact_product():
  """FP4 is coarse, but relative errors of a few percent, not garbage; small
  magnitudes are not flushed."""
  x, w = _random((32, 64), 7, 1e-3), _random((64, 32), 8, 1e-3)
  g = _random((32, 32), 9)
  y, dx, dw = _value_and_grads(fp4.Fp4Config(), x, w, g,
                               key=jax.random.key(0))
  for got, exact in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert err < 0.25, err


def test_late_switch_runs_the_forward_in_high_precision_only():
  """quantize_forward=False: the forward product is the plain float32-
  accumulated dot of the operands as given; both gradients are the FP4
  backward pass's, bit for bit."""
  x = jnp.asarray(_random((32, 64), 10), jnp.bfloat16)
  w = jnp.asarray(_random((64, 32), 11), jnp.bfloat16)
  g = jnp.asarray(_random((32, 32), 12), jnp.bfloat16)
  key = jax.random.key(3)
  fp4_y, *fp4_grads = _value_and_grads(fp4.Fp4Config(), x, w, g, key=key)
  y, *grads = _value_and_grads(fp4.Fp4Config(quantize_forward=False), x, w,
                               g, key=key)
  exact = jax.lax.dot_general(x, w, MATMUL, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(y, np.asarray(exact.astype(jnp.bfloat16)))
  assert not np.array_equal(y, fp4_y)
  for a, b in zip(grads, fp4_grads):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(TypeError, match="quantize_forward must be True or False"):
    fp4.Fp4Config(quantize_forward="no")


# ---------------------------------------------------------------------------
# Shapes: padding, batch dimensions, dtypes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
def test_partial_blocks_are_zero_padded_exactly(recipe):
  """K = 40, M = 20, N = 24: the result equals the matmul of the operands
  zero-padded to whole blocks by hand (K to 64, M to 32, N to 32)."""
  config = fp4.Fp4Config(recipe, stochastic_rounding=False)
  x, w, g = _random((20, 40), 10), _random((40, 24), 11), _random((20, 24), 12)
  got = _value_and_grads(config, x, w, g)
  xp = np.pad(x, ((0, 12), (0, 24)))
  wp = np.pad(w, ((0, 24), (0, 8)))
  gp = np.pad(g, ((0, 12), (0, 8)))
  padded = _value_and_grads(config, xp, wp, gp)
  _same(got[0], padded[0][:20, :24])
  _same(got[1], padded[1][:20, :40])
  _same(got[2], padded[2][:40, :24])


def test_batch_dimensions_and_result_dtypes():
  x = jnp.asarray(_random((2, 16, 32), 13), jnp.bfloat16)
  w = jnp.asarray(_random((2, 32, 16), 14), jnp.bfloat16)
  dn = (((2,), (1,)), ((0,), (0,)))
  config = RECIPES["nvfp4"]

  @jax.jit  # one program (the eager path: test_finite_inputs_create_...)
  def run(x, w):
    y = fp4.dot_general(x, w, dn, config=config)
    y32 = fp4.dot_general(x, w, dn, preferred_element_type=jnp.float32,
                              config=config)
    grads = jax.grad(lambda x, w: fp4.dot_general(
        x, w, dn, config=config).astype(jnp.float32).sum(), (0, 1))(x, w)
    return y, y32, grads

  y, y32, grads = run(x, w)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 16, 16)
  assert y32.dtype == jnp.float32
  exact = np.einsum("bmk,bkn->bmn", np.asarray(x, F32), np.asarray(w, F32))
  err = np.linalg.norm(np.asarray(y32) - exact) / np.linalg.norm(exact)
  assert err < 0.25, err
  assert [d.dtype for d in grads] == [jnp.bfloat16, jnp.bfloat16]


# ---------------------------------------------------------------------------
# No silent loss of information.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", default_run_keeps(["nvfp4", "mxfp4"]))
@pytest.mark.parametrize("where", default_run_keeps(["x", "w", "g"]))
@pytest.mark.parametrize("bad", default_run_keeps([np.nan, np.inf]))
def test_nonfinite_values_stay_visible(recipe, where, bad):
  config = fp4.Fp4Config(recipe)
  arrays = {"x": _random((16, 32), 15), "w": _random((32, 16), 16),
            "g": _random((16, 16), 17)}
  arrays[where][3, 4] = bad
  y, dx, dw = _value_and_grads(config, arrays["x"], arrays["w"], arrays["g"])
  # Each result that reads the bad operand is NaN (all of it); the others are
  # finite, as in float32 (dx = g @ w^T does not read x, dw = g^T @ x not w).
  reads = {"y": ("x", "w"), "dx": ("g", "w"), "dw": ("g", "x")}
  for name, value in (("y", y), ("dx", dx), ("dw", dw)):
    if where in reads[name]:
      assert np.isnan(value).all(), name
    else:
      assert np.isfinite(value).all(), name


def test_zero_operands_give_zeros_not_nan():
  for recipe in ("nvfp4", "mxfp4"):
    z = np.zeros((16, 32), F32)
    y, dx, dw = _value_and_grads(fp4.Fp4Config(recipe), z, z.T.copy(),
                                 np.zeros((16, 16), F32))
    for v in (y, dx, dw):
      assert np.all(v == 0)


def _positive(shape, seed, low, high):
  """Positive normal float32 values (no cancellation: no partial sum of a
  dot passes through the float32 subnormals, which XLA:CPU flushes)."""
  return np.random.default_rng(seed).uniform(low, high, shape).astype(F32)


def _exact_mx(x, rule="round_up"):
  """float64 (P, C): x quantized by the NumPy reference, dequantized exactly."""
  values, codes = ref.mxfp4(x, rule)
  p, c = values.shape
  scales = np.exp2(codes.astype(np.float64) - 127)
  return (values.reshape(p, c // 32, 32) * scales[..., None]).reshape(p, c)


def test_mxfp4_smallest_scale_reaches_the_product():
  """An activation whose blocks have amax near 1e-38 (E8M0 scales 2**-127
  and 2**-126) and the smallest normal float32: forward and both gradients
  equal the exact product of the reference's quantized operands. Code 0's
  2**-127 is a float32 subnormal, and so are its blocks' small elements
  (0.5 * 2**-127): XLA:CPU flushed them to zero."""
  tiny = 2.0**-126
  x = _positive((32, 64), 30, tiny, 1.2e-38)
  x[0] = tiny
  x[1] = _positive((64,), 31, tiny, 7e-38)
  w, g = _positive((64, 32), 32, 1, 6), _positive((32, 32), 33, 1, 6)
  config = fp4.Fp4Config("mxfp4", stochastic_rounding=False, rht=False)
  y, dx, dw = _value_and_grads(config, x, w, g)
  for got, want in ((y, _exact_mx(x) @ _exact_mx(w.T).T),
                    (dx, _exact_mx(g) @ _exact_mx(w).T),
                    (dw, (_exact_mx(g.T) @ _exact_mx(x.T).T).T)):
    assert np.all(want >= tiny)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("two_d", default_run_keeps([True, False]))
def test_nvfp4_tiny_tensor_scales_reach_the_product(two_d):
  """An activation of amax 1.5e-35 (its tensor scale 1 / S_enc a float32
  subnormal) whose other blocks have amax below 5e-38 (their block scale
  times the tensor scale a subnormal too): forward and both gradients equal
  the reference bit for bit wherever the reference's result is a normal
  float32 (XLA:CPU flushed both: a zero or saturated product). Without the
  Hadamard transform, whose sums and differences of such values are float32
  subnormals themselves."""
  config = fp4.Fp4Config("nvfp4", stochastic_rounding=False, rht=False,
                         two_d_weights=two_d)
  x = _positive((32, 64), 37, 2.0**-126, 5e-38)
  x[3] *= F32(300)
  w, g = _positive((64, 32), 38, 1, 6), _positive((32, 32), 39, 1, 6)
  got = _value_and_grads(config, x, w, g)
  with np.errstate(over="ignore"):
    want = _reference("nvfp4", x, w, g, two_d=config.two_d_weights,
                      rht=config.rht)
  for part, a, b in zip(("y", "dx", "dw"), got, want):
    normal = np.abs(b) >= 2.0**-126
    assert normal.mean() > 0.9, part
    _same(a[normal], b[normal])


def test_mxfp8_smallest_scales_reach_the_product():
  """MXFP8's blocks near 1e-38 get the E8M0 scale 2**-126 (never 2**-127
  for a nonzero block): forward and both gradients equal the exact product
  of the quantized operands."""
  from jmp_lite import fp8  # pylint: disable=g-import-not-at-top
  from jmp_lite._src.low_precision import scaling  # pylint: disable=g-import-not-at-top
  tiny = 2.0**-126
  x = _positive((32, 64), 34, tiny, 1.2e-38)
  x[0] = tiny
  w, g = _positive((64, 32), 35, 1, 6), _positive((32, 32), 36, 1, 6)
  config = fp8.Fp8Config(granularity="mxfp8")

  @jax.jit
  def value_and_grads(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(
        x, w, MATMUL, config=config), x, w)
    return (y,) + vjp(g)

  y, dx, dw = value_and_grads(x, w, g)

  quantize = jax.jit(scaling.quantize, static_argnums=(1, 2))

  def exact(a, fmt):
    q = quantize(a, fmt, "mxfp8")
    assert np.all(np.asarray(q.scale.astype(jnp.float32)) >= tiny)
    codes = np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8))
    scales = np.repeat(np.exp2(codes.astype(np.float64) - 127), 32, -1)
    return np.asarray(q.values.astype(jnp.float32), np.float64) * scales

  for got, want in ((y, exact(x, "e4m3") @ exact(w.T, "e4m3").T),
                    (dx, exact(g, "e5m2") @ exact(w, "e4m3").T),
                    (dw, (exact(g.T, "e5m2") @ exact(x.T, "e4m3").T).T)):
    assert np.all(want >= tiny)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------
# Stochastic rounding in the backward pass.
# ---------------------------------------------------------------------------


def test_stochastic_rounding_uses_the_key_and_only_on_gradients():
  config = fp4.Fp4Config()
  x, w, g = _random((32, 32), 18), _random((32, 16), 19), _random((32, 16), 20)
  a = _value_and_grads(config, x, w, g, key=jax.random.key(1))
  b = _value_and_grads(config, x, w, g, key=jax.random.key(2))
  c = _value_and_grads(config, x, w, g, key=jax.random.key(1))
  rtn = _value_and_grads(fp4.Fp4Config(stochastic_rounding=False), x, w, g)
  _same(a[0], b[0])            # the forward pass never rounds stochastically
  _same(a[0], rtn[0])
  assert not np.array_equal(a[2], b[2]) and not np.array_equal(a[1], b[1])
  for u, v in zip(a, c):       # the same key, the same bits
    _same(u, v)
  # key=None: bits derived from the gradient, deterministic.
  d = _value_and_grads(config, x, w, g)
  e = _value_and_grads(config, x, w, g)
  _same(d[2], e[2])
  assert not np.array_equal(d[2], rtn[2])


#: Seeds of the gradient-bias test.
BIAS_SEEDS = 256


def test_wgrad_bias_of_stochastic_rounding_vs_round_to_nearest():
  """Over 256 keys, the mean NVFP4 weight gradient with stochastic rounding
  is within 5 sigma (+ the 8-bit truncation) of the gradient of the exact
  (transformed) g against the quantized activation, and its bias is smaller
  than round-to-nearest's."""
  x, w = _random((64, 32), 21), _random((32, 16), 22)
  g = _random((64, 16), 23)
  sr, rtn = fp4.Fp4Config(), fp4.Fp4Config(stochastic_rounding=False)

  def wgrad(config, key):
    _, vjp = jax.vjp(lambda w: fp4.dot_general(
        x, w, MATMUL, config=config, key=key), w)
    return vjp(g)[0]

  keys = jax.random.split(jax.random.key(5), BIAS_SEEDS)
  draws = np.asarray(jax.jit(jax.vmap(functools.partial(wgrad, sr)))(keys),
                     np.float64)
  mean = draws.mean(axis=0)
  rtn_dw = np.asarray(jax.jit(functools.partial(wgrad, rtn))(None), np.float64)
  # Target: the transformed exact gradient against the RTN-quantized,
  # transformed activation (what SR's expectation is, up to truncation).
  hg = ref.rht(g.T).astype(np.float64)                 # (N, M)
  xq, ts = _quantized(ref.rht(x.T), "nvfp4")           # (K, M)
  xq = xq.astype(np.float64) * ts
  target = (hg @ xq.T).T                               # (K, N)
  # Per element: sum_m xq^2 * (gap_m / 2)^2 bounds the variance of one draw;
  # gap_m <= 2 * (g's block scale * tensor scale) (the widest E2M1 spacing).
  _, g_scales, g_ts = ref.nvfp4(ref.rht(g.T))
  gap = 2 * np.repeat(g_scales.astype(np.float64), 16, axis=-1) * g_ts  # (N, M)
  var = (gap ** 2 / 4) @ (xq ** 2).T                  # (N, K)
  sigma = np.sqrt(var.T / BIAS_SEEDS)
  truncation = ((gap / 256) @ np.abs(xq).T).T
  assert np.all(np.abs(mean - target) <= 5 * sigma + truncation)
  sr_bias = np.linalg.norm(mean - target) / np.linalg.norm(target)
  rtn_bias = np.linalg.norm(rtn_dw - target) / np.linalg.norm(target)
  assert sr_bias < 0.5 * rtn_bias, (sr_bias, rtn_bias)


# ---------------------------------------------------------------------------
# The program: float32 accumulation, the CUDA block-scaled dot.
# ---------------------------------------------------------------------------


def _dot_operand_types(jaxpr):
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is jax.lax.dot_general_p:
        found.append((tuple(str(v.aval.dtype) for v in eqn.invars),
                      eqn.params["preferred_element_type"]))
      for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") \
          else []:
        visit(sub)
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          visit(inner)
  visit(jaxpr.jaxpr)
  return found


def test_every_dot_accumulates_in_float32():
  config = fp4.Fp4Config(native=False)
  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp4.dot_general(
      x, w, MATMUL, config=config).astype(jnp.float32).sum(), (0, 1)))(x, w)
  dots = _dot_operand_types(jaxpr)
  assert len(dots) >= 3, dots
  assert all(pref == jnp.float32 for _, pref in dots), dots


@pytest.mark.parametrize("recipe,scale_type", default_run_keeps([("nvfp4", "f8E4M3FN"),
                                                                 ("mxfp4", "f8E8M0FNU")], unpack=True))
def test_cuda_program_runs_fp4_operands_through_the_block_scaled_dot(
    recipe, scale_type):
  config = fp4.Fp4Config(recipe)

  def step(x, w, key):
    return jax.value_and_grad(lambda x, w: fp4.dot_general(
        x, w, MATMUL, config=config, key=key).sum(), (0, 1))(x, w)

  # Distinct shapes per product, so that no two calls share one function.
  args = (jnp.ones((48, 64)), jnp.ones((64, 32)), jax.random.key(0))
  jitted = jax.jit(step)  # one trace for both platforms
  exported = jax.export.export(
      jitted, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          "__op$block_scaled_dot")])(*args)
  calls = [line for line in exported.mlir_module().splitlines()
           if "@__op$block_scaled_dot" in line]
  assert len(calls) == 3, calls  # forward, dgrad, wgrad
  for line in calls:
    assert line.count("xf4E2M1FN>") >= 2, line
    assert line.count(f"x{scale_type}>") >= 2, line
    assert "host_callback" not in line
  # The CPU program has none of it.
  cpu = jitted.lower(*args).as_text()
  assert "block_scaled_dot" not in cpu


# ---------------------------------------------------------------------------
# Config and errors.
# ---------------------------------------------------------------------------


def test_config_canonical_and_hashable():
  assert fp4.Fp4Config(" NVFP4 ") == fp4.Fp4Config()
  assert hash(fp4.Fp4Config("mxfp4")) == hash(
      fp4.Fp4Config("mxfp4", mx_scale_rule="ROUND_UP"))
  assert fp4.Fp4Config("mxfp4").two_d_weights is False
  assert fp4.Fp4Config().two_d_weights is True
  assert fp4.Fp4Config().block_size == 16
  assert fp4.Fp4Config("mxfp4").block_size == 32


def test_config_errors():
  with pytest.raises(ValueError, match="unknown recipe 'nvfp'.*'nvfp4'"):
    fp4.Fp4Config("nvfp")
  with pytest.raises(TypeError, match="recipe must be a string"):
    fp4.Fp4Config(4)
  with pytest.raises(TypeError, match="rht must be True or False.*'no'"):
    fp4.Fp4Config(rht="no")
  with pytest.raises(ValueError, match="two_d_weights=True.*mxfp4"):
    fp4.Fp4Config("mxfp4", two_d_weights=True)
  with pytest.raises(ValueError, match="mx_scale_rule='floor'.*nvfp4"):
    fp4.Fp4Config("nvfp4", mx_scale_rule="floor")
  with pytest.raises(ValueError, match="Unknown MXFP4 scale rule"):
    fp4.Fp4Config("mxfp4", mx_scale_rule="nearest")
  with pytest.raises(TypeError, match="disable_rht"):
    fp4.Fp4Config(disable_rht=True)  # pylint: disable=unexpected-keyword-arg


def test_matmul_errors():
  """The one dtype validator refuses narrow and integer operands and results
  (naming which); JAX reports a bad key where the backward pass uses it."""
  x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
  with pytest.raises(ValueError, match="lhs must be one of float32.*got "
                     "float4_e2m1fn.*quantize their operands"):
    fp4.dot_general(x.astype(jnp.float4_e2m1fn), w, MATMUL)
  with pytest.raises(ValueError, match="rhs must be.*got float8_e4m3fn"):
    fp4.dot_general(x, w.astype(jnp.float8_e4m3fn), MATMUL)
  with pytest.raises(ValueError, match="lhs must be.*got int32"):
    fp4.dot_general(x.astype(jnp.int32), w, MATMUL)
  with pytest.raises(ValueError, match="preferred_element_type must be.*got "
                     "float4_e2m1fn"):
    fp4.dot_general(x, w, MATMUL, preferred_element_type=jnp.float4_e2m1fn)
  with pytest.raises(TypeError, match="config must be an Fp4Config"):
    fp4.dot_general(x, w, MATMUL, config="nvfp4")
  with pytest.raises(TypeError, match="contracting (dimensions to have the "
                     "same|axes have sizes)"):
    fp4.dot_general(x, w, (((0,), (0,)), ((), ())))
  with pytest.raises(TypeError, match="PRNG key"):
    jax.grad(lambda w: fp4.dot_general(x, w, MATMUL, key=0).sum())(w)


def test_second_derivatives_are_refused():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
  loss = lambda x, w: fp4.dot_general(x, w, MATMUL).sum()
  with pytest.raises(ValueError, match="no second derivative"):
    jax.grad(lambda x: jax.grad(loss, 1)(x, w).sum())(x)


def test_vmap_over_keys_and_operands():
  config = fp4.Fp4Config()
  x, w = jnp.asarray(_random((3, 16, 32), 24)), jnp.asarray(_random((32, 16),
                                                                    25))
  product = jax.jit(lambda x: fp4.dot_general(x, w, MATMUL, config=config))
  y = jax.jit(jax.vmap(product))(x)
  for i in range(3):
    _same(y[i], product(x[i]))  # one program for the three slices


# Op by op under jax_debug_nans/infs: a whole program's run (the slow stage).
@pytest.mark.slow
def test_finite_inputs_create_no_nan_or_inf_anywhere():
  """Op by op under jax_debug_nans/jax_debug_infs: zeros, an all-zero block
  and tiny magnitudes create no intermediate NaN or inf. (The matmul is one
  jitted function, whose intermediates jax_debug_nans does not see:
  jax.disable_jit runs it op by op.)"""
  x = _random((16, 32), 26, 1e-3)
  x[0, :16] = 0.0
  w, g = _random((32, 16), 27), _random((16, 16), 28)
  with jax.debug_nans(True), jax.debug_infs(True), jax.disable_jit():
    for config in (fp4.Fp4Config(), fp4.Fp4Config("mxfp4")):
      y, vjp = jax.vjp(lambda x, w: fp4.dot_general(
          x, w, MATMUL, config=config), x, w)
      vjp(g)
      fp4.dot_general(np.zeros_like(x), w, MATMUL, config=config)
    fp4_lib.quantize_nvfp4(np.zeros((16, 16), F32), two_d=True)
    fp4_lib.dequantize_fp4(fp4_lib.quantize_mxfp4(np.zeros((32,), F32)))


# ---------------------------------------------------------------------------
# Data parallel: NVFP4's tensor amaxes over an axis_name.
# ---------------------------------------------------------------------------

_N_DEV = 8
_EXACT = dict(stochastic_rounding=False)  # no random bits: shard-independent


def _sharded_data():
  """x (8 replicas x 16 rows, 32), one replica holding an outlier; w, g."""
  x = _random((_N_DEV * 16, 32), 40)
  x[3 * 16 + 2, 5] = 300.0
  return x, _random((32, 16), 41), _random((_N_DEV * 16, 16), 42)


def _per_replica(fn, *args):
  """fn(x_shard, w, g_shard) on 8 replicas under shard_map, stacked."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:_N_DEV]), ("data",))
  spec = jax.sharding.PartitionSpec
  body = lambda x, w, g: jax.tree.map(lambda v: v[None], fn(x, w, g))
  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(spec("data"), spec(), spec("data")),
      out_specs=spec("data")))(*args)


def test_axis_name_makes_nvfp4_tensor_scales_global():
  """Replicas with different data get the same per-tensor scale (the
  unsharded tensor's), and the product and both gradients equal the
  unsharded computation's; without the axis each replica scales its own
  shard."""
  x, w, g = _sharded_data()

  def run(config):
    def fn(x, w, g):
      y, vjp = jax.vjp(lambda x, w: fp4.dot_general(
          x, w, MATMUL, config=config), x, w)
      scale = fp4_matmul._quantize(x[None], config).tensor_scale  # pylint: disable=protected-access
      return (y,) + vjp(g) + (scale,)
    return [np.asarray(v) for v in _per_replica(fn, x, w, g)]

  config = fp4.Fp4Config(axis_name="data", **_EXACT)
  y, dx, dw, scale = run(config)
  want_y, want_dx, want_dw = _value_and_grads(fp4.Fp4Config(**_EXACT), x, w,
                                              g)
  whole = jax.jit(fp4_lib.nvfp4_quantize_f32)(jnp.asarray(x))[2]
  np.testing.assert_array_equal(scale, np.full(_N_DEV, whole))
  _same(y.reshape(want_y.shape), want_y)
  _same(dx.reshape(want_dx.shape), want_dx)
  # The replicated weight's gradient: the sum of the replicas' FP4 products
  # (shard_map's psum), the unsharded one up to float32 summation order.
  for replica in dw:
    np.testing.assert_allclose(replica, want_dw, rtol=1e-5, atol=1e-6)
  local_y, _, _, local_scale = run(fp4.Fp4Config(**_EXACT))
  assert len(set(local_scale.tolist())) > 1
  assert not np.array_equal(local_y.reshape(want_y.shape), want_y)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_axis_name_shares_a_nan_with_every_replica(recipe):
  """A NaN on one replica makes every replica's product NaN, as unsharded."""
  x, w, g = _sharded_data()
  x[5 * 16, 0] = np.nan
  config = fp4.Fp4Config(recipe, axis_name="data", **_EXACT)
  y = _per_replica(lambda x, w, g: fp4.dot_general(
      x, w, MATMUL, config=config), x, w, g)
  assert np.isnan(np.asarray(y)).all()


def test_unbound_axis_name_teaches():
  config = fp4.Fp4Config(axis_name="data")
  with pytest.raises(ValueError, match=r"Fp4Config\(axis_name='data'\).*"
                     r"jax.pmap or jax.shard_map.*jax.jit with sharded arrays"):
    fp4.dot_general(jnp.ones((16, 32)), jnp.ones((32, 16)), MATMUL,
                        config=config)
  with pytest.raises(TypeError, match="axis_name"):
    fp4.Fp4Config(axis_name=0)
  assert fp4.Fp4Config(axis_name=["a", "b"]).axis_name == ("a", "b")
  assert fp4.Fp4Config(axis_name=["a", "b"]).spec() == "nvfp4(axis_name=(a|b))"
  hash(fp4.Fp4Config(axis_name=["a", "b"]))
  # In a policy: written and read back with its case; an axis name the
  # grammar cannot write is refused, as float8's.
  policy = jmp_lite.get_policy("c=bf16,m=nvfp4(axis_name=(Data|fsdp))")
  assert policy.fp8_recipe == fp4.Fp4Config(axis_name=("Data", "fsdp"))
  assert jmp_lite.get_policy(str(policy)) == policy
  with pytest.raises(ValueError, match="axis_name='a b' cannot be written"):
    jmp_lite.Policy("f32", "bf16", "f32",
                    matmul_precision=fp4.Fp4Config(axis_name="a b"))
