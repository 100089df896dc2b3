"""The float8 grouped matmul (fp8.ragged_dot): the per-group loop of the dense
recipe, per-expert scales, group-aligned blocks, empty experts, accuracy,
delayed scaling, expert parallelism, errors and the compiled programs.

Every test multiplies small shapes in jitted functions that are built once
per recipe (``_grouped_fn``, ``_loop_fn``) and shared by the tests.
"""

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import formats as formats_lib
from jmp_lite._src.low_precision import fp8_grouped as grouped
from jmp_lite._src.low_precision import scaling as scaling_lib
from helpers import default_run_keeps

DENSE = (((1,), (0,)), ((), ()))
RECIPES = ("fp8", "fp8_rowwise", "fp8_blockwise", "mxfp8", "fp8_delayed")
M, K, N = 256, 64, 48
# Group sizes over M rows: jagged with an empty group, every token in one
# expert of five (the others empty), the first and last group empty, and a
# single group (G = 1).
SPLITS = {
    "jagged": (44, 0, 84, 3, 125),
    "one_expert": (0, 0, 256, 0, 0),
    "ends_empty": (0, 100, 56, 100, 0),
    "single_group": (256,),
}
JAGGED = SPLITS["jagged"]
G = len(JAGGED)


def _named(name):
  return config_lib._named(name)  # pylint: disable=protected-access


def _exact(shape, seed):
  """Small integers in [-3, 3]: with power-of-two scales every float8 product
  and every float32 sum of them is exact, in any order."""
  rng = np.random.default_rng(seed)
  return rng.integers(-3, 4, shape).astype(np.float32)


def _normal(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _operands(kind, sizes=JAGGED, m=M, k=K, n=N, seed=0):
  make = _exact if kind == "exact" else _normal
  g = len(sizes)
  return (make((m, k), seed), make((g, k, n), seed + 1),
          make((m, n), seed + 2))


def _bounds(sizes):
  ends = np.cumsum(sizes)
  return list(zip(ends - np.asarray(sizes), ends))


def _group_amax(v, sizes):
  """float32 [G]: the true per-group amax of v's rows (0 where empty)."""
  return np.array([np.abs(v[s:e]).max() if e > s else 0.0
                   for s, e in _bounds(sizes)], np.float32)


def _delayed_scales(x, w, dy, sizes, grad=True, factor=1.5):
  """Per-group dequantization scales of the data (amax / fmt.max), times
  ``factor`` so that they are not the current scales; 1 for an empty
  group."""
  def scale(amax, fmt_max):
    return jnp.asarray(np.where(amax > 0, amax * factor / fmt_max, 1.0),
                       jnp.float32)
  return fp8.DelayedScales(
      scale(_group_amax(x, sizes), 448.0),
      scale(np.abs(w).max(axis=(1, 2)), 448.0),
      scale(_group_amax(dy, sizes), 57344.0) if grad else None)


def _scales_for(name, x, w, dy, sizes, grad=True):
  if _named(name).scaling != "delayed":
    return None
  return _delayed_scales(x, w, dy, sizes, grad)


@functools.lru_cache(maxsize=None)
def _grouped_fn(name, per_group=True):
  """jit((x, w, dy, sizes, scales) -> (y, dx, dw, d_scales))."""
  config = _named(name)

  def run(x, w, dy, sizes, scales):
    f = lambda x, w, s: fp8.ragged_dot(x, w, sizes, config=config,
                                           scales=s,
                                           per_group_scales=per_group)
    y, vjp = jax.vjp(f, x, w, scales)
    return (y,) + vjp(dy)
  return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _dense_fn(name):
  """jit((x, w, dy, scales) -> (y, dx, dw)) of fp8.dot_general: one group
  (compiled once per recipe and row count, shared by every split)."""
  config = _named(name)

  def run(x, w, dy, scales):
    f = lambda a, b: fp8.dot_general(a, b, DENSE, config=config,
                                         scales=scales)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)
  return jax.jit(run)


def _loop_fn(name, sizes):
  """(x, w, dy, scales) -> (y, dx, dw): the per-group loop of
  fp8.dot_general (group g's scales ``scales[g]``)."""
  def run(x, w, dy, scales):
    parts = []
    for g, (s, e) in enumerate(_bounds(sizes)):
      sg = (None if scales is None
            else jax.tree.map(lambda v, g=g: v[g], scales))
      parts.append(_dense_fn(name)(x[s:e], w[g], dy[s:e], sg))
    ys, dxs, dws = zip(*parts)
    return np.concatenate(ys), np.concatenate(dxs), np.stack(dws)
  return run


def _run_both(name, kind, split):
  sizes = SPLITS[split]
  x, w, dy = _operands(kind, sizes)
  scales = _scales_for(name, x, w, dy, sizes)
  got = _grouped_fn(name)(x, w, dy, jnp.asarray(sizes, jnp.int32), scales)
  want = _loop_fn(name, sizes)(x, w, dy, scales)
  return got[:3], want


def _max_rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


# ---------------------------------------------------------------------------
# 1. The per-group loop of the dense recipe.
#
# Two tests, because XLA:CPU's dot does not sum in one order for every shape
# (grouped.py's docstring): even the dense recipe's rows differ in the last
# bits between dot(x)[:m] and dot(x[:m]). The quantized operands and scales
# are the loop's bit for bit, so on data whose float32 sums are exact (small
# integers) the results are too; on random data they agree to float32
# rounding of the accumulation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("split", default_run_keeps(SPLITS))
@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_equals_the_per_group_loop_bit_for_bit_on_exact_data(name, split):
  got, want = _run_both(name, "exact", split)
  for part, a, b in zip(("y", "dx", "dw"), got, want):
    assert a.dtype == b.dtype == np.float32, part
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=part)
  assert np.abs(np.asarray(got[2])).max() > 0


