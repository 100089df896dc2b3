"""Tree utilities: the one float-leaf predicate, casting, finiteness, selection.

Every function here treats leaves the same way:

* floating arrays (``jax.Array`` including tracers, ``numpy.ndarray`` and numpy
  scalars) are cast, checked and scaled;
* every other leaf — integer and boolean arrays, Python scalars, ``None``,
  strings, arbitrary objects such as Equinox/NNX statics — passes through.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import dtypes

T = TypeVar("T")

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_array(x: Any) -> bool:
  """Whether ``x`` is a JAX or numpy array (or numpy scalar), tracers included."""
  return isinstance(x, _ARRAY_TYPES)


def is_float_array(x: Any) -> bool:
  """The float-leaf predicate shared by every tree utility in jmp_lite.

  Args:
    x: any pytree leaf.

  Returns:
    True when ``x`` is a JAX array (or tracer), numpy array or numpy scalar with
    a real floating dtype; False for everything else (integer and boolean
    arrays, Python numbers, ``None``, objects), which passes through.
  """
  return is_array(x) and dtypes.is_floating(x.dtype)


def find_nodes(tree: Any, node_type: type | tuple[type, ...]) -> list[Any]:
  """Every node of ``node_type`` inside ``tree``, in pytree order.

  The search walks the pytree (``optax.chain`` tuples, ``MultiSteps``,
  ``inject_hyperparams``, dicts, named tuples) and does not look inside a
  match. It is how an optimizer's wrapper states are found wherever the
  wrapper sits.

  Args:
    tree: any pytree, e.g. an optimizer state.
    node_type: a class, or a tuple of classes, to look for.

  Returns:
    The matching nodes (empty if there is none).
  """
  is_match = lambda x: isinstance(x, node_type)  # noqa: E731
  return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_match)
          if is_match(x)]


def cast_floating(tree: T, dtype: Any, is_leaf: Any = None) -> T:
  """Casts every floating array leaf of ``tree`` to ``dtype``.

  Leaves already in ``dtype`` are returned as they are (no op is added);
  non-floating leaves pass through. numpy leaves stay numpy.

  Args:
    tree: any pytree.
    dtype: the target floating dtype.
    is_leaf: optional, as for ``jax.tree_util.tree_map``: nodes it accepts are
      handed over whole (a framework's stateful objects, say) and pass
      through unless they are floating arrays.

  Returns:
    A tree of the same structure.
  """
  dtype = np.dtype(dtype)

  def cast(x):
    if is_float_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree, is_leaf=is_leaf)


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
      for path, x in jax.tree_util.tree_flatten_with_path(reference)[0]
      if is_float_array(x)
  }

  def cast(path, x):
    dtype = dtypes_at.get(jax.tree_util.keystr(path))
    if dtype is not None and is_float_array(x) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map_with_path(cast, tree)


def widen_floating(tree: T) -> T:
  """Casts floating leaves narrower than float32 to float32 (float64 stays).

  The precision jmp_lite computes loss-scale and optimizer arithmetic in;
  other leaves pass through.
  """

  def widen(x):
    if is_float_array(x):
      wide = dtypes.at_least_f32(x.dtype)
      return x if x.dtype == wide else x.astype(wide)
    return x

  return jax.tree_util.tree_map(widen, tree)


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
      for x in jax.tree_util.tree_leaves(tree)
      if is_float_array(x)
  ]
  if flags:
    finite = jnp.all(jnp.stack(flags))
  else:
    finite = jnp.array(True)
  if axis_name is not None:
    check_axis_name(axis_name)
    # pmin over {0, 1}: one non-finite replica makes every replica non-finite.
    try:
      finite = lax.pmin(finite.astype(jnp.int32), axis_name) == 1
    except NameError as err:
      raise ValueError(
          f"all_finite(axis_name={axis_name!r}) must run inside jax.pmap or "
          "jax.shard_map over that axis, so that replicas agree on "
          "finiteness; here no such axis is bound. Under jax.jit with sharded "
          f"arrays, pass axis_name=None. ({err})"
      ) from None
  return finite


def check_axis_name(axis_name: Any) -> None:
  """A mapped axis is named by a string (or a tuple of strings)."""
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(
        "axis_name must be the name of a pmap/shard_map axis (a string such "
        f"as 'batch') or a tuple of names, got {axis_name!r}. (An integer "
        "would be taken as a positional array axis.)"
    )


def check_predicate(pred: Any, what: str) -> jax.Array:
  """Validates a scalar boolean predicate and returns it as an array."""
  if isinstance(pred, (bool, np.bool_)):
    return jnp.asarray(pred)
  if not is_array(pred):
    raise TypeError(
        f"{what} must be a scalar boolean array (e.g. the result of "
        f"jmp_lite.all_finite), got {type(pred).__name__}: {pred!r}."
    )
  if np.ndim(pred) != 0:
    raise ValueError(
        f"{what} must be a scalar (shape ()), got shape {np.shape(pred)}. Reduce"
        " it first, e.g. with jnp.all(...) or jmp_lite.all_finite(...)."
    )
  if pred.dtype != np.bool_:
    raise TypeError(
        f"{what} must have dtype bool, got {pred.dtype}. Compare explicitly, "
        "e.g. `x > 0`, or use jmp_lite.all_finite(...)."
    )
  return pred


def _is_number(x: Any) -> bool:
  return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


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
    TypeError: if ``pred`` is not boolean, or leaves differ in dtype or cannot
      be selected.
    ValueError: if ``pred`` is not a scalar, or the trees or leaf shapes differ.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.select_tree(jnp.array(False), {"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
    {'w': Array([1., 1.], dtype=float32)}
  """
  pred = check_predicate(pred, "select_tree's predicate")
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(a)
  b_leaves, b_def = jax.tree_util.tree_flatten(b)
  if a_def != b_def:
    raise ValueError(
        "select_tree needs two trees of the same structure, got\n"
        f"  a: {a_def}\n  b: {b_def}\n"
        "Make both branches return the same containers and keys."
    )

  def select(path, x, y):
    where = jax.tree_util.keystr(path) or "<root>"
    if is_array(x) or is_array(y):
      if not (is_array(x) and is_array(y)):
        raise TypeError(
            f"select_tree: leaf {where} is an array in one tree and "
            f"{type(y if is_array(x) else x).__name__} in the other."
        )
      if np.shape(x) != np.shape(y):
        raise ValueError(
            f"select_tree: leaf {where} has shape {np.shape(x)} in a and "
            f"{np.shape(y)} in b; both trees must have the same shapes."
        )
      if x.dtype != y.dtype:
        raise TypeError(
            f"select_tree: leaf {where} has dtype {x.dtype} in a and {y.dtype}"
            " in b; cast one side first so both have the same dtype."
        )
      return lax.select(pred, x, y)
    if x is y:
      return x
    if _is_number(x) and _is_number(y):
      return x if x == y else lax.select(pred, jnp.asarray(x), jnp.asarray(y))
    try:
      same = bool(x == y)
    except Exception:  # pylint: disable=broad-except
      same = False
    if same:
      return x
    raise TypeError(
        f"select_tree: leaf {where} is a non-array value that differs between"
        f" the trees ({x!r} vs {y!r}); only arrays can be selected under jit."
    )

  return jax.tree_util.tree_unflatten(
      a_def, [select(p, x, y) for (p, x), y in zip(a_leaves, b_leaves)]
  )
