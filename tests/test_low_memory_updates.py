"""Tests for master_weights' low-memory methods: stochastic rounding and Kahan.

Covers: stochastic rounding is unbiased (the mean of many roundings of a value
between two neighbours is that value, within a stated statistical tolerance)
and only ever gives the two neighbours, in bfloat16 and float16; Kahan
compensation keeps params + compensation equal to the float32 values a master
copy holds, bit for bit, so a long run of updates far below the params'
spacing lands where float32 does; runs are reproducible from the seed; on 8
simulated devices the shards of a sharded param draw different bits, results
do not depend on the sharding and nothing crosses devices; a step skipped by
loss_scaling changes neither params, compensation nor key stream; composition
with accumulation, inject_hyperparams, chains and schedules; float16 params
with loss scaling; the rounding survives XLA's excess-precision rewrites;
checkpoints; every bad input. The tests shared with method="copy" (state
dtypes, recompilation, strict promotion...) are in test_master_weights.py.
"""

import functools
import pickle

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import get_master_params
from jmp_lite import master_weights
from jmp_lite import with_state_dtype
from jmp_lite._src.master_weights import MasterWeightsState

from helpers import all_eqns
from helpers import assert_bit_identical
from helpers import lowered_functions
from helpers import orbax_round_trip
from helpers import pull_to_zero
# The dtypes, the inner optimizers and the small model's params that the
# master-copy tests use too.
from test_master_weights import _params
from test_master_weights import HALF
from test_master_weights import INNERS
from test_master_weights import JIT
from helpers import default_run_keeps

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
LOW_MEMORY = ["stochastic_rounding", "kahan"]
SR = "stochastic_rounding"

standard_promotion = pytest.mark.standard_promotion


# -- helpers -------------------------------------------------------------------


def _grad_sequence(steps, seed=5):
  """Gradients that do not depend on the params: every method sees the same."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), F32),
                       _params(F32)) for _ in range(steps)]


def _apply(params, updates):
  """``optax.apply_updates``'s arithmetic, strict-promotion clean."""
  return jax.tree.map(
      lambda p, u: (p.astype(u.dtype) + u).astype(p.dtype), params, updates)


def _spacing_below(value, dtype):
  """The spacing of ``dtype`` just below the positive ``value``."""
  v = np.asarray(value, dtype)
  below = np.nextafter(v, np.asarray(0, dtype))  # ml_dtypes: in ``dtype``
  return float(v.astype(np.float64) - below.astype(np.float64))


def _leaves_equal(a, b):
  return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _run(opt, params, grads_seq, jit=False):
  def step(params, state, grads):
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, state = opt.update(grads, state, params)
    return _apply(params, updates), state

  step = jax.jit(step) if jit else step
  state = opt.init(params)
  for grads in grads_seq:
    params, state = step(params, state, grads)
  return params, state


# -- stochastic rounding ---------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("position", [0.03, 0.5, 0.9])
@pytest.mark.parametrize("jit", JIT)
def test_stochastic_rounding_is_unbiased(dtype, position, jit):
  """65536 params at 1.0, one step to a value `position` of the way from the
  neighbour below 1.0 to 1.0: only those two values occur, and their mean is
  the value within 5 standard errors (sigma = spacing * sqrt(p (1 - p) / n)).
  Plain rounding would give 1.0 everywhere (position >= 0.5) or the lower
  neighbour everywhere."""
  n = 2**16
  spacing = _spacing_below(1.0, dtype)
  target = 1.0 - (1.0 - position) * spacing  # exact in float32
  opt = master_weights(optax.sgd(1.0), method=SR, seed=11)
  params = {"w": jnp.ones(n, dtype)}
  grads = {"w": jnp.full(n, 1.0 - target, F32)}  # sgd(1): update = -grad
  update = jax.jit(opt.update) if jit else opt.update
  updates, _ = update(grads, opt.init(params), params)
  values = np.asarray(_apply(params, updates)["w"], np.float64)
  assert set(np.unique(values)) <= {1.0 - spacing, 1.0}
  sigma = spacing * np.sqrt(position * (1 - position) / n)
  assert abs(values.mean() - target) <= 5 * sigma, (values.mean(), target)
  assert abs(np.mean(values == 1.0) - position) <= 5 * np.sqrt(
      position * (1 - position) / n)


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_mean_over_steps_follows_float32(dtype):
  """Many steps of an update a tenth of the spacing: plain half params never
  move; rounded stochastically, the mean over 4096 params follows float32's
  trajectory within 5 standard errors of a random walk."""
  n, steps = 4096, 200
  spacing = _spacing_below(1.0, dtype)
  lr = 0.1 * spacing
  grads = [{"w": jnp.ones(n, F32)}] * steps
  params = {"w": jnp.ones(n, dtype)}
  plain, _ = _run(optax.sgd(lr), params, grads, jit=True)
  rounded, _ = _run(master_weights(optax.sgd(lr), method=SR), params, grads,
                    jit=True)
  assert np.all(np.asarray(plain["w"], F32) == 1.0)
  expected = 1.0 - steps * lr
  values = np.asarray(rounded["w"], np.float64)
  # Each step adds an independent rounding error of variance <= spacing**2/4.
  sigma = spacing * np.sqrt(steps / 4 / n)
  assert abs(values.mean() - expected) <= 5 * sigma
  assert np.all(np.abs(values - expected) <= 40 * spacing)


