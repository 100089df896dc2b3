"""Step time of ``loss_scaling(..., accumulation_steps=k)`` against ``optax.MultiSteps``.

The question: what does a micro-step of jmp_lite's gradient accumulation
(unscale in float32, finiteness check, float32 accumulator, window bookkeeping,
the dynamic loss scale) cost against optax's own accumulation, which does no
loss scaling at all?

Three variants of the same jitted MLP micro-step (params f32, compute f16 or
bf16, output f32; Adam; ``k`` micro-batches per optimizer step):

* ``jmp_lite``: ``jmp_lite.loss_scaling(optax.adam(lr),
  DynamicLossScale(2**15), accumulation_steps=k)`` + ``get_loss_scale`` +
  ``scaled_value_and_grad``;
* ``multisteps``: ``optax.MultiSteps(optax.adam(lr), k)``, plain
  ``value_and_grad``: no loss scaling, no skipping (the baseline);
* ``multisteps_if_finite``: ``optax.MultiSteps(optax.apply_if_finite(
  optax.adam(lr), 10), k)``: optax's way of skipping non-finite steps, still
  without loss scaling.

Before timing, the script checks that the variants compute the same optimizer
steps: with float32 compute (where the MultiSteps variants' unscaled gradients
cannot underflow) ``CHECK_WINDOWS`` windows from the same params must give
params within ``CHECK_RTOL``/``CHECK_ATOL`` of each other; with the timed
dtype (where they legitimately differ: float16 gradients that underflow
without a loss scale) every variant must take one optimizer step per window
and keep finite params. Method as
in ``benchmarks.wrapper_overhead``: each step is compiled ahead of time, then
timed in blocks of ``--steps`` micro-steps (a multiple of ``k``, so every block
holds the same optimizer steps), the variants interleaved in this process with
the order rotating each repeat, ``--repeats`` times; ratios are medians of the
per-block ratios to ``multisteps`` (wall clock, and process CPU time as a
cross-check).

Run from the repository root::

  python -m benchmarks.accumulation_overhead                   # ~1-2 min on 2 CPU cores
  python -m benchmarks.accumulation_overhead --update-results  # ... into benchmarks/results/
  python -m benchmarks.accumulation_overhead --quick --out /tmp/ao   # smoke test

Writes ``accumulation_overhead.json`` (machine, config, figures) and
``accumulation_overhead.md`` (the table, with the command line) to ``--out``
(a scratch folder by default).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import numpy as np
import optax

import jmp_lite
from benchmarks import common
from benchmarks.common import compile_step
from benchmarks.common import fresh_copy
from benchmarks.common import make_jmp_lite_step
from benchmarks.common import make_plain_step
from benchmarks.common import run_steps
from benchmarks.common import State
from benchmarks.common import summarize
from benchmarks.common import time_interleaved
from benchmarks.models import apply_mlp
from benchmarks.models import init_mlp
from benchmarks.wrapper_overhead import make_batch
from benchmarks.wrapper_overhead import make_loss_fn
from benchmarks.wrapper_overhead import make_workloads
from benchmarks.wrapper_overhead import Workload

INITIAL_SCALE = 2.0**15
LEARNING_RATE = 1e-3
MAX_CONSECUTIVE_ERRORS = 10
CHECK_WINDOWS = 3
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-6
BASELINE = "multisteps"
VARIANTS = ("jmp_lite", "multisteps", "multisteps_if_finite")
DESCRIPTIONS = {
    "jmp_lite": "loss_scaling(adam, DynamicLossScale(2**15), "
                "accumulation_steps=k) + get_loss_scale + scaled_value_and_grad",
    "multisteps": "optax.MultiSteps(adam, k), value_and_grad (no loss scaling)",
    "multisteps_if_finite": f"optax.MultiSteps(optax.apply_if_finite(adam, "
                            f"{MAX_CONSECUTIVE_ERRORS}), k), value_and_grad "
                            "(no loss scaling)",
}


def make_optimizers(k: int) -> dict[str, Any]:
  """The three optimizers, by variant."""
  adam = lambda: optax.adam(LEARNING_RATE)
  return {
      "jmp_lite": jmp_lite.loss_scaling(
          adam(), jmp_lite.DynamicLossScale(INITIAL_SCALE),
          accumulation_steps=k),
      "multisteps": optax.MultiSteps(adam(), k),
      "multisteps_if_finite": optax.MultiSteps(
          optax.apply_if_finite(adam(), MAX_CONSECUTIVE_ERRORS), k),
  }


def optimizer_steps(opt_state) -> int:
  """How many optimizer steps the variant's state says Adam took."""
  leaves = jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
  adam = next(x for x in leaves if isinstance(x, optax.ScaleByAdamState))
  return int(adam.count)


