"""Tests of jmp_lite.nnx: precision policies on Flax NNX models.

Precision is asserted on the jaxpr of the split/merged model (every
``dot_general``/``conv_general_dilated`` operand, every norm reduction), not
inferred from outputs.
"""

import re
import warnings

from flax import nnx
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

import helpers
from helpers import all_eqns
from helpers import assert_all_f32
from helpers import assert_documented_with_examples
from helpers import full_precision_windows

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
MATMULS = ("dot_general", "conv_general_dilated")


# ---------------------------------------------------------------------------
# Jaxpr inspection.
# ---------------------------------------------------------------------------


def operand_dtypes(jaxpr, primitives):
  return [dtypes for _, dtypes in helpers.operand_dtypes(jaxpr, primitives)]


def matmul_dtypes(jaxpr):
  return operand_dtypes(jaxpr, MATMULS)


def reduce_dtypes(jaxpr):
  return [d[0] for d in operand_dtypes(jaxpr, ("reduce_sum",))]


def forward_jaxpr(module, *args):
  """The jaxpr of ``module(*args)`` as a pure function of its state."""
  graphdef, state = nnx.split(module)
  return jax.make_jaxpr(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)


def _dtypes(tree):
  return {
      jax.tree_util.keystr(p): np.dtype(x.dtype)
      for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]
  }


def _x(shape=(4, 3), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------


class MLP(nnx.Module):
  """Linear -> LayerNorm -> relu -> Linear: the only reductions are the norm's."""

  def __init__(self, rngs, din=3, hidden=8):
    self.dense = nnx.Linear(din, hidden, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.norm(self.dense(x))))

  def encode(self, x):
    return self.dense(x)