def test_stochastic_rounding_exactly_representable_results_stay():
  """An update that lands on a representable value is never rounded away."""
  opt = master_weights(optax.sgd(1.0), method=SR)
  params = {"w": jnp.linspace(-4, 4, 1024, dtype=BF16)}
  grads = {"w": -jnp.asarray(params["w"], F32)}  # to exactly 2 * params
  # Jitted: the eager update runs in test_eager_and_jit_draw_the_same_bits
  # and the eager cases of test_stochastic_rounding_is_unbiased.
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  np.testing.assert_array_equal(
      _apply(params, updates)["w"], (params["w"].astype(F32) * 2).astype(BF16))


@standard_promotion
def test_same_seed_same_run_other_seed_other_run():
  grads = _grad_sequence(10)
  params = _params(BF16)
  runs = [_run(master_weights(optax.adam(1e-2), method=SR, seed=seed), params,
               grads, jit=True) for seed in (3, 3, 4)]
  assert_bit_identical(runs[0], runs[1])
  assert not _leaves_equal(runs[0][0], runs[2][0])


@pytest.mark.parametrize("jit", JIT)
def test_key_lives_in_the_state_and_advances_each_step(jit):
  opt = master_weights(optax.sgd(0.1), method=SR, seed=7)
  params = _params(BF16)
  state = opt.init(params)
  assert state.rng_key.dtype == np.uint32 and state.rng_key.shape == (2,)
  np.testing.assert_array_equal(
      state.rng_key, jax.random.key_data(jax.random.key(7)))
  assert state.master_params is None and state.compensation is None
  update = jax.jit(opt.update) if jit else opt.update
  keys = [np.asarray(state.rng_key)]
  for grads in _grad_sequence(3):
    _, state = update(jax.tree.map(lambda g: g.astype(BF16), grads), state,
                      params)
    keys.append(np.asarray(state.rng_key))
  assert len({k.tobytes() for k in keys}) == 4


def test_eager_and_jit_draw_the_same_bits():
  grads = _grad_sequence(5)
  opt = master_weights(optax.sgd(0.05, momentum=0.9), method=SR)
  assert_bit_identical(_run(opt, _params(BF16), grads, jit=False),
                       _run(opt, _params(BF16), grads, jit=True))


def test_get_master_params_of_stochastic_rounding_is_the_params():
  """Stochastic rounding keeps nothing more precise than the params."""
  params = {**_params(BF16), "scale": jnp.ones(3, F32)}
  opt = master_weights(optax.sgd(0.1), method=SR)
  params, state = _run(opt, params, [jax.tree.map(
      lambda p: jnp.ones(p.shape, F32), params)])
  assert_bit_identical(get_master_params(state, params), params)


def _step_memory(method, bits=None):
  """XLA's peak and temporaries of a compiled train step (a bf16 MLP, Adam,
  the state donated), in bytes."""
  def loss_fn(p, x):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.mean(jnp.square((h @ p["w2"]).astype(F32)))

  params = {"w1": jnp.zeros((256, 512), BF16), "w2": jnp.zeros((512, 256), BF16)}
  x = jnp.zeros((64, 256), BF16)
  opt = master_weights(optax.adam(1e-3), method=method)

  def step(state, x):
    p, s = state
    updates, s = opt.update(jax.grad(loss_fn)(p, x), s, p)
    return _apply(p, updates), s

  state = (params, jax.eval_shape(opt.init, params))
  stats = jax.jit(step, donate_argnums=0).lower(state, x).compile(
      ).memory_analysis()
  if stats is None:
    pytest.skip("this backend gives no memory analysis")
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return peak, stats.temp_size_in_bytes


@standard_promotion
def test_stochastic_rounding_step_peaks_below_the_master_copy(monkeypatch):
  """The point of stochastic rounding is memory: its compiled step's peak is
  no higher than the master copy's, and its random bits are fused into the
  update (temporaries within 1% of the copy's). With jax.random's bits, a
  temporary of 4 bytes per parameter, both fail: the check can fail."""
  copy_peak, copy_temp = _step_memory("copy")
  sr_peak, sr_temp = _step_memory(SR)
  assert sr_peak <= copy_peak, (sr_peak, copy_peak)
  assert sr_temp <= 1.01 * copy_temp, (sr_temp, copy_temp)
  # pylint: disable-next=g-import-not-at-top
  from jmp_lite._src import master_weights as master_weights_lib
  from jmp_lite._src import state_codes  # pylint: disable=g-import-not-at-top
  leaf = master_weights_lib._stochastic_leaf  # pylint: disable=protected-access
  with monkeypatch.context() as patch:
    patch.setattr(state_codes, "counter_bits",
                  lambda key, shape: jax.random.bits(key, shape, jnp.uint32))
    try:
      leaf.clear_cache()  # Its cached trace would keep the patched-out bits.
      old_peak, old_temp = _step_memory(SR)
    finally:
      leaf.clear_cache()
  assert old_peak > copy_peak and old_temp > 1.5 * copy_temp


