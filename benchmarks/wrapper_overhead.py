"""Overhead of ``jmp_lite.loss_scaling`` against a hand-written jmp-style step.

The question: does a jitted train step written with the optimizer wrapper
(``loss_scaling`` + ``get_loss_scale`` + ``scaled_value_and_grad``) cost more
than the same step written by hand the way jmp users write it (scale the loss,
unscale the grads, ``all_finite``, ``adjust``, ``select_tree`` over params and
optimizer state)? Target: median step-time ratio (a)/(b) <= 1.03.

Two more variants of (a) measure what its default options cost on every
step: (c) the stall guard turned off (``max_consecutive_skips=None``): the
ratio (a)/(c) is what the default guard costs (``on_max_skips="apply"``: a
comparison and a select on scalars; never reached here), and (d)
the unscaled-gradient check turned off (``check_scaling=False``): the ratio
(a)/(d) is what the default check costs. All four run the same model, policy (params f32, compute f16 or
bf16, output f32), Adam and ``DynamicLossScale``; before timing, the script
checks that they produce the same params, loss scale and losses. Method:
``benchmarks/runner.py``.

Run from the repository root::

  python -m benchmarks.wrapper_overhead              # full run, ~2-4 min on 2 CPU cores
  python -m benchmarks.wrapper_overhead --update-results   # ... into benchmarks/results/
  python -m benchmarks.wrapper_overhead --quick --out /tmp/wo   # smoke test
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

import jmp_lite
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl

TARGET_RATIO = 1.03
CHECK_STEPS = 8
CHECK_ATOL = 1e-5
CHECK_RTOL = 1e-4
MODELS = ("mlp", "conv")
#: The variants, in timing order: (a), (b), (c), (d).
VARIANTS = {
    "jmp_lite": common.STEP_KINDS["jmp_lite"],
    "hand": common.STEP_KINDS["hand"],
    "unguarded": "(a) with max_consecutive_skips=None (no stall guard)",
    "unchecked": "(a) with check_scaling=False",
}
#: Variants that must train as (a): the same params within CHECK_RTOL /
#: CHECK_ATOL. (Bitwise equality is not promised: they are different
#: programs, and XLA may fuse and round the shared arithmetic differently.)
SAME_AS_A = ("unguarded", "unchecked")
RATIOS = {"ratio_a_over_b": ("jmp_lite", "hand"),
          "a_over_unguarded": ("jmp_lite", "unguarded"),
          "a_over_unchecked": ("jmp_lite", "unchecked")}


def workloads(args) -> list[tuple[wl.Workload, str]]:
  return [(w, compute) for w in wl.make_workloads("quick" if args.quick else "cpu", args.models)
          for compute in args.computes]


def check(fns, states, batch) -> tuple[dict, dict[str, Any]]:
  """Runs every variant CHECK_STEPS steps: (a) ``jmp_lite`` and (b) ``hand``
  must agree on params, loss scale and losses (within CHECK_RTOL /
  CHECK_ATOL); (c) and (d), where present, must give (a)'s params and loss
  scale within the same tolerance.
  The GPU suite checks its wrapper-vs-hand comparison with it too."""
  states, losses = runner.run_all(fns, states, batch, CHECK_STEPS)
  (params_a, opt_state_a), (params_b, _, scale_b) = states["jmp_lite"], states["hand"]
  close = runner.allclose(params_a, params_b, CHECK_RTOL, CHECK_ATOL)
  scales = {"jmp_lite": float(jmp_lite.get_loss_scale(opt_state_a).loss_scale),
            "hand": float(scale_b.loss_scale)}
  verdict = {
      "steps": CHECK_STEPS, "rtol": CHECK_RTOL, "atol": CHECK_ATOL,
      "max_abs_param_diff": runner.max_abs_diff(params_a, params_b),
      "max_abs_loss_diff": runner.max_abs_diff(losses["jmp_lite"], losses["hand"]),
      "loss_scale": scales,
      "skipped_steps": int(opt_state_a.skipped_steps),
  }
  same_as_a = [name for name in SAME_AS_A if name in fns]
  for name in same_as_a:
    params, opt_state = states[name]
    verdict[f"max_abs_param_diff_{name}"] = runner.max_abs_diff(params, params_a)
    verdict[f"{name}_same"] = bool(
        runner.allclose(params, params_a, CHECK_RTOL, CHECK_ATOL) and float(jmp_lite.get_loss_scale(opt_state).loss_scale) == scales["jmp_lite"])
  verdict["same"] = bool(
      close and scales["jmp_lite"] == scales["hand"]
      and np.allclose(losses["jmp_lite"], losses["hand"], rtol=CHECK_RTOL, atol=CHECK_ATOL)
      and all(verdict[f"{name}_same"] for name in same_as_a))
  return states, verdict


def measure(workload_compute: tuple[wl.Workload, str], args) -> dict[str, Any]:
  workload, compute = workload_compute
  policy = wl.policy(compute)
  params, batch = wl.setup(workload, args.seed)
  loss_fn = wl.loss_fn(workload, "policy", policy)
  options = {"jmp_lite": {}, "hand": {},
             "unguarded": dict(max_consecutive_skips=None),
             "unchecked": dict(check_scaling=False)}
  built = {name: common.build_step("hand" if name == "hand" else "jmp_lite", loss_fn,
                                   params, **opts) for name, opts in options.items()}
  name = f"{workload.name}-{compute}"
  result = runner.measure(
      name, {n: step for n, (step, _) in built.items()},
      {n: state for n, (_, state) in built.items()}, batch,
      runner.Timing.from_args(args), check=check, ratios=RATIOS)
  return {"workload": name, "description": workload.description, "policy": str(policy),
          "param_count": common.param_count(params), **result,
          "within_target": bool(result["ratio_a_over_b"]["median"] <= TARGET_RATIO)}


def table(report: dict[str, Any]) -> list[str]:
  lines = [
      "(a) `loss_scaling(adam)` + `get_loss_scale` + `scaled_value_and_grad`;"
      " (b) the same step by hand: scale, grad, unscale, `all_finite`, `adjust`,"
      " `select_tree` over params and Adam state; (c) = (a) with the stall "
      "guard off (`max_consecutive_skips=None`), so (a)/(c) is what the "
      "default guard costs (`on_max_skips=\"apply\"`, never reached here); "
      "(d) = (a) with `check_scaling=False`, so (a)/(d) "
      "is what the default unscaled-gradient check costs. All: Adam"
      f"({common.LEARNING_RATE:g}), `DynamicLossScale({common.INITIAL_SCALE:g})`, "
      "params f32, `jax.jit` with the state donated, compiled ahead of time.",
      "",
      runner.method(report["config"], "(a)/(b), (a)/(c) and (a)/(d)")
      + f" Target: wall-clock ratio (a)/(b) <= {TARGET_RATIO}.",
      "",
      "| workload | policy | (a) ms/step | (b) ms/step | ratio (a)/(b) "
      "| ratio IQR | <= 1.03 | CPU-time ratio | compile (a) / (b) s "
      "| kernels (a) / (b) | (a) / (c) max_consecutive_skips=None "
      "| (a) / (d) check_scaling=False |",
      "|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    a, b = r["step_time_s"]["jmp_lite"], r["step_time_s"]["hand"]
    ratio = r["ratio_a_over_b"]
    compile_a, compile_b = r["compile"]["jmp_lite"], r["compile"]["hand"]
    lines.append(
        f"| {r['workload']}: {r['description']} | `{r['policy']}` "
        f"| {a['median'] * 1e3:.2f} | {b['median'] * 1e3:.2f} "
        f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
        f"| {runner.yes_no(r['within_target'])} "
        f"| {r['cpu_ratio_a_over_b']['median']:.3f} "
        f"| {compile_a['total_s']:.2f} / {compile_b['total_s']:.2f} "
        f"| {compile_a['entry_kernels']} / {compile_b['entry_kernels']} "
        f"| {runner.ratio_cell(r['a_over_unguarded'])} "
        f"| {runner.ratio_cell(r['a_over_unchecked'])} |")
  return lines + [
      "",
      "Compile: `jax.jit(step).lower(...)` plus `.compile()`. Kernels: "
      "instructions in the optimized HLO's ENTRY computation (fusions, dots, "
      "convolutions, copies). Before timing, the variants were run "
      f"{CHECK_STEPS} steps from the same params: (a) and (b) gave the same "
      "params, loss scale and losses, and so did (c) and (d) with (a). Full "
      "figures: `wrapper_overhead.json`.",
      "",
  ]


def _add_flags(parser) -> None:
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated subset of {','.join(MODELS)} (default all)")


def _finish_flags(parser, args) -> None:
  args.models = runner.split_choices(parser, "--models", args.models, MODELS)


STUDY = runner.Study(
    name="wrapper_overhead",
    title="Wrapper overhead: `loss_scaling` vs a hand-written jmp-style step",
    description="Step-time overhead of jmp_lite.loss_scaling against a hand-written "
                "jmp-style loss-scaled train step, and of its options.",
    workloads=workloads, measure=measure, table=table,
    repeats=(41, 3), steps=(4, 2),
    add_flags=_add_flags, finish_flags=_finish_flags,
    config=lambda args: {"models": args.models, "check_steps": CHECK_STEPS,
                         "target_ratio": TARGET_RATIO, "variants": VARIANTS})


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
