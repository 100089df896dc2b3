"""Tree utilities: the one float predicate, the one cast, finiteness,
selection, and the one lookup of a wrapper's state.

Every function here treats leaves the same way:

* floating values -- ``jax.Array`` (tracers included), ``numpy.ndarray`` and
  numpy scalars with a real floating dtype -- are cast, checked and scaled;
  floating abstract values (``jax.ShapeDtypeStruct``, a jaxpr's avals) count
  as floating too, and casting one gives the abstract value in the new dtype;
* every other leaf -- integer and boolean arrays, Python scalars, ``None``,
  strings, arbitrary objects such as Equinox/NNX statics -- passes through.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import dtypes

T = TypeVar("T")

_ABSTRACT = tuple(t for t in (jax.ShapeDtypeStruct, compat.ShapedArray) if t)


def is_float(x: Any) -> bool:
  """The float predicate shared by every part of jmp_lite.

  Args:
    x: any pytree leaf, or an abstract value.

  Returns:
    True when ``x`` is an array (JAX array or tracer, numpy array or scalar) or
    an abstract value (``jax.ShapeDtypeStruct``, a jaxpr's aval) with a real
    floating dtype, float8 and float64 included; False for everything else
    (integer and boolean arrays, Python numbers, ``None``, objects).
  """
  return ((checks.is_array(x) or isinstance(x, _ABSTRACT))
          and dtypes.is_floating(x.dtype))


def cast(x: Any, dtype: Any) -> Any:
  """The one cast of a floating leaf to ``dtype`` (others pass through).

  A leaf already in ``dtype`` is returned as it is (no operation is added);
  numpy values stay numpy (as the constants of a traced function must), JAX
  arrays and tracers are converted with ``lax.convert_element_type``, and an
  abstract value becomes a ``jax.ShapeDtypeStruct`` of the new dtype.
  """
  dtype = np.dtype(dtype)
  if not is_float(x) or np.dtype(x.dtype) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic)):
    with np.errstate(over="ignore", invalid="ignore"):  # As XLA: to inf.
      return x.astype(dtype)
  if isinstance(x, _ABSTRACT):
    return jax.ShapeDtypeStruct(x.shape, dtype,
                                sharding=getattr(x, "sharding", None))
  return lax.convert_element_type(x, dtype)


def find(tree: Any, state_type: type, field: str) -> list[Any]:
  """Every ``field`` of the ``state_type`` NamedTuples inside ``tree``.

  The one lookup of a wrapper's state, wherever the wrapper sits
  (``optax.chain`` tuples, ``MultiSteps``, ``inject_hyperparams``, dicts,
  named tuples, an ``nnx.Optimizer``'s state): ``optax.tree.get_all_with_path``
  filtered by the named tuple's type.

  Args:
    tree: any pytree, e.g. an optimizer state.
    state_type: a ``NamedTuple`` class.
    field: one of its fields.

  Returns:
    The values of that field (``None`` included), in pytree order.
  """
  name = state_type.__name__

  def in_state(path, value):
    del value
    return getattr(path[-1], "tuple_name", None) == name

  return [value for _, value in optax.tree.get_all_with_path(
      tree, field, filtering=in_state)]


def find_one(tree: Any, state_type: type, field: str, owner: str,
             what: str, build: str) -> Any:
  """The one ``field`` of a ``state_type`` inside ``tree`` (:func:`find`);
  a ValueError naming ``what`` was found, and ``build`` to make one, if
  there is none or more than one."""
  found = find(tree, state_type, field)
  if len(found) != 1:
    fix = (f"Build the optimizer with {build} and pass the state its init "
           "returned." if not found else "Which one to use is ambiguous: "
           "pass the sub-state of the optimizer you mean.")
    raise ValueError(f"{owner} found {len(found) or 'no'} {what} in the "
                     f"optimizer state (a {type(tree).__name__}). {fix}")
  return found[0]


def cast_floating(tree: T, dtype: Any, is_leaf: Any = None) -> T:
  """Casts every floating array leaf of ``tree`` to ``dtype``.

  Leaves already in ``dtype`` are returned as they are (no op is added);
  non-floating leaves pass through. numpy leaves stay numpy.

  Args:
    tree: any pytree.
    dtype: the target floating dtype.
    is_leaf: optional, as for ``jax.tree.map``: nodes it accepts are
      handed over whole (a framework's stateful objects, say) and pass
      through unless they are floating arrays.

  Returns:
    A tree of the same structure.
  """
  return jax.tree.map(lambda x: cast(x, dtype), tree,
                                is_leaf=is_leaf)


def cast_like(tree: T, reference: Any) -> T:
  """Casts floating leaves back to the dtype of their counterpart in ``reference``.

  The counterpart is the leaf at the same path (``jax.tree_util`` key path).
  Leaves without a floating counterpart -- keys a Flax mutable collection or
  NNX state gained during a call, say -- pass through, as do non-floating
  leaves. It is how a state keeps the dtypes it started with across updates.

  Args:
    tree: the new tree.
    reference: the tree whose dtypes to restore.

  Returns:
    ``tree`` with those leaves cast.
  """
  dtypes_at = {
      jax.tree_util.keystr(path): x.dtype
      for path, x in jax.tree.flatten_with_path(reference)[0]
      if is_float(x)
  }

  def cast_back(path, x):
    dtype = dtypes_at.get(jax.tree_util.keystr(path))
    return x if dtype is None else cast(x, dtype)

  return jax.tree.map_with_path(cast_back, tree)


def widen_floating(tree: T) -> T:
  """Casts floating leaves narrower than float32 to float32 (float64 stays).

  The precision jmp_lite computes loss-scale and optimizer arithmetic in;
  other leaves pass through.
  """

  return jax.tree.map(
      lambda x: cast(x, dtypes.at_least_f32(x.dtype)) if is_float(x) else x,
      tree)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """Returns a scalar boolean array: are all floating leaves of ``tree`` finite?

  Non-floating leaves (ints, bools, objects) count as finite, and so do Python
  floats, which are not arrays (jmp checks those too; gradients are always
  arrays). An empty tree is finite.

  Args:
    tree: any pytree, typically gradients.
    axis_name: optional mapped axis name (a string, or a tuple of them) under
      ``pmap`` or ``shard_map``. When given, the result is True only if the
      leaves are finite on *every* device along that axis, so all replicas
      agree (and keep the same loss scale).

  Returns:
    A ``bool`` scalar ``jax.Array``.

  Raises:
    TypeError: if ``axis_name`` is not a string or a tuple of strings.
    ValueError: if ``axis_name`` is not bound (called outside ``pmap`` /
      ``shard_map``).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> bool(jmp_lite.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  flags = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if is_float(x)
  ]
  if flags:
    finite = jnp.all(jnp.stack(flags))
  else:
    finite = jnp.array(True)
  if axis_name is not None:
    checks.bound_axis(axis_name, "all_finite")
    # pmin over {0, 1}: one non-finite replica makes every replica non-finite.
    finite = lax.pmin(finite.astype(jnp.int32), axis_name) == 1
  return finite


def select_tree(pred: Any, a: T, b: T) -> T:
  """Selects ``a`` where ``pred`` is True, else ``b``, leaf by leaf.

  Jit-safe (``lax.select``, no host sync). Array leaves of any dtype are
  selected and must agree in shape and dtype; non-array leaves (objects,
  strings, statics) must be equal in both trees and pass through; Python
  numbers that differ are selected as arrays.

  Args:
    pred: a scalar boolean (``jax.Array``, numpy bool or Python bool).
    a: the tree returned where ``pred`` is True.
    b: a tree with the same structure as ``a``.

  Returns:
    A tree with the structure of ``a``.

  Raises:
    TypeError: if ``pred`` is not boolean, array leaves differ in shape or
      dtype (from ``lax.select``), or other leaves differ.
    ValueError: if ``pred`` is not a scalar, or the trees' structures differ
      (from ``jax.tree.map``).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.select_tree(jnp.array(False), {"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
    {'w': Array([1., 1.], dtype=float32)}
  """
  pred = checks.predicate(pred, "select_tree's predicate")

  def select(path, x, y):
    if checks.is_array(x) and checks.is_array(y):
      return lax.select(pred, x, y)  # JAX names differing shapes or dtypes.
    if x is y:
      return x
    if (checks.is_real_number(x) and not checks.is_array(x)
        and checks.is_real_number(y) and not checks.is_array(y)):
      return x if x == y else lax.select(pred, jnp.asarray(x), jnp.asarray(y))
    try:
      same = bool(x == y)
    except Exception:  # pylint: disable=broad-except
      same = False
    if not same:
      raise TypeError(
          f"select_tree: leaf {jax.tree_util.keystr(path) or '<root>'} differs "
          f"between the trees and is not an array in both ({x!r} vs {y!r}); "
          "only arrays can be selected under jit.")
    return x

  # JAX reports trees of different structures.
  return jax.tree.map_with_path(select, a, b)
