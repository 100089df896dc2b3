"""An FP4 ``dot_general`` (NVFP4, MXFP4) with an FP4 backward pass.

:func:`fp4_dot_general` has ``jax.lax.dot_general``'s signature plus a static
:class:`Fp4Config`. How it computes (the guide: ``docs/fp4.md``):

1. Each operand is brought to the canonical form ``(B, M, K)`` / ``(B, N, K)``
   (batch, free, contracting dimensions), as the float8 matmul does.
2. Forward: both operands are quantized to FP4 with round-to-nearest-even
   along K (:mod:`~jmp_lite._src.low_precision.fp4`); the **rhs is the weight** by
   convention (Flax's ``Dense`` calls ``dot_general(inputs, kernel, ...)``):
   with NVFP4 and ``two_d_weights`` it is quantized in 16x16 tiles over
   ``(N, K)``, so the backward pass sees the same quantized weight. The block
   scales multiply the E2M1 values (exact in float32), one float32 dot
   accumulates, and the tensor scales multiply the float32 result.
3. Backward, with the incoming gradient ``g`` (``(B, M, N)``):

   * ``dlhs = g @ W^T`` contracts over N: ``g`` quantized along N (stochastic
     rounding if ``config.stochastic_rounding``), the weight's column-wise
     copy quantized along N from the high-precision weight (with 16x16 tiles:
     the same values as the forward's copy);
   * ``drhs = g^T @ x`` contracts over M (every row of every batch element):
     both operands are transformed by the 16-point random Hadamard transform
     along M (``config.rht``; the amax is taken after the transform), then
     quantized along M, ``g`` with stochastic rounding.

Contracting dimensions that are not multiples of the block size (16 or 32)
are zero-padded: exact, since the padding adds nothing to a dot product and
changes no block's amax (nor, for M, the Hadamard transform of any real
element's block beyond adding zeros). 16x16 weight tiles pad N too.

**Stochastic rounding needs random bits**: pass ``key`` (a PRNG key; a
training step folds its step counter into a base key,
``jax.random.fold_in(key, step)``, and each matmul needs its own, e.g.
folded with the layer index). With ``key=None`` the bits are derived from
the incoming gradient's bits (a wrapping sum of them folded into a fixed
key): deterministic and reproducible, different whenever the gradient is,
but correlated across matmuls that see the same gradient.

**NaN and inf stay visible**: an operand or gradient holding NaN or inf gives
a NaN product (the whole product: the flag travels in the tensor scale,
which multiplies the float32 result on every platform).

**Data parallel**: with ``config.axis_name`` (a ``pmap``/``shard_map`` axis)
every operand's tensor amax and NaN flag are reduced over that axis
(``lax.pmax``/``lax.psum``), so that the replicas share NVFP4's tensor
scales and see a NaN wherever the unsharded product would; block scales
(NVFP4's and MXFP4's) are local by construction.

**The platform**: where the program is lowered for CUDA (and
``config.native``), the block-scaled product is ``jax.nn.scaled_matmul`` on
the ``float4_e2m1fn`` values and the E4M3 (NVFP4) or E8M0 (MXFP4) scales:
the ``__op$block_scaled_dot`` custom call, which XLA:GPU turns into a cuDNN
block-scaled GEMM on Blackwell and into a dequantize-then-dot elsewhere.
Everywhere else it is the exact emulation: the dequantized operands (exact in
float32; MXFP4's lifted by ``2**2`` so that XLA:CPU flushes none of a
``2**-127`` block's elements, see ``_emulated``) and one float32
``dot_general``. The choice is made by
``jax.lax.platform_dependent``, by the platform the program is lowered for.
Exporting the CUDA program needs ``disabled_checks=[jax.export.\
DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]``.

Second derivatives through the FP4 backward pass are refused with a
``ValueError`` (the backward pass rounds; its derivative would be silently
zero).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import dtypes as dtypes_lib
from jmp_lite._src.low_precision import recipes as recipes_lib
from jmp_lite._src.low_precision import fp4 as fp4_lib
from jmp_lite._src.low_precision import fp8_matmul as fp8_matmul_lib

_F32 = np.dtype(np.float32)

#: The FP4 recipes (the recipe layer's names).
FP4_RECIPES = recipes_lib.FP4_RECIPES
#: The fixed key that ``key=None`` folds the gradient's bits into.
DATA_KEY_SEED = 0x4F50

SECOND_ORDER_HELP = (
    "jmp_lite.fp4.dot_general has no second derivative: its backward pass "
    "quantizes (rounds) the gradient and the operands, so differentiating it would "
    "silently give zero. Compute gradient penalties and Hessian-vector "
    "products of this part of the model in high precision (jax.lax."
    "dot_general), or stop the gradient through it."
)


#: The FP4 recipe object (data, in the recipe layer below: a policy resolves
#: ``m=nvfp4`` to it).
Fp4Config = recipes_lib.Fp4Config


_DEFAULT_CONFIG = Fp4Config()


# ---------------------------------------------------------------------------
# Quantized operands and their product.
# ---------------------------------------------------------------------------


class _Operand(NamedTuple):
  """A ``(B, P, C)`` FP4 operand of a product over C (C padded to blocks).

  ``values`` float32 on the E2M1 grid; ``scales`` float32 E4M3 values
  (NVFP4) or uint8 E8M0 codes (MXFP4), ``(B, P, C // block)``;
  ``tensor_scale`` a float32 scalar (NVFP4: ``1 / S_enc``; MXFP4: 1) that is
  NaN if the operand held NaN or inf.
  """

  values: jax.Array
  scales: jax.Array
  tensor_scale: jax.Array


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _quantize(x: jax.Array, config: Fp4Config, *, two_d: bool = False,
              key: Any = None) -> _Operand:
  """Quantizes ``(B, P, C)`` along C (padding C, and P for 2D tiles)."""
  x = _pad_axis(x.astype(_F32), -1, config.block_size)
  if config.recipe == "nvfp4":
    if two_d:
      x = _pad_axis(x, -2, fp4_lib.NVFP4_BLOCK_SIZE)
    values, scales, tensor_scale = fp4_lib.nvfp4_quantize_f32(
        x, two_d=two_d, key=key, axis_name=config.axis_name)
  else:
    values, scales = fp4_lib.mxfp4_quantize_f32(
        x, rule=config.mx_scale_rule, key=key)
    _, poison = fp4_lib.global_tensor_stats(
        jnp.zeros((), _F32), fp4_lib.nonfinite_poison(x), config.axis_name)
    tensor_scale = jnp.ones((), _F32) + poison
  return jax.lax.stop_gradient(_Operand(values, scales, tensor_scale))


_DN = (((2,), (2,)), ((0,), (0,)))  # (B, P, C) x (B, Q, C) -> (B, P, Q)


def _dequantized_blocks(values: jax.Array, scales: jax.Array,
                        shift: Any = 0) -> jax.Array:
  """float32 ``values`` times their block scales (exact); E8M0 scales
  (uint8 codes) times ``2**shift`` too."""
  b, p, c = values.shape
  nb = scales.shape[-1]
  blocks = values.reshape(b, p, nb, c // nb)
  if np.dtype(scales.dtype) == np.dtype(np.uint8):
    full = fp4_lib.scale_e8m0_blocks(blocks, scales, shift)
  else:
    full = blocks * scales.astype(_F32)[..., None]
  return full.reshape(b, p, c)


#: MXFP4's emulated product lifts each dequantized operand by ``2**2``: its
#: smallest nonzero element ``0.5 * 2**-127`` becomes a normal float32.
_MX_LIFT = 2


def mx_top_exponent(codes: jax.Array, axis: Any = None) -> jax.Array:
  """int32: the largest finite block exponent ``k`` of E8M0 ``codes`` (over
  ``axis``; all of them for None), at least -127 (NaN codes count as 0)."""
  k = jnp.where(codes == 255, jnp.zeros((), jnp.int32),
                codes.astype(jnp.int32) - 127)
  return jnp.max(k, axis=axis, initial=-127)


def mx_lift(ka: jax.Array, kb: jax.Array, log_c: Any) -> jax.Array:
  """int32 ``_MX_LIFT`` where lifting both MXFP4 operands, of top block
  exponents ``ka`` and ``kb``, by it can overflow no element and no partial
  sum of a dot over ``c <= 2**log_c`` elements, else 0 (elementwise)."""
  # |element| <= 6 * 2**k < 2**(k + 3); a sum of c products < 2**(ka + kb +
  # 6 + log2(c)).
  bound = 3 + _MX_LIFT
  safe = ((ka + bound <= 127) & (kb + bound <= 127) &
          (ka + kb + 2 * bound + log_c <= 127))
  return jnp.where(safe, jnp.asarray(_MX_LIFT, jnp.int32),
                   jnp.zeros((), jnp.int32))


def _mx_lift(a_scales: jax.Array, b_scales: jax.Array, c: int) -> jax.Array:
  """int32 ``_MX_LIFT`` where lifting both MXFP4 operands by it can
  overflow no element and no partial sum of the dot over ``c``, else 0."""
  log_c = int(np.ceil(np.log2(max(c, 1))))
  return mx_lift(mx_top_exponent(a_scales), mx_top_exponent(b_scales), log_c)


def _emulated(a_values, a_scales, b_values, b_scales):
  """The exact emulation: one float32 dot of the dequantized operands.

  MXFP4's operands are dequantized lifted by ``2**2`` each (where nothing
  can overflow) and the product brought back by ``2**-4`` with
  :func:`~jmp_lite._src.low_precision.fp4.mul_pow2`: a block with scale ``2**-127`` or
  ``2**-126`` dequantizes to float32 subnormals that XLA:CPU flushes to
  zero, where the GPU's block-scaled product keeps them."""
  mx = np.dtype(a_scales.dtype) == np.dtype(np.uint8)  # E8M0 codes
  shift = _mx_lift(a_scales, b_scales, a_values.shape[-1]) if mx else 0
  acc = jax.lax.dot_general(
      _dequantized_blocks(a_values, a_scales, shift),
      _dequantized_blocks(b_values, b_scales, shift), _DN,
      precision=jax.lax.Precision.HIGHEST, preferred_element_type=_F32)
  return fp4_lib.mul_pow2(acc, -2 * shift) if mx else acc


