"""Low-bit storage of optimizer moments: code books and block quantizers.

What :func:`jmp_lite.with_state_dtype` stores an optimizer moment in, one
leaf at a time, and how the leaf is turned back into float32. Formats
(:data:`FORMAT_NAMES`):

* ``"float32"``: the moment itself.
* ``"bfloat16"``: the moment rounded to nearest even; ``"bfloat16_sr"``:
  rounded stochastically (unbiased), from random bits the caller passes.
* ``"e4m3"``: float8 e4m3 values under a float32 absmax scale per block of
  256 (the nearest e4m3 value of ``x / absmax * 448``, by the rule below).
* ``"8bit"``: bitsandbytes' dynamic-exponent code (Dettmers et al., arXiv
  2110.02861), blocks of 256, nearest code: the signed map for moments that
  can be negative, the unsigned map for non-negative ones.
* ``"4bit"``: blocks of 128, two codes per byte: the signed dynamic-exponent
  map with 3 exponent bits (lpmm, torchao) for signed moments, the linear map
  ``{1/16, ..., 16/16}`` without zero (torchao's, lpmm's) for non-negative
  ones.
* ``"4bit_rank1"``: non-negative moments only. A 2-D leaf ``(rows, n)`` gets
  lpmm's rank-1 normalisation (Li, Chen, Zhu, NeurIPS 2023): element
  ``(i, j)``'s scale is ``min(row_max[i], column_max[j])``, its code the
  zero-free linear 4-bit code of ``x / scale``. Other leaves use ``"4bit"``.

Layout (one array per moment, the params' leading axes untouched). Blocks
run along the LAST axis of a leaf of shape ``(*lead, n)`` (a row shorter
than the format's block uses the next power of two >= n, at least 32, as its
block: :func:`block_for`); the last axis is
padded with zeros to ``nb * block`` (``nb = ceil(n / block)``; zeros change no
block's absmax) and each block is stored as its code bytes followed by the
4 bytes of its float32 absmax (little-endian bits), so the stored leaf is
``(*lead, nb * (block + 4))`` for 8-bit codes, ``(*lead, nb * (block / 2 + 4))``
for 4-bit codes. 8-bit and 4-bit codes are ``uint8``; e4m3 codes are the
float8 bits as ``int8``, so no format's leaf can be read as another's. An
FSDP sharding of the leading axes never splits a block, and every operation
is elementwise or a max within a block: results do not depend on the
number of devices.

Rank-1 layout: a ``(rows, n)`` leaf is stored as ``(rows, ceil(n / 2) + 4 +
4 * c)`` bytes, ``c = ceil(n / rows)``: each row holds its codes (two per
byte, the last axis zero-padded to even length), its row max's 4 bytes, then
the 4 bytes of each of the column maxes ``c * i ... c * (i + 1) - 1`` (the
column maxes, zero-padded to ``c * rows``, spread over the rows). Sharding
the rows keeps each row's bytes together; encoding takes a max over the rows
(an all-reduce of ``n`` floats under FSDP) and decoding gathers the ``n``
column maxes, both exact, so the stored bytes and the decoded moments do
not depend on the number of devices. (What the inner optimizer computes
from them is XLA's: under FSDP the column maxes reach a device through a
collective, so its fused update loop differs from one device's, and XLA:CPU
at backend optimization level 0 may contract a multiply-add into an FMA in
one of the programs only; see docs/precision.md.) A NaN or inf makes its
row's and its column's maxes NaN, and every element of that row and column
decodes to NaN.

Rules every block format follows (rank-1 leaves too, with each element's
scale) (the spec :mod:`tests.state_codes_reference`
re-implements):

* Subnormal moments (``|x| < 2**-126``) count as zero, on every backend (XLA
  on CPU flushes them anyway).
* The scale ``s`` is the block's largest magnitude; for signed 8-bit and
  4-bit moments it carries that element's sign (the positive one on a tie):
  their maps hold +1 but no -1, so the extreme element takes code 1 and
  decodes to exactly itself, and decode -> encode gives back the same bytes.
  A block holding NaN or inf gets a NaN scale and code 0 everywhere, so it
  decodes to NaN: a non-finite moment stays visible, never becomes a finite
  code. A block of zeros gets scale 0 and decodes to zeros.
* With ``|s| = m * 2**e`` (``1 <= m < 2``), the code of ``x`` is the number
  of thresholds ``t`` (the sorted code book's midpoints of neighbouring
  codes, rounded down to float32; for e4m3 the book is e4m3's finite values
  over 448) with ``x / (+-2**e) > float32(t * m)``: the left side exact (two
  multiplications by powers of two; below ``2**-126`` it is 0), the right
  side one rounded product. No division or reciprocal, which XLA rewrites
  (``x / s`` into ``x * (1 / s)``, a flushed subnormal for ``s >= 2**126``):
  the same codes on every backend. It is the nearest code of ``x / s``, ties
  to the lower one, up to the rounding of ``t * m``.
* Decoding is ``value[code] * s``; results below ``2**-126`` are 0.
* Non-negative moments never decode to 0 unless their whole block is 0:
  their code books' zero is unreachable (a second moment quantized to zero
  makes ``1 / sqrt(v)`` explode, lpmm's "zero-point problem"). Values below
  the smallest code, negative ones included, take the smallest code.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import compat
from jmp_lite._src import dtypes

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)
_E4M3 = np.dtype(jnp.float8_e4m3fn)
_U8 = np.dtype(np.uint8)
_I8 = np.dtype(np.int8)
_SCALE_BYTES = 4
#: Below this magnitude a moment counts as zero (float32's smallest normal).
_TINY = 2.0**-126
_E4M3_MAX = 448.0
# e4m3 value / 448 for each of the 256 bit patterns (NaN for 0x7F, 0xFF).
_E4M3_OVER_MAX = (np.arange(256, dtype=np.uint8).view(_E4M3).astype(_F32)
                  / _F32.type(_E4M3_MAX)).astype(_F32)


# -- code books ----------------------------------------------------------------


def dynamic_map_values(signed: bool, max_exponent_bits: int,
                       total_bits: int) -> list[Fraction]:
  """bitsandbytes' dynamic-exponent map, as exact fractions (sorted).

  For exponent ``i`` in ``0 .. max_exponent_bits - 1`` the map holds the
  midpoints of ``k`` equal steps from 0.1 to 1, times ``10**(i - (e - 1))``
  (``k = 2**(i + b - e)``, doubled for the unsigned map, ``b`` the bits after
  the sign), their negatives for the signed map, then 0 and 1.
  """
  e, b = max_exponent_bits, total_bits - 1
  values = [Fraction(0), Fraction(1)]
  for i in range(e):
    steps = 2 ** (i + b - e) * (1 if signed else 2)
    power = Fraction(10) ** (i - (e - 1))
    for j in range(steps):
      mid = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * j + 1, 2 * steps)
      values.append(power * mid)
      if signed:
        values.append(-power * mid)
  # bitsandbytes' 2**(b - e) - 1 extra linear items: none in jmp_lite's maps,
  # which all have max_exponent_bits == total_bits - 1.
  return sorted(values)


def _round_down_f32(q: Fraction) -> np.float32:
  """The largest float32 that is <= ``q``."""
  f = np.float32(float(q))
  if Fraction(float(f)) > q:
    f = np.nextafter(f, np.float32(-np.inf))
  return f


def _nearest_f32(q: Fraction) -> np.float32:
  """``q`` rounded to the nearest float32 (ties to even), from exact values."""
  lo = _round_down_f32(q)
  if Fraction(float(lo)) == q:
    return lo
  hi = np.nextafter(lo, np.float32(np.inf))
  d_lo, d_hi = q - Fraction(float(lo)), Fraction(float(hi)) - q
  if d_lo != d_hi:
    return lo if d_lo < d_hi else hi
  return lo if int(lo.view(np.uint32)) % 2 == 0 else hi


@dataclasses.dataclass(frozen=True, eq=False)
class CodeBook:
  """A sorted table of float32 code values and the thresholds between them.

  Attributes:
    name: what the docs call it.
    values: the float32 values, sorted ascending (index = code).
    thresholds: ``thresholds[k]``, between codes ``k`` and ``k + 1``: their
      exact midpoint rounded down to float32.
    first: the lowest code a value may take: 0, or, for a non-negative book
      whose code 0 is 0.0, the first positive code (zero is unreachable).
  """

  name: str
  values: np.ndarray
  thresholds: np.ndarray
  first: int

  @property
  def bits(self) -> int:
    return int(np.log2(len(self.values)))


def _code_book(name: str, exact: list[Fraction], zero_free: bool) -> CodeBook:
  values = np.array([_nearest_f32(q) for q in exact], _F32)
  thresholds = np.array([
      _round_down_f32((Fraction(float(a)) + Fraction(float(b))) / 2)
      for a, b in zip(values[:-1], values[1:])], _F32)
  first = int(np.argmax(values > 0)) if zero_free else 0
  return CodeBook(name, values, thresholds, first)


DYNAMIC8_SIGNED = _code_book(
    "8-bit dynamic, signed", dynamic_map_values(True, 7, 8), False)
DYNAMIC8_UNSIGNED = _code_book(
    "8-bit dynamic, unsigned, zero unreachable",
    dynamic_map_values(False, 7, 8), True)
DYNAMIC4_SIGNED = _code_book(
    "4-bit dynamic, signed", dynamic_map_values(True, 3, 4), False)
LINEAR4_UNSIGNED = _code_book(
    "4-bit linear without zero", [Fraction(k, 16) for k in range(1, 17)],
    True)


def _e4m3_book(zero_free: bool) -> tuple[CodeBook, np.ndarray]:
  """e4m3's finite values over 448 (rounded to float32, as decoding reads
  them), sorted, one per value (-0 left out), and each one's e4m3 bits."""
  bits = [b for b in range(256) if np.isfinite(_E4M3_OVER_MAX[b]) and b != 0x80]
  bits.sort(key=lambda b: float(_E4M3_OVER_MAX[b]))
  exact = [Fraction(float(_E4M3_OVER_MAX[b])) for b in bits]
  return (_code_book("e4m3 / 448" + (", zero unreachable" if zero_free
                                      else ""), exact, zero_free),
          np.array(bits, np.uint8))


