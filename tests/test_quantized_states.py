"""quantized_states: low-bit moments for any optax optimizer."""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lite
from jmp_lite._src import state_codes as sc
from jmp_lite._src.quantized_states import (
    QuantizedStatesState, bytes_per_parameter, quantized_states)

from helpers import ROOT, lowered_functions
from helpers import default_run_keeps

# optax's adam raises float ** int32 under strict promotion (conftest.py).
pytestmark = pytest.mark.standard_promotion


def _params(dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (64, 256), jnp.float32).astype(dtype),
          "e": jax.random.normal(k2, (32, 384), jnp.float32).astype(dtype),
          "b": jnp.zeros(256, dtype)}


def _grads(params, step):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(step), p.shape, jnp.float32)
      .astype(p.dtype) * 0.1, params)


@functools.cache
def _jitted(fn):
  """One jax.jit per function (an optimizer's update), so that the runs of
  one optimizer share its program."""
  return jax.jit(fn)


def _run(opt, params, steps=3, jit_init=False):
  state = (_jitted(opt.init) if jit_init else opt.init)(params)
  step = _jitted(opt.update)
  for i in range(steps):
    updates, state = step(_grads(params, i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=1024),
}


@functools.cache
def _float32_run(name):
  """The float32 run of INNERS[name] (computed once for the three formats)."""
  return _run(INNERS[name](), _params())


@pytest.mark.parametrize("name", default_run_keeps(list(INNERS)))
@pytest.mark.parametrize("fmt", default_run_keeps(["8bit", "4bit", "e4m3"]))
def test_one_wrapper_for_every_optimizer(name, fmt):
  """The inner optimizer's own math on decoded moments: close to the float32
  run, the quantized leaves stored in their format, the rest float32."""
  params = _params()
  ref, _ = _float32_run(name)
  got, state = _run(quantized_states(INNERS[name](), mu=fmt, nu=fmt), params)
  for k in params:
    np.testing.assert_allclose(got[k], ref[k], atol=0.05)
  dtype = sc.stored_dtype(sc.FORMATS[fmt])
  leaves = jax.tree.leaves_with_path(state.inner_state)
  stored = [jax.tree_util.keystr(p) for p, x in leaves
            if hasattr(x, "dtype") and x.dtype == dtype]
  if name == "adafactor":  # Unfactored leaves only: v.
    assert stored and all(".v[" in p for p in stored)
  else:
    assert stored
  # The bias (256 < 4096 elements) stays float32.
  assert all("'b'" not in p for p in stored)


@pytest.mark.parametrize("fmt", ["8bit", "4bit_rank1", "bfloat16_sr"])
def test_codes_are_inlined_into_a_jitted_update(fmt):
  """encode and decode are jitted functions (one program each for an eager
  update) with inline=True: a jitted update's program holds their
  operations, not a function called for them."""
  opt = quantized_states(optax.adam(1e-3), mu="8bit", nu=fmt)
  params = _params()
  functions = lowered_functions(opt.update, _grads(params, 0),
                                opt.init(params), params)
  assert not [f for f in functions if f.startswith(("encode", "decode"))], (
      functions)


def test_roles_from_state_structure():
  params = _params()
  state = quantized_states(optax.adam(1e-3), mu="4bit", nu="4bit").init(params)
  adam = state.inner_state[0]
  w_mu, w_nu = adam.mu["w"], adam.nu["w"]
  fmt = sc.FORMATS["4bit"]
  # Zero moments: mu decodes to 0 with the signed map's zero code, nu's block
  # scale is 0 (its zero-free code decodes to 0 only in an all-zero block).
  codes, scales = sc.unpack(w_mu, fmt)
  zero = int(np.flatnonzero(fmt.book(False).values == 0)[0])
  assert np.all(np.asarray(codes) == zero) and np.all(np.asarray(scales) == 0)
  codes, scales = sc.unpack(w_nu, fmt)
  assert np.all(np.asarray(codes) == fmt.book(True).first)
  # User overrides by path.
  state = quantized_states(optax.adam(1e-3), mu="8bit", nu="8bit",
                           keep=(r"\['e'\]",)).init(params)
  assert state.inner_state[0].mu["e"].dtype == jnp.float32
  assert state.inner_state[0].mu["w"].dtype == jnp.uint8


