"""Tests of the float8 diagnostics: ``fp8_stats`` / ``Fp8Stats`` and
``advise`` / ``Fp8Advice``.

The counts are checked against a reference written here in NumPy float64 —
its own scales (powers of two rounded up from ``amax / max``), its own
round-to-nearest-even onto the e4m3/e5m2 grids, its own blocks — on crafted
arrays: outliers far above 448, values below e4m3's smallest subnormal 2**-9,
zeros, inf and NaN, shapes that do not divide into blocks; jit and no jit.
"""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import diagnostics
from jmp_lite._src.diagnostics import fp8_advice
from jmp_lite._src.diagnostics import fp8_stats as fp8_stats_lib

import helpers
from helpers import ROOT
from helpers import default_run_keeps

RECIPES = ("cast", "tensor", "row", "blockwise", "mxfp8")

# -- the reference ------------------------------------------------------------------

# format -> (largest finite value, mantissa bits, exponent of the smallest normal)
FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}


def ref_round(v, fmt):
  """Round to nearest, ties to even, onto the format's grid; saturating."""
  top, mant, emin = FORMATS[fmt]
  a = np.abs(v)
  _, exp = np.frexp(np.where(a > 0, a, 1.0))   # a = m * 2**exp, m in [0.5, 1)
  step = np.exp2(np.maximum(exp - 1, emin) - mant)
  q = np.minimum(np.round(a / step) * step, top)
  return np.sign(v) * q


def ref_scale(amax, fmt):
  """2**ceil(log2(amax / max)), at least 2**-126; 1 for amax == 0."""
  ratio = np.asarray(amax, np.float64) / FORMATS[fmt][0]
  m, e = np.frexp(np.where(ratio > 0, ratio, 1.0))
  pow2 = np.where(m == 0.5, ratio, np.exp2(e))
  return np.where(ratio > 0, np.maximum(pow2, 2.0**-126), 1.0)


def block_scales(x, fmt, rows_per_block, cols_per_block):
  """One scale per (rows_per_block x cols_per_block) block, spread back to
  every entry; partial edge blocks take the entries they have."""
  r, k = x.shape
  out = np.empty_like(x)
  for i in range(0, r, rows_per_block):
    for j in range(0, k, cols_per_block):
      block = x[i:i + rows_per_block, j:j + cols_per_block]
      out[i:i + rows_per_block, j:j + cols_per_block] = ref_scale(
          np.abs(block).max(), fmt)
  return out


def ref_stats(x, fmt, recipe, role="activation", scale=None):
  """``{"clipped", "flushed", "error", "worst"}`` of a (rows, K) matrix."""
  x = np.asarray(x, np.float64)
  x = np.where(np.isfinite(x), x, 0.0)
  r, k = x.shape
  if recipe == "cast":
    s = np.ones_like(x)
  elif recipe == "delayed":
    s = np.full_like(x, scale)
  elif recipe == "tensor":
    s = block_scales(x, fmt, r, k)
  elif recipe == "row":
    s = block_scales(x, fmt, 1, k)
  elif recipe == "mxfp8":
    s = block_scales(x, fmt, 1, 32)
  elif role == "weight":   # blockwise weights: 128 x 128 blocks
    s = block_scales(x, fmt, 128, 128)
  else:                    # blockwise activations and gradients: 1 x 128
    s = block_scales(x, fmt, 1, 128)
  v = x / s
  top, mant, emin = FORMATS[fmt]
  tiny = 2.0**(emin - mant)                       # the smallest subnormal
  flushed = (x != 0) & ((np.abs(v) < tiny / 2) | (np.abs(v) == tiny / 2))
  clipped = np.abs(v) > top
  dq = ref_round(v, fmt) * s
  assert np.array_equal(dq == 0, (x == 0) | flushed)   # the rounding agrees
  row_max = np.abs(x).max(axis=1)
  valid = row_max >= 2.0**-126
  num = np.sqrt(np.sum((x - dq)**2, axis=1))
  den = np.sqrt(np.sum(x**2, axis=1))
  rel = np.where(valid, num / np.where(valid, den, 1.0), 0.0)
  return {"clipped": int(clipped.sum()), "flushed": int(flushed.sum()),
          "error": float(rel[valid].mean()) if valid.any() else 0.0,
          "worst": float(rel.max(initial=0.0))}


