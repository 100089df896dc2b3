"""Flax's ``fp8_ops`` next to jmp_lite's delayed scaling, in two training loops.

One MLP on scikit-learn's digits (64 -> 256 -> 256 -> 10, relu) whose two
hidden layers run in float8 with delayed (per-tensor, amax-history) scaling,
trained from the same initial params on the same batches with the same Adam:

* **Flax, TrainState**: ``nn.Dense(..., dot_general_cls=nn.Fp8DirectDotGeneralOp)``
  trained with ``flax.training.train_state.TrainState.apply_gradients``. Flax
  keeps each layer's scales and amax histories in the
  ``_overwrite_with_gradient`` collection; its float8 ops return their *new*
  values as the "gradient" of those variables, and ``apply_gradients``
  overwrites them with it instead of stepping them. This is the loop Flax's
  float8 needs.
* **Flax, plain optax loop**: the same model and gradients, but
  ``optax.adam`` updates every variable it is given, as any loop without
  ``TrainState`` does (``optax.apply_updates(variables, adam(grads))``). Adam
  then *steps* the scales and histories with their new values as gradients,
  silently.
* **Flax, plain loop on params only**: the usual linen loop (differentiate
  and step ``variables["params"]``, pass the other collections through): the
  fp8 collection never changes, so the scales stay at their initial 1.0.
* **jmp_lite, plain optax loop**: the unmodified MLP under
  ``jmp_lite.linen.apply_policy(mlp, "p=f32,c=f32,o=f32,m=fp8_delayed")``. The
  amax histories live in the ``fp8_state`` collection, which
  ``apply(..., mutable=["fp8_state"])`` rolls like BatchNorm's statistics; the
  optimizer sees the params only. The loop of the second run (every variable
  differentiated and stepped) is refused with jmp_lite's state: its
  histories are integers (bit patterns of float32 amaxes), so ``jax.grad``
  over them raises instead of letting Adam (or adamw's weight decay) step
  them; the script checks that it does.

Every run computes in float32 with float8 (e4m3) operands in the two hidden
layers; the head stays in float32 (jmp_lite's default; Flax's head has no
float8 op either). An f32 run without float8 is the yardstick. Flax keeps
1024-step histories (not settable from ``Dense``) and scales the output
gradient from a history too; jmp_lite keeps 16-step histories of the forward
operands and scales the gradient from its own amax.

Run it with::

  python -m examples.fp8_flax_ops           # about 40 s on 2 CPU cores
  python -m examples.fp8_flax_ops --quick --out /tmp/fp8   # the smoke run

It writes ``fp8_flax_ops.md`` (the state and the losses), ``fp8_flax_ops.json``
and ``fp8_flax_ops.png`` (loss curves, first layer's input scale) to
``--out`` (a scratch folder; ``--update-results`` writes
``examples/results/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from examples import common
from models import flax_models
import jmp_lite.linen as jlinen

NAME = "fp8_flax_ops"
OWG = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
JMP_POLICY = "p=f32,c=f32,o=f32,m=fp8_delayed"
SMOOTHING = common.SMOOTHING
TAIL = 50  # final train loss: the mean of the last TAIL steps


class MLP(nn.Module):
  """64 -> 256 -> 256 -> 10 with relu; the hidden layers' ``dot_general``
  comes from ``dot_general_cls`` when given (Flax's float8 ops)."""

  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x):
    extra = ({} if self.dot_general_cls is None else
             dict(dot_general_cls=self.dot_general_cls))
    x = nn.relu(nn.Dense(256, name="hidden_0", **extra)(x))
    x = nn.relu(nn.Dense(256, name="hidden_1", **extra)(x))
    return nn.Dense(10, name="head")(x)


#: (name, label): every run, in the order of the tables.
RUNS = (
    ("f32", "f32, no float8 (yardstick)"),
    ("flax_trainstate", "Flax fp8_ops + TrainState.apply_gradients"),
    ("flax_plain_all", "Flax fp8_ops + optax.adam on all variables"),
    ("flax_plain_params", "Flax fp8_ops + optax.adam on params only"),
    ("jmp_plain", "jmp_lite m=fp8_delayed + optax.adam on params"),
)


