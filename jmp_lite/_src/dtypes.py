"""Dtype names, parsing and canonicalisation.

This is the bottom layer of jmp_lite: every other module asks this one what a
dtype is called, which dtypes a policy may hold and what "half" means on the
current backend.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# The floating dtypes a policy may hold, with their names. The first name is the
# one ``str(policy)`` prints (jmp's convention: f32 prints as "full").
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float32): ("full", "f32", "float32"),
    np.dtype(jnp.float16): ("f16", "float16"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float64): ("f64", "float64"),
}

_NAME_TO_DTYPE: dict[str, np.dtype] = {
    name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names
}

#: Every dtype name the policy grammar accepts ("half" is resolved per backend).
DTYPE_NAMES: tuple[str, ...] = tuple(_NAME_TO_DTYPE) + ("half",)

FLOAT32 = np.dtype(jnp.float32)

#: Why a float8 dtype is not a policy dtype, and what to write instead.
FLOAT8_POLICY_DTYPE = (
    "float8 holds no params, activations or outputs in jmp_lite: it is a "
    "matmul recipe, whose matmuls quantize their operands to float8 and "
    "accumulate in float32. Write e.g. get_policy('mixed_fp8') or "
    "'p=f32,c=bf16,o=f32,m=fp8' (docs/fp8.md)."
)
#: Why FP4 is no policy dtype, and what to write instead.
FP4_POLICY_DTYPE = (
    "FP4 (float4_e2m1fn) holds no params, activations or outputs in "
    "jmp_lite: it is a matmul recipe, whose matmuls quantize their operands "
    "to E2M1 with block scales and accumulate in float32. Write e.g. "
    "get_policy('mixed_nvfp4') or 'p=f32,c=bf16,o=f32,m=nvfp4' "
    "(docs/fp4.md)."
)

# The canonical form of each policy dtype: JAX's scalar type, as jmp returns
# them (``policy.compute_dtype is jnp.float16``; ``half_dtype()(2 ** 15)`` makes
# a scalar). One object per dtype, so equal policies compare and hash equal.
_SCALAR_TYPES: dict[np.dtype, type] = {
    np.dtype(jnp.float32): jnp.float32,
    np.dtype(jnp.float16): jnp.float16,
    np.dtype(jnp.bfloat16): jnp.bfloat16,
    np.dtype(jnp.float64): jnp.float64,
}


def half_dtype() -> type:
  """Returns the half-precision dtype for the current default backend.

  bfloat16 on TPU (which has no fast float16), float16 everywhere else — the
  same rule as jmp, and the same objects: JAX's scalar types, which are
  callable and compare equal to the matching ``numpy.dtype``.

  Returns:
    ``jnp.bfloat16`` on TPU, otherwise ``jnp.float16``.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.half_dtype() in (jnp.float16, jnp.bfloat16)
    True
    >>> jmp_lite.half_dtype()(2 ** 15).dtype == jmp_lite.half_dtype()
    True
  """
  on_tpu = jax.default_backend() == "tpu"
  return jnp.bfloat16 if on_tpu else jnp.float16


def parse_dtype(value: str) -> np.dtype | None:
  """Looks up a dtype name such as ``"f16"`` or ``"bfloat16"``.

  Case and surrounding whitespace are ignored. The callers raise for an
  unknown name (:func:`floating_dtype`, and ``get_policy`` with the spec).

  Args:
    value: one of ``full``, ``f32``, ``float32``, ``half``, ``f16``,
      ``float16``, ``bf16``, ``bfloat16``, ``f64``, ``float64``.

  Returns:
    The ``numpy.dtype``, or None if the name is unknown.
  """
  name = value.strip().lower()
  return np.dtype(half_dtype()) if name == "half" else _NAME_TO_DTYPE.get(name)


def _no_policy_dtype_hint(dtype: np.dtype, example: str) -> str:
  """Why ``dtype`` is refused, and what to write instead."""
  if dtype.name.startswith("float4"):
    return FP4_POLICY_DTYPE
  if is_floating(dtype) and dtype.itemsize == 1:
    return FLOAT8_POLICY_DTYPE
  return f"Use e.g. {example}."


def floating_dtype(dtype: Any, what: str = "dtype", *, policy: bool = True,
                   example: str = "jnp.float16 or 'bf16'") -> np.dtype:
  """The one dtype validator: a floating dtype given by the user.

  Args:
    dtype: a dtype name understood by :func:`parse_dtype` (or, with
      ``policy=False``, a numpy name such as ``"float8_e4m3fn"``), a
      ``numpy.dtype``, or a scalar type such as ``jnp.float16``.
    what: how to refer to the value in error messages.
    policy: only the dtypes a policy may hold (float32, float16, bfloat16,
      float64); ``False`` accepts every real floating dtype (float8 too).
    example: what to suggest in error messages.

  Returns:
    The canonical ``numpy.dtype``; equal inputs give equal, equally hashing
    outputs.

  Raises:
    TypeError: if ``dtype`` is not dtype-like (``None``, an object, an unknown
      name).
    ValueError: if it is a dtype but not an allowed floating one (or, with
      ``policy``, an unknown dtype name).
  """
  named = isinstance(dtype, str) and (
      policy or dtype.strip().lower() in DTYPE_NAMES)
  try:  # np.dtype(None) would silently mean float64.
    result = parse_dtype(dtype) if named else None if dtype is None else (
        np.dtype(dtype.strip() if isinstance(dtype, str) else dtype))
  except TypeError:
    result = None
  if result is None:  # An unknown policy dtype name is a ValueError (jmp's).
    raise (ValueError if named else TypeError)(
        f"{what} must be a floating dtype or a dtype name, got "
        f"{type(dtype).__name__}: {dtype!r}. Valid dtype names are: "
        f"{', '.join(DTYPE_NAMES)}; or use e.g. {example}.")
  if not is_floating(result) or (policy and result not in _DTYPE_NAMES):
    allowed = ("one of float32, float16, bfloat16 or float64" if policy
               else "a floating dtype")
    raise ValueError(f"{what} must be {allowed}, got {result.name}. "
                     f"{_no_policy_dtype_hint(result, example)}")
  return result


def canonical_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
  """A dtype a policy may hold (:func:`floating_dtype` with ``policy=True``)."""
  return floating_dtype(dtype, what)


def scalar_type(dtype: Any, what: str = "dtype") -> type:
  """The canonical form of a policy dtype: JAX's scalar type (``jnp.float16``).

  Accepts what :func:`canonical_dtype` accepts, and raises as it does.
  """
  return _SCALAR_TYPES[canonical_dtype(dtype, what)]


def dtype_name(dtype: Any) -> str:
  """Returns the short name ``str(policy)`` uses for a policy dtype."""
  return _DTYPE_NAMES[canonical_dtype(dtype)][0]


def is_floating(dtype: Any) -> bool:
  """Whether ``dtype`` is a real floating dtype (including bfloat16 and fp8)."""
  return bool(jnp.issubdtype(dtype, jnp.floating))


def at_least_f32(dtype: Any) -> np.dtype:
  """The dtype loss-scale arithmetic runs in: float64 stays, every other float
  (f16, bf16, fp8, f32) computes in float32.

  Same as ``promote_types(dtype, float32)`` for floats, but independent of
  ``jax_numpy_dtype_promotion`` (strict mode forbids bf16/f32 promotion).
  """
  dtype = np.dtype(dtype)
  return dtype if dtype == np.float64 else FLOAT32


def promote_floats(a: Any, b: Any) -> np.dtype:
  """The result dtype of an operation on two floating dtypes: JAX's floating
  promotion lattice (bf16 + f16 -> f32), spelled out so that it does not
  depend on ``jax_numpy_dtype_promotion`` (strict mode refuses it)."""
  a, b = np.dtype(a), np.dtype(b)
  if a == b:
    return a
  return np.dtype(np.float64) if np.dtype(np.float64) in (a, b) else FLOAT32


# -- the value grid of a narrower float format, in float32 arithmetic -----------
#
# The values of a float format with ``mantissa_bits`` explicit bits and
# smallest normal ``2**min_exponent`` between 2**e and 2**(e + 1) are the
# multiples of 2**(max(e, min_exponent) - mantissa_bits). Rounding a float32
# value to the format is then a multiplication by a power of two, a round
# (or floor), and a multiplication back, all exact; master_weights' low-memory
# updates (bfloat16, float16) and the float8 encodings round so.


def pow2(k: jax.Array) -> jax.Array:
  """``2.0**k`` in float32 for int32 ``k`` in [-126, 127], built from bits."""
  return lax.bitcast_convert_type(lax.shift_left(k + 127, 23), jnp.float32)


def spacing_exponent(x: jax.Array, mantissa_bits: int,
                     min_exponent: int) -> jax.Array:
  """``k`` (int32) such that ``2.0**k`` is the spacing of the format's values
  around float32 ``x`` (for a power of two, the spacing above it)."""
  magnitude = lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
  exponent = jnp.maximum(lax.shift_right_logical(magnitude, 23) - 127,
                         min_exponent)
  return exponent - mantissa_bits

