"""Tests for jmp_lite's autocast: op-level mixed precision via a jaxpr interpreter.

Invariants are asserted on jaxprs (which dtype each ``dot_general``, ``exp``,
``reduce_sum``... sees, recursively through every sub-jaxpr) and numerically
against the float32 function.
"""

from flax import nnx
import flax.linen as nn
import jax
from jax import lax
from jax.extend.core import primitives as P
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import autocast
from jmp_lite import op_dtypes
from jmp_lite._src import compat
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite.autocast_rules import DEFAULT_OP_RULES
from jmp_lite._src.autocast.rules import OP_RULE_NAMES
from jmp_lite.autocast_rules import OpRuleContext

from helpers import all_eqns
from helpers import default_run_keeps


def _eqns_of(jaxpr, kind):
  """Top-level equations of a kind (``"remat"``, ``"custom_jvp"``...), by
  primitive object or, under JAX's upgrade flags, the hi operation's class."""
  return [e for e in jaxpr.eqns if interpreter_lib.kind_of(e) == kind]


def _body(eqn):
  """The (first) body of a higher-order equation."""
  return next(compat.sub_jaxprs(eqn.params))

F32 = np.dtype(jnp.float32)
F16 = np.dtype(jnp.float16)
HALF_DTYPES = [np.dtype(jnp.float16), np.dtype(jnp.bfloat16)]
# Relative gradient error allowed per compute dtype (10 and 7 mantissa bits).
GRAD_TOL = {np.dtype(jnp.float16): 1e-2, np.dtype(jnp.bfloat16): 6e-2}
SENSITIVE = ("exp", "log", "log1p", "rsqrt", "reduce_sum", "integer_pow", "logistic")

# -- helpers -------------------------------------------------------------------


def input_dtypes(jaxpr, name):
  """The float input dtypes of every ``name`` equation (recursively)."""
  return [
      tuple(
          np.dtype(v.aval.dtype)
          for v in eqn.invars
          if jnp.issubdtype(v.aval.dtype, jnp.floating)
      )
      for eqn in all_eqns(jaxpr)
      if eqn.primitive.name == name
  ]


def assert_dots_in(jaxpr, dtype, count=None):
  dots = input_dtypes(jaxpr, "dot_general")
  assert dots, "no dot_general in the jaxpr"
  assert all(d == (dtype, dtype) for d in dots), dots
  if count is not None:
    assert len(dots) == count, dots


def assert_sensitive_ops_in_f32(jaxpr):
  seen = 0
  for name in SENSITIVE:
    for dtypes in input_dtypes(jaxpr, name):
      assert dtypes and all(d == F32 for d in dtypes), (name, dtypes)
      seen += 1
  assert seen, "no numerically sensitive op found"