@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_equals_the_per_group_loop_to_rounding_on_random_data(name):
  got, want = _run_both(name, "normal", "jagged")
  for part, a, b in zip(("y", "dx", "dw"), got, want):
    assert _max_rel(a, b) <= 1e-6, (part, _max_rel(a, b))
  # Empty groups: exactly zero weight gradient in both.
  np.testing.assert_array_equal(np.asarray(got[2])[1], 0.0)


def test_eager_call_equals_the_jitted_one():
  x, w, dy = _operands("normal")
  sizes = jnp.asarray(JAGGED, jnp.int32)
  config = _named("fp8_rowwise")
  y, vjp = jax.vjp(lambda x, w: fp8.ragged_dot(x, w, sizes,
                                                   config=config), x, w)
  dx, dw = vjp(dy)
  jy, jdx, jdw, _ = _grouped_fn("fp8_rowwise")(x, w, dy, sizes, None)
  for a, b in ((y, jy), (dx, jdx), (dw, jdw)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------
# 2. Per-expert scales.
# ---------------------------------------------------------------------------

_J = 2  # the expert given outliers: rows 44..127 of JAGGED


def _with_outliers(x, w, dy, factor=1000.0):
  s, e = _bounds(JAGGED)[_J]
  x, w, dy = x.copy(), w.copy(), dy.copy()
  x[s:e] *= factor
  dy[s:e] *= factor
  w[_J] *= factor
  return x, w, dy


def _others(y, dx, dw):
  """The rows and slices of every group but _J."""
  s, e = _bounds(JAGGED)[_J]
  rows = np.r_[0:s, e:M]
  keep = [g for g in range(G) if g != _J]
  return np.asarray(y)[rows], np.asarray(dx)[rows], np.asarray(dw)[keep]


@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_one_experts_outliers_change_no_other_group(name):
  """Expert _J's tokens, its weight and its rows of the incoming gradient
  multiplied by 1000: every other group's output rows, input-gradient rows
  and weight-gradient slices are bit-identical (delayed: each group's scale
  from its own amax, the gradient current-scaled per group)."""
  sizes = jnp.asarray(JAGGED, jnp.int32)
  fn = _grouped_fn(name)
  results = []
  for x, w, dy in (_operands("normal"), _with_outliers(*_operands("normal"))):
    scales = _scales_for(name, x, w, dy, JAGGED, grad=False)
    results.append(fn(x, w, dy, sizes, scales)[:3])
  for a, b in zip(_others(*results[0]), _others(*results[1])):
    np.testing.assert_array_equal(a, b)
  s, e = _bounds(JAGGED)[_J]
  assert not np.array_equal(np.asarray(results[0][0])[s:e],
                            np.asarray(results[1][0])[s:e])


def test_shared_scales_let_one_expert_change_the_others():
  """per_group_scales=False (one scale over all groups, qwix's choice): the
  per-tensor recipe's other groups do change."""
  sizes = jnp.asarray(JAGGED, jnp.int32)
  fn = _grouped_fn("fp8", per_group=False)
  base = _others(*fn(*_operands("normal"), sizes, None)[:3])
  out = _others(*fn(*_with_outliers(*_operands("normal")), sizes, None)[:3])
  for part, a, b in zip(("y", "dx", "dw"), base, out):
    assert _max_rel(a, b) > 1e-3, part


# ---------------------------------------------------------------------------
# 3. Group boundaries in the weight gradient.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", default_run_keeps(["fp8_blockwise", "mxfp8"]))
def test_weight_gradient_blocks_never_hold_two_groups(name):
  """Group 0 (44 rows) and group 2 (84 rows) would share the first block of
  128 (blockwise) and rows 32..63 (MX, 32) in an unpadded layout. Group 2's
  tokens and gradient rows scaled by 2**8 (exact): the weight gradient is
  still the per-group loop's exactly, and group 0's slice is the one without
  the outlier (its block scales saw only its own tokens)."""
  sizes = jnp.asarray(JAGGED, jnp.int32)
  x, w, dy = _operands("exact")
  s, e = _bounds(JAGGED)[2]
  xo, dyo = x.copy(), dy.copy()
  xo[s:e] *= 256.0
  dyo[s:e] *= 256.0
  dw = _grouped_fn(name)(xo, w, dyo, sizes, None)[2]
  want = _loop_fn(name, JAGGED)(xo, w, dyo, None)[2]
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(want))
  plain = _grouped_fn(name)(x, w, dy, sizes, None)[2]
  np.testing.assert_array_equal(np.asarray(dw)[0], np.asarray(plain)[0])
  np.testing.assert_array_equal(np.asarray(dw)[3:], np.asarray(plain)[3:])


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("jit", [False, True])
def test_padded_layout_starts_every_group_at_a_block(block, jit):
  """padded_layout/to_padded: each group's rows in order from a multiple of
  the block, zeros up to the next multiple; empty groups take no rows; a
  group of exactly one block takes one; rows past the sum are dropped; the
  static row count bounds every split of M rows into G groups."""
  sizes = np.array([0, 5, block, 0, block + 3, 1, 0], np.int32)
  m = int(sizes.sum()) + 2  # two rows of no group
  x = np.arange(1, 3 * m + 1, dtype=np.float32).reshape(m, 3)

  def layout(x, sizes):
    padded = grouped.padded_layout(grouped.groups_of(sizes, m), block)
    return (grouped.to_padded(x, padded), padded.sizes, padded.block_ids,
            padded.positions)

  fn = jax.jit(layout) if jit else layout
  xp, psizes, block_ids, positions = (np.asarray(v) for v in
                                      fn(x, jnp.asarray(sizes)))
  g = len(sizes)
  rows = -(-(m + g * (block - 1)) // block) * block
  assert xp.shape == (rows, 3)
  np.testing.assert_array_equal(psizes, -(-sizes // block) * block)
  start = 0
  want_ids = np.full(rows // block, g)
  for gi, ((s, e), size) in enumerate(zip(_bounds(sizes), psizes)):
    assert start % block == 0
    np.testing.assert_array_equal(xp[start:start + e - s], x[s:e])
    np.testing.assert_array_equal(xp[start + e - s:start + size], 0.0)
    np.testing.assert_array_equal(positions[s:e], np.arange(e - s) + start)
    want_ids[start // block:(start + size) // block] = gi
    start += size
  np.testing.assert_array_equal(xp[start:], 0.0)
  np.testing.assert_array_equal(positions[sizes.sum():], rows)
  np.testing.assert_array_equal(block_ids, want_ids)
  # Every block holds one group's rows (or none).
  for b in range(rows // block):
    nonzero = np.flatnonzero(np.abs(xp[b * block:(b + 1) * block]).sum(1))
    owners = {int(np.searchsorted(np.cumsum(sizes),
                                  (xp[b * block + r, 0] - 1) // 3,
                                  side="right")) for r in nonzero}
    assert len(owners) <= 1 and owners <= {int(block_ids[b])}


# ---------------------------------------------------------------------------
# 4. Empty experts.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_empty_experts_are_finite_with_zero_weight_gradients(name):
  sizes = (0, 0, 256, 0, 0)  # all groups empty but one
  x, w, dy = _operands("normal", sizes)
  w[3] = 0.0  # an all-zero expert too (amax 0)
  scales = _scales_for(name, x, w, dy, sizes)
  y, dx, dw, ds = _grouped_fn(name)(x, w, dy, jnp.asarray(sizes, jnp.int32),
                                    scales)
  for v in (y, dx, dw):
    assert np.all(np.isfinite(np.asarray(v)))
  for g in (0, 1, 3, 4):
    np.testing.assert_array_equal(np.asarray(dw)[g], 0.0)
  assert np.abs(np.asarray(dw)[2]).max() > 0
  if ds is not None:  # the amaxes observed: 0 for empty groups
    np.testing.assert_array_equal(np.asarray(ds.lhs)[[0, 1, 3, 4]], 0.0)
    np.testing.assert_array_equal(np.asarray(ds.grad)[[0, 1, 3, 4]], 0.0)
    np.testing.assert_array_equal(np.asarray(ds.rhs)[3], 0.0)


def test_empty_groups_get_finite_unit_scales():
  """Per tensor: an empty group (amax 0) and an all-zero expert get scale 1,
  finite, whatever the other groups hold."""
  config = _named("fp8")
  sizes = jnp.asarray((0, 3, 0, 5), jnp.int32)
  x = _normal((8, 32), 0) * 1e4
  w = _normal((4, 32, 16), 1)
  w[1] = 0.0
  groups = grouped.groups_of(sizes, 8)
  _, amax, scale = grouped._group_tensor_quantize(  # pylint: disable=protected-access
      jnp.asarray(x), formats_lib.E4M3, groups, config, None, True)
  np.testing.assert_array_equal(np.asarray(amax)[[0, 2]], 0.0)
  np.testing.assert_array_equal(np.asarray(scale)[[0, 2]], 1.0)
  assert np.all(np.isfinite(np.asarray(scale)))
  _, amax, scale = grouped._expert_tensor_quantize(  # pylint: disable=protected-access
      jnp.asarray(w), formats_lib.E4M3, config, None, True)
  assert float(amax[1]) == 0.0 and float(scale[1]) == 1.0
  amax = grouped.segment_amax(jnp.asarray(x), groups)
  np.testing.assert_array_equal(np.asarray(amax).max(axis=1),
                                _group_amax(x, (0, 3, 0, 5)))


@pytest.mark.parametrize("name", RECIPES)
def test_finite_run_passes_debug_nans_and_infs(name, debug_nans_and_infs):
  del debug_nans_and_infs
  sizes = (0, 100, 0, 156, 0)
  x, w, dy = _operands("normal", sizes)
  scales = _scales_for(name, x, w, dy, sizes)
  out = _grouped_fn(name)(x, w, dy, jnp.asarray(sizes, jnp.int32), scales)
  assert all(np.all(np.isfinite(np.asarray(v)))
             for v in jax.tree.leaves(out))


# Op by op under jax_debug_nans/infs: a whole program's run (the slow stage).
@pytest.mark.slow
def test_no_intermediate_nan_or_inf_op_by_op(debug_nans_and_infs):
  """Op by op (jax.disable_jit): empty groups, an all-zero expert and rows
  of zeros create no intermediate NaN or inf, forward and backward, per
  tensor; and the grouped helpers every other recipe adds to the dense
  recipe's quantizers (segment amaxes per row and per column, the
  group-padded layout) neither. (The dense recipe's own op-by-op test
  covers tensor, row and block; MXFP8's E8M0 decoder and a given (delayed)
  scale's inf -> NaN select build a NaN constant, which only an op-by-op
  run sees: their jitted runs are checked above.)"""
  del debug_nans_and_infs
  sizes = jnp.asarray((20, 0, 44, 0), jnp.int32)
  x = _normal((64, 32), 0)
  x[:3] = 0.0
  w = _normal((4, 32, 32), 1)
  w[2] = 0.0
  with jax.disable_jit():
    _, vjp = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, sizes), x, w)
    vjp(np.ones((64, 32), np.float32))
    groups = grouped.groups_of(sizes, 64)
    grouped.segment_amax(x, groups)
    grouped.segment_amax(jnp.max(jnp.abs(x), axis=1), groups)
    grouped.to_padded(x, grouped.padded_layout(groups, 32))


# ---------------------------------------------------------------------------
# 5. Accuracy against the float32 ragged_dot.
# ---------------------------------------------------------------------------

SQNR_SIZES = (64, 96, 0, 100, 28, 80, 60, 84)  # 8 groups, one empty: 512
# Output / dx / dw floors in dB: torchao's bars for MXFP8 and blockwise;
# for per tensor and per row the measured figures less 2 dB of margin.
# Measured (XLA:CPU, jax 0.10.2 and 0.12.1, seed 7): 28.5 / 28.5 / 28.5 for
# fp8_rowwise, fp8_blockwise and mxfp8 (e4m3 everywhere: each operand's
# quantization noise is about 31 dB on normal data), 28.5 / 24.5 / 24.5 for
# fp8 (an e5m2 gradient in dx and dw).
SQNR_FLOORS = {
    "mxfp8": (27.0, 25.0, 24.0),
    "fp8_blockwise": (27.0, 26.0, 26.0),
    "fp8": (26.5, 22.5, 22.5),
    "fp8_rowwise": (26.5, 26.5, 26.5),
}


def _sqnr(ref, got):
  ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
  return 20 * math.log10(np.linalg.norm(ref) / np.linalg.norm(ref - got))


@functools.lru_cache(maxsize=None)
def _reference_fn():
  def run(x, w, dy, sizes):
    y, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(
        x, w, sizes, precision=jax.lax.Precision.HIGHEST), x, w)
    return (y,) + vjp(dy)
  return jax.jit(run)


@pytest.mark.parametrize("name", default_run_keeps(SQNR_FLOORS))
def test_sqnr_against_the_float32_ragged_dot(name):
  m, k, n = 512, 256, 256
  x, w, dy = _operands("normal", SQNR_SIZES, m, k, n, seed=7)
  sizes = jnp.asarray(SQNR_SIZES, jnp.int32)
  ref = _reference_fn()(x, w, dy, sizes)
  got = _grouped_fn(name)(x, w, dy, sizes, None)[:3]
  sqnr = [_sqnr(r, q) for r, q in zip(ref, got)]
  print(f"{name}: SQNR output/dx/dw = "
        + " / ".join(f"{s:.1f}" for s in sqnr) + " dB")
  for part, s, floor in zip(("output", "dx", "dw"), sqnr, SQNR_FLOORS[name]):
    assert s >= floor, (part, s, floor)
  np.testing.assert_array_equal(np.asarray(got[2])[2], 0.0)


# ---------------------------------------------------------------------------
# 6. Delayed scaling.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("grad", [True, False])
def test_delayed_scales_cotangent_holds_the_per_group_amaxes(grad):
  x, w, dy = _operands("normal")
  scales = _delayed_scales(x, w, dy, JAGGED, grad=grad)
  ds = _grouped_fn("fp8_delayed")(x, w, dy, jnp.asarray(JAGGED, jnp.int32),
                                  scales)[3]
  np.testing.assert_array_equal(np.asarray(ds.lhs), _group_amax(x, JAGGED))
  np.testing.assert_array_equal(np.asarray(ds.rhs),
                                np.abs(w).max(axis=(1, 2)))
  if grad:
    np.testing.assert_array_equal(np.asarray(ds.grad),
                                  _group_amax(dy, JAGGED))
  else:
    assert ds.grad is None


def test_given_scales_equal_to_the_current_ones_give_current_scaling():
  """Delayed scaling with each group's current scales (from the true
  per-group amaxes) is current scaling, bit for bit; other scales are used
  (the result changes)."""
  x, w, dy = _operands("normal")
  sizes = jnp.asarray(JAGGED, jnp.int32)
  pow2 = _named("fp8").power_of_two_scales
  current = fp8.DelayedScales(
      scaling_lib.scale_from_amax(_group_amax(x, JAGGED), "e4m3",
                                  power_of_two=pow2),
      scaling_lib.scale_from_amax(np.abs(w).max(axis=(1, 2)), "e4m3",
                                  power_of_two=pow2),
      scaling_lib.scale_from_amax(_group_amax(dy, JAGGED), "e5m2",
                                  power_of_two=pow2))
  want = _grouped_fn("fp8")(x, w, dy, sizes, None)[:3]
  got = _grouped_fn("fp8_delayed")(x, w, dy, sizes, current)[:3]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = current._replace(lhs=current.lhs * 4.0)
  got = _grouped_fn("fp8_delayed")(x, w, dy, sizes, other)[0]
  assert not np.array_equal(np.asarray(got), np.asarray(want[0]))


try:
  _shard_map = jax.shard_map
except AttributeError:  # jax < 0.7
  from jax.experimental.shard_map import shard_map as _shard_map  # pylint: disable=all

needs_devices = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs 4 devices (see conftest.py)")


@needs_devices
@pytest.mark.parametrize("axis_name", [None, "d"])
def test_delayed_amaxes_are_global_over_the_data_axis(axis_name):
  """Data parallel over 2 devices, each its own tokens and group sizes, the
  weights and scales replicated: with the config's axis_name (or none: a
  delayed recipe binds the mapped axes) each shard's amaxes are the global
  per-group ones."""
  n, ml = 2, 64
  mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
  sizes = np.array([[10, 0, 30, 24], [0, 50, 4, 10]], np.int32)
  x = _normal((n * ml, 32), 0)
  w = _normal((4, 32, 32), 1)
  dy = _normal((n * ml, 32), 2)
  x[5] *= 100.0         # shard 0, group 0
  dy[ml + 20] *= 50.0   # shard 1, group 1
  config = fp8.Fp8Config(scaling="delayed", axis_name=axis_name)

  def body(x, w, dy, sizes, scales):
    f = lambda x, w, s: fp8.ragged_dot(x, w, sizes[0], config=config,
                                           scales=s)
    _, vjp = jax.vjp(f, x, w, scales)
    return jax.tree.map(lambda v: v[None], vjp(dy)[2])

  ones = jnp.ones(4, jnp.float32)
  ds = jax.jit(_shard_map(
      body, mesh=mesh, in_specs=(P("d"), P(), P("d"), P("d"), P()),
      out_specs=P("d")))(x, w, dy, sizes, fp8.DelayedScales(ones, ones, ones))

  def global_amax(v):
    per_shard = [_group_amax(v[i * ml:(i + 1) * ml], sizes[i])
                 for i in range(n)]
    return np.max(per_shard, axis=0)

  for got, want in ((ds.lhs, global_amax(x)), (ds.grad, global_amax(dy)),
                    (ds.rhs, np.abs(w).max(axis=(1, 2)))):
    np.testing.assert_array_equal(np.asarray(got), np.stack([want] * n))


# ---------------------------------------------------------------------------
# 7. Expert parallelism.
# ---------------------------------------------------------------------------

EP_SIZES = (30, 34, 0, 64, 64, 0, 10, 54)  # 8 experts, 64 tokens per pair


@needs_devices
@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_experts_sharded_under_shard_map_equal_the_unsharded_call(name):
  """Each of 4 devices holds 2 experts (and their scales) and the 64 tokens
  routed to them: with per-expert scales every device computes exactly its
  experts' part of the unsharded call (delayed: the amaxes too). Exact data:
  on random data XLA:CPU may sum a 64-row shard in another order than the
  whole (MXFP8's weight gradient does, in the last bit)."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("e",))
  x, w, dy = _operands("exact", EP_SIZES, m=256, k=64, n=64)
  scales = _scales_for(name, x, w, dy, EP_SIZES)
  sizes = jnp.asarray(EP_SIZES, jnp.int32)
  want = _grouped_fn(name)(x, w, dy, sizes, scales)
  config = _named(name)

  def run(x, w, dy, sizes, scales):
    f = lambda x, w, s: fp8.ragged_dot(x, w, sizes, config=config,
                                           scales=s)
    y, vjp = jax.vjp(f, x, w, scales)
    return (y,) + vjp(dy)

  spec = P("e")
  got = jax.jit(_shard_map(run, mesh=mesh, in_specs=(spec,) * 5,
                           out_specs=(spec,) * 4))(x, w, dy, sizes, scales)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_devices
@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_expert_sharded_weights_under_jit_equal_the_unsharded_call(name):
  mesh = Mesh(np.array(jax.devices()[:4]), ("e",))
  x, w, dy = _operands("exact", EP_SIZES, m=256, k=64, n=64)
  scales = _scales_for(name, x, w, dy, EP_SIZES)
  sizes = jnp.asarray(EP_SIZES, jnp.int32)
  want = _grouped_fn(name)(x, w, dy, sizes, scales)
  ws = jax.device_put(w, NamedSharding(mesh, P("e", None, None)))
  got = _grouped_fn(name)(x, ws, dy, sizes, scales)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_devices
def test_delayed_amaxes_with_data_and_expert_axes():
  """A (2, 2) mesh: tokens over both axes, experts (weights and scales) over
  'e'. Each expert's observed amax is the maximum over the data axis of its
  tokens' (a delayed recipe binds 'd' and not 'e', which its scales vary
  over): the global per-expert amax, not another expert's."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("d", "e"))
  sizes = np.array([[10, 20, 0, 34, 64, 0, 0, 0],
                    [0, 0, 60, 4, 1, 2, 3, 58]], np.int32)
  x, w, dy = _operands("normal", EP_SIZES, m=256, k=32, n=32, seed=5)
  x[70] *= 100.0    # device (d=0, e=1): expert 4
  dy[200] *= 50.0   # device (d=1, e=1): expert 7
  config = fp8.Fp8Config(scaling="delayed")

  def body(x, w, dy, sizes, scales):
    f = lambda x, w, s: fp8.ragged_dot(x, w, sizes[0], config=config,
                                           scales=s)
    _, vjp = jax.vjp(f, x, w, scales)
    return vjp(dy)[2]

  ones = jnp.ones(8, jnp.float32)
  rows = P(("d", "e"))
  ds = jax.jit(_shard_map(
      body, mesh=mesh, in_specs=(rows, P("e"), rows, P("d", "e"), P("e")),
      out_specs=P("e")))(x, w, dy, sizes, fp8.DelayedScales(ones, ones, ones))

  def expert_amax(v):
    out = np.zeros(8, np.float32)
    for d in range(2):
      for e in range(2):
        block = v[(2 * d + e) * 64:(2 * d + e + 1) * 64]
        local = _group_amax(block, sizes[d, 4 * e:4 * e + 4])
        out[4 * e:4 * e + 4] = np.maximum(out[4 * e:4 * e + 4], local)
    return out

  np.testing.assert_array_equal(np.asarray(ds.lhs), expert_amax(x))
  np.testing.assert_array_equal(np.asarray(ds.grad), expert_amax(dy))
  np.testing.assert_array_equal(np.asarray(ds.rhs),
                                np.abs(w).max(axis=(1, 2)))


# ---------------------------------------------------------------------------
# 8. Bad input.
# ---------------------------------------------------------------------------

_X, _W = np.ones((8, 32), np.float32), np.ones((2, 32, 16), np.float32)
_S = np.array([3, 5], np.int32)
_D = fp8.Fp8Config(scaling="delayed")
_ONES = np.ones(2, np.float32)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((_X, _W, np.array([3.0, 5.0])), {}, TypeError,
     r"group_sizes must be an integer array, got dtype float32"),
    ((_X, _W, None), {}, TypeError, r"group_sizes must be an integer array"),
    ((_X, _W, np.array([3, 4])), {}, ValueError,
     r"group_sizes \[3, 4\] sum to 7, but lhs has 8 rows"),
    ((_X, _W, np.array([-1, 9])), {}, ValueError,
     r"non-negative, got \[-1, 9\]"),
    ((_X[None], _W, _S), {}, ValueError,
     r"lhs of shape \(1, 8, 32\).*lhs \[M, K\]"),
    ((_X, _W[0], _S), {}, ValueError, r"rhs of shape \(32, 16\).*\[G, K, N\]"),
    ((_X[:, :16], _W, _S), {}, ValueError, r"different K \(16 != 32\)"),
    ((_X, _W, np.array([3, 5, 0])), {}, ValueError,
     r"group_sizes has shape \(3,\), but rhs holds 2 groups"),
    ((_X, _W, _S[None]), {}, ValueError, r"group_sizes has shape \(1, 2\)"),
    ((_X.astype(jnp.float8_e4m3fn), _W, _S), {}, TypeError,
     r"lhs is already float8"),
    ((_X, _W.astype(jnp.float8_e5m2), _S), {}, TypeError,
     r"rhs is already float8"),
    ((_X.astype(np.int32), _W, _S), {}, TypeError, r"must be a floating"),
    ((_X, _W, _S), {"scales": fp8.DelayedScales(_ONES, _ONES)}, ValueError,
     r"scales were given, but the config uses current scaling"),
    ((_X, _W, _S), {"config": _D}, TypeError, r"Missing or malformed scales"),
    ((_X, _W, _S), {"config": _D, "scales": fp8.DelayedScales(
        np.ones(3, np.float32), _ONES)}, ValueError,
     r"scales.lhs must hold one scale per group, shape \(2,\).*\(3,\)"),
    ((_X, _W, _S), {"config": _D, "scales": fp8.DelayedScales(
        _ONES, _ONES, np.ones((2, 1), np.float32))}, ValueError,
     r"scales.grad must hold one scale per group"),
    ((_X, _W, _S), {"config": "fp8"}, TypeError,
     r"config must be an Fp8Config, got str"),
    ((_X, _W, _S), {"config": {"granularity": "row"}}, TypeError,
     r"config must be an Fp8Config, got dict"),
    ((_X, _W, _S), {"per_group_scales": "yes"}, TypeError,
     r"per_group_scales must be a bool"),
], ids=["float_sizes", "none_sizes", "sum", "negative", "lhs_rank",
        "rhs_rank", "k", "group_count", "sizes_rank", "float8_lhs",
        "float8_rhs", "int_lhs", "scales_to_current", "no_scales",
        "scale_shape", "grad_scale_shape", "config_str", "config_dict",
        "per_group_flag"])
