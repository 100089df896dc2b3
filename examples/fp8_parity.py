"""Float8 training parity: a CNN and a transformer LM in f32, bf16 and float8.

Trains two small models under six policies, from the same initial variables,
on the same batches, with the same hyperparameters; only the precision
changes:

* ``f32`` (``p=f32,c=f32,o=f32``) and ``bf16`` (``p=f32,c=bf16,o=f32``, the
  reference every float8 run is held to);
* float8 matmuls on top of bf16 compute: ``m=fp8`` (per-tensor current
  scaling), ``m=fp8_rowwise`` (one scale per row, torchao's "rowwise"),
  ``m=mxfp8`` (1x32 blocks, E8M0 scales) and ``m=fp8_delayed`` (per-tensor
  scales from a 16-step amax history, kept in the ``fp8_state`` collection /
  the ``Fp8State`` variable, never seen by the optimizer).

The models are unmodified Flax code from ``models/flax_models.py``:

* ``DigitsCNN`` (linen, BatchNorm) on scikit-learn's 8x8 digits through
  ``jmp_lite.linen.apply_policy``. Its convolutions stay in bf16 (jmp_lite's
  float8 covers ``dot_general``), the output head too (the default): only its
  1024 -> 128 dense layer runs in float8;
* ``CharLM`` (NNX, a 2-block pre-LayerNorm transformer) on the Python standard
  library's source bytes through ``jmp_lite.nnx.apply_policy``: the q/k/v/out
  projections and the MLP (12 of its 17 forward matmuls) run in float8; the
  attention scores, the softmax-weighted values, the norms, the embeddings and
  the head stay in bf16/f32.

**The criterion.** The LM's validation loss must be within 0.25% (relative)
of bf16's, for every seed: DeepSeek-V3's bar for its FP8 training ("compared
with the BF16 baseline, the relative loss error of our FP8-training model
remains consistently below 0.25%", DeepSeek-V3 Technical Report,
arXiv:2412.19437, section 3.3 and appendix B.1). The CNN's test accuracy must
be within 1 point of bf16's (``examples/common.py``'s ``ACCURACY_TOLERANCE``,
what the digits examples call matching: under 4 of the 360 test images); the
report also counts the rows outside ``examples/parity.py``'s stricter 0.5
points (under 2 images), and gives the seed-to-seed spread of bf16 itself,
the "training randomness" DeepSeek compares against.

Run it with::

  python -m examples.fp8_parity            # 6-10 min on 2 CPU cores
  python -m examples.fp8_parity --quick --out /tmp/fp8   # the smoke run (tests)

It writes ``fp8_parity.md`` (tables and verdicts), ``fp8_parity.json`` (every
figure and the per-step losses) and ``fp8_parity.png`` (loss curves) to
``--out`` (a scratch folder; ``--update-results`` writes ``examples/results/``)
and exits with status 1 if a run fails its criterion (not with --quick). On CPU float8 is
emulated (XLA:CPU upcasts float8 operands), so step times show the cost of
the emulation, not a speed-up.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from examples import common
from models import flax_models
import jmp_lite
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx

NAME = "fp8_parity"
REFERENCE = "bf16"
#: (name, label, policy): the reference first after f32.
RUNS = (
    ("f32", "f32", "p=f32,c=f32,o=f32"),
    ("bf16", "bf16", "p=f32,c=bf16,o=f32"),
    ("fp8", "float8 per-tensor (current)", "p=f32,c=bf16,o=f32,m=fp8"),
    ("fp8_rowwise", "float8 rowwise (current)",
     "p=f32,c=bf16,o=f32,m=fp8_rowwise"),
    ("mxfp8", "MXFP8 (1x32 blocks, E8M0)", "p=f32,c=bf16,o=f32,m=mxfp8"),
    ("fp8_delayed", "float8 per-tensor (delayed)",
     "p=f32,c=bf16,o=f32,m=fp8_delayed"),
)
#: DeepSeek-V3's bar: relative loss error of FP8 training vs BF16.
LOSS_TOLERANCE = 0.25  # percent
#: The digits examples' "matching accuracy" (examples/common.py): test
#: accuracy points. 360 test images: one image is 0.28 points.
ACC_TOLERANCE = common.ACCURACY_TOLERANCE
#: examples/parity.py's stricter tolerance, reported next to it.
STRICT_ACC_TOLERANCE = 0.5
TAIL = 50  # Final train loss: the mean of the last TAIL steps.
WARMUP_STEPS = 5  # Left out of the median step time (compilation).
SMOOTHING = common.SMOOTHING
CNN_SOURCE = "the sorted train set of scikit-learn's digits"
# The full and the --quick settings.
FULL = dict(cnn_steps=600, lm_steps=300, seeds=(0, 1), d_model=64, layers=2,
            seq_len=64, lm_batch=16, max_chars=400_000, val_windows=256,
            runs=tuple(name for name, _, _ in RUNS))
# The smoke run: the reference, the emulated block-scaled path and the
# stateful one, on a 1-block LM, so that it compiles in seconds.
QUICK = dict(cnn_steps=3, lm_steps=3, seeds=(0,), d_model=32, layers=1,
             seq_len=16, lm_batch=4, max_chars=20_000, val_windows=8,
             runs=("bf16", "mxfp8", "fp8_delayed"))


def dot_dtypes(fn, *args) -> dict[str, int]:
  """How many forward matmuls see each operand dtype pair, e.g.
  ``{"float8_e4m3fn": 12, "bfloat16": 5}`` (named by the lhs dtype)."""
  return dict(collections.Counter(
      dtypes[0] for op, dtypes in jmp_lite.op_dtypes(fn, *args)
      if op == "dot_general"))


# -- the CNN (linen) -------------------------------------------------------------


def train_cnn(policy: str, data, seed: int, steps: int, batch_size: int,
              lr: float) -> dict:
  """Trains DigitsCNN under ``policy``; returns its figures."""
  x_train, y_train, x_test, y_test = data
  model = jlinen.apply_policy(flax_models.DigitsCNN(), policy)
  variables = model.init(jax.random.key(seed), x_train[:1])
  optimizer = optax.adam(optax.cosine_decay_schedule(lr, steps))
  opt_state = optimizer.init(variables["params"])

  @jax.jit
  def step(variables, opt_state, x, y):
    def loss_fn(params):
      # fp8_state exists for delayed scaling only; mutable rolls its history.
      logits, updates = model.apply(
          {**variables, "params": params}, x, train=True,
          mutable=["batch_stats", "fp8_state"])
      return common.cross_entropy(logits, y), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        variables["params"])
    deltas, opt_state = optimizer.update(grads, opt_state)
    params = optax.apply_updates(variables["params"], deltas)
    return {**variables, **updates, "params": params}, opt_state, loss

  @jax.jit
  def evaluate(variables, x, y):
    logits = model.apply(variables, x, train=False)
    return jnp.mean(jnp.argmax(logits, -1) == y), common.cross_entropy(
        logits, y)

  losses, step_ms = [], []
  for idx in common.batch_indices(len(x_train), batch_size, steps, seed):
    start = time.perf_counter()
    variables, opt_state, loss = step(variables, opt_state, x_train[idx],
                                      y_train[idx])
    losses.append(float(loss))
    step_ms.append(1e3 * (time.perf_counter() - start))
  test_acc, test_loss = evaluate(variables, x_test, y_test)
  return dict(
      test_accuracy=100.0 * float(test_acc), test_loss=float(test_loss),
      final_train_loss=float(np.mean(losses[-TAIL:])),
      median_step_ms=float(np.median(step_ms[WARMUP_STEPS:] or step_ms)),
      # At the training batch size: float8 needs M, N, K multiples of 16.
      forward_dots=dot_dtypes(lambda v, x: model.apply(v, x), variables,
                              x_train[:batch_size]),
      loss_history=losses)


# -- the language model (NNX) --------------------------------------------------


def lm_windows(tokens: np.ndarray, starts, seq_len: int):
  """Inputs ``(B, T)`` and next-token targets ``(B, T)`` at ``starts``."""
  idx = np.asarray(starts)[:, None] + np.arange(seq_len + 1)
  chunk = tokens[idx]
  return chunk[:, :-1], chunk[:, 1:]


@nnx.jit
def lm_step(model, optimizer, x, y):
  """One Adam step of the LM; returns the loss."""
  def loss_fn(model):
    return common.cross_entropy(model(x), y)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def lm_eval_loss(model, x, y):
  return common.cross_entropy(model(x), y)


def train_lm(policy: str, data, seed: int, steps: int, batch_size: int,
             seq_len: int, d_model: int, layers: int, lr: float,
             val_windows: int) -> dict:
  """Trains CharLM under ``policy``; returns its figures."""
  train_tokens, val_tokens = data
  module = flax_models.CharLM(
      flax_models.BYTE_VOCAB_SIZE, d_model=d_model, num_heads=4, num_layers=layers,
      max_len=seq_len, rngs=nnx.Rngs(seed))
  model = jnnx.apply_policy(module, policy)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, min(50, steps // 10 + 1), steps)
  # The optimizer steps the nnx.Param variables; the delayed recipe's
  # Fp8State is another variable type, which it never sees.
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)
  rng = np.random.default_rng(seed)
  batches = [rng.integers(0, len(train_tokens) - seq_len - 1, size=batch_size)
             for _ in range(steps)]
  model(lm_windows(train_tokens, batches[0], seq_len)[0])  # rolls Fp8State once
  losses, step_ms = [], []
  for starts in batches:
    x, y = lm_windows(train_tokens, starts, seq_len)
    start = time.perf_counter()
    losses.append(float(lm_step(model, optimizer, x, y)))
    step_ms.append(1e3 * (time.perf_counter() - start))

  model.eval()  # evaluation reads the amax histories, does not roll them
  count = min(val_windows, (len(val_tokens) - 1) // seq_len)
  starts = np.arange(count) * seq_len
  val = [float(lm_eval_loss(model, *lm_windows(val_tokens, s, seq_len)))
         for s in np.array_split(starts, max(1, count // 64))]
  graphdef, state = nnx.split(model)
  x = lm_windows(val_tokens, starts[:2], seq_len)[0]
  return dict(
      validation_loss=float(np.mean(val)),
      final_train_loss=float(np.mean(losses[-TAIL:])),
      median_step_ms=float(np.median(step_ms[WARMUP_STEPS:] or step_ms)),
      forward_dots=dot_dtypes(lambda s, x: nnx.merge(graphdef, s)(x), state,
                              x),
      loss_history=losses)


# -- the report ----------------------------------------------------------------


def relative_error(value: float, reference: float) -> float:
  """``100 * (value - reference) / reference``, in percent."""
  return 100.0 * (value - reference) / reference


def verdicts(results: dict) -> list[dict]:
  """One row per (model, float8 run, seed): figure, bf16's, error, PASS/FAIL."""
  rows = []
  for model, metric, unit, tolerance in (
      ("cnn", "test_accuracy", "pt", ACC_TOLERANCE),
      ("lm", "validation_loss", "%", LOSS_TOLERANCE)):
    for name in next(iter(results[model].values())):
      if name == REFERENCE:
        continue
      for seed, runs in results[model].items():
        value, ref = runs[name][metric], runs[REFERENCE][metric]
        error = value - ref if unit == "pt" else relative_error(value, ref)
        rows.append(dict(model=model, run=name, seed=seed, metric=metric,
                         value=value, reference=ref, error=error, unit=unit,
                         tolerance=tolerance,
                         gated=name != "f32",
                         passed=math.isfinite(error) and abs(error) <= tolerance))
  return rows


