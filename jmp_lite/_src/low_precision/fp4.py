"""FP4 (E2M1) numerics: the NVFP4 and MXFP4 quantizers, the random Hadamard
transform and stochastic rounding (the internals of
:func:`~jmp_lite._src.low_precision.fp4_matmul.fp4_dot_general`; the tests check them
against an independent reference).

The element format is E2M1 (:data:`jax.numpy.float4_e2m1fn`): 1 sign bit, 2
exponent bits, 1 mantissa bit, no infinity, no NaN; its values are
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` and their negatives. Two block formats scale
it (the guide: ``docs/fp4.md``):

* **NVFP4** (NVIDIA, Transformer Engine's ``NVFP4BlockScaling``): blocks of
  16 consecutive elements along the last axis, each with an E4M3 block scale,
  under one float32 scale per tensor computed from the tensor's current amax.
  Optionally (weights) 16x16 tiles share one block scale, so that a weight
  and its transpose quantize to the same values.
* **MXFP4** (OCP Microscaling): blocks of 32 elements with a power-of-two
  E8M0 scale.

How each step is computed, following Transformer Engine's reference
quantizer (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``)
and CUDA kernel (``compute_global_encode_scaling_factor_FP4``):

1. NVFP4's tensor scale: ``S_enc = 6 * 448 / amax`` (float32), at most the
   largest float32; ``S_enc = 1`` where ``amax == 0``. The stored (decoding)
   tensor scale is ``1 / S_enc``, a float32 subnormal below an amax of
   3.2e-35: computed from integers there, and multiplied lifted
   (:func:`lift_scale`), as XLA:CPU would flush it to zero.
2. Each block's scale is ``amax_block * (S_enc * float32(1/6))``, clipped to
   448 and rounded to nearest even onto the E4M3 grid; the block is multiplied
   by ``min(1 / (block_scale * (1 / S_enc)), float32 max)``, clipped to
   ``[-6, 6]`` and rounded onto the E2M1 grid.
3. MXFP4's scale ``2**k`` is built from the exponent bits of the block's amax
   ``m * 2**e`` (``1 <= m < 2``), never by a cast: the rule ``"round_up"`` (the
   default, as cuBLAS and JAX's MX quantizer) takes the smallest ``k`` with
   ``amax <= 6 * 2**k`` (``k = e - 2`` if ``m <= 1.5``, else ``e - 1``), so no
   element is clipped; the OCP rule ``"floor"`` takes ``k = e - 2``
   (``floor(log2 amax)`` minus E2M1's largest exponent, 2) and clips elements
   in ``(6, 8)`` to 6. ``k`` is clipped to E8M0's range ``[-127, 127]``; an
   all-zero block gets ``k = -127``.

Every rounding is done in float32 arithmetic on the format's grid (a
multiplication by a power of two, a round, a multiplication back: exact);
the casts to ``float4_e2m1fn``/``float8_e4m3fn`` only re-encode representable
values. A bare cast is not relied on: ``astype(float4_e2m1fn)`` turns NaN into
-0, ``astype(float8_e8m0fnu)`` maps 0 to NaN, and jaxlib 0.10's XLA:CPU rounds
a float32 -> float8 cast twice.

**Non-finite inputs stay visible.** NaN and inf are replaced by 0 for the
computation of the scales and values (so that one inf does not crush the
tensor's other values), and flagged: an NVFP4 tensor holding any NaN or inf
gets a NaN tensor scale, an MXFP4 block holding one gets the E8M0 NaN code
(255). Dequantizing, or multiplying with :func:`~jmp_lite._src.low_precision.\
fp4_matmul.fp4_dot_general`, then gives NaN, where a plain E2M1 cast would have
given -0 (NaN) or 6 (inf): an overflow reaches the loss-scaling check.

**Stochastic rounding** rounds a value between two neighbouring E2M1 values
``lo < v < hi`` up with probability ``(v - lo) / (hi - lo)``, using
:data:`SR_RANDOM_BITS` (8) random bits per element as Blackwell's
``cvt.rs`` instruction does: the fraction ``(v - lo) / (hi - lo)`` is
truncated to 8 bits ``f`` and ``v`` rounds up where ``f + r >= 256`` for a
uniform random byte ``r``. The expected value is exact for fractions that are
multiples of 1/256 and low by less than ``(hi - lo) / 256`` otherwise. The
random bytes are ``jax.random.bits(key, shape, jnp.uint8)`` of the quantized
tensor's shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src.low_precision import recipes as recipes_lib

_F32 = np.dtype(np.float32)
_U32 = np.dtype(np.uint32)
_U8 = np.dtype(np.uint8)
_F32_MAX = float(np.finfo(np.float32).max)
# The smallest amax whose NVFP4 encoding scale 2688 / amax is finite.
_TINY_AMAX = float(np.nextafter(np.float32(6 * 448 / _F32_MAX), np.float32(1)))

#: The FP4 element type (E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives).
E2M1_DTYPE = np.dtype(jnp.float4_e2m1fn)
#: NVFP4's block-scale type.
E4M3_DTYPE = np.dtype(jnp.float8_e4m3fn)
#: MXFP4's block-scale type (a biased power-of-two exponent; 255 is NaN).
E8M0_DTYPE = np.dtype(jnp.float8_e8m0fnu)
#: The largest E2M1 value.
E2M1_MAX = 6.0
#: The largest E4M3 value.
E4M3_MAX = 448.0
#: NVFP4 blocks: 16 elements along the last axis (16x16 tiles for weights).
NVFP4_BLOCK_SIZE = recipes_lib.NVFP4_BLOCK_SIZE
#: MXFP4 blocks: 32 elements along the last axis.
MXFP4_BLOCK_SIZE = recipes_lib.MXFP4_BLOCK_SIZE
#: The size of the random Hadamard transform.
RHT_SIZE = 16
#: Transformer Engine's fixed sign vector of the random Hadamard transform
#: (``get_wgrad_sign_vector``), applied before the Hadamard matrix.
RHT_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1,
                              1, -1, -1)
#: Random bits per element of stochastic rounding (as Blackwell's ``cvt.rs``).
SR_RANDOM_BITS = 8
#: MXFP4 scale rules: ``"round_up"`` (cuBLAS, JAX; the default) or ``"floor"``
#: (the OCP Microscaling spec's).
MX_SCALE_RULES = recipes_lib.MX_SCALE_RULES


class Nvfp4Tensor(NamedTuple):
  """An NVFP4 tensor: E2M1 values, E4M3 block scales, a float32 tensor scale.

  It stands for ``values * block_scale * tensor_scale``, each block scale
  repeated over its 16 elements of the last axis
  (:func:`dequantize_fp4`).

  Attributes:
    values: ``float4_e2m1fn``, the input's shape.
    block_scales: ``float8_e4m3fn``, the input's shape with the last axis
      divided by 16 (with 16x16 tiles, each tile's scale is repeated on its
      16 rows).
    tensor_scale: a float32 scalar, ``1 / S_enc = amax / 2688`` (1 for an
      all-zero tensor); NaN if the input held NaN or inf.
  """

  values: jax.Array
  block_scales: jax.Array
  tensor_scale: jax.Array


class Mxfp4Tensor(NamedTuple):
  """An MXFP4 tensor: E2M1 values and E8M0 block scales.

  It stands for ``values * 2**(code - 127)``, each scale repeated over its
  32 elements of the last axis (:func:`dequantize_fp4`); code 255 (NaN)
  marks a block that held NaN or inf.

  Attributes:
    values: ``float4_e2m1fn``, the input's shape.
    scales: ``float8_e8m0fnu``, the input's shape with the last axis divided
      by 32.
  """

  values: jax.Array
  scales: jax.Array


# ---------------------------------------------------------------------------
# Rounding on a grid, in float32 arithmetic.
# ---------------------------------------------------------------------------


def round_to_grid(x: jax.Array, mantissa_bits: int,
                  min_exponent: int) -> jax.Array:
  """float32 ``x`` rounded to nearest, ties to even, onto the grid of a
  format with ``mantissa_bits`` and smallest normal ``2**min_exponent``
  (no clipping: the caller clips to the format's range first)."""
  k = dtypes.spacing_exponent(x, mantissa_bits, min_exponent)
  return jnp.round(x * dtypes.pow2(-k)) * dtypes.pow2(k)


def round_e2m1(x: jax.Array) -> jax.Array:
  """float32 ``x`` in ``[-6, 6]`` rounded to nearest even E2M1 (float32)."""
  return round_to_grid(x, 1, 0)


def round_e4m3(x: jax.Array) -> jax.Array:
  """float32 ``x`` in ``[-448, 448]`` rounded to nearest even E4M3 (float32)."""
  return round_to_grid(x, 3, -6)


def stochastic_round_e2m1(x: jax.Array, random_bytes: jax.Array) -> jax.Array:
  """float32 ``x`` in ``[-6, 6]`` rounded stochastically onto E2M1 (float32).

  ``random_bytes`` (uint8, ``x``'s shape) are the random bits: with ``f`` the
  first 8 bits of ``x``'s fraction between its two neighbours, ``x`` rounds
  up (away from zero) where ``f + r >= 256``.
  """
  magnitude = jnp.abs(x)
  k = dtypes.spacing_exponent(magnitude, 1, 0)
  t = magnitude * dtypes.pow2(-k)  # in units of the spacing: exact
  low = jnp.floor(t)
  fraction = jnp.floor((t - low) * 2.0**SR_RANDOM_BITS).astype(jnp.int32)
  up = fraction + random_bytes.astype(jnp.int32) >= 2**SR_RANDOM_BITS
  rounded = (low + up.astype(_F32)) * dtypes.pow2(k)
  return jnp.copysign(rounded, x)


def _quantize_elements(scaled: jax.Array, key: Any) -> jax.Array:
  """float32 ``scaled`` clipped to ``[-6, 6]`` and rounded onto E2M1 (to
  nearest even, or stochastically where a key is given)."""
  clipped = jnp.clip(scaled, -E2M1_MAX, E2M1_MAX)
  if key is None:
    return round_e2m1(clipped)
  bits = jax.random.bits(key, clipped.shape, jnp.uint8)
  return stochastic_round_e2m1(clipped, bits)


def _blocks(x: jax.Array, size: int) -> jax.Array:
  return x.reshape(x.shape[:-1] + (x.shape[-1] // size, size))


def nonfinite_poison(x: jax.Array) -> jax.Array:
  """A float32 scalar: 0 if ``x`` is finite, NaN if it holds NaN or inf
  (``sum(x * 0)``). Adding it flags a scale without a NaN constant, which
  ``jax_debug_nans`` would stop at in a finite run."""
  return jnp.sum(x.astype(_F32) * jnp.zeros((), _F32))


def global_tensor_stats(amax: jax.Array, poison: jax.Array,
                        axis_name: Any) -> tuple[jax.Array, jax.Array]:
  """A tensor's amax and NaN flag (:func:`nonfinite_poison`) over the mapped
  axis ``axis_name`` (``lax.pmax``; ``lax.psum``, which keeps a NaN), as
  if the replicas' shards were one tensor; unchanged for None."""
  if axis_name is None:
    return amax, poison
  return lax.pmax(amax, axis_name), lax.psum(poison, axis_name)


def _finite_part(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x`` as float32 with NaN and inf replaced by 0, and where it was finite."""
  x = x.astype(_F32)
  finite = jnp.isfinite(x)
  return jnp.where(finite, x, jnp.zeros((), _F32)), finite


# ---------------------------------------------------------------------------
# NVFP4.
# ---------------------------------------------------------------------------


#: A float32 scale below 2**-126 (a subnormal, which XLA:CPU flushes to zero
#: in any arithmetic) is carried as a normal float32 lifted by 2**_LIFT.
_LIFT = 64


def _reciprocal_units(encode: jax.Array) -> jax.Array:
  """uint32 ``round(2**149 / encode)`` (to nearest, ties to even) for
  float32 ``encode`` in ``(2**126, 2**128)``: the float32 subnormal
  ``1 / encode`` in units of ``2**-149``, by integer long division (a
  float32 quotient rounded again to the subnormal grid would round twice)."""
  bits = lax.bitcast_convert_type(encode, _U32)
  m = (bits & 0x7FFFFF) | 0x800000                  # encode = m * 2**(e - 23)
  e = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127  # 126 or 127
  # 2**149 / encode = 2**(172 - e) / m: 2**31 first, then 8 and 7 - (e - 126)
  # more bits (every partial remainder < 2**24, shifted by at most 8).
  top = jnp.asarray(2**31, _U32)
  q, r = top // m, top % m
  for shift in (jnp.asarray(8, _U32), (7 - (e - 126)).astype(_U32)):
    t = r << shift
    q, r = (q << shift) + t // m, t % m
  up = ((r << 1) > m) | (((r << 1) == m) & ((q & 1) == 1))
  return q + up.astype(_U32)


def lift_scale(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A float32 scale ``s >= 0`` (or NaN) as ``(S, L)`` with ``s = S * 2**-L``:
  ``(s, 0)`` for a normal (or zero, or NaN) ``s``, ``(s * 2**64, 64)`` (a
  normal float32) for a subnormal one, read from its bits. Multiply by
  ``S``, then :func:`mul_pow2` by ``-L``: the float8 matmul's way with a
  scale product that is no normal float32; exact wherever the result is a
  normal float32, where ``x * s`` on XLA:CPU would flush ``s`` to zero."""
  bits = lax.bitcast_convert_type(scale.astype(_F32), _U32)
  subnormal = (bits & 0x7F800000) == 0
  units = (bits & 0x7FFFFF).astype(_F32)           # s / 2**-149
  lifted = units * jnp.asarray(2.0**(_LIFT - 149), _F32)
  return (jnp.where(subnormal, lifted, scale),
          jnp.where(subnormal, jnp.asarray(_LIFT, jnp.int32),
                    jnp.zeros((), jnp.int32)))


def mul_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """float32 ``x * scale`` rounded once, as a float32 product that keeps
  subnormal operands would give it, wherever the result is a normal float32
  (``scale`` may be a subnormal: see :func:`lift_scale`)."""
  lifted, lift = lift_scale(scale)
  return mul_pow2(x * lifted, -lift)


def nvfp4_tensor_scales(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(S_enc, 1 / S_enc)`` for a finite float32 ``amax``: ``S_enc = 2688 /
  amax`` at most the largest float32, 1 where ``amax == 0``. ``1 / S_enc``
  is the float32 quotient, a subnormal for ``amax`` below ``2688 *
  2**-126`` (3.2e-35): built from its bits there (XLA:CPU flushes a
  subnormal result to zero), so multiply by it with :func:`mul_scale`."""
  # Below _TINY_AMAX, 2688 / amax exceeds the largest float32: the result is
  # that maximum, computed without the intermediate inf (jax_debug_infs).
  tiny = jnp.asarray(_TINY_AMAX, _F32)
  encode = jnp.where(
      amax >= tiny,
      jnp.asarray(E2M1_MAX * E4M3_MAX, _F32) / jnp.maximum(amax, tiny),
      jnp.asarray(_F32_MAX, _F32))
  encode = jnp.where((amax == 0) | (encode == 0), jnp.ones((), _F32), encode)
  small = encode > jnp.asarray(2.0**126, _F32)
  normal = jnp.ones((), _F32) / jnp.where(small, jnp.ones((), _F32), encode)
  subnormal = lax.bitcast_convert_type(
      _reciprocal_units(jnp.where(small, encode, jnp.asarray(2.0**127, _F32))),
      _F32)
  return encode, jnp.where(small, subnormal, normal)


def _split_e4m3(d: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 E4M3 values ``d >= 0`` as ``(m, k)``, ``d = m * 2**k`` with
  uint32 ``m < 16`` and int32 ``k`` in ``[-9, 5]``."""
  biased = (lax.bitcast_convert_type(d, _U32) >> 23).astype(jnp.int32)
  k = jnp.maximum(biased - 127, -6) - 3
  return mul_pow2(d, -k).astype(_U32), k


def _block_encode(block_scales: jax.Array, decode: jax.Array) -> jax.Array:
  """``min(1 / (block_scale * (1 / S_enc)), float32 max)``, each product and
  quotient rounded once as float32 arithmetic that keeps subnormals rounds
  it (the reference quantizer's): a block scale times a tiny tensor scale is
  a float32 subnormal for blocks of amax below ``6 * 2**-126`` (7e-38),
  rounded to its grid of ``2**-149`` here in integers."""
  f32_max = jnp.asarray(_F32_MAX, _F32)
  lifted, lift = lift_scale(decode)
  product = block_scales * lifted                    # the denominator * 2**L
  normal = product >= dtypes.pow2(lift - 126)
  normal_encode = mul_pow2(
      jnp.ones((), _F32) / jnp.where(normal, product, jnp.ones((), _F32)),
      lift)
  # Subnormal: round(block_scale * decode / 2**-149) from the integers
  # decode / 2**-149 (< 2**32 wherever the product is subnormal) and m.
  # (Clamped first, where that branch is not taken: no intermediate inf.)
  units = jnp.minimum(
      mul_pow2(jnp.minimum(lifted, dtypes.pow2(lift - 117)), 149 - lift),
      jnp.asarray(2.0**32 - 256, _F32)).astype(_U32)
  m, k = _split_e4m3(block_scales)
  whole = units * m
  right = jnp.clip(-k, 0, 31).astype(_U32)
  floor = (whole << jnp.clip(k, 0, 31).astype(_U32)) >> right
  rest = whole - ((whole >> right) << right)
  half = (jnp.ones((), _U32) << right) >> 1
  up = (right > 0) & ((rest > half) | ((rest == half) & ((floor & 1) == 1)))
  grid = (floor + up.astype(_U32)).astype(_F32)      # the subnormal / 2**-149
  # 1 / (grid * 2**-149) = (2**85 / grid) * 2**64, the maximum above it.
  quotient = (jnp.asarray(2.0**85, _F32) /
              jnp.maximum(grid, jnp.ones((), _F32)))
  fits = (grid > 0) & (quotient < jnp.asarray(2.0**64, _F32))
  sub_encode = jnp.where(fits, mul_pow2(jnp.where(fits, quotient, 1.0), 64),
                         f32_max)
  return jnp.where(normal, jnp.minimum(normal_encode, f32_max), sub_encode)


def _tile_amax(magnitude: jax.Array) -> jax.Array:
  """The amax of each 16x16 tile of the last two axes, repeated on the
  tile's 16 rows: ``(..., P, C // 16)``."""
  *lead, p, c = magnitude.shape
  t = NVFP4_BLOCK_SIZE
  tiles = magnitude.reshape(*lead, p // t, t, c // t, t)
  amax = jnp.max(tiles, axis=(-3, -1))  # (..., P // 16, C // 16)
  return jnp.repeat(amax, t, axis=-2)


def nvfp4_quantize_f32(x: jax.Array, *, two_d: bool = False,
                       key: Any = None,
                       axis_name: Any = None) -> tuple[jax.Array, jax.Array,
                                                       jax.Array]:
  """NVFP4 of ``x`` (last axis a multiple of 16; with ``two_d`` the last
  two): ``(values, block_scales, tensor_scale)`` as float32 arrays whose
  values lie on the E2M1 and E4M3 grids. The tensor scale is NaN if ``x``
  held NaN or inf. ``key`` rounds the elements stochastically. With
  ``axis_name`` (a bound ``pmap``/``shard_map`` axis) the tensor's amax and
  its NaN flag are those of the whole tensor across the axis
  (:func:`global_tensor_stats`); block scales stay local."""
  xf, _ = _finite_part(x)
  magnitude = jnp.abs(xf)
  amax = jnp.max(magnitude) if x.size else jnp.zeros((), _F32)
  amax, poison = global_tensor_stats(amax, nonfinite_poison(x), axis_name)
  return nvfp4_quantize_given(xf, magnitude, amax, poison, two_d=two_d,
                              key=key)


def nvfp4_quantize_given(xf: jax.Array, magnitude: jax.Array,
                         amax: jax.Array, poison: jax.Array, *,
                         two_d: bool = False,
                         key: Any = None) -> tuple[jax.Array, jax.Array,
                                                   jax.Array]:
  """:func:`nvfp4_quantize_f32` of the finite float32 ``xf`` (NaN and inf
  replaced by 0) and its ``magnitude`` under given tensor statistics: the
  amax and the NaN flag (:func:`nonfinite_poison`) broadcast against the
  block scales ``(..., P, C // 16)``: scalars for one tensor scale, or, for
  a grouped matmul's per-group tensor scales, one per row, per matrix of a
  batch or per block column. The tensor scale has their shape."""
  encode, decode = nvfp4_tensor_scales(amax)
  # The NaN flag replaces the scale (an addition would flush a subnormal).
  tensor_scale = jnp.where(jnp.isnan(poison), poison, decode)
  if two_d:
    block_amax = _tile_amax(magnitude)
  else:
    block_amax = jnp.max(_blocks(magnitude, NVFP4_BLOCK_SIZE), axis=-1)
  multiplier = encode * jnp.asarray(np.float32(1.0) / np.float32(E2M1_MAX))
  block_scales = round_e4m3(jnp.minimum(block_amax * multiplier,
                                        jnp.asarray(E4M3_MAX, _F32)))
  block_encode = _block_encode(block_scales, decode)
  scaled = (_blocks(xf, NVFP4_BLOCK_SIZE) * block_encode[..., None]).reshape(
      xf.shape)
  return _quantize_elements(scaled, key), block_scales, tensor_scale


# ---------------------------------------------------------------------------
# MXFP4.
# ---------------------------------------------------------------------------


def mx_exponents(amax: jax.Array, rule: str) -> jax.Array:
  """int32 ``k`` of MXFP4's scale ``2**k`` for float32 block amaxes, from
  their exponent bits (see the module docstring), in ``[-127, 127]``."""
  bits = lax.bitcast_convert_type(amax.astype(_F32), _U32)
  biased = (bits >> 23).astype(jnp.int32) & 0xFF
  mantissa = bits & 0x7FFFFF
  k = biased - 127 - 2
  if rule == "round_up":
    k = k + (mantissa > 0x400000).astype(jnp.int32)
  k = jnp.where(biased == 0, jnp.asarray(-127, jnp.int32), k)
  return jnp.clip(k, -127, 127)


def mul_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
  """float32 ``x * 2**k`` for int32 ``k`` in ``[-254, 254]``: two exact
  multiplications by normal powers of two."""
  half = k // 2
  return (x * dtypes.pow2(half)) * dtypes.pow2(k - half)


def mxfp4_quantize_f32(x: jax.Array, *, rule: str = "round_up",
                       key: Any = None) -> tuple[jax.Array, jax.Array]:
  """MXFP4 of ``x`` (last axis a multiple of 32): ``(values, codes)``, float32
  values on the E2M1 grid and uint8 E8M0 codes (255 for a block that held NaN
  or inf). ``key`` rounds the elements stochastically."""
  xf, finite = _finite_part(x)
  blocks = _blocks(xf, MXFP4_BLOCK_SIZE)
  k = mx_exponents(jnp.max(jnp.abs(blocks), axis=-1), rule)
  bad = ~jnp.all(_blocks(finite, MXFP4_BLOCK_SIZE), axis=-1)
  codes = jnp.where(bad, jnp.asarray(255, jnp.int32), k + 127).astype(_U8)
  scaled = mul_pow2(blocks, -k[..., None]).reshape(x.shape)
  return _quantize_elements(scaled, key), codes


def decode_e8m0_codes(codes: jax.Array) -> jax.Array:
  """float32 ``2**(code - 127)`` of uint8 E8M0 codes, NaN for 255.

  Code 0 is ``2**-127``, a float32 subnormal that XLA:CPU flushes to zero in
  any product: multiply blocks by their scales with :func:`scale_e8m0_blocks`
  instead."""
  k = codes.astype(jnp.int32) - 127
  value = mul_pow2(jnp.ones(codes.shape, _F32), k)
  # Code 255 gives 2**128 = inf above, and inf - inf = NaN: no NaN constant
  # (jax_debug_nans would stop at one in a finite run).
  return jnp.where(codes == 255, value - value, value)


def scale_e8m0_blocks(blocks: jax.Array, codes: jax.Array,
                      shift: Any = 0) -> jax.Array:
  """float32 ``blocks`` ``(..., nb, size)`` times ``2**(code - 127 + shift)``
  per block, NaN in the blocks whose code is 255.

  The scale is applied as :func:`mul_pow2` applies a power of two (two
  multiplications by normal powers of two, as the float8 matmul applies a
  scale product that is not a normal float32), never as the decoded scale:
  code 0's ``2**-127`` is a float32 subnormal that XLA:CPU flushes to zero,
  which would zero a block of normal values such as ``2 * 2**-127``. The
  result is exact wherever it is a normal float32.
  """
  k = codes.astype(jnp.int32) - 127 + shift
  # 0 for a finite scale, NaN for code 255 (2**128 * 0 = inf * 0).
  poison = decode_e8m0_codes(codes) * jnp.zeros((), _F32)
  return mul_pow2(blocks, k[..., None]) + poison[..., None]


# ---------------------------------------------------------------------------
# The random Hadamard transform.
# ---------------------------------------------------------------------------


def hadamard_f32(x: jax.Array) -> jax.Array:
  """The 16-point random Hadamard transform of float32 ``x`` along its last
  axis (a multiple of 16), in float32: each block of 16 is multiplied by
  TE's signs, transformed by the Sylvester Hadamard matrix with the fast
  Walsh-Hadamard butterfly (halves of 8, then 4, 2, 1: ``[a + b, a - b]``),
  and multiplied by 1/4, so that the transform is orthogonal."""
  shape = x.shape
  signs = jnp.asarray(np.array(RHT_SIGNS, np.float32))
  y = _blocks(x.astype(_F32), RHT_SIZE) * signs
  half = RHT_SIZE // 2
  while half >= 1:
    y = y.reshape(y.shape[:-1] + (RHT_SIZE // (2 * half), 2, half))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(
        y.shape[:-3] + (RHT_SIZE,))
    half //= 2
  return (y * jnp.asarray(0.25, _F32)).reshape(shape)


# ---------------------------------------------------------------------------
# Encoded tensors (the tests' view of the quantizers; no argument checking:
# fp4_dot_general validates its operands, and JAX reports partial blocks and
# bad keys).
# ---------------------------------------------------------------------------


def quantize_nvfp4(x: Any, *, two_d: bool = False,
                   key: Any = None) -> Nvfp4Tensor:
  """NVFP4 of a float32, bfloat16 or float16 array along its last axis (a
  multiple of 16; with ``two_d``, 16x16 tiles over the last two axes), the
  elements rounded to nearest even, or stochastically with a PRNG ``key``."""
  x = jnp.asarray(x)
  values, scales, tensor_scale = nvfp4_quantize_f32(x, two_d=bool(two_d),
                                                    key=key)
  return Nvfp4Tensor(values.astype(E2M1_DTYPE), scales.astype(E4M3_DTYPE),
                     tensor_scale)


def quantize_mxfp4(x: Any, *, scale_rule: str = "round_up",
                   key: Any = None) -> Mxfp4Tensor:
  """MXFP4 of a float32, bfloat16 or float16 array along its last axis (a
  multiple of 32), with the scale rule ``"round_up"`` or ``"floor"``."""
  values, codes = mxfp4_quantize_f32(
      jnp.asarray(x), rule=check_scale_rule(scale_rule), key=key)
  return Mxfp4Tensor(values.astype(E2M1_DTYPE),
                     lax.bitcast_convert_type(codes, E8M0_DTYPE))


check_scale_rule = recipes_lib.check_scale_rule


def dequantize_fp4(q: Nvfp4Tensor | Mxfp4Tensor,
                   dtype: Any = jnp.float32) -> jax.Array:
  """The values an :class:`Nvfp4Tensor` (``values * block_scale *
  tensor_scale``) or :class:`Mxfp4Tensor` (``values * 2**(code - 127)``)
  stands for, NaN where a scale is NaN."""
  if isinstance(q, Nvfp4Tensor):
    values = _blocks(q.values.astype(_F32), NVFP4_BLOCK_SIZE)
    full = values * q.block_scales.astype(_F32)[..., None]
    return mul_scale(full.reshape(q.values.shape),
                     jnp.asarray(q.tensor_scale, _F32)).astype(dtype)
  codes = lax.bitcast_convert_type(q.scales, _U8)
  values = _blocks(q.values.astype(_F32), MXFP4_BLOCK_SIZE)
  full = scale_e8m0_blocks(values, codes)
  return full.reshape(q.values.shape).astype(dtype)