def check_against_reference(stats, x, role="activation", scale=None):
  """Every format and recipe of ``stats`` against :func:`ref_stats`."""
  size = x.size
  for fmt in stats.formats:
    for recipe in stats.recipes:
      ref = ref_stats(x, fmt, recipe, role, scale)
      i, j = stats.formats.index(fmt), stats.recipes.index(recipe)
      where = (fmt, recipe)
      assert int(stats.clipped[i, j]) == ref["clipped"], where
      assert int(stats.flushed[i, j]) == ref["flushed"], where
      assert stats.fraction("clipped", recipe, fmt) == ref["clipped"] / size
      assert stats.fraction("flushed", recipe, fmt) == ref["flushed"] / size
      np.testing.assert_allclose(stats.error(recipe, fmt), ref["error"],
                                 rtol=1e-4, atol=1e-7, err_msg=str(where))
      np.testing.assert_allclose(stats.error(recipe, fmt, worst=True),
                                 ref["worst"], rtol=1e-4, atol=1e-7,
                                 err_msg=str(where))


def crafted(rows=6, k=300, seed=0):
  """Gaussian rows with outliers far above 448, values below 2**-9, zeros."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k))
  x[0, 5] = 3e6                         # far above e4m3's and e5m2's max
  x[1 % rows, :40] *= 1e5               # a run of outliers in one row
  x[2 % rows, k // 3:k // 2] = 2.0**-11  # below e4m3's smallest subnormal
  x[3 % rows, 7 % k] = -7e-5
  x[4 % rows, k - k // 6:] = 0.0
  x[5 % rows] *= 1e-3                   # a small row
  return x.astype(np.float32)


def maybe_jit(fn, jit):
  return helpers.maybe_jit(fn, jit, static_argnums=1)


# -- the statistics against the reference ----------------------------------------


@pytest.mark.parametrize("role,jit", [("activation", False),
                                          ("gradient", True)])
def test_fractions_match_the_reference(role, jit):
  x = crafted()
  stats = maybe_jit(lambda t, r: diagnostics.fp8_stats(
      t, r, fmt=("e4m3", "e5m2")), jit)(jnp.asarray(x), role)
  assert stats.formats == ("e4m3", "e5m2") and stats.recipes == RECIPES
  check_against_reference(stats, x, role)
  # The crafted outliers do clip without scaling, and per tensor they flush
  # the rest of the array in e4m3.
  assert stats.fraction("clipped", "cast", "e4m3") > 0
  assert stats.fraction("flushed", "tensor", "e4m3") > 0.5


def test_rows_near_the_smallest_normal_float32_are_measured():
  """Rows of normal values near 1e-38: the float8 recipes' errors are the
  reference's (each row's difference is taken after normalising it, not as
  a float32 subnormal that XLA:CPU flushes), and MXFP4's scale 2**-127
  neither clips every entry nor loses the row (it was decoded to a float32
  subnormal, flushed to zero), nor does NVFP4's subnormal tensor scale."""
  import fp4_reference as fp4_ref  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(7)
  x = (rng.uniform(2.0**-126, 1.2e-38, (4, 64)) *
       np.where(rng.random((4, 64)) < 0.5, -1, 1)).astype(np.float32)
  x[1, :32] = 7e-38                       # MXFP4 scale 2**-126
  stats = jax.jit(lambda t: diagnostics.fp8_stats(t, "activation"))(x)
  check_against_reference(stats, x)
  assert stats.error("mxfp8", worst=True) > 0
  fp4 = jax.jit(lambda t: diagnostics.fp8_stats(t, "activation",
                                                fmt="e2m1"))(x)
  values, codes = fp4_ref.mxfp4(x)
  assert (codes == 0).any() and (codes == 1).any()
  deq = fp4_ref.dequantize_mxfp4(values, codes).astype(np.float64)
  x64 = x.astype(np.float64)
  rel = np.linalg.norm(x64 - deq, axis=1) / np.linalg.norm(x64, axis=1)
  assert fp4.fraction("clipped", "mxfp4") == 0
  assert fp4.fraction("flushed", "mxfp4") == 0
  np.testing.assert_allclose(fp4.error("mxfp4"), rel.mean(), rtol=1e-4)
  np.testing.assert_allclose(fp4.error("mxfp4", worst=True), rel.max(),
                             rtol=1e-4)
  # NVFP4: its tensor scale 1 / S_enc is a float32 subnormal here (flushed:
  # every entry counted clipped, every row 100% wrong).
  with np.errstate(over="ignore"):
    values, scales, tensor_scale = fp4_ref.nvfp4(x)
  assert 0 < tensor_scale < 2.0**-126
  deq = fp4_ref.dequantize_nvfp4(values, scales, tensor_scale)
  rel = (np.linalg.norm(x64 - deq.astype(np.float64), axis=1) /
         np.linalg.norm(x64, axis=1))
  assert fp4.fraction("clipped", "nvfp4") < 0.1
  np.testing.assert_allclose(fp4.error("nvfp4"), rel.mean(), rtol=1e-4)
  np.testing.assert_allclose(fp4.error("nvfp4", worst=True), rel.max(),
                             rtol=1e-4)