def train_check(fns, states, batch, k) -> tuple[dict[str, State], dict[str, Any]]:
  """Runs CHECK_WINDOWS windows of every variant; compares params and steps.

  Returns the new states and: the optimizer steps each variant took, the
  largest parameter difference to the baseline, and whether all params are
  finite and within CHECK_RTOL / CHECK_ATOL of the baseline's.
  """
  for name in VARIANTS:
    states[name], _ = run_steps(fns[name], states[name], batch,
                                CHECK_WINDOWS * k)
  jax.block_until_ready(states)
  ref = jax.tree_util.tree_leaves(states[BASELINE][0])
  diffs, close, finite = {}, True, True
  for name in VARIANTS:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(states[name][0])]
    diffs[name] = max(float(np.max(np.abs(a - np.asarray(b))))
                      for a, b in zip(leaves, ref))
    close &= all(np.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_ATOL)
                 for a, b in zip(leaves, ref))
    finite &= all(bool(np.all(np.isfinite(a))) for a in leaves)
  steps = {name: optimizer_steps(states[name][1]) for name in VARIANTS}
  return states, {"optimizer_steps": steps, "max_abs_param_diff": diffs,
                  "close": bool(close), "finite": bool(finite),
                  "same_steps": set(steps.values()) == {CHECK_WINDOWS}}


def check_equivalent(params, batch, opts_factory, k) -> dict[str, Any]:
  """The variants compute the same optimizer steps: checked with float32
  compute, where the unscaled gradients of the MultiSteps variants cannot
  underflow (with float16 they can, which is the point of loss scaling, and
  their params legitimately differ by up to the learning rate)."""
  loss_fn = make_loss_fn(apply_mlp, jmp_lite.get_policy("f32"))
  fns, states, _ = make_variants(loss_fn, opts_factory(k), params, batch)
  _, result = train_check(fns, states, batch, k)
  result["same"] = bool(result["close"] and result["finite"]
                        and result["same_steps"])
  return result


def make_variants(loss_fn, opts, params, batch):
  """The three variants' compiled steps, fresh states and compile figures."""
  step_fns = {
      "jmp_lite": make_jmp_lite_step(loss_fn, opts["jmp_lite"]),
      "multisteps": make_plain_step(loss_fn, opts["multisteps"]),
      "multisteps_if_finite": make_plain_step(loss_fn,
                                              opts["multisteps_if_finite"]),
  }
  states = {name: fresh_copy((params, opts[name].init(params)))
            for name in VARIANTS}
  fns, compile_info = {}, {}
  for name in VARIANTS:
    fns[name], compile_info[name] = compile_step(step_fns[name], states[name],
                                                 batch)
  return fns, states, compile_info


def run_workload(workload: Workload, k: int, steps: int, repeats: int,
                 seed: int) -> dict[str, Any]:
  key_params, key_batch = jax.random.split(jax.random.PRNGKey(seed))
  params = init_mlp(key_params, workload.sizes)
  batch = make_batch(key_batch, workload)
  equivalent = check_equivalent(params, batch, make_optimizers, k)
  fns, states, compile_info = make_variants(
      make_loss_fn(apply_mlp, workload.policy), make_optimizers(k), params,
      batch)
  # The timed steps, run as warm-up: no window may be skipped.
  states, warmup = train_check(fns, states, batch, k)
  check = {"f32_compute": equivalent, "timed_dtype": warmup,
           "same": bool(equivalent["same"] and warmup["same_steps"]
                        and warmup["finite"])}
  print(f"[{workload.name}] check: f32 compute same={equivalent['same']} "
        f"max|dparams|={equivalent['max_abs_param_diff']}; "
        f"{workload.compute}: optimizer steps {warmup['optimizer_steps']}, "
        f"max|dparams|={warmup['max_abs_param_diff']}", flush=True)
  if not check["same"]:
    raise SystemExit(f"{workload.name}: the variants do not train alike "
                     f"({check}); timing them against each other would be "
                     "meaningless.")

  per_step = time_interleaved(fns, states, batch, steps, repeats, VARIANTS)
  ratios = {
      clock: {name: summarize([a / b for a, b in zip(
          per_step[clock][name], per_step[clock][BASELINE])])
              for name in VARIANTS if name != BASELINE}
      for clock in ("wall", "cpu")
  }
  result = {
      "workload": workload.name,
      "description": workload.describe(),
      "policy": str(workload.policy),
      "batch": workload.batch,
      "sizes": list(workload.sizes),
      "accumulation_steps": k,
      "param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
      "check": check,
      "compile": compile_info,
      "step_time_s": {name: summarize(per_step["wall"][name])
                      for name in VARIANTS},
      "cpu_time_s": {name: summarize(per_step["cpu"][name])
                     for name in VARIANTS},
      "ratio_to_multisteps": ratios["wall"],
      "cpu_ratio_to_multisteps": ratios["cpu"],
  }
  print(f"[{workload.name}] multisteps "
        f"{result['step_time_s'][BASELINE]['median'] * 1e3:.2f} ms/micro-step; "
        + "; ".join(f"{name} x{ratios['wall'][name]['median']:.3f}"
                    for name in VARIANTS if name != BASELINE), flush=True)
  return result


