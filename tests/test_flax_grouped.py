"""The Flax policies and a module's own grouped matmuls (jax.lax.ragged_dot)
under float8/FP4 recipes. Flax has no ragged_dot hook: the linen policies
run a model that calls one through autocast's interpreter with the grouped
rule only, each module's call marked with its recipe, so the experts run in
the recipe of their module (per-module rules too); so do the NNX policies,
each rule-matched module's call marked with its recipe and the call run as a
pure function of the model's state."""

import dataclasses
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import pytest

import jmp_lite
import jmp_lite.fp4
import jmp_lite.fp8
from jmp_lite import int8
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx
from jmp_lite._src import compat
from jmp_lite._src.flax import float8 as float8_lib
from helpers import default_run_keeps

E, D, F = 4, 32, 32
X = jax.random.normal(jax.random.key(1), (16, D))
SIZES = jnp.array([4, 4, 0, 8], jnp.int32)


class LinenMoE(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param("w", nn.initializers.normal(0.1), (E, D, F))
    return nn.Dense(F)(jax.lax.ragged_dot(x, w, sizes))


class NnxMoE(nnx.Module):

  def __init__(self, rngs, grouped=jax.lax.ragged_dot):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, F)) * 0.1)
    self.out = nnx.Linear(F, F, rngs=rngs)
    self.grouped = grouped   # a hand-written module: the recipe's own

  def __call__(self, x, sizes):
    return self.out(self.grouped(x, self.w[...], sizes))


