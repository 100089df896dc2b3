"""Float8 in the Flax policies: which dots run in float8 (linen, NNX, per
module), delayed scaling's state (creation, rolling, evaluation, scan/remat,
gradient accumulation, checkpoints, optimizers), exported programs, training.
"""

import functools

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx

from helpers import orbax_round_trip
from test_fp8_policy import assert_no_host_calls
from test_fp8_policy import cuda_ops
from test_fp8_policy import cuda_program
from test_fp8_policy import fp8_counts
from test_fp8_policy import jaxpr_dots
from helpers import default_run_keeps

E4, BF = ("float8_e4m3fn",) * 2, ("bfloat16",) * 2
DELAYED = "p=f32,c=bf16,o=f32,m=fp8_delayed"
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)),
                jnp.float32)
Y = jnp.arange(16) % 16


def amaxes(bits):
  """The float32 amaxes a stored history (uint32 bit patterns) holds."""
  return np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float32))


def bits(tree, value):
  """A state like ``tree`` whose every history slot holds ``value``."""
  return jax.tree.map(lambda h: jax.lax.bitcast_convert_type(
      jnp.full(h.shape, value, jnp.float32), jnp.uint32), tree)


def xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------------------
# linen
# ---------------------------------------------------------------------------


class Block(nn.Module):

  @nn.compact
  def __call__(self, carry, _):
    return nn.relu(nn.Dense(32)(carry)), None


