"""An int8 ``dot_general`` with an int8 backward pass: integer products.

:func:`int8_dot_general` has the signature of :func:`jax.lax.dot_general`
plus a static :class:`~jmp_lite._src.low_precision.recipes.Int8Config`, so
that ``functools.partial(int8_dot_general, config=...)`` can be Flax's
``dot_general`` or an autocast rule for ``dot_general_p``. It is for the
hardware with int8 matrix units and no float8 ones: TPU v4/v5e/v5p/v6e and
NVIDIA Ampere/Ada GPUs.

How it computes (every platform):

1. The operands are brought to the canonical form ``(B, M, K)`` /
   ``(B, N, K)`` as the float8 matmul brings them
   (:func:`~jmp_lite._src.low_precision.fp8_matmul.as_dot_general`).
2. **Each product quantizes each of its two operands along that product's
   own contracted axis** (:func:`quantize`): one float32 scale
   ``s = amax * float32(1 / 127)`` per row of the operand (all its other
   elements), or one per tensor (a SwitchBack weight), and
   ``q = clip(round(v * r), -127, 127)`` as int8 with the float32
   reciprocal ``r = 1 / s`` (one per row), rounding half to even
   (``jnp.round``; stochastic rounding of the incoming gradient as an
   option: ``floor(v * r + u)``, ``u`` uniform in ``[0, 1)``). Both are
   written as multiplications because XLA compiles a division by a
   constant or by a broadcast scale into one anyway (jax 0.10's XLA:CPU
   does), and which one it does must not change the result: as written,
   every compiler computes the same floats. A row whose scale is below the
   smallest normal float32 (amax 0, or below ``127 * 2**-126``, about
   1.5e-36, where ``r`` could overflow) gets ``s = 1`` (all its values
   quantize to 0). The amax element maps to exactly +-127; -128 is never
   produced: the range is symmetric. Rounded half to even, no value can
   pass 127 (the amax's quotient is within four float32 roundings of 127),
   so the clip is applied where it can bind: stochastic rounding.
3. The product is an integer product: ``dot_general`` of the two int8
   arrays with ``preferred_element_type=int32`` (``s8 x s8 -> s32``: the
   int8 matrix units' instruction on TPU and on NVIDIA GPUs), then one
   float32 rescale, ``float32(acc) * s_lhs * s_rhs`` (in that order). On
   CPU the int32 sum is exact, so the result equals an integer reference
   (int64 accumulation of the same int8 operands, the same rescale) bit for
   bit. A contraction longer than :data:`EXACT_INT32_LENGTH` (where
   ``127 * 127 * length`` could overflow int32) is split into chunks of
   :data:`CHUNK` whose int32 partial products are converted to float32,
   rescaled and summed in float32.
4. The three products of a linear: forward ``y = x W`` (the activation per
   row along K, the weight per output channel along K, or per tensor),
   input gradient ``dx = g W^T`` (the gradient per row along N, the weight
   requantized per input channel along N, or per tensor), weight gradient
   ``dW = x^T g`` (both along the token axis M). Each can be switched off
   (``Int8Config.quantize_forward``, ``quantize_input_gradient``,
   ``quantize_weight_gradient``): that product then runs on the operands in
   their own (compute) dtype with float32 accumulation.

**Non-finite values stay visible**: a NaN or inf makes its row's (or the
tensor's) scale inf (the amax is a float maximum of the magnitudes with
NaN taken as inf (:func:`magnitude`), so that no compiler can skip a NaN
in it, as XLA:CPU's float maximum can), which zeroes the row's finite
int8 values, and the rescale makes every output element that row feeds
non-finite (``acc * inf``: NaN where ``acc`` is 0). The NaN or inf element
itself converts as XLA converts a NaN to int8 (0 on CPU and GPU); whatever
it becomes, it only feeds those outputs.

**Second derivatives** are refused with a teaching error
(:data:`SECOND_ORDER_HELP`): the backward pass rounds to int8.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import dtypes as dtypes_lib
from jmp_lite._src.low_precision import collectives as collectives_lib
from jmp_lite._src.low_precision import fp4_matmul as fp4_matmul_lib
from jmp_lite._src.low_precision import fp8_matmul as fp8_matmul_lib
from jmp_lite._src.low_precision import recipes as recipes_lib
from jmp_lite._src.low_precision import scaling as scaling_lib

_F32 = np.dtype(np.float32)
Int8Config = recipes_lib.Int8Config
_DEFAULT_CONFIG = Int8Config()
INT8_MAX = recipes_lib.INT8_MAX

#: The longest contraction whose int32 sum of int8 x int8 products cannot
#: overflow: ``127 * 127 * length <= 2**31 - 1``.
EXACT_INT32_LENGTH = (2**31 - 1) // (INT8_MAX * INT8_MAX)
#: The chunk a longer contraction is split into (each chunk's int32 sum is
#: exact; the chunks are summed in float32).
CHUNK = 2**17

# (B, P, C) x (B, Q, C) -> (B, P, Q): every product in canonical form.
_DN = (((2,), (2,)), ((0,), (0,)))

SECOND_ORDER_HELP = (
    "A second derivative through an int8 matmul (jmp_lite.int8."
    "dot_general, or a policy with m=int8 / m=int8_switchback) is not "
    "supported: its backward pass rounds the gradient to int8, which has no "
    "useful derivative. For a gradient penalty or a Hessian-vector product, "
    "run that part of the model outside the int8 recipe (e.g. a 16-bit "
    "policy for it: jmp_lite.with_policy(f, 'mixed_bfloat16')), or use a "
    "float8 recipe, whose second derivatives are straight-through."
)


# ---------------------------------------------------------------------------
# The quantizer.
# ---------------------------------------------------------------------------


def quantize(x: jax.Array, *, axis: int = -1, per_tensor: bool = False,
             key: Any = None, axis_name: Any = None,
             shared_over: Any = None) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 of ``x`` along ``axis`` (the contracted one).

  Args:
    x: a floating array.
    axis: the axis a product contracts (default the last).
    per_tensor: one scale for the whole array (else one per row: every
      element of the other axes).
    key: a PRNG key for stochastic rounding (``floor(v + u)``), or None for
      round half to even.
    axis_name: with ``per_tensor``, the mapped axis over which the amax is
      reduced (``lax.pmax``), or None.
    shared_over: mapped axes over which every amax (per tensor or per row)
      is also reduced: the shards of an FSDP weight along ``axis``, under
      ``shard_map``.

  Returns:
    ``(q, scale)``: int8 values in ``[-127, 127]`` shaped as ``x``, and the
    float32 scale (``amax * float32(1 / 127)``; 1 where that is below the
    smallest normal float32: :func:`scale_from_amax`) shaped as ``x``
    with ``axis`` (and, per tensor, every axis) of size 1, so that
    ``q * scale`` dequantizes.
  """
  x = x.astype(_F32)
  axes = tuple(range(x.ndim)) if per_tensor else (axis % x.ndim,)
  amax = amax_of(x, axes, scaling_lib.joined_axis_names(
      axis_name if per_tensor else None, shared_over))
  scale = scale_from_amax(amax)
  # Stochastic rounding can reach 128 (the amax plus u): clipped.
  return rounded(x, scale, key, clip=key is not None), scale


