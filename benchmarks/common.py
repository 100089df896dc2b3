"""The train steps, compilation and timing the studies and the suites share.

Every benchmark compares train steps that compute the same thing in different
ways. The steps share one state convention (a tuple, donated to ``jax.jit``):

* :func:`make_jmp_lite_step`, :func:`make_hand_step`, :func:`make_plain_step`:
  the step written with ``jmp_lite.loss_scaling``, the same step by hand jmp
  style, and a step with no loss scaling; :func:`make_variant` and
  :func:`build_step` build one of them, with its optimizer and initial state,
  by name (:data:`STEP_KINDS`);
* :func:`compile_step`: ahead-of-time compilation, timed, with the kernel
  count of the optimized HLO;
* :func:`time_interleaved`: short blocks of steps of every variant in turn, in
  one process, the order rotating each repeat, so that load from other
  processes affects all variants alike; :func:`summarize` and
  :func:`ratio_summary` give medians and interquartile ranges.

``benchmarks/runner.py`` puts these together into the check-then-time loop.
"""

from __future__ import annotations

import functools
import pathlib
import re
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from models import results

Params = Any
Batch = dict[str, jax.Array]
State = tuple[Any, ...]
Step = Callable[[State, Batch], tuple[State, jax.Array]]

#: The committed results, written only when a benchmark is given --update-results.
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
#: Where benchmarks write by default, so that running them leaves the clone
#: unchanged.
SCRATCH_DIR = results.scratch_dir("benchmarks")
OUTPUTS = results.Outputs(committed=RESULTS_DIR, scratch=SCRATCH_DIR)

#: Every benchmark trains with Adam at this learning rate ...
LEARNING_RATE = 1e-3
#: ... and, where it scales the loss dynamically, starts from this scale.
INITIAL_SCALE = 2.0**15
#: optax.apply_if_finite's tolerance of non-finite steps in a row.
MAX_CONSECUTIVE_ERRORS = 10


# --- train steps ---------------------------------------------------------------


def make_jmp_lite_step(loss_fn, opt: optax.GradientTransformation) -> Step:
  """The step written with the optimizer wrapper. State: (params, opt_state).

  ``opt`` is ``jmp_lite.loss_scaling(inner, loss_scale)``; the loss scale
  lives in its state.
  """

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state = state
    loss_scale = jmp_lite.get_loss_scale(opt_state)
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(
        params, batch
    )
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def make_hand_step(loss_fn, inner: optax.GradientTransformation) -> Step:
  """The same step by hand, jmp style. State: (params, opt_state, loss_scale)."""

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state, loss_scale = state

    def scaled_loss(p):
      loss = loss_fn(p, batch)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    finite = jmp_lite.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = inner.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp_lite.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return (params, opt_state, loss_scale), loss

  return step


def make_plain_step(loss_fn, opt: optax.GradientTransformation) -> Step:
  """A step with no loss scaling: ``value_and_grad`` and ``opt.update``.

  With ``opt = optax.apply_if_finite(adam, n)`` this is optax's own way of
  skipping non-finite steps. State: (params, opt_state).
  """

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


#: The steps :func:`build_step` builds, all with ``optax.adam(LEARNING_RATE)``.
STEP_KINDS = {
    "jmp_lite": "loss_scaling(adam, scale) + get_loss_scale + scaled_value_and_grad",
    "hand": "scale/grad/unscale + all_finite + adjust + select_tree(params, opt_state)",
    "plain": "value_and_grad + adam, no loss scaling",
    "apply_if_finite": f"value_and_grad + optax.apply_if_finite(adam, "
                       f"{MAX_CONSECUTIVE_ERRORS}), no loss scaling",
}


def make_variant(kind: str, loss_fn, scale: Any = None,
                 **options: Any) -> tuple[Step, Callable[[Params], State]]:
  """One train step of ``loss_fn`` by kind (:data:`STEP_KINDS`) and its init.

  Args:
    kind: ``"jmp_lite"``, ``"hand"``, ``"plain"`` or ``"apply_if_finite"``.
    loss_fn: ``(params, batch) -> float32 loss``.
    scale: the loss scale of ``"jmp_lite"`` and ``"hand"`` (default
      ``DynamicLossScale(INITIAL_SCALE)``).
    **options: further arguments of ``jmp_lite.loss_scaling`` (``"jmp_lite"``).

  Returns:
    ``(step, init)``: ``init(params)`` is the initial state, holding ``params``
    themselves and its own copy of the loss scale (the step donates its
    state: it must not delete the arrays of ``scale``).
  """
  adam = optax.adam(LEARNING_RATE)
  scale = jmp_lite.DynamicLossScale(INITIAL_SCALE) if scale is None else scale
  if kind == "jmp_lite":
    opt = jmp_lite.loss_scaling(adam, scale, **options)
    return make_jmp_lite_step(loss_fn, opt), lambda params: (
        params, _own_scale(opt.init(params)))
  if kind == "hand":
    return make_hand_step(loss_fn, adam), lambda params: (
        params, adam.init(params), fresh_copy(scale))
  if kind in ("plain", "apply_if_finite"):
    opt = adam if kind == "plain" else optax.apply_if_finite(adam, MAX_CONSECUTIVE_ERRORS)
    return make_plain_step(loss_fn, opt), lambda params: (params, opt.init(params))
  raise ValueError(f"unknown step {kind!r}; choose from {', '.join(STEP_KINDS)}")


def _own_scale(opt_state: jmp_lite.LossScaleState) -> jmp_lite.LossScaleState:
  return opt_state._replace(loss_scale=fresh_copy(opt_state.loss_scale))


