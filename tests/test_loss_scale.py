"""Tests for NoOpLossScale, StaticLossScale and DynamicLossScale.

Covers the DynamicLossScale state machine against a pure-Python reference, the
pytree layout (leaves and static config, including the jmp bug where
``min_loss_scale`` silently resets to 1), the float32 storage of the scale
whatever dtype it is given in, the dtype contract of ``scale``/``unscale`` and
input validation.
"""

import pickle
import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite

from helpers import JIT
from helpers import default_run_keeps
from helpers import maybe_jit
from helpers import orbax_round_trip

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
I32 = np.dtype(jnp.int32)
F32_MAX = float(np.finfo(np.float32).max)

HALF_AND_FULL = [F16, BF16, F32]


def _config(ls):
  """The static configuration of a DynamicLossScale, as a tuple."""
  return (ls.period, ls.factor, ls.min_loss_scale, ls.max_loss_scale)


def _true():
  return jnp.array(True)


def _false():
  return jnp.array(False)


# ---------------------------------------------------------------------------
# The state machine against a pure-Python reference.
# ---------------------------------------------------------------------------


def reference_trajectory(config, flags):
  """Pure-Python model of the DynamicLossScale update rule.

  * finite step: the counter increments; on the ``period``-th consecutive
    finite step the scale is multiplied by ``factor`` (capped at
    ``max_loss_scale`` and at 2**126, the largest scale whose reciprocal is a
    normal float32) and the counter returns to 0;
  * non-finite step: the scale is divided by ``factor``, floored at
    ``min_loss_scale`` (and at 2**-126), and the counter returns to 0.

  Arithmetic is float32 (numpy scalars), as in the library.

  Args:
    config: dict with loss_scale, period, factor, min_loss_scale and
      max_loss_scale.
    flags: sequence of bools, True for a finite step.

  Returns:
    (scales, counters): float32 and int32 numpy arrays, the state after each
    step.
  """
  scale = np.float32(config["loss_scale"])
  factor = np.float32(config["factor"])
  min_scale = np.float32(max(config["min_loss_scale"], 2.0**-126))
  max_scale = min(config["max_loss_scale"] or 2.0**126, 2.0**126)
  counter = 0
  scales, counters = [], []
  for finite in flags:
    if finite:
      counter += 1
      if counter == config["period"]:
        with np.errstate(over="ignore"):
          scale = min(np.float32(scale * factor), np.float32(max_scale))
        counter = 0
    else:
      scale = max(np.float32(scale / factor), min_scale)
      counter = 0
    scales.append(scale)
    counters.append(counter)
  return np.asarray(scales, F32), np.asarray(counters, I32)


STATE_MACHINE_CONFIGS = [
    dict(loss_scale=2.0**15, period=1, factor=2.0, min_loss_scale=1.0,
         max_loss_scale=None),
    dict(loss_scale=2.0**15, period=3, factor=2.0, min_loss_scale=0.5,
         max_loss_scale=2.0**17),
    dict(loss_scale=81.0, period=2, factor=3.0, min_loss_scale=1.0,
         max_loss_scale=None),
    dict(loss_scale=1.0, period=4, factor=1.5, min_loss_scale=2.0**-10,
         max_loss_scale=1e6),
    # Starts near the floor and the cap: both are hit.
    dict(loss_scale=4.0, period=2, factor=2.0, min_loss_scale=2.0,
         max_loss_scale=16.0),
    # Grows towards float32 overflow: the scale stops at 2**126.
    dict(loss_scale=2.0**100, period=1, factor=2.0**20, min_loss_scale=1.0,
         max_loss_scale=None),
    # No floor of one's own (jmp's min_loss_scale=0): stops at 2**-126.
    dict(loss_scale=2.0**-100, period=3, factor=2.0**20, min_loss_scale=0.0,
         max_loss_scale=None),
]


def _flags(seed, steps=40, p_finite=0.8):
  rng = np.random.default_rng(seed)
  return rng.random(steps) < p_finite


