"""Explicit sharding: ``jax.make_mesh``'s default axis types and ``jax.set_mesh``.

Since jax 0.10, ``jax.make_mesh(shape, names)`` makes Explicit axes (sharding
in types), the setting JAX's sharding tutorial teaches. Every operation must
then be able to say how its result is sharded, which a block reshape across
a sharded axis, a code-book gather or the weight gradient's contraction over
the sharded batch cannot. The float8/FP4 matmuls, the low-bit optimizer
states and the diagnostics run those parts as under Auto axes
(``jax.sharding.auto_axes``): same program, same bits as an Auto mesh, results
typed as ``jax.lax.dot_general``'s / sharded like their params. conftest.py
gives 8 simulated CPU devices.
"""

import collections
import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import diagnostics
from jmp_lite import fp4
from jmp_lite import fp8
import jmp_lite.linen as jlinen
from helpers import assert_bit_identical
from helpers import default_run_keeps

N = 8
DENSE = (((1,), (0,)), ((), ()))

pytestmark = pytest.mark.skipif(
    jax.device_count() < N, reason=f"needs {N} devices (see conftest.py)")

RECIPES = {
    "tensor": fp8.Fp8Config(granularity="tensor"),
    "row": fp8.Fp8Config(granularity="row"),
    "blockwise": fp8.Fp8Config(granularity="blockwise"),
    "mxfp8": fp8.Fp8Config(granularity="mxfp8"),
    "nvfp4": fp4.Fp4Config("nvfp4"),
    "mxfp4": fp4.Fp4Config("mxfp4"),
}


def _explicit_mesh():
  mesh = jax.make_mesh((N,), ("d",))
  assert mesh.axis_types == (AxisType.Explicit,)  # jax.make_mesh's default
  return mesh


_no_mesh = contextlib.nullcontext


def _auto_mesh():
  return jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))


def _dot(config):
  fn = fp4.dot_general if isinstance(config, fp4.Fp4Config) else (
      fp8.dot_general)
  return lambda x, w, **kw: fn(x, w, DENSE, config=config, **kw)


def _collectives(compiled):
  """How many of each cross-device operation a compiled program runs."""
  found = re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                     r"reduce-scatter)(?:-start)?\(", compiled.as_text())
  return collections.Counter(found)


def _compiled_step(fn, mesh, args, out_specs=None):
  """``fn`` jitted on ``mesh`` (results sharded by ``out_specs``, else as
  their types say), compiled for ``args``: ``(compiled, results)``."""
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs,
                           is_leaf=lambda s: isinstance(s, P))
  jitted = jax.jit(fn) if out_specs is None else jax.jit(
      fn, out_shardings=shardings)
  with jax.set_mesh(mesh):
    compiled = jitted.lower(*args).compile()
    return compiled, compiled(*args)


def _put(mesh, tree, specs):
  return jax.device_put(tree, jax.tree.map(
      lambda s: NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, P)))


