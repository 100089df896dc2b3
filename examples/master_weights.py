"""Half-precision params: float32 master weights and bfloat16 optimizer state.

Storing the params themselves in bfloat16 halves their memory, but an update
smaller than half the spacing of bfloat16 numbers at a parameter's value (2**-9
just under 1.0) rounds away: the parameter never moves. This script measures
that and what jmp_lite's two optimizer-side precision controls do about it.

**(a) The stall.** Params initialised to 1.0 and pulled towards 0 by the loss
``0.5 * sum(w**2)``, trained with
``jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.NoOpLossScale())``. Adam
moves each parameter by about the learning rate per step. In float32 the params
reach about 0.90 after 100 steps; in bfloat16 each step's 1e-3 is below half
the spacing (2**-9, about 2e-3) and the params stay at exactly 1.0. Wrapping
Adam in ``jmp_lite.master_weights`` keeps a float32 master copy in the
optimizer state: the steps accumulate there and the bfloat16 params are the
master copy rounded, within half a bfloat16 spacing of the float32 run.

**(b) Training.** The digits MLP (``models.flax_models.DigitsMLP``) (64 -> 256 -> 256 -> 10)
on scikit-learn's digits, with Adam and a cosine-decayed learning rate (so the
late steps are small, where bfloat16 params stop moving), same initial params
and batches in every configuration:

* ``f32``: float32 params, float32 Adam moments;
* ``bf16``: bfloat16 params and compute; Adam's moments follow the params
  (bfloat16);
* ``bf16_master``: bfloat16 params + ``master_weights(optax.adam(...))``;
* ``bf16_master_bf16_moments``: the same with
  ``master_weights(with_state_dtype(optax.adam(...), jnp.bfloat16))``;
* ``f32_bf16_moments``: float32 params with
  ``with_state_dtype(optax.adam(...), jnp.bfloat16)``: the accuracy cost of
  bfloat16 moments alone.

For each it reports test accuracy, final train loss, the fraction of params
that did not change over the last 10% of the steps, and the bytes of params +
optimizer state, summed from the actual arrays (``x.nbytes``).

Run it with::

  pip install -e ".[examples]"
  python -m examples.master_weights

It prints the tables and writes ``master_weights.md`` and
``master_weights.json`` to ``--out`` (a scratch folder;
``--update-results`` writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from models import flax_models
import jmp_lite

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)

#: The stall setting: how many parameters (all start at 1.0).
STALL_WIDTH = 4
#: How close the master copy must stay to the float32 run in the stall setting.
#: Its gradients are computed from the rounded bfloat16 params, so it is not
#: bit-identical; Adam normalises the gradient, so the difference is tiny.
MASTER_TOLERANCE = 1e-4


# -- (a) the stall -------------------------------------------------------------


def stall_run(param_dtype, inner, steps: int) -> dict:
  """Minimises ``0.5 * sum(w**2)`` from ``w = 1`` with ``inner``.

  Returns:
    The trajectory of the params (first element), the final params and, with
    master weights, the final master copy; the dtype of Adam's ``mu``.
  """
  optimizer = jmp_lite.loss_scaling(inner, jmp_lite.NoOpLossScale())
  params = {"w": jnp.ones(STALL_WIDTH, param_dtype)}
  opt_state = optimizer.init(params)
  loss_fn = lambda p: 0.5 * jnp.sum(p["w"].astype(jnp.float32) ** 2)

  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  trajectory = [1.0]
  for _ in range(steps):
    params, opt_state = step(params, opt_state)
    trajectory.append(float(params["w"][0]))
  adam = _adam_state(opt_state)
  result = dict(
      param_dtype=np.dtype(param_dtype).name,
      final_value=float(params["w"][0]),
      all_equal=bool(jnp.all(params["w"] == params["w"][0])),
      mu_dtype=np.dtype(adam.mu["w"].dtype).name,
      trajectory=trajectory,
  )
  try:
    master = jmp_lite.get_master_params(opt_state, params)["w"]
  except ValueError:
    master = None
  if master is not None:
    result["master_value"] = float(master[0])
    result["params_are_rounded_master"] = bool(
        jnp.all(params["w"] == master.astype(param_dtype)))
  return result


def _adam_state(opt_state) -> optax.ScaleByAdamState:
  """Adam's state, wherever it sits in ``opt_state``."""
  leaves = jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
  return next(x for x in leaves if isinstance(x, optax.ScaleByAdamState))


