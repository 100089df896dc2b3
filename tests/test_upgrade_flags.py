"""Every autocast route under JAX's upgrade flags (issue 25, item 9).

jax 0.12 has ``jax_remat3``, ``jax_custom_vjp3``, ``jax_custom_jvp3`` and
``jax_scan3`` (about to become the defaults): they trace ``jax.checkpoint``,
``custom_vjp``, ``custom_jvp`` and ``scan`` to one "hi" primitive. Each test
runs with one flag on (flags this jax lacks are skipped) and checks the dtype
every ``dot_general`` sees inside the body and that gradients are the ones
autocast gives without the flag. The nox session ``newest-3.12`` (or
``upgrade-flags`` alone) runs the README's selection with the flags on
through their environment variables.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from helpers import default_run_keeps
from jmp_lite._src import compat

FLAGS = ("jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")


def _has(flag):
  try:
    getattr(jax.config, flag)
  except AttributeError:
    return False
  return True


@pytest.fixture(params=FLAGS)
def flag(request):
  if not _has(request.param):
    pytest.skip(f"jax {jax.__version__} has no {request.param}")
  before = getattr(jax.config, request.param)
  jax.config.update(request.param, True)
  yield request.param
  jax.config.update(request.param, before)


W = jnp.full((16, 16), 0.25)
X = jnp.linspace(-1.0, 1.0, 16 * 16).reshape(16, 16)


def _layer(x, w):
  return jnp.sin(x @ w)


def _fwd(x, w):
  return _layer(x, w), (x, w)


def _bwd(res, ct):
  x, w = res
  return ct @ w.T, x.T @ ct


def _bodies():
  """``{name: function of (x, w)}``: a dot inside each kind of body."""
  vjp = jax.custom_vjp(_layer)
  vjp.defvjp(_fwd, _bwd)
  jvp = jax.custom_jvp(_layer)
  jvp.defjvp(lambda p, t: (_layer(*p), jnp.cos(p[0] @ p[1])
                           * (t[0] @ p[1] + p[0] @ t[1])))

  def scan(x, w):
    return lax.scan(lambda c, _: (_layer(c, w), None), x, None, length=2)[0]

  return {"checkpoint": jax.checkpoint(_layer), "custom_vjp": vjp,
          "custom_jvp": jvp, "scan": scan}


def _dots(fn, *args):
  return [d for op, d in jmp_lite.op_dtypes(fn, *args) if op == "dot_general"]


def _grads(policy, body):
  def loss(x, w):
    return jnp.sum(body(x, w) ** 2)
  return jax.jit(jax.grad(jmp_lite.autocast(loss, policy), argnums=1))(X, W)


@pytest.mark.parametrize("name", default_run_keeps(["checkpoint", "custom_vjp", "custom_jvp",
                                  "scan"]))
def test_autocast_enters_every_body_under_the_flag(flag, name):
  body = _bodies()[name]
  if (flag == "jax_custom_vjp3" and name == "custom_vjp"
      and "custom_vjp" not in compat._HI_CLASSES):  # pylint: disable=protected-access
    # jax < 0.12's experimental protocol: refused, naming it.
    with pytest.raises(ValueError, match="CustomVJPTraced"):
      jmp_lite.autocast(body, "bf16")(X, W)
    return
  forward = jmp_lite.autocast(body, "bf16")
  assert _dots(forward, X, W) and all(
      d == ("bfloat16", "bfloat16") for d in _dots(forward, X, W)), (
          flag, _dots(forward, X, W))
  got = _grads("bf16", body)
  jax.config.update(flag, False)
  try:
    want = _grads("bf16", _bodies()[name])
    plain = jax.jit(jax.grad(lambda x, w: jnp.sum(_bodies()[name](x, w) ** 2),
                             argnums=1))(X, W)
  finally:
    jax.config.update(flag, True)
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
  # The autocast gradient, not the float32 one that ignoring the body gives.
  assert not np.array_equal(np.asarray(got), np.asarray(plain))


def test_float8_reaches_a_checkpointed_layer(flag):
  def model(p, x):
    h = jax.checkpoint(lambda x: jax.nn.relu(x @ p["w1"]))(x)
    return h @ p["w2"]

  params = {"w1": jnp.full((16, 32), 0.05), "w2": jnp.full((32, 16), 0.05)}
  for fn in (jmp_lite.autocast(model, "mixed_fp8"),
             jmp_lite.with_policy(model, "mixed_fp8")):
    dots = _dots(fn, params, X)
    assert dots[0] == ("float8_e4m3fn", "float8_e4m3fn"), (flag, dots)
    assert dots[-1] != ("float8_e4m3fn", "float8_e4m3fn"), dots  # the head


def test_linen_float8_policy_with_remat_under_the_flag(flag):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.linen as jlinen  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.remat(nn.Dense)(32, name="up")(x)
      return nn.Dense(16, name="head")(jax.nn.relu(x))

  model = jlinen.apply_policy(Model(), "mixed_fp8")
  variables = model.init(jax.random.key(0), X)
  dots = _dots(lambda v: model.apply(v, X), variables)
  assert dots[0] == ("float8_e4m3fn", "float8_e4m3fn"), (flag, dots)
  assert dots[-1] == ("bfloat16", "bfloat16"), dots


def test_nnx_float8_policy_with_remat_under_the_flag(flag):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jmp_lite.nnx as jnnx  # pylint: disable=g-import-not-at-top

  class Model(nnx.Module):
    def __init__(self):
      self.up = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
      self.head = nnx.Linear(32, 16, rngs=nnx.Rngs(1))

    def __call__(self, x):
      h = jax.checkpoint(lambda x: jax.nn.relu(self.up(x)))(x)
      return self.head(h)

  model = jnnx.apply_policy(Model(), "mixed_fp8")
  dots = _dots(lambda x: model(x), X)
  assert dots[0] == ("float8_e4m3fn", "float8_e4m3fn"), (flag, dots)
  assert dots[-1] == ("bfloat16", "bfloat16"), dots


def test_scan3_is_refused_naming_it():
  if not _has("jax_scan3"):
    pytest.skip(f"jax {jax.__version__} has no jax_scan3")
  jax.config.update("jax_scan3", True)
  try:
    with pytest.raises(ValueError, match="Scan3") as info:
      jmp_lite.autocast(_bodies()["scan"], "bf16")(X, W)
  finally:
    jax.config.update("jax_scan3", False)
  assert "jax_scan3" in str(info.value) and "in_float32" in str(info.value)


def test_a_first_order_hi_operation_runs_as_traced(flag):
  # jnp.frexp is a "hi" operation without a body under jax_custom_jvp3.
  fn = lambda x: jnp.frexp(x @ x)[0]
  x = jnp.full((16, 16), 3.0)
  np.testing.assert_array_equal(jmp_lite.autocast(fn, "bf16")(x), fn(x))


def test_custom_vjp_with_an_integer_input_under_the_flag(flag):
  """A custom_vjp whose bwd returns None (or JAX's symbolic zero) for an
  integer input, called with that input traced (a MoE layer's group sizes,
  ``jmp_lite.fp8.ragged_dot``): autocast's gradient is the plain one's
  (under jax_custom_vjp3 the cotangents used to shift by one and fail)."""
  if (flag == "jax_custom_vjp3"
      and "custom_vjp" not in compat._HI_CLASSES):  # pylint: disable=protected-access
    pytest.skip(f"jax {jax.__version__} refuses custom_vjp3 bodies (above)")

  @jax.custom_vjp
  def scaled(x, n):
    return x * n.astype(x.dtype)

  scaled.defvjp(lambda x, n: (scaled(x, n), n),
                lambda n, ct: (ct * n.astype(ct.dtype), None))
  loss = lambda x, n: jnp.sum(scaled(x, n) ** 2)
  x, n = jnp.arange(3.0), jnp.array(2)
  got = jax.jit(jax.grad(jmp_lite.autocast(loss, "bf16")))(x, n)
  np.testing.assert_allclose(got, jax.grad(loss)(x, n), rtol=1e-2)
  from jmp_lite import fp8  # pylint: disable=g-import-not-at-top
  moe = lambda x, w, s: jnp.sum(fp8.ragged_dot(
      x, w, s, config=fp8.Fp8Config(granularity="row")).astype(jnp.float32))
  args = (jnp.ones((16, 32)), jnp.ones((4, 32, 32)) * 0.1,
          jnp.array([4, 0, 8, 4], jnp.int32))
  grads = jax.jit(jax.grad(jmp_lite.autocast(moe, "mixed_bfloat16"),
                           argnums=(0, 1)))(*args)
  want = jax.grad(moe, argnums=(0, 1))(*args)
  for g, w in zip(grads, want):
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(w, np.float32), rtol=2e-2, atol=1e-2)