def test_bad_input_is_a_clear_error(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.ragged_dot(*args, **kwargs)


def test_traced_group_sizes_are_not_read():
  """Traced sizes cannot be checked without a host sync: no error under jit
  (rows past their sum get zeros, below); a float dtype is still refused."""
  jax.jit(lambda s: fp8.ragged_dot(_X, _W, s))(np.array([1, 2], np.int32))
  with pytest.raises(TypeError, match="got dtype float32"):
    jax.jit(lambda s: fp8.ragged_dot(_X, _W, s))(np.array([3.0, 5.0],
                                                              np.float32))


# ---------------------------------------------------------------------------
# 9. Dtypes, compilation, second derivatives, rows past the sum.
# ---------------------------------------------------------------------------


def test_no_recompilation_on_a_second_call():
  fn = jax.jit(jax.value_and_grad(
      lambda x, w, s: fp8.ragged_dot(x, w, s).sum(), argnums=(0, 1)))
  x, w, _ = _operands("normal")
  fn(x, w, jnp.asarray(JAGGED, jnp.int32))
  before = fn._cache_size()  # pylint: disable=protected-access
  fn(x * 2, w, jnp.asarray(SPLITS["ends_empty"], jnp.int32))
  assert fn._cache_size() == before == 1  # pylint: disable=protected-access


@pytest.mark.parametrize("name,dtype", default_run_keeps([
                      ("fp8", jnp.bfloat16), ("fp8", jnp.float16), ("fp8_rowwise", jnp.bfloat16),
                      ("fp8", jnp.float32)], unpack=True))
def test_half_operands_give_half_results(name, dtype):
  x, w, dy = (v.astype(dtype) for v in _operands("normal", seed=3))
  sizes = jnp.asarray(JAGGED, jnp.int32)
  config = _named(name)
  y, vjp = jax.vjp(lambda x, w: fp8.ragged_dot(x, w, sizes,
                                                   config=config), x, w)
  dx, dw = vjp(dy)
  assert y.dtype == dx.dtype == dw.dtype == dtype
  ref = jax.lax.ragged_dot(x.astype(np.float32), w.astype(np.float32), sizes)
  assert _max_rel(y.astype(np.float32), ref) < 0.1
  # preferred_element_type sets the result dtype; gradients keep the
  # operands'.
  y32, vjp = jax.vjp(lambda x, w: fp8.ragged_dot(
      x, w, sizes, preferred_element_type=jnp.float32, config=config), x, w)
  assert y32.dtype == np.float32
  dx, dw = vjp(dy.astype(np.float32))
  assert dx.dtype == dw.dtype == dtype
  if dtype == jnp.float32:
    # float32 operands, a bfloat16 result: the float32 result rounded once.
    y16 = fp8.ragged_dot(x, w, sizes, preferred_element_type=jnp.bfloat16,
                             config=config)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y16),
                                  np.asarray(y32.astype(jnp.bfloat16)))


