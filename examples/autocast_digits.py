"""Op-level mixed precision with ``jmp_lite.autocast`` on scikit-learn's digits.

A tiny transformer written in plain JAX, in float32, and never modified: each
8x8 digit is a sequence of its 8 rows (8 pixels each), embedded to 64
features, with pre-LayerNorm 4-head self-attention (softmax), a GELU MLP, mean
pooling, a final LayerNorm and a 10-way softmax cross-entropy. It is trained
three times, from the same initial parameters, on the same batches, with the
same hyperparameters:

* f32: the loss function as written, ``NoOpLossScale()``;
* f16 autocast: ``jmp_lite.autocast(loss_fn, jnp.float16)`` with
  ``jmp_lite.loss_scaling(optax.adam(lr), jmp_lite.DynamicLossScale(2**15))``
  and ``jmp_lite.scaled_value_and_grad``;
* bf16 autocast: ``jmp_lite.autocast(loss_fn, jnp.bfloat16)`` with
  ``NoOpLossScale()`` (bfloat16 has float32's exponent range).

autocast decides per operation: the matmuls (``dot_general``) run in the half
dtype, and the numerically sensitive pieces of the LayerNorms, the softmaxes,
the GELU and the cross-entropy (``exp``, ``log``, ``reduce_sum``, squares,
``rsqrt``) in float32, like ``torch.autocast``. The script prints, as
evidence, how many ``dot_general`` equations of the autocast loss and of the
jitted train step (forward, backward and optimizer) see the half dtype, and
which dtypes ``exp``, ``reduce_sum`` and the other sensitive ops see, read from
their jaxprs (``jax.make_jaxpr``, every sub-jaxpr included).

Run it with::

  pip install -e ".[examples]"
  python -m examples.autocast_digits

It prints the comparison table and writes ``autocast_digits.png`` (loss curves
and the f16 run's loss scale), ``autocast_digits.md`` (the tables) and
``autocast_digits.json`` (every figure) to ``--out`` (a scratch folder;
``--update-results`` writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from models import flax_models
import jmp_lite

WARMUP_STEPS = 10  # First steps (compilation) left out of the median step time.
EVIDENCE_OPS = ("dot_general", "exp", "log", "reduce_sum", "square", "rsqrt",
                "integer_pow", "tanh", "reduce_max")
ROWS = PIXELS = 8  # A digit is a sequence of 8 rows of 8 pixels.


# -- the model: plain JAX, float32, unmodified -------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the transformer.

  Attributes:
    width: features per token.
    heads: attention heads (``width`` must be a multiple).
    mlp: hidden features of the MLP.
    classes: output classes.
  """

  width: int = 64
  heads: int = 4
  mlp: int = 128
  classes: int = 10


def _dense(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
  """A float32 dense layer, LeCun-normal kernel and zero bias."""
  kernel = jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)
  return dict(kernel=kernel, bias=jnp.zeros((fan_out,)))


def _norm(width: int) -> dict[str, jax.Array]:
  return dict(scale=jnp.ones((width,)), bias=jnp.zeros((width,)))