@pytest.mark.parametrize("method", ["copy", "kahan", SR])
def test_leaf_writes_are_inlined_into_a_jitted_update(method):
  """Each leaf's write is a jitted function (one program for an eager call)
  with inline=True: a jitted update's program holds its operations, not a
  function called for it."""
  opt = master_weights(optax.sgd(0.1), method=method)
  params = _params(BF16)
  state = opt.init(params)
  functions = lowered_functions(opt.update, _grad_sequence(1)[0], state,
                                params)
  kernels = ("_copy_leaf", "_kahan_leaf", "_stochastic_leaf", "_compensated")
  assert not [f for f in functions if f.startswith(kernels)], functions


# -- Kahan compensation ----------------------------------------------------------


@pytest.mark.parametrize("dtype", default_run_keeps(HALF))
@pytest.mark.parametrize("jit", JIT)
def test_kahan_long_run_of_tiny_updates_lands_on_float32(dtype, jit):
  """3000 sgd steps (300 eagerly), each 1/40 of the params' spacing at their
  start (plain half params never move): params + compensation equal the
  float32 run bit for bit, and the params are within half a spacing of it
  (rounded to nearest), at whatever magnitude each param ended."""
  rng = np.random.default_rng(0)
  start = jnp.asarray(rng.uniform(1.0, 2.0, 256) * rng.choice([-1, 1], 256),
                      dtype)
  spacing = 2.0 ** -(7 if dtype == BF16 else 10)  # between 1 and 2
  lr = spacing / 40
  steps = 3000 if jit else 300
  grads = [{"w": jnp.ones(256, F32)}] * steps
  params = {"w": start}
  plain, _ = _run(optax.sgd(lr), params, grads, jit=True)
  kahan, state = _run(master_weights(optax.sgd(lr), method="kahan"), params,
                      grads, jit=jit)
  f32 = start.astype(F32)
  for _ in range(steps):  # The same float32 additions sgd makes.
    f32 = f32 + jnp.float32(-lr)
  np.testing.assert_array_equal(plain["w"], start)
  np.testing.assert_array_equal(get_master_params(state, kahan)["w"], f32)
  error = np.abs(np.asarray(kahan["w"], np.float64) - np.asarray(f32))
  # Half the spacing at |x| in [2**e, 2**(e + 1)) is 2**(e - bits - 1) <= |x|
  # times 2**-8 (bfloat16) or 2**-11 (float16).
  half_spacing = np.abs(np.asarray(f32)) * 2.0 ** -(8 if dtype == BF16 else 11)
  assert np.all(error <= half_spacing)
  assert np.max(np.abs(np.asarray(f32) - np.asarray(start, F32))) > 3 * spacing
  assert state.compensation["w"].dtype == np.int16


@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
@pytest.mark.parametrize("dtype", default_run_keeps(HALF))
def test_kahan_holds_the_master_copy_values_bit_for_bit(make_inner, dtype):
  """With the same gradients, params + compensation are the float32 values the
  master copy holds, bit for bit, in 2 bytes per parameter instead of 4."""
  grads = _grad_sequence(25)
  copy_params, copy_state = _run(master_weights(make_inner()),
                                 _params(dtype), grads)
  params, state = _run(master_weights(make_inner(), method="kahan"),
                       _params(dtype), grads)
  assert_bit_identical(get_master_params(state, params),
                       get_master_params(copy_state, copy_params))
  assert_bit_identical(state.inner_state, copy_state.inner_state)
  # Both params are the float32 values rounded to nearest.
  master = get_master_params(state, params)
  for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
    assert np.all(np.abs(np.asarray(p, F32) - np.asarray(m))
                  <= np.abs(np.asarray(m)) * 2.0**-(8 if dtype == BF16 else 11))


@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
def test_kahan_jitted_follows_the_master_copy(make_inner):
  """Jitted, XLA may fuse the two programs' float32 arithmetic differently
  (a multiply-add contracted in one and not the other, adafactor's
  reductions): a few float32 roundings apart per step, so after 25 steps
  within 2**-16 relative (bfloat16's own rounding is 2**-8)."""
  grads = _grad_sequence(25)
  copy_params, copy_state = _run(master_weights(make_inner()),
                                 _params(BF16), grads, jit=True)
  params, state = _run(master_weights(make_inner(), method="kahan"),
                       _params(BF16), grads, jit=True)
  for a, b in zip(jax.tree.leaves(get_master_params(state, params)),
                  jax.tree.leaves(get_master_params(copy_state, copy_params))):
    np.testing.assert_allclose(a, b, rtol=2.0**-16, atol=2.0**-30)