def magnitude(x: jax.Array) -> jax.Array:
  """float32 ``|x|``, with ``+inf`` in place of a NaN. A float maximum over
  these is the amax, ``inf`` wherever a NaN or an inf is met: XLA:CPU's
  float maximum can skip a NaN (in a row reduction of 128 elements, a
  scatter-max, ``lax.pmax`` across replicas), never an inf. Computed on
  the bits (the sign cleared, then at most inf's pattern, which every NaN's
  exceeds), so that no inf is made where there was none (``jax_debug_infs``
  stays quiet). An infinite scale zeroes the row's finite int8 values and
  makes every output it feeds non-finite (``acc * inf``), as a NaN scale
  would."""
  bits = jax.lax.bitcast_convert_type(
      jax.lax.convert_element_type(x, _F32), jnp.int32)
  bits = jax.lax.min(jax.lax.bitwise_and(bits, _MAGNITUDE_MASK), _INF_BITS)
  return jax.lax.bitcast_convert_type(bits, _F32)


#: The magnitude bits of a float32, and +inf's pattern (below every NaN's).
_MAGNITUDE_MASK = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)


def amax_of(x: jax.Array, axes: Any, axis_name: Any = None) -> jax.Array:
  """float32 ``max |x|`` over ``axes`` (kept as size 1), and over the mapped
  axis ``axis_name`` when given; 0 for no elements; inf where a NaN or an
  inf is met (:func:`magnitude`)."""
  kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
  if all(x.shape[i] for i in axes):
    amax = jax.lax.reduce_max(magnitude(x), axes).reshape(kept)
  else:                                     # nothing to reduce: amax 0
    amax = jnp.zeros(kept, _F32)
  if axis_name is not None:
    amax = jax.lax.pmax(amax, axis_name)
  return amax