E4M3_SIGNED, _E4M3_SIGNED_BITS = _e4m3_book(False)
E4M3_UNSIGNED, _E4M3_UNSIGNED_BITS = _e4m3_book(True)


# -- formats -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateFormat:
  """How one optimizer moment is stored.

  Attributes:
    name: the canonical name (one of :data:`FORMAT_NAMES`).
    kind: ``"float"`` (a plain dtype), ``"e4m3"``, ``"code"`` (a code book)
      or ``"rank1"`` (the linear 4-bit code under rank-1 scales).
    dtype: the float dtype of a ``"float"`` format.
    bits: code bits of a block format (8 or 4).
    block_size: elements per block of a block format.
    stochastic: ``"bfloat16_sr"``: stochastic rounding.
  """

  name: str
  kind: str
  dtype: np.dtype | None = None
  bits: int = 0
  block_size: int = 0
  stochastic: bool = False

  @property
  def blocked(self) -> bool:
    return self.kind != "float"

  def book(self, non_negative: bool) -> CodeBook:
    if self.kind == "e4m3":
      return E4M3_UNSIGNED if non_negative else E4M3_SIGNED
    if self.bits == 8:
      return DYNAMIC8_UNSIGNED if non_negative else DYNAMIC8_SIGNED
    return LINEAR4_UNSIGNED if non_negative else DYNAMIC4_SIGNED