def test_unknown_fields_are_kept():
  """MultiSteps' accumulated gradients are no moment: they stay float32,
  while the moments inside are quantized."""
  opt = quantized_states(optax.MultiSteps(optax.adam(1e-3), 2),
                         mu="8bit", nu="8bit")
  state = opt.init(_params())
  acc = state.inner_state.acc_grads
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(acc))
  assert state.inner_state.inner_opt_state[0].mu["w"].dtype == jnp.uint8


def test_bytes_per_parameter_table():
  """From jax.eval_shape(opt.init): bf16 params + stochastic rounding +
  8-bit m and v <= 4.05 bytes; 4-bit <= 3.1 (GPT-2-small-like shapes)."""
  params = {"wte": jax.ShapeDtypeStruct((50257, 768), jnp.bfloat16),
            "attn": jax.ShapeDtypeStruct((768, 2304), jnp.bfloat16),
            "mlp": jax.ShapeDtypeStruct((768, 3072), jnp.bfloat16),
            "ln": jax.ShapeDtypeStruct((768,), jnp.bfloat16)}
  table = {}
  for mu, nu in [("float32", "float32"), ("bfloat16", "bfloat16"),
                 ("e4m3", "e4m3"), ("8bit", "8bit"), ("4bit", "4bit")]:
    opt = jmp_lite.master_weights(
        quantized_states(optax.adam(1e-3), mu=mu, nu=nu),
        method="stochastic_rounding")
    state = jax.eval_shape(opt.init, params)
    table[mu] = 2 + bytes_per_parameter(state, params)
  assert table["8bit"] <= 4.05 and table["e4m3"] <= 4.05
  assert table["4bit"] <= 3.1
  assert table["bfloat16"] == pytest.approx(6.0, abs=0.01)
  assert table["float32"] == pytest.approx(10.0, abs=0.01)


def test_tree_utilities():
  params = _params()
  opt = quantized_states(optax.adam(1e-3), mu="8bit", nu="4bit")
  state = opt.init(params)
  shapes = jax.eval_shape(opt.init, params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
      lambda x: (x.shape, x.dtype), state)
  mu = optax.tree.get(state, "mu")
  assert mu["w"].shape == sc.stored_shape((64, 256), sc.FORMATS["8bit"])
  specs = {"w": P("x"), "e": P("x"), "b": P()}
  mapped = optax.tree_map_params(opt, lambda _, s: s, state, specs,
                                 transform_non_params=lambda _: P())
  assert mapped.inner_state[0].nu["w"] == P("x")
  assert mapped.inner_state[0].count == P()


@pytest.mark.parametrize("fmt,nu", default_run_keeps(
    [("8bit", "8bit"), ("4bit", "4bit"), ("4bit", "4bit_rank1")], unpack=True))
