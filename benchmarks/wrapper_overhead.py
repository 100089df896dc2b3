"""Overhead of ``jmp_lite.loss_scaling`` against a hand-written jmp-style step.

The question: does a jitted train step written with the optimizer wrapper
(``loss_scaling`` + ``get_loss_scale`` + ``scaled_value_and_grad``) cost more
than the same step written by hand the way jmp users write it (scale the loss,
unscale the grads, ``all_finite``, ``adjust``, ``select_tree`` over params and
optimizer state)? Target: median step-time ratio (a)/(b) <= 1.03.

Both steps run the same model, policy (params f32, compute f16 or bf16, output
f32), Adam and ``DynamicLossScale``; before timing, the script checks that they
produce the same params, loss scale and losses.

Method: each step is compiled ahead of time (``jax.jit(...).lower(...).compile()``,
timed), run a few steps (the equivalence check, which doubles as warm-up), then
timed in blocks of ``--steps`` steps, (a) and (b) interleaved in this process
and alternating which goes first, ``--repeats`` times. Each block ends with
``jax.block_until_ready``. Per-step time is block time / steps; the report gives
the median and interquartile range of the per-step times and of the per-repeat
ratios (a)/(b). Short blocks keep each (a)/(b) pair close in time, so load from
other processes affects both alike; the same ratio computed from the process's
CPU time (``time.process_time``) is reported as a cross-check.

Run from the repository root::

  python -m benchmarks.wrapper_overhead              # full run, ~1-3 min on 2 CPU cores
  python -m benchmarks.wrapper_overhead --update-results   # ... into benchmarks/results/
  python -m benchmarks.wrapper_overhead --quick --out /tmp/wo   # smoke test

Writes ``wrapper_overhead.json`` (machine, config, figures) and
``wrapper_overhead.md`` (the table, with the command line) to ``--out`` (a
scratch folder by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from benchmarks import common
from benchmarks.common import Batch
from benchmarks.common import compile_step
from benchmarks.common import fresh_copy
from benchmarks.common import make_hand_step
from benchmarks.common import make_jmp_lite_step
from benchmarks.common import Params
from benchmarks.common import run_steps
from benchmarks.common import State
from benchmarks.common import Step
from benchmarks.common import summarize
from benchmarks.common import time_interleaved
from benchmarks.models import apply_conv
from benchmarks.models import apply_mlp
from benchmarks.models import init_conv
from benchmarks.models import init_mlp

TARGET_RATIO = 1.03
INITIAL_SCALE = 2.0**15
LEARNING_RATE = 1e-3
CHECK_STEPS = 8
CHECK_ATOL = 1e-5
CHECK_RTOL = 1e-4
VARIANTS = ("jmp_lite", "hand", "raise")
#: The stall guard's limit in the "raise" variant: never reached here, so the
#: variant measures what the guard costs on every step (a host callback).
GUARD_LIMIT = 1000


@dataclasses.dataclass(frozen=True)
class Workload:
  """One model at one size and compute dtype.

  Attributes:
    model: ``"mlp"`` or ``"conv"``.
    compute: compute dtype name for the policy, ``"f16"`` or ``"bf16"``.
    batch: batch size.
    sizes: MLP layer widths including input and output, e.g. (784, 1024, 10);
      for the conv net (image side, channels 1, channels 2, classes).
  """

  model: str
  compute: str
  batch: int
  sizes: tuple[int, ...]

  @property
  def name(self) -> str:
    return f"{self.model}-{self.compute}"

  @property
  def policy(self) -> jmp_lite.Policy:
    return jmp_lite.get_policy(f"p=f32,c={self.compute},o=f32")

  def describe(self) -> str:
    if self.model == "mlp":
      return f"MLP {'->'.join(map(str, self.sizes))}, batch {self.batch}"
    side, c1, c2, classes = self.sizes
    return (
        f"conv {side}x{side}x1 -> 3x3x{c1} -> 3x3x{c2}/2 -> {classes}, "
        f"batch {self.batch}"
    )


def make_workloads(models: list[str], computes: list[str], quick: bool) -> list[Workload]:
  """The workloads to run, at full or smoke-test (``quick``) size."""
  shapes = {
      "mlp": (8, (16, 32, 32, 10)) if quick else (256, (784, 1024, 1024, 10)),
      "conv": (4, (8, 4, 8, 10)) if quick else (64, (28, 16, 32, 10)),
  }
  return [
      Workload(model, compute, *shapes[model])
      for model in models
      for compute in computes
  ]


MODELS = {"mlp": (init_mlp, apply_mlp), "conv": (init_conv, apply_conv)}


def make_batch(key: jax.Array, workload: Workload) -> Batch:
  """A fixed synthetic batch: float32 inputs and int32 labels."""
  kx, ky = jax.random.split(key)
  if workload.model == "mlp":
    shape = (workload.batch, workload.sizes[0])
  else:
    side = workload.sizes[0]
    shape = (workload.batch, side, side, 1)
  classes = workload.sizes[-1]
  return {
      "x": jax.random.normal(kx, shape, jnp.float32),
      "y": jax.random.randint(ky, (workload.batch,), 0, classes, jnp.int32),
  }


def make_loss_fn(apply_fn: Callable[..., jax.Array], policy: jmp_lite.Policy):
  """Cross-entropy computed under ``policy``; the loss is float32."""

  def loss_fn(params: Params, batch: Batch) -> jax.Array:
    params, x = policy.cast_to_compute((params, batch["x"]))
    logits = apply_fn(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]
    ).mean()

  return loss_fn



# --- equivalence check and timing -------------------------------------------


def check_same(
    fns: dict[str, Step], states: dict[str, State], batch: Batch
) -> tuple[dict[str, State], dict[str, Any]]:
  """Runs both steps ``CHECK_STEPS`` times and compares params, scale and losses."""
  losses = {}
  for name in fns:
    states[name], losses[name] = run_steps(fns[name], states[name], batch, CHECK_STEPS)
  jax.block_until_ready(states)
  params_a, opt_state_a = states["jmp_lite"]
  params_b, _, scale_b = states["hand"]
  diffs = [
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree_util.tree_leaves(params_a), jax.tree_util.tree_leaves(params_b))
  ]
  close = all(
      np.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_ATOL)
      for a, b in zip(jax.tree_util.tree_leaves(params_a), jax.tree_util.tree_leaves(params_b))
  )
  scale_a = float(jmp_lite.get_loss_scale(opt_state_a).loss_scale)
  loss_diff = float(
      np.max(np.abs(np.asarray(losses["jmp_lite"]) - np.asarray(losses["hand"])))
  )
  result = {
      "steps": CHECK_STEPS,
      "max_abs_param_diff": max(diffs),
      "max_abs_loss_diff": loss_diff,
      "loss_scale": {"jmp_lite": scale_a, "hand": float(scale_b.loss_scale)},
      "skipped_steps": int(opt_state_a.skipped_steps),
      "rtol": CHECK_RTOL,
      "atol": CHECK_ATOL,
  }
  result["same"] = bool(
      close and scale_a == result["loss_scale"]["hand"]
      and np.allclose(losses["jmp_lite"], losses["hand"], rtol=CHECK_RTOL, atol=CHECK_ATOL)
  )
  return states, result


def run_workload(workload: Workload, steps: int, repeats: int, seed: int) -> dict[str, Any]:
  """Builds, checks and times both steps for one workload."""
  init_fn, apply_fn = MODELS[workload.model]
  key_params, key_batch = jax.random.split(jax.random.PRNGKey(seed))
  params = init_fn(key_params, workload.sizes)
  batch = make_batch(key_batch, workload)
  loss_fn = make_loss_fn(apply_fn, workload.policy)

  inner = optax.adam(LEARNING_RATE)
  opt = jmp_lite.loss_scaling(inner, jmp_lite.DynamicLossScale(INITIAL_SCALE))
  guarded = jmp_lite.loss_scaling(
      inner, jmp_lite.DynamicLossScale(INITIAL_SCALE),
      max_consecutive_skips=GUARD_LIMIT, on_max_skips="raise")
  states = {
      "jmp_lite": fresh_copy((params, opt.init(params))),
      "raise": fresh_copy((params, guarded.init(params))),
      "hand": fresh_copy(
          (params, inner.init(params), jmp_lite.DynamicLossScale(INITIAL_SCALE))
      ),
  }
  steps_fns = {
      "jmp_lite": make_jmp_lite_step(loss_fn, opt),
      "hand": make_hand_step(loss_fn, inner),
      "raise": make_jmp_lite_step(loss_fn, guarded),
  }
  fns, compile_info = {}, {}
  for name in VARIANTS:
    fns[name], compile_info[name] = compile_step(steps_fns[name], states[name], batch)

  states, check = check_same(fns, states, batch)
  check["raise_same"] = bool(all(
      np.array_equal(a, b) for a, b in zip(
          jax.tree_util.tree_leaves(states["raise"][0]),
          jax.tree_util.tree_leaves(states["jmp_lite"][0]))))
  print(
      f"[{workload.name}] check after {check['steps']} steps: same={check['same']} "
      f"max|dparams|={check['max_abs_param_diff']:.3g} "
      f"max|dloss|={check['max_abs_loss_diff']:.3g} "
      f"scale={check['loss_scale']} skipped={check['skipped_steps']}",
      flush=True,
  )
  if not (check["same"] and check["raise_same"]):
    raise SystemExit(
        f"{workload.name}: the two steps do not compute the same thing "
        f"({check}); timing them against each other would be meaningless."
    )

  per_step = time_interleaved(fns, states, batch, steps, repeats, VARIANTS)
  ratio, cpu_ratio = (
      summarize([a / b for a, b in zip(times["jmp_lite"], times["hand"])])
      for times in (per_step["wall"], per_step["cpu"])
  )
  guard_ratio = summarize([a / b for a, b in zip(per_step["wall"]["raise"],
                                                 per_step["wall"]["jmp_lite"])])
  result = {
      "workload": workload.name,
      "description": workload.describe(),
      "model": workload.model,
      "policy": str(workload.policy),
      "batch": workload.batch,
      "sizes": list(workload.sizes),
      "param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
      "loss_scale": f"DynamicLossScale({INITIAL_SCALE:g})",
      "optimizer": f"adam({LEARNING_RATE:g})",
      "check": check,
      "compile": compile_info,
      "step_time_s": {name: summarize(per_step["wall"][name]) for name in VARIANTS},
      "ratio_a_over_b": ratio,
      "cpu_time_s": {name: summarize(per_step["cpu"][name]) for name in VARIANTS},
      "cpu_ratio_a_over_b": cpu_ratio,
      "raise_over_a": guard_ratio,
      "within_target": bool(ratio["median"] <= TARGET_RATIO),
  }
  print(
      f"[{workload.name}] (a) {result['step_time_s']['jmp_lite']['median'] * 1e3:.3f} ms"
      f"  (b) {result['step_time_s']['hand']['median'] * 1e3:.3f} ms"
      f"  ratio {ratio['median']:.4f} [IQR {ratio['q25']:.4f}-{ratio['q75']:.4f}]"
      f"  CPU-time ratio {cpu_ratio['median']:.4f}"
      f"  on_max_skips='raise' / (a) {guard_ratio['median']:.4f}",
      flush=True,
  )
  return result


# --- reporting ----------------------------------------------------------------


def markdown_table(report: dict[str, Any]) -> str:
  """The results as a markdown page (what ``wrapper_overhead.md`` holds)."""
  config = report["config"]
  lines = common.report_header(
      "Wrapper overhead: `loss_scaling` vs a hand-written jmp-style step",
      report) + [
      f"(a) `loss_scaling(adam)` + `get_loss_scale` + `scaled_value_and_grad`;"
      " (b) the same step by hand: scale, grad, unscale, `all_finite`, `adjust`,"
      " `select_tree` over params and Adam state; (c) = (a) with the stall "
      f"guard raising (`max_consecutive_skips={GUARD_LIMIT}, "
      "on_max_skips=\"raise\"`, never reached: the cost of its host callback "
      "on every step). All: Adam"
      f"({LEARNING_RATE:g}), `DynamicLossScale({INITIAL_SCALE:g})`, params f32,"
      " `jax.jit` with the state donated, compiled ahead of time.",
      "",
      f"Per-step time: median over {config['repeats']} blocks of "
      f"{config['steps']} steps, (a) and (b) interleaved in one process, "
      "alternating which goes first. Ratio: median of the per-block ratios "
      "(a)/(b) and its interquartile range; the CPU-time ratio is the same "
      "from the process's CPU time, less sensitive to other processes. "
      f"Target: wall-clock ratio <= {TARGET_RATIO}.",
      "",
      "| workload | policy | (a) ms/step | (b) ms/step | ratio (a)/(b) "
      "| ratio IQR | <= 1.03 | CPU-time ratio | compile (a) / (b) s "
      "| kernels (a) / (b) | (c) / (a) |",
      "|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    a, b = r["step_time_s"]["jmp_lite"], r["step_time_s"]["hand"]
    ratio, cpu_ratio = r["ratio_a_over_b"], r["cpu_ratio_a_over_b"]
    compile_a, compile_b = r["compile"]["jmp_lite"], r["compile"]["hand"]
    lines.append(
        f"| {r['workload']}: {r['description']} | `{r['policy']}` "
        f"| {a['median'] * 1e3:.2f} | {b['median'] * 1e3:.2f} "
        f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
        f"| {'yes' if r['within_target'] else 'no'} "
        f"| {cpu_ratio['median']:.3f} "
        f"| {compile_a['total_s']:.2f} / {compile_b['total_s']:.2f} "
        f"| {compile_a['entry_kernels']} / {compile_b['entry_kernels']} "
        f"| {r['raise_over_a']['median']:.3f} |"
    )
  lines += [
      "",
      "Compile: `jax.jit(step).lower(...)` plus `.compile()`. Kernels: "
      "instructions in the optimized HLO's ENTRY computation (fusions, dots, "
      "convolutions, copies). Before timing, each pair was run "
      f"{CHECK_STEPS} steps from the same params and checked to give the same "
      "params, loss scale and losses. Full figures: `wrapper_overhead.json`.",
      "",
  ]
  return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.wrapper_overhead",
      description=(
          "Step-time overhead of jmp_lite.loss_scaling against a hand-written "
          "jmp-style loss-scaled train step."
      ),
  )
  common.add_timing_args(parser, steps=(4, 2), repeats=(41, 3))
  parser.add_argument("--models", default="mlp,conv",
                      help="comma-separated subset of: mlp, conv (default both)")
  args = common.finish_timing_args(parser, parser.parse_args(argv))
  args.models = common.split_choices(parser, args.models, MODELS, "model")
  return args


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  config = {
      "steps": args.steps,
      "repeats": args.repeats,
      "quick": args.quick,
      "seed": args.seed,
      "check_steps": CHECK_STEPS,
      "target_ratio": TARGET_RATIO,
      "initial_loss_scale": INITIAL_SCALE,
      "learning_rate": LEARNING_RATE,
      "variants": {
          "jmp_lite": "loss_scaling(adam) + get_loss_scale + scaled_value_and_grad",
          "hand": "scale/grad/unscale + all_finite + adjust + select_tree(params, opt_state)",
          "raise": f"(a) with max_consecutive_skips={GUARD_LIMIT}, on_max_skips='raise'",
      },
  }
  common.publish(
      "wrapper_overhead", argv, args.out, config,
      lambda: [run_workload(w, args.steps, args.repeats, args.seed)
               for w in make_workloads(args.models, args.computes, args.quick)],
      markdown_table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