FORMATS: dict[str, StateFormat] = {
    "float32": StateFormat("float32", "float", _F32),
    "bfloat16": StateFormat("bfloat16", "float", _BF16),
    "bfloat16_sr": StateFormat("bfloat16_sr", "float", _BF16,
                               stochastic=True),
    "e4m3": StateFormat("e4m3", "e4m3", bits=8, block_size=256),
    "8bit": StateFormat("8bit", "code", bits=8, block_size=256),
    "4bit": StateFormat("4bit", "code", bits=4, block_size=128),
    # block_size: that of the "4bit" format leaves that are not 2-D use.
    "4bit_rank1": StateFormat("4bit_rank1", "rank1", bits=4, block_size=128),
}
#: The format names, in the order error messages list them.
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)
ALIASES = {"f32": "float32", "bf16": "bfloat16", "bf16_sr": "bfloat16_sr",
           "fp8": "e4m3", "float8_e4m3fn": "e4m3"}
#: The block sizes a block format accepts.
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def with_block_size(fmt: StateFormat, block_size: int) -> StateFormat:
  return dataclasses.replace(fmt, block_size=block_size)


#: The smallest block: rows shorter than a format's block use the next power
#: of two at or above their length, not below this.
MIN_BLOCK = 32


def for_shape(fmt: StateFormat, shape: tuple[int, ...]) -> StateFormat:
  """The format a leaf of ``shape`` is stored in: ``"4bit_rank1"`` is
  ``"4bit"`` (same block size) unless the leaf is 2-D; others are ``fmt``."""
  if fmt.kind == "rank1" and len(shape) != 2:
    return dataclasses.replace(FORMATS["4bit"], block_size=fmt.block_size)
  return fmt