def _run_eager(ls, flags):
  scales, counters = [], []
  for finite in flags:
    ls = ls.adjust(jnp.asarray(finite))
    scales.append(np.asarray(ls.loss_scale))
    counters.append(np.asarray(ls.counter))
  return np.asarray(scales), np.asarray(counters), ls


def _run_jit(ls, flags):
  adjust = jax.jit(lambda ls, f: ls.adjust(f))
  scales, counters = [], []
  for finite in flags:
    ls = adjust(ls, jnp.asarray(finite))
    scales.append(np.asarray(ls.loss_scale))
    counters.append(np.asarray(ls.counter))
  return np.asarray(scales), np.asarray(counters), ls


def _run_scan(ls, flags):
  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  ls, (scales, counters) = jax.jit(lambda ls, f: lax.scan(body, ls, f))(
      ls, jnp.asarray(flags)
  )
  return np.asarray(scales), np.asarray(counters), ls


@pytest.mark.parametrize("runner", [_run_eager, _run_jit, _run_scan],
                         ids=["eager", "jit", "scan"])
@pytest.mark.parametrize("seed", default_run_keeps([0, 1]))
@pytest.mark.parametrize("config", STATE_MACHINE_CONFIGS,
                         ids=lambda c: f"p{c['period']}-f{c['factor']}-"
                         f"min{c['min_loss_scale']}-max{c['max_loss_scale']}")
def test_dynamic_state_machine_matches_reference(config, seed, runner):
  flags = _flags(seed)
  ref_scales, ref_counters = reference_trajectory(config, flags)
  # The sequence must exercise both directions, or the comparison is weak.
  start = np.float32(config["loss_scale"])
  previous = np.concatenate([[start], ref_scales[:-1]])
  assert np.any(ref_scales < previous) and np.any(ref_counters == 0)
  assert np.any(ref_counters > 0) or config["period"] == 1

  ls = jmp_lite.DynamicLossScale(**config)
  scales, counters, final = runner(ls, flags)

  assert scales.dtype == F32 and counters.dtype == I32
  if np.log2(config["factor"]).is_integer():
    np.testing.assert_array_equal(scales, ref_scales)
  else:
    # XLA may divide by a constant as a multiply by its reciprocal: an ulp or
    # so per back-off, compounding over the sequence.
    np.testing.assert_allclose(scales, ref_scales, rtol=1e-5)
  np.testing.assert_array_equal(counters, ref_counters)
  assert np.all(np.isfinite(scales))
  assert isinstance(final, jmp_lite.DynamicLossScale)
  assert _config(final) == _config(ls)


def test_reference_configs_hit_floor_cap_and_float32_limits():
  """The configs above reach every branch of the rule at least once."""
  hit_floor = hit_cap = hit_top = hit_bottom = False
  for config in STATE_MACHINE_CONFIGS:
    for seed in (0, 1):
      flags = _flags(seed)
      scales, _ = reference_trajectory(config, flags)
      hit_floor |= bool(np.any(scales == np.float32(config["min_loss_scale"])))
      if config["max_loss_scale"] is not None:
        hit_cap |= bool(np.any(scales == np.float32(config["max_loss_scale"])))
      hit_top |= bool(np.any(scales == np.float32(2.0**126)))
      hit_bottom |= bool(np.any(scales == np.float32(2.0**-126)))
  assert hit_floor and hit_cap and hit_top and hit_bottom


@JIT
def test_dynamic_grows_on_period_th_finite_step(jit):
  adjust = maybe_jit(lambda ls, f: ls.adjust(f), jit)
  ls = jmp_lite.DynamicLossScale(jnp.float32(8.0), period=3)
  seen = []
  for _ in range(4):
    ls = adjust(ls, _true())
    seen.append((float(ls.loss_scale), int(ls.counter)))
  assert seen == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1)]
  ls = adjust(ls, _false())
  assert (float(ls.loss_scale), int(ls.counter)) == (8.0, 0)


