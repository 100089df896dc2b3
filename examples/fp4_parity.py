"""FP4 training parity: a tiny decoder LM in bf16, NVFP4 (and its ablations)
and MXFP4, with the NVFP4 paper's criteria.

Trains a 4-block pre-LayerNorm decoder LM (linen) on the Python standard
library's source bytes under each recipe, from the same initial variables, on
the same batches, with the same hyperparameters; only the precision of the
block matmuls changes:

* ``bf16``: every matmul in bfloat16 with float32 accumulation and float32
  params (the reference);
* ``nvfp4``: NVIDIA's recipe (1x16 E2M1 blocks, E4M3 block scales under a
  float32 tensor scale, 16x16 weight tiles, random Hadamard transform on the
  weight-gradient operands, stochastic rounding of gradients) in the q/k/v/out
  projections and the MLP of the first 75% of the blocks;
* ``nvfp4_switch``: the same, with the forward pass switched to bf16 for the
  last 20% of the steps (the paper's appendix D; one recompile:
  ``Fp4Config(quantize_forward=False)``);
* ``mxfp4``: 1x32 E2M1 blocks with E8M0 scales (Tseng et al.'s backward:
  random Hadamard transform and stochastic rounding);
* ``nvfp4_no_sr``, ``nvfp4_no_rht``, ``nvfp4_no_2d``: NVFP4 without one
  component each (Transformer Engine's ``disable_*`` switches).

The last 25% of the blocks, the attention scores and softmax, the embeddings,
the output head and the norms stay in bf16/f32 in every run (the paper keeps
the last blocks in bf16). Each FP4 layer is an unmodified ``nn.Dense`` with
Flax's own hook, ``dot_general=functools.partial(fp4.dot_general,
config=..., key=...)``; the stochastic-rounding key of each matmul is
``self.make_rng("fp4")``, from a per-step key ``fold_in(base, step)``.

**The criteria** (NVFP4 paper, "Pretraining Large Language Models with NVFP4",
2025): the final validation loss within 1.5% (relative) of bf16's, within
0.5% with the late switch; every run's gap is reported with its spread over
seeds, whether it meets the criterion or not. Ablations and MXFP4 are held to
1.5% too. The same script measures, on the bf16-trained model, each block's
FP4 error (``diagnostics.fp8_stats(..., fmt="e2m1")``) and reports whether
the blocks with the largest error are the final ones (the paper's keep-list).

Run it with::

  python -m examples.fp4_parity             # about 10-20 min on 2 shared CPU cores
  python -m examples.fp4_parity --quick --out /tmp/fp4   # the smoke run

It writes ``fp4_parity.md`` and ``fp4_parity.json`` to ``--out`` (a scratch
folder; ``--update-results`` writes ``examples/results/``) and exits with
status 1 if a run misses its criterion (not with --quick). On CPU FP4 is an
exact emulation (dequantized blocks, one float32 dot): the step times are the
emulation's cost, not a speed figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import common
from models import flax_models
from jmp_lite import diagnostics
from jmp_lite import fp4

NAME = "fp4_parity"
REFERENCE = "bf16"
#: (name, label, Fp4Config or None, late switch).
RUNS = (
    ("bf16", "bf16", None, False),
    ("nvfp4", "NVFP4", fp4.Fp4Config("nvfp4"), False),
    ("nvfp4_switch", "NVFP4, forward in bf16 for the last 20%",
     fp4.Fp4Config("nvfp4"), True),
    ("mxfp4", "MXFP4", fp4.Fp4Config("mxfp4"), False),
    ("nvfp4_no_sr", "NVFP4 without stochastic rounding",
     fp4.Fp4Config("nvfp4", stochastic_rounding=False), False),
    ("nvfp4_no_rht", "NVFP4 without the Hadamard transform",
     fp4.Fp4Config("nvfp4", rht=False), False),
    ("nvfp4_no_2d", "NVFP4 without 16x16 weight tiles",
     fp4.Fp4Config("nvfp4", two_d_weights=False), False),
)
#: The paper's criteria: relative final-loss gap to bf16, in percent.
GAP = 1.5
SWITCH_GAP = 0.5
#: The share of the steps run with the forward pass in bf16 (late switch).
SWITCH_SHARE = 0.2
#: The share of the blocks kept in bf16 (the last ones).
KEEP_SHARE = 0.25
PROJECTIONS = ("q", "k", "v", "o", "up", "down")
TAIL = 50  # Final train loss: the mean of the last TAIL steps.
WARMUP_STEPS = 5
#: Sized to fit 10-20 min on 2 shared CPU cores (the committed run: 584 s;
#: 7 runs x 2 seeds, the first seed's compiles about half of it): 300 steps of
#: 8 windows of 32 bytes.
FULL = dict(steps=300, seeds=(0, 1), d_model=64, heads=4, blocks=4,
            seq_len=32, batch=8, max_chars=400_000, val_windows=256,
            runs=tuple(name for name, *_ in RUNS))
QUICK = dict(steps=3, seeds=(0,), d_model=32, heads=2, blocks=4, seq_len=16,
             batch=2, max_chars=20_000, val_windows=4,
             runs=("bf16", "nvfp4_switch"))


# -- the model -------------------------------------------------------------------


class Block(nn.Module):
  """A pre-LayerNorm decoder block; its six projections take ``dot_general``."""

  d_model: int
  heads: int
  config: fp4.Fp4Config | None

  def dense(self, name: str, x: jax.Array, features: int) -> jax.Array:
    # The matmul's input and output gradient are observable for diagnostics:
    # sow (inputs) and perturb (the gradient flowing into the output).
    self.sow("inputs", f"{name}_in", x)
    hook = None
    if self.config is not None:
      hook = functools.partial(fp4.dot_general, config=self.config,
                               key=self.make_rng("fp4"))
    y = nn.Dense(features, dtype=jnp.bfloat16, dot_general=hook,
                 name=name)(x)
    return self.perturb(f"{name}_out", y)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    head_dim = self.d_model // self.heads
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.bfloat16)
    q, k, v = (self.dense(n, h, self.d_model).reshape(b, t, self.heads,
                                                      head_dim)
               for n in ("q", "k", "v"))
    # Attention scores and softmax: bf16 operands, float32 softmax.
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                        preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
    att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.d_model)
    x = x + self.dense("o", att, self.d_model).astype(jnp.float32)
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.bfloat16)
    h = nn.gelu(self.dense("up", h, 4 * self.d_model))
    return x + self.dense("down", h, self.d_model).astype(jnp.float32)


class TinyLM(nn.Module):
  """Byte embeddings, ``blocks`` decoder blocks (the first ones in FP4 when
  ``config`` is given, the last ``keep`` in bf16), a final norm, a bf16
  head."""

  vocab: int
  d_model: int
  heads: int
  blocks: int
  keep: int
  max_len: int
  config: fp4.Fp4Config | None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.d_model)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02),
                     (self.max_len, self.d_model))
    x = x + pos[:tokens.shape[1]]
    for i in range(self.blocks):
      in_fp4 = i < self.blocks - self.keep
      x = Block(self.d_model, self.heads, self.config if in_fp4 else None,
                name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.bfloat16)
    return nn.Dense(self.vocab, dtype=jnp.bfloat16, name="head")(x).astype(
        jnp.float32)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def lm_windows(tokens: np.ndarray, starts, seq_len: int):
  idx = np.asarray(starts)[:, None] + np.arange(seq_len + 1)
  chunk = tokens[idx]
  return chunk[:, :-1], chunk[:, 1:]


def make_model(s: dict, config) -> TinyLM:
  keep = max(1, round(KEEP_SHARE * s["blocks"]))
  return TinyLM(flax_models.BYTE_VOCAB_SIZE, s["d_model"], s["heads"],
                s["blocks"], keep, s["seq_len"], config)


def late_config(config):
  """The late switch's config: the same recipe, the forward pass in bf16."""
  return None if config is None else dataclasses.replace(
      config, quantize_forward=False)


