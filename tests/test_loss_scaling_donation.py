"""``loss_scaling``'s state must survive buffer donation.

Training steps are usually jitted with ``donate_argnums`` on the optimizer
state. Donating a state must not invalidate arrays that a later ``opt.init``
hands out: each ``init`` has to return fresh buffers, as optax's own
transformations do.
"""

import jax
import jax.numpy as jnp
import optax

import jmp_lite


def _donating_step(opt):
  def step(params, state):
    updates, state = opt.update(params, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=1)


def test_init_after_a_donated_step_returns_a_live_loss_scale():
  opt = jmp_lite.loss_scaling(
      optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**15, period=3)
  )
  params = {"w": jnp.ones(3)}
  jax.block_until_ready(_donating_step(opt)(params, opt.init(params)))

  fresh = opt.init(params)  # e.g. a second run or a re-initialised model

  assert float(fresh.loss_scale.loss_scale) == 2.0**15
  assert int(fresh.loss_scale.counter) == 0


def test_two_states_from_one_optimizer_can_both_be_donated():
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
  params = {"w": jnp.ones(3)}
  first, second = opt.init(params), opt.init(params)
  step = _donating_step(opt)

  jax.block_until_ready(step(params, first))
  _, second = step(params, second)

  assert float(jmp_lite.get_loss_scale(second).loss_scale) == 8.0
