"""The float8 dot_general: forward, custom backward, transformations, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp4
from jmp_lite._src import low_precision as fp8

from helpers import all_eqns
from helpers import lowered_functions

from test_fp8_reference import codes_to_float
from test_fp8_reference import current_scale
from test_fp8_reference import quantize_blocks_ref
from test_fp8_reference import quantize_mx_ref
from helpers import default_run_keeps

DENSE = (((1,), (0,)), ((), ()))
U4, U5 = 2.0**-4, 2.0**-3  # unit roundoffs of e4m3 and e5m2


def _data(shape, seed, spread=3.0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, shape))
  return x.astype(np.float32)


X = _data((8, 96), 0)           # (M, K)
W = _data((96, 40), 1)          # (K, N)
G = _data((8, 40), 2, 1.0)      # (M, N): the incoming gradient


def _config(granularity, **kwargs):
  if granularity == "blockwise":
    kwargs.setdefault("block_size", 32)
  return fp8.Fp8Config(granularity=granularity, **kwargs)


@functools.lru_cache(maxsize=None)
def _vjp_fn(config):
  """jit(x, w, g -> (y, dx, dw)) for a config: one compile per config."""
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, DENSE,
                                                      config=config), x, w)
    return (y,) + vjp(g)
  return jax.jit(run)


# ---------------------------------------------------------------------------
# An independent reference: operands quantized and dequantized by the numpy
# quantizers of test_fp8_reference, multiplied exactly in float64.
#
# The float8 products and the power-of-two scalings are exact in float32, so
# the matmul differs from the exact product of the dequantized operands only
# by float32 accumulation, at most C * 2**-24 * (|a| @ |b|) for C contracting
# elements in any summation order. XLA:CPU picks the order (and the kernel)
# per compiled program, so two separately compiled float32 dots need not
# agree bit for bit; on data whose sums are exact in float32 in every order
# the result is checked bit for bit.
# ---------------------------------------------------------------------------


def _deq(x, fmt, kind, t=32):
  """x (P, C) quantized for a product over C, dequantized (float64)."""
  p, c = x.shape
  if kind == "mx":
    padded = np.zeros((p, -(-c // 32) * 32), np.float32)
    padded[:, :c] = x
    codes, scale_codes = quantize_mx_ref(padded, fmt)
    scale = np.exp2(scale_codes.astype(np.float64) - 127).repeat(32, axis=1)
    return (codes_to_float(codes, fmt) * scale)[:, :c]
  block = {"tensor": (p, c), "row": (1, c), "tile": (1, t),
           "block": (t, t)}[kind]
  codes, scale, _ = quantize_blocks_ref(x, fmt, block)
  full = scale.astype(np.float64).repeat(block[0], 0).repeat(block[1], 1)
  return codes_to_float(codes, fmt) * full[:p, :c]


def _ref_product(a, b, fmt_a, fmt_b, kinds, t=32):
  """(P, C) x (Q, C) -> exact (P, Q) and |a| @ |b|, of the dequantized
  operands quantized as `kinds`."""
  da, db = _deq(a, fmt_a, kinds[0], t), _deq(b, fmt_b, kinds[1], t)
  return da @ db.T, np.abs(da) @ np.abs(db).T


def _assert_float32_dot_of(got, ref, c):
  exact, magnitude = ref
  got = np.asarray(got, np.float64)
  assert np.all(np.abs(got - exact) <= (c + 2) * 2.0**-24 * magnitude), (
      np.max(np.abs(got - exact) / (magnitude + 1e-300)))


_KINDS = {  # forward, dgrad, wgrad: (kind of first operand, of second)
    "tensor": [("tensor",) * 2] * 3,
    "row": [("row",) * 2] * 3,
    "blockwise": [("tile", "block"), ("tile", "block"), ("tile", "tile")],
    "mxfp8": [("mx",) * 2] * 3,
}


def _check_against_reference(granularity, x, w, g, exact=False):
  y, dx, dw = _vjp_fn(_config(granularity))(x, w, g)
  fwd, dgrad, wgrad = _KINDS[granularity]
  refs = [(y, _ref_product(x, w.T, "e4m3", "e4m3", fwd), x.shape[1]),
          (dx, _ref_product(g, w, "e5m2", "e4m3", dgrad), w.shape[1]),
          (dw.T, _ref_product(g.T, x.T, "e5m2", "e4m3", wgrad), x.shape[0])]
  for got, ref, c in refs:
    if exact:
      np.testing.assert_array_equal(np.asarray(got), ref[0].astype(np.float32))
    else:
      _assert_float32_dot_of(got, ref, c)


_GRANULARITIES = ["tensor", "row", "blockwise", "mxfp8"]


@pytest.mark.parametrize("granularity", default_run_keeps(_GRANULARITIES))
def test_forward_and_backward_are_float32_dots_of_the_reference(granularity):
  """Forward: the e4m3 operands. Backward: g in e5m2 times the other operand
  requantized along the backward matmul's contracting dimension (dx
  contracts over N, dw over M)."""
  _check_against_reference(granularity, X, W, G)


def _exactly_summable(shape, seed, row_spread, col_spread):
  """Values m * 2**e, m in [1, 2) with a full mantissa (quantizing rounds
  them), e spanning a few binades: every float8 product has at most 8
  significant bits within a few binades of the others, so every partial sum
  of up to 96 of them is exact in float32."""
  rng = np.random.default_rng(seed)
  e = (rng.integers(0, 3, shape) + rng.integers(-row_spread, row_spread + 1,
                                                (shape[0], 1))
       + rng.integers(-col_spread, col_spread + 1, (1, shape[1])))
  m = rng.uniform(1, 2, shape) * rng.choice([-1.0, 1.0], shape)
  return (m * np.exp2(e)).astype(np.float32)


@pytest.mark.parametrize("granularity", _GRANULARITIES)
def test_bitwise_where_float32_sums_are_exact(granularity):
  x = _exactly_summable((8, 96), 10, 1, 0)
  w = _exactly_summable((96, 40), 11, 0, 1)
  g = _exactly_summable((8, 40), 12, 0, 0)
  _check_against_reference(granularity, x, w, g, exact=True)


def test_blockwise_ragged_contracting_dimension_is_zero_padded():
  # K = 80 = 2.5 blocks of 32; dx contracts over N = 40 (ragged too), dw
  # over M = 8 (a single partial tile).
  _check_against_reference("blockwise", X[:, :80], W[:80], G)


def test_mx_ragged_contracting_dimension_is_zero_padded():
  # K = 70, N = 40, M = 8: every contraction has a partial block.
  _check_against_reference("mxfp8", X[:, :70], W[:70], G)


def test_e4m3_everywhere_and_non_power_of_two_scales():
  config = _config("row", gradient_format="e4m3", power_of_two_scales=False)
  y, dx, _ = _vjp_fn(config)(X, W, G)
  # Without power-of-two scales the quantizer's own (tested) scales are used.
  dq = jax.jit(lambda a: fp8.dequantize(fp8.quantize(
      a, "e4m3", "row", power_of_two=False)))
  for got, a, b in ((y, X, W.T), (dx, G, W)):
    da, db = (np.asarray(dq(v), np.float64) for v in (a, b))
    _assert_float32_dot_of(got, (da @ db.T, np.abs(da) @ np.abs(db).T),
                           a.shape[1])


@pytest.mark.parametrize("granularity", ["tensor", "row", "blockwise",
                                         "mxfp8"])
def test_close_to_float32(granularity):
  """|y - x @ w| <= ex @ |w| + |x| @ ew + ex @ ew (+ float32 rounding),
  where e = u |.| + s * min_subnormal / 2 bounds each operand's error. The
  gradients: relative Frobenius error within 2**-3 + 2**-4 (the unit
  roundoffs of e5m2 and e4m3, a product's worst case)."""
  y, dx, dw = _vjp_fn(_config(granularity))(X, W, G)
  x64, w64, g64 = (a.astype(np.float64) for a in (X, W, G))
  # Per-element error bounds of the forward operands (per-tensor scales are
  # the coarsest: they bound every granularity's error from above).
  sx = float(current_scale(np.abs(X).max(), 448.0))
  sw = float(current_scale(np.abs(W).max(), 448.0))
  ex = U4 * np.abs(x64) + sx * 2.0**-10
  ew = U4 * np.abs(w64) + sw * 2.0**-10
  bound = ex @ np.abs(w64) + np.abs(x64) @ ew + ex @ ew
  bound += 96 * 2.0**-23 * (np.abs(x64) @ np.abs(w64))
  assert np.all(np.abs(np.asarray(y, np.float64) - x64 @ w64) <= bound)
  for got, ref in ((dx, g64 @ w64.T), (dw, x64.T @ g64)):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - ref) <= (U4 + U5) * np.linalg.norm(ref)