class ConvNet(nnx.Module):
  """Conv -> BatchNorm -> Dropout -> GroupNorm -> RMSNorm -> Linear."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.gn = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.rms = nnx.RMSNorm(8, rngs=rngs)
    self.out = nnx.Linear(6 * 6 * 8, 3, rngs=rngs)

  def __call__(self, x):
    x = self.drop(nnx.relu(self.bn(self.conv(x))))
    x = self.rms(self.gn(x))
    return self.out(x.reshape((x.shape[0], -1)))


class Block(nnx.Module):

  def __init__(self, rngs, width=8):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.dense = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return x + nnx.gelu(self.dense(self.norm(x)))


class Deep(nnx.Module):
  """An nnx.remat'ed block and an nnx.scan over vmapped (stacked) blocks."""

  def __init__(self, rngs):
    self.inp = nnx.Linear(5, 8, rngs=rngs)
    self.remat_block = Block(rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.stack = make(rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    x = nnx.remat(lambda block, x: block(x))(self.remat_block, x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.out(body(x, self.stack))


class Towers(nnx.Module):
  """Layers in an nnx.List, for path rules with list indices."""

  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


# ---------------------------------------------------------------------------
# Precision where it should be.
# ---------------------------------------------------------------------------


@HALF
def test_mlp_matmuls_in_compute_dtype_and_norm_stats_in_f32(half):
  model = jnnx.apply_policy(MLP(nnx.Rngs(0)), jmp_lite.Policy(F32, half, F32))
  x = _x()
  jaxpr = forward_jaxpr(model, x)
  assert matmul_dtypes(jaxpr) == [(half, half)] * 2
  assert reduce_dtypes(jaxpr) == [F32, F32]  # LayerNorm's mean, mean square
  # The whole LayerNorm (statistics, scale, bias) runs in f32 between a cast
  # of its input up and of its output back down.
  (window,) = full_precision_windows(jaxpr, half)
  assert_all_f32(window)
  assert model(x).dtype == F32


@HALF
def test_convnet_every_conv_and_dot_in_compute_dtype_norms_in_f32(half):
  model = jnnx.apply_policy(ConvNet(nnx.Rngs(0)), jmp_lite.Policy(F32, half, F32))
  jaxpr = forward_jaxpr(model, _x((2, 6, 6, 3)))
  assert matmul_dtypes(jaxpr) == [(half, half)] * 2
  reductions = reduce_dtypes(jaxpr)
  # BatchNorm, GroupNorm (mean, mean of squares) and RMSNorm (mean square).
  assert len(reductions) == 5 and set(reductions) == {F32}
  windows = full_precision_windows(jaxpr, half)
  assert len(windows) == 3  # BatchNorm, GroupNorm, RMSNorm
  for window in windows:
    assert_all_f32(window)


@HALF
def test_remat_and_scan_inside_the_model(half):
  model = jnnx.apply_policy(Deep(nnx.Rngs(0)), jmp_lite.Policy(F32, half, F32))
  x = _x((2, 5))
  assert model.module.stack.dense.kernel.shape == (3, 8, 8)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  assert {interpreter_lib.kind_of(e) for e in all_eqns(jaxpr)} >= {
      "remat", "scan"}
  found = matmul_dtypes(jaxpr)
  assert found and set(found) == {(half, half)}  # forward and backward
  assert set(reduce_dtypes(jax.make_jaxpr(loss)(params))) == {F32}
  grads = jax.jit(jax.grad(loss))(params)
  assert set(_dtypes(grads).values()) == {F32}
  assert bool(jmp_lite.all_finite(nnx.to_pure_dict(grads)))


# ---------------------------------------------------------------------------
# No surprising mutation; state.
# ---------------------------------------------------------------------------


def test_module_is_not_changed_and_variables_are_shared():
  module = MLP(nnx.Rngs(0))
  graphdef_before = nnx.graphdef(module)
  kernel_before = module.dense.kernel[...]
  model = jnnx.apply_policy(module, "mixed_float16")
  assert model.module is module
  model(_x())
  with pytest.raises(TypeError):
    model(_x((4, 5)))  # wrong input size: fails inside the forward pass
  # The module keeps its structure, classes, attributes and dtypes.
  assert nnx.graphdef(module) == graphdef_before
  assert type(module.norm) is nnx.LayerNorm
  assert module.dense.dtype is None and module.dense.kernel.dtype == F32
  np.testing.assert_array_equal(module.dense.kernel[...], kernel_before)
  # Variables are shared: updating the policy module updates the module.
  grads = nnx.grad(lambda m: jnp.sum(m(_x()) ** 2))(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  optimizer.update(model, grads)
  assert not np.allclose(module.dense.kernel[...], kernel_before)
  assert module.dense.kernel.dtype == F32


@HALF
def test_batch_stats_and_rng_state_advance_in_their_dtypes(half):
  module = ConvNet(nnx.Rngs(0))
  model = jnnx.apply_policy(module, jmp_lite.Policy(F32, half, F32))
  x = _x((2, 6, 6, 3))
  y1 = model(x)
  y2 = model(x)
  assert y1.dtype == F32
  assert not np.allclose(y1, y2)  # a new dropout mask each call
  assert int(module.drop.rngs.count[...]) == 2
  assert module.bn.mean.dtype == F32 and module.bn.var.dtype == F32
  assert not np.allclose(module.bn.mean[...], 0.0)
  assert set(_dtypes(nnx.state(module, nnx.BatchStat)).values()) == {F32}
  model.eval()  # NNX's own mode switch reaches the wrapped module
  np.testing.assert_array_equal(model(x), model(x))


def test_rngs_passed_as_argument_are_not_copied():
  class Noisy(nnx.Module):

    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 3, rngs=rngs)
      self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
      return self.drop(self.dense(x), rngs=rngs)

  model = jnnx.apply_policy(Noisy(nnx.Rngs(0)), "mixed_float16")
  rngs = nnx.Rngs(dropout=1)
  a = model(_x(), rngs)
  b = model(_x(), rngs)
  assert int(rngs.dropout.count[...]) == 2
  assert not np.allclose(a, b)


def test_call_method_and_module_policies():
  model = jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_bfloat16")
  x = _x()
  for method in ("encode", MLP.encode):
    z = model.call_method(method, x)
    assert z.dtype == F32 and z.shape == (4, 8)
  policies = {k: str(v) for k, v in model.module_policies().items()}
  assert policies == {
      "": "p=full,c=bf16,o=full",
      "dense": "p=full,c=bf16,o=bf16",
      "norm": "p=full,c=full,o=bf16,m=f32",
      "head": "p=full,c=bf16,o=bf16",
  }


def test_a_rule_matching_the_model_itself_keeps_the_output_dtype():
  model = jnnx.apply_policy(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), "mixed_bfloat16")
  assert model(_x((2, 4))).dtype == F32
  assert str(model.module_policies()[""]) == "p=full,c=full,o=bf16,m=f32"


# ---------------------------------------------------------------------------
# Training: nnx.jit, nnx.grad, nnx.Optimizer with loss scaling.
# ---------------------------------------------------------------------------


@pytest.mark.standard_promotion
@HALF
def test_train_steps_with_optimizer_and_loss_scaling_adam(half):
  x = _x((32, 3))
  y = jnp.sum(x, axis=1, keepdims=True)
  module = MLP(nnx.Rngs(0), hidden=32)
  model = jnnx.apply_policy(module, jmp_lite.Policy(F32, half, F32))
  tx = jmp_lite.loss_scaling(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(jnp.float32(2.0**15))
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  traces = []

  @nnx.jit
  def step(model, optimizer, x, y):
    traces.append(1)
    loss_scale = jmp_lite.get_loss_scale(optimizer.opt_state)

    def loss_fn(model):
      loss = jnp.mean((model(x) - y) ** 2)
      return loss_scale.scale(loss), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, x, y)) for _ in range(15)]
  assert len(traces) == 1  # no recompilation
  state = optimizer.opt_state  # The LossScaleState.
  assert int(state.skipped_steps) <= 2 and bool(state.last_finite)
  assert set(_dtypes(nnx.state(module, nnx.Param)).values()) == {F32}
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0]