def _encoded_scales(scales: jax.Array) -> jax.Array:
  if np.dtype(scales.dtype) == np.dtype(np.uint8):
    return jax.lax.bitcast_convert_type(scales, fp4_lib.E8M0_DTYPE)
  return scales.astype(fp4_lib.E4M3_DTYPE)


@jax.custom_batching.custom_vmap
def _native(a_values, a_scales, b_values, b_scales):
  """FP4 on the GPU: ``jax.nn.scaled_matmul`` on E2M1 values and encoded
  block scales (``__op$block_scaled_dot``)."""
  return jax.nn.scaled_matmul(
      a_values.astype(fp4_lib.E2M1_DTYPE), b_values.astype(fp4_lib.E2M1_DTYPE),
      _encoded_scales(a_scales), _encoded_scales(b_scales),
      preferred_element_type=_F32)


@_native.def_vmap
def _native_vmap(axis_size, in_batched, *args):
  # scaled_matmul's batching rule wants every operand batched on one axis:
  # fold the mapped axis into B instead, broadcasting unbatched operands.
  flat = []
  for x, batched in zip(args, in_batched):
    if not batched:
      x = jnp.broadcast_to(x[None], (axis_size,) + x.shape)
    flat.append(x.reshape((-1,) + x.shape[2:]))
  out = _native(*flat)
  return out.reshape((axis_size, -1) + out.shape[1:]), True


