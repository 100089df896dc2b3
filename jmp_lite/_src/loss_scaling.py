"""Loss scaling that lives inside an optax optimizer."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import compat
from jmp_lite._src import dtypes
from jmp_lite._src import loss_scale as loss_scale_lib
from jmp_lite._src import tree as tree_lib

#: What :func:`loss_scaling` does after ``max_consecutive_skips`` skipped steps
#: in a row: ``"flag"`` sets ``state.gave_up`` (jit-safe, no host sync);
#: ``"raise"`` raises ``FloatingPointError`` from the step (a host callback
#: per step).
ON_MAX_SKIPS = ("flag", "raise")


class LossScaleState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    inner_state: the wrapped optimizer's state. It is left untouched (step
      counts included) on a step whose gradients are not finite.
    loss_scale: the loss scale to use for the *next* forward pass; read it with
      :func:`get_loss_scale`. ``loss_scale.loss_scale`` is the float32 value to
      log. ``None`` when the wrapper shares a scale passed to every ``update``
      (``loss_scaling(inner)`` without a scale).
    skipped_steps: int32, the number of optimizer steps skipped so far because
      the gradients were not finite (with accumulation: windows).
    consecutive_skips: int32, optimizer steps skipped in a row (0 after a
      finite step); a value that keeps growing once the scale sits at its
      floor means the model itself produces NaN/inf.
    accumulated: with ``accumulation_steps > 1``, the float32 sum of the
      unscaled gradients of the finite micro-batches of the current window;
      ``None`` otherwise.
    micro_step: with accumulation, the micro-batches already seen in the
      current window (int32); ``None`` otherwise.
    window_finite: with accumulation, whether every micro-batch of the current
      window was finite so far (bool); ``None`` otherwise.
    max_consecutive_skips: the limit given to :func:`loss_scaling` (int32), or
      ``None``.
    last_finite: (property) bool array, whether the last optimizer step's
      gradients were finite: ``consecutive_skips == 0``. Derived rather than
      stored, since returning the all-finite flag as its own output costs XLA
      a fusion.
    gave_up: (property) bool array, ``consecutive_skips >=
      max_consecutive_skips``: the run has stalled (always False without a
      limit).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**15))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> int(state.skipped_steps), bool(state.last_finite), bool(state.gave_up)
    (0, True, False)
  """

  inner_state: Any
  loss_scale: Any
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  accumulated: Any = None
  micro_step: Any = None
  window_finite: Any = None
  max_consecutive_skips: Any = None

  @property
  def last_finite(self) -> jax.Array:
    """Whether the last optimizer step's gradients were finite (bool array)."""
    return self.consecutive_skips == 0

  @property
  def gave_up(self) -> jax.Array:
    """Whether ``max_consecutive_skips`` steps in a row were skipped."""
    if self.max_consecutive_skips is None:
      return jnp.zeros_like(self.consecutive_skips, dtype=bool)
    return self.consecutive_skips >= self.max_consecutive_skips


def _check_loss_scale(loss_scale: Any) -> None:
  if loss_scale is None:
    return
  if isinstance(loss_scale, type):
    raise TypeError(
        f"loss_scaling expects a loss-scale object, got the class "
        f"{loss_scale.__name__}; create one: jmp_lite.{loss_scale.__name__}("
        f"{'' if loss_scale is loss_scale_lib.NoOpLossScale else '2.0**15'})."
    )
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


def _check_config(
    loss_scale: Any, accumulation_steps: Any, max_consecutive_skips: Any,
    on_max_skips: Any,
) -> None:
  """Validates loss_scaling's options (each error names the option)."""
  for name, value in (("accumulation_steps", accumulation_steps),
                      ("max_consecutive_skips", max_consecutive_skips)):
    if value is None and name == "max_consecutive_skips":
      continue
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
      raise TypeError(
          f"loss_scaling: {name} must be an int >= 1, got "
          f"{type(value).__name__}: {value!r}."
      )
    if not 1 <= value < 2**31:
      raise ValueError(
          f"loss_scaling: {name} must be an int >= 1 (and < 2**31), got {value!r}."
      )
  if on_max_skips not in ON_MAX_SKIPS:
    raise ValueError(
        f"loss_scaling: on_max_skips must be one of {ON_MAX_SKIPS}, got "
        f"{on_max_skips!r}."
    )
  if on_max_skips == "raise" and max_consecutive_skips is None:
    raise ValueError(
        "loss_scaling: on_max_skips='raise' needs max_consecutive_skips, the "
        "number of skipped steps in a row after which to raise."
    )
  if loss_scale is None and accumulation_steps > 1:
    raise ValueError(
        "loss_scaling: accumulation_steps needs the wrapper's own loss scale "
        "(it changes the scale once per window); a shared scale you adjust "
        "yourself cannot know where windows end. Pass the loss scale."
    )


