"""Scaled float8 quantization: scales per tensor, row, tile, block or MX block.

**Scale convention.** Everywhere in jmp_lite a float8 scale is the
*dequantization* scale: ``x ≈ dequantize(q) = q * scale`` and
``q = saturating_cast(x / scale)``. This is the meaning of an MX (E8M0) block
scale, of DeepSeek-V3's and Transformer Engine's blockwise ``s_block``, and of
the ``scale_inv`` that TE and ``torch._scaled_mm`` pass to the GEMM (TE's and
torchao's ``scale`` is the reciprocal multiplier, ``fp8_max / amax``).

**Current scaling** (the default) computes the scale of each group of elements
from its own absolute maximum (amax), just in time:
``scale = amax / fmt.max``, then

* ``amax == 0`` (an all-zero group): ``scale = 1`` (no NaN, no inf);
* a tiny amax: the scale is at least 2**-126, the smallest normal float32, so
  that ``x / scale`` never divides by a flushed subnormal; a huge one (with a
  margin) at most 2**126, so that neither the scale nor its reciprocal is
  inf;
* ``power_of_two=True`` (the default): the scale is rounded *up* to a power of
  two. The group's amax then still maps to at most ``fmt.max`` (no saturation),
  quantizing and dequantizing only touch exponents (exact, no extra rounding),
  and a float8 dot scaled afterwards equals the float32 dot of the dequantized
  operands bit for bit. Sources: torchao's ``ROWWISE`` recipe
  (``round_scales_to_power_of_2=True``: "scales are rounded (floor) to the
  nearest power of two for increased accuracy", floor of torchao's
  multiplier is ceil of our scale), Transformer Engine's ``Float8BlockScaling``
  (power-of-two scales unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``), and
  MXFP8, whose E8M0 scales are powers of two by construction.

**Granularities** (:func:`quantize`): ``"tensor"`` (one scale), ``"row"``
(one scale per index of the other axes, i.e. reduced along the contracting
axis: torchao's "axiswise"), ``"tile"`` (``1 x block_size`` along one axis:
DeepSeek-V3's 1x128 activation tiles), ``"block"`` (``block_size x
block_size`` over two axes: DeepSeek-V3's 128x128 weight blocks), and
``"mxfp8"`` (1x32 blocks with E8M0 scales rounded up, bit for bit JAX's own MX
quantizer; see :func:`quantize`).

**Non-finite inputs.** Finite values saturate to ``±fmt.max``. A NaN stays NaN
and makes its group's scale NaN (current scaling), so the whole group
dequantizes to NaN; an infinity becomes NaN (e4m3 has no infinity, and
mapping it to ``±max`` would hide an overflow from loss scaling). A non-finite
input therefore always yields a non-finite float8 dot.

**Delayed scaling** keeps the scale out of the current step: the caller passes
``scale=`` (one per group) computed from an amax history with
:func:`scale_from_history`, and reads the amax the quantizer observed in
:attr:`Quantized.amax` to roll the history with :func:`update_amax_history`.
A given scale that is zero, negative, subnormal or not finite is refused
when it is a Python/NumPy value and replaced by the current scale when it is
a JAX array (see :func:`usable_scale`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from numpy.lib.array_utils import normalize_axis_tuple

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import formats as formats_lib

_F32 = np.dtype(np.float32)
#: The smallest scale current scaling produces: the smallest normal float32.
MIN_SCALE = checks.SCALE_MIN
#: The largest scale it produces: 2**126, so that its reciprocal is a normal
#: float32 too (only reached with a margin and an amax near float32's max).
MAX_SCALE = checks.SCALE_MAX
GIVEN_SCALE_HELP = (
    "A dequantization scale must be a positive, finite, normal float32 "
    "(at least 2**-126): x is quantized as x / scale. Compute delayed scales "
    "with scale_from_history (it never returns 0, inf or NaN); a traced scale "
    "that is not usable falls back to current scaling (the scale of the "
    "tensor's own amax)."
)
# The granularity vocabulary, block sizes and amax algorithms are the
# recipe layer's (one set of names: jmp_lite._src.low_precision.recipes).
MX_BLOCK_SIZE = config_lib.MX_BLOCK_SIZE
DEFAULT_BLOCK_SIZE = config_lib.DEFAULT_BLOCK_SIZE
#: The granularities :func:`quantize` knows.
GRANULARITIES = config_lib.GRANULARITIES
AMAX_ALGORITHMS = config_lib.AMAX_ALGORITHMS
AMAX_ALGORITHM_HELP = config_lib.AMAX_ALGORITHM_HELP

GRANULARITY_HELP = (
    "Valid granularities are 'tensor' (one scale), 'row' (one scale per row, "
    "reduced along `axis`), 'tile' (1 x block_size along `axis`, default "
    "128), 'block' (block_size x block_size over two axes, default 128) and "
    "'mxfp8' (1x32 blocks along `axis` with power-of-two E8M0 scales)."
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
  """A float8 array with its scales.

  ``dequantize(q) = q.values * scale`` broadcast over blocks of
  ``block_shape`` elements (the last block along an axis may be partial).

  Attributes:
    values: the float8 values, with the shape of the quantized array.
    scale: the dequantization scales, one per block: float32 (a scalar for
      per-tensor scaling), or ``float8_e8m0fnu`` for MX.
    amax: float32, the absolute maximum of the input over each block (the
      shape of ``scale``): what delayed scaling records in its history.
    block_shape: static; how many elements along each axis share one scale.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> q = fp8.quantize(jnp.array([[1.0, -2.0], [3.0, 4.0]]), "e4m3", "row")
    >>> q.scale.shape, q.block_shape
    ((2, 1), (1, 2))
  """

  values: jax.Array
  scale: jax.Array
  amax: jax.Array
  block_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})


# ---------------------------------------------------------------------------
# Scales.
# ---------------------------------------------------------------------------


_OWNER = "jmp_lite.fp8"


def check_given_scale(scale: Any, what: str) -> jax.Array:
  """A user-given dequantization scale, as a float32 array.

  A Python or NumPy value that is not positive, finite and normal is refused
  here (a ValueError naming ``what``); a JAX array (traced or not: reading it
  would wait for the device) is checked where it is used, by
  :func:`usable_scale`.
  """
  value = checks.float_array(scale, what)
  if not isinstance(scale, jax.Array):
    host = np.asarray(scale, np.float64)
    bad = ~(np.isfinite(host) & (host >= MIN_SCALE))
    if bad.any():
      raise ValueError(
          f"{what} must be positive, finite and normal, got "
          f"{host[bad].ravel()[0]!r}. {GIVEN_SCALE_HELP}")
  return value.astype(_F32)


def usable_scale(scale: jax.Array, fallback: jax.Array) -> jax.Array:
  """``scale`` where it is a usable float32 scale (finite, at least 2**-126),
  else ``fallback``: a zero, negative, subnormal or non-finite scale would
  turn every element into 0, inf or NaN."""
  ok = jnp.isfinite(scale) & (scale >= jnp.asarray(MIN_SCALE, _F32))
  return jnp.where(ok, scale, fallback)


def scale_from_amax(amax: Any, fmt: Any = "e4m3", *, margin: float = 0,
                    power_of_two: bool = True) -> jax.Array:
  """The dequantization scale that maps ``amax`` onto the format's range.

  ``scale = amax * 2**margin / fmt.max``, clamped to [2**-126, 2**126] (so
  that neither the scale nor its reciprocal is 0 or inf), 1 where
  ``amax == 0``, rounded up to a power of two if ``power_of_two``. NaN and inf
  amaxes give NaN and inf scales (see the module docstring).

  Args:
    amax: absolute maxima (any shape; computed in float32).
    fmt: the float8 format (``"e4m3"`` or ``"e5m2"``).
    margin: headroom in powers of two, an integer from 0 to 64: the scale is
      multiplied by ``2**margin`` (Transformer Engine's ``margin``, which
      divides its reciprocal scale by ``2**margin``).
    power_of_two: round the scale up to a power of two.

  Returns:
    float32 scales of ``amax``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> fp8.scale_from_amax(jnp.array([448.0, 500.0, 0.0]))
    Array([1., 2., 1.], dtype=float32)
  """
  fmt = formats_lib.get_format(fmt)
  margin = checks.fp8_margin(margin, _OWNER)
  amax = checks.float_array(amax, "amax").astype(_F32)
  return _scale_from_amax(amax, fmt, margin, power_of_two)


def _scale_from_amax(amax, fmt, margin, power_of_two):
  # lax operations, not jnp's jitted wrappers: this runs for every operand of
  # every float8 matmul, and each wrapper is a call to trace and lower.
  f32 = lambda v: jnp.asarray(v, _F32)
  scale = jax.lax.div(amax, f32(fmt.max))
  if margin:
    scale = scale * f32(2.0**margin)
  # Within [2**-126, 2**126] for every finite amax, so that neither the scale
  # nor its reciprocal is 0 or inf (after rounding up to a power of two too);
  # a NaN or infinite amax keeps its NaN or inf scale (lax.max propagates
  # NaN, and the ceiling is applied where the amax is finite). Without a margin
  # no finite float32 amax reaches the ceiling (float32's largest / the
  # format's largest < 2**126): it is left out.
  scale = jax.lax.max(scale, f32(MIN_SCALE))
  if float(np.finfo(np.float32).max) * 2.0**margin / fmt.max > MAX_SCALE:
    scale = jax.lax.select(jax.lax.is_finite(amax),
                           jax.lax.min(scale, f32(MAX_SCALE)), scale)
  if power_of_two:
    scale = formats_lib.round_up_pow2(scale)
  return jax.lax.select(amax == f32(0.0), jnp.ones_like(scale), scale)


def update_amax_history(history: Any, amax: Any) -> jax.Array:
  """Pushes a new amax onto an amax history, dropping the oldest entry.

  ``history[0]`` is the most recent amax and ``history[i]`` the one ``i``
  steps before (chronological, unlike Transformer Engine's rotating buffer).

  Args:
    history: array of shape ``(N, *amax.shape)``, N >= 1, floating.
    amax: the amax observed this step (e.g. :attr:`Quantized.amax`).

  Returns:
    The new history, same shape and dtype.

  Raises:
    TypeError: if either is not floating.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> fp8.update_amax_history(jnp.array([3.0, 2.0, 1.0]), jnp.float32(4.0))
    Array([4., 3., 2.], dtype=float32)
  """
  history = checks.float_array(history, "history")
  amax = checks.float_array(amax, "amax")
  new = amax.astype(history.dtype)[None]
  return jnp.concatenate([new, history[:-1]], axis=0)


def scale_from_history(history: Any, fmt: Any = "e4m3", *, margin: float = 0,
                       algorithm: str = "max", previous_scale: Any = None,
                       power_of_two: bool = True) -> jax.Array:
  """The delayed-scaling scale from an amax history.

  The amax is ``max(history)`` (``algorithm="max"``) or ``history[0]``
  (``"most_recent"``), Transformer Engine's two algorithms; the scale is
  :func:`scale_from_amax` of it. Where that amax is zero or not finite (an
  unused history, or an overflowing step), the scale falls back to
  ``previous_scale`` (1 if not given), as Transformer Engine keeps its
  previous scale.

  Args:
    history: ``(N, ...)`` amax history, most recent first (see
      :func:`update_amax_history`).
    fmt: the float8 format the scale is for.
    margin: headroom in powers of two, an integer from 0 to 64 (the scale
      is multiplied by ``2**margin``).
    algorithm: ``"max"`` or ``"most_recent"``.
    previous_scale: the scale to keep where the amax is zero or not finite.
    power_of_two: round the scale up to a power of two.

  Returns:
    float32 scales of shape ``history.shape[1:]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> h = jnp.array([100.0, 800.0, 0.0])  # most recent first
    >>> fp8.scale_from_history(h)  # 800 / 448, rounded up to a power of two
    Array(2., dtype=float32)
    >>> fp8.scale_from_history(h, algorithm="most_recent")  # 100 / 448
    Array(0.25, dtype=float32)
  """
  fmt = formats_lib.get_format(fmt)
  margin = checks.fp8_margin(margin, _OWNER)
  algorithm = checks.choice(algorithm, "amax algorithm", _OWNER,
                            AMAX_ALGORITHMS, AMAX_ALGORITHM_HELP)
  history = checks.float_array(history, "history").astype(_F32)
  amax = history[0] if algorithm == "most_recent" else jnp.max(history, axis=0)
  scale = _scale_from_amax(amax, fmt, margin, power_of_two)
  if previous_scale is None:
    fallback = jnp.ones_like(scale)
  else:
    fallback = check_given_scale(previous_scale, "previous_scale")
    # A traced previous scale that is not usable: 1, as without one.
    fallback = usable_scale(fallback, jnp.ones_like(fallback))
  usable = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(usable, scale, fallback)


# ---------------------------------------------------------------------------
# Amaxes across replicas (pmap, shard_map, named vmap).
# ---------------------------------------------------------------------------


def joined_axis_names(*parts: Any) -> Any:
  """The mapped axes of every part (each None, a name or a tuple of names),
  once each in order: None, one name, or a tuple of them (as
  ``lax.pmax`` takes them)."""
  names = tuple(dict.fromkeys(
      n for part in parts if part is not None
      for n in (part if isinstance(part, tuple) else (part,))))
  return None if not names else names[0] if len(names) == 1 else names


def global_amax(amax: jax.Array, axis_name: Any) -> jax.Array:
  """The maximum of ``amax`` over the mapped axes ``axis_name`` (a name or a
  tuple of names; ``amax`` itself where None): every replica gets the same.

  Under ``shard_map``, an amax that varies over some of those axes but not
  all (a weight sharded over one, replicated over another) is first marked
  varying over the others: jax 0.12's ``lax.pmax`` takes axes of one kind
  only, and the maximum over axes where every replica holds the same value
  is that value.
  """
  if axis_name is None:
    return amax
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  varying = compat.varying_axes(amax)
  if varying & set(names):  # shard_map's types: make them one kind
    for name in names:
      if name not in varying:
        amax = compat.to_varying(amax, name)
  return jax.lax.pmax(amax, axis_name)


def with_bound_axes(config: Any) -> Any:
  """A delayed recipe without ``axis_name``, with the mapped axes bound here.

  Delayed scaling keeps state: under ``pmap``, ``shard_map`` or a ``vmap``
  with an ``axis_name``, replicas that each recorded their own shard's amax
  would hold different histories (and a checkpoint one replica's). So a
  delayed recipe whose ``axis_name`` is None reduces its amaxes over every
  mapped axis bound where it runs (JAX's axis environment,
  :func:`~jmp_lite._src.compat.bound_axis_names`), as Transformer Engine
  reduces amaxes over its data-parallel group by default; under ``jax.jit``
  alone none is bound and amaxes are global already. An explicit
  ``axis_name`` (e.g. the data axes only, where another mapped axis holds
  different layers) is kept, as is every other recipe (current scaling keeps
  no state: each replica scales from its own shard unless ``axis_name``).
  Axis names that are not strings (JAX's temporaries) are left out.
  """
  if (getattr(config, "scaling", None) != "delayed"
      or config.axis_name is not None):
    return config
  names = tuple(n for n in compat.bound_axis_names() if isinstance(n, str))
  if not names:
    return config
  return dataclasses.replace(
      config, axis_name=names[0] if len(names) == 1 else names)


# ---------------------------------------------------------------------------
# Blocks.
# ---------------------------------------------------------------------------


def _num_blocks(shape, block_shape):
  return tuple(-(-n // b) for n, b in zip(shape, block_shape))


def _pad_to_blocks(x, block_shape):
  pads = [(0, -n % b) for n, b in zip(x.shape, block_shape)]
  if any(hi for _, hi in pads):
    x = jnp.pad(x, pads)
  return x


def _block_reduce_max(x, block_shape):
  """Max of ``x`` over each block (a partial edge block counts what it has)."""
  padded = _pad_to_blocks(x, block_shape)  # x >= 0: zero padding is neutral
  split = []
  for n, b in zip(padded.shape, block_shape):
    split += [n // b, b]
  # initial=0: an empty block (a zero-size array) has amax 0.
  return jnp.max(padded.reshape(split), axis=tuple(range(1, len(split), 2)),
                 initial=0.0)


def broadcast_blocks(per_block: jax.Array, block_shape: Sequence[int],
                     shape: Sequence[int]) -> jax.Array:
  """Expands one value per block to one value per element of ``shape``."""
  if per_block.ndim == 0:
    return jnp.broadcast_to(per_block, tuple(shape))
  inter, full = [], []
  for s, b in zip(per_block.shape, block_shape):
    inter += [s, 1]
    full += [s, b]
  expanded = jnp.broadcast_to(per_block.reshape(inter), full)
  expanded = expanded.reshape([s * b for s, b in zip(per_block.shape,
                                                     block_shape)])
  if tuple(expanded.shape) != tuple(shape):
    expanded = expanded[tuple(slice(0, n) for n in shape)]
  return expanded


def _cast_scaled(x32, scale_full, fmt, given=True):
  """``saturating_cast(x / scale)``, with infinities mapped to NaN.

  ``given=False`` says that each scale is the current scale of its block:
  an infinity in a block makes its scale inf and ``inf / inf`` NaN already
  (and a NaN makes it NaN), so the explicit mapping is left out."""
  hi = jnp.asarray(fmt.max, _F32)
  y = jax.lax.min(jax.lax.max(jax.lax.div(x32, scale_full), -hi), hi)
  if given:
    y = jax.lax.select(jnp.isinf(x32),
                       jnp.full(y.shape, np.nan, _F32), y)
  return formats_lib.encode(y, fmt)


def quantize_blocks(x: jax.Array, fmt: formats_lib.Fp8Format,
                    block_shape: tuple[int, ...], scale: jax.Array | None,
                    power_of_two: bool, scalar_scale: bool = False,
                    axis_name: Any = None) -> Quantized:
  """Quantizes with one float32 scale per block (no argument checking).

  ``scale`` (one per block) replaces the computed scale when given (delayed
  scaling); where it is not usable (zero, negative, subnormal or not finite)
  the block falls back to current scaling. ``scalar_scale`` stores a single
  scale as a scalar. ``axis_name``: each amax is the maximum over that
  mapped axis (``lax.pmax``), so that every replica of a
  ``pmap``/``shard_map`` computes the same scale (per tensor; per block,
  where the replicas hold pieces of the same blocks: an FSDP weight's
  shards along the blocks' long axis).
  """
  block_shape = tuple(max(b, 1) for b in block_shape)  # zero-size axes
  x32 = x.astype(_F32)
  if scalar_scale:
    amax = global_amax(jnp.max(jnp.abs(x32), initial=0.0), axis_name)
  else:
    amax = global_amax(_block_reduce_max(jnp.abs(x32), block_shape),
                       axis_name)
  current = _scale_from_amax(amax, fmt, 0, power_of_two)
  given = scale is not None
  if given:
    scale = usable_scale(scale.astype(_F32).reshape(amax.shape), current)
  else:
    scale = current
  values = _cast_scaled(x32, broadcast_blocks(scale, block_shape, x.shape),
                        fmt, given)
  return Quantized(values, scale, amax, tuple(block_shape))


def quantize_mx_last(x: jax.Array, fmt: formats_lib.Fp8Format) -> Quantized:
  """MX quantization in 1x32 blocks along the last axis (no checking).

  The steps and the dtype of each step are those of JAX's MX quantizer
  (``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, behind
  ``jax.nn.scaled_dot_general``), so that the result is bit for bit the same:
  the block amax and ``amax / fmt.max`` in ``x``'s dtype, E8M0 rounding up in
  float32, then ``clip(x / 2**k)`` cast to float8. The division is computed
  in float32 as a multiplication by the exact reciprocal ``2**-k`` (the same
  value), which matters only where JAX's result is not usable:

  * an all-zero block has code 0 (2**-127) in both; its reciprocal 2**127 is
    a normal number and the block quantizes to zeros, where JAX divides by
    the subnormal 2**-127, which XLA:CPU flushes to zero: 0/0 = NaN;
  * JAX divides float16 blocks in float16, by the scale cast to float16:
    below 2**-14 (e4m3 blocks with amax < ~0.027) that scale is a float16
    subnormal, flushed by XLA:CPU, and the block saturates; here it does not;
  * a block whose ``amax / fmt.max`` underflows to zero in ``x``'s dtype (a
    float16 e4m3 block below ~1.3e-5, a float32 one below ~2.6e-36) gets its
    scale from the float32 quotient, and at least 2**-126, instead of code 0
    with values that do not match it;
  * a NaN block gets the NaN scale (code 255), where JAX's wraps around to
    code 0.

  Everywhere else (every float32 and bfloat16 block with a nonzero finite
  amax, float16 blocks whose scale is at least 2**-14) the values and scales
  are JAX's, bit for bit (tested against JAX's function).
  """
  *lead, k = x.shape
  nb = -(-k // MX_BLOCK_SIZE)
  padded = _pad_to_blocks(x, (1,) * len(lead) + (MX_BLOCK_SIZE,))
  blocks = padded.reshape(*lead, nb, MX_BLOCK_SIZE)
  amax = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0)
  ratio = amax / jnp.asarray(fmt.max, x.dtype)
  codes = formats_lib.e8m0_codes(ratio.astype(_F32))
  underflow = (amax > 0) & (codes == 0)
  codes32 = jnp.maximum(
      formats_lib.e8m0_codes(amax.astype(_F32) / jnp.asarray(fmt.max, _F32)),
      jnp.asarray(1, codes.dtype))
  codes = jnp.where(underflow, codes32, codes)
  reciprocal = formats_lib.e8m0_reciprocal(codes)
  hi = jnp.asarray(fmt.max, _F32)
  y = jnp.clip(blocks.astype(_F32) * reciprocal[..., None], -hi, hi)
  values = formats_lib.encode(y, fmt).reshape(
      *lead, nb * MX_BLOCK_SIZE)[..., :k]
  scale = jax.lax.bitcast_convert_type(codes, formats_lib.E8M0_DTYPE)
  return Quantized(values, scale, amax.astype(_F32),
                   (1,) * len(lead) + (MX_BLOCK_SIZE,))


# ---------------------------------------------------------------------------
# The public quantizer.
# ---------------------------------------------------------------------------


#: Why MX blocks take neither a given scale nor non-power-of-two scales.
MX_SCALES_FIXED = (
    "granularity 'mxfp8' computes each block's E8M0 scale (always a power of "
    "two) from the block itself: it takes no precomputed scale and no "
    "power_of_two=False. Use granularity 'tensor' for delayed scaling."
)


def check_granularity(name: Any, valid: Sequence[str] = GRANULARITIES,
                      help_text: str = GRANULARITY_HELP, *,
                      owner: str = _OWNER) -> str:
  """Canonicalises a granularity name or raises a teaching error."""
  return config_lib.check_granularity(name, tuple(valid), help_text,
                                      owner=owner)


def _check_block_size(block_size, granularity):
  fixed = {"tensor": None, "row": None, "mxfp8": MX_BLOCK_SIZE}
  if granularity in fixed:
    if block_size not in (None, fixed[granularity]):
      raise ValueError(
          f"block_size sets the size of 'tile' and 'block' granularities "
          f"only, got block_size={block_size!r} with granularity "
          f"{granularity!r} (MXFP8 blocks are {MX_BLOCK_SIZE} elements, the "
          "OCP Microscaling spec's). Leave it None.")
    return fixed[granularity]
  if block_size is None:
    return DEFAULT_BLOCK_SIZE
  return checks.integer(block_size, "block_size", _OWNER, low=1)


def quantize(x: Any, fmt: Any = "e4m3", granularity: str = "tensor", *,
             axis: int | Sequence[int] | None = None,
             block_size: int | None = None, scale: Any = None,
             power_of_two: bool = True) -> Quantized:
  """Quantizes an array to float8 with scales of the given granularity.

  Args:
    x: a float32, bfloat16 or float16 array.
    fmt: ``"e4m3"`` or ``"e5m2"`` (see
      :func:`~jmp_lite._src.low_precision.formats.get_format`).
    granularity: how elements share scales:

      * ``"tensor"``: one scale (``axis`` must be None);
      * ``"row"``: the amax is reduced along ``axis`` (an int or a tuple, by
        default the last axis): one scale per index of the other axes. For a
        matmul, reduce along the contracting axis;
      * ``"tile"``: ``1 x block_size`` tiles along ``axis`` (default the last
        axis, ``block_size`` 128);
      * ``"block"``: ``block_size x block_size`` blocks over the two axes
        ``axis`` (default ``(-2, -1)``, ``block_size`` 128);
      * ``"mxfp8"``: 1x32 blocks along ``axis`` (default last) with E8M0
        scales rounded up: bit for bit JAX's MX quantizer, see
        :func:`quantize_mx_last` for the blocks where it is not.

      A last block that the axis length does not fill is a partial block (its
      amax is over the elements it has): the same as zero padding.
    axis: see ``granularity``.
    block_size: the tile/block size, see ``granularity``.
    scale: precomputed dequantization scales (delayed scaling), of the shape
      the granularity gives ``Quantized.scale``. Not for ``"mxfp8"``.
    power_of_two: round computed scales up to powers of two (see the module
      docstring). MX scales always are.

  Returns:
    A :class:`Quantized` with the float8 values, the scales and the amax per
    block.

  Raises:
    TypeError: for a non-floating or float8 ``x`` or a badly typed argument.
    ValueError: for an unknown format or granularity, or an ``axis``,
      ``block_size`` or ``scale`` that does not fit.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> q = fp8.quantize(jnp.array([1000.0, 1.0, 0.5]), "e4m3")
    >>> q.values, q.scale  # 1000 / 4 = 250 rounds to 256 (3 mantissa bits)
    (Array([256, 0.25, 0.125], dtype=float8_e4m3fn), Array(4., dtype=float32))
    >>> fp8.dequantize(q)
    Array([1.024e+03, 1.000e+00, 5.000e-01], dtype=float32)
  """
  fmt = formats_lib.get_format(fmt)
  granularity = check_granularity(granularity)
  x = checks.float_array(x, "x")
  block_size = _check_block_size(block_size, granularity)
  ndim = x.ndim
  default = {"tensor": (), "block": (-2, -1)}.get(granularity, -1)
  # NumPy reports an axis out of range or repeated.
  axes = normalize_axis_tuple(default if axis is None else axis, ndim)
  need = {"tensor": 0, "tile": 1, "mxfp8": 1, "block": 2}.get(
      granularity, max(len(axes), 1))
  if len(axes) != need:
    raise ValueError(
        f"granularity {granularity!r} takes {need} axis/axes, got "
        f"axis={axis!r} (granularity='row' gives one scale per row).")
  if granularity in ("tensor", "row"):
    block_shape = tuple(max(n, 1) if i in axes or granularity == "tensor"
                        else 1 for i, n in enumerate(x.shape))
  else:
    block_shape = tuple(block_size if i in axes else 1 for i in range(ndim))
  scale_shape = () if granularity == "tensor" else _num_blocks(
      x.shape, block_shape)
  if granularity == "mxfp8":
    if not power_of_two or scale is not None:
      raise ValueError(MX_SCALES_FIXED)
    (ax,) = axes
    moved = jnp.moveaxis(x, ax, -1)
    q = quantize_mx_last(moved, fmt)
    return Quantized(jnp.moveaxis(q.values, -1, ax),
                     jnp.moveaxis(q.scale, -1, ax),
                     jnp.moveaxis(q.amax, -1, ax), block_shape)
  if scale is not None:
    # A scale of another shape: JAX's broadcasting names both shapes.
    scale = jnp.broadcast_to(check_given_scale(scale, "scale"), scale_shape)
  return quantize_blocks(x, fmt, block_shape, scale, power_of_two,
                         scalar_scale=granularity == "tensor")


def dequantize(q: Quantized, dtype: Any = jnp.float32) -> jax.Array:
  """``q.values * scale``, each block times its scale, in ``dtype``.

  Computed in float32 and then cast: with power-of-two scales the float32
  result is exact.

  Args:
    q: a :class:`Quantized`.
    dtype: the result dtype.

  Returns:
    The dequantized array, of ``q.values``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite._src import low_precision as fp8
    >>> fp8.dequantize(fp8.quantize(jnp.array([3.0, -7.0]), "e5m2"))
    Array([ 3., -7.], dtype=float32)
  """
  scale = q.scale
  if np.dtype(scale.dtype) == formats_lib.E8M0_DTYPE:
    scale = formats_lib.decode_e8m0(scale)
  full = broadcast_blocks(scale.astype(_F32), q.block_shape, q.values.shape)
  return (q.values.astype(_F32) * full).astype(dtype)