def rel_err(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((x.astype(F32) - y.astype(F32)) ** 2)) for x, y in zip(a, b))
  den = sum(float(jnp.sum(y.astype(F32) ** 2)) for y in b)
  return (num / den) ** 0.5


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def normal(seed, shape, scale=1.0):
  """A float32 array from numpy's RNG (no per-shape compilation)."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, F32)


def mlp_params(seed=0, d_in=8, d_hidden=16, d_out=4):
  return {
      "w1": normal(seed, (d_in, d_hidden), d_in**-0.5),
      "b1": jnp.zeros(d_hidden),
      "w2": normal(seed + 1, (d_hidden, d_out), d_hidden**-0.5),
      "b2": jnp.zeros(d_out),
  }


def layer_norm(x, scale, bias, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * scale + bias


def transformer_block(params, x, num_heads=2):
  """Pre-LN block: causal attention (softmax) + layer norm + GELU MLP."""
  b, t, d = x.shape
  h = layer_norm(x, params["ln1_scale"], params["ln1_bias"])

  def heads(z):
    return z.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)

  q, k, v = (heads(h @ params[name]) for name in ("wq", "wk", "wv"))
  scores = (q @ k.swapaxes(-1, -2)) * (d // num_heads) ** -0.5
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e4)
  attn = jax.nn.softmax(scores, axis=-1)
  o = (attn @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
  x = x + o @ params["wo"]
  h = layer_norm(x, params["ln2_scale"], params["ln2_bias"])
  h = jax.nn.gelu(h @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
  return x + h


def block_params(d=16, hidden=32, vocab=11):
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
            "w1": (d, hidden), "w2": (hidden, d), "wout": (d, vocab)}
  params = {
      name: normal(seed, shape, shape[0] ** -0.5)
      for seed, (name, shape) in enumerate(shapes.items())
  }
  params.update(ln1_scale=jnp.ones(d), ln1_bias=jnp.zeros(d),
                ln2_scale=jnp.ones(d), ln2_bias=jnp.zeros(d),
                b1=jnp.zeros(hidden), b2=jnp.zeros(d))
  return params


def lm_loss(params, x, labels):
  logits = transformer_block(params, x) @ params["wout"]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


@pytest.fixture(name="lm_batch")
def fixture_lm_batch():
  x = normal(10, (2, 6, 16))
  labels = jnp.asarray(np.random.default_rng(11).integers(0, 11, (2, 6)), jnp.int32)
  return block_params(), x, labels


# -- plain JAX models ----------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_mlp_dots_run_in_compute_dtype(dtype):
  params, x = mlp_params(), normal(2, (5, 8))
  f = autocast(mlp, dtype)
  jaxpr = jax.make_jaxpr(f)(params, x)
  assert_dots_in(jaxpr, dtype, count=2)
  out = f(params, x)
  assert out.dtype == F32  # Output dtype of the original function.
  assert rel_err(out, mlp(params, x)) < GRAD_TOL[dtype]


def test_dot_accumulates_in_f32_and_returns_compute_dtype():
  f = autocast(lambda w, x: x @ w, jnp.float16)
  jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 4)), jnp.ones((2, 3)))
  (dot,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert dot.params["preferred_element_type"] == F32
  assert [v.aval.dtype for v in dot.invars] == [jnp.float16, jnp.float16]
  # ... and the value handed on is in the compute dtype (the custom-derivative
  # product: inlined with jax 0.10, inside an inline jit equation with 0.12).
  (call,) = [e for e in all_eqns(jaxpr) if interpreter_lib.kind_of(e) == "custom_jvp"]
  assert call.outvars[0].aval.dtype == jnp.float16


def test_repeated_matmuls_trace_the_accumulating_product_once(monkeypatch):
  """Matmuls of the same shapes (a deep model's blocks) share one trace of
  the float32-accumulating product: autocast's trace time grows with the
  model like the hand-cast step's. Each matmul still has its own dot."""
  accumulating = []
  bind = compat.bind

  def counting_bind(primitive, args, params):
    if primitive.name == "dot_general" and params.get("preferred_element_type") == F32:
      accumulating.append(primitive)
    return bind(primitive, args, params)

  monkeypatch.setattr(compat, "bind", counting_bind)

  def f(w, x):  # shapes no other test uses: nothing is cached yet
    for _ in range(3):
      x = jnp.tanh(x @ w)
    return x

  jaxpr = jax.make_jaxpr(autocast(f, jnp.float16))(jnp.ones((11, 11)), jnp.ones((5, 11)))
  assert len(accumulating) == 1
  dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3
  assert all(d.params["preferred_element_type"] == F32 for d in dots)


def test_f32_compute_dtype_leaves_the_jaxpr_unchanged():
  params, x = mlp_params(), jnp.ones((5, 8))
  assert str(jax.make_jaxpr(autocast(mlp, jnp.float32))(params, x)) == str(
      jax.make_jaxpr(mlp)(params, x)
  )


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_transformer_block_forward_dtypes(dtype, lm_batch):
  params, x, labels = lm_batch
  jaxpr = jax.make_jaxpr(autocast(lm_loss, dtype))(params, x, labels)
  # 4 projections, 2 attention matmuls, 2 MLP matmuls, 1 output projection.
  assert_dots_in(jaxpr, dtype, count=9)
  # softmax/log-softmax exp, log, layer-norm means/variances and rsqrt, GELU
  # cube, loss mean: all in float32.
  assert_sensitive_ops_in_f32(jaxpr)
  assert len(input_dtypes(jaxpr, "rsqrt")) == 2
  assert len(input_dtypes(jaxpr, "exp")) == 2
  assert jaxpr.out_avals[0].dtype == F32


@pytest.mark.parametrize("dtype", default_run_keeps(HALF_DTYPES), ids=str)
def test_transformer_block_gradients_match_f32(dtype, lm_batch):
  params, x, labels = lm_batch
  grad_fn = jax.jit(jax.value_and_grad(autocast(lm_loss, dtype)))
  loss, grads = grad_fn(params, x, labels)
  loss32, grads32 = jax.jit(jax.value_and_grad(lm_loss))(params, x, labels)
  dtypes_of = lambda tree: jax.tree.map(lambda g: g.dtype, tree)
  assert dtypes_of(grads) == dtypes_of(grads32)
  assert abs(float(loss) - float(loss32)) < GRAD_TOL[dtype] * abs(float(loss32))
  assert rel_err(grads, grads32) < GRAD_TOL[dtype]
  # The backward pass has no mixed-dtype (hence float32) matmuls either.
  grad_jaxpr = jax.make_jaxpr(jax.grad(autocast(lm_loss, dtype)))(params, x, labels)
  assert_dots_in(grad_jaxpr, dtype)


def test_grad_of_grad_matches_f32():
  # A gradient penalty: differentiate through the gradient of a softmax
  # cross-entropy MLP loss.
  params, x = mlp_params(), normal(12, (5, 8))
  labels = jnp.arange(5) % 4

  def ce_loss(p):
    logp = jax.nn.log_softmax(mlp(p, x))
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()

  def penalty(loss_fn):
    def fn(p):
      g = jax.grad(loss_fn)(p)
      return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))
    return fn

  got = jax.jit(jax.grad(penalty(autocast(ce_loss, jnp.float16))))(params)
  want = jax.jit(jax.grad(penalty(ce_loss)))(params)
  assert rel_err(got, want) < 5e-2
  # Second-order matmuls run in half precision too.
  jaxpr = jax.make_jaxpr(jax.grad(penalty(autocast(ce_loss, jnp.float16))))(params)
  assert_dots_in(jaxpr, np.dtype(jnp.float16))


