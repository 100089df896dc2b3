"""Gradient accumulation under float16, with overflows the loss scale recovers.

The digits MLP (``models.flax_models.DigitsMLP``) (64 -> 256 -> 256 -> 10) on
scikit-learn's digits, trained with Adam on an effective batch of 128 examples
made of 4 micro-batches of 32:

* ``f32_big_batch``: float32, one batch of 128 per optimizer step (the
  reference);
* ``f32_accumulated``: float32, the same 128 examples as 4 micro-batches of 32,
  ``jmp_lite.loss_scaling(optax.adam(lr), NoOpLossScale(),
  accumulation_steps=4)``: it should train like the big batch;
* ``f16_accumulated``: ``jmp_lite.with_policy(model.apply, "mixed_float16")``
  (float32 params, float16 compute, float32 logits) and
  ``jmp_lite.loss_scaling(optax.adam(lr), DynamicLossScale(2**24, period=50),
  accumulation_steps=4)``, with two deliberate overflows:

  1. the initial scale, 2**24, is far too large: the first windows' float16
     gradients overflow, each such window is skipped once and the scale backs
     off once per window (not once per micro-batch) until the gradients fit;
  2. at one chosen window (``--overflow-window``), the inputs of its second
     micro-batch are multiplied by 10**4 (a corrupted batch): its float16
     forward pass overflows, the whole window is skipped (the three finite
     micro-batches are dropped with it, so no half-window step is taken), the
     scale backs off once and the run goes on.

A skipped window leaves Adam's state untouched and takes no step; nothing of
the bad micro-batch survives into the next window (it is never added to the
float32 accumulator). The float32 runs see the same batches without the
corrupted one.

Why not ``optax.MultiSteps``? ``MultiSteps(loss_scaling(...))`` accumulates
the scaled gradients itself and resets its accumulator by multiplying it with
0, so one inf micro-batch leaves NaN there for good and every later step is
skipped; ``loss_scaling(MultiSteps(...))`` would adjust the scale on every
micro-batch and let a bad micro-batch drop alone. jmp_lite refuses both
(``get_loss_scale`` of the first raises, ``init`` of the second raises) and
points to ``accumulation_steps``.

Run it with::

  pip install -e ".[examples]"
  python -m examples.accumulation

It prints the scale's trajectory and a table, and writes
``accumulation.{md,json,png}`` to ``--out`` (a scratch folder;
``--update-results`` writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import common
from models import flax_models
import jmp_lite

#: The corrupted micro-batch's inputs are multiplied by this: its float16
#: activations exceed 65504.
OVERFLOW_INPUT_FACTOR = 1e4
#: Which micro-batch of the overflow window is corrupted (0-based).
OVERFLOW_MICRO_BATCH = 1
#: Window of the moving average in the loss plot, in optimizer steps.
SMOOTHING = 10

RUNS = (
    # name, label, policy, micro-batches per step, loss scale, corrupted
    ("f32_big_batch", "f32, batch 128", "p=f32,c=f32,o=f32", 1,
     lambda args: jmp_lite.NoOpLossScale(), False),
    ("f32_accumulated", "f32, 4 x 32 accumulated", "p=f32,c=f32,o=f32", 4,
     lambda args: jmp_lite.NoOpLossScale(), False),
    ("f16_accumulated", "f16, 4 x 32 accumulated, dynamic scale",
     "mixed_float16", 4,
     lambda args: jmp_lite.DynamicLossScale(args.initial_scale,
                                            period=args.period), True),
)


def make_micro_step(apply_fn, optimizer):
  """The jitted step of one micro-batch (or of the whole batch when
  ``optimizer`` does not accumulate).

  Returns:
    ``step(params, opt_state, x, y) -> (params, opt_state, metrics)``: the
    micro-batch's cross-entropy and the loss scale it used. The updates are
    zeros except at the last micro-batch of a window whose micro-batches were
    all finite.
  """

  def loss_fn(params, x, y):
    return common.cross_entropy(apply_fn({"params": params}, x), y)

  @jax.jit
  def step(params, opt_state, x, y):
    loss_scale = jmp_lite.get_loss_scale(opt_state)  # fixed within a window
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(
        params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = dict(loss=loss, loss_scale=jnp.asarray(loss_scale.loss_scale,
                                                     jnp.float32))
    return optax.apply_updates(params, updates), opt_state, metrics

  return step


def train(name, label, spec, k, loss_scale, corrupted, data, init_params,
          args) -> dict:
  """Trains one run for ``args.steps`` optimizer steps; returns its figures."""
  apply_fn = jmp_lite.with_policy(flax_models.DigitsMLP().apply, spec)
  optimizer = jmp_lite.loss_scaling(optax.adam(args.lr), loss_scale,
                                    accumulation_steps=k)
  step = make_micro_step(apply_fn, optimizer)
  params, opt_state = init_params, optimizer.init(init_params)
  losses, scales, skipped_at, events = [], [], [], []
  first_step_params = None
  micro = args.micro_batch * 4 // k  # examples per update call
  start = time.perf_counter()
  batches = common.batch_indices(len(data["x_train"]), args.micro_batch * 4,
                                 args.steps, args.seed)
  for window, idx in enumerate(batches):
    window_losses = []
    for m in range(k):
      part = idx[m * micro:(m + 1) * micro]
      x, y = data["x_train"][part], data["y_train"][part]
      if (corrupted and window == args.overflow_window
          and m == OVERFLOW_MICRO_BATCH):
        x = x * np.float32(OVERFLOW_INPUT_FACTOR)
      params, opt_state, metrics = step(params, opt_state, x, y)
      window_losses.append(metrics["loss"])
    metrics, window_losses = jax.device_get((metrics, window_losses))
    state = opt_state  # The LossScaleState.
    finite_losses = [float(v) for v in window_losses if np.isfinite(v)]
    losses.append(float(np.mean(finite_losses)) if finite_losses
                  else float("nan"))
    scales.append(float(metrics["loss_scale"]))
    skipped = not bool(state.last_finite)
    next_scale = float(state.loss_scale.loss_scale)
    if skipped:
      skipped_at.append(window)
    if skipped or next_scale != scales[-1]:
      events.append(dict(window=window, scale=scales[-1], skipped=skipped,
                         next_scale=next_scale,
                         finite_micro_batches=len(finite_losses)))
    if first_step_params is None and not skipped:
      first_step_params = params
  seconds = time.perf_counter() - start

  evaluate = common.make_eval_fn(apply_fn)
  test_acc, test_ce = evaluate(params, data["x_test"], data["y_test"])
  _, train_ce = evaluate(params, data["x_train"], data["y_train"])
  state = opt_state  # The LossScaleState.
  adam = state.inner_state[0]
  return dict(
      label=label,
      policy=str(jmp_lite.get_policy(spec)),
      accumulation_steps=k,
      micro_batch=micro,
      loss_scale_type=type(loss_scale).__name__,
      test_accuracy=100.0 * float(test_acc),
      test_loss=float(test_ce),
      final_train_loss=float(train_ce),
      optimizer_steps_taken=int(adam.count),
      skipped_steps=int(state.skipped_steps),
      final_loss_scale=float(state.loss_scale.loss_scale),
      accumulated_dtypes=sorted({np.dtype(a.dtype).name for a in
                                 jax.tree_util.tree_leaves(
                                     state.accumulated)}),
      seconds=seconds,
      events=events,
      loss_history=losses,
      loss_scale_history=scales,
      # Exact in the JSON, which keeps 6 significant digits.
      loss_scale_log2_history=[math.log2(v) for v in scales],
      skipped_at=skipped_at,
      _params=params,
      _first_step_params=first_step_params,
  )


def max_relative_diff(a, b) -> float:
  """The largest ``|a - b| / max(|b|, 1e-3)`` over the leaves."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))
                          / np.maximum(np.abs(np.asarray(y)), 1e-3)))
             for x, y in zip(jax.tree_util.tree_leaves(a),
                             jax.tree_util.tree_leaves(b)))


