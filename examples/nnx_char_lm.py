"""A Flax NNX byte-level transformer LM on Python's stdlib, in f32, bf16, f16.

Trains :class:`flax_models.CharLM` (a small decoder-only transformer) to
predict the next byte of the Python standard library's own source code
(``flax_models.load_stdlib_text``: nothing is downloaded) three times, from
the same initial parameters, on the same batches, with the same
hyperparameters; only the precision changes:

* f32: policy ``p=f32,c=f32,o=f32``, ``NoOpLossScale()``;
* bf16: policy ``p=f32,c=bf16,o=f32``, ``NoOpLossScale()``;
* f16 + dynamic loss scaling: policy ``p=f32,c=f16,o=f32``,
  ``DynamicLossScale(2**15, period=...)``.

The text is encoded as UTF-8 bytes (vocabulary 256); its first 90% is the
training split and the last 10% the validation split.

The model is unmodified NNX code. Going from the float32 training loop to a
mixed-precision one changes the lines marked ``# [mixed precision]``:

1. ``jnnx.apply_policy(model, policy)`` runs attention and MLP matmuls in the
   compute dtype and keeps the params (shared with ``model``), the LayerNorms
   and the logits in float32;
2. ``nnx.Optimizer(model, jmp_lite.loss_scaling(optax.adam(...), loss_scale),
   wrt=nnx.Param)`` unscales the gradients, skips non-finite steps and adapts
   the scale;
3. the train step reads the current scale from the optimizer state and
   differentiates ``loss_scale.scale(loss)``.

Run it with::

  python -m examples.nnx_char_lm             # about 3.5 min on 2 CPU cores
  python -m examples.nnx_char_lm --steps 10 --out /tmp/lm   # smoke run

It prints the comparison table and a text sample per run, and writes
``nnx_char_lm.md``, ``nnx_char_lm.json`` and ``nnx_char_lm.png`` (loss curves
and the loss-scale history) to ``--out`` (a scratch folder;
``--update-results`` writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from models import flax_models
import jmp_lite
import jmp_lite.nnx as jnnx

NAME = "nnx_char_lm"
WARMUP_STEPS = 5  # First steps (compilation) left out of the median step time.
SMOOTHING = common.SMOOTHING  # Window of the moving average in the loss plot.
VAL_FRACTION = 0.1
EVAL_BATCH = 64
PROMPT = "    def __init__(self"


def load_splits(max_chars: int):
  """The byte tokens of the stdlib text: ``(train, validation)`` int32 arrays."""
  tokens = flax_models.encode(flax_models.load_stdlib_text(max_chars))
  split = int(len(tokens) * (1 - VAL_FRACTION))
  return tokens[:split], tokens[split:]


def batch_starts(num_tokens: int, seq_len: int, batch_size: int, steps: int,
                 seed: int):
  """Yields each step's window start offsets, uniformly at random (seeded)."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    yield rng.integers(0, num_tokens - seq_len - 1, size=batch_size)


def windows(tokens: np.ndarray, starts, seq_len: int):
  """Inputs ``(B, T)`` and next-token targets ``(B, T)`` at ``starts``."""
  idx = np.asarray(starts)[:, None] + np.arange(seq_len + 1)
  chunk = tokens[idx]
  return chunk[:, :-1], chunk[:, 1:]


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy (nats), in the logits' dtype (float32)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
  """One optimizer step; returns the loss, the scale used, whether applied."""
  loss_scale = jmp_lite.get_loss_scale(optimizer.opt_state)  # [mixed precision]

  def loss_fn(model):
    loss = cross_entropy(model(x), y)
    return loss_scale.scale(loss), loss  # [mixed precision]

  grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  state = optimizer.opt_state  # The LossScaleState.
  return dict(loss=loss, finite=state.last_finite,
              loss_scale=jnp.asarray(loss_scale.loss_scale, jnp.float32))


@nnx.jit
def eval_loss(model, x, y):
  """Mean cross-entropy of a batch of windows."""
  return cross_entropy(model(x), y)