def _rank1_widths(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(code bytes, column maxes per row)`` of a rank-1 leaf."""
  rows, n = shape
  return -(-n // 2), -(-n // max(rows, 1))


def block_for(fmt: StateFormat, n: int) -> StateFormat:
  """``fmt`` with the block it uses for rows of length ``n``: its own, or,
  for a shorter row, the next power of two >= n (at least
  :data:`MIN_BLOCK`), so that short rows are not mostly padding."""
  if not fmt.blocked:
    return fmt
  block = min(fmt.block_size, max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length()))
  return fmt if block == fmt.block_size else with_block_size(fmt, block)


def stored_shape(shape: tuple[int, ...], fmt: StateFormat) -> tuple[int, ...]:
  """The shape of the array a moment of ``shape`` is stored in."""
  if not fmt.blocked:  # (Scalars are never stored in a block format.)
    return tuple(shape)
  fmt = for_shape(fmt, tuple(shape))
  if fmt.kind == "rank1":
    code_bytes, per_row = _rank1_widths(tuple(shape))
    return (shape[0], code_bytes + _SCALE_BYTES * (1 + per_row))
  *lead, n = shape
  fmt = block_for(fmt, n)
  blocks = -(-n // fmt.block_size)
  return (*lead, blocks * (fmt.block_size * fmt.bits // 8 + _SCALE_BYTES))


def stored_dtype(fmt: StateFormat) -> np.dtype:
  """The dtype of the array a moment is stored in."""
  if fmt.kind == "float":
    return fmt.dtype
  return _I8 if fmt.kind == "e4m3" else _U8


# -- blocks ----------------------------------------------------------------------


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """``(*lead, n)`` -> ``(*lead, nb, block)``, the last block zero-padded."""
  *lead, n = x.shape
  blocks = -(-n // block)
  pad = blocks * block - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
  return x.reshape(*lead, blocks, block)


def _unblocks(x: jax.Array, n: int) -> jax.Array:
  *lead, blocks, block = x.shape
  return x.reshape(*lead, blocks * block)[..., :n]


def _flush(x: jax.Array) -> jax.Array:
  """Subnormals to zero, the same on every backend (NaN stays)."""
  return jnp.where(jnp.abs(x) < _TINY, jnp.zeros_like(x), x)


def _extreme(blocks: jax.Array, absolute: bool) -> jax.Array:
  """Each block's scale: its largest magnitude, unless ``absolute`` with
  that element's sign (the positive one on a tie), so that it normalises to
  the code book's +1 and decodes to exactly itself (the signed books hold no
  -1); NaN where a block holds NaN or inf."""
  # Flagged explicitly: a max reduction need not propagate NaN.
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  if absolute:
    scale = jnp.max(jnp.abs(blocks), axis=-1)
  else:
    high, low = jnp.max(blocks, axis=-1), jnp.min(blocks, axis=-1)
    scale = jnp.where(high >= -low, high, low)
  return jnp.where(finite, scale, jnp.float32(jnp.nan))


def _split_scale(scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``|scale| = m * 2**e`` with ``1 <= m < 2`` (float32 scales are normal or
  0 here): ``(m, 2**-a, 2**-b)`` with ``a + b = e``, each factor a normal
  float32 (``2**-127`` is not), the sign of ``scale`` on ``2**-a``. A zero or
  NaN scale gives ``m = 1``, ``e = 0``."""
  bits = lax.bitcast_convert_type(jnp.abs(scale), jnp.int32)
  usable = (scale != 0) & ~jnp.isnan(scale)
  bits = jnp.where(usable, bits, jnp.int32(0x3F800000))
  e = lax.shift_right_logical(bits, 23) - 127
  m = lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, jnp.float32)
  a = lax.shift_right_arithmetic(e, 1)
  first = dtypes.pow2(-a)
  first = jnp.where(scale < 0, -first, first)
  return m, first, dtypes.pow2(a - e)