@pytest.mark.parametrize("dtype", HALF)
def test_kahan_compensation_is_exact_over_every_magnitude(dtype):
  """One step to 2**17 float32 targets spread over 40 binades, exact ties
  included: params + compensation == target exactly (float16: in its normal
  range, 2**-14 and up), and params are a nearest value."""
  rng = np.random.default_rng(1)
  n = 2**17
  low = -14 if dtype == F16 else -40
  target = (rng.uniform(1, 2, n) * np.exp2(rng.integers(low, 14, n))
            * rng.choice([-1, 1], n)).astype(np.float32)
  start = target.astype(dtype)
  # Exact ties: halfway between start and its neighbour above.
  ties = rng.random(n) < 0.05
  up = np.nextafter(start, np.asarray(np.inf, dtype))
  target[ties] = ((start.astype(np.float64) + up.astype(np.float64)) / 2)[ties]
  inner = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (u, s))  # Returns the "gradients" as updates.
  opt = master_weights(inner, method="kahan")
  params = {"w": jnp.asarray(start)}
  delta = {"w": jnp.asarray(target - start.astype(np.float32))}
  updates, state = opt.update(delta, opt.init(params), params)
  new = _apply(params, updates)
  np.testing.assert_array_equal(get_master_params(state, new)["w"], target)
  gap = np.abs(np.asarray(new["w"], np.float64) - target)
  other = np.abs(np.nextafter(np.asarray(new["w"]),
                              np.where(target > np.asarray(new["w"], np.float64),
                                       np.inf, -np.inf).astype(dtype))
                 .astype(np.float64) - target)
  assert np.all(gap <= other)  # new["w"] is a nearest value of the target.


def test_kahan_state_and_master_params():
  params = {"w": jnp.ones((4, 3), BF16), "scale": jnp.ones(3, F32),
            "step": jnp.zeros((), jnp.int32)}
  state = master_weights(optax.sgd(0.1), method="kahan").init(params)
  assert state.master_params is None and state.rng_key is None
  assert state.compensation["w"].dtype == np.int16
  assert state.compensation["w"].shape == (4, 3)
  # No bytes for float32 or integer params: optax's marker, no leaf.
  assert state.compensation["scale"] == optax.MaskedNode()
  assert state.compensation["step"] == optax.MaskedNode()
  master = get_master_params(state, params)
  assert master["w"].dtype == F32
  assert master["scale"] is params["scale"] and master["step"] is params["step"]


# -- both: precision, loss scaling, composition ------------------------------------


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_rounding_survives_excess_precision_rewrites(method):
  """XLA:GPU may delete a float32 -> half -> float32 round trip as a no-op
  (xla_allow_excess_precision), which would silently turn the rounding off:
  the update rounds with float32 arithmetic. The one cast to half it makes
  (Kahan materialises the new param, already on the half grid, in 2 bytes)
  feeds an optimization_barrier, which no rewrite removes."""
  params = {"w": jnp.ones((4, 3), BF16), "h": jnp.ones(3, F16)}
  opt = master_weights(optax.adam(1e-3), method=method)
  state = opt.init(params)
  with jax.numpy_dtype_promotion("standard"):
    jaxpr = jax.make_jaxpr(opt.update)(params, state, params)
  eqns = list(all_eqns(jaxpr))
  to_half = {id(e.outvars[0]) for e in eqns
             if e.primitive.name == "convert_element_type"
             and np.dtype(e.params["new_dtype"]) in (BF16, F16)}
  into_barrier = {id(v) for e in eqns if e.primitive.name == "optimization_barrier"
                  for v in e.invars}
  assert to_half <= into_barrier
  assert len(to_half) == (2 if method == "kahan" else 0)


@pytest.mark.parametrize("method", default_run_keeps(LOW_MEMORY))
@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("poison", [np.inf, np.nan], ids=["inf", "nan"])
def test_skipped_step_changes_nothing_and_keeps_the_key_stream(
    method, jit, poison):
  """A non-finite step skipped by loss_scaling leaves params, compensation,
  key and inner state bit-identical, and the run continues exactly as the run
  without that step."""
  opt = jmp_lite.loss_scaling(
      master_weights(optax.sgd(0.05, momentum=0.9), method=method),
      jmp_lite.StaticLossScale(4.0))

  def step(params, state, grads):
    scaled = jax.tree.map(lambda g, p: (g * 4.0).astype(p.dtype),
                          grads, params)
    updates, state = opt.update(scaled, state, params)
    return _apply(params, updates), state

  step = jax.jit(step) if jit else step
  grads = _grad_sequence(6)
  bad = jax.tree.map(lambda g: g, grads[0])
  bad["w"] = bad["w"].at[2, 3].set(poison)
  params = clean = _params(F16)
  state = clean_state = opt.init(params)
  for i, g in enumerate(grads):
    if i == 3:
      new_params, new_state = step(params, state, bad)
      assert not bool(new_state.last_finite)
      assert_bit_identical(new_params, params)
      assert_bit_identical(new_state.inner_state, state.inner_state)
      params, state = new_params, new_state
    params, state = step(params, state, g)
    clean, clean_state = step(clean, clean_state, g)
  assert_bit_identical(params, clean)
  assert_bit_identical(state.inner_state, clean_state.inner_state)
  assert int(state.skipped_steps) == 1


