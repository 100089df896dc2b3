"""Loss scaling that lives inside an optax optimizer."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import dtypes
from jmp_lite._src import loss_scale as loss_scale_lib
from jmp_lite._src import tree as tree_lib

class LossScaleState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    inner_state: the wrapped optimizer's state. It is left untouched (step
      counts included) on a step whose gradients are not finite.
    loss_scale: the loss scale to use for the *next* forward pass; read it with
      :func:`get_loss_scale`. ``loss_scale.loss_scale`` is the float32 value to
      log.
    skipped_steps: int32, the number of updates skipped so far because the
      gradients were not finite.
    consecutive_skips: int32, updates skipped in a row (0 after a finite step);
      a value that keeps growing once the scale sits at ``min_loss_scale``
      means the model itself produces NaN/inf.
    last_finite: (property) bool array, whether the last update's gradients
      were finite: ``consecutive_skips == 0``. Derived rather than stored, since
      returning the all-finite flag as its own output costs XLA a fusion.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**15))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> int(state.skipped_steps), bool(state.last_finite)
    (0, True)
  """

  inner_state: Any
  loss_scale: Any
  skipped_steps: jax.Array
  consecutive_skips: jax.Array

  @property
  def last_finite(self) -> jax.Array:
    """Whether the last update's gradients were finite (bool array)."""
    return self.consecutive_skips == 0


def _check_loss_scale(loss_scale: Any) -> None:
  if isinstance(loss_scale, (int, float)) or tree_lib.is_array(loss_scale):
    raise TypeError(
        f"loss_scaling expects a loss-scale object, got the number {loss_scale!r}."
        " Wrap it: jmp_lite.DynamicLossScale(2.0**15) to adapt the scale, or "
        "jmp_lite.StaticLossScale(value) to keep it fixed."
    )
  if not isinstance(loss_scale, loss_scale_lib.LossScale):
    raise TypeError(
        "loss_scaling expects a jmp_lite loss scale (NoOpLossScale, "
        "StaticLossScale or DynamicLossScale), got "
        f"{type(loss_scale).__name__}: {loss_scale!r}."
    )


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.AnyLossScale,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer with loss scaling and non-finite step skipping.

  ``update(grads, state, params, **extra_args)`` takes gradients of the *scaled*
  loss (see :func:`get_loss_scale` and :func:`scaled_value_and_grad`) and:

  1. unscales them with the scale used for this step's forward pass, computing
     in float32 and handing the inner optimizer float32 (or wider) gradients,
     so small half-precision gradients do not underflow again;
  2. checks that they are all finite (agreed across devices when
     ``axis_name`` is given);
  3. runs the inner update; on a non-finite step returns zero updates (in the
     dtypes the inner update returns) and keeps the inner state exactly as it
     was, step counts included;
  4. adjusts the loss scale (``DynamicLossScale`` backs off or grows).

  Every choice is made with ``lax.select``: no host sync, no recompilation.
  The inner state keeps the dtypes its ``init`` gave it.

  Args:
    inner: the optax optimizer to wrap (``GradientTransformation`` or
      ``GradientTransformationExtraArgs``).
    loss_scale: the initial ``NoOpLossScale``, ``StaticLossScale`` or
      ``DynamicLossScale``.
    axis_name: mapped axis name(s) under ``pmap``/``shard_map`` over which the
      finiteness check is agreed, so all replicas keep the same scale. Not
      needed with ``jax.jit`` and sharded arrays.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: if ``inner`` is not an optax transformation or ``loss_scale`` is
      not a loss scale.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"].astype(jnp.float16) ** 2)
    >>> loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"].dtype, bool(state.last_finite)
    (dtype('float32'), True)
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        "loss_scaling expects an optax GradientTransformation such as "
        f"optax.adam(1e-3), got {type(inner).__name__}: {inner!r}."
    )
  _check_loss_scale(loss_scale)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LossScaleState(
        inner_state=inner.init(params),
        # Fresh buffers on every init: a step that donates its state must not
        # delete the arrays of the loss scale this optimizer was built with.
        loss_scale=jax.tree_util.tree_map(jnp.array, loss_scale),
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise TypeError(
          "loss_scaling's update expects the LossScaleState made by its init, "
          f"got {type(state).__name__}. Pass the state returned by opt.init."
      )
    current = state.loss_scale
    # Unscale in f32 (or wider) and keep that precision for the inner update.
    wide = jax.tree_util.tree_map(
        lambda g: g.astype(dtypes.at_least_f32(g.dtype))
        if tree_lib.is_float_array(g)
        else g,
        updates,
    )
    grads = current.unscale(wide)
    finite = tree_lib.all_finite(grads, axis_name=axis_name)

    new_updates, new_inner = inner.update(
        grads, state.inner_state, params, **extra_args
    )
    # Keep the state's dtypes stable across steps (as its init made them).
    new_inner = jax.tree_util.tree_map(
        lambda new, old: new.astype(old.dtype)
        if tree_lib.is_array(new) and tree_lib.is_array(old)
        and new.dtype != old.dtype
        else new,
        new_inner,
        state.inner_state,
    )
    zeros = jax.tree_util.tree_map(
        lambda u: jnp.zeros_like(u) if tree_lib.is_array(u) else u, new_updates
    )
    out_updates = tree_lib.select_tree(finite, new_updates, zeros)
    out_inner = tree_lib.select_tree(finite, new_inner, state.inner_state)
    skipped = (~finite).astype(jnp.int32)
    new_state = LossScaleState(
        inner_state=out_inner,
        loss_scale=current.adjust(finite),
        skipped_steps=state.skipped_steps + skipped,
        consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1),
    )
    return out_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_states(tree: Any) -> Sequence[LossScaleState]:
  leaves = jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, LossScaleState)
  )
  return [x for x in leaves if isinstance(x, LossScaleState)]