def nearest_codes(x: jax.Array, scale: jax.Array, book: CodeBook) -> jax.Array:
  """The code of each ``x`` under ``scale`` (broadcast against ``x``): the
  number of the book's thresholds ``t`` with ``y > fl(t * m)``, where
  ``scale = +-m * 2**e`` (``1 <= m < 2``), ``y = x / (+-2**e)`` (exact,
  computed as two multiplications by powers of two; ``|y| < 2**-126`` counts
  as 0) and ``fl`` rounds the product to float32. No division and no
  reciprocal: every backend computes the same codes. A zero scale takes the
  code of 0 (``x`` is 0 there), NaN code 0. Binary search; int32."""
  m, first, second = _split_scale(scale)
  y = _flush((x * first) * second)
  size = 1 << (len(book.values) - 1).bit_length()
  thresholds = jnp.asarray(np.concatenate([
      book.thresholds, np.full(size - len(book.values), np.inf, _F32)]))
  index = jnp.zeros(jnp.broadcast_shapes(x.shape, m.shape), jnp.int32)
  step = size // 2
  while step:
    candidate = index + step
    above = y > jnp.take(thresholds, candidate - 1, mode="clip") * m
    index = jnp.where(above, candidate, index)
    step //= 2
  if book.first:
    index = jnp.where(jnp.isnan(y), 0, jnp.maximum(index, book.first))
  return index


def quantize_blocks(x: jax.Array, fmt: StateFormat,
                    non_negative: bool) -> tuple[jax.Array, jax.Array]:
  """A moment as block codes and scales (before packing).

  Args:
    x: the moment, float32, at least one axis ``(*lead, n)``.
    fmt: a block format (``"e4m3"``, ``"8bit"``, ``"4bit"``).
    non_negative: whether ``x`` is a non-negative moment (picks the code
      book; its zero is unreachable).

  Returns:
    ``codes`` (``(*lead, nb, block)``: uint8 code indices, int8 e4m3 bits)
    and ``scales`` (``(*lead, nb)`` float32: the block's largest magnitude,
    signed for a signed moment; NaN for a non-finite block).
  """
  blocks = _blocks(_flush(x.astype(_F32)), fmt.block_size)
  # e4m3's grid is symmetric (-1 is a code): its scale is the absmax.
  scale = _extreme(blocks, non_negative or fmt.kind == "e4m3")
  index = nearest_codes(blocks, scale[..., None], fmt.book(non_negative))
  if fmt.kind == "e4m3":  # sorted index -> e4m3 bits
    bits = _E4M3_UNSIGNED_BITS if non_negative else _E4M3_SIGNED_BITS
    codes = lax.bitcast_convert_type(
        jnp.take(jnp.asarray(bits), index, mode="clip"), jnp.int8)
  else:
    codes = index.astype(jnp.uint8)
  nonfinite = jnp.isnan(scale)[..., None]
  codes = jnp.where(nonfinite, jnp.zeros_like(codes), codes)
  return codes, scale


def dequantize_blocks(codes: jax.Array, scales: jax.Array, fmt: StateFormat,
                      non_negative: bool) -> jax.Array:
  """The float32 blocks ``quantize_blocks`` stored (``(*lead, nb, block)``)."""
  if fmt.kind == "e4m3":
    # Every e4m3 value over 448, rounded to float32 once, indexed by its bits.
    table = jnp.asarray(_E4M3_OVER_MAX)
    index = lax.bitcast_convert_type(codes.astype(jnp.int8), jnp.uint8)
  else:
    table = jnp.asarray(fmt.book(non_negative).values)
    index = codes
  v = jnp.take(table, index.astype(jnp.int32), mode="clip")
  return _flush(v * scales[..., None])


def pack(codes: jax.Array, scales: jax.Array, fmt: StateFormat) -> jax.Array:
  """Codes and scales in one array: per block, its code bytes then the 4
  little-endian bytes of its scale; 4-bit codes two per byte (the even
  element in the low nibble)."""
  if fmt.bits == 4:
    c = codes.astype(jnp.uint8)
    codes = c[..., 0::2] | lax.shift_left(c[..., 1::2], jnp.uint8(4))
  bits = lax.bitcast_convert_type(scales.astype(_F32), jnp.uint32)
  scale_bytes = jnp.stack(
      [(lax.shift_right_logical(bits, jnp.uint32(8 * i)) & jnp.uint32(0xFF))
       .astype(jnp.uint8) for i in range(_SCALE_BYTES)], axis=-1)
  if codes.dtype == _I8:
    scale_bytes = lax.bitcast_convert_type(scale_bytes, jnp.int8)
  out = jnp.concatenate([codes, scale_bytes], axis=-1)
  *lead, blocks, width = out.shape
  return out.reshape(*lead, blocks * width)