def _product(a: _Operand, b: _Operand, config: Fp4Config, p: int,
             q: int) -> jax.Array:
  """float32 ``(B, p, q)``: the scaled product of two FP4 operands."""
  args = (a.values, a.scales, b.values, b.scales)
  if config.native:
    acc = jax.lax.platform_dependent(*args, cuda=compat.varying_like(_native),
                                     default=_emulated)
  else:
    acc = _emulated(*args)
  acc = acc[:, :p, :q]
  return apply_tensor_scales(acc, a.tensor_scale, b.tensor_scale)


def apply_tensor_scales(acc: jax.Array, a_scale: jax.Array,
                        b_scale: jax.Array) -> jax.Array:
  """``acc * (a_scale * b_scale)`` (cuBLAS's alpha) where that product is a
  normal float32, else ``(acc * a_scale) * b_scale`` (tiny or huge amaxes);
  NaN if either scale is NaN. A tensor scale may be a float32 subnormal
  (NVFP4's ``1 / S_enc`` for an amax below 3.2e-35): each is carried lifted
  to a normal float32 (:func:`~jmp_lite._src.low_precision.fp4.lift_scale`) and the
  lift taken back with exact powers of two, as the float8 matmul applies a
  scale product that is no normal float32, so that the result is right
  wherever it is a normal float32."""
  a_lifted, a_lift = fp4_lib.lift_scale(a_scale)
  b_lifted, b_lift = fp4_lib.lift_scale(b_scale)
  lift = a_lift + b_lift
  alpha = a_lifted * b_lifted                          # a * b * 2**lift
  normal = jnp.isfinite(alpha) & (alpha >= dtypes_lib.pow2(lift - 126))
  alpha = fp4_lib.mul_pow2(jnp.where(normal, alpha, jnp.ones((), _F32)),
                           -lift)
  split = fp4_lib.mul_pow2((acc * a_lifted) * b_lifted, -lift)
  return jnp.where(normal, acc * alpha, split)


