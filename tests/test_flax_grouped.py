"""The Flax policies and a module's own grouped matmuls (jax.lax.ragged_dot)
under float8/FP4 recipes. Flax has no ragged_dot hook: the linen policies
run a model that calls one through autocast's interpreter with the grouped
rule only, each module's call marked with its recipe, so the experts run in
the recipe of their module (per-module rules too); the NNX policies run them
in the compute dtype and say so (a warning naming the fixes)."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import pytest

import jmp_lite
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx

E, D, F = 4, 32, 32
X = jax.random.normal(jax.random.key(1), (16, D))
SIZES = jnp.array([4, 4, 0, 8], jnp.int32)


class LinenMoE(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param("w", nn.initializers.normal(0.1), (E, D, F))
    return nn.Dense(F)(jax.lax.ragged_dot(x, w, sizes))


class NnxMoE(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, F)) * 0.1)
    self.out = nnx.Linear(F, F, rngs=rngs)

  def __call__(self, x, sizes):
    return self.out(jax.lax.ragged_dot(x, self.w[...], sizes))


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


@pytest.mark.parametrize("recipe,expected", [
    ("fp8", ("float8_e4m3fn", "float8_e4m3fn")),
    ("nvfp4", ("float32", "float32"))])   # NVFP4's exact float32 emulation
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
  from jmp_lite._src.low_precision import fp4_grouped  # pylint: disable=g-import-not-at-top
  hand = fp4_grouped.recipe_ragged_dot(X.astype(jnp.bfloat16), w, SIZES,
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


def test_nnx_policy_says_the_grouped_matmuls_stay_out_of_its_recipe():
  module = jnnx.apply_policy(NnxMoE(nnx.Rngs(0)), "p=f32,c=bf16,o=f32,m=fp8")
  with pytest.warns(UserWarning, match=r"jmp_lite\.nnx: .*ragged_dot"):
    out = module(X, SIZES)
  assert out.dtype == jnp.float32


def test_no_warning_without_a_recipe_or_from_linen(recwarn):
  model = jlinen.apply_policy(LinenMoE(), "mixed_bfloat16")
  model.init(jax.random.key(0), X, SIZES)
  fp8 = jlinen.apply_policy(LinenMoE(), "p=f32,c=bf16,o=f32,m=fp8")
  fp8.apply(fp8.init(jax.random.key(0), X, SIZES), X, SIZES)
  assert not [w for w in recwarn if "ragged_dot" in str(w.message)]
