"""Every optimizer-side state jmp_lite creates, saved with orbax's
``StandardCheckpointer`` and restored into the documented target
(``jax.eval_shape(opt.init, params)``; a Flax model's variables into
``jax.eval_shape(model.init, ...)``), then resumed: N steps straight land bit
for bit where k steps, a checkpoint, a restore and N - k steps land.

Params mix dtypes as mixed-precision models do: bfloat16 weights, a float32
norm scale, and (under master_weights) an integer leaf.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
import jmp_lite.linen as jlinen

from helpers import assert_bit_identical
from helpers import orbax_round_trip
from helpers import default_run_keeps

# optax's adam on bfloat16 params (loss_scaling alone) is not strict-clean.
pytestmark = pytest.mark.standard_promotion

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
STEPS, SAVE_AT, BAD_STEP = 6, 3, 1  # BAD_STEP: an inf in the gradients


def _params(integer=False):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 64)), BF16),
            "norm": jnp.asarray(rng.normal(size=(64,)), F32)}
  if integer:
    params["step"] = jnp.int32(3)
  return params


def _adam(params):
  """adam on the floating params (optax.masked leaves the integer one out:
  adam has no update for it)."""
  return optax.masked(optax.adam(1e-2), jax.tree.map(
      lambda p: jnp.issubdtype(p.dtype, jnp.floating), params))


def _grads(params, i, scale=1.0, bad=False):
  """Step ``i``'s gradients (an inf in ``w`` at BAD_STEP where ``bad``),
  times ``scale``, in the params' dtypes; zero for integer params."""
  def grad(p):
    if not jnp.issubdtype(p.dtype, jnp.floating):
      return jnp.zeros_like(p)
    x = p.astype(F32)
    return ((x - jnp.cos(x * (i.astype(F32) + 1))) * scale).astype(p.dtype)
  grads = jax.tree.map(grad, params)
  if bad:
    w = grads["w"]
    grads["w"] = w.at[0, 0].set(jnp.where(i == BAD_STEP, jnp.inf, w[0, 0]))
  return grads


def _step(opt, scaled):
  """One jitted train step ``(params, state, i) -> (params, state)``; the
  loss-scaling optimizers get gradients scaled by their current scale, with
  an inf at BAD_STEP (skipped, the scale backs off)."""
  @jax.jit
  def step(params, state, i):
    if scaled:
      scale = jmp_lite.get_loss_scale(state).loss_scale
      grads = _grads(params, i, scale, bad=True)
    else:
      grads = _grads(params, i)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _run(step, params, state, start, stop):
  for i in range(start, stop):
    params, state = step(params, state, jnp.int32(i))
  return params, state


def assert_resumes_bit_identically(opt, params, tmp_path, scaled):
  """The checkpoint test: ``opt``'s state (with the params) through orbax at
  step SAVE_AT, restored into ``jax.eval_shape(opt.init, params)``, resumes
  to STEPS bit for bit. Returns the restored ``(params, state)``."""
  step = _step(opt, scaled)
  state = opt.init(params)
  straight = _run(step, params, state, 0, STEPS)
  saved = _run(step, params, state, 0, SAVE_AT)
  target = (jax.eval_shape(lambda: params), jax.eval_shape(opt.init, params))
  restored = orbax_round_trip(saved, tmp_path / "ckpt", target)
  assert_bit_identical(restored, saved)
  assert_bit_identical(_run(step, *restored, SAVE_AT, STEPS), straight)
  return restored


# -- loss_scaling --------------------------------------------------------------

LOSS_SCALES = {
    "noop": lambda: jmp_lite.NoOpLossScale(),
    "static": lambda: jmp_lite.StaticLossScale(jnp.float32(2.0**4)),
    "dynamic": lambda: jmp_lite.DynamicLossScale(
        jnp.float32(2.0**10), period=2, min_loss_scale=jnp.float32(2.0)),
}