def test_weights_contract_every_axis_but_the_last_with_128x128_blocks():
  rng = np.random.default_rng(1)
  kernel = rng.standard_normal((3, 3, 20, 150)).astype(np.float32)   # a conv
  kernel[0, 0, 0, :] *= 1e6
  stats = diagnostics.fp8_stats(jnp.asarray(kernel), "weight")
  # Rows are output features, the contracting axes (3 * 3 * 20) the columns.
  matrix = kernel.reshape(180, 150).T
  check_against_reference(stats, matrix, "weight")
  dense = rng.standard_normal((260, 200)).astype(np.float32)   # (in, out)
  dense[:, 3] *= 1e5
  stats = diagnostics.fp8_stats(jnp.asarray(dense), "weight")
  check_against_reference(stats, dense.T, "weight")
  assert stats.error("blockwise") != stats.error("row")


def test_axis_chooses_the_contracting_axes():
  x = crafted(rows=40, k=70)
  down = diagnostics.fp8_stats(jnp.asarray(x), "activation", axis=0)
  check_against_reference(down, x.T)
  both = diagnostics.fp8_stats(jnp.asarray(x.reshape(2, 20, 70)),
                               "activation", axis=(0, 1))
  check_against_reference(both, x.T)
  weight_default = diagnostics.fp8_stats(jnp.asarray(x), "weight")
  check_against_reference(weight_default, x.T, "weight")


def test_shapes_that_do_not_divide_into_blocks_use_partial_blocks():
  # 1x128 tiles and 1x32 MX blocks over K = 45 and 200; 128x128 weight
  # blocks over 130 x 200: the last block holds what is left (the float8
  # matmul's zero padding is the same), never an error.
  for shape in [(3, 45), (7, 200)]:
    x = crafted(*shape, seed=shape[1])
    check_against_reference(diagnostics.fp8_stats(jnp.asarray(x),
                                                  "activation"), x)
  w = crafted(200, 130, seed=3)
  check_against_reference(diagnostics.fp8_stats(jnp.asarray(w), "weight"),
                          w.T, "weight")


def test_block_size_sets_the_blockwise_tiles():
  x = crafted(4, 200)
  stats = diagnostics.fp8_stats(jnp.asarray(x), "activation", block_size=32)
  ref = ref_stats(x, "e4m3", "mxfp8")   # 1 x 32 tiles with float32 scales
  i = stats.recipes.index("blockwise")
  assert int(stats.flushed[0, i]) == ref["flushed"]
  assert stats.block_size == 32


def test_a_delayed_scale_measures_clipping():
  x = crafted()
  fn = jax.jit(lambda t, r, s: diagnostics.fp8_stats(t, r, scale=s),
               static_argnums=1)   # a traced scale
  stale = 2.0**-4          # an amax history that never saw the outliers
  stats = fn(jnp.asarray(x), "activation", jnp.float32(stale))
  assert stats.recipes == RECIPES + ("delayed",)
  check_against_reference(stats, x, scale=stale)
  assert stats.fraction("clipped", "delayed") == np.mean(np.abs(x) > 448 / 16)
  # A scale per leaf: a tree of scalars (a prefix of the values' tree).
  tree = {"a": jnp.asarray(x), "b": {"c": jnp.asarray(x), "n": 3}}
  stats = diagnostics.fp8_stats(tree, "activation",
                                scale={"a": 1.0, "b": 2.0**20})
  assert stats["b"]["n"] is None
  assert stats["a"].fraction("clipped", "delayed") > 0
  assert stats["b"]["c"].fraction("clipped", "delayed") == 0
  check_against_reference(stats["b"]["c"], x, scale=2.0**20)


def test_non_finite_entries_are_counted_and_measured_as_zeros():
  x = crafted()
  bad = x.copy()
  bad[0, 0], bad[1, 1], bad[2, 2] = np.nan, np.inf, -np.inf
  stats = diagnostics.fp8_stats(jnp.asarray(bad), "activation")
  zeroed = diagnostics.fp8_stats(jnp.asarray(np.where(np.isfinite(bad), bad,
                                                      0.0)), "activation")
  assert int(stats.nonfinite) == 3 and int(zeroed.nonfinite) == 0
  assert int(stats.zeros) == int(zeroed.zeros) - 3
  for field in ("clipped", "flushed", "error_sum", "error_max"):
    np.testing.assert_array_equal(getattr(stats, field),
                                  getattr(zeroed, field))
  assert float(stats.max_abs) == np.abs(x[np.isfinite(bad)]).max()
  assert all(math.isfinite(v) for fmt in stats.summary().values()
             for rec in fmt.values() for v in rec.values())


