"""Cross-device gradient reduction in float32 (or wider), and its wire formats.

With a half-precision compute dtype the data-parallel all-reduce of the
gradients runs in half precision (under ``jax.jit`` + sharding, right after
each backward matmul; under ``shard_map``, inside the backward pass; under
``pmap``, in the gradients' dtype). :func:`pmean_value_and_grad` makes it
float32, with ``num_groups=`` under ``jax.jit`` + sharding and with
``axis_name=`` under ``pmap``/``shard_map``; either way the gradients come
back float32 (or wider). Guide: ``docs/precision.md``.

With ``axis_name`` it can also send fewer bytes (``wire_format``):
every device's sum is computed in float32, only what travels is narrower.
The all-reduce is then a reduce-scatter (an ``all_to_all`` of the narrow
values, then a float32 sum of the pieces each device receives: Megatron's
``reduce_scatter_with_fp32_accumulation``) followed by an ``all_gather`` of
the narrow mean; ``"e4m3"`` scales each gradient leaf with a scale every
device shares (one ``pmax`` of the leaves' amaxes, NaN counted as inf:
MS-AMP's rule) before each of the two transfers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.low_precision import formats as formats_lib


#: What a value-and-grad function must return.
VALUE_AND_GRAD_OUTPUT = (
    "{caller}: the value-and-grad function must return (loss, grads) as "
    "jax.value_and_grad does, the loss an array, or ((loss, aux), grads) with "
    "has_aux=True; got {got} with has_aux={has_aux}. Then pass has_aux=True if "
    "it returns ((loss, aux), grads), has_aux=False if it returns (loss, grads)."
)

#: A batch that the groups do not divide.
GROUPS_DO_NOT_DIVIDE = (
    "{caller}: num_groups={num_groups} does not divide the leading (batch) "
    "axis of batch leaf {where}, of size {size} (shape {shape}). Use a batch "
    "size that is a multiple of num_groups (the data-parallel device count), "
    "e.g. {fit}."
)


def _split_value(out: Any, has_aux: bool, caller: str) -> tuple[Any, Any, Any]:
  """``(loss, aux, grads)`` from a value-and-grad function's output."""
  pair = lambda x: isinstance(x, (tuple, list)) and len(x) == 2
  if not (pair(out) and (pair(out[0]) if has_aux
                         else checks.is_array(out[0]))):
    kind = lambda x: "an array" if checks.is_array(x) else type(x).__name__
    got = f"({kind(out[0])}, grads)" if pair(out) else kind(out)
    raise TypeError(VALUE_AND_GRAD_OUTPUT.format(caller=caller, got=got, has_aux=has_aux))
  value, grads = out
  if has_aux:
    return value[0], value[1], grads
  return value, None, grads


def _join(loss: Any, aux: Any, grads: Any, has_aux: bool) -> Any:
  return ((loss, aux), grads) if has_aux else (loss, grads)


def _mean_groups(x: Any) -> Any:
  """The mean over the leading (group) axis, computed in float32 or wider."""
  if tree_lib.is_float(x):
    return jnp.mean(tree_lib.widen_floating(x), axis=0)
  return x[0] if checks.is_array(x) else x


