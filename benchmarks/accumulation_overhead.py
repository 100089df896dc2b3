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
and keep finite params. Timed blocks hold ``--steps`` micro-steps, a multiple
of ``k``, so that every block holds the same optimizer steps; ratios are to
``multisteps``. Method: ``benchmarks/runner.py``.

Run from the repository root::

  python -m benchmarks.accumulation_overhead                   # ~1-2 min on 2 CPU cores
  python -m benchmarks.accumulation_overhead --update-results  # ... into benchmarks/results/
  python -m benchmarks.accumulation_overhead --quick --out /tmp/ao   # smoke test
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
import optax

import jmp_lite
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl

CHECK_WINDOWS = 3
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-6
BASELINE = "multisteps"
VARIANTS = {
    "jmp_lite": "loss_scaling(adam, DynamicLossScale(2**15), "
                "accumulation_steps=k) + get_loss_scale + scaled_value_and_grad",
    "multisteps": "optax.MultiSteps(adam, k), value_and_grad (no loss scaling)",
    "multisteps_if_finite": f"optax.MultiSteps(optax.apply_if_finite(adam, "
                            f"{common.MAX_CONSECUTIVE_ERRORS}), k), value_and_grad "
                            "(no loss scaling)",
}
RATIOS = {"ratio_to_multisteps": {name: (name, BASELINE) for name in VARIANTS
                                  if name != BASELINE}}


def variants(loss_fn, params, k: int) -> tuple[dict, dict]:
  """The three variants' step functions and fresh states."""
  adam = lambda: optax.adam(common.LEARNING_RATE)  # noqa: E731
  opts = {
      "jmp_lite": jmp_lite.loss_scaling(
          adam(), jmp_lite.DynamicLossScale(common.INITIAL_SCALE), accumulation_steps=k),
      "multisteps": optax.MultiSteps(adam(), k),
      "multisteps_if_finite": optax.MultiSteps(
          optax.apply_if_finite(adam(), common.MAX_CONSECUTIVE_ERRORS), k),
  }
  steps = {name: (common.make_jmp_lite_step if name == "jmp_lite" else
                  common.make_plain_step)(loss_fn, opt) for name, opt in opts.items()}
  states = {name: common.fresh_copy((params, opt.init(params))) for name, opt in opts.items()}
  return steps, states


def optimizer_steps(opt_state) -> int:
  """How many optimizer steps the variant's state says Adam took."""
  leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
  return int(next(x for x in leaves if isinstance(x, optax.ScaleByAdamState)).count)


def train_windows(fns, states, batch, k: int) -> tuple[dict, dict[str, Any]]:
  """Runs CHECK_WINDOWS windows of every variant; compares params and steps
  with the baseline's."""
  states, _ = runner.run_all(fns, states, batch, CHECK_WINDOWS * k)
  ref = states[BASELINE][0]
  leaves = {name: [np.asarray(x) for x in jax.tree.leaves(states[name][0])] for name in fns}
  steps = {name: optimizer_steps(states[name][1]) for name in fns}
  return states, {
      "optimizer_steps": steps,
      "max_abs_param_diff": {name: runner.max_abs_diff(states[name][0], ref) for name in fns},
      "close": all(np.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_ATOL)
                   for name in fns for a, b in zip(leaves[name], leaves[BASELINE])),
      "finite": all(bool(np.all(np.isfinite(a))) for ls in leaves.values() for a in ls),
      "same_steps": set(steps.values()) == {CHECK_WINDOWS},
  }


def make_check(workload: wl.Workload, params, k: int):
  """The criterion: with float32 compute (where the unscaled gradients of the
  MultiSteps variants cannot underflow; with float16 they can, which is the
  point of loss scaling) the variants reach the same params; with the timed
  dtype each takes one optimizer step per window."""

  def check(fns, states, batch):
    f32_steps, f32_states = variants(wl.loss_fn(workload, "f32"), params, k)
    f32_fns = {name: common.compile_step(step, f32_states[name], batch)[0]
               for name, step in f32_steps.items()}
    _, f32 = train_windows(f32_fns, f32_states, batch, k)
    f32["same"] = bool(f32["close"] and f32["finite"] and f32["same_steps"])
    states, timed = train_windows(fns, states, batch, k)
    return states, {"f32_compute": f32, "timed_dtype": timed,
                    "same": bool(f32["same"] and timed["same_steps"] and timed["finite"])}

  return check


