"""int8 recipes through every route (issue 38): ``with_policy``, ``autocast``,
linen and NNX run a policy's ``m=int8`` / ``m=int8_switchback`` matmuls as
:func:`jmp_lite.int8.dot_general` (``s8 x s8 -> s32`` products, forward
and backward), bit for bit against the hand-written call, with float8's
exclusions (the output head, K or N not multiples of ``dim_multiple``,
batched products, a Mixture-of-Experts layer's router and combine), each
fallback visible in ``op_dtypes`` and named "int8" in the debug record; the
grouped matmul (``jax.lax.ragged_dot``) as :func:`int8.ragged_dot`; and the
policy grammar of the int8 recipes, with its errors."""

from __future__ import annotations

import logging
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import int8
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx
from helpers import default_run_keeps

_DN = (((1,), (0,)), ((), ()))
_BF16 = jnp.bfloat16
I8 = ("int8", "int8")
BF = ("bfloat16", "bfloat16")
RECIPES = pytest.mark.parametrize("recipe", ["int8", "int8_switchback"])
HEAD = "output head (include_output_head=False)"


def _normal(seed, shape, scale=1.0):
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _spec(recipe):
  return f"p=f32,c=bf16,o=f32,m={recipe}"


def _dots(fn, *args):
  """The ``dot_general``s op_dtypes lists (operand dtypes, fallback note)."""
  return [o for o in jmp_lite.op_dtypes(fn, *args) if o[0] == "dot_general"]


def _mlp(params, x):
  h = jnp.tanh(x @ params["w1"])
  return h @ params["w2"]          # the output head


def _params():
  return {"w1": _normal(1, (32, 32), 0.2), "w2": _normal(2, (32, 16), 0.2)}


def _reference(params, x, config):
  """The policy's program written by hand: bf16 operands, the hidden matmul
  through int8.dot_general, the head as written."""
  p = jax.tree.map(lambda a: a.astype(_BF16), params)
  h = jnp.tanh(int8.dot_general(x.astype(_BF16), p["w1"], _DN,
                                     config=config))
  return (h @ p["w2"]).astype(jnp.float32)


def _loss(f, x):
  c = _normal(3, (8, 16))
  return lambda p, x=x: jnp.sum(f(p, x) * c)


# ---------------------------------------------------------------------------
# Every route: the quantized products, forward and backward.
# ---------------------------------------------------------------------------


def _expected_backward(recipe):
  """The hidden layer's three products (forward, input gradient, weight
  gradient): SwitchBack's weight gradient in the compute dtype."""
  return [I8, I8, I8 if recipe == "int8" else BF]


@RECIPES
@pytest.mark.parametrize("route", default_run_keeps([jmp_lite.with_policy, jmp_lite.autocast]),
                         ids=["with_policy", "autocast"])
def test_functional_routes_run_int8_bit_for_bit(route, recipe):
  params, x = _params(), _normal(0, (8, 32))
  fn = route(_mlp, _spec(recipe))
  config = int8.Int8Config(recipe)
  if route is jmp_lite.with_policy:   # the program as traced, the hidden
    # product swapped: the hand-written program's numbers, bit for bit.
    np.testing.assert_array_equal(
        jax.jit(fn)(params, x), jax.jit(_reference, static_argnums=2)(
            params, x, config))
    got = jax.jit(jax.grad(_loss(fn, x)))(params)
    want = jax.jit(jax.grad(_loss(lambda p, x: _reference(p, x, config),
                                  x)))(params)
    jax.tree.map(np.testing.assert_array_equal, got, want)
  # One product (autocast runs the rest of a program by its own op rules):
  # int8.dot_general on the bf16 operands, forward and backward.
  one = route(lambda w, x: x @ w,
              _spec(f"{recipe}(include_output_head=true)"))
  hand = lambda w, x: int8.dot_general(
      x.astype(_BF16), w.astype(_BF16), _DN,
      config=int8.Int8Config(recipe, include_output_head=True)
  ).astype(jnp.float32)
  w1 = params["w1"]
  np.testing.assert_array_equal(jax.jit(one)(w1, x), jax.jit(hand)(w1, x))
  c = _normal(3, (8, 32))
  grad = lambda f: jax.jit(jax.grad(lambda w, x: jnp.sum(f(w, x) * c),
                                    argnums=(0, 1)))
  jax.tree.map(np.testing.assert_array_equal, grad(one)(w1, x),
               grad(hand)(w1, x))
  # The forward pass: the hidden product in int8, the head as traced.
  assert [(o[1], o.note) for o in _dots(fn, params, x)] == [
      (I8, None), (BF, HEAD)]
  # Forward and backward, differentiating the input too (all three
  # products of the hidden layer live).
  grad = jax.grad(lambda p, x: _loss(fn, x)(p), argnums=(0, 1))
  quantized = [o[1] for o in _dots(grad, params, x) if o.note is None]
  assert quantized == _expected_backward(recipe)


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(32, name="hidden")(x))
    return nn.Dense(16, name="head")(h)