@JIT
def test_dynamic_back_off_floors_at_min_loss_scale(jit):
  """jmp floors at 1 whatever min_loss_scale is; jmp_lite keeps the config."""
  adjust = maybe_jit(lambda ls, f: ls.adjust(f), jit)
  ls = jmp_lite.DynamicLossScale(64.0, min_loss_scale=4.0)
  values = []
  for _ in range(6):
    ls = adjust(ls, _false())
    values.append(float(ls.loss_scale))
  assert values == [32.0, 16.0, 8.0, 4.0, 4.0, 4.0]
  assert ls.min_loss_scale == 4.0


@JIT
@pytest.mark.parametrize("start,factor", [
    (2.0**126, 2.0),
    (2.0**125, 3.0),
    (2.0**120, 2.0**10),
])
def test_dynamic_growth_stops_where_unscaling_still_works(start, factor, jit):
  """A long run grows the scale to 2**126 and no further: its reciprocal is a
  normal float32, so unscaling (x * 1/scale) never flushes to zero."""
  adjust = maybe_jit(lambda ls, f: ls.adjust(f), jit)
  ls = jmp_lite.DynamicLossScale(start, period=1, factor=factor)
  for _ in range(3):
    ls = adjust(ls, _true())
    assert float(ls.loss_scale) == 2.0**126
  x = jnp.float32(0.75)
  assert float(ls.unscale(ls.scale(x))) == 0.75
  assert float(jax.jit(lambda l: l.unscale(l.scale(x)))(ls)) == 0.75


@JIT
def test_a_zero_floor_stops_at_the_smallest_normal_scale(jit):
  """jmp's min_loss_scale=0: the scale never reaches 0 (which would make every
  step non-finite for good)."""
  adjust = maybe_jit(lambda ls, f: ls.adjust(f), jit)
  ls = jmp_lite.DynamicLossScale(2.0**-120, min_loss_scale=0, factor=2.0**4)
  for _ in range(4):
    ls = adjust(ls, _false())
  assert float(ls.loss_scale) == 2.0**-126
  assert ls.min_loss_scale == 0.0
  assert float(ls.unscale(ls.scale(jnp.float32(3.0)))) == 3.0


@JIT
def test_dynamic_max_loss_scale_caps_growth(jit):
  adjust = maybe_jit(lambda ls, f: ls.adjust(f), jit)
  ls = jmp_lite.DynamicLossScale(1024.0, period=1, max_loss_scale=3000.0)
  values = []
  for _ in range(3):
    ls = adjust(ls, _true())
    values.append(float(ls.loss_scale))
  assert values == [2048.0, 3000.0, 3000.0]


# ---------------------------------------------------------------------------
# Pytree layout and static config.
# ---------------------------------------------------------------------------


def _configured():
  return jmp_lite.DynamicLossScale(
      jnp.float32(64.0), counter=3, period=5, factor=4.0, min_loss_scale=2.0,
      max_loss_scale=2.0**20,
  )


def test_dynamic_leaves_are_loss_scale_and_counter():
  ls = _configured()
  leaves = jax.tree_util.tree_leaves(ls)
  assert len(leaves) == 2
  assert leaves[0] is ls.loss_scale
  assert leaves[1] is ls.counter
  for leaf, dtype in zip(leaves, (F32, I32)):
    assert leaf.dtype == dtype and leaf.shape == ()
  adjusted = jax.jit(lambda ls: ls.adjust(jnp.array(True)))(ls)
  assert [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(adjusted)] == [
      (F32, ()), (I32, ())
  ]


def test_static_and_noop_leaves():
  static = jmp_lite.StaticLossScale(8.0)
  (leaf,) = jax.tree_util.tree_leaves(static)
  assert leaf.dtype == F32 and leaf.shape == ()
  assert jax.tree_util.tree_leaves(jmp_lite.NoOpLossScale()) == []


def _abstract_adjust(ls):
  return jax.eval_shape(lambda x: x.adjust(jnp.array(True)), ls)