def _float16_run(dtype, inner, jit, n=1024):
  """100 steps of ``inner`` under dynamic loss scaling pulling ``n`` params at
  1.0 to 0."""
  return pull_to_zero(inner, jmp_lite.DynamicLossScale(2.0**10, period=20),
                      dtype, n=n, steps=100, jit=jit)


@functools.cache
def _float16_baselines():
  """Plain float16 and float32 Adam runs (jitted), shared by every case."""
  with jax.numpy_dtype_promotion("standard"):  # adam: float ** int32
    return (_float16_run(F16, optax.adam(1e-4), jit=True)[0],
            _float16_run(F32, optax.adam(1e-4), jit=True)[0])


@standard_promotion
@pytest.mark.parametrize("method", default_run_keeps(LOW_MEMORY))
@pytest.mark.parametrize("jit", default_run_keeps(JIT))
def test_float16_params_with_dynamic_loss_scaling(method, jit):
  """float16 params at 1.0 pulled to 0 by Adam(1e-4): each step is below half
  float16's spacing there (2**-12), so plain float16 params never move; both
  methods follow float32 (Kahan: its values; stochastic rounding: on average
  over 1024 params)."""
  n = 1024
  # The two baselines run jitted, once for all variants (the eager variant is
  # about the method's own eager steps; 200 eager Adam steps cost seconds).
  plain, reference = _float16_baselines()
  params, state = _float16_run(
      F16, master_weights(optax.adam(1e-4), method=method), jit, n=n)
  assert np.all(np.asarray(plain["w"], F32) == 1.0)
  assert float(jmp_lite.get_loss_scale(state).loss_scale) == 2.0**15
  values = np.asarray(params["w"], np.float64)
  ref = float(reference["w"][0])
  assert abs(ref - 0.99) < 1e-3
  spacing = 2.0**-11
  if method == "kahan":
    np.testing.assert_allclose(get_master_params(state, params)["w"], ref,
                               atol=1e-4)
    assert np.all(np.abs(values - ref) <= spacing)
  else:
    assert abs(values.mean() - ref) <= 5 * spacing * np.sqrt(100 / 4 / n)


@standard_promotion
@pytest.mark.parametrize("method", LOW_MEMORY)
def test_loss_scaling_accumulation_gives_one_step_of_the_mean(method):
  """loss_scaling(..., accumulation_steps=2): two micro-batches make exactly
  the step of their mean gradient, and the key advances once per step."""
  grads = _grad_sequence(4)
  params = _params(BF16)

  def opt(accumulation_steps):
    return jmp_lite.loss_scaling(
        master_weights(optax.adam(1e-2), method=method),
        jmp_lite.NoOpLossScale(), accumulation_steps=accumulation_steps)

  accumulating = opt(2)
  p, s = params, accumulating.init(params)
  for g in grads:
    updates, s = accumulating.update(g, s, p)
    p = _apply(p, updates)
  mean = [jax.tree.map(lambda a, b: (a + b) / 2, grads[i], grads[i + 1])
          for i in (0, 2)]
  expected, _ = _run(opt(1), params, mean)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a, F32), np.asarray(b, F32),
                               atol=2.0**-6)
  inner = jax.tree.leaves(s, is_leaf=lambda x: isinstance(
      x, MasterWeightsState))
  state = next(x for x in inner if isinstance(x, MasterWeightsState))
  if method == SR:
    key = jax.random.key(0)
    for _ in range(2):
      key, _ = jax.random.split(key)
    np.testing.assert_array_equal(state.rng_key, jax.random.key_data(key))


@standard_promotion
@pytest.mark.parametrize("method", LOW_MEMORY)
def test_inject_hyperparams_schedules_and_chains(method):
  params = _params(BF16)
  grads = _grad_sequence(6)
  injected = optax.inject_hyperparams(
      lambda learning_rate: master_weights(optax.adam(learning_rate),
                                           method=method))(learning_rate=1e-2)
  scheduled = master_weights(
      optax.adam(optax.linear_schedule(1e-2, 0.0, 6)), method=method)
  chained = optax.chain(optax.clip_by_global_norm(1.0),
                        master_weights(optax.adam(1e-2), method=method))
  for opt in (injected, scheduled, chained):
    p, s = _run(opt, params, grads, jit=True)
    master = get_master_params(s, p)
    assert jax.tree.structure(master) == jax.tree.structure(params)
    assert not _leaves_equal(p, params)  # It trained.
  # The injected learning rate is used: set to 0, nothing moves.
  state = injected.init(params)
  state.hyperparams["learning_rate"] = jnp.zeros((), F32)
  updates, _ = injected.update(
      jax.tree.map(lambda g: g.astype(BF16), grads[0]), state, params)
  assert_bit_identical(_apply(params, updates), params)


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_with_state_dtype_inside(method):
  params = _params(BF16)
  opt = master_weights(with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16),
                       method=method)
  p, s = _run(opt, params, _grad_sequence(3))
  assert s.inner_state[0].trace["w"].dtype == BF16
  assert p["w"].dtype == BF16
  with pytest.raises(ValueError, match=r"master_weights\(with_state_dtype"):
    with_state_dtype(master_weights(optax.sgd(0.1), method=method),
                     BF16).init(params)


