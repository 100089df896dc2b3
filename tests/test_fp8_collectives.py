"""fp8.all_to_all: an MoE dispatch whose payload travels as float8 rows and
their scales, bit for bit the quantized plain all-to-all, 1 byte per element
in the compiled and the exported programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jmp_lite import fp8
from jmp_lite._src.low_precision import recipes
from jmp_lite._src.low_precision import scaling
from helpers import default_run_keeps

RECIPES = ["fp8_blockwise", "mxfp8", "fp8_rowwise"]
_KIND = {"blockwise": "tile", "mxfp8": "mxfp8", "row": "row"}
N = 4


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("e",))


def _tokens(rows=N * 16, features=256, seed=0, dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  scale = jnp.exp(2 * jax.random.normal(k2, (rows, 1)))   # rows far apart
  return (jax.random.normal(k1, (rows, features)) * scale).astype(dtype)


def _mapped(fn):
  return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P("e"),
                               out_specs=P("e")))


def _quantized(x, fmt, config):
  kind = _KIND[config.granularity]
  q = scaling.quantize(x, fmt, kind, block_size=(
      config.block_size if kind == "tile" else None))
  return scaling.dequantize(q, x.dtype)


def _sqnr(ref, got):
  ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
  return 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))


@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
@pytest.mark.parametrize("axes,tiled", default_run_keeps(
    [((0, 0), True), ((1, 0), False)], unpack=True))
def test_quantize_then_dispatch_equals_dispatch_then_quantize(recipe, axes,
                                                              tiled):
  config = recipes.from_spec(recipe)
  split, concat = axes
  x = _tokens()
  if not tiled:    # [local rows, N, features]: one slice per peer
    x = x.reshape(N * 4, N, 256)
  dispatch = _mapped(lambda v: fp8.all_to_all(
      v, "e", split, concat, tiled=tiled, config=config))
  plain = _mapped(lambda v: jax.lax.all_to_all(v, "e", split, concat,
                                               tiled=tiled))
  got, moved = dispatch(x), plain(x)
  assert got.dtype == x.dtype and got.shape == moved.shape
  np.testing.assert_array_equal(
      np.asarray(got, np.float32),
      np.asarray(_quantized(moved, config.forward_format, config), np.float32))


@pytest.mark.parametrize("recipe", default_run_keeps(RECIPES))
def test_the_gradient_travels_back_in_float8(recipe):
  config = recipes.from_spec(recipe)
  x = _tokens(dtype=jnp.float32)
  cot = _tokens(seed=1, dtype=jnp.float32)
  dispatch = _mapped(lambda v: fp8.all_to_all(v, "e", 0, 0, tiled=True,
                                                  config=config))
  back = _mapped(lambda v: jax.lax.all_to_all(v, "e", 0, 0, tiled=True))
  _, vjp = jax.vjp(dispatch, x)
  (grad,) = vjp(cot)
  # The transpose of a tiled all-to-all over axis 0 is the same all-to-all.
  np.testing.assert_array_equal(
      np.asarray(grad),
      np.asarray(_quantized(back(cot), config.gradient_format, config)))
  exact = jax.vjp(back, x)[1](cot)[0]
  assert _sqnr(exact, grad) > 28.0


@pytest.mark.parametrize("recipe", RECIPES)
def test_sqnr_of_the_dispatched_tokens(recipe):
  # Measured: 31.5 dB for each recipe (e4m3 keeps 3 significand bits at any
  # scale; the blocks differ only near e4m3's subnormals, rare here).
  config = recipes.from_spec(recipe)
  x = _tokens(dtype=jnp.float32)
  got = _mapped(lambda v: fp8.all_to_all(v, "e", 0, 0, tiled=True,
                                             config=config))(x)
  ref = _mapped(lambda v: jax.lax.all_to_all(v, "e", 0, 0, tiled=True))(x)
  assert _sqnr(ref, got) > 30.0


def _all_to_alls(text):
  """Element type and per-peer element count of each all-to-all operand."""
  import re  # pylint: disable=g-import-not-at-top
  out = []
  for line in text.splitlines():
    if "all-to-all(" not in line or "=" not in line:
      continue
    result = line.split("=", 1)[1].split("all-to-all(")[0]
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", result):
      out.append((dtype, int(np.prod([int(d) for d in dims.split(",") if d]))))
  return out


@pytest.mark.parametrize("recipe,scale", [("fp8_blockwise", ("f32", 2)),
                                          ("mxfp8", ("u8", 8)),
                                          ("fp8_rowwise", ("f32", 1))])
def test_the_compiled_program_moves_one_byte_per_element(recipe, scale):
  config = recipes.from_spec(recipe)
  x = _tokens()
  text = _mapped(lambda v: fp8.all_to_all(
      v, "e", 0, 0, tiled=True, config=config)).lower(x).compile().as_text()
  moved = _all_to_alls(text)
  rows = x.shape[0] // N // N          # per peer
  # N pieces of `rows` rows: the values in u8, the scales beside them.
  assert sorted(set(moved)) == sorted({("u8", rows * 256),
                                       (scale[0], rows * scale[1])}), moved
  assert all(dtype in ("u8", "f32") for dtype, _ in moved)
  # The plain dispatch moves bf16 rows (widened by XLA:CPU): what we avoid.
  plain = _mapped(lambda v: jax.lax.all_to_all(v, "e", 0, 0, tiled=True))
  assert {d for d, _ in _all_to_alls(plain.lower(x).compile().as_text())} \
      - {"u8"}


def test_the_cuda_program_moves_ui8_rows_and_their_scales():
  x = _tokens()
  step = jax.shard_map(lambda v: fp8.all_to_all(v, "e", 0, 0, tiled=True),
                       mesh=_mesh(), in_specs=P("e"), out_specs=P("e"))
  text = jax.export.export(jax.jit(step), platforms=["cuda"])(
      jax.ShapeDtypeStruct(x.shape, x.dtype)).mlir_module()
  lines = [l for l in text.splitlines() if "all_to_all" in l and "->" in l]
  assert any("xui8>" in l for l in lines), lines
  assert any("xf32>" in l for l in lines), lines
  assert not any("xbf16>" in l for l in lines), lines


def test_a_non_finite_row_stays_in_its_row():
  x = _tokens(dtype=jnp.float32).at[3, 7].set(jnp.nan).at[20, 0].set(jnp.inf)
  got = np.asarray(_mapped(lambda v: fp8.all_to_all(
      v, "e", 0, 0, tiled=True))(x))
  ref = np.asarray(_mapped(lambda v: fp8.all_to_all(
      v, "e", 0, 0, tiled=True))(
          jnp.where(jnp.isfinite(x), x, 0.0)))
  bad_rows = ~np.all(np.isfinite(got), axis=1)
  assert bad_rows.sum() == 2
  np.testing.assert_array_equal(got[~bad_rows], ref[~bad_rows])


def test_bad_arguments_teach():
  x = _tokens()
  with pytest.raises(ValueError, match="last axis"):
    _mapped(lambda v: fp8.all_to_all(v, "e", 1, 1, tiled=True))(x)
  with pytest.raises(ValueError, match="granularity"):
    fp8.all_to_all(x, "e", 0, 0, config=fp8.Fp8Config())
  with pytest.raises(ValueError, match="delayed"):
    fp8.all_to_all(x, "e", 0, 0,
                       config=fp8.Fp8Config(scaling="delayed"))
  with pytest.raises(TypeError, match="Fp8Config"):
    fp8.all_to_all(x, "e", 0, 0, config="fp8_blockwise")
  with pytest.raises((TypeError, ValueError), match="x"):
    fp8.all_to_all(jnp.ones((4, 8), jnp.int32), "e", 0, 0)