# ---------------------------------------------------------------------------
# Dimension numbers and dtypes.
# ---------------------------------------------------------------------------

_DN_CASES = [
    # Dense on a (batch, seq, features) input.
    ((2, 4, 48), (48, 16), (((2,), (0,)), ((), ()))),
    # Attention scores: (B, H, T, D) x (B, H, S, D), batch (B, H).
    ((2, 3, 5, 32), (2, 3, 7, 32), (((3,), (3,)), ((0, 1), (0, 1)))),
    # Batch axes not leading, listed out of order.
    ((5, 2, 3, 32), (3, 32, 2, 4), (((3,), (1,)), ((2, 1), (0, 2)))),
    # Two contracting axes, a contracting axis first on the rhs.
    ((4, 6, 8), (6, 8, 5), (((1, 2), (0, 1)), ((), ()))),
    # Vector dot: no free axes.
    ((64,), (64,), (((0,), (0,)), ((), ()))),
]


def _per_tensor_deq(a, fmt="e4m3"):
  codes, scale, _ = quantize_blocks_ref(a, fmt, a.shape)
  return (codes_to_float(codes, fmt) * float(scale.reshape(()))).astype(
      np.float32)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn", _DN_CASES)
def test_general_dimension_numbers(lhs_shape, rhs_shape, dn):
  lhs = _data(lhs_shape, 3, 1.0)
  rhs = _data(rhs_shape, 4, 1.0)
  config = _config("tensor")

  @jax.jit
  def run(lhs, rhs, lhs_q, rhs_q):
    f = lambda a, b: fp8.fp8_dot_general(a, b, dn, config=config)
    y, vjp = jax.vjp(f, lhs, rhs)
    y32, vjp32 = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs)
    ones = jnp.ones_like(y)
    # Per-tensor quantization does not depend on the layout: the product is
    # the float32 dot_general of the dequantized operands.
    ref = jax.lax.dot_general(lhs_q, rhs_q, dn)
    mag = jax.lax.dot_general(jnp.abs(lhs_q), jnp.abs(rhs_q), dn)
    return y, ref, mag, y32, vjp(ones), vjp32(ones)

  y, ref, mag, y32, grads, grads32 = run(lhs, rhs, _per_tensor_deq(lhs),
                                         _per_tensor_deq(rhs))
  assert y.shape == y32.shape and y.dtype == jnp.float32
  contracted = int(np.prod([lhs_shape[d] for d in dn[0][0]]))
  assert np.all(np.abs(np.asarray(y) - np.asarray(ref)) <=
                2 * (contracted + 2) * 2.0**-24 * np.asarray(mag))
  for got, want in zip(grads, grads32):
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= (U4 + U5) * np.linalg.norm(want)


@pytest.mark.parametrize("lhs_dtype,rhs_dtype,kwargs,expected", [
    (jnp.bfloat16, jnp.bfloat16, {}, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, {}, jnp.float32),
    (jnp.float16, jnp.float16, {"preferred_element_type": jnp.float32},
     jnp.float32),
    (jnp.float32, jnp.float32, {"compute_dtype": "bf16"}, jnp.bfloat16),
    (jnp.float32, jnp.float32, {"compute_dtype": "bf16",
                                "preferred_element_type": jnp.float16},
     jnp.float16),
])
def test_result_and_gradient_dtypes(lhs_dtype, rhs_dtype, kwargs, expected):
  kwargs = dict(kwargs)
  config = fp8.Fp8Config(compute_dtype=kwargs.pop("compute_dtype", None))
  x = jnp.asarray(X[:, :32]).astype(lhs_dtype)
  w = jnp.asarray(W[:32, :16]).astype(rhs_dtype)

  @jax.jit
  def run(x, w):
    f = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, config=config,
                                         **kwargs)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(jnp.ones_like(y))

  y, dx, dw = run(x, w)
  assert y.dtype == expected
  assert dx.dtype == lhs_dtype and dw.dtype == rhs_dtype
  ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  assert np.linalg.norm(np.asarray(y, np.float32) - ref) <= (
      2 * U4 * np.linalg.norm(ref))