def make_run(name: str, lr: float, init_params):
  """``(variables, step, evaluate, opt_state)`` of one run.

  ``step(variables, opt_state, x, y) -> (variables, opt_state, loss)``, jitted.
  """
  optimizer = optax.adam(lr)
  if name.startswith("flax"):
    model = MLP(dot_general_cls=nn.Fp8DirectDotGeneralOp)
  elif name.startswith("jmp"):
    model = jlinen.apply_policy(MLP(), JMP_POLICY)  # [float8]
  else:
    model = MLP()
  x0 = jnp.zeros((1, 64), jnp.float32)
  variables = dict(model.init(jax.random.key(0), x0))
  # Every run starts from the same params (fresh float8 state: scales 1,
  # zero histories). jmp_lite's policy model nests the params the same way.
  variables["params"] = jax.tree.map(
      lambda like, p: p.astype(like.dtype), variables["params"], init_params)

  def loss_of(params, rest, x, y, mutable):
    out = model.apply({**rest, "params": params}, x, mutable=mutable)
    logits, updates = out if mutable else (out, {})
    return common.cross_entropy(logits, y), updates

  if name == "flax_trainstate":
    # Flax's documented loop: the fp8 collection is differentiated (its
    # "gradient" is its new value) and apply_gradients overwrites it.
    state = train_state.TrainState.create(apply_fn=model.apply,
                                          params=variables, tx=optimizer)

    @jax.jit
    def step(state, _, x, y):
      def loss(all_vars):
        return loss_of(all_vars["params"], all_vars, x, y, False)[0]
      value, grads = jax.value_and_grad(loss)(state.params)
      return state.apply_gradients(grads=grads), None, value

    return state, step, lambda s: s.params, None, model

  if name in ("flax_plain_all", "jmp_plain_all"):
    # Any loop without TrainState: Adam on every variable's gradient.
    mutable = ["fp8_state"] if name.startswith("jmp") else False
    opt_state = optimizer.init(variables)

    @jax.jit
    def step(variables, opt_state, x, y):
      def loss(all_vars):
        return loss_of(all_vars["params"], all_vars, x, y, mutable)
      (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(
          variables)
      deltas, opt_state = optimizer.update(grads, opt_state)
      variables = optax.apply_updates(variables, deltas)
      return {**variables, **updates}, opt_state, value

    return variables, step, lambda v: v, opt_state, model

  # The usual linen loop: Adam on the params; jmp_lite's state rolls through
  # mutable=["fp8_state"], Flax's fp8 collection is passed through unchanged.
  mutable = ["fp8_state"] if name.startswith("jmp") else False
  opt_state = optimizer.init(variables["params"])

  @jax.jit
  def step(variables, opt_state, x, y):
    (value, updates), grads = jax.value_and_grad(loss_of, has_aux=True)(
        variables["params"], variables, x, y, mutable)
    deltas, opt_state = optimizer.update(grads, opt_state)
    params = optax.apply_updates(variables["params"], deltas)
    return {**variables, **updates, "params": params}, opt_state, value

  return variables, step, lambda v: v, opt_state, model


def fp8_state(name: str, variables) -> dict:
  """The first hidden layer's float8 state, as plain numbers.

  Flax: its stored scales (dequantization scales, ``x ≈ q * scale``) and its
  amax histories. jmp_lite: its amax histories and the scale each implies
  (``max(history) / 448`` rounded up to a power of two: the delayed recipe's
  dequantization scale, ``docs/fp8.md``).
  """
  def summary(history):
    history = np.asarray(history, np.float64)
    return dict(min=float(history.min()), max=float(history.max()),
                latest=float(history[0]))  # both keep the newest first

  if name.startswith("flax"):
    layer = variables[OWG]["hidden_0"]["Fp8DirectDotGeneralOp_0"]
    return dict(
        input_scale=float(layer["input_scale"][0]),
        kernel_scale=float(layer["kernel_scale"][0]),
        output_grad_scale=float(layer["output_grad_scale"][0]),
        input_amax_history=summary(layer["input_amax_history"]),
        kernel_amax_history=summary(layer["kernel_amax_history"]),
        output_grad_amax_history=summary(layer["output_grad_amax_history"]))
  if name.startswith("jmp"):
    # The layer's histories: uint32 bit patterns of float32 amaxes.
    site = jax.tree.map(
        lambda h: jax.lax.bitcast_convert_type(h, jnp.float32),
        variables["fp8_state"]["hidden_0"])

    def implied_scale(history):
      amax = float(np.max(history))
      return 2.0 ** np.ceil(np.log2(amax / E4M3_MAX)) if amax > 0 else 1.0

    return dict(
        input_scale=float(implied_scale(site["lhs"])),
        kernel_scale=float(implied_scale(site["rhs"])),
        output_grad_scale=None,  # current-scaled from the gradient's amax
        input_amax_history=summary(site["lhs"]),
        kernel_amax_history=summary(site["rhs"]),
        output_grad_amax_history=None)
  return {}


def train(name: str, data, init_params, args) -> dict:
  x_train, y_train, x_test, y_test = data
  state, step, variables_of, opt_state, model = make_run(
      name, args.lr, init_params)
  losses = []
  for idx in common.batch_indices(len(x_train), args.batch_size, args.steps,
                                  args.seed):
    state, opt_state, loss = step(state, opt_state, x_train[idx],
                                  y_train[idx])
    losses.append(float(loss))
  variables = variables_of(state)
  logits = jax.jit(model.apply)(variables, x_test)
  return dict(
      test_accuracy=100.0 * float(jnp.mean(jnp.argmax(logits, -1) == y_test)),
      test_loss=float(common.cross_entropy(logits, y_test)),
      final_train_loss=float(np.mean(losses[-TAIL:])),
      mean_train_loss=float(np.mean(losses)),
      fp8_state=fp8_state(name, variables),
      all_fp8_state_finite=bool(all(
          np.all(np.isfinite(np.asarray(x))) for k, v in variables.items()
          if k in (OWG, "fp8_state") for x in jax.tree.leaves(v))),
      loss_history=losses)


def all_variables_loop_refused(data, init_params, args) -> bool:
  """Whether the second run's loop (Adam on every variable) raises with
  jmp_lite's state, as it should: ``jax.grad`` refuses integer inputs."""
  variables, step, _, opt_state, _ = make_run("jmp_plain_all", args.lr,
                                              init_params)
  x, y = data[0][:args.batch_size], data[1][:args.batch_size]
  try:
    jax.eval_shape(step, variables, opt_state, x, y)
  except TypeError as e:
    return "integer" in str(e) or "real" in str(e)
  return False


def ratio(value, reference):
  if value is None or reference is None or reference == 0:
    return ""
  return f" ({value / reference:.3g}x)"


def format_tables(runs: dict) -> list[str]:
  labels = dict(RUNS)
  ref_loss = runs["flax_trainstate"]["final_train_loss"]
  ref_mean = runs["flax_trainstate"]["mean_train_loss"]
  losses = ["| run | test acc. (%) | test loss | final train loss "
            "| vs Flax + TrainState | mean train loss, all steps "
            "| vs Flax + TrainState |", "|---|--:|--:|--:|--:|--:|--:|"]
  for name, r in runs.items():
    losses.append(f"| {labels[name]} | {r['test_accuracy']:.2f} "
                  f"| {r['test_loss']:.4f} | {r['final_train_loss']:.4f} "
                  f"| {r['final_train_loss'] / ref_loss:.2f}x "
                  f"| {r['mean_train_loss']:.4f} "
                  f"| {r['mean_train_loss'] / ref_mean:.2f}x |")
  ref = runs["flax_trainstate"]["fp8_state"]
  state = ["| run | input scale | kernel scale | output-grad scale "
           "| input amax history: min / max / latest | kernel amax history: "
           "min / max / latest | all state finite |",
           "|---|--:|--:|--:|--:|--:|:-:|"]
  for name, r in runs.items():
    s = r["fp8_state"]
    if not s:
      continue

    def scale(key):
      value = s[key]
      if value is None:
        return "from its own amax"
      return f"{value:.3g}" + ("" if name == "flax_trainstate"
                               else ratio(value, ref[key]))

    def hist(key):
      h = s[key]
      return f"{h['min']:.3g} / {h['max']:.3g} / {h['latest']:.3g}"

    state.append(f"| {labels[name]} | {scale('input_scale')} "
                 f"| {scale('kernel_scale')} | {scale('output_grad_scale')} "
                 f"| {hist('input_amax_history')} "
                 f"| {hist('kernel_amax_history')} "
                 f"| {'yes' if r['all_fp8_state_finite'] else 'NO'} |")
  return ["## Losses", "\n".join(losses),
          "## The first hidden layer's float8 state after training",
          "\n".join(state)]


def plot(runs: dict, path: str) -> None:
  labels = dict(RUNS)
  fig, ax = plt.subplots(1, 1, figsize=(7.5, 4.2))
  styles = [dict(color="black", linewidth=3, alpha=0.35),
            dict(color="tab:blue", linewidth=2.5, alpha=0.6),
            dict(color="tab:red"),
            dict(color="tab:gray", linestyle="-."),
            dict(color="tab:green", linestyle="--"),
            dict(color="tab:olive", linestyle=":", linewidth=2)]
  for (name, r), style in zip(runs.items(), styles):
    ax.plot(common.moving_average(r["loss_history"], SMOOTHING),
            label=labels[name], **style)
  ax.set(xlabel="step", ylabel=f"train loss ({SMOOTHING}-step average)",
         yscale="log", title="MLP on digits, float8 delayed scaling")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  common.save_figure(fig, path, dpi=100)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=1000,
                      help="training steps per run (default: %(default)s)")
  parser.add_argument("--quick", action="store_true",
                      help="20 steps (a smoke run for the tests)")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="Adam's learning rate (constant)")
  parser.add_argument("--seed", type=int, default=0,
                      help="initial params and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    if args.update_results:
      parser.error("--quick runs never replace the committed results")
    args.steps = 20
  common.check_at_least_one(parser, args, ("steps", "batch_size"))
  common.check_positive_finite(parser, args, ("lr",))
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  start = time.perf_counter()
  data = flax_models.load_digits_data()
  data = tuple(a.reshape(len(a), -1) if a.ndim > 1 else a for a in data)
  init_params = MLP().init(jax.random.key(args.seed),
                           jnp.zeros((1, 64), jnp.float32))["params"]
  runs = {name: train(name, data, init_params, args) for name, _ in RUNS}
  refused = all_variables_loop_refused(data, init_params, args)
  wall_s = time.perf_counter() - start
  ts, plain = runs["flax_trainstate"], runs["flax_plain_all"]
  flax_plain_ok = plain["all_fp8_state_finite"] and (
      plain["fp8_state"]["input_amax_history"]["min"] >= 0)
  jmp_ok = runs["jmp_plain"]["all_fp8_state_finite"] and (
      runs["jmp_plain"]["fp8_state"]["input_amax_history"]["min"] >= 0)
  findings = dict(
      flax_plain_loop_state_corrupted=not flax_plain_ok,
      flax_plain_loss_vs_trainstate=plain["final_train_loss"]
      / ts["final_train_loss"],
      flax_plain_mean_loss_vs_trainstate=plain["mean_train_loss"]
      / ts["mean_train_loss"],
      jmp_state_intact=jmp_ok,
      jmp_all_variables_loop_refused=refused,
      jmp_loss_vs_flax_trainstate=runs["jmp_plain"]["final_train_loss"]
      / ts["final_train_loss"])
  config = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                seed=args.seed, quick=args.quick, jmp_lite_policy=JMP_POLICY,
                wall_s=round(wall_s, 1), jax=jax.__version__,
                backend=jax.default_backend())
  base = args.out / NAME
  common.write_json(base.with_suffix(".json"),
                    dict(config=config, findings=findings, runs=runs))
  flag = " --quick" if args.quick else ""
  report = [
      f"`python -m examples.{NAME}{flag}`: {args.steps} steps of "
      f"{args.batch_size} digits per run, Adam (lr {args.lr:g}, constant), "
      f"seed {args.seed}; every run starts from the same params and sees the "
      f"same batches. {wall_s:.0f} s in all on {jax.default_backend()} "
      f"(jax {jax.__version__}). The two hidden layers run in float8 with "
      "delayed scaling in every run but f32; scales are dequantization scales "
      "(`x ≈ q * scale`), the ratios compare with Flax + TrainState.",
      "**Findings.** "
      + ("Adam on Flax's `_overwrite_with_gradient` collection corrupted it "
         f"(input amax history down to "
         f"{plain['fp8_state']['input_amax_history']['min']:.3g}; input scale "
         f"{plain['fp8_state']['input_scale']:.3g} against "
         f"{ts['fp8_state']['input_scale']:.3g}), with no error; the loss "
         "averaged "
         f"{findings['flax_plain_mean_loss_vs_trainstate']:.2f}x the "
         "TrainState run's over the run and ended "
         f"{findings['flax_plain_loss_vs_trainstate']:.2f}x it (test loss "
         f"{plain['test_loss'] / ts['test_loss']:.2f}x). " if not flax_plain_ok else
         "Adam on Flax's collection left it non-negative in this run "
         f"(train loss {findings['flax_plain_loss_vs_trainstate']:.2f}x the "
         "TrainState run's). ")
      + ("jmp_lite's amax histories stayed the amaxes the layers saw, in the "
         "plain loop" if jmp_ok else "jmp_lite's state did NOT survive")
      + (", and the all-variables loop is refused with them (jax.grad raises "
         "on the integer histories: no optimizer can step them)." if refused
         else "; the all-variables loop was NOT refused.")
      + " The params-only Flax loop never updates its scales (they stay 1.0: "
      "any value above 448 saturates).",
  ] + format_tables(runs)
  with open(base.with_suffix(".md"), "w") as f:
    f.write("# Flax `fp8_ops` and jmp_lite's delayed scaling in TrainState and "
            "plain optax loops\n\n")
    f.write("\n\n".join(report) + "\n\n")
    f.write(f"![loss curves]({NAME}.png)\n")
  plot(runs, str(base.with_suffix(".png")))
  print("\n\n".join(report))
  print(f"Wrote {base}.{{md,json,png}} in {wall_s:.0f} s.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
