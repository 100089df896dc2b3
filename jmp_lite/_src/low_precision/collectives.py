"""Quantized collectives: the all-to-all of a Mixture-of-Experts dispatch in
float8.

:func:`fp8_all_to_all` is ``jax.lax.all_to_all`` whose payload travels as
float8 rows with their scales as a second array on the same offsets
(DeepSeek-V3 / DeepEP's dispatch): each row (the last axis, the features)
is quantized in blocks of the recipe's granularity (1 x ``block_size``
tiles for ``fp8_blockwise``, 1 x 32 E8M0 blocks for ``mxfp8``, one scale
per row for ``fp8_rowwise``), the float8 values and the scales are each
moved by one ``all_to_all`` along the same axes, and the receiver
dequantizes. A row moves whole, so quantizing before the move equals
quantizing after it, bit for bit. The backward pass (the transposed
all-to-all of the cotangent) does the same in the recipe's gradient format.

The float8 values (and E8M0 scales) travel as their bits, ``uint8``: a
compiler cannot widen an integer payload (XLA:CPU turns a float8
``all_to_all`` into a float16 one), so the program moves 1 byte per element,
checked in the compiled and the exported programs by the tests.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import dtypes as dtypes_lib
from jmp_lite._src import parallel as parallel_lib
from jmp_lite._src.low_precision import recipes as recipes_lib
from jmp_lite._src.low_precision import scaling as scaling_lib

#: The recipe granularities the dispatch quantizes with (each row's scales
#: are its own: nothing to agree on across devices).
DISPATCH_GRANULARITIES = ("row", "blockwise", "mxfp8")
DISPATCH_GRANULARITY_HELP = (
    "fp8_all_to_all quantizes each row (the last axis) on its own: use a "
    "recipe of granularity 'blockwise' (1 x block_size tiles with float32 "
    "scales, DeepSeek-V3's dispatch; the default), 'mxfp8' (1 x 32 blocks, "
    "E8M0 scales) or 'row' (one scale per row), with current scaling, e.g. "
    "config=jmp_lite.fp8.Fp8Config(granularity='blockwise')."
)
FEATURE_AXIS_HELP = (
    "fp8_all_to_all quantizes along the last axis (the features of each "
    "token), which must stay whole: split and concatenate along another "
    "axis (the tokens), as an MoE dispatch does."
)


def _quantized(x: jax.Array, fmt: Any, config: Any) -> scaling_lib.Quantized:
  granularity = {"row": "row", "blockwise": "tile",
                 "mxfp8": "mxfp8"}[config.granularity]
  block = config.block_size if config.granularity == "blockwise" else None
  return scaling_lib.quantize(x, fmt, granularity, block_size=block,
                              power_of_two=config.power_of_two_scales
                              or config.granularity == "mxfp8")


def _moved(x: jax.Array, fmt: Any, config: Any, move: Any) -> jax.Array:
  """``move`` of ``x`` with a float8 payload: quantized by rows, values
  and scales moved, dequantized to ``x``'s dtype."""
  q = _quantized(x, fmt, config)
  values = parallel_lib.moved_as_bits(q.values, move)
  scale = (parallel_lib.moved_as_bits(q.scale, move)
           if q.scale.dtype.itemsize == 1 else move(q.scale))
  # (dequantize reads the values, the scales and the block shape.)
  moved = scaling_lib.Quantized(values, scale, scale, q.block_shape)
  return scaling_lib.dequantize(moved, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _all_to_all(x, axis_name, split_axis, concat_axis, tiled, config):
  move = functools.partial(jax.lax.all_to_all, axis_name=axis_name,
                           split_axis=split_axis, concat_axis=concat_axis,
                           tiled=tiled)
  return _moved(x, config.forward_format, config, move)


def _all_to_all_fwd(x, axis_name, split_axis, concat_axis, tiled, config):
  return _all_to_all(x, axis_name, split_axis, concat_axis, tiled,
                     config), None


def _all_to_all_bwd(axis_name, split_axis, concat_axis, tiled, config, _, g):
  # all_to_all's transpose: split where the forward concatenated, and back.
  move = functools.partial(jax.lax.all_to_all, axis_name=axis_name,
                           split_axis=concat_axis, concat_axis=split_axis,
                           tiled=tiled)
  return (_moved(g, config.gradient_format, config, move),)


_all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)

