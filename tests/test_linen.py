"""Tests of jmp_lite.linen: precision policies on Flax linen models.

Precision is asserted where it happens — on the jaxpr (every ``dot_general`` /
``conv_general_dilated`` operand, every norm reduction) and on the lowered
StableHLO — not inferred from outputs.
"""

import dataclasses
import re
import warnings

from flax import nnx
from flax.core import freeze
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite._src.autocast import interpreter as interpreter_lib
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx

from helpers import all_eqns
from helpers import assert_all_f32
from helpers import assert_documented_with_examples
from helpers import full_precision_windows
from helpers import operand_dtypes

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
MATMULS = ("dot_general", "conv_general_dilated")


# ---------------------------------------------------------------------------
# Jaxpr inspection.
# ---------------------------------------------------------------------------


def assert_matmuls_in(jaxpr, dtype, expected_count=None):
  found = operand_dtypes(jaxpr, MATMULS)
  assert found, "no dot_general/conv in the jaxpr"
  wrong = [f for f in found if set(f[1]) != {dtype}]
  assert not wrong, f"matmuls not in {dtype}: {wrong}"
  if expected_count is not None:
    assert len(found) == expected_count, found


def reduce_dtypes(jaxpr):
  return [d[0] for _, d in operand_dtypes(jaxpr, ("reduce_sum",))]


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------


class MLP(nn.Module):
  """Dense -> LayerNorm -> relu -> Dense: the only reductions are the norm's."""

  features: int = 8

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.features)(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(1, name="head")(nn.relu(x))


class ConvNet(nn.Module):
  """Conv -> BatchNorm -> Dropout -> GroupNorm -> RMSNorm -> Dense."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Dropout(0.25, deterministic=not train)(x)
    x = nn.GroupNorm(num_groups=2)(x)
    x = nn.RMSNorm()(x)
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(3)(x)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.Dense(x.shape[-1])(nn.LayerNorm()(x))
    return x + nn.gelu(y), None


class Deep(nn.Module):
  """nn.remat'ed block and an nn.scan over stacked blocks."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="inp")(x)
    x, _ = nn.remat(Block)(name="remat_block")(x, None)
    x, _ = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
    )(name="stack")(x, None)
    return nn.Dense(2, name="out")(x)


class Encoder(nn.Module):
  """A model whose ``__call__`` uses its own public methods."""

  def setup(self):
    self.enc = nn.Dense(4)
    self.dec = nn.Dense(3)

  def encode(self, x):
    return self.enc(x)

  def decode(self, z):
    return self.dec(z)

  def __call__(self, x):
    z = self.encode(x)
    return self.decode(z) + z[..., :3]