def get_loss_scale_state(opt_state: Any) -> LossScaleState:
  """Returns the :class:`LossScaleState` from anywhere inside an optimizer state.

  The state may sit at the top, inside ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams``, dicts or named tuples, or an
  ``nnx.Optimizer``'s ``opt_state``. Its loss scale and counters come back as
  plain arrays even where a framework keeps them in wrapper pytrees (NNX
  variables); ``inner_state`` is returned as it is stored.

  Args:
    opt_state: the state of an optimizer built with :func:`loss_scaling`.

  Returns:
    The ``LossScaleState``: log its ``skipped_steps``, ``last_finite`` and
    ``loss_scale.loss_scale``.

  Raises:
    ValueError: if the state holds no loss scaling, or more than one (then
      pass the sub-state you mean).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = optax.chain(optax.add_decayed_weights(1e-4),
    ...                   jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0)))
    >>> state = jmp_lite.get_loss_scale_state(opt.init({"w": jnp.zeros(2)}))
    >>> int(state.skipped_steps), float(state.loss_scale.loss_scale)
    (0, 8.0)
  """
  return _the_state(opt_state, "get_loss_scale_state")


def _the_state(opt_state: Any, caller: str) -> LossScaleState:
  found = _find_states(opt_state)
  if not found:
    raise ValueError(
        f"{caller} found no loss-scaling state in the optimizer state "
        f"(a {type(opt_state).__name__}). Build the optimizer with "
        "jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(2.0**15)) and "
        "pass the state its init returned."
    )
  if len(found) > 1:
    raise ValueError(
        f"{caller} found {len(found)} loss-scaling states in the optimizer"
        " state, so which scale to use is ambiguous. Pass the sub-state of the"
        " optimizer whose loss you are scaling."
    )
  state = found[0]
  return state._replace(
      loss_scale=_fields_as_arrays(state.loss_scale),
      skipped_steps=_as_array(state.skipped_steps),
      consecutive_skips=_as_array(state.consecutive_skips),
  )


def get_loss_scale(opt_state: Any) -> loss_scale_lib.AnyLossScale:
  """Returns the current loss scale from an optimizer state.

  The :class:`LossScaleState` may sit anywhere inside ``opt_state``, as for
  :func:`get_loss_scale_state`; a loss scale passed in is returned as it is.

  Args:
    opt_state: the state of an optimizer built with :func:`loss_scaling`.

  Returns:
    The loss scale to use for this step's forward pass (``scale`` the loss
    with it; ``update`` unscales with the same one).

  Raises:
    ValueError: if the state holds no loss scaling, or more than one (then
      pass the sub-state you mean).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
    >>> float(jmp_lite.get_loss_scale(opt.init({"w": jnp.zeros(2)})).loss_scale)
    8.0
  """
  if isinstance(opt_state, loss_scale_lib.LossScale):
    return opt_state
  return _the_state(opt_state, "get_loss_scale").loss_scale


def _as_array(x: Any) -> Any:
  """``x``, or the one array inside a wrapper pytree such as an NNX variable.

  Frameworks may keep optimizer state in wrapper pytrees (``nnx.Optimizer``
  keeps it in NNX variables). No framework is imported or named here.
  """
  if tree_lib.is_array(x):
    return x
  leaves = jax.tree_util.tree_leaves(x)
  return leaves[0] if len(leaves) == 1 else x


def _fields_as_arrays(loss_scale: Any) -> Any:
  """The loss scale with each of its fields as a plain array."""
  fields, treedef = jax.tree_util.tree_flatten(
      loss_scale, is_leaf=lambda x: x is not loss_scale
  )
  return jax.tree_util.tree_unflatten(treedef, [_as_array(f) for f in fields])


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of the scaled loss, returning the unscaled loss.

  The gradients are those of ``loss_scale.scale(fun(...))`` — still scaled, as
  the :func:`loss_scaling` optimizer expects (it unscales them). Without that
  wrapper, call ``loss_scale.unscale(grads)`` yourself.

  Args:
    fun: a function returning a scalar loss (or ``(loss, aux)`` with
      ``has_aux=True``).
    loss_scale: a loss scale, or an optimizer state of :func:`loss_scaling`
      (its current scale is used, as by :func:`get_loss_scale`).
    argnums: which positional arguments to differentiate, as in ``jax.grad``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function with ``fun``'s signature returning ``(loss, grads)`` or
    ``((loss, aux), grads)``, where ``loss`` is unscaled and in ``fun``'s dtype.

  Raises:
    TypeError: if ``fun`` is not callable or ``loss_scale`` holds no scale.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> ls = jmp_lite.StaticLossScale(4.0)
    >>> loss, grads = jmp_lite.scaled_value_and_grad(lambda w: jnp.sum(w ** 2), ls)(jnp.ones(2))
    >>> float(loss), grads.tolist()
    (2.0, [8.0, 8.0])
  """
  if not callable(fun):
    raise TypeError(
        f"scaled_value_and_grad expects a loss function, got {type(fun).__name__}."
    )
  loss_scale = get_loss_scale(loss_scale)

  def scaled_fun(*args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            "scaled_value_and_grad(has_aux=True) needs fun to return a pair "
            f"(loss, aux), got {type(out).__name__}."
        )
      loss, aux = out
    else:
      loss, aux = out, None
    return loss_scale.scale(loss), (loss, aux)

  grad_fn = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

  def wrapped(*args, **kwargs):
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