_DEFAULT_CONFIG = recipes_lib.from_spec("fp8_blockwise")


def fp8_all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int,
                   *, tiled: bool = False,
                   config: recipes_lib.Fp8Config = _DEFAULT_CONFIG
                   ) -> jax.Array:
  """``jax.lax.all_to_all`` with a float8 payload (an MoE dispatch).

  Inside ``jax.shard_map`` (or ``pmap``), in place of
  ``jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)``
  for the tokens an expert-parallel layer sends to the experts' devices:
  every row (the last axis) is quantized to float8 in the recipe's blocks
  (``config.forward_format``), the float8 values and the scales move as two
  arrays along the same axes (1 byte per element, plus one float32 scale
  per 128 elements with the default ``fp8_blockwise`` recipe), and the
  receiver gets them dequantized, in ``x``'s dtype. The gradient travels
  back the same way in ``config.gradient_format``. Send the experts'
  outputs back (the combine) with ``jax.lax.all_to_all`` in bfloat16.
  Guide: ``docs/fp8.md#float8-moe-dispatch``.

  Args:
    x: a float32, bfloat16 or float16 array; its last axis (the features)
      is quantized and must be neither ``split_axis`` nor ``concat_axis``.
    axis_name: the mapped axis, as for ``jax.lax.all_to_all``.
    split_axis: as for ``jax.lax.all_to_all``.
    concat_axis: as for ``jax.lax.all_to_all``.
    tiled: as for ``jax.lax.all_to_all``.
    config: an :class:`Fp8Config` with current scaling and granularity
      ``"blockwise"`` (default: the ``fp8_blockwise`` recipe, 1 x 128 tiles,
      e4m3 both ways), ``"mxfp8"`` or ``"row"``.

  Returns:
    ``jax.lax.all_to_all(x, ...)``'s result, each row dequantized from
    float8 (bit for bit the result of quantizing and dequantizing the rows
    of the plain all-to-all's result).

  Raises:
    TypeError: for a non-floating ``x`` or a config that is not an
      ``Fp8Config``.
    ValueError: for a split or concat axis that is the last axis, a
      per-tensor or delayed recipe, or axes out of range.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from jmp_lite import fp8
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    >>> dispatch = jax.shard_map(
    ...     lambda x: fp8.all_to_all(x, "expert", 0, 0, tiled=True),
    ...     mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    >>> dispatch(jnp.full((4, 128), 3.0, jnp.bfloat16))[0, :2]
    Array([3, 3], dtype=bfloat16)
  """
  owner = "fp8_all_to_all"
  if not isinstance(config, recipes_lib.Fp8Config):
    raise TypeError(
        f"{owner}: config must be an Fp8Config, got {type(config).__name__}: "
        f"{config!r}. {DISPATCH_GRANULARITY_HELP}")
  if (config.granularity not in DISPATCH_GRANULARITIES
      or config.scaling != "current"):
    raise ValueError(
        f"{owner}: the recipe {config.spec()!r} (granularity "
        f"{config.granularity!r}, {config.scaling} scaling) cannot quantize "
        f"a dispatch. {DISPATCH_GRANULARITY_HELP}")
  x = checks.float_array(x, "x")
  dtypes_lib.canonical_dtype(x.dtype, f"{owner}'s x")
  axes = []
  for what, axis in (("split_axis", split_axis), ("concat_axis", concat_axis)):
    axis = checks.integer(axis, what, owner, low=-x.ndim, high=x.ndim - 1)
    axes.append(axis % x.ndim)
  if x.ndim - 1 in axes:
    raise ValueError(
        f"{owner}: split_axis={split_axis}, concat_axis={concat_axis} on an "
        f"array of shape {tuple(x.shape)} move the last axis. "
        f"{FEATURE_AXIS_HELP}")
  tiled = checks.flag(tiled, "tiled", owner)
  return _all_to_all(x, axis_name, axes[0], axes[1], tiled, config)


# ---------------------------------------------------------------------------
# FSDP: the weight all-gather of a float8 matmul, 1 byte per element.
# ---------------------------------------------------------------------------