@pytest.mark.parametrize("name", default_run_keeps(list(LOSS_SCALES)))
def test_loss_scaling(name, tmp_path):
  params = _params()
  opt = jmp_lite.loss_scaling(optax.adam(1e-2), LOSS_SCALES[name]())
  _, state = assert_resumes_bit_identically(opt, params, tmp_path,
                                            scaled=name != "noop")
  if name == "dynamic":  # the config comes back with the target's treedef
    scale = jmp_lite.get_loss_scale(state)
    assert (scale.period, float(scale.min_loss_scale)) == (2, 2.0)
    assert int(state.skipped_steps) == 1  # BAD_STEP was skipped


def test_loss_scaling_accumulating_saved_mid_window(tmp_path):
  """accumulation_steps=2, saved after 3 micro-batches: the window is open
  (its float32 accumulator and micro-batch count are in the checkpoint)."""
  params = _params()
  opt = jmp_lite.loss_scaling(
      optax.adam(1e-2), LOSS_SCALES["dynamic"](), accumulation_steps=2)
  _, state = assert_resumes_bit_identically(opt, params, tmp_path,
                                            scaled=True)
  micro = [x for _, x in optax.tree.get_all_with_path(state, "micro_step")]
  assert [int(x) for x in micro] == [SAVE_AT % 2]


def test_loss_scaling_inject_hyperparams(tmp_path):
  params = _params()
  opt = jmp_lite.loss_scaling(
      optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
      LOSS_SCALES["dynamic"]())
  _, state = assert_resumes_bit_identically(opt, params, tmp_path,
                                            scaled=True)
  assert float(optax.tree.get(state, "learning_rate")) == np.float32(1e-2)


# -- master_weights --------------------------------------------------------------


@pytest.mark.parametrize("method", default_run_keeps(["copy", "stochastic_rounding", "kahan"]))
def test_master_weights(method, tmp_path):
  """Each method with bfloat16, float32 and integer params; inside
  loss_scaling (a skipped step among them)."""
  params = _params(integer=True)
  opt = jmp_lite.loss_scaling(
      jmp_lite.master_weights(_adam(params), method=method),
      LOSS_SCALES["dynamic"]())
  restored_params, state = assert_resumes_bit_identically(
      opt, params, tmp_path, scaled=True)
  master = jmp_lite.get_master_params(state, restored_params)
  assert master["w"].dtype == (BF16 if method == "stochastic_rounding"
                               else F32)
  assert master["norm"] is restored_params["norm"]


def test_master_weights_with_float16_params(tmp_path):
  params = {"w": jnp.linspace(-1, 1, 64 * 64, dtype=jnp.float16
                              ).reshape(64, 64),
            "b": jnp.zeros(64, BF16), "norm": jnp.ones(64, F32)}
  opt = jmp_lite.master_weights(optax.adam(1e-2), method="kahan")
  assert_resumes_bit_identically(opt, params, tmp_path, scaled=False)


def test_master_weights_around_multisteps_saved_mid_window(tmp_path):
  """The documented accumulation without loss scaling:
  master_weights(optax.MultiSteps(inner, k)), low-bit moments inside."""
  params = _params()
  opt = jmp_lite.master_weights(optax.MultiSteps(
      jmp_lite.with_state_dtype(optax.adam(1e-2), mu="8bit", nu="4bit"),
      every_k_schedule=2))
  assert_resumes_bit_identically(opt, params, tmp_path, scaled=False)


@pytest.mark.parametrize("tree", ["empty", "scalar"])
def test_master_weights_small_trees(tree, tmp_path):
  params = {} if tree == "empty" else {"w": jnp.asarray(0.5, BF16),
                                       "b": jnp.float32(1.0)}
  opt = jmp_lite.master_weights(optax.sgd(0.1))
  assert_resumes_bit_identically(opt, params, tmp_path, scaled=False)