class Experts(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param("w", nn.initializers.normal(0.1), (E, D, F))
    return jax.lax.ragged_dot(x, w, sizes)


class TwoPart(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    return nn.Dense(F, name="out")(Experts(name="experts")(x, sizes))


def _grouped_dtypes(fn, *args):
  return [d for op, d in jmp_lite.op_dtypes(fn, *args)
          if op == "ragged_dot_general"]


@pytest.mark.parametrize("recipe,expected", default_run_keeps([
    ("fp8", ("float8_e4m3fn", "float8_e4m3fn")),
    ("nvfp4", ("float32", "float32")),    # NVFP4's exact float32 emulation
    ("int8", ("int8", "int8"))], unpack=True))
def test_linen_policy_runs_a_module_s_ragged_dot_in_its_recipe(recipe, expected):
  spec = f"p=f32,c=bf16,o=f32,m={recipe}"
  model = jlinen.apply_policy(LinenMoE(), spec)
  variables = model.init(jax.random.key(0), X, SIZES)
  assert _grouped_dtypes(model.apply, variables, X, SIZES) == [expected]
  # The same numbers as autocast of the model written by hand around the
  # recipe's grouped matmul (both: bf16 operands, the recipe, bf16 output).
  out = jax.jit(model.apply)(variables, X, SIZES)
  assert out.dtype == jnp.float32
  w = variables["params"]["w"].astype(jnp.bfloat16)
  config = jmp_lite.get_policy(spec).fp8_recipe
  from jmp_lite._src.low_precision import recipe_matmuls  # pylint: disable=g-import-not-at-top
  hand = recipe_matmuls.recipe_ragged_dot(X.astype(jnp.bfloat16), w, SIZES,
                                       config=config,
                                       preferred_element_type=jnp.bfloat16)
  dense = variables["params"]["Dense_0"]
  want = (hand @ dense["kernel"].astype(jnp.bfloat16)
          + dense["bias"].astype(jnp.bfloat16))
  assert jnp.allclose(out, want.astype(jnp.float32), rtol=2e-2, atol=2e-2)
  grads = jax.grad(lambda p: model.apply({"params": p}, X, SIZES).sum())(
      variables["params"])
  assert grads["w"].dtype == jnp.float32
  assert bool(jnp.isfinite(grads["w"]).all()) and (grads["w"][2] == 0).all()


def test_linen_module_rules_choose_each_module_s_recipe():
  spec = "p=f32,c=bf16,o=f32,m=fp8"
  quantized = jlinen.apply_policy(TwoPart(), spec)
  variables = quantized.init(jax.random.key(0), X, SIZES)
  assert _grouped_dtypes(quantized.apply, variables, X, SIZES) == [
      ("float8_e4m3fn", "float8_e4m3fn")]
  kept = jlinen.apply_policy(TwoPart(), spec, module_rules=jlinen.ModuleRules(
      ("experts", "p=f32,c=bf16,o=bf16")))
  assert _grouped_dtypes(kept.apply, variables, X, SIZES) == [
      ("bfloat16", "bfloat16")]


def _by_hand(spec):
  """The recipe's grouped matmul of ``spec``, called by hand (delayed
  recipes: current scaling, as the policies scale grouped matmuls)."""
  config = jmp_lite.get_policy(spec).fp8_recipe
  if config.scaling == "delayed":
    config = dataclasses.replace(config, scaling="current",
                                 history_length=None, margin=0.0,
                                 amax_algorithm=None)
  if isinstance(config, jmp_lite.fp4.Fp4Config):
    return lambda x, w, s: jmp_lite.fp4.ragged_dot(x, w, s, config=config)
  if isinstance(config, int8.Int8Config):
    return lambda x, w, s: int8.ragged_dot(x, w, s, config=config)
  return lambda x, w, s: jmp_lite.fp8.ragged_dot(x, w, s, config=config)


def _ragged_operands(closed):
  return [tuple(str(v.aval.dtype) for v in eqn.invars[:2])
          for eqn in compat.walk_eqns(closed)
          if eqn.primitive.name == "ragged_dot_general"]


@pytest.mark.parametrize("recipe,expected", default_run_keeps([
    ("fp8_rowwise", ("float8_e4m3fn", "float8_e4m3fn")),
    ("nvfp4", ("float32", "float32")),   # NVFP4's exact float32 emulation
    ("mxfp8", ("float32", "float32")),   # MXFP8's emulation (dequantized)
    ("int8", ("int8", "int8")),
    ("int8_switchback", ("int8", "int8"))], unpack=True))
def test_nnx_policy_runs_a_module_s_ragged_dot_in_its_recipe(recipe, expected):
  spec = f"p=f32,c=bf16,o=f32,m={recipe}"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning: the recipe runs
    model = jnnx.apply_policy(NnxMoE(nnx.Rngs(0)), spec)
    hand = jnnx.apply_policy(NnxMoE(nnx.Rngs(0), _by_hand(spec)), spec)
    assert _grouped_dtypes(lambda x: model(x, SIZES), X) == [expected]
    # The same numbers, forward and backward (dx, dw), as the module written
    # by hand around the recipe's grouped matmul: bit for bit, under jit.
    call = nnx.jit(lambda m, x: m(x, SIZES))
    out = call(model, X)
    assert out.dtype == jnp.float32
    assert (out == call(hand, X)).all()
    loss = nnx.jit(nnx.grad(lambda m, x: (m(x, SIZES) ** 2).sum(),
                            argnums=(0, 1)))
    (grads, dx), (hand_grads, hand_dx) = loss(model, X), loss(hand, X)
  dw = grads["module"]["w"][...]
  assert dw.dtype == jnp.float32 and bool(jnp.isfinite(dw).all())
  assert (dw[2] == 0).all()   # the empty expert
  assert (dw == hand_grads["module"]["w"][...]).all() and (dx == hand_dx).all()
  assert (grads["module"]["out"]["kernel"][...]
          == hand_grads["module"]["out"]["kernel"][...]).all()
  if recipe in ("fp8_rowwise", "int8"):  # forward, dx, dw: 8-bit operands
    closed = jax.make_jaxpr(jax.grad(lambda x: (model(x, SIZES) ** 2).sum()))(X)
    assert _ragged_operands(closed) == [expected] * 3


class NnxTwoPart(nnx.Module):

  def __init__(self, rngs):
    self.experts = NnxExperts(rngs)
    self.shared = NnxExperts(rngs)
    self.out = nnx.Linear(F, F, rngs=rngs)

  def __call__(self, x, sizes):
    return self.out(self.experts(x, sizes) + self.shared(x, sizes))


class NnxExperts(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, F)) * 0.1)

  def __call__(self, x, sizes):
    return jax.lax.ragged_dot(x, self.w[...], sizes)