CONFIG_TRANSFORMS = {
    "jit_identity": lambda ls: jax.jit(lambda x: x)(ls),
    "jit_adjust": lambda ls: jax.jit(lambda x: x.adjust(jnp.array(False)))(ls),
    "jit_built_inside": lambda ls: jax.jit(
        lambda s, c: jmp_lite.DynamicLossScale(
            s, c, period=5, factor=4.0, min_loss_scale=2.0,
            max_loss_scale=2.0**20,
        )
    )(ls.loss_scale, ls.counter),
    "tree_map_identity": lambda ls: jax.tree_util.tree_map(lambda x: x, ls),
    "tree_map_arith": lambda ls: jax.tree_util.tree_map(lambda x: x * 1, ls),
    "eval_shape": _abstract_adjust,
    "flatten_unflatten": lambda ls: jax.tree_util.tree_unflatten(
        *reversed(jax.tree_util.tree_flatten(ls))
    ),
    "pickle": lambda ls: pickle.loads(pickle.dumps(ls)),
    "device_put": jax.device_put,
    "scan_carry": lambda ls: lax.scan(
        lambda c, f: (c.adjust(f), None), ls, jnp.array([True, False])
    )[0],
}


@pytest.mark.parametrize("name", list(CONFIG_TRANSFORMS))
def test_dynamic_config_survives(name):
  ls = _configured()
  out = CONFIG_TRANSFORMS[name](ls)
  assert type(out) is jmp_lite.DynamicLossScale
  assert _config(out) == (5, 4.0, 2.0, 2.0**20)
  leaves = jax.tree_util.tree_leaves(out)
  assert [(x.dtype, x.shape) for x in leaves] == [(F32, ()), (I32, ())]


def test_min_loss_scale_survives_jit_then_floors():
  """The jmp regression: after jit, back-off must still floor at the minimum."""
  ls = jmp_lite.DynamicLossScale(16.0, min_loss_scale=8.0)
  ls = jax.jit(lambda x: x)(ls)
  step = jax.jit(lambda x: x.adjust(jnp.array(False)))
  for _ in range(4):
    ls = step(ls)
  assert ls.min_loss_scale == 8.0
  assert float(ls.loss_scale) == 8.0


BATCHING_TRANSFORMS = {
    # What pmap replication (and flax's jax_utils.replicate) does to a state.
    "tree_map_stack": lambda ls: jax.tree_util.tree_map(
        lambda x: jnp.stack([x, x, x]), ls
    ),
    "vmap_adjust": lambda ls: jax.vmap(lambda x, f: x.adjust(f))(
        jax.tree_util.tree_map(lambda x: jnp.stack([x, x, x]), ls),
        jnp.array([True, False, True]),
    ),
    # The state a pmapped train step returns: one scale per device.
    "pmap_adjust": lambda ls: jax.pmap(lambda f: ls.adjust(f))(
        jnp.array([True, False][: jax.local_device_count()])
    ),
}


@pytest.mark.parametrize("name", list(BATCHING_TRANSFORMS))
def test_dynamic_config_survives_batching(name):
  """Stacked leaves (pmap/vmap/replication) are legal and keep the config."""
  ls = _configured()
  out = BATCHING_TRANSFORMS[name](ls)
  assert type(out) is jmp_lite.DynamicLossScale
  assert _config(out) == (5, 4.0, 2.0, 2.0**20)
  assert out.loss_scale.dtype == F32 and out.counter.dtype == I32
  assert out.loss_scale.ndim == 1


def test_static_survives_stacking():
  ls = jmp_lite.StaticLossScale(8.0)
  out = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
  assert type(out) is jmp_lite.StaticLossScale
  np.testing.assert_array_equal(out.loss_scale, np.full(2, 8.0, F32))


@pytest.mark.parametrize("make", [
    lambda: jmp_lite.NoOpLossScale(),
    lambda: jmp_lite.StaticLossScale(4.0),
    _configured,
], ids=["noop", "static", "dynamic"])
def test_pickle_round_trip(make):
  ls = make()
  out = pickle.loads(pickle.dumps(ls))
  assert type(out) is type(ls)
  leaves = zip(jax.tree_util.tree_leaves(ls), jax.tree_util.tree_leaves(out))
  for a, b in leaves:
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype
  if isinstance(ls, jmp_lite.DynamicLossScale):
    assert _config(out) == _config(ls)