# -- what wraps loss_scaling ---------------------------------------------------
#
# loss_scaling must be the outermost optax transformation. An optax wrapper
# around it either sees the scaled gradients (a clip before it clips them to
# 1/scale of their size), or steps and skips on its own so that the loss
# scale cannot back off (MultiSteps poisons its accumulator with 0 * inf =
# NaN; apply_if_finite discards the state in which the scale backed off), or
# moves the params on a skipped step (schedule_free, lookahead), or counts
# skipped steps in its schedules (inject_hyperparams). Its init is the only
# place the wrapper can see what encloses it: an optax wrapper's init calls
# ours, so the enclosing transformations are on the call stack (host-side,
# at init time; nothing here runs in a train step).

#: optax transformations that may run loss_scaling's init: those applying
#: their elements in order (loss_scaling first is fine), and flatten, which
#: only reshapes. Any other optax transformation around it is refused.
_IN_ORDER = frozenset({"chain", "named_chain"})
_TRANSPARENT = frozenset({"flatten"})

#: Per enclosing optax transformation: what goes wrong, and what to write.
_ENCLOSING_FIXES = {
    "MultiSteps": (
        "MultiSteps accumulates the scaled gradients itself and resets its "
        "accumulator by multiplying with 0, so one non-finite micro-batch "
        "makes it NaN for good and every later step is skipped",
        "jmp_lite.loss_scaling(inner, loss_scale, accumulation_steps=k)"),
    "apply_if_finite": (
        "apply_if_finite drops the whole update of a non-finite step, "
        "including the state in which the loss scale backed off, so the "
        "scale cannot back off until it gives up",
        "jmp_lite.loss_scaling(inner, loss_scale) alone (it skips non-finite "
        "steps itself; pass max_consecutive_skips= for apply_if_finite's "
        "limit)"),
    "schedule_free": (
        "schedule_free moves the params on every step, including the steps "
        "loss_scaling skips",
        "jmp_lite.loss_scaling(optax.contrib.schedule_free(inner, ...), "
        "loss_scale)"),
    "lookahead": (
        "lookahead counts skipped steps towards its synchronisation and "
        "re-initialises the fast optimizer, loss scale included",
        "jmp_lite.loss_scaling(optax.lookahead(inner, ...), loss_scale)"),
    "inject_hyperparams": (
        "inject_hyperparams counts skipped steps in its schedules",
        "jmp_lite.loss_scaling(optax.inject_hyperparams(optimizer)(...), "
        "loss_scale)"),
    "masked": (
        "the parameters outside the mask would receive scaled gradients",
        "jmp_lite.loss_scaling(optax.masked(inner, mask), loss_scale) or "
        "jmp_lite.loss_scaling(optax.multi_transform(...), loss_scale)"),
    "partition": (
        "the other partitions would receive scaled gradients",
        "jmp_lite.loss_scaling(optax.multi_transform(...), loss_scale)"),
    "multi_transform": (
        "the other partitions would receive scaled gradients",
        "jmp_lite.loss_scaling(optax.multi_transform(...), loss_scale)"),
}


def _enclosing_problem() -> str | None:
  """Why the optax transformations running this init break loss scaling, or
  None if loss_scaling is outermost (or first in a chain). Of several, the
  outermost (what the user wrote: multi_transform, not the masked inside)."""
  problem = None
  for name, position in compat.enclosing_optax_inits(skip=2):
    if name in _IN_ORDER:
      if position:
        problem = (
            f"optax.{name} runs {position} transformation(s) before "
            "loss_scaling: they see the scaled gradients (a clip clips them to"
            " 1/scale of their size, weight decay is divided by the scale). "
            "Put them inside: jmp_lite.loss_scaling(optax.chain("
            "optax.clip_by_global_norm(1.0), optax.adam(1e-3)), loss_scale)")
    elif name not in _TRANSPARENT:
      why, fix = _ENCLOSING_FIXES.get(name, (
          "optax transformations around loss_scaling see the scaled "
          "gradients and do not know about skipped steps",
          "jmp_lite.loss_scaling(<that transformation>, loss_scale)"))
      problem = (f"loss_scaling is inside optax's {name}: {why}. Make "
                 f"loss_scaling the outermost transformation: {fix}")
  return problem