def test_nnx_module_rules_choose_each_module_s_recipe():
  spec = "p=f32,c=bf16,o=f32,m=fp8_rowwise"
  model = NnxTwoPart(nnx.Rngs(0))
  quantized = jnnx.apply_policy(model, spec)
  assert _grouped_dtypes(lambda x: quantized(x, SIZES), X) == [
      ("float8_e4m3fn", "float8_e4m3fn")] * 2
  # A rule puts one expert layer in bf16: its ragged_dot stays out of the
  # recipe (compute dtype), the other's runs in it.
  kept = jnnx.apply_policy(model, spec, module_rules=jnnx.ModuleRules(
      ("experts", "p=f32,c=bf16,o=bf16")))
  assert _grouped_dtypes(lambda x: kept(x, SIZES), X) == [
      ("bfloat16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn")]
  closed = jax.make_jaxpr(jax.grad(lambda x: kept(x, SIZES).sum()))(X)
  assert sorted(_ragged_operands(closed)) == sorted(
      [("bfloat16", "bfloat16")] * 2 + [("float8_e4m3fn", "float8_e4m3fn")] * 3)
  # A rule giving one layer another recipe (MXFP8's emulation: float32).
  other = jnnx.apply_policy(model, spec, module_rules=jnnx.ModuleRules(
      (NnxExperts, "p=f32,c=bf16,o=bf16,m=mxfp8")))
  assert _grouped_dtypes(lambda x: other(x, SIZES), X) == [
      ("float32", "float32")] * 2
  out = jax.jit(lambda x: kept(x, SIZES))(X)
  assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())


def test_nnx_delayed_recipe_rolls_the_layers_histories_in_the_grouped_route():
  spec = "p=f32,c=bf16,o=f32,m=fp8_delayed(include_output_head=true)"
  model = jnnx.apply_policy(NnxMoE(nnx.Rngs(0)), spec)
  hand = jnnx.apply_policy(NnxMoE(nnx.Rngs(0), _by_hand(spec)), spec)
  step = nnx.jit(lambda m, x: m(x, SIZES))
  for _ in range(2):
    assert (step(model, X) == step(hand, X)).all()
  rolled = model.fp8_state["out"].get_value()
  assert (rolled["lhs"][:2] != 0).all()
  assert all((rolled[k] == hand.fp8_state["out"].get_value()[k]).all()
             for k in ("lhs", "rhs"))
  model.eval()   # frozen: the histories stay
  step(model, X)
  assert (model.fp8_state["out"].get_value()["lhs"] == rolled["lhs"]).all()


class NnxDropoutMoE(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, F)) * 0.1)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, sizes, rngs):
    return self.drop(jax.lax.ragged_dot(x, self.w[...], sizes), rngs=rngs)


def test_nnx_grouped_route_keeps_the_call_s_state():
  # RNG counters of an nnx.Rngs passed in advance, as without the route.
  model = jnnx.apply_policy(NnxDropoutMoE(nnx.Rngs(0)),
                            "p=f32,c=bf16,o=f32,m=fp8_rowwise")
  plain = jnnx.apply_policy(NnxDropoutMoE(nnx.Rngs(0)), "mixed_bfloat16")
  rngs, plain_rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
  first = model(X, SIZES, rngs)
  second = model(X, SIZES, rngs)
  plain(X, SIZES, plain_rngs)
  plain(X, SIZES, plain_rngs)
  assert int(rngs.dropout.count[...]) == int(plain_rngs.dropout.count[...]) == 2
  assert not (first == second).all()   # another dropout mask


def test_nnx_model_without_ragged_dot_is_not_interpreted(monkeypatch):
  calls = []
  real = float8_lib.grouped_in_recipes
  monkeypatch.setattr(float8_lib, "grouped_in_recipes",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  spec = "p=f32,c=bf16,o=f32,m=fp8_rowwise"
  dense = jnnx.apply_policy(nnx.Sequential(
      nnx.Linear(D, F, rngs=nnx.Rngs(0)), nnx.Linear(F, F, rngs=nnx.Rngs(1))),
                            spec)
  jax.jit(lambda x: dense(x))(X)
  assert not calls
  moe = jnnx.apply_policy(NnxMoE(nnx.Rngs(0)), spec)
  moe(X, SIZES)
  assert calls


def test_no_warning_without_a_recipe_or_from_linen(recwarn):
  model = jlinen.apply_policy(LinenMoE(), "mixed_bfloat16")
  model.init(jax.random.key(0), X, SIZES)
  fp8 = jlinen.apply_policy(LinenMoE(), "p=f32,c=bf16,o=f32,m=fp8")
  fp8.apply(fp8.init(jax.random.key(0), X, SIZES), X, SIZES)
  assert not [w for w in recwarn if "ragged_dot" in str(w.message)]