def run_stall(steps: int, lr: float) -> dict:
  """The three stall runs; the master run is checked against float32."""
  runs = {
      "f32": stall_run(jnp.float32, optax.adam(lr), steps),
      "bf16": stall_run(jnp.bfloat16, optax.adam(lr), steps),
      "bf16_master": stall_run(
          jnp.bfloat16, jmp_lite.master_weights(optax.adam(lr)), steps),
  }
  ref = runs["f32"]["final_value"]
  master = runs["bf16_master"]
  # A bfloat16 value can be at best half a spacing away from f32's.
  spacing = float(np.spacing(np.asarray(ref, BF16)).astype(F32))
  master["params_tolerance"] = spacing / 2
  master["params_error"] = abs(master["final_value"] - ref)
  master["master_tolerance"] = MASTER_TOLERANCE
  master["master_error"] = abs(master["master_value"] - ref)
  master["matches_f32"] = bool(
      master["params_error"] <= master["params_tolerance"]
      and master["master_error"] <= MASTER_TOLERANCE)
  return runs



def format_stall(runs: dict, steps: int, lr: float) -> str:
  """The stall table, as GitHub markdown."""
  label = {"f32": "f32 params", "bf16": "bf16 params",
           "bf16_master": "bf16 params + `master_weights`"}
  lines = [
      f"| run | params after {steps} steps | master copy | Adam `mu` dtype |",
      "|---|--:|--:|---|",
  ]
  for name, r in runs.items():
    master = f"{r['master_value']:.6f}" if "master_value" in r else "-"
    lines.append(f"| {label[name]} | {r['final_value']:.6f} | {master} "
                 f"| {r['mu_dtype']} |")
  m = runs["bf16_master"]
  verdict = "matches" if m["matches_f32"] else "does NOT match"
  return "\n".join(lines) + (
      f"\n\nParams start at 1.0 and the loss `0.5 * sum(w**2)` pulls them "
      f"towards 0; the optimizer is `loss_scaling(optax.adam({lr:g}), "
      "NoOpLossScale())`, with Adam wrapped in `master_weights` in the last "
      "row. In bf16 every step (about the learning rate) is below half the "
      "spacing of bf16 numbers under 1.0 (2^-9), so the params never move. "
      f"With master weights the run {verdict} f32: the bf16 params are "
      f"{m['params_error']:.2e} from f32's {runs['f32']['final_value']:.6f} "
      f"(tolerance: half a bf16 spacing there, {m['params_tolerance']:.2e}), "
      f"the float32 master copy {m['master_error']:.2e} (tolerance "
      f"{MASTER_TOLERANCE:g}), and the params are the master copy rounded to "
      f"bf16, bit for bit: {m['params_are_rounded_master']}.")


# -- (b) training --------------------------------------------------------------


CONFIGS = (
    # name, label, policy spec, optimizer factory (lr -> GradientTransformation)
    ("f32", "f32 params", "p=f32,c=f32,o=f32", lambda lr: optax.adam(lr)),
    ("bf16", "bf16 params", "p=bf16,c=bf16,o=f32", lambda lr: optax.adam(lr)),
    ("bf16_master", "bf16 params + master weights", "p=bf16,c=bf16,o=f32",
     lambda lr: jmp_lite.master_weights(optax.adam(lr))),
    ("bf16_master_bf16_moments", "bf16 params + master weights + bf16 moments",
     "p=bf16,c=bf16,o=f32",
     lambda lr: jmp_lite.master_weights(
         jmp_lite.with_state_dtype(optax.adam(lr), jnp.bfloat16))),
    ("f32_bf16_moments", "f32 params + bf16 moments", "p=f32,c=f32,o=f32",
     lambda lr: jmp_lite.with_state_dtype(optax.adam(lr), jnp.bfloat16)),
)


def tree_bytes(tree) -> int:
  """Bytes of the array leaves of ``tree`` (``x.nbytes``)."""
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree)
             if hasattr(x, "nbytes"))