def test_vmap_of_autocast():
  params = mlp_params()
  xs = normal(3, (4, 5, 8))
  f = jax.vmap(autocast(mlp, jnp.float16), in_axes=(None, 0))
  assert_dots_in(jax.make_jaxpr(f)(params, xs), np.dtype(jnp.float16))
  want = jax.jit(jax.vmap(mlp, (None, 0)))(params, xs)
  assert rel_err(jax.jit(f)(params, xs), want) < 1e-2


def test_autocast_of_vmap():
  params, xs = mlp_params(), jnp.ones((4, 5, 8))
  f = autocast(jax.vmap(mlp, in_axes=(None, 0)), jnp.bfloat16)
  assert_dots_in(jax.make_jaxpr(f)(params, xs), np.dtype(jnp.bfloat16))


def test_jit_of_autocast_traces_once():
  params, x = mlp_params(), jnp.ones((5, 8))
  f = jax.jit(autocast(mlp, jnp.float16))
  first = f(params, x)
  second = f(jax.tree.map(lambda p: p * 2, params), x)
  assert first.dtype == second.dtype == F32
  assert f._cache_size() == 1  # pylint: disable=protected-access


def test_weak_literals_follow_and_params_promote():
  def fn(w, b, x):
    h = (x @ w) * 2.0      # Python scalar: stays in the compute dtype.
    return h, h + b        # float32 bias: promotes to float32.

  args = jnp.ones((3, 3)), jnp.ones(3), jnp.ones((2, 3))
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(*args)
  assert input_dtypes(jaxpr, "mul") == [(np.dtype(jnp.float16),) * 2]
  assert input_dtypes(jaxpr, "add") == [(F32, F32)]


def test_explicit_casts_are_honoured():
  def fn(w, x):
    return (x @ w).astype(jnp.bfloat16), jnp.exp(x).astype(jnp.float16)

  out = autocast(fn, jnp.float16)(jnp.ones((3, 3)), jnp.ones((2, 3)))
  assert [o.dtype for o in out] == [jnp.bfloat16, jnp.float16]


def test_outputs_keep_their_dtypes():
  def fn(w, x, n):
    return {"f32": x @ w, "f16": x.astype(jnp.float16) * 2, "int": n + 1, "bool": n > 0}

  args = (jnp.ones((3, 3)), jnp.ones((2, 3)), jnp.arange(3))
  got = jax.tree.map(lambda a: a.dtype, autocast(fn, jnp.bfloat16)(*args))
  assert got == jax.tree.map(lambda a: a.dtype, fn(*args))


def test_integer_only_function_passes_through_untouched():
  def fn(a, b):
    loop = lax.fori_loop(0, 3, lambda i, c: c + i, b)
    return (a * b + 3).sum() // 2, jnp.argsort(a), loop

  a, b = jnp.arange(5), jnp.arange(5)[::-1]
  want = str(jax.make_jaxpr(fn)(a, b))
  assert str(jax.make_jaxpr(autocast(fn, jnp.float16))(a, b)) == want
  for got, want in zip(autocast(fn, jnp.float16)(a, b), fn(a, b)):
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype


# -- higher-order primitives, one by one --------------------------------------


def _check_grads(fn, *args, dtype=np.dtype(jnp.float16), tol=1e-2):
  got = jax.jit(jax.grad(autocast(fn, dtype)))(*args)
  want = jax.jit(jax.grad(fn))(*args)
  assert rel_err(got, want) < tol


W = normal(4, (4, 4), 0.5)
X = normal(5, (3, 4))


def test_nested_jit_body_is_autocast_and_params_kept():
  inner = jax.jit(lambda a, b: jnp.exp(a @ b).sum(), inline=False)

  def fn(w, x):
    return inner(x, w)

  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (call,) = [e for e in jaxpr.eqns if e.primitive is P.jit_p]
  assert call.params["name"] == "<lambda>"
  assert_dots_in(call.params["jaxpr"], np.dtype(jnp.float16), count=1)
  assert_sensitive_ops_in_f32(call.params["jaxpr"])
  _check_grads(fn, W, X)


def test_checkpoint_body_is_autocast():
  fn = lambda w, x: jax.checkpoint(lambda a, b: jnp.tanh(a @ b) @ b)(x, w).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (remat,) = _eqns_of(jaxpr, "remat")
  assert_dots_in(_body(remat), np.dtype(jnp.float16), count=2)
  _check_grads(fn, W, X)


def test_checkpoint_policy_is_kept():
  # (Not nothing_saveable: jax_remat3 stores that default as None.)
  policy = jax.checkpoint_policies.dots_saveable
  fn = lambda w, x: jax.checkpoint(lambda a, b: a @ b, policy=policy)(x, w).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (remat,) = _eqns_of(jaxpr, "remat")
  parts = (compat.hi_remat_parts if compat.hi_kind(remat.params)
           else compat.remat_parts)(remat.params)
  assert parts[2] is policy


