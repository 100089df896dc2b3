"""Tests for loss_scaling, get_loss_scale and scaled_value_and_grad (optax).

Covers finite and skipped steps for several inner optimizers and gradient
dtypes (updates dtypes, state dtypes, bit-identical inner state on a skip,
counters), the underflow rescue that is the point of loss scaling, finding the
scale inside composed optimizer states, the value-and-grad helper, and a whole
jitted train step (no recompilation, and ``lax.scan`` over steps).
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from helpers import assert_bit_identical
from helpers import default_run_keeps
from helpers import debug_nans_and_infs
from helpers import faulty

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
I32 = np.dtype(jnp.int32)

HALF_AND_FULL = [F16, BF16, F32]

standard_promotion = pytest.mark.standard_promotion


@pytest.fixture(autouse=True)
def _no_nan_or_inf_anywhere():
  """jax_debug_nans and jax_debug_infs on for every test: a finite step may
  create no NaN/inf (DESIGN.md, "Scale"); the steps given NaN/inf gradients
  on purpose run inside ``faulty()``."""
  with debug_nans_and_infs():
    yield

# optax's adam family computes `float ** int32` and needs standard promotion.
INNERS = [
    pytest.param(lambda: optax.sgd(0.1), id="sgd"),
    pytest.param(lambda: optax.sgd(0.1, momentum=0.9), id="sgd_momentum"),
    pytest.param(lambda: optax.adam(0.1), id="adam", marks=standard_promotion),
    pytest.param(lambda: optax.adamw(0.1), id="adamw",
                 marks=standard_promotion),
    pytest.param(lambda: optax.lion(0.1), id="lion"),
    pytest.param(lambda: optax.adafactor(0.1), id="adafactor"),
]


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.normal(size=(4, 3)), F32),
      "b": jnp.asarray(rng.normal(size=(3,)), F32),
  }


def _true_grads(seed=1):
  """Unscaled float32 gradients for ``_params``."""
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.normal(size=(4, 3)), F32),
      "b": jnp.asarray(rng.normal(size=(3,)), F32),
  }


def _scaled(grads, scale, dtype):
  """What the backward pass of a scaled loss hands to ``update``."""
  return jax.tree_util.tree_map(lambda g: (g * np.float32(scale)).astype(dtype),
                                grads)


def _poison(grads, value):
  """Puts ``value`` (inf or nan) into one element of one leaf. As numpy: a
  JAX op making it would trip jax_debug_nans/infs outside ``faulty()``."""
  grads = dict(grads)
  grads["w"] = np.array(grads["w"])
  grads["w"][1, 2] = value
  return grads


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype), tree)


def _counts(tree):
  """Every leaf of ``tree`` stored in a field called ``count`` (step counts)."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "count":
      found.append(int(leaf))
  return found


def _update_fn(opt, jit):
  return jax.jit(opt.update) if jit else opt.update


# ---------------------------------------------------------------------------
# Finite and non-finite steps.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("grad_dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("make_inner", default_run_keeps(INNERS))
def test_finite_skipped_and_recovered_steps(make_inner, grad_dtype, jit):
  """A finite step applies; inf/-inf/nan steps are skipped; finite recovers."""
  params = _params()
  scale = 2.0**4
  opt = jmp_lite.loss_scaling(
      make_inner(), jmp_lite.DynamicLossScale(scale, period=1000)
  )
  update = _update_fn(opt, jit)
  state = opt.init(params)
  grads = _scaled(_true_grads(), scale, grad_dtype)

  updates, new_state = update(grads, state, params)
  _check_finite_step(make_inner(), params, grads, scale, state, updates,
                     new_state)
  counts_before = _counts(new_state.inner_state)
  assert all(count == 1 for count in counts_before)
  # Eager dispatch is slow: the eager variant checks inf and nan only.
  for bad in (np.inf, -np.inf, np.nan) if jit else (np.inf, np.nan):
    _check_skip_then_recover(update, params, new_state, grads, bad,
                             _dtypes(updates), counts_before, scale,
                             grad_dtype)