# ---------------------------------------------------------------------------
# Transformations.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", default_run_keeps(["tensor", "mxfp8"]))
def test_grad_under_jit_vmap_checkpoint_and_scan(granularity):
  """Per tensor (float8 residuals) and MX (the platform switch and its vmap
  rule); the other granularities share their code with one or the other."""
  config = _config(granularity)
  dot = functools.partial(fp8.fp8_dot_general, dimension_numbers=DENSE,
                          config=config)
  xs = jnp.asarray(_data((3, 4, 64), 5, 1.0))
  ws = jnp.asarray(_data((2, 64, 64), 6, 1.0) * 0.1)
  loss = lambda h: jnp.sum(h * h)

  def unrolled(x, ws):
    return loss(dot(dot(x, ws[0]), ws[1]))

  def scanned_remat(x, ws):
    step = jax.checkpoint(lambda h, w: (dot(h, w), None))
    return loss(jax.lax.scan(step, x, ws)[0])

  @jax.jit
  def all_grads(xs, ws):
    grad = jax.grad(unrolled, argnums=(0, 1))
    looped = jax.lax.map(lambda x: grad(x, ws), xs)
    vmapped = jax.vmap(grad, in_axes=(0, None))(xs, ws)
    scanned = jax.grad(scanned_remat, argnums=(0, 1))(xs[0], ws)
    ref = jax.grad(lambda x, ws: loss(x @ ws[0] @ ws[1]), argnums=(0, 1))(
        xs[0], ws)
    return looped, vmapped, scanned, ref

  looped, vmapped, scanned, ref = all_grads(xs, ws)
  # vmap: each example quantized on its own, as in a loop over examples;
  # scan with checkpoint computes the float8 products of the unrolled layers.
  # (Equal up to float32 summation order, which XLA picks per fusion.)
  same = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  for a, b in zip(vmapped, looped):
    same(np.asarray(a), np.asarray(b))
  for a, b in zip(scanned, looped):
    same(np.asarray(a), np.asarray(b[0]))
  # ... and those are close to the float32 gradients.
  for a, b in zip(scanned, ref):
    assert np.all(np.isfinite(np.asarray(a)))
    assert np.linalg.norm(a - b) <= 2 * (U4 + U5) * np.linalg.norm(b)


# ---------------------------------------------------------------------------
# Edge values.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "row", "blockwise",
                                         "mxfp8"])
def test_edge_values(granularity):
  run = _vjp_fn(_config(granularity))
  zeros = np.zeros_like(X)
  y, dx, dw = run(zeros, W, G)
  assert not np.any(np.isnan(np.asarray(y))) and np.all(np.asarray(y) == 0)
  assert np.all(np.asarray(dw) == 0) and np.all(np.isfinite(np.asarray(dx)))
  # Outliers far beyond 448 and near float32's max: no NaN, and a finite
  # product where the exact one is finite. (MX emulation dequantizes first:
  # a value within 2**-5 of float32's max rounds to 256 * 2**120 = inf, as
  # the MX format defines it.)
  big = X.copy()
  big[0, :4] = [3.4028235e38, -3e38, 1e30, 1e6]
  w_small = (W * 1e-30).astype(np.float32)
  y, dx, dw = run(big, w_small, G)
  for a in (y, dx, dw):
    assert not np.any(np.isnan(np.asarray(a)))
  finite = np.isfinite(np.asarray(y))
  assert np.all(finite[1:]) and (granularity == "mxfp8" or np.all(finite))
  big[0, 0] = 3e38
  y, _, _ = run(big, w_small, G)
  assert np.all(np.isfinite(np.asarray(y)))
  # A NaN in an operand makes the product non-finite (loss scaling sees it).
  bad = X.copy()
  bad[2, 5] = np.nan
  y, dx, dw = run(bad, W, G)
  assert np.isnan(np.asarray(y)[2]).any()
  assert not np.all(np.isfinite(np.asarray(dw)))
  # So does an infinite incoming gradient: never saturated to a finite max.
  g_inf = G.copy()
  g_inf[1, 1] = np.inf
  _, dx, dw = run(X, W, g_inf)
  assert not np.all(np.isfinite(np.asarray(dx)))
  assert not np.all(np.isfinite(np.asarray(dw)))


def test_empty_operands_and_no_retracing():
  @jax.jit
  def run(x, w):
    f = lambda x, w: fp8.fp8_dot_general(x, w, DENSE, config=_config("row"))
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(jnp.ones_like(y))

  # K = 0: the product is zeros, and so are the gradients.
  y, dx, dw = run(jnp.ones((4, 0)), jnp.ones((0, 8)))
  assert y.shape == (4, 8) and np.all(np.asarray(y) == 0)
  assert dx.shape == (4, 0) and dw.shape == (0, 8)
  y, dx, dw = run(jnp.ones((0, 16)), jnp.ones((16, 8)))
  assert y.shape == (0, 8) and np.all(np.asarray(dw) == 0)
  # A second step with new values of the same shapes compiles nothing.
  fn = _vjp_fn(_config("tensor"))
  fn(X, W, G)
  before = fn._cache_size()  # pylint: disable=protected-access
  fn(X * 2, W, G * 3)
  assert fn._cache_size() == before  # pylint: disable=protected-access


@pytest.mark.parametrize("matmul", [
    functools.partial(fp8.fp8_dot_general, config=fp8.Fp8Config()),
    functools.partial(fp4.dot_general, config=fp4.Fp4Config(
        "nvfp4", stochastic_rounding=False))], ids=["fp8", "fp4"])
def test_the_product_is_inlined_into_a_jitted_forward(matmul):
  """The quantized product is a jitted function (one program for an eager
  call) with inline=True: a jitted forward's program holds its operations,
  not a function called for it, and an eager call gives the jitted
  result. (A backward pass may keep it as a call: jax's partial evaluation
  stages the product's linear part as its own jit, which XLA inlines.)"""
  forward = lambda x, w: matmul(x, w, DENSE)
  functions = lowered_functions(forward, X, W)
  assert not [f for f in functions if f.startswith("_canonical_product")], (
      functions)
  np.testing.assert_array_equal(forward(X, W), jax.jit(forward)(X, W))