class _NnxMlp(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(32, 32, rngs=rngs)
    self.head = nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.hidden(x)))


def _dense_reference(layers, x, config):
  """A Dense/Linear MLP by hand: bf16 parameters, the hidden layer's
  product through int8.dot_general (the hook keeps the bf16 result)."""
  (k0, b0), (k1, b1) = [(k.astype(_BF16), b.astype(_BF16)) for k, b in layers]
  h = int8.dot_general(x.astype(_BF16), k0, _DN,
                            preferred_element_type=_BF16, config=config) + b0
  return (jnp.tanh(h) @ k1 + b1).astype(jnp.float32)


@RECIPES
def test_linen_runs_int8_through_the_dot_general_hook(recipe):
  x = _normal(0, (8, 32))
  model = jlinen.apply_policy(_Mlp(), _spec(recipe))
  variables = model.init(jax.random.key(0), x)
  assert set(variables) == {"params"}   # current scaling: no fp8_state
  config = int8.Int8Config(recipe)
  layers = lambda p: [(p[n]["kernel"], p[n]["bias"]) for n in ("hidden", "head")]
  want = jax.jit(lambda p: _dense_reference(layers(p), x, config))
  np.testing.assert_array_equal(jax.jit(model.apply)(variables, x),
                                want(variables["params"]))
  got = jax.jit(jax.grad(lambda p: jnp.sum(
      model.apply({"params": p}, x) ** 2)))(variables["params"])
  ref = jax.jit(jax.grad(lambda p: jnp.sum(want(p) ** 2)))(variables["params"])
  jax.tree.map(np.testing.assert_array_equal, got, ref)
  grad = jax.grad(lambda v, x: jnp.sum(model.apply(v, x)), argnums=(0, 1))
  quantized = [o[1] for o in _dots(grad, variables, x) if o.note is None]
  assert quantized == _expected_backward(recipe)
  assert [o.note for o in _dots(model.apply, variables, x)] == [None, HEAD]


@RECIPES
def test_nnx_runs_int8_through_the_dot_general_hook(recipe):
  x = _normal(0, (8, 32))
  module = _NnxMlp(nnx.Rngs(0))
  model = jnnx.apply_policy(module, _spec(recipe))
  config = int8.Int8Config(recipe)
  layers = [(m.kernel[...], m.bias[...]) for m in (module.hidden, module.head)]
  np.testing.assert_array_equal(model(x), _dense_reference(layers, x, config))
  assert [o.note for o in _dots(lambda x: model(x), x)] == [None, HEAD]
  grads = nnx.grad(lambda m, x: jnp.sum(m(x)), argnums=(0, 1))
  quantized = [o[1] for o in _dots(grads, model, x) if o.note is None]
  assert quantized == _expected_backward(recipe)
  # The gradient: the hand-written reference's, bit for bit.
  got = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  want = jax.grad(lambda ls: jnp.sum(_dense_reference(ls, x, config) ** 2))(
      layers)
  np.testing.assert_array_equal(got["module"]["hidden"]["kernel"][...],
                                want[0][0])