def test_zeros_subnormals_and_the_smallest_e4m3_values():
  # 2**-10 (half the smallest e4m3 subnormal) is a tie: rounds to even, 0;
  # just above it rounds up to 2**-9; float32 subnormals are not zeros.
  x = np.array([[0.0, -0.0, 2.0**-10, 2.0**-10 * 1.01, 2.0**-12, 1e-40,
                 1.0, 2.0**-9]], np.float32)
  stats = diagnostics.fp8_stats(jnp.asarray(x), "activation")
  assert int(stats.zeros) == 2 and int(stats.size) == 8
  i = stats.recipes.index("cast")
  assert int(stats.flushed[0, i]) == 3   # 2**-10, 2**-12, 1e-40
  assert int(stats.clipped[0, i]) == 0
  e5m2 = diagnostics.fp8_stats(jnp.asarray(x), "gradient")   # down to 2**-16
  assert int(e5m2.flushed[0, i]) == 1    # only the float32 subnormal


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_leaves(dtype):
  x = crafted(4, 96)
  x = np.clip(x, -6e4, 6e4)
  half = jnp.asarray(x, dtype)
  stats = diagnostics.fp8_stats(half, "activation",)
  exact = np.asarray(half.astype(jnp.float32))
  # MX computes its block ratio in the input's dtype (as JAX's quantizer
  # does), so only the float32-scaled recipes are compared here.
  for recipe in ("cast", "tensor", "row", "blockwise"):
    ref = ref_stats(exact, "e4m3", recipe)
    j = stats.recipes.index(recipe)
    assert int(stats.flushed[0, j]) == ref["flushed"], recipe
    assert int(stats.clipped[0, j]) == ref["clipped"], recipe


def test_non_float_leaves_pass_through_and_scalars_are_one_entry():
  tree = {"w": jnp.ones((4, 4)), "step": jnp.array(3), "flag": True,
          "name": "dense", "none": None, "lr": 0.1,
          "scalar": jnp.float32(500.0), "f8": jnp.ones(4, jnp.float8_e4m3fn)}
  stats = diagnostics.fp8_stats(tree, "weight")
  for key in ("step", "flag", "name", "lr"):
    assert stats[key] is None, key
  assert stats["none"] is None
  assert isinstance(stats["w"], diagnostics.Fp8Stats)
  assert int(stats["scalar"].size) == 1
  assert stats["scalar"].fraction("clipped", "cast") == 1.0
  assert stats["scalar"].fraction("clipped", "tensor") == 0.0
  assert stats["f8"].error("tensor") == 0.0   # float8 values are exact
  assert diagnostics.fp8_stats({}, "activation") == {}


def test_empty_and_float64_leaves():
  for shape in [(0,), (0, 8), (4, 0)]:
    stats = diagnostics.fp8_stats(jnp.zeros(shape), "weight")
    assert int(stats.size) == 0 and int(stats.rows) == 0, shape
    assert stats.fraction("flushed", "blockwise") == 0.0
    assert stats.error("mxfp8") == 0.0
  # NumPy float64 goes through float32: beyond its range is inf.
  stats = diagnostics.fp8_stats(np.array([[1e300, 1.0, 1e-300]]),
                                "activation")
  assert int(stats.nonfinite) == 1 and int(stats.zeros) == 1
  assert stats.fraction("flushed", "tensor") == 0.0


def test_statistics_are_a_pytree_that_jit_returns_and_groups():
  @jax.jit
  def step(params):
    return diagnostics.fp8_stats(params, "weight")
  params = {"a": {"kernel": jnp.ones((32, 16)), "bias": jnp.ones(16)},
            "b": {"kernel": jnp.full((16, 8), 2.0)}}
  stats = step(params)
  leaves = jax.tree.leaves(stats)
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
  grouped = jax.jit(lambda s: diagnostics.group_stats(s, by=1))(stats)
  assert set(grouped) == {"a", "b"}
  assert int(grouped["a"].size) == 32 * 16 + 16
  assert int(grouped["a"].rows) == 16 + 1
  np.testing.assert_array_equal(
      grouped["a"].clipped,
      stats["a"]["kernel"].clipped + stats["a"]["bias"].clipped)