NO_FSDP_MESH = (
    "A recipe's fsdp_axis={axis!r} gathers the quantized (float8 or int8) "
    "weight over the mesh "
    "axis {axis!r}, which it reads from the mesh set where the step is "
    "traced, but {found}. Trace the step under that mesh: "
    "`with jax.set_mesh(mesh): step(params, batch)`, with the weights "
    "sharded over {axis!r} "
    "(e.g. NamedSharding(mesh, P({axis!r}, None))); or leave fsdp_axis None "
    "to let XLA partition the matmul."
)
FSDP_PARTLY_MANUAL = (
    "A recipe's fsdp_axis={axis!r} names mesh axes of which some are manual "
    "here (inside jax.shard_map) and some are not. Name only the shard_map "
    "axes the weight is sharded over (the weight then arrives as this "
    "device's shard), or only axes of the jax.jit mesh."
)
FSDP_SHARD_MAP_SHARD = (
    "{owner}: under jax.shard_map, fsdp_axis={axis!r} ({n} shards) takes the "
    "rhs as this device's shard of the weight, split along its one "
    "contracting dimension (FSDP's in_specs=P({axis!r}, None) for a (K, N) "
    "kernel), but {found}. Pass the shard (shape[contracting] * {n} == the "
    "lhs's contracting size), or leave fsdp_axis None and gather the weight "
    "yourself (jax.lax.all_gather)."
)
FSDP_SHARD_MAP_BLOCKS = (
    "{owner}: under jax.shard_map, fsdp_axis={axis!r} gathers the quantized "
    "shards of the weight, each {local} long along the contracting "
    "dimension, which the recipe {recipe!r} splits into blocks of {block}: "
    "a block would straddle two shards. Use a shard length that is a "
    "multiple of {block}, or the 'fp8', 'fp8_rowwise', 'int8' or "
    "'int8_switchback' recipe (no blocks along it)."
)
FSDP_SHARD_MAP_DELAYED = (
    "{owner}: fsdp_axis={axis!r} under jax.shard_map takes current scaling "
    "(every shard's amax is max-reduced where it is quantized); a delayed "
    "recipe's scales would need the gathered weight's history. Use a "
    "current-scaling recipe here, or run the step under jax.jit."
)


def _axis_names(axis: Any) -> tuple[Any, ...]:
  return axis if isinstance(axis, tuple) else (axis,)


def manual_fsdp_axis(config: Any) -> Any:
  """``config.fsdp_axis`` where it names manual axes here (inside
  ``jax.shard_map``: the weight arrives as this device's shard and the
  matmul gathers it with ``jax.lax.all_gather``), else None (under
  ``jax.jit`` the partitioner gathers: :func:`fsdp_replicated`).

  Raises:
    ValueError: for axes of which only some are manual.
  """
  axis = getattr(config, "fsdp_axis", None)
  if axis is None:
    return None
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  names = set(_axis_names(axis))
  if not names & manual:
    return None
  if not names <= manual:
    raise ValueError(FSDP_PARTLY_MANUAL.format(axis=axis))
  return axis


def fsdp_shards(axis: Any) -> int:
  """The number of shards over the mesh axes ``axis`` (the mesh set here)."""
  shape = jax.sharding.get_abstract_mesh().shape
  return int(np.prod([shape[n] for n in _axis_names(axis)]))