# -- devices ---------------------------------------------------------------------


def _mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (see conftest.py)")
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def test_shards_draw_different_bits_and_results_do_not_depend_on_sharding():
  """Every element of a (64, 32) param at 1.0, one update of a quarter of the
  spacing below: each of the 8 shards rounds a different set of elements
  (the bits are a hash of the element's global index, not of which device
  holds it), the result equals the unsharded run bit for bit, and the
  compiled step moves nothing between devices."""
  mesh = _mesh()
  sharding = NamedSharding(mesh, P("data", "model"))
  opt = master_weights(optax.sgd(2.0**-10), method=SR, seed=3)

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return _apply(params, updates), state

  params = {"w": jnp.ones((64, 32), BF16)}
  grads = {"w": jnp.ones((64, 32), BF16)}
  sharded = jax.tree.map(lambda x: jax.device_put(x, sharding), params)
  sharded_grads = jax.tree.map(lambda x: jax.device_put(x, sharding), grads)
  jitted = jax.jit(step)
  new, state = jitted(sharded, opt.init(sharded), sharded_grads)
  reference, ref_state = jax.jit(step)(params, opt.init(params), grads)
  assert_bit_identical(new, reference)
  assert_bit_identical(state, ref_state)
  assert new["w"].sharding.is_equivalent_to(sharding, 2)
  shards = [np.asarray(s.data, F32) for s in new["w"].addressable_shards]
  assert len(shards) == 8
  assert len({s.tobytes() for s in shards}) == 8
  for s in shards:  # Each shard rounds down about a quarter of its elements.
    assert 0.1 < np.mean(s != 1.0) < 0.4
  hlo = jitted.lower(sharded, opt.init(sharded), sharded_grads).compile()
  for collective in ("all-gather", "all-reduce", "collective-permute",
                     "all-to-all"):
    assert collective not in hlo.as_text()


def _sharded_run(method, steps=4):
  mesh = _mesh()
  specs = {"w": P("data", "model"), "b": P("model"), "s": P()}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in _params(BF16).items()}
  opt = master_weights(with_state_dtype(optax.adam(1e-2), BF16), method=method)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  init_state = state
  counts = []
  for g in _grad_sequence(steps):
    params, state = step(params, state, g)
    counts.append(len(traces))
  return specs, params, init_state, state, counts


@functools.cache
def _sharded_copy_counts():
  """method='copy''s compilation counts, shared by the low-memory cases."""
  with jax.numpy_dtype_promotion("standard"):  # adam: float ** int32
    return _sharded_run("copy")[-1]


@standard_promotion
@pytest.mark.parametrize("method", default_run_keeps(LOW_MEMORY))
def test_named_sharding_state_and_compilations(method):
  """The compensation and the moments take the params' sharding; the step
  compiles as often as with method='copy' (an eager init's uncommitted
  scalars, Adam's count, come back committed from the first step, which
  retraces once with any optimizer), then never again; the result is the
  unsharded one."""
  specs, params, init_state, state, counts = _sharded_run(method)
  copy_counts = _sharded_copy_counts()
  assert counts == copy_counts and counts[-1] == counts[1] <= 2
  for name in ("w", "b"):
    assert params[name].sharding.spec == specs[name]
    if method == "kahan":
      for s in (init_state, state):
        assert s.compensation[name].sharding.is_equivalent_to(
            params[name].sharding, params[name].ndim)
    assert state.inner_state[0].mu[name].sharding.is_equivalent_to(
        params[name].sharding, params[name].ndim)
  opt = master_weights(with_state_dtype(optax.adam(1e-2), BF16), method=method)
  unsharded, _ = _run(opt, _params(BF16), _grad_sequence(4), jit=True)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(unsharded)):
    np.testing.assert_allclose(np.asarray(a, F32), np.asarray(b, F32),
                               atol=2.0**-6)


@pytest.mark.parametrize("method", default_run_keeps(LOW_MEMORY))
def test_pmap_replicas_agree_with_a_single_device_run(method):
  """Replicas hold the same key, so they draw the same bits and stay equal."""
  n = min(jax.device_count(), 8)
  opt = master_weights(optax.sgd(0.1, momentum=0.9), method=method)
  params = _params(BF16)
  state = opt.init(params)
  grads = jax.tree.map(lambda g: g.astype(BF16), _grad_sequence(1)[0])

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return _apply(params, updates), state

  replicate = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n), t)
  rp, rs = jax.pmap(step, axis_name="i")(replicate(params), replicate(state),
                                         replicate(grads))
  sp, ss = jax.jit(step)(params, state, grads)
  for i in (0, n - 1):
    assert_bit_identical(jax.tree.map(lambda x: x[i], rp), sp)
    assert_bit_identical(jax.tree.map(lambda x: x[i], rs), ss)