def test_summary_and_methods():
  stats = diagnostics.fp8_stats(jnp.asarray(crafted()), "gradient",
                                fmt=("e5m2", "e4m3"))
  summary = stats.summary()
  assert list(summary) == ["e5m2", "e4m3"]
  assert list(summary["e4m3"]) == list(RECIPES)
  assert summary["e4m3"]["row"]["flushed"] == stats.fraction(
      "flushed", "row", "e4m3")
  assert summary["e5m2"]["mxfp8"]["worst_error"] == stats.error(
      "mxfp8", "e5m2", worst=True)
  traced = jax.jit(lambda s: s.fraction("flushed", "tensor", "e4m3"))(stats)
  assert float(traced) == pytest.approx(
      stats.fraction("flushed", "tensor", "e4m3"))


# -- bad inputs -------------------------------------------------------------------


def test_bad_arguments_name_the_problem():
  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="unknown role 'input_grad'.*activation"):
    diagnostics.fp8_stats(x, "input_grad")
  with pytest.raises(TypeError, match="role must be a string"):
    diagnostics.fp8_stats(x, 1)
  with pytest.raises(ValueError, match="Unknown float8 fmt 'e3m4'.*e4m3"):
    diagnostics.fp8_stats(x, "activation", fmt="e3m4")
  with pytest.raises(TypeError, match="float8 fmt must be a name"):
    diagnostics.fp8_stats(x, "activation", fmt=8)
  with pytest.raises(ValueError, match="at least one format"):
    diagnostics.fp8_stats(x, "activation", fmt=())
  # Axes are NumPy's (normalize_axis_tuple): its errors.
  with pytest.raises(np.exceptions.AxisError, match="axis 2 is out of bounds"):
    diagnostics.fp8_stats({"w": x}, "activation", axis=2)
  for bad in ("last", 1.0, (0, "1"), True):
    with pytest.raises(TypeError, match=(
        r"fp8_stats: axis must be an int, a tuple of ints or None, got "
        + type(bad).__name__ + ": " + re.escape(repr(bad)) +
        r"\. axis names the contracting axes .* axis=-1, the last axis")):
      diagnostics.fp8_stats(x, "activation", axis=bad)
  with pytest.raises(ValueError, match="repeated axis"):
    diagnostics.fp8_stats(x, "activation", axis=(0, -2))
  with pytest.raises(ValueError, match="block_size=100 is not a positive "
                     "multiple of 16"):
    diagnostics.fp8_stats(x, "activation", block_size=100)
  with pytest.raises(TypeError, match="block_size must be an int"):
    diagnostics.fp8_stats(x, "activation", block_size=64.0)
  with pytest.raises(ValueError, match="scale must be positive.*delayed"):
    diagnostics.fp8_stats(x, "activation", scale=-1.0)
  with pytest.raises(TypeError, match="scale must be a number, got a bool"):
    diagnostics.fp8_stats(x, "activation", scale=True)
  with pytest.raises(ValueError, match="scale must be a scalar"):
    diagnostics.fp8_stats(x, "activation", scale=jnp.ones(2))
  with pytest.raises(ValueError, match="one format"):
    diagnostics.fp8_stats(x, "activation", scale=1.0, fmt=("e4m3", "e5m2"))
  with pytest.raises(ValueError):  # JAX's own pytree error (its wording varies)
    diagnostics.fp8_stats({"a": x, "b": x}, "activation",
                          scale={"a": 1.0, "c": 1.0})


def test_bad_recipe_format_and_count_in_the_methods():
  stats = diagnostics.fp8_stats(jnp.ones((2, 8)), "activation")
  with pytest.raises(ValueError, match="recipe 'colwise' was not measured"):
    stats.fraction("flushed", "colwise")
  with pytest.raises(ValueError, match="'delayed' only when"):
    stats.error("delayed")
  with pytest.raises(ValueError, match="count must be one of"):
    stats.fraction("zeros", "tensor")
  with pytest.raises(ValueError, match="format 'e5m2' was not measured"):
    stats.error("row", "e5m2")
  both = diagnostics.fp8_stats(jnp.ones((2, 8)), "activation",
                               fmt=("e4m3", "e5m2"))
  with pytest.raises(ValueError, match="say which with fmt="):
    both.fraction("flushed", "row")


