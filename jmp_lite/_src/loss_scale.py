"""Loss scales: no-op, static and dynamic.

A loss scale multiplies the loss before differentiation so that small
half-precision gradients do not underflow to zero, and divides the gradients
afterwards. ``DynamicLossScale`` also adapts the scale: it backs off on a step
with non-finite gradients and grows after ``period`` finite steps in a row.

All three are pytrees. Their only leaves are arrays (``loss_scale`` and, for the
dynamic scale, ``counter``); ``period``, ``factor``, ``min_loss_scale`` and
``max_loss_scale`` are static config that survives ``jax.jit``, ``tree_map`` and
checkpoint round-trips.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Protocol, TypeVar, Union, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib

T = TypeVar("T")

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def _is_concrete(x: Any) -> bool:
  """Whether ``x``'s value can be read (it is not a tracer)."""
  return not isinstance(x, jax.core.Tracer)


def _is_complex(x: Any) -> bool:
  return isinstance(x, complex) or (
      tree_lib.is_array(x) and jnp.issubdtype(x.dtype, jnp.complexfloating)
  )


def _scalar_leaf(x: Any, dtype: np.dtype, what: str, owner: str) -> jax.Array:
  """Validates a user-given loss-scale leaf; returns it as a ``dtype`` scalar.

  Accepts Python and numpy numbers and JAX arrays (tracers too) of any real
  dtype: a float16/bfloat16/int scale becomes float32.
  """
  if isinstance(x, (bool, np.bool_)) or (
      tree_lib.is_array(x) and x.dtype == np.bool_
  ):
    raise TypeError(f"{owner}: {what} must be a number, got a bool ({x!r}).")
  if _is_complex(x):
    raise TypeError(f"{owner}: {what} must be real, got {x!r}.")
  if not (isinstance(x, numbers.Real) or tree_lib.is_array(x)):
    raise TypeError(
        f"{owner}: {what} must be a number or a scalar array, got "
        f"{type(x).__name__}: {x!r}. Pass e.g. 2.0**15."
    )
  if np.ndim(x) != 0:
    raise ValueError(
        f"{owner}: {what} must be a scalar, got an array of shape "
        f"{np.shape(x)}. Pass a single number such as 2.0**15."
    )
  if isinstance(x, jax.Array):
    return x if x.dtype == dtype else x.astype(dtype)
  return jnp.asarray(x, dtype=dtype)


def _static_number(x: Any, what: str, owner: str) -> float:
  """Reads static config (a Python or numpy number, or a concrete array)."""
  if not _is_concrete(x):
    raise TypeError(
        f"{owner}: {what} is static configuration and cannot be a traced value;"
        " pass a Python number."
    )
  if _is_complex(x):
    raise TypeError(f"{owner}: {what} must be real, got {x!r}.")
  if isinstance(x, (bool, np.bool_)) or not (
      isinstance(x, numbers.Real) or (tree_lib.is_array(x) and np.ndim(x) == 0)
  ):
    raise TypeError(
        f"{owner}: {what} must be a real number, got {type(x).__name__}: {x!r}."
    )
  value = float(x)
  if not math.isfinite(value):
    raise ValueError(f"{owner}: {what} must be finite, got {value}.")
  return value


def _check_positive_scale(x: Any, owner: str) -> float | None:
  """Checks a concrete scale value is positive and finite; returns it."""
  if not _is_concrete(x):
    return None
  value = _static_number(x, "loss_scale", owner)
  if value <= 0:
    raise ValueError(f"{owner}: loss_scale must be positive, got {value}.")
  return value


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
  """``x * loss_scale`` for floating leaves, in ``promote_types(x.dtype, f32)``."""

  def scale(x):
    if not tree_lib.is_float_array(x):
      return x
    dtype = dtypes.at_least_f32(x.dtype)
    return jnp.asarray(x, dtype) * jnp.asarray(loss_scale).astype(dtype)

  return jax.tree_util.tree_map(scale, tree)


