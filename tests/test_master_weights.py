"""Tests for master_weights, get_master_params and with_state_dtype.

Covers: the master copy's layout, dtypes and sharding; params equal to the
master copy rounded to their dtype, bit for bit, for every optax optimizer we
support and every half dtype, jitted or not; the stall of half-precision
params that master weights cure; state dtypes stable across updates; no
recompilation; composition with loss_scaling (a skipped step leaves params,
master copy and inner state bit-identical) and with each other; pmap,
NamedSharding, pickle and orbax round trips; finding the state in composed
optimizers; and every bad input.
"""

import functools
import json
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
from jmp_lite._src.master_weights import MasterWeightsState
from jmp_lite import with_state_dtype

from helpers import assert_bit_identical
from helpers import default_run_keeps
from helpers import assert_exited_cleanly
from helpers import maybe_jit
from helpers import pull_to_zero
from helpers import ROOT
from helpers import run_example
from helpers import orbax_round_trip

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
I32 = np.dtype(jnp.int32)
HALF = [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")]
JIT = [pytest.param(False, id="eager"), pytest.param(True, id="jit")]
#: master_weights' methods; the low-memory ones have their own tests in
#: test_low_memory_updates.py, and share these where they apply.
METHODS = ["copy", "stochastic_rounding", "kahan"]

standard_promotion = pytest.mark.standard_promotion

# optax's adam family computes `float ** int32` and needs standard promotion.
INNERS = [
    pytest.param(lambda: optax.sgd(0.05), id="sgd"),
    pytest.param(lambda: optax.sgd(0.05, momentum=0.9), id="sgd_momentum"),
    pytest.param(lambda: optax.adam(1e-2), id="adam", marks=standard_promotion),
    pytest.param(lambda: optax.adamw(1e-2, weight_decay=0.1), id="adamw",
                 marks=standard_promotion),
    pytest.param(lambda: optax.lion(1e-3), id="lion"),
    pytest.param(lambda: optax.adafactor(1e-2), id="adafactor"),
    pytest.param(lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.adam(1e-2)),
                 id="clip_adam", marks=standard_promotion),
]


# -- helpers -------------------------------------------------------------------


def _params(dtype, seed=0):
  """A small model's params: a matrix, a vector and a scalar."""
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.normal(scale=0.5, size=(8, 6)), dtype),
      "b": jnp.asarray(rng.normal(scale=0.5, size=(6,)), dtype),
      "s": jnp.asarray(0.3, dtype),
  }


def _targets(seed=1):
  """Where the quadratic loss pulls the params (many elements cross zero)."""
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.normal(scale=0.5, size=(8, 6)), F32),
      "b": jnp.asarray(rng.normal(scale=0.5, size=(6,)), F32),
      "s": jnp.asarray(-0.2, F32),
  }


def _grads(params, targets):
  """Gradients of 0.5 * |p - target|^2, in the params' dtype (as a half
  backward pass would give them)."""
  return jax.tree_util.tree_map(
      lambda p, t: (p.astype(F32) - t).astype(p.dtype), params, targets)


def _apply(params, updates):
  """``optax.apply_updates``'s arithmetic, written strict-promotion clean:
  ``p + u`` in the wider dtype, cast back to ``p``'s dtype."""

  def add(p, u):
    wide = p.dtype if p.dtype.itemsize > u.dtype.itemsize else u.dtype
    return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

  return jax.tree_util.tree_map(add, params, updates)


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype), tree)


def _assert_params_are_rounded_master(params, state):
  master = get_master_params(state, params)
  rounded = jax.tree_util.tree_map(
      lambda m, p: m.astype(p.dtype), master, params)
  assert_bit_identical(params, rounded)


# -- the master copy -----------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_init_makes_a_float32_master_copy_and_inner_state(dtype):
  params = _params(dtype)
  state = master_weights(optax.sgd(0.1, momentum=0.9)).init(params)
  assert isinstance(state, MasterWeightsState)
  master = state.master_params
  assert _dtypes(master) == jax.tree_util.tree_map(lambda _: F32, params)
  leaves = jax.tree_util.tree_leaves
  for m, p in zip(leaves(master), leaves(params)):
    np.testing.assert_array_equal(np.asarray(m), np.asarray(p.astype(F32)))
  # The inner optimizer was built from the master copy: float32 momentum.
  trace = state.inner_state[0].trace
  assert _dtypes(trace) == jax.tree_util.tree_map(lambda _: F32, params)


