"""Fp8Config(fsdp_axis=...) and Int8Config(fsdp_axis=...): the FSDP weight
all-gather of a float8 (int8) matmul moves the quantized shard's 1-byte
values (as uint8 bits) and its scales, never a wider copy of the weight; the
step equals the unsharded quantized one."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jmp_lite
import jmp_lite.int8
from jmp_lite import fp8
from helpers import default_run_keeps

N = 8
WIDTH, BATCH = 256, 512       # the batch larger than a weight: XLA then
                              # keeps the activations sharded (FSDP's pattern)
RECIPES = ["fp8", "fp8_rowwise", "fp8_blockwise", "mxfp8"]
_BYTES = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "u16": 2, "f16": 2,
          "bf16": 2, "u32": 4, "s32": 4, "f32": 4, "pred": 1}


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((N,), ("fsdp",), axis_types=(axis_type,))


def _policy(recipe, fsdp=True):
  fields = ["include_output_head=true"] + (["fsdp_axis=fsdp"] if fsdp else [])
  return f"p=f32,c=bf16,o=f32,m={recipe}({';'.join(fields)})"


def _params(seed=0, layers=2):
  keys = jax.random.split(jax.random.key(seed), layers + 1)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5
            for k in keys[:-1]]
  return params, jax.random.normal(keys[-1], (BATCH, WIDTH))


def _loss(params, x):
  for w in params[:-1]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x @ params[-1]) ** 2)


def _sharded(mesh, params, x):
  return (jax.device_put(params, NamedSharding(mesh, P("fsdp", None))),
          jax.device_put(x, NamedSharding(mesh, P("fsdp"))))


def _gathers(hlo):
  """(element type, elements) of every all-gather of a compiled program."""
  out = []
  for m in re.finditer(r"= (\(.*?\)|\S+) all-gather\(", hlo):
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1)):
      out.append((dtype, int(np.prod([int(d) for d in dims.split(",") if d]))))
  return out


def _compiled(recipe, fsdp, axis_type=AxisType.Auto, layers=2):
  mesh = _mesh(axis_type)
  step = jax.jit(jax.value_and_grad(jmp_lite.with_policy(
      _loss, _policy(recipe, fsdp))))
  with jax.set_mesh(mesh):
    return step.lower(*_sharded(mesh, *_params(layers=layers))).compile(
    ).as_text()


@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_compiled_weight_gather_is_one_byte(recipe):
  gathers = _gathers(_compiled(recipe, fsdp=True))
  weight = WIDTH * WIDTH
  values = [g for g in gathers if g == ("u8", weight)]
  # Forward: both weights; backward: per tensor the gathered weights are
  # reused, the other recipes gather the requantized transposed weight of
  # each layer whose input gradient is needed (the second one: 1).
  assert len(values) == (2 if recipe == "fp8" else 3), gathers
  wide = [g for g in gathers if _BYTES[g[0]] > 1 and g[1] * 16 > weight]
  assert not wide, gathers                    # no wide gather of a weight
  assert {t for t, _ in gathers} <= {"u8", "u32"}, gathers   # scales: bits
  assert all(n * 16 <= weight for t, n in gathers if t == "u32"), gathers


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise", "mxfp8"])
def test_without_fsdp_axis_the_weight_gather_is_wider(recipe):
  # What XLA's partitioning does by itself: XLA:CPU widens a float8
  # all-gather to float16 (fp8, fp8_rowwise), or it gathers the float32
  # weight (mxfp8); the difference fsdp_axis makes.
  gathers = _gathers(_compiled(recipe, fsdp=False))
  weight = WIDTH * WIDTH
  assert not [g for g in gathers if g == ("u8", weight)], gathers
  assert [g for g in gathers if g[0] in ("f16", "f32") and g[1] == weight], (
      gathers)


def test_explicit_axes_gather_one_byte():
  # jax.make_mesh's default axis type: the matmul runs inside auto_axes.
  gathers = _gathers(_compiled("fp8", fsdp=True, axis_type=AxisType.Explicit))
  assert [g for g in gathers if g == ("u8", WIDTH * WIDTH)], gathers
  assert {t for t, _ in gathers} <= {"u8", "u32"}, gathers


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_then_gather_equals_gather_then_quantize(recipe):
  # The matmul gathers each shard quantized with the scales every shard
  # shares: its forward equals the unsharded float8 forward bit for bit.
  mesh = _mesh()
  params, x = _params()
  config = jmp_lite.get_policy(_policy(recipe)).fp8_recipe
  plain = dataclasses.replace(config, fsdp_axis=None)
  dn = (((1,), (0,)), ((), ()))
  fn = lambda c: jax.jit(lambda w, x: fp8.dot_general(x, w, dn, config=c))
  want = fn(plain)(params[0], x)
  with jax.set_mesh(mesh):
    ps, xs = _sharded(mesh, params, x)
    got = fn(config)(ps[0], xs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_loss_and_gradients_equal_unsharded(recipe):
  params, x = _params()
  grad = lambda spec: jax.jit(jax.value_and_grad(
      jmp_lite.with_policy(_loss, spec)))
  want_loss, want = grad(_policy(recipe, fsdp=False))(params, x)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got_loss, got = grad(_policy(recipe))(*_sharded(mesh, params, x))
  assert got_loss == want_loss
  for g, w in zip(got, want):
    # The weight gradient contracts over the sharded batch: XLA sums the
    # devices' partial products (an all-reduce) in another order than one
    # device's dot, and the gradient is rounded to the compute dtype
    # (bfloat16) after it: equal up to one bfloat16 rounding (per tensor,
    # rowwise and MX are bit for bit or within float32 rounding here).
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2**-7,
                               atol=1e-6 * float(jnp.abs(w).max()))


@pytest.mark.standard_promotion
@pytest.mark.parametrize("recipe", default_run_keeps(["fp8", "fp8_rowwise"]))
def test_ten_adam_steps_equal_unsharded(recipe):
  params, x = _params(layers=3)
  opt = optax.adam(1e-3)

  def run(spec, params, x):
    loss = jmp_lite.with_policy(_loss, spec)

    @jax.jit
    def step(params, state, x):
      value, grads = jax.value_and_grad(loss)(params, x)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value

    state, losses = opt.init(params), []
    for _ in range(10):
      params, state, value = step(params, state, x)
      losses.append(float(value))
    return np.array(losses)

  want = run(_policy(recipe, fsdp=False), params, x)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got = run(_policy(recipe), *_sharded(mesh, params, x))
  # The losses of the first step are equal bit for bit; later ones follow
  # weights updated from gradients summed across devices in another order
  # (float32 rounding), and Adam's normalised step carries that on.
  assert got[0] == want[0]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cuda_export_constrains_uint8_weight_replicated():
  mesh = _mesh()
  ws, bs = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P("fsdp"))
  grad = jax.value_and_grad(jmp_lite.with_policy(_loss, _policy("fp8")))
  step = jax.jit(grad, in_shardings=([ws, ws], bs),
                 out_shardings=(NamedSharding(mesh, P()), [ws, ws]))
  arg = lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)
  with jax.set_mesh(mesh):
    text = jax.export.export(step, platforms=["cuda"])(
        [arg((WIDTH, WIDTH), ws)] * 2, arg((BATCH, WIDTH), bs)).mlir_module()
  # Partitioning happens when XLA:GPU compiles it: the exported program
  # shows where the partitioner must gather (the constraints), not the
  # all-gathers themselves.
  constraints = re.findall(
      r"(?:sdy\.sharding_constraint|custom_call @Sharding)\(?\s*%\S+\)?\s*"
      r"(.*?):\s*(?:\()?tensor<([^>]*)>", text)
  weights = [c for c in constraints if c[1].startswith(f"1x{WIDTH}x{WIDTH}x")]
  assert len(weights) == 2, constraints
  for sharding, tensor in weights:
    assert tensor.endswith("ui8"), weights
    assert "fsdp" not in sharding, weights               # replicated
  assert "f8E4M3FN" in text


def test_fsdp_axis_in_the_policy_grammar():
  policy = jmp_lite.get_policy("p=f32,c=bf16,m=fp8_rowwise(fsdp_axis=FSDP)")
  assert policy.fp8_recipe.fsdp_axis == "FSDP"          # case kept
  assert jmp_lite.get_policy(str(policy)) == policy
  config = fp8.Fp8Config(fsdp_axis=["data", "fsdp"])
  assert config.fsdp_axis == ("data", "fsdp")
  assert jmp_lite.get_policy(str(jmp_lite.get_policy("bf16").with_matmul_precision(
      config))).fp8_recipe == config


def _step(recipe="fp8"):
  return jax.jit(jax.grad(jmp_lite.with_policy(_loss, _policy(recipe))))


def test_no_mesh_teaches():
  params, x = _params()
  with pytest.raises(ValueError, match=r"no mesh is set.*jax\.set_mesh"):
    _step()(params, x)


def test_axis_missing_from_mesh_teaches():
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  params, x = _params()
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"no axis 'fsdp'.*'data'"):
      _step()(params, x)


def test_a_whole_weight_under_shard_map_teaches():
  # Under shard_map, fsdp_axis takes this device's shard of the weight: a
  # whole (replicated) weight is refused, naming what to pass.
  mesh = _mesh()
  params, x = _params()
  config = fp8.Fp8Config(fsdp_axis="fsdp")
  body = lambda w, x: fp8.dot_general(x, w, (((1,), (0,)), ((), ())),
                                      config=config)
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("fsdp")),
                         out_specs=P("fsdp"))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"this device's shard.*all_gather"):
      jax.jit(mapped)(params[0], x)


# --- under jax.shard_map: the matmul gathers the shard itself -------------------

SM_K, SM_N, SM_M = 128 * N, 128, 64    # a 128-long shard per device along K
SM_RECIPES = RECIPES + ["int8", "int8_switchback"]
DN = (((1,), (0,)), ((), ()))


def _sm_config(recipe, fsdp=True):
  config = jmp_lite.get_policy(_policy(recipe, fsdp)).fp8_recipe
  return config


def _dot(recipe):
  return jmp_lite.int8.dot_general if recipe.startswith("int8") else fp8.dot_general


def _sm_data(seed=3):
  kw, kx, kg = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kx, (SM_M, SM_K)),
          jax.random.normal(kw, (SM_K, SM_N)) / SM_K**0.5,
          jax.random.normal(kg, (SM_M, SM_N)))


def _sm_vjp(recipe, fsdp):
  """shard_map of (y, dx, dw): the batch sharded, the weight sharded along K
  with fsdp_axis, else replicated (gather, then quantize)."""
  config, dot = _sm_config(recipe, fsdp), _dot(recipe)

  def body(x, w, g):
    y, back = jax.vjp(lambda x, w: dot(x, w, DN, config=config), x, w)
    return (y, *back(g))

  w_spec = P("fsdp", None) if fsdp else P()
  return jax.jit(jax.shard_map(body, mesh=_mesh(),
                               in_specs=(P("fsdp"), w_spec, P("fsdp")),
                               out_specs=(P("fsdp"), P("fsdp"), w_spec)))


@pytest.mark.parametrize("recipe", default_run_keeps(SM_RECIPES))
def test_shard_map_quantize_then_gather_equals_gather_then_quantize(recipe):
  # Each shard quantized with the scales every shard shares, gathered as
  # bits, equals the whole (replicated) weight quantized: y, dx and the
  # weight gradient (each shard's: the sum over devices, scattered) are the
  # replicated-weight run's bit for bit.
  data = _sm_data()
  with jax.set_mesh(_mesh()):
    want = _sm_vjp(recipe, fsdp=False)(*data)
    got = _sm_vjp(recipe, fsdp=True)(*data)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("recipe", SM_RECIPES)
def test_shard_map_gathers_one_byte_values(recipe):
  # The compiled program gathers the weight only as 1-byte values (plus
  # scales, at most one float32 per 16 values' worth); the CUDA export
  # shows the same all_gather of ui8.
  data = _sm_data()
  step = _sm_vjp(recipe, fsdp=True)
  with jax.set_mesh(_mesh()):
    gathers = _gathers(step.lower(*data).compile().as_text())
    text = jax.export.export(step, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")])(
            *data).mlir_module()
  weight = SM_K * SM_N
  assert [g for g in gathers if g == ("u8", weight)], gathers
  assert not [g for g in gathers if _BYTES[g[0]] > 1 and g[1] * 16 > weight], gathers
  assert {t for t, _ in gathers} <= {"u8", "u32"}, gathers
  exported = re.findall(r"stablehlo\.all_gather.*?->\s*tensor<([^>]*)>", text,
                        re.DOTALL)
  assert [t for t in exported if t.endswith("ui8") and "x" in t], exported
  wide = [t for t in exported
          if not t.endswith(("ui8", "ui32"))]
  assert not wide, exported


# Ten training steps compared with an unsharded run: the slow stage (the
# jitted FSDP steps of test_ten_adam_steps_equal_unsharded and the shard_map
# gathers above stay in the README's selection).
@pytest.mark.slow
@pytest.mark.standard_promotion
@pytest.mark.parametrize("recipe", ["fp8", "int8"])
def test_shard_map_ten_adam_steps_equal_unsharded(recipe):
  # FSDP under shard_map (batch and weights over 8 devices; every amax of
  # the activations and gradients shared through axis_name, as one device
  # holding the whole batch sees them) trains bit for bit as data
  # parallelism with the weights replicated (gather, then quantize), and as
  # the unsharded run up to the order of the devices' sums.
  params, x = _params(layers=3)
  dot = _dot(recipe)
  base = jmp_lite.get_policy(_policy(recipe, fsdp=False)).fp8_recipe
  replicated = dataclasses.replace(base, axis_name="fsdp")
  sharded = dataclasses.replace(replicated, fsdp_axis="fsdp")
  opt = optax.adam(1e-3)

  def loss(config, params, x, mean):
    for w in params[:-1]:
      x = jnp.tanh(dot(x, w, DN, config=config))
    return mean(jnp.mean(dot(x, params[-1], DN, config=config) ** 2))

  def update(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def plain_step(params, state, x):
    value, grads = jax.value_and_grad(
        lambda p: loss(base, p, x, lambda v: v))(params)
    return (*update(grads, state, params), value)

  def mapped_step(config, spec):
    def body(params, state, x):
      # Each weight's gradient is the sum over the devices of their
      # whole-weight gradients of pmean's share (1/N of each local mean):
      # the global mean's gradient (scattered to the shards with fsdp_axis).
      value, grads = jax.value_and_grad(lambda p: loss(
          config, p, x, lambda v: jax.lax.pmean(v, "fsdp")))(params)
      return (*update(grads, state, params), value)

    specs = [spec] * len(params)
    state_specs = optax.tree_map_params(
        opt, lambda _: spec, opt.init(params), transform_non_params=lambda _: P())
    return jax.jit(jax.shard_map(body, mesh=_mesh(),
                                 in_specs=(specs, state_specs, P("fsdp")),
                                 out_specs=(specs, state_specs, P())))

  def run(step):
    p, s, losses = params, opt.init(params), []
    for _ in range(10):
      p, s, v = step(p, s, x)
      losses.append(float(v))
    return p, np.array(losses)

  _, want = run(plain_step)
  with jax.set_mesh(_mesh()):
    got_params, got = run(mapped_step(sharded, P("fsdp", None)))
    rep_params, rep = run(mapped_step(replicated, P()))
  np.testing.assert_array_equal(got, rep)
  for a, b in zip(got_params, rep_params):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Against one device: the first loss to float32 rounding (the mean of the
  # devices' means); later ones follow weights updated from gradients the
  # devices sum in another order than one device's dot (float32 rounding,
  # which can move a value across a float8 or int8 rounding boundary, and
  # Adam's normalised steps carry that on; measured 1.5e-4 relative); int8's
  # weight gradient also scales each column along the device's own tokens
  # (rows are local, as in any data-parallel int8 run).
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-3)


@pytest.mark.parametrize("recipe,k,match", [
    ("fp8", SM_K // 2, r"lhs contracts.*shard"),
    ("fp8_blockwise", 64 * N, r"straddle two shards"),
    ("mxfp8", 16 * N, r"straddle two shards"),
    ("fp8_delayed", SM_K, r"current scaling")])
def test_shard_map_refusals_teach(recipe, k, match):
  w = jnp.ones((k // N if match.startswith("lhs") else k, SM_N))
  x = jnp.ones((SM_M, SM_K if match.startswith("lhs") else k))
  config = _sm_config(recipe)
  body = lambda x, w: fp8.dot_general(x, w, DN, config=config)
  mapped = jax.shard_map(body, mesh=_mesh(), in_specs=(P("fsdp"), P("fsdp")),
                         out_specs=P("fsdp"))
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match=match):
      jax.jit(mapped)(x, w)


@pytest.mark.parametrize("bad,error", [(3, TypeError), ("", TypeError),
                                       (("a", "a"), ValueError)])
def test_bad_fsdp_axis_teaches(bad, error):
  with pytest.raises(error, match="fsdp_axis"):
    fp8.Fp8Config(fsdp_axis=bad)


@pytest.mark.parametrize("recipe", default_run_keeps(["int8", "int8_switchback"]))
def test_int8_weight_gather_is_one_byte_and_exact(recipe):
  gathers = _gathers(_compiled(recipe, fsdp=True))
  weight = WIDTH * WIDTH
  values = [g for g in gathers if g == ("u8", weight)]
  # Forward: both weights; backward: the second layer's weight requantized
  # along N for its input gradient (int8), or the forward's reused (a
  # tensor-wise scale fits both contractions: SwitchBack).
  assert len(values) == (3 if recipe == "int8" else 2), gathers
  assert not [g for g in gathers if _BYTES[g[0]] > 1 and g[1] * 16 > weight]
  assert {t for t, _ in gathers} <= {"u8", "u32"}, gathers
  # Quantize then gather equals gather then quantize: the forward and the
  # loss equal the unsharded int8 run's bit for bit.
  mesh = _mesh()
  params, x = _params()
  config = jmp_lite.get_policy(_policy(recipe)).fp8_recipe
  plain = dataclasses.replace(config, fsdp_axis=None)
  dn = (((1,), (0,)), ((), ()))
  fn = lambda c: jax.jit(lambda w, x: jmp_lite.int8.dot_general(
      x, w, dn, config=c))
  want = fn(plain)(params[0], x)
  with jax.set_mesh(mesh):
    got = fn(config)(*_sharded(mesh, params[0], x))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  loss = lambda policy: jax.jit(jmp_lite.with_policy(_loss, policy))
  want = loss(_policy(recipe, fsdp=False))(*_params())
  with jax.set_mesh(mesh):
    got = loss(_policy(recipe))(*_sharded(mesh, *_params()))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_int8_fsdp_axis_in_the_grammar_and_its_errors():
  config = jmp_lite.get_policy("p=f32,c=bf16,o=f32,m=int8(fsdp_axis=Fsdp)"
                               ).fp8_recipe
  assert config.fsdp_axis == "Fsdp"
  assert jmp_lite.get_policy(str(jmp_lite.get_policy(
      "p=f32,c=bf16,o=f32,m=int8(fsdp_axis=Fsdp)"))).fp8_recipe == config
  with pytest.raises(TypeError, match="Int8Config.fsdp_axis"):
    jmp_lite.int8.Int8Config(fsdp_axis=3)
  dn = (((1,), (0,)), ((), ()))
  with pytest.raises(ValueError, match=r"no mesh is set.*jax\.set_mesh"):
    jmp_lite.int8.dot_general(
        jnp.ones((8, 32)), jnp.ones((32, 16)), dn,
        config=jmp_lite.int8.Int8Config(fsdp_axis="fsdp"))