def test_bit_identical_on_1_2_4_8_devices(fmt, nu):
  """FSDP sharding of the leading axis: state sharded like the params and
  the same bits on 1, 2, 4 and 8 devices (rank-1 scales too: their column
  maxes are an exact max over the shards)."""
  params = _params()
  opt = quantized_states(optax.adamw(1e-2), mu=fmt, nu=nu)
  results = []
  for n in (1, 2, 4, 8):
    mesh = Mesh(np.array(jax.devices()[:n]), ("fsdp",))
    specs = {"w": P("fsdp"), "e": P("fsdp"), "b": P()}
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    p = jax.device_put(params, shard)
    state_shapes = jax.eval_shape(opt.init, p)
    state_specs = optax.tree_map_params(
        opt, lambda _, s: s, state_shapes, shard,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    state = jax.jit(opt.init, out_shardings=state_specs)(p)
    step = jax.jit(opt.update, out_shardings=(shard, state_specs))
    for i in range(2):
      updates, state = step(jax.device_put(_grads(params, i), shard), state, p)
      p = optax.apply_updates(p, updates)
    nu_w = state.inner_state[0].nu["w"]
    assert nu_w.sharding.spec == P("fsdp")
    results.append(jax.tree.map(np.asarray, (p, state)))
  for other in results[1:]:
    jax.tree.map(np.testing.assert_array_equal, results[0], other)


def test_composes_with_master_weights_and_loss_scaling():
  """A skipped step leaves codes, scales and the key untouched."""
  params = _params(jnp.bfloat16)
  opt = jmp_lite.loss_scaling(
      jmp_lite.master_weights(
          quantized_states(optax.adam(1e-2), mu="bf16_sr", nu="8bit"),
          method="stochastic_rounding"),
      jmp_lite.DynamicLossScale(jnp.float32(2.0**4)))
  state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
  update = jax.jit(opt.update)  # one program for both steps
  _, skipped = update(grads, state, params)
  inner = lambda s: optax.tree.get(s, "inner_state")
  before = jax.tree.leaves(optax.tree.get_all_with_path(state, "rng_key"))
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.leaves(state.inner_state),
               jax.tree.leaves(skipped.inner_state))
  del inner, before
  grads = _grads(params, 0)
  scaled = jax.tree.map(lambda g: g * 16, grads)
  updates, state = update(scaled, state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_stochastic_rounding_key_in_state():
  params = _params()
  opt = quantized_states(optax.adam(1e-2), mu="bf16_sr", nu="bf16")
  _, a = _run(opt, params, steps=2)
  _, b = _run(opt, params, steps=2)
  jax.tree.map(np.testing.assert_array_equal, a, b)  # Reproducible.
  assert a.rng_key.dtype == jnp.uint32
  _, c = _run(quantized_states(optax.adam(1e-2), mu="bf16_sr", nu="bf16",
                               seed=1), params, steps=2)
  assert not np.array_equal(a.inner_state[0].mu["w"], c.inner_state[0].mu["w"])


def test_non_finite_moments_stay_visible():
  params = _params()
  opt = quantized_states(optax.sgd(0.1, momentum=0.9), mu="8bit")
  state = opt.init(params)
  grads = _grads(params, 0)
  grads["w"] = grads["w"].at[3, 7].set(jnp.nan)
  # Compiled (an eager update: test_4bit_adam_is_adam_on_the_reference_codes).
  _, state = jax.jit(opt.update)(grads, state, params)
  trace = jax.jit(lambda s: sc.decode(s, sc.FORMATS["8bit"], False, (64, 256)))(
      state.inner_state[0].trace["w"])
  assert bool(jnp.all(jnp.isnan(trace[3]))) and bool(
      jnp.all(jnp.isfinite(trace[4])))


# -- bad inputs ------------------------------------------------------------------


def test_rank1_second_moments():
  """nu='4bit_rank1': 2-D second moments in the rank-1 layout, the 1-D ones
  (big enough to quantize) in 4-bit blocks; Adam trains on them."""
  params = dict(_params(), v=jnp.ones(8192, jnp.float32))
  opt = jmp_lite.with_state_dtype(optax.adam(1e-2), mu="4bit",
                                  nu="4bit_rank1")
  # Init jitted too (the eager rank-1 encoding: test_state_codes.py's
  # test_rank1_is_closer_than_blocks_on_a_rank1_moment).
  new, state = _run(opt, params, jit_init=True)
  nu = state.inner_state[0].nu
  rank1, blocks = sc.FORMATS["4bit_rank1"], sc.FORMATS["4bit"]
  assert nu["w"].shape == sc.stored_shape((64, 256), rank1) == (64, 148)
  assert nu["v"].shape == sc.stored_shape((8192,), blocks)
  assert nu["b"].dtype == jnp.float32  # under min_size
  reference, _ = _run(optax.adam(1e-2), params)
  for name in ("w", "e"):
    moved = np.asarray(new[name] - params[name])
    want = np.asarray(reference[name] - params[name])
    assert np.all(np.isfinite(moved))
    assert np.corrcoef(moved.ravel(), want.ravel())[0, 1] > 0.9


def test_rank1_codes_do_not_depend_on_the_device_count():
  """jmp_lite's own rank-1 arithmetic, encoding (a max over the sharded rows)
  and decoding (a gather of the column maxes), gives the same bits with the
  rows sharded over 1, 2 and 8 devices, under the suite's XLA flags too."""
  k1, k2 = jax.random.split(jax.random.key(5))
  moments = [jax.random.uniform(k1, (64, 512)) ** 4 * 1e-3,
             jax.random.uniform(k2, (64, 256)) ** 8]
  fmt = sc.FORMATS["4bit_rank1"]
  encode = jax.jit(lambda x: sc.encode(x, fmt, True))
  decode = jax.jit(lambda s, x: sc.decode(s, fmt, True, x.shape))
  results = []
  for n in (1, 2, 8):
    rows = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("x",)),
                         P("x", None))
    stored = [encode(jax.device_put(x, rows)) for x in moments]
    decoded = [decode(s, x) for s, x in zip(stored, moments)]
    assert stored[0].sharding.spec == P("x", None)
    results.append(jax.tree.map(np.asarray, (stored, decoded)))
  for other in results[1:]:
    jax.tree.map(np.testing.assert_array_equal, results[0], other)