def test_mixed_operand_dtypes_promote():
  x, w, _ = _operands("normal")
  y = fp8.ragged_dot(x.astype(jnp.bfloat16), w,
                         jnp.asarray(JAGGED, jnp.int32))
  assert y.dtype == np.float32
  config = fp8.Fp8Config(compute_dtype=jnp.bfloat16)
  y = fp8.ragged_dot(x, w, jnp.asarray(JAGGED, jnp.int32), config=config)
  assert y.dtype == jnp.bfloat16


def test_second_derivative_is_refused():
  """The guard is on the backward pass's inputs (x, w, dy), before any
  recipe's branch: one recipe tests it."""
  config = _named("fp8_rowwise")
  x, w, _ = _operands("normal", seed=4)
  sizes = jnp.asarray(JAGGED, jnp.int32)
  loss = lambda x: jnp.sum(fp8.ragged_dot(x, w, sizes, config=config)**2)
  help_text = re.escape(grouped.SECOND_ORDER_HELP[:60])
  with pytest.raises(ValueError, match=help_text):
    jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(x)
  with pytest.raises(ValueError, match=help_text):
    jax.jvp(jax.grad(loss), (x,), (x,))
  jax.grad(loss)(x)  # the first derivative is fine


@pytest.mark.parametrize("name", default_run_keeps(RECIPES))
def test_rows_past_the_sum_give_zeros_as_ragged_dot(name):
  """Traced sizes summing to less than M under jit: the rows past the sum
  belong to no group; their output and input gradient are zero, as
  jax.lax.ragged_dot's (the weight gradient ignores them)."""
  sizes = (44, 0, 84, 3, 60)  # 191 of 256 rows
  x, w, dy = _operands("exact")
  scales = _scales_for(name, x, w, dy, sizes)
  y, dx, dw, _ = _grouped_fn(name)(x, w, dy, jnp.asarray(sizes, jnp.int32),
                                   scales)
  np.testing.assert_array_equal(np.asarray(y)[191:], 0.0)
  np.testing.assert_array_equal(np.asarray(dx)[191:], 0.0)
  ry, rdx, _ = _reference_fn()(x, w, dy, jnp.asarray(sizes, jnp.int32))
  np.testing.assert_array_equal(np.asarray(ry)[191:], 0.0)
  np.testing.assert_array_equal(np.asarray(rdx)[191:], 0.0)
  # The weight gradient of the rows in groups: the loop's over the first 191
  # rows (the rest would change it if they were read).
  want = _loop_fn(name, sizes)(x[:191], w, dy[:191], scales)
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(want[2]))
  np.testing.assert_array_equal(np.asarray(y)[:191], np.asarray(want[0]))