def schedule(steps: int, lr: float):
  return optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 10 + 1),
                                            steps)


@functools.lru_cache(maxsize=None)
def compiled(config, key: tuple):
  """The jitted train step and validation loss of one model (cached: every
  seed of a run, and both phases of the late switch, reuse them)."""
  s = dict(key)
  model = make_model(s, config)
  opt = optax.adam(schedule(s["steps"], s["lr"]))

  @jax.jit
  def step(params, opt_state, x, y, step_key):
    def loss_fn(p):
      logits = model.apply({"params": p}, x, rngs={"fp4": step_key})
      return cross_entropy(logits, y)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def eval_loss(params, x, y):
    logits = model.apply({"params": params}, x,
                         rngs={"fp4": jax.random.key(0)})
    return cross_entropy(logits, y)

  return step, eval_loss


def _key(s: dict, lr: float) -> tuple:
  return tuple(sorted((k, s[k]) for k in ("steps", "d_model", "heads",
                                          "blocks", "seq_len"))) + (
                                              ("lr", lr),)


def train(name: str, s: dict, data, seed: int, lr: float) -> dict:
  """Trains one run; returns its figures."""
  _, _, config, switch = next(r for r in RUNS if r[0] == name)
  train_tokens, val_tokens = data
  steps = s["steps"]
  switch_at = steps - int(round(SWITCH_SHARE * steps)) if switch else steps
  key = _key(s, lr)
  phases = (compiled(config, key), compiled(late_config(config), key))
  x0 = jnp.zeros((1, s["seq_len"]), jnp.int32)
  params = make_model(s, None).init(jax.random.key(seed), x0)["params"]
  opt_state = optax.adam(schedule(steps, lr)).init(params)
  # Stochastic rounding: one key per step (fold_in of the step counter);
  # each FP4 matmul draws its own from it with make_rng("fp4").
  base_key = jax.random.key(1000 + seed)
  rng = np.random.default_rng(seed)
  batches = [rng.integers(0, len(train_tokens) - s["seq_len"] - 1,
                          size=s["batch"]) for _ in range(steps)]
  losses, step_ms = [], []
  for i, starts in enumerate(batches):
    x, y = lm_windows(train_tokens, starts, s["seq_len"])
    step = phases[int(i >= switch_at)][0]
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, x, y,
                                   jax.random.fold_in(base_key, i))
    losses.append(float(loss))
    step_ms.append(1e3 * (time.perf_counter() - t0))
  # Evaluation: the run's final forward pass (the late switch's is bf16).
  eval_loss = phases[int(switch_at < steps)][1]
  count = min(s["val_windows"], (len(val_tokens) - 1) // s["seq_len"])
  starts = np.arange(count) * s["seq_len"]
  val = [float(eval_loss(params, *lm_windows(val_tokens, c, s["seq_len"])))
         for c in np.array_split(starts, max(1, count // 64))]
  return dict(validation_loss=float(np.mean(val)),
              final_train_loss=float(np.mean(losses[-TAIL:])),
              median_step_ms=float(np.median(step_ms[WARMUP_STEPS:]
                                             or step_ms)),
              switch_step=switch_at if switch else None,
              loss_history=losses, params=params)


# -- diagnostics: which blocks FP4 hurts most ------------------------------------


def block_diagnostics(s: dict, params, data) -> dict:
  """Per block, the FP4 error of every projection's activations, weights and
  gradients (the bf16-trained model, one training batch), the advice and
  whether the blocks with the largest error are the final ones."""
  model = make_model(s, None)
  train_tokens, _ = data
  starts = np.random.default_rng(123).integers(
      0, len(train_tokens) - s["seq_len"] - 1, size=s["batch"])
  x, y = lm_windows(train_tokens, starts, s["seq_len"])
  variables = model.init(jax.random.key(0), x)
  perturbations = variables["perturbations"]

  @jax.jit
  def measure(params, perturbations):
    def loss_fn(perturbations):
      logits, state = model.apply(
          {"params": params, "perturbations": perturbations}, x,
          mutable=["inputs"])
      return cross_entropy(logits, y), state["inputs"]

    grads, inputs = jax.grad(loss_fn, has_aux=True)(perturbations)
    stats = {}
    for i in range(s["blocks"]):
      block = f"block_{i}"
      for proj in PROJECTIONS:
        name = f"{block}/{proj}"
        stats[f"{name}/activation"] = diagnostics.fp8_stats(
            inputs[block][f"{proj}_in"][0], "activation", fmt="e2m1")
        stats[f"{name}/weight"] = diagnostics.fp8_stats(
            params[block][proj]["kernel"], "weight", fmt="e2m1")
        stats[f"{name}/gradient"] = diagnostics.fp8_stats(
            grads[block][f"{proj}_out"], "gradient", fmt="e2m1")
    return stats

  stats = measure(params, perturbations)
  advice = diagnostics.advise(stats, by=lambda path: path.split("/")[0])
  keep = max(1, round(KEEP_SHARE * s["blocks"]))
  final = [f"block_{i}" for i in range(s["blocks"] - keep, s["blocks"])]
  picked = list(advice.ranking[:keep])
  per_block = {}
  for block, roles in advice.stats.items():
    per_block[block] = {
        role: {recipe: dict(snr_db=float(st.snr(recipe)),
                            error=float(st.error(recipe)),
                            clipped=float(st.fraction("clipped", recipe)),
                            flushed=float(st.fraction("flushed", recipe)))
               for recipe in st.recipes}
        for role, st in roles.items()}
  return dict(ranking=list(advice.ranking), keep_out=list(advice.keep_out),
              recipe=dict(advice.granularity), final_blocks=final,
              top_by_error=picked,
              picks_final_blocks=sorted(picked) == sorted(final),
              per_block=per_block, advice=str(advice))


# -- the report ------------------------------------------------------------------


def gaps(results: dict) -> list[dict]:
  """Per FP4 run: the relative validation-loss gap to bf16 of each seed,
  their mean and spread, the criterion and whether every seed meets it."""
  rows = []
  names = [n for n, *_ in RUNS if n != REFERENCE
           and all(n in r for r in results.values())]
  for name in names:
    per_seed = {
        seed: 100.0 * (r[name]["validation_loss"] -
                       r[REFERENCE]["validation_loss"]) /
        r[REFERENCE]["validation_loss"]
        for seed, r in results.items()}
    values = list(per_seed.values())
    criterion = SWITCH_GAP if name == "nvfp4_switch" else GAP
    rows.append(dict(
        run=name, gap_percent=per_seed, mean=float(np.mean(values)),
        spread=float(max(values) - min(values)), criterion=criterion,
        passed=all(math.isfinite(v) and v <= criterion for v in values)))
  return rows


def format_report(s, results, rows, diag, wall_s, lr) -> list[str]:
  labels = {name: label for name, label, *_ in RUNS}
  runs = ["| run | seed | validation loss | final train loss | median step "
          "(ms, CPU emulation) |", "|---|--:|--:|--:|--:|"]
  for name, *_ in RUNS:
    for seed, r in results.items():
      if name in r:
        f = r[name]
        runs.append(f"| {labels[name]} | {seed} | {f['validation_loss']:.4f} "
                    f"| {f['final_train_loss']:.4f} "
                    f"| {f['median_step_ms']:.1f} |")
  seeds = list(results)
  verdict = ["| run | gap to bf16 per seed (%) | mean (%) | spread over seeds "
             "(pt) | criterion | verdict |", "|---|---|--:|--:|--:|:-:|"]
  for row in rows:
    per_seed = ", ".join(f"{row['gap_percent'][sd]:+.3f}" for sd in seeds)
    verdict.append(
        f"| {labels[row['run']]} | {per_seed} | {row['mean']:+.3f} "
        f"| {row['spread']:.3f} | ≤ {row['criterion']:g}% "
        f"| {'meets' if row['passed'] else 'MISSES'} |")
  ref = [r[REFERENCE]["validation_loss"] for r in results.values()]
  bf16_spread = (100.0 * (max(ref) - min(ref)) / min(ref)
                 if len(ref) > 1 else None)
  met = sum(r["passed"] for r in rows)
  out = [
      f"`python -m examples.{NAME}{' --quick' if s.get('quick') else ''}`: "
      f"seeds {seeds}; {s['steps']} Adam steps (peak lr {lr:g}, warm-up + "
      f"cosine decay) of {s['batch']} windows of {s['seq_len']} bytes; "
      f"d_model {s['d_model']}, {s['blocks']} blocks ({s['heads']} heads), the "
      f"last {max(1, round(KEEP_SHARE * s['blocks']))} in bf16; the late "
      f"switch runs the last {SWITCH_SHARE:.0%} of the steps with the forward "
      f"pass in bf16. Validation over {s['val_windows']} windows. Every run of "
      "a seed starts from the same variables and sees the same batches. "
      f"{wall_s:.0f} s in all on {jax.default_backend()} (jax "
      f"{jax.__version__}).",
      f"**Criteria** (NVFP4 paper): final validation loss within {GAP}% "
      f"(relative) of bf16's, within {SWITCH_GAP}% with the late switch; a "
      "run meets it only if every seed does. **"
      f"{met} of {len(rows)} runs meet their criterion.**"
      + (f" For scale, bf16 itself moves by {bf16_spread:.3f}% from one seed "
         "to another." if bf16_spread is not None else ""),
      "## Final-loss gap to bf16", "\n".join(verdict),
      "## Every run", "\n".join(runs),
  ]
  if diag is not None:
    ranking = ", ".join(diag["ranking"])
    out += [
        "## Diagnostics: which blocks FP4 hurts most",
        "The bf16-trained model of seed "
        f"{seeds[0]}, one training batch: every projection's activations, "
        "weights and gradients measured with `diagnostics.fp8_stats(..., "
        "fmt=\"e2m1\")` and grouped per block by `diagnostics.advise` "
        "(largest mean row error under NVFP4 first). Ranking: "
        f"{ranking}. The final blocks ({', '.join(diag['final_blocks'])}) "
        + ("**are** the ones with the largest error: the metric picks the "
           "paper's keep-list." if diag["picks_final_blocks"] else
           f"are **not** the top of the ranking ({', '.join(diag['top_by_error'])}"
           " is): on this model the metric does not pick the paper's "
           "keep-list.")
        + " Blocks kept out of FP4 by the advice's limit (mean row error "
        f"above 25%): {', '.join(diag['keep_out']) or 'none'}.",
        diag["advice"],
    ]
  return out


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a few steps, one seed (a smoke run for the tests: "
                      "its figures mean nothing)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None)
  parser.add_argument("--steps", type=int, default=None,
                      help=f"steps per run (default {FULL['steps']})")
  parser.add_argument("--runs", nargs="+", default=None,
                      choices=[name for name, *_ in RUNS],
                      help="the runs (default: all; bf16 is always trained)")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="peak learning rate")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  for key in ("seeds", "steps", "runs"):
    value = getattr(args, key)
    if value is not None:
      settings[key] = tuple(value) if isinstance(value, list) else value
  settings["runs"] = tuple(n for n, *_ in RUNS
                           if n in set(settings["runs"]) | {REFERENCE})
  if settings["steps"] < 1:
    parser.error("--steps must be at least 1")
  if args.quick and args.update_results:
    parser.error("--quick runs are smoke runs: they never replace the "
                 "committed results")
  settings["quick"] = args.quick
  args.settings = settings
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  s = args.settings
  start = time.perf_counter()
  tokens = flax_models.encode(flax_models.load_stdlib_text(s["max_chars"]))
  split = int(0.9 * len(tokens))
  data = (tokens[:split], tokens[split:])
  results, diag = {}, None
  for seed in s["seeds"]:
    results[seed] = {}
    for name in s["runs"]:
      t0 = time.perf_counter()
      results[seed][name] = train(name, s, data, seed, args.lr)
      print(f"seed {seed} {name:>13}: {time.perf_counter() - t0:5.1f} s, val "
            f"loss {results[seed][name]['validation_loss']:.4f}", flush=True)
    if diag is None:
      diag = block_diagnostics(s, results[seed][REFERENCE]["params"], data)
  for runs in results.values():
    for r in runs.values():
      del r["params"]
  wall_s = time.perf_counter() - start
  rows = gaps(results)
  report = format_report(s, results, rows, diag, wall_s, args.lr)
  base = args.out / NAME
  config = dict(quick=args.quick, seeds=list(s["seeds"]), steps=s["steps"],
                batch=s["batch"], seq_len=s["seq_len"], d_model=s["d_model"],
                heads=s["heads"], blocks=s["blocks"], keep_share=KEEP_SHARE,
                switch_share=SWITCH_SHARE, lr=args.lr,
                optimizer="adam, warm-up + cosine decay",
                criteria=dict(gap_percent=GAP, switch_gap_percent=SWITCH_GAP,
                              source="Pretraining Large Language Models with "
                              "NVFP4 (NVIDIA, 2025), section 4 and appendix D"),
                wall_s=round(wall_s, 1), jax=jax.__version__,
                backend=jax.default_backend())
  diag_json = None if diag is None else {k: v for k, v in diag.items()
                                         if k != "advice"}
  common.write_json(base.with_suffix(".json"), dict(
      config=config, gaps=rows, diagnostics=diag_json,
      runs={str(seed): r for seed, r in results.items()}))
  with open(base.with_suffix(".md"), "w") as f:
    f.write("# FP4 training parity: a tiny decoder LM in bf16, NVFP4 and "
            "MXFP4\n\n")
    f.write("\n\n".join(report) + "\n")
  print("\n".join(report[2:4]))
  print(f"Wrote {base}.{{md,json}} in {wall_s:.0f} s.")
  failed = [r for r in rows if not r["passed"]]
  return 1 if failed and not args.quick else 0


if __name__ == "__main__":
  sys.exit(main())