def test_repeated_matmuls_trace_forward_and_backward_once(monkeypatch):
  """Matmuls of the same shapes and config (a deep model's blocks) share one
  trace of the quantized product and one of its backward pass (a
  custom_vjp's bwd runs per call site; it is a jitted function): four
  matmuls quantize as often while tracing as one does."""
  from jmp_lite._src.low_precision import scaling  # pylint: disable=g-import-not-at-top
  calls = []
  quantize_blocks = scaling.quantize_blocks

  def counting(x, *args, **kwargs):
    calls.append(x.shape)
    return quantize_blocks(x, *args, **kwargs)

  monkeypatch.setattr(scaling, "quantize_blocks", counting)

  def traced(n, rows):  # shapes no other test uses: nothing is cached yet
    def loss(w, x):
      for _ in range(n):
        x = fp8.fp8_dot_general(x, w, DENSE)
      return x.sum()
    calls.clear()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(
        jnp.ones((48, 48)), jnp.ones((rows, 48)))
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3 * n  # each matmul keeps its own three products
    return len(calls)

  assert traced(4, 5) == traced(1, 7) <= 5, calls


# Op by op under jax_debug_nans/infs: a whole program's run (the slow stage).
@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["tensor", "row", "blockwise"])
def test_finite_inputs_create_no_nan_or_inf_anywhere(granularity):
  """Op by op (jax.disable_jit) under jax_debug_nans/jax_debug_infs: typical
  data, an all-zero row and an all-zero operand create no intermediate NaN
  or inf, forward and backward. (A scale product that overflows is a
  non-finite scalar nowhere: huge and tiny scales lie on either side of 1.)"""
  config = _config(granularity)
  x = X[:, :64].copy()
  x[0] = 0.0
  w, g = W[:64], G
  with jax.debug_nans(True), jax.debug_infs(True), jax.disable_jit():
    for lhs in (x, np.zeros_like(x)):
      _, vjp = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DENSE,
                                                        config=config), lhs, w)
      vjp(g)


def test_per_tensor_dense_matmul_transposes_nothing():
  """Per tensor, a Dense matmul's operands and gradients keep their layouts:
  x (M, K) and w (K, N) are quantized as they are, and the three products
  contract where they must (the weight gradient's result comes back
  transposed, a float32 (N, K) -> (K, N) that XLA folds into the dot)."""
  def loss(x, w):
    return fp8.fp8_dot_general(x, w, DENSE).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(X, W)
  eqns = list(all_eqns(jaxpr))  # jax 0.12 keeps the jitted kernels as calls
  transposes = [e for e in eqns if e.primitive.name == "transpose"]
  assert [e.invars[0].aval.dtype for e in transposes] == [jnp.float32]
  dots = [tuple(str(v.aval.dtype) for v in e.invars)
          for e in eqns if e.primitive.name == "dot_general"]
  assert dots == [("float8_e4m3fn",) * 2,
                  ("float8_e5m2", "float8_e4m3fn"),
                  ("float8_e5m2", "float8_e4m3fn")]


# ---------------------------------------------------------------------------
# Delayed scaling.
# ---------------------------------------------------------------------------

_DELAYED = fp8.Fp8Config(scaling="delayed")


@jax.jit
def _delayed(x, w, scales, g):
  f = lambda x, w, s: fp8.fp8_dot_general(x, w, DENSE, config=_DELAYED,
                                          scales=s)
  y, vjp = jax.vjp(f, x, w, scales)
  return (y,) + vjp(g)


def test_delayed_scaling_uses_given_scales_and_reports_amaxes():
  scales = fp8.DelayedScales(jnp.float32(2.0), jnp.float32(0.5),
                             jnp.float32(2.0**-10))
  y, dx, dw, amaxes = _delayed(X, W, scales, G)
  dq = lambda a, fmt, s: codes_to_float(quantize_blocks_ref(
      a, fmt, a.shape, scale=s)[0], fmt) * s
  xq, wq, gq = dq(X, "e4m3", 2.0), dq(W, "e4m3", 0.5), dq(G, "e5m2", 2.0**-10)
  ref = lambda a, b: (a @ b.T, np.abs(a) @ np.abs(b).T)
  _assert_float32_dot_of(y, ref(xq, wq.T), 96)
  _assert_float32_dot_of(dx, ref(gq, wq), 40)
  _assert_float32_dot_of(dw.T, ref(gq.T, xq.T), 8)
  # The cotangent of the scales holds the amaxes this call observed.
  assert isinstance(amaxes, fp8.DelayedScales)
  assert float(amaxes.lhs) == np.abs(X).max()
  assert float(amaxes.rhs) == np.abs(W).max()
  assert float(amaxes.grad) == np.abs(G).max()


def test_delayed_scaling_saturates_without_nan_and_keeps_overflow_visible():
  tiny = fp8.DelayedScales(*(jnp.float32(1e-6),) * 3)
  y, dx, dw, _ = _delayed(X, W, tiny, G)
  for a in (y, dx, dw):
    assert np.all(np.isfinite(np.asarray(a)))
  g_inf = G.copy()
  g_inf[0, 0] = -np.inf
  _, dx, dw, amaxes = _delayed(X, W, tiny, g_inf)
  assert not np.all(np.isfinite(np.asarray(dw)))
  assert np.isinf(float(amaxes.grad))


def test_delayed_scales_are_required_and_checked():
  with pytest.raises(TypeError, match="DelayedScales"):
    fp8.fp8_dot_general(X, W, DENSE, config=_DELAYED)
  with pytest.raises(ValueError, match=r"scales.rhs must be a scalar.*\(2,\)"):
    fp8.fp8_dot_general(X, W, DENSE, config=_DELAYED, scales=fp8.DelayedScales(
        jnp.float32(1), jnp.ones(2), jnp.float32(1)))
  with pytest.raises(ValueError, match="current scaling"):
    fp8.fp8_dot_general(X, W, DENSE, scales=fp8.DelayedScales(1.0, 1.0, 1.0))