# ---------------------------------------------------------------------------
# 10. The programs: exported for CUDA, compiled for CPU.
# ---------------------------------------------------------------------------


def _step(f):
  def step(x, w, sizes):
    return jax.value_and_grad(lambda x, w: f(x, w, sizes).sum(),
                              argnums=(0, 1))(x, w)
  return step


_RAGGED_OP = re.compile(
    r'stablehlo\.composite "chlo\.ragged_dot".*?:\s*\((tensor<[^>]+>), '
    r'(tensor<[^>]+>), tensor<[^>]+>\) -> (tensor<[^>]+>)')


@pytest.mark.parametrize("name,fwd,grad", [
    ("fp8", "f8E4M3FN", "f8E5M2"), ("fp8_rowwise", "f8E4M3FN", "f8E4M3FN")])
def test_exported_cuda_program_has_float8_ragged_dots(name, fwd, grad):
  """jax.export for CUDA (on this CPU machine): the forward product, the
  input gradient and the weight gradient are chlo.ragged_dot composites
  (what jax lowers jax.lax.ragged_dot_general to for cuda) of float8
  operands with float32 results. Per tensor the weight is [G, K, N] as it
  comes; per row the forward product takes it as [G, N, K] (row scales
  along K)."""
  w_fwd = f"{G}x{K}x{N}" if name == "fp8" else f"{G}x{N}x{K}"
  config = _named(name)
  x, w, _ = _operands("normal")
  text = jax.export.export(
      jax.jit(_step(lambda x, w, s: fp8.ragged_dot(x, w, s,
                                                       config=config))),
      platforms=["cuda"])(x, w, jnp.asarray(JAGGED, jnp.int32)).mlir_module()
  ops = sorted(_RAGGED_OP.findall(text))
  want = sorted([
      (f"tensor<{M}x{K}x{fwd}>", f"tensor<{w_fwd}x{fwd}>",
       f"tensor<{M}x{N}xf32>"),                            # forward
      (f"tensor<{M}x{N}x{grad}>", f"tensor<{G}x{K}x{N}x{fwd}>",
       f"tensor<{M}x{K}xf32>"),                            # dx
      (f"tensor<{M}x{N}x{grad}>", f"tensor<{M}x{K}x{fwd}>",
       f"tensor<{G}x{N}x{K}xf32>"),                        # dw
  ])
  assert ops == want, ops


