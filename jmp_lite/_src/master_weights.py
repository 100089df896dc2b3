"""Optimizer-side precision: float32 master weights and optimizer-state dtypes.

Two optax wrappers, usable with any optax optimizer and with each other:

* :func:`master_weights` keeps half-precision params (for compute and memory)
  and a float32 master copy in the optimizer state (Apex's O2 recipe): the
  inner optimizer runs against the master copy, updates accumulate in float32,
  and the params are the master copy rounded to their dtype, bit for bit.
* :func:`with_state_dtype` stores an optimizer's moments in a chosen dtype
  (e.g. bfloat16, to halve the optimizer state) and does the update math in
  float32.

:func:`get_master_params` reads the master copy out of an optimizer state,
wherever it sits (``optax.chain``, ``MultiSteps``, ``inject_hyperparams``...).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib

# -- shared helpers ----------------------------------------------------------


def _check_enabled(dtype: np.dtype, what: str) -> None:
  """float64 needs x64 mode; without it JAX silently makes float32 arrays."""
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(
        f"{what} is {dtype.name}, but JAX is running without "
        "jax_enable_x64, so arrays of that dtype cannot be made. Enable it "
        "(jax.config.update('jax_enable_x64', True)) or use jnp.float32."
    )


def _represents(wide: np.dtype, narrow: np.dtype) -> bool:
  """Whether every value of ``narrow`` is exactly a value of ``wide``."""
  if wide == narrow:
    return True
  fw, fn = jnp.finfo(wide), jnp.finfo(narrow)
  return (
      fw.nmant >= fn.nmant
      and fw.maxexp >= fn.maxexp
      and fw.minexp <= fn.minexp
  )


# -- master weights ----------------------------------------------------------


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`.

  Attributes:
    inner_state: the wrapped optimizer's state, made by ``inner.init`` from the
      master copy, so its moments are in the master dtype (float32).
    master_params: the master copy, a tree with the params' structure: every
      floating param narrower than the master dtype (bfloat16, float16) has
      its copy there, in the master dtype and with the param's sharding; the
      other params (already in the master dtype, or not floating) need none
      and hold ``None``. It is authoritative: after each step
      ``params == master_params.astype(params.dtype)``, bit for bit. Read it,
      completed with those params, with :func:`get_master_params`.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.master_weights(optax.sgd(0.1))
    >>> state = opt.init({"w": jnp.ones(2, jnp.bfloat16), "scale": jnp.ones(2)})
    >>> state.master_params["w"].dtype, state.master_params["scale"]
    (dtype('float32'), None)
  """

  inner_state: Any
  master_params: Any


def _refuse_loss_scaling_inside(inner_state: Any, owner: str) -> None:
  # Imported here: loss_scaling's module imports this one's neighbours only.
  from jmp_lite._src import loss_scaling  # pylint: disable=g-import-not-at-top
  if tree_lib.find(inner_state, loss_scaling.LossScaleState, "loss_scale"):
    raise TypeError(
        f"{owner} wraps loss_scaling, which must be the outermost "
        "transformation (a skipped step must leave this wrapper's state "
        f"untouched too): write loss_scaling({owner}(inner, ...), loss_scale)."
    )