def seed_spread(results: dict, model: str, metric: str, relative: bool):
  """The largest difference of bf16's ``metric`` between two seeds."""
  values = [runs[REFERENCE][metric] for runs in results[model].values()]
  if len(values) < 2:
    return None
  spread = max(values) - min(values)
  return 100.0 * spread / min(values) if relative else spread


def format_dots(dots: dict[str, int]) -> str:
  short = {"float8_e4m3fn": "e4m3", "bfloat16": "bf16", "float32": "f32"}
  return " + ".join(f"{n} {short.get(d, d)}" for d, n in dots.items())


def format_tables(results: dict, rows: list[dict]) -> list[str]:
  """The markdown tables: per model, per run (seed 0 first), and verdicts."""
  labels = {name: label for name, label, _ in RUNS}
  policies = {name: str(jmp_lite.get_policy(p)) for name, _, p in RUNS}
  out = []
  cnn = ["| run | policy | seed | test acc. (%) | test loss | final train loss "
         "| forward matmuls (lhs dtype) | median step (ms, CPU) |",
         "|---|---|--:|--:|--:|--:|---|--:|"]
  lm = ["| run | policy | seed | validation loss | final train loss "
        "| forward matmuls (lhs dtype) | median step (ms, CPU) |",
        "|---|---|--:|--:|--:|---|--:|"]
  for name in next(iter(results["cnn"].values())):
    for seed, runs in results["cnn"].items():
      r = runs[name]
      cnn.append(f"| {labels[name]} | `{policies[name]}` | {seed} "
                 f"| {r['test_accuracy']:.2f} | {r['test_loss']:.4f} "
                 f"| {r['final_train_loss']:.5f} | {format_dots(r['forward_dots'])} "
                 f"| {r['median_step_ms']:.1f} |")
    for seed, runs in results["lm"].items():
      r = runs[name]
      lm.append(f"| {labels[name]} | `{policies[name]}` | {seed} "
                f"| {r['validation_loss']:.4f} | {r['final_train_loss']:.4f} "
                f"| {format_dots(r['forward_dots'])} "
                f"| {r['median_step_ms']:.1f} |")
  verdict = ["| model | metric | run | seed | bf16 | run's | difference "
             "| tolerance | parity |", "|---|---|---|--:|--:|--:|--:|--:|:-:|"]
  for row in rows:
    model = "DigitsCNN (linen)" if row["model"] == "cnn" else "CharLM (NNX)"
    fmt = ".2f" if row["unit"] == "pt" else ".4f"
    unit = " pt" if row["unit"] == "pt" else " %"
    shown = "PASS" if row["passed"] else "FAIL"
    if not row["gated"]:
      shown = f"({shown}; not gated)"
    verdict.append(
        f"| {model} | {row['metric'].replace('_', ' ')} | {labels[row['run']]} "
        f"| {row['seed']} | {row['reference']:{fmt}} | {row['value']:{fmt}} "
        f"| {row['error']:+.3f}{unit} | ±{row['tolerance']:g}{unit} | {shown} |")
  out += ["## DigitsCNN (linen) on digits", "\n".join(cnn),
          "## CharLM (NNX) on Python source bytes", "\n".join(lm),
          "## Parity against bf16", "\n".join(verdict)]
  return out