# -- checkpoints -----------------------------------------------------------------


def _trained(method):
  opt = jmp_lite.loss_scaling(
      master_weights(with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16),
                     method=method),
      jmp_lite.DynamicLossScale(2.0**10, period=3))
  grads = [jax.tree.map(lambda g: g * 2.0**10, g) for g in _grad_sequence(2)]
  params, state = _run(opt, _params(BF16), grads)
  return opt, params, state


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_pickle_round_trip(method):
  opt, params, state = _trained(method)
  restored = pickle.loads(pickle.dumps(state))
  assert_bit_identical(restored, state)
  grads = jax.tree.map(lambda g: g.astype(BF16), _grad_sequence(1)[0])
  assert_bit_identical(opt.update(grads, restored, params),
                       opt.update(grads, state, params))


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_orbax_checkpoint_round_trip(method, tmp_path):
  opt, params, state = _trained(method)
  restored = orbax_round_trip(
      {"params": params, "opt_state": state}, tmp_path / "ckpt",
      {"params": jax.eval_shape(lambda: params),
       "opt_state": jax.eval_shape(opt.init, params)})  # the documented target
  assert_bit_identical(restored["opt_state"], state)
  grads = jax.tree.map(lambda g: g.astype(BF16), _grad_sequence(1)[0])
  # One jitted update for both (restored arrays are committed: eager, every
  # op would compile again); test_pickle_round_trip continues eagerly.
  update = jax.jit(opt.update)
  assert_bit_identical(update(grads, restored["opt_state"], params),
                       update(grads, state, params))


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("method,error,match", [
    ("sr", ValueError, r"unknown method 'sr'.*'copy'.*'stochastic_rounding'"
     r".*'kahan'"),
    ("kahn", ValueError, r"unknown method 'kahn'"),
    (1, TypeError, r"method must be a string, got int: 1\. Choose 'copy'.*"
     r"'stochastic_rounding'.*'kahan'"),
    (None, TypeError, r"got NoneType: None"),
])
def test_unknown_method_raises(method, error, match):
  with pytest.raises(error, match=match):
    master_weights(optax.sgd(0.1), method=method)


def test_method_names_ignore_case_and_spaces():
  # One option contract (checks.choice), as for every other option name.
  state = master_weights(optax.sgd(0.1), method=" Kahan ").init(
      {"w": jnp.ones(2, BF16)})
  assert state.compensation["w"].dtype == jnp.int16


@pytest.mark.parametrize("method", ["copy", "kahan"])
def test_seed_without_random_bits_raises(method):
  with pytest.raises(ValueError, match=rf"seed=3 was given, but "
                     rf"method='{method}' draws no random bits"):
    master_weights(optax.sgd(0.1), method=method, seed=3)


@pytest.mark.parametrize("seed,error,match", [
    (jax.random.key(0), TypeError, r"seed must be an int, got an array of "
     r"shape \(\).*PRNG key|seed must be an int"),
    (jax.random.PRNGKey(0), TypeError, r"array of shape \(2,\) and dtype "
     r"uint32 \(a PRNG key\?\).*no key per step"),
    (1.5, TypeError, r"seed must be an int >= 0, got float: 1.5"),
    (True, TypeError, r"seed must be an int >= 0, got bool: True"),
    (-1, ValueError, r"between 0 and 4294967295, got -1"),
    (2**32, ValueError, r"got 4294967296"),
])
def test_bad_seed_raises(seed, error, match):
  with pytest.raises(error, match=match):
    master_weights(optax.sgd(0.1), method=SR, seed=seed)


def test_numpy_integer_seed_is_accepted():
  state = master_weights(optax.sgd(0.1), method=SR, seed=np.int64(5)).init(
      {"w": jnp.ones(2, BF16)})
  np.testing.assert_array_equal(state.rng_key,
                                jax.random.key_data(jax.random.key(5)))


@pytest.mark.parametrize("method", LOW_MEMORY)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16, "f16"])
def test_other_compute_dtype_raises(method, dtype):
  with pytest.raises(ValueError, match=rf"method='{method}'\) computes in "
                     r"float32, got dtype=(float64|bfloat16|float16)"):
    master_weights(optax.sgd(0.1), dtype, method=method)