def _refuse_nesting(inner_state: Any) -> None:
  """Compositions that would silently break are errors at init."""
  if tree_lib.find_nodes(inner_state, LossScaleState):
    raise TypeError(
        "loss_scaling wraps an optimizer that already contains loss_scaling: "
        "the gradients would be unscaled twice and training would stall. Use "
        "one loss_scaling, outermost (e.g. loss_scaling(optax.chain(clip, "
        "adam), scale))."
    )
  if tree_lib.find_nodes(inner_state, optax.MultiStepsState):
    raise TypeError(
        "loss_scaling wraps optax.MultiSteps: each micro-batch would adjust "
        "the loss scale and a non-finite one would be dropped alone instead of"
        " invalidating its window. Accumulate inside the wrapper instead: "
        "jmp_lite.loss_scaling(inner, loss_scale, accumulation_steps=k)."
    )


def _gave_up(consecutive_skips, limit, loss_scale) -> None:
  """Host callback of on_max_skips='raise'."""
  if int(consecutive_skips) >= int(limit):
    raise FloatingPointError(
        f"jmp_lite.loss_scaling gave up: {int(consecutive_skips)} optimizer "
        f"steps in a row had non-finite gradients (max_consecutive_skips="
        f"{int(limit)}); the loss scale is now {float(loss_scale):g}. A scale "
        "that keeps backing off to its floor means the model itself makes "
        "NaN/inf (learning rate, data, a log of 0...), or that the gradients "
        "handed to update were not computed from a scaled loss."
    )


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.AnyLossScale | None = None,
    *,
    axis_name: Any = None,
    accumulation_steps: int = 1,
    max_consecutive_skips: int | None = None,
    on_max_skips: str = "flag",
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

  **Gradient clipping goes inside** (``loss_scaling(optax.chain(
  optax.clip_by_global_norm(1.0), optax.adam(1e-3)), scale)``): the inner
  optimizer sees unscaled gradients. Outside, it would clip the still-scaled
  gradients down to a norm of 1 / scale.

  **Gradient accumulation** (``accumulation_steps=k``): every ``update`` is a
  micro-batch; the inner optimizer steps on the mean of ``k`` unscaled
  gradients, accumulated in float32, and returns zero updates in between.
  A non-finite micro-batch invalidates its whole window (no NaN enters the
  accumulator or a later window); the scale stays fixed within a window and
  adjusts once at its end, so growth counts optimizer steps (torch's
  ``GradScaler`` semantics). ``optax.MultiSteps`` around or inside this
  wrapper is refused with an error pointing here.

  **Several optimizers, one scale** (a GAN's two, torch's one ``GradScaler``
  for two optimizers): build each wrapper without a scale
  (``loss_scaling(optax.adam(1e-4))``) and pass the shared scale to every
  update (``update(grads, state, params, loss_scale=scale)``); each optimizer
  skips on its own non-finite gradients. Then adjust the scale once per step,
  backing off if any optimizer skipped:
  ``scale = scale.adjust(state_a.last_finite & state_b.last_finite)``.

  Args:
    inner: the optax optimizer to wrap (``GradientTransformation`` or
      ``GradientTransformationExtraArgs``).
    loss_scale: the initial ``NoOpLossScale``, ``StaticLossScale`` or
      ``DynamicLossScale``; ``None`` to use a scale passed to every
      ``update`` as ``loss_scale=`` (shared between optimizers).
    axis_name: mapped axis name(s) under ``pmap``/``shard_map`` over which the
      finiteness check is agreed, so all replicas keep the same scale. Not
      needed with ``jax.jit`` and sharded arrays.
    accumulation_steps: micro-batches per optimizer step (1: none).
    max_consecutive_skips: optional limit on optimizer steps skipped in a row;
      reaching it sets ``state.gave_up`` (see ``on_max_skips``).
    on_max_skips: ``"flag"`` (default: ``state.gave_up`` only, jit-safe, no
      host sync) or ``"raise"`` (the step fails with a ``FloatingPointError``
      explaining why, which JAX reports as a runtime error at the next
      synchronisation; it costs a host callback on every step).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: if ``inner`` is not an optax transformation, ``loss_scale`` is
      not a loss scale (a class instead of an instance, a number...), or an
      option has the wrong type; from ``init``, if ``inner`` contains another
      ``loss_scaling`` or ``optax.MultiSteps``.
    ValueError: for an option out of range.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ...     jmp_lite.DynamicLossScale(2.0**10))
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
  _check_config(loss_scale, accumulation_steps, max_consecutive_skips,
                on_max_skips)
  if axis_name is not None:
    tree_lib.check_axis_name(axis_name)
  wrapper = _LossScaling(
      inner=optax.with_extra_args_support(inner),
      loss_scale=loss_scale,
      axis_name=axis_name,
      k=int(accumulation_steps),
      max_skips=None if max_consecutive_skips is None
      else int(max_consecutive_skips),
      raise_on_max_skips=on_max_skips == "raise",
  )
  return optax.GradientTransformationExtraArgs(wrapper.init, wrapper.update)