def test_orbax_checkpoint_round_trip(tmp_path):
  tree = {"scale": _configured(), "step": jnp.int32(7)}
  tree["scale"] = tree["scale"].adjust(jnp.array(True))
  # The config lives in the treedef, so it comes back with the target tree.
  restored = orbax_round_trip(tree, tmp_path / "ckpt")
  scale = restored["scale"]
  assert type(scale) is jmp_lite.DynamicLossScale
  assert _config(scale) == (5, 4.0, 2.0, 2.0**20)
  assert scale.loss_scale.dtype == F32 and scale.counter.dtype == I32
  assert float(scale.loss_scale) == 64.0 and int(scale.counter) == 4
  # It behaves as the saved one: back-off floors at the restored minimum.
  for _ in range(6):
    scale = scale.adjust(jnp.array(False))
  assert float(scale.loss_scale) == 2.0


# ---------------------------------------------------------------------------
# The scale is always a float32 scalar.
# ---------------------------------------------------------------------------

SCALE_INPUTS = {
    "jnp_float16": lambda: jnp.float16(1024),
    "np_float16": lambda: np.float16(1024),
    "jnp_bfloat16": lambda: jnp.bfloat16(1024),
    "np_bfloat16": lambda: np.asarray(1024, BF16),
    "python_int": lambda: 1024,
    "np_int32": lambda: np.int32(1024),
    "jnp_int32": lambda: jnp.int32(1024),
    "np_float64": lambda: np.float64(1024),
    "python_float": lambda: 1024.0,
}

SCALE_CLASSES = {
    "static": jmp_lite.StaticLossScale,
    "dynamic": jmp_lite.DynamicLossScale,
}


@pytest.mark.parametrize("cls_name", list(SCALE_CLASSES))
@pytest.mark.parametrize("input_name", list(SCALE_INPUTS))
def test_scale_input_stored_as_f32_scalar(input_name, cls_name):
  ls = SCALE_CLASSES[cls_name](SCALE_INPUTS[input_name]())
  assert isinstance(ls.loss_scale, jax.Array)
  assert ls.loss_scale.dtype == F32 and ls.loss_scale.shape == ()
  assert float(ls.loss_scale) == 1024.0


@pytest.mark.parametrize("input_name", list(SCALE_INPUTS))
def test_dynamic_adjust_under_jit_with_any_input_dtype(input_name):
  """jmp crashes in adjust with an f16 scale; jmp_lite converts it."""
  ls = jmp_lite.DynamicLossScale(SCALE_INPUTS[input_name](), period=1)
  step = jax.jit(lambda ls, f: ls.adjust(f))
  down = step(ls, _false())
  up = step(ls, _true())
  assert float(down.loss_scale) == 512.0 and float(up.loss_scale) == 2048.0
  assert down.loss_scale.dtype == F32 and up.loss_scale.dtype == F32
  grads = jax.jit(lambda ls, g: ls.unscale(g))(down, jnp.full(3, 512.0, F16))
  assert grads.dtype == F32
  np.testing.assert_array_equal(grads, np.ones(3, F32))


BAD_SCALE_INPUTS = {
    "bool": (True, TypeError),
    "np_bool": (np.bool_(True), TypeError),
    "jnp_bool": (jnp.array(True), TypeError),
    "complex": (1 + 2j, TypeError),
    "np_complex": (np.complex64(2), TypeError),
    "jnp_complex": (jnp.complex64(2), TypeError),
    "jnp_vector": (jnp.ones(2), ValueError),
    "np_vector": (np.ones(2), (TypeError, ValueError)),
}