class LM(nn.Module):
  """Dense, LayerNorm, a scan over two layers, a remat'd Dense, the head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, name="inp")(x)
    x = nn.LayerNorm(name="norm")(x)
    # 'fp8_state' scanned like the params: one history per iteration.
    x, _ = nn.scan(Block, variable_axes={"params": 0, "fp8_state": 0},
                   split_rngs={"params": True}, length=2)(name="blocks")(x, None)
    x = nn.remat(nn.Dense)(32, name="mid")(x)
    return nn.Dense(16, name="head")(x)


@functools.lru_cache(maxsize=None)
def linen_model(policy, rules=None):
  """(model, variables), made once per policy; ``init`` runs jitted (the
  eager ``init`` of a policy model runs in the tests that build their own)."""
  model = jlinen.apply_policy(
      LM(), policy, jlinen.DEFAULT_MODULE_RULES if rules is None else rules)
  return model, jax.jit(model.init)(jax.random.key(0), X)


@functools.lru_cache(maxsize=None)
def linen_apply(policy, mutable=False):
  """``linen_model(policy)``'s ``apply`` jitted, made once per policy: rolling
  the float8 state (``mutable=("fp8_state",)``) or reading it. The eager
  ``apply`` runs in the tests of errors, of a restored history and of adamw."""
  model, _ = linen_model(policy)
  return jax.jit(functools.partial(model.apply, mutable=mutable))


ROLL = ("fp8_state",)


def linen_step(model, opt):
  """A train step: loss scaling + the optimizer on params, state rolled."""
  def step(variables, opt_state, x, y):
    def loss(params):
      logits, updates = model.apply({**variables, "params": params}, x,
                                    mutable=["fp8_state"])
      return xent(logits, y), updates
    (value, updates), grads = jmp_lite.scaled_value_and_grad(
        loss, opt_state, has_aux=True)(variables["params"])
    deltas, opt_state = opt.update(grads, opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], deltas)
    return {**variables, **updates, "params": params}, opt_state, value
  return step


def test_linen_dots_in_float8_but_the_head():
  model, variables = linen_model("mixed_fp8")
  assert set(variables) == {"params"}  # current scaling: no state
  # inp, the scan body, mid in float8; the head in bf16; LayerNorm has none.
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [E4] * 3 + [BF]


def test_linen_module_rules_choose_per_module():
  rules = (jlinen.ModuleRules(("mid", "p=f32,c=bf16,o=bf16,m=fp8"))
           + jlinen.DEFAULT_MODULE_RULES)
  model, variables = linen_model("mixed_bfloat16", rules)
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [BF, BF, E4, BF]
  # The recipe asks for the head too; a rule keeps it out, and FullPrecision
  # (norm layers by default) resolves to no float8.
  rules = (jlinen.ModuleRules(("head", "mixed_bfloat16"),
                              ("inp", jlinen.FullPrecision()))
           + jlinen.DEFAULT_MODULE_RULES)
  model, variables = linen_model(
      "p=f32,c=bf16,o=f32,m=fp8(include_output_head=true)", rules)
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [
      ("float32",) * 2, E4, E4, BF]


@pytest.mark.standard_promotion
@pytest.mark.parametrize("policy", default_run_keeps(["mixed_fp8", DELAYED]))
def test_linen_exported_cuda_step(policy):
  model, variables = linen_model(policy)
  opt = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.NoOpLossScale())
  text = cuda_program(linen_step(model, opt), variables,
                      opt.init(variables["params"]), X, Y)
  dots = cuda_ops(text)
  # Forward: inp, the scan body, mid (e4m3 x e4m3). Backward: inp's weight
  # gradient (X is no parameter), the scan body's and mid's two products,
  # all from the e5m2 gradient. Every float8 dot accumulates in float32.
  assert fp8_counts(dots) == (3, 5)
  assert all(r == "f32" for d, r in dots if d[0].startswith("f8"))
  assert [d for d, _ in dots if not d[0].startswith("f8")] == [
      ("bf16", "bf16")] * 3  # the head, forward and backward
  assert_no_host_calls(text)


# -- delayed scaling's state ------------------------------------------------------


def test_linen_init_creates_one_history_per_site():
  _, variables = linen_model(DELAYED)
  state = variables["fp8_state"]
  shapes = jax.tree.map(jnp.shape, state)
  # One entry per float8 layer, at the layer's own path (the head has none).
  assert shapes == {
      "inp": {"lhs": (16,), "rhs": (16,)},
      "mid": {"lhs": (16,), "rhs": (16,)},
      # The scan over two layers: one slot per iteration.
      "blocks": {"Dense_0": {"lhs": (2, 16), "rhs": (2, 16)}},
  }
  assert all(not np.any(leaf) for leaf in jax.tree.leaves(state))
  # Bit patterns of float32 amaxes: no optimizer can step them.
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {np.dtype("uint32")}


def test_linen_apply_rolls_when_mutable_and_reads_otherwise():
  _, variables = linen_model(DELAYED)
  roll, apply = linen_apply(DELAYED, ROLL), linen_apply(DELAYED)
  y, updates = roll(variables, X)
  assert set(updates) == {"fp8_state"}
  state = jax.tree.map(amaxes, updates["fp8_state"])
  inp = state["inp"]
  x_bf16 = X.astype(jnp.bfloat16).astype(jnp.float32)
  kernel = variables["params"]["inp"]["kernel"].astype(jnp.bfloat16)
  assert float(inp["lhs"][0]) == float(jnp.max(jnp.abs(x_bf16)))
  assert float(inp["rhs"][0]) == float(jnp.max(jnp.abs(kernel)).astype(
      jnp.float32))
  assert not np.any(inp["lhs"][1:])
  slots = state["blocks"]["Dense_0"]["lhs"]
  assert slots[0, 0] != slots[1, 0] and not np.any(slots[:, 1:])
  # The first step had no history: current scaling, exactly.
  np.testing.assert_array_equal(y, linen_apply("mixed_fp8")(variables, X))
  # Rolling again pushes the new amaxes in front.
  _, again = roll({**variables, **updates}, X)
  rolled = amaxes(again["fp8_state"]["inp"]["lhs"])
  np.testing.assert_array_equal(rolled[:2], [inp["lhs"][0]] * 2)
  # Evaluation reads: no state back. A history whose max is far above the
  # data makes coarser scales, so the output changes; the history of this
  # very step reproduces current scaling.
  read = {**variables, **updates}
  assert isinstance(apply(read, X), jax.Array)
  np.testing.assert_array_equal(apply(read, X), y)
  huge = {**variables, "fp8_state": bits(read["fp8_state"], 1e4)}
  assert not np.array_equal(apply(huge, X), y)


@pytest.mark.parametrize("margin", default_run_keeps([0, 2, 8]))
def test_linen_delayed_margin_and_algorithm(margin):
  policy = ("p=f32,c=bf16,o=f32,m=fp8_delayed(amax_algorithm=most_recent;"
            f"margin={margin})")
  _, variables = linen_model(policy)
  _, updates = linen_apply(policy, ROLL)(variables, X)
  # most_recent: the large older entries are ignored, so with no margin the
  # scales are current scaling's, exactly.
  big = jax.lax.bitcast_convert_type(jnp.float32(1e6), jnp.uint32)
  old = jax.tree.map(lambda h: h.at[..., 1:].set(big), updates["fp8_state"])
  out = linen_apply(policy)({**variables, "fp8_state": old}, X)
  # A margin multiplies the (power-of-two) scales by 2**margin: every value
  # moves down by whole binades, which changes no rounding while it stays in
  # e4m3's normal range (>= 2**-6): margin 2 leaves this data's output
  # bitwise unchanged; margin 8 pushes the small values into subnormals.
  same = np.array_equal(out, linen_apply("mixed_fp8")(variables, X))
  assert same == (margin < 8)


def test_linen_state_errors():
  model, variables = linen_model(DELAYED)
  with pytest.raises(ValueError, match="'fp8_state' collection.*have none.*"
                     "policy_model.init"):
    model.apply({"params": variables["params"]}, X)
  partial = {**variables, "fp8_state": {"mid": variables["fp8_state"]["mid"]}}
  with pytest.raises(ValueError, match="no amax history for the matmul at "
                     "inp"):
    model.apply(partial, X)
  # Delayed-scaling state handed to an optimizer.
  opt = jmp_lite.loss_scaling(optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"float8 state at \['fp8_state'\]"
                     r"\['blocks'\].*variables\['params'\]"):
    opt.init(variables)


HEAD = "p=f32,c=bf16,o=f32,m=fp8_delayed(include_output_head=true)"


@pytest.mark.standard_promotion
def test_linen_delayed_recipe_with_the_head_inits_applies_and_trains():
  """Issue 36, item 3: init kept no history for the head whatever the
  recipe said, and every apply then failed blaming the user."""
  model, variables = linen_model(HEAD)
  assert set(variables["fp8_state"]) == {"inp", "mid", "blocks", "head"}
  assert jax.tree.map(jnp.shape, variables["fp8_state"]["head"]) == {
      "lhs": (16,), "rhs": (16,)}
  # Every dot in float8, the head's included.
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [E4] * 4
  opt = jmp_lite.loss_scaling(optax.adam(1e-3),
                              jmp_lite.DynamicLossScale(jnp.float32(2**15)))
  opt_state = opt.init(variables["params"])
  step = jax.jit(linen_step(model, opt))
  for _ in range(2):
    variables, opt_state, value = step(variables, opt_state, X, Y)
    assert np.isfinite(float(value))
  head = amaxes(variables["fp8_state"]["head"]["lhs"])
  assert head[0] > 0 and head[1] > 0 and not np.any(head[2:])
  # The error now fires for a real mistake only: a state made under the
  # default recipe (no history for the head) handed to this one.
  _, default = linen_model(DELAYED)
  with pytest.raises(ValueError, match="no amax history for the matmul at "
                     "head.*include_output_head=False"):
    model.apply(default, X)


@pytest.mark.standard_promotion
def test_linen_plain_optax_loop_keeps_the_state_intact():
  """The loop of Flax's docs: the optimizer sees variables['params'] only."""
  model, variables = linen_model(DELAYED)
  opt = optax.adam(1e-2)
  opt_state = opt.init(variables["params"])
  traces = []

  @jax.jit
  def step(variables, opt_state, x):
    traces.append(1)
    def loss(params):
      out, updates = model.apply({**variables, "params": params}, x,
                                 mutable=["fp8_state"])
      return xent(out, Y), updates
    (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(
        variables["params"])
    deltas, opt_state = opt.update(grads, opt_state)
    return ({**variables, **updates,
             "params": optax.apply_updates(variables["params"], deltas)},
            opt_state, value)

  seen = []
  for i in range(3):
    x = X * (i + 1)
    seen.append(float(jnp.max(jnp.abs(x.astype(jnp.bfloat16)))))
    variables, opt_state, _ = step(variables, opt_state, x)
  history = amaxes(variables["fp8_state"]["inp"]["lhs"])
  np.testing.assert_array_equal(history[:4], seen[::-1] + [0.0])
  assert traces == [1]  # no recompilation on the second step


@pytest.mark.standard_promotion
@pytest.mark.parametrize("accumulate", default_run_keeps(["loss_scaling", "optax.MultiSteps"]))
def test_linen_accumulation_history_covers_every_micro_batch(accumulate):
  model, variables = linen_model(DELAYED)
  k = 4
  if accumulate == "loss_scaling":
    opt = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.NoOpLossScale(),
                                accumulation_steps=k)
    step = jax.jit(linen_step(model, opt))
  else:
    opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k)

    @jax.jit
    def step(variables, opt_state, x, y):
      def loss(params):
        out, updates = model.apply({**variables, "params": params}, x,
                                   mutable=["fp8_state"])
        return xent(out, y), updates
      (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(
          variables["params"])
      deltas, opt_state = opt.update(grads, opt_state, variables["params"])
      return ({**variables, **updates,
               "params": optax.apply_updates(variables["params"], deltas)},
              opt_state, value)
  opt_state = opt.init(variables["params"])
  scales = [1.0, 8.0, 2.0, 0.5]  # the micro-batches' magnitudes
  for s in scales:
    variables, opt_state, _ = step(variables, opt_state, X * s, Y)
  history = amaxes(variables["fp8_state"]["inp"]["lhs"])
  expected = [float(jnp.max(jnp.abs((X * s).astype(jnp.bfloat16))))
              for s in scales[::-1]]
  np.testing.assert_array_equal(history[:k], expected)
  # With the default "max" over 16 >= k entries, the next scale covers the
  # largest micro-batch of the window.
  assert float(jnp.max(history)) == max(expected)


def test_linen_state_checkpoint_round_trip(tmp_path):
  _, variables = linen_model(DELAYED)
  _, updates = linen_apply(DELAYED, ROLL)(variables, X)
  variables = {**variables, **updates}
  restored = orbax_round_trip(variables, tmp_path / "ckpt")
  jax.tree.map(np.testing.assert_array_equal, restored, variables)
  apply = linen_apply(DELAYED)
  np.testing.assert_array_equal(apply(restored, X), apply(variables, X))


def test_linen_raw_matmul_stays_as_written_unless_opted_in():
  """Float8 reaches layers through their dot_general hook: a raw `x @ w` in
  a custom module stays in the compute dtype; the module opts it in with
  with_policy (current scaling) or by using nn.Dense."""

  class Custom(nn.Module):
    opt_in: bool = False

    @nn.compact
    def __call__(self, x):
      w = self.param("inner", nn.initializers.lecun_normal(), (32, 32))
      matmul = lambda x, w: x @ w
      if self.opt_in:
        matmul = jmp_lite.with_policy(  # its only matmul is no head here
            matmul, "p=f32,c=bf16,o=f32,m=fp8(include_output_head=true)")
      x = matmul(x, w).astype(x.dtype)
      return nn.Dense(16, name="head")(nn.Dense(32, name="outer")(x))

  for opt_in, first in ((False, BF), (True, E4)):
    model = jlinen.apply_policy(Custom(opt_in), DELAYED)
    variables = jax.jit(model.init)(jax.random.key(0), X)
    assert set(variables["fp8_state"]) == {"outer"}  # the layer's histories
    assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [
        first, E4, BF]


def test_linen_layers_and_their_hooks():
  """DenseGeneral is hooked like Dense; a layer with its own dot_general
  and nn.Einsum (no hook in Flax) stay as written, visibly."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.DenseGeneral((2, 16), name="general")(x).reshape(16, 32)
      x = nn.Dense(32, dot_general=jax.lax.dot_general, name="own")(x)
      x = nn.Einsum((32, 32), "bk,kn->bn", name="einsum")(x)
      return nn.Dense(16, name="head")(x)

  model = jlinen.apply_policy(Net(), "mixed_fp8")
  variables = model.init(jax.random.key(0), X)
  text = jax.jit(lambda v: model.apply(v, X)).lower(variables).as_text(
      debug_info=True)
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [
      E4, BF, BF, BF]
  for reason in ("has its own dot_general", "has no dot_general hook",
                 "output head"):
    assert reason in text, reason


def test_linen_scan_must_carry_the_state():
  class NoState(nn.Module):
    @nn.compact
    def __call__(self, x):
      x, _ = nn.scan(Block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=2)(name="b")(x, None)
      return nn.Dense(16, name="head")(x)

  model = jlinen.apply_policy(NoState(), DELAYED)
  with pytest.raises(ValueError, match=r"layer at b/Dense_0.*'fp8_state'.*"
                     r"variable_axes=\{'params': 0, 'fp8_state': 0\}"):
    model.init(jax.random.key(0), X)
  # Current scaling keeps no state: the same model needs nothing more.
  model = jlinen.apply_policy(NoState(), "mixed_fp8")
  variables = model.init(jax.random.key(0), X)
  assert jaxpr_dots(lambda v: model.apply(v, X), variables) == [E4, BF]


def test_linen_model_is_traced_once_per_apply():
  calls = []

  class Counted(LM):
    def __call__(self, x):
      calls.append(1)
      return super().__call__(x)

  for policy in ("mixed_fp8", DELAYED):
    model = jlinen.apply_policy(Counted(), policy)
    # Also finds the head; jitted (the eager init of a policy model runs in
    # test_linen_layers_and_their_hooks and the adamw test).
    variables = jax.jit(model.init)(jax.random.key(0), X)
    calls.clear()
    jax.jit(lambda v: model.apply(v, X, mutable=["fp8_state"])).lower(
        variables)
    assert len(calls) == 1, policy


@pytest.mark.standard_promotion
def test_linen_adamw_on_all_variables_cannot_shrink_histories():
  """Issue 25 item 8: adamw over the whole variables dict, a layer seeing
  amax 3.0 every step. The histories are integers (bit patterns), so the
  loop fails loudly instead of weight-decaying them."""

  class One(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="head")(nn.Dense(16, name="layer")(x))

  model = jlinen.apply_policy(One(), DELAYED)
  x = jnp.full((16, 16), 3.0)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  opt = optax.adamw(1e-3, weight_decay=1.0)
  opt_state = opt.init(variables)

  def loss(variables):
    out, updates = model.apply(variables, x, mutable=["fp8_state"])
    return jnp.sum(out), updates

  with pytest.raises(TypeError, match="grad requires real"):
    jax.grad(loss, has_aux=True)(variables)
  # The tester's loop, with integer gradients allowed: optax refuses them.
  grads, updates = jax.jit(jax.grad(loss, has_aux=True, allow_int=True))(
      variables)
  with pytest.raises(TypeError):
    opt.update(grads, opt_state, {**variables, **updates})

  # The loop of the docs (optimizer on the params only) keeps the amaxes.
  @jax.jit
  def step(variables, opt_state):
    grads, updates = jax.grad(
        lambda p: loss({**variables, "params": p}), has_aux=True)(
            variables["params"])
    deltas, opt_state = opt.update(grads, opt_state, variables["params"])
    return {**variables, **updates,
            "params": optax.apply_updates(variables["params"], deltas)
            }, opt_state

  opt_state = opt.init(variables["params"])
  for _ in range(3):
    variables, opt_state = step(variables, opt_state)
  np.testing.assert_array_equal(
      amaxes(variables["fp8_state"]["layer"]["lhs"])[:4], [3.0] * 3 + [0.0])


@functools.lru_cache(maxsize=None)
def linen_training_losses(policy):
  """The losses of 4 jitted train steps of ``linen_model(policy)``, computed
  once per policy (the bfloat16 reference is shared by the float8 cases)."""
  model, variables = linen_model(policy)
  opt = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.NoOpLossScale())
  step = jax.jit(linen_step(model, opt))
  opt_state = opt.init(variables["params"])
  losses = []
  with jax.numpy_dtype_promotion("standard"):  # adam: float ** int32
    for _ in range(4):
      variables, opt_state, loss = step(variables, opt_state, X, Y)
      losses.append(float(loss))
  return tuple(losses)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("policy", default_run_keeps(["mixed_fp8", DELAYED]))
def test_linen_training_is_finite_and_close_to_bf16(policy):
  bf16, f8 = linen_training_losses("mixed_bfloat16"), linen_training_losses(policy)
  assert all(np.isfinite(f8)) and f8[-1] < f8[0]
  assert abs(f8[-1] - bf16[-1]) <= 0.05 * bf16[-1], (f8, bf16)


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------


class NnxLM(nnx.Module):
  """Linear, LayerNorm, nnx.scan over two layers, dropout, the head."""

  def __init__(self, rngs):
    self.inp = nnx.Linear(32, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def layers(rngs):
      return nnx.Linear(32, 32, rngs=rngs)

    self.layers = layers(rngs)
    self.drop = nnx.Dropout(0.25)
    self.head = nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, x, rngs=None):
    x = self.norm(self.inp(x))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return nnx.relu(layer(x))

    x = self.drop(body(x, self.layers), rngs=rngs, deterministic=rngs is None)
    return self.head(x)


def nnx_model(policy, rules=None):
  return jnnx.apply_policy(
      NnxLM(nnx.Rngs(0)), policy,
      jnnx.DEFAULT_MODULE_RULES if rules is None else rules)


def test_nnx_dots_in_float8_but_the_head():
  model = nnx_model("mixed_fp8")
  graphdef, state = nnx.split(model)
  run = lambda state: nnx.merge(graphdef, state)(X)
  assert jaxpr_dots(run, state) == [E4, E4, BF]
  rules = jnnx.ModuleRules(("inp", "p=f32,c=bf16,o=bf16,m=fp8"))
  model = nnx_model("mixed_bfloat16", rules + jnnx.DEFAULT_MODULE_RULES)
  graphdef, state = nnx.split(model)
  assert jaxpr_dots(run, state) == [E4, BF, BF]


@pytest.mark.standard_promotion
def test_nnx_delayed_state_train_eval_and_optimizers():
  model = nnx_model(DELAYED)
  optimizer = nnx.Optimizer(model, jmp_lite.loss_scaling(
      optax.adam(1e-2), jmp_lite.NoOpLossScale()), wrt=nnx.Param)
  # Zero histories from the start, one per float8-capable layer (by path);
  # the head's stays unused.
  assert all(not np.any(h) for h in jax.tree.leaves(
      nnx.state(model, jnnx.Fp8State)))
  # The optimizer never sees the state; handing it over is an error.
  assert not any("fp8_state" in jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(optimizer.opt_state)[0])
  with pytest.raises(ValueError, match="float8 state at.*fp8_state"):
    nnx.Optimizer(model, jmp_lite.loss_scaling(optax.adam(1e-2)),
                  wrt=nnx.Variable)
  shapes = {k: jax.tree.map(jnp.shape, v.get_value())
            for k, v in model.fp8_state.items()}
  assert shapes == {"inp": {"lhs": (16,), "rhs": (16,)},
                    "head": {"lhs": (16,), "rhs": (16,)},
                    # The scanned stack of layers: one slot per iteration.
                    "layers": {"lhs": (2, 16), "rhs": (2, 16)}}
  model(X)
  traces = []

  @nnx.jit
  def step(model, optimizer, x, rngs):
    traces.append(1)
    loss_scale = jmp_lite.get_loss_scale(optimizer.opt_state)

    # The Rngs go in as an argument: NNX refuses to mutate one captured by
    # closure inside nnx.grad (with or without a policy).
    def loss_fn(model, rngs):
      loss = xent(model(x, rngs=rngs), Y)
      return loss_scale.scale(loss), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model, rngs)
    optimizer.update(model, grads)
    return loss

  rngs = nnx.Rngs(dropout=1)
  losses = [float(step(model, optimizer, X * s, rngs)) for s in (2.0, 3.0)]
  assert all(np.isfinite(losses)) and traces == [1]
  assert int(rngs.dropout.count[...]) == 2  # call arguments' state advances
  history = amaxes(model.fp8_state["inp"].get_value()["lhs"])
  expected = [float(jnp.max(jnp.abs((X * s).astype(jnp.bfloat16))))
              for s in (3.0, 2.0, 1.0)]
  np.testing.assert_array_equal(history[:3], expected)
  # Evaluation freezes the histories, as it freezes BatchNorm's statistics.
  model.eval()
  frozen = nnx.state(model, jnnx.Fp8State)
  model(X * 10)
  jax.tree.map(np.testing.assert_array_equal,
               nnx.state(model, jnnx.Fp8State), frozen)
  model.train()
  model(X * 10)
  layers = amaxes(model.fp8_state["layers"].get_value()["lhs"])
  assert layers[0, 0] != layers[1, 0] and np.all(layers[:, :4] > 0)
  assert not np.any(model.fp8_state["head"].get_value()["lhs"])
  assert float(amaxes(model.fp8_state["inp"].get_value()["lhs"])[0]) == (
      float(jnp.max(jnp.abs((X * 10).astype(jnp.bfloat16)))))


@pytest.mark.standard_promotion
def test_nnx_exported_cuda_step():
  model = nnx_model("mixed_fp8")
  graphdef, state = nnx.split(model)

  def step(state, x):
    model = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: xent(m(x), Y))(model)
    return loss, grads

  text = cuda_program(step, state, X)
  dots = cuda_ops(text)
  # inp and the scan body forward; inp's weight gradient and the body's two
  # backward products from e5m2; the head in bf16.
  assert fp8_counts(dots) == (2, 3)
  assert [d for d, _ in dots if not d[0].startswith("f8")] == [
      ("bf16", "bf16")] * 3
  assert_no_host_calls(text)


# ---------------------------------------------------------------------------
# A restored state that does not fit the recipe (issue 25, item 7)
# ---------------------------------------------------------------------------


def test_linen_restored_history_of_another_length_is_refused():
  model, variables = linen_model(DELAYED)               # history_length=16
  short = jlinen.apply_policy(
      LM(), "p=f32,c=bf16,o=f32,m=fp8_delayed(history_length=4)",
      jlinen.DEFAULT_MODULE_RULES)
  with pytest.raises(ValueError, match=r"16-step amax history for the matmul "
                     r"at (inp|blocks/Dense_0|mid).*history_length=4.*h\[\.\.\., "
                     r":4\]") as info:
    short.apply(variables, X, mutable=["fp8_state"])
  assert "init" in str(info.value)
  # The fix the message gives works: the 4 newest amaxes of every history.
  sliced = {**variables, "fp8_state": jax.tree.map(
      lambda h: h[..., :4], variables["fp8_state"])}
  # Jitted: the refusal above runs the eager apply.
  _, updates = jax.jit(functools.partial(short.apply, mutable=["fp8_state"]))(
      sliced, X)
  assert updates["fp8_state"]["inp"]["lhs"].shape == (4,)


def test_linen_site_without_lhs_is_a_teaching_error():
  model, variables = linen_model(DELAYED)
  state = jax.tree.map(lambda x: x, variables["fp8_state"])
  del state["inp"]["lhs"]
  with pytest.raises(ValueError, match=r"entry for the matmul at "
                     r"inp is not \{'lhs'.*got \['rhs'\]"):
    model.apply({**variables, "fp8_state": state}, X)
