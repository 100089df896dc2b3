"""save_half_residuals: a jax.checkpoint policy that saves only half precision."""

import flax.linen as nn
import jax
import jax.extend
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
import jmp_lite.linen as jlinen


def _saved(fn, *args):
  """(dtype, shape) of every array jax.vjp keeps, beyond the inputs."""
  _, f_vjp = jax.vjp(fn, *args)
  inputs = {id(leaf) for leaf in jax.tree_util.tree_leaves(args)}
  return [
      (np.dtype(r.dtype), r.shape)
      for r in jax.tree_util.tree_leaves(f_vjp)
      if id(r) not in inputs and np.ndim(r)
  ]


def _block(params, x):
  """A pure-JAX block: half matmul, float32 layer norm and softmax."""
  h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  h = h.astype(jnp.float32)
  mean = h.mean(-1, keepdims=True)
  var = ((h - mean) ** 2).mean(-1, keepdims=True)
  h = (h - mean) * lax.rsqrt(var + 1e-5) * params["scale"]
  return jnp.sum(jax.nn.log_softmax(h) ** 2)


def _block_args():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {
      "w": jax.random.normal(k1, (16, 32)) * 0.2,
      "scale": jnp.ones(32),
  }
  return params, jax.random.normal(k2, (8, 16))


@pytest.mark.parametrize(
    "prim, avals, params, expected",
    [
        (lax.exp_p, (jax.core.ShapedArray((3,), jnp.float32),), {}, False),
        (lax.exp_p, (jax.core.ShapedArray((3,), jnp.float16),), {}, True),
        (lax.exp_p, (jax.core.ShapedArray((3,), jnp.bfloat16),), {}, True),
        (lax.gt_p, (jax.core.ShapedArray((3,), jnp.float16),) * 2, {}, False),
        (lax.add_p, (jax.core.ShapedArray((3,), jnp.int32),) * 2, {}, False),
        (
            lax.broadcast_in_dim_p,
            (jax.core.ShapedArray((), jnp.float16),),
            dict(shape=(3,), broadcast_dimensions=(), sharding=None),
            False,
        ),
        (
            lax.convert_element_type_p,
            (jax.core.ShapedArray((3,), jnp.float16),),
            dict(new_dtype=jnp.dtype("float32"), weak_type=False, sharding=None),
            False,
        ),
        (
            lax.convert_element_type_p,
            (jax.core.ShapedArray((3,), jnp.float32),),
            dict(new_dtype=jnp.dtype("float16"), weak_type=False, sharding=None),
            True,
        ),
    ],
)
def test_policy_saves_by_output_dtype(prim, avals, params, expected):
  assert jmp_lite.save_half_residuals(prim, *avals, **params) is expected


def test_policy_does_not_save_what_it_cannot_type():
  """A primitive without an abstract evaluation rule: its outputs are
  recomputed, which is always correct."""
  untyped = jax.extend.core.Primitive("jmp_lite_test_untyped")
  aval = jax.core.ShapedArray((2,), jnp.float16)
  assert jmp_lite.save_half_residuals(untyped, aval) is False


@pytest.mark.parametrize("mistake", [lambda x: x ** 2, "dot_general", object()],
                         ids=["decorated_function", "name", "object"])
def test_policy_called_by_hand_is_a_type_error(mistake):
  """Called on something that is not a primitive (mistaken for a decorator or
  given a name), it raised nothing and returned False."""
  with pytest.raises(TypeError, match=r"jax.checkpoint policy.*policy=jmp_lite"
                     r"\.save_half_residuals"):
    jmp_lite.save_half_residuals(mistake)


def test_block_keeps_no_float32_residuals_and_same_gradients():
  params, x = _block_args()
  plain = _saved(_block, params, x)
  assert any(dtype == np.float32 for dtype, _ in plain)

  remat = jax.checkpoint(_block, policy=jmp_lite.save_half_residuals)
  saved = _saved(remat, params, x)
  assert saved, "the half-precision activations should still be saved"
  assert all(dtype == np.float16 for dtype, _ in saved), saved
  half_bytes = sum(np.prod(s) * 2 for _, s in saved)
  plain_bytes = sum(np.prod(s) * d.itemsize for d, s in plain)
  assert half_bytes < plain_bytes

  g_plain = jax.jit(jax.grad(_block))(params, x)
  g_remat = jax.jit(jax.grad(remat))(params, x)
  for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_remat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _ConvBN(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_linen_batchnorm_model_saves_only_half_activations():
  """Under an f16 policy the f32 BatchNorm internals are recomputed, not saved."""
  model = jlinen.apply_policy(_ConvBN(), "mixed_float16")
  x = jnp.ones((4, 6, 6, 1))
  y = jnp.zeros(4, jnp.int32)
  variables = model.init(jax.random.PRNGKey(0), x, train=False)

  def loss(params, x):
    logits, _ = model.apply(
        {"params": params, "batch_stats": variables["batch_stats"]},
        x,
        train=True,
        mutable=["batch_stats"],
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  activation = (4, 6, 6, 8)
  plain = _saved(loss, variables["params"], x)
  assert (np.dtype(np.float32), activation) in plain

  remat = jax.checkpoint(loss, policy=jmp_lite.save_half_residuals)
  saved = _saved(remat, variables["params"], x)
  big = [(d, s) for d, s in saved if np.prod(s) >= np.prod(activation)]
  assert big and all(d != np.float32 for d, _ in big), big

  g_plain = jax.jit(jax.grad(loss))(variables["params"], x)
  g_remat = jax.jit(jax.grad(remat))(variables["params"], x)
  for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_remat)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4)