#: float32 ``1 / 127``: a scale is ``amax * INV_INT8_MAX`` (what XLA makes
#: of ``amax / 127`` anyway, written so that no compiler differs).
INV_INT8_MAX = np.float32(1) / np.float32(INT8_MAX)
#: The smallest normal float32: a smaller scale is replaced by 1 (its
#: reciprocal could overflow to inf).
_TINY = np.float32(np.finfo(np.float32).tiny)


def scale_from_amax(amax: jax.Array) -> jax.Array:
  """float32 ``amax * float32(1 / 127)``; 1 where that is below the smallest
  normal float32 (an all-zero row, or an amax below ``127 * 2**-126`` whose
  reciprocal scale could overflow; its values all quantize to 0); NaN and
  inf stay as they are."""
  scale = amax.astype(_F32) * INV_INT8_MAX
  return jax.lax.select(scale < _TINY, jnp.ones_like(scale), scale)


def rounded(x: jax.Array, scale: jax.Array, key: Any = None, *,
            clip: bool = True) -> jax.Array:
  """int8 ``clip(round(x * (1 / scale)), -127, 127)`` (``scale``
  broadcasting against ``x``; its float32 reciprocal taken first, one per
  scale): half to even, or ``floor(x * (1 / scale) + u)`` with ``key``.

  ``clip=False`` where no value can pass 127.5 in magnitude: a scale from
  this data's own amax (:func:`quantize`) rounded half to even, where
  ``|x| * r <= amax * fl(1 / fl(amax * fl(1 / 127)))``, within four float32
  roundings of 127 (``127 * (1 + 2**-22)`` at most), rounds to at most 127.
  The conversion to int8 is XLA's (the same on CPU and GPU: saturating,
  NaN to 0). A NaN product (a NaN or inf element, whose scale is inf) is
  left to it: whatever int8 it becomes, every output it feeds is
  ``acc * inf``, non-finite."""
  v = jax.lax.convert_element_type(x, _F32) * (np.float32(1) / scale)
  if key is None:
    v = jax.lax.round(v, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  else:
    v = jnp.floor(v + jax.random.uniform(key, v.shape, _F32))
  if clip:
    v = jax.lax.clamp(np.float32(-INT8_MAX), v, np.float32(INT8_MAX))
  return jax.lax.convert_element_type(v, jnp.int8)


def _product(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
             contract: tuple[int, int] = (2, 2)) -> jax.Array:
  """``(B, P, .) x (B, ., Q) -> (B, P, Q)`` float32: the int32 product of
  the int8 operands contracting axes ``contract`` (the lhs's free axis is
  the other of 1 and 2, and likewise the rhs's), rescaled once:
  ``acc * sa * sb`` with the scales laid out as ``(B, P, 1)`` and
  ``(B, 1, Q)`` (reshapes of the quantizer's, whose contracted axis has
  size 1)."""
  (ca, cb) = contract
  sa = sa.reshape(sa.shape[0], -1, 1)
  sb = sb.reshape(sb.shape[0], 1, -1)
  length = qa.shape[ca]
  if length > EXACT_INT32_LENGTH:
    # Chunks whose int32 sums are exact, summed in float32: the contracted
    # axes moved last (a long contraction is rare; a copy is fine there).
    qa, qb = jnp.moveaxis(qa, ca, 2), jnp.moveaxis(qb, cb, 2)
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length

    def split(q):
      q = jnp.pad(q, ((0, 0), (0, 0), (0, pad)))
      b, p = q.shape[:2]
      return jnp.moveaxis(q.reshape(b, p, chunks, CHUNK), 2, 1).reshape(
          b * chunks, p, CHUNK)

    bsz, p, q = qa.shape[0], qa.shape[1], qb.shape[1]
    acc = jax.lax.dot_general(split(qa), split(qb), _DN,
                              preferred_element_type=jnp.int32)
    acc = acc.reshape(bsz, chunks, p, q).astype(_F32)
    return jnp.sum(acc * sa[:, None] * sb[:, None], axis=1)
  acc = jax.lax.dot_general(qa, qb, (((ca,), (cb,)), ((0,), (0,))),
                            preferred_element_type=jnp.int32)
  return acc.astype(_F32) * sa * sb


def _high(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
  """A product left in high precision: the operands in their common dtype
  (the compute dtype under a policy), float32 accumulation."""
  common = jnp.promote_types(a.dtype, b.dtype)
  return jax.lax.dot_general(a.astype(common), b.astype(common), dn,
                             preferred_element_type=_F32)


# ---------------------------------------------------------------------------
# The custom gradient.
# ---------------------------------------------------------------------------


class _Static(NamedTuple):
  """The static arguments of the custom-gradient matmul (hashable)."""

  config: Int8Config
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _weight(b: jax.Array, config: Int8Config,
            axis: int = 2) -> tuple[jax.Array, jax.Array]:
  """The weight ``(B, N, K)`` quantized along ``axis`` (K forward, N for
  the input gradient): per channel (row) or per tensor; with
  ``config.fsdp_axis``, all-gathered as its int8 bits and scales (quantize,
  then gather). Under ``jax.shard_map`` ``b`` is this device's shard along
  K: amaxes along K are max-reduced over the shards, and the shard (with
  its per-K scales) is gathered along K; under ``jax.jit`` the partitioner
  gathers it."""
  fsdp = collectives_lib.manual_fsdp_axis(config)
  per_tensor = config.weight_granularity == "tensor"
  q, scale = quantize(b, axis=axis, per_tensor=per_tensor,
                      axis_name=config.axis_name,
                      shared_over=fsdp if axis == 2 or per_tensor else None)
  if config.fsdp_axis is None:
    return q, scale
  scale_along = axis != 2 and not per_tensor    # (B, 1, K): one per k
  return (collectives_lib.fsdp_gathered(q, config, 2),
          collectives_lib.fsdp_gathered(scale, config, 2, scale_along))


def _whole(b: jax.Array, config: Int8Config) -> jax.Array:
  """The weight ``(B, N, K)`` for a product left in high precision: under
  ``jax.shard_map`` with ``config.fsdp_axis`` the shard gathered along K in
  its own dtype (the switch that left the product unquantized asked for
  that width); else ``b``."""
  fsdp = collectives_lib.manual_fsdp_axis(config)
  return b if fsdp is None else collectives_lib.manual_gathered(b, fsdp, 2)


def _forward(a: jax.Array, b: jax.Array, config: Int8Config):
  """float32 ``(B, M, N)`` and the int8 weight with its scale (None where
  the forward is not quantized)."""
  if not config.quantize_forward:
    return _high(a, _whole(b, config), _DN), None
  qa, sa = quantize(a)
  qb, sb = _weight(b, config)
  return _product(qa, sa, qb, sb), (qb, sb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _int8_matmul(a, b, static):
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` in int8, result in out_dtype."""
  return _forward(a, b, static.config)[0].astype(static.out_dtype)


def _int8_matmul_fwd(a, b, static):
  out, weight = _forward(a, b, static.config)
  # A tensor-wise weight scale fits any contraction: the input gradient
  # reuses the forward's int8 weight (the same values a requantization
  # would give), a quarter of a float32 copy.
  reuse = static.config.weight_granularity == "tensor"
  return out.astype(static.out_dtype), (a, b, weight if reuse else None)


def backward_products(a: jax.Array, b: jax.Array, g: jax.Array,
                      config: Int8Config,
                      weight: Any = None) -> tuple[jax.Array, jax.Array]:
  """float32 ``(dlhs (B, M, K), drhs (B, N, K))`` for ``g`` ``(B, M, N)``;
  ``weight``: the forward's int8 weight and scale, where they fit the
  input gradient's contraction (per tensor)."""
  if config.stochastic_rounding:
    key = fp4_matmul_lib.data_key(g)
    dgrad_key, wgrad_key = (jax.random.fold_in(key, 0),
                            jax.random.fold_in(key, 1))
  else:
    dgrad_key = wgrad_key = None
  # dlhs = g @ W^T, contracting N: g per row along N, the weight per input
  # channel along N (or per tensor).
  if config.quantize_input_gradient:
    qg, sg = quantize(g, key=dgrad_key)                       # (B, M, 1)
    qb, sb = weight if weight is not None else _weight(b, config, axis=1)
    da = _product(qg, sg, qb, sb, contract=(2, 1))           # sb (B, 1, K)
  else:
    da = _high(g, _whole(b, config), (((2,), (1,)), ((0,), (0,))))
  # drhs = g^T @ x, contracting the token axis M: both per column along M.
  if config.quantize_weight_gradient:
    qg, sg = quantize(g, axis=1, key=wgrad_key)               # (B, 1, N)
    qa, sa = quantize(a, axis=1)                              # (B, 1, K)
    db = _product(qg, sg, qa, sa, contract=(1, 1))
  else:
    db = _high(g, a, (((1,), (1,)), ((0,), (0,))))
  fsdp = collectives_lib.manual_fsdp_axis(config)
  if fsdp is not None:
    # The gradient of this device's shard along K: the sum over the shards
    # of their whole-weight gradients, scattered (all_gather's derivative).
    db = collectives_lib.manual_scattered(db, fsdp, 2)
  return da, db


def _int8_matmul_bwd(static, residuals, g):
  a, b, weight = residuals
  # Whatever would differentiate the backward pass (a second derivative)
  # meets the refusal.
  a, b, g = _first_order_only(a), _first_order_only(b), _first_order_only(g)
  # JAX calls a custom_vjp's bwd once per call site; jitted (inline=True), a
  # deep model's matmuls of one shape share one trace of it.
  return _backward(a, b, g, weight, static=static)


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(a, b, g, weight, *, static):
  """The int8 backward pass of :func:`_int8_matmul`, in the operands'
  dtypes."""
  da, db = backward_products(a, b, g, static.config, weight)
  return da.astype(static.lhs_dtype), db.astype(static.rhs_dtype)


_int8_matmul.defvjp(_int8_matmul_fwd, _int8_matmul_bwd)

_first_order_only = fp8_matmul_lib.first_order_only(SECOND_ORDER_HELP)


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def _operand(x: Any, what: str) -> jax.Array:
  """A high-precision operand (float32, bfloat16, float16, float64): the one
  dtype validator refuses int8, float8 and other non-floating operands (the
  matmul quantizes them itself, with scales from the high-precision
  values)."""
  x = jnp.asarray(x)
  dtypes_lib.canonical_dtype(x.dtype, f"jmp_lite.int8.dot_general's {what}")
  return x


def int8_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any,
                     precision: Any = None, preferred_element_type: Any = None,
                     *, out_sharding: Any = None,
                     config: Int8Config = _DEFAULT_CONFIG) -> jax.Array:
  """``jax.lax.dot_general`` as int8 integer products, forward and backward.

  Each product quantizes its operands to symmetric int8 (``[-127, 127]``,
  round half to even) with float32 scales along its contracted axis (per
  row; the weight, the rhs, per output channel or per tensor), multiplies
  ``s8 x s8 -> s32`` and rescales once in float32. The backward pass does
  the same for the input gradient and the weight gradient (each can be left
  in the compute dtype). Exact on CPU against an integer reference; see
  ``docs/int8.md``.

  Args:
    lhs: a float32, bfloat16 or float16 array (the activation).
    rhs: likewise (the weight).
    dimension_numbers: as for ``jax.lax.dot_general``.
    precision: accepted for signature compatibility and ignored.
    preferred_element_type: the result dtype (float32, bfloat16, float16,
      float64). Default: the operands' (promoted) dtype.
    out_sharding: under explicit sharding (mesh axes of type Explicit), the
      result's sharding as ``jax.lax.dot_general`` takes it; elsewhere None.
    config: the static :class:`Int8Config` (default: the ``int8`` recipe).

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.

  Raises:
    TypeError: for a config that is not an ``Int8Config``, or malformed
      dimension numbers.
    ValueError: for non-floating operands or ``preferred_element_type``, a
      ``config.axis_name`` that is not bound here, an ``out_sharding`` for
      operands on no mesh with Explicit axes, or (when differentiated) a
      second derivative.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import int8
    >>> def loss(w, x):
    ...   return int8.dot_general(x, w, (((1,), (0,)), ((), ()))).sum()
    >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
    >>> float(loss(w, x)), jax.jit(jax.grad(loss))(w, x).shape
    (4096.0, (32, 16))
  """
  if not isinstance(config, Int8Config):
    raise TypeError(
        f"config must be an Int8Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Int8Config('int8').")
  lhs = _operand(lhs, "lhs")
  rhs = _operand(rhs, "rhs")
  del precision
  fp8_matmul_lib.check_axis_bound(config)
  dimension_numbers = checks.dimension_numbers(
      dimension_numbers, lhs.shape, collectives_lib.fsdp_weight_shape(
          lhs, rhs, dimension_numbers, config, "jmp_lite.int8.dot_general"),
      "jmp_lite.int8.dot_general")
  out_dtype = fp8_matmul_lib.result_dtype(lhs, rhs, preferred_element_type)
  static = _Static(config, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  return fp8_matmul_lib.as_dot_general(
      _int8_matmul, static, lhs, rhs, dimension_numbers, out_dtype,
      out_sharding, "jmp_lite.int8.dot_general")