def init_params(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
  """The float32 parameters of :func:`model`."""
  keys = jax.random.split(key, 8)
  return dict(
      embed=_dense(keys[0], PIXELS, cfg.width),
      position=0.02 * jax.random.normal(keys[1], (ROWS, cfg.width)),
      norm1=_norm(cfg.width),
      query=_dense(keys[2], cfg.width, cfg.width),
      key=_dense(keys[3], cfg.width, cfg.width),
      value=_dense(keys[4], cfg.width, cfg.width),
      attn_out=_dense(keys[5], cfg.width, cfg.width),
      norm2=_norm(cfg.width),
      mlp_in=_dense(keys[6], cfg.width, cfg.mlp),
      mlp_out=_dense(keys[7], cfg.mlp, cfg.width),
      norm_final=_norm(cfg.width),
      head=_dense(jax.random.fold_in(key, 1), cfg.width, cfg.classes),
  )


def dense(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x @ p["kernel"] + p["bias"]


def layer_norm(p: dict[str, jax.Array], x: jax.Array, eps: float = 1e-5):
  """LayerNorm over the last axis, written out."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(params: dict[str, Any], x: jax.Array, heads: int) -> jax.Array:
  """Multi-head self-attention over the rows: softmax(q k^T / sqrt(d)) v."""
  batch, length, width = x.shape
  split = lambda t: t.reshape(batch, length, heads, width // heads)
  q = split(dense(params["query"], x))
  k = split(dense(params["key"], x))
  v = split(dense(params["value"], x))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width // heads)
  weights = jax.nn.softmax(logits, axis=-1)
  mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
  return dense(params["attn_out"], mixed.reshape(batch, length, width))


def model(params: dict[str, Any], images: jax.Array, cfg: ModelConfig):
  """Logits for a batch of flattened 8x8 images, shape ``(batch, 64)``."""
  rows = images.reshape(-1, ROWS, PIXELS)
  h = dense(params["embed"], rows) + params["position"]
  h = h + attention(params, layer_norm(params["norm1"], h), cfg.heads)
  u = jax.nn.gelu(dense(params["mlp_in"], layer_norm(params["norm2"], h)))
  h = h + dense(params["mlp_out"], u)
  pooled = layer_norm(params["norm_final"], jnp.mean(h, axis=1))
  return dense(params["head"], pooled)


def make_loss_fn(cfg: ModelConfig) -> Callable[..., jax.Array]:
  """``loss_fn(params, images, labels)``: mean softmax cross-entropy."""

  def loss_fn(params, images, labels):
    log_probs = jax.nn.log_softmax(model(params, images, cfg))
    picked = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)
    return -jnp.mean(picked)

  return loss_fn


# -- the three runs ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run.

  Attributes:
    name: identifier, the run's key in the JSON output.
    label: human-readable name for the tables and the plot.
    compute_dtype: autocast's compute dtype, or None for the plain function.
    loss_scale: the initial loss scale given to ``jmp_lite.loss_scaling``.
  """

  name: str
  label: str
  compute_dtype: Any
  loss_scale: Any


def make_run_specs() -> tuple[RunSpec, ...]:
  """The three runs, float32 (the reference) first."""
  return (
      RunSpec("f32", "f32", None, jmp_lite.NoOpLossScale()),
      RunSpec("f16_autocast", "f16 autocast + dynamic loss scaling",
              jnp.float16, jmp_lite.DynamicLossScale(2.0**15)),
      RunSpec("bf16_autocast", "bf16 autocast", jnp.bfloat16,
              jmp_lite.NoOpLossScale()),
  )


def make_train_step(loss_fn, optimizer):
  """The jitted train step: ``(params, opt_state, x, y) -> (..., metrics)``.

  Args:
    loss_fn: the float32 loss function or its autocast version.
    optimizer: ``jmp_lite.loss_scaling(optax.adam(lr), loss_scale)``.
  """

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss_scale = jmp_lite.get_loss_scale(opt_state)  # this step's scale
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(
        params, x, y)  # unscaled loss, scaled grads
    # Unscales, skips non-finite steps, adjusts the dynamic scale.
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(loss=loss, finite=opt_state.last_finite,
                   loss_scale=jnp.asarray(loss_scale.loss_scale, jnp.float32))
    return params, opt_state, metrics

  return train_step


def make_eval_fn(loss_fn, cfg: ModelConfig):
  """``evaluate(params, x, y) -> (accuracy, loss)`` in float32."""

  @jax.jit
  def evaluate(params, x, y):
    accuracy = jnp.mean(jnp.argmax(model(params, x, cfg), axis=-1) == y)
    return accuracy, loss_fn(params, x, y)

  return evaluate


def op_evidence(fn, *args) -> dict[str, Any]:
  """What the operations of ``fn(*args)`` see, read from its jaxpr.

  Built on ``jmp_lite.op_dtypes``, which lists every operation that runs
  (sub-jaxprs included; equations whose results nothing reads are left out,
  as XLA removes them).

  Args:
    fn: the function to trace (the loss, or the jitted train step).
    *args: its arguments.

  Returns:
    ``dot_general_half`` / ``dot_general_total``: how many ``dot_general``
    equations take half-precision inputs, of all; ``ops``: for each op in
    :data:`EVIDENCE_OPS`, a ``{"dtype, dtype": count}`` histogram of its
    floating input dtypes.
  """
  ops = collections.defaultdict(collections.Counter)
  for name, dtypes in jmp_lite.op_dtypes(fn, *args):
    if name in EVIDENCE_OPS:
      ops[name][", ".join(dtypes)] += 1
  dots = ops["dot_general"]
  return dict(
      dot_general_half=sum(n for key, n in dots.items() if "float16" in key),
      dot_general_total=sum(dots.values()),
      ops={name: dict(ops[name]) for name in EVIDENCE_OPS if ops[name]},
  )


def train(spec: RunSpec, data, init, cfg: ModelConfig, args) -> dict:
  """Trains one run; returns its figures, histories and op evidence."""
  loss_fn = make_loss_fn(cfg)
  step_loss = loss_fn
  if spec.compute_dtype is not None:
    step_loss = jmp_lite.autocast(loss_fn, spec.compute_dtype)
  optimizer = jmp_lite.loss_scaling(optax.adam(args.lr), spec.loss_scale)
  train_step = make_train_step(step_loss, optimizer)

  params, opt_state = init, optimizer.init(init)
  x0, y0 = data["x_train"][:args.batch_size], data["y_train"][:args.batch_size]
  evidence = dict(forward=op_evidence(step_loss, params, x0, y0),
                  train_step=op_evidence(train_step, params, opt_state, x0, y0))

  log = common.StepLog()
  batches = common.batch_indices(len(data["x_train"]), args.batch_size,
                                 args.steps, args.seed)
  bar = tqdm(batches, total=args.steps, desc=f"{spec.label:>36}",
             disable=None, dynamic_ncols=True)
  for step, idx in enumerate(bar):
    start = time.perf_counter()
    params, opt_state, metrics = train_step(
        params, opt_state, data["x_train"][idx], data["y_train"][idx])
    log.record(step, start, jax.device_get(jax.block_until_ready(metrics)))
    if step % 20 == 0 or step == args.steps - 1:
      bar.set_postfix(loss=f"{log.losses[-1]:.3f}", scale=f"{log.scales[-1]:g}",
                      skipped=len(log.skipped_at), refresh=False)
  bar.close()

  # Evaluation uses the float32 model: it measures the trained parameters.
  evaluate = make_eval_fn(loss_fn, cfg)
  test_acc, _ = evaluate(params, data["x_test"], data["y_test"])
  _, train_loss = evaluate(params, data["x_train"], data["y_train"])
  return dict(
      label=spec.label,
      compute_dtype=(np.dtype(spec.compute_dtype).name
                     if spec.compute_dtype is not None else None),
      loss_scale_type=type(spec.loss_scale).__name__,
      test_accuracy=100.0 * float(test_acc),
      final_train_loss=float(train_loss),
      median_step_ms=log.median_step_ms(WARMUP_STEPS),
      skipped_steps=int(opt_state.skipped_steps),
      final_loss_scale=float(jmp_lite.get_loss_scale(opt_state).loss_scale),
      evidence=evidence,
      **log.histories(),
  )


# -- reporting ---------------------------------------------------------------


def format_table(results: dict[str, dict]) -> str:
  """The comparison table, as GitHub markdown."""
  lines = [
      "| run | test acc. (%) | final train loss | median step (ms) "
      "| skipped steps | final loss scale |",
      "|---|--:|--:|--:|--:|--:|",
  ]
  for r in results.values():
    lines.append(
        f"| {r['label']} | {r['test_accuracy']:.1f} "
        f"| {r['final_train_loss']:.4f} | {r['median_step_ms']:.2f} "
        f"| {r['skipped_steps']} "
        f"| {common.format_scale(r['final_loss_scale'])} |"
    )
  return "\n".join(lines)


def _histogram(evidence: dict[str, Any], op: str) -> str:
  """``"2x (float32)"``-style cell."""
  counts = evidence["ops"].get(op)
  if not counts:
    return "-"
  return ", ".join(f"{n}x ({key})" for key, n in sorted(counts.items()))


def evidence_columns(results: dict[str, dict]) -> list[tuple[str, dict]]:
  """(header, evidence) per column: f32's step, each autocast run's forward
  pass and train step."""
  columns = []
  for name, r in results.items():
    if r["compute_dtype"] is not None:
      columns.append((f"{name}: forward", r["evidence"]["forward"]))
    columns.append((f"{name}: train step", r["evidence"]["train_step"]))
  return columns


def format_evidence(results: dict[str, dict]) -> str:
  """The op-dtype evidence table: which dtypes each op sees, per run."""
  columns = evidence_columns(results)
  lines = ["| op | " + " | ".join(h for h, _ in columns) + " |",
           "|---|" + "---|" * len(columns)]
  dots = [f"**{e['dot_general_half']} of {e['dot_general_total']}**"
          for _, e in columns]
  lines.append("| `dot_general` with half inputs | " + " | ".join(dots) + " |")
  for op in EVIDENCE_OPS:
    if op == "dot_general":
      continue
    cells = [_histogram(e, op) for _, e in columns]
    lines.append(f"| `{op}` inputs | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def verdict(results: dict[str, dict]) -> str:
  """One sentence: do the autocast runs match float32's test accuracy?"""
  ref = results["f32"]["test_accuracy"]
  parts = []
  for name in ("f16_autocast", "bf16_autocast"):
    r = results[name]
    gap = r["test_accuracy"] - ref
    ok = "within" if abs(gap) <= common.ACCURACY_TOLERANCE else "NOT within"
    parts.append(f"{r['label']} {r['test_accuracy']:.1f}% ({ok} "
                 f"{common.ACCURACY_TOLERANCE:g} point of f32)")
  return f"Verdict: f32 {ref:.1f}% test accuracy; " + "; ".join(parts) + "."


def plot(results: dict[str, dict], path: str) -> None:
  """Loss curves of the three runs and the f16 run's loss scale."""
  fig, (ax_loss, ax_scale) = common.loss_and_scale_axes(figsize=(12, 4.5))
  for style, r in zip(common.LINE_STYLES, results.values()):
    losses = np.asarray(r["loss_history"], dtype=np.float64)
    steps = np.flatnonzero(np.isfinite(losses))
    window = min(common.SMOOTHING, max(len(steps), 1))
    smooth = np.convolve(losses[steps], np.ones(window) / window, "valid")
    ax_loss.plot(steps[window - 1:], smooth, label=r["label"], **style)
  common.style_loss_axis(
      ax_loss, f"train loss ({common.SMOOTHING}-step moving average)",
      "Training loss: plain f32 vs autocast")
  common.plot_loss_scale_steps(ax_scale, results["f16_autocast"],
                               "tab:orange", fit_ylim=True)
  common.save_figure(fig, path, dpi=110)


def write_outputs(results, args, report: list[str], cfg: ModelConfig) -> str:
  """Writes ``autocast_digits.{png,md,json}`` to ``args.out``; returns stem."""
  stem = os.path.join(args.out, "autocast_digits")
  plot(results, stem + ".png")
  config = {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "seed")}
  common.write_markdown(stem + ".md", "autocast on digits: results", report,
                        common.command_line("autocast_digits", config),
                        "autocast_digits.png")
  common.write_json(stem + ".json", dict(
      config=config, model=dataclasses.asdict(cfg),
      jax_version=jax.__version__, backend=jax.default_backend(),
      summary=report, runs=results))
  return stem


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the command-line flags."""
  parser = argparse.ArgumentParser(
      description="Train a tiny plain-JAX transformer on scikit-learn's digits "
      "in f32 and with jmp_lite.autocast (f16 + loss scaling, bf16).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=1500,
                      help="training steps per run")
  parser.add_argument("--batch-size", type=int, default=128,
                      help="examples per step")
  parser.add_argument("--lr", type=float, default=2e-3,
                      help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  common.check_at_least_one(parser, args, ("steps", "batch_size"))
  common.check_positive_finite(parser, args, ("lr",))
  return args


def main(argv=None) -> int:
  """Runs the three trainings, prints the tables, writes the files."""
  args = parse_args(argv)
  cfg = ModelConfig()
  data = flax_models.load_flat_digits()
  init = init_params(jax.random.key(args.seed), cfg)
  print(f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test "
        f"examples; {args.steps} steps of batch {args.batch_size}, Adam lr "
        f"{args.lr:g}, seed {args.seed}, {jax.default_backend()} backend.")

  results = {}
  for spec in make_run_specs():
    r = results[spec.name] = train(spec, data, init, cfg, args)
    print(f"{r['label']:>36}: test accuracy {r['test_accuracy']:5.1f}%, "
          f"final train loss {r['final_train_loss']:.4f}", flush=True)

  evidence_note = (
      "Op dtypes, read from the jaxprs of each autocast loss (forward) and of "
      "each jitted train step (forward, backward and Adam): `N x (dtypes)` "
      "counts the equations whose floating inputs have those dtypes "
      "(`jmp_lite.op_dtypes`, which leaves out equations whose results nothing "
      "reads). The model code is the same float32 code in every run."
  )
  report = [format_table(results), evidence_note, format_evidence(results),
            verdict(results)]
  print("\n" + "\n\n".join(report))
  stem = write_outputs(results, args, report, cfg)
  print(f"\nWrote {stem}.png, {stem}.md and {stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
