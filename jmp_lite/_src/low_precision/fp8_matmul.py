"""A float8 ``dot_general`` with a float8 backward pass.

:func:`fp8_dot_general` has the signature of :func:`jax.lax.dot_general` plus a
static :class:`~jmp_lite._src.low_precision.recipes.Fp8Config`, so that
``functools.partial(fp8_dot_general, config=...)`` can be Flax's
``dot_general`` or an autocast rule for ``dot_general_p``.

How it computes (every granularity, every platform):

1. Each operand is brought to the canonical form ``(B, M, K)`` / ``(B, N, K)``
   (batch dimensions, free dimensions, contracting dimensions, each group
   flattened), with plain transposes and reshapes that autodiff handles. Per
   tensor the rhs is ``(B, K, N)`` instead: a scalar scale fits any layout,
   so a Dense weight ``(K, N)`` and the float8 operands are never
   transposed, and each product contracts where it must.
2. A ``jax.custom_vjp`` quantizes both operands with saturating casts
   (e4m3 by default) and multiplies them with ``preferred_element_type=
   float32``: float8 operands reach the ``dot_general`` (no upcast before it)
   and accumulate in float32. The scales multiply the float32 result (per
   tensor, per row), or each contracting block's float32 partial product
   (blockwise: the DeepSeek-V3 scheme of promoting every 128-element partial
   sum to float32 and scaling it), and the result is cast to the compute
   dtype.
3. The backward pass quantizes the incoming gradient (e5m2 by default) and
   runs both backward matmuls in float8 with float32 accumulation:
   ``dlhs = g @ rhs^T`` contracts over N and ``drhs = g^T @ lhs`` over M (a
   jitted function: a deep model's matmuls of one shape trace it once). Per
   tensor, the forward's float8 operands are reused (saved as residuals, a
   quarter of a float32 copy); per row, per block and MX, a scale computed
   along K does not fit a contraction along N or M, so the operands are
   requantized along the backward matmul's own contracting dimension from the
   high-precision residuals (torchao's rowwise recipe; DeepSeek-V3 quantizes
   the weight in 128x128 blocks precisely so that they fit both directions,
   which requantizing reproduces exactly).

**Second derivatives.** The forward product and both backward products are
each wrapped so that their derivative is that of the float32 product of
their quantized operands (straight-through quantization, ``_straight_through``):
``jax.grad`` of a gradient, ``jax.jvp`` of ``jax.grad`` and ``jax.hessian``
are those of the float32 program with fake-quantized operands. Only a
derivative of the backward pass computes anything there: the first-order
values are the float8 ones, unchanged, and the high-precision operands kept
for the second derivatives are dead in a first-order program.

**Data parallel.** With ``config.axis_name`` every per-tensor amax (forward
operands, incoming gradient, the amaxes reported to delayed scaling) is the
``lax.pmax`` over that ``pmap``/``shard_map`` axis, so that replicas share
their scales; rows, tiles, blocks and MX blocks are local and not reduced.
Under ``jax.jit`` with sharded operands no ``axis_name`` is needed (the
scales are those of the global arrays), on Auto and Explicit mesh axes alike:
under Explicit axes (``jax.make_mesh``'s default) the result and the
gradients are typed as ``jax.lax.dot_general``'s, and the quantized matmul
runs inside ``jax.sharding.auto_axes`` (:func:`as_dot_general`), so the
compiled program is the one Auto axes give.

**FSDP** (``config.fsdp_axis``): under ``jax.jit`` with the weight (the
rhs) sharded over that mesh axis, the forward quantizes the local shard
(scales shared by every shard: XLA reduces the amaxes) and constrains the
float8 values and the scales, as their bits, to be replicated
(:func:`~jmp_lite._src.low_precision.collectives.gathered`): the
partitioner all-gathers 1-byte values, and an optimization barrier keeps
it from moving the gather back onto the float8 array (which XLA:CPU
widens). Per tensor the backward reuses the gathered weight; the other
granularities gather their requantized transposed weight the same way, so
no high-precision copy of the weight is gathered. Under ``jax.shard_map``
(``fsdp_axis`` a manual axis) the rhs is this device's shard along its one
contracting dimension: per-tensor and per-row amaxes along K are
max-reduced over the shards, the quantized shard is all-gathered as its
bits along K, and the backward pass returns the shard's gradient, the
whole-weight gradients summed and scattered in float32
(:func:`~jmp_lite._src.low_precision.collectives.manual_scattered`).

Contracting dimensions that do not divide into the block size (blockwise,
MX) are zero-padded: exact for a dot product, since the padding contributes
nothing and does not change any block's amax.

**MXFP8 and the platform.** Where the program is lowered for CUDA (and
``config.native_mx``), the MX matmul is ``jax.nn.scaled_matmul`` on the same
E8M0 scales and float8 values: the ``__op$block_scaled_dot`` custom call that
``jax.nn.scaled_dot_general`` also lowers to. XLA:GPU's
``BlockScalingRewriter`` (openxla/xla,
``xla/service/gpu/transforms/block_scaling_rewriter.cc``) turns it into a
cuDNN block-scaled GEMM where cuDNN supports it (MXFP8 tensor cores:
Blackwell; not both operands e5m2), and otherwise into a composite that
dequantizes both operands and runs one ``dot`` (Hopper and older). On every
other platform the matmul is that same computation, the exact emulation:
both operands dequantized to float32 and one float32 ``dot_general``.
(Neither was run on a GPU here: this was verified on the exported CUDA
program.) The choice is made by
``jax.lax.platform_dependent``, i.e. by the platform the program is lowered
for, not by ``jax.default_backend()``: a program exported for ``cuda`` from a
CPU machine takes the native path, and the CPU program contains none of it.
Two consequences of the native path: ``jax.export`` refuses its custom call
unless given ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
"__op$block_scaled_dot")]`` (the target has no compatibility guarantee), and
with jax < 0.12 a program lowered for several platforms at once
(``platforms=["cpu", "cuda"]``) cannot be lowered with it, since those
versions have no CPU rule for ``scaled_matmul``: use ``native_mx=False``
there (jax 0.12 lowers it, the custom call in the CUDA branch only).

**Delayed scaling** (``config.scaling="delayed"``, per tensor): the caller
passes ``scales=DelayedScales(lhs, rhs, grad)``, float32 scalars computed from
amax histories (:func:`~jmp_lite._src.low_precision.scaling.scale_from_history`). The
matmul reports the amaxes it observed through autodiff: the cotangent of
``scales`` is a ``DelayedScales`` holding the amax of the lhs, of the rhs and
of the incoming gradient (the only way a backward-pass value can leave a
``jax.grad`` without host callbacks; Flax's fp8 ops use the same device).
Where one ``scales`` feeds several matmul calls (a ``scan`` body, a weight
used twice), autodiff *sums* these cotangents: give each call its own scales
to read exact amaxes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import dtypes as dtypes_lib
from jmp_lite._src.low_precision import collectives as collectives_lib
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import formats as formats_lib
from jmp_lite._src.low_precision import scaling as scaling_lib

_F32 = np.dtype(np.float32)
Fp8Config = config_lib.Fp8Config
_DEFAULT_CONFIG = Fp8Config()

#: The target of the custom call ``jax.nn.scaled_matmul`` lowers to on CUDA.
NATIVE_MX_CUSTOM_CALL = "__op$block_scaled_dot"

DELAYED_SCALES_HELP = (
    "With Fp8Config(scaling='delayed') the matmul needs "
    "scales=DelayedScales(lhs=..., rhs=..., grad=...): float32 scalars, the "
    "dequantization scales of the lhs, the rhs and the incoming gradient "
    "(grad=None: the gradient is current-scaled, as the policies do), "
    "computed from amax histories with scale_from_history. The cotangent of "
    "`scales` returns the amaxes this call observed."
)


NO_OUT_SHARDING = (
    "As for jax.lax.dot_general, out_sharding names the result's sharding "
    "under explicit sharding only (mesh axes of type Explicit, "
    "jax.make_mesh's default). Here the operands are on no such mesh: leave "
    "it None and constrain the result's sharding with "
    "jax.lax.with_sharding_constraint instead."
)
SCALES_WITH_CURRENT = (
    "scales were given, but the config uses current scaling "
    "(Fp8Config(scaling='current')), which computes its own. Pass "
    "Fp8Config(scaling='delayed') to use precomputed scales."
)


class DelayedScales(NamedTuple):
  """The per-tensor scales of a delayed-scaling float8 matmul.

  Float32 scalars: dequantization scales (``x ≈ q * scale``). ``grad=None``
  scales the incoming gradient from its own amax (current scaling): what the
  policies do, so that their state holds forward amaxes only
  (``docs/fp8.md``). As the cotangent of :func:`fp8_dot_general`'s
  ``scales`` argument, the same structure holds the amaxes the matmul
  observed (``grad`` None where it was not given).

  Attributes:
    lhs: the scale of the left operand.
    rhs: the scale of the right operand.
    grad: the scale of the incoming gradient (backward pass), or None.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite import fp8
    >>> config = fp8.Fp8Config(scaling="delayed")
    >>> scales = fp8.DelayedScales(jnp.float32(1.0), jnp.float32(0.5))
    >>> y = fp8.dot_general(jnp.ones((2, 16)), jnp.ones((16, 4)),
    ...                         (((1,), (0,)), ((), ())), config=config,
    ...                         scales=scales)
    >>> float(y[0, 0])
    16.0
  """

  lhs: Any
  rhs: Any
  grad: Any = None


# ---------------------------------------------------------------------------
# Argument checking.
# ---------------------------------------------------------------------------


def _scalar_scale(value: jax.Array, name: str) -> jax.Array:
  checks.real_scalar(value, f"scales.{name}", "jmp_lite.fp8.dot_general")
  return value.astype(_F32)


def check_scales(scales: Any, config: Fp8Config, each: Any = _scalar_scale,
                 help_text: str = "") -> DelayedScales | None:
  """``scales`` checked against ``config``: None for current scaling, else
  a :class:`DelayedScales` of usable float32 scales, each checked by
  ``check_given_scale`` and then ``each(value, name)`` (the dense matmul's:
  a scalar; the grouped one's: one per group); ``help_text`` ends the
  malformed-scales message."""
  if config.scaling == "current":
    if scales is not None:
      raise ValueError(SCALES_WITH_CURRENT)
    return None
  if not isinstance(scales, DelayedScales):
    raise TypeError(
        f"Missing or malformed scales: got {type(scales).__name__}. "
        f"{DELAYED_SCALES_HELP}{help_text}")
  out = []
  for name, value in zip(DelayedScales._fields, scales):
    if name == "grad" and value is None:
      out.append(None)
      continue
    value = scaling_lib.check_given_scale(value, f"scales.{name}")
    out.append(each(value, name))
  return DelayedScales(*out)


def check_axis_bound(config: Any) -> None:
  """Raises a teaching ValueError if ``config.axis_name`` (of an
  ``Fp8Config`` or ``Fp4Config``) is not bound here."""
  if config.axis_name is not None:
    checks.bound_axis(config.axis_name, type(config).__name__)


def result_dtype(lhs: Any, rhs: Any, preferred_element_type: Any,
                 compute_dtype: Any = None) -> np.dtype:
  """A quantized matmul's result dtype (every recipe's, dense and grouped):
  ``preferred_element_type`` if given, else ``compute_dtype`` (a float8
  recipe's) if set, else the operands' promoted floating dtype."""
  if preferred_element_type is not None:
    return dtypes_lib.canonical_dtype(preferred_element_type,
                                      "preferred_element_type")
  if compute_dtype is not None:
    return compute_dtype
  return dtypes_lib.promote_floats(lhs.dtype, rhs.dtype)


# ---------------------------------------------------------------------------
# Canonical form.
# ---------------------------------------------------------------------------


def _to_canonical(x, batch, contract, contract_first=False):
  """``x`` as ``(B, F, K)``: batch axes (in order), free axes, contracting;
  ``(B, K, F)`` if ``contract_first``."""
  free = [d for d in range(x.ndim) if d not in batch and d not in contract]
  middle, last = (contract, free) if contract_first else (free, contract)
  perm = list(batch) + list(middle) + list(last)
  if perm != list(range(x.ndim)):
    x = jnp.transpose(x, perm)
  b = math.prod(x.shape[:len(batch)])
  m = math.prod(x.shape[len(batch):len(batch) + len(middle)])
  n = math.prod(x.shape[len(batch) + len(middle):])
  return x.reshape(b, m, n), free


# ---------------------------------------------------------------------------
# Quantized operands and their products.
# ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Operand:
  """A ``(B, P, C)`` float8 operand of a product contracting over C.

  ``kind`` is static: "row" (``scale`` a scalar or ``(B, P, 1)``, factored
  out of the dot), "kblock" (``scale`` float32 ``(B, P, C // T)``, one per
  contracting block) or "mx" (``scale`` E8M0 ``(B, P, C // 32)``).
  """

  values: jax.Array
  scale: jax.Array
  kind: str = dataclasses.field(metadata={"static": True})


def _pad_contracting(x, multiple):
  pad = -x.shape[-1] % multiple
  if pad:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)))
  return x


def _quantize_operand(x, fmt, kind, config, scale=None, shared_over=None):
  """Quantizes a ``(B, P, C)`` array for a product over C.

  ``kind``: "tensor", "row", "tile" (1 x T along C), "block" (T x T over P
  and C) or "mx". Returns the ``_Operand`` and the observed amax (per tensor:
  the maximum over ``config.axis_name`` if set). ``shared_over``: mapped
  axes over which the per-tensor or per-row amaxes are also max-reduced
  (the shards of an FSDP weight along C, under ``shard_map``).

  The operand has no derivative (its gradient is stopped): the derivatives
  of the products are defined by ``_straight_through``.
  """
  op, amax = _quantize_operand_values(x, fmt, kind, config, scale,
                                     shared_over)
  return jax.lax.stop_gradient(op), amax


def _quantize_operand_values(x, fmt, kind, config, scale, shared_over):
  b, p, c = x.shape
  pow2 = config.power_of_two_scales
  if kind == "tensor":
    q = scaling_lib.quantize_blocks(
        x, fmt, (b, p, c), scale, pow2, scalar_scale=True,
        axis_name=scaling_lib.joined_axis_names(config.axis_name, shared_over))
    return _Operand(q.values, q.scale, "row"), q.amax
  if kind == "row":
    q = scaling_lib.quantize_blocks(x, fmt, (1, 1, c), None, pow2,
                                    axis_name=shared_over)
    return _Operand(q.values, q.scale, "row"), q.amax
  if kind == "mx":
    q = scaling_lib.quantize_mx_last(
        _pad_contracting(x, scaling_lib.MX_BLOCK_SIZE), fmt)
    return _Operand(q.values, q.scale, "mx"), q.amax
  t = config.block_size
  xp = _pad_contracting(x, t)
  if kind == "tile":
    q = scaling_lib.quantize_blocks(xp, fmt, (1, 1, t), None, pow2)
    return _Operand(q.values, q.scale, "kblock"), q.amax
  assert kind == "block", kind
  q = scaling_lib.quantize_blocks(xp, fmt, (1, t, t), None, pow2)
  per_row = scaling_lib.broadcast_blocks(q.scale, (1, t, 1),
                                         (b, p, q.scale.shape[-1]))
  return _Operand(q.values, per_row, "kblock"), q.amax


_DN = (((2,), (2,)), ((0,), (0,)))  # (B, P, C) x (B, Q, C) -> (B, P, Q)
# Per tensor, the rhs is canonical as (B, K, N) (a weight (K, N) needs no
# transpose), and the three products contract as they come:
_DN_FORWARD = (((2,), (1,)), ((0,), (0,)))  # (B, M, K) x (B, K, N) -> (B, M, N)
_DN_WGRAD = (((1,), (1,)), ((0,), (0,)))    # (B, M, N) x (B, M, K) -> (B, N, K)
# (dgrad: (B, M, N) x (B, K, N) -> (B, M, K) is _DN.)


def _forward_dn(config: Fp8Config) -> Any:
  """The forward product's dimension numbers: per tensor the rhs is
  canonical as ``(B, K, N)`` (``_DN_FORWARD``), else ``(B, N, K)``."""
  return _DN_FORWARD if config.granularity == "tensor" else _DN


def _product(a: _Operand, b: _Operand, native_mx: bool,
             dn: Any = _DN) -> jax.Array:
  """float32 ``(B, P, Q)``: the scaled product of two float8 operands,
  contracting as ``dn`` says (per-tensor scales only; else ``_DN``)."""
  if a.kind == "row":
    assert b.kind == "row" and (dn == _DN or b.scale.ndim == 0)
    acc = jax.lax.dot_general(a.values, b.values, dn,
                              preferred_element_type=_F32)
    b_scale = b.scale if b.scale.ndim == 0 else jnp.swapaxes(b.scale, 1, 2)
    return _scaled(acc, a.scale, b_scale)
  if a.kind == "kblock":
    assert b.kind == "kblock"
    bsz, p, c = a.values.shape
    q = b.values.shape[1]
    nk = a.scale.shape[-1]
    t = c // nk
    acc = jax.lax.dot_general(
        a.values.reshape(bsz, p, nk, t), b.values.reshape(bsz, q, nk, t),
        (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=_F32)
    a_scale = jnp.swapaxes(a.scale, 1, 2)[:, :, :, None]   # (B, nk, P, 1)
    b_scale = jnp.swapaxes(b.scale, 1, 2)[:, :, None, :]   # (B, nk, 1, Q)
    return jnp.sum(_scaled(acc, a_scale, b_scale), axis=1)
  assert a.kind == b.kind == "mx", (a.kind, b.kind)
  args = (a.values, a.scale, b.values, b.scale)
  if not native_mx:
    return _mx_emulated(*args)
  return jax.lax.platform_dependent(
      *args, cuda=compat.varying_like(_mx_native), default=_mx_emulated)


def _scaled(acc, a_scale, b_scale):
  """``acc * a_scale * b_scale``, right wherever the result is a normal float32.

  One multiplication by the product of the scales (cuBLAS's alpha) where that
  product is a normal float32: with power-of-two scales exact, and it
  overflows only where the result does, unlike ``(acc * a_scale) * b_scale``
  with a huge ``a_scale`` and a tiny ``b_scale``. Where the product of the
  scales underflows or overflows (``amax_a * amax_b`` below ~2.4e-33 or
  above ~1e43), both scales lie on the same side of 1 (two normal scales on
  either side of 1 have a product between them), so multiplying by one and
  then by the other moves monotonically from ``acc`` to the result: no
  intermediate overflows or flushes unless the result does. The choice is
  made on the scales (scalars per tensor): two factors, the second 1 where
  the product is normal.
  """
  a_scale, b_scale = jnp.broadcast_arrays(a_scale, b_scale)
  product = a_scale * b_scale
  normal = ((product >= jnp.asarray(2.0**-126, _F32)) &
            (product <= jnp.asarray(np.finfo(np.float32).max, _F32)))
  first = jax.lax.select(normal, product, a_scale)
  second = jax.lax.select(normal, jnp.ones_like(product), b_scale)
  return (acc * first) * second


def _mx_emulated(a_values, a_scale, b_values, b_scale):
  """The exact emulation: the float32 dot of the dequantized operands."""
  def dequantized(values, scale):
    full = scaling_lib.broadcast_blocks(
        formats_lib.decode_e8m0(scale), (1, 1, scaling_lib.MX_BLOCK_SIZE),
        values.shape)
    return values.astype(_F32) * full
  return jax.lax.dot_general(dequantized(a_values, a_scale),
                             dequantized(b_values, b_scale), _DN,
                             preferred_element_type=_F32)


@jax.custom_batching.custom_vmap
def _mx_native(a_values, a_scale, b_values, b_scale):
  """MXFP8 on the GPU: ``jax.nn.scaled_matmul`` (cuDNN block-scaled GEMM)."""
  return jax.nn.scaled_matmul(a_values, b_values, a_scale, b_scale,
                              preferred_element_type=_F32)


@_mx_native.def_vmap
def _mx_native_vmap(axis_size, in_batched, a_values, a_scale, b_values,
                    b_scale):
  # JAX's batching rule for scaled_matmul requires every operand batched along
  # the same axis; fold the vmapped axis into B instead, broadcasting the
  # operands that are not batched.
  args = []
  for x, batched in zip((a_values, a_scale, b_values, b_scale), in_batched):
    if not batched:
      x = jnp.broadcast_to(x[None], (axis_size,) + x.shape)
    args.append(x.reshape((-1,) + x.shape[2:]))
  out = _mx_native(*args)
  return out.reshape((axis_size, -1) + out.shape[1:]), True


# ---------------------------------------------------------------------------
# Straight-through derivatives (second order).
# ---------------------------------------------------------------------------


def _part(scales: DelayedScales | None, name: str) -> jax.Array | None:
  return None if scales is None else getattr(scales, name)


def _dequantized(op: _Operand, c: int) -> jax.Array:
  """float32 ``(B, P, c)``: the values ``op`` stands for (padding dropped)."""
  values = op.values.astype(_F32)
  if op.kind == "row":
    full = values * op.scale
  elif op.kind == "kblock":
    bsz, p, padded = values.shape
    nk = op.scale.shape[-1]
    full = (values.reshape(bsz, p, nk, padded // nk) *
            op.scale[..., None]).reshape(bsz, p, padded)
  else:
    full = values * scaling_lib.broadcast_blocks(
        formats_lib.decode_e8m0(op.scale), (1, 1, scaling_lib.MX_BLOCK_SIZE),
        values.shape)
  return full[:, :, :c]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fake_quantized(side, x, scale):
  """``x`` quantized as ``side = (config, fmt, kind)`` says, dequantized to
  float32, with the derivative of the identity (straight through)."""
  config, fmt, kind = side
  return _dequantized(_quantize_operand(x, fmt, kind, config, scale)[0],
                      x.shape[-1])


@_fake_quantized.defjvp
def _fake_quantized_jvp(side, primals, tangents):
  x, scale = primals
  return _fake_quantized(side, x, scale), tangents[0].astype(_F32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _straight_through(spec, value, x, y, x_scale, y_scale):
  """``value``, the float8 product of ``x`` and ``y`` (contracting as ``dn``
  says, ``_DN`` but per tensor) quantized as ``spec = (config, (fmt, kind),
  (fmt, kind), dn)`` says, with the derivative of the float32 product of the two quantized
  operands: ``dx . q(y) + q(x) . dy`` (straight-through quantization).

  The value is returned as it is (first-order numerics unchanged); only a
  derivative of it (a second derivative of the float8 matmul) computes
  anything, and that derivative is itself differentiable.
  """
  del spec, x, y, x_scale, y_scale
  return value


@_straight_through.defjvp
def _straight_through_jvp(spec, primals, tangents):
  value, x, y, x_scale, y_scale = primals
  _, dx, dy, _, _ = tangents
  config, (x_fmt, x_kind), (y_fmt, y_kind), dn = spec
  qx = _fake_quantized((config, x_fmt, x_kind), x, x_scale)
  qy = _fake_quantized((config, y_fmt, y_kind), y, y_scale)
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=dn,
                          preferred_element_type=_F32)
  tangent = dot(dx.astype(_F32), qy) + dot(qx, dy.astype(_F32))
  out = _straight_through(spec, value, x, y, x_scale, y_scale)
  return out, tangent.astype(value.dtype)


# ---------------------------------------------------------------------------
# The custom gradient.
# ---------------------------------------------------------------------------

# (lhs kind, rhs kind) of the forward product, per granularity.
_FORWARD_KINDS = {"tensor": ("tensor", "tensor"), "row": ("row", "row"),
                  "blockwise": ("tile", "block"), "mxfp8": ("mx", "mx")}
# (gradient kind, other operand kind) of each backward product.
_BACKWARD_KINDS = {"row": ("row", "row"), "mxfp8": ("mx", "mx")}


def _gathered_weight(op: _Operand, config: Fp8Config, dim: int,
                     scale_along: bool) -> _Operand:
  """The quantized rhs (the weight), with ``config.fsdp_axis``
  all-gathered as float8 bits and scales (quantize, then gather: each shard
  quantized with the scales every shard shares); else as it is. Under
  ``jax.shard_map`` the shard is gathered along ``dim`` (its contracting
  axis K), and so is the scale where it varies along K (``scale_along``);
  under ``jax.jit`` the partitioner gathers it."""
  if config.fsdp_axis is None:
    return op
  return _Operand(collectives_lib.fsdp_gathered(op.values, config, dim),
                  collectives_lib.fsdp_gathered(op.scale, config, dim,
                                                scale_along), op.kind)


def _forward(a, b, scales, config):
  lhs_kind, rhs_kind = _FORWARD_KINDS[config.granularity]
  fmt = config.forward
  qa, amax_a = _quantize_operand(a, fmt, lhs_kind, config,
                                 None if scales is None else scales.lhs)
  # Under shard_map FSDP the weight is this device's shard along K: a
  # per-tensor or per-row (along K) amax is max-reduced over the shards.
  shared = (collectives_lib.manual_fsdp_axis(config)
            if rhs_kind in ("tensor", "row") else None)
  qb, amax_b = _quantize_operand(b, fmt, rhs_kind, config,
                                 None if scales is None else scales.rhs,
                                 shared)
  qb = _gathered_weight(qb, config, 1 if rhs_kind == "tensor" else 2,
                        scale_along=rhs_kind in ("block", "mx"))
  return (_product(qa, qb, config.native_mx, _forward_dn(config)), qa, qb,
          amax_a, amax_b)


class _Static(NamedTuple):
  """The static arguments of the custom-gradient matmul (hashable)."""

  config: Fp8Config
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_matmul(a, b, scales, static):
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` in float8, result in out_dtype;
  per tensor ``(B, M, K) x (B, K, N)``."""
  return _forward(a, b, scales, static.config)[0].astype(static.out_dtype)


def _fp8_matmul_fwd(a, b, scales, static):
  config = static.config
  out, qa, qb, amax_a, amax_b = _forward(a, b, scales, config)
  lhs_kind, rhs_kind = _FORWARD_KINDS[config.granularity]
  out = _straight_through(
      (config, (config.forward, lhs_kind), (config.forward, rhs_kind),
       _forward_dn(config)),
      out, a, b, _part(scales, "lhs"), _part(scales, "rhs"))
  # Per-tensor scales fit any contraction: the backward matmuls reuse the
  # float8 operands. The high-precision operands are residuals too, but only
  # the derivatives of the backward pass (second order) read them: in a
  # first-order program they are dead once the forward product is done.
  quantized = (qa, qb) if config.granularity == "tensor" else None
  return (out.astype(static.out_dtype),
          ((a, b), quantized, scales, amax_a, amax_b))


def _fp8_matmul_bwd(static, residuals, g):
  # JAX calls a custom_vjp's bwd once per call site; jitted (inline=True), a
  # deep model's matmuls of one shape share one trace of it.
  return _backward(residuals, g, static=static)


@functools.partial(jax.jit, inline=True, static_argnames=("static",))
def _backward(residuals, g, *, static):
  """The float8 backward pass of :func:`_fp8_matmul`."""
  config = static.config
  (a, b), quantized, scales, amax_a, amax_b = residuals
  grad_fmt, fwd_fmt = config.gradient, config.forward
  if config.granularity == "tensor":
    # a (B, M, K), b (B, K, N), g (B, M, N): the float8 operands as they
    # are, each product contracting where it must (no transposes of them;
    # the gradient first in each, as cuBLASLt's float8 GEMMs are written).
    qa, qb = quantized
    sg = _part(scales, "grad")
    g_op, amax_g = _quantize_operand(g, grad_fmt, "tensor", config, sg)
    if scales is not None and scales.grad is None:
      amax_g = None
    sa, sb = _part(scales, "lhs"), _part(scales, "rhs")
    da = _product(g_op, qb, config.native_mx, _DN)
    db = _product(g_op, qa, config.native_mx, _DN_WGRAD)
    da = _straight_through(
        (config, (grad_fmt, "tensor"), (fwd_fmt, "tensor"), _DN),
        da, g, b, sg, sb)
    db = jnp.swapaxes(_straight_through(
        (config, (grad_fmt, "tensor"), (fwd_fmt, "tensor"), _DN_WGRAD),
        db, g, a, sg, sa), 1, 2)
    wgrad_k = 1                     # db (B, K, N)
  else:
    gt = jnp.swapaxes(g, 1, 2)  # (B, N, M): the gradient contracting over M
    at, bt = jnp.swapaxes(a, 1, 2), jnp.swapaxes(b, 1, 2)
    if config.granularity == "blockwise":
      # DeepSeek-V3: gradients in 1 x T tiles along the contracting dimension;
      # the weight's T x T blocks serve both directions; the activation is
      # requantized in tiles along M for the weight gradient.
      dgrad_kinds, wgrad_kinds = ("tile", "block"), ("tile", "tile")
    else:
      dgrad_kinds = wgrad_kinds = _BACKWARD_KINDS[config.granularity]
    g_n, _ = _quantize_operand(g, grad_fmt, dgrad_kinds[0], config)
    bt_op, _ = _quantize_operand(bt, fwd_fmt, dgrad_kinds[1], config)
    bt_op = _gathered_weight(bt_op, config, 1, scale_along=True)
    da = _product(g_n, bt_op, config.native_mx)
    g_m, _ = _quantize_operand(gt, grad_fmt, wgrad_kinds[0], config)
    at_op, _ = _quantize_operand(at, fwd_fmt, wgrad_kinds[1], config)
    db = _product(g_m, at_op, config.native_mx)
    amax_g = None
    # Differentiable (second order): each backward product is differentiated
    # as the high-precision product of its straight-through quantized
    # operands (per tensor likewise, above).
    da = _straight_through(
        (config, (grad_fmt, dgrad_kinds[0]), (fwd_fmt, dgrad_kinds[1]), _DN),
        da, g, bt, None, None)
    db = _straight_through(
        (config, (grad_fmt, wgrad_kinds[0]), (fwd_fmt, wgrad_kinds[1]), _DN),
        db, gt, at, None, None)
    wgrad_k = 2                     # db (B, N, K)
  fsdp = collectives_lib.manual_fsdp_axis(config)
  if fsdp is not None:
    # The gradient of this device's shard: the sum over the shards of
    # their whole-weight gradients, scattered along K (all_gather's
    # derivative), in float32.
    db = collectives_lib.manual_scattered(db, fsdp, wgrad_k)
  da = da.astype(static.lhs_dtype)
  db = db.astype(static.rhs_dtype)
  if scales is None:
    return da, db, None
  return da, db, DelayedScales(amax_a, amax_b, amax_g)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


# ---------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------


def same_varying_axes(*xs: jax.Array) -> list[jax.Array]:
  """Under ``shard_map``, every operand marked varying over the axes any one
  varies over (as ``jax.lax.dot_general`` does implicitly): a custom gradient
  must return each operand's cotangent with the operand's own type, and the
  cotangent of a replicated weight multiplied by a sharded batch varies. The
  transpose of this marking is the ``psum`` that makes the weight's gradient
  the sum over shards, as without float8."""
  axes = frozenset().union(*(compat.varying_axes(x) for x in xs))
  return [compat.vary_over(x, axes) for x in xs]


def first_order_only(message: str) -> Any:
  """The identity, whose derivative raises ``ValueError(message)``: what a
  custom backward pass that rounds (FP4, the grouped matmuls) wraps its
  inputs in, so that a second derivative is refused, not silently zero."""

  @jax.custom_jvp
  def identity(x):
    return x

  @identity.defjvp
  def _refuse(primals, tangents):
    raise ValueError(message)

  return identity


def fp8_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any,
                    precision: Any = None, preferred_element_type: Any = None,
                    *, out_sharding: Any = None,
                    config: Fp8Config = _DEFAULT_CONFIG,
                    scales: DelayedScales | None = None) -> jax.Array:
  """``jax.lax.dot_general`` in float8, forward and backward.

  Both operands are quantized (``config.forward_format``, e4m3 by default)
  with saturating casts and scales of ``config.granularity``, multiplied with
  float8 operands and float32 accumulation, and the result is dequantized.
  The backward pass quantizes the incoming gradient
  (``config.gradient_format``, e5m2 by default) and computes both operand
  gradients with float8 matmuls and float32 accumulation; see the module
  docstring for how operands are requantized and how MXFP8 picks the native
  GPU path.

  Args:
    lhs: a float32, bfloat16 or float16 array (not float8: the matmul
      quantizes it itself).
    rhs: likewise.
    dimension_numbers: as for ``jax.lax.dot_general``: any contracting and
      batch axes (Dense: ``(((x.ndim - 1,), (0,)), ((), ()))``; attention:
      batched products such as ``(((3,), (3,)), ((0, 2), (0, 2)))``).
    precision: accepted for signature compatibility and ignored: a float8
      product has a single precision.
    preferred_element_type: the result dtype (float32, bfloat16, float16 or
      float64). Accumulation is float32 regardless.
    out_sharding: under explicit sharding (mesh axes of type Explicit,
      ``jax.make_mesh``'s default), the result's sharding as
      ``jax.lax.dot_general`` takes it: needed only where JAX cannot infer
      it (a contraction over a sharded axis). None infers it as
      ``jax.lax.dot_general`` does. Elsewhere it must be None.
    config: the static :class:`Fp8Config` (default: per-tensor current
      scaling, e4m3 forward, e5m2 gradients).
    scales: with ``config.scaling="delayed"``, the :class:`DelayedScales`;
      its cotangent holds the amaxes observed. None otherwise. A traced scale
      that is not usable (zero, negative, subnormal, not finite) falls back
      to current scaling for its operand.

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s, in
    ``preferred_element_type`` if given, else ``config.compute_dtype`` if set,
    else the operands' (promoted) dtype.

  Raises:
    TypeError: for non-floating, float8 or None operands, a config that is
      not an ``Fp8Config``, or missing delayed-scaling scales; as
      ``jax.lax.dot_general`` raises (its type), for dimension numbers that
      are not ``(((lhs_contract,), (rhs_contract,)), ((lhs_batch,),
      (rhs_batch,)))`` of distinct integer axes fitting the operands (the
      message names the value and that form).
    ValueError: for scales given to current scaling, a Python/NumPy scale that is zero, negative,
      subnormal or not finite, a ``config.axis_name`` that is not bound
      here, a ``config.fsdp_axis`` that the mesh set here lacks (or no mesh
      set; under ``shard_map``, a rhs that is not this device's shard along
      its one contracting dimension, a delayed recipe, or shards that split
      blocks), or an out_sharding for operands
      on no mesh with Explicit axes.

  Example:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jmp_lite import fp8
    >>> dot = functools.partial(fp8.dot_general,
    ...                         config=fp8.Fp8Config(granularity="row"))
    >>> @jax.jit
    ... def loss_and_grad(x, w):
    ...   loss = lambda w: dot(x, w, (((1,), (0,)), ((), ()))).sum()
    ...   return jax.value_and_grad(loss)(w)
    >>> loss, grad = loss_and_grad(jnp.ones((4, 32)), jnp.full((32, 8), 0.5))
    >>> float(loss), grad.shape, grad.dtype
    (512.0, (32, 8), dtype('float32'))
  """
  if not isinstance(config, Fp8Config):
    raise TypeError(
        f"config must be an Fp8Config, got {type(config).__name__}: "
        f"{config!r}. Build one with e.g. Fp8Config(granularity='row').")
  lhs = checks.float_array(lhs, "lhs")
  rhs = checks.float_array(rhs, "rhs")
  del precision
  dimension_numbers = checks.dimension_numbers(
      dimension_numbers, lhs.shape, collectives_lib.fsdp_weight_shape(
          lhs, rhs, dimension_numbers, config, "jmp_lite.fp8.dot_general"),
      "jmp_lite.fp8.dot_general")
  scales = check_scales(scales, config)
  # Delayed amaxes are global under pmap/shard_map by default.
  config = scaling_lib.with_bound_axes(config)
  check_axis_bound(config)
  out_dtype = result_dtype(lhs, rhs, preferred_element_type,
                           config.compute_dtype)
  static = _Static(config, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  return as_dot_general(_fp8_matmul, static, lhs, rhs, dimension_numbers,
                        out_dtype, out_sharding, "jmp_lite.fp8.dot_general",
                        scales, rhs_contract_first=_forward_dn(config) == _DN_FORWARD)


def as_dot_general(matmul: Any, static: Any, lhs: jax.Array, rhs: jax.Array,
                   dimension_numbers: Any, out_dtype: Any, out_sharding: Any,
                   owner: str, *extra: Any,
                   rhs_contract_first: bool = False) -> jax.Array:
  """``matmul(a, b, *extra, static)`` of the canonical forms ``(B, M, K)``
  and ``(B, N, K)`` of ``lhs`` and ``rhs`` (``(B, K, N)`` if
  ``rhs_contract_first``), as ``jax.lax.dot_general``'s result.

  Shaped as it, and typed as it under explicit sharding (``jax.make_mesh``'s
  default axis types): the result sharded as ``jax.lax.dot_general`` shards
  it (or as ``out_sharding`` says, where it must be said: a contraction over
  a sharded axis), the quantized matmul itself partitioned as under Auto axes
  (:func:`~jmp_lite._src.compat.partitioned_as_auto`: its block reshapes and
  the weight gradient's contraction over a sharded batch need no sharding of
  their own). ``dimension_numbers`` are normalised
  (:func:`~jmp_lite._src.checks.dimension_numbers`); an empty operand gives
  zeros.
  ``matmul`` (a module-level function) and ``static`` (its hashable static
  arguments) make the product one jitted function
  (:func:`_canonical_product`).
  """
  _, explicit = compat.explicit_axes(lhs, rhs)
  out_spec = None
  if explicit:
    out_spec = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(
            a.astype(_F32), b.astype(_F32), dimension_numbers,
            out_sharding=out_sharding), lhs, rhs).sharding
    # None: operands whose types name no mesh, under jax.set_mesh.
    out_spec = getattr(out_spec, "spec", None)
  elif out_sharding is not None:
    raise ValueError(f"{owner}: out_sharding={out_sharding!r} is not "
                     f"supported here. {NO_OUT_SHARDING}")
  return _canonical_product(lhs, rhs, extra, matmul=matmul, static=static,
                            rhs_contract_first=rhs_contract_first,
                            dimension_numbers=dimension_numbers,
                            out_dtype=np.dtype(out_dtype), out_spec=out_spec)


# Jitted with inline=True: inside a traced caller (a jitted step, grad, vmap,
# shard_map) its operations join the caller's program as if written there;
# an eager call compiles one program per shape (and its gradient likewise)
# instead of each of the quantized matmul's hundreds of operations.
@functools.partial(jax.jit, inline=True,
                   static_argnames=("matmul", "static", "rhs_contract_first",
                                    "dimension_numbers", "out_dtype",
                                    "out_spec"))
def _canonical_product(lhs, rhs, extra, *, matmul, static, rhs_contract_first,
                       dimension_numbers, out_dtype, out_spec):
  """:func:`as_dot_general`'s product, partitioned as under Auto axes."""
  (lc, rc), (lb, rb) = dimension_numbers

  def product(lhs, rhs, *extra):
    a, lhs_free = _to_canonical(lhs, lb, lc)
    b, rhs_free = _to_canonical(rhs, rb, rc, rhs_contract_first)
    shape = ([lhs.shape[d] for d in lb] + [lhs.shape[d] for d in lhs_free] +
             [rhs.shape[d] for d in rhs_free])
    if 0 in a.shape or 0 in b.shape:
      # An empty operand: the product is all zeros (or empty), as is its
      # gradient; nothing to quantize.
      return jnp.zeros(shape, out_dtype)
    a, b = same_varying_axes(a, b)
    return matmul(a, b, *extra, static).reshape(shape)

  return compat.partitioned_as_auto(product, out_spec, lhs, rhs, *extra)