def _check_finite_step(inner, params, grads, scale, state, updates, new_state):
  """The wrapper's first step equals the inner optimizer's on f32 grads."""
  unscaled = jax.tree_util.tree_map(
      lambda g: g.astype(F32) / np.float32(scale), grads
  )
  ref_updates, ref_inner = inner.update(unscaled, inner.init(params), params)
  assert _dtypes(updates) == _dtypes(ref_updates)
  assert _dtypes(updates) == {"w": F32, "b": F32}
  jax.tree_util.tree_map(
      lambda u, r: np.testing.assert_allclose(u, r, rtol=1e-5, atol=1e-7),
      updates, ref_updates,
  )
  jax.tree_util.tree_map(
      lambda s, r: np.testing.assert_allclose(s, r, rtol=1e-5, atol=1e-7),
      new_state.inner_state, ref_inner,
  )
  # State dtypes (and structure) are unchanged by update.
  assert _dtypes(new_state) == _dtypes(state)
  assert (jax.tree_util.tree_structure(new_state)
          == jax.tree_util.tree_structure(state))
  new_params = optax.apply_updates(params, updates)
  assert not np.allclose(new_params["w"], params["w"])
  assert bool(new_state.last_finite)
  assert int(new_state.skipped_steps) == 0
  assert int(new_state.consecutive_skips) == 0
  assert float(new_state.loss_scale.loss_scale) == scale
  assert int(new_state.loss_scale.counter) == 1


def _check_skip_then_recover(update, params, state, grads, bad, update_dtypes,
                             counts_before, scale, grad_dtype):
  """Two bad steps in a row are skipped, then a finite step applies."""
  with faulty():
    updates, skipped = update(_poison(grads, bad), state, params)

  assert _dtypes(updates) == update_dtypes
  for leaf in jax.tree_util.tree_leaves(updates):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
  assert_bit_identical(skipped.inner_state, state.inner_state)
  assert _counts(skipped.inner_state) == counts_before
  assert _dtypes(skipped) == _dtypes(state)
  assert not bool(skipped.last_finite)
  assert int(skipped.skipped_steps) == 1
  assert int(skipped.consecutive_skips) == 1
  assert float(skipped.loss_scale.loss_scale) == scale / 2
  assert int(skipped.loss_scale.counter) == 0

  with faulty():
    _, skipped2 = update(_poison(grads, bad), skipped, params)
  assert_bit_identical(skipped2.inner_state, state.inner_state)
  assert int(skipped2.skipped_steps) == 2
  assert int(skipped2.consecutive_skips) == 2
  assert float(skipped2.loss_scale.loss_scale) == scale / 4

  # A finite step resets the run of skips but not the total.
  grads = _scaled(_true_grads(), scale / 4, grad_dtype)
  updates, recovered = update(grads, skipped2, params)
  assert bool(recovered.last_finite)
  assert int(recovered.consecutive_skips) == 0
  assert int(recovered.skipped_steps) == 2
  assert _counts(recovered.inner_state) == [c + 1 for c in counts_before]
  assert any(np.any(leaf != 0) for leaf in jax.tree_util.tree_leaves(updates))
  assert _dtypes(recovered) == _dtypes(state)


@pytest.mark.standard_promotion
def test_skip_keeps_adam_count_exactly():
  params = _params()
  opt = jmp_lite.loss_scaling(optax.adam(0.1), jmp_lite.DynamicLossScale(8.0))
  state = opt.init(params)
  update = jax.jit(opt.update)
  grads = _scaled(_true_grads(), 8.0, F16)
  _, state = update(grads, state, params)
  with faulty():
    _, state = update(_poison(grads, np.inf), state, params)
  adam_state = state.inner_state[0]
  assert isinstance(adam_state, optax.ScaleByAdamState)
  assert int(adam_state.count) == 1
  assert adam_state.count.dtype == I32