# ---------------------------------------------------------------------------
# Stochastic-rounding keys.
# ---------------------------------------------------------------------------


def data_key(g: jax.Array) -> jax.Array:
  """A PRNG key derived from the bits of float32 ``g`` (``key=None``)."""
  bits = jax.lax.bitcast_convert_type(g.astype(_F32), jnp.uint32)
  digest = jnp.sum(bits, dtype=jnp.uint32) ^ jnp.uint32(g.size & 0xFFFFFFFF)
  return jax.random.fold_in(jax.random.key(DATA_KEY_SEED), digest)


# ---------------------------------------------------------------------------
# The custom gradient.
# ---------------------------------------------------------------------------


class _Static(NamedTuple):
  config: Fp4Config
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _forward(a, b, config):
  if not config.quantize_forward:   # the late switch: high precision
    if a.dtype != b.dtype:
      a, b = a.astype(_F32), b.astype(_F32)
    return jax.lax.dot_general(a, b, _DN, preferred_element_type=_F32)
  qa = _quantize(a, config)
  qb = _quantize(b, config, two_d=config.two_d_weights)
  return _product(qa, qb, config, a.shape[1], b.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp4_matmul(a, b, key, static):
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` in FP4, result in out_dtype."""
  del key
  return _forward(a, b, static.config).astype(static.out_dtype)


def _fp4_matmul_fwd(a, b, key, static):
  out = _forward(a, b, static.config).astype(static.out_dtype)
  return out, (a, b, key)


def backward_products(a, b, g, key, config):
  """float32 ``(dlhs (B, M, K), drhs (B, N, K))`` for ``g`` ``(B, M, N)``."""
  g = g.astype(_F32)
  if config.stochastic_rounding:
    key = data_key(g) if key is None else key
    dgrad_key = jax.random.fold_in(key, 0)
    wgrad_key = jax.random.fold_in(key, 1)
  else:
    dgrad_key = wgrad_key = None
  m, n, k = a.shape[1], b.shape[1], a.shape[2]
  # dlhs = g @ W^T over N; the weight's column-wise copy from high precision.
  qg = _quantize(g, config, key=dgrad_key)
  qbt = _quantize(jnp.swapaxes(b, 1, 2), config, two_d=config.two_d_weights)
  da = _product(qg, qbt, config, m, k)
  # drhs = g^T @ x over M, both transformed along M.
  gt = jnp.swapaxes(g, 1, 2)
  at = jnp.swapaxes(a, 1, 2).astype(_F32)
  if config.rht:
    gt = fp4_lib.hadamard_f32(_pad_axis(gt, -1, fp4_lib.RHT_SIZE))
    at = fp4_lib.hadamard_f32(_pad_axis(at, -1, fp4_lib.RHT_SIZE))
  db = _product(_quantize(gt, config, key=wgrad_key), _quantize(at, config),
                config, n, k)
  return da, db


def _fp4_matmul_bwd(static, residuals, g):
  a, b, key = residuals
  # Whatever would differentiate the backward pass (a second derivative)
  # meets _first_order_only's refusal.
  a, b, g = _first_order_only(a), _first_order_only(b), _first_order_only(g)
  # JAX calls a custom_vjp's bwd once per call site; jitted (inline=True), a
  # deep model's matmuls of one shape share one trace of it.
  return _backward(a, b, g, key, static=static) + (None,)


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(a, b, g, key, *, static):
  """The FP4 backward pass of :func:`_fp4_matmul`, in the operands'
  dtypes."""
  da, db = backward_products(a, b, g, key, static.config)
  return da.astype(static.lhs_dtype), db.astype(static.rhs_dtype)


_fp4_matmul.defvjp(_fp4_matmul_fwd, _fp4_matmul_bwd)


_first_order_only = fp8_matmul_lib.first_order_only(SECOND_ORDER_HELP)


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def _operand(x: Any, what: str) -> jax.Array:
  """A high-precision operand (float32, bfloat16, float16, float64): the one
  dtype validator refuses FP4, float8 and non-floating operands (the matmul
  quantizes them itself, with scales computed from the high-precision
  values); JAX refuses what is no array."""
  x = jnp.asarray(x)
  dtypes_lib.canonical_dtype(x.dtype, f"jmp_lite.fp4.dot_general's {what}")
  return x


def fp4_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any,
                    precision: Any = None, preferred_element_type: Any = None,
                    *, out_sharding: Any = None,
                    config: Fp4Config = _DEFAULT_CONFIG,
                    key: Any = None) -> jax.Array:
  """``jax.lax.dot_general`` in FP4 (NVFP4 or MXFP4), forward and backward.

  Both operands are quantized to E2M1 with block scales (round to nearest
  even), multiplied with float32 accumulation, and the result is
  dequantized. The rhs is treated as the weight (16x16 tiles with NVFP4).
  The backward pass quantizes the incoming gradient (stochastic rounding)
  and computes both operand gradients with FP4 matmuls, the weight gradient
  on random-Hadamard-transformed operands. See ``docs/fp4.md``.

  Args:
    lhs: a float32, bfloat16 or float16 array (the activation).
    rhs: likewise (the weight).
    dimension_numbers: as for ``jax.lax.dot_general``.
    precision: accepted for signature compatibility and ignored.
    preferred_element_type: the result dtype (float32, bfloat16, float16,
      float64); accumulation is float32 regardless. Default: the operands'
      (promoted) dtype.
    out_sharding: under explicit sharding (mesh axes of type Explicit,
      ``jax.make_mesh``'s default), the result's sharding as
      ``jax.lax.dot_general`` takes it: needed only where JAX cannot infer
      it (a contraction over a sharded axis). None infers it as
      ``jax.lax.dot_general`` does. Elsewhere it must be None.
    config: the static :class:`Fp4Config` (default: NVFP4 with every
      component on).
    key: a PRNG key for the backward pass's stochastic rounding, e.g.
      ``jax.random.fold_in(base_key, step)``; None derives one from the
      gradient's bits (deterministic).

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.

  Raises:
    TypeError: for a config that is not an ``Fp4Config``, or malformed or
      inconsistent dimension numbers.
    ValueError: for non-floating, float8 or FP4 operands or
      ``preferred_element_type``, or a ``config.axis_name`` that is not
      bound (outside the ``pmap``/``shard_map`` that names it), or an
      ``out_sharding`` for operands on no mesh with Explicit axes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import fp4
    >>> def loss(w, x, key):
    ...   y = fp4.dot_general(x, w, (((1,), (0,)), ((), ())), key=key)
    ...   return y.sum()
    >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
    >>> g = jax.jit(jax.grad(loss))(w, x, jax.random.key(0))
    >>> float(loss(w, x, None)), g.shape
    (4096.0, (32, 16))
  """
  if not isinstance(config, Fp4Config):
    raise TypeError(
        f"config must be an Fp4Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Fp4Config('nvfp4').")
  lhs = _operand(lhs, "lhs")
  rhs = _operand(rhs, "rhs")
  del precision
  fp8_matmul_lib.check_axis_bound(config)
  dimension_numbers = checks.dimension_numbers(
      dimension_numbers, lhs.shape, rhs.shape, "jmp_lite.fp4.dot_general")
  out_dtype = fp8_matmul_lib.result_dtype(lhs, rhs, preferred_element_type)
  static = _Static(config, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  # Canonical forms, shard_map's varying types, explicit sharding: as float8's.
  return fp8_matmul_lib.as_dot_general(
      _fp4_matmul, static, lhs, rhs, dimension_numbers, out_dtype,
      out_sharding, "jmp_lite.fp4.dot_general", key)
