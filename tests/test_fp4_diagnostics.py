"""FP4 diagnostics: diagnostics.fp8_stats(..., fmt="e2m1") measures what
NVFP4 and MXFP4 do to each role's values (against the independent NumPy
reference in tests/fp4_reference.py), and advise turns FP4 statistics
into a keep-list and a ranking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4_reference as ref
from jmp_lite import diagnostics

from helpers import JIT
from helpers import maybe_jit


def _random(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _row_errors(x, deq):
  x, deq = np.asarray(x, np.float64), np.asarray(deq, np.float64)
  return np.linalg.norm(x - deq, axis=1) / np.linalg.norm(x, axis=1)


def _stats(x, role):
  return diagnostics.fp8_stats(jnp.asarray(x), role, fmt="e2m1")


@JIT
def test_activation_error_matches_the_reference_quantizers(jit):
  x = _random((32, 64))
  measure = maybe_jit(_stats, jit, static_argnums=1)
  s = measure(x, "activation")
  assert s.formats == ("e2m1",) and s.recipes == ("nvfp4", "mxfp4")
  values, scales, tensor_scale = ref.nvfp4(x)
  nv = _row_errors(x, ref.dequantize_nvfp4(values, scales, tensor_scale))
  values, codes = ref.mxfp4(x)
  mx = _row_errors(x, ref.dequantize_mxfp4(values, codes))
  np.testing.assert_allclose(s.error("nvfp4"), nv.mean(), rtol=1e-4)
  np.testing.assert_allclose(s.error("mxfp4"), mx.mean(), rtol=1e-4)
  np.testing.assert_allclose(s.error("nvfp4", worst=True), nv.max(),
                             rtol=1e-4)
  # Flushed: nonzero entries that quantize to zero, as the reference says.
  assert s.fraction("flushed", "mxfp4") == pytest.approx(
      np.mean((values == 0) & (x != 0)))
  # SNR in dB is the error's.
  assert s.snr("nvfp4") == pytest.approx(-20 * np.log10(nv.mean()), rel=1e-4)
  assert 18 < s.snr("nvfp4") < 23 and 16 < s.snr("mxfp4") < s.snr("nvfp4")


def test_weights_are_measured_in_16x16_tiles_and_padded():
  # A Dense kernel (in=40, out=24): contracting over `in`, rows are `out`;
  # neither is a multiple of 16: zero-padded as fp4.dot_general pads.
  w = _random((40, 24), 1)
  s = _stats(w, "weight")
  rows = np.zeros((32, 48), np.float32)
  rows[:24, :40] = w.T
  values, scales, tensor_scale = ref.nvfp4(rows, two_d=True)
  deq = ref.dequantize_nvfp4(values, scales, tensor_scale)[:24, :40]
  np.testing.assert_allclose(s.error("nvfp4"), _row_errors(w.T, deq).mean(),
                             rtol=1e-4)
  one_d = _stats(w.T, "activation")   # the same rows quantized 1x16
  assert s.error("nvfp4") != pytest.approx(one_d.error("nvfp4"))


def test_gradients_are_rounded_stochastically():
  g = _random((32, 64), 2)
  gradient, activation = _stats(g, "gradient"), _stats(g, "activation")
  # Stochastic rounding is unbiased but noisier than round-to-nearest.
  assert gradient.error("nvfp4") > 1.2 * activation.error("nvfp4")
  assert gradient.error("mxfp4") > 1.2 * activation.error("mxfp4")
  # Deterministic: the key is derived from the values.
  assert _stats(g, "gradient").error("nvfp4") == gradient.error("nvfp4")


def test_nvfp4_clipping_from_a_rounded_down_block_scale_is_counted():
  # Rows of ones under a tensor amax of 1e4: each block of ones gets the
  # E4M3 scale 0.0448 rounded down to 0.04297, so its ones scale to 6.26
  # and are clipped to 6 (as Transformer Engine's reference does).
  x = np.ones((16, 64), np.float32)
  x[0, 0] = 1e4
  s = _stats(x, "activation")
  assert s.fraction("clipped", "nvfp4") > 0.9
  assert s.fraction("clipped", "mxfp4") == 0.0   # round-up E8M0 scales
  zeros = _stats(np.zeros((16, 16), np.float32), "weight")
  assert zeros.error("nvfp4") == 0.0 and zeros.snr("mxfp4") == float("inf")


def test_fp4_format_errors():
  x = jnp.ones((16, 16))
  with pytest.raises(ValueError, match="mixes FP4 with float8"):
    diagnostics.fp8_stats(x, "weight", fmt=("e4m3", "e2m1"))
  with pytest.raises(ValueError, match="FP4 has no delayed scaling"):
    diagnostics.fp8_stats(x, "weight", fmt="e2m1", scale=1.0)
  with pytest.raises(ValueError, match="fmt='e2m1'"):
    diagnostics.fp8_stats(x, "weight", fmt="e3m0")
  s = diagnostics.fp8_stats(x, "weight", fmt=jnp.float4_e2m1fn)
  assert s.formats == ("e2m1",)
  with pytest.raises(ValueError, match="'cast' was not measured"):
    s.error("cast")


def _fp4_layers():
  keys = jax.random.split(jax.random.key(0), 3)
  return {
      "normal": _stats(jax.random.normal(keys[0], (64, 64)), "weight"),
      # Cauchy weights: the per-tensor scale of the outliers pushes the
      # other blocks' E4M3 scales into their subnormals; MXFP4's
      # power-of-two scales have the range.
      "heavy_tailed": _stats(jax.random.t(keys[1], 1.0, (64, 64)), "weight"),
      "gaussian_acts": _stats(jax.random.normal(keys[2], (64, 64)),
                              "activation"),
  }


def test_advice_keeps_layers_in_bf16_by_measurement_and_ranks_them():
  stats = _fp4_layers()
  advice = diagnostics.advise(stats)
  assert advice.granularity == {"normal": "nvfp4", "heavy_tailed": "mxfp4",
                                "gaussian_acts": "nvfp4"}
  assert advice.ranking[0] == "heavy_tailed"
  assert advice.max_error == {"e2m1": 0.25}
  assert advice.max_clipped == 1.0 and advice.max_flushed == 1.0
  only_nvfp4 = diagnostics.advise(stats, granularities=("nvfp4",))
  assert only_nvfp4.keep_out == ("heavy_tailed",)
  text = str(only_nvfp4)
  assert "| layer | FP4 recipe |" in text
  assert "keep in the compute dtype" in text
  assert "Keep heavy_tailed out of FP4" in text
  assert "e4m3" not in text and "Largest error first: heavy_tailed" in text
  # Explicit limits apply to FP4 too.
  strict = diagnostics.advise(stats, max_error=0.05)
  assert set(strict.keep_out) == set(stats)


def test_float8_advice_keeps_its_defaults_and_gets_a_ranking():
  x = jnp.ones((4, 64)).at[0].set(1e6)
  advice = diagnostics.advise(
      {"dense": diagnostics.fp8_stats(x, "activation"),
       "flat": diagnostics.fp8_stats(jnp.ones((4, 64)), "activation")})
  assert advice.granularity == {"dense": "row", "flat": "tensor"}
  assert advice.max_clipped == 0.0 and advice.max_flushed == 0.01
  assert advice.ranking == ("dense", "flat")


def test_advice_errors_for_fp4():
  stats = _fp4_layers()
  with pytest.raises(ValueError, match="mix FP4"):
    diagnostics.advise(
        {"a": stats["normal"],
         "b": diagnostics.fp8_stats(jnp.ones((4, 16)), "weight")})
  with pytest.raises(ValueError, match="unknown FP4 recipe 'tensor'"):
    diagnostics.advise(stats, granularities=("nvfp4", "tensor"))
  with pytest.raises(ValueError, match="each once"):
    diagnostics.advise(stats, granularities=("mxfp4", "mxfp4"))