def test_static_and_noop_scales_skip_without_changing_scale():
  params = _params()
  grads = _poison(_scaled(_true_grads(), 4.0, F16), np.inf)
  for ls in (jmp_lite.StaticLossScale(4.0), jmp_lite.NoOpLossScale()):
    opt = jmp_lite.loss_scaling(optax.sgd(0.1), ls)
    with faulty():
      updates, state = jax.jit(opt.update)(grads, opt.init(params), params)
    assert not bool(state.last_finite)
    assert int(state.skipped_steps) == 1
    assert type(state.loss_scale) is type(ls)
    assert state.loss_scale.loss_scale == ls.loss_scale
    for leaf in jax.tree_util.tree_leaves(updates):
      np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_state_fields():
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0))
  state = opt.init(_params())
  assert isinstance(state, jmp_lite.LossScaleState)
  assert state.skipped_steps.dtype == I32 and state.skipped_steps.shape == ()
  assert state.consecutive_skips.dtype == I32
  assert state.last_finite.dtype == np.bool_ and bool(state.last_finite)
  assert isinstance(state.loss_scale, jmp_lite.DynamicLossScale)


@pytest.mark.standard_promotion  # optax.MultiSteps / reduce_on_plateau
def test_update_passes_extra_args_to_inner():
  """Extra args reach an inner GradientTransformationExtraArgs (e.g. value).
  optax's reduce_on_plateau keeps inf in its own state (best_value): the
  NaN/inf checks are off for it."""
  with faulty():
    _check_extra_args()


def _check_extra_args():
  params = _params()
  inner = optax.contrib.reduce_on_plateau(patience=1)
  opt = jmp_lite.loss_scaling(optax.chain(optax.sgd(0.1), inner),
                              jmp_lite.StaticLossScale(2.0))
  state = opt.init(params)
  grads = _scaled(_true_grads(), 2.0, F32)
  updates, state = opt.update(grads, state, params, value=jnp.float32(1.0))
  assert bool(state.last_finite)
  with pytest.raises(TypeError):
    opt.update(grads, state, params)  # reduce_on_plateau needs `value`


# ---------------------------------------------------------------------------
# Underflow rescue.
# ---------------------------------------------------------------------------


def _tiny_loss(p16, x16):
  """A loss whose f16 gradients (~1e-8) underflow to zero: computed in f16."""
  return jnp.sum(p16["w"] * x16) * jnp.asarray(2.0**-20, F16)


def test_loss_scaling_rescues_underflowing_half_gradients():
  rng = np.random.default_rng(0)
  x16 = jnp.asarray(rng.uniform(0.01, 0.02, size=(8,)), F16)
  params = {"w": jnp.asarray(rng.normal(size=(8,)), F32)}
  p16 = jax.tree_util.tree_map(lambda p: p.astype(F16), params)
  # The float32 truth, from the same f16 inputs.
  expected = np.asarray(x16, F32) * np.float32(2.0**-20)
  assert np.all(expected > 0)

  plain = jax.grad(_tiny_loss)(p16, x16)
  assert plain["w"].dtype == F16
  np.testing.assert_array_equal(plain["w"], np.zeros(8, F16))

  opt = jmp_lite.loss_scaling(optax.sgd(1.0),
                              jmp_lite.DynamicLossScale(2.0**15))
  state = opt.init(params)
  loss, grads = jmp_lite.scaled_value_and_grad(_tiny_loss, state)(p16, x16)
  assert loss.dtype == F16
  assert grads["w"].dtype == F16
  assert np.all(np.asarray(grads["w"]) != 0)
  updates, state = jax.jit(opt.update)(grads, state, params)
  assert bool(state.last_finite)
  # sgd(1.0): the update is minus the unscaled gradient, kept in float32.
  assert updates["w"].dtype == F32
  np.testing.assert_allclose(-np.asarray(updates["w"]), expected, rtol=1e-3)


# ---------------------------------------------------------------------------
# get_loss_scale inside composed states.
# ---------------------------------------------------------------------------