def test_groups_of_different_kinds_or_roles_are_refused():
  x = {"a": jnp.ones((2, 8))}
  mixed = {"w": diagnostics.fp8_stats(x, "weight"),
           "g": diagnostics.fp8_stats(x, "gradient")}
  with pytest.raises(ValueError, match="measure different things"):
    diagnostics.group_stats(mixed, by=lambda path: "all")
  kinds = {"h": diagnostics.tensor_stats(x), "f": diagnostics.fp8_stats(
      x, "weight")}
  with pytest.raises(TypeError, match="mixes half-precision statistics"):
    diagnostics.group_stats(kinds, by=lambda path: "all")
  fp8 = diagnostics.fp8_stats(x, "weight")
  assert isinstance(diagnostics.advise(fp8), diagnostics.Fp8Advice)
  with pytest.raises(TypeError, match="give them to diagnostics.advise as its "
                     "first argument"):
    diagnostics.advise(x, fp8)          # float8 activation statistics
  with pytest.raises(TypeError, match="give them to diagnostics.advise as its "
                     "first argument"):
    diagnostics.report(fp8, file=io.StringIO())


def test_fp8_advice_refuses_other_statistics_and_traced_values():
  x = {"a": jnp.ones((2, 8))}
  fp8 = diagnostics.fp8_stats(x, "weight")
  with pytest.raises(TypeError, match="mix float8, FP4 or int8 statistics.*"
                     "with half-precision statistics"):
    diagnostics.advise({"f": fp8, "h": diagnostics.tensor_stats(x)})
  with pytest.raises(TypeError, match="with a float32 array at 'h/a'.*"
                     r"advise\(fp8_stats_tree\)"):
    diagnostics.advise({"f": fp8, "h": x})
  # The implementation refuses them too (it is called with Fp8Stats only).
  with pytest.raises(TypeError, match="got half-precision statistics"):
    fp8_advice.advise_fp8(diagnostics.tensor_stats(x))
  with pytest.raises(TypeError, match="got a float32 array at 'a'"):
    fp8_advice.advise_fp8(x)
  with pytest.raises(TypeError, match="outside jax.jit"):
    jax.jit(lambda s: diagnostics.advise(s).keep_out)(
        diagnostics.fp8_stats(x, "weight"))
  stats = diagnostics.fp8_stats(x, "weight")
  with pytest.raises(ValueError, match="max_flushed is a share"):
    diagnostics.advise(stats, max_flushed=2)
  with pytest.raises(TypeError, match="max_clipped must be a number"):
    diagnostics.advise(stats, max_clipped="none")
  with pytest.raises(ValueError, match="max_error must be a finite number"):
    diagnostics.advise(stats, max_error=-1)
  with pytest.raises(TypeError, match="must return a string"):
    diagnostics.advise(stats, by=lambda path: 3)


# -- the advice -------------------------------------------------------------------


