"""Mixed precision with jmp_lite: f32, bf16 and f16 on scikit-learn's digits.

This is jmp_lite's demo. It trains the same small Flax MLP (64 -> 256 -> 256 ->
10, relu) on scikit-learn's 8x8 handwritten digits four times, with the same
initial parameters, batches and hyperparameters, changing only the precision:

* f32: policy ``p=f32,c=f32,o=f32``, ``NoOpLossScale()``;
* bf16: policy ``p=f32,c=bf16,o=f32``, ``NoOpLossScale()``;
* f16 + dynamic loss scaling: policy ``p=f32,c=f16,o=f32``,
  ``DynamicLossScale(2**15, period=200)``;
* f16, no loss scaling: policy ``p=f32,c=f16,o=f32``, ``NoOpLossScale()``.

jmp_lite is the precision layer and nothing else:

* ``jmp_lite.with_policy(model.apply, policy)`` casts the float32 params and
  the inputs to the compute dtype and returns float32 logits, so the
  cross-entropy is computed in float32;
* the optimizer is ``jmp_lite.loss_scaling(optax.adam(lr), loss_scale)``: it
  unscales the gradients, skips steps whose gradients are not finite and
  adapts a dynamic scale;
* the train step reads this step's scale with ``jmp_lite.get_loss_scale`` and
  differentiates with ``jmp_lite.scaled_value_and_grad``, all under
  ``jax.jit``.

**The underflow setting.** Every run minimises the cross-entropy multiplied by
a small weight (``--loss-weight``, default 1e-5), as an auxiliary loss with a
small weight would be. Adam divides each update by the gradient's running
magnitude, so it is (up to its ``eps``) blind to that weight: float32 and
bfloat16 (which has float32's exponent range) train as usual. In float16 the
backward pass of the weighted loss produces values below half the smallest
float16 subnormal (2**-24, about 6e-8), which round to zero. Without loss
scaling the hidden layers' gradients start out entirely zero and the last
layer gets a coarse, biased signal (one subnormal step, and only from the
largest probability errors), so the model does not learn; with the default
flags its activations then grow until the logits overflow float16, and the
optimizer skips those non-finite steps.
Dynamic loss scaling multiplies the loss by 2**15 and more before the backward
pass and recovers float32's accuracy. ``--loss-weight 1`` turns the setting
off: then plain float16 trains too.

Run it with::

  pip install -e ".[examples]"
  python -m examples.digits_demo

**Diagnostics.** Before the first update of each run, a second jitted
function measures the gradients that run hands its optimizer with
``jmp_lite.diagnostics.tensor_stats`` (exactly-zero entries, float16
underflow and overflow, per layer). After the runs,
``jmp_lite.diagnostics.report`` prints the float32 run's first gradients and
activations (captured with linen's ``capture_intermediates``) against the
float16/bfloat16 ranges, with its advice (a static loss scale and a dtype),
and plots them. After each run, the activations of its final parameters are
measured the same way (in float32) to name the layers whose outputs exceed
float16's range.

It prints a comparison table, the diagnostics and a verdict, and writes
``digits_demo.png`` (loss curves and the loss-scale history),
``digits_demo_diagnostics.png`` (the gradient and activation histograms),
``digits_demo.md`` (the tables) and ``digits_demo.json`` (every figure) to
``--out`` (a scratch folder; ``--update-results`` writes
``examples/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from models import flax_models
import jmp_lite
from jmp_lite import diagnostics

WARMUP_STEPS = 10  # First steps (compilation) left out of the median step time.


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One of the four runs.

  Attributes:
    name: identifier, the run's key in the JSON output.
    label: human-readable name for the table and the plot.
    policy: a ``jmp_lite.get_policy`` spec.
    loss_scale: the initial loss scale given to ``jmp_lite.loss_scaling``.
  """

  name: str
  label: str
  policy: str
  loss_scale: Any