@pytest.mark.parametrize("method", LOW_MEMORY)
@pytest.mark.parametrize("params,found", [
    ({"w": jnp.ones(3)}, "float32"),
    ({"w": jnp.ones(3), "n": jnp.zeros(2, jnp.int32)}, "float32, int32"),
    ({"n": jnp.zeros(2, jnp.int32)}, "int32"),
], ids=["f32", "f32_int", "int"])
def test_params_without_half_precision_raise(method, params, found):
  opt = master_weights(optax.sgd(0.1), method=method)
  with pytest.raises(ValueError, match=rf"method='{method}'\) rounds each "
                     rf"float32 update to half-precision params .*got {found}"
                     r"\).*cast_to_param"):
    opt.init(params)


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_params_without_leaves_are_accepted(method):
  """A tree without leaves has nothing to round and nothing to refuse: it is
  what optax.tree_map_params hands init (one placeholder for the params)."""
  opt = master_weights(optax.sgd(0.1), method=method)
  updates, _ = opt.update({}, opt.init({}), {})
  assert updates == {}


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_float8_params_raise(method):
  params = {"w": jnp.ones(3, BF16), "q": jnp.ones(3, jnp.float8_e4m3fn)}
  with pytest.raises(ValueError, match=r"rounds to bfloat16 or float16 params,"
                     r" got \['q'\] \(float8_e4m3fn\).*method='copy'"):
    master_weights(optax.sgd(0.1), method=method).init(params)


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_float64_params_raise(method):
  with pytest.raises(ValueError, match="cannot represent"):
    master_weights(optax.sgd(0.1), method=method).init(
        {"w": np.ones(2, np.float64), "h": jnp.ones(2, BF16)})


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_loss_scaling_inside_raises(method):
  inner = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale())
  with pytest.raises(TypeError, match="must be the outermost"):
    master_weights(inner, method=method).init({"w": jnp.ones(2, BF16)})


@pytest.mark.parametrize("method", LOW_MEMORY)
def test_update_without_params_raises(method):
  opt = master_weights(optax.sgd(0.1), method=method)
  params = {"w": jnp.ones(2, BF16)}
  with pytest.raises(ValueError, match="needs the current params"):
    opt.update(params, opt.init(params))


@pytest.mark.parametrize("method", ["copy", *LOW_MEMORY])
def test_float8_state_in_the_params_raises(method):
  """jmp_lite's float8 amax histories are not parameters: handed to the
  optimizer with them, init refuses (as loss_scaling does)."""
  variables = {"params": {"w": jnp.ones(3, BF16)},
               "fp8_state": {"dense": {"amax_history": jnp.zeros(16, F32)}}}
  with pytest.raises(ValueError, match=r"jmp_lite.master_weights: .*float8 "
                     r"state at \['fp8_state'\]"):
    master_weights(optax.sgd(0.1), method=method).init(variables)
  master_weights(optax.sgd(0.1), method=method).init(variables["params"])


def test_float8_state_in_with_state_dtype_params_raises():
  variables = {"params": {"w": jnp.ones(3)},
               "fp8_state": {"amax_history": jnp.zeros(16, F32)}}
  with pytest.raises(ValueError, match=r"jmp_lite.with_state_dtype: .*float8 "
                     r"state at \['fp8_state'\]"):
    with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16).init(variables)
  with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16).init(
      variables["params"])


# -- states and params that do not fit ------------------------------------------


@pytest.mark.parametrize("made,used", [
    (a, b) for a in ("copy", *LOW_MEMORY) for b in ("copy", *LOW_MEMORY)
    if a != b])
def test_a_state_of_another_method_is_refused_naming_both(made, used):
  params = {"w": jnp.ones((4, 3), BF16), "s": jnp.ones(3)}
  state = master_weights(optax.sgd(0.1), method=made).init(params)
  opt = master_weights(optax.sgd(0.1), method=used)
  with pytest.raises(ValueError, match=rf"method='{used}'\)'s update got a "
                     rf"state made by method='{made}'.*build the optimizer "
                     rf"with method='{made}'"):
    opt.update(params, state, params)


@pytest.mark.parametrize("method", ["copy", "kahan"])
def test_params_of_other_dtypes_than_at_init_are_refused(method):
  """A Kahan update given float32 params (it raised KeyError: dtype) or a
  master copy given them: a ValueError naming the param and the fix, before
  anything is computed, eager and under jit."""
  params = {"w": jnp.ones((4, 3), BF16), "s": jnp.ones(3)}
  opt = master_weights(optax.sgd(0.1), method=method)
  state = opt.init(params)
  wide = {"w": jnp.ones((4, 3)), "s": jnp.ones(3)}
  for update in (opt.update, jax.jit(opt.update)):
    with pytest.raises(ValueError, match=r"\['w'\] is float32\[4, 3\] and the "
                       r"state keeps a .* for it.*dtypes given to init"):
      update(wide, state, wide)
  narrow = {"w": jnp.ones((4, 3), BF16), "s": jnp.ones(3, BF16)}
  with pytest.raises(ValueError, match=r"\['s'\] is bfloat16\[3\] and the "
                     r"state keeps nothing for it"):
    opt.update(narrow, state, narrow)
  if method == "kahan":
    with pytest.raises(ValueError, match=r"get_master_params got params"):
      jmp_lite.get_master_params(state, wide)