def test_delayed_scales_that_are_not_usable():
  # A Python/NumPy constant is refused where it is given...
  for bad in (0.0, -1.0, np.inf, np.nan, np.float32(1e-40)):
    with pytest.raises(ValueError, match="scales.lhs must be positive, finite"):
      fp8.fp8_dot_general(X, W, DENSE, config=_DELAYED,
                          scales=fp8.DelayedScales(bad, 1.0))
  # ...a JAX array (traced here) falls back to current scaling, per operand.
  current = _vjp_fn(fp8.Fp8Config())(X, W, G)
  for bad in (0.0, -2.0, np.inf, np.nan):
    scales = fp8.DelayedScales(jnp.float32(bad), jnp.float32(bad),
                               jnp.float32(bad))
    y, dx, dw, _ = _delayed(X, W, scales, G)
    for got, want in zip((y, dx, dw), current):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_scales_are_applied_so_that_a_representable_result_is_right():
  # amax_x * amax_w ~ 1e-34: the product of the two scales (~5e-40) is not a
  # normal float32, the result (~1e-33) is.
  x, w = X / np.abs(X).max() * 1e-17, W / np.abs(W).max() * 1e-17
  for config in (fp8.Fp8Config(), _config("row"), _config("blockwise"),
                 fp8.Fp8Config(power_of_two_scales=False)):
    y, dx, dw = _vjp_fn(config)(x, w, G)
    ref = x.astype(np.float64) @ w
    assert np.linalg.norm(y - ref) <= 2 * U4 * np.linalg.norm(ref), config
    assert np.all(np.isfinite(np.asarray(dx))) and np.any(np.asarray(dx))
  # The rule itself, where the scales' product underflows or overflows and
  # the result does not (and is exact: powers of two), and where it is a
  # normal float32 (one multiplication, as before).
  from jmp_lite._src.low_precision import fp8_matmul as matmul_lib  # pylint: disable=import-outside-toplevel
  acc = jnp.array([2.0**-100, 2.0**100, 3 * 2.0**30, 0.0], jnp.float32)
  a = jnp.array([2.0**100, 2.0**-100, 2.0**-70, 2.0**126], jnp.float32)
  b = jnp.array([2.0**100, 2.0**-100, 2.0**-70, 2.0**126], jnp.float32)
  got = jax.jit(matmul_lib._scaled)(acc, a, b)  # pylint: disable=protected-access
  np.testing.assert_array_equal(
      np.asarray(got), np.array([2.0**100, 2.0**-100, 3 * 2.0**-110, 0.0],
                                np.float32))
  a, b = jnp.float32(1.5), jnp.float32(1 / 3)
  assert float(jax.jit(matmul_lib._scaled)(jnp.float32(7.0), a, b)) == float(  # pylint: disable=protected-access
      np.float32(7.0) * (np.float32(1.5) * np.float32(1 / 3)))


@pytest.mark.parametrize("call", [
    lambda: fp8.fp8_dot_general(None, W, DENSE),
    lambda: fp8.fp8_dot_general(X, None, DENSE),
    lambda: fp8.fp8_dot_general(X, W, DENSE, config=_DELAYED,
                                scales=fp8.DelayedScales(None, 1.0)),
], ids=["lhs", "rhs", "scales.lhs"])
def test_none_arguments_are_named(call):
  with pytest.raises(TypeError, match=r"(lhs|rhs|scales\.lhs) must be a "
                     r"floating array, got NoneType"):
    call()


# ---------------------------------------------------------------------------
# Second derivatives: each backward matmul is differentiated as the float32
# product of its straight-through quantized operands.
# ---------------------------------------------------------------------------

_X2, _W2 = _data((16, 32), 20, 0.0), _data((32, 16), 21, 0.0) * 0.2
_V2 = _data((32, 16), 22, 0.5)


def _fake_quantized(a, fmt="e4m3"):
  """a quantized per tensor and dequantized; derivative 1."""
  q = fp8.dequantize(fp8.quantize(a, fmt))
  return a + jax.lax.stop_gradient(q - a)


@jax.custom_vjp
def _gradient_quantized(y):
  return y


_gradient_quantized.defvjp(lambda y: (y, None),
                           lambda _, ct: (_fake_quantized(ct),))


def _emulated(a, b, dn):
  """The per-tensor e4m3 matmul in float32 arithmetic, straight through."""
  return _gradient_quantized(
      jax.lax.dot_general(_fake_quantized(a), _fake_quantized(b), dn))


def _tanh_loss(w, x, dot):
  return jnp.sum(jnp.tanh(dot(x, w, DENSE)) ** 2)


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) /
               np.linalg.norm(np.asarray(b)))


@pytest.mark.parametrize("granularity", default_run_keeps(["tensor", "row", "blockwise", "mxfp8"]))
def test_second_derivatives_match_float32(granularity):
  kwargs = {"block_size": 16} if granularity == "blockwise" else {}
  dot = functools.partial(fp8.fp8_dot_general, config=_config(
      granularity, gradient_format="e4m3", **kwargs))

  @jax.jit
  def second(w, x, v):
    penalty = lambda d: jax.grad(
        lambda w: jnp.sum(jax.grad(_tanh_loss)(w, x, d) ** 2))(w)
    hvp = lambda d: jax.jvp(lambda w: jax.grad(_tanh_loss)(w, x, d), (w,),
                            (v,))[1]
    mixed = lambda d: jax.grad(lambda x: jnp.vdot(
        jax.grad(_tanh_loss)(w, x, d), v))(x)   # d/dx of a d/dw
    return [(penalty(d), hvp(d), mixed(d))
            for d in (dot, jax.lax.dot_general, _emulated)]

  got, f32, emulated = second(_W2, _X2, _V2)
  for a, b in zip(got, f32):
    # Zeros (the old behaviour) are off by 1; float8 operands by 0.1-0.15.
    assert _rel(a, b) < 0.3
  # The float32 program of the straight-through emulation, to rounding. (On
  # this data every granularity quantizes as per tensor does: power-of-two
  # scales only shift exponents, and no value reaches float8's subnormals.)
  for a, b in zip(got, emulated):
    assert _rel(a, b) < 1e-5