def master_weights(
    inner: optax.GradientTransformation, dtype: Any = jnp.float32
) -> optax.GradientTransformationExtraArgs:
  """Keeps a float32 master copy of half-precision params inside the optimizer.

  Apex's O2 recipe as an optax wrapper: the params stay in half precision
  (bfloat16/float16) for compute and memory, and the optimizer state holds a
  master copy of them in ``dtype``. ``update(grads, state, params,
  **extra_args)``

  1. casts the floating gradients to the master dtype;
  2. runs ``inner`` against the master copy (so its moments are float32 and
     params-dependent transforms such as ``adamw``'s weight decay see the
     master values);
  3. adds the inner updates to the master copy in the master dtype, so updates
     below the params' spacing (a bfloat16 ``1.0`` ignores any update smaller
     than ``2**-9``) still accumulate;
  4. returns the updates that take the params to the new master copy rounded
     to their dtype (``optax.apply_updates`` lands on it exactly; the guide
     says why).

  Params already in the master dtype (a float32 norm scale among bfloat16
  weights) and non-floating params get no copy: ``inner`` runs on them as
  they are and its updates are returned unchanged, so they train exactly as
  under ``inner`` alone. Because the master copy is authoritative, a change
  made to the half-precision params outside the optimizer (loading weights)
  is undone by the next step; re-run ``init`` after changing them.

  Compose with :func:`loss_scaling` outside
  (``loss_scaling(master_weights(optax.adam(1e-3)), loss_scale)``), so that a
  skipped step leaves the master copy untouched; put
  :func:`with_state_dtype` inside to store the moments in bfloat16. Guide:
  ``docs/precision.md``.

  Args:
    inner: the optax optimizer to run on the master copy
      (``GradientTransformation`` or ``GradientTransformationExtraArgs``).
    dtype: the master dtype, a floating dtype at least as precise as every
      floating param: ``jnp.float32`` (the default), or ``jnp.float64`` with
      ``jax_enable_x64``. A name such as ``"f32"`` is accepted too.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update`` needs ``params``.

  Raises:
    TypeError: if ``inner`` is not an optax transformation or ``dtype`` is not
      a floating dtype; from ``init``, if ``inner`` contains
      :func:`loss_scaling`; from ``update``, if the state is not this
      wrapper's.
    ValueError: from ``init``, if ``dtype`` cannot represent some floating
      param (e.g. a bfloat16 master for float32 params); from ``update``, if
      ``params`` is not given.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> opt = jmp_lite.master_weights(optax.sgd(1e-3))
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> for _ in range(10):  # each step is below bfloat16's spacing at 1.0
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> master = jmp_lite.get_master_params(state, params)["w"]
    >>> master.dtype, round(float(master[0]), 6)
    (dtype('float32'), 0.99)
    >>> params["w"]  # the master copy, rounded (plain sgd would stay at 1)
    Array([0.988281, 0.988281, 0.988281], dtype=bfloat16)
  """
  owner = "master_weights"
  inner = checks.optax_transformation(inner, owner)
  master_dtype = dtypes.floating_dtype(
      dtype, f"{owner}'s dtype", policy=False,
      example="jnp.float32 (the default)")

  def needs_copy(p):
    return tree_lib.is_float(p) and np.dtype(p.dtype) != master_dtype

  def init_fn(params):
    _check_enabled(master_dtype, f"{owner}'s dtype")
    narrower = [
        (jax.tree_util.keystr(path), np.dtype(p.dtype))
        for path, p in jax.tree.leaves_with_path(params)
        if tree_lib.is_float(p)
        and not _represents(master_dtype, np.dtype(p.dtype))
    ]
    if narrower:
      shown = ", ".join(
          f"{path or '<root>'} ({d.name})" for path, d in narrower[:5]
      )
      more = f" and {len(narrower) - 5} more" if len(narrower) > 5 else ""
      raise ValueError(
          f"{owner}: the master dtype {master_dtype.name} cannot represent "
          f"every value of the params {shown}{more}; the master copy must be "
          "at least as precise as the params it keeps. Use "
          f"{owner}(inner, dtype=jnp.float32) (the default) for float16 or "
          "bfloat16 params; float32 params need no master copy."
      )
    master = jax.tree.map(
        lambda p: jnp.asarray(p, master_dtype) if needs_copy(p) else None,
        params)
    inner_state = inner.init(_inner_params(params, master))
    _refuse_loss_scaling_inside(inner_state, owner)
    return MasterWeightsState(inner_state=inner_state, master_params=master)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, MasterWeightsState):
      raise TypeError(
          f"{owner}'s update expects the MasterWeightsState made by its init, "
          f"got {type(state).__name__}. Pass the state returned by opt.init."
      )
    if params is None:
      raise ValueError(
          f"{owner}'s update needs the current params, to return the updates "
          "that take them to the master copy: call "
          "opt.update(grads, state, params)."
      )
    master = state.master_params
    # The inner optimizer sees the master copy (and the params that need
    # none) and gradients in their dtypes.
    inner_params = _inner_params(params, master)
    grads = tree_lib.cast_like(updates, inner_params)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, inner_params, **extra_args
    )
    inner_updates = tree_lib.cast_like(inner_updates, inner_params)

    def new_master(p, m, u):
      del p
      return None if m is None else m + u

    def out_update(p, m, new_m, u):
      if m is None:
        return u  # No copy: the param trains as under inner alone.
      # Exact in the master dtype (see docs/precision.md), so p + u lands on
      # the rounded master value.
      target = new_m.astype(p.dtype).astype(m.dtype)
      return target - p.astype(m.dtype)

    master_out = jax.tree.map(
        new_master, params, master, inner_updates)
    updates_out = jax.tree.map(
        out_update, params, master, master_out, inner_updates)
    return updates_out, MasterWeightsState(
        inner_state=inner_state, master_params=master_out
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _inner_params(params: Any, master: Any) -> Any:
  """The params the inner optimizer runs on: the master copy where one is
  kept, the params themselves elsewhere."""
  return jax.tree.map(
      lambda p, m: p if m is None else m, params, master)


def get_master_params(opt_state: Any, params: Any) -> Any:
  """Returns the full-precision params from an optimizer state.

  The :class:`MasterWeightsState` may sit anywhere inside ``opt_state``: at the
  top, inside ``loss_scaling``, ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams``, dicts or named tuples.

  Args:
    opt_state: the state of an optimizer built with :func:`master_weights`.
    params: the current params (those that need no master copy -- already in
      the master dtype, or not floating -- are returned as they are).

  Returns:
    The params' tree with the master copy where one is kept (in the master
    dtype) and ``params``' own leaves elsewhere. Evaluate or export from these
    rather than from the rounded half-precision params.

  Raises:
    ValueError: if the state holds no master copy, or more than one (then pass
      the sub-state you mean), or ``params`` does not have the structure of
      the params the state was made for.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(jmp_lite.master_weights(optax.sgd(0.1)),
    ...                             jmp_lite.NoOpLossScale())
    >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(2)}
    >>> jmp_lite.get_master_params(opt.init(params), params)["w"]
    Array([1., 1.], dtype=float32)
  """
  found = tree_lib.find(opt_state, MasterWeightsState, "master_params")
  if not found:
    raise ValueError(
        "get_master_params found no master weights in the optimizer state "
        f"(a {type(opt_state).__name__}). Build the optimizer with "
        "jmp_lite.master_weights(inner) and pass the state its init returned."
    )
  if len(found) > 1:
    raise ValueError(
        f"get_master_params found {len(found)} master-weights states in the "
        "optimizer state, so which one to return is ambiguous. Pass the "
        "sub-state of the optimizer you mean."
    )
  master = found[0]
  try:
    return _inner_params(params, master)
  except ValueError as err:
    raise ValueError(
        "get_master_params: params must have the structure of the params "
        f"the optimizer state was made for. ({err})"
    ) from None


# -- optimizer-state dtypes --------------------------------------------------


def _is_moment(x: Any) -> bool:
  """The state leaves :func:`with_state_dtype` stores in its dtype."""
  return tree_lib.is_float(x) and np.ndim(x) >= 1


def with_state_dtype(
    inner: optax.GradientTransformation, dtype: Any
) -> optax.GradientTransformationExtraArgs:
  """Stores an optimizer's moments in ``dtype``; computes in float32.

  For any optax optimizer (optax's ``mu_dtype`` covers only ``adam``'s first
  moment): ``init`` stores the moments -- the floating state leaves with at
  least one dimension -- in ``dtype``; ``update`` runs the inner update in
  float32 (float64 stays) and rounds the new moments back to ``dtype``. Other
  leaves keep their dtypes and the state keeps the inner optimizer's
  structure. Put it inside :func:`master_weights`. Guide, and what bfloat16
  moments cost in accuracy: ``docs/precision.md``.

  Args:
    inner: the optax optimizer whose state to store in ``dtype``.
    dtype: a floating dtype, e.g. ``jnp.bfloat16``, ``jnp.float16``,
      ``jnp.float32``, or a name such as ``"bf16"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``inner``'s state
    structure.

  Raises:
    TypeError: if ``inner`` is not an optax transformation or ``dtype`` is not
      a floating dtype.
    ValueError: from ``init``, if ``inner`` contains :func:`master_weights`
      (the master copy would be stored in ``dtype`` too).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.with_state_dtype(optax.adam(1e-3), jnp.bfloat16)
    >>> state = opt.init({"w": jnp.ones(3)})
    >>> state[0].mu["w"].dtype, state[0].nu["w"].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype(bfloat16), dtype('int32'))
    >>> updates, state = opt.update({"w": jnp.ones(3)}, state)
    >>> updates["w"].dtype, state[0].mu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
  """
  owner = "with_state_dtype"
  inner = checks.optax_transformation(inner, owner)
  store_dtype = dtypes.floating_dtype(
      dtype, f"{owner}'s dtype", policy=False,
      example="jnp.bfloat16 or jnp.float32")

  def store(state):
    return jax.tree.map(
        lambda x: x.astype(store_dtype)
        if _is_moment(x) and x.dtype != store_dtype
        else x,
        state,
    )

  def init_fn(params):
    _check_enabled(store_dtype, f"{owner}'s dtype")
    state = inner.init(params)
    _refuse_loss_scaling_inside(state, owner)
    if tree_lib.find(state, MasterWeightsState, "master_params"):
      raise ValueError(
          f"{owner} wraps an optimizer containing master_weights, so the "
          f"float32 master copy would be stored in {store_dtype.name} too. "
          "Put it inside instead: master_weights(with_state_dtype(inner, "
          f"jnp.{store_dtype.name}))."
      )
    return store(state)

  def update_fn(updates, state, params=None, **extra_args):
    # The moments, the other floating leaves, the gradients and the params,
    # all in float32 (or wider): the math runs there, strict-promotion clean.
    new_updates, new_state = inner.update(
        tree_lib.widen_floating(updates), tree_lib.widen_floating(state),
        tree_lib.widen_floating(params), **extra_args
    )

    # Back to the stored dtypes: the moments' dtype, and each other leaf's own.
    return new_updates, tree_lib.cast_like(new_state, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