def unpack(stored: jax.Array, fmt: StateFormat) -> tuple[jax.Array, jax.Array]:
  """The inverse of :func:`pack`: ``(codes, scales)``."""
  width = fmt.block_size * fmt.bits // 8
  *lead, total = stored.shape
  blocks = stored.reshape(*lead, total // (width + _SCALE_BYTES),
                          width + _SCALE_BYTES)
  codes, scale_bytes = blocks[..., :width], blocks[..., width:]
  scale_bytes = lax.bitcast_convert_type(scale_bytes, jnp.uint8).astype(
      jnp.uint32)
  bits = scale_bytes[..., 0]
  for i in range(1, _SCALE_BYTES):
    bits = bits | lax.shift_left(scale_bytes[..., i], jnp.uint32(8 * i))
  scales = lax.bitcast_convert_type(bits, jnp.float32)
  if fmt.bits == 4:
    low = codes & jnp.uint8(0x0F)
    high = lax.shift_right_logical(codes, jnp.uint8(4))
    codes = jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1],
                                                    2 * width)
  return codes, scales


# -- rank-1 normalisation --------------------------------------------------------


def _scale_bytes(scales: jax.Array) -> jax.Array:
  """float32 ``(..., k)`` -> their little-endian bytes ``(..., 4 k)``."""
  bits = lax.bitcast_convert_type(scales.astype(_F32), jnp.uint32)
  out = jnp.stack(
      [(lax.shift_right_logical(bits, jnp.uint32(8 * i)) & jnp.uint32(0xFF))
       .astype(jnp.uint8) for i in range(_SCALE_BYTES)], axis=-1)
  return out.reshape(*scales.shape[:-1], scales.shape[-1] * _SCALE_BYTES)


def _scales_from_bytes(data: jax.Array) -> jax.Array:
  """The inverse of :func:`_scale_bytes`."""
  data = data.reshape(*data.shape[:-1], -1, _SCALE_BYTES).astype(jnp.uint32)
  bits = data[..., 0]
  for i in range(1, _SCALE_BYTES):
    bits = bits | lax.shift_left(data[..., i], jnp.uint32(8 * i))
  return lax.bitcast_convert_type(bits, jnp.float32)


def rank1_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Row and column maxes of a non-negative 2-D moment (subnormals
  flushed), NaN for a row or column holding NaN or inf."""
  x = _flush(x.astype(_F32))
  finite = jnp.isfinite(x)
  nan = jnp.float32(jnp.nan)
  rows = jnp.where(jnp.all(finite, axis=1), jnp.max(x, axis=1), nan)
  cols = jnp.where(jnp.all(finite, axis=0), jnp.max(x, axis=0), nan)
  return rows, cols


def _rank1_scale(rows: jax.Array, cols: jax.Array) -> jax.Array:
  # jnp.minimum propagates NaN: a non-finite row or column stays NaN.
  return jnp.minimum(rows[:, None], cols[None, :])


def encode_rank1(x: jax.Array) -> jax.Array:
  """A non-negative 2-D moment in the rank-1 layout (module docstring)."""
  x = _flush(x.astype(_F32))
  rows, cols = rank1_scales(x)
  # (A row or column of values <= 0 has a scale <= 0: they all take the
  # smallest code, as under scale 0.)
  scale = jnp.maximum(_rank1_scale(rows, cols), jnp.float32(0))
  codes = nearest_codes(x, scale, LINEAR4_UNSIGNED).astype(jnp.uint8)
  codes = jnp.where(jnp.isnan(scale), jnp.zeros_like(codes), codes)
  n_rows, n = x.shape
  code_bytes, per_row = _rank1_widths(x.shape)
  if n % 2:
    codes = jnp.pad(codes, [(0, 0), (0, 1)])
  packed = codes[:, 0::2] | lax.shift_left(codes[:, 1::2], jnp.uint8(4))
  cols = jnp.pad(cols, (0, per_row * n_rows - n)).reshape(n_rows, per_row)
  return jnp.concatenate(
      [packed, _scale_bytes(rows[:, None]), _scale_bytes(cols)], axis=-1)


def decode_rank1(stored: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The float32 moment of ``shape`` (2-D) from :func:`encode_rank1`'s."""
  n_rows, n = shape
  code_bytes, _ = _rank1_widths(shape)
  packed = stored[:, :code_bytes]
  rows = _scales_from_bytes(
      stored[:, code_bytes:code_bytes + _SCALE_BYTES])[:, 0]
  cols = _scales_from_bytes(
      stored[:, code_bytes + _SCALE_BYTES:]).reshape(-1)[:n]
  low = packed & jnp.uint8(0x0F)
  high = lax.shift_right_logical(packed, jnp.uint8(4))
  codes = jnp.stack([low, high], axis=-1).reshape(n_rows, 2 * code_bytes)
  values = jnp.take(jnp.asarray(LINEAR4_UNSIGNED.values),
                    codes[:, :n].astype(jnp.int32), mode="clip")
  return _flush(values * _rank1_scale(rows, cols))