def build_step(kind: str, loss_fn, params: Params, scale: Any = None,
               **options: Any) -> tuple[Step, State]:
  """:func:`make_variant` and its initial state, every buffer its own (so
  that several variants may start from the same ``params``)."""
  step, init = make_variant(kind, loss_fn, scale, **options)
  return step, fresh_copy(init(params))


def fresh_copy(tree: Any) -> Any:
  """Copies every array leaf into a new buffer.

  The steps donate their state, so no two states may share a buffer: several
  variants start from the same ``params``, and the states must not alias the
  arrays of the loss scale the optimizer was built with.
  """
  return jax.tree.map(
      lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree
  )


def param_count(params: Params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


# --- compilation ------------------------------------------------------------------

_SKIP_OPCODES = {"parameter", "constant", "tuple", "get-tuple-element"}
_OPCODE = re.compile(r"=\s.*?\b([a-z][a-z0-9-]*)\(")


def entry_opcodes(hlo_text: str) -> dict[str, int]:
  """Counts the instructions of the optimized HLO's ENTRY computation by opcode.

  Parameters, constants and tuple plumbing are left out, so the total is about
  the number of kernels (fusions, dots, convolutions...) run per step.
  """
  counts: dict[str, int] = {}
  in_entry = False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
      continue
    if in_entry and line.startswith("}"):
      break
    if in_entry:
      match = _OPCODE.search(line)
      if match and match.group(1) not in _SKIP_OPCODES:
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
  return dict(sorted(counts.items()))


def compile_step(
    step: Step, state: State, batch: Batch, repeats: int = 1
) -> tuple[Any, dict[str, Any]]:
  """AOT-compiles ``step`` (state donated) and times lowering and compilation.

  Each repeat wraps a new function calling ``step`` in a fresh ``jax.jit``, so
  tracing, lowering and XLA compilation all run again (jitted library functions
  called inside ``step`` keep their trace caches after the first repeat); the
  reported times are medians over repeats. ``state`` and ``batch`` may be
  arrays or ``jax.ShapeDtypeStruct`` trees.

  Returns:
    The compiled step of the last repeat and a dict of timings (seconds) and
    HLO statistics.
  """
  lower_s, compile_s = [], []
  for _ in range(repeats):
    # A new function object each time: jax.jit caches traces by function.
    fresh = functools.wraps(step)(lambda state, batch: step(state, batch))
    jitted = jax.jit(fresh, donate_argnums=0)
    start = time.perf_counter()
    lowered = jitted.lower(state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    lower_s.append(lowered_at - start)
    compile_s.append(compiled_at - lowered_at)
  ops = entry_opcodes(compiled.as_text())
  totals = [a + b for a, b in zip(lower_s, compile_s)]
  info = {
      "lower_s": float(np.median(lower_s)),
      "compile_s": float(np.median(compile_s)),
      "total_s": float(np.median(totals)),
      "total_s_values": [float(t) for t in totals],
      "stablehlo_ops": lowered.as_text().count(" = stablehlo."),
      "entry_kernels": sum(ops.values()),
      "entry_opcodes": ops,
  }
  return compiled, info


def shape_structs(tree: Any) -> Any:
  """``tree`` with every array replaced by its shape and dtype (for lowering)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
      if isinstance(x, jax.Array) else x, tree)


# --- timing -----------------------------------------------------------------------


def run_steps(fn: Step, state: State, batch: Batch, steps: int) -> tuple[State, list[jax.Array]]:
  losses = []
  for _ in range(steps):
    state, loss = fn(state, batch)
    losses.append(loss)
  return state, losses


def time_block(fn: Step, state: State, batch: Batch, steps: int) -> tuple[State, float, float]:
  """Runs ``steps`` steps and waits for them.

  Returns:
    The new state, the wall-clock seconds and the CPU seconds of this process
    (all its threads); the latter is less sensitive to other processes
    competing for the cores.
  """
  wall_start, cpu_start = time.perf_counter(), time.process_time()
  state, losses = run_steps(fn, state, batch, steps)
  jax.block_until_ready((state, losses))
  return state, time.perf_counter() - wall_start, time.process_time() - cpu_start


def time_interleaved(
    fns: dict[str, Step], states: dict[str, State], batch: Batch,
    steps: int, repeats: int, names: Sequence[str] | None = None,
) -> dict[str, dict[str, list[float]]]:
  """Per-step wall and CPU seconds per repeat, variants interleaved.

  Each repeat runs one block of ``steps`` steps of every variant; the order
  rotates by one each repeat (for two variants: alternates). ``states`` is
  updated in place with the final states.
  """
  names = list(fns if names is None else names)
  per_step = {clock: {name: [] for name in names} for clock in ("wall", "cpu")}
  for repeat in range(repeats):
    shift = repeat % len(names)
    for name in names[shift:] + names[:shift]:
      states[name], wall, cpu = time_block(fns[name], states[name], batch, steps)
      per_step["wall"][name].append(wall / steps)
      per_step["cpu"][name].append(cpu / steps)
  return per_step


def summarize(values: list[float]) -> dict[str, Any]:
  q25, median, q75 = np.percentile(values, [25, 50, 75])
  return {
      "median": float(median),
      "q25": float(q25),
      "q75": float(q75),
      "iqr": float(q75 - q25),
      "min": float(np.min(values)),
      "values": [float(v) for v in values],
  }


def ratio_summary(num: list[float], den: list[float]) -> dict[str, Any]:
  """Summary of the per-repeat ratios ``num[i] / den[i]``."""
  return summarize([a / b for a, b in zip(num, den)])