def plot(results: dict, path: str) -> None:
  """Seed 0's training-loss curves of both models, every run."""
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  styles = [dict(color="black", linewidth=3, alpha=0.35),
            dict(color="tab:blue", linewidth=2.5, alpha=0.6),
            dict(color="tab:orange", linestyle="--"),
            dict(color="tab:green", linestyle=":", linewidth=2),
            dict(color="tab:red", linestyle="-."),
            dict(color="tab:purple", linestyle=(0, (1, 3)), linewidth=2)]
  for ax, model, title in ((axes[0], "cnn", "DigitsCNN (linen)"),
                           (axes[1], "lm", "CharLM (NNX)")):
    runs = next(iter(results[model].values()))
    for (name, label, _), style in zip(RUNS, styles):
      if name not in runs:
        continue
      ax.plot(common.moving_average(runs[name]["loss_history"], SMOOTHING),
              label=label, **style)
    ax.set(xlabel="step", ylabel=f"train loss ({SMOOTHING}-step average)",
           yscale="log", title=f"{title}, seed {next(iter(results[model]))}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  common.save_figure(fig, path, dpi=100)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a few steps of tiny models, one seed (a smoke run "
                      "for the tests: its figures mean nothing)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None,
                      help=f"seeds (initial variables and batch order; "
                      f"default {FULL['seeds']})")
  parser.add_argument("--runs", nargs="+", default=None,
                      choices=[name for name, _, _ in RUNS],
                      help="the runs to train (default: all; bf16, the "
                      "reference, is always trained)")
  parser.add_argument("--cnn-steps", type=int, default=None,
                      help=f"CNN steps per run (default {FULL['cnn_steps']})")
  parser.add_argument("--lm-steps", type=int, default=None,
                      help=f"LM steps per run (default {FULL['lm_steps']})")
  parser.add_argument("--cnn-lr", type=float, default=1e-3,
                      help="CNN learning rate (cosine decay to 0)")
  parser.add_argument("--lm-lr", type=float, default=2e-3,
                      help="LM peak learning rate (warm-up, cosine decay)")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  for key in ("seeds", "cnn_steps", "lm_steps", "runs"):
    value = getattr(args, key)
    if value is not None:
      settings[key] = tuple(value) if isinstance(value, list) else value
  settings["runs"] = tuple(sorted(set(settings["runs"]) | {REFERENCE}))
  if settings["cnn_steps"] < 1 or settings["lm_steps"] < 1:
    parser.error("--cnn-steps and --lm-steps must be at least 1")
  if args.quick and args.update_results:
    parser.error("--quick runs are smoke runs: they never replace the "
                 "committed results")
  args.settings = settings
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  s = args.settings
  start = time.perf_counter()
  digits = flax_models.load_digits_data()
  tokens = flax_models.encode(flax_models.load_stdlib_text(s["max_chars"]))
  split = int(0.9 * len(tokens))
  text = (tokens[:split], tokens[split:])
  results = {"cnn": {}, "lm": {}}
  for seed in s["seeds"]:
    results["cnn"][seed], results["lm"][seed] = {}, {}
    for name, _, policy in RUNS:
      if name not in s["runs"]:
        continue
      t0 = time.perf_counter()
      results["cnn"][seed][name] = train_cnn(
          policy, digits, seed, s["cnn_steps"], 128, args.cnn_lr)
      t1 = time.perf_counter()
      results["lm"][seed][name] = train_lm(
          policy, text, seed, s["lm_steps"], s["lm_batch"], s["seq_len"],
          s["d_model"], s["layers"], args.lm_lr, s["val_windows"])
      print(f"seed {seed} {name:>12}: CNN {t1 - t0:5.1f} s, acc "
            f"{results['cnn'][seed][name]['test_accuracy']:.2f}; LM "
            f"{time.perf_counter() - t1:5.1f} s, val loss "
            f"{results['lm'][seed][name]['validation_loss']:.4f}", flush=True)
  wall_s = time.perf_counter() - start
  rows = verdicts(results)
  failed = [r for r in rows if r["gated"] and not r["passed"]]
  cnn_gated = [r for r in rows if r["model"] == "cnn" and r["gated"]]
  strict = [r for r in cnn_gated if abs(r["error"]) > STRICT_ACC_TOLERANCE]
  cnn_spread = seed_spread(results, "cnn", "test_accuracy", relative=False)
  lm_spread = seed_spread(results, "lm", "validation_loss", relative=True)

  config = dict(quick=args.quick, seeds=list(s["seeds"]),
                cnn=dict(steps=s["cnn_steps"], batch_size=128, lr=args.cnn_lr,
                         optimizer="adam, cosine decay"),
                lm=dict(steps=s["lm_steps"], batch_size=s["lm_batch"],
                        seq_len=s["seq_len"], d_model=s["d_model"], heads=4,
                        layers=s["layers"], lr=args.lm_lr, max_chars=s["max_chars"],
                        val_windows=s["val_windows"],
                        optimizer="adam, warm-up + cosine decay"),
                criteria=dict(
                    lm_validation_loss_relative_percent=LOSS_TOLERANCE,
                    lm_source="DeepSeek-V3 Technical Report (arXiv:2412.19437), "
                    "section 3.3 / appendix B.1: relative loss error of FP8 "
                    "training vs BF16 below 0.25%",
                    cnn_test_accuracy_points=ACC_TOLERANCE,
                    cnn_source="examples/common.py ACCURACY_TOLERANCE",
                    cnn_strict_test_accuracy_points=STRICT_ACC_TOLERANCE),
                wall_s=round(wall_s, 1), jax=jax.__version__,
                backend=jax.default_backend())
  base = args.out / NAME
  common.write_json(base.with_suffix(".json"), dict(
      config=config, verdicts=rows, bf16_seed_spread=dict(
          cnn_test_accuracy_points=cnn_spread,
          lm_validation_loss_percent=lm_spread),
      runs={m: {str(k): v for k, v in r.items()} for m, r in results.items()}))
  flag_line = " --quick" if args.quick else ""
  summary = (
      f"**{len(rows) - len(failed)} of {len(rows)} rows pass "
      f"({sum(r['gated'] for r in rows) - len(failed)} of "
      f"{sum(r['gated'] for r in rows)} float8 rows)**"
      + ("; failed: " + ", ".join(
          f"{r['model']}/{r['run']}/seed {r['seed']}" for r in failed) + "."
         if failed else "."))
  spread = []
  if cnn_spread is not None:
    spread.append(f"bf16 itself moves by {cnn_spread:.2f} points of CNN test "
                  f"accuracy and {lm_spread:.3f}% of LM validation loss from "
                  "one seed to another")
  report = [
      f"`python -m examples.{NAME}{flag_line}`: seeds {list(s['seeds'])}; "
      f"CNN {s['cnn_steps']} steps of 128 images (Adam, lr {args.cnn_lr:g}, "
      f"cosine decay); LM {s['lm_steps']} steps of {s['lm_batch']} windows of "
      f"{s['seq_len']} bytes, d_model {s['d_model']}, {s['layers']} block(s), 4 heads (Adam, "
      f"peak lr {args.lm_lr:g}); validation over {s['val_windows']} windows. "
      f"Every run of a seed starts from the same variables and sees the same "
      f"batches. {wall_s:.0f} s in all on {jax.default_backend()} "
      f"(jax {jax.__version__}).",
      "**Criteria.** LM: validation loss within "
      f"{LOSS_TOLERANCE}% (relative) of bf16's, DeepSeek-V3's bar for FP8 "
      "training (\"the relative loss error of our FP8-training model remains "
      "consistently below 0.25%\", arXiv:2412.19437, section 3.3 and appendix "
      f"B.1). CNN: test accuracy within {ACC_TOLERANCE:g} point of bf16's "
      "(`examples/common.py`'s `ACCURACY_TOLERANCE`, what the digits examples "
      "call matching; one of the 360 test images is 0.28 points). Against "
      f"`examples/parity.py`'s stricter {STRICT_ACC_TOLERANCE} points (under 2 "
      f"images), {len(strict)} of {len(cnn_gated)} CNN float8 rows fall "
      "outside" + (" (" + ", ".join(
          f"{r['run']} seed {r['seed']}: {r['error']:+.3f} pt" for r in strict)
          + ")" if strict else "") + ". f32 is shown against bf16 too, "
      "ungated, as a yardstick."
      + (f" For scale, {spread[0]}." if spread else ""),
      summary,
      "**Reading the figures.** On CPU float8 is emulated: XLA:CPU upcasts "
      "float8 operands and runs an f32 dot (the products of float8 values are "
      "exact in f32; a GPU accumulates in another order), and MXFP8's block scales are applied by "
      "an emulation that multiplies the e4m3 values by their E8M0 scales "
      "before an f32 dot (hence its `f32` matmuls below). The step times are "
      "the emulation's cost on a shared 2-core CPU: they are no speed figure "
      "(see `benchmarks/gpu_suite.py`'s float8 rows for that). The CNN's "
      "convolutions stay in bf16 (float8 covers `dot_general`), and so does "
      "every output head (the default). Per-tensor, rowwise and MXFP8 come "
      "out close to one another: with power-of-two scales e4m3's relative "
      "rounding is the same at any scale, so the granularities differ only "
      "for values near e4m3's subnormal range, rare in models this small.",
  ] + format_tables(results, rows)
  with open(base.with_suffix(".md"), "w") as f:
    f.write("# Float8 training parity: DigitsCNN and CharLM in f32, bf16 and "
            "float8\n\n")
    f.write("\n\n".join(report) + "\n\n")
    f.write(f"![loss curves]({NAME}.png)\n")
  plot(results, str(base.with_suffix(".png")))
  print("\n".join(format_tables(results, rows)[-1:]))
  print(f"{summary}\nWrote {base}.{{md,json,png}} in {wall_s:.0f} s.")
  # A --quick run's figures mean nothing: only a full run's verdicts decide.
  return 1 if failed and not args.quick else 0


if __name__ == "__main__":
  sys.exit(main())