def test_init_copies_only_params_narrower_than_the_master_dtype():
  """A float32 param (a norm scale among bfloat16 weights) needs no float32
  copy: the state holds optax.MaskedNode() there (no leaf, no bytes; orbax
  refuses zero-size arrays), as optax.masked does for a param without
  state."""
  params = {"w": jnp.ones((8, 6), BF16), "scale": jnp.ones(6, F32),
            "step": jnp.zeros((), I32)}
  state = master_weights(optax.sgd(0.1)).init(params)
  assert state.master_params["w"].dtype == F32
  assert state.master_params["scale"] == optax.MaskedNode()
  assert state.master_params["step"] == optax.MaskedNode()
  assert [x.nbytes for x in jax.tree_util.tree_leaves(state.master_params)
          ] == [8 * 6 * 4]
  full = get_master_params(state, params)
  assert full["scale"] is params["scale"] and full["step"] is params["step"]
  with pytest.raises(ValueError, match="structure of the params"):
    get_master_params(state, {"w": params["w"]})


def test_master_dtype_accepts_names_and_scalar_types():
  params = {"w": jnp.ones(2, BF16)}
  for dtype in ("f32", "float32", np.float32, np.dtype("float32"), jnp.float32):
    state = master_weights(optax.sgd(0.1), dtype).init(params)
    assert state.master_params["w"].dtype == F32


@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("jit", JIT)
def test_params_are_the_rounded_master_bit_for_bit(make_inner, dtype, jit):
  """After every step, params == master.astype(params.dtype), exactly, using
  optax.apply_updates itself (where the promotion mode allows it)."""
  opt = master_weights(make_inner())
  params, targets = _params(dtype), _targets()
  state = opt.init(params)
  standard = jax.config.jax_numpy_dtype_promotion == "standard"
  apply = optax.apply_updates if standard else _apply

  def step(params, state):
    updates, state = opt.update(_grads(params, targets), state, params)
    return apply(params, updates), state, updates

  step = maybe_jit(step, jit)
  for _ in range(25):
    params, state, updates = step(params, state)
    _assert_params_are_rounded_master(params, state)
  assert _dtypes(params) == jax.tree_util.tree_map(lambda _: dtype, params)
  assert _dtypes(updates) == jax.tree_util.tree_map(lambda _: F32, params)
  # It trained: the master copy moved away from the initial params.
  moved = jax.tree_util.tree_map(
      lambda m, p0: bool(jnp.any(m != p0.astype(F32))),
      get_master_params(state, params), _params(dtype))
  assert all(jax.tree_util.tree_leaves(moved))


@pytest.mark.parametrize("half", [BF16, F16], ids=["bf16", "f16"])
def test_landing_is_exact_within_the_documented_range(half):
  """Update = rounded target - params in f32 lands exactly unless an element
  shrinks by more than 2**16 (bf16) / 2**13 (f16) in one step, and then the
  next step lands exactly again."""
  rng = np.random.default_rng(0)
  n = 20000
  p = (rng.normal(size=n) * np.exp2(rng.uniform(-20, 4, n))).astype(half)
  t = (rng.normal(size=n) * np.exp2(rng.uniform(-20, 4, n))).astype(half)
  p, t = jnp.asarray(p), jnp.asarray(t)
  # The master copy is set to t; an inner optimizer that does not move it.
  opt = master_weights(optax.set_to_zero())
  state = opt.init({"x": p})._replace(master_params={"x": t.astype(F32)})
  zero = {"x": jnp.zeros(n, half)}
  updates, state = opt.update(zero, state, {"x": p})
  np.testing.assert_array_equal(state.master_params["x"], t.astype(F32))
  new_p = _apply({"x": p}, updates)["x"]
  # |t| >= |p| * 2**-(limit), by exponents: always exact.
  limit = 16 if half == BF16 else 13
  exp = lambda x: np.floor(np.log2(np.abs(np.asarray(x, np.float64)) + 1e-300))
  is_zero = lambda x: np.asarray(x, F32) == 0
  within = (exp(p) - exp(t) <= limit) | is_zero(p) | is_zero(t)
  assert 0.9 < within.mean() < 1
  new_p, t_np = np.asarray(new_p), np.asarray(t)
  np.testing.assert_array_equal(new_p[within], t_np[within])
  assert np.any(new_p[~within] != t_np[~within])
  # Beyond the range, one more step (master unchanged) lands exactly.
  updates, state = opt.update(zero, state, {"x": jnp.asarray(new_p)})
  np.testing.assert_array_equal(
      _apply({"x": jnp.asarray(new_p)}, updates)["x"], t)