def _grouped(value_and_grad_fn: Callable[..., Any], num_groups: Any,
             batch_argnums: Any, has_aux: bool,
             caller: str) -> Callable[..., Any]:
  """:func:`pmean_value_and_grad` with ``num_groups`` (under ``jax.jit``)."""
  num_groups = checks.integer(num_groups, "num_groups", caller, 1)
  batch_nums = checks.argnums(batch_argnums, "batch_argnums", caller)

  def split_leaf(path, x):
    if not checks.is_array(x) or np.ndim(x) == 0:
      return x, None
    size = x.shape[0]
    if size % num_groups:
      raise ValueError(GROUPS_DO_NOT_DIVIDE.format(
          caller=caller, num_groups=num_groups, size=size,
          where=jax.tree_util.keystr(path) or "<root>", shape=tuple(x.shape),
          fit=-(-size // num_groups) * num_groups))
    return x.reshape((num_groups, size // num_groups) + tuple(x.shape[1:])), 0

  def split_batch(batch, argnum):
    leaves, treedef = jax.tree.flatten_with_path(batch)
    out = [split_leaf((jax.tree_util.SequenceKey(argnum),) + p, x)
           for p, x in leaves]
    return (jax.tree.unflatten(treedef, [x for x, _ in out]),
            jax.tree.unflatten(treedef, [a for _, a in out]))

  def wrapped(*args, **kwargs):
    checks.argnums_in_range(batch_nums, "batch_argnums", len(args), caller)
    args = list(args)
    in_axes: list[Any] = [None] * len(args)
    for i in batch_nums:
      args[i], in_axes[i] = split_batch(args[i], i)

    def one_group(*group_args):
      loss, aux, grads = _split_value(
          value_and_grad_fn(*group_args, **kwargs), has_aux, caller)
      return loss, aux, grads

    loss, aux, grads = jax.vmap(one_group, in_axes=tuple(in_axes))(*args)
    loss_dtype = loss.dtype
    loss = jnp.mean(tree_lib.widen_floating(loss), axis=0).astype(loss_dtype)
    grads = jax.tree.map(_mean_groups, grads)
    return _join(loss, aux, grads, has_aux)

  return wrapped


def _pmean_f32(tree: Any, axis_name: Any) -> Any:
  """``lax.pmean`` in float32: each floating leaf is cast to float32 (float64
  stays) before the collective, so the all-reduce sums in float32; other
  leaves pass through. (A float16 sum of eight 40000.0 is inf.)"""
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if tree_lib.is_float(x)]
  if where:
    means = lax.pmean([tree_lib.widen_floating(leaves[i]) for i in where],
                      axis_name)
    for i, m in zip(where, means):
      leaves[i] = m
  return jax.tree.unflatten(treedef, leaves)


#: The formats :func:`pmean_value_and_grad` can send gradients in.
WIRE_FORMATS: tuple[str, ...] = ("float32", "bfloat16", "e4m3")
#: The largest e4m3 value (a scaled leaf's amax lands on it).
_E4M3_MAX = 448.0
#: The largest scale the e4m3 wire applies (a leaf whose amax is below
#: 448 / 2**100 is sent with this scale: less precision for values that
#: small, never an overflow of the scale to inf).
_E4M3_MAX_SCALE = 2.0**100


def _amax(x: jax.Array) -> jax.Array:
  """max |x| in float32, NaN counted as inf (a max-reduce may drop NaN)."""
  a = jnp.abs(x.astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), initial=0.0)


def _e4m3_scale(amax: jax.Array) -> jax.Array:
  """448 / amax, 1 for amax 0 or not finite, at most ``_E4M3_MAX_SCALE``."""
  ok = (amax > 0) & jnp.isfinite(amax)
  scale = jnp.where(ok, _E4M3_MAX / jnp.where(ok, amax, 1.0), 1.0)
  return jnp.minimum(scale, _E4M3_MAX_SCALE)


def moved_as_bits(x: jax.Array,
                  move: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """``move(x)`` for a collective that only moves data (all_to_all,
  all_gather), on ``x``'s bits as unsigned integers of its width: no
  compiler can widen an integer payload to a wider float (XLA:CPU turns a
  bfloat16 all_to_all into a float32 one, and a float8 one into float16)."""
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return lax.bitcast_convert_type(
      move(lax.bitcast_convert_type(x, bits)), x.dtype)


def _wire_pmean(values: list[jax.Array], axis_name: Any,
                wire: str) -> list[jax.Array]:
  """The float32 mean over ``axis_name`` of float arrays, sent as ``wire``
  (see the module docstring): one bucket of all of them, cut into one piece
  per device."""
  n = lax.psum(1, axis_name)
  sizes = [int(np.prod(x.shape)) for x in values]
  total = sum(sizes)
  piece = -(-total // n)
  flat = jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in values])
  flat = jnp.pad(flat, (0, piece * n - total))
  scatter = lambda x: lax.all_to_all(x, axis_name, 0, 0, tiled=True)
  gather = lambda x: compat.all_gather_invariant(x, axis_name)
  if wire == "bfloat16":
    got = moved_as_bits(flat.astype(jnp.bfloat16).reshape(n, piece), scatter)
    mine = jnp.sum(got.astype(jnp.float32), axis=0) / n
    full = moved_as_bits(mine.astype(jnp.bfloat16), gather).astype(jnp.float32)
    bad = None
  else:
    # Which leaf each position of the bucket holds (the padding: one more).
    ids = np.repeat(np.arange(len(values) + 1),
                    sizes + [piece * n - total]).astype(np.int32)
    amax = lax.pmax(jnp.stack([_amax(x) for x in values]), axis_name)
    scale = jnp.concatenate([_e4m3_scale(amax), jnp.ones((1,), jnp.float32)])
    at = scale[ids]                                             # [n * piece]
    sent = formats_lib.saturating_cast(flat * at, "e4m3").reshape(n, piece)
    got = moved_as_bits(sent, scatter)
    me = lax.axis_index(axis_name)
    my_ids = lax.dynamic_index_in_dim(ids.reshape(n, piece), me, 0,
                                      keepdims=False)
    my_at = lax.dynamic_index_in_dim(at.reshape(n, piece), me, 0,
                                     keepdims=False)
    mine = jnp.sum(got.astype(jnp.float32), axis=0) / my_at / n
    # The mean's own shared scale per leaf, for the gather.
    amax2 = jnp.zeros((len(values) + 1,), jnp.float32).at[my_ids].max(
        jnp.where(jnp.isnan(mine), jnp.inf, jnp.abs(mine)))
    amax2 = lax.pmax(amax2[:len(values)], axis_name)
    scale2 = jnp.concatenate([_e4m3_scale(amax2),
                              jnp.ones((1,), jnp.float32)])
    sent2 = formats_lib.saturating_cast(mine * scale2[my_ids], "e4m3")
    full = moved_as_bits(sent2, gather).astype(jnp.float32) / scale2[ids]
    # A leaf with a NaN or inf on any device is NaN on every device: inf -
    # inf is NaN, and a finite amax adds 0 (no NaN constant in the program).
    bad = (amax - amax) + (amax2 - amax2)
  out, start = [], 0
  for i, (x, size) in enumerate(zip(values, sizes)):
    leaf = full[start:start + size].reshape(x.shape)
    if bad is not None:
      leaf = leaf + bad[i]
    out.append(leaf.astype(x.dtype))
    start += size
  return out


def _pmean_wire(tree: Any, axis_name: Any, wire: str) -> Any:
  """:func:`_pmean_f32`, the floating leaves sent as ``wire``."""
  if wire == "float32":
    return _pmean_f32(tree, axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if tree_lib.is_float(x)
           and np.prod(np.shape(x)) > 0]
  if where:
    means = _wire_pmean([tree_lib.widen_floating(leaves[i]) for i in where],
                        axis_name, wire)
    for i, m in zip(where, means):
      leaves[i] = m
  return jax.tree.unflatten(treedef, leaves)


#: Where each of pmean_value_and_grad's two modes applies.
WHERE_TO_REDUCE = (
    "Pass axis_name='batch' inside jax.pmap or jax.shard_map over that axis "
    "(the mapped axis the gradients are averaged over), or num_groups=N (the "
    "data-parallel device count) under jax.jit with a sharded batch (the "
    "batch is split into N groups whose gradients are averaged in float32)."
)


def pmean_value_and_grad(
    value_and_grad_fn: Callable[..., Any],
    axis_name: Any = None,
    *,
    num_groups: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    wire_format: str = "float32",
) -> Callable[..., Any]:
  """Makes the cross-device gradient reduction float32 (or wider).

  With a half-precision compute dtype the data-parallel all-reduce of the
  gradients runs in half precision. The returned function averages the loss
  and the gradients in float32 instead; give exactly one of:

  - ``axis_name``, inside ``jax.pmap`` or ``jax.shard_map``: call the
    returned function there with each device's share of the batch; it runs
    ``value_and_grad_fn`` and averages across ``axis_name`` in float32.
    Under ``shard_map`` it first marks the differentiated arguments
    (``argnums``) as varying, so that JAX does not sum their gradients in
    half precision inside the backward pass.
  - ``num_groups``, under ``jax.jit`` with a sharded batch (where ``jit``
    all-reduces each weight gradient in its backward matmul's dtype): the
    returned function splits the batch's leading axis into ``num_groups``
    groups, computes one gradient per group with ``jax.vmap`` and averages
    the groups in float32: that average is the all-reduce. Use the
    data-parallel device count; the loss must be a mean over the examples;
    batch statistics and ``aux`` become per group.

  Guide: ``docs/precision.md``.

  Args:
    value_and_grad_fn: a function returning ``(loss, grads)`` or, with
      ``has_aux=True``, ``((loss, aux), grads)``: ``jax.value_and_grad(...)``
      or ``jmp_lite.scaled_value_and_grad(...)``.
    axis_name: the mapped axis name (a string, or a tuple of them), under
      ``pmap``/``shard_map``.
    num_groups: under ``jax.jit``, the number of groups (an int >= 1) the
      leading axis of the batch is split into; it must divide the batch
      size.
    argnums: with ``axis_name``, the positional argument(s)
      ``value_and_grad_fn`` differentiates (as its own ``argnums``; default
      0).
    batch_argnums: with ``num_groups``, the positional argument(s) holding
      the batch (default 1: ``fn(params, batch)``). Every array leaf of them
      with at least one dimension is split along its leading axis; scalars
      and non-array leaves go to every group unchanged, as do the other
      arguments and keyword arguments.
    has_aux: whether ``value_and_grad_fn`` returns ``((loss, aux), grads)``.
    wire_format: with ``axis_name``, what the gradients travel in:
      ``"float32"`` (default: one float32 all-reduce), ``"bfloat16"`` (half
      the bytes: an ``all_to_all`` in bfloat16, a float32 sum on each
      device, an ``all_gather`` of the bfloat16 mean) or ``"e4m3"``
      (experimental, a quarter of the bytes: the same in float8 e4m3, each
      leaf scaled by a scale every device shares). The sums are float32 in
      every format; the error bound of each is in ``docs/precision.md``. A
      NaN or inf on one device reaches every device's gradients, so a
      loss-scaling check skips the step everywhere. The loss is averaged in
      float32. (With ``num_groups``, ``jit`` emits the reduction itself:
      only ``"float32"``.)

  Returns:
    A function with ``value_and_grad_fn``'s signature returning the averaged
    loss (in its own dtype) and the averaged gradients (float32 or wider);
    ``aux`` is returned as computed on each device (varying under
    ``shard_map``: average it or give it a per-device ``out_specs``), or per
    group with ``num_groups``.

  Raises:
    TypeError: if ``value_and_grad_fn`` is not callable, neither or both of
      ``axis_name`` and ``num_groups`` are given, an option of the other
      mode is given (``argnums`` or ``wire_format`` with ``num_groups``,
      ``batch_argnums`` with ``axis_name``), ``axis_name`` is not a string
      or a tuple of strings, or an option has the wrong type; at call time,
      if ``value_and_grad_fn`` does not return ``(value, grads)``.
    ValueError: for ``num_groups < 1``, a negative or repeated ``argnums``
      or ``batch_argnums``, an unknown ``wire_format`` or a narrow one with
      ``num_groups``; at call time, if ``argnums`` (``batch_argnums``) is
      out of range, the axis is not bound, or a batch leaf's leading axis is
      not divisible by ``num_groups``.

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def loss_fn(w, x):
    ...   return jnp.mean((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))
    >>> step = jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss_fn), "i")
    >>> w, xs = jnp.ones((3,), jnp.bfloat16), jnp.ones((4, 2, 3))   # 4 "devices"
    >>> loss, grads = jax.vmap(step, in_axes=(None, 0), axis_name="i")(w, xs)
    >>> float(loss[0]), grads.dtype
    (3.0, dtype('float32'))
    >>> grad_fn = jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss_fn),
    ...                                         num_groups=4)   # under jit
    >>> loss, grads = jax.jit(grad_fn)(w, jnp.ones((8, 3)))
    >>> float(loss), grads.dtype, grads.shape
    (3.0, dtype('float32'), (3,))
  """
  caller = "pmean_value_and_grad"
  checks.function(value_and_grad_fn, caller, "a value-and-grad function "
                  "such as jax.value_and_grad(loss_fn)")
  if (axis_name is None) == (num_groups is None):
    got = ("neither" if axis_name is None else
           f"both (axis_name={axis_name!r}, num_groups={num_groups!r})")
    raise TypeError(f"{caller} needs exactly one of axis_name and "
                    f"num_groups, got {got}. {WHERE_TO_REDUCE}")
  if num_groups is not None:
    if argnums != 0:
      raise TypeError(
          f"{caller}: argnums={argnums!r} applies with axis_name (under "
          "pmap/shard_map, the arguments marked as varying); with "
          "num_groups every argument value_and_grad_fn differentiates is "
          "reduced. Leave argnums out, or use axis_name. " + WHERE_TO_REDUCE)
    if wire_format != "float32":
      checks.choice(wire_format, "wire_format", caller, WIRE_FORMATS)
      raise ValueError(
          f"{caller}: wire_format={wire_format!r} needs axis_name under "
          "jax.shard_map or jax.pmap, where the reduction is emitted here; "
          "with num_groups (under jax.jit) XLA emits the reduction itself, "
          "which only a float32 wire can be asked of. Leave wire_format "
          "out, or reduce under shard_map with axis_name.")
    return _grouped(value_and_grad_fn, num_groups, batch_argnums, has_aux,
                    caller)
  if batch_argnums != 1:
    raise TypeError(
        f"{caller}: batch_argnums={batch_argnums!r} applies with num_groups "
        "(under jax.jit, the arguments whose batch is split into groups); "
        "with axis_name each device already holds its share of the batch. "
        "Leave batch_argnums out, or use num_groups. " + WHERE_TO_REDUCE)
  checks.axis_name(axis_name)
  nums = checks.argnums(argnums, "argnums", caller)
  wire = checks.choice(wire_format, "wire_format", caller, WIRE_FORMATS)

  def wrapped(*args, **kwargs):
    checks.argnums_in_range(nums, "argnums", len(args), caller)
    checks.bound_axis(axis_name, caller)
    args = list(args)
    for i in nums:
      args[i] = jax.tree.map(
          lambda x: compat.to_varying(x, axis_name)
          if tree_lib.is_float(x) else x, args[i])
    loss, aux, grads = _split_value(value_and_grad_fn(*args, **kwargs), has_aux,
                                    caller)
    loss_dtype = loss.dtype
    loss = _pmean_f32(loss, axis_name).astype(loss_dtype)
    return _join(loss, aux, _pmean_wire(grads, axis_name, wire), has_aux)

  return wrapped


def grouped_value_and_grad(
    value_and_grad_fn: Callable[..., Any],
    num_groups: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """The old (deprecated) spelling of ``pmean_value_and_grad(value_and_grad_fn,
  num_groups=num_groups, ...)`` (``jmp_lite.grouped_value_and_grad`` warns
  and calls this, for one release)."""
  return pmean_value_and_grad(value_and_grad_fn, num_groups=num_groups,
                              batch_argnums=batch_argnums, has_aux=has_aux)