def _unscale_tree(tree: T, loss_scale: Any) -> T:
  """``x / loss_scale`` computed in float32 (or wider), returned in x's dtype."""
  inv = 1.0 / jnp.asarray(loss_scale, _F32)

  def unscale(x):
    if not tree_lib.is_float_array(x):
      return x
    dtype = dtypes.at_least_f32(x.dtype)
    out = jnp.asarray(x, dtype) * inv.astype(dtype)
    return out.astype(x.dtype)

  return jax.tree_util.tree_map(unscale, tree)


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
    tree_lib.check_predicate(grads_finite, "NoOpLossScale.adjust's grads_finite")
    return self


@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale:
  """A fixed loss scale.

  Args:
    loss_scale: the scale, a positive finite scalar; stored as float32 whatever
      dtype it is given in.

  Raises:
    TypeError: if ``loss_scale`` is not a real number.
    ValueError: if it is not a positive, finite scalar.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.StaticLossScale(128)
    >>> ls.scale(jnp.float16(2.0))  # computed in float32
    Array(256., dtype=float32)
    >>> ls.unscale(jnp.full((2,), 256.0, jnp.float16))
    Array([2., 2.], dtype=float16)
  """

  loss_scale: jax.Array

  def __init__(self, loss_scale: Any):
    owner = "StaticLossScale"
    leaf = _scalar_leaf(loss_scale, _F32, "loss_scale", owner)
    _check_positive_scale(loss_scale, owner)
    object.__setattr__(self, "loss_scale", leaf)

  def scale(self, tree: T) -> T:
    """Multiplies floating leaves by the scale, in ``promote_types(dtype, f32)``."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides floating leaves by the scale in f32; each keeps its dtype."""
    return _unscale_tree(tree, self.loss_scale)

  def adjust(self, grads_finite: Any) -> "StaticLossScale":
    """Returns ``self`` (after checking ``grads_finite`` is a scalar bool)."""
    tree_lib.check_predicate(grads_finite, "StaticLossScale.adjust's grads_finite")
    return self


def _field(static: bool = False, **kwargs) -> Any:
  return dataclasses.field(metadata={"static": static}, **kwargs)