def test_hessian_vector_products_under_with_policy():
  import jmp_lite  # pylint: disable=import-outside-toplevel
  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)
  fp8_loss = jmp_lite.with_policy(
      loss, "p=f32,c=f32,m=fp8(include_output_head=true)")

  @jax.jit
  def hvps(w, x, v):
    fwd_over_rev = lambda f: jax.jvp(lambda w: jax.grad(f)(w, x), (w,),
                                     (v,))[1]
    rev_over_rev = lambda f: jax.grad(
        lambda w: jnp.vdot(jax.grad(f)(w, x), v))(w)
    return [(fwd_over_rev(f), rev_over_rev(f)) for f in (fp8_loss, loss)]

  (fwd, rev), (fwd32, _) = hvps(_W2, _X2, _V2)
  assert "f8_e4m3" in str(jax.make_jaxpr(jax.grad(fp8_loss))(_W2, _X2))
  assert _rel(fwd, fwd32) < 0.3
  assert _rel(rev, fwd) < 1e-5


# ---------------------------------------------------------------------------
# Data parallel: per-tensor amaxes over an axis_name.
# ---------------------------------------------------------------------------

_N_DEV = 8
# One replica holds an outlier: with the global scale the other replicas'
# values are quantized more coarsely than with their own.
_XB = _data((_N_DEV, 4, 32), 30, 0.5)
_XB[3, 0, 0] = 3000.0
_WB = _data((32, 16), 31, 0.5)


def _per_replica(fn, kind, *args):
  """fn(x_shard, w) on each of 8 replicas (pmap or shard_map), stacked."""
  if kind == "pmap":
    return jax.pmap(fn, axis_name="data", in_axes=(0, None))(*args)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:_N_DEV]), ("data",))
  spec = jax.sharding.PartitionSpec
  body = lambda x, w: jax.tree.map(lambda v: v[None], fn(x[0], w))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec("data"), spec()),
                               out_specs=spec("data")))(*args)


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_axis_name_makes_current_scaling_global(kind):
  def run(config):
    def fn(x, w):
      y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(
          x, w, DENSE, config=config), x, w)
      return (y,) + vjp(jnp.ones_like(y))
    return _per_replica(fn, kind, _XB, _WB)

  glob = jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DENSE))(
      _XB.reshape(-1, 32), _WB).reshape(_N_DEV, 4, 16)
  y, dx, dw = run(fp8.Fp8Config(axis_name="data"))
  # The same quantized operands and scales; the float32 sums of a (4, 32)
  # shard and of the whole (32, 32) batch may round differently (XLA:CPU's
  # dot tiling depends on the shape: jax 0.12.1 gives 1 ulp somewhere).
  np.testing.assert_allclose(np.asarray(y), np.asarray(glob), rtol=2e-7,
                             atol=0)
  # Without it, each replica scales its own shard (documented): other
  # quantized values, far more than rounding apart.
  local, _, _ = run(fp8.Fp8Config())
  assert np.max(np.abs(np.asarray(local) - np.asarray(glob))
                / np.maximum(np.abs(np.asarray(glob)), 1e-3)) > 1e-3
  # The replica with the outlier has the global amax anyway.
  np.testing.assert_allclose(np.asarray(local[3]), np.asarray(glob[3]),
                             rtol=2e-7, atol=0)
  if kind == "shard_map":
    # The replicated weight's gradient is the sum over shards, as without
    # float8 (each replica's own gradient under pmap).
    np.testing.assert_allclose(np.asarray(dw[0]), np.asarray(dw[1]))
  assert np.all(np.isfinite(np.asarray(dx)))


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_axis_name_makes_delayed_amaxes_global(kind):
  from jmp_lite._src.flax import float8 as flax_fp8  # pylint: disable=import-outside-toplevel
  config = fp8.Fp8Config(scaling="delayed", axis_name="data")

  def fn(x, w):
    # The matmul's own report (the scales' cotangent)...
    _, vjp = jax.vjp(lambda x, w, s: fp8.fp8_dot_general(
        x, w, DENSE, config=config, scales=s), x, w,
        fp8.DelayedScales(jnp.float32(1.0), jnp.float32(1.0)))
    amaxes = vjp(jnp.ones_like(_))[2]
    # ...and the state the policies keep (one history per operand).
    scales, new = flax_fp8.delayed_scales(flax_fp8.zero_histories(4), x, w,
                                          config)
    return amaxes.lhs, scales.lhs, flax_fp8.decode(new["lhs"])

  amax, scale, history = _per_replica(fn, kind, _XB, _WB)
  np.testing.assert_array_equal(np.asarray(amax), np.full(_N_DEV, 3000.0))
  np.testing.assert_array_equal(np.asarray(scale), np.full(_N_DEV, 8.0))
  np.testing.assert_array_equal(np.asarray(history[:, 0]),
                                np.full(_N_DEV, 3000.0))


@pytest.mark.parametrize("granularity", ["mxfp8", "blockwise"])
def test_block_scaled_recipes_run_under_shard_map(granularity):
  """MXFP8's GPU branch (jax.nn.scaled_matmul, whose custom_vmap drops the
  shard_map varying type) must agree with the emulation's output type, or
  lax.platform_dependent refuses to trace under shard_map. Block scales are
  local to each row, so each replica's result is the unsharded one."""
  config = fp8.Fp8Config(granularity=granularity)

  def fn(x, w):
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(
        x, w, DENSE, config=config), x, w)
    return (y,) + vjp(jnp.ones_like(y))

  y, dx, _ = _per_replica(fn, "shard_map", _XB, _WB)
  x = _XB.reshape(-1, 32)
  ones = jnp.ones((x.shape[0], _WB.shape[1]), jnp.float32)
  if granularity == "mxfp8":
    # Eager: the suite's eager run of a block-scaled matmul and its custom
    # backward (the platform switch executed op by op).
    glob, glob_vjp = jax.vjp(lambda x: fp8.fp8_dot_general(
        x, _WB, DENSE, config=config), x)
    glob_dx = glob_vjp(ones)[0]
  else:  # one jitted program (the eager path is mxfp8's above)
    glob, glob_dx, _ = _vjp_fn(config)(x, _WB, ones)
  np.testing.assert_array_equal(np.asarray(y).reshape(-1, 16), np.asarray(glob))
  np.testing.assert_array_equal(np.asarray(dx).reshape(-1, 32),
                                np.asarray(glob_dx))


