"""FP4 recipes through every route (issue 29 items 1-3): ``with_policy``,
``autocast``, linen and NNX run a policy's ``m=nvfp4`` / ``m=mxfp4`` matmuls
as :func:`jmp_lite.fp4.dot_general`, bit for bit, with float8's
exclusions (the head, batched products, dimensions not multiples of the block
size), the late forward switch, the bf16 keep-list through ``ModuleRules``,
and the CUDA program's block-scaled dot on E2M1 operands."""

from __future__ import annotations

import logging

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import fp4
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx
from jmp_lite._src.low_precision import fp4_matmul
from helpers import default_run_keeps

_DN = (((1,), (0,)), ((), ()))
_BF16 = jnp.bfloat16


def _normal(seed, shape, scale=1.0):
  return jnp.asarray(
      np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _mlp(params, x):
  h = jnp.tanh(x @ params["w1"])
  return h @ params["w2"]          # the output head


def _params():
  return {"w1": _normal(1, (32, 32), 0.2), "w2": _normal(2, (32, 16), 0.2)}


def _reference(params, x, config):
  """The policy's program written by hand: bf16 operands, the hidden matmul
  in FP4 (key=None, as the routes pass), the head as written."""
  p = jax.tree.map(lambda a: a.astype(_BF16), params)
  h = jnp.tanh(fp4.dot_general(x.astype(_BF16), p["w1"], _DN,
                                   config=config))
  return (h @ p["w2"]).astype(jnp.float32)


#: The reference compiled (one program per config, shared by the tests).
_jitted_reference = jax.jit(_reference, static_argnums=2)


def _fp4_ops(ops):
  """The block-scaled products op_dtypes lists (E2M1 operands; the call
  into JAX's wrapper function not counted)."""
  return [o for o in ops if "float4_e2m1fn" in o[1] and o[0] != "jit"]


@pytest.mark.parametrize("recipe", default_run_keeps(fp4_matmul.FP4_RECIPES))
def test_with_policy_runs_fp4_bit_for_bit(recipe):
  params, x = _params(), _normal(0, (8, 32))
  spec = f"p=f32,c=bf16,o=f32,m={recipe}"
  fn = jmp_lite.with_policy(_mlp, spec)
  config = fp4.Fp4Config(recipe)
  # Both compiled: XLA:CPU keeps a bf16 dot's float32 result where a
  # convert back to float32 follows, in both programs alike.
  np.testing.assert_array_equal(
      jax.jit(fn)(params, x), _jitted_reference(params, x, config))
  # The gradient: the FP4 backward pass, its SR bits derived from the
  # gradient (key=None: routes hold no PRNG key).
  loss = lambda f: lambda p: jnp.sum(f(p, x) ** 2)
  got = jax.jit(jax.grad(loss(fn)))(params)
  want = jax.jit(jax.grad(loss(lambda p, x: _reference(p, x, config))))(
      params)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  ops = jmp_lite.op_dtypes(fn, params, x)
  assert len(_fp4_ops(ops)) == 1
  assert any("output head" in str(o) for o in ops)


def test_autocast_runs_fp4():
  params, x = _params(), _normal(0, (8, 32))
  fn = jmp_lite.autocast(_mlp, "p=f32,c=bf16,o=f32,m=nvfp4")
  ops = jmp_lite.op_dtypes(fn, params, x)
  assert len(_fp4_ops(ops)) == 1
  assert any("output head" in str(o) for o in ops)
  y = jax.jit(fn)(params, x)
  assert jnp.all(jnp.isfinite(y))
  np.testing.assert_allclose(
      np.asarray(y, np.float32),
      np.asarray(_jitted_reference(params, x, fp4.Fp4Config()), np.float32),
      rtol=0.05, atol=0.05)


@pytest.mark.parametrize("spec, shapes, reason", [
    # K = 24 is not a multiple of NVFP4's 16-element blocks.
    ("nvfp4", ((8, 24), (24, 32)), "dims not multiple of 16: K=24"),
    # MXFP4 blocks are 32 elements: K = N = 16 stays out.
    ("mxfp4", ((8, 16), (16, 16)), "dims not multiple of 32: K=16, N=16"),
    (None, ((8, 32), (32, 32)), None),
    # dim_multiple=1 admits every shape (fp4.dot_general pads K).
    ("nvfp4(dim_multiple=1)", ((8, 24), (24, 32)), None),
])
def test_dimension_rule(spec, shapes, reason):
  spec = spec or "nvfp4"
  a, b = _normal(3, shapes[0]), _normal(4, shapes[1])
  f = lambda a, b, c: jnp.tanh(a @ b) @ c   # the second product is the head
  c = _normal(5, (shapes[1][1], 16))
  ops = jmp_lite.op_dtypes(
      jmp_lite.with_policy(f, f"p=f32,c=bf16,o=f32,m={spec}"), a, b, c)
  notes = [getattr(o, "note", None) for o in ops if o[0] == "dot_general"]
  if reason is None:
    assert len(_fp4_ops(ops)) == 1
  else:
    assert not _fp4_ops(ops)
    assert reason in notes, notes


def test_batched_products_stay_out_unless_included():
  q, k = _normal(6, (2, 16, 32)), _normal(7, (2, 16, 32))
  w, head = _normal(8, (32, 32)), _normal(9, (16, 16))
  f = lambda q, k, w, head: jnp.einsum("bqd,bkd->bqk", q @ w, k) @ head
  out = jmp_lite.op_dtypes(
      jmp_lite.with_policy(f, "p=f32,c=bf16,o=f32,m=nvfp4"), q, k, w, head)
  assert any("batched matmul (include_batched=False)" in str(o) for o in out)
  assert any("output head" in str(o) for o in out)
  assert len(_fp4_ops(out)) == 1            # q @ w only
  out = jmp_lite.op_dtypes(jmp_lite.with_policy(
      f, "p=f32,c=bf16,o=f32,m=nvfp4(include_batched=true)"), q, k, w, head)
  assert len(_fp4_ops(out)) == 2            # and the scores'
  assert any("output head" in str(o) for o in out)


def test_late_switch_through_the_policy():
  """m=nvfp4(quantize_forward=false): the forward product as given (bf16
  operands, float32 accumulation), the backward pass still FP4 (gradients
  bit-identical to m=nvfp4's); switching is one compile per policy."""
  x, w = _normal(0, (8, 32)), _normal(1, (32, 16), 0.2)
  c = _normal(2, (8, 16))
  f = lambda w, x: x @ w
  late = "p=f32,c=bf16,o=f32,m=nvfp4(quantize_forward=false;include_output_head=true)"
  early = "p=f32,c=bf16,o=f32,m=nvfp4(include_output_head=true)"
  y = jmp_lite.with_policy(f, late)(w, x)
  want = jax.lax.dot_general(x.astype(_BF16), w.astype(_BF16), _DN,
                             preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(y, want.astype(_BF16).astype(jnp.float32))
  # Jitted (the forward above runs with_policy eagerly; the FP4 backward
  # pass runs eagerly in test_fp4_matmul's test_finite_inputs_...).
  grad = jax.jit(jax.grad(lambda w, s: jnp.sum(
      jmp_lite.with_policy(f, s)(w, x) * c)), static_argnums=1)
  grads = [grad(w, s) for s in (late, early)]
  np.testing.assert_array_equal(*grads)

  calls = []

  def run(w, x, spec):
    calls.append(spec)
    return jmp_lite.with_policy(f, spec)(w, x)

  jitted = jax.jit(run, static_argnums=2)
  for spec in (early, early, late, late, early):
    jitted(w, x, spec)
  assert len(calls) == 2            # one trace per policy, none per step


class _Net(nn.Module):
  """Four residual blocks and a head."""

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = x + nn.Dense(32, name=f"blocks_{i}")(x)
    return nn.Dense(16, name="head")(x)


def test_linen_keeps_the_last_blocks_in_bf16_by_path():
  """docs/fp4.md's keep-list: ModuleRules by path keeps blocks 2-3 in bf16
  while 0-1 run NVFP4 through Dense's dot_general hook, bit for bit."""
  x = _normal(0, (8, 32))
  rules = jlinen.ModuleRules(
      ("blocks_[2-3]", "p=f32,c=bf16,o=bf16")) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(_Net(), "mixed_nvfp4", module_rules=rules)
  variables = model.init(jax.random.key(0), x)
  y = jax.jit(model.apply)(variables, x)

  @jax.jit  # compiled, as the model (the eager route: model.init above)
  def reference(params, x):
    p = jax.tree.map(lambda a: a.astype(_BF16), params)
    h = x.astype(_BF16)
    for i in range(4):
      w, b = p[f"blocks_{i}"]["kernel"], p[f"blocks_{i}"]["bias"]
      d = fp4.dot_general(h, w, _DN) if i < 2 else h @ w
      h = h + (d + b)
    return (h @ p["head"]["kernel"] + p["head"]["bias"]).astype(jnp.float32)

  np.testing.assert_array_equal(y, reference(variables["params"], x))
  ops = jmp_lite.op_dtypes(model.apply, variables, x)
  assert len(_fp4_ops(ops)) == 2
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(
      variables)  # the eager route: model.init above
  assert all(jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("spec,name", [("nvfp4", "NVFP4"), ("mxfp4", "MXFP4"),
                                       ("fp8", "float8")])
def test_fallback_records_name_the_recipes_format(spec, name, caplog):
  """The debug record of a product a recipe leaves out names the recipe's
  format, through the autocast interpreter (with_policy: the head) and the
  linen hook (an own dot_general)."""
  policy = f"p=f32,c=bf16,o=f32,m={spec}"
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
    assert any(f"stays out of {name}: " in m and reason in m
               for m in messages), messages
  other = {"NVFP4": "float8", "MXFP4": "float8", "float8": "FP4"}[name]
  assert not any(f"stays out of {other}" in m for m in messages), messages


def test_nnx_runs_mxfp4():
  rngs = nnx.Rngs(0)
  module = nnx.Sequential(nnx.Linear(32, 32, rngs=rngs),
                          nnx.Linear(32, 16, rngs=rngs))
  model = jnnx.apply_policy(module, "p=f32,c=bf16,o=f32,m=mxfp4")
  x = _normal(0, (8, 32))
  y = model(x)
  l0, l1 = module.layers
  k0, b0 = l0.kernel[...].astype(_BF16), l0.bias[...].astype(_BF16)
  k1, b1 = l1.kernel[...].astype(_BF16), l1.bias[...].astype(_BF16)
  h = fp4.dot_general(x.astype(_BF16), k0, _DN,
                          config=fp4.Fp4Config("mxfp4")) + b0
  want = (h @ k1 + b1).astype(jnp.float32)   # the head stays as written
  np.testing.assert_array_equal(y, want)


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11),
    reason="jax < 0.11 lowers no block-scaled dot for CUDA")
@pytest.mark.parametrize("recipe, scale", [("nvfp4", "f8E4M3FN"),
                                           ("mxfp4", "f8E8M0FNU")])
def test_cuda_program_through_a_route(recipe, scale):
  """with_policy(f, 'p=f32,c=bf16,o=f32,m=...'), exported for CUDA: E2M1
  operands with their block scales reach the block-scaled dot, forward and
  backward."""
  params, x = _params(), _normal(0, (8, 32))
  fn = jmp_lite.with_policy(_mlp, f"p=f32,c=bf16,o=f32,m={recipe}")
  check = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
  for g in (fn, jax.grad(lambda p, x: jnp.sum(fn(p, x))),):
    text = jax.export.export(jax.jit(g), platforms=["cuda"],
                             disabled_checks=check)(params, x).mlir_module()
    assert "__op$block_scaled_dot" in text
    assert "f4E2M1FN" in text and scale in text
    assert "host_callback" not in text and "callback" not in text


def test_cast_to_compute_says_fp4_does_not_apply():
  """A jmp-API client that only casts gets no FP4 and is told so."""
  policy = jmp_lite.get_policy(
      "p=f32,c=bf16,o=f32,m=nvfp4(native=false;include_batched=true)")
  with pytest.warns(UserWarning, match=r"not in FP4 \(nvfp4\(native=false"):
    policy.cast_to_compute(jnp.ones(2))


def test_nnx_keeps_blocks_in_bf16_by_path():
  """The NNX keep-list: a path rule of jmp_lite.nnx.ModuleRules."""
  rngs = nnx.Rngs(0)
  module = nnx.Sequential(*[nnx.Linear(32, 32, rngs=rngs) for _ in range(4)],
                          nnx.Linear(32, 16, rngs=rngs))
  rules = jnnx.ModuleRules(
      ("layers/[2-3]", "p=f32,c=bf16,o=bf16")) + jnnx.DEFAULT_MODULE_RULES
  model = jnnx.apply_policy(module, "mixed_nvfp4", module_rules=rules)
  policies = {k: str(v) for k, v in model.module_policies().items()}
  assert policies["layers/1"].endswith("m=nvfp4")
  assert "m=" not in policies["layers/2"] and "m=" not in policies["layers/3"]
  graph, state = nnx.split(model)
  ops = jmp_lite.op_dtypes(lambda s, x: nnx.merge(graph, s)(x), state,
                           jnp.ones((8, 32)))
  assert len(_fp4_ops(ops)) == 2       # layers 0-1; layers/4 is the head


_UPGRADE_FLAGS = ("jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")


@pytest.fixture
def upgrade_flags():
  """JAX's upgrade flags on where this jax has them (jax 0.12), restored."""
  old = {f: getattr(jax.config, f) for f in _UPGRADE_FLAGS
         if hasattr(jax.config, f)}
  for flag in old:
    jax.config.update(flag, True)
  yield
  for flag, value in old.items():
    jax.config.update(flag, value)


def test_fp4_inside_scan_and_remat(upgrade_flags):
  """with_policy enters scan and checkpoint: the FP4 products inside equal
  the unrolled hand-written program, and gradients flow (under the upgrade
  flags where this jax has them)."""
  del upgrade_flags
  ws, x = _normal(0, (3, 32, 32), 0.2), _normal(1, (8, 32))
  head = jnp.ones((32, 16))

  def f(ws, x):
    def body(h, w):
      return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w), None
    h, _ = jax.lax.scan(body, x, ws)
    return h @ head.astype(h.dtype)

  def ref(ws, x):
    h = x.astype(_BF16)
    for i in range(3):
      h = jnp.tanh(fp4.dot_general(h, ws[i].astype(_BF16), _DN))
    return (h @ head.astype(_BF16)).astype(jnp.float32)

  fn = jmp_lite.with_policy(f, "p=f32,c=bf16,o=f32,m=nvfp4")
  np.testing.assert_array_equal(jax.jit(fn)(ws, x), jax.jit(ref)(ws, x))
  grads = jax.jit(jax.grad(lambda ws: fn(ws, x).sum()))(ws)
  assert bool(jnp.all(jnp.isfinite(grads))) and bool(jnp.any(grads != 0))