def test_overflowing_f16_step_is_skipped_with_sgd():
  module = MLP(nnx.Rngs(0))
  model = jnnx.apply_policy(module, "mixed_float16")
  tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(jnp.float32(2.0**40)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  before = nnx.to_pure_dict(nnx.state(module, nnx.Param))

  @nnx.jit
  def step(model, optimizer, x):
    loss_scale = jmp_lite.get_loss_scale(optimizer.opt_state)
    grads = nnx.grad(lambda m: loss_scale.scale(jnp.mean(m(x) ** 2)))(model)
    optimizer.update(model, grads)

  step(model, optimizer, _x())
  state = optimizer.opt_state  # The LossScaleState.
  assert int(state.skipped_steps) == 1
  assert float(state.loss_scale.loss_scale) == 2.0**39
  after = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  jax.tree_util.tree_map(np.testing.assert_array_equal, after, before)


# ---------------------------------------------------------------------------
# Per-module overrides.
# ---------------------------------------------------------------------------


def test_override_by_path_with_list_indices():
  rules = jnnx.ModuleRules(("blocks/1", jnnx.FullPrecision())) + jnnx.DEFAULT_MODULE_RULES
  model = jnnx.apply_policy(Towers(nnx.Rngs(0)), "mixed_float16", rules)
  assert matmul_dtypes(forward_jaxpr(model, _x((2, 8)))) == [
      (F16, F16), (F32, F32), (F16, F16), (F16, F16)
  ]
  policies = model.module_policies()
  assert str(policies["blocks/1/dense"]) == "p=full,c=full,o=full,m=f32"  # inherited
  assert str(policies["blocks/0/dense"]) == "p=full,c=f16,o=f16"


def test_override_by_class_regex_and_first_match_wins():
  rules = jnnx.ModuleRules(
      (re.compile(r"blocks/[2-9]/d\w+"), "p=f32,c=bf16,o=bf16"),  # wins
      (nnx.Linear, "p=f32,c=f32,o=bf16"),
  ) + jnnx.DEFAULT_MODULE_RULES
  model = jnnx.apply_policy(Towers(nnx.Rngs(0)), "mixed_bfloat16", rules)
  assert matmul_dtypes(forward_jaxpr(model, _x((2, 8)))) == [
      (F32, F32), (F32, F32), (BF16, BF16), (F32, F32)
  ]


def test_no_rules_and_rule_sets_are_static_config():
  a = jnnx.ModuleRules((nnx.LayerNorm, jnnx.FullPrecision()), ("head", "f32"))
  b = jnnx.ModuleRules((nnx.LayerNorm, jnnx.FullPrecision()), ("head", "p=f32"))
  assert a == b and hash(a) == hash(b)
  model_a = jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_float16", a)
  model_b = jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_float16", b)
  assert nnx.graphdef(model_a) == nnx.graphdef(model_b)
  assert hash(nnx.graphdef(model_a)) == hash(nnx.graphdef(model_b))
  bare = jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_float16", module_rules=None)
  assert str(bare.module_policies()["norm"]) == "p=full,c=f16,o=f16"


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@HALF
def test_half_params_under_f32_param_policy(half):
  module = MLP(nnx.Rngs(0))
  module.dense = nnx.Linear(3, 8, param_dtype=half, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=(
      rf"param 'dense/bias' is stored in {half.name} \(1 other param\(s\) too\)"
      r".*stores params in float32.*param_dtype=jnp\.float32.*p=f16,c=f16,o=f16")):
    jnnx.apply_policy(module, "mixed_float16")
  # Half params are fine under a policy that stores params in half.
  model = jnnx.apply_policy(module, jmp_lite.Policy(half, half, F32))
  assert model(_x()).dtype == F32


def test_wrong_objects_and_frameworks():
  with pytest.raises(TypeError, match=r"jmp_lite\.linen\.apply_policy"):
    jnnx.apply_policy(nn.Dense(3), "mixed_float16")
  with pytest.raises(TypeError, match=r"Pass an instance"):
    jnnx.apply_policy(MLP, "mixed_float16")
  model = jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_float16")
  with pytest.raises(TypeError, match=r"already has a policy.*policy_module\.module"):
    jnnx.apply_policy(model, "mixed_bfloat16")
  with pytest.raises(TypeError, match=(
      r"flax\.linen\.normalization\.LayerNorm is not a flax\.nnx module class"
      r".*jmp_lite\.linen")):
    jnnx.ModuleRules((nn.LayerNorm, "f32"))
  with pytest.raises(TypeError, match=r"builtins\.str.*not a flax\.nnx module class"):
    jnnx.ModuleRules(((nnx.Linear, str), "f32"))
  with pytest.raises(TypeError, match=r"re\.compile\(b'Linear'\) is a bytes "
                     r"pattern.*must be a str"):
    jnnx.ModuleRules((re.compile(b"Linear"), "f32"))
  with pytest.raises(TypeError, match=r"got jmp_lite\.linen\.ModuleRules"):
    jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_float16", jlinen.DEFAULT_MODULE_RULES)
  with pytest.raises(ValueError, match=r"Unknown dtype or preset 'mixed_f16'"):
    jnnx.apply_policy(MLP(nnx.Rngs(0)), "mixed_f16")
  with pytest.raises(ValueError, match=r"entry 0 \(Linear\).*unknown key 'x'"):
    jnnx.ModuleRules((nnx.Linear, "x=f16"))


def test_pattern_matching_nothing_warns_and_can_be_silenced():
  rules = jnnx.ModuleRules(("blocks/3/*", "f32"))
  with pytest.warns(jnnx.UnmatchedRuleWarning, match=r"'blocks/3/\*'.*'blocks/2/dense'"):
    jnnx.apply_policy(Towers(nnx.Rngs(0)), "mixed_float16", rules)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=jnnx.UnmatchedRuleWarning)
    jnnx.apply_policy(Towers(nnx.Rngs(0)), "mixed_float16", rules)
    jnnx.apply_policy(Towers(nnx.Rngs(0)), "mixed_float16", jnnx.ModuleRules(
        ("blocks/2/*", "f32"), (nnx.BatchNorm, "f32")))  # class rules never warn


# ---------------------------------------------------------------------------
# Documentation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", jnnx.__all__)
def test_public_names_documented_with_examples(name):
  assert_documented_with_examples(jnnx, name)


def test_get_loss_scale_unwraps_nnx_optimizer_state():
  """get_loss_scale(optimizer.opt_state) gives plain arrays, not NNX variables."""
  module = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      module,
      jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0)),
      wrt=nnx.Param,
  )
  loss_scale = jmp_lite.get_loss_scale(optimizer.opt_state)
  assert isinstance(loss_scale, jmp_lite.DynamicLossScale)
  assert isinstance(loss_scale.loss_scale, jax.Array)
  assert float(loss_scale.loss_scale) == 8.0
  assert loss_scale.loss_scale.dtype == jnp.float32