def test_scan_body_is_autocast_and_carry_keeps_its_dtype():
  def fn(w, x):
    def step(carry, row):
      out = jnp.tanh(row @ w + carry)
      return out, jnp.exp(out).sum()
    carry, ys = lax.scan(step, jnp.zeros(4), x)
    return carry.sum() + ys.sum()

  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (scan,) = [e for e in all_eqns(jaxpr) if e.primitive is P.scan_p]
  body = scan.params["jaxpr"]
  assert_dots_in(body, np.dtype(jnp.float16), count=1)
  assert_sensitive_ops_in_f32(body)
  _, _, carry_in, _ = compat.scan_parts(scan.params, body.in_avals)
  assert [a.dtype for a in carry_in] == [F32]
  assert [a.dtype for a in body.out_avals[:len(carry_in)]] == [F32]
  _check_grads(fn, W, X)


def test_cond_branches_are_autocast_and_agree_on_dtypes():
  def fn(w, x):
    # One branch ends in exp (float32), the other in a matmul (float16).
    return lax.cond(x.sum() > 0, lambda a: jnp.exp(a @ w), lambda a: a @ w, x).sum()

  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (cond,) = [e for e in all_eqns(jaxpr) if e.primitive is P.cond_p]
  for branch in cond.params["branches"]:
    assert_dots_in(branch, np.dtype(jnp.float16), count=1)
  branch_outs = {b.out_avals[0].dtype for b in cond.params["branches"]}
  assert branch_outs == {F32}  # The widest of the two.
  _check_grads(fn, W, X)
  _check_grads(fn, W, -X)


def test_while_body_is_autocast_and_carry_keeps_its_dtype():
  def fn(w, x):
    def body(state):
      i, h = state
      return i + 1, jnp.tanh(h @ w)
    return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1].sum()

  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  (loop,) = [e for e in all_eqns(jaxpr) if e.primitive is P.while_p]
  body = loop.params["body_jaxpr"]
  assert_dots_in(body, np.dtype(jnp.float16), count=1)
  assert [a.dtype for a in body.out_avals] == [a.dtype for a in body.in_avals[-2:]]
  assert body.out_avals[-1].dtype == F32
  # while_loop is forward-differentiable only.
  got = jax.jit(lambda *a: jax.jvp(autocast(fn, jnp.float16), a, a)[1])(W, X)
  want = jax.jit(lambda *a: jax.jvp(fn, a, a)[1])(W, X)
  assert abs(float(got) - float(want)) < 1e-2 * abs(float(want))


@jax.custom_jvp
def _scaled_sin(w, x):
  return jnp.sin(x @ w)


@_scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
  w, x = primals
  tw, tx = tangents
  # A deliberately "wrong" rule (3x the true derivative) to prove it is kept.
  cos = jnp.cos(x @ w)
  return _scaled_sin(w, x), 3.0 * cos * (tx @ w + x @ tw)


def test_custom_jvp_primal_is_autocast_and_rule_kept():
  fn = lambda w, x: _scaled_sin(w, x).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  calls = _eqns_of(jaxpr, "custom_jvp")
  assert [compat.func_name(_body(e), "?") for e in calls] == ["_scaled_sin"]
  assert_dots_in(_body(calls[0]), np.dtype(jnp.float16), count=1)
  _check_grads(fn, W, X)  # Equal to 3x the true gradient, as the rule says.
  true_grad = jax.grad(lambda w: jnp.sin(X @ w).sum())(W)
  np.testing.assert_allclose(jax.jit(jax.grad(fn))(W, X), 3 * true_grad, rtol=1e-5)
  # The rule itself is evaluated with autocast: its matmuls run in half.
  assert_dots_in(jax.make_jaxpr(jax.grad(autocast(fn, jnp.float16)))(W, X),
                 np.dtype(jnp.float16))


def test_custom_jvp_relu_stays_in_compute_dtype():
  fn = lambda w, x: jax.nn.relu(x @ w).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  assert input_dtypes(jaxpr, "max") == [(np.dtype(jnp.float16),) * 2]
  _check_grads(fn, W, X)


@jax.custom_vjp
def _marked(w, x):
  return jnp.tanh(x @ w)


def _marked_fwd(w, x):
  out = jnp.tanh(x @ w)
  return out, (w, x, out)


def _marked_bwd(res, g):
  w, x, out = res
  g = 5.0 * g * (1 - out**2)  # 5x the true cotangent: proves bwd is kept.
  return x.T @ g, g @ w.T


_marked.defvjp(_marked_fwd, _marked_bwd)


