"""Mixture-of-Experts layers under autocast (issue 37, items 1 and 8).

A MoE layer multiplies its tokens, sorted by expert, with
``jax.lax.ragged_dot`` (the primitive ``ragged_dot_general``). It is a matmul
like ``dot_general`` on every route: operands in the compute dtype, float32
accumulation, and a backward pass whose grouped matmuls (JAX's transposes: the
ragged non-contracting one for the input gradient, the ragged contracting one
for the weight gradient) run on compute-dtype operands too. Asserted on the
jaxpr, for jit and no-jit, bfloat16 and float16, with gradients close to the
float32 reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
import jmp_lite.autocast_rules
from jmp_lite._src import compat
from jmp_lite._src.autocast import rules as rules_lib

from helpers import all_eqns
from helpers import maybe_jit
from helpers import default_run_keeps

F16, BF16, F32 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
HALF = pytest.mark.parametrize("half", [BF16, F16], ids=["bf16", "f16"])
# The jitted variant runs in the README's selection, the eager one (every
# operation compiled on its own) in the slow stage.
JIT = pytest.mark.parametrize("jit", default_run_keeps([False, True], keep=1),
                              ids=["eager", "jit"])
RAGGED = compat.primitive("ragged_dot_general_p")
DOT = compat.primitive("dot_general_p")

E, TOPK, D, F, T = 4, 2, 32, 64, 16   # experts, top-k, model dim, hidden, tokens


def moe_layer(params, x):
  """A tiny top-2 MoE: router matmul, tokens sorted by expert, two grouped
  expert matmuls, and the combine (a matmul with the gate weights)."""
  logits = x @ params["router"]                         # [T, E]: the router
  probs = jax.nn.softmax(logits, axis=-1)
  gates, experts = jax.lax.top_k(probs, TOPK)           # [T, TOPK]
  gates = gates / gates.sum(-1, keepdims=True)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat)                             # sort by expert
  tokens = order // TOPK
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
  h = jax.nn.relu(jax.lax.ragged_dot(x[tokens], params["w1"], sizes))
  y = jax.lax.ragged_dot(h, params["w2"], sizes)        # [T * TOPK, D]
  combine = jnp.zeros((T, T * TOPK), y.dtype).at[
      tokens, jnp.arange(T * TOPK)].set(gates.reshape(-1)[order])
  return combine @ y                                    # the combine


def model(params, x):
  """The MoE layer as a residual block, then an output head."""
  h = x + moe_layer(params, x)
  return h @ params["head"]


def make_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  return {
      "router": jax.random.normal(k[0], (D, E)) * 0.3,
      "w1": jax.random.normal(k[1], (E, D, F)) * D ** -0.5,
      "w2": jax.random.normal(k[2], (E, F, D)) * F ** -0.5,
      "head": jax.random.normal(k[3], (D, 16)) * D ** -0.5,
  }


PARAMS = make_params()
X = jax.random.normal(jax.random.key(7), (T, D))
COTANGENT = jax.random.normal(jax.random.key(8), (T, 16))


def loss(params, x):
  return jnp.sum(model(params, x).astype(F32) * COTANGENT)


def ragged_eqns(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return [e for e in compat.walk_eqns(closed, live_only=True)
          if e.primitive is RAGGED]


def operand_dtypes(eqn):
  return tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2])


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------
# 16-bit autocast: compute dtype in, float32 accumulation, backward too.
# ---------------------------------------------------------------------------


def test_ragged_dot_general_is_a_lower_primitive_found_through_compat():
  assert RAGGED is not None and RAGGED.name == "ragged_dot_general"
  assert RAGGED in rules_lib.LOWER_PRIMITIVES
  assert jmp_lite.autocast_rules.DEFAULT_OP_RULES[RAGGED] == "lower"


@HALF
@JIT
def test_forward_runs_in_the_compute_dtype_and_accumulates_in_f32(half, jit):
  f = maybe_jit(jmp_lite.autocast(model, half), jit)
  out = f(PARAMS, X)
  assert out.dtype == F32                       # the traced output dtype
  found = ragged_eqns(jmp_lite.autocast(model, half), PARAMS, X)
  assert len(found) == 2
  for eqn in found:
    assert operand_dtypes(eqn) == (half, half)
    assert np.dtype(eqn.invars[2].aval.dtype) == np.int32   # group sizes
    assert np.dtype(eqn.params["preferred_element_type"]) == F32
  assert rel_err(out, model(PARAMS, X)) < (3e-2 if half == BF16 else 5e-3)


@HALF
@JIT
def test_backward_grouped_matmuls_run_in_the_compute_dtype(half, jit):
  grad_fn = jax.grad(jmp_lite.autocast(loss, half))
  found = ragged_eqns(grad_fn, PARAMS, X)
  forward = [e for e in found
             if np.dtype(e.params["preferred_element_type"]) == F32]
  backward = [e for e in found if e not in forward]
  assert len(forward) == 2
  # The input gradient of the second expert matmul (ragged along a
  # non-contracting dimension, one group dimension in the rhs) and the two
  # weight gradients (ragged along the contracting dimension, no group
  # dimension): JAX's transposes, on compute-dtype operands.
  dnums = [e.params["ragged_dot_dimension_numbers"] for e in backward]
  assert sorted(len(d.rhs_group_dimensions) for d in dnums) == [0, 0, 1]
  for eqn in found:
    assert operand_dtypes(eqn) == (half, half), eqn
  for eqn in backward:
    assert np.dtype(eqn.params["preferred_element_type"]) == half
  # No mixed-dtype (half x float32) matmul anywhere in the backward pass.
  closed = jax.make_jaxpr(grad_fn)(PARAMS, X)
  for eqn in compat.walk_eqns(closed, live_only=True):
    if eqn.primitive in (RAGGED, DOT):
      assert len({np.dtype(v.aval.dtype) for v in eqn.invars[:2]}) == 1, eqn
  grads = maybe_jit(grad_fn, jit)(PARAMS, X)
  reference = jax.grad(loss)(PARAMS, X)
  tol = 3e-2 if half == BF16 else 5e-3
  for name in PARAMS:
    assert grads[name].dtype == F32
    assert rel_err(grads[name], reference[name]) < tol, name


def test_second_derivatives_through_the_grouped_matmul():
  # A Hessian-vector product: the custom JVP's tangent matmuls use this rule
  # again (higher orders stay in the compute dtype).
  w = jnp.linspace(-1, 1, 3 * 8 * 4).reshape(3, 8, 4)
  x = jnp.linspace(-1, 1, 16 * 8).reshape(16, 8)
  sizes = jnp.array([6, 0, 10], jnp.int32)

  def f(w, x):
    return jnp.sum(jnp.tanh(jax.lax.ragged_dot(x, w, sizes)) ** 2)

  def hvp(fn):
    return jax.jvp(jax.grad(lambda w: fn(w, x)), (w,), (jnp.ones_like(w),))[1]

  reference = hvp(f)
  found = hvp(jmp_lite.autocast(f, F16))
  assert float(jnp.abs(reference).max()) > 0
  # float16's own rounding (a dense x @ w under autocast is as far off).
  assert rel_err(found, reference) < 2e-2
  second = ragged_eqns(lambda w: hvp(jmp_lite.autocast(f, F16)), w)
  assert len(second) >= 4
  assert all(operand_dtypes(e) == (F16, F16) for e in second)


def test_op_dtypes_lists_the_grouped_matmuls():
  ops = jmp_lite.op_dtypes(jmp_lite.autocast(model, "mixed_bfloat16"),
                           PARAMS, X)
  matmuls = [op for op in ops if op[0] in ("dot_general", "ragged_dot_general")]
  assert matmuls == [
      ("dot_general", ("bfloat16",) * 2),
      ("ragged_dot_general", ("bfloat16",) * 2),
      ("ragged_dot_general", ("bfloat16",) * 2),
      ("dot_general", ("bfloat16",) * 2),
      ("dot_general", ("bfloat16",) * 2),
  ]
  assert all(op.note is None for op in matmuls)   # no float8 recipe here


@JIT
def test_with_policy_runs_the_grouped_matmuls_in_the_compute_dtype(jit):
  f = jmp_lite.with_policy(model, "mixed_bfloat16")
  found = ragged_eqns(f, PARAMS, X)
  assert [operand_dtypes(e) for e in found] == [(BF16, BF16)] * 2
  out = maybe_jit(f, jit)(PARAMS, X)
  assert out.dtype == F32
  assert rel_err(out, model(PARAMS, X)) < 3e-2



# ---------------------------------------------------------------------------
# Flax: a module calling jax.lax.ragged_dot gets compute-dtype operands.
# ---------------------------------------------------------------------------

SIZES = jnp.array([4, 4, 0, 8], jnp.int32)


def test_a_linen_module_calling_ragged_dot_under_a_bf16_policy():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.linen as jlinen  # pylint: disable=g-import-not-at-top

  class Experts(nn.Module):
    @nn.compact
    def __call__(self, x, sizes):
      w = self.param("w", nn.initializers.normal(0.1), (E, D, F))
      return jax.lax.ragged_dot(x, w, sizes)

  model = jlinen.apply_policy(Experts(), "mixed_bfloat16")
  variables = model.init(jax.random.key(0), X, SIZES)
  assert variables["params"]["w"].dtype == F32          # stored in f32
  assert model.apply(variables, X, SIZES).dtype == F32  # the output dtype
  ops = jmp_lite.op_dtypes(model.apply, variables, X, SIZES)
  assert [op for op in ops if op[0] == "ragged_dot_general"] == [
      ("ragged_dot_general", ("bfloat16", "bfloat16"))]
  grads = jax.grad(lambda p: model.apply({"params": p}, X, SIZES).sum())(
      variables["params"])
  assert grads["w"].dtype == F32


def test_an_nnx_module_calling_ragged_dot_under_a_bf16_policy():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jmp_lite.nnx as jnnx  # pylint: disable=g-import-not-at-top

  class Experts(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, F)) * 0.1)

    def __call__(self, x, sizes):
      return jax.lax.ragged_dot(x, self.w[...], sizes)

  module = Experts(nnx.Rngs(0))
  policy_module = jnnx.apply_policy(module, "mixed_bfloat16")
  assert policy_module(X, SIZES).dtype == F32
  graph, state = nnx.split(policy_module)

  def run(state, x, sizes):
    return nnx.merge(graph, state)(x, sizes)

  ops = jmp_lite.op_dtypes(run, state, X, SIZES)
  assert [op for op in ops if op[0] == "ragged_dot_general"] == [
      ("ragged_dot_general", ("bfloat16", "bfloat16"))]
  assert module.w[...].dtype == F32


# ---------------------------------------------------------------------------
# Float8 and FP4 recipes: the grouped matmul of the recipe, visible fallbacks.
# ---------------------------------------------------------------------------

E4, BF = ("float8_e4m3fn",) * 2, ("bfloat16",) * 2
ROUTES = pytest.mark.parametrize(
    "route", [jmp_lite.autocast, jmp_lite.with_policy],
    ids=["autocast", "with_policy"])
GX = jnp.linspace(-2.0, 2.0, 24 * 32).reshape(24, 32)
GW = jnp.cos(jnp.arange(3 * 32 * 32, dtype=jnp.float32)).reshape(3, 32, 32)
GSIZES = jnp.array([8, 0, 16], jnp.int32)


def grouped(x, w, sizes):
  return jax.lax.ragged_dot(x, w, sizes)


def policy(recipe):
  return f"p=f32,c=bf16,o=f32,m={recipe}"


def matmul_ops(fn, *args):
  return [op for op in jmp_lite.op_dtypes(fn, *args)
          if op[0] in ("dot_general", "ragged_dot_general")]


RECIPES = ["fp8", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4", "mxfp4",
           "int8", "int8_switchback"]


@ROUTES
@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_the_rule_runs_the_recipes_grouped_matmul(route, recipe):
  from jmp_lite._src.low_precision import recipe_matmuls  # pylint: disable=g-import-not-at-top
  config = jmp_lite.get_policy(policy(recipe)).fp8_recipe
  found = route(grouped, policy(recipe))(GX, GW, GSIZES)
  expected = recipe_matmuls.recipe_ragged_dot(
      GX.astype(BF16), GW.astype(BF16), GSIZES, config=config,
      preferred_element_type=BF16).astype(F32)
  assert found.dtype == F32
  np.testing.assert_array_equal(np.asarray(found), np.asarray(expected))
  assert all(op.note is None for op in matmul_ops(
      route(grouped, policy(recipe)), GX, GW, GSIZES))


@JIT
@ROUTES
def test_expert_matmuls_run_in_float8_forward_and_backward(route, jit):
  f = route(model, "mixed_fp8")
  ops = matmul_ops(f, PARAMS, X)
  assert [(op[0], op[1]) for op in ops if op[0] == "ragged_dot_general"] == [
      ("ragged_dot_general", E4)] * 2
  grads = [op for op in matmul_ops(jax.grad(route(loss, "mixed_fp8")),
                                   PARAMS, X) if op[0] == "ragged_dot_general"]
  # e4m3 forward, an e5m2 gradient in the backward products (fp8's hybrid).
  assert {op[1] for op in grads} >= {E4, ("float8_e5m2", "float8_e4m3fn")}
  out = maybe_jit(f, jit)(PARAMS, X)
  assert out.dtype == F32 and bool(jnp.all(jnp.isfinite(out)))
  g = maybe_jit(jax.grad(route(loss, "mixed_fp8")), jit)(PARAMS, X)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in g.values())


def test_a_transposed_weight_layout_gives_the_same_product():
  # rhs [G, N, K]: contracting dimension 2; the rule hands the recipe
  # [G, K, N].
  def transposed(x, w_t, sizes):
    dnums = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(x, w_t, sizes, dnums)

  w_t = jnp.swapaxes(GW, 1, 2)
  for recipe in ("fp8", "fp8_rowwise"):
    a = jmp_lite.autocast(transposed, policy(recipe))(GX, w_t, GSIZES)
    b = jmp_lite.autocast(grouped, policy(recipe))(GX, GW, GSIZES)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [op[1] for op in matmul_ops(jmp_lite.autocast(
        transposed, policy(recipe)), GX, w_t, GSIZES)] == [E4]


def _ragged_contracting(x, dy, sizes):
  # The weight gradient's form: lhs and rhs ragged along the contracting
  # (token) axis, a [G, K, N] result.
  dnums = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(x, dy, sizes, dnums)


@ROUTES
def test_every_other_form_stays_in_the_compute_dtype_visibly(route, caplog):
  cases = [
      ("batched grouped matmul",
       jax.vmap(grouped),
       (jnp.stack([GX, -GX]), jnp.stack([GW, GW]), jnp.stack([GSIZES] * 2))),
      ("grouped matmul ragged along its contracting dimension",
       _ragged_contracting, (GX, jnp.ones((24, 16)), GSIZES)),
      ("dims not multiple of 16: K=24",
       grouped, (GX[:, :24], GW[:, :24], GSIZES)),
      ("dims not multiple of 16: N=8", grouped, (GX, GW[..., :8], GSIZES)),
      ("empty matmul", grouped, (GX[:0], GW, jnp.zeros(3, jnp.int32))),
  ]
  for reason, fn, args in cases:
    f = route(fn, "mixed_fp8")
    ops = matmul_ops(f, *args)
    assert len(ops) == 1 and ops[0].note.startswith(reason), (reason, ops)
    assert ops[0][1] == BF, ops
    # As the 16-bit route computes it (float32 accumulation, compute dtype).
    plain = route(fn, "mixed_bfloat16")(*args)
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(plain))
  with caplog.at_level("DEBUG", logger="jmp_lite"):
    route(grouped, "mixed_fp8")(GX[:, :24], GW[:, :24], GSIZES)
  assert any("ragged_dot_general" in r.getMessage()
             and "stays out of float8: dims not multiple of 16: K=24"
             in r.getMessage() for r in caplog.records)


def test_the_fallback_keeps_float32_accumulation_and_a_low_backward():
  f = jmp_lite.autocast(jax.vmap(grouped), "mixed_fp8")
  sizes = jnp.stack([GSIZES] * 2)
  args = (jnp.stack([GX, -GX]), jnp.stack([GW, GW]), sizes)
  found = ragged_eqns(f, *args)
  assert [np.dtype(e.params["preferred_element_type"]) for e in found] == [F32]
  back = ragged_eqns(jax.grad(lambda x, w: f(x, w, sizes).sum(), (0, 1)),
                     *args[:2])
  assert back and all(operand_dtypes(e) == (BF16, BF16) for e in back)


def test_a_delayed_recipe_named_by_a_marker_is_scaled_currently():
  from jmp_lite._src import markers  # pylint: disable=g-import-not-at-top
  from jmp_lite.fp8 import Fp8Config  # pylint: disable=g-import-not-at-top

  def marked(x, w, sizes):
    with jax.named_scope(markers.fp8_marker(Fp8Config(scaling="delayed"))):
      return grouped(x, w, sizes)

  a = jmp_lite.autocast(marked, "mixed_fp8")(GX, GW, GSIZES)
  b = jmp_lite.autocast(grouped, "mixed_fp8")(GX, GW, GSIZES)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------
# Item 8: the router and the combine stay in high precision by default.
# ---------------------------------------------------------------------------

ROUTER = "MoE router (include_moe_gating=False)"
COMBINE = "MoE combine (include_moe_gating=False)"
HEAD = "output head (include_output_head=False)"


@JIT
@ROUTES
@pytest.mark.parametrize("recipe", default_run_keeps(["fp8", "fp8_rowwise", "nvfp4", "int8"]))
def test_router_and_combine_stay_in_the_compute_dtype(route, recipe, jit):
  f = route(model, policy(recipe))
  ops = matmul_ops(f, PARAMS, X)
  assert [op[0] for op in ops] == [
      "dot_general", "ragged_dot_general", "ragged_dot_general",
      "dot_general", "dot_general"]
  assert [op.note for op in ops] == [ROUTER, None, None, COMBINE, HEAD]
  for op in (ops[0], ops[3], ops[4]):
    assert op[1] == BF
  out = maybe_jit(f, jit)(PARAMS, X)
  assert bool(jnp.all(jnp.isfinite(out)))


@ROUTES
def test_include_moe_gating_puts_them_in_float8(route):
  spec = policy("fp8(include_moe_gating=true;dim_multiple=1)")
  assert jmp_lite.get_policy(spec).fp8_recipe.include_moe_gating
  ops = matmul_ops(route(model, spec), PARAMS, X)
  assert [op.note for op in ops] == [None] * 4 + [HEAD]
  assert [op[1] for op in ops[:4]] == [E4] * 4


def test_the_gating_matmuls_are_found_inside_jit_and_scan():
  layer = jax.jit(moe_layer)

  def stacked(params, x):
    def block(h, _):
      return h + layer(params, h), None
    h, _ = jax.lax.scan(block, x, None, length=2)
    return h @ params["head"]

  ops = matmul_ops(jmp_lite.autocast(stacked, "mixed_fp8"), PARAMS, X)
  assert [op.note for op in ops] == [ROUTER, None, None, COMBINE, HEAD]


def test_an_argmax_of_the_head_makes_no_router():
  # The head's argmax (an accuracy) picks nothing that reaches a matmul.
  def dense(params, x):
    logits = jax.nn.relu(x @ params["w1"]) @ params["w2"]
    return logits, jnp.argmax(logits, -1)

  params = {"w1": jnp.full((32, 64), 0.05), "w2": jnp.full((64, 16), 0.05)}
  spec = policy("fp8(include_output_head=true)")
  ops = matmul_ops(jmp_lite.autocast(dense, spec), params, X)
  assert [(op[1], op.note) for op in ops] == [(E4, None)] * 2


def test_a_one_hot_of_the_expert_indices_is_no_combine():
  # Top-1 routing by argmax; a matmul with the one-hot of the indices (an
  # integer path) is no combine; the router is found by the matmul it picks.
  def top1(params, x):
    idx = jnp.argmax(jax.nn.softmax(x @ params["router"]), -1)
    onehot = jax.nn.one_hot(idx, 16, dtype=x.dtype)
    return (x + onehot @ params["bias"]) @ params["head"]

  params = {"router": jnp.sin(jnp.arange(32 * 16.0)).reshape(32, 16),
            "bias": jnp.ones((16, 32)), "head": jnp.ones((32, 16))}
  ops = matmul_ops(jmp_lite.autocast(top1, "mixed_fp8"), params, X)
  assert [op.note for op in ops] == [ROUTER, None, HEAD]
  assert ops[1][1] == E4


def test_no_gating_search_without_a_float8_recipe():
  ops = matmul_ops(jmp_lite.autocast(model, "mixed_bfloat16"), PARAMS, X)
  assert all(op.note is None for op in ops)
