"""Loss scaling that lives inside an optax optimizer: the wrapper, its state,
the lookup of its scale, the scaled value-and-grad helper, and the check that
the gradients it receives were computed from the scaled loss.

Guide: ``docs/training_loops.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import loss_scale as loss_scale_lib
from jmp_lite._src import tree as tree_lib

#: What :func:`loss_scaling` does from the ``max_consecutive_skips``-th
#: non-finite optimizer step in a row on: ``"apply"`` (the default) applies it
#: like a finite one, as ``optax.apply_if_finite`` does after
#: ``max_consecutive_errors`` (the non-finite values reach the params, so a
#: stalled run shows NaN/inf instead of skipping silently forever; no host
#: callback, so a step stays exportable with ``jax.export``); ``"raise"``
#: raises ``FloatingPointError`` from that step (a host callback behind a
#: ``lax.cond``: not exportable); ``"flag"`` only sets ``state.gave_up``.
ON_MAX_SKIPS = ("apply", "raise", "flag")

#: The default ``max_consecutive_skips``: a run that skips 100 optimizer steps
#: in a row is not training (backing off from jmp's suggested 2**15 to its
#: floor of 1 takes 15), so a healthy run never reaches it, and a stalled one -- ``optax.MultiSteps``
#: around ``loss_scaling``, which no structural check sees when the loop never
#: hands its whole state to jmp_lite -- fails loudly instead of silently.
_DEFAULT_MAX_SKIPS = 100

_F16_MAX = 65504.0

# -- messages ----------------------------------------------------------------------

_NESTED = (
    "loss_scaling wraps an optimizer that already contains loss_scaling: the "
    "gradients would be unscaled twice and training would stall. Use one "
    "loss_scaling, outermost (e.g. loss_scaling(optax.chain(clip, adam), "
    "scale))."
)
_MULTISTEPS_INSIDE = (
    "loss_scaling wraps optax.MultiSteps: each micro-batch would adjust the "
    "loss scale and a non-finite one would be dropped alone instead of "
    "invalidating its window. Accumulate inside the wrapper instead: "
    "jmp_lite.loss_scaling(inner, loss_scale, accumulation_steps=k)."
)
_NO_SHARED_SCALE = (
    "This loss_scaling was built without a loss scale, to share one: pass it "
    "to every update, opt.update(grads, state, params, loss_scale=scale), and "
    "adjust it once per step yourself."
)
_OWN_AND_SHARED = (
    "loss_scaling got loss_scale= in update, but it keeps its own scale in its"
    " state. To share one scale between optimizers, build each with "
    "loss_scaling(inner) (no scale)."
)
_RESTORED_AS_DICT = (
    "The optimizer state's loss_scale is a plain dict ({keys}): it came back "
    "from a checkpoint restored without a target, which loses the loss "
    "scale's class and its static configuration (period, factor, "
    "min_loss_scale...). Restore with the state from opt.init as the target "
    "(orbax: checkpointer.restore(path, target=opt.init(params)), or "
    "ocp.args.StandardRestore(abstract_state))."
)
_WRAP_NUMBER = (
    "Pass a jmp_lite loss scale: jmp_lite.DynamicLossScale(2.0**15) to adapt "
    "the scale, jmp_lite.StaticLossScale(value) to keep it fixed, or "
    "jmp_lite.NoOpLossScale()"
)
_SHARED_WITH_ACCUMULATION = (
    "loss_scaling: accumulation_steps needs the wrapper's own loss scale (it "
    "changes the scale once per window); a shared scale you adjust yourself "
    "cannot know where windows end. Pass the loss scale."
)
_SHARES_A_SCALE = (
    "get_loss_scale: this loss_scaling shares a loss scale passed to each "
    "update (it was built without one), so its state holds none: use the "
    "scale you pass to update."
)
_GAVE_UP = (
    "jmp_lite.loss_scaling gave up: {skips} optimizer steps in a row had "
    "non-finite gradients (max_consecutive_skips={limit}); the loss scale is "
    "now {scale:g}. Training has stalled: every step is skipped. The usual "
    "causes: (1) optax.MultiSteps around loss_scaling -- MultiSteps resets its"
    " accumulator by multiplying it with 0, so one non-finite micro-batch "
    "leaves NaN in it for good and every later window is non-finite; "
    "accumulate inside the wrapper instead: jmp_lite.loss_scaling(inner, "
    "loss_scale, accumulation_steps=k) (and drop MultiSteps); (2) the model "
    "itself makes NaN/inf whatever the scale (learning rate, data, a log of "
    "0...). Pass on_max_skips='flag' to only set state.gave_up, or "
    "max_consecutive_skips=None to turn this guard off."
)
_STATE_ACCUMULATES = (
    "loss_scaling(accumulation_steps=1) got a state that accumulates "
    "micro-batches (made with accumulation_steps > 1): its current window "
    "would be dropped. Build the optimizer with the accumulation_steps the "
    "state was made with, or start from opt.init(params)."
)
_STATE_DOES_NOT_ACCUMULATE = (
    "loss_scaling(accumulation_steps={k}) got a state made without "
    "accumulation (it has no accumulator, micro_step or window_finite). Make "
    "the state with this optimizer's init (opt.init(params)); to restore a "
    "checkpoint, restore it into opt.init(params) of the optimizer that "
    "wrote it."
)
_GRADS_NOT_LIKE_PARAMS = (
    "loss_scaling(accumulation_steps>1) accumulates gradients in a buffer "
    "shaped like the params given to init, but the gradients have another "
    "structure:\n  gradients: {grads}\n  params:    {params}\nPass gradients "
    "with the structure of the params (for optax.lookahead, whose params are "
    "LookaheadParams, accumulate without it or use accumulation_steps=1)."
)

# -- what may wrap loss_scaling -------------------------------------------------------
#
# loss_scaling must be the outermost optax transformation. An optax wrapper
# around it either sees the scaled gradients (a clip before it clips them to
# 1/scale of their size), or steps and skips on its own so that the loss
# scale cannot back off (MultiSteps poisons its accumulator with 0 * inf =
# NaN; apply_if_finite discards the state in which the scale backed off), or
# moves the params on a skipped step (schedule_free, lookahead), or counts
# skipped steps in its schedules (inject_hyperparams).
#
# The refusal is structural: an enclosing optax wrapper keeps our state as a
# field of its own named-tuple state (MultiStepsState.inner_opt_state, ...),
# and optax.chain keeps it at a position of a tuple. Our init and update see
# only our own part of the state, so the layout is read where the whole
# optimizer state is handed to jmp_lite: get_loss_scale and
# scaled_value_and_grad (the documented train step's first line, at trace
# time, before anything is computed), and the init of jmp_lite's own wrappers.
# What no layout shows (optax.named_chain's dict of states looks like any
# dict of states; a loop that never hands the whole state to jmp_lite) is
# said in docs/training_loops.md. For MultiSteps in such a loop, what init
# and update receive is what they receive without it, and the accumulator
# that turns NaN is MultiSteps' own: the stall guard (max_consecutive_skips,
# on by default, raising) makes that stall loud at run time instead.

_BEFORE_IN_CHAIN = (
    "optax.{name} runs {count} transformation(s) before loss_scaling: they see"
    " the scaled gradients (a clip clips them to 1/scale of their size, "
    "weight decay is divided by the scale). Put them inside: "
    "jmp_lite.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), "
    "optax.adam(1e-3)), loss_scale). (Read from the state's layout: a "
    "loss_scaling state at position {count} of a tuple of optimizer states. "
    "If that tuple is your own grouping of states, not an optax.chain, pass "
    "the loss_scaling state itself.)"
)
_INSIDE_WRAPPER = (
    "loss_scaling is inside optax's {name}: {why}. Make loss_scaling the "
    "outermost transformation: {fix}."
)
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
}
_UNKNOWN_WRAPPER = (
    "optax transformations around loss_scaling see the scaled gradients and "
    "do not know about skipped steps",
    "jmp_lite.loss_scaling(<that transformation>, loss_scale)")

#: The optax wrapper that keeps an inner state in each named-tuple state
#: (by the named tuple's class name: optax's public state classes). Named
#: tuples of optax's own transformations not listed here (ScaleByAdamState,
#: EmptyState...) hold no inner state; any other named tuple is a container
#: (a user's, jmp_lite's own) and passes.
_WRAPPER_STATES = {
    "MultiStepsState": "MultiSteps",
    "ApplyIfFiniteState": "apply_if_finite",
    "ScheduleFreeState": "schedule_free",
    "LookaheadState": "lookahead",
    "InjectHyperparamsState": "inject_hyperparams",
    "InjectStatefulHyperparamsState": "inject_hyperparams",
    "MaskedState": "masked",
    "PartitionState": "partition",
    "MultiTransformState": "partition",
    "MechanicState": "mechanize",
}


def _layout_problem(path: Sequence[Any]) -> str | None:
  """Why the optax states enclosing a ``LossScaleState`` at ``path`` (from
  ``optax.tree.get_all_with_path``, root first) break loss scaling, or None.
  Of several, the outermost: what the user wrote (multi_transform, not the
  masked inside it)."""
  for key in path[:-1]:
    tuple_name = getattr(key, "tuple_name", None)
    if tuple_name in _WRAPPER_STATES:
      name = _WRAPPER_STATES[tuple_name]
      why, fix = _ENCLOSING_FIXES.get(name, _UNKNOWN_WRAPPER)
      return _INSIDE_WRAPPER.format(name=name, why=why, fix=fix)
    if (isinstance(key, jax.tree_util.SequenceKey) and key.idx > 0
        and tuple_name is None):
      # optax.chain's state is a plain tuple, one state per element in order.
      return _BEFORE_IN_CHAIN.format(name="chain", count=key.idx)
  return None


def _check_layout(opt_state: Any) -> None:
  """Refuses an optimizer state whose layout shows an optax wrapper around
  (or a chain element before) a ``loss_scaling``; see the comment above."""
  name = LossScaleState.__name__
  for path, _ in optax.tree.get_all_with_path(
      opt_state, "loss_scale",
      filtering=lambda p, v: getattr(p[-1], "tuple_name", None) == name):
    problem = _layout_problem(path)
    if problem is not None:
      raise TypeError(problem)


# -- the check that gradients were scaled ----------------------------------------------


class ScalingCheck(NamedTuple):
  """Running evidence that gradients reach :func:`loss_scaling` unscaled.

  The mistake it catches: gradients of the *unscaled* loss handed to
  ``update``, which divides them by the scale, so updates shrink by that
  factor and training stalls with no error. It costs nothing beyond the
  wrapper's own reduction over the gradients (their largest magnitude, which
  also decides finiteness) and a few scalars. Two signals, both from the
  largest magnitude ``m`` of the gradients handed to ``update`` and the scale
  ``s`` of their step (``docs/training_loops.md`` explains them):

  * headroom: scaled gradients still fitting float16 after a *second*
    multiplication by ``s >= 2`` (``m * s <= 65504``) are suspect;
  * response: between finite steps whose scale changed, ``log2 m`` of scaled
    gradients moves with ``log2 s``, that of unscaled ones does not.

  Attributes:
    suspect_steps: int32, finite steps in a row that failed the headroom test.
    last_log2_max: float32, ``log2 m`` at the last finite nonzero step (0
      before any: read it together with ``seen``).
    last_log2_scale: float32, ``log2 s`` at that step (0 before any).
    scale_change: float32, total ``|change of log2 s|`` between such steps.
    response: float32, total change of ``log2 m`` between them, signed by the
      direction of the scale's change.
    seen: bool, whether a finite nonzero step has been recorded (whether the
      two ``last_*`` fields hold a value). No field is ever NaN or inf: a
      fresh state passes ``jax_debug_nans`` and can be ``device_put`` onto a
      multi-process mesh.
  """

  suspect_steps: Any
  last_log2_max: Any
  last_log2_scale: Any
  scale_change: Any
  response: Any
  seen: Any

  @classmethod
  def initial(cls) -> "ScalingCheck":
    """No evidence yet (a buffer per leaf: states may be donated)."""
    return cls(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32),
               jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32),
               jnp.zeros([], jnp.float32), jnp.zeros([], bool))

  def looks_unscaled(self) -> jax.Array:
    """True once the scale has changed by 2 binades and the gradients followed
    less than half of it, or, before that, after 20 suspect steps in a row."""
    change = jnp.asarray(self.scale_change, jnp.float32)
    decided = change >= 2.0
    ratio = jnp.asarray(self.response, jnp.float32) / jnp.where(
        decided, change, 1.0)
    by_response = decided & (ratio < 0.5)
    by_headroom = ~decided & (jnp.asarray(self.suspect_steps) >= 20)
    return by_response | by_headroom

  def record(self, largest: jax.Array, scale: Any) -> "ScalingCheck":
    """Adds one step: ``largest`` is the largest magnitude of the gradients
    handed to ``update`` (inf if any is not finite), ``scale`` its scale."""
    scale = jnp.asarray(scale, jnp.float32)
    valid = (largest > 0) & jnp.isfinite(largest)
    # Only finite positive values reach log2 (no -inf from a zero step, no
    # inf from a non-finite one), and the headroom test divides a finite
    # constant by a scale >= 2 instead of multiplying (no overflow).
    one = jnp.ones([], jnp.float32)
    log2_max = _log2(jnp.where(valid, largest, one))
    positive = scale > 0
    log2_scale = _log2(jnp.where(positive, scale, one))
    suspect = (positive & (log2_scale >= 1)
               & (largest <= _F16_MAX / jnp.maximum(scale, 2 * one)))
    suspect_steps = jnp.where(
        valid, jnp.where(suspect, optax.safe_increment(self.suspect_steps),
                         jnp.zeros_like(self.suspect_steps)),
        self.suspect_steps)
    delta = log2_scale - self.last_log2_scale
    pair = valid & self.seen & (jnp.abs(delta) > 1e-3)
    zero = jnp.zeros([], jnp.float32)
    return ScalingCheck(
        suspect_steps=suspect_steps,
        last_log2_max=jnp.where(valid, log2_max, self.last_log2_max),
        last_log2_scale=jnp.where(valid, log2_scale, self.last_log2_scale),
        scale_change=self.scale_change + jnp.where(pair, jnp.abs(delta), zero),
        response=self.response + jnp.where(
            pair, (log2_max - self.last_log2_max) * jnp.sign(delta), zero),
        seen=self.seen | valid,
    )


def _log2(x: jax.Array) -> jax.Array:
  """log2 of a positive finite float32 scalar, exact for powers of two."""
  mantissa, exponent = jnp.frexp(x)  # x = mantissa * 2**exponent, [0.5, 1)
  return (exponent - 1).astype(jnp.float32) + jnp.log2(2 * mantissa)


def _largest_magnitude(tree: Any) -> jax.Array:
  """The largest ``|x|`` over the floating leaves, as a float32 scalar; inf if
  any entry is inf or NaN (one reduction answers finiteness too: NaN counts
  as inf, since XLA's vectorised max does not propagate NaN reliably)."""
  leaves = [x for x in jax.tree.leaves(tree) if tree_lib.is_float(x)]
  return _max_magnitude(leaves) if leaves else jnp.zeros([], jnp.float32)


@jax.jit
def _max_magnitude(leaves: list[jax.Array]) -> jax.Array:
  """One program (inlined under an outer jit): its inf constant for NaN is
  internal, so an eager step of a finite run creates no inf that
  ``jax_debug_infs`` would flag."""
  maxima = [
      jnp.max(jnp.where(jnp.isnan(x), jnp.full((), jnp.inf, x.dtype),
                        jnp.abs(x)), initial=np.array(0, x.dtype))
      .astype(jnp.float32)
      for x in leaves
  ]
  return jnp.max(jnp.stack(maxima))


# -- the state ----------------------------------------------------------------------


class LossScaleState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    inner_state: the wrapped optimizer's state. It is left untouched (step
      counts included) on a step whose gradients are not finite.
    loss_scale: the loss scale to use for the *next* forward pass; read it with
      :func:`get_loss_scale`. ``loss_scale.loss_scale`` is the float32 value to
      log. ``None`` when the wrapper shares a scale passed to every ``update``.
    skipped_steps: int32, optimizer steps skipped so far because the
      gradients were not finite (with accumulation: windows).
    consecutive_skips: int32, optimizer steps in a row whose gradients were
      not finite (0 after a finite step): skipped, or from the limit on under
      ``on_max_skips="apply"``, applied.
    accumulated: with ``accumulation_steps > 1``, the float32 sum of the
      unscaled gradients of the finite micro-batches of the current window;
      ``None`` otherwise.
    micro_step: with accumulation, the micro-batches already seen in the
      current window (int32); ``None`` otherwise.
    window_finite: with accumulation, whether every micro-batch of the current
      window was finite so far (bool); ``None`` otherwise.
    max_consecutive_skips: the limit given to :func:`loss_scaling` (int32), or
      ``None``.
    scaling_check: the evidence behind ``looks_unscaled`` (a
      ``ScalingCheck``), or ``None`` with ``check_scaling=False``.

  Read a field from anywhere inside an optimizer state with
  ``optax.tree.get(opt_state, "skipped_steps")``.

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
  scaling_check: Any = None

  @property
  def last_finite(self) -> jax.Array:
    """Whether the last optimizer step's gradients were finite (bool array).

    Derived (``consecutive_skips == 0``) rather than stored: returning the
    all-finite flag as an output of its own costs XLA a fusion.
    """
    return self.consecutive_skips == 0

  @property
  def gave_up(self) -> jax.Array:
    """Whether the last ``max_consecutive_skips`` optimizer steps (or more) in
    a row had non-finite gradients (always False without a limit). Under
    ``on_max_skips="apply"`` those from the limit on were applied."""
    if self.max_consecutive_skips is None:
      return jnp.zeros_like(self.consecutive_skips, dtype=bool)
    return self.consecutive_skips >= self.max_consecutive_skips

  @property
  def looks_unscaled(self) -> jax.Array:
    """Whether the gradients handed to ``update`` look as if they were not
    computed from the scaled loss (or the scale is far too small for them);
    always False with ``check_scaling=False``."""
    if self.scaling_check is None:
      return jnp.zeros_like(self.consecutive_skips, dtype=bool)
    return self.scaling_check.looks_unscaled()