# --- reporting ----------------------------------------------------------------


def markdown_table(report: dict[str, Any]) -> str:
  config = report["config"]
  k = config["accumulation_steps"]
  lines = common.report_header(
      "Accumulation overhead: `loss_scaling(..., accumulation_steps=k)` vs "
      "`optax.MultiSteps`",
      report) + [
      f"One jitted micro-step of an MLP (params f32, compute f16 or bf16, "
      f"Adam({LEARNING_RATE:g}), k = {k} micro-batches per optimizer step, "
      "state donated, compiled ahead of time): **jmp_lite** — "
      f"{DESCRIPTIONS['jmp_lite']}; **multisteps** — "
      f"{DESCRIPTIONS['multisteps']}; **multisteps_if_finite** — "
      f"{DESCRIPTIONS['multisteps_if_finite']}. The MultiSteps variants do no "
      "loss scaling: with float16 they are not a safe alternative, they are "
      "the cost floor of accumulating at all.",
      "",
      f"Per micro-step time: median over {config['repeats']} blocks of "
      f"{config['steps']} micro-steps ({config['steps'] // k} optimizer step(s) "
      "each), the variants interleaved in one process, the order rotating "
      "each repeat. Ratios: median of the per-block ratios to multisteps, "
      "with the interquartile range; the CPU-time ratio is the same from the "
      "process's CPU time, less sensitive to other processes.",
      "",
      "| workload | policy | multisteps ms/micro-step | variant "
      "| ms/micro-step | ratio to multisteps | ratio IQR | CPU-time ratio "
      "| compile s | kernels |",
      "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    base = r["step_time_s"][BASELINE]["median"] * 1e3
    for name in VARIANTS:
      if name == BASELINE:
        continue
      ratio, cpu = r["ratio_to_multisteps"][name], r[
          "cpu_ratio_to_multisteps"][name]
      lines.append(
          f"| {r['workload']}: {r['description']} | `{r['policy']}` "
          f"| {base:.2f} | {name} "
          f"| {r['step_time_s'][name]['median'] * 1e3:.2f} "
          f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
          f"| {cpu['median']:.3f} "
          f"| {r['compile'][name]['total_s']:.2f} (multisteps "
          f"{r['compile'][BASELINE]['total_s']:.2f}) "
          f"| {r['compile'][name]['entry_kernels']} (multisteps "
          f"{r['compile'][BASELINE]['entry_kernels']}) |")
  lines += [
      "",
      "Kernels: instructions in the optimized HLO's ENTRY computation. Before "
      f"timing, the three variants ran {CHECK_WINDOWS} windows from the same "
      "params with float32 compute and reached the same params (within rtol "
      f"{CHECK_RTOL:g} / atol {CHECK_ATOL:g}; largest difference "
      "in the JSON), and with the timed dtype each took one optimizer step per "
      "window. Full figures: `accumulation_overhead.json`.",
      "",
  ]
  return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.accumulation_overhead",
      description="Micro-step time of jmp_lite's loss-scaled gradient "
                  "accumulation against optax.MultiSteps.")
  parser.add_argument("--accumulation-steps", type=int, default=4,
                      help="micro-batches per optimizer step (default 4)")
  parser.add_argument("--steps", type=int, default=None,
                      help="micro-steps per timed block, a multiple of "
                           "--accumulation-steps (default 2 windows; 1 with "
                           "--quick)")
  common.add_timing_args(parser, repeats=(31, 3))
  args = parser.parse_args(argv)
  k = args.accumulation_steps
  if k < 2:
    parser.error("--accumulation-steps must be >= 2")
  if args.steps is None:
    args.steps = k if args.quick else 2 * k
  args = common.finish_timing_args(parser, args)
  if args.steps % k:
    parser.error(f"--steps must be a multiple of --accumulation-steps ({k}), "
                 "so that every timed block holds the same optimizer steps")
  return args


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  config = {
      "accumulation_steps": args.accumulation_steps,
      "steps": args.steps,
      "repeats": args.repeats,
      "quick": args.quick,
      "seed": args.seed,
      "check_windows": CHECK_WINDOWS,
      "initial_loss_scale": INITIAL_SCALE,
      "learning_rate": LEARNING_RATE,
      "baseline": BASELINE,
      "variants": DESCRIPTIONS,
  }
  common.publish(
      "accumulation_overhead", argv, args.out, config,
      lambda: [run_workload(w, args.accumulation_steps, args.steps,
                            args.repeats, args.seed)
               for w in make_workloads(["mlp"], args.computes, args.quick)],
      markdown_table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