def test_custom_vjp_primal_and_fwd_autocast_bwd_kept():
  fn = lambda w, x: _marked(w, x).sum()
  f = autocast(fn, jnp.float16)
  jaxpr = jax.make_jaxpr(f)(W, X)
  (call,) = _eqns_of(jaxpr, "custom_vjp")
  assert_dots_in(_body(call), np.dtype(jnp.float16), count=1)
  # The boundary keeps the traced dtypes the user's bwd was written for.
  assert [a.dtype for a in _body(call).out_avals] == [F32]
  true_grad = jax.grad(lambda w: jnp.tanh(X @ w).sum())(W)
  np.testing.assert_allclose(
      jax.jit(jax.grad(f))(W, X), 5 * true_grad, rtol=2e-2, atol=2e-2)
  # Under differentiation the fwd rule runs autocast too.
  grad_jaxpr = jax.make_jaxpr(jax.grad(f))(W, X)
  dot_dtypes = {d for ds in input_dtypes(grad_jaxpr, "dot_general") for d in ds}
  assert np.dtype(jnp.float16) in dot_dtypes


def test_shard_map_body_is_autocast():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))

  def fn(w, x):
    def body(w, xb):
      return lax.psum(jnp.exp(xb @ w).sum(0), "i")
    specs = (PartitionSpec(), PartitionSpec("i"))
    return jax.shard_map(body, mesh=mesh, in_specs=specs,
                         out_specs=PartitionSpec())(w, x).sum()

  x = normal(6, (16, 4))
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, x)
  (smap,) = [e for e in jaxpr.eqns if e.primitive is compat.primitive("shard_map_p")]
  assert smap.params["out_specs"] == (PartitionSpec(),)
  assert_dots_in(smap.params["jaxpr"], np.dtype(jnp.float16), count=1)
  assert_sensitive_ops_in_f32(smap.params["jaxpr"])
  _check_grads(fn, W, x)


@jax.custom_jvp
def _times_count(x, n):
  return x * n.astype(x.dtype)


@_times_count.defjvp
def _times_count_jvp(primals, tangents):
  x, n = primals
  return _times_count(x, n), tangents[0] * n.astype(x.dtype)


def test_custom_jvp_with_integer_argument():
  fn = lambda w, x: _times_count(x @ w, jnp.arange(4)).sum()
  assert_dots_in(jax.make_jaxpr(autocast(fn, jnp.float16))(W, X), np.dtype(jnp.float16))
  _check_grads(fn, W, X)


def test_recursion_can_be_switched_off_per_primitive():
  fn = lambda w, x: lax.scan(lambda c, r: (c, r @ w), 0.0, x)[1].sum()
  f = autocast(fn, jnp.float16, op_rules={P.scan_p: "passthrough"})
  jaxpr = jax.make_jaxpr(f)(W, X)
  assert input_dtypes(jaxpr, "dot_general") == [(F32, F32)]


def test_op_dtypes_lists_nested_operations():
  fn = autocast(lambda w, x: jax.jit(lambda a: jnp.exp(a @ w))(x).sum(), jnp.float16)
  names = ("dot_general", "exp", "reduce_sum")
  ops = [op for op in op_dtypes(fn, W, X) if op[0] in names]
  assert ops == [("dot_general", ("float16", "float16")), ("exp", ("float32",)),
                 ("reduce_sum", ("float32",))]


def test_the_default_table_recurses_into_exactly_the_registered_primitives():
  recursing = {p for p, rule in DEFAULT_OP_RULES.items() if rule == "recurse"}
  assert recursing == set(interpreter_lib.HIGHER_ORDER)
  names = {p.name for p in recursing}
  assert {"jit", "scan", "while", "cond", "remat2", "custom_jvp_call",
          "custom_vjp_call", "shard_map"} <= names, names


# -- exclusion -----------------------------------------------------------------


def test_float32_island_is_left_as_traced():
  """in_float32 is autocast's one exclusion: a jit inside is not entered and
  its matmul runs in float32."""
  def fn(w, x):
    h = x @ w
    out = jmp_lite.in_float32(jax.jit(lambda a, w: jnp.exp(a @ w)))(h, w)
    return out.astype(h.dtype) @ w

  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16))(W, X)
  half = np.dtype(jnp.float16)
  assert input_dtypes(jaxpr, "dot_general") == [(half, half), (F32, F32), (half, half)]


def test_float32_island_as_decorator_and_nested_autocast():
  @jmp_lite.in_float32
  def sensitive(a, w):
    return a @ w

  fn = lambda w, x: sensitive(x @ w, w)
  twice = autocast(autocast(fn, jnp.float16), jnp.float16)
  jaxpr = jax.make_jaxpr(twice)(W, X)
  half = np.dtype(jnp.float16)
  assert input_dtypes(jaxpr, "dot_general") == [(half, half), (F32, F32)]


def test_enabled_false_calls_fn_unchanged():
  params, x = mlp_params(), jnp.ones((5, 8))
  f = autocast(mlp, jnp.float16, enabled=False)
  assert str(jax.make_jaxpr(f)(params, x)) == str(jax.make_jaxpr(mlp)(params, x))
  assert f.__name__ == "mlp"


# -- rules ---------------------------------------------------------------------