def measure(workload_compute: tuple[wl.Workload, str], args) -> dict[str, Any]:
  workload, compute = workload_compute
  policy = wl.policy(compute)
  params, batch = wl.setup(workload, args.seed)
  k = args.accumulation_steps
  steps, states = variants(wl.loss_fn(workload, "policy", policy), params, k)
  name = f"{workload.name}-{compute}"
  result = runner.measure(name, steps, states, batch, runner.Timing.from_args(args),
                          check=make_check(workload, params, k), ratios=RATIOS)
  return {"workload": name, "description": workload.description, "policy": str(policy),
          "accumulation_steps": k, "param_count": common.param_count(params), **result}


def table(report: dict[str, Any]) -> list[str]:
  config = report["config"]
  k = config["accumulation_steps"]
  lines = [
      f"One jitted micro-step of an MLP (params f32, compute f16 or bf16, "
      f"Adam({common.LEARNING_RATE:g}), k = {k} micro-batches per optimizer step, "
      "state donated, compiled ahead of time): **jmp_lite** — "
      f"{VARIANTS['jmp_lite']}; **multisteps** — {VARIANTS['multisteps']}; "
      f"**multisteps_if_finite** — {VARIANTS['multisteps_if_finite']}. The "
      "MultiSteps variants do no loss scaling: with float16 they are not a safe "
      "alternative, they are the cost floor of accumulating at all.",
      "",
      runner.method(config, "to multisteps", unit=f"micro-steps ({config['steps'] // k} "
                    "optimizer step(s) each)"),
      "",
      "| workload | policy | multisteps ms/micro-step | variant "
      "| ms/micro-step | ratio to multisteps | ratio IQR | CPU-time ratio "
      "| compile s | kernels |",
      "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    base = r["step_time_s"][BASELINE]["median"] * 1e3
    for name, ratio in r["ratio_to_multisteps"].items():
      lines.append(
          f"| {r['workload']}: {r['description']} | `{r['policy']}` "
          f"| {base:.2f} | {name} | {r['step_time_s'][name]['median'] * 1e3:.2f} "
          f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
          f"| {r['cpu_ratio_to_multisteps'][name]['median']:.3f} "
          f"| {r['compile'][name]['total_s']:.2f} (multisteps "
          f"{r['compile'][BASELINE]['total_s']:.2f}) "
          f"| {r['compile'][name]['entry_kernels']} (multisteps "
          f"{r['compile'][BASELINE]['entry_kernels']}) |")
  return lines + [
      "",
      "Kernels: instructions in the optimized HLO's ENTRY computation. Before "
      f"timing, the three variants ran {CHECK_WINDOWS} windows from the same "
      "params with float32 compute and reached the same params (within rtol "
      f"{CHECK_RTOL:g} / atol {CHECK_ATOL:g}; largest difference "
      "in the JSON), and with the timed dtype each took one optimizer step per "
      "window. Full figures: `accumulation_overhead.json`.",
      "",
  ]


def _add_flags(parser) -> None:
  parser.add_argument("--accumulation-steps", type=int, default=4,
                      help="micro-batches per optimizer step (default 4)")


def _finish_flags(parser, args) -> None:
  k = args.accumulation_steps
  if k < 2:
    parser.error(f"--accumulation-steps must be >= 2, got {k}")
  if args.steps is None:
    args.steps = k if args.quick else 2 * k
  if args.steps % k:
    parser.error(f"--steps must be a multiple of --accumulation-steps ({k}), got "
                 f"{args.steps}, so that every timed block holds the same optimizer steps")


STUDY = runner.Study(
    name="accumulation_overhead",
    title="Accumulation overhead: `loss_scaling(..., accumulation_steps=k)` vs "
          "`optax.MultiSteps`",
    description="Micro-step time of jmp_lite's loss-scaled gradient accumulation "
                "against optax.MultiSteps.",
    workloads=lambda args: [(w, c) for w in wl.make_workloads(
        "quick" if args.quick else "cpu", ["mlp"]) for c in args.computes],
    measure=measure, table=table,
    repeats=(31, 3), steps=(8, 4),
    steps_help="micro-steps per timed block, a multiple of --accumulation-steps "
               "(default two windows; one with --quick)",
    add_flags=_add_flags, finish_flags=_finish_flags,
    config=lambda args: {"accumulation_steps": args.accumulation_steps,
                         "check_windows": CHECK_WINDOWS, "baseline": BASELINE,
                         "variants": VARIANTS})


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