def fsdp_weight_shape(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                      config: Any, owner: str) -> tuple[int, ...]:
  """The shape of the whole weight whose shard ``rhs`` is, under
  ``jax.shard_map`` with ``config.fsdp_axis`` (:func:`manual_fsdp_axis`):
  ``rhs.shape`` with its one contracting dimension times the shard count;
  elsewhere ``rhs.shape``. Dimension numbers that do not parse are left to
  the caller's check.

  Raises:
    ValueError: for a rhs that is not such a shard, a delayed recipe, or
      shards that split the recipe's blocks (each message says how to fix
      it).
  """
  axis = manual_fsdp_axis(config)
  if axis is None:
    return tuple(rhs.shape)
  if getattr(config, "scaling", "current") != "current":
    raise ValueError(FSDP_SHARD_MAP_DELAYED.format(owner=owner, axis=axis))
  n = fsdp_shards(axis)
  try:
    (lc, rc), _ = dimension_numbers
  except (TypeError, ValueError):
    return tuple(rhs.shape)
  lc, rc = checks.integer_axes(lc), checks.integer_axes(rc)
  if (lc is None or rc is None or not all(0 <= a < lhs.ndim for a in lc)
      or not all(0 <= a < rhs.ndim for a in rc)):
    return tuple(rhs.shape)     # (the caller's check names the problem)
  found = None
  if len(rc) != 1 or len(lc) != 1:
    found = f"the dimension numbers contract {len(rc)} dimensions"
  elif rhs.shape[rc[0]] * n != lhs.shape[lc[0]]:
    found = (f"the lhs contracts {lhs.shape[lc[0]]} elements and the rhs "
             f"(shape {tuple(rhs.shape)}) {rhs.shape[rc[0]]}")
  if found:
    raise ValueError(FSDP_SHARD_MAP_SHARD.format(owner=owner, axis=axis, n=n,
                                                 found=found))
  block = {"blockwise": getattr(config, "block_size", None),
           "mxfp8": 32}.get(getattr(config, "granularity", None))
  if block and rhs.shape[rc[0]] % block:
    raise ValueError(FSDP_SHARD_MAP_BLOCKS.format(
        owner=owner, axis=axis, local=rhs.shape[rc[0]], block=block,
        recipe=config.spec()))
  shape = list(rhs.shape)
  shape[rc[0]] *= n
  return tuple(shape)


def manual_gathered(x: jax.Array, axis: Any, dim: int) -> jax.Array:
  """``x`` all-gathered (tiled) over the manual axes ``axis`` along ``dim``,
  as its bits (1 byte per float8 or int8 element)."""
  return parallel_lib.moved_as_bits(x, lambda bits: jax.lax.all_gather(
      bits, axis, axis=dim, tiled=True))


def fsdp_gathered(x: jax.Array, config: Any, dim: int,
                  along: bool = True) -> jax.Array:
  """A quantized weight's values or scales, gathered for
  ``config.fsdp_axis`` as their bits: under ``jax.shard_map`` all-gathered
  along ``dim`` (its K axis) where they vary along it (``along``; a scale
  shared by every shard stays as it is); under ``jax.jit`` constrained to
  be replicated (:func:`fsdp_replicated`: the partitioner gathers them)."""
  axis = manual_fsdp_axis(config)
  if axis is not None:
    return manual_gathered(x, axis, dim) if along else x
  return gathered(x, fsdp_replicated(config.fsdp_axis))


def manual_scattered(x: jax.Array, axis: Any, dim: int) -> jax.Array:
  """The weight gradient of a gathered weight: ``x`` summed over the manual
  axes ``axis`` and scattered (tiled) along ``dim``, as the derivative of
  ``jax.lax.all_gather`` is (in ``x``'s dtype: float32)."""
  return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def fsdp_replicated(axis: Any) -> jax.sharding.NamedSharding:
  """The sharding a float8 weight takes once gathered over the mesh axis (or
  axes) ``axis``: replicated (``PartitionSpec()``) on the mesh set where
  this is traced (``jax.set_mesh``).

  Fully replicated: FSDP over ``axis``; a weight also sharded over another
  mesh axis (tensor parallelism) is gathered over that one too.

  Raises:
    ValueError: no mesh is set, or it lacks ``axis``; each message says how
      to fix it.
  """
  mesh = jax.sharding.get_abstract_mesh()
  names = _axis_names(axis)
  if mesh.empty:
    raise ValueError(NO_FSDP_MESH.format(axis=axis, found="no mesh is set"))
  missing = [n for n in names if n not in mesh.axis_names]
  if missing:
    raise ValueError(NO_FSDP_MESH.format(
        axis=axis, found=f"the mesh set has no axis {missing[0]!r} (its axes: "
        f"{', '.join(map(repr, mesh.axis_names))})"))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def gathered(x: jax.Array, sharding: Any) -> jax.Array:
  """``x`` constrained to ``sharding`` (replicated: the partitioner gathers
  it) as its bits (``uint8`` for float8 values and E8M0 scales, ``uint32``
  for float32 scales): what moves is the payload at its own width."""
  # The optimization barrier pins the gather to the bits: without it XLA's
  # sharding propagation moves the replicated sharding back through the
  # bitcast and gathers the float8 array, which XLA:CPU widens to float16.
  move = lambda bits: jax.lax.with_sharding_constraint(
      jax.lax.optimization_barrier(bits), sharding)
  return parallel_lib.moved_as_bits(x, move)