def test_default_rule_lists():
  assert DEFAULT_OP_RULES[P.dot_general_p] == "lower"
  assert DEFAULT_OP_RULES[P.conv_general_dilated_p] == "lower"
  for prim in (P.exp_p, P.log_p, P.log1p_p, P.expm1_p, P.pow_p, P.rsqrt_p, P.erf_p,
               P.erf_inv_p, P.reduce_sum_p, P.cumsum_p, P.logistic_p):
    assert DEFAULT_OP_RULES[prim] == "f32", prim
  for prim in (P.add_p, P.mul_p, P.div_p, P.max_p, P.select_n_p, P.concatenate_p):
    assert DEFAULT_OP_RULES[prim] == "promote", prim
  assert set(OP_RULE_NAMES) == {"lower", "f32", "promote", "passthrough", "recurse"}
  with pytest.raises(TypeError):
    DEFAULT_OP_RULES[P.exp_p] = "promote"  # Read-only.


def test_conv_runs_in_compute_dtype():
  def fn(k, x):
    return jnp.exp(lax.conv(x, k, (1, 1), "SAME")).sum()

  k, x = jnp.ones((3, 2, 3, 3)) * 0.1, jnp.ones((1, 2, 5, 5))
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.bfloat16))(k, x)
  bf16 = np.dtype(jnp.bfloat16)
  assert input_dtypes(jaxpr, "conv_general_dilated") == [(bf16, bf16)]
  assert_sensitive_ops_in_f32(jaxpr)
  _check_grads(fn, k, x, dtype=bf16, tol=5e-2)


def test_user_rules_override_defaults():
  fn = lambda w, x: jnp.exp(x @ w).sum()
  half = np.dtype(jnp.float16)
  jaxpr = jax.make_jaxpr(autocast(fn, half, op_rules={P.exp_p: "promote"}))(W, X)
  assert input_dtypes(jaxpr, "exp") == [(half,)]
  f = autocast(fn, half, op_rules={P.dot_general_p: "passthrough"})
  jaxpr = jax.make_jaxpr(f)(W, X)
  assert input_dtypes(jaxpr, "dot_general") == [(F32, F32)]


def test_user_lower_rule_on_another_primitive():
  fn = lambda x: jnp.tanh(x).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.bfloat16, op_rules={lax.tanh_p: "lower"}))(X)
  assert input_dtypes(jaxpr, "tanh") == [(np.dtype(jnp.bfloat16),)]


def test_callable_rule_sees_traced_avals_and_can_delegate():
  seen = []

  def tanh_rule(ctx, x, **params):
    assert isinstance(ctx, OpRuleContext)
    seen.append((ctx.primitive, ctx.in_avals[0].dtype, x.dtype, ctx.compute_dtype))
    return ctx.apply("f32", x, **params)

  fn = lambda w, x: jnp.tanh(x @ w).sum()
  jaxpr = jax.make_jaxpr(autocast(fn, jnp.float16, op_rules={P.tanh_p: tanh_rule}))(W, X)
  half = np.dtype(jnp.float16)
  assert seen == [(P.tanh_p, F32, half, half)]
  assert input_dtypes(jaxpr, "tanh") == [(F32,)]


def _linear_solve_fn(w, x):
  a = w @ w.T + 4 * jnp.eye(4)
  solve = lambda mv, b: jnp.linalg.solve(a, b)
  sol = lax.custom_linear_solve(lambda v: a @ v, x[0], solve)
  return sol.sum()


def test_unknown_higher_order_primitive_is_refused_naming_it():
  # linear_solve has jaxpr parameters autocast does not enter: binding it as
  # traced would leave its body silently in float32, so autocast refuses it.
  assert P.linear_solve_p not in DEFAULT_OP_RULES
  with pytest.raises(ValueError, match="custom_linear_solve") as info:
    autocast(_linear_solve_fn, jnp.float16)(W, X)
  assert "in_float32" in str(info.value) and "op_rules" in str(info.value)


def test_unknown_higher_order_primitive_opt_outs():
  want = jax.jit(_linear_solve_fn)(W, X)
  # A rule of the user's own runs it as traced...
  by_rule = autocast(_linear_solve_fn, jnp.float16,
                     op_rules={P.linear_solve_p: "passthrough"})
  np.testing.assert_allclose(jax.jit(by_rule)(W, X), want, rtol=2e-2)
  # ... and so does a float32 island around it.
  island = autocast(jmp_lite.in_float32(_linear_solve_fn), jnp.float16)
  np.testing.assert_allclose(jax.jit(island)(W, X), want, rtol=1e-5)


# -- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["exp", "matmul", 3, None])
def test_rules_with_non_primitive_keys_raise(key):
  with pytest.raises(TypeError, match="keyed by primitive objects") as info:
    autocast(mlp, jnp.float16, op_rules={key: "f32"})
  assert repr(key) in str(info.value)


def test_rules_key_named_like_a_primitive_gets_a_hint():
  with pytest.raises(TypeError, match="exp_p"):
    autocast(mlp, jnp.float16, op_rules={"exp": "f32"})


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ({P.exp_p: "fp32"}, ValueError, "autocast rule 'fp32'.*valid rules"),
        ({P.exp_p: "recurse"}, ValueError, "only applies to higher-order"),
        ({P.exp_p: 3}, TypeError, "must be one of"),
        ({P.exp_p: jnp.float32}, TypeError, "must be one of.*not a rule"),
        ([(P.exp_p, 3)], TypeError, "must be one of"),
        (3, TypeError, "not iterable"),  # Python's dict() names the value
    ],
)
def test_bad_rules_raise(rules, error, match):
  with pytest.raises(error, match=match):
    autocast(mlp, jnp.float16, op_rules=rules)