def _big_buffers(hlo, limit):
  """The top-level instructions (outside fusions: what gets a buffer) of an
  optimized HLO module with at least ``limit`` elements: 'dtype[dims]'."""
  called = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
  out = []
  for comp in re.split(r"\n(?=\S)", hlo):
    head = re.match(r"(?:ENTRY )?(%[\w.\-]+) ", comp)
    if not head or head.group(1) in called:
      continue
    for line in comp.splitlines()[1:]:
      m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]+)\]", line)
      if m and math.prod(int(d) for d in m.group(2).split(",")) >= limit:
        out.append(f"{m.group(1)}[{m.group(2)}]")
  return collections.Counter(out)


def test_compiled_cpu_program_has_no_more_group_by_token_buffers():
  """XLA:CPU expands ragged_dot into a dense product of a [G, M, K] operand
  masked by group: the plain float32 forward+backward holds four buffers
  of G*M*min(K, N) elements or more. The float8 program of each recipe
  holds no more of them (per tensor and per row float32 too: XLA:CPU
  converts the float8 operands inside the masking fusion). Blockwise's weight gradient is a dense product of 128-token
  blocks (no masked copy), MXFP8's a ragged product over the group-padded
  tokens (M + G*31 rounded up: [G, 384, K] here, in place of [G, M, K])."""
  m, k, n, g = 256, 128, 128, 4
  x, w = jnp.ones((m, k)), jnp.ones((g, k, n))
  sizes = jnp.full((g,), m // g, jnp.int32)
  limit = g * m * min(k, n)

  def buffers(f):
    return _big_buffers(jax.jit(_step(f)).lower(x, w, sizes).compile()
                        .as_text(), limit)

  base = buffers(jax.lax.ragged_dot)
  assert sum(base.values()) >= 3, base
  for name in ("fp8", "fp8_rowwise", "fp8_blockwise", "mxfp8"):
    config = _named(name)
    got = buffers(lambda x, w, s: fp8.ragged_dot(x, w, s, config=config))
    print(name, dict(got), "plain:", dict(base))
    assert sum(got.values()) <= sum(base.values()), (name, got, base)


def test_docs_table_is_the_code_s_scaling_table():
  """docs/fp8.md's table of what each recipe scales in each product of the
  grouped matmul is the table the code quantizes by (grouped.PASSES, and
  each recipe's formats): what each kind means is checked against the dense
  recipe by the per-group loop tests above."""
  import pathlib  # pylint: disable=g-import-not-at-top
  guide = (pathlib.Path(__file__).parent.parent / "docs" / "fp8.md").read_text()
  for line in grouped.scaling_table():
    assert line in guide, line


@pytest.mark.parametrize("recipe", default_run_keeps(["fp8", "fp8_rowwise", "fp8_blockwise", "mxfp8"]))
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_weight_stays_in_its_expert(recipe, bad):
  """XLA:CPU expands ragged_dot into every row times every expert's matrix
  (the rows masked): a NaN or inf in one expert's weight must still reach
  only that expert's rows (forward and input gradient), as in the per-group
  loop, and every other row stays bit-identical to the clean weight's."""
  sizes = (44, 0, 84, 3, 125)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.integers(-3, 4, size=(256, 64)), jnp.float32)
  w = np.asarray(rng.integers(-3, 4, size=(5, 64, 48)), np.float32)
  config = config_lib._named(recipe)  # pylint: disable=protected-access
  f = lambda x, w: fp8.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32),
                                      config=config)
  dy = jnp.ones((256, 48))
  clean_y, vjp = jax.vjp(f, x, jnp.asarray(w))
  clean_dx = vjp(dy)[0]
  w[2, 5, 7] = bad
  y, vjp = jax.vjp(f, x, jnp.asarray(w))
  dx = vjp(dy)[0]
  rows = np.zeros(256, bool)
  rows[44:128] = True                                   # expert 2's tokens
  for out, clean in ((y, clean_y), (dx, clean_dx)):
    out, clean = np.asarray(out), np.asarray(clean)
    assert np.isnan(out[rows]).any(axis=1).all()
    np.testing.assert_array_equal(out[~rows], clean[~rows])