#: The docs' rank-1 example (docs/precision.md, "Rank-1 normalisation") with
#: AdamW, rows sharded over 1, 2 and 8 devices, 3 jitted steps; it prints the
#: number of update elements and stored bytes that differ from 1 device's.
_RANK1_DEVICE_COUNTS = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jmp_lite
opt = jmp_lite.with_state_dtype(optax.adamw(1e-3), mu="4bit", nu="4bit_rank1")
params = {"a": jax.random.normal(jax.random.key(0), (64, 512)),
          "b": jax.random.normal(jax.random.key(1), (64, 256))}
step = jax.jit(opt.update)
runs = []
for n in (1, 2, 8):
  rows = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("x",)), P("x", None))
  p = jax.device_put(params, rows)
  state, out = jax.jit(opt.init)(p), []
  for i in range(3):
    g = jax.tree.map(lambda x: jax.random.normal(jax.random.key(10 + i),
                                                 x.shape) * 0.1, params)
    updates, state = step(jax.device_put(g, rows), state, p)
    p = optax.apply_updates(p, updates)
    out.append(updates)
  assert state.inner_state[0].nu["a"].sharding.spec == P("x", None)
  runs.append([np.asarray(x) for x in jax.tree.leaves((out, state))])
print([sum(int(np.sum(a != b)) for a, b in zip(runs[0], r)) for r in runs[1:]])
"""


@pytest.mark.slow  # a subprocess compiling at XLA's default level: ~15 s
def test_rank1_example_bit_identical_on_1_2_8_devices():
  """The docs' promise: the rank-1 example's updates and stored states are
  bit-identical on 1, 2 and 8 devices under XLA's default CPU flags. Run in a
  subprocess because the suite's cheap flags (backend optimization level 0
  without the fusion emitters, one codegen module) let LLVM contract optax's
  ``b2 * nu + (1 - b2) * g**2`` into an FMA in some programs and not others
  (docs/precision.md says which)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", _RANK1_DEVICE_COUNTS],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == ["[0,", "0]"], result.stdout


def test_rank1_is_for_second_moments_only():
  with pytest.raises(ValueError, match=r"mu='4bit_rank1'.*nu='4bit_rank1'"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="4bit_rank1")


def test_unknown_format():
  with pytest.raises(ValueError, match=r"unknown nu format 'int8'.*'8bit'"):
    quantized_states(optax.adam(1e-3), nu="int8")
  with pytest.raises(TypeError, match="mu format must be a string.*'8bit'"):
    quantized_states(optax.adam(1e-3), mu=object())


def test_bad_roles_and_patterns():
  with pytest.raises(ValueError, match=r"unknown role of 'sq' 'second'.*'nu'"):
    quantized_states(optax.adam(1e-3), mu="8bit", roles={"sq": "second"})
  with pytest.raises(ValueError, match=r"keep=\('\[',\) holds '\[', not a "
                     r"valid regular expression \(unterminated"):
    quantized_states(optax.adam(1e-3), mu="8bit", keep=("[",))


