"""An independent NumPy reference for jmp_lite's low-bit optimizer-state codes.

Written from the specs, not from jmp_lite's code:

* bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits, total_bits)``
  (functional.py), followed step by step: for each exponent ``i``, the means of
  consecutive points of ``linspace(0.1, 1, fraction_items)`` times
  ``10 ** (-(max_exponent_bits - 1) + i)``, negated too when signed, then 0
  and 1, sorted. Computed here in exact rational arithmetic and rounded once
  to float32 (bitsandbytes rounds in float32 at every step; the two tables
  agree to a float32 ulp).
* torchao's 4-bit maps (prototype/low_bit_optim/subclass_4bit.py):
  ``create_dynamic_map(True, 3, 4)`` for signed states and
  ``linspace(0, 1, 17)[1:]`` (no zero) for non-negative ones.
* Block quantization (bitsandbytes' blockwise quantization, torchao's
  ``quantize_*bit_with_qmap``), by jmp_lite's documented rule: per block
  along the last axis a scale ``s``, the largest magnitude (for a signed
  moment in 8 or 4 bits, whose maps hold +1 but no -1, with that element's
  sign, the positive one on a tie), written
  ``|s| = m 2**e`` (``1 <= m < 2``); the code of ``x`` is the number of
  thresholds ``t`` (exact midpoints of neighbouring codes rounded down to
  float32) with ``x / (sign(s) 2**e) > float32(t * m)`` (the left side exact,
  0 below ``2**-126``): the nearest code of ``x / s`` up to the rounding of
  ``t * m``, with no division anyone could compute differently. Here:
  ``np.frexp``/``np.ldexp`` in float64 and ``np.searchsorted``.
* e4m3: the same rule over the finite e4m3 values over 448 (``ml_dtypes``'
  table, rounded to float32; -0 left out), stored as the value's e4m3 bits.
* jmp_lite's documented rules: subnormals count as zero (in decoded values
  too), a non-finite block
  has a NaN scale and codes 0, a block of zeros has scale 0, non-negative
  moments never take the code 0.0 (the smallest positive code instead), the
  last block is zero-padded, each block stored as its codes then the
  little-endian bytes of its float32 scale, 4-bit codes two per byte with the
  even element in the low nibble, e4m3 bits as int8.
* Rank-1 normalisation (lpmm, Li, Chen, Zhu, NeurIPS 2023,
  ``lpmm/functional.py``'s ``rank1`` normalisation): for a non-negative 2-D
  moment, element ``(i, j)``'s scale is ``min(max of row i, max of column
  j)`` (0 if that is negative); the code: the rule above for torchao's
  zero-free linear 4-bit values under that scale. jmp_lite's documented layout and rules: a NaN/inf makes its
  row's and column's maxes NaN (codes 0 there, every element of that row and
  column decodes to NaN); per row its codes (two per byte, padded to even
  length), its row max's bytes, then the bytes of the column maxes
  ``c i ... c (i + 1) - 1`` with ``c = ceil(n / rows)``, zero-padded.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np


def _linspace(start: Fraction, stop: Fraction, num: int) -> list[Fraction]:
  return [start + (stop - start) * k / (num - 1) for k in range(num)]


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
  """bitsandbytes' construction, exact, rounded once to float32."""
  data = []
  non_sign_bits = total_bits - 1
  additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
  assert additional_items == 0  # True for the maps used here.
  for i in range(max_exponent_bits):
    fraction_items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1
                      if signed else
                      2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
    boundaries = _linspace(Fraction(1, 10), Fraction(1), fraction_items)
    means = [(a + b) / 2 for a, b in zip(boundaries[:-1], boundaries[1:])]
    scale = Fraction(10) ** (-(max_exponent_bits - 1) + i)
    data += [scale * m for m in means]
    if signed:
      data += [-scale * m for m in means]
  data.append(Fraction(0))
  data.append(Fraction(1))
  assert len(data) == 2**total_bits
  data.sort()
  return np.array([_to_f32(q) for q in data], np.float32)


def _to_f32(q: Fraction) -> np.float32:
  """Exact rational -> nearest float32, ties to even (no double rounding)."""
  f = np.float32(float(q))
  candidates = [np.nextafter(f, np.float32(-np.inf)), f,
                np.nextafter(f, np.float32(np.inf))]
  best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - q),
                                        int(c.view(np.uint32)) & 1))
  return np.float32(best)