@standard_promotion
def test_float32_params_train_exactly_as_the_inner_optimizer():
  params, targets = _params(F32), _targets()
  plain, wrapped = optax.adam(1e-2), master_weights(optax.adam(1e-2))
  p1, s1 = params, plain.init(params)
  p2, s2 = params, wrapped.init(params)
  for _ in range(20):
    u1, s1 = plain.update(_grads(p1, targets), s1, p1)
    p1 = optax.apply_updates(p1, u1)
    u2, s2 = wrapped.update(_grads(p2, targets), s2, p2)
    p2 = optax.apply_updates(p2, u2)
  assert_bit_identical(p1, p2)
  assert_bit_identical(p2, get_master_params(s2, p2))
  assert_bit_identical(s1, s2.inner_state)


@standard_promotion
@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
def test_mixed_params_land_on_the_master_with_only_update_jitted(make_inner):
  """The issue's case: only opt.update is jitted, apply_updates runs eagerly.
  XLA contracted a float32 master's m + u into an FMA there, and float32
  params ended one ulp off their copy; a float32 param now has no copy, and
  every param equals its master rounded, bit for bit."""
  params = {**_params(BF16), "scale": jnp.linspace(0.5, 1.5, 6, dtype=F32)}
  targets = {**_targets(), "scale": jnp.zeros(6, F32)}
  opt = master_weights(make_inner())
  state, update = opt.init(params), jax.jit(opt.update)
  for _ in range(25):
    updates, state = update(_grads(params, targets), state, params)
    params = _apply(params, updates)
    _assert_params_are_rounded_master(params, state)
  assert state.master_params["scale"] == optax.MaskedNode()  # no copy
  assert float(params["scale"][0]) != 0.5  # It trained.


def test_updates_below_the_half_spacing_accumulate():
  """sgd steps of 1e-3 at 1.0: below bf16's spacing (2**-8 under 1), so plain
  bf16 params never move, while the master copy accumulates them."""
  params = {"w": jnp.ones(4, BF16)}
  grads = {"w": jnp.ones(4, BF16)}
  plain, wrapped = optax.sgd(1e-3), master_weights(optax.sgd(1e-3))
  p1, s1 = params, plain.init(params)
  p2, s2 = params, wrapped.init(params)
  for _ in range(50):
    u1, s1 = plain.update(grads, s1, p1)
    p1 = _apply(p1, u1)
    u2, s2 = wrapped.update(grads, s2, p2)
    p2 = _apply(p2, u2)
  assert np.all(np.asarray(p1["w"], F32) == 1.0)
  np.testing.assert_allclose(get_master_params(s2, p2)["w"], 0.95, rtol=1e-5)
  np.testing.assert_array_equal(p2["w"], jnp.full(4, 0.95, F32).astype(BF16))


def _stall_run(dtype, inner, jit):
  """100 steps of ``inner`` pulling 4 params at 1.0 to 0, no loss scaling."""
  return pull_to_zero(inner, jmp_lite.NoOpLossScale(), dtype, n=4, steps=100,
                      jit=jit)


@functools.cache
def _stall_baselines():
  """Plain Adam in bfloat16 (it stalls) and float32 (the reference), jitted,
  shared by the eager and the jitted case."""
  with jax.numpy_dtype_promotion("standard"):  # adam: float ** int32
    return (_stall_run(BF16, optax.adam(1e-3), jit=True)[0],
            _stall_run(F32, optax.adam(1e-3), jit=True)[0])


@standard_promotion
@pytest.mark.parametrize("jit", JIT)
def test_stall_of_bf16_params_and_its_cure(jit):
  """The issue's measurement: params at 1.0 pulled to 0 by Adam(1e-3)."""
  stalled, reference = _stall_baselines()
  cured, state = _stall_run(BF16, master_weights(optax.adam(1e-3)), jit)
  assert np.all(np.asarray(stalled["w"], F32) == 1.0)
  np.testing.assert_allclose(reference["w"], 0.9017, atol=1e-3)
  master = get_master_params(state, cured)["w"]
  np.testing.assert_allclose(master, reference["w"], atol=1e-4)
  np.testing.assert_array_equal(cured["w"], master.astype(BF16))
  # The params are within half a bf16 spacing (2**-9 at 0.9) of f32's.
  assert np.max(np.abs(np.asarray(cured["w"], F32) - reference["w"])) <= 2.0**-9