def _x(shape=(4, 3), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _dtypes(tree):
  return {
      jax.tree_util.keystr(p): np.dtype(x.dtype)
      for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


# ---------------------------------------------------------------------------
# Precision where it should be.
# ---------------------------------------------------------------------------


@HALF
def test_mlp_matmuls_in_compute_dtype_and_norm_stats_in_f32(half):
  model = jlinen.apply_policy(MLP(), jmp_lite.Policy(F32, half, F32))
  x = _x()
  variables = model.init(jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(model.apply)(variables, x)
  assert_matmuls_in(jaxpr, half, expected_count=2)
  # LayerNorm's mean and mean-of-squares: two reductions, both in f32.
  assert reduce_dtypes(jaxpr) == [F32, F32]
  # The whole LayerNorm (statistics, scale, bias) runs in f32 between a cast
  # of its input up and of its output back down.
  (window,) = full_precision_windows(jaxpr, half)
  assert_all_f32(window)
  assert model.apply(variables, x).dtype == F32


@HALF
def test_convnet_every_conv_and_dot_in_compute_dtype_norms_in_f32(half):
  model = jlinen.apply_policy(ConvNet(), jmp_lite.Policy(F32, half, F32))
  x = _x((2, 6, 6, 3))
  variables = model.init(jax.random.key(0), x, train=False)

  def train_apply(variables, x, key):
    return model.apply(
        variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )

  jaxpr = jax.make_jaxpr(train_apply)(variables, x, jax.random.key(1))
  assert_matmuls_in(jaxpr, half, expected_count=2)
  reductions = reduce_dtypes(jaxpr)
  # BatchNorm, GroupNorm (mean, mean of squares) and RMSNorm (mean square).
  assert len(reductions) == 5
  assert set(reductions) == {F32}
  windows = full_precision_windows(jaxpr, half)
  assert len(windows) == 3  # BatchNorm, GroupNorm, RMSNorm
  for window in windows:
    assert_all_f32(window)


def test_norm_output_goes_back_to_compute_dtype():
  model = jlinen.apply_policy(MLP(), "mixed_float16")
  x = _x()
  jaxpr = jax.make_jaxpr(model.apply)(model.init(jax.random.key(0), x), x)
  converts = [
      (np.dtype(e.invars[0].aval.dtype), np.dtype(e.params["new_dtype"]))
      for e in all_eqns(jaxpr)
      if e.primitive.name == "convert_element_type"
  ]
  assert (F16, F32) in converts  # into the LayerNorm
  assert converts.count((F32, F16)) >= 5  # 4 Dense params + x + norm output


def test_lowered_hlo_dots_are_half():
  model = jlinen.apply_policy(MLP(), "mixed_bfloat16")
  x = _x()
  variables = model.init(jax.random.key(0), x)
  hlo = jax.jit(model.apply).lower(variables, x).as_text()
  dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 2
  for line in dots:
    operand_types = line.rsplit(":", 1)[1]
    assert "bf16" in operand_types and "f32" not in operand_types, line


@HALF
def test_remat_and_scan(half):
  model = jlinen.apply_policy(Deep(), jmp_lite.Policy(F32, half, F32))
  x = _x((2, 5))
  variables = model.init(jax.random.key(0), x)
  assert variables["params"]["stack"]["Dense_0"]["kernel"].shape == (3, 8, 8)

  def loss(params):
    return jnp.mean(model.apply({"params": params}, x) ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"])
  assert {interpreter_lib.kind_of(e) for e in all_eqns(jaxpr)} >= {
      "remat", "scan"}
  # Forward and backward matmuls, inside remat and scan too, all in half.
  assert_matmuls_in(jaxpr, half)
  assert set(reduce_dtypes(jax.make_jaxpr(loss)(variables["params"]))) == {F32}
  grads = jax.jit(jax.grad(loss))(variables["params"])
  assert set(_dtypes(grads).values()) == {F32}
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))


# ---------------------------------------------------------------------------
# Variables: dtypes in, dtypes out.
# ---------------------------------------------------------------------------


@HALF
def test_init_params_and_batch_stats_dtypes(half):
  mixed = jlinen.apply_policy(ConvNet(), jmp_lite.Policy(F32, half, F32))
  x = _x((2, 6, 6, 3))
  variables = mixed.init(jax.random.key(0), x, train=False)
  assert set(_dtypes(variables).values()) == {F32}

  pure = jlinen.apply_policy(ConvNet(), jmp_lite.Policy(half, half, half))
  variables = pure.init(jax.random.key(0), x, train=False)
  params = variables["params"]
  assert params["Conv_0"]["kernel"].dtype == half
  assert params["Dense_0"]["kernel"].dtype == half
  for norm in ("BatchNorm_0", "GroupNorm_0", "RMSNorm_0"):
    assert set(_dtypes(params[norm]).values()) == {F32}, norm
  assert set(_dtypes(variables["batch_stats"]).values()) == {F32}
  y = pure.apply(variables, x, train=False)
  assert y.dtype == half


@HALF
def test_mutable_batch_stats_stay_f32_and_update(half):
  model = jlinen.apply_policy(ConvNet(), jmp_lite.Policy(F32, half, F32))
  x = _x((2, 6, 6, 3))
  variables = model.init(jax.random.key(0), x, train=False)
  y, updates = jax.jit(
      lambda v, x, k: model.apply(
          v, x, train=True, rngs={"dropout": k}, mutable=["batch_stats"]
      )
  )(variables, x, jax.random.key(1))
  assert y.dtype == F32
  assert set(updates) == {"batch_stats"}
  assert set(_dtypes(updates).values()) == {F32}
  before = variables["batch_stats"]["BatchNorm_0"]["mean"]
  after = updates["batch_stats"]["BatchNorm_0"]["mean"]
  assert not np.allclose(before, after)


def test_mutable_intermediates_and_frozen_variables():
  class Sowing(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(4)(x)
      self.sow("intermediates", "hidden", h)
      return nn.Dense(1)(h)

  model = jlinen.apply_policy(Sowing(), "mixed_float16")
  x = _x()
  variables = freeze(model.init(jax.random.key(0), x))
  y, state = model.apply(variables, x, mutable=["intermediates"])
  assert y.dtype == F32
  assert state["intermediates"]["hidden"][0].dtype == F16


def test_dropout_rngs():
  model = jlinen.apply_policy(ConvNet(), "mixed_float16")
  x = _x((2, 6, 6, 3))
  variables = model.init(jax.random.key(0), x, train=False)

  def run(key):
    y, _ = model.apply(
        variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    return y

  np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
  assert not np.allclose(run(jax.random.key(1)), run(jax.random.key(2)))
  # Deterministic mode needs no dropout rng and mutates nothing.
  assert model.apply(variables, x, train=False).dtype == F32


def test_grads_come_back_in_stored_dtype_and_match_f32_closely():
  x = _x((16, 3))
  plain = MLP()
  variables = plain.init(jax.random.key(0), x)
  mixed = jlinen.apply_policy(plain, "mixed_bfloat16")

  def loss(apply, params):
    return jnp.mean(apply({"params": params}, x) ** 2)

  g_ref = jax.jit(jax.grad(lambda p: loss(plain.apply, p)))(variables["params"])
  g_mix = jax.jit(jax.grad(lambda p: loss(mixed.apply, p)))(variables["params"])
  assert set(_dtypes(g_mix).values()) == {F32}
  for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_mix)):
    np.testing.assert_allclose(a, b, rtol=0.1, atol=0.02)


def test_method_argument_and_reentrant_methods():
  model = jlinen.apply_policy(Encoder(), "mixed_float16")
  x = _x()
  variables = model.init(jax.random.key(0), x)
  # __call__ -> encode -> decode: no cast to the output dtype in the middle,
  # or strict promotion would reject f32 z + f16 decode(z).
  jaxpr = jax.make_jaxpr(model.apply)(variables, x)
  assert_matmuls_in(jaxpr, F16, expected_count=2)
  assert model.apply(variables, x).dtype == F32
  z = model.apply(variables, x, method="encode")
  assert z.dtype == F32 and z.shape == (4, 4)
  z = model.apply(variables, x, method=Encoder.encode)
  assert z.dtype == F32


# ---------------------------------------------------------------------------
# Training with loss scaling.
# ---------------------------------------------------------------------------


class Regressor(nn.Module):
  """A small regression MLP with a LayerNorm (for the training tests)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.LayerNorm()(nn.Dense(32)(x)))
    return nn.Dense(1)(x)


@pytest.mark.standard_promotion
@HALF
def test_train_steps_with_loss_scaling_adam(half):
  x = _x((32, 4))
  y = jnp.sum(x, axis=1, keepdims=True)
  model = jlinen.apply_policy(Regressor(), jmp_lite.Policy(F32, half, F32))
  variables = model.init(jax.random.key(0), x)
  params = variables["params"]
  opt = jmp_lite.loss_scaling(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(jnp.float32(2.0**15))
  )
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(p):
      return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(15):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert step._cache_size() == 1  # no recompilation
  assert set(_dtypes(params).values()) == {F32}
  # An f16 step may overflow at 2**15 and be skipped while the scale settles.
  assert int(opt_state.skipped_steps) <= 2 and bool(opt_state.last_finite)
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0]


def test_train_step_skips_overflow_in_f16_with_sgd():
  x = _x((8, 4))
  model = jlinen.apply_policy(Regressor(), "mixed_float16")
  params = model.init(jax.random.key(0), x)["params"]
  opt = jmp_lite.loss_scaling(
      optax.sgd(1e-2), jmp_lite.DynamicLossScale(jnp.float32(2.0**40))
  )
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
    _, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new_params, opt_state = step(params, opt_state)
  # 2**40 overflows f16 gradients: the step is skipped, the scale halves.
  assert int(opt_state.skipped_steps) == 1
  assert float(jmp_lite.get_loss_scale(opt_state).loss_scale) == 2.0**39
  jax.tree_util.tree_map(np.testing.assert_array_equal, new_params, params)


# ---------------------------------------------------------------------------
# Per-module overrides.
# ---------------------------------------------------------------------------


class TwoTower(nn.Module):
  @nn.compact
  def __call__(self, x):
    a = nn.Dense(4, name="encoder")(x)
    b = Tower(name="decoder")(a)
    return nn.Dense(2, name="head")(b)


class Tower(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="inner")(nn.LayerNorm(name="ln")(x))


def _matmul_dtype_by_shape(model, x):
  """``{kernel shape: dtype its dot sees}`` (kernels of distinct shapes)."""
  variables = model.init(jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(model.apply)(variables, x)
  return [d for _, d in operand_dtypes(jaxpr, ("dot_general",))]


def test_override_by_path_is_inherited_by_submodules():
  rules = jlinen.ModuleRules(("decoder", "p=f32,c=f32,o=f16")) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(TwoTower(), "mixed_float16", rules)
  assert _matmul_dtype_by_shape(model, _x()) == [(F16, F16), (F32, F32), (F16, F16)]
  policies = model.module_policies(model.init(jax.random.key(0), _x()), _x())
  assert str(policies["decoder/inner"]) == "p=full,c=full,o=full"  # inherited
  assert str(policies["decoder"]) == "p=full,c=full,o=f16"


def test_override_by_glob_and_regex():
  # Mid-model rules hand back the surrounding compute dtype (as FullPrecision).
  inner = "p=f32,c=f32,o=bf16"
  glob = jlinen.ModuleRules(("*/inner", inner)) + jlinen.DEFAULT_MODULE_RULES
  regex = jlinen.ModuleRules((re.compile(r"dec\w+/inner"), inner)) + jlinen.DEFAULT_MODULE_RULES
  for rules in (glob, regex):
    model = jlinen.apply_policy(TwoTower(), "mixed_bfloat16", rules)
    assert _matmul_dtype_by_shape(model, _x()) == [
        (BF16, BF16), (F32, F32), (BF16, BF16)
    ]


@pytest.mark.standard_promotion  # the next Dense mixes f32 inputs, bf16 kernel
def test_a_rule_output_dtype_flows_on_as_in_nnx():
  """Only boundaries cast (as in jmp_lite.nnx): a mid-model rule with float32
  outputs makes the next layer compute in float32 too."""
  rules = jlinen.ModuleRules(("*/inner", "f32")) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(TwoTower(), "mixed_bfloat16", rules)
  assert _matmul_dtype_by_shape(model, _x()) == [
      (BF16, BF16), (F32, F32), (F32, F32)
  ]


def test_override_by_class_and_first_match_wins():
  # All Dense layers in f32, except the head (the earlier rule wins).
  rules = jlinen.ModuleRules(
      ("head", "mixed_float16"), (nn.Dense, "f32")
  ) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(TwoTower(), "mixed_float16", rules)
  assert _matmul_dtype_by_shape(model, _x()) == [(F32, F32), (F32, F32), (F16, F16)]


# Flax's own norm layers are not strict-promotion clean with half inputs.
@pytest.mark.standard_promotion
def test_rules_can_send_a_norm_back_to_half():
  rules = jlinen.ModuleRules(("decoder/ln", "mixed_bfloat16")) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(TwoTower(), "mixed_bfloat16", rules)
  x = _x()
  jaxpr = jax.make_jaxpr(model.apply)(model.init(jax.random.key(0), x), x)
  # LayerNorm's statistics are upcast by Flax itself; its input now is bf16.
  ln_inputs = [
      np.dtype(e.invars[0].aval.dtype)
      for e in all_eqns(jaxpr)
      if e.primitive.name == "convert_element_type"
      and np.dtype(e.params["new_dtype"]) == F32
  ]
  assert BF16 in ln_inputs


def test_no_rules_means_norms_follow_the_policy():
  model = jlinen.apply_policy(MLP(), "p=bf16,c=bf16,o=bf16", module_rules=None)
  variables = model.init(jax.random.key(0), _x())
  assert set(_dtypes(variables).values()) == {BF16}


# ---------------------------------------------------------------------------
# Rules are static config.
# ---------------------------------------------------------------------------


def test_rules_are_immutable_hashable_and_static():
  a = jlinen.ModuleRules((nn.LayerNorm, jlinen.FullPrecision()), ("h*", "f32"))
  b = jlinen.ModuleRules((nn.LayerNorm, jlinen.FullPrecision()), ("h*", "p=f32"))
  assert a == b and hash(a) == hash(b)
  assert a != jlinen.ModuleRules(("h*", "f32"), (nn.LayerNorm, jlinen.FullPrecision()))
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.entries = ()
  assert isinstance(a.entries, tuple)
  assert a.entries[1] == ("h*", jmp_lite.get_policy("f32"))
  assert "LayerNorm" in repr(a) and "'h*'" in repr(a)

  m1 = jlinen.apply_policy(MLP(), "mixed_float16", a)
  m2 = jlinen.apply_policy(MLP(), jmp_lite.get_policy("p=f32,c=f16,o=f32"), b)
  assert m1 == m2 and hash(m1) == hash(m2)

  calls = []

  @jax.jit
  def forward(variables, x):
    return m1.apply(variables, x)

  def traced(model, variables, x):
    calls.append(model)
    return model.apply(variables, x)

  jitted = jax.jit(traced, static_argnums=0)
  x = _x()
  variables = m1.init(jax.random.key(0), x)
  jitted(m1, variables, x)
  jitted(m2, variables, x)  # equal static config: no retrace
  assert len(calls) == 1
  np.testing.assert_array_equal(forward(variables, x), jitted(m1, variables, x))


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def test_rule_class_that_is_not_a_module():
  with pytest.raises(TypeError, match=r"builtins\.int is not a flax\.linen module class"):
    jlinen.ModuleRules((int, "f32"))
  with pytest.raises(TypeError, match="pass the class LayerNorm itself"):
    jlinen.ModuleRules((nn.LayerNorm(), "f32"))
  with pytest.raises(TypeError, match=r"jmp_lite\.nnx\.ModuleRules"):
    jlinen.ModuleRules((nnx.LayerNorm, "f32"))
  with pytest.raises(TypeError, match=r"\(match, policy\) pair"):
    jlinen.ModuleRules(nn.LayerNorm)
  with pytest.raises(TypeError, match=r"FullPrecision\(\)"):
    jlinen.ModuleRules((nn.LayerNorm, jlinen.FullPrecision))
  with pytest.raises(TypeError, match=r"tuple: \(\) is not.*non-empty tuple"):
    jlinen.ModuleRules(((), "f32"))


@pytest.mark.parametrize("pattern", [b"Dense_0", re.compile(b"Dense_\\d")])
def test_bytes_pattern_is_refused_when_the_rules_are_built(pattern):
  """A bytes regex used to pass until init (re raised on the first match)."""
  with pytest.raises(TypeError, match=(
      r"entry 0: (b'Dense_0'|re\.compile\(b'Dense_\\\\d'\)) is a bytes "
      r"pattern.*must be a str.*module type")):
    jlinen.ModuleRules((pattern, "f32"))


def test_full_precision_resolve_takes_a_policy():
  with pytest.raises(TypeError, match=r"FullPrecision\.resolve\(outer\) takes a "
                     r"jmp_lite\.Policy, got int: 3"):
    jlinen.FullPrecision().resolve(3)


def test_policy_strings_that_do_not_parse():
  with pytest.raises(ValueError, match=r"entry 0 \('dec/\*'\).*'f17'.*Valid dtype names"):
    jlinen.ModuleRules(("dec/*", "p=f32,c=f17"))
  with pytest.raises(ValueError, match=r"unknown key 'compute_dtype'"):
    jlinen.apply_policy(MLP(), "compute_dtype=f16")


def test_wrong_framework_and_wrong_objects():
  with pytest.raises(TypeError, match=r"jmp_lite\.nnx\.apply_policy"):
    jlinen.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_float16")
  with pytest.raises(TypeError, match=r"Pass an instance, e\.g\. MLP\(\.\.\.\)"):
    jlinen.apply_policy(MLP, "mixed_float16")
  with pytest.raises(
      TypeError,
      match=r"got jmp_lite\.nnx\.ModuleRules.*models need jmp_lite\.linen\.ModuleRules",
  ):
    jlinen.apply_policy(MLP(), "mixed_float16", jnnx.DEFAULT_MODULE_RULES)
  with pytest.raises(TypeError, match="Cannot combine"):
    _ = jlinen.DEFAULT_MODULE_RULES + jnnx.DEFAULT_MODULE_RULES


def test_pattern_matching_nothing_warns_and_can_be_silenced():
  rules = jlinen.ModuleRules(("decodr/*", "f32")) + jlinen.DEFAULT_MODULE_RULES
  model = jlinen.apply_policy(TwoTower(), "mixed_float16", rules)
  x = _x()
  with pytest.warns(jlinen.UnmatchedRuleWarning, match=r"'decodr/\*'.*'decoder/inner'"):
    variables = model.init(jax.random.key(0), x)
  with pytest.warns(jlinen.UnmatchedRuleWarning):
    model.apply(variables, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=jlinen.UnmatchedRuleWarning)
    model.apply(variables, x)
  # Class rules matching nothing (no BatchNorm here) never warn.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jlinen.apply_policy(TwoTower(), "mixed_float16").apply(variables, x)


def test_pattern_for_params_of_unused_method_does_not_warn():
  model = jlinen.apply_policy(
      Encoder(), "mixed_float16", jlinen.ModuleRules(("dec", "f32"))
  )
  variables = model.init(jax.random.key(0), _x())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model.apply(variables, _x(), method="encode")  # 'dec' owns params


@pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
def test_half_params_under_f32_param_policy(half):
  model = jlinen.apply_policy(MLP(), "mixed_float16")
  x = _x()
  variables = model.init(jax.random.key(0), x)
  halved = {"params": jmp_lite.Policy(half, half, half).cast_to_param(variables["params"])}
  with pytest.raises(ValueError, match=(
      rf"param 'Dense_0/bias' is stored in {half.name} \(5 other param\(s\) too\)"
      r".*stores params in float32.*policy_model\.init.*p=f16,c=f16,o=f16")):
    model.apply(halved, x)
  # Wider params than the policy asks for are fine.
  pure = jlinen.apply_policy(MLP(), "p=bf16,c=bf16,o=bf16")
  assert pure.apply(variables, x).dtype == BF16


# ---------------------------------------------------------------------------
# Documentation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", jlinen.__all__)
def test_public_names_documented_with_examples(name):
  assert_documented_with_examples(jlinen, name)