@pytest.mark.parametrize("cls_name", list(SCALE_CLASSES))
@pytest.mark.parametrize("input_name", list(BAD_SCALE_INPUTS))
def test_scale_input_rejected(input_name, cls_name):
  value, error = BAD_SCALE_INPUTS[input_name]
  with pytest.raises(error) as excinfo:
    SCALE_CLASSES[cls_name](value)
  assert "loss_scale" in str(excinfo.value)


# ---------------------------------------------------------------------------
# Dtype contract of scale/unscale.
# ---------------------------------------------------------------------------

SCALERS = {
    "static": lambda value: jmp_lite.StaticLossScale(value),
    "dynamic": lambda value: jmp_lite.DynamicLossScale(
        value, min_loss_scale=min(value, 1.0)
    ),
}


@JIT
@pytest.mark.parametrize("kind", list(SCALERS))
@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
def test_scale_returns_promoted_dtype_exactly(dtype, kind, jit):
  ls = SCALERS[kind](2.0**12)
  loss = jnp.asarray(3.0, dtype)
  out = maybe_jit(lambda ls, x: ls.scale(x), jit)(ls, loss)
  # promote_types(dtype, float32) is float32 for every half/full input.
  assert out.dtype == F32
  assert out.shape == ()
  assert float(out) == 3.0 * 2.0**12


@pytest.mark.parametrize("kind", list(SCALERS))
def test_scale_does_not_overflow_f16_loss(kind):
  """A loss near the float16 max times a large scale is finite in float32."""
  ls = SCALERS[kind](2.0**15)
  loss = jnp.asarray(60000.0, F16)
  out = ls.scale(loss)
  assert out.dtype == F32 and np.isfinite(np.asarray(out))


def _grads(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "f16": jnp.asarray(rng.normal(size=(5,)) * 1000, F16),
      "bf16": jnp.asarray(rng.normal(size=(2, 3)) * 1000, BF16),
      "f32": jnp.asarray(rng.normal(size=(4,)) * 1000, F32),
  }


@JIT
@pytest.mark.parametrize("kind", list(SCALERS))
@pytest.mark.parametrize("value", [2.0**10, 2.0**-3, 3.0])
def test_unscale_returns_promote_types_with_float32(value, kind, jit):
  """jmp's dtype rule: half leaves come back in float32, float32 (and
  float64) leaves in their own dtype."""
  ls = SCALERS[kind](value)
  grads = _grads()
  out = maybe_jit(lambda ls, g: ls.unscale(g), jit)(ls, grads)
  structure = jax.tree_util.tree_structure
  assert structure(out) == structure(grads)
  for key, x in grads.items():
    got = out[key]
    assert got.dtype == F32 and got.shape == x.shape
    expected = x.astype(F32) / np.float32(value)
    if np.log2(value).is_integer():
      np.testing.assert_array_equal(got, expected)
    else:
      # x * (1/s) vs x / s: at most one rounding step apart.
      np.testing.assert_allclose(got, expected,
                                 rtol=float(jnp.finfo(F32).eps))


def test_unscale_computes_in_f32_not_in_half():
  """2**25 overflows float16 and 2**-25 flushes to zero: only f32 math works,
  and the quotient 2**-27 must stay float32 (in float16 it is zero)."""
  ls = jmp_lite.StaticLossScale(2.0**25)
  out = ls.unscale(jnp.asarray(0.25, F16))
  assert out.dtype == F32
  assert float(out) == 2.0**-27


@pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
def test_haiku_recipe_cast_unscale_pmean_keeps_small_gradients(half):
  """Haiku's ImageNet recipe: grads = policy.cast_to_compute(grads), then
  loss_scale.unscale(grads), then jax.lax.pmean. Unscaling returns float32, as
  jmp's does, so true gradients below float16's smallest subnormal (2**-24)
  survive; rounded back to float16 every one of them would flush to zero."""
  policy = jmp_lite.get_policy(f"p=f32,c={half.name}")
  ls = jmp_lite.StaticLossScale(2.0**15)
  true = jnp.asarray(np.exp2(-np.arange(26, 36, dtype=np.float32)), F32)
  per_device = jnp.stack([true] * 4)  # 4 replicas, equal gradients.

  def replica(g_true):
    grads = {"w": g_true * ls.loss_scale}  # what a scaled backward gives
    grads = policy.cast_to_compute(grads)
    grads = ls.unscale(grads)
    return jax.lax.pmean(grads, "devices")

  out = jax.vmap(replica, axis_name="devices")(per_device)["w"]
  assert out.dtype == F32
  np.testing.assert_array_equal(out[0], true)
  assert np.all(np.asarray(true.astype(F16), F32) == 0)  # f16 would lose all


