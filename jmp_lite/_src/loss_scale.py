"""Loss scales: no-op, static and dynamic.

A loss scale multiplies the loss before differentiation so that small
half-precision gradients do not underflow to zero, and divides the gradients
afterwards. ``DynamicLossScale`` also adapts the scale: it backs off on a step
with non-finite gradients and grows after ``period`` finite steps in a row.

All three are pytrees. Their only leaves are arrays (``loss_scale`` and, for the
dynamic scale, ``counter``); the dynamic scale's configuration (``period``,
``factor``, ``backoff_factor``, ``hysteresis``, ``min_loss_scale``,
``max_loss_scale``) is static and survives ``jax.jit``, ``tree_map`` and
checkpoint round-trips.

Every scale stays within [:data:`SCALE_MIN`, :data:`SCALE_MAX`] = [2**-126,
2**126], where both the scale and its reciprocal are normal float32 numbers:
unscaling (a multiplication by the reciprocal) never flushes to zero, and a
long run cannot grow the scale into a value that silently zeroes every update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar, Union, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib

T = TypeVar("T")

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


SCALE_MIN = checks.SCALE_MIN
SCALE_MAX = checks.SCALE_MAX


def _scalar_leaf(x: Any, dtype: np.dtype) -> jax.Array:
  """A checked scalar as a ``dtype`` array (a float16/int scale -> float32)."""
  if isinstance(x, jax.Array):
    return x if x.dtype == dtype else x.astype(dtype)
  return jnp.asarray(x, dtype=dtype)


def _counter_leaf(x: Any, owner: str) -> jax.Array:
  """Validates ``counter`` (a whole number >= 0, or a traced int array)."""
  if checks.is_concrete(x):
    return jnp.asarray(
        checks.integer(x, "counter", owner, whole_floats=True), _I32)
  checks.real_scalar(x, "counter", owner)
  return _scalar_leaf(x, _I32)


def _factor(x: Any, what: str, owner: str, grows: bool) -> float:
  """A growth factor (> 1) or a back-off factor (in (0, 1)), in float32."""
  value = checks.number(x, what, owner)
  f32 = np.float32(value)
  if not (f32 > 1 if grows else 0 < f32 < 1):
    rule, default = (("> 1", "2 (the default)") if grows
                     else ("in (0, 1)", "0.5 (torch's default)"))
    rounds = " (it rounds to 1)" if grows and value > 1 else ""
    raise ValueError(
        f"{owner}: {what} must be {rule} in float32 (the scale is multiplied "
        f"by it to {'grow' if grows else 'back off'}), got {value!r}{rounds}. "
        f"Use {default}.")
  return value


#: What min_loss_scale=0 means.
NO_FLOOR = (" Use min_loss_scale=0 for no floor of your own (the scale then "
            "stops at 2**-126).")


def _floor(x: Any, owner: str) -> float:
  """``min_loss_scale``: 0 (no floor of one's own) or a valid scale."""
  if checks.number(x, "min_loss_scale", owner) == 0:
    return 0.0
  return checks.loss_scale_value(x, "min_loss_scale", owner, NO_FLOOR)


def _register(cls):
  """Registers a frozen dataclass as a pytree; ``static`` fields are treedef.

  Fields come from ``dataclasses.fields`` and their ``static`` metadata, so no
  field can be forgotten (jmp's flatten dropped ``min_loss_scale``). Unlike
  ``jax.tree_util.register_dataclass``, unflattening does not call
  ``__init__``: JAX rebuilds pytrees with tracers, stacked arrays (``pmap``,
  ``vmap``), ``ShapeDtypeStruct``s and placeholder objects as leaves, so the
  constructor's validation must only run on a user's call, like a NamedTuple's.
  """
  fields = dataclasses.fields(cls)
  data = tuple(f.name for f in fields if not f.metadata.get("static", False))
  meta = tuple(f.name for f in fields if f.metadata.get("static", False))
  keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

  def flatten_with_keys(obj):
    children = tuple((k, getattr(obj, n)) for k, n in zip(keys, data))
    return children, tuple(getattr(obj, n) for n in meta)

  def flatten(obj):
    return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in meta)

  def unflatten(aux, children):
    return _new(cls, {**dict(zip(meta, aux)), **dict(zip(data, children))})

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls


def _new(cls, values: dict[str, Any]):
  """Builds a frozen dataclass from its field values without ``__init__``."""
  obj = object.__new__(cls)
  for name, value in values.items():
    object.__setattr__(obj, name, value)
  return obj


def _replace(obj, **changes):
  """Like ``dataclasses.replace`` without re-running ``__init__`` (jit-safe)."""
  fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
  return _new(type(obj), {**fields, **changes})