def test_a_hand_called_int8_product_is_no_fallback():
  """A product int8.dot_general made already (s8 x s8) runs as written
  under a policy: no fallback note, and it counts for the head rule."""
  w, x = _normal(1, (32, 32), 0.2), _normal(0, (8, 32))
  f = lambda w, x: int8.dot_general(x, w, _DN) @ w
  for route in (jmp_lite.with_policy, jmp_lite.autocast):
    ops = _dots(route(f, "mixed_int8"), w, x)
    assert [(o[1], o.note) for o in ops] == [(I8, None), (BF, HEAD)]


def test_op_dtypes_lists_integer_matmul_operands():
  a = jnp.ones((4, 4), jnp.int32)
  assert jmp_lite.op_dtypes(lambda a: a @ a, a) == [
      ("dot_general", ("int32", "int32"))]
  sizes = jnp.array([2, 2], jnp.int32)
  grouped = jmp_lite.op_dtypes(
      lambda x, w: jax.lax.ragged_dot(x, w, sizes),
      jnp.ones((4, 8)), jnp.ones((2, 8, 4)))
  assert grouped == [("ragged_dot_general", ("float32", "float32"))]


# ---------------------------------------------------------------------------
# What stays out of int8, and the switches.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, shapes, reason", [
    ("int8", ((8, 24), (24, 32)), "dims not multiple of 16: K=24"),
    ("int8", ((8, 32), (32, 40)), "dims not multiple of 16: N=40"),
    ("int8(dim_multiple=8)", ((8, 24), (24, 32)), None),
    ("int8_switchback(dim_multiple=8)", ((8, 32), (32, 40)), None),
    ("int8", ((8, 32), (32, 32)), None),
])
def test_dimension_rule(spec, shapes, reason):
  a, b = _normal(3, shapes[0]), _normal(4, shapes[1])
  c = _normal(5, (shapes[1][1], 16))
  f = lambda a, b, c: jnp.tanh(a @ b) @ c   # the second product is the head
  ops = _dots(jmp_lite.with_policy(f, _spec(spec)), a, b, c)
  assert ops[1].note == HEAD
  if reason is None:
    assert (ops[0][1], ops[0].note) == (I8, None)
  else:
    assert (ops[0][1], ops[0].note) == (BF, reason)


def test_output_head_stays_out_unless_included():
  params, x = _params(), _normal(0, (8, 32))
  for route in (jmp_lite.with_policy, jmp_lite.autocast):
    ops = _dots(route(_mlp, _spec("int8(include_output_head=true)")),
                params, x)
    assert [(o[1], o.note) for o in ops] == [(I8, None), (I8, None)]


def test_batched_products_stay_out_unless_included():
  q, k = _normal(6, (2, 16, 32)), _normal(7, (2, 16, 32))
  w, head = _normal(8, (32, 32)), _normal(9, (16, 16))
  f = lambda q, k, w, head: jnp.einsum("bqd,bkd->bqk", q @ w, k) @ head
  ops = _dots(jmp_lite.with_policy(f, "mixed_int8"), q, k, w, head)
  assert [(o[1], o.note) for o in ops] == [
      (I8, None), (BF, "batched matmul (include_batched=False)"), (BF, HEAD)]
  ops = _dots(jmp_lite.with_policy(f, _spec("int8(include_batched=true)")),
              q, k, w, head)
  assert [(o[1], o.note) for o in ops] == [(I8, None), (I8, None), (BF, HEAD)]
  got = jax.jit(jmp_lite.with_policy(
      f, _spec("int8(include_batched=true;include_output_head=true)")))(
          q, k, w, head)
  dn = (((2,), (2,)), ((0,), (0,)))
  bf = lambda a: a.astype(_BF16)
  want = jax.jit(lambda q, k, w, head: int8.dot_general(
      int8.dot_general(int8.dot_general(bf(q), bf(w), (((2,), (0,)), ((), ()))),
                            bf(k), dn),
      bf(head), (((2,), (0,)), ((), ()))).astype(jnp.float32))(q, k, w, head)
  np.testing.assert_array_equal(got, want)


