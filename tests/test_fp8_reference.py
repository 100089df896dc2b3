"""Independent numpy references for the float8 tests, and tests of them.

Nothing here uses jmp_lite or XLA's float8 conversions: the float8 value
table comes from the bit patterns (ml_dtypes' view of the 256 codes), rounding
is a brute-force nearest-value search with ties to the even code, and scales
are computed in float64 from their definitions. The other ``test_fp8_*``
files import these functions; the tests below pin the references to values
known from the OCP FP8 / MX specifications, so a wrong reference fails here.
"""

import math

import ml_dtypes
import numpy as np
import pytest

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, E4M3_MAX),
    "e5m2": (ml_dtypes.float8_e5m2, E5M2_MAX),
}


def _finite_table(dtype):
  """(codes, values) of the non-negative finite float8 values, ascending."""
  codes = np.arange(128, dtype=np.uint8)  # sign bit clear
  values = codes.view(dtype).astype(np.float64)
  keep = np.isfinite(values)
  return codes[keep], values[keep]


def round_codes(y, fmt):
  """The float8 codes (uint8) of float64 ``y`` clipped to ±max, rounded to
  nearest with ties to the even code. NaN gives 0xFF (a NaN in both formats:
  compare NaNs with ``isnan``)."""
  dtype, fmax = FORMATS[fmt]
  codes, values = _finite_table(dtype)
  y = np.asarray(y, np.float64)
  a = np.minimum(np.abs(y), fmax)
  hi = np.clip(np.searchsorted(values, a), 0, len(values) - 1)
  lo = np.clip(hi - 1, 0, len(values) - 1)
  d_lo, d_hi = a - values[lo], values[hi] - a
  even_hi = (codes[hi] % 2) == 0
  pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
  out = np.where(pick_hi, codes[hi], codes[lo]).astype(np.uint8)
  out = out | (np.signbit(y).astype(np.uint8) << 7)
  return np.where(np.isnan(y), np.uint8(0xFF), out).astype(np.uint8)


def codes_to_float(codes, fmt):
  return np.asarray(codes, np.uint8).view(FORMATS[fmt][0]).astype(np.float64)


def ceil_pow2_exponent(v):
  """The smallest integer k with 2**k >= v, for positive finite float64 v."""
  m, e = np.frexp(np.asarray(v, np.float64))
  return np.where(m == 0.5, e - 1, e).astype(np.int64)


def e8m0_code(v):
  """E8M0 code of float32 ``v`` >= 0 rounded up (OCP MX / cuDNN)."""
  v = np.asarray(v, np.float64)
  k = ceil_pow2_exponent(np.where(v > 0, v, 1.0))
  code = np.clip(k + 127, 0, 254)
  code = np.where(v <= 2.0**-127, 0, code)
  return np.where(~np.isfinite(v), 255, code).astype(np.uint8)


def current_scale(amax, fmax, power_of_two=True):
  """jmp_lite's documented current-scaling rule, in float64/float32."""
  amax = np.asarray(amax, np.float32)
  s = (amax / np.float32(fmax)).astype(np.float32)
  s = np.maximum(s, np.float32(2.0**-126))
  s = np.where(amax == 0, np.float32(1.0), s)
  if power_of_two:
    s = np.where(np.isfinite(s),
                 2.0 ** ceil_pow2_exponent(np.where(np.isfinite(s), s, 1.0)),
                 s)
  return s.astype(np.float32)


def quantize_blocks_ref(x, fmt, block_shape, power_of_two=True, scale=None):
  """(codes, per-block scale, per-block amax) of blockwise current scaling,
  by looping over blocks."""
  _, fmax = FORMATS[fmt]
  x = np.asarray(x, np.float32)
  nblocks = tuple(-(-n // b) for n, b in zip(x.shape, block_shape))
  amax = np.zeros(nblocks, np.float32)
  for idx in np.ndindex(*nblocks):
    sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block_shape))
    amax[idx] = np.max(np.abs(x[sl]))
  s = current_scale(amax, fmax, power_of_two) if scale is None else (
      np.broadcast_to(np.asarray(scale, np.float32), nblocks))
  full = s
  for axis, b in enumerate(block_shape):
    full = np.repeat(full, b, axis=axis)
  full = full[tuple(slice(0, n) for n in x.shape)]
  y = x.astype(np.float64) / full.astype(np.float64)
  codes = round_codes(y, fmt)
  codes = np.where(np.isinf(x), np.uint8(0xFF), codes)
  return codes, s, amax