def format_table(runs: dict) -> str:
  lines = [
      "| run | policy | micro-batches x size | loss scale | test acc. (%) "
      "| test loss | final train loss | optimizer steps taken "
      "| skipped windows | final loss scale |",
      "|---|---|---|---|--:|--:|--:|--:|--:|--:|",
  ]
  for r in runs.values():
    lines.append(
        f"| {r['label']} | `{r['policy']}` "
        f"| {r['accumulation_steps']} x {r['micro_batch']} "
        f"| {r['loss_scale_type']} | {r['test_accuracy']:.2f} "
        f"| {r['test_loss']:.4f} | {r['final_train_loss']:.4f} "
        f"| {r['optimizer_steps_taken']} | {r['skipped_steps']} "
        f"| {common.format_scale(r['final_loss_scale'])} |")
  return "\n".join(lines)


def format_events(run: dict, args) -> str:
  """The windows where the f16 run skipped or changed its scale."""
  lines = ["| window | loss scale used | micro-batches with a finite loss | step "
           "| next loss scale |", "|--:|--:|--:|---|--:|"]
  for e in run["events"]:
    cause = ""
    if e["skipped"] and e["window"] == args.overflow_window:
      cause = " (corrupted micro-batch)"
    elif e["skipped"]:
      cause = " (gradients overflowed)"
    lines.append(
        f"| {e['window']} | {common.format_scale(e['scale'])} "
        f"| {e['finite_micro_batches']} of 4 "
        f"| {'skipped' + cause if e['skipped'] else 'taken, scale grew'} "
        f"| {common.format_scale(e['next_scale'])} |")
  return "\n".join(lines)


