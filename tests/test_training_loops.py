"""Training-loop semantics of loss scaling (DESIGN.md, "Training-loop semantics").

What tests/test_loss_scale.py and tests/test_optax.py do not cover:

* the ``DynamicLossScale`` options added for torch/Flax/Megatron users
  (``growth_factor``, ``backoff_factor``, ``hysteresis``) against a
  pure-Python reference model, eager, jitted and under ``lax.scan``, with the
  [2**-126, 2**126] clamps and ``min_loss_scale=0``;
* fault sequences (inf/nan gradients injected at chosen steps) through every
  composition: plain, accumulation, several optimizers sharing one scale,
  clipping, ``inject_hyperparams``, ``multi_transform`` and ``master_weights``
  inside the wrapper. Each run is compared with the inner optimizer alone run
  on the finite steps (windows) only;
* the issue's measured scenarios as regression tests (``MultiSteps``, drift of
  two scales, clipping outside the wrapper, the float32 range of scales);
* giving up after ``max_consecutive_skips``; bad values of every new option;
  no recompilation and stable state dtypes;
* the documented pattern for several losses with separate scales
  (``docs/training_loops.md``; its code blocks run in ``test_docs.py``);
* smoke runs of ``examples/accumulation.py`` and
  ``benchmarks/accumulation_overhead.py`` (marked ``slow``).

**Bitwise comparisons.** The fault-sequence runs compare the wrapper with the
inner optimizer alone *eagerly* (op by op), where both execute the same float32
operations in the same order, so the final params must be bit-identical. The
accumulated mean divides by the count as a runtime array in the reference, as
the wrapper does: a division by a constant is turned into ``x * (1 / k)`` by
some XLA:CPU versions (0.10) and not others (0.8), one ulp apart for about a
third of the values when ``k = 3``.
Under ``jax.jit`` the wrapper and the reference are two different XLA programs
(different fusions, FMA contraction), so they agree to a few ulps per step,
compounding: those runs are compared with ``rtol=RTOL_JIT``. Skipped steps are
bit-identical in both modes (the old state is selected, not recomputed).
"""

import chex
import functools
import json
import math
import re
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from helpers import assert_bit_identical
from helpers import assert_exited_cleanly
from helpers import debug_nans_and_infs
from helpers import faulty
from helpers import assert_is_png
from helpers import example_env
from helpers import is_finite_number
from helpers import ROOT
from helpers import run_example
from helpers import default_run_keeps

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
I32 = np.dtype(jnp.int32)
HALF_AND_FULL = [F16, BF16, F32]
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126
#: Relative tolerance between a jitted wrapper run and the jitted reference
#: (a few ulps per step, see the module docstring; measured <= 8e-7).
RTOL_JIT = 4e-6

standard_promotion = pytest.mark.standard_promotion
slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def _no_nan_or_inf_anywhere():
  """Every test here runs with jax_debug_nans and jax_debug_infs on: no state
  or intermediate of a finite step may hold NaN or inf (DESIGN.md, "Scale").
  The steps that get NaN/inf gradients on purpose run inside ``faulty()``."""
  with debug_nans_and_infs():
    yield


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype), tree)


def _scale_value(loss_scale):
  return float(loss_scale.loss_scale)


# ---------------------------------------------------------------------------
# DynamicLossScale's new options against a pure-Python reference.
# ---------------------------------------------------------------------------


def reference_dynamic(config, flags):
  """Pure-Python model of ``DynamicLossScale.adjust`` with every option.

  * finite step: pending non-finite steps are forgotten; the streak of finite
    steps grows by one; on the ``period``-th the scale is multiplied by the
    growth factor (capped at ``max_loss_scale`` and at 2**126) and the counter
    returns to 0;
  * non-finite step: one more pending non-finite step; on the
    ``hysteresis``-th in a row the scale is multiplied by the back-off factor
    (``1 / factor`` unless given; floored at ``max(min_loss_scale,
    2**-126)``) and the counter returns to 0; before that the counter holds
    minus the number of pending steps.

  The scale is rounded to float32 after each step (products in float64, which
  are exact for the factors used here, then rounded once).

  Args:
    config: the keyword arguments of ``DynamicLossScale``.
    flags: sequence of bools, True for a finite step.

  Returns:
    (scales, counters): float32 and int32 arrays, the state after each step.
  """
  factor = config.get("growth_factor") or config.get("factor", 2.0)
  backoff = config.get("backoff_factor") or 1.0 / factor
  period = config.get("period", 2000)
  hysteresis = config.get("hysteresis", 1)
  floor = max(config.get("min_loss_scale", 1.0), SCALE_MIN)
  cap = min(config.get("max_loss_scale") or SCALE_MAX, SCALE_MAX)
  scale = float(np.float32(config["loss_scale"]))
  streak, pending = 0, 0
  scales, counters = [], []
  for finite in flags:
    if finite:
      pending = 0
      streak += 1
      if streak == period:
        scale = float(np.float32(min(scale * factor, cap)))
        streak = 0
      counter = streak
    else:
      streak = 0
      pending += 1
      if pending == hysteresis:
        scale = float(np.float32(max(scale * backoff, floor)))
        pending = 0
      counter = -pending
    scales.append(scale)
    counters.append(counter)
  return np.asarray(scales, F32), np.asarray(counters, I32)


#: (id, DynamicLossScale kwargs, whether every factor is a power of two).
NEW_OPTION_CONFIGS = [
    ("torch_h2", dict(loss_scale=2.0**15, period=3, growth_factor=2.0,
                      backoff_factor=0.5, hysteresis=2), True),
    ("megatron_h3", dict(loss_scale=2.0**9, period=2, hysteresis=3,
                         min_loss_scale=2.0**8), True),
    ("asymmetric_pow2", dict(loss_scale=2.0**10, period=2, factor=4.0,
                             backoff_factor=0.125, hysteresis=1,
                             max_loss_scale=2.0**14), True),
    ("non_pow2", dict(loss_scale=1000.0, period=2, growth_factor=1.5,
                      backoff_factor=0.7, hysteresis=1,
                      max_loss_scale=1500.0), False),
    ("non_pow2_h2", dict(loss_scale=3.0, period=1, factor=3.0,
                         backoff_factor=0.3, hysteresis=2,
                         min_loss_scale=0.5), False),
    # Grows into the float32 ceiling: the scale stops at 2**126.
    ("ceiling_h3", dict(loss_scale=2.0**100, period=1, growth_factor=2.0**10,
                        backoff_factor=0.5, hysteresis=3), True),
    # min_loss_scale=0 (jmp's idiom): the scale stops at 2**-126, never 0.
    ("zero_floor_h2", dict(loss_scale=2.0**-100, period=3, factor=2.0,
                           backoff_factor=2.0**-12, hysteresis=2,
                           min_loss_scale=0), True),
]


def _flags(seed, steps=48, p_finite=0.6):
  return np.random.default_rng(seed).random(steps) < p_finite


def _run_eager(ls, flags):
  out = []
  for finite in flags:
    ls = ls.adjust(jnp.asarray(finite))
    out.append((np.asarray(ls.loss_scale), np.asarray(ls.counter)))
  scales, counters = zip(*out)
  return np.asarray(scales), np.asarray(counters), ls


def _run_jit(ls, flags):
  adjust = jax.jit(lambda ls, f: ls.adjust(f))
  out = []
  for finite in flags:
    ls = adjust(ls, jnp.asarray(finite))
    out.append((np.asarray(ls.loss_scale), np.asarray(ls.counter)))
  scales, counters = zip(*out)
  return np.asarray(scales), np.asarray(counters), ls


def _run_scan(ls, flags):
  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  ls, (scales, counters) = jax.jit(lambda ls, f: lax.scan(body, ls, f))(
      ls, jnp.asarray(flags))
  return np.asarray(scales), np.asarray(counters), ls


RUNNERS = [pytest.param(_run_eager, id="eager"),
           pytest.param(_run_jit, id="jit"),
           pytest.param(_run_scan, id="scan")]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", default_run_keeps([0, 1]))
@pytest.mark.parametrize("config,exact", [c[1:] for c in NEW_OPTION_CONFIGS],
                         ids=[c[0] for c in NEW_OPTION_CONFIGS])
def test_new_options_match_the_reference(config, exact, seed, runner):
  """Scale and counter after every step, for random finite/non-finite runs."""
  flags = _flags(seed)
  ref_scales, ref_counters = reference_dynamic(config, flags)
  ls = jmp_lite.DynamicLossScale(**config)
  scales, counters, final = runner(ls, flags)

  assert scales.dtype == F32 and counters.dtype == I32
  np.testing.assert_array_equal(counters, ref_counters)
  if exact:
    np.testing.assert_array_equal(scales, ref_scales)
  else:
    # XLA multiplies in float32 step by step; the reference rounds a float64
    # product: an ulp per change at most, compounding over the run.
    np.testing.assert_allclose(scales, ref_scales, rtol=1e-5)
  assert np.all((scales >= SCALE_MIN) & (scales <= SCALE_MAX))
  # The leaves stay (loss_scale, counter); the config survives the run.
  assert len(jax.tree_util.tree_leaves(final)) == 2
  assert (final.period, final.factor, final.backoff_factor, final.hysteresis,
          final.min_loss_scale, final.max_loss_scale) == (
              ls.period, ls.factor, ls.backoff_factor, ls.hysteresis,
              ls.min_loss_scale, ls.max_loss_scale)


def test_reference_runs_reach_every_branch():
  """The configs above exercise pending steps, back-off, growth and all four
  clamps (floor, cap, 2**126, 2**-126): otherwise the comparison is weak."""
  seen = set()
  for _, config, _ in NEW_OPTION_CONFIGS:
    for seed in (0, 1):
      scales, counters = reference_dynamic(config, _flags(seed))
      previous = np.concatenate([[np.float32(config["loss_scale"])],
                                 scales[:-1]])
      seen |= {"grew"} if np.any(scales > previous) else set()
      seen |= {"backed_off"} if np.any(scales < previous) else set()
      seen |= {"pending"} if np.any(counters < 0) else set()
      seen |= {"streak"} if np.any(counters > 0) else set()
      if config.get("max_loss_scale"):
        seen |= {"cap"} if np.any(scales == np.float32(
            config["max_loss_scale"])) else set()
      floor = config.get("min_loss_scale", 1.0)
      if floor:
        seen |= {"floor"} if np.any(scales == np.float32(floor)) else set()
      seen |= {"2**126"} if np.any(scales == np.float32(SCALE_MAX)) else set()
      seen |= {"2**-126"} if np.any(scales == np.float32(SCALE_MIN)) else set()
  assert seen == {"grew", "backed_off", "pending", "streak", "cap", "floor",
                  "2**126", "2**-126"}, seen


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_hysteresis_counts_pending_steps_and_a_finite_step_clears_them(jit):
  adjust = jax.jit(lambda ls, f: ls.adjust(f)) if jit else (
      lambda ls, f: ls.adjust(f))
  ls = jmp_lite.DynamicLossScale(64.0, period=2, hysteresis=3)
  seen = []
  for finite in (False, False, True, False, False, False, True, True):
    ls = adjust(ls, jnp.asarray(finite))
    seen.append((float(ls.loss_scale), int(ls.counter)))
  assert seen == [
      (64.0, -1), (64.0, -2),   # two pending, scale kept
      (64.0, 1),                # a finite step forgets them
      (64.0, -1), (64.0, -2),
      (32.0, 0),                # the third in a row backs off
      (32.0, 1), (64.0, 0),     # growth as usual
  ]