# -- dtypes, jit ---------------------------------------------------------------


@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("method", METHODS)
def test_state_dtypes_unchanged_by_update(make_inner, jit, method):
  params, targets = _params(BF16), _targets()
  for opt in (master_weights(make_inner(), method=method),
              with_state_dtype(make_inner(), BF16),
              master_weights(with_state_dtype(make_inner(), BF16),
                             method=method)):
    state = opt.init(params)
    before = _dtypes(state)
    update = maybe_jit(opt.update, jit)
    for _ in range(3):
      _, state = update(_grads(params, targets), state, params)
      assert _dtypes(state) == before


@standard_promotion
@pytest.mark.parametrize("method", METHODS)
def test_no_recompilation_on_the_second_step(method):
  traces = []
  opt = jmp_lite.loss_scaling(
      master_weights(with_state_dtype(optax.adamw(1e-2), BF16),
                     method=method),
      jmp_lite.DynamicLossScale(2.0**10, period=2))
  targets = _targets()

  def loss(params):
    return 0.5 * sum(jnp.sum((p.astype(F32) - targets[k]) ** 2)
                     for k, p in params.items())

  @jax.jit
  def step(params, state):
    traces.append(1)
    loss_scale = jmp_lite.get_loss_scale(state)
    grads = jax.grad(lambda p: loss_scale.scale(loss(p)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _params(F16)
  state = opt.init(params)
  for _ in range(5):  # The scale grows on steps 2 and 4.
    params, state = step(params, state)
  assert len(traces) == 1
  assert float(jmp_lite.get_loss_scale(state).loss_scale) == 2.0**12
  if method == "copy":
    _assert_params_are_rounded_master(params, state)


def test_update_is_strict_promotion_clean():
  """The library code itself runs under strict promotion (this module's
  default): sgd, lion and adafactor are strict-clean, so is the wrapper."""
  assert jax.config.jax_numpy_dtype_promotion == "strict"
  params, targets = _params(F16), _targets()
  for inner in (optax.sgd(0.1, momentum=0.9), optax.lion(1e-3)):
    opt = jmp_lite.loss_scaling(master_weights(with_state_dtype(inner, BF16)),
                                jmp_lite.StaticLossScale(8.0))
    state = opt.init(params)
    for _ in range(3):
      grads = jmp_lite.StaticLossScale(8.0).scale(_grads(params, targets))
      grads = jax.tree_util.tree_map(
          lambda g, p: g.astype(p.dtype), grads, params)
      updates, state = jax.jit(opt.update)(grads, state, params)
      params = _apply(params, updates)
    _assert_params_are_rounded_master(params, state)


@standard_promotion
def test_multi_steps_inside_accumulates_in_float32():
  opt = master_weights(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3))
  params, targets = _params(BF16), _targets()
  state = opt.init(params)
  assert _dtypes(state.inner_state.acc_grads) == jax.tree_util.tree_map(
      lambda _: F32, params)
  step = jax.jit(lambda p, s: opt.update(_grads(p, targets), s, p))
  for i in range(7):
    updates, state = step(params, state)
    new_params = optax.apply_updates(params, updates)
    if i % 3 != 2:  # A mini-step: nothing moves.
      assert_bit_identical(new_params, params)
    params = new_params
    _assert_params_are_rounded_master(params, state)
  assert int(state.inner_state.gradient_step) == 2


def test_update_passes_extra_args_to_inner():
  seen = {}

  def update(updates, state, params=None, **extra_args):
    seen.update(extra_args)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update)
  params = {"w": jnp.ones(2, BF16)}
  for opt in (*(master_weights(inner, method=m) for m in METHODS),
              with_state_dtype(inner, BF16)):
    seen.clear()
    opt.update({"w": jnp.ones(2, BF16)}, opt.init(params), params, value=3)
    assert seen == {"value": 3}