@runtime_checkable
class LossScale(Protocol):
  """The interface shared by every loss scale.

  ``NoOpLossScale``, ``StaticLossScale`` and ``DynamicLossScale`` implement it;
  ``isinstance(x, jmp_lite.LossScale)`` checks for the methods.

  Example:
    >>> import jmp_lite
    >>> isinstance(jmp_lite.DynamicLossScale(2.0**15), jmp_lite.LossScale)
    True
  """

  @property
  def loss_scale(self) -> Any:
    """The current scale (a float32 scalar)."""

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of ``tree`` by the scale."""

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of ``tree`` by the scale."""

  def adjust(self, grads_finite: Any) -> "LossScale":
    """Returns the loss scale for the next step."""


def _scale_tree(tree: T, loss_scale: Any) -> T:
  """``x * loss_scale`` for floating leaves, in ``promote_types(x.dtype, f32)``.

  Python numbers are scaled too (as jmp does: ``scale(1.0)`` of a scale of
  ``2**15`` is ``32768.0``), as float32 arrays; other leaves pass through.
  """

  def scale(x):
    if checks.is_real_number(x) and not checks.is_array(x):
      return jnp.asarray(x, _F32) * jnp.asarray(loss_scale, _F32)
    if not tree_lib.is_float(x):
      return x
    dtype = dtypes.at_least_f32(x.dtype)
    return jnp.asarray(x, dtype) * jnp.asarray(loss_scale).astype(dtype)

  return jax.tree.map(scale, tree)