def test_hysteresis_keeps_the_scale_but_every_non_finite_step_is_skipped():
  params = {"w": jnp.ones(2, F32)}
  opt = jmp_lite.loss_scaling(
      optax.sgd(1.0), jmp_lite.DynamicLossScale(8.0, hysteresis=2))
  state = opt.init(params)
  update = jax.jit(opt.update)
  with faulty():
    bad = {"w": jnp.asarray([np.inf, 1.0], F32)}
    updates, state = update(bad, state, params)
  np.testing.assert_array_equal(updates["w"], np.zeros(2, F32))
  assert (int(state.skipped_steps), _scale_value(state.loss_scale),
          int(state.loss_scale.counter)) == (1, 8.0, -1)
  updates, state = update(bad, state, params)
  np.testing.assert_array_equal(updates["w"], np.zeros(2, F32))
  assert (int(state.skipped_steps), _scale_value(state.loss_scale),
          int(state.loss_scale.counter)) == (2, 4.0, 0)


# ---------------------------------------------------------------------------
# Fault sequences through every composition.
# ---------------------------------------------------------------------------

#: The scale every fault run starts from: growth after 2 finite optimizer
#: steps, so the trajectory both grows and backs off. Powers of two keep
#: unscaling exact.
FAULT_SCALE = dict(loss_scale=2.0**6, period=2)
#: Windows of every fault run: ``None`` is a finite window, otherwise the
#: micro-batch position ("first", "middle", "last") and value of a bad one.
#: Windows 3 and 4 are bad in a row (consecutive skips); window 5 has two.
FAULT_WINDOWS = [None, ("first", np.inf), None, ("middle", np.nan),
                 ("last", -np.inf), [("first", np.nan), ("last", np.inf)],
                 None, None]


def _position(name, k):
  return {"first": 0, "middle": k // 2, "last": k - 1}[name]


def _bad_micro_batches(k):
  """``{micro-batch index: inf or nan}`` for FAULT_WINDOWS with ``k``."""
  bad = {}
  for w, spec in enumerate(FAULT_WINDOWS):
    if spec is None:
      continue
    for name, value in spec if isinstance(spec, list) else [spec]:
      bad[w * k + _position(name, k)] = value
  return bad


def _fault_params(dtype=F32, seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 3)), dtype),
          "b": jnp.asarray(rng.normal(size=(3,)), dtype)}


def _true_grads(n, dtype, seed=1, like=None):
  """``n`` unscaled float32 gradients whose values are exact in ``dtype``,
  so that scaling by a power of two and unscaling gives them back exactly."""
  rng = np.random.default_rng(seed)
  like = _fault_params() if like is None else like
  return [jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), dtype).astype(F32), like)
          for _ in range(n)]


def _scaled(grads, scale, dtype, bad=None):
  """What the backward pass of a scaled loss hands to ``update``."""
  out = jax.tree_util.tree_map(
      lambda g: (g * np.float32(scale)).astype(dtype), grads)
  if bad is not None:
    out = dict(out)
    out["w"] = out["w"].at[1, 2].set(bad)
  return out


def _window_flags(k, n):
  bad = _bad_micro_batches(k)
  return [not any(w * k + i in bad for i in range(k)) for w in range(n // k)]


def run_fault_sequence(opt, params, grads, bad, dtype, k, jit):
  """Feeds ``opt`` the scaled ``grads``, poisoning the micro-batches in ``bad``.

  Checks after every update: params finite; the accumulator (if any) holds no
  NaN/inf; the state dtypes and structure are unchanged; the scale is fixed
  within a window; where no optimizer step is taken (inside a window, or a
  skipped window) the updates are zeros, and the params and the inner state
  are bit-identical to before.

  Returns:
    (final params, final state, the scale each window used and the counters
    after each window).
  """
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  dtypes, structure = _dtypes(state), jax.tree_util.tree_structure(state)
  window_ok, history = True, []
  for i, g in enumerate(grads):
    scale = _scale_value(jmp_lite.get_loss_scale(state))
    if i % k == 0:
      window_scale = scale
    assert scale == window_scale  # fixed within a window
    with faulty(i in bad):
      updates, new_state = update(_scaled(g, scale, dtype, bad.get(i)), state,
                                  params)
      new_params = optax.apply_updates(params, updates)
    window_ok &= i not in bad
    step_taken = (i % k == k - 1) and window_ok
    chex.assert_tree_all_finite(new_params)
    if k > 1:
      chex.assert_tree_all_finite(new_state.accumulated)
    assert _dtypes(new_state) == dtypes
    assert jax.tree_util.tree_structure(new_state) == structure
    if not step_taken:
      for leaf in jax.tree_util.tree_leaves(updates):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
      assert_bit_identical(new_params, params)
      assert_bit_identical(new_state.inner_state, state.inner_state)
    params, state = new_params, new_state
    if i % k == k - 1:
      history.append(dict(scale=window_scale,
                          skipped=int(state.skipped_steps),
                          consecutive=int(state.consecutive_skips),
                          last_finite=bool(state.last_finite)))
      window_ok = True
  return params, state, history


def run_reference(inner, params, grads, flags, k):
  """``inner`` alone, eagerly, on the mean of each finite window.

  The mean is accumulated in float32 in micro-batch order and divided on the
  device, as the wrapper does.
  """
  state = inner.init(params)
  for w, finite in enumerate(flags):
    if not finite:
      continue
    window = grads[w * k:(w + 1) * k]
    if k == 1:
      mean = window[0]
    else:
      acc = jax.tree_util.tree_map(jnp.zeros_like, window[0])
      for g in window:
        acc = jax.tree_util.tree_map(jnp.add, acc, g)
      count = jnp.asarray(k, F32)  # A runtime divisor, as in the wrapper.
      mean = jax.tree_util.tree_map(lambda a: a / count, acc)
    updates, state = inner.update(mean, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def check_fault_run(make_inner, dtype, k, jit, params=None):
  """Runs FAULT_WINDOWS through ``loss_scaling(make_inner(), ...)`` and checks
  the final params and the scale trajectory against the references."""
  params = _fault_params() if params is None else params
  n = k * len(FAULT_WINDOWS)
  grads = _true_grads(n, dtype, like=params)
  bad = _bad_micro_batches(k)
  opt = jmp_lite.loss_scaling(
      make_inner(), jmp_lite.DynamicLossScale(**FAULT_SCALE),
      accumulation_steps=k)
  final, state, history = run_fault_sequence(opt, params, grads, bad, dtype,
                                             k, jit)
  flags = _window_flags(k, n)
  ref_params, _ = run_reference(make_inner(), params, grads, flags, k)
  if jit:
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, F32), np.asarray(b, F32), rtol=RTOL_JIT, atol=0),
        final, ref_params)
  else:
    assert_bit_identical(final, ref_params)
  assert not np.allclose(final["w"], params["w"])  # It did train.

  # The scale: backs off once per bad window, grows every 2 finite steps.
  ref_scales, _ = reference_dynamic(FAULT_SCALE, flags)
  used = [np.float32(FAULT_SCALE["loss_scale"])] + list(ref_scales[:-1])
  assert [h["scale"] for h in history] == used
  assert _scale_value(state.loss_scale) == ref_scales[-1]
  assert [h["scale"] for h in history] == [64, 64, 32, 32, 16, 8, 4, 4]
  assert [h["skipped"] for h in history] == [0, 1, 1, 2, 3, 4, 4, 4]
  assert [h["consecutive"] for h in history] == [0, 1, 0, 1, 2, 3, 0, 0]
  assert [h["last_finite"] for h in history] == flags
  return final, state


SGD_MOMENTUM = pytest.param(lambda: optax.sgd(0.1, momentum=0.9),
                            id="sgd_momentum")
ADAM = pytest.param(lambda: optax.adam(0.1), id="adam",
                    marks=standard_promotion)
JIT_IDS = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
DTYPES = pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)


@JIT_IDS
@DTYPES
@pytest.mark.parametrize("make_inner", default_run_keeps([SGD_MOMENTUM, ADAM]))
def test_fault_sequence_plain(make_inner, dtype, jit):
  check_fault_run(make_inner, dtype, 1, jit)


@JIT_IDS
@DTYPES
@pytest.mark.parametrize("k", default_run_keeps([2, 3]))
def test_fault_sequence_accumulation(k, dtype, jit):
  """A bad micro-batch first, in the middle, last, or two in one window: the
  whole window is skipped once; half gradients accumulate in float32."""
  _, state = check_fault_run(lambda: optax.sgd(0.1, momentum=0.9), dtype, k,
                             jit)
  assert _dtypes(state.accumulated) == {"w": F32, "b": F32}
  assert int(state.micro_step) == 0 and bool(state.window_finite)


def _multi_transform():
  return optax.multi_transform(
      {"adam": optax.adam(0.1), "sgd": optax.sgd(0.1, momentum=0.9)},
      {"w": "adam", "b": "sgd"})


#: (inner optimizer, params and gradient dtype).
COMPOSITIONS = [
    pytest.param(lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.adam(0.1)), F32, id="clip_adam"),
    pytest.param(lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=0.1), F32, id="inject_hyperparams_adam"),
    pytest.param(_multi_transform, F32, id="multi_transform"),
    # Half params with a float32 master copy: the gradients are half too.
    pytest.param(lambda: jmp_lite.master_weights(optax.adam(0.1)), BF16,
                 id="master_weights_adam_bf16"),
    pytest.param(lambda: jmp_lite.master_weights(optax.adam(0.1)), F16,
                 id="master_weights_adam_f16"),
]


@standard_promotion
@pytest.mark.parametrize("k", default_run_keeps([1, 3]))
@pytest.mark.parametrize("make_inner,dtype", default_run_keeps(COMPOSITIONS, unpack=True))
def test_fault_sequence_through_compositions(make_inner, dtype, k):
  """Eager, bitwise against the same inner optimizer alone."""
  params = _fault_params(dtype)
  final, state = check_fault_run(make_inner, dtype, k, jit=False,
                                 params=params)
  assert _dtypes(final) == _dtypes(params)
  if dtype != F32:  # master_weights: the params are the master copy rounded.
    master = jmp_lite.get_master_params(state, final)
    assert _dtypes(master) == {"w": F32, "b": F32}
    assert_bit_identical(final, jax.tree_util.tree_map(
        lambda m: m.astype(dtype), master))


@standard_promotion
@pytest.mark.parametrize("make_inner,dtype", default_run_keeps(COMPOSITIONS, unpack=True))
def test_fault_sequence_through_compositions_jit(make_inner, dtype):
  check_fault_run(make_inner, dtype, 3, jit=True,
                  params=_fault_params(dtype))