QMAP_8_SIGNED = create_dynamic_map(True, 7, 8)
QMAP_8_UNSIGNED = create_dynamic_map(False, 7, 8)
QMAP_4_SIGNED = create_dynamic_map(True, 3, 4)
QMAP_4_UNSIGNED = np.array([_to_f32(Fraction(k, 16)) for k in range(1, 17)],
                           np.float32)

BLOCK = {"e4m3": 256, "8bit": 256, "4bit": 128}


def _e4m3_values():
  """``(values / 448 as float32, sorted; their e4m3 bits)``, finite, no -0."""
  bits = np.arange(256, dtype=np.uint8)
  over = (bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
          / np.float32(448)).astype(np.float32)
  keep = np.isfinite(over) & (bits != 0x80)
  order = np.argsort(over[keep], kind="stable")
  return over[keep][order], bits[keep][order]


E4M3_VALUES, E4M3_BITS = _e4m3_values()


def effective_block(fmt: str, n: int) -> int:
  """The documented rule: the format's block, or for a shorter row the
  smallest power of two >= n, at least 32."""
  block = 32
  while block < n:
    block *= 2
  return min(BLOCK[fmt], block)


def qmap(fmt: str, non_negative: bool) -> np.ndarray:
  if fmt == "e4m3":
    return E4M3_VALUES
  if fmt == "8bit":
    return QMAP_8_UNSIGNED if non_negative else QMAP_8_SIGNED
  return QMAP_4_UNSIGNED if non_negative else QMAP_4_SIGNED


def thresholds(table: np.ndarray) -> np.ndarray:
  """Exact midpoints of neighbouring codes, rounded down to float32."""
  out = []
  for a, b in zip(table[:-1], table[1:]):
    mid = (Fraction(float(a)) + Fraction(float(b))) / 2
    t = np.float32(float(mid))
    if Fraction(float(t)) > mid:
      t = np.nextafter(t, np.float32(-np.inf))
    out.append(t)
  return np.array(out, np.float32)


def codes_of(x: np.ndarray, scale, table: np.ndarray,
             non_negative: bool) -> np.ndarray:
  """Sorted-table indices of float32 ``x`` under one float32 ``scale`` (the
  documented threshold rule); ``scale`` 0 gives the code of 0."""
  scale = np.float32(scale)
  if scale == 0:
    m, e, sign = np.float32(1), 0, 1.0
  else:
    frac, exp = np.frexp(np.float64(abs(scale)))  # |s| = frac 2**exp
    m, e = np.float32(frac * 2), int(exp) - 1
    sign = -1.0 if scale < 0 else 1.0
  y = np.ldexp(np.asarray(x, np.float64), -e) * sign  # exact
  y = np.where(np.abs(y) < 2.0**-126, 0.0, y)
  limits = (thresholds(table) * m).astype(np.float32).astype(np.float64)
  index = np.searchsorted(limits, y, side="left")  # how many t*m < y
  if non_negative:
    first = int(np.argmax(table > 0))
    index = np.maximum(index, first)
  return index