class _Marker:
  """An arbitrary non-array leaf (e.g. an Equinox/NNX static)."""


@pytest.mark.parametrize("kind", ["noop", "static", "dynamic"])
def test_non_floating_leaves_pass_through(kind):
  ls = {
      "noop": jmp_lite.NoOpLossScale(),
      "static": jmp_lite.StaticLossScale(4.0),
      "dynamic": jmp_lite.DynamicLossScale(4.0),
  }[kind]
  marker = _Marker()
  ints = jnp.arange(3, dtype=jnp.int32)
  np_ints = np.arange(3)
  bools = jnp.array([True, False])
  tree = {
      "ints": ints, "np_ints": np_ints, "bools": bools, "py_int": 3,
      "none": None, "marker": marker, "name": "layer", "f": jnp.ones(2, F16),
  }
  for method in (ls.scale, ls.unscale):
    out = method(tree)
    for key in ("ints", "np_ints", "bools", "marker"):
      assert out[key] is tree[key], key
    assert out["none"] is None and out["name"] == "layer"
  # Python numbers are scaled, as jmp scales them (a loss may be one).
  assert ls.unscale(tree)["py_int"] == 3
  assert float(ls.scale(tree)["py_int"]) == 3 * float(ls.loss_scale)
  if kind != "noop":
    assert ls.scale(tree)["f"].dtype == F32
    assert ls.unscale(tree)["f"].dtype == F32  # as jmp: promote with f32


def test_non_floating_leaves_pass_through_under_jit():
  ls = jmp_lite.DynamicLossScale(4.0)
  ints = jnp.arange(3, dtype=jnp.int32)
  out = jax.jit(lambda ls, t: (ls.scale(t), ls.unscale(t)))(
      ls, {"ints": ints, "f": jnp.full(2, 8.0, BF16)}
  )
  for tree in out:
    assert tree["ints"].dtype == I32
    np.testing.assert_array_equal(tree["ints"], ints)
  assert out[0]["f"].dtype == F32 and out[1]["f"].dtype == F32
  np.testing.assert_array_equal(out[1]["f"], [2.0, 2.0])


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
def test_noop_is_identity(dtype):
  ls = jmp_lite.NoOpLossScale()
  tree = {"g": jnp.ones(3, dtype), "i": jnp.arange(2)}
  assert ls.scale(tree) is tree
  assert ls.unscale(tree) is tree
  assert ls.scale(tree["g"]) is tree["g"]
  assert ls.loss_scale == 1
  assert ls.adjust(jnp.array(False)) is ls
  out = jax.jit(lambda x: ls.unscale(ls.scale(x)))(tree["g"])
  assert out.dtype == dtype


def test_static_adjust_keeps_scale():
  ls = jmp_lite.StaticLossScale(4.0)
  for flag in (True, False):
    out = jax.jit(lambda ls, f: ls.adjust(f))(ls, jnp.array(flag))
    assert type(out) is jmp_lite.StaticLossScale
    assert float(out.loss_scale) == 4.0


def test_all_are_loss_scales():
  for ls in (jmp_lite.NoOpLossScale(), jmp_lite.StaticLossScale(2.0),
             jmp_lite.DynamicLossScale(2.0)):
    assert isinstance(ls, jmp_lite.LossScale)


# ---------------------------------------------------------------------------
# Bad input: every case raises with a message naming the bad value.
# ---------------------------------------------------------------------------

_DLS = jmp_lite.DynamicLossScale
_SLS = jmp_lite.StaticLossScale