@standard_promotion
def test_fault_sequence_keeps_inject_hyperparams_count_and_learning_rate():
  """The skipped windows leave inject_hyperparams' state (count, the injected
  learning rate) as it was: 4 optimizer steps out of 8 windows."""
  _, state = check_fault_run(
      lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1), F32, 2,
      jit=False)
  inner = state.inner_state
  assert int(inner.count) == 4
  assert int(inner.inner_state[0].count) == 4
  assert float(inner.hyperparams["learning_rate"]) == np.float32(0.1)


# ---------------------------------------------------------------------------
# Every optax wrapper around and inside loss_scaling: the result of the inner
# optimizer on the finite steps only, or refused from the state's layout.
# ---------------------------------------------------------------------------

#: Inside the wrapper: each runs the fault sequence and must match the same
#: inner optimizer run alone on the finite windows (eager: bit for bit).
INSIDE = [
    pytest.param(lambda: optax.apply_if_finite(optax.adam(0.1), 3),
                 id="apply_if_finite"),
    pytest.param(lambda: optax.contrib.schedule_free(optax.sgd(0.1), 0.1),
                 id="schedule_free"),
    pytest.param(lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.sgd(0.1)), id="chain_clip"),
    pytest.param(lambda: optax.flatten(optax.adam(0.1)), id="flatten"),
    pytest.param(lambda: optax.masked(optax.adam(0.1), {"w": True, "b": False}),
                 id="masked"),
]


@standard_promotion
@pytest.mark.parametrize("k", default_run_keeps([1, 2]))
@pytest.mark.parametrize("make_inner", default_run_keeps(INSIDE))
def test_fault_sequence_with_optax_wrappers_inside(make_inner, k, request):
  # optax's schedule_free makes a NaN array of its own in every update
  # (jnp.full(shape, nan), selected away): eagerly, jax_debug_nans flags it.
  optax_nan = "schedule_free" in request.node.name
  with faulty(optax_nan):
    check_fault_run(make_inner, F32, k, jit=False)


@standard_promotion
def test_fault_sequence_with_lookahead_inside():
  """loss_scaling(lookahead(sgd)): params are LookaheadParams, gradients the
  fast params'. The skipped steps leave the fast and slow params and the
  synchronisation counter as they were."""
  fast = _fault_params()
  params = optax.LookaheadParams(fast=fast, slow=fast)
  grads = _true_grads(len(FAULT_WINDOWS), F32)
  bad = _bad_micro_batches(1)
  flags = _window_flags(1, len(FAULT_WINDOWS))
  make = lambda: optax.lookahead(optax.sgd(0.1), sync_period=2,
                                 slow_step_size=0.5)
  opt = jmp_lite.loss_scaling(make(), _DLS(**FAULT_SCALE))
  state = opt.init(params)
  for i, g in enumerate(grads):
    scale = _scale_value(jmp_lite.get_loss_scale(state))
    with faulty(i in bad):
      updates, state = opt.update(_scaled(g, scale, F32, bad.get(i)), state,
                                  params)
      params = optax.apply_updates(params, updates)
  ref_params, ref_state = optax.LookaheadParams(fast=fast, slow=fast), None
  inner = make()
  ref_state = inner.init(ref_params)
  for g, finite in zip(grads, flags):
    if finite:
      updates, ref_state = inner.update(g, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, updates)
  assert_bit_identical(params, ref_params)
  assert int(state.skipped_steps) == flags.count(False)


@pytest.mark.parametrize("k", [2, 3])
def test_lookahead_inside_with_accumulation_explains_the_structure(k):
  params = optax.LookaheadParams(fast=_fault_params(), slow=_fault_params())
  opt = jmp_lite.loss_scaling(optax.lookahead(optax.sgd(0.1), 2, 0.5),
                              _DLS(8.0), accumulation_steps=k)
  with pytest.raises(ValueError, match=r"structure of the params.*lookahead"):
    opt.update(_true_grads(1, F32)[0], opt.init(params), params)


def _ls(inner=None, scale=FAULT_SCALE):
  return jmp_lite.loss_scaling(optax.sgd(0.1) if inner is None else inner,
                               None if scale is None else _DLS(**scale))


#: Around the wrapper (name, the optimizer, what the error must say). The
#: refusal is structural: the state's layout shows the wrapper, and
#: get_loss_scale / scaled_value_and_grad (which read the whole state) refuse
#: it before anything is computed.
AROUND_REFUSED = [
    ("multi_steps", lambda s: optax.MultiSteps(_ls(scale=s), 2),
     r"MultiSteps.*accumulation_steps=k"),
    ("apply_if_finite", lambda s: optax.apply_if_finite(_ls(scale=s), 10),
     r"apply_if_finite.*back off.*max_consecutive_skips"),
    ("schedule_free", lambda s: optax.contrib.schedule_free(_ls(scale=s), 0.1),
     r"schedule_free.*skips.*loss_scaling\(optax\.contrib\.schedule_free"),
    ("lookahead", lambda s: optax.lookahead(_ls(scale=s), 2, 0.5),
     r"lookahead.*loss_scaling\(optax\.lookahead"),
    ("inject_hyperparams", lambda s: optax.inject_hyperparams(
        lambda learning_rate: _ls(optax.sgd(learning_rate), s))(
            learning_rate=optax.linear_schedule(0.1, 0.0, 10)),
     r"inject_hyperparams.*schedules"),
    ("chain_clip_first", lambda s: optax.chain(
        optax.clip_by_global_norm(1.0), _ls(scale=s)),
     r"chain runs 1 transformation\(s\) before loss_scaling"),
    ("chain_weight_decay_first", lambda s: optax.chain(
        optax.add_decayed_weights(1e-4), _ls(scale=s)),
     r"chain runs 1 transformation\(s\) before.*weight decay"),
    ("chain_nested", lambda s: optax.chain(
        optax.clip(1.0), optax.chain(_ls(scale=s), optax.scale(1.0))),
     r"chain runs 1 transformation\(s\) before loss_scaling"),
    ("chain_third", lambda s: optax.chain(
        optax.clip(1.0), optax.scale(1.0), _ls(scale=s)),
     r"chain runs 2 transformation\(s\) before loss_scaling"),
    ("multi_transform", lambda s: optax.multi_transform(
        {"ls": _ls(scale=s), "sgd": optax.sgd(0.1)}, {"w": "ls", "b": "sgd"}),
     r"partitions would receive scaled gradients"),
    ("masked", lambda s: optax.masked(_ls(scale=s), {"w": True, "b": False}),
     r"outside the mask would receive scaled gradients"),
    ("multi_steps_in_a_dict", lambda s: _DictOfStates(
        optax.MultiSteps(_ls(scale=s), 2)),
     r"MultiSteps.*accumulation_steps=k"),
]


def _DictOfStates(opt):  # pylint: disable=invalid-name
  """``opt``'s state kept in a dict, as a user's train state may."""
  return optax.GradientTransformation(
      lambda p: {"opt": opt.init(p), "step": jnp.zeros([], jnp.int32)},
      lambda u, s, p=None: opt.update(u, s["opt"], p))


def _refusals(state, params):
  """Every door that reads the whole state: get_loss_scale and
  scaled_value_and_grad, eagerly, under jit and on abstract values."""
  loss = lambda p: jnp.sum(p["w"])  # pylint: disable=unnecessary-lambda-assignment
  abstract = jax.eval_shape(lambda: state)
  return [
      lambda: jmp_lite.get_loss_scale(state),
      lambda: jax.jit(jmp_lite.get_loss_scale)(state),
      lambda: jmp_lite.get_loss_scale(abstract),
      lambda: jmp_lite.scaled_value_and_grad(loss, state)(params),
      lambda: jax.jit(lambda s, p: jmp_lite.scaled_value_and_grad(
          loss, s)(p))(state, params),
  ]


@standard_promotion
@pytest.mark.parametrize("shared", default_run_keeps([False, True]), ids=["own_scale", "shared"])
@pytest.mark.parametrize("name,make,pattern", AROUND_REFUSED,
                         ids=[c[0] for c in AROUND_REFUSED])
def test_optax_wrappers_around_loss_scaling_are_refused_from_the_layout(
    name, make, pattern, shared):
  """No call stack is read: init works (eagerly, jitted, abstractly) and the
  first door that sees the whole state refuses it, at trace time."""
  opt = make(None if shared else FAULT_SCALE)
  params = _fault_params()
  if name == "lookahead":
    params = optax.LookaheadParams(fast=params, slow=params)
  state = opt.init(params)
  jax.jit(opt.init)(params)
  jax.eval_shape(opt.init, params)
  fast = params.fast if isinstance(params, optax.LookaheadParams) else params
  for refused in _refusals(state, fast):
    with pytest.raises(TypeError, match=pattern):
      refused()


@standard_promotion
def test_what_no_layout_shows_is_not_refused():
  """docs/training_loops.md says it: optax.named_chain keeps its states in a
  dict, like any dict of states, so a transformation named before the
  wrapper is not seen; nor is a wrapper around loss_scaling in a loop that
  never hands the whole state to jmp_lite (a shared scale passed to update)."""
  params = _fault_params()
  named = optax.named_chain(("clip", optax.clip(1.0)), ("ls", _ls()))
  state = named.init(params)
  assert _scale_value(jmp_lite.get_loss_scale(state)) == FAULT_SCALE[
      "loss_scale"]
  shared = optax.MultiSteps(_ls(scale=None), 2)
  state = shared.init(params)
  _, state = shared.update(jax.tree.map(jnp.ones_like, params), state, params,
                           loss_scale=_DLS(2.0))
  assert int(state.mini_step) == 1


def test_a_user_tuple_of_states_names_the_way_out():
  """A plain tuple is optax.chain's layout; a user's own tuple with a
  loss_scaling state second is refused with the way out (pass it alone)."""
  params = _fault_params()
  states = (optax.sgd(0.1).init(params), _ls().init(params))
  with pytest.raises(TypeError, match=r"position 1 of a tuple.*state itself"):
    jmp_lite.get_loss_scale(states)
  assert _scale_value(jmp_lite.get_loss_scale(states[1])) == FAULT_SCALE[
      "loss_scale"]


def test_the_refusal_reads_no_call_stack():
  """loss_scaling's init works under optax.tree_map_params (optax's way to
  build state shardings), which the stack reading refused."""
  import inspect  # pylint: disable=g-import-not-at-top
  from jmp_lite._src import compat, loss_scaling  # pylint: disable=g-import-not-at-top
  assert "_getframe" not in inspect.getsource(loss_scaling)
  assert not hasattr(compat, "enclosing_optax_inits")
  params = _fault_params()
  opt = _ls(optax.adam(0.1))
  names = optax.tree_map_params(opt, lambda _: "param", opt.init(params),
                                transform_non_params=lambda _: "other")
  assert names.accumulated is None
  assert jax.tree.leaves(names.inner_state[0].mu) == ["param", "param"]