def quantize(x: np.ndarray, fmt: str, non_negative: bool, block=None):
  """``(codes (*lead, nb, block), scales (*lead, nb))`` of a float32 moment."""
  x = np.asarray(x, np.float32)
  block = block or effective_block(fmt, x.shape[-1])
  x = np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0), x)
  *lead, n = x.shape
  nb = -(-n // block)
  padded = np.zeros((*lead, nb * block), np.float32)
  padded[..., :n] = x
  blocks = padded.reshape(*lead, nb, block)
  codes = np.zeros(blocks.shape, np.uint8 if fmt != "e4m3" else np.int8)
  scales = np.zeros(blocks.shape[:-1], np.float32)
  table = qmap(fmt, non_negative)
  if fmt == "e4m3" and non_negative:
    table = table[table >= 0]
  for index in np.ndindex(*blocks.shape[:-1]):
    b = blocks[index]
    if not np.all(np.isfinite(b)):
      scales[index] = np.nan
      continue  # codes 0
    k = int(np.argmax(np.abs(b)))  # the first of the largest magnitudes
    ties = np.flatnonzero(np.abs(b) == np.abs(b[k]))
    absolute = non_negative or fmt == "e4m3"  # e4m3's grid holds -1
    scale = np.float32(np.abs(b[k]) if absolute else max(b[ties]))
    scales[index] = scale
    found = codes_of(b, scale, table, non_negative)
    if fmt == "e4m3":
      bits = E4M3_BITS if not non_negative else E4M3_BITS[qmap(fmt, False) >= 0]
      codes[index] = bits[found].view(np.int8)
    else:
      codes[index] = found
  return codes, scales


def pack(codes: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
  """Each block: its code bytes, then its scale's 4 little-endian bytes."""
  codes = np.asarray(codes)
  if fmt == "4bit":
    c = codes.astype(np.uint8)
    codes = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
  scale_bytes = np.ascontiguousarray(
      scales.astype("<f4")).view(np.uint8).reshape(*scales.shape, 4)
  if fmt == "e4m3":
    scale_bytes = scale_bytes.view(np.int8)
  out = np.concatenate([codes, scale_bytes], axis=-1)
  return out.reshape(*out.shape[:-2], -1)


def encode(x: np.ndarray, fmt: str, non_negative: bool) -> np.ndarray:
  return pack(*quantize(x, fmt, non_negative), fmt)


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: str,
               non_negative: bool, n: int) -> np.ndarray:
  """float32 values (``(*lead, n)``), computed as jmp_lite documents:
  ``table[code] * scale``, for e4m3 ``(value / 448) * scale``; results
  below ``2**-126`` are 0."""
  if fmt == "e4m3":
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v = (v / np.float32(448.0)).astype(np.float32)
  else:
    v = qmap(fmt, non_negative)[codes.astype(np.int64)]
  with np.errstate(invalid="ignore", over="ignore"):
    out = (v * scales[..., None]).astype(np.float32)
    out = np.where(np.abs(out) < 2.0**-126, np.float32(0), out)
  return out.reshape(*out.shape[:-2], -1)[..., :n]


def rank1_quantize(x: np.ndarray):
  """``(codes (rows, n), row maxes, column maxes)`` of a non-negative 2-D
  moment, one element at a time."""
  x = np.asarray(x, np.float32)
  x = np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0), x)
  rows, n = x.shape
  row_max = np.array([np.max(r) if np.all(np.isfinite(r)) else np.nan
                      for r in x], np.float32)
  col_max = np.array([np.max(c) if np.all(np.isfinite(c)) else np.nan
                      for c in x.T], np.float32)
  codes = np.zeros((rows, n), np.uint8)
  for i in range(rows):
    for j in range(n):
      if np.isnan(row_max[i]) or np.isnan(col_max[j]):
        continue  # code 0
      scale = max(np.float32(min(row_max[i], col_max[j])), np.float32(0))
      codes[i, j] = codes_of(x[i, j:j + 1], scale, QMAP_4_UNSIGNED, True)[0]
  return codes, row_max, col_max


def rank1_encode(x: np.ndarray) -> np.ndarray:
  codes, row_max, col_max = rank1_quantize(x)
  rows, n = codes.shape
  if n % 2:
    codes = np.concatenate([codes, np.zeros((rows, 1), np.uint8)], axis=1)
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  per_row = -(-n // rows)
  cols = np.zeros(per_row * rows, np.float32)
  cols[:n] = col_max
  as_bytes = lambda v: np.ascontiguousarray(v.astype("<f4")).view(np.uint8)
  return np.concatenate([
      packed, as_bytes(row_max).reshape(rows, 4),
      as_bytes(cols).reshape(rows, 4 * per_row)], axis=1)


def rank1_dequantize(codes, row_max, col_max) -> np.ndarray:
  """``value[code] * min(row max, column max)`` (NaN if either is NaN)."""
  scale = np.minimum(row_max[:, None], col_max[None, :])  # NaN propagates
  with np.errstate(invalid="ignore", over="ignore"):
    out = (QMAP_4_UNSIGNED[codes.astype(np.int64)] * scale).astype(
        np.float32)
  return np.where(np.abs(out) < 2.0**-126, np.float32(0), out)