@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_quantized_matmul_batch_sharded(recipe):
  """A batch-sharded activation times a replicated weight, forward and both
  gradients: typed as jax.lax.dot_general's (y and dx sharded like x, dW
  replicated), the bits and collectives of the same program on an Auto mesh,
  and the unsharded results up to float32 summation order. The weight
  gradient contracts over the sharded batch, and MX/FP4
  blocks of the batch span devices (4 rows each)."""
  dot = _dot(RECIPES[recipe])
  kx, kw, kt = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (32, 64))
  w = jax.random.normal(kw, (64, 32))
  t = jax.random.normal(kt, (32, 32))  # a cotangent sharded like y

  def step(x, w, t):
    y, vjp = jax.vjp(dot, x, w)
    return (y, *vjp(t))

  def control(x, w, t):  # jax.lax.dot_general's types
    y, vjp = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, DENSE), x, w)
    return (y, *vjp(t))

  mesh = _explicit_mesh()
  args = _put(mesh, (x, w, t), (P("d"), P(), P("d")))
  compiled, (y, dx, dw) = _compiled_step(step, mesh, args)
  _, want = _compiled_step(control, mesh, args)
  assert [a.sharding for a in (y, dx, dw)] == [a.sharding for a in want]
  assert y.sharding.spec[0] == dx.sharding.spec[0] == "d"
  auto = _auto_mesh()
  runs = {"auto": _compiled_step(step, auto, _put(auto, (x, w, t), (
      P("d"), P(), P("d"))), tuple(a.sharding.spec for a in want))}
  assert_bit_identical((y, dx, dw), runs["auto"][1])
  assert _collectives(compiled) == _collectives(runs["auto"][0])
  # Unsharded: the same quantized values; XLA:CPU's float32 accumulation
  # order depends on the local shapes (1 ulp here and there).
  for got, want in zip((y, dx, dw), jax.jit(step)(x, w, t)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recipe", default_run_keeps(["row", "nvfp4"]))
def test_out_sharding_for_a_sharded_contraction(recipe):
  """A contraction over a sharded axis (a row-parallel layer) has no
  inferable result sharding: as jax.lax.dot_general, the matmul asks for
  out_sharding, and with it gives the unsharded result."""
  dot = _dot(RECIPES[recipe])
  x = jax.random.normal(jax.random.key(1), (16, 64))
  w = jax.random.normal(jax.random.key(2), (64, 32))
  mesh = _explicit_mesh()
  xs, ws = _put(mesh, (x, w), (P(None, "d"), P("d", None)))
  with jax.set_mesh(mesh):
    with pytest.raises(Exception, match="out_sharding"):
      jax.jit(dot)(xs, ws)
    y = jax.jit(lambda x, w: dot(x, w, out_sharding=P("d")))(xs, ws)
  assert y.sharding.spec == P("d", None)
  np.testing.assert_allclose(y, jax.jit(dot)(x, w), rtol=1e-6, atol=1e-5)


def _params():
  k1, k2 = jax.random.split(jax.random.key(3))
  return {"w": jax.random.normal(k1, (64, 256)),
          "e": jax.random.normal(k2, (32, 384)),
          "b": jnp.zeros(256)}


PARAM_SPECS = {"w": P("d"), "e": P("d"), "b": P()}


@pytest.mark.standard_promotion  # optax's adam is not strict-clean
@pytest.mark.parametrize("mu,nu", default_run_keeps(
    [("8bit", "8bit"), ("4bit", "4bit"), ("e4m3", "e4m3"),
     ("4bit", "4bit_rank1")], unpack=True))
def test_low_bit_states_fsdp(mu, nu):
  """Params sharded FSDP-style on an explicit mesh: two jitted updates give
  the bits of the unsharded optimizer and of an Auto mesh, every stored
  moment is sharded like its param, and the compiled update moves what the
  Auto one moves (block formats: nothing gathered)."""
  params = _params()
  grads = [jax.tree.map(lambda a, i=i: jnp.cos(a * (i + 1)) * 0.1, params)
           for i in range(2)]
  opt = jmp_lite.with_state_dtype(optax.adamw(1e-2), mu=mu, nu=nu)
  state_specs = optax.tree_map_params(
      opt, lambda _, s: s, jax.eval_shape(opt.init, params), PARAM_SPECS,
      transform_non_params=lambda _: P())

  def train(mesh=None, out_specs=None):
    """Two steps; the last update compiled (``(compiled, (params, state))``)."""
    place = (lambda t: t) if mesh is None else (
        lambda t: _put(mesh, t, PARAM_SPECS))
    p = place(params)
    update = jax.jit(opt.update)
    with jax.set_mesh(mesh) if mesh is not None else _no_mesh():
      state = jax.jit(opt.init)(p)
      updates, state = update(place(grads[0]), state, p)
      p = jax.jit(optax.apply_updates)(p, updates)
      if mesh is None:
        compiled = update.lower(grads[1], state, p).compile()
      else:
        compiled, _ = _compiled_step(opt.update, mesh,
                                     (place(grads[1]), state, p), out_specs)
      updates, state = compiled(place(grads[1]), state, p)
      return compiled, (jax.jit(optax.apply_updates)(p, updates), state)

  _, expected = train()
  compiled, result = train(_explicit_mesh())
  auto_compiled, auto_result = train(_auto_mesh(), (PARAM_SPECS, state_specs))
  assert_bit_identical(result, expected)
  assert_bit_identical(result, auto_result)
  for name in ("mu", "nu"):
    stored = optax.tree.get(result[1], name)
    for key in ("w", "e"):
      assert stored[key].sharding.spec == P("d", None), (name, key)
  collectives = _collectives(compiled)
  assert collectives == _collectives(auto_compiled)
  if nu != "4bit_rank1":  # rank-1 scales reduce over the rows
    assert not collectives["all-gather"], collectives


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(64, name="inp")(x))
    x = jnp.tanh(nn.Dense(64, name="mid")(x))
    return nn.Dense(16, name="out")(x)


def _with_policy_grad(spec, door=jmp_lite.with_policy):
  def mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.sum(jnp.tanh(h @ p["w2"]) ** 2)
  grad = jax.grad(door(mlp, spec))
  k1, k2 = jax.random.split(jax.random.key(4))
  params = {"w1": jax.random.normal(k1, (64, 64)) * 0.1,
            "w2": jax.random.normal(k2, (64, 32)) * 0.1}
  return grad, params


def _linen_grad(spec):
  model = jlinen.apply_policy(_Mlp(), spec)
  # Jitted (eager, each op of the model's init would compile on its own;
  # test_fp8_flax runs a policy model's eager init).
  variables = jax.jit(model.init)(jax.random.key(5), jnp.ones((32, 64)))

  def grad(variables, x):
    def loss(params):
      out, updates = model.apply({**variables, "params": params}, x,
                                 mutable=["fp8_state"])
      return jnp.mean(out ** 2), updates
    return jax.grad(loss, has_aux=True)(variables["params"])
  return grad, variables