@pytest.mark.parametrize("method", METHODS)
def test_non_floating_leaves_pass_through(method):
  params = {"w": jnp.ones(3, BF16), "steps": jnp.arange(3, dtype=jnp.int32)}
  mask = {"w": True, "steps": False}
  opt = master_weights(optax.masked(optax.sgd(0.5), mask), method=method)
  state = opt.init(params)
  if method != "stochastic_rounding":
    kept = state.master_params if method == "copy" else state.compensation
    assert kept["steps"] == optax.MaskedNode()
  grads = {"w": jnp.ones(3, BF16), "steps": jnp.zeros(3, jnp.int32)}
  updates, state = opt.update(grads, state, params)
  assert updates["steps"].dtype == I32 and not np.any(updates["steps"])
  params = _apply(params, updates)
  np.testing.assert_array_equal(params["steps"], jnp.arange(3))
  np.testing.assert_array_equal(
      get_master_params(state, params)["steps"], params["steps"])
  np.testing.assert_array_equal(params["w"], jnp.full(3, 0.5, BF16))


# -- loss scaling --------------------------------------------------------------


@standard_promotion
@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("poison", [np.inf, np.nan], ids=["inf", "nan"])
def test_skipped_step_leaves_params_master_and_inner_state_bit_identical(
    jit, poison):
  opt = jmp_lite.loss_scaling(
      master_weights(with_state_dtype(optax.adamw(1e-2), BF16)),
      jmp_lite.DynamicLossScale(2.0**12))
  params, targets = _params(F16), _targets()
  state = opt.init(params)

  def step(params, state, grads):
    ls = jmp_lite.get_loss_scale(state)
    grads = jax.tree_util.tree_map(
        lambda g: (g.astype(F32) * ls.loss_scale).astype(g.dtype), grads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = maybe_jit(step, jit)
  for _ in range(3):
    params, state = step(params, state, _grads(params, targets))
  grads = _grads(params, targets)
  grads["w"] = grads["w"].at[2, 3].set(poison)
  new_params, new_state = step(params, state, grads)
  assert not bool(new_state.last_finite)
  assert_bit_identical(new_params, params)
  assert_bit_identical(new_state.inner_state, state.inner_state)
  assert_bit_identical(get_master_params(new_state, new_params),
                        get_master_params(state, params))
  # Training resumes on the next finite step, and still lands exactly.
  params, state = step(new_params, new_state, _grads(new_params, targets))
  assert bool(state.last_finite)
  assert int(state.inner_state.inner_state[0].count) == 4
  _assert_params_are_rounded_master(params, state)


# -- with_state_dtype ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("param_dtype", [F32, BF16], ids=["p32", "pbf16"])
def test_state_dtype_of_adam_moments(dtype, param_dtype):
  params = _params(param_dtype)
  state = with_state_dtype(optax.adam(1e-3), dtype).init(params)
  adam = state[0]
  assert adam.count.dtype == I32
  for name in ("w", "b"):
    assert adam.mu[name].dtype == dtype and adam.nu[name].dtype == dtype
  # The moments of a scalar param are scalars: kept in their own dtype.
  assert adam.mu["s"].dtype == param_dtype


@pytest.mark.parametrize("make_inner,moment_paths", [
    pytest.param(lambda: optax.adamw(1e-3), ("mu", "nu"), id="adamw"),
    pytest.param(lambda: optax.lion(1e-3), ("mu",), id="lion"),
    pytest.param(lambda: optax.sgd(0.1, momentum=0.9), ("trace",),
                 id="sgd_momentum"),
    pytest.param(lambda: optax.adafactor(1e-2), ("v_row", "v_col", "v"),
                 id="adafactor"),
])
def test_state_dtype_covers_every_moment(make_inner, moment_paths):
  params = {"w": jnp.ones((8, 6)), "b": jnp.ones(6)}
  state = with_state_dtype(make_inner(), BF16).init(params)
  leaves = jax.tree_util.tree_leaves_with_path(state)
  moments = [(jax.tree_util.keystr(k), x) for k, x in leaves if x.ndim >= 1]
  assert moments
  assert {x.dtype for _, x in moments} == {BF16}
  for name in moment_paths:
    assert any(name in path for path, _ in moments), (name, moments)
  assert all(x.dtype in (F32, I32) for _, x in
             ((jax.tree_util.keystr(k), x) for k, x in leaves if x.ndim == 0))


@standard_promotion
def test_state_dtype_keeps_injected_hyperparameters_in_their_dtype():
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  opt = with_state_dtype(inner, BF16)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  assert state.hyperparams["learning_rate"].dtype == F32
  assert state.inner_state[0].mu["w"].dtype == BF16
  _, state = opt.update({"w": jnp.ones(3)}, state, params)
  assert state.hyperparams["learning_rate"].dtype == F32
  assert state.inner_state[0].nu["w"].dtype == BF16


@standard_promotion
@pytest.mark.parametrize("jit", JIT)
def test_state_dtype_computes_in_float32(jit):
  """One step equals: upcast the stored moments and grads, run adam in f32,
  round the new moments to bf16."""
  params, targets = _params(F32), _targets()
  opt = with_state_dtype(optax.adam(1e-2), BF16)
  reference = optax.adam(1e-2)
  state = opt.init(params)
  update = maybe_jit(opt.update, jit)

  def reference_update(grads, state, params):
    wide = jax.tree_util.tree_map(
        lambda x: x.astype(F32) if x.dtype == BF16 else x, state)
    updates, state = reference.update(grads, wide, params)
    return updates, jax.tree_util.tree_map(
        lambda x: x.astype(BF16) if x.ndim >= 1 else x, state)

  reference_update = maybe_jit(reference_update, jit)
  for _ in range(3):
    grads = _grads(params, targets)
    ref_updates, ref_state = reference_update(grads, state, params)
    updates, state = update(grads, state, params)
    assert_bit_identical(updates, ref_updates)
    assert_bit_identical(state, ref_state)
    params = optax.apply_updates(params, updates)


@standard_promotion
def test_state_dtype_upcasts_half_gradients():
  opt = with_state_dtype(optax.adam(1e-2), BF16)
  params = {"w": jnp.ones(3, BF16)}
  grads = {"w": jnp.ones(3, BF16)}
  updates, state = opt.update(grads, opt.init(params), params)
  assert updates["w"].dtype == F32
  assert state[0].mu["w"].dtype == BF16


@standard_promotion
def test_bf16_moments_with_master_weights_follow_float32():
  """master_weights(with_state_dtype(adam, bf16)) on bf16 params: memory of
  bf16 moments, and the trajectory stays close to float32 training."""
  params32, targets = _params(F32), _targets()
  opt32 = optax.adam(1e-2)
  opt = master_weights(with_state_dtype(optax.adam(1e-2), BF16))
  p32, s32 = params32, opt32.init(params32)
  p, s = _params(BF16), opt.init(_params(BF16))
  for _ in range(50):
    u32, s32 = opt32.update(_grads(p32, targets), s32, p32)
    p32 = optax.apply_updates(p32, u32)
    u, s = opt.update(_grads(p, targets), s, p)
    p = optax.apply_updates(p, u)
  assert s.inner_state[0].mu["w"].dtype == BF16
  _assert_params_are_rounded_master(p, s)
  for a, b in zip(jax.tree_util.tree_leaves(get_master_params(s, p)),
                  jax.tree_util.tree_leaves(p32)):
    np.testing.assert_allclose(a, b, atol=0.02)


# -- finding the state ---------------------------------------------------------


def test_get_master_params_inside_composed_optimizers():
  params = {"w": jnp.ones(2, BF16)}
  wrapped = [
      master_weights(optax.sgd(0.1)),
      jmp_lite.loss_scaling(master_weights(optax.sgd(0.1)),
                            jmp_lite.NoOpLossScale()),
      optax.chain(optax.clip(1.0), master_weights(optax.sgd(0.1))),
      optax.MultiSteps(master_weights(optax.sgd(0.1)), every_k_schedule=2),
      optax.inject_hyperparams(
          lambda learning_rate: master_weights(optax.sgd(learning_rate)))(
              learning_rate=0.1),
  ]
  for opt in wrapped:
    state = opt.init(params)
    master = get_master_params(state, params)
    assert master["w"].dtype == F32
    np.testing.assert_array_equal(master["w"], jnp.ones(2))
    assert get_master_params({"opt": state}, params)["w"].dtype == F32


def test_get_master_params_without_or_with_two_states_raises():
  params = {"w": jnp.ones(2, BF16)}
  with pytest.raises(ValueError,
                     match="found no master weights.*master_weights"):
    get_master_params(optax.sgd(0.1).init(params), params)
  two = (master_weights(optax.sgd(0.1)).init(params),
         master_weights(optax.sgd(0.1)).init(params))
  with pytest.raises(ValueError, match="found 2 .*ambiguous"):
    get_master_params(two, params)


# -- devices and checkpoints ---------------------------------------------------


@standard_promotion
def test_named_sharding_master_copy_has_the_params_sharding():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (see conftest.py)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  specs = {"w": P("data", "model"), "b": P("model"), "s": P()}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in _params(BF16).items()}
  opt = master_weights(with_state_dtype(optax.adam(1e-2), BF16))
  targets = _targets()
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    updates, state = opt.update(_grads(params, targets), state, params)
    return optax.apply_updates(params, updates), state

  for init in (opt.init, jax.jit(opt.init)):
    state = init(params)
    for name, leaf in state.master_params.items():
      assert leaf.sharding.is_equivalent_to(
          params[name].sharding, leaf.ndim), name
  for _ in range(3):
    params, state = step(params, state)
  assert len(traces) == 1
  for name, leaf in state.master_params.items():
    assert leaf.sharding.is_equivalent_to(
        params[name].sharding, leaf.ndim), name
    assert params[name].sharding.spec == specs[name] or leaf.ndim == 0
  mu = state.inner_state[0].mu["w"]
  assert mu.dtype == BF16
  assert mu.sharding.is_equivalent_to(params["w"].sharding, 2)
  _assert_params_are_rounded_master(params, state)