@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale:
  """A loss scale that adapts to keep gradients finite and as large as possible.

  On each ``adjust(grads_finite)``:

  * finite gradients: ``counter`` increments; on the ``period``-th consecutive
    finite step the scale is multiplied by ``factor`` (never past
    ``max_loss_scale`` nor to infinity) and ``counter`` returns to 0;
  * non-finite gradients: the scale is divided by ``factor``, floored at
    ``min_loss_scale``, and ``counter`` returns to 0.

  Leaves are exactly ``(loss_scale, counter)`` (float32 and int32 scalars);
  ``period``, ``factor``, ``min_loss_scale`` and ``max_loss_scale`` are static and
  survive ``jax.jit``, ``tree_map`` and checkpoint round-trips (jmp drops
  ``min_loss_scale``).

  Args:
    loss_scale: the initial scale, e.g. ``2.0**15``; converted to float32 (an
      f16/bf16/int scale is accepted and converted).
    counter: finite steps since the last change of scale (int32).
    period: grow after this many consecutive finite steps (>= 1).
    factor: growth and back-off factor (> 1).
    min_loss_scale: the scale never backs off below this (> 0).
    max_loss_scale: optional cap on growth (>= min_loss_scale).

  Raises:
    TypeError: for non-numeric or traced config, or a non-scalar/complex/bool
      scale.
    ValueError: for ``period < 1``, ``factor <= 1``, ``min_loss_scale <= 0``,
      ``max_loss_scale < min_loss_scale``, a scale that is not positive and
      finite, or ``min_loss_scale > loss_scale`` (checked whenever the scale is a
      concrete value rather than a tracer).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.DynamicLossScale(jnp.float32(2**15), period=2)
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(jnp.array(False)).loss_scale)
    32768.0
  """

  loss_scale: jax.Array = _field()
  counter: jax.Array = _field()
  period: int = _field(static=True)
  factor: float = _field(static=True)
  min_loss_scale: float = _field(static=True)
  max_loss_scale: float | None = _field(static=True)

  def __init__(
      self,
      loss_scale: Any,
      counter: Any = 0,
      period: int = 2000,
      factor: float = 2,
      min_loss_scale: float = 1,
      max_loss_scale: float | None = None,
  ):
    # Only a user's call runs this: unflattening bypasses it (see _register).
    owner = "DynamicLossScale"
    if isinstance(period, (bool, np.bool_)) or not isinstance(
        period, numbers.Integral
    ):
      raise TypeError(
          f"{owner}: period must be an int >= 1, got {type(period).__name__}:"
          f" {period!r}."
      )
    if period < 1:
      raise ValueError(
          f"{owner}: period must be >= 1 (the number of finite steps before the"
          f" scale grows), got {period}."
      )
    factor = _static_number(factor, "factor", owner)
    if factor <= 1:
      raise ValueError(
          f"{owner}: factor must be > 1 (the scale is multiplied by it to grow "
          f"and divided by it to back off), got {factor}. Use 2 (the default)."
      )
    min_loss_scale = _static_number(min_loss_scale, "min_loss_scale", owner)
    if min_loss_scale <= 0:
      raise ValueError(
          f"{owner}: min_loss_scale must be > 0, got {min_loss_scale}."
      )
    if max_loss_scale is not None:
      max_loss_scale = _static_number(max_loss_scale, "max_loss_scale", owner)
      if max_loss_scale < min_loss_scale:
        raise ValueError(
            f"{owner}: max_loss_scale ({max_loss_scale}) must be >= "
            f"min_loss_scale ({min_loss_scale})."
        )
    scale_leaf = _scalar_leaf(loss_scale, _F32, "loss_scale", owner)
    counter_leaf = _scalar_leaf(counter, _I32, "counter", owner)
    value = _check_positive_scale(loss_scale, owner)
    if value is not None and value < min_loss_scale:
      raise ValueError(
          f"{owner}: loss_scale ({value}) is below min_loss_scale "
          f"({min_loss_scale}). Start at or above the minimum, or lower "
          "min_loss_scale."
      )
    if (
        value is not None
        and max_loss_scale is not None
        and value > max_loss_scale
    ):
      raise ValueError(
          f"{owner}: loss_scale ({value}) is above max_loss_scale "
          f"({max_loss_scale})."
      )
    if _is_concrete(counter) and int(counter) < 0:
      raise ValueError(f"{owner}: counter must be >= 0, got {counter}.")
    set_ = object.__setattr__
    set_(self, "loss_scale", scale_leaf)
    set_(self, "counter", counter_leaf)
    set_(self, "period", int(period))
    set_(self, "factor", factor)
    set_(self, "min_loss_scale", min_loss_scale)
    set_(self, "max_loss_scale", max_loss_scale)

  def scale(self, tree: T) -> T:
    """Multiplies floating leaves by the scale, in ``promote_types(dtype, f32)``."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides floating leaves by the scale in f32; each keeps its dtype."""
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
    finite = tree_lib.check_predicate(
        grads_finite, "DynamicLossScale.adjust's grads_finite"
    )
    scale = jnp.asarray(self.loss_scale, _F32)
    counter = jnp.asarray(self.counter, _I32)
    grow = counter >= self.period - 1
    grown = scale * np.float32(self.factor)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    if self.max_loss_scale is not None:
      grown = jnp.minimum(grown, np.float32(self.max_loss_scale))
    backed_off = jnp.maximum(
        scale / np.float32(self.factor), np.float32(self.min_loss_scale)
    )
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
    zero = jnp.zeros_like(counter)
    new_counter = jnp.where(finite & ~grow, counter + 1, zero)
    return _replace(self, loss_scale=new_scale, counter=new_counter)


_register(NoOpLossScale)
_register(StaticLossScale)
_register(DynamicLossScale)

#: Any of the three loss scales (for type annotations).
AnyLossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
