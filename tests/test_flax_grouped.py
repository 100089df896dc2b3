"""The Flax policies and a module's own grouped matmuls (jax.lax.ragged_dot)
under float8/FP4 recipes: Flax has no ragged_dot hook, so the policies run
them in the compute dtype and say so (a warning naming the fix: autocast the
apply, or call fp8_ragged_dot/fp4_ragged_dot); autocast of the same apply
quantizes them."""

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


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_linen_policy_says_the_grouped_matmuls_stay_out_of_its_recipe(recipe):
  model = jlinen.apply_policy(LinenMoE(), f"p=f32,c=bf16,o=f32,m={recipe}")
  with pytest.warns(UserWarning, match=r"ragged_dot \(1 grouped matmul") as got:
    variables = model.init(jax.random.key(0), X, SIZES)
  message = str(got[0].message)
  assert "jmp_lite.autocast(model.apply" in message and "fp8_ragged_dot" in message
  ops = jmp_lite.op_dtypes(model.apply, variables, X, SIZES)
  assert [d for op, d in ops if op == "ragged_dot_general"] == [
      ("bfloat16", "bfloat16")]
  # The fix it names: autocast of the unmodified model's apply.
  plain = LinenMoE()
  fixed = jmp_lite.op_dtypes(
      jmp_lite.autocast(plain.apply, f"p=f32,c=bf16,o=f32,m={recipe}"),
      plain.init(jax.random.key(0), X, SIZES), X, SIZES)
  grouped = [d for op, d in fixed if op == "ragged_dot_general"]
  assert grouped and ("bfloat16", "bfloat16") not in grouped


def test_nnx_policy_says_the_grouped_matmuls_stay_out_of_its_recipe():
  module = jnnx.apply_policy(NnxMoE(nnx.Rngs(0)), "p=f32,c=bf16,o=f32,m=fp8")
  with pytest.warns(UserWarning, match=r"jmp_lite\.nnx: .*ragged_dot"):
    out = module(X, SIZES)
  assert out.dtype == jnp.float32


def test_no_warning_without_a_recipe_or_without_ragged_dot(recwarn):
  model = jlinen.apply_policy(LinenMoE(), "mixed_bfloat16")
  model.init(jax.random.key(0), X, SIZES)
  dense = jlinen.apply_policy(nn.Dense(F), "p=f32,c=bf16,o=f32,m=fp8")
  dense.init(jax.random.key(0), X)
  assert not [w for w in recwarn if "ragged_dot" in str(w.message)]