BAD_INPUTS = [
    ("factor_1", lambda: _DLS(2.0**15, factor=1), [r"factor", r"\b1(\.0)?\b"]),
    ("factor_half", lambda: _DLS(2.0**15, factor=0.5), [r"factor", r"0\.5"]),
    ("period_0", lambda: _DLS(2.0**15, period=0), [r"period", r"\b0\b"]),
    ("period_negative", lambda: _DLS(2.0**15, period=-3), [r"period", r"-3"]),
    ("period_float", lambda: _DLS(2.0**15, period=2.5), [r"period", r"2\.5"]),
    ("min_above_scale", lambda: _DLS(4.0, min_loss_scale=8.0),
     [r"min_loss_scale", r"\b4(\.0)?\b", r"\b8(\.0)?\b"]),
    ("min_tiny", lambda: _DLS(4.0, min_loss_scale=1e-50), [r"min_loss_scale",
                                                           r"1e-50", r"2\*\*-126"]),
    ("min_negative", lambda: _DLS(4.0, min_loss_scale=-1.0),
     [r"min_loss_scale", r"-1(\.0)?\b"]),
    ("max_below_min", lambda: _DLS(4.0, min_loss_scale=2.0, max_loss_scale=1.0),
     [r"max_loss_scale", r"\b1(\.0)?\b"]),
    ("scale_zero", lambda: _DLS(0.0), [r"loss_scale", r"\b0(\.0)?\b"]),
    ("scale_negative", lambda: _DLS(-2.0), [r"loss_scale", r"-2(\.0)?\b"]),
    ("scale_negative_array", lambda: _DLS(jnp.float32(-2.0)),
     [r"loss_scale", r"-2(\.0)?\b"]),
    ("scale_inf", lambda: _DLS(float("inf")), [r"loss_scale", r"inf"]),
    ("scale_nan", lambda: _DLS(float("nan")), [r"loss_scale", r"nan"]),
    ("scale_inf_array", lambda: _DLS(jnp.float32(jnp.inf)),
     [r"loss_scale", r"inf"]),
    ("scale_vector", lambda: _DLS(jnp.ones(2)), [r"loss_scale", r"\(2,\)"]),
    ("adjust_vector", lambda: _DLS(4.0).adjust(jnp.array([True, False])),
     [r"\(2,\)"]),
    ("adjust_float", lambda: _DLS(4.0).adjust(jnp.float32(1.0)),
     [r"float32"]),
    ("adjust_int", lambda: _DLS(4.0).adjust(1), [r"\bint\b"]),
    ("static_adjust_int", lambda: _SLS(4.0).adjust(1), [r"\bint\b"]),
    ("noop_adjust_vector",
     lambda: jmp_lite.NoOpLossScale().adjust(jnp.array([True, False])),
     [r"\(2,\)"]),
    ("static_zero", lambda: _SLS(0), [r"loss_scale", r"\b0(\.0)?\b"]),
    ("static_nan", lambda: _SLS(float("nan")), [r"loss_scale", r"nan"]),
    ("static_vector", lambda: _SLS(jnp.ones(3)), [r"loss_scale", r"\(3,\)"]),
    # Static config cannot be traced (it was a '<' between None and float).
    ("max_loss_scale_traced", lambda: jax.jit(
        lambda m: _DLS(2.0**15, max_loss_scale=m).loss_scale)(2.0**20),
     [r"max_loss_scale", r"static configuration", r"traced"]),
    ("min_loss_scale_traced", lambda: jax.jit(
        lambda m: _DLS(2.0**15, min_loss_scale=m).loss_scale)(2.0),
     [r"min_loss_scale", r"static configuration", r"traced"]),
]


@pytest.mark.parametrize("make,patterns", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_raises_naming_the_value(make, patterns):
  with pytest.raises((ValueError, TypeError)) as excinfo:
    make()
  message = str(excinfo.value)
  for pattern in patterns:
    assert re.search(pattern, message), (pattern, message)