def test_pmap_replicas_agree_with_a_single_device_run():
  n = min(jax.device_count(), 8)
  opt = master_weights(optax.sgd(0.1, momentum=0.9))
  targets = _targets()
  params = _params(BF16)
  state = opt.init(params)

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return _apply(params, updates), state

  def p_step(params, state, grads):
    grads = jax.lax.pmean(grads, "i")
    return step(params, state, grads)

  grads = _grads(params, targets)
  replicate = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), t)
  rp, rs = jax.pmap(p_step, axis_name="i")(replicate(params), replicate(state),
                                           replicate(grads))
  sp, ss = jax.jit(step)(params, state, grads)  # Compiled, as pmap's is.
  for i in (0, n - 1):
    assert_bit_identical(jax.tree_util.tree_map(lambda x: x[i], rp), sp)
    assert_bit_identical(jax.tree_util.tree_map(lambda x: x[i], rs), ss)


def _trained_state():
  opt = jmp_lite.loss_scaling(
      master_weights(with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16)),
      jmp_lite.DynamicLossScale(2.0**10, period=3))
  params, targets = _params(BF16), _targets()
  state = opt.init(params)
  for _ in range(2):
    updates, state = opt.update(_grads(params, targets), state, params)
    params = _apply(params, updates)
  return opt, params, state