def _jax_differentiates_batch_sharded_dots():
  """Whether this jax's own ``dot_general`` transpose handles a weight
  gradient contracting over an explicitly sharded batch (jax 0.10.0's does
  not: plain ``jax.grad(lambda w: (x @ w).sum())`` raises there)."""
  mesh = _explicit_mesh()
  x = jax.ShapeDtypeStruct((N, 16), jnp.float32,
                           sharding=NamedSharding(mesh, P("d")))
  w = jax.ShapeDtypeStruct((16, 16), jnp.float32)  # on no mesh
  try:
    with jax.set_mesh(mesh):
      jax.eval_shape(jax.grad(lambda w, x: (x @ w).sum()), w, x)
  except Exception:  # pylint: disable=broad-except
    return False
  return True


@pytest.mark.skipif(
    not _jax_differentiates_batch_sharded_dots(),
    reason="this jax cannot differentiate a plain batch-sharded matmul under "
    "explicit sharding (the policies keep the output head out of float8)")
@pytest.mark.parametrize("route,m", default_run_keeps(
    [("with_policy", "fp8_rowwise"), ("with_policy", "mxfp8"),
     ("with_policy", "nvfp4"), ("autocast", "fp8"), ("linen", "fp8_delayed")],
    unpack=True))
def test_policy_routes(route, m):
  """with_policy, autocast and a linen policy (Flax's dot_general hook,
  delayed scaling's amax histories) on a batch-sharded input: the gradients
  (and rolled histories) of the same program on an Auto mesh."""
  spec = f"p=f32,c=bf16,o=f32,m={m}"
  if route == "linen":
    grad, params = _linen_grad(spec)
  else:
    door = jmp_lite.autocast if route == "autocast" else jmp_lite.with_policy
    grad, params = _with_policy_grad(spec, door)
  x = jax.random.normal(jax.random.key(6), (32, 64))
  results = []
  for mesh in (_explicit_mesh(), _auto_mesh()):
    xs = _put(mesh, x, P("d"))
    with jax.set_mesh(mesh):
      results.append(jax.jit(grad)(params, xs))
  if route == "linen":
    # The amax histories read a bfloat16 activation, which XLA may keep in
    # float32 where it fuses the rounding away (excess precision): within
    # bfloat16's rounding (equal with --xla_allow_excess_precision=false).
    (results[0], histories), (results[1], auto_histories) = results
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        jax.lax.bitcast_convert_type(a, jnp.float32),
        jax.lax.bitcast_convert_type(b, jnp.float32), rtol=2.0**-8),
                 histories, auto_histories)
  assert_bit_identical(results[0], results[1])


@pytest.mark.parametrize("what", default_run_keeps(["fp8_stats", "fp4_stats", "tensor_stats"]))
def test_diagnostics(what):
  """fp8_stats (weights: MX blocks and 128x128 blocks along the sharded
  axis; FP4: 16x16 tiles) and tensor_stats (a histogram's scatter) of an
  explicitly sharded leaf: the statistics of the unsharded leaf."""
  stats = {
      "fp8_stats": lambda t: diagnostics.fp8_stats(t, "weight"),
      "fp4_stats": lambda t: diagnostics.fp8_stats(t, "weight", fmt="e2m1"),
      "tensor_stats": lambda t: diagnostics.tensor_stats(t, 2.0**15),
  }[what]
  w = jax.random.normal(jax.random.key(7), (64, 64))
  mesh = _explicit_mesh()
  with jax.set_mesh(mesh):
    got = jax.jit(stats)(_put(mesh, w, P("d")))
  want = jax.jit(stats)(w)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               got, want)


@pytest.mark.parametrize("m", default_run_keeps(["fp8_rowwise", "nvfp4"]))
def test_policy_route_keeps_the_traced_out_sharding(m):
  """A row-parallel matmul written with out_sharding= under with_policy: the
  float8/FP4 product it becomes takes the same out_sharding (the rule passes
  the traced dot's through)."""
  # The product is the function's output: the head, kept out by default.
  policy = jmp_lite.get_policy(
      f"p=f32,c=bf16,o=f32,m={m}(include_output_head=true)")
  fn = jmp_lite.with_policy(lambda w, x: jnp.einsum(
      "bk,kn->bn", x, w, out_sharding=P("d")), policy)
  x = jax.random.normal(jax.random.key(1), (16, 64))
  w = jax.random.normal(jax.random.key(2), (64, 32))
  mesh = _explicit_mesh()
  xs, ws = _put(mesh, (x, w), (P(None, "d"), P("d", None)))
  with jax.set_mesh(mesh):
    y = jax.jit(fn)(ws, xs)
  assert y.sharding.spec == P("d", None)
  want = jax.jit(jmp_lite.with_policy(
      lambda w, x: jnp.einsum("bk,kn->bn", x, w), policy))(w, x)
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-5)
  plain = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)  # not quantized
  assert not np.allclose(y, plain.astype(jnp.float32), rtol=1e-2)