# -- one moment ------------------------------------------------------------------


# -- random bits for stochastic rounding -----------------------------------------
#
# Stochastic rounding needs one uniform random number per element, drawn in
# the same fused loop as the rounding: jax.random.bits over a whole leaf is a
# temporary of 4 bytes per element on XLA:CPU (threefry's 20 rounds are not
# fused into the update), more than the master copy stochastic rounding
# replaces. These bits are a keyed hash of the element's global index instead
# (a counter-based generator, like threefry and philox, but a few integer
# operations per element), so XLA fuses them into the update and nothing of
# the leaf's size is materialized.

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads the key words apart.


def _mix32(h: jax.Array) -> jax.Array:
  """A bijection of uint32 with full avalanche (Wellons' "lowbias32")."""
  h = h ^ lax.shift_right_logical(h, jnp.uint32(16))
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ lax.shift_right_logical(h, jnp.uint32(15))
  h = h * jnp.uint32(0x846CA68B)
  return h ^ lax.shift_right_logical(h, jnp.uint32(16))


def counter_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """32 random bits per element of ``shape``, a keyed hash of its index.

  ``h = mix(k0 ^ c)``, then ``h = mix(h + i_d)`` for the element's index
  ``i_d`` along each axis ``d`` in turn, then ``mix(h ^ k1)``, with
  ``(k0, k1)`` the key's two ``uint32`` words and ``mix`` a bijection of
  ``uint32``. For a fixed element the bits are a bijection of ``k0``, so a
  uniformly random key gives exactly uniform bits (stochastic rounding stays
  unbiased); the index is the element's global one (``lax.broadcasted_iota``
  under sharding), so each shard draws its own bits and no result depends on
  the sharding; the same key gives the same bits. Every operation is
  elementwise: XLA fuses the bits into their consumer.

  Args:
    key: a typed PRNG key or its raw ``uint32`` data (threefry: 2 words).
    shape: the shape of the bits.

  Returns:
    A ``uint32`` array of ``shape``.
  """
  data = key
  if jnp.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  data = jnp.asarray(data, jnp.uint32).reshape(-1)
  k0, k1 = data[0], data[-1]
  h = _mix32(k0 ^ jnp.uint32(_GOLDEN))
  h = jnp.broadcast_to(h, shape)
  for axis in range(len(shape)):
    h = _mix32(h + lax.broadcasted_iota(jnp.uint32, shape, axis))
  return _mix32(h ^ k1)


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """Float32 in [0, 1) from the top 23 of 32 random bits: exact multiples of
  2**-23, so ``u < f`` holds with probability exactly ``f`` for any ``f``
  with at most 23 fraction bits."""
  top = lax.shift_right_logical(bits, jnp.uint32(9))
  return top.astype(jnp.float32) * jnp.float32(2.0**-23)