@pytest.mark.parametrize("keep,bad", [
    ((3,), "3 (int)"), (("x", None), "None (NoneType)"),
    ((b"x",), "b'x' (bytes)")])
def test_keep_items_that_are_not_patterns(keep, bad):
  with pytest.raises(TypeError, match=r"keep=.* holds " + re.escape(bad)
                     + r", not a string\. They are regular expressions"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", keep=keep)


@pytest.mark.parametrize("keep", [42, b"x", None])
def test_keep_that_is_not_a_sequence(keep):
  with pytest.raises(TypeError, match=re.escape(f"keep={keep!r}")
                     + r".*tuple/list of strings.*regular expressions"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", keep=keep)


def test_roles_keys_that_are_not_patterns():
  with pytest.raises(TypeError, match=r"roles \(a key\) holds 3 \(int\)"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", roles={3: "nu"})
  with pytest.raises(ValueError, match=r"roles \(a key\) holds '\('.*regular"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", roles={"(": "nu"})
  with pytest.raises(TypeError, match=r"roles=\['nu'\] \(list\).*dict"):
    jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", roles=["nu"])


def test_bad_block_size():
  with pytest.raises(ValueError, match=r"block_size=100; .*power of two"):
    quantized_states(optax.adam(1e-3), mu="8bit", block_size=100)
  with pytest.raises(TypeError, match="block_size must be an int"):
    quantized_states(optax.adam(1e-3), mu="8bit", block_size=128.0)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn])
def test_integer_or_float8_params(dtype):
  params = {"w": jnp.ones((4, 4), dtype)}
  with pytest.raises(ValueError, match=r"param \['w'\] is " + np.dtype(dtype).name):
    quantized_states(optax.adam(1e-3), mu="8bit").init(params)


def test_hyperparameters_in_the_states_dtype():
  inner = optax.inject_hyperparams(optax.adam)(
      learning_rate=1e-3, b2=jnp.bfloat16(0.999))
  if inner.init(_params()).hyperparams["b2"].dtype == jnp.bfloat16:
    with pytest.raises(ValueError, match=r"b2.* bfloat16 \(value 1\.0\).*beta2"):
      quantized_states(inner, mu="8bit", nu="8bit").init(_params())
  else:  # optax 0.2.6 stores every hyperparameter in float32: nothing to see
    assert optax.__version__ < "0.2.7"
  # float32 hyperparameters are never cast.
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b2=0.999)
  state = quantized_states(inner, mu="8bit", nu="8bit").init(_params())
  assert state.inner_state.hyperparams["b2"].dtype == jnp.float32


def test_state_restored_into_another_format():
  params = _params()
  state = quantized_states(optax.adam(1e-3), mu="8bit", nu="8bit").init(params)
  other = quantized_states(optax.adam(1e-3), mu="4bit", nu="8bit")
  with pytest.raises(ValueError, match=r"holds moments stored as mu=8bit,"
                     r"nu=8bit.*stores mu=4bit,nu=8bit.*restore it into "
                     r"with_state_dtype\(inner, mu='8bit', nu='8bit'\)"):
    other.update(_grads(params, 0), state, params)
  e4m3 = quantized_states(optax.adam(1e-3), mu="e4m3", nu="8bit")
  with pytest.raises(ValueError, match="stores mu=e4m3,nu=8bit"):
    jax.jit(e4m3.update)(_grads(params, 0), state, params)  # static: jit too
  kept = quantized_states(optax.adam(1e-3), mu="8bit", nu="8bit",
                          keep=(r"\['e'\]",))
  with pytest.raises(ValueError, match=r"leaf formats .*keep=, roles= or"):
    kept.update(_grads(params, 0), state, params)
  with pytest.raises(ValueError, match="stores mu=bfloat16_sr"):
    quantized_states(optax.adam(1e-3), mu="bf16_sr").update(
        _grads(params, 0), state, params)


# -- FSDP, checkpoints, accumulation, the public door ----------------------------


def test_fsdp_update_gathers_no_state_leaf():
  """Under jax.jit with params and state sharded FSDP-style over 8 devices
  (leading axis), the compiled update of 8-bit/4-bit states inside
  master_weights(stochastic rounding) moves nothing between devices: no
  all-gather (of a state leaf or anything else), all-to-all or permute. Each
  block lies on one device; decode, the inner update and encode are
  elementwise or a max within a block."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (see conftest.py)")
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  params = _params(jnp.bfloat16)
  specs = {"w": P("fsdp"), "e": P("fsdp"), "b": P()}
  shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  p = jax.device_put(params, shard)
  opt = jmp_lite.master_weights(
      jmp_lite.with_state_dtype(optax.adam(1e-2), mu="8bit", nu="4bit"),
      method="stochastic_rounding")
  state_specs = optax.tree_map_params(
      opt, lambda _, s: s, jax.eval_shape(opt.init, p), shard,
      transform_non_params=lambda _: NamedSharding(mesh, P()))
  state = jax.jit(opt.init, out_shardings=state_specs)(p)
  step = jax.jit(opt.update, out_shardings=(shard, state_specs))
  grads = jax.device_put(_grads(params, 0), shard)
  hlo = step.lower(grads, state, p).compile().as_text()
  for collective in ("all-gather", "all-to-all", "collective-permute",
                     "reduce-scatter"):
    assert collective not in hlo, collective
  _, new_state = step(grads, state, p)
  mu = optax.tree.get(new_state, "mu")["w"]
  assert mu.dtype == jnp.uint8 and mu.sharding.spec == P("fsdp")
  assert len({s.data.shape for s in mu.addressable_shards}) == 1
  assert mu.addressable_shards[0].data.shape[0] == 64 // 8


def _train(opt, params, start, stop, state=None):
  state = opt.init(params) if state is None else state
  step = _jitted(opt.update)
  for i in range(start, stop):
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), _grads(params, i),
                         params)
    updates, state = step(grads, state, params)
    params = jax.tree.map(lambda p, u: (p.astype(u.dtype) + u).astype(p.dtype),
                          params, updates)
  return params, state


def _low_bit_optimizer():
  return jmp_lite.loss_scaling(
      jmp_lite.master_weights(
          jmp_lite.with_state_dtype(optax.adam(1e-2), mu="bf16_sr",
                                    nu="4bit", seed=5),
          method="stochastic_rounding", seed=6),
      jmp_lite.DynamicLossScale(jnp.float32(1.0)))


def test_orbax_round_trip_and_resume_bit_identical(tmp_path):
  """The state (codes, scales, keys) saved with orbax and restored into a
  jax.eval_shape(opt.init) target: the same arrays, and training resumed
  from it lands bit for bit where the uninterrupted run does."""
  from helpers import orbax_round_trip  # pylint: disable=g-import-not-at-top
  params = _params(jnp.bfloat16)
  opt = _low_bit_optimizer()
  straight = _train(opt, params, 0, 4)
  half = _train(opt, params, 0, 2)
  restored = orbax_round_trip(half, tmp_path / "ckpt")
  jax.tree.map(np.testing.assert_array_equal, restored, half)
  target = jax.eval_shape(opt.init, params)
  assert jax.tree.structure(restored[1]) == jax.tree.structure(target)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), restored[1]) == (
      jax.tree.map(lambda x: (x.shape, x.dtype), target))
  resumed = _train(opt, restored[0], 2, 4, state=restored[1])
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_accumulation_steps_the_mean_once_and_keeps_states_between():
  """loss_scaling(..., accumulation_steps=2) around low-bit states: the
  mini-steps leave the stored moments untouched (codes and scales), the
  window's step is the step of the mean gradient, and the accumulator stays
  float32. optax.MultiSteps inside keeps its accumulated gradients float32
  (a field with no moment role)."""
  params = _params()
  inner = lambda: jmp_lite.with_state_dtype(optax.adam(1e-2), mu="8bit",
                                            nu="8bit")
  acc = jmp_lite.loss_scaling(inner(), jmp_lite.NoOpLossScale(),
                              accumulation_steps=2)
  state = acc.init(params)
  update = jax.jit(acc.update)
  before = optax.tree.get(state, "nu")
  updates, state = update(_grads(params, 0), state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  jax.tree.map(np.testing.assert_array_equal, optax.tree.get(state, "nu"),
               before)
  updates, state = update(_grads(params, 1), state, params)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, _grads(params, 0),
                      _grads(params, 1))
  plain = inner()
  expected, expected_state = jax.jit(plain.update)(mean, plain.init(params),
                                                   params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-9),
               updates, expected)
  jax.tree.map(np.testing.assert_array_equal, optax.tree.get(state, "mu"),
               optax.tree.get(expected_state, "mu"))
  multi = jmp_lite.with_state_dtype(optax.MultiSteps(optax.adam(1e-2), 2),
                                    mu="8bit", nu="8bit")
  state = multi.init(params)
  assert optax.tree.get(state, "acc_grads")["w"].dtype == jnp.float32
  assert optax.tree.get(state, "mu")["w"].dtype == jnp.uint8


def test_with_state_dtype_door_and_its_errors():
  """with_state_dtype(inner, mu=, nu=) is quantized_states; a dtype with
  mu=/nu=, or low-bit options with a dtype, is refused naming the fix."""
  params = _params()
  door = jmp_lite.with_state_dtype(optax.adam(1e-2), mu="8bit", nu="4bit")
  direct = quantized_states(optax.adam(1e-2), mu="8bit", nu="4bit")
  jax.tree.map(np.testing.assert_array_equal, _run(door, params),
               _run(direct, params))
  only_nu = jmp_lite.with_state_dtype(optax.adam(1e-2), nu="8bit")
  state = only_nu.init(params)
  assert state.inner_state[0].mu["w"].dtype == jnp.float32
  assert state.inner_state[0].nu["w"].dtype == jnp.uint8
  with pytest.raises(ValueError, match=r"either dtype.*got dtype=.*mu='8bit'"):
    jmp_lite.with_state_dtype(optax.adam(1e-2), jnp.bfloat16, mu="8bit")
  with pytest.raises(ValueError, match=r"dtype=.* with keep=, block_size="):
    jmp_lite.with_state_dtype(optax.adam(1e-2), jnp.bfloat16, keep=("e",),
                              block_size=64)


def test_4bit_adam_is_adam_on_the_reference_codes():
  """4-bit moments train slower over the first steps than float32 ones (the
  codes' error: docs/precision.md): Adam whose moments are rounded through
  the independent NumPy reference's 4-bit codes after every step takes the
  same steps as quantized_states, so the lag is not an encoding bug."""
  from tests import state_codes_reference as ref  # pylint: disable=import-outside-toplevel
  params = {"w": _params()["w"]}
  adam = optax.adam(1e-2)

  def round_trip(x, fmt, non_negative):
    codes, scales = ref.quantize(np.asarray(x), fmt, non_negative)
    return jnp.asarray(ref.dequantize(codes, scales, fmt, non_negative,
                                      x.shape[-1]))

  opt = quantized_states(adam, mu="4bit", nu="4bit")
  state, ref_state = opt.init(params), adam.init(params)
  p, ref_p = params, params
  for i in range(3):
    g = _grads(params, i)
    updates, state = opt.update(g, state, p)
    p = optax.apply_updates(p, updates)
    ref_updates, ref_state = adam.update(g, ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, ref_updates)
    s = ref_state[0]
    ref_state = (s._replace(
        mu={"w": round_trip(s.mu["w"], "4bit", False)},
        nu={"w": round_trip(s.nu["w"], "4bit", True)}),) + ref_state[1:]
    np.testing.assert_allclose(p["w"], ref_p["w"], rtol=0, atol=1e-6)
  # and the codes cost something: float32 Adam moves elsewhere.
  f32_p, _ = _run(adam, params)
  assert np.max(np.abs(np.asarray(f32_p["w"] - p["w"]))) > 1e-3


def test_state_says_its_formats_through_orbax_and_tree_map_params(tmp_path):
  """The tag is a dict key of the state (its structure) over uint8 codes
  (finite): it survives orbax's restore into jax.eval_shape(opt.init) and
  optax.tree_map_params; restoring an 8-bit checkpoint into an e4m3 target,
  or a 4-bit nu into a 4bit_rank1 one whose bytes coincide (256 x 256), is
  refused by orbax's structure check (the message names both tags)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = {"w": jnp.ones((256, 256), jnp.float32)}
  opt = jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", nu="4bit")
  state = opt.init(params)
  (tag, codes), = state.formats.items()
  assert tag == "mu=8bit,nu=4bit,block_size=default"
  assert codes.dtype == jnp.uint8
  mapped = optax.tree_map_params(opt, lambda _, s: s, state, params,
                                 transform_non_params=lambda x: x)
  assert list(mapped.formats) == [tag]
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "a", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "a",
                                    jax.eval_shape(opt.init, params))
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    jax.jit(opt.update)(params, restored, params)
    for mu, nu in [("e4m3", "4bit"), ("8bit", "4bit_rank1")]:
      other = jmp_lite.with_state_dtype(optax.adam(1e-3), mu=mu, nu=nu)
      target = jax.eval_shape(other.init, params)
      if nu == "4bit_rank1":  # the same bytes: only the tag tells them apart
        assert jax.tree.map(lambda x: (x.shape, x.dtype),
                            target.inner_state) == jax.tree.map(
                                lambda x: (x.shape, x.dtype),
                                state.inner_state)
      with pytest.raises(ValueError, match=re.escape(
          f"mu={mu},nu={nu},block_size=default") + r"(.|\n)*"
                         + re.escape(tag)):
        checkpointer.restore(tmp_path / "a", target)
  # Handed over directly, the other optimizer's update refuses it.
  with pytest.raises(ValueError, match="stores mu=8bit,nu=4bit_rank1"):
    jax.jit(jmp_lite.with_state_dtype(
        optax.adam(1e-3), mu="8bit", nu="4bit_rank1").update)(
            params, state, params)


def _negative_extremes(shape, seed):
  """Moments whose blocks' largest magnitudes are negative (the signed
  maps hold +1 but no -1)."""
  x = np.asarray(_grads({"w": jnp.zeros(shape)}, seed)["w"])
  x = -np.abs(x)
  x[..., ::7] *= -0.5
  return jnp.asarray(x)


@pytest.mark.parametrize("mu,nu", default_run_keeps(
    [("e4m3", "e4m3"), ("8bit", "8bit"), ("4bit", "4bit"),
     ("4bit", "4bit_rank1"), ("bf16_sr", "8bit")], unpack=True))
def test_unchanged_moments_keep_their_bits(mu, nu):
  """MultiSteps' mini-steps (either side of with_state_dtype) and steps
  apply_if_finite skips leave every stored moment bit-identical, for blocks
  whose extreme is negative too."""
  params = {"w": jnp.zeros((64, 256), jnp.float32)}
  grads = [{"w": _negative_extremes((64, 256), i)} for i in range(4)]
  inner = lambda: jmp_lite.with_state_dtype(optax.adam(1e-2), mu=mu, nu=nu)
  moments = lambda s: [np.asarray(x) for x in jax.tree.leaves(
      (optax.tree.get(s, "mu"), optax.tree.get(s, "nu")))]
  for opt in (optax.MultiSteps(inner(), 4),
              jmp_lite.with_state_dtype(optax.MultiSteps(optax.adam(1e-2), 4),
                                        mu=mu, nu=nu)):
    step = jax.jit(opt.update)
    state = opt.init(params)
    _, state = step(grads[0], state, params)  # a first moment
    for g in grads[1:]:
      _, state = step(g, state, params)
    before = moments(state)  # a full window: stepped
    for g in grads[:3]:  # mini-steps
      _, state = step(g, state, params)
      jax.tree.map(np.testing.assert_array_equal, moments(state), before)
  bad = {"w": jnp.full((64, 256), jnp.nan)}
  for opt in (optax.apply_if_finite(inner(), 10),
              jmp_lite.with_state_dtype(
                  optax.apply_if_finite(optax.adam(1e-2), 10), mu=mu, nu=nu)):
    step = jax.jit(opt.update)
    _, state = step(grads[0], opt.init(params), params)
    before = moments(state)
    for _ in range(7):
      _, state = step(bad, state, params)
    jax.tree.map(np.testing.assert_array_equal, moments(state), before)