def _wrapped(scale=8.0):
  return jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(scale))


def _inf_grads():
  return _poison(_true_grads(), np.inf)


def _scale_of(state):
  return float(jmp_lite.get_loss_scale(state).loss_scale)


def test_get_loss_scale_in_chain():
  params = _params()
  opt = optax.chain(_wrapped(), optax.scale_by_schedule(lambda n: 0.5))
  state = opt.init(params)
  assert isinstance(jmp_lite.get_loss_scale(state), jmp_lite.DynamicLossScale)
  assert _scale_of(state) == 8.0
  with faulty():
    updates, state = jax.jit(opt.update)(_inf_grads(), state, params)
  assert _scale_of(state) == 4.0
  for leaf in jax.tree_util.tree_leaves(updates):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


@pytest.mark.standard_promotion  # optax.MultiSteps / reduce_on_plateau
def test_multi_steps_around_loss_scaling_is_refused_with_a_teaching_error():
  """MultiSteps(loss_scaling(...)) poisons its accumulator for good on one inf
  micro-batch (it resets with 0 * acc): refused from the state's layout by
  get_loss_scale / scaled_value_and_grad, before any step."""
  opt = optax.MultiSteps(_wrapped(), every_k_schedule=2)
  state = opt.init(_params())
  with pytest.raises(TypeError, match=r"MultiSteps.*accumulation_steps=k"):
    jmp_lite.get_loss_scale(state)
  with pytest.raises(TypeError, match=r"MultiSteps.*accumulation_steps=k"):
    jmp_lite.scaled_value_and_grad(lambda p: jnp.sum(p["w"]), state)


@pytest.mark.standard_promotion  # optax.MultiSteps / reduce_on_plateau
def test_loss_scaling_around_multi_steps_is_refused_at_init():
  params = _params()
  for inner in (optax.MultiSteps(optax.sgd(0.1), 2),
                optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()):
    opt = jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(8.0))
    with pytest.raises(TypeError, match=r"MultiSteps.*accumulation_steps=k"):
      opt.init(params)


def test_get_loss_scale_around_inject_hyperparams():
  """loss_scaling outermost, inject_hyperparams inside (the other order is
  refused from the state's layout: its schedules would count the skipped
  steps)."""
  params = _params()
  opt = jmp_lite.loss_scaling(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
      jmp_lite.DynamicLossScale(8.0))
  state = opt.init(params)
  assert _scale_of(state) == 8.0
  with faulty():
    _, state = jax.jit(opt.update)(_inf_grads(), state, params)
  assert _scale_of(state) == 4.0
  assert int(state.inner_state.count) == 0  # The skipped step did not count.


def test_get_loss_scale_in_dict_and_of_a_loss_scale():
  params = _params()
  states = {"model": _wrapped(16.0).init(params),
            "other": optax.sgd(0.1).init(params)}
  assert _scale_of(states) == 16.0
  ls = jmp_lite.StaticLossScale(2.0)
  assert jmp_lite.get_loss_scale(ls) is ls


@pytest.mark.standard_promotion
def test_get_loss_scale_without_loss_scaling_raises():
  with pytest.raises(ValueError, match="loss_scaling"):
    jmp_lite.get_loss_scale(optax.adam(0.1).init(_params()))
  with pytest.raises(ValueError):
    jmp_lite.get_loss_scale({})


def test_get_loss_scale_with_two_wrappers_raises():
  """Two optimizers' states kept together (a GAN's two, say)."""
  state = {"g": _wrapped(8.0).init(_params()),
           "d": _wrapped(16.0).init(_params())}
  with pytest.raises(ValueError, match="2"):
    jmp_lite.get_loss_scale(state)
  # Each sub-state on its own is unambiguous.
  assert _scale_of(state["g"]) == 8.0 and _scale_of(state["d"]) == 16.0