def train(name, label, spec, make_inner, data, init_params, args) -> dict:
  """Trains the MLP in one configuration; returns its figures."""
  policy = jmp_lite.get_policy(spec)
  apply_fn = jmp_lite.with_policy(flax_models.DigitsMLP().apply, policy)
  schedule = optax.cosine_decay_schedule(args.lr, args.steps)
  optimizer = jmp_lite.loss_scaling(make_inner(schedule),
                                    jmp_lite.NoOpLossScale())

  def loss_fn(params, x, y):
    return common.cross_entropy(apply_fn({"params": params}, x), y)

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(
        params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = policy.cast_to_param(init_params)
  opt_state = optimizer.init(params)
  late = args.steps - max(1, args.steps // 10)  # The last 10% of the steps.
  snapshot = params
  losses = []
  start = time.perf_counter()
  batches = common.batch_indices(len(data["x_train"]), args.batch_size,
                                 args.steps, args.seed)
  for step, idx in enumerate(tqdm(batches, total=args.steps,
                                  desc=f"{label:>44}", disable=None)):
    if step == late:
      snapshot = params
    params, opt_state, loss = train_step(
        params, opt_state, data["x_train"][idx], data["y_train"][idx])
    losses.append(loss)  # Read after the loop: no host sync per step.
  losses = [float(x) for x in jax.device_get(losses)]
  seconds = time.perf_counter() - start

  evaluate = common.make_eval_fn(apply_fn)
  test_acc, test_ce = evaluate(params, data["x_test"], data["y_test"])
  _, train_ce = evaluate(params, data["x_train"], data["y_train"])
  unchanged = sum(int(jnp.sum(a == b)) for a, b in zip(
      jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(snapshot)))
  size = sum(x.size for x in jax.tree_util.tree_leaves(params))
  # The copies the state keeps (none without master_weights).
  master_bytes = tree_bytes(optax.tree.get(opt_state, "master_params"))
  adam_leaves = jax.tree_util.tree_leaves(_adam_state(opt_state))
  state_dtypes = sorted({np.dtype(x.dtype).name
                         for x in adam_leaves if x.ndim >= 1})
  return dict(
      label=label,
      policy=str(policy),
      test_accuracy=100.0 * float(test_acc),
      test_loss=float(test_ce),
      final_train_loss=float(train_ce),
      unchanged_late_fraction=unchanged / size,
      params_bytes=tree_bytes(params),
      state_bytes=tree_bytes(opt_state),
      master_bytes=master_bytes,
      moment_dtypes=state_dtypes,
      seconds=seconds,
      loss_history=losses,
  )


def format_runs(runs: dict) -> str:
  """The training and memory table, as GitHub markdown."""
  f32 = runs["f32"]
  bf16 = runs["bf16"]
  total = lambda r: r["params_bytes"] + r["state_bytes"]
  lines = [
      "| configuration | params | Adam moments | test acc. (%) | test loss "
      "| final train loss | params unchanged in the last 10% of steps (%) "
      "| params (KiB) | master copy (KiB) | optimizer state (KiB) "
      "| params + state (KiB) | vs f32 | vs bf16 |",
      "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
  ]
  for r in runs.values():
    param_dtype = jmp_lite.get_policy(r["policy"]).param_dtype
    lines.append(
        f"| {r['label']} | {np.dtype(param_dtype).name} "
        f"| {', '.join(r['moment_dtypes'])} "
        f"| {r['test_accuracy']:.2f} | {r['test_loss']:.4f} "
        f"| {r['final_train_loss']:.4f} "
        f"| {100 * r['unchanged_late_fraction']:.1f} "
        f"| {r['params_bytes'] / 1024:.1f} | {r['master_bytes'] / 1024:.1f} "
        f"| {r['state_bytes'] / 1024:.1f} | {total(r) / 1024:.1f} "
        f"| {total(r) / total(f32):.2f}x | {total(r) / total(bf16):.2f}x |")
  return "\n".join(lines)


def describe_runs(runs: dict, args) -> str:
  """The conclusions, computed from the figures."""
  acc = {n: r["test_accuracy"] for n, r in runs.items()}
  loss = {n: r["final_train_loss"] for n, r in runs.items()}
  test = {n: r["test_loss"] for n, r in runs.items()}
  frozen = {n: 100 * r["unchanged_late_fraction"] for n, r in runs.items()}
  tol = common.ACCURACY_TOLERANCE

  def vs_f32(name):
    diff = acc[name] - acc["f32"]
    word = "within" if abs(diff) <= tol else "NOT within"
    return f"{acc[name]:.2f}% ({diff:+.2f} points, {word} {tol:g} of f32)"

  return (
      f"Adam, learning rate {args.lr:g} with cosine decay to 0 over "
      f"{args.steps} steps, batch {args.batch_size}. Test accuracy: f32 "
      f"{acc['f32']:.2f}%; bf16 params {vs_f32('bf16')}; with master weights "
      f"{vs_f32('bf16_master')}; with master weights and bf16 moments "
      f"{vs_f32('bf16_master_bf16_moments')}; f32 params with bf16 moments "
      f"{vs_f32('f32_bf16_moments')}. Final train loss: f32 "
      f"{loss['f32']:.4f}, bf16 params {loss['bf16']:.4f}, master weights "
      f"{loss['bf16_master']:.4f}, + bf16 moments "
      f"{loss['bf16_master_bf16_moments']:.4f}, f32 params + bf16 moments "
      f"{loss['f32_bf16_moments']:.4f} (test loss: {test['f32']:.4f}, "
      f"{test['bf16']:.4f}, {test['bf16_master']:.4f}, "
      f"{test['bf16_master_bf16_moments']:.4f}, "
      f"{test['f32_bf16_moments']:.4f}). Over the last 10% of the steps, as "
      f"the learning rate decays, {frozen['bf16']:.1f}% of the plain bf16 "
      f"params did not change at all: their updates round away. In f32 "
      f"{frozen['f32']:.1f}% did not change (weights of always-blank pixels "
      "and of dead relu units get exactly zero gradients); with master "
      f"weights {frozen['bf16_master']:.1f}% of the bf16 params did not "
      "change, but their float32 master copy kept moving and reached f32's "
      "loss: a bf16 param changes when its master value crosses a bf16 "
      "rounding boundary. The cost of bf16 Adam moments is the difference "
      "between the rows with and without them.")


def describe_memory(runs: dict) -> str:
  """What the memory table says, in words."""
  total = {n: r["params_bytes"] + r["state_bytes"] for n, r in runs.items()}
  ratio = lambda a, b: total[a] / total[b]
  return (
      "Memory: bytes of params + optimizer state, summed over the arrays "
      "(`x.nbytes`; the optimizer state includes the master copy, Adam's "
      "moments and count, and the loss-scaling counters). Per parameter: f32 "
      "params + f32 Adam = 4 + 8 bytes; bf16 params + bf16 Adam = 2 + 4; "
      "master weights add a 4-byte master copy and keep Adam in f32 (2 + 4 + "
      f"8 = 14, {ratio('bf16_master', 'f32'):.2f}x f32: master weights buy "
      "f32 accuracy for half-precision params, not memory); bf16 moments "
      "bring that to 2 + 4 + 4 = 10 "
      f"({ratio('bf16_master_bf16_moments', 'f32'):.2f}x f32), and f32 "
      "params with bf16 moments to 4 + 4 = 8 "
      f"({ratio('f32_bf16_moments', 'f32'):.2f}x f32). Activation memory "
      "and compute, where half precision pays, are not counted here.")


# -- output --------------------------------------------------------------------


def write_outputs(stall, runs, report, args) -> str:
  """Writes ``master_weights.{md,json}`` to ``args.out``; returns the stem."""
  stem = os.path.join(args.out, "master_weights")
  keys = ("stall_steps", "stall_lr", "steps", "batch_size", "lr", "seed")
  config = {k: getattr(args, k) for k in keys}
  with open(stem + ".md", "w") as f:
    f.write("# master weights and optimizer-state dtypes: results\n\n")
    f.write("\n\n".join(report) + "\n\n")
    f.write(f"Command: `{common.command_line('master_weights', config)}` "
            f"(jax {jax.__version__}, optax {optax.__version__}, "
            f"{jax.default_backend()} backend).\n")
  common.write_json(stem + ".json", dict(
      config=config, jax_version=jax.__version__,
      optax_version=optax.__version__, backend=jax.default_backend(),
      summary=report, stall=stall, runs=runs))
  return stem


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the command-line flags."""
  parser = argparse.ArgumentParser(
      description="bf16 params with and without float32 master weights, and "
      "bf16 optimizer state: the stall, accuracy and memory.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--stall-steps", type=int, default=100,
                      help="steps of the stall setting")
  parser.add_argument("--stall-lr", type=float, default=1e-3,
                      help="Adam learning rate of the stall setting")
  parser.add_argument("--steps", type=int, default=1000,
                      help="training steps per configuration")
  parser.add_argument("--batch-size", type=int, default=128,
                      help="examples per step")
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="peak Adam learning rate (cosine decay to 0)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  common.check_at_least_one(parser, args,
                            ("stall_steps", "steps", "batch_size"))
  common.check_positive_finite(parser, args, ("stall_lr", "lr"))
  return args


def main(argv=None) -> int:
  """Runs the stall setting and the trainings; prints and writes the results."""
  args = parse_args(argv)
  print(f"(a) stall setting: {args.stall_steps} steps of Adam "
        f"{args.stall_lr:g} from w = 1.0", flush=True)
  stall = run_stall(args.stall_steps, args.stall_lr)
  stall_text = format_stall(stall, args.stall_steps, args.stall_lr)
  print(stall_text + "\n", flush=True)

  data = flax_models.load_flat_digits()
  init_params = flax_models.DigitsMLP().init(
      jax.random.key(args.seed), data["x_train"][:1])["params"]
  print(f"(b) digits MLP: {len(data['x_train'])} train / "
        f"{len(data['x_test'])} test examples, {args.steps} steps of batch "
        f"{args.batch_size}, {jax.default_backend()} backend.", flush=True)
  runs = {}
  for name, label, spec, make_inner in CONFIGS:
    r = runs[name] = train(name, label, spec, make_inner, data, init_params,
                           args)
    print(f"{label:>44}: test accuracy {r['test_accuracy']:6.2f}%, final "
          f"train loss {r['final_train_loss']:.4f}", flush=True)

  report = ["## (a) The stall of bf16 params", stall_text,
            "## (b) Training the digits MLP", format_runs(runs),
            describe_runs(runs, args), describe_memory(runs)]
  print("\n" + "\n\n".join(report[3:]))
  stem = write_outputs(stall, runs, report, args)
  print(f"\nWrote {stem}.md and {stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