class _Window(NamedTuple):
  """What one update decides (see ``_LossScaling._window``)."""

  grads: Any  # for the inner update: this micro-batch's, or the window's mean
  step_ends: Any  # bool: this update is an optimizer step
  finite: Any  # bool: the step's gradients (its whole window) were finite
  fields: dict  # the accumulation fields of the next state


@dataclasses.dataclass(frozen=True)
class _LossScaling:
  """The configuration of one :func:`loss_scaling` and its init/update."""

  inner: optax.GradientTransformationExtraArgs
  loss_scale: Any
  axis_name: Any
  k: int
  max_skips: int | None
  raise_on_max_skips: bool

  def init(self, params: Any) -> LossScaleState:
    problem = _enclosing_problem()
    if problem is not None:
      raise TypeError(problem + ".")
    inner_state = self.inner.init(params)
    _refuse_nesting(inner_state)
    accumulating = dict(
        accumulated=jax.tree_util.tree_map(
            lambda p: jnp.zeros(p.shape, dtypes.at_least_f32(p.dtype))
            if tree_lib.is_float_array(p) else p,
            params,
        ),
        micro_step=jnp.zeros([], jnp.int32),
        window_finite=jnp.ones([], bool),
    ) if self.k > 1 else {}
    return LossScaleState(
        inner_state=inner_state,
        # Fresh buffers on every init: a step that donates its state must not
        # delete the arrays of the loss scale this optimizer was built with.
        loss_scale=jax.tree_util.tree_map(jnp.array, self.loss_scale),
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        max_consecutive_skips=None if self.max_skips is None
        else jnp.asarray(self.max_skips, jnp.int32),
        **accumulating,
    )

  def update(self, updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise TypeError(
          "loss_scaling's update expects the LossScaleState made by its init, "
          f"got {type(state).__name__}. Pass the state returned by opt.init."
      )
    self._check_fits(state)
    current = _scale_for_update(state.loss_scale,
                                extra_args.pop("loss_scale", None))
    # Unscale in f32 (or wider) and keep that precision for the inner update.
    grads = current.unscale(tree_lib.widen_floating(updates))
    window = self._window(
        grads, tree_lib.all_finite(grads, axis_name=self.axis_name), state)
    out_updates, out_inner = self._inner_step(
        window.grads, window.step_ends & window.finite, state, params,
        extra_args)
    skipped = window.step_ends & ~window.finite
    consecutive = jnp.where(
        skipped, optax.safe_increment(state.consecutive_skips),
        jnp.where(window.step_ends, 0, state.consecutive_skips))
    new_scale = state.loss_scale
    if new_scale is not None:  # Shared scales are adjusted by their owner.
      new_scale = tree_lib.select_tree(
          jnp.asarray(window.step_ends), current.adjust(window.finite), current)
    if self.raise_on_max_skips:
      scale_now = current if new_scale is None else new_scale
      jax.debug.callback(_gave_up, consecutive, state.max_consecutive_skips,
                         scale_now.loss_scale)
    return out_updates, state._replace(
        inner_state=out_inner,
        loss_scale=new_scale,
        skipped_steps=jnp.where(
            skipped, optax.safe_increment(state.skipped_steps),
            state.skipped_steps),
        consecutive_skips=consecutive,
        **window.fields,
    )

  def _check_fits(self, state: LossScaleState) -> None:
    """A state must have been made by a wrapper with the same accumulation
    (a checkpoint restored into another configuration, say)."""
    accumulates = state.micro_step is not None
    if accumulates == (self.k > 1):
      return
    if accumulates:
      raise ValueError(
          "loss_scaling(accumulation_steps=1) got a state that accumulates "
          "micro-batches (made with accumulation_steps > 1): its current "
          "window would be dropped. Build the optimizer with the "
          "accumulation_steps the state was made with, or start from "
          "opt.init(params).")
    raise ValueError(
        f"loss_scaling(accumulation_steps={self.k}) got a state made without"
        " accumulation (it has no accumulator, micro_step or window_finite). "
        "Make the state with this optimizer's init (opt.init(params)); to "
        "restore a checkpoint, restore it into opt.init(params) of the "
        "optimizer that wrote it.")

  def _window(self, grads: Any, finite: Any, state: LossScaleState) -> _Window:
    """Accumulation: where this micro-batch's unscaled gradients go."""
    if self.k == 1:
      return _Window(grads, jnp.ones([], bool), finite, {})
    # ">=": a state restored from a run with more micro-batches per window
    # ends its window now, with the mean of all it holds, instead of never.
    step_ends = state.micro_step >= self.k - 1
    window_ok = state.window_finite & finite
    if (jax.tree_util.tree_structure(grads)
        != jax.tree_util.tree_structure(state.accumulated)):
      raise ValueError(
          "loss_scaling(accumulation_steps>1) accumulates gradients in a "
          "buffer shaped like the params given to init, but the gradients "
          "have another structure:\n"
          f"  gradients: {jax.tree_util.tree_structure(grads)}\n"
          f"  params:    {jax.tree_util.tree_structure(state.accumulated)}\n"
          "Pass gradients with the structure of the params (for "
          "optax.lookahead, whose params are LookaheadParams, accumulate "
          "without it or use accumulation_steps=1).")
    # A non-finite micro-batch is never added: no NaN enters the sum.
    acc = jax.tree_util.tree_map(
        lambda a, g: a + jnp.where(finite, g, jnp.zeros_like(g))
        if tree_lib.is_float_array(a) else a,
        state.accumulated, grads,
    )
    # The mean over k micro-batches (over all it holds, after such a
    # restore). The count is a runtime value, so every XLA version divides
    # exactly (some turn a division by a constant into a multiplication).
    seen = jnp.maximum(state.micro_step + 1, self.k)
    mean = jax.tree_util.tree_map(
        lambda a, g: a / seen.astype(a.dtype) if tree_lib.is_float_array(a)
        else g, acc, grads)
    fields = dict(
        accumulated=tree_lib.select_tree(
            step_ends, optax.tree.zeros_like(acc), acc),
        micro_step=jnp.where(step_ends, 0, state.micro_step + 1),
        window_finite=step_ends | window_ok,
    )
    return _Window(mean, step_ends, window_ok, fields)

  def _inner_step(self, grads, ok, state, params, extra_args):
    """The inner update where ``ok``; zero updates and the old state elsewhere."""
    new_updates, new_inner = self.inner.update(
        grads, state.inner_state, params, **extra_args
    )
    # Keep the state's dtypes stable across steps (as its init made them).
    new_inner = tree_lib.cast_like(new_inner, state.inner_state)
    zeros = jax.tree_util.tree_map(
        lambda u: jnp.zeros_like(u) if tree_lib.is_array(u) else u, new_updates
    )
    return (tree_lib.select_tree(ok, new_updates, zeros),
            tree_lib.select_tree(ok, new_inner, state.inner_state))


def _scale_for_update(own: Any, shared: Any) -> Any:
  """The loss scale this update unscales with: the state's, or the shared one."""
  if own is None:
    if shared is None:
      raise TypeError(
          "This loss_scaling was built without a loss scale, to share one: "
          "pass it to every update, opt.update(grads, state, params, "
          "loss_scale=scale), and adjust it once per step yourself."
      )
    _check_loss_scale(shared)
    return shared
  if shared is not None:
    raise TypeError(
        "loss_scaling got loss_scale= in update, but it keeps its own scale in"
        " its state. To share one scale between optimizers, build each with "
        "loss_scaling(inner) (no scale)."
    )
  return _restored(own)


def _restored(loss_scale: Any) -> Any:
  """The state's loss scale, or a clear error if a checkpoint lost its class."""
  if isinstance(loss_scale, Mapping):
    raise TypeError(
        "The optimizer state's loss_scale is a plain dict "
        f"({sorted(loss_scale)}): it came back from a checkpoint restored "
        "without a target, which loses the loss scale's class and its static "
        "configuration (period, factor, min_loss_scale...). Restore with the "
        "state from opt.init as the target (orbax: "
        "checkpointer.restore(path, target=opt.init(params)), or "
        "ocp.args.StandardRestore(abstract_state))."
    )
  return loss_scale


def _find_states(tree: Any) -> Sequence[LossScaleState]:
  """The LossScaleStates inside an optimizer state."""
  return tree_lib.find_nodes(tree, LossScaleState)


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
    >>> opt = optax.chain(jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0)),
    ...                   optax.scale_by_schedule(lambda step: 0.5))
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
  if state.loss_scale is None:
    raise ValueError(
        f"{caller}: this loss_scaling shares a loss scale passed to each "
        "update (it was built without one), so its state holds none: use the "
        "scale you pass to update."
    )
  return state._replace(
      loss_scale=_fields_as_arrays(_restored(state.loss_scale)),
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