@nnx.jit
def next_token(model, buffer, position, key, temperature):
  """Samples the token after ``buffer[0, position]`` at ``temperature``."""
  logits = model(buffer)[0, position]
  return jax.random.categorical(key, logits / temperature)


def validation_loss(model, val_tokens, seq_len: int, max_windows: int) -> float:
  """Mean loss over non-overlapping validation windows (at most max_windows)."""
  count = min(max_windows, (len(val_tokens) - 1) // seq_len)
  count -= count % EVAL_BATCH if count >= EVAL_BATCH else 0
  starts = np.arange(count) * seq_len
  losses = []
  for i in range(0, count, EVAL_BATCH):
    x, y = windows(val_tokens, starts[i:i + EVAL_BATCH], seq_len)
    losses.append(float(eval_loss(model, x, y)))
  return float(np.mean(losses))


def sample(model, prompt: str, seq_len: int, length: int, seed: int,
           temperature: float) -> str:
  """A seeded sampled continuation of ``prompt`` (sliding window of seq_len).

  Every run uses the same keys, so runs whose logits agree sample the same
  text. (Greedy decoding of models this small and briefly trained falls into
  loops such as ``________``.)
  """
  tokens = list(flax_models.encode(prompt))
  keys = jax.random.split(jax.random.key(seed), length)
  for key in keys:
    context = tokens[-seq_len:]
    buffer = np.zeros((1, seq_len), np.int32)
    buffer[0, :len(context)] = context
    tokens.append(int(next_token(model, buffer, len(context) - 1, key,
                                 temperature)))
  return flax_models.decode(tokens)


def train(spec, data, args) -> dict:
  """Trains the LM under one policy and loss scale; returns its figures."""
  _, label, policy, loss_scale = spec
  train_tokens, val_tokens = data
  module = flax_models.CharLM(
      flax_models.BYTE_VOCAB_SIZE, d_model=args.d_model, num_heads=args.heads,
      num_layers=args.layers, max_len=args.seq_len, rngs=nnx.Rngs(args.seed))
  model = jnnx.apply_policy(module, policy)  # [mixed precision]
  learning_rate = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, min(100, args.steps // 10 + 1), args.steps)
  optimizer = nnx.Optimizer(  # [mixed precision]
      model, jmp_lite.loss_scaling(optax.adam(learning_rate), loss_scale),
      wrt=nnx.Param)

  log = common.StepLog()
  starts = batch_starts(len(train_tokens), args.seq_len, args.batch_size,
                        args.steps, args.seed)
  bar = tqdm(starts, total=args.steps, desc=f"{label:>26}", disable=None,
             dynamic_ncols=True)
  for i, batch in enumerate(bar):
    x, y = windows(train_tokens, batch, args.seq_len)
    start = time.perf_counter()
    log.record(i, start,
               jax.device_get(train_step(model, optimizer, x, y)))
    if i % 10 == 0 or i == args.steps - 1:
      bar.set_postfix(loss=f"{log.losses[-1]:.3f}", scale=f"{log.scales[-1]:g}",
                      skipped=len(log.skipped_at), refresh=False)
  bar.close()

  state = optimizer.opt_state  # The LossScaleState.
  tail = log.losses[-min(50, len(log.losses)):]
  return dict(
      label=label,
      policy=str(jmp_lite.get_policy(policy)),
      loss_scale_type=type(loss_scale).__name__,
      final_train_loss=float(np.mean([v for v in tail if math.isfinite(v)]
                                     or [math.nan])),
      validation_loss=validation_loss(model, val_tokens, args.seq_len,
                                      args.val_windows),
      median_step_ms=log.median_step_ms(WARMUP_STEPS),
      skipped_steps=int(state.skipped_steps),
      final_loss_scale=float(jmp_lite.get_loss_scale(state).loss_scale),
      sample=sample(model, PROMPT, args.seq_len, args.sample_length, args.seed,
                    args.temperature),
      **log.histories(),
  )


def format_table(runs: dict) -> str:
  """The comparison table as GitHub markdown."""
  lines = [
      "| run | policy | final train loss | validation loss | median step (ms) "
      "| skipped steps | final loss scale |",
      "|---|---|--:|--:|--:|--:|--:|",
  ]
  for r in runs.values():
    lines.append(
        f"| {r['label']} | `{r['policy']}` | {r['final_train_loss']:.4f} "
        f"| {r['validation_loss']:.4f} | {r['median_step_ms']:.1f} "
        f"| {r['skipped_steps']} | {r['final_loss_scale']:g} |")
  return "\n".join(lines)


def format_samples(runs: dict) -> str:
  """Each run's text sample, as markdown code blocks."""
  parts = []
  for r in runs.values():
    parts.append(f"**{r['label']}**\n\n```python\n{r['sample']}\n```\n")
  return "\n".join(parts)


def plot(runs: dict, path: str) -> None:
  """Loss curves of every run and the f16 run's loss scale, as a PNG."""
  common.plot_loss_and_scale(
      runs, path, SMOOTHING,
      loss_ylabel=f"train loss, nats ({SMOOTHING}-step avg.)",
      loss_title="CharLM (nnx) training loss")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=500,
                      help="training steps per run (default: %(default)s)")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--lr", type=float, default=2e-3,
                      help="peak learning rate (warm-up, then cosine decay)")
  parser.add_argument("--period", type=int, default=200,
                      help="growth period of the dynamic loss scale")
  parser.add_argument("--max-chars", type=int, default=2_000_000,
                      help="characters of stdlib source to use")
  parser.add_argument("--val-windows", type=int, default=512,
                      help="validation windows of --seq-len to evaluate")
  parser.add_argument("--sample-length", type=int, default=120,
                      help="bytes of sampled text per run")
  parser.add_argument("--temperature", type=float, default=0.8,
                      help="sampling temperature of the text samples")
  parser.add_argument("--seed", type=int, default=0,
                      help="initial parameters and batch order")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  data = load_splits(args.max_chars)
  start = time.perf_counter()
  runs = {spec[0]: train(spec, data, args)
          for spec in common.flax_run_specs(args.period)}
  wall_s = time.perf_counter() - start
  table = format_table(runs)
  print(table)
  print(format_samples(runs))
  config = dict(
      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
      d_model=args.d_model, heads=args.heads, layers=args.layers, lr=args.lr,
      period=args.period, max_chars=args.max_chars,
      temperature=args.temperature, prompt=PROMPT,
      train_tokens=len(data[0]), val_tokens=len(data[1]), seed=args.seed,
      wall_s=round(wall_s, 1), jax=jax.__version__,
      backend=jax.default_backend())
  base = os.path.join(args.out, NAME)
  with open(base + ".json", "w") as f:
    json.dump(dict(config=config, runs=runs), f, indent=1)
  with open(base + ".md", "w") as f:
    f.write(
        "# CharLM (Flax NNX) on the Python stdlib's source: f32 vs bf16 vs "
        "f16\n\n"
        f"`python -m examples.{NAME}` — byte-level transformer "
        f"(d_model {args.d_model}, {args.layers} layers, {args.heads} heads), "
        f"{args.steps} steps per run, batch {args.batch_size} x "
        f"{args.seq_len} bytes, Adam with peak lr {args.lr:g} (warm-up, "
        f"cosine decay), seed {args.seed}; {len(data[0])} train / "
        f"{len(data[1])} validation bytes; {wall_s:.0f} s in all on "
        f"{jax.default_backend()} (jax {jax.__version__}). Losses in nats "
        "per byte; the train loss is the mean of the last 50 steps.\n\n"
        f"{table}\n\nSamples (prompt {PROMPT!r}, temperature "
        f"{args.temperature:g}, the same keys for every run):\n\n"
        f"{format_samples(runs)}")
  plot(runs, base + ".png")
  print(f"Wrote {base}.{{md,json,png}} in {wall_s:.0f} s.")
  finite = all(math.isfinite(r["validation_loss"]) for r in runs.values())
  return 0 if finite else 1


if __name__ == "__main__":
  sys.exit(main())
