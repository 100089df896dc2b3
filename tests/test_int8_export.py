"""The programs exported for the hardware (TPU and CUDA): every quantized
matmul is an s8 x s8 -> s32 dot_general (a ragged dot for int8.ragged_dot)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import int8

PLATFORMS = ["tpu", "cuda"]


def _data(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


PARAMS = {"w1": _data((32, 64), 0), "w2": _data((64, 48), 1),
          "w3": _data((48, 16), 2)}
X, Y = _data((8, 32), 3), _data((8, 16), 4)


def mlp(params, x):
  """Two hidden layers (the first's input gradient is not needed, the
  second's is) and the output head."""
  h = jax.nn.relu(x @ params["w1"])
  h = jax.nn.relu(h @ params["w2"])
  return h @ params["w3"]


def loss_fn(params, x, y):
  return jnp.mean((mlp(params, x) - y) ** 2)


def _signatures(text, op):
  """(operand types, result type) of each stablehlo `op` in a module."""
  out = []
  for line in text.splitlines():
    if f"stablehlo.{op} " in line and "->" in line:
      operands, result = line.rsplit(" : ", 1)[1].split("->")
      out.append((operands.strip(), result.split(" loc")[0].strip()))
  return out


def _exported(step, args, platform):
  exp = jax.export.export(jax.jit(step), platforms=[platform])(*args)
  text = exp.mlir_module()
  assert "custom_call" not in text and "callback" not in text
  return text


def _is_int8_dot(sig):
  operands, result = sig
  return operands.count("xi8>") == 2 and result.endswith("xi32>")


@pytest.mark.parametrize("wrap", ["autocast", "with_policy"])
@pytest.mark.parametrize("recipe", ["int8", "int8_switchback"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_train_step_exports_int8_dots(platform, recipe, wrap):
  wrapper = jmp_lite.autocast if wrap == "autocast" else jmp_lite.with_policy
  f = wrapper(loss_fn, f"p=f32,c=bf16,o=f32,m={recipe}")
  step = jax.value_and_grad(f)
  dots = _signatures(_exported(step, (PARAMS, X, Y), platform),
                     "dot_general")
  int8_dots = [d for d in dots if _is_int8_dot(d)]
  other = [d for d in dots if not _is_int8_dot(d)]
  # Nothing else takes int8 (no s8 x bf16 or s8 -> f32 product).
  assert not any("i8>" in o or "i32>" in r for o, r in other), other
  # Two quantized layers: their forwards (the canonical (B, M, K) x
  # (B, N, K)), the second's input gradient (g (B, M, N) x the weight
  # (B, N, K), contracting N = 48 in place; the first's is not needed),
  # their weight gradients (g x the activation, contracting the 8 tokens
  # in place: no transposed copies).
  sig = lambda a, b, r: (f"(tensor<1x{a}xi8>, tensor<1x{b}xi8>)",
                         f"tensor<1x{r}xi32>")
  forward_and_dx = [sig("8x32", "64x32", "8x64"),     # layer 1 forward
                    sig("8x64", "48x64", "8x48"),     # layer 2 forward
                    sig("8x48", "48x64", "8x64")]     # layer 2 dx
  wgrads = [sig("8x64", "8x32", "64x32"), sig("8x48", "8x64", "48x64")]
  # The head stays bfloat16 (excluded by default): its forward, input
  # gradient and weight gradient, nothing int8.
  head = [(o, r) for o, r in other if "16xbf16>" in o]
  assert len(head) == 3 and all(o.count("bf16") == 2 for o, _ in head), (
      other)
  if recipe == "int8":
    assert sorted(int8_dots) == sorted(forward_and_dx + wgrads), int8_dots
    assert len(other) == 3, other              # the head only
  else:
    # SwitchBack: the weight gradients in the compute dtype, bf16 x bf16
    # -> f32 (contracting the 8 tokens).
    assert sorted(int8_dots) == sorted(forward_and_dx), int8_dots
    switchback = [("(tensor<1x8x64xbf16>, tensor<1x8x32xbf16>)",
                   "tensor<1x64x32xf32>"),
                  ("(tensor<1x8x48xbf16>, tensor<1x8x64xbf16>)",
                   "tensor<1x48x64xf32>")]
    assert sorted(o for o in other if o not in head) == sorted(switchback), (
        other)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_output_head_opt_in(platform):
  config = int8.Int8Config(include_output_head=True)
  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32").with_matmul_precision(
      config)
  step = jax.grad(jmp_lite.autocast(loss_fn, policy))
  dots = _signatures(_exported(step, (PARAMS, X, Y), platform),
                     "dot_general")
  assert all(_is_int8_dot(d) for d in dots), dots
  assert len(dots) == 8     # 3 forwards, 2 input gradients, 3 weight grads


@pytest.mark.parametrize("recipe", ["int8", "int8_switchback"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_ragged_dot_exports_int8(platform, recipe):
  """The exported program holds the grouped products as chlo.ragged_dot
  composites (with their dot_general expansion as the decomposition) on
  int8 operands with int32 results: forward, input gradient and (int8
  recipe) weight gradient."""
  config = int8.Int8Config(recipe)
  sizes = jnp.asarray((4, 0, 8), jnp.int32)
  x, w = _data((12, 32), 5), _data((3, 32, 16), 6)

  def loss(x, w):
    return jnp.sum(int8.ragged_dot(x, w, sizes, config=config) ** 2)

  text = _exported(jax.value_and_grad(loss, argnums=(0, 1)), (x, w),
                   platform)
  composites = [line for line in text.splitlines()
                if 'stablehlo.composite "chlo.ragged_dot"' in line]
  sigs = [re.search(r" : \((.*)\) -> (\S+)", line).groups()
          for line in composites]
  int8_sigs = [s for s in sigs if s[0].count("xi8>") == 2
               and s[1].endswith("xi32>")]
  expected = 3 if recipe == "int8" else 2
  assert len(int8_sigs) == expected, sigs
  # The expert weights' layout in the composite ([G, N, K] or [G, K, N])
  # is JAX's choice (jax 0.10.0 and 0.10.2 differ); the operands' and the
  # result's types are the claim.
  experts = ("tensor<3x16x32xi8>", "tensor<3x32x16xi8>")
  forward = [s for s in int8_sigs if s[0].startswith("tensor<12x32xi8>")
             and s[1] == "tensor<12x16xi32>"]
  dx = [s for s in int8_sigs if s[0].startswith("tensor<12x16xi8>")
        and s[1] == "tensor<12x32xi32>"]
  for found in (forward, dx):
    assert len(found) == 1 and found[0][0].split(", ")[1] in experts, sigs
  if recipe == "int8_switchback":
    # The weight gradient in float32 (the operands' dtype here).
    assert len(sigs) == 3
    assert [s for s in sigs if s not in int8_sigs][0][1] == (
        "tensor<3x16x32xf32>")
  # The decompositions: dot_generals of int8 operands into int32.
  dots = _signatures(text, "dot_general")
  assert dots and all(_is_int8_dot(d) or recipe == "int8_switchback"
                      for d in dots)
  assert sum(_is_int8_dot(d) for d in dots) >= expected