def test_loss_scaling_first_in_a_chain_matches_the_reference():
  """chain(loss_scaling(sgd), scale(0.5)): what follows the wrapper sees its
  (zero on a skipped step) updates; the run is chain(sgd, scale) on the finite
  steps."""
  params = _fault_params()
  grads = _true_grads(len(FAULT_WINDOWS), F32)
  bad = _bad_micro_batches(1)
  opt = optax.chain(_ls(optax.sgd(0.1, momentum=0.9)), optax.scale(0.5))
  named = optax.named_chain(("ls", _ls(optax.sgd(0.1, momentum=0.9))),
                            ("half", optax.scale(0.5)))
  flags = _window_flags(1, len(FAULT_WINDOWS))
  ref, _ = run_reference(optax.chain(optax.sgd(0.1, momentum=0.9),
                                     optax.scale(0.5)),
                         params, grads, flags, 1)
  for composed, ls_state in ((opt, lambda s: s[0]),
                             (named, lambda s: s["ls"])):
    p, state = params, composed.init(params)
    for i, g in enumerate(grads):
      scale = _scale_value(jmp_lite.get_loss_scale(state))
      with faulty(i in bad):
        updates, state = composed.update(_scaled(g, scale, F32, bad.get(i)),
                                         state, p)
        p = optax.apply_updates(p, updates)
    assert_bit_identical(p, ref)
    assert int(ls_state(state).skipped_steps) == flags.count(False)


@standard_promotion
@pytest.mark.parametrize("wrap", ["master_weights", "with_state_dtype"])
def test_our_wrappers_refuse_loss_scaling_inside(wrap):
  inner = _ls(optax.adam(0.1))
  opt = (jmp_lite.master_weights(inner) if wrap == "master_weights"
         else jmp_lite.with_state_dtype(inner, jnp.bfloat16))
  with pytest.raises(TypeError, match=r"loss_scaling.*outermost"):
    opt.init(_fault_params(BF16 if wrap == "master_weights" else F32))


# A state restored into a wrapper configured otherwise.


def _accumulating_state(k, micro_batches, grads):
  opt = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(4.0),
                              accumulation_steps=k)
  params = {"w": jnp.zeros(2, F32)}
  state = opt.init(params)
  for g in grads[:micro_batches]:
    _, state = opt.update({"w": jnp.full(2, 4.0 * g, F32)}, state, params)
  return state


@JIT_IDS
def test_state_restored_into_fewer_accumulation_steps_ends_its_window(jit):
  """Saved at micro_step=3 of accumulation_steps=4, restored into a wrapper
  with accumulation_steps=2: the next update ends the window with the mean of
  the four micro-batches it holds (never: a window end that never comes)."""
  grads = [1.0, 2.0, 3.0, 6.0, 5.0, 7.0]
  state = _accumulating_state(4, 3, grads)
  assert int(state.micro_step) == 3
  opt = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(4.0),
                              accumulation_steps=2)
  update = jax.jit(opt.update) if jit else opt.update
  params = {"w": jnp.zeros(2, F32)}
  applied = []
  for g in grads[3:]:
    updates, state = update({"w": jnp.full(2, 4.0 * g, F32)}, state, params)
    params = optax.apply_updates(params, updates)
    applied.append(float(params["w"][0]))
  # Window 1 (restored): mean(1, 2, 3, 6) = 3; then windows of 2: (5, 7) = 6.
  assert applied == [-3.0, -3.0, -9.0]
  assert int(state.micro_step) == 0 and int(state.skipped_steps) == 0


@pytest.mark.parametrize("made_with,used_with,pattern", [
    (1, 2, r"accumulation_steps=2\) got a state made without accumulation"),
    (3, 1, r"accumulation_steps=1\) got a state that accumulates"),
])
def test_state_of_another_accumulation_config_is_refused(made_with, used_with,
                                                         pattern):
  params = {"w": jnp.zeros(2, F32)}
  state = jmp_lite.loss_scaling(optax.sgd(1.0), _DLS(4.0),
                                accumulation_steps=made_with).init(params)
  opt = jmp_lite.loss_scaling(optax.sgd(1.0), _DLS(4.0),
                              accumulation_steps=used_with)
  for update in (opt.update, jax.jit(opt.update)):
    with pytest.raises(ValueError, match=pattern):
      update(_ones(), state, params)


# ---------------------------------------------------------------------------
# The scaling check: gradients handed to loss_scaling without being scaled.
# ---------------------------------------------------------------------------


def _softmax_regression_data():
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (256, 16))
  y = jnp.argmax(x @ jax.random.normal(kw, (16, 10)), axis=-1)
  return x, y


def _train_checked(loss_scale, scale_the_loss, steps, **options):
  """SGD on softmax regression through loss_scaling (its check on)."""
  x, y = _softmax_regression_data()
  params = {"w": jnp.zeros((16, 10)), "b": jnp.zeros(10)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.5), loss_scale, **options)

  def loss_fn(p):
    logits = x @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, state):
    if scale_the_loss:
      _, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params)
    else:  # the mistake: gradients of the unscaled loss
      grads = jax.grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return float(loss_fn(params)), state


def _ratio(check):
  return float(check.response) / float(check.scale_change)


def test_unscaled_gradients_with_a_static_scale_stall_and_are_flagged():
  scale = jmp_lite.StaticLossScale(2.0**15)
  good_loss, good = _train_checked(scale, True, 60)
  bad_loss, bad = _train_checked(scale, False, 60)
  assert good_loss < 0.5 * bad_loss  # the mistake stalls training silently
  assert bad_loss > 0.95 * math.log(10)
  assert bool(bad.looks_unscaled) and int(bad.scaling_check.suspect_steps) == 60
  assert not bool(good.looks_unscaled)
  assert int(good.scaling_check.suspect_steps) == 0
  assert float(good.scaling_check.scale_change) == 0  # a static scale


def test_unscaled_gradients_with_a_dynamic_scale_do_not_follow_it():
  scale = jmp_lite.DynamicLossScale(2.0**4, period=3)
  _, good = _train_checked(scale, True, 40)
  _, bad = _train_checked(scale, False, 40)
  assert float(bad.scaling_check.scale_change) >= 10
  assert float(good.scaling_check.scale_change) >= 10
  assert abs(_ratio(bad.scaling_check)) < 0.2
  assert abs(_ratio(good.scaling_check) - 1) < 0.2
  assert bool(bad.looks_unscaled) and not bool(good.looks_unscaled)


def test_without_the_check_nothing_is_kept_and_nothing_is_flagged():
  scale = jmp_lite.StaticLossScale(2.0**15)
  loss_on, on = _train_checked(scale, False, 30)
  loss_off, off = _train_checked(scale, False, 30, check_scaling=False)
  assert off.scaling_check is None and not bool(off.looks_unscaled)
  assert bool(on.looks_unscaled)
  assert loss_on == loss_off  # the check changes nothing else


def test_a_scale_too_small_is_suspect_until_the_response_clears_it():
  """Correctly scaled but tiny gradients (the digits demo's setting) fail the
  headroom test; once the scale has moved, the response clears them."""
  from jmp_lite._src.loss_scaling import ScalingCheck  # pylint: disable=g-import-not-at-top
  check = ScalingCheck.initial()
  rng = np.random.default_rng(0)
  largest = np.float32(np.max(np.abs(rng.standard_normal(1000))) * 1e-7)
  record = jax.jit(lambda c, m, s: c.record(m, s))
  scale = 2.0**4
  for i in range(30):
    check = record(check, largest * np.float32(rng.uniform(0.9, 1.1) * scale),
                   scale)
    if i == 19:  # 20 suspect steps, the scale has moved by one binade
      assert int(check.suspect_steps) == 20
      assert float(check.scale_change) == 1.0
      assert bool(check.looks_unscaled())
    if i % 10 == 9:
      scale *= 2
  assert float(check.scale_change) == 2.0
  assert abs(_ratio(check) - 1) < 0.2
  assert not bool(check.looks_unscaled())


@JIT_IDS
def test_non_finite_and_zero_steps_leave_the_check_unchanged(jit):
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), _DLS(2.0**15))
  update = jax.jit(opt.update) if jit else opt.update
  params = {"w": jnp.zeros(2, F32)}
  _, state = update({"w": jnp.ones(2, F32)}, opt.init(params), params)
  for bad in (np.inf, np.nan, None):
    with faulty(bad is not None):
      w = jnp.zeros(2) if bad is None else jnp.array([bad, 1.0])
      _, same = update({"w": w}, state, params)
    assert_bit_identical(same.scaling_check, state.scaling_check)


@JIT_IDS
def test_one_reduction_decides_finiteness_with_nan_and_half_leaves(jit):
  """The wrapper's one reduction (largest magnitude, NaN as inf) skips a NaN
  anywhere and reads half-precision leaves."""
  opt = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.StaticLossScale(4.0))
  update = jax.jit(opt.update) if jit else opt.update
  params = {"a": jnp.zeros(2, BF16), "b": jnp.zeros(2, F32)}
  state = opt.init(params)
  grads = {"a": jnp.array([4.0, -20.0], BF16), "b": jnp.array([8.0, 2.0])}
  updates, state = update(grads, state, params)
  assert bool(state.last_finite)
  np.testing.assert_array_equal(updates["a"], [-1.0, 5.0])
  assert float(state.scaling_check.last_log2_max) == pytest.approx(
      math.log2(20.0))
  with faulty():
    grads["b"] = jnp.array([jnp.nan, 2.0])
    _, state = update(grads, state, params)
  assert not bool(state.last_finite)


# ---------------------------------------------------------------------------
# Several optimizers sharing one scale.
# ---------------------------------------------------------------------------


def _shared_run(jit, steps, bad_a, bad_b, dtype=F16):
  """Two optimizers (a GAN's two, say) on two param sets, one shared scale.

  Each step scales both gradients with the shared scale; each optimizer skips
  on its own non-finite gradients; the scale adjusts once, backing off if
  either skipped.
  """
  params = {"a": _fault_params(seed=0), "b": _fault_params(seed=5)}
  grads = {"a": _true_grads(steps, dtype, seed=1),
           "b": _true_grads(steps, dtype, seed=2)}
  make = {"a": lambda: optax.sgd(0.1, momentum=0.9),
          "b": lambda: optax.sgd(0.05)}
  opts = {name: jmp_lite.loss_scaling(make[name]()) for name in ("a", "b")}
  updates_fn = {name: jax.jit(o.update) if jit else o.update
                for name, o in opts.items()}
  states = {name: o.init(params[name]) for name, o in opts.items()}
  bad = {"a": bad_a, "b": bad_b}
  scale = jmp_lite.DynamicLossScale(**FAULT_SCALE)
  used = []
  for i in range(steps):
    used.append(_scale_value(scale))
    for name in ("a", "b"):
      old = (params[name], states[name])
      with faulty(i in bad[name]):
        g = _scaled(grads[name][i], scale.loss_scale, dtype,
                    bad[name].get(i))
        updates, states[name] = updates_fn[name](
            g, states[name], params[name], loss_scale=scale)
        params[name] = optax.apply_updates(params[name], updates)
      assert states[name].loss_scale is None
      if i in bad[name]:
        assert_bit_identical((params[name], states[name].inner_state),
                              (old[0], old[1].inner_state))
    scale = scale.adjust(states["a"].last_finite & states["b"].last_finite)
  refs = {name: run_reference(make[name](), _fault_params(
      seed={"a": 0, "b": 5}[name]), grads[name],
                               [i not in bad[name] for i in range(steps)],
                               1)[0] for name in ("a", "b")}
  return params, states, scale, used, refs


