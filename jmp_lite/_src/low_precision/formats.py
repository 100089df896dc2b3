"""Float8 element formats, saturating casts and E8M0 (MX) scales.

Two element formats, named as Transformer Engine and the OCP FP8 spec name
them:

* ``"e4m3"``: :data:`jax.numpy.float8_e4m3fn` (4 exponent bits, 3 mantissa
  bits, no infinity, largest finite value 448). The forward-pass format.
* ``"e5m2"``: :data:`jax.numpy.float8_e5m2` (5 exponent bits, 2 mantissa bits,
  IEEE-like with infinities, largest finite value 57344). The default format
  for incoming gradients ("hybrid" recipe), for its wider range.

A plain ``x.astype(jnp.float8_e4m3fn)`` does not saturate: XLA gives NaN for
every value above ~464 (and for infinities), and ``float8_e5m2`` overflows to
inf. :func:`saturating_cast` clips to the format's largest finite value before
the cast.

MX block scales (OCP Microscaling, MXFP8) are E8M0 numbers: a biased 8-bit
exponent, no sign and no mantissa, i.e. a power of two ``2**(code - 127)``,
code 255 is NaN. :func:`encode_e8m0` rounds a positive float32 scale *up* to
such a power of two (rounding down would make the block's largest element
overflow the element format and is known to make training diverge), as
cuDNN's ``block_scale_quantize`` and JAX's own MX quantizer do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import dtypes

_F32 = np.dtype(np.float32)
_U32 = np.dtype(np.uint32)
_U8 = np.dtype(np.uint8)
E8M0_DTYPE = np.dtype(jnp.float8_e8m0fnu)


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """A float8 element format.

  Attributes:
    name: the canonical name, ``"e4m3"`` or ``"e5m2"``.
    dtype: the JAX element type (``float8_e4m3fn`` or ``float8_e5m2``).
    max: the largest finite value (448 or 57344).
    mantissa_bits: explicit mantissa bits (3 or 2); a value in the normal range
      is stored with a relative error of at most ``2**-(mantissa_bits + 1)``.
    min_normal: the smallest positive normal value (``2**-6``, ``2**-14``).
    min_subnormal: the smallest positive value (``2**-9``, ``2**-16``).

  Example:
    >>> from jmp_lite._src.low_precision import formats
    >>> formats.get_format("e4m3").max
    448.0
  """

  name: str
  dtype: np.dtype
  max: float
  mantissa_bits: int
  min_normal: float
  min_subnormal: float

  @property
  def unit_roundoff(self) -> float:
    """Largest relative rounding error in the normal range, 2**-(m + 1)."""
    return 2.0 ** -(self.mantissa_bits + 1)


def _format(name: str, dtype: Any) -> Fp8Format:
  info = jnp.finfo(dtype)
  return Fp8Format(name, np.dtype(dtype), float(info.max), int(info.nmant),
                   float(info.smallest_normal), float(info.smallest_subnormal))


E4M3 = _format("e4m3", jnp.float8_e4m3fn)
E5M2 = _format("e5m2", jnp.float8_e5m2)

#: The canonical format names, in the order error messages list them.
FORMAT_NAMES: tuple[str, ...] = ("e4m3", "e5m2")
_BY_NAME = {"e4m3": E4M3, "e5m2": E5M2}
_BY_DTYPE = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}
#: Names accepted before one spelling per format: each raises an error naming
#: the one spelling (for one release). The dtypes themselves still work.
RENAMED_FORMATS: dict[str, str] = {
    "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}

FORMAT_HELP = (
    "Valid float8 formats are 'e4m3' (float8_e4m3fn, max 448: forward "
    "operands) and 'e5m2' (float8_e5m2, max 57344: gradients), or the dtypes "
    "jnp.float8_e4m3fn / jnp.float8_e5m2. Other float8 variants (e4m3fnuz, "
    "e4m3b11fnuz, e5m2fnuz) are not supported."
)


def get_format(fmt: Any, what: str = "format") -> Fp8Format:
  """Looks up a float8 format by name or dtype.

  Args:
    fmt: ``"e4m3"``/``"e5m2"`` (case and surrounding whitespace ignored),
      the dtype ``jnp.float8_e4m3fn``/``jnp.float8_e5m2``, or an
      :class:`Fp8Format`.
    what: how to name the argument in error messages.

  Returns:
    The :class:`Fp8Format`.

  Raises:
    TypeError: if ``fmt`` is neither a string, a dtype nor a format.
    ValueError: if it names no supported float8 format.

  Example:
    >>> from jmp_lite._src.low_precision import formats
    >>> formats.get_format(" E5M2 ").name
    'e5m2'
  """
  if isinstance(fmt, Fp8Format):
    return fmt
  if isinstance(fmt, str):
    key = fmt.strip().lower()
    found, shown = _BY_NAME.get(key), repr(fmt)
    if key in RENAMED_FORMATS:
      shown += f" (now spelled {RENAMED_FORMATS[key]!r})"
  else:
    try:  # np.dtype(None) would be float64; bools and numbers are no dtype.
      dtype = None if fmt is None or isinstance(fmt, (bool, int, float)) else (
          np.dtype(fmt))
    except TypeError:
      dtype = None
    if dtype is None:
      raise TypeError(
          f"The float8 {what} must be a name or a float8 dtype, got "
          f"{type(fmt).__name__}: {fmt!r}. {FORMAT_HELP}")
    found, shown = _BY_DTYPE.get(dtype), f"dtype {dtype.name}"
  if found is None:
    raise ValueError(f"Unknown float8 {what} {shown}. {FORMAT_HELP}")
  return found


def saturating_cast(x: Any, fmt: Any = "e4m3") -> jax.Array:
  """Casts to a float8 format, clipping to its largest finite value.

  Finite values beyond the format's range become ``±max`` (448 for e4m3,
  57344 for e5m2) instead of NaN (e4m3) or inf (e5m2); ``±inf`` also become
  ``±max``, as in torchao's ``to_fp8_saturated`` and JAX's MX quantizer. NaN
  stays NaN. Everything else rounds to nearest, ties to even, exactly as
  ``astype`` does.

  This is a bare cast. The quantizers (:func:`~jmp_lite._src.low_precision.scaling.\
quantize`) divide by a scale first, and map infinite inputs to NaN instead,
  so that an overflow upstream stays visible to loss scaling.

  Args:
    x: a floating array (float8 inputs are re-encoded through float32).
    fmt: the target format (see :func:`get_format`).

  Returns:
    An array of ``x``'s shape with the format's dtype.

  Raises:
    TypeError: if ``x`` is not floating, or ``fmt`` is not a format.
    ValueError: if ``fmt`` names no supported format.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src.low_precision import formats
    >>> formats.saturating_cast(jnp.array([500.0, -1e30]), "e4m3")
    Array([448, -448], dtype=float8_e4m3fn)
  """
  fmt = get_format(fmt)
  x = checks.float_array(x, "x", float8=True)
  if np.dtype(x.dtype).itemsize == 1:
    x = x.astype(_F32)
  # ``fmt.max`` is exact in bfloat16, float16 and float32, so the clip can run
  # in x's own dtype. jnp.clip keeps NaN.
  hi = jnp.asarray(fmt.max, x.dtype)
  return encode(jnp.clip(x, -hi, hi), fmt)


def encode(x: jax.Array, fmt: Fp8Format,
           grid_rounding: bool | None = None) -> jax.Array:
  """``x`` (within ``±fmt.max``, or NaN) in ``fmt``'s dtype, rounded to
  nearest, ties to even: the float32 -> float8 cast.

  Where the jaxlib rounds that cast twice (``compat.FLOAT8_CAST_ROUNDS_TWICE``:
  jaxlib 0.10.0's XLA:CPU goes through a narrower float, so values just above
  a midpoint came out one code low), the rounding is done here first, in
  float32 arithmetic on the format's grid (a multiplication by a power of
  two, a round, a multiplication back: all exact), and the cast only
  re-encodes a representable value. Both give the same bits.
  """
  x = x.astype(_F32)
  if grid_rounding is None:
    grid_rounding = compat.FLOAT8_CAST_ROUNDS_TWICE
  if grid_rounding:
    # The spacing of the format's values around x is 2**k (see dtypes).
    k = dtypes.spacing_exponent(x, fmt.mantissa_bits,
                                int(np.log2(fmt.min_normal)))
    rounded = jnp.round(x * dtypes.pow2(-k)) * dtypes.pow2(k)
    x = jnp.where(jnp.isnan(x), x, rounded)
  return x.astype(fmt.dtype)


# ---------------------------------------------------------------------------
# E8M0 scales.
# ---------------------------------------------------------------------------

_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF


def e8m0_codes(scale: jax.Array) -> jax.Array:
  """The E8M0 codes (uint8) of ``scale`` rounded up to powers of two.

  ``scale`` is a float32 array of non-negative values. The code of a value
  ``v`` is the biased exponent of the smallest power of two ``>= v``:

  * ``v <= 2**-127`` (including 0 and float32 subnormals up to 2**-127): 0,
    i.e. 2**-127, the smallest E8M0 value;
  * ``2**-127 < v``, finite: ``ceil(log2(v)) + 127``, at most 254 (values
    above 2**127 saturate to 2**127 rather than becoming NaN);
  * inf and NaN: 255 (NaN).

  This is the rounding of cuDNN's ``block_scale_quantize`` and of JAX's MX
  quantizer, except for NaN, which JAX's wraps around to code 0.
  """
  bits = jax.lax.bitcast_convert_type(scale.astype(_F32), _U32)
  exponent = (bits >> 23) & 0xFF  # drops the sign bit (a NaN may carry one)
  mantissa = bits & _MANT_MASK
  up = exponent + (mantissa != 0).astype(_U32)  # ceil to a power of two
  code = jnp.minimum(up, jnp.asarray(254, _U32))
  # Subnormals up to 2**-127 (mantissa <= 0x400000) have code 0 (2**-127).
  code = jnp.where((exponent == 0) & (mantissa <= 0x400000),
                   jnp.asarray(0, _U32), code)
  code = jnp.where(exponent == 0xFF, jnp.asarray(255, _U32), code)
  return code.astype(_U8)


def encode_e8m0(scale: Any) -> jax.Array:
  """Rounds non-negative float32 scales up to powers of two, as E8M0.

  Args:
    scale: non-negative scales (any float dtype; computed in float32).

  Returns:
    A ``float8_e8m0fnu`` array: ``2**ceil(log2(scale))``, see
    :func:`e8m0_codes` for zero, tiny, huge and non-finite values.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src.low_precision import formats
    >>> formats.decode_e8m0(formats.encode_e8m0(jnp.array([0.3, 4.0])))
    Array([0.5, 4. ], dtype=float32)
  """
  scale = checks.float_array(scale, "scale", float8=True)
  return jax.lax.bitcast_convert_type(e8m0_codes(scale), E8M0_DTYPE)


def decode_e8m0(codes: jax.Array) -> jax.Array:
  """The float32 value of E8M0 scales: ``2**(code - 127)``, NaN for 255.

  Code 0 is 2**-127, a float32 subnormal: XLA:CPU flushes it to zero in
  arithmetic. The quantizers never emit code 0 for a block holding a nonzero
  value, so that this cannot change a result.

  Args:
    codes: a ``float8_e8m0fnu`` (or uint8) array.

  Returns:
    The float32 scales.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src.low_precision import formats
    >>> formats.decode_e8m0(jnp.array([127, 128], jnp.uint8))
    Array([1., 2.], dtype=float32)
  """
  codes = _as_codes(codes).astype(_U32)
  value = jax.lax.bitcast_convert_type(codes << 23, _F32)
  value = jnp.where(codes == 0, jnp.asarray(2.0**-127, _F32), value)
  return jnp.where(codes == 255, jnp.asarray(np.nan, _F32), value)


def e8m0_reciprocal(codes: jax.Array) -> jax.Array:
  """``2**(127 - code)`` as a normal float32, for quantizing with a multiply.

  Exact for codes 0..253 (2**127 .. 2**-126; code 0's reciprocal 2**127 is
  normal, unlike 2**-127 itself); 0 for code 254 (2**-127, out of reach of
  any float32/bfloat16/float16 block) and for code 255, so that a block with an
  infinity quantizes to 0 (finite elements) and NaN (infinities), exactly as
  JAX's quantizer does.
  """
  codes = _as_codes(codes).astype(jnp.int32)
  biased = jnp.clip(254 - codes, 0, 254).astype(_U32)
  value = jax.lax.bitcast_convert_type(biased << 23, _F32)
  return jnp.where(codes == 255, jnp.asarray(0.0, _F32), value)


def _as_codes(codes: jax.Array) -> jax.Array:
  codes = jnp.asarray(codes)
  if np.dtype(codes.dtype) == E8M0_DTYPE:
    return jax.lax.bitcast_convert_type(codes, _U8)
  return codes  # uint8 codes: the library's callers pass nothing else


def round_up_pow2(scale: jax.Array) -> jax.Array:
  """Rounds positive finite float32 values up to a power of two.

  Non-finite values pass through unchanged. Exact (bit manipulation, no
  ``log2``): adding ``2**23 - 1`` to the bit pattern carries into the exponent
  exactly when the mantissa is nonzero. That maps inf to inf and a NaN to
  0: ``lax.max`` with the value itself (which propagates NaN) keeps the NaN,
  and is the rounded value everywhere else.
  """
  scale = scale.astype(_F32)
  bits = jax.lax.bitcast_convert_type(scale, _U32)
  rounded = (bits + _MANT_MASK) & _EXP_MASK
  return jax.lax.max(jax.lax.bitcast_convert_type(rounded, _F32), scale)