def test_two_loss_scalings_in_one_chain_are_refused():
  state = optax.chain(_wrapped(8.0), _wrapped(16.0)).init(_params())
  with pytest.raises(TypeError, match="before loss_scaling"):
    jmp_lite.get_loss_scale(state)


# ---------------------------------------------------------------------------
# scaled_value_and_grad.
# ---------------------------------------------------------------------------


def _loss(params, x):
  pred = x @ params["w"] + params["b"]
  return jnp.mean(jnp.square(pred))


def _x(seed=2):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(5, 4)), F32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scaled_value_and_grad_matches_scaled_grad(jit):
  params, x = _params(), _x()
  ls = jmp_lite.StaticLossScale(8.0)
  fn = jmp_lite.scaled_value_and_grad(_loss, ls)
  fn = jax.jit(fn) if jit else fn
  loss, grads = fn(params, x)
  ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree_util.tree_map(
      lambda g, r: np.testing.assert_allclose(g, 8.0 * r, rtol=1e-5), grads,
      ref_grads,
  )


def test_scaled_value_and_grad_has_aux():
  params, x = _params(), _x()
  marker = {"n": jnp.int32(5)}

  def loss_with_aux(p, x):
    return _loss(p, x), {"pred_mean": jnp.mean(x @ p["w"]), **marker}

  fn = jmp_lite.scaled_value_and_grad(
      loss_with_aux, jmp_lite.DynamicLossScale(4.0), has_aux=True
  )
  (loss, aux), grads = fn(params, x)
  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(
      loss_with_aux, has_aux=True)(params, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(aux["pred_mean"], ref_aux["pred_mean"], rtol=1e-6)
  assert int(aux["n"]) == 5
  np.testing.assert_allclose(grads["w"], 4.0 * ref_grads["w"], rtol=1e-5)


def test_scaled_value_and_grad_argnums_tuple():
  params, x = _params(), _x()
  fn = jmp_lite.scaled_value_and_grad(
      _loss, jmp_lite.StaticLossScale(2.0), argnums=(0, 1)
  )
  loss, (g_params, g_x) = fn(params, x)
  ref_loss, (r_params, r_x) = jax.value_and_grad(_loss, argnums=(0, 1))(
      params, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(g_params["b"], 2.0 * r_params["b"], rtol=1e-5)
  np.testing.assert_allclose(g_x, 2.0 * r_x, rtol=1e-5)


def test_scaled_value_and_grad_given_an_opt_state():
  params, x = _params(), _x()
  state = optax.chain(_wrapped(32.0), optax.clip(1.0)).init(params)
  _, grads = jmp_lite.scaled_value_and_grad(_loss, state)(params, x)
  ref = jax.grad(_loss)(params, x)
  np.testing.assert_allclose(grads["w"], 32.0 * ref["w"], rtol=1e-5)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
def test_scaled_value_and_grad_returns_unscaled_loss_in_fun_dtype(dtype):
  params, x = _params(), _x()

  def half_loss(p, x):
    pred = x.astype(dtype) @ p["w"].astype(dtype)
    return jnp.mean(jnp.square(pred))

  ls = jmp_lite.DynamicLossScale(2.0**10)
  loss, grads = jax.jit(jmp_lite.scaled_value_and_grad(half_loss, ls))(
      params, x)
  assert loss.dtype == dtype
  np.testing.assert_array_equal(np.asarray(loss, F32),
                                np.asarray(half_loss(params, x), F32))
  assert grads["w"].dtype == F32  # w.r.t. the f32 params
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(
      params)


def test_scaled_value_and_grad_bad_input():
  with pytest.raises(TypeError):
    jmp_lite.scaled_value_and_grad("loss", jmp_lite.StaticLossScale(2.0))
  with pytest.raises(ValueError):
    jmp_lite.scaled_value_and_grad(_loss, optax.sgd(0.1).init(_params()))
  fn = jmp_lite.scaled_value_and_grad(_loss, jmp_lite.StaticLossScale(2.0),
                                      has_aux=True)
  with pytest.raises(TypeError, match="aux"):
    fn(_params(), _x())


# ---------------------------------------------------------------------------
# A whole jitted train step.
# ---------------------------------------------------------------------------


def _half_loss(params, batch):
  x, y = batch
  pred = x.astype(F16) @ params["w"].astype(F16) + params["b"].astype(F16)
  return jnp.mean(jnp.square(pred.astype(F32) - y))


def _batches(steps, bad_step=None, seed=3):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(steps, 6, 4)).astype(np.float32)
  if bad_step is not None:
    xs[bad_step, 0, 0] = np.inf
  ys = rng.normal(size=(steps, 6, 3)).astype(np.float32)
  return xs, ys  # numpy (see _poison); the inf step runs jitted, flags on


def _make_opt():
  return jmp_lite.loss_scaling(
      optax.adamw(1e-2), jmp_lite.DynamicLossScale(2.0**10, period=2)
  )


def _make_train_step(opt, traces):
  def train_step(params, state, batch):
    traces.append(1)  # runs only while tracing
    loss_scale = jmp_lite.get_loss_scale(state)
    loss, grads = jax.value_and_grad(
        lambda p: loss_scale.scale(_half_loss(p, batch)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return train_step


@pytest.mark.standard_promotion
def test_train_step_compiles_once():
  opt = _make_opt()
  traces = []
  step = jax.jit(_make_train_step(opt, traces))
  params = _params()
  state = opt.init(params)
  xs, ys = _batches(6, bad_step=2)
  scales = []
  for i in range(6):
    params, state = step(params, state, (xs[i], ys[i]))
    scales.append(float(state.loss_scale.loss_scale))
  assert len(traces) == 1
  if hasattr(step, "_cache_size"):
    assert step._cache_size() == 1
  # The scale changed value (grew, backed off) without a retrace.
  assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
  assert int(state.skipped_steps) == 1
  assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params))


@pytest.mark.standard_promotion
def test_train_step_in_scan_matches_python_loop():
  opt = _make_opt()
  step = _make_train_step(opt, [])
  params = _params()
  xs, ys = _batches(5, bad_step=1)

  loop_params, loop_state = params, opt.init(params)
  jit_step = jax.jit(step)
  for i in range(5):
    loop_params, loop_state = jit_step(loop_params, loop_state, (xs[i], ys[i]))

  @jax.jit
  def run(params, state, xs, ys):
    def body(carry, batch):
      return step(*carry, batch), None
    return lax.scan(body, (params, state), (xs, ys))[0]

  scan_params, scan_state = run(params, opt.init(params), xs, ys)
  assert _dtypes(scan_state) == _dtypes(loop_state)
  assert int(scan_state.skipped_steps) == 1
  assert float(scan_state.loss_scale.loss_scale) == float(
      loop_state.loss_scale.loss_scale)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      (scan_params, scan_state), (loop_params, loop_state),
  )


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.0**15, 1024, jnp.float32(2.0**15)],
                         ids=["float", "int", "array"])
def test_loss_scaling_rejects_a_number_as_loss_scale(scale):
  with pytest.raises(TypeError, match="DynamicLossScale"):
    jmp_lite.loss_scaling(optax.sgd(0.1), scale)


@pytest.mark.parametrize("inner", [lambda g: g, "adam", None, 3],
                         ids=["function", "string", "none", "int"])
def test_loss_scaling_rejects_a_non_optax_inner(inner):
  with pytest.raises(TypeError, match="GradientTransformation"):
    jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(2.0))


def test_loss_scaling_rejects_other_objects_as_loss_scale():
  with pytest.raises(TypeError, match="loss scale"):
    jmp_lite.loss_scaling(optax.sgd(0.1), "dynamic")


def test_update_rejects_a_foreign_state():
  params = _params()
  opt = _wrapped()
  with pytest.raises(TypeError, match="LossScaleState"):
    opt.update(_true_grads(), optax.sgd(0.1).init(params), params)
