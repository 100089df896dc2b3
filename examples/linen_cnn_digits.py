"""A Flax linen CNN with BatchNorm on digits, in f32, bf16 and f16.

Trains :class:`flax_models.DigitsCNN` (two convolutions with BatchNorm, two
dense layers) on scikit-learn's 8x8 digits three times, from the same initial
variables, on the same batches, with the same hyperparameters; only the
precision changes:

* f32: policy ``p=f32,c=f32,o=f32``, ``NoOpLossScale()``;
* bf16: policy ``p=f32,c=bf16,o=f32``, ``NoOpLossScale()``;
* f16 + dynamic loss scaling: policy ``p=f32,c=f16,o=f32``,
  ``DynamicLossScale(2**15, period=...)``.

The model is unmodified linen code. Going from the float32 training loop to a
mixed-precision one changes three lines, marked ``# [mixed precision]``:

1. ``jlinen.apply_policy(DigitsCNN(), policy)`` runs convolutions and dense
   layers in the compute dtype, keeps params, BatchNorm (statistics, scale,
   bias, running averages) and the logits in float32;
2. ``jmp_lite.loss_scaling(optax.adam(lr), loss_scale)`` unscales the
   gradients, skips non-finite steps and adapts the scale;
3. ``jmp_lite.scaled_value_and_grad(loss_fn, opt_state, has_aux=True)``
   differentiates the scaled loss.

A fourth marked line keeps the old running averages on a skipped step.

Run it with::

  python -m examples.linen_cnn_digits            # about 1 min on 2 CPU cores
  python -m examples.linen_cnn_digits --steps 20 --out /tmp/cnn   # smoke run

It prints the comparison table and writes ``linen_cnn_digits.md`` (the table),
``linen_cnn_digits.json`` (every figure and the per-step histories) and
``linen_cnn_digits.png`` (loss curves and the loss-scale history) to ``--out``
(a scratch folder; ``--update-results`` writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from examples import common
from models import flax_models
import jmp_lite
import jmp_lite.linen as jlinen

NAME = "linen_cnn_digits"
WARMUP_STEPS = 10  # First steps (compilation) left out of the median step time.
SMOOTHING = common.SMOOTHING  # Window of the moving average in the loss plot.


def make_train_step(model, optimizer):
  """The jitted ``step(params, batch_stats, opt_state, x, y)``.

  Args:
    model: the (policy-wrapped) linen model.
    optimizer: the optax optimizer (wrapped by ``jmp_lite.loss_scaling``).

  Returns:
    ``step -> (params, batch_stats, opt_state, metrics)`` where ``metrics``
    holds the loss, the loss scale this step used and whether it was applied.
  """

  def loss_fn(params, batch_stats, x, y):
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True,
        mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]

  @jax.jit
  def step(params, batch_stats, opt_state, x, y):
    scale = jmp_lite.get_loss_scale(opt_state)
    (loss, new_stats), grads = jmp_lite.scaled_value_and_grad(  # [mixed precision]
        loss_fn, opt_state, has_aux=True)(params, batch_stats, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    batch_stats = jmp_lite.select_tree(  # [mixed precision] skip -> keep stats
        opt_state.last_finite, new_stats, batch_stats)
    metrics = dict(loss=loss, finite=opt_state.last_finite,
                   loss_scale=jnp.asarray(scale.loss_scale, jnp.float32))
    return params, batch_stats, opt_state, metrics

  return step


def make_eval_fn(model):
  """A jitted ``evaluate(variables, x, y) -> (accuracy, mean cross-entropy)``."""

  @jax.jit
  def evaluate(variables, x, y):
    logits = model.apply(variables, x, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return jnp.mean(jnp.argmax(logits, -1) == y), loss

  return evaluate


def train(spec, data, args) -> dict:
  """Trains the CNN under one policy and loss scale; returns its figures."""
  _, label, policy, loss_scale = spec
  x_train, y_train, x_test, y_test = data
  model = jlinen.apply_policy(flax_models.DigitsCNN(), policy)  # [mixed precision]
  learning_rate = optax.cosine_decay_schedule(args.lr, args.steps)
  optimizer = jmp_lite.loss_scaling(optax.adam(learning_rate), loss_scale)  # [mixed precision]
  variables = model.init(jax.random.key(args.seed), x_train[:1], train=False)
  params, batch_stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)
  step = make_train_step(model, optimizer)

  log = common.StepLog()
  batches = common.batch_indices(len(x_train), args.batch_size, args.steps,
                                 args.seed)
  bar = tqdm(batches, total=args.steps, desc=f"{label:>26}", disable=None,
             dynamic_ncols=True)
  for i, idx in enumerate(bar):
    start = time.perf_counter()
    params, batch_stats, opt_state, metrics = step(
        params, batch_stats, opt_state, x_train[idx], y_train[idx])
    log.record(i, start, jax.device_get(metrics))
    if i % 20 == 0 or i == args.steps - 1:
      bar.set_postfix(loss=f"{log.losses[-1]:.3f}", scale=f"{log.scales[-1]:g}",
                      skipped=len(log.skipped_at), refresh=False)
  bar.close()

  evaluate = make_eval_fn(model)
  variables = {"params": params, "batch_stats": batch_stats}
  test_acc, test_loss = evaluate(variables, x_test, y_test)
  _, train_loss = evaluate(variables, x_train, y_train)
  return dict(
      label=label,
      policy=str(jmp_lite.get_policy(policy)),
      loss_scale_type=type(loss_scale).__name__,
      test_accuracy=100.0 * float(test_acc),
      test_loss=float(test_loss),
      final_train_loss=float(train_loss),
      median_step_ms=log.median_step_ms(WARMUP_STEPS),
      skipped_steps=int(opt_state.skipped_steps),
      final_loss_scale=float(jmp_lite.get_loss_scale(opt_state).loss_scale),
      **log.histories(),
  )


def format_table(runs: dict) -> str:
  """The comparison table as GitHub markdown."""
  lines = [
      "| run | policy | test acc. (%) | final train loss | median step (ms) "
      "| skipped steps | final loss scale |",
      "|---|---|--:|--:|--:|--:|--:|",
  ]
  for r in runs.values():
    lines.append(
        f"| {r['label']} | `{r['policy']}` | {r['test_accuracy']:.2f} "
        f"| {r['final_train_loss']:.4f} | {r['median_step_ms']:.2f} "
        f"| {r['skipped_steps']} | {r['final_loss_scale']:g} |")
  return "\n".join(lines)


def plot(runs: dict, path: str) -> None:
  """Loss curves of every run and the f16 run's loss scale, as a PNG."""
  common.plot_loss_and_scale(
      runs, path, SMOOTHING,
      loss_ylabel=f"train loss ({SMOOTHING}-step average)",
      loss_title="DigitsCNN (linen) training loss", log_loss=True)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=1500,
                      help="training steps per run (default: %(default)s)")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="peak learning rate (cosine decay to 0)")
  parser.add_argument("--period", type=int, default=500,
                      help="growth period of the dynamic loss scale")
  parser.add_argument("--seed", type=int, default=0,
                      help="initial variables and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  data = flax_models.load_digits_data()
  start = time.perf_counter()
  runs = {spec[0]: train(spec, data, args)
          for spec in common.flax_run_specs(args.period)}
  wall_s = time.perf_counter() - start
  table = format_table(runs)
  print(table)
  config = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                period=args.period, seed=args.seed, wall_s=round(wall_s, 1),
                jax=jax.__version__, backend=jax.default_backend())
  base = os.path.join(args.out, NAME)
  with open(base + ".json", "w") as f:
    json.dump(dict(config=config, runs=runs), f, indent=1)
  with open(base + ".md", "w") as f:
    f.write("# DigitsCNN (Flax linen) on scikit-learn digits: f32 vs bf16 "
            "vs f16\n\n"
            f"`python -m examples.{NAME}` — {args.steps} steps per run, batch "
            f"{args.batch_size}, Adam with lr {args.lr:g} and cosine decay, seed {args.seed}; "
            f"1437 train / 360 test images; {wall_s:.0f} s in all on "
            f"{jax.default_backend()} (jax {jax.__version__}).\n\n"
            f"{table}\n")
  plot(runs, base + ".png")
  print(f"Wrote {base}.{{md,json,png}} in {wall_s:.0f} s.")
  finite = all(math.isfinite(r["final_train_loss"]) for r in runs.values())
  return 0 if finite else 1


if __name__ == "__main__":
  sys.exit(main())