def test_pickle_round_trip():
  opt, params, state = _trained_state()
  restored = pickle.loads(pickle.dumps(state))
  assert_bit_identical(restored, state)
  assert type(get_master_params(restored, params)) is dict
  # The restored state steps exactly as the original.
  grads = _grads(params, _targets())
  assert_bit_identical(opt.update(grads, restored, params),
                        opt.update(grads, state, params))


def test_orbax_checkpoint_round_trip(tmp_path):
  """Mixed params (bfloat16 weights, a float32 scale without a copy) saved
  with orbax and restored into the documented target,
  jax.eval_shape(opt.init, params): the same bytes, and the same next step.
  tests/test_checkpoints.py resumes every method bit for bit."""
  opt = jmp_lite.loss_scaling(
      master_weights(with_state_dtype(optax.sgd(0.1, momentum=0.9), BF16)),
      jmp_lite.DynamicLossScale(2.0**10, period=3))
  params = {**_params(BF16), "scale": jnp.linspace(0.5, 1.5, 6, dtype=F32)}
  targets = {**_targets(), "scale": jnp.zeros(6, F32)}
  state, update = opt.init(params), jax.jit(opt.update)
  for _ in range(2):
    updates, state = update(_grads(params, targets), state, params)
    params = _apply(params, updates)
  restored = orbax_round_trip(
      {"params": params, "opt_state": state}, tmp_path / "ckpt",
      {"params": jax.eval_shape(lambda: params),
       "opt_state": jax.eval_shape(opt.init, params)})
  assert_bit_identical(restored["opt_state"], state)
  assert_bit_identical(restored["params"], params)
  assert isinstance(restored["opt_state"].inner_state, MasterWeightsState)
  assert restored["opt_state"].inner_state.master_params["scale"] == (
      optax.MaskedNode())
  grads = _grads(params, targets)
  assert_bit_identical(update(grads, restored["opt_state"], params),
                       update(grads, state, params))