@JIT_IDS
def test_shared_scale_each_optimizer_skips_on_its_own_gradients(jit):
  """torch's one GradScaler for two optimizers: a's inf skips a only, b's nan
  skips b only, both bad skips both; the scale backs off once per bad step."""
  steps = 8
  bad_a, bad_b = {1: np.inf, 4: np.inf}, {3: np.nan, 4: -np.inf}
  params, states, scale, used, refs = _shared_run(jit, steps, bad_a, bad_b)
  for name, bad in (("a", bad_a), ("b", bad_b)):
    if jit:
      jax.tree_util.tree_map(
          lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL_JIT),
          params[name], refs[name])
    else:
      assert_bit_identical(params[name], refs[name])
    assert int(states[name].skipped_steps) == len(bad)
  flags = [i not in bad_a and i not in bad_b for i in range(steps)]
  ref_scales, _ = reference_dynamic(FAULT_SCALE, flags)
  assert used == [64.0] + list(ref_scales[:-1])
  assert used == [64, 64, 32, 32, 16, 8, 8, 16]
  assert _scale_value(scale) == ref_scales[-1]


def test_shared_scale_state_holds_no_scale():
  opt = jmp_lite.loss_scaling(optax.sgd(0.1))
  state = opt.init(_fault_params())
  assert state.loss_scale is None
  with pytest.raises(ValueError, match="shares a loss scale"):
    jmp_lite.get_loss_scale(state)


# ---------------------------------------------------------------------------
# The issue's measured scenarios, as regression tests.
# ---------------------------------------------------------------------------

#: Scenario (a): the scaled gradients fed to the optimizer, one per update.
ISSUE_GRADS = [1.0, 1.0, np.inf, 1.0, 1.0, 1.0]


@standard_promotion  # optax.MultiSteps
@pytest.mark.parametrize("scale", [jmp_lite.DynamicLossScale(128.0, period=1),
                                   jmp_lite.StaticLossScale(128.0), None],
                         ids=["dynamic", "static", "shared"])
def test_issue_a_multi_steps_around_loss_scaling_is_refused_at_first_step(
    scale):
  """MultiSteps(loss_scaling(...), 2): its accumulator resets by multiplying
  with 0, so one inf micro-batch becomes NaN for good and every later window
  is skipped. Refused from the state's layout by the first door that reads
  the whole state (the documented step's get_loss_scale), at trace time,
  before the first step computes anything. (A jmp-style loop that never
  hands the whole state to jmp_lite is what no layout check can see:
  docs/training_loops.md says so.)"""
  opt = optax.MultiSteps(jmp_lite.loss_scaling(optax.sgd(1.0), scale), 2)
  state = opt.init({"w": jnp.zeros(2, F32)})
  with pytest.raises(TypeError, match=r"MultiSteps.*accumulation_steps=k"):
    jax.jit(jmp_lite.get_loss_scale)(state)


#: What the stall guard's error says (under jit JAX reports the callback's
#: FloatingPointError as a runtime error carrying its message).
STALL_ERROR = (FloatingPointError, RuntimeError)
STALL_MESSAGE = (r"(?s)gave up.*optax\.MultiSteps around loss_scaling.*"
                 r"loss_scaling\(inner, loss_scale, accumulation_steps=k\)")


def _stalled_multi_steps_run(opt, update, micro_steps, state=None, start=0,
                             **extra):
  """Feeds ``MultiSteps(loss_scaling(...), 2)`` finite gradients with one inf
  micro-batch (the third: window 0 trains, window 1 has the inf), calling
  only init/update, as a loop that scales its loss with a scale of its own
  does; returns the last state."""
  params = {"w": jnp.zeros(2, F32)}
  state = opt.init(params) if state is None else state
  for i in range(start, micro_steps):
    grads = _inf() if i == 2 else _ones()
    with faulty(i >= 2):  # From the inf on, MultiSteps' accumulator is NaN.
      _, state = update(grads, state, params, **extra)
      jax.block_until_ready(state)
  return state


def _stalled_multi_steps_updates(opt, update, micro_steps, **extra):
  """:func:`_stalled_multi_steps_run`, keeping every micro-step's updates."""
  params = {"w": jnp.zeros(2, F32)}
  state, out = opt.init(params), []
  for i in range(micro_steps):
    grads = _inf() if i == 2 else _ones()
    with faulty(i >= 2):
      updates, state = update(grads, state, params, **extra)
      out.append(np.asarray(updates["w"]))
  return out, state


@standard_promotion  # optax.MultiSteps
@pytest.mark.parametrize(
    "scale,jit", default_run_keeps([("dynamic", False), ("dynamic", True), ("noop", True),
                                    ("shared", True)], unpack=True),
    ids=["dynamic-eager", "dynamic-jit", "noop-jit", "shared-jit"])
def test_multi_steps_around_loss_scaling_stalls_loudly_through_update(
    scale, jit):
  """The loops no layout check sees (they never hand the whole state to
  jmp_lite: a jmp-style loop with a scale of its own around a
  DynamicLossScale or NoOpLossScale wrapper, a shared scale passed to update)
  call only init and update. MultiSteps' accumulator turns NaN for good at
  the inf micro-batch and every later window is skipped, until the stall
  guard acts at the max_consecutive_skips-th non-finite window in a row: by
  default it applies that window (its NaN reaches the updates, as
  optax.apply_if_finite does), with on_max_skips='raise' it raises, naming
  MultiSteps and the composition to write instead."""
  wrapper_scale = {"dynamic": _DLS(2.0**10), "noop": jmp_lite.NoOpLossScale(),
                   "shared": None}[scale]
  extra = {"loss_scale": _DLS(2.0**10)} if scale == "shared" else {}
  # The default mode, "apply".
  opt = optax.MultiSteps(jmp_lite.loss_scaling(
      optax.sgd(0.1), wrapper_scale, max_consecutive_skips=3), 2)
  update = jax.jit(opt.update) if jit else opt.update
  updates, state = _stalled_multi_steps_updates(opt, update, 8, **extra)
  # Window 0 trained; windows 1-2 skipped (zero updates); window 3 applied
  # (MultiSteps calls update on every micro-step and multiplies a mid-step's
  # updates by 0, which keeps their NaN: both of window 3's are non-finite).
  assert np.all(np.isfinite(updates[1])) and np.any(updates[1] != 0)
  assert all(np.all(u == 0) for u in updates[2:6]), updates
  assert all(not np.isfinite(u).all() for u in updates[6:8]), updates
  assert bool(state.inner_opt_state.gave_up)
  assert int(state.inner_opt_state.skipped_steps) == 2
  assert np.isnan(np.asarray(state.acc_grads["w"])[0])  # MultiSteps', for good
  # on_max_skips="raise".
  opt = optax.MultiSteps(jmp_lite.loss_scaling(
      optax.sgd(0.1), wrapper_scale, max_consecutive_skips=3,
      on_max_skips="raise"), 2)
  update = jax.jit(opt.update) if jit else opt.update
  # Window 0 trained; windows 1-2 skipped, not yet the limit.
  state = _stalled_multi_steps_run(opt, update, 6, **extra)
  assert int(state.inner_opt_state.consecutive_skips) == 2
  assert int(state.inner_opt_state.skipped_steps) == 2
  assert int(state.gradient_step) == 3
  with pytest.raises(STALL_ERROR, match=STALL_MESSAGE):
    _stalled_multi_steps_run(opt, update, 8, state, 6, **extra)


@standard_promotion  # optax.MultiSteps
def test_multi_steps_stall_is_applied_at_the_default_limit():
  """With loss_scaling's defaults (max_consecutive_skips=100,
  on_max_skips='apply'), the stalled run's 100th non-finite window in a row
  is applied (NaN reaches the updates) and no window before it; one jitted
  scan of 2 * 100 + 2 micro-steps."""
  params = {"w": jnp.zeros(2, F32)}
  opt = optax.MultiSteps(
      jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale()), 2)
  assert int(opt.init(params).inner_opt_state.max_consecutive_skips) == 100

  @jax.jit
  def run(state):
    def body(state, i):
      grads = {"w": jnp.where(i == 2, np.float32(np.inf), jnp.ones(2, F32))}
      updates, state = opt.update(grads, state, params)
      return state, ~jnp.all(jnp.isfinite(updates["w"]))
    return lax.scan(body, state, jnp.arange(2 + 2 * 100))

  with faulty():
    state, nan = run(opt.init(params))
  nan = np.asarray(nan)
  assert not nan[:-2].any() and nan[-2:].all()  # the 100th window only
  assert int(state.inner_opt_state.skipped_steps) == 99
  assert bool(state.inner_opt_state.gave_up)


