"""An independent NumPy reference of FP4 quantization, written from the specs.

Nothing here calls jmp_lite. Sources: Transformer Engine's reference NVFP4
quantizer (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py) and
its CUDA kernel's tensor scale (compute_global_encode_scaling_factor_FP4:
amax 0 -> 1), the OCP Microscaling spec (E8M0 scales; the floor rule
``floor(log2 amax) - emax_elem``) and cuBLAS/JAX's round-up rule (the smallest
power of two that fits the block's amax into E2M1), TE's RHT sign vector
(get_wgrad_sign_vector) and the Sylvester Hadamard matrix. The deliberate
differences from TE (documented in docs/fp4.md): non-finite elements are
zeroed for the scales and flagged (NVFP4: a NaN tensor scale; MXFP4: E8M0
code 255), and the RHT is computed by the fast Walsh-Hadamard butterfly in
float32 (the order of its roundings is part of the definition).

The algorithms differ from the library's on purpose: E2M1 rounding searches
the value table, E4M3 rounding is ml_dtypes' cast, MX exponents come from
``ceil(log2(amax / 6))`` in float64, the transform is recursive.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
F32_MAX = np.float32(np.finfo(np.float32).max)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Codes of the positive values: even mantissa (ties go there) = even index.
SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1],
                 np.float32)


def e2m1_nearest_even(x):
  """float32 ``x`` (finite, clipped to [-6, 6] first) to the nearest E2M1
  value, ties to the value with the even code."""
  x = np.clip(np.asarray(x, F32), -6, 6)
  mag = np.abs(x).astype(np.float64)
  dist = np.abs(mag[..., None] - E2M1_VALUES)
  best = dist.min(axis=-1, keepdims=True)
  candidates = np.isclose(dist, best, rtol=0, atol=0)
  even = candidates & (np.arange(8) % 2 == 0)
  index = np.where(even.any(-1), np.argmax(even, -1), np.argmax(candidates, -1))
  return np.copysign(E2M1_VALUES[index], x).astype(F32)


def e2m1_stochastic(x, random_bytes):
  """Stochastic rounding onto E2M1 with 8 random bits: up (away from 0) where
  floor(256 * (|x| - lo) / (hi - lo)) + r >= 256."""
  x = np.clip(np.asarray(x, F32), -6, 6)
  mag = np.abs(x).astype(np.float64)
  lo_index = np.searchsorted(E2M1_VALUES, mag, side="right") - 1
  lo = E2M1_VALUES[lo_index]
  hi = E2M1_VALUES[np.minimum(lo_index + 1, 7)]
  gap = np.where(hi > lo, hi - lo, 1.0)
  fraction = np.floor((mag - lo) / gap * 256).astype(np.int64)
  up = fraction + random_bytes.astype(np.int64) >= 256
  return np.copysign(np.where(up, hi, lo), x).astype(F32)


def e4m3(x):
  """Round to nearest even E4M3 (ml_dtypes' cast), as float32."""
  return np.asarray(x, F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def _round_elements(scaled, random_bytes):
  if random_bytes is None:
    return e2m1_nearest_even(scaled)
  return e2m1_stochastic(scaled, random_bytes)


def nvfp4(x, two_d=False, random_bytes=None):
  """(values, block_scales, tensor_scale), float32, along the last axis."""
  x = np.asarray(x, F32)
  finite = np.isfinite(x)
  x = np.where(finite, x, F32(0))
  amax = F32(np.max(np.abs(x))) if x.size else F32(0)
  with np.errstate(divide="ignore", over="ignore"):
    s_enc = F32(F32(6 * 448) / amax) if amax != 0 else F32(np.inf)
  s_enc = min(s_enc, F32_MAX)
  if amax == 0 or s_enc == 0:
    s_enc = F32(1)
  s_dec = F32(F32(1) / s_enc)
  mag = np.abs(x)
  shape = x.shape
  blocks = mag.reshape(shape[:-1] + (shape[-1] // 16, 16))
  vec_max = blocks.max(-1)
  if two_d:
    p, c = shape[-2], shape[-1]
    tiles = mag.reshape(shape[:-2] + (p // 16, 16, c // 16, 16))
    vec_max = np.repeat(tiles.max(axis=(-3, -1)), 16, axis=-2)
  multiplier = F32(s_enc * F32(F32(1) / F32(6)))
  decode = np.minimum(vec_max * multiplier, F32(448)).astype(F32)
  decode = e4m3(decode)
  with np.errstate(divide="ignore"):
    encode = np.minimum(F32(1) / (decode * s_dec), F32_MAX).astype(F32)
  scaled = (x.reshape(blocks.shape) * encode[..., None]).reshape(shape)
  values = _round_elements(scaled, random_bytes)
  tensor_scale = s_dec if finite.all() else F32(np.nan)
  return values, decode, F32(tensor_scale)


def mx_exponent(amax, rule):
  """The power of two k of an MXFP4 block's scale (amax >= 0, finite)."""
  amax = float(amax)
  if amax < 2.0**-126:  # zero (float32 subnormals do not occur here)
    return -127
  if rule == "round_up":
    k = int(np.ceil(np.log2(amax / 6.0)))
  else:
    k = int(np.floor(np.log2(amax))) - 2
  return int(np.clip(k, -127, 127))


def mxfp4(x, rule="round_up", random_bytes=None):
  """(values float32, codes uint8) along the last axis."""
  x = np.asarray(x, F32)
  finite = np.isfinite(x)
  x = np.where(finite, x, F32(0))
  shape = x.shape
  blocks = x.reshape(shape[:-1] + (shape[-1] // 32, 32))
  amax = np.abs(blocks).max(-1)
  k = np.vectorize(lambda a: mx_exponent(a, rule), otypes=[np.int64])(amax)
  bad = ~finite.reshape(blocks.shape).all(-1)
  codes = np.where(bad, 255, k + 127).astype(np.uint8)
  scaled = (blocks.astype(np.float64) * np.exp2(-k[..., None].astype(
      np.float64))).astype(F32).reshape(shape)
  return _round_elements(scaled, random_bytes), codes


def dequantize_nvfp4(values, block_scales, tensor_scale=None):
  """values * block scale (float32, exact), times the tensor scale if given."""
  shape = values.shape
  full = (values.reshape(shape[:-1] + (shape[-1] // 16, 16)) *
          block_scales[..., None]).reshape(shape).astype(F32)
  return full if tensor_scale is None else (full * tensor_scale).astype(F32)


def dequantize_mxfp4(values, codes):
  shape = values.shape
  scale = np.where(codes == 255, np.nan,
                   np.exp2(codes.astype(np.float64) - 127))
  return (values.reshape(shape[:-1] + (shape[-1] // 32, 32)) *
          scale[..., None]).reshape(shape).astype(F32)


def _wht(v):
  """Sylvester Hadamard H_n @ v along the last axis, recursively, in float32:
  H_2n [a; b] = [H_n (a + b); H_n (a - b)]."""
  n = v.shape[-1]
  if n == 1:
    return v
  a, b = v[..., : n // 2], v[..., n // 2:]
  return np.concatenate([_wht((a + b).astype(F32)), _wht((a - b).astype(F32))],
                        axis=-1)


def rht(x):
  """The 16-point random Hadamard transform along the last axis (float32)."""
  x = np.asarray(x, F32)
  blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 16, 16)) * SIGNS
  return (_wht(blocks.astype(F32)) * F32(0.25)).astype(F32).reshape(x.shape)


def rht_matrix():
  """diag(signs) @ H16 / 4 in float64 (the definition, for tolerance checks)."""
  h = np.array([[1.0]])
  while h.shape[0] < 16:
    h = np.block([[h, h], [h, -h]])
  return np.diag(SIGNS.astype(np.float64)) @ h / 4


def alpha_product(acc, a_scale, b_scale):
  """acc * (a_scale * b_scale) where the product is a normal float32, else
  (acc * a_scale) * b_scale: how the tensor scales reach the result."""
  alpha = F32(F32(a_scale) * F32(b_scale))
  if np.isfinite(alpha) and alpha >= 2.0**-126:
    return (acc * alpha).astype(F32)
  return ((acc * F32(a_scale)).astype(F32) * F32(b_scale)).astype(F32)