# -- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("factory", [master_weights, with_state_dtype],
                         ids=["master_weights", "with_state_dtype"])
@pytest.mark.parametrize("inner", [None, "adam", optax.adam, 0.1],
                         ids=["none", "str", "factory", "float"])
def test_non_optax_inner_raises_type_error(factory, inner):
  with pytest.raises(TypeError, match=f"{factory.__name__} expects an optax"):
    factory(inner, jnp.float32)


@pytest.mark.parametrize("factory", [master_weights, with_state_dtype],
                         ids=["master_weights", "with_state_dtype"])
@pytest.mark.parametrize("dtype,shown,error", [
    (jnp.int32, "int32", ValueError), ("int8", "int8", ValueError),
    (np.bool_, "bool", ValueError), (jnp.complex64, "complex64", ValueError),
    (None, "None", TypeError), ("nonsense", "nonsense", TypeError),
    (object(), "object", TypeError),
])
def test_non_floating_dtype_raises(factory, dtype, shown, error):
  """Not a dtype at all: TypeError; a dtype of the wrong kind: ValueError
  (the one dtype validator's rule, as for policies)."""
  with pytest.raises(error, match=rf"{factory.__name__}'s dtype must be a "
                     rf"floating dtype.*{shown}"):
    factory(optax.sgd(0.1), dtype)


@pytest.mark.parametrize("master,param", [
    (BF16, F32), (F16, F32), (F16, BF16), (BF16, F16),
], ids=["bf16_for_f32", "f16_for_f32", "f16_for_bf16", "bf16_for_f16"])
def test_master_dtype_narrower_than_params_raises_at_init(master, param):
  opt = master_weights(optax.sgd(0.1), master)
  params = {"ok": jnp.ones(2, master), "bad": jnp.ones(2, param)}
  with pytest.raises(ValueError, match=rf"master dtype {master.name} cannot "
                     rf"represent .*\['bad'\] \({param.name}\)"
                     r".*dtype=jnp.float32"):
    opt.init(params)
  with pytest.raises(ValueError, match="cannot represent"):
    jax.jit(opt.init)(params)


def test_float64_without_x64_raises():
  assert not jax.config.jax_enable_x64
  with pytest.raises(ValueError, match="float64.*jax_enable_x64"):
    master_weights(optax.sgd(0.1), jnp.float64).init({"w": jnp.ones(2, BF16)})
  with pytest.raises(ValueError, match="float64.*jax_enable_x64"):
    opt = with_state_dtype(optax.sgd(0.1, momentum=0.9), "f64")
    opt.init({"w": jnp.ones(2)})


def test_update_without_params_raises():
  opt = master_weights(optax.sgd(0.1))
  params = {"w": jnp.ones(2, BF16)}
  with pytest.raises(ValueError, match="needs the current params.*opt.update"):
    opt.update(params, opt.init(params))


def test_update_with_a_foreign_state_raises():
  opt = master_weights(optax.sgd(0.1))
  params = {"w": jnp.ones(2, BF16)}
  with pytest.raises(ValueError, match=r"got a .*, not the MasterWeightsState "
                     r"made by its init.*opt.init"):
    opt.update(params, optax.sgd(0.1).init(params), params)


def test_state_dtype_around_master_weights_raises():
  opt = with_state_dtype(master_weights(optax.sgd(0.1)), BF16)
  with pytest.raises(ValueError, match=r"master_weights\(with_state_dtype"):
    opt.init({"w": jnp.ones(2, BF16)})


# -- the example ---------------------------------------------------------------


@pytest.mark.slow
def test_example_runs_and_writes_results(tmp_path):
  proc = run_example(ROOT / "examples" / "master_weights.py", "--steps", 20,
                     "--stall-steps", 100, "--out", tmp_path)
  assert_exited_cleanly(proc)
  data = json.loads((tmp_path / "master_weights.json").read_text())
  stall = data["stall"]
  assert stall["bf16"]["final_value"] == 1.0
  assert abs(stall["f32"]["final_value"] - 0.9017) < 1e-3
  assert stall["bf16_master"]["matches_f32"]
  runs = data["runs"]
  assert runs["bf16_master"]["state_bytes"] > runs["bf16"]["state_bytes"]
  total = lambda r: r["state_bytes"] + r["params_bytes"]
  assert total(runs["f32_bf16_moments"]) < total(runs["f32"])
  assert "| configuration |" in (tmp_path / "master_weights.md").read_text()