@standard_promotion  # optax.MultiSteps
def test_separate_scales_pattern_inside_multi_steps_stalls_loudly():
  """docs/training_loops.md's separate-scales pattern (each loss's own
  scale, the unscaled sum to a NoOpLossScale wrapper) with MultiSteps around
  the wrapper: the losses' scales recover after an overflow, MultiSteps'
  accumulator does not, and the guard raises (on_max_skips='raise')."""
  def separate_scales_step(params, opt_state, scales, x, optimizer):
    total, new_scales = None, []
    for loss_fn, scale in zip((lambda p: jnp.sum(p["w"] * x),
                               lambda p: 1e3 * jnp.sum(p["w"] * x)), scales):
      grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
      grads = scale.unscale(grads)
      new_scales.append(scale.adjust(jmp_lite.all_finite(grads)))
      total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    updates, opt_state = optimizer.update(total, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, tuple(new_scales)

  optimizer = optax.MultiSteps(jmp_lite.loss_scaling(
      optax.sgd(1e-3), jmp_lite.NoOpLossScale(), max_consecutive_skips=2,
      on_max_skips="raise"), 2)
  step = jax.jit(functools.partial(separate_scales_step, optimizer=optimizer))
  params = {"w": jnp.full(2, 0.1, F32)}
  state = optimizer.init(params)
  scales = (_DLS(2.0**10), _DLS(2.0**10))
  with faulty():
    with pytest.raises(STALL_ERROR, match=STALL_MESSAGE):
      for i in range(8):  # Micro-batch 2 overflows the second loss only.
        x = jnp.full(2, 1e35 if i == 2 else 1.0, F32)
        params, state, scales = step(params, state, scales, x)
        jax.block_until_ready(state)
  assert [float(s.loss_scale) for s in scales] == [2.0**10, 2.0**9]


@standard_promotion  # optax.MultiSteps
def test_without_the_guard_the_stall_is_silent():
  """max_consecutive_skips=None turns the guard off: docs/training_loops.md
  says the stall is then silent again (every window skipped)."""
  opt = optax.MultiSteps(jmp_lite.loss_scaling(
      optax.sgd(0.1), jmp_lite.NoOpLossScale(), max_consecutive_skips=None),
      2)
  state = _stalled_multi_steps_run(opt, jax.jit(opt.update), 12)
  assert int(state.inner_opt_state.consecutive_skips) == 5
  assert state.inner_opt_state.max_consecutive_skips is None


@JIT_IDS
def test_issue_a_accumulation_steps_trains_windows_1_and_3(jit):
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(
      optax.sgd(1.0), jmp_lite.DynamicLossScale(128.0, period=1),
      accumulation_steps=2)
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  seen = []
  for g in ISSUE_GRADS:
    updates, state = _update(update, {"w": np.full(2, g, F32)}, state, params)
    params = optax.apply_updates(params, updates)
    seen.append((float(params["w"][0]), _scale_value(state.loss_scale),
                 int(state.skipped_steps)))
    chex.assert_tree_all_finite(state.accumulated)
  # Window 1 at scale 128 (-1/128), grows to 256; window 2 skipped once, the
  # scale backs off to 128; window 3 trains at 128 (-1/128 more).
  assert seen == [(0.0, 128.0, 0), (-1 / 128, 256.0, 0),
                  (-1 / 128, 256.0, 0), (-1 / 128, 128.0, 1),
                  (-1 / 128, 128.0, 1), (-2 / 128, 256.0, 1)]


def test_issue_b_two_scales_drift_apart_one_shared_scale_cannot():
  """Two wrappers with a scale each (the old way): an overflow in one
  model's gradients backs off only its scale, and the two drift apart. Shared
  mode keeps one scale, backed off once when either overflowed."""
  params = _fault_params()
  grads = _true_grads(6, F16)
  bad_a = {1: np.inf, 3: np.inf}
  own = [jmp_lite.loss_scaling(optax.sgd(0.1),
                               jmp_lite.DynamicLossScale(**FAULT_SCALE))
         for _ in range(2)]
  own_states = [o.init(params) for o in own]
  shared = [jmp_lite.loss_scaling(optax.sgd(0.1)) for _ in range(2)]
  shared_states = [o.init(params) for o in shared]
  scale = jmp_lite.DynamicLossScale(**FAULT_SCALE)
  drift = []
  for i, g in enumerate(grads):
    for j in range(2):
      bad = bad_a.get(i) if j == 0 else None
      s = jmp_lite.get_loss_scale(own_states[j])
      with faulty(bad is not None):
        _, own_states[j] = own[j].update(_scaled(g, s.loss_scale, F16, bad),
                                         own_states[j], params)
        _, shared_states[j] = shared[j].update(
            _scaled(g, scale.loss_scale, F16, bad), shared_states[j], params,
            loss_scale=scale)
    scale = scale.adjust(shared_states[0].last_finite
                         & shared_states[1].last_finite)
    drift.append(_scale_value(own_states[1].loss_scale)
                 / _scale_value(own_states[0].loss_scale))
  # b grows while a backs off: after two overflows of a, b's scale is 16x
  # a's (64 -> 128 -> 256 against 64 -> 32 -> 16).
  assert drift == [1.0, 4.0, 4.0, 16.0, 16.0, 16.0]
  assert _scale_value(scale) == 32.0  # 64 -> 32 -> 32 -> 16 -> 16 -> 32
  assert [int(s.skipped_steps) for s in shared_states] == [2, 0]


def _regression_problem():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, 8)), F32)
  y = x @ jnp.asarray(rng.normal(size=(8,)), F32)
  loss = lambda w: jnp.mean(jnp.square(x @ w - y))
  return loss, jnp.zeros(8, F32)


def clipping_losses(steps=100, scale=2.0**15):
  """Final loss of ``clip_by_global_norm(1) + sgd(0.1)`` on a least-squares
  problem: unscaled float32, and the clip inside ``loss_scaling``.

  Returns:
    dict of final losses (``initial``, ``f32``, ``inside``).
  """
  loss, w0 = _regression_problem()
  clip_sgd = lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.sgd(0.1))
  ls = lambda: jmp_lite.DynamicLossScale(scale)
  runs = {
      "f32": (clip_sgd(), lambda w, s: jax.grad(loss)(w)),
      "inside": (jmp_lite.loss_scaling(clip_sgd(), ls()), None),
  }
  out = {"initial": float(loss(w0))}
  for name, (opt, grad_fn) in runs.items():

    @jax.jit
    def step(w, state, opt=opt, grad_fn=grad_fn):
      if grad_fn is None:
        grads = jmp_lite.scaled_value_and_grad(loss, state)(w)[1]
      else:
        grads = grad_fn(w, state)
      updates, state = opt.update(grads, state, w)
      return optax.apply_updates(w, updates), state

    w, state = w0, opt.init(w0)
    for _ in range(steps):
      w, state = step(w, state)
    out[name] = float(loss(w))
  return out


def test_issue_c_clipping_belongs_inside_the_wrapper():
  """Inside, the clip sees unscaled gradients: the run is the float32 run.
  Chained before the wrapper it would clip the scaled gradients to norm 1 (the
  true ones to 2**-15): refused from the state's layout."""
  losses = clipping_losses()
  assert losses["inside"] == pytest.approx(losses["f32"], rel=1e-5)
  assert losses["f32"] < 1e-3 * losses["initial"]
  outside = optax.chain(optax.clip_by_global_norm(1.0),
                        jmp_lite.loss_scaling(optax.sgd(0.1), _DLS(2.0**15)))
  with pytest.raises(TypeError, match=r"chain runs 1 transformation\(s\) "
                     r"before loss_scaling.*clip"):
    jmp_lite.get_loss_scale(outside.init(jnp.zeros(8, F32)))


@JIT_IDS
def test_issue_d_scales_at_the_float32_limits_still_unscale_exactly(jit):
  """Growth stops at 2**126 and a zero floor at 2**-126 inside the wrapper:
  the steps there still train with the exact unscaled gradients."""
  true = jnp.asarray([1.5, -2.0], F32)
  # At 2**-126, scaled values below 1 are float32 subnormals, which XLA
  # flushes to zero: the round trip is checked with 3.0 there.
  for config, flag_seq, limit, x in (
      (dict(loss_scale=2.0**125, period=1), [True] * 3, SCALE_MAX, 0.75),
      (dict(loss_scale=2.0**-120, min_loss_scale=0, factor=16.0),
       [False] * 3 + [True], SCALE_MIN, 3.0)):
    opt = jmp_lite.loss_scaling(optax.sgd(1.0),
                                jmp_lite.DynamicLossScale(**config))
    update = jax.jit(opt.update) if jit else opt.update
    params = {"w": jnp.zeros(2, F32)}
    state = opt.init(params)
    applied = 0
    for finite in flag_seq:
      ls = jmp_lite.get_loss_scale(state)
      grads = {"w": ls.scale(true) if finite else np.full(2, np.inf, F32)}
      updates, state = _update(update, grads, state, params)
      params = optax.apply_updates(params, updates)
      applied += finite
      np.testing.assert_array_equal(params["w"], -applied * np.asarray(true))
    ls = jmp_lite.get_loss_scale(state)
    assert _scale_value(ls) == limit
    assert float(ls.unscale(ls.scale(jnp.float32(x)))) == x
    assert float(ls.unscale(ls.scale(x))) == x
    assert _scale_value(ls) > 0 and math.isfinite(_scale_value(ls))
  top = jmp_lite.DynamicLossScale(2.0**126)  # constructed at the ceiling
  assert float(top.unscale(top.scale(jnp.float32(0.75)))) == 0.75


# ---------------------------------------------------------------------------
# Giving up after max_consecutive_skips.
# ---------------------------------------------------------------------------


def _inf(n=2):
  """numpy: a JAX op making inf would trip jax_debug_infs (see _update)."""
  return {"w": np.full(n, np.inf, F32)}


def _is_faulty(tree):
  return not all(np.all(np.isfinite(np.asarray(x)))
                 for x in jax.tree_util.tree_leaves(tree))


def _update(update, grads, *args, **kwargs):
  """``update(grads, ...)``, with jax_debug_nans/infs off where ``grads``
  hold NaN/inf on purpose."""
  with faulty(_is_faulty(grads)):
    return update(grads, *args, **kwargs)


def _ones(n=2):
  return {"w": jnp.ones(n, F32)}


@JIT_IDS
def test_gave_up_flag_after_n_skips_and_reset_by_a_finite_step(jit):
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0),
                              max_consecutive_skips=3, on_max_skips="flag")
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  assert not bool(state.gave_up)
  seen = []
  for grads in (_inf(), _inf(), _ones(), _inf(), _inf(), _inf(), _inf(),
                _ones()):
    _, state = _update(update, grads, state, params)
    seen.append((int(state.consecutive_skips), bool(state.gave_up)))
  assert seen == [(1, False), (2, False), (0, False), (1, False), (2, False),
                  (3, True), (4, True), (0, False)]
  assert int(state.skipped_steps) == 6
  assert state.gave_up.dtype == np.bool_


def test_gave_up_is_false_without_a_limit():
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0),
                              max_consecutive_skips=None)
  params = {"w": jnp.zeros(2, F32)}
  state = opt.init(params)
  for _ in range(3):
    _, state = _update(opt.update, _inf(), state, params)
  assert not bool(state.gave_up) and int(state.consecutive_skips) == 3


@JIT_IDS
def test_on_max_skips_raise(jit):
  """The step that reaches the limit fails, naming it; the steps before do
  not, and a finite step in between starts the count again."""
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0),
                              max_consecutive_skips=2, on_max_skips="raise")
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  for grads in (_inf(), _ones(), _inf()):
    _, state = _update(update, grads, state, params)
    jax.block_until_ready(state)
  assert int(state.consecutive_skips) == 1
  # Eagerly the callback's FloatingPointError surfaces as it is; under jit
  # JAX reports it as a runtime error carrying the message.
  with pytest.raises((FloatingPointError, RuntimeError),
                     match=r"gave up.*max_consecutive_skips=2"):
    _, state = _update(update, _inf(), state, params)
    jax.block_until_ready(state)


@JIT_IDS
def test_on_max_skips_apply_is_the_default(jit):
  """From the limit-th non-finite step in a row on, the step is applied like
  a finite one (optax.apply_if_finite's rule): its NaN reaches the updates
  and the inner state; the steps before are skipped, and a finite step in
  between starts the count again. No host callback: the step exports."""
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0),
                              max_consecutive_skips=2)
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(params)
  seen = []
  with faulty():
    for grads in (_inf(), _ones(), _inf(), _inf(), _inf(), _ones()):
      updates, state = _update(update, grads, state, params)
      seen.append((not np.isfinite(np.asarray(updates["w"])).all(),
                   int(state.skipped_steps), int(state.consecutive_skips),
                   bool(state.gave_up)))
  assert seen == [(False, 1, 1, False), (False, 1, 0, False),
                  (False, 2, 1, False), (True, 2, 2, True),
                  (True, 2, 3, True), (False, 2, 0, False)]
  exported = jax.export.export(jax.jit(opt.update), platforms=["cuda"])(
      _ones(), opt.init(params), params)
  assert "callback" not in exported.mlir_module()