def test_unbound_axis_name_teaches():
  config = fp8.Fp8Config(axis_name="data")
  with pytest.raises(ValueError, match=r"axis_name='data'.*jax.pmap or "
                     r"jax.shard_map.*jax.jit with sharded arrays"):
    fp8.fp8_dot_general(X, W, DENSE, config=config)
  with pytest.raises(TypeError, match="axis_name"):
    fp8.Fp8Config(axis_name=0)
  assert fp8.Fp8Config(axis_name=["a", "b"]).axis_name == ("a", "b")
  hash(fp8.Fp8Config(axis_name=["a", "b"]))


# ---------------------------------------------------------------------------
# What a GPU would run: the program exported for CUDA.
# ---------------------------------------------------------------------------

_DISABLED = [jax.export.DisabledSafetyCheck.custom_call(
    fp8.NATIVE_MX_CUSTOM_CALL)]


def _exported_text(fn, args, platforms=("cuda",)):
  exported = jax.export.export(jax.jit(fn), platforms=list(platforms),
                               disabled_checks=_DISABLED)(*args)
  return exported.mlir_module()


def _ops(text, op):
  """(operand types, result type) of each `op` in a StableHLO module."""
  out = []
  for line in text.splitlines():
    if f"stablehlo.{op}" in line and "->" in line:
      sig = line.rsplit(" : ", 1)[1]
      operands, result = sig.split("->")
      out.append((operands, result.split(" loc")[0]))
  return out


def _value_and_grads(config, dn=DENSE):
  def loss(x, w):
    return jnp.sum(fp8.fp8_dot_general(x, w, dn, config=config) * 0.5)
  return jax.value_and_grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("granularity", ["tensor", "row", "blockwise"])
def test_cuda_export_float8_operands_reach_every_dot(granularity):
  x = jnp.asarray(X, jnp.bfloat16)
  w = jnp.asarray(W, jnp.bfloat16)
  text = _exported_text(_value_and_grads(_config(granularity)), (x, w))
  dots = _ops(text, "dot_general")
  assert len(dots) == 3  # forward, dgrad, wgrad
  for operands, result in dots:
    assert operands.count("f8E4M3FN") + operands.count("f8E5M2") == 2, (
        operands)
    assert "xf32>" in result
  # The forward multiplies two e4m3 operands, both backward products take
  # the e5m2 gradient.
  assert sum(o.count("f8E4M3FN") == 2 for o, _ in dots) == 1
  assert sum("f8E5M2" in o for o, _ in dots) == 2
  assert "custom_call" not in text and "callback" not in text


def test_cuda_export_attention_and_e4m3_everywhere():
  q, k = jnp.ones((2, 3, 16, 32)), jnp.ones((2, 3, 16, 32))
  config = fp8.Fp8Config(gradient_format="e4m3")
  text = _exported_text(_value_and_grads(
      config, (((3,), (3,)), ((0, 1), (0, 1)))), (q, k))
  dots = _ops(text, "dot_general")
  assert len(dots) == 3
  for operands, result in dots:
    assert operands.count("f8E4M3FN") == 2 and "xf32>" in result
  assert "f8E5M2" not in text and "custom_call" not in text


def test_mx_platform_switch_in_exported_programs():
  config = _config("mxfp8")
  cuda = _exported_text(_value_and_grads(config), (X, W))
  calls = _ops(cuda, "custom_call")
  assert len(calls) == 3 and _ops(cuda, "dot_general") == []
  assert cuda.count(f"@{fp8.NATIVE_MX_CUSTOM_CALL}") == 3
  for operands, result in calls:
    assert operands.count("f8E8M0FNU") == 2 and "xf32>" in result
  assert sum(o.count("f8E4M3FN") == 2 for o, _ in calls) == 1
  assert sum("f8E5M2" in o for o, _ in calls) == 2
  cpu = _exported_text(_value_and_grads(config), (X, W), ("cpu",))
  assert "custom_call" not in cpu and "scaled" not in cpu
  assert len(_ops(cpu, "dot_general")) == 3
  # native_mx=False: the emulation on CUDA too, so several platforms at once.
  emulated = _config("mxfp8", native_mx=False)
  both = _exported_text(_value_and_grads(emulated), (X, W), ("cpu", "cuda"))
  assert "custom_call" not in both
  # The native path lowered for both platforms at once: jax < 0.12 has no
  # CPU rule for scaled_matmul even in the branch the CPU never takes; from
  # 0.12 on it lowers, with the custom call in the CUDA branch only.
  if jax.__version_info__ < (0, 12):
    with pytest.raises(NotImplementedError, match="scaled_matmul"):
      _exported_text(_value_and_grads(config), (X, W), ("cpu", "cuda"))
  else:
    multi = _exported_text(_value_and_grads(config), (X, W), ("cpu", "cuda"))
    assert multi.count(f"@{fp8.NATIVE_MX_CUSTOM_CALL}") == 3


def test_mx_native_path_under_vmap_with_an_unbatched_operand():
  config = _config("mxfp8")
  f = jax.vmap(lambda x, w: fp8.fp8_dot_general(x, w, DENSE, config=config),
               in_axes=(0, None))
  xs = jnp.stack([jnp.asarray(X)] * 2)
  text = _exported_text(f, (xs, W))
  (call,) = _ops(text, "custom_call")
  assert "2x8x96xf8E4M3FN" in call[0] and "2x40x96xf8E4M3FN" in call[0]
  _assert_float32_dot_of(jax.jit(f)(xs, W)[1],
                         _ref_product(X, W.T, "e4m3", "e4m3", ("mx", "mx")),
                         96)


# ---------------------------------------------------------------------------
# Config and argument errors.
# ---------------------------------------------------------------------------