def test_fallback_records_name_int8(caplog):
  policy = "mixed_int8"
  x = _normal(0, (8, 32))

  class Own(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, dot_general=jax.lax.dot_general)(x)

  model = jlinen.apply_policy(Own(), policy)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  with caplog.at_level(logging.DEBUG, logger="jmp_lite"):
    jax.make_jaxpr(jmp_lite.with_policy(_mlp, policy))(_params(), x)
    jax.make_jaxpr(model.apply)(variables, x)
  messages = [r.getMessage() for r in caplog.records if r.name == "jmp_lite"]
  for reason in ("output head", "its own dot_general"):
    assert any("stays out of int8: " in m and reason in m
               for m in messages), messages
  assert not any("stays out of float8" in m for m in messages), messages


# ---------------------------------------------------------------------------
# Mixture-of-Experts: ragged_dot under int8.
# ---------------------------------------------------------------------------

E, D, F = 4, 32, 32
SIZES = jnp.array([4, 4, 0, 8], jnp.int32)


@RECIPES
def test_autocast_runs_ragged_dot_in_int8(recipe):
  x, w = _normal(0, (16, D)), _normal(1, (E, D, F), 0.2)
  f = lambda x, w: jax.lax.ragged_dot(x, w, SIZES)
  config = int8.Int8Config(recipe)
  for route in (jmp_lite.autocast, jmp_lite.with_policy):
    fn = route(f, _spec(recipe))
    ops = [o for o in jmp_lite.op_dtypes(fn, x, w)
           if o[0] == "ragged_dot_general"]
    assert [(o[1], o.note) for o in ops] == [(I8, None)]
    hand = lambda x, w: int8.ragged_dot(
        x.astype(_BF16), w.astype(_BF16), SIZES,
        config=config).astype(jnp.float32)
    np.testing.assert_array_equal(jax.jit(fn)(x, w), jax.jit(hand)(x, w))
    got = jax.jit(jax.grad(lambda w: jnp.sum(fn(x, w) ** 2)))(w)
    want = jax.jit(jax.grad(lambda w: jnp.sum(hand(x, w) ** 2)))(w)
    np.testing.assert_array_equal(got, want)
    assert (got[2] == 0).all()   # the empty group's weight gradient


class _LinenMoE(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param("w", nn.initializers.normal(0.1), (E, D, F))
    return nn.Dense(F)(jax.lax.ragged_dot(x, w, sizes))


@RECIPES
def test_linen_runs_a_module_s_ragged_dot_in_int8(recipe):
  x = _normal(0, (16, D))
  model = jlinen.apply_policy(_LinenMoE(), _spec(recipe))
  variables = model.init(jax.random.key(0), x, SIZES)
  ops = [o for o in jmp_lite.op_dtypes(model.apply, variables, x, SIZES)
         if o[0] == "ragged_dot_general"]
  assert [(o[1], o.note) for o in ops] == [(I8, None)]
  out = jax.jit(model.apply)(variables, x, SIZES)
  p = jax.tree.map(lambda a: a.astype(_BF16), variables["params"])
  hand = int8.ragged_dot(x.astype(_BF16), p["w"], SIZES,
                              config=int8.Int8Config(recipe))
  want = hand @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
  np.testing.assert_array_equal(out, jax.jit(lambda: want)().astype(jnp.float32))


# ---------------------------------------------------------------------------
# The policy grammar.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, config", [
    ("p=f32,c=bf16,o=f32,m=int8", int8.Int8Config()),
    ("mixed_int8", int8.Int8Config()),
    ("p=f32,c=bf16,o=f32,m=int8_switchback",
     int8.Int8Config("int8_switchback")),
    ("p=f32,c=bf16,o=f32,m=int8(quantize_weight_gradient=false;"
     "stochastic_rounding=true)",
     int8.Int8Config(quantize_weight_gradient=False, stochastic_rounding=True)),
    ("P=F32, C=BF16, O=F32, M=Int8_SwitchBack(Weight_Granularity=Channel)",
     int8.Int8Config("int8_switchback", weight_granularity="channel")),
    ("p=f32,c=f16,o=f32,m=int8(axis_name=(data|fsdp);dim_multiple=32)",
     int8.Int8Config(axis_name=("data", "fsdp"), dim_multiple=32)),
])
def test_grammar_reads_and_round_trips(spec, config):
  policy = jmp_lite.get_policy(spec)
  assert policy.fp8_recipe == config
  again = jmp_lite.get_policy(str(policy))
  assert again == policy and hash(again) == hash(policy)
  assert str(again) == str(policy)