def _unscale_tree(tree: T, loss_scale: Any) -> T:
  """``x / loss_scale`` in ``promote_types(x.dtype, f32)``, returned in it.

  Half-precision leaves come back in float32, as in jmp: a small true
  gradient that the scale lifted into float16's range would flush to zero
  again if the quotient were rounded back to float16.
  """
  inv = 1.0 / jnp.asarray(loss_scale, _F32)

  def unscale(x):
    if not tree_lib.is_float(x):
      return x
    dtype = dtypes.at_least_f32(x.dtype)
    return jnp.asarray(x, dtype) * inv.astype(dtype)

  return jax.tree.map(unscale, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale that does nothing: for float32/bfloat16 training.

  ``scale`` and ``unscale`` return their input unchanged and ``adjust`` returns
  the same object, so code written for a loss scale runs unscaled.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.NoOpLossScale()
    >>> ls.scale(jnp.float32(3.0)), ls.loss_scale
    (Array(3., dtype=float32), 1)
  """

  @property
  def loss_scale(self) -> int:
    """Always 1 (as in jmp)."""
    return 1

  def scale(self, tree: T) -> T:
    """Returns ``tree`` unchanged."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns ``tree`` unchanged."""
    return tree

  def adjust(self, grads_finite: Any) -> "NoOpLossScale":
    """Returns ``self`` (after checking ``grads_finite`` is a scalar bool)."""
    checks.predicate(grads_finite, "NoOpLossScale.adjust's grads_finite")
    return self


@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale:
  """A fixed loss scale.

  Args:
    loss_scale: the scale, a scalar in [2**-126, 2**126]; stored as float32
      whatever dtype it is given in.

  Raises:
    TypeError: if ``loss_scale`` is not a real number.
    ValueError: if it is not a scalar in [2**-126, 2**126] (outside, float32
      would store it as 0 or inf, or its reciprocal would flush to 0).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.StaticLossScale(128)
    >>> ls.scale(jnp.float16(2.0))  # computed in float32
    Array(256., dtype=float32)
    >>> ls.scale(1.0)               # Python numbers too, as in jmp
    Array(128., dtype=float32)
    >>> ls.unscale(jnp.full((2,), 256.0, jnp.float16))  # float32, as in jmp
    Array([2., 2.], dtype=float32)
  """

  loss_scale: jax.Array

  def __init__(self, loss_scale: Any):
    owner = "StaticLossScale"
    checks.real_scalar(loss_scale, "loss_scale", owner)
    checks.loss_scale_value(loss_scale, "loss_scale", owner)
    object.__setattr__(self, "loss_scale", _scalar_leaf(loss_scale, _F32))

  def scale(self, tree: T) -> T:
    """Multiplies floating leaves by the scale, in ``promote_types(dtype, f32)``."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides floating leaves by the scale, in and returning
    ``promote_types(dtype, f32)`` (float32 for half-precision leaves)."""
    return _unscale_tree(tree, self.loss_scale)

  def adjust(self, grads_finite: Any) -> "StaticLossScale":
    """Returns ``self`` (after checking ``grads_finite`` is a scalar bool)."""
    checks.predicate(grads_finite, "StaticLossScale.adjust's grads_finite")
    return self


def _field(static: bool = False, **kwargs) -> Any:
  return dataclasses.field(metadata={"static": static}, **kwargs)


@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale:
  """A loss scale that adapts to keep gradients finite and as large as possible.

  jmp's rule: ``adjust(grads_finite)`` grows the scale by ``factor`` on the
  ``period``-th finite step in a row and divides it by ``factor`` (floored at
  ``min_loss_scale``) on a non-finite one, ``counter`` back to 0 in both
  cases; torch's and Flax's options (separate factors, a cap, hysteresis) are
  additions. The scale stays in [2**-126, 2**126]. Leaves are exactly
  ``(loss_scale, counter)``; the rest is static configuration that survives
  ``jax.jit``, ``tree_map`` and checkpoints. Guide, and the options' names
  elsewhere: ``docs/training_loops.md``.

  Args:
    loss_scale: the initial scale, e.g. ``2.0**15``; converted to float32 (an
      f16/bf16/int scale is accepted and converted).
    counter: finite steps since the scale last changed (a whole number >= 0).
    period: grow after this many consecutive finite steps (a whole number
      >= 1; ``5.0`` is accepted, as jmp accepts it).
    factor: the growth factor (> 1); also the back-off divisor unless
      ``backoff_factor`` is given.
    min_loss_scale: the scale never backs off below this. ``0`` means no floor
      of your own: the scale can then fall to 2**-126 but never to 0.
    max_loss_scale: optional cap on growth (>= min_loss_scale).
    growth_factor: torch's and Flax's name for ``factor`` (give one of them).
    backoff_factor: multiply the scale by this (in (0, 1)) to back off;
      default ``1 / factor``.
    hysteresis: back off on the ``hysteresis``-th non-finite step in a row
      (>= 1; 1 backs off on every non-finite step). Every non-finite step is
      still skipped by :func:`jmp_lite.loss_scaling`.

  Raises:
    TypeError: for non-numeric or traced config, or a non-scalar, complex or
      bool scale.
    ValueError: for config that is out of range or means nothing in float32
      (``period`` or ``counter`` not whole or beyond int32, ``factor`` that
      rounds to 1, ``min_loss_scale`` that rounds to 0, a scale outside
      [2**-126, 2**126] or outside [min_loss_scale, max_loss_scale]),
      ``growth_factor`` contradicting ``factor``, or ``hysteresis < 1``.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.DynamicLossScale(jnp.float32(2**15), period=2)
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(jnp.array(False)).loss_scale)
    32768.0
    >>> torch_like = jmp_lite.DynamicLossScale(2.0**16, growth_factor=2.0,
    ...                                        backoff_factor=0.5, hysteresis=2)
    >>> float(torch_like.adjust(jnp.array(False)).loss_scale)  # 1st of 2: kept
    65536.0
  """

  loss_scale: jax.Array = _field()
  counter: jax.Array = _field()
  period: int = _field(static=True)
  factor: float = _field(static=True)
  min_loss_scale: float = _field(static=True)
  max_loss_scale: float | None = _field(static=True)
  backoff_factor: float = _field(static=True)
  hysteresis: int = _field(static=True)

  def __init__(
      self,
      loss_scale: Any,
      counter: Any = 0,
      period: int = 2000,
      factor: float = 2,
      min_loss_scale: float = 1,
      max_loss_scale: float | None = None,
      *,
      growth_factor: float | None = None,
      backoff_factor: float | None = None,
      hysteresis: int = 1,
  ):
    # Only a user's call runs this: unflattening bypasses it (see _register).
    owner = "DynamicLossScale"
    config = _dynamic_config(
        owner, period, factor, growth_factor, backoff_factor, hysteresis,
        min_loss_scale, max_loss_scale,
    )
    checks.real_scalar(loss_scale, "loss_scale", owner)
    _check_within("loss_scale",
                  checks.loss_scale_value(loss_scale, "loss_scale", owner),
                  config["min_loss_scale"], config["max_loss_scale"], owner)
    scale_leaf = _scalar_leaf(loss_scale, _F32)
    counter_leaf = _counter_leaf(counter, owner)
    for name, value in (("loss_scale", scale_leaf), ("counter", counter_leaf),
                        *config.items()):
      object.__setattr__(self, name, value)

  @property
  def growth_factor(self) -> float:
    """The growth factor (torch's and Flax's name for ``factor``)."""
    return self.factor

  def scale(self, tree: T) -> T:
    """Multiplies floating leaves by the scale, in ``promote_types(dtype, f32)``."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides floating leaves by the scale, in and returning
    ``promote_types(dtype, f32)`` (float32 for half-precision leaves)."""
    return _unscale_tree(tree, self.loss_scale)

  def adjust(self, grads_finite: Any) -> "DynamicLossScale":
    """Returns the next loss scale given whether this step's grads were finite.

    Jit-safe: the choice is made with ``jnp.where``.

    Args:
      grads_finite: scalar bool, e.g. ``jmp_lite.all_finite(grads)``.

    Returns:
      A new ``DynamicLossScale`` with the same config.

    Raises:
      TypeError / ValueError: if ``grads_finite`` is not a scalar bool.
    """
    finite = checks.predicate(
        grads_finite, "DynamicLossScale.adjust's grads_finite"
    )
    scale = jnp.asarray(self.loss_scale, _F32)
    counter = jnp.asarray(self.counter, _I32)
    cap = np.float32(min(self.max_loss_scale or SCALE_MAX, SCALE_MAX))
    floor = np.float32(max(self.min_loss_scale, SCALE_MIN))
    zero = jnp.zeros_like(counter)
    # A finite step: grow on the period-th in a row.
    streak = jnp.maximum(counter, zero)
    grow = streak >= self.period - 1
    # Multiplied from at most the scale whose growth reaches the cap: the
    # same result as min(scale * factor, cap), with no overflow to inf on
    # the way (jax_debug_infs flags that even in a finite run).
    grown = jnp.minimum(
        jnp.minimum(scale, _growth_limit(cap, self.factor))
        * np.float32(self.factor), cap)
    finite_scale = jnp.where(grow, grown, scale)
    finite_counter = jnp.where(grow, zero, streak + 1)
    # A non-finite step: back off on the hysteresis-th in a row.
    pending = jnp.maximum(-counter, zero) + 1
    back = pending >= self.hysteresis
    backed = jnp.maximum(scale * np.float32(self.backoff_factor), floor)
    bad_scale = jnp.where(back, backed, scale)
    bad_counter = jnp.where(back, zero, -pending)
    return _replace(
        self,
        loss_scale=jnp.where(finite, finite_scale, bad_scale),
        counter=jnp.where(finite, finite_counter, bad_counter),
    )


def _growth_limit(cap: np.float32, factor: float) -> np.float32:
  """``cap / factor`` as a float32 ``x`` with ``x * factor >= cap`` (rounded
  up where float32 division rounded it down)."""
  limit = np.float32(float(cap) / float(factor))
  while np.float32(limit * np.float32(factor)) < cap:
    limit = np.nextafter(limit, np.float32(np.inf))
  return limit


def _dynamic_config(
    owner, period, factor, growth_factor, backoff_factor, hysteresis,
    min_loss_scale, max_loss_scale,
) -> dict[str, Any]:
  """Validates DynamicLossScale's static configuration; returns its fields."""
  factor = _factor(factor, "factor", owner, grows=True)
  if growth_factor is not None:
    growth = _factor(growth_factor, "growth_factor", owner, grows=True)
    if factor not in (2.0, growth):
      raise ValueError(f"{owner}: growth_factor={growth} contradicts factor="
                       f"{factor}; they are the same setting (torch's name and "
                       "jmp's): give one of them.")
    factor = growth
  backoff = 1.0 / factor if backoff_factor is None else _factor(
      backoff_factor, "backoff_factor", owner, grows=False)
  floor = _floor(min_loss_scale, owner)
  cap = None if max_loss_scale is None else checks.loss_scale_value(
      checks.number(max_loss_scale, "max_loss_scale", owner),
      "max_loss_scale", owner)
  _check_within("max_loss_scale", cap, floor, None, owner)
  return dict(
      period=checks.integer(period, "period", owner, 1, whole_floats=True),
      factor=factor,
      min_loss_scale=floor,
      max_loss_scale=cap,
      backoff_factor=backoff,
      hysteresis=checks.integer(hysteresis, "hysteresis", owner, 1,
                                whole_floats=True),
  )


def _check_within(what: str, value: float | None, low: float,
                  high: float | None, owner: str) -> None:
  """A concrete scale (the initial one, the cap) within ``[low, high]``."""
  if value is not None and not low <= value <= (high or value):
    raise ValueError(
        f"{owner}: {what}={value} must be >= min_loss_scale ({low})"
        f"{f' and <= max_loss_scale ({high})' if high else ''}. Change it or "
        "the bounds.")


_register(NoOpLossScale)
_register(StaticLossScale)
_register(DynamicLossScale)

#: Any of the three loss scales (for type annotations).
AnyLossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