def test_max_consecutive_skips_with_accumulation_counts_windows():
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0),
                              accumulation_steps=3, max_consecutive_skips=2,
                              on_max_skips="flag")
  update = jax.jit(opt.update)
  state = opt.init(params)
  # Window 1: two bad micro-batches; window 2: the last one bad.
  seen = []
  for grads in (_inf(), _inf(), _ones(), _ones(), _ones(), _inf(), _ones()):
    _, state = _update(update, grads, state, params)
    seen.append((int(state.skipped_steps), int(state.consecutive_skips),
                 bool(state.gave_up)))
  assert seen == [(0, 0, False), (0, 0, False), (1, 1, False),
                  (1, 1, False), (1, 1, False), (2, 2, True), (2, 2, True)]
  assert _scale_value(state.loss_scale) == 2.0  # backed off once per window


def test_gave_up_message_reports_the_scale_the_state_now_holds():
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(128.0),
                              max_consecutive_skips=2, on_max_skips="raise")
  state = opt.init(params)
  _, state = _update(opt.update, _inf(), state, params)  # 128 -> 64
  with pytest.raises(STALL_ERROR) as excinfo:
    _update(opt.update, _inf(), state, params)  # 64 -> 32, and gives up
  assert "loss scale is now 32" in str(excinfo.value), str(excinfo.value)


@standard_promotion  # accumulation around adam
def test_on_max_skips_raise_with_accumulation_raises_at_the_window_end():
  params = {"w": jnp.zeros(2, F32)}
  opt = jmp_lite.loss_scaling(optax.adam(0.1), jmp_lite.DynamicLossScale(8.0),
                              accumulation_steps=2, max_consecutive_skips=1,
                              on_max_skips="raise")
  update = jax.jit(opt.update)
  state = opt.init(params)
  _, state = _update(update, _inf(), state, params)  # mid-window: not yet
  jax.block_until_ready(state)
  with pytest.raises((FloatingPointError, RuntimeError), match="gave up"):
    _, state = update(_ones(), state, params)
    jax.block_until_ready(state)


# ---------------------------------------------------------------------------
# Bad values of every new option: the error type and a message naming it.
# ---------------------------------------------------------------------------

_DLS = jmp_lite.DynamicLossScale


def _sgd_scaled(**kwargs):
  return jmp_lite.loss_scaling(optax.sgd(0.1), _DLS(8.0), **kwargs)


def test_integer_options_accept_numpy_integers():
  # Config systems hand over numpy integers.
  opt = _sgd_scaled(accumulation_steps=np.int64(2), max_consecutive_skips=np.int32(3))
  state = opt.init({"w": jnp.zeros(2, F32)})
  assert int(state.max_consecutive_skips) == 3 and int(state.micro_step) == 0


def _update_shared_without_scale():
  opt = jmp_lite.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.zeros(2, F32)}
  opt.update(_ones(), opt.init(params), params)


def _update_own_with_shared_scale():
  opt = _sgd_scaled()
  params = {"w": jnp.zeros(2, F32)}
  opt.update(_ones(), opt.init(params), params, loss_scale=_DLS(8.0))


def _update_shared_with(loss_scale):
  opt = jmp_lite.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.zeros(2, F32)}
  opt.update(_ones(), opt.init(params), params, loss_scale=loss_scale)


def _update_shared_with_a_number():
  _update_shared_with(8.0)


def _nested():
  opt = jmp_lite.loss_scaling(_sgd_scaled(), _DLS(8.0))
  opt.init({"w": jnp.zeros(2, F32)})


def _restored_without_target(read):
  """A checkpoint restored without a target: the loss scale is a dict."""
  opt = _sgd_scaled()
  params = {"w": jnp.zeros(2, F32)}
  state = opt.init(params)
  state = state._replace(loss_scale={"loss_scale": jnp.float32(8.0),
                                     "counter": jnp.int32(0)})
  if read:
    jmp_lite.get_loss_scale(state)
  else:
    opt.update(_ones(), state, params)


BAD_OPTIONS = [
    # loss_scaling's options.
    ("accumulation_steps_0", lambda: _sgd_scaled(accumulation_steps=0),
     ValueError, [r"accumulation_steps", r"\b0\b"]),
    ("accumulation_steps_float", lambda: _sgd_scaled(accumulation_steps=1.5),
     TypeError, [r"accumulation_steps", r"1\.5"]),
    ("accumulation_steps_bool", lambda: _sgd_scaled(accumulation_steps=True),
     TypeError, [r"accumulation_steps", r"True"]),
    ("max_consecutive_skips_0", lambda: _sgd_scaled(max_consecutive_skips=0),
     ValueError, [r"max_consecutive_skips", r"\b0\b"]),
    ("max_consecutive_skips_str",
     lambda: _sgd_scaled(max_consecutive_skips="3"),
     TypeError, [r"max_consecutive_skips", r"'3'"]),
    ("on_max_skips_x", lambda: _sgd_scaled(on_max_skips="x"),
     ValueError, [r"on_max_skips", r"'x'", r"apply", r"flag", r"raise"]),
    ("shared_with_accumulation",
     lambda: jmp_lite.loss_scaling(optax.sgd(0.1), accumulation_steps=2),
     ValueError, [r"accumulation_steps", r"loss scale"]),
    ("shared_update_without_loss_scale", _update_shared_without_scale,
     TypeError, [r"loss_scale=scale", r"without a loss scale"]),
    ("own_scale_update_with_loss_scale", _update_own_with_shared_scale,
     TypeError, [r"loss_scale=", r"its own scale"]),
    ("shared_update_with_a_number", _update_shared_with_a_number,
     TypeError, [r"number 8\.0", r"DynamicLossScale"]),
    ("loss_scale_class", lambda: jmp_lite.loss_scaling(optax.sgd(0.1), _DLS),
     TypeError, [r"class DynamicLossScale", r"DynamicLossScale\(2\.0\*\*15\)"]),
    # A class where an instance belongs: NoOpLossScale's class even has the
    # methods isinstance(x, LossScale) looks for. One check, at every door
    # that takes a loss scale, naming it and the instance to create.
    ("loss_scale_noop_class",
     lambda: jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale),
     TypeError, [r"^loss_scaling\b", r"class NoOpLossScale",
                 r"NoOpLossScale\(\)"]),
    ("loss_scale_static_class",
     lambda: jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale),
     TypeError, [r"class StaticLossScale", r"StaticLossScale\(2\.0\*\*15\)"]),
    ("get_loss_scale_of_a_class",
     lambda: jmp_lite.get_loss_scale(jmp_lite.NoOpLossScale),
     TypeError, [r"^get_loss_scale\b", r"class NoOpLossScale",
                 r"NoOpLossScale\(\)"]),
    ("scaled_value_and_grad_of_a_class",
     lambda: jmp_lite.scaled_value_and_grad(jnp.sum, _DLS),
     TypeError, [r"^scaled_value_and_grad\b", r"class DynamicLossScale",
                 r"DynamicLossScale\(2\.0\*\*15\)"]),
    ("shared_update_with_a_class",
     lambda: _update_shared_with(jmp_lite.NoOpLossScale),
     TypeError, [r"update\(loss_scale=\.\.\.\)", r"class NoOpLossScale",
                 r"NoOpLossScale\(\)"]),
    ("nested_loss_scaling", _nested,
     TypeError, [r"already contains loss_scaling", r"outermost"]),
    ("dict_loss_scale_in_update", lambda: _restored_without_target(False),
     TypeError, [r"plain dict", r"target"]),
    ("dict_loss_scale_in_get_loss_scale",
     lambda: _restored_without_target(True),
     TypeError, [r"plain dict", r"target"]),
    # DynamicLossScale's new options.
    ("hysteresis_0", lambda: _DLS(8.0, hysteresis=0),
     ValueError, [r"hysteresis", r"\b0\b"]),
    ("hysteresis_float", lambda: _DLS(8.0, hysteresis=1.5),
     ValueError, [r"hysteresis", r"1\.5"]),
    ("hysteresis_bool", lambda: _DLS(8.0, hysteresis=True),
     TypeError, [r"hysteresis", r"bool|True"]),
    ("backoff_factor_1", lambda: _DLS(8.0, backoff_factor=1.0),
     ValueError, [r"backoff_factor", r"1\.0", r"\(0, 1\)"]),
    ("backoff_factor_0", lambda: _DLS(8.0, backoff_factor=0.0),
     ValueError, [r"backoff_factor", r"\b0\.0\b"]),
    ("backoff_factor_2", lambda: _DLS(8.0, backoff_factor=2.0),
     ValueError, [r"backoff_factor", r"2\.0"]),
    ("growth_factor_1", lambda: _DLS(8.0, growth_factor=1.0),
     ValueError, [r"growth_factor", r"1\.0"]),
    ("growth_factor_rounds_to_1", lambda: _DLS(8.0, growth_factor=1 + 1e-9),
     ValueError, [r"growth_factor", r"rounds to 1"]),
    ("growth_contradicts_factor", lambda: _DLS(8.0, factor=4.0,
                                               growth_factor=3.0),
     ValueError, [r"growth_factor=3", r"factor=4"]),
    ("max_loss_scale_above_2_126", lambda: _DLS(8.0, max_loss_scale=2.0**127),
     ValueError, [r"max_loss_scale", r"2\*\*126"]),
    ("loss_scale_above_2_126", lambda: _DLS(2.0**127),
     ValueError, [r"loss_scale", r"2\*\*126"]),
    ("loss_scale_below_2_-126", lambda: _DLS(2.0**-127, min_loss_scale=0),
     ValueError, [r"loss_scale", r"2\*\*-126"]),
]


@pytest.mark.parametrize("make,error,patterns",
                         [case[1:] for case in BAD_OPTIONS],
                         ids=[case[0] for case in BAD_OPTIONS])
def test_bad_option_raises_naming_it(make, error, patterns):
  with pytest.raises(error) as excinfo:
    make()
  message = str(excinfo.value)
  for pattern in patterns:
    assert re.search(pattern, message), (pattern, message)


# ---------------------------------------------------------------------------
# jit: one compilation, stable state dtypes.
# ---------------------------------------------------------------------------


def _half_loss(params, x):
  pred = x.astype(F16) @ params["w"].astype(F16) + params["b"].astype(F16)
  return jnp.mean(jnp.square(pred.astype(F32)))


def _inputs(steps, bad_steps=(), seed=3):
  xs = np.random.default_rng(seed).normal(size=(steps, 6, 4)).astype(F32)
  for i in bad_steps:
    xs[i, 0, 0] = np.inf
  return xs  # numpy: each step's x is made under faulty() where it has inf