def test_rules_may_be_given_as_pairs():
  params, x = mlp_params(), jnp.ones((5, 8))
  dot = jax.extend.core.primitives.dot_general_p
  pairs = autocast(mlp, jnp.float16, op_rules=[(dot, "f32")])
  mapping = autocast(mlp, jnp.float16, op_rules={dot: "f32"})
  text = str(jax.make_jaxpr(pairs)(params, x))
  assert text == str(jax.make_jaxpr(mapping)(params, x))
  assert text != str(jax.make_jaxpr(autocast(mlp, jnp.float16))(params, x))


@pytest.mark.parametrize("dtype", [jnp.int32, "int8", jnp.complex64, None, object()])
def test_non_floating_compute_dtype_raises(dtype):
  with pytest.raises((TypeError, ValueError), match="autocast needs a"):
    autocast(mlp, dtype)


def test_not_callable_raises():
  with pytest.raises(TypeError, match="expects a callable"):
    autocast("mlp", jnp.float16)


@pytest.mark.parametrize("fn", [3, None, "f"])
def test_op_dtypes_of_a_non_callable_raises_a_clear_error(fn):
  with pytest.raises(TypeError, match=r"op_dtypes expects a callable.*"
                     r"jmp_lite\.op_dtypes\(fn, \*args\)"):
    jmp_lite.op_dtypes(fn, jnp.ones(2))


def test_untraceable_function_raises_a_clear_error():
  def fn(x):
    return x if x.sum() > 0 else -x  # Python control flow on a traced value.

  with pytest.raises(TypeError, match="autocast could not trace"):
    autocast(fn, jnp.float16)(jnp.ones(3))


def test_python_arguments_are_static():
  def fn(w, x, *, activation="tanh", scale=2.0, train=False):
    h = x @ w
    h = jnp.tanh(h) if activation == "tanh" else jax.nn.relu(h)
    return h * scale if train else h

  f = jax.jit(autocast(fn, jnp.float16), static_argnames=("activation", "train"))
  got = f(W, X, activation="relu", scale=3.0, train=True)
  np.testing.assert_allclose(got, fn(W, X, activation="relu", scale=3.0, train=True),
                             rtol=2e-2, atol=2e-2)


# -- policies ------------------------------------------------------------------


def test_outputs_keep_fn_dtypes_whether_given_a_dtype_or_a_policy():
  """One rule for both entry points: autocast never changes fn's interface.
  A policy contributes its compute dtype (here: the matmuls' inputs)."""
  fn = lambda w, x: (x @ w, jnp.arange(3))
  for precision in ("p=f32,c=f16,o=f16", "params=f32,compute=f16",
                    "mixed_float16", jnp.float16, "f16"):
    jaxpr = jax.make_jaxpr(autocast(fn, precision))(W, X)
    assert_dots_in(jaxpr, F16)
    assert [a.dtype for a in jaxpr.out_avals] == [F32, jnp.int32], precision
  policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
  jaxpr = jax.make_jaxpr(autocast(fn, policy))(W, X)
  assert_dots_in(jaxpr, np.dtype(jnp.bfloat16))
  assert jaxpr.out_avals[0].dtype == F32


def test_dtype_names_are_compute_dtypes_not_policies():
  out = autocast(lambda w, x: x @ w, "bf16")(W, X)
  assert out.dtype == F32  # A bare dtype keeps the original output dtype.


def test_policy_matmul_precision_applies_to_every_matmul():
  def fn(w, x):
    h = jax.jit(lambda a: a @ w)(x)
    return lax.scan(lambda c, row: (c + row @ w, None), jnp.zeros(W.shape[1]), h)[0]

  for spec, marker in (("tf32", "HIGH"), ("c=f32,m=bf16_bf16_f32_x3", "algorithm")):
    text = jax.jit(autocast(fn, spec)).lower(W, X).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 2 and all(marker in line for line in dots), dots
  plain = jax.jit(autocast(fn, "f32")).lower(W, X).as_text()
  assert "HIGH" not in plain and "algorithm" not in plain


# -- Flax and optax ------------------------------------------------------------


class _Block(nn.Module):
  """A linen model with attention, layer norm, GELU MLP and batch norm."""

  @nn.compact
  def __call__(self, x, train=False):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
    h = nn.Dense(32)(nn.LayerNorm()(x))
    h = nn.Dense(16)(nn.gelu(h))
    h = nn.BatchNorm(use_running_average=not train)(h)
    return nn.Dense(3)(x + h).mean(axis=1)