def quantize_mx_ref(x, fmt):
  """(codes, E8M0 codes) of MX quantization along the last axis (multiple of
  32): per block ``k = ceil(log2(amax / max))`` with the quotient rounded in
  the input's dtype, as JAX does (where that quotient underflows to zero for
  a nonzero block, the float32 quotient and at least code 1, as documented);
  values ``round(clip(x / 2**k))``."""
  _, fmax = FORMATS[fmt]
  x = np.asarray(x)
  *lead, n = x.shape
  blocks = x.reshape(*lead, n // 32, 32)
  amax = np.max(np.abs(blocks), axis=-1)
  ratio = (amax / x.dtype.type(fmax)).astype(np.float32)
  amax32 = amax.astype(np.float32)
  underflow = (ratio == 0) & (amax32 > 0)
  fallback = np.maximum(e8m0_code(amax32 / np.float32(fmax)), 1)
  scale_codes = np.where(underflow, fallback, e8m0_code(ratio)).astype(
      np.uint8)
  scale = 2.0 ** (scale_codes.astype(np.float64) - 127)
  y = blocks.astype(np.float64) / scale[..., None]
  return round_codes(y, fmt).reshape(x.shape), scale_codes


# ---------------------------------------------------------------------------
# The references against values fixed by the specifications.
# ---------------------------------------------------------------------------


def test_round_codes_known_values():
  # e4m3fn: 448 = 0x7E (S.1111.110), 0x7F is NaN; the smallest subnormal is
  # 2**-9 = 0x01; 1.0 = 0x38. e5m2: 57344 = 0x7B, 1.0 = 0x3C, 2**-16 = 0x01.
  y = [448.0, 1.0, 2.0**-9, -1.0, 0.0, -0.0, 1e9, np.nan]
  assert list(round_codes(y, "e4m3")) == [0x7E, 0x38, 0x01, 0xB8, 0x00, 0x80,
                                          0x7E, 0xFF]
  assert list(round_codes([57344.0, 1.0, 2.0**-16, 1e9], "e5m2")) == [
      0x7B, 0x3C, 0x01, 0x7B]
  # Ties go to the even code: 1 + 1/16 lies halfway between 1 (0x38) and
  # 1.125 (0x39); 1 + 3/16 between 1.125 and 1.25 (0x3A).
  assert list(round_codes([1 + 1 / 16, 1 + 3 / 16], "e4m3")) == [0x38, 0x3A]
  # 464 is halfway between 448 and the NaN slot: clipped first, so 448.
  assert round_codes([464.0, 465.0], "e4m3").tolist() == [0x7E, 0x7E]


def test_e8m0_reference_known_values():
  assert e8m0_code([1.0, 1.5, 2.0, 0.3, 0.0]).tolist() == [127, 128, 128,
                                                           126, 0]
  assert e8m0_code([2.0**-127, 2.0**-126.5, 2.0**127, np.inf,
                    np.nan]).tolist() == [0, 1, 254, 255, 255]


def test_current_scale_reference():
  np.testing.assert_array_equal(
      current_scale([448.0, 449.0, 0.0, 1.0], E4M3_MAX),
      [1.0, 2.0, 1.0, 2.0**-8])
  assert current_scale([300.0], E4M3_MAX, power_of_two=False)[0] == (
      np.float32(300.0) / np.float32(448.0))


def test_mx_reference_against_hand_computation():
  x = np.zeros((1, 32), np.float32)
  x[0, :3] = [1000.0, 1.0, -3.0]
  codes, scale = quantize_mx_ref(x, "e4m3")
  # amax / 448 = 2.23 -> 4 (code 129); 1000 / 4 = 250 -> 256; 1/4; -3/4.
  assert scale.tolist() == [[129]]
  np.testing.assert_array_equal(codes_to_float(codes[0, :3], "e4m3"),
                                [256.0, 0.25, -0.75])
  assert math.isclose(2.0 ** (129 - 127), 4.0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_table_round_trips(fmt):
  codes, values = _finite_table(FORMATS[fmt][0])
  np.testing.assert_array_equal(round_codes(values, fmt), codes)