def make_run_specs(period: int) -> tuple[RunSpec, ...]:
  """Returns the four runs, float32 (the reference) first.

  Args:
    period: the dynamic loss scale's growth period, in steps.
  """
  mixed_f16 = "p=f32,c=f16,o=f32"
  return (
      RunSpec("f32", "f32", "p=f32,c=f32,o=f32", jmp_lite.NoOpLossScale()),
      RunSpec("bf16", "bf16", "p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale()),
      RunSpec("f16_scaled", "f16 + dynamic loss scaling", mixed_f16,
              jmp_lite.DynamicLossScale(2.0**15, period=period)),
      RunSpec("f16_unscaled", "f16, no loss scaling", mixed_f16,
              jmp_lite.NoOpLossScale()),
  )


def make_loss_fn(apply_fn, loss_weight: float):
  """``loss_fn(params, x, y) -> (weighted loss, cross-entropy)``."""

  def loss_fn(params, x, y):
    logits = apply_fn({"params": params}, x)  # float32 logits
    ce = common.cross_entropy(logits, y)
    return loss_weight * ce, ce

  return loss_fn


def make_train_step(apply_fn, optimizer, loss_weight: float):
  """Builds the jitted train step: the part of a training loop jmp_lite touches.

  Args:
    apply_fn: ``jmp_lite.with_policy(model.apply, policy)``.
    optimizer: ``jmp_lite.loss_scaling(optax.adam(lr), loss_scale)``.
    loss_weight: the weight of the cross-entropy in the training loss.

  Returns:
    ``train_step(params, opt_state, x, y) -> (params, opt_state, metrics)``;
    the metrics are the step's unweighted cross-entropy, the loss scale it
    used and whether its gradients were finite.
  """
  loss_fn = make_loss_fn(apply_fn, loss_weight)

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss_scale = jmp_lite.get_loss_scale(opt_state)  # this step's scale
    (_, ce), grads = jmp_lite.scaled_value_and_grad(
        loss_fn, loss_scale, has_aux=True
    )(params, x, y)
    # Unscale, check finiteness, skip or apply, adjust the scale.
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(
        ce=ce,
        loss_scale=jnp.asarray(loss_scale.loss_scale, jnp.float32),
        finite=opt_state.last_finite,
    )
    return params, opt_state, metrics

  return train_step


def make_grad_stats_fn(apply_fn, loss_weight: float):
  """Builds a jitted ``grad_stats(params, opt_state, x, y)``: the precision
  statistics of the gradients ``train_step`` would hand its optimizer.

  A second jitted function rather than a branch of the train step, so the
  step times stay those of the plain step. The gradients carry the run's loss
  scale, so they are measured at scale 1: the statistics describe the values
  the optimizer receives (for the float32 run, the true gradients).
  """
  loss_fn = make_loss_fn(apply_fn, loss_weight)

  @jax.jit
  def grad_stats(params, opt_state, x, y):
    loss_scale = jmp_lite.get_loss_scale(opt_state)
    _, grads = jmp_lite.scaled_value_and_grad(
        loss_fn, loss_scale, has_aux=True
    )(params, x, y)
    return diagnostics.tensor_stats(grads)

  return grad_stats


@jax.jit
def activation_stats(params, x):
  """The precision statistics of every layer's output, computed in float32.

  Linen's ``capture_intermediates`` records each module's output; the
  statistics say which of them would underflow or overflow in float16.
  """
  _, state = flax_models.DigitsMLP().apply({"params": params}, x, capture_intermediates=True,
                         mutable=["intermediates"])
  return diagnostics.tensor_stats(state["intermediates"])


def layer_outputs(stats) -> dict:
  """The statistics of :func:`activation_stats` per layer: ``Dense_0 output``
  ... (from the paths ``Dense_0/__call__/0``; the MLP's own output, the same
  as ``Dense_2``'s, is left out)."""
  layers = diagnostics.group_stats(stats, by=-2)
  return {f"{name} output": s for name, s in layers.items()
          if name != "__call__"}


def zero_fractions(stats) -> dict[str, float]:
  """The share of exactly-zero entries per gradient leaf and ``"all"``, from
  :func:`jmp_lite.diagnostics.tensor_stats`'s statistics."""
  per_leaf = diagnostics.group_stats(stats)
  fractions = {name: s.fraction("zeros") for name, s in per_leaf.items()}
  fractions["all"] = diagnostics.group_stats(stats, by=lambda _: "all")[
      "all"].fraction("zeros")
  return fractions


def train(spec: RunSpec, data, init_params, args) -> dict:
  """Trains the model under one precision policy and loss scale.

  Args:
    spec: which run.
    data: the output of :func:`load_data`.
    init_params: float32 initial parameters, shared by all runs.
    args: the parsed flags (``steps``, ``batch_size``, ``lr``, ``seed``,
      ``loss_weight``).

  Returns:
    ``(figures, first_grad_stats)``. The figures: test accuracy (%), final
    train loss (unweighted cross-entropy on the whole training set), median
    step time (ms), skipped steps, final loss scale, the fraction of
    exactly-zero gradient entries at the first step (per layer and overall),
    the share of each layer's output (final params, training set, float32)
    above float16's max, and per-step histories of the loss and of the loss
    scale, with the steps that were skipped. ``first_grad_stats``: the
    diagnostics statistics of the first step's gradients.
  """
  policy = jmp_lite.get_policy(spec.policy)
  apply_fn = jmp_lite.with_policy(flax_models.DigitsMLP().apply, policy)
  optimizer = jmp_lite.loss_scaling(optax.adam(args.lr), spec.loss_scale)
  train_step = make_train_step(apply_fn, optimizer, args.loss_weight)
  grad_stats = make_grad_stats_fn(apply_fn, args.loss_weight)
  dynamic = isinstance(spec.loss_scale, jmp_lite.DynamicLossScale)

  params = init_params
  opt_state = optimizer.init(params)
  log = common.StepLog()
  first_stats = None
  batches = common.batch_indices(len(data["x_train"]), args.batch_size,
                                 args.steps, args.seed)
  bar = tqdm(batches, total=args.steps, desc=f"{spec.label:>26}",
             disable=None,  # No bar when the output is not a terminal.
             dynamic_ncols=True)
  for step, idx in enumerate(bar):
    x, y = data["x_train"][idx], data["y_train"][idx]
    if first_stats is None:  # The gradients of the first step, measured.
      first_stats = jax.device_get(grad_stats(params, opt_state, x, y))
    start = time.perf_counter()
    params, opt_state, metrics = train_step(params, opt_state, x, y)
    metrics = jax.device_get(jax.block_until_ready(metrics))
    log.record(step, start, metrics, loss_key="ce")
    if step % 10 == 0 or step == args.steps - 1:
      postfix = dict(loss=f"{log.losses[-1]:.3f}")
      if dynamic:
        postfix.update(scale=common.format_scale(log.scales[-1]),
                       skipped=len(log.skipped_at))
      bar.set_postfix(postfix, refresh=False)
  bar.close()

  evaluate = common.make_eval_fn(apply_fn)
  test_acc, _ = evaluate(params, data["x_test"], data["y_test"])
  _, train_ce = evaluate(params, data["x_train"], data["y_train"])
  first_zeros = zero_fractions(first_stats)
  final_acts = layer_outputs(
      jax.device_get(activation_stats(params, data["x_train"])))
  figures = dict(
      label=spec.label,
      policy=str(policy),
      loss_scale_type=type(spec.loss_scale).__name__,
      test_accuracy=100.0 * float(test_acc),
      final_train_loss=float(train_ce),
      median_step_ms=log.median_step_ms(WARMUP_STEPS),
      skipped_steps=int(opt_state.skipped_steps),
      # loss_scaling's stall guard (max_consecutive_skips=100,
      # on_max_skips="apply") applied a non-finite step: params not finite.
      guard_applied=not bool(jmp_lite.all_finite(params)),
      final_loss_scale=float(jmp_lite.get_loss_scale(opt_state).loss_scale),
      zero_grad_fraction=first_zeros["all"],
      zero_grad_fraction_per_layer=first_zeros,
      f16_overflow_activations_per_layer={
          name: s.fraction("f16_overflow") for name, s in final_acts.items()},
      **log.histories(),
  )
  return figures, first_stats


def format_table(results: dict[str, dict]) -> str:
  """The comparison table, as GitHub markdown (also readable as plain text)."""
  lines = [
      "| run | policy | test acc. (%) | final train loss | median step (ms) "
      "| skipped steps | final loss scale | zero grads at step 1 (%) |",
      "|---|---|--:|--:|--:|--:|--:|--:|",
  ]
  for r in results.values():
    lines.append(
        f"| {r['label']} | `{r['policy']}` | {r['test_accuracy']:.1f} "
        f"| {r['final_train_loss']:.4f} | {r['median_step_ms']:.2f} "
        f"| {r['skipped_steps']} "
        f"| {common.format_scale(r['final_loss_scale'])} "
        f"| {100 * r['zero_grad_fraction']:.1f} |"
    )
  return "\n".join(lines)


def describe_zeros(results: dict[str, dict]) -> str:
  """One line comparing exactly-zero gradient entries, f16 unscaled vs f32."""
  ref = results["f32"]["zero_grad_fraction_per_layer"]
  f16 = results["f16_unscaled"]["zero_grad_fraction_per_layer"]
  layers = ", ".join(
      f"{name} {100 * ref[name]:.0f}% -> {100 * f16[name]:.0f}%"
      for name in ref if name != "all"
  )
  return (
      "Gradient entries exactly zero at step 1 (same params and batch): f32 "
      f"{100 * ref['all']:.1f}%, f16 without loss scaling "
      f"{100 * f16['all']:.1f}% (per leaf, f32 -> f16: {layers})."
  )


def verdict(results: dict[str, dict]) -> str:
  """The one-line conclusion, computed from the test accuracies."""
  acc = {name: r["test_accuracy"] for name, r in results.items()}

  def matches(name):
    return abs(acc[name] - acc["f32"]) <= common.ACCURACY_TOLERANCE

  text = (
      f"Verdict: f16 + dynamic loss scaling {acc['f16_scaled']:.1f}% and bf16 "
      f"{acc['bf16']:.1f}% vs f32 {acc['f32']:.1f}% test accuracy: "
  )
  off = [results[n]["label"] for n in ("f16_scaled", "bf16") if not matches(n)]
  if off:
    text += (f"{' and '.join(off)} NOT within "
             f"{common.ACCURACY_TOLERANCE:g} point "
             "of f32; ")
  else:
    text += f"both within {common.ACCURACY_TOLERANCE:g} point of f32; "
  plain = acc["f16_unscaled"]
  if matches("f16_unscaled"):
    text += (f"f16 without loss scaling also matches ({plain:.1f}%), so its "
             "gradients did not underflow at this loss weight.")
  else:
    zeros = 100 * results["f16_unscaled"]["zero_grad_fraction"]
    text += (f"f16 without loss scaling reaches only {plain:.1f}% "
             f"({acc['f32'] - plain:.1f} points below f32): its gradients "
             f"underflow ({zeros:.0f}% exactly zero at step 1).")
  return text


def describe_non_finite(results: dict[str, dict]) -> list[str]:
  """Notes on runs whose final train loss is not finite (an overflow), naming
  the layers whose float32 outputs exceed float16's max."""
  notes = []
  for r in results.values():
    if not math.isfinite(r["final_train_loss"]):
      dtype = np.dtype(jmp_lite.get_policy(r["policy"]).compute_dtype).name
      over = {name: share for name, share
              in r["f16_overflow_activations_per_layer"].items() if share > 0}
      where = (", ".join(f"{name} {100 * share:.1f}%"
                         for name, share in over.items())
               or "no layer output in float32")
      if r.get("guard_applied"):
        notes.append(
            f"{r['label']}: final train loss {r['final_train_loss']} (the "
            f"{dtype} forward pass overflowed): the optimizer skipped "
            f"{r['skipped_steps']} non-finite steps, until 100 in a row, "
            "when loss_scaling's stall guard (max_consecutive_skips=100, "
            "on_max_skips='apply') applied the next one: the params are NaN "
            "from there on.")
        continue
      notes.append(
          f"{r['label']}: final train loss {r['final_train_loss']} (the "
          f"{dtype} forward pass overflowed; with the final params, outputs "
          f"above 65504: {where}); the optimizer skipped "
          f"{r['skipped_steps']} non-finite steps."
      )
  return notes


def diagnose(first_stats, init_params, data, path: str, loss_weight: float):
  """The diagnostics report of the float32 run's first step: tables, advice
  and the histogram plot written to ``path``. Returns ``(text, advice)``."""
  acts = jax.device_get(activation_stats(init_params, data["x_train"]))
  out = io.StringIO()
  advice = diagnostics.report(
      first_stats["f32"], path,
      activation_stats=layer_outputs(acts),
      title=(f"Diagnostics: the f32 run's gradients at step 1 (loss weight "
             f"{loss_weight:g}) and its layers' outputs on the training set"),
      file=out)
  text = out.getvalue().strip()
  # The markdown names the figure by its file name (it sits next to it).
  text = text.replace(f"Wrote {path}", "")
  return text.strip(), advice


def plot(results: dict[str, dict], path: str, loss_weight: float) -> None:
  """Writes the figure: loss curves, and the f16 run's loss-scale history."""
  fig, (ax_loss, ax_scale) = common.loss_and_scale_axes(figsize=(12, 4.5))
  for r, style in zip(results.values(), common.LINE_STYLES):
    ax_loss.plot(common.moving_average(r["loss_history"], common.SMOOTHING),
                 label=r["label"],
                 **style)
  common.style_loss_axis(
      ax_loss, f"train cross-entropy ({common.SMOOTHING}-step moving average)",
      f"Training loss (loss weight {loss_weight:g})")
  common.plot_loss_scale_steps(ax_scale, results["f16_scaled"], "tab:green")
  common.save_figure(fig, path, dpi=110)


def advice_figures(advice) -> dict:
  """The diagnostics advice as JSON figures; the loss scales (powers of two)
  also as exponents, which the JSON's 6 significant digits keep exact."""
  figures = dataclasses.asdict(advice)
  for key in ("loss_scale", "f16_loss_scale"):
    if figures[key]:
      figures[f"{key}_log2"] = math.log2(figures[key])
  return figures


def write_outputs(results, args, report: list[str], advice) -> str:
  """Writes ``digits_demo.{png,md,json}`` to ``args.out`` (the diagnostics
  figure is already there); returns the stem."""
  stem = os.path.join(args.out, "digits_demo")
  plot(results, stem + ".png", args.loss_weight)
  report = report + ["![gradient and activation histograms]"
                     "(digits_demo_diagnostics.png)"]
  keys = ("steps", "batch_size", "lr", "seed", "loss_weight", "period")
  config = {k: getattr(args, k) for k in keys}
  common.write_markdown(stem + ".md", "digits demo: results", report,
                        common.command_line("digits_demo", config),
                        "digits_demo.png")
  common.write_json(stem + ".json", dict(
      config=config, jax_version=jax.__version__,
      backend=jax.default_backend(), summary=report,
      advice=advice_figures(advice), runs=results))
  return stem


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the command-line flags."""
  parser = argparse.ArgumentParser(
      description="Train on scikit-learn's digits in f32, bf16 and f16 (with "
      "and without loss scaling) and compare.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=2000,
                      help="training steps per run")
  parser.add_argument("--batch-size", type=int, default=128,
                      help="examples per step")
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and batch order")
  parser.add_argument(
      "--loss-weight", type=float, default=1e-5,
      help="weight of the cross-entropy in the training loss; small weights "
      "make f16 gradients underflow, 1 turns the underflow setting off")
  parser.add_argument("--period", type=int, default=200,
                      help="growth period of the dynamic loss scale, in steps")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  common.check_at_least_one(parser, args, ("steps", "batch_size", "period"))
  common.check_positive_finite(parser, args, ("lr", "loss_weight"))
  return args


def main(argv=None) -> int:
  """Runs the four trainings, prints the table and verdict, writes the files."""
  args = parse_args(argv)
  data = flax_models.load_flat_digits()
  init_params = flax_models.DigitsMLP().init(jax.random.key(args.seed), data["x_train"][:1])
  init_params = init_params["params"]
  setting = (
      f"Underflow setting: the training loss is the cross-entropy times "
      f"{args.loss_weight:g}, so unscaled f16 gradients fall below f16's "
      "smallest subnormal (6e-8) and flush to zero, while Adam, blind to the "
      "weight, lets f32 and bf16 train as usual."
  )
  print(f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test "
        f"examples; {args.steps} steps of batch {args.batch_size}, Adam lr "
        f"{args.lr:g}, seed {args.seed}, {jax.default_backend()} backend.")
  print(setting)

  results, first_stats = {}, {}
  for spec in make_run_specs(args.period):
    r, first_stats[spec.name] = train(spec, data, init_params, args)
    results[spec.name] = r
    print(f"{r['label']:>26}: test accuracy {r['test_accuracy']:5.1f}%, "
          f"final train loss {r['final_train_loss']:.4f}", flush=True)

  stem = os.path.join(args.out, "digits_demo")
  diagnostics_text, advice = diagnose(
      first_stats, init_params, data, stem + "_diagnostics.png",
      args.loss_weight)
  report = [setting, format_table(results), describe_zeros(results),
            *describe_non_finite(results), diagnostics_text, verdict(results)]
  print("\n" + "\n\n".join(report[1:]))
  stem = write_outputs(results, args, report, advice)
  print(f"\nWrote {stem}.png, {stem}_diagnostics.png, {stem}.md and "
        f"{stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