def describe(runs: dict, args, first_step_diff: float) -> list[str]:
  """The conclusions, computed from the figures."""
  f16, big = runs["f16_accumulated"], runs["f32_big_batch"]
  acc = runs["f32_accumulated"]
  tol = common.ACCURACY_TOLERANCE
  initial = [e for e in f16["events"] if e["skipped"]
             and e["window"] != args.overflow_window]
  first_ok = next((w for w in range(args.steps)
                   if w not in f16["skipped_at"]), None)
  corrupted = [e for e in f16["events"]
               if e["skipped"] and e["window"] == args.overflow_window]
  later = [e for e in initial if first_ok is not None
           and e["window"] > first_ok]
  diff = f16["test_accuracy"] - big["test_accuracy"]
  verdict = "within" if abs(diff) <= tol else "NOT within"
  setup = (
      f"{args.steps} optimizer steps of Adam (learning rate {args.lr:g}) on "
      f"an effective batch of {4 * args.micro_batch} digits; the accumulated "
      f"runs use `loss_scaling(..., accumulation_steps=4)` with micro-batches "
      f"of {args.micro_batch}, the unscaled gradients summed in a "
      f"{', '.join(f16['accumulated_dtypes'])} accumulator.")
  story = (
      f"The f16 run starts at a loss scale of "
      f"{common.format_scale(args.initial_scale)}: windows "
      f"{', '.join(str(e['window']) for e in initial if e not in later)} "
      f"overflowed and were skipped, the scale backing off once per window "
      f"(not once per micro-batch) to "
      f"{common.format_scale(f16['loss_scale_history'][first_ok])}, where "
      f"window {first_ok} took the first optimizer step.")
  if corrupted:
    e = corrupted[0]
    story += (
        f" At window {e['window']} the inputs of micro-batch "
        f"{OVERFLOW_MICRO_BATCH} were multiplied by "
        f"{OVERFLOW_INPUT_FACTOR:g}: its float16 forward pass overflowed, "
        f"so the whole window was skipped (the other "
        f"{e['finite_micro_batches']} micro-batches were dropped with it), "
        f"the scale backed off once "
        f"({common.format_scale(e['scale'])} -> "
        f"{common.format_scale(e['next_scale'])}) and the next window "
        "trained as usual: nothing of the bad micro-batch reached the "
        "accumulator.")
  if later:
    story += (
        f" The scale grew every {args.period} optimizer steps and backed off "
        f"when the gradients overflowed again at windows "
        f"{', '.join(str(e['window']) for e in later)}.")
  story += (
      f" In all, {f16['skipped_steps']} of {args.steps} windows were "
      f"skipped and Adam took {f16['optimizer_steps_taken']} steps.")
  result = (
      f"Test accuracy: f16 accumulated {f16['test_accuracy']:.2f}% vs f32 "
      f"with the same effective batch {big['test_accuracy']:.2f}% "
      f"({diff:+.2f} points, {verdict} the tolerance of {tol:g} point). "
      f"Accumulating in float32 trains like the big batch: after the first "
      f"optimizer step the params of the two f32 runs differ by at most "
      f"{first_step_diff:.1e} (relative; float32 rounding of the two ways of "
      f"taking the mean), and their final test accuracies are "
      f"{acc['test_accuracy']:.2f}% and {big['test_accuracy']:.2f}%.")
  why = (
      "`optax.MultiSteps` is not used: `MultiSteps(loss_scaling(...))` resets "
      "its accumulator by multiplying it with 0, so one inf micro-batch "
      "leaves NaN in it for good and every later step is skipped, and "
      "`loss_scaling(MultiSteps(...))` would change the scale on every "
      "micro-batch. jmp_lite refuses both with an error pointing to "
      "`accumulation_steps`.")
  return [setup, story, result, why]