def _stochastic_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` rounded to bfloat16 up or down at random, unbiased: 16 random
  bits added below bfloat16's last bit, then truncated. NaN stays NaN."""
  noise = lax.shift_right_logical(counter_bits(key, x.shape), jnp.uint32(16))
  bits = lax.bitcast_convert_type(x, jnp.uint32) + noise
  bits = bits & jnp.uint32(0xFFFF0000)
  rounded = lax.bitcast_convert_type(bits, jnp.float32)
  return jnp.where(jnp.isnan(x), x, rounded).astype(_BF16)


# encode and decode are jitted with inline=True: inside a jitted step their
# operations are part of the step's program; an eager optimizer update
# compiles one program per moment shape instead of each of their operations.
@functools.partial(jax.jit, static_argnames=("fmt", "non_negative"),
                   inline=True)
def encode(x: jax.Array, fmt: StateFormat, non_negative: bool,
           key: jax.Array | None = None) -> jax.Array:
  """A float32 moment in its stored form (see the module docstring).

  Args:
    x: the moment (float32; at least one axis for a block format).
    fmt: its format.
    non_negative: whether the moment is non-negative (second-moment-like).
    key: ``"bfloat16_sr"`` only: a PRNG key for this leaf.

  Returns:
    The stored array, of :func:`stored_shape` and :func:`stored_dtype`,
    sharded as ``x`` where ``x`` is on a mesh with Explicit axes (see
    :func:`_as_auto`).
  """
  if fmt.kind == "float":  # elementwise: typed as x under any sharding
    return _encode(x, fmt, non_negative, key)
  return _as_auto(lambda x: _encode(x, fmt, non_negative, None),
                  stored_shape(x.shape, fmt), x)


def _as_auto(fn, out_shape, x):
  """``fn(x)``, of shape ``out_shape``, partitioned as under Auto axes.

  Under explicit sharding (``jax.make_mesh``'s default) a block reshape or a
  code-book lookup cannot say how its result is sharded: encoding and
  decoding run inside ``jax.sharding.auto_axes``
  (:func:`~jmp_lite._src.compat.partitioned_as_auto`), so they compile to the
  program (and the bits) Auto axes give, and the result is sharded as ``x``
  on every axis the mesh axes divide.
  """
  return compat.partitioned_as_auto(
      fn, compat.spec_for_shape(x, out_shape), x)


def _encode(x, fmt, non_negative, key):
  if fmt.kind == "float":
    if fmt.stochastic:
      return _stochastic_bf16(x.astype(_F32), key)
    return x.astype(fmt.dtype)
  fmt = for_shape(fmt, x.shape)
  if fmt.kind == "rank1":
    return encode_rank1(x)
  fmt = block_for(fmt, x.shape[-1])
  codes, scales = quantize_blocks(x, fmt, non_negative)
  return pack(codes, scales, fmt)


@functools.partial(jax.jit, static_argnames=("fmt", "non_negative", "shape"),
                   inline=True)
def decode(stored: jax.Array, fmt: StateFormat, non_negative: bool,
           shape: tuple[int, ...]) -> jax.Array:
  """The float32 moment of original shape ``shape`` from its stored form
  (sharded as ``stored`` under explicit sharding, as :func:`encode`)."""
  if fmt.kind == "float":
    return stored.astype(_F32)
  return _as_auto(lambda stored: _decode(stored, fmt, non_negative, shape),
                  tuple(shape), stored)


def _decode(stored, fmt, non_negative, shape):
  if fmt.kind == "float":
    return stored.astype(_F32)
  fmt = for_shape(fmt, tuple(shape))
  if fmt.kind == "rank1":
    return decode_rank1(stored, tuple(shape))
  fmt = block_for(fmt, shape[-1])
  codes, scales = unpack(stored, fmt)
  return _unblocks(dequantize_blocks(codes, scales, fmt, non_negative),
                   shape[-1])


@functools.partial(jax.jit, static_argnames=("fmt", "non_negative"),
                   inline=True)
def reencode(new: jax.Array, old: jax.Array, stored: jax.Array,
             fmt: StateFormat, non_negative: bool,
             key: jax.Array | None = None) -> jax.Array:
  """:func:`encode` of ``new``, keeping ``stored``'s bytes wherever ``new``
  is bitwise ``old`` (``stored`` decoded): per element for the float
  formats, per block for block formats, per leaf for the rank-1 layout
  (whose column maxes every row shares). A moment an update left unchanged
  keeps its bits, however its codes round."""
  fresh = encode(new, fmt, non_negative, key)
  same = (lax.bitcast_convert_type(new.astype(_F32), jnp.uint32)
          == lax.bitcast_convert_type(old.astype(_F32), jnp.uint32))
  if fmt.kind == "float":
    return jnp.where(same, stored, fresh)
  if for_shape(fmt, new.shape).kind == "rank1":
    return jnp.where(jnp.all(same), stored, fresh)

  def per_block(same, stored, fresh):
    fmt_n = block_for(fmt, same.shape[-1])
    kept = jnp.all(_blocks(same, fmt_n.block_size), axis=-1)
    *lead, total = stored.shape
    nb = kept.shape[-1]
    pick = jnp.where(kept[..., None], stored.reshape(*lead, nb, total // nb),
                     fresh.reshape(*lead, nb, total // nb))
    return pick.reshape(stored.shape)

  return compat.partitioned_as_auto(
      per_block, compat.spec_for_shape(stored, stored.shape), same, stored,
      fresh)