@standard_promotion  # adam
def test_accumulation_train_step_compiles_once_and_keeps_state_dtypes():
  opt = jmp_lite.loss_scaling(
      optax.adamw(1e-2), jmp_lite.DynamicLossScale(2.0**10, period=1),
      accumulation_steps=3)
  traces = []

  @jax.jit
  def train_step(params, state, x):
    traces.append(1)  # runs only while tracing
    _, grads = jmp_lite.scaled_value_and_grad(_half_loss, state)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _fault_params()
  state = opt.init(params)
  dtypes = _dtypes(state)
  xs = _inputs(9, bad_steps=[4])
  scales = []
  for x in xs:
    with faulty(_is_faulty(x)):
      params, state = train_step(params, state, x)
    assert _dtypes(state) == dtypes
    scales.append(_scale_value(state.loss_scale))
  assert len(traces) == 1
  if hasattr(train_step, "_cache_size"):
    assert train_step._cache_size() == 1
  # The scale changed value (grew, backed off) without a retrace.
  assert scales == [1024.0] * 2 + [2048.0] * 3 + [1024.0] * 3 + [2048.0]
  assert int(state.skipped_steps) == 1
  assert dtypes.accumulated == {"w": F32, "b": F32}
  assert (dtypes.micro_step, dtypes.window_finite) == (I32, np.bool_)


def test_shared_scale_train_step_compiles_once_and_keeps_state_dtypes():
  opt_a = jmp_lite.loss_scaling(optax.sgd(0.1, momentum=0.9))
  opt_b = jmp_lite.loss_scaling(optax.sgd(0.1))
  traces = []

  @jax.jit
  def train_step(params, states, scale, x):
    traces.append(1)
    new_params, new_states = {}, {}
    for name, opt in (("a", opt_a), ("b", opt_b)):
      _, grads = jmp_lite.scaled_value_and_grad(_half_loss, scale)(
          params[name], x if name == "a" else 2 * x)
      updates, new_states[name] = opt.update(grads, states[name],
                                             params[name], loss_scale=scale)
      new_params[name] = optax.apply_updates(params[name], updates)
    scale = scale.adjust(new_states["a"].last_finite
                         & new_states["b"].last_finite)
    return new_params, new_states, scale

  params = {"a": _fault_params(seed=0), "b": _fault_params(seed=1)}
  states = {"a": opt_a.init(params["a"]), "b": opt_b.init(params["b"])}
  scale = jmp_lite.DynamicLossScale(2.0**10, period=2)
  dtypes = (_dtypes(states), _dtypes(scale))
  for x in _inputs(6, bad_steps=[2]):
    with faulty(_is_faulty(x)):
      params, states, scale = train_step(params, states, scale, x)
    assert (_dtypes(states), _dtypes(scale)) == dtypes
  assert len(traces) == 1
  if hasattr(train_step, "_cache_size"):
    assert train_step._cache_size() == 1
  assert [int(states[n].skipped_steps) for n in "ab"] == [1, 1]
  assert _scale_value(scale) == 2.0**11  # grew twice, backed off once
  assert isinstance(scale, jmp_lite.DynamicLossScale) and scale.period == 2


# ---------------------------------------------------------------------------
# Several losses with separate scales (the pattern of docs/training_loops.md).
# ---------------------------------------------------------------------------


def separate_scales_step(params, opt_state, scales, batch, loss_fns,
                         optimizer):
  """One step of several losses, each scaled by its own loss scale.

  Apex's ``num_losses``: each loss's gradients are unscaled with its own
  scale, in float32; each scale adjusts on its own gradients' finiteness; the
  sum goes to ``optimizer = loss_scaling(inner, NoOpLossScale())``, which
  skips the step if any loss's gradients were not finite.
  """
  total, new_scales = None, []
  for loss_fn, scale in zip(loss_fns, scales):
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, batch)))(params)
    grads = scale.unscale(
        jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads))
    new_scales.append(scale.adjust(jmp_lite.all_finite(grads)))
    total = grads if total is None else jax.tree_util.tree_map(
        jnp.add, total, grads)
  updates, opt_state = optimizer.update(total, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, tuple(new_scales)


def _main_loss(p, batch):
  """A float16 loss with small gradients (wants a large scale)."""
  return 1e-3 * _half_loss(p, batch["x"])


def _aux_loss(p, batch):
  """A float16 auxiliary loss with large values (overflows at a large scale;
  ``batch["big"]`` makes it overflow at any scale)."""
  pred = batch["x"].astype(F16) @ p["w"].astype(F16) * batch["big"]
  return jnp.mean(jnp.square(pred)).astype(F32)


def test_separate_scales_pattern():
  """An overflow in the auxiliary loss skips the step and backs off only its
  scale; the main loss's scale keeps growing. The finite steps train exactly
  like the inner optimizer on the summed float32 gradients."""
  optimizer = jmp_lite.loss_scaling(optax.sgd(0.05), jmp_lite.NoOpLossScale())
  step = jax.jit(functools.partial(separate_scales_step,
                                   loss_fns=(_main_loss, _aux_loss),
                                   optimizer=optimizer))
  params = _fault_params()
  opt_state = optimizer.init(params)
  scales = (jmp_lite.DynamicLossScale(2.0**14, period=2),
            jmp_lite.DynamicLossScale(2.0**4, period=2))
  xs = _inputs(6)
  bigs = [1.0, 1.0, 1e4, 1.0, 1.0, 1.0]  # step 2: the aux loss overflows
  history, ref = [], params
  ref_inner = optax.sgd(0.05)
  ref_state = ref_inner.init(params)
  for x, big in zip(xs, bigs):
    batch = {"x": x, "big": jnp.asarray(big, F16)}
    before = params
    params, opt_state, scales = step(params, opt_state, scales, batch)
    history.append(tuple(_scale_value(s) for s in scales))
    chex.assert_tree_all_finite(params)
    if big != 1.0:
      assert_bit_identical(params, before)
      continue
    grads = jax.tree_util.tree_map(
        jnp.add, jax.grad(_main_loss)(ref, batch),
        jax.grad(_aux_loss)(ref, batch))
    updates, ref_state = ref_inner.update(grads, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  assert int(opt_state.skipped_steps) == 1
  assert history == [(2.0**14, 2.0**4), (2.0**15, 2.0**5),
                     (2.0**15, 2.0**4),  # the overflow: aux backs off alone
                     (2.0**16, 2.0**4), (2.0**16, 2.0**5),
                     (2.0**17, 2.0**5)]
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3), params, ref)


# ---------------------------------------------------------------------------
# examples/accumulation.py and benchmarks/accumulation_overhead.py, end to end.
# ---------------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "accumulation.py"
EXAMPLE_STEPS = 12
EXAMPLE_OVERFLOW_WINDOW = 9


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("accumulation")
  proc = run_example(EXAMPLE, "--steps", EXAMPLE_STEPS, "--overflow-window",
                     EXAMPLE_OVERFLOW_WINDOW, "--out", out)
  return proc, out


@slow
def test_example_skips_the_overflowing_windows_and_recovers(example_run):
  proc, out = example_run
  assert_exited_cleanly(proc)
  assert "| run | policy |" in proc.stdout
  assert_is_png(out / "accumulation.png")
  assert "| window | loss scale used |" in (out / "accumulation.md").read_text()
  data = json.loads((out / "accumulation.json").read_text())
  assert data["config"]["steps"] == EXAMPLE_STEPS
  runs = data["runs"]
  assert tuple(runs) == ("f32_big_batch", "f32_accumulated", "f16_accumulated")
  for name, run in runs.items():
    assert len(run["loss_history"]) == EXAMPLE_STEPS, name
    assert len(run["loss_scale_history"]) == EXAMPLE_STEPS, name
    assert is_finite_number(run["test_accuracy"]), name
    assert (run["optimizer_steps_taken"] + run["skipped_steps"]
            == EXAMPLE_STEPS), name
  f16 = runs["f16_accumulated"]
  # The initial scale 2**24 overflows: the first windows are skipped, the
  # scale halving once per window; then the corrupted window is skipped.
  skipped = f16["skipped_at"]
  assert skipped[0] == 0 and EXAMPLE_OVERFLOW_WINDOW in skipped
  log2_scales = f16["loss_scale_log2_history"]
  assert log2_scales[0] == 24
  for w in skipped:
    if w + 1 < EXAMPLE_STEPS:
      assert log2_scales[w + 1] == log2_scales[w] - 1, (w, log2_scales)
  assert EXAMPLE_OVERFLOW_WINDOW + 1 not in skipped  # it recovered
  assert f16["accumulated_dtypes"] == ["float32"]
  assert runs["f32_big_batch"]["skipped_steps"] == 0
  assert data["checks"]["f32_accumulated_vs_big_batch_first_step_rel_diff"] < 1e-4


@pytest.fixture(scope="module")
def benchmark_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("accumulation_overhead")
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.accumulation_overhead", "--quick",
       "--out", str(out)],
      cwd=ROOT, env=example_env(), capture_output=True, text=True, timeout=600,
      check=False)
  return proc, out


@slow
def test_benchmark_quick_run_writes_its_figures(benchmark_run):
  proc, out = benchmark_run
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "| workload | policy |" in proc.stdout
  report = json.loads((out / "accumulation_overhead.json").read_text())
  assert report["benchmark"] == "accumulation_overhead"
  assert report["config"]["quick"] is True
  assert "--quick" in report["command"]
  assert {r["workload"] for r in report["results"]} == {"mlp-f16", "mlp-bf16"}
  for result in report["results"]:
    assert result["check"]["same"] is True, result["check"]
    for variant in ("jmp_lite", "multisteps", "multisteps_if_finite"):
      stats = result["step_time_s"][variant]
      assert len(stats["values"]) == report["config"]["repeats"]
      assert all(is_finite_number(v) and v > 0 for v in stats["values"])
    for variant in ("jmp_lite", "multisteps_if_finite"):
      ratio = result["ratio_to_multisteps"][variant]
      assert is_finite_number(ratio["median"]) and ratio["median"] > 0
  assert "accumulation_overhead.json" in (
      out / "accumulation_overhead.md").read_text()


# ---------------------------------------------------------------------------
# Accumulation across devices.
# ---------------------------------------------------------------------------


def test_accumulation_under_pmap_skips_the_window_on_every_replica():
  """One replica's bad micro-batch invalidates the window everywhere
  (``axis_name``): the replicas keep one scale and the same params."""
  n = 4
  opt = jmp_lite.loss_scaling(
      optax.sgd(1.0), jmp_lite.DynamicLossScale(8.0, period=1),
      accumulation_steps=2, axis_name="i")
  params = {"w": jnp.zeros(2, F32)}
  stack = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), t)
  params_r, state_r = stack(params), stack(opt.init(params))
  update = jax.pmap(opt.update, axis_name="i", devices=jax.devices()[:n])
  good = np.full((n, 2), 8.0, F32)
  bad = good.copy()
  bad[2, 0] = np.inf  # replica 2 only, second window
  for grads in (good, good, good, bad):
    updates, state_r = _update(update, {"w": grads}, state_r, params_r)
    params_r = optax.apply_updates(params_r, updates)
    chex.assert_tree_all_finite(state_r.accumulated)
  np.testing.assert_array_equal(params_r["w"], np.full((n, 2), -1.0, F32))
  np.testing.assert_array_equal(state_r.skipped_steps, np.ones(n, I32))
  # 8 -> 16 after the first window (period 1), back to 8 after the second.
  np.testing.assert_array_equal(state_r.loss_scale.loss_scale,
                                np.full(n, 8.0, F32))