@pytest.mark.parametrize("dtype", default_run_keeps(HALF_DTYPES), ids=str)
def test_flax_linen_apply_autocast_unmodified(dtype):
  model = _Block()
  x = normal(7, (4, 5, 16))
  variables = jax.jit(model.init)(jax.random.key(8), x)
  apply = autocast(model.apply, dtype)
  train_apply = lambda v, x: apply(v, x, train=True, mutable=["batch_stats"])
  jaxpr = jax.make_jaxpr(train_apply)(variables, x)
  # q, k, v, out projections, 2 attention matmuls, 3 Dense layers.
  assert_dots_in(jaxpr, dtype, count=9)
  assert_sensitive_ops_in_f32(jaxpr)
  out, state = jax.jit(apply, static_argnames=("train", "mutable"))(
      variables, x, train=True, mutable=("batch_stats",))
  assert out.dtype == F32
  dtypes_of = lambda tree: jax.tree.map(lambda a: a.dtype, tree)
  assert dtypes_of(state["batch_stats"]) == dtypes_of(variables["batch_stats"])

  def loss(apply_fn):
    def fn(params):
      out, _ = apply_fn({**variables, "params": params}, x, train=True,
                        mutable=["batch_stats"])
      return jnp.mean(out**2)
    return fn

  got = jax.jit(jax.grad(loss(apply)))(variables["params"])
  want = jax.jit(jax.grad(loss(model.apply)))(variables["params"])
  assert rel_err(got, want) < GRAD_TOL[dtype]


def test_flax_nnx_functional_apply():
  class Model(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 8, rngs=rngs)
      self.norm = nnx.LayerNorm(8, rngs=rngs)
      self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.gelu(self.norm(self.l1(x))))

  graphdef, state = nnx.split(Model(nnx.Rngs(0)))
  apply = lambda state, x: nnx.merge(graphdef, state)(x)
  f = autocast(apply, jnp.bfloat16)
  jaxpr = jax.make_jaxpr(f)(state, X)
  assert_dots_in(jaxpr, np.dtype(jnp.bfloat16), count=2)
  assert_sensitive_ops_in_f32(jaxpr)
  loss = lambda fn: lambda s: jnp.sum(fn(s, X) ** 2)
  got = jax.jit(jax.grad(loss(f)))(state)
  want = jax.jit(jax.grad(loss(apply)))(state)
  assert rel_err(got, want) < GRAD_TOL[np.dtype(jnp.bfloat16)]


@pytest.mark.standard_promotion
def test_train_step_with_optax_loss_scaling():
  params, x = mlp_params(), normal(9, (5, 8))
  y = jnp.ones((5, 4))
  loss_fn = autocast(lambda p: jnp.mean((mlp(p, x) - y) ** 2), jnp.float16)
  loss_scale = jmp_lite.DynamicLossScale(jnp.float32(2**15))
  opt = jmp_lite.loss_scaling(optax.adam(1e-2), loss_scale)

  @jax.jit
  def step(params, state):
    loss_scale = jmp_lite.get_loss_scale(state)
    grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss_fn(params)

  state = opt.init(params)
  losses = []
  for _ in range(5):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert step._cache_size() == 1  # pylint: disable=protected-access
  assert jax.tree.map(lambda p: p.dtype, params) == jax.tree.map(lambda _: F32, params)
  assert losses[-1] < losses[0]


def test_op_dtypes_treats_non_array_arguments_as_static():
  """op_dtypes splits arguments like autocast does (strings, mutable=[...])."""

  def layer(w, x, act="tanh"):
    return jnp.tanh(x @ w) if act == "tanh" else x @ w

  f = autocast(layer, jnp.float16)
  w = jnp.ones((2, 2))
  ops = [name for name, _ in op_dtypes(f, w, w, act="none")]
  assert "dot_general" in ops
  assert "tanh" not in ops
  ops = [name for name, _ in op_dtypes(f, w, w, act="tanh")]
  assert "tanh" in ops


def test_autocast_of_a_gradient_with_a_gather():
  """The gradient of a gather is a scatter-add whose combiner JAX traced
  for float32: autocast of the gradient function runs it as traced (before,
  its operands were cast to bfloat16 against the float32 combiner, and XLA
  refused the program)."""
  grad = jax.grad(lambda x, w, i: (x[i] @ w).sum())
  x, w, i = jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.array([0, 3])
  got = jax.jit(jmp_lite.autocast(grad, "mixed_bfloat16"))(x, w, i)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, grad(x, w, i), rtol=1e-2)


def test_autocast_of_a_jit_taking_a_typed_prng_key():
  """A typed PRNG key (``jax.random.key``: an extended dtype, no NumPy one)
  passed into a ``jit`` inside the function: the memo key of the jit's
  autocast body read its dtype with NumPy and raised a TypeError."""
  inner = jax.jit(lambda k, x: (x @ x) * jax.random.uniform(k, x.shape))
  fn = jmp_lite.autocast(lambda k, x: inner(k, x), "mixed_bfloat16")
  key, x = jax.random.key(0), jnp.ones((4, 4))
  assert fn(key, x).dtype == jnp.float32
  assert [d for op, d in op_dtypes(fn, key, x) if op == "dot_general"] == [
      ("bfloat16", "bfloat16")]