def plot(runs: dict, path: str, args) -> None:
  """Loss per optimizer step (left) and the f16 run's loss scale (right)."""
  fig, (ax_loss, ax_scale) = common.loss_and_scale_axes(figsize=(12, 4.5))
  for r, style in zip(runs.values(), common.LINE_STYLES):
    ax_loss.plot(common.moving_average(r["loss_history"], SMOOTHING),
                 label=r["label"], **style)
  common.style_loss_axis(
      ax_loss, f"train cross-entropy ({SMOOTHING}-step moving average)",
      "Training loss (mean of each window's micro-batches)")
  ax_loss.set_xlabel("optimizer step")
  f16 = dict(runs["f16_accumulated"])
  f16["label"] = "f16 accumulated"
  common.plot_loss_scale_steps(ax_scale, f16, "tab:green")
  if 0 <= args.overflow_window < args.steps:
    ax_scale.axvline(args.overflow_window, color="tab:red", alpha=0.3,
                     linestyle="--", label="corrupted micro-batch")
    ax_scale.legend()
  ax_scale.set_xlabel("optimizer step (window of 4 micro-batches)")
  common.save_figure(fig, path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description="Gradient accumulation in float16 with loss scaling, "
      "with deliberate overflows, against float32 with the same effective "
      "batch.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300,
                      help="optimizer steps (windows of 4 micro-batches)")
  parser.add_argument("--micro-batch", type=int, default=32,
                      help="examples per micro-batch (4 per optimizer step)")
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="Adam learning rate")
  parser.add_argument("--initial-scale", type=float, default=2.0**24,
                      help="initial loss scale of the f16 run (large enough "
                      "to overflow the first windows)")
  parser.add_argument("--period", type=int, default=50,
                      help="growth period of the dynamic loss scale, in "
                      "optimizer steps")
  parser.add_argument("--overflow-window", type=int, default=None,
                      help="the window whose second micro-batch is corrupted "
                      "(default: the middle one; -1: none)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  common.check_at_least_one(parser, args, ("steps", "micro_batch", "period"))
  common.check_positive_finite(parser, args, ("lr", "initial_scale"))
  if args.overflow_window is None:
    args.overflow_window = args.steps // 2
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  data = flax_models.load_flat_digits()
  init_params = flax_models.DigitsMLP().init(jax.random.key(args.seed),
                                       data["x_train"][:1])["params"]
  print(f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test "
        f"examples; {args.steps} optimizer steps of 4 x {args.micro_batch}, "
        f"Adam lr {args.lr:g}, seed {args.seed}, {jax.default_backend()} "
        "backend.")
  runs = {}
  for name, label, spec, k, make_scale, corrupted in RUNS:
    runs[name] = train(name, label, spec, k, make_scale(args), corrupted,
                       data, init_params, args)
    r = runs[name]
    print(f"{label:>40}: test accuracy {r['test_accuracy']:.2f}%, final "
          f"train loss {r['final_train_loss']:.4f}, skipped windows "
          f"{r['skipped_steps']} ({r['seconds']:.1f} s)", flush=True)
  first_step_diff = max_relative_diff(
      runs["f32_accumulated"].pop("_first_step_params"),
      runs["f32_big_batch"].pop("_first_step_params"))
  runs["f16_accumulated"].pop("_first_step_params")
  final_diff = max_relative_diff(runs["f32_accumulated"]["_params"],
                                 runs["f32_big_batch"]["_params"])
  for r in runs.values():
    r.pop("_params")

  report = describe(runs, args, first_step_diff)
  tables = [format_table(runs),
            "The f16 run's windows that were skipped or changed the scale:\n\n"
            + format_events(runs["f16_accumulated"], args)]
  report = report[:2] + tables + report[2:]
  print("\n" + "\n\n".join(report))

  stem = os.path.join(args.out, "accumulation")
  plot(runs, stem + ".png", args)
  keys = ("steps", "micro_batch", "lr", "initial_scale", "period",
          "overflow_window", "seed")
  config = {k: getattr(args, k) for k in keys}
  command = common.command_line("accumulation", config)
  common.write_markdown(stem + ".md", "Gradient accumulation under float16: "
                        "results", report, command, "accumulation.png")
  f16, big = runs["f16_accumulated"], runs["f32_big_batch"]
  common.write_json(stem + ".json", dict(
      config=config, jax_version=jax.__version__,
      backend=jax.default_backend(), summary=report,
      checks=dict(
          accuracy_tolerance=common.ACCURACY_TOLERANCE,
          f16_vs_f32_accuracy_points=f16["test_accuracy"]
          - big["test_accuracy"],
          f16_matches_f32=abs(f16["test_accuracy"] - big["test_accuracy"])
          <= common.ACCURACY_TOLERANCE,
          f32_accumulated_vs_big_batch_first_step_rel_diff=first_step_diff,
          f32_accumulated_vs_big_batch_final_rel_diff=final_diff),
      runs=runs))
  print(f"\nWrote {stem}.png, {stem}.md and {stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
