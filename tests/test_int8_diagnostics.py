"""int8 diagnostics: diagnostics.fp8_stats(..., fmt="int8") counts what the
int8 matmul's quantizer does to each role's values (exact counts on small
hand-built arrays, a NumPy reference for the error), and advise turns
int8 statistics into the layers to keep in 16 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import diagnostics

from helpers import JIT
from helpers import maybe_jit


def _stats(x, role, **kwargs):
  return diagnostics.fp8_stats(jnp.asarray(x), role, fmt="int8", **kwargs)


def _reference(x, per_tensor=False):
  """Row-wise (or per-tensor) symmetric int8 in float64: (q, scale)."""
  x = np.asarray(x, np.float64)
  amax = np.abs(x).max() if per_tensor else np.abs(x).max(axis=1,
                                                           keepdims=True)
  scale = np.where(amax == 0, 1.0, amax / 127)
  return np.clip(np.round(x / scale), -127, 127), scale


def test_exact_counts_on_a_hand_built_row():
  # amax 127: the grid step is 1. 0.4 and 0.5 round to 0 (half to even),
  # 0.6 to 1, 1.5 to 2, -2.5 to -2; the zero is no flush.
  x = np.array([[127.0, 0.4, 0.5, 0.6, 1.5, -2.5, 0.0]], np.float32)
  s = _stats(x, "activation")
  assert s.formats == ("int8",) and s.recipes == ("int8", "int8_switchback")
  assert int(s.flushed[0, 0]) == 2 and int(s.clipped[0, 0]) == 0
  assert int(s.zeros) == 1 and s.fraction("flushed", "int8") == 2 / 7
  deq = np.array([127, 0, 0, 1, 2, -2, 0], np.float64)
  expected = np.linalg.norm(x[0] - deq) / np.linalg.norm(x[0])
  assert s.error("int8") == pytest.approx(expected, rel=1e-5)


def test_rows_are_scaled_along_the_contracting_axis():
  # Two rows of different magnitudes: row-wise scales flush nothing; the
  # contracting axis 0 puts 1 and 1000 in one row, flushing the 1s.
  x = np.array([[1.0, 2.0, 3.0, 4.0], [1000.0, 2000.0, 3000.0, 4000.0]],
               np.float32)
  assert _stats(x, "activation").fraction("flushed", "int8") == 0.0
  columns = _stats(x, "activation", axis=0)
  # Each column (1, 1000) gets the scale 1000 / 127: its small entry, 0.127
  # steps, rounds to 0.
  assert int(columns.flushed[0, 0]) == 4


@JIT
def test_weights_per_channel_and_switchback_per_tensor(jit):
  # A Dense kernel (in=4, out=2): int8 scales each output channel along
  # `in`; SwitchBack one scale for the tensor, which flushes the small
  # channel's entries below half its grid step (500 / 127 / 2 = 1.97): 1,
  # 1.5 and -0.5, not 3.
  w = np.array([[1.0, 500.0], [1.5, -250.0], [-0.5, 100.0], [3.0, 10.0]],
               np.float32)
  s = maybe_jit(_stats, jit, static_argnums=1)(w, "weight")
  assert int(s.flushed[0, s.recipes.index("int8")]) == 0
  assert int(s.flushed[0, s.recipes.index("int8_switchback")]) == 3
  q, scale = _reference(w.T)
  rows = np.linalg.norm(w.T - q * scale, axis=1) / np.linalg.norm(w.T, axis=1)
  np.testing.assert_allclose(s.error("int8"), rows.mean(), rtol=1e-5)
  np.testing.assert_allclose(s.error("int8", worst=True), rows.max(),
                             rtol=1e-5)


def test_gaussian_rows_flush_little_an_outlier_row_flushes_most():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 1024)).astype(np.float32)
  gaussian = _stats(x, "activation")
  q, scale = _reference(x)
  # Flushed: nonzero entries below half a grid step, as the reference says.
  assert gaussian.fraction("flushed", "int8") == pytest.approx(
      np.mean((q == 0) & (x != 0)))
  assert gaussian.fraction("flushed", "int8") < 0.02
  assert gaussian.fraction("clipped", "int8") == 0.0
  rows = np.linalg.norm(x - q * scale, axis=1) / np.linalg.norm(x, axis=1)
  np.testing.assert_allclose(gaussian.error("int8"), rows.mean(), rtol=1e-4)
  assert 38 < gaussian.snr("int8") < 45   # about 41 dB
  # One huge entry per row sets each row's scale: the rest flush to zero.
  outlier = _stats(np.where(np.arange(1024) == 0, np.float32(1e4), x),
                   "activation")
  assert outlier.fraction("flushed", "int8") > 0.99
  assert outlier.fraction("clipped", "int8") == 0.0


def test_a_given_scale_clips_what_lies_beyond_127_steps():
  # scale 1: |x| >= 127.5 rounds to 128 or more and is clipped; 127.4 is
  # not (it rounds to 127); 0.3 flushes; the current recipes never clip.
  x = np.array([[127.4, 127.5, -300.0, 0.3, 5.0, 1.0]], np.float32)
  s = _stats(x, "activation", scale=1.0)
  assert s.recipes == ("int8", "int8_switchback", "delayed")
  assert int(s.clipped[0, s.recipes.index("delayed")]) == 2
  assert int(s.flushed[0, s.recipes.index("delayed")]) == 1
  assert int(s.clipped[0, s.recipes.index("int8")]) == 0
  # Traced scales too.
  traced = jax.jit(lambda v, sc: diagnostics.fp8_stats(
      v, "activation", fmt="int8", scale=sc))(jnp.asarray(x), 1.0)
  assert int(traced.clipped[0, 2]) == 2


def test_edge_cases():
  zeros = _stats(np.zeros((4, 8), np.float32), "activation")
  assert zeros.error("int8") == 0.0 and zeros.snr("int8") == float("inf")
  assert zeros.fraction("flushed", "int8") == 0.0
  nan = _stats(np.array([[1.0, np.nan, 0.001]], np.float32), "gradient")
  assert int(nan.nonfinite) == 1 and int(nan.flushed[0, 0]) == 1
  bf16 = _stats(jnp.ones((2, 8), jnp.bfloat16), "activation")
  assert bf16.error("int8") == 0.0
  assert diagnostics.fp8_stats(jnp.ones((2, 8)), "weight",
                               fmt=jnp.int8).formats == ("int8",)


def test_int8_format_errors():
  x = jnp.ones((16, 16))
  with pytest.raises(ValueError, match="mixes int8 with float8"):
    diagnostics.fp8_stats(x, "weight", fmt=("e4m3", "int8"))
  with pytest.raises(ValueError, match="mixes FP4 with int8"):
    diagnostics.fp8_stats(x, "weight", fmt=("e2m1", "int8"))
  with pytest.raises(ValueError, match="fmt='int8'"):
    diagnostics.fp8_stats(x, "weight", fmt="int4")
  with pytest.raises(ValueError, match="'cast' was not measured"):
    _stats(x, "weight").error("cast")


def _int8_layers():
  rng = np.random.default_rng(1)
  acts = rng.standard_normal((64, 256)).astype(np.float32)
  outliers = acts.copy()
  outliers[:, 7] = 300.0         # an outlier feature in every token
  return {
      "dense_0": {"activation": _stats(acts, "activation"),
                  "weight": _stats(rng.standard_normal((256, 64)), "weight")},
      "dense_1": {"activation": _stats(outliers, "activation"),
                  "weight": _stats(rng.standard_normal((256, 64)), "weight")},
  }


def test_advice_keeps_outlier_layers_in_16_bits():
  stats = _int8_layers()
  advice = diagnostics.advise(stats, by=1)
  assert advice.granularity == {"dense_0": "int8", "dense_1": None}
  assert advice.keep_out == ("dense_1",)
  assert advice.ranking == ("dense_1", "dense_0")
  assert advice.max_error == {"int8": 2**-5}
  assert advice.max_clipped == 0.0 and advice.max_flushed == 0.05
  text = str(advice)
  assert "| layer | int8 recipe |" in text
  assert "keep in the compute dtype" in text
  assert "Keep dense_1 out of int8" in text
  assert "int8_switchback: flushed / error %" in text
  assert "e4m3" not in text
  # Explicit limits apply to int8 too.
  lax_limits = diagnostics.advise(stats, by=1, max_flushed=1.0,
                                      max_error=1.0)
  assert lax_limits.keep_out == ()
  only_switchback = diagnostics.advise(
      stats, by=1, granularities=("int8_switchback",))
  assert only_switchback.granularity["dense_0"] == "int8_switchback"


def test_advice_with_a_given_scale_says_whether_it_fits():
  x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
  fits = _stats(x, "activation", scale=10.0 / 127)
  clips = _stats(x, "activation", scale=1.0 / 127)
  advice = diagnostics.advise({"a": fits, "b": clips})
  assert advice.delayed == {"a": True, "b": False}


def test_advice_errors_for_int8():
  stats = _int8_layers()
  with pytest.raises(ValueError, match="mix int8"):
    diagnostics.advise(
        {"a": stats["dense_0"]["weight"],
         "b": diagnostics.fp8_stats(jnp.ones((4, 16)), "weight")})
  with pytest.raises(ValueError, match="mix FP4"):
    diagnostics.advise(
        {"a": stats["dense_0"]["weight"],
         "b": diagnostics.fp8_stats(jnp.ones((16, 16)), "weight",
                                    fmt="e2m1")})
  with pytest.raises(ValueError, match="unknown int8 recipe 'tensor'"):
    diagnostics.advise(stats, granularities=("int8", "tensor"))