def test_restored_into_another_method_is_refused(tmp_path):
  """A method='copy' checkpoint does not fit a method='kahan' optimizer:
  orbax refuses its restore target, and the copy state handed to the kahan
  update is a ValueError naming both methods."""
  params = _params()
  copy = jmp_lite.master_weights(optax.adam(1e-2))
  kahan = jmp_lite.master_weights(optax.adam(1e-2), method="kahan")
  state = copy.init(params)
  with pytest.raises(ValueError, match="compensation"):
    orbax_round_trip(state, tmp_path / "a", jax.eval_shape(kahan.init, params))
  restored = orbax_round_trip(state, tmp_path / "b",
                              jax.eval_shape(copy.init, params))
  with pytest.raises(ValueError, match=r"method='kahan'.*made by "
                     r"method='copy'.*build the optimizer with method='copy'"):
    kahan.update(_grads(params, jnp.int32(0)), restored, params)


# -- with_state_dtype --------------------------------------------------------------

STATE_FORMATS = [
    dict(dtype=jnp.bfloat16),
    dict(mu="float32", nu="bfloat16"),
    dict(mu="bfloat16_sr", nu="e4m3"),
    dict(mu="8bit", nu="4bit"),
    dict(mu="4bit", nu="4bit_rank1"),
]


@pytest.mark.parametrize("formats", default_run_keeps(STATE_FORMATS),
                         ids=["-".join(map(str, f.values())) for f in
                              STATE_FORMATS])
def test_with_state_dtype_inside_loss_scaling(formats, tmp_path):
  params = _params()
  opt = jmp_lite.loss_scaling(
      jmp_lite.with_state_dtype(optax.adam(1e-2), **formats),
      LOSS_SCALES["dynamic"]())
  assert_resumes_bit_identically(opt, params, tmp_path, scaled=True)


def test_everything_composed(tmp_path):
  """loss_scaling(master_weights(with_state_dtype(chain(clip, adam))))."""
  params = _params()
  opt = jmp_lite.loss_scaling(
      jmp_lite.master_weights(jmp_lite.with_state_dtype(
          optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
          mu="8bit", nu="4bit"), method="stochastic_rounding", seed=5),
      LOSS_SCALES["dynamic"](), accumulation_steps=2)
  assert_resumes_bit_identically(opt, params, tmp_path, scaled=True)


# -- float8 delayed scaling (Flax linen) ----------------------------------------------


class _MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(16)(x)


def test_fp8_delayed_histories_with_the_optimizer(tmp_path):
  """The histories (Flax state next to the params) and loss_scaling's state
  saved together; restored into jax.eval_shape(model.init, ...) and
  jax.eval_shape(opt.init, params), training resumes bit for bit."""
  model = jlinen.apply_policy(_MLP(), "p=f32,c=bf16,o=f32,m=fp8_delayed")
  x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 32)), F32)
  y = jnp.arange(16) % 16
  variables = jax.jit(model.init)(jax.random.key(0), x)
  assert jax.tree.leaves(variables["fp8_state"])
  opt = jmp_lite.loss_scaling(optax.adam(1e-2), LOSS_SCALES["dynamic"]())

  @jax.jit
  def step(variables, opt_state):
    def loss(params):
      logits, updates = model.apply({**variables, "params": params}, x,
                                    mutable=["fp8_state"])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, y).mean(), updates
    (_, updates), grads = jmp_lite.scaled_value_and_grad(
        loss, opt_state, has_aux=True)(variables["params"])
    deltas, opt_state = opt.update(grads, opt_state, variables["params"])
    return {**variables, **updates,
            "params": optax.apply_updates(variables["params"], deltas)
            }, opt_state

  def run(carry, n):
    for _ in range(n):
      carry = step(*carry)
    return carry

  start = (variables, opt.init(variables["params"]))
  straight = run(start, STEPS)
  saved = run(start, SAVE_AT)
  target = (jax.eval_shape(model.init, jax.random.key(0), x),
            jax.eval_shape(opt.init, variables["params"]))
  restored = orbax_round_trip(saved, tmp_path / "ckpt", target)
  assert_bit_identical(restored, saved)
  assert_bit_identical(run(restored, STEPS - SAVE_AT), straight)
  # The histories moved (each step pushed an amax), and came back.
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(saved[0]["fp8_state"]),
      jax.tree.leaves(variables["fp8_state"])))