# -- the wrapper ---------------------------------------------------------------------


def _check_loss_scale(loss_scale: Any, owner: str = "loss_scaling") -> None:
  """The one check of a loss-scale argument (``loss_scaling``'s, a shared
  scale given to ``update``, ``get_loss_scale``'s and
  ``scaled_value_and_grad``'s): a loss-scale object, not its class (the class
  ``NoOpLossScale`` even passes ``isinstance(x, LossScale)``: it has the
  methods), nor a number."""
  if loss_scale is None:
    return
  if isinstance(loss_scale, type):
    name = loss_scale.__name__
    fix = (f"jmp_lite.{name}()" if loss_scale is loss_scale_lib.NoOpLossScale
           else f"jmp_lite.{name}(2.0**15)" if loss_scale in (
               loss_scale_lib.StaticLossScale, loss_scale_lib.DynamicLossScale)
           else "jmp_lite.DynamicLossScale(2.0**15) or jmp_lite.NoOpLossScale()")
    got = f"the class {name}, not an instance of it; create one: {fix}"
  elif isinstance(loss_scale, loss_scale_lib.LossScale):
    return
  elif checks.is_real_number(loss_scale) or checks.is_array(loss_scale):
    got = f"the number {loss_scale!r}. {_WRAP_NUMBER}"
  else:
    got = f"{type(loss_scale).__name__}: {loss_scale!r}. {_WRAP_NUMBER}"
  raise TypeError(f"{owner} expects a loss-scale object, got {got}.")


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.AnyLossScale | None = None,
    *,
    axis_name: Any = None,
    accumulation_steps: int = 1,
    check_scaling: bool = True,
    max_consecutive_skips: int | None = _DEFAULT_MAX_SKIPS,
    on_max_skips: str = "apply",
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer with loss scaling and non-finite step skipping.

  ``update(grads, state, params, **extra_args)`` takes gradients of the
  *scaled* loss (see :func:`get_loss_scale`, :func:`scaled_value_and_grad`)
  and unscales them in float32 with the scale of this step's forward pass,
  checks they are finite (agreed across devices with ``axis_name``), runs the
  inner update -- or, on a non-finite step, returns zero updates and keeps the
  inner state exactly as it was, step counts included -- and adjusts the
  scale. Every choice is a ``lax.select``: no host sync, no recompilation.
  ``loss_scaling`` must be the outermost transformation (clipping goes
  inside); :func:`get_loss_scale` and :func:`scaled_value_and_grad` refuse an
  optimizer state whose layout shows an optax wrapper around it.

  Args:
    inner: the optax optimizer to wrap.
    loss_scale: the initial ``NoOpLossScale``, ``StaticLossScale`` or
      ``DynamicLossScale``; ``None`` to use a scale passed to every
      ``update`` as ``loss_scale=`` (shared between optimizers).
    axis_name: mapped axis name(s) under ``pmap``/``shard_map`` over which
      finiteness is agreed. Not needed with ``jax.jit`` and sharded arrays.
    accumulation_steps: micro-batches per optimizer step (1: none); the inner
      optimizer steps on their mean, accumulated in float32, and a non-finite
      micro-batch voids its window.
    check_scaling: keep the evidence behind ``state.looks_unscaled`` (a few
      scalars; the reduction it reads is the one that decides finiteness).
    max_consecutive_skips: the limit on optimizer steps (windows) skipped in a
      row (default 100: a run that skips 100 steps in a row is not training); reaching it sets
      ``state.gave_up`` and acts as ``on_max_skips`` says. ``None``: no limit.
    on_max_skips: from the ``max_consecutive_skips``-th non-finite step in a
      row on: ``"apply"`` (default: the step is applied like a finite one, as
      ``optax.apply_if_finite`` does, so a stalled run shows NaN instead of
      skipping silently forever), ``"raise"`` (a ``FloatingPointError`` from
      that step: a host callback behind a ``lax.cond``, which ``jax.export``
      cannot serialize) or ``"flag"`` (``state.gave_up`` only).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: if ``inner`` is not an optax transformation, ``loss_scale`` is
      not a loss scale, or an option has the wrong type; from ``init``, if
      ``inner`` contains another ``loss_scaling`` or ``optax.MultiSteps``.
    ValueError: for an option out of range; from ``update``, for a state made
      with another accumulation setting.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ...     jmp_lite.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"].astype(jnp.float16) ** 2)
    >>> loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, state)(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(state.last_finite), bool(state.looks_unscaled)
    (True, False)

  See ``docs/training_loops.md`` for accumulation, shared scales, what may
  wrap ``loss_scaling``, the stall guard and the scaling check.
  """
  owner = "loss_scaling"
  inner = checks.optax_transformation(inner, owner)
  _check_loss_scale(loss_scale)
  k = checks.integer(accumulation_steps, "accumulation_steps", owner, 1)
  max_skips = None if max_consecutive_skips is None else checks.integer(
      max_consecutive_skips, "max_consecutive_skips", owner, 1)
  check_scaling = checks.flag(check_scaling, "check_scaling", owner)
  on_max_skips = checks.choice(on_max_skips, "on_max_skips", owner,
                               ON_MAX_SKIPS)
  if loss_scale is None and k > 1:
    raise ValueError(_SHARED_WITH_ACCUMULATION)
  if axis_name is not None:
    checks.axis_name(axis_name)
  wrapper = _LossScaling(
      inner=inner, loss_scale=loss_scale, axis_name=axis_name, k=k,
      check_scaling=bool(check_scaling), max_skips=max_skips,
      on_max_skips=None if max_skips is None else on_max_skips,
  )
  return optax.GradientTransformationExtraArgs(wrapper.init, wrapper.update)


def _gave_up(consecutive_skips, limit, loss_scale) -> None:
  """Host callback of on_max_skips='raise' (its arguments may be batched:
  under ``vmap`` the ``lax.cond`` around it becomes a select)."""
  skips, limit = np.asarray(consecutive_skips), np.asarray(limit)
  if np.any(skips >= limit):
    raise FloatingPointError(_GAVE_UP.format(
        skips=int(np.max(skips)), limit=int(np.min(limit)),
        scale=float(np.min(np.asarray(loss_scale)))))


def _raise_if_gave_up(consecutive_skips, limit, loss_scale) -> None:
  """Raises from the step that reaches the limit, and costs no host callback
  on the others: the callback sits in a ``lax.cond`` branch."""
  args = (consecutive_skips, limit, jnp.asarray(loss_scale, jnp.float32))
  lax.cond(consecutive_skips >= limit,
           lambda *a: jax.debug.callback(_gave_up, *a),
           lambda *a: None, *args)


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
  check_scaling: bool
  max_skips: int | None
  on_max_skips: str | None  # ON_MAX_SKIPS' choice; None without a limit

  def init(self, params: Any) -> LossScaleState:
    checks.no_fp8_state(params, "jmp_lite.loss_scaling")
    inner_state = self.inner.init(params)
    problem = (_NESTED if tree_lib.find(inner_state, LossScaleState,
                                        "loss_scale")
               else _MULTISTEPS_INSIDE if tree_lib.find(
                   inner_state, optax.MultiStepsState, "mini_step") else None)
    if problem:
      raise TypeError(problem)
    accumulating = dict(
        accumulated=jax.tree.map(
            lambda p: jnp.zeros(p.shape, dtypes.at_least_f32(p.dtype))
            if tree_lib.is_float(p) else p,
            params,
        ),
        micro_step=jnp.zeros([], jnp.int32),
        window_finite=jnp.ones([], bool),
    ) if self.k > 1 else {}
    return LossScaleState(
        inner_state=inner_state,
        # Fresh buffers on every init: a step that donates its state must not
        # delete the arrays of the loss scale this optimizer was built with.
        loss_scale=jax.tree.map(jnp.array, self.loss_scale),
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        max_consecutive_skips=None if self.max_skips is None
        else jnp.asarray(self.max_skips, jnp.int32),
        scaling_check=ScalingCheck.initial() if self.check_scaling else None,
        **accumulating,
    )

  def update(self, updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise TypeError("loss_scaling's update expects the LossScaleState made "
                      f"by its init, got {type(state).__name__}. Pass the "
                      "state returned by opt.init.")
    self._check_fits(state)
    current = _scale_for_update(state.loss_scale,
                                extra_args.pop("loss_scale", None))
    # Unscale in f32 (or wider) and keep that precision for the inner update.
    grads = current.unscale(tree_lib.widen_floating(updates))
    # One reduction decides finiteness and feeds the scaling check.
    largest = _largest_magnitude(grads)
    if self.axis_name is not None:
      checks.bound_axis(self.axis_name, "loss_scaling")
      largest = lax.pmax(largest, self.axis_name)  # Replicas agree.
    window = self._window(grads, jnp.isfinite(largest), state)
    non_finite = window.step_ends & ~window.finite
    # Non-finite optimizer steps in a row (applied ones included).
    consecutive = jnp.where(
        non_finite, optax.safe_increment(state.consecutive_skips),
        jnp.where(window.step_ends, 0, state.consecutive_skips))
    applied_anyway = jnp.zeros([], bool)
    if self.on_max_skips == "apply" and state.max_consecutive_skips is not None:
      applied_anyway = non_finite & (consecutive
                                     >= state.max_consecutive_skips)
    out_updates, out_inner = self._inner_step(
        window.grads, window.step_ends & (window.finite | applied_anyway),
        state, params, extra_args)
    skipped = non_finite & ~applied_anyway
    new_scale = state.loss_scale
    if new_scale is not None:  # Shared scales are adjusted by their owner.
      new_scale = tree_lib.select_tree(
          jnp.asarray(window.step_ends), current.adjust(window.finite), current)
    if self.on_max_skips == "raise" and state.max_consecutive_skips is not None:
      scale_now = current if new_scale is None else new_scale
      _raise_if_gave_up(consecutive, state.max_consecutive_skips,
                        scale_now.loss_scale)
    scaling_check = state.scaling_check
    if scaling_check is not None:
      scale = jnp.asarray(current.loss_scale, jnp.float32)
      scaling_check = scaling_check.record(largest * scale, scale)
    return out_updates, state._replace(
        inner_state=out_inner,
        loss_scale=new_scale,
        skipped_steps=jnp.where(
            skipped, optax.safe_increment(state.skipped_steps),
            state.skipped_steps),
        consecutive_skips=consecutive,
        scaling_check=scaling_check,
        **window.fields,
    )

  def _check_fits(self, state: LossScaleState) -> None:
    """A state must have been made by a wrapper with the same accumulation
    (a checkpoint restored into another configuration, say)."""
    accumulates = state.micro_step is not None
    if accumulates != (self.k > 1):
      raise ValueError(_STATE_ACCUMULATES if accumulates
                       else _STATE_DOES_NOT_ACCUMULATE.format(k=self.k))

  def _window(self, grads: Any, finite: Any, state: LossScaleState) -> _Window:
    """Accumulation: where this micro-batch's unscaled gradients go."""
    if self.k == 1:
      return _Window(grads, jnp.ones([], bool), finite, {})
    structure = jax.tree.structure
    if structure(grads) != structure(state.accumulated):
      raise ValueError(_GRADS_NOT_LIKE_PARAMS.format(
          grads=structure(grads), params=structure(state.accumulated)))
    # ">=": a state restored from a run with more micro-batches per window
    # ends its window now, with the mean of all it holds, instead of never.
    step_ends = state.micro_step >= self.k - 1
    window_ok = state.window_finite & finite
    # A non-finite micro-batch is never added: no NaN enters the sum.
    acc = jax.tree.map(
        lambda a, g: a + jnp.where(finite, g, jnp.zeros_like(g))
        if tree_lib.is_float(a) else a,
        state.accumulated, grads,
    )
    # The mean over k micro-batches (over all it holds, after such a
    # restore). The count is a runtime value, so every XLA version divides
    # exactly (some turn a division by a constant into a multiplication).
    seen = jnp.maximum(state.micro_step + 1, self.k)
    mean = jax.tree.map(
        lambda a, g: a / seen.astype(a.dtype) if tree_lib.is_float(a)
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
    zeros = jax.tree.map(
        lambda u: jnp.zeros_like(u) if checks.is_array(u) else u, new_updates
    )
    return (tree_lib.select_tree(ok, new_updates, zeros),
            tree_lib.select_tree(ok, new_inner, state.inner_state))


def _scale_for_update(own: Any, shared: Any) -> Any:
  """The loss scale this update unscales with: the state's, or the shared one."""
  if (own is None) == (shared is None):
    raise TypeError(_NO_SHARED_SCALE if own is None else _OWN_AND_SHARED)
  if own is None:
    _check_loss_scale(shared, "loss_scaling's update(loss_scale=...)")
    return shared
  return _restored(own)


def _restored(loss_scale: Any) -> Any:
  """The state's loss scale, or a clear error if a checkpoint lost its class."""
  if isinstance(loss_scale, Mapping):
    raise TypeError(_RESTORED_AS_DICT.format(keys=sorted(loss_scale)))
  return loss_scale


# -- reading the scale -------------------------------------------------------------


def get_loss_scale(opt_state: Any) -> loss_scale_lib.AnyLossScale:
  """Returns the current loss scale from an optimizer state.

  The wrapper's state may sit anywhere inside ``opt_state`` (``optax.chain``,
  dicts, named tuples, an ``nnx.Optimizer``'s state); a loss scale passed in
  is returned as it is.

  Args:
    opt_state: the state of an optimizer built with :func:`loss_scaling`.

  Returns:
    The loss scale to use for this step's forward pass (``scale`` the loss
    with it; ``update`` unscales with the same one), its fields plain arrays.

  Raises:
    ValueError: if the state holds no loss scaling, more than one (pass the
      sub-state you mean), or a shared scale's wrapper (use the scale you
      pass to ``update``).
    TypeError: if a checkpoint restored the scale as a plain dict, or the
      state's layout shows an optax wrapper around ``loss_scaling`` (its
      state inside ``MultiSteps``', ``apply_if_finite``'s...) or a chain
      element before it: the error says which composition to write.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(8.0))
    >>> float(jmp_lite.get_loss_scale(opt.init({"w": jnp.zeros(2)})).loss_scale)
    8.0
  """
  return _loss_scale_of(opt_state, "get_loss_scale")


def _loss_scale_of(opt_state: Any, owner: str) -> loss_scale_lib.AnyLossScale:
  """:func:`get_loss_scale` for ``owner`` (named by the argument check)."""
  if isinstance(opt_state, (type, loss_scale_lib.LossScale)):
    _check_loss_scale(opt_state, owner)
    return opt_state
  _check_layout(opt_state)  # Before the count: a wrapper may hold several.
  found = tree_lib.find_one(
      opt_state, LossScaleState, "loss_scale", "get_loss_scale",
      "loss-scaling states", "jmp_lite.loss_scaling(inner, "
      "jmp_lite.DynamicLossScale(2.0**15))")
  if found is None:
    raise ValueError(_SHARES_A_SCALE)
  return _fields_as_arrays(_restored(found))


def _as_array(x: Any) -> Any:
  """``x``, or the one array inside a wrapper pytree such as an NNX variable.

  Frameworks may keep optimizer state in wrapper pytrees (``nnx.Optimizer``
  keeps it in NNX variables). No framework is imported or named here.
  """
  if checks.is_array(x):
    return x
  leaves = jax.tree.leaves(x)
  return leaves[0] if len(leaves) == 1 else x


def _fields_as_arrays(loss_scale: Any) -> Any:
  """The loss scale with each of its fields as a plain array."""
  fields, treedef = jax.tree.flatten(
      loss_scale, is_leaf=lambda x: x is not loss_scale
  )
  return jax.tree.unflatten(treedef, [_as_array(f) for f in fields])


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of the scaled loss, returning the unscaled loss.

  The gradients are those of ``loss_scale.scale(fun(...))`` -- still scaled,
  as the :func:`loss_scaling` optimizer expects (it unscales them).

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
  checks.function(fun, "scaled_value_and_grad", "a loss function")
  loss_scale = _loss_scale_of(loss_scale, "scaled_value_and_grad")

  def scaled_fun(*args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError("scaled_value_and_grad(has_aux=True) needs fun to "
                        f"return a pair (loss, aux), got {type(out).__name__}.")
      loss, aux = out
    else:
      loss, aux = out, None
    return loss_scale.scale(loss), (loss, aux)

  grad_fn = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

  def wrapped(*args, **kwargs):
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