def test_config_is_canonical_hashable_and_static():
  a = fp8.Fp8Config(forward_format=" E4M3", gradient_format=jnp.float8_e5m2,
                    granularity=" Row ", compute_dtype=jnp.bfloat16)
  b = fp8.Fp8Config(granularity="row", compute_dtype="bf16")
  assert a == b and hash(a) == hash(b)
  assert a.forward_format == "e4m3" and a.gradient_format == "e5m2"
  assert fp8.Fp8Config(granularity="blockwise").block_size == 128
  with pytest.raises(AttributeError):
    a.granularity = "tensor"

  @functools.partial(jax.jit, static_argnums=2)
  def f(x, w, config):
    return fp8.fp8_dot_general(x, w, DENSE, config=config)

  np.testing.assert_array_equal(np.asarray(f(X, W, a)),
                                np.asarray(f(X, W, b)))


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(forward_format="e4m4"), ValueError, "'e4m4'.*'e4m3'.*'e5m2'"),
    (dict(gradient_format=jnp.float16), ValueError, "float16.*Valid"),
    (dict(granularity="tile"), ValueError,
     "'tile'.*'tensor'.*'row'.*'blockwise'.*'mxfp8'"),
    (dict(scaling="dynamic"), ValueError, "'dynamic'.*'current'.*'delayed'"),
    (dict(scaling=1), TypeError, "scaling must be a string"),
    (dict(scaling="delayed", granularity="row"), ValueError,
     "granularity='tensor'"),
    (dict(granularity="blockwise", block_size=100), ValueError,
     "block_size=100.*multiple of 16"),
    (dict(granularity="blockwise", block_size="128"), TypeError,
     "str: '128'"),
    (dict(block_size=128), ValueError, "block_size=128.*blockwise"),
    (dict(granularity="mxfp8", block_size=32), ValueError, "always 32"),
    (dict(granularity="mxfp8", power_of_two_scales=False), ValueError,
     "E8M0"),
    (dict(power_of_two_scales="yes"), TypeError,
     "power_of_two_scales must be a bool.*'yes'"),
    (dict(native_mx=None), TypeError, "native_mx"),
    (dict(compute_dtype=jnp.int8), ValueError, "compute_dtype.*int8"),
])
def test_config_errors(kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    fp8.Fp8Config(**kwargs)


@pytest.mark.parametrize("args,kwargs,error,pattern", [
    ((jnp.arange(6).reshape(2, 3), W[:3]), {}, TypeError, "lhs.*int32"),
    ((X, W.astype(jnp.float8_e4m3fn)), {}, TypeError,
     "rhs is already float8"),
    # Dimension numbers: checks.dimension_numbers names the value and the
    # expected form (a TypeError, as jax.lax.dot_general raises).
    ((X, W), {"dimension_numbers": ((1, 0), ())}, TypeError,
     r"not a pair of \(lhs, rhs\) pairs; got dimension_numbers=\(\(1, 0\), "
     r"\(\)\).*\(\(\(lhs_contract,\), \(rhs_contract,\)\), "
     r"\(\(lhs_batch,\), \(rhs_batch,\)\)\)"),
    ((X, W[:50]), {}, TypeError,
     r"contracting axes have sizes \(96,\) \(lhs\) and \(50,\) \(rhs\)"),
    ((X, W), {"dimension_numbers": (((2,), (0,)), ((), ()))}, TypeError,
     r"lhs axes \(2,\) are not all in \[0, 2\)"),
    ((X, W), {"dimension_numbers": (((1,), (0,)), ((0,), ()))}, TypeError,
     "1 lhs but 0 rhs batch axes"),
    ((X, W), {"config": "row"}, TypeError, "Fp8Config"),
    ((X, W), {"out_sharding": "x"}, ValueError, "out_sharding"),
    ((X, W), {"preferred_element_type": jnp.int32}, ValueError,
     "preferred_element_type.*int32"),
])
def test_argument_errors(args, kwargs, error, pattern):
  kwargs = dict(kwargs)
  dn = kwargs.pop("dimension_numbers", DENSE)
  with pytest.raises(error, match=pattern):
    fp8.fp8_dot_general(*args, dn, **kwargs)


@pytest.mark.parametrize("dn,problem", [
    (None, "not a pair of (lhs, rhs) pairs"),
    ((((1.0,), (0,)), ((), ())), "an axis is not an integer"),
    ((((True,), (0,)), ((), ())), "an axis is not an integer"),
    ((((1,), (0,)), (("0",), (0,))), "an axis is not an integer"),
    ((((-1,), (0,)), ((), ())), "the lhs axes (-1,) are not all in [0, 2)"),
    ((((1, 1), (0, 0)), ((), ())), "the lhs axes (1, 1) repeat an axis"),
    ((((1,), (0,)), ((1,), (0,))), "the lhs axes (1, 1) repeat an axis"),
])
@pytest.mark.parametrize("dot,owner", [
    (fp8.fp8_dot_general, "jmp_lite.fp8.dot_general"),
    (fp4.dot_general, "jmp_lite.fp4.dot_general")])
def test_dimension_numbers_errors_teach(dn, problem, dot, owner):
  """fp8.fp8_dot_general and fp4.dot_general refuse malformed dimension numbers
  through one check: the owner, the problem, the value and the form."""
  with pytest.raises(TypeError) as info:
    dot(jnp.ones((16, 32)), jnp.ones((32, 16)), dn)
  message = str(info.value)
  assert message.startswith(f"{owner}: {problem}; got dimension_numbers={dn!r}")
  assert ("(((lhs_contract,), (rhs_contract,)), ((lhs_batch,), (rhs_batch,)))"
          in message)


def test_dimension_numbers_in_other_spellings():
  """Lists, NumPy integers and a bare int per group are dimension numbers
  too (as for jax.lax.dot_general), and give the same product."""
  y = fp8.fp8_dot_general(X, W, DENSE)
  for dn in (([1], [0]), ([], [])), ((1, 0), ((), ())), (
      ((np.int64(1),), (np.int32(0),)), ((), ())):
    np.testing.assert_array_equal(fp8.fp8_dot_general(X, W, dn), y)


# ---------------------------------------------------------------------------
# Flax. (tests/test_public_api.py runs every docstring example.)
# ---------------------------------------------------------------------------


def test_as_flax_dense_dot_general():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  dot = functools.partial(fp8.fp8_dot_general,
                          config=fp8.Fp8Config(granularity="row"))
  fp8_dense, dense = nn.Dense(16, dot_general=dot), nn.Dense(16)
  x = jnp.asarray(_data((2, 4, 32), 8, 1.0))
  params = jax.jit(dense.init)(jax.random.key(0), x)

  @jax.jit
  def run(params):
    loss = lambda p, m: jnp.sum(m.apply(p, x) ** 2)
    return (jax.value_and_grad(loss)(params, fp8_dense),
            jax.value_and_grad(loss)(params, dense))

  (l8, g8), (l32, g32) = run(params)
  assert abs(float(l8) - float(l32)) <= 4 * U4 * float(l32)
  k8, k32 = g8["params"]["kernel"], g32["params"]["kernel"]
  assert np.linalg.norm(k8 - k32) <= (U4 + U5) * np.linalg.norm(k32)