def gaussian(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def layer(weight, activation, gradient):
  return {"weight": diagnostics.fp8_stats({"dense": weight}, "weight"),
          "activation": diagnostics.fp8_stats({"dense": activation},
                                              "activation"),
          "gradient": diagnostics.fp8_stats({"dense": gradient}, "gradient")}


BY_LAYER = {"by": lambda path: path.split("/")[1]}


def test_a_well_scaled_layer_is_advised_per_tensor():
  stats = layer(gaussian((64, 32), 0) * 0.05, gaussian((16, 64), 1),
                gaussian((16, 32), 2) * 1e-4)
  advice = diagnostics.advise(stats, **BY_LAYER)
  assert advice.granularity == {"dense": "tensor"}
  assert advice.keep_out == () and advice.delayed == {}
  assert advice.reasons == ()
  assert list(advice.stats["dense"]) == ["activation", "weight", "gradient"]
  assert advice.max_error == {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
  text = str(advice)
  assert "| dense | tensor | activation, weight, gradient |" in text
  assert "| dense | gradient | e5m2 | 512 |" in text


def test_outlier_rows_are_advised_per_row():
  acts = gaussian((16, 64), 1).at[0].multiply(1e6)   # one massive token
  stats = layer(gaussian((64, 32), 0) * 0.05, acts, gaussian((16, 32), 2))
  advice = diagnostics.advise(stats, **BY_LAYER)
  assert advice.granularity == {"dense": "row"}
  (reason,) = advice.reasons
  assert reason.startswith("dense: row, because per tensor, its activations "
                           "(e4m3) flush")


def test_outlier_features_need_mxfp8_or_stay_out():
  # One outlier feature per row: 1 x 128 tiles flush the other 127 entries
  # of its tile (3.1% of 4096), MX blocks only 31 (0.76%).
  acts = gaussian((8, 4096), 1).at[:, 0].set(1e7)
  advice = diagnostics.advise({"x": diagnostics.fp8_stats(
      acts, "activation")})
  assert advice.granularity == {"x": "mxfp8"}
  # One in every 32: MX flushes 97% too. Keep the layer out.
  acts = gaussian((8, 256), 1).at[:, ::32].set(1e7)
  advice = diagnostics.advise({"x": diagnostics.fp8_stats(
      acts, "activation")})
  assert advice.granularity == {"x": None} and advice.keep_out == ("x",)
  assert advice.reasons[0].startswith(
      "Keep x out of float8 (in the compute dtype): even MXFP8, its "
      "activations (e4m3) flush")
  assert "| x | keep out of float8 | activation |" in str(advice)


def test_limits_change_the_advice():
  stats = {"x": diagnostics.fp8_stats(gaussian((16, 64), 0), "activation")}
  assert diagnostics.advise(stats).granularity == {"x": "tensor"}
  # Gaussian rows lose 2-3% to e4m3 rounding, whatever the scales.
  strict = diagnostics.advise(stats, max_error=0.01)
  assert strict.granularity == {"x": None}
  assert re.search(r"lose 2\.\d% of each row on average \(limit 1%\)",
                   strict.reasons[0]), strict.reasons
  acts = gaussian((8, 4096), 1).at[:, 0].set(1e7)
  stats = {"x": diagnostics.fp8_stats(acts, "activation")}
  assert diagnostics.advise(stats, max_flushed=0.05).granularity == {
      "x": "blockwise"}


def test_delayed_scales_that_clip_do_not_fit():
  acts = gaussian((16, 64), 1)
  amax = float(jnp.max(jnp.abs(acts)))
  fresh = float(fp8_stats_lib.fp8_scaling.scale_from_amax(jnp.float32(amax)))
  fits = diagnostics.advise({"x": diagnostics.fp8_stats(
      acts, "activation", scale=fresh)})
  assert fits.delayed == {"x": True} and fits.granularity == {"x": "tensor"}
  stale = diagnostics.advise({"x": diagnostics.fp8_stats(
      acts * 8, "activation", scale=fresh)})
  assert stale.delayed == {"x": False}
  assert stale.granularity == {"x": "tensor"}   # current scaling still fits
  (reason,) = stale.reasons
  assert reason.startswith("x: the given delayed scales do not fit: its "
                           "activations (e4m3) clip")
  assert "delayed scales do not fit" in str(stale)
  assert "delayed: clipped / flushed / error %" in str(stale)


def test_layers_group_across_roles_and_report_non_finite_entries():
  stats = {
      "weight": diagnostics.fp8_stats(
          {"a": {"kernel": gaussian((32, 16), 0)}, "b": {"kernel": gaussian(
              (16, 8), 1)}}, "weight"),
      "activation": diagnostics.fp8_stats(
          {"a": {"input": gaussian((4, 32), 2).at[0, 0].set(jnp.nan)},
           "b": {"input": gaussian((4, 16), 3)}}, "activation")}
  advice = diagnostics.advise(stats, **BY_LAYER)
  assert list(advice.granularity) == ["a", "b"]
  assert list(advice.stats["a"]) == ["activation", "weight"]
  assert advice.reasons == (
      "a: 1 of its activations are inf/NaN (measured as zeros): fix those "
      "first; in a float8 matmul they make the result non-finite whatever "
      "the granularity.",)
  per_leaf = diagnostics.advise(stats)
  assert list(per_leaf.granularity) == [   # dicts flatten in key order
      "activation/a/input", "activation/b/input", "weight/a/kernel",
      "weight/b/kernel"]
  empty = fp8_advice.advise_fp8({"n": None})
  assert empty.granularity == {} and "nothing to advise" in str(empty)
  # No leaf says which kind: the public advise gives half-precision advice.
  assert "nothing to advise" in str(diagnostics.advise({"n": None}))


def test_the_public_names_have_examples():
  for name in ("fp8_stats", "Fp8Stats", "advise", "Fp8Advice"):
    assert name in diagnostics.__all__
    doc = getattr(diagnostics, name).__doc__
    assert ">>>" in doc and "docs/diagnostics.md" in doc, name


# -- the guide ----------------------------------------------------------------------


@pytest.mark.slow  # runs a code block of the guide, as test_docs does
def test_the_guide_shows_what_its_float8_example_prints():
  """The Float8 section's example runs, prints the granularities its comments
  give, and the table rows and the reason the text quotes."""
  text = (ROOT / "docs" / "diagnostics.md").read_text()
  section = text[text.index("## Float8"):text.index("## FP4")]
  (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
  (table,) = re.findall(r"```text\n(.*?)```", section, re.DOTALL)
  out = io.StringIO()
  with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
    exec(compile(block, "diagnostics.md Float8", "exec"), {})  # pylint: disable=exec-used
  printed = out.getvalue()
  for comment in re.findall(r"print\(advice\.granularity\)\s+# (\{.*\})",
                            block):
    assert comment in printed.splitlines(), comment
  for row in table.strip().splitlines():
    assert row in printed, row
  quoted = re.search(r"e\.g\. `(Dense_0: row,.*?)`", section, re.DOTALL)
  assert " ".join(quoted.group(1).split()) in printed


@pytest.mark.parametrize("ladder,error", [
    ("row", TypeError), (None, TypeError), ((), ValueError),
    (("row", "row"), ValueError)])
def test_fp8_advice_granularities_are_a_tuple_of_distinct_names(ladder, error):
  stats = {"x": diagnostics.fp8_stats(jnp.ones((2, 16)), "activation")}
  with pytest.raises(error, match="granularities must be a tuple.*each once"):
    diagnostics.advise(stats, granularities=ladder)


# -- one advise for every format -----------------------------------------------------


@pytest.mark.parametrize("fmt", default_run_keeps([None, "e2m1", "int8"]),
                         ids=["float8", "fp4", "int8"])
def test_advise_on_low_precision_statistics_is_the_fp8_advice(fmt):
  """diagnostics.advise on Fp8Stats gives what advise_fp8 gave (the
  implementation it calls), with the same options."""
  rng = np.random.default_rng(0)
  acts = {"a": jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
               .at[0].set(1e4),
          "b": jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)}
  stats = {"activation": diagnostics.fp8_stats(acts, "activation", fmt=fmt),
           "weight": diagnostics.fp8_stats(acts, "weight", fmt=fmt)}
  options = {"by": lambda path: path.split("/")[1], "max_error": 0.05}
  got = diagnostics.advise(stats, **options)
  want = fp8_advice.advise_fp8(stats, **options)
  assert isinstance(got, diagnostics.Fp8Advice)
  assert str(got) == str(want)
  for field in ("granularity", "keep_out", "delayed", "max_clipped",
                "max_flushed", "max_error", "reasons", "ranking"):
    assert getattr(got, field) == getattr(want, field), field
  assert str(diagnostics.advise(stats)) == str(fp8_advice.advise_fp8(stats))


@pytest.mark.parametrize("option,value", [
    ("headroom", 4.0), ("max_underflow", 0.1), ("keep_f32_underflow", 0.9)])
def test_advise_refuses_half_precision_options_with_fp8_statistics(option,
                                                                   value):
  stats = diagnostics.fp8_stats(jnp.ones((2, 16)), "weight")
  with pytest.raises(TypeError, match=rf"advise: {option}= is an option for "
                     "half-precision statistics.*these are float8, FP4 or "
                     "int8 statistics"):
    diagnostics.advise(stats, **{option: value})


@pytest.mark.parametrize("option,value", [
    ("max_clipped", 0.0), ("max_flushed", 0.1), ("max_error", 0.1),
    ("granularities", ("row",)), ("max_error", None)])
def test_advise_refuses_fp8_options_with_half_precision_statistics(option,
                                                                   value):
  grads = {"w": jnp.array([1e-6, 2.0**-10, 0.5])}
  for given in (grads, diagnostics.tensor_stats(grads)):
    with pytest.raises(TypeError, match=rf"advise: {option}= is an option for "
                       "float8, FP4 or int8 statistics.*these are "
                       "half-precision statistics"):
      diagnostics.advise(given, **{option: value})


def test_advise_refuses_activation_stats_with_fp8_statistics():
  stats = diagnostics.fp8_stats(jnp.ones((2, 16)), "weight")
  acts = diagnostics.fp8_stats(jnp.ones((2, 16)), "activation")
  with pytest.raises(TypeError, match="activation_stats is for half-precision "
                     "statistics.*put every role in the first argument"):
    diagnostics.advise(stats, acts)


def test_advise_refuses_statistics_mixing_float8_and_fp4():
  x = jnp.ones((2, 32))
  mixed = {"f": diagnostics.fp8_stats(x, "weight"),
           "q": diagnostics.fp8_stats(x, "weight", fmt="e2m1")}
  with pytest.raises(ValueError, match=r"mix FP4 \('q'\) and float8 \('f'\).*"
                     r"advise\(fp4_stats\), advise\(float8_stats\)"):
    diagnostics.advise(mixed)