def test_named_spelling_and_object_make_equal_policies():
  base = jmp_lite.get_policy("mixed_bfloat16")
  by_object = base.with_matmul_precision(int8.Int8Config())
  assert by_object == jmp_lite.get_policy("mixed_int8")
  assert str(by_object) == "p=full,c=bf16,o=full,m=int8"
  custom = base.with_matmul_precision(int8.Int8Config(stochastic_rounding=True))
  assert str(custom) == "p=full,c=bf16,o=full,m=int8(stochastic_rounding=true)"
  assert jmp_lite.get_policy(str(custom)) == custom
  assert str(jmp_lite.get_policy("p=f32,c=bf16,o=f32,m=int8(weight_granularity="
                                 "channel)")) == "p=full,c=bf16,o=full,m=int8"


@pytest.mark.parametrize("spec, words", [
    ("int8(foo=1)", ["Unknown field 'foo'", "int8 recipe", "Fields: ",
                     "stochastic_rounding"]),
    ("int8(stochastic_rounding=maybe)",
     ["'stochastic_rounding'", "true or false", "'maybe'",
      "stochastic_rounding=true"]),
    ("int8(weight_granularity=row)",
     ["unknown weight_granularity 'row'", "'channel'", "'tensor'"]),
    ("int8(dim_multiple=x)", ["'dim_multiple'", "whole number"]),
    ("int8(stochastic_rounding=true,include_batched=true)",
     ["separates its fields with ','",
      "'int8(stochastic_rounding=true;include_batched=true)'"]),
    ("int9(a=1)", ["'int9' names no float8, FP4 or int8 recipe",
                   "int8, int8_switchback"]),
    ("int9", ["Unknown matmul precision 'int9'", "int8, int8_switchback",
              "docs/int8.md"]),
])
def test_grammar_errors_teach(spec, words):
  with pytest.raises(ValueError) as info:
    jmp_lite.get_policy(f"p=f32,c=bf16,o=f32,m={spec}")
  for word in words:
    assert word in str(info.value), (word, str(info.value))


def test_an_int8_recipe_needs_a_16_or_32_bit_compute_dtype():
  with pytest.raises(ValueError, match="int8 recipe.*float64.*'mixed_int8'"):
    jmp_lite.get_policy("p=f64,c=f64,o=f64,m=int8")
  with pytest.raises(ValueError, match="int8 recipe.*mixed_int8"):
    jmp_lite.Policy(jnp.float64, jnp.float64, jnp.float64,
                    matmul_precision=int8.Int8Config())


def test_the_messages_name_int8():
  with pytest.raises(ValueError, match="is an int8 recipe"):
    jmp_lite.in_float32(lambda x: x, matmul_precision="int8")
  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32,m=int8(dim_multiple=32)")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    policy.cast_to_compute(jnp.ones(2))
  assert any("not in int8 (int8(dim_multiple=32))" in str(w.message)
             for w in caught), [str(w.message) for w in caught]
