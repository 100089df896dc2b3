"""Overhead of ``jmp_lite.diagnostics`` statistics inside a jitted train step.

The question: what does it cost to compute the precision statistics of the
gradients (``diagnostics.tensor_stats``: zero/underflow/overflow counts, the
largest magnitude and the log2 histogram of every leaf) inside a jitted MLP
train step? (The unscaled-gradient check lives in ``loss_scaling`` now; its
cost is measured by ``wrapper_overhead``.)

Four variants of the same step (``jmp_lite.loss_scaling(adam)`` +
``get_loss_scale`` + ``scaled_value_and_grad``, params f32, compute f16 or
bf16, ``DynamicLossScale``), timed against each other:

* ``plain``: the step alone;
* ``stats``: plus ``tensor_stats`` of the unscaled gradients at the step's
  loss scale, every step, returned from ``jit``;
* ``cond_stats``: plus the same under ``lax.cond(step % 100 == 0, ...)``
  around the statistics only (zeros otherwise);
* ``cond_step``: ``lax.cond(step % 100 == 0, ...)`` choosing between the whole
  step with the statistics and the whole step without them.

A timed block of 4 steps rarely contains a collecting step (step % 100 == 0),
so the two ``cond`` variants measure what collecting every N steps costs on
the other steps. Before timing, the script checks that every variant produces
the params of ``plain`` (the statistics do not change training), within
rtol 1e-4 / atol 1e-5: they are different programs, which XLA may fuse and
round differently.
Method: ``benchmarks/runner.py``; ratios are to ``plain``.

Run from the repository root::

  python -m benchmarks.diagnostics_overhead                   # ~2 min on 2 CPU cores
  python -m benchmarks.diagnostics_overhead --update-results  # ... into benchmarks/results/
  python -m benchmarks.diagnostics_overhead --quick --out /tmp/do   # smoke test
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

import jmp_lite
from jmp_lite import diagnostics
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl

EVERY = 100
CHECK_STEPS = 6
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-5
VARIANTS = {
    "plain": "loss_scaling(adam) step",
    "stats": "+ tensor_stats(grads) every step",
    "cond_stats": f"+ tensor_stats under lax.cond(step % {EVERY} == 0), zeros otherwise",
    "cond_step": f"lax.cond(step % {EVERY} == 0) between the whole step with and "
                 "without tensor_stats",
}
RATIOS = {"ratio_to_plain": {name: (name, "plain") for name in VARIANTS if name != "plain"}}


def make_steps(loss_fn, opt) -> dict[str, common.Step]:
  """The four variants. State: (params, opt_state, step)."""

  def train(params, opt_state, batch):
    loss_scale = jmp_lite.get_loss_scale(opt_state)
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads, loss_scale

  def stats_of(grads, loss_scale, collect=True):
    # The unscaled gradients, measured at the step's loss scale.
    stats = diagnostics.tensor_stats(loss_scale.unscale(grads), loss_scale)
    return stats if collect else jax.tree.map(jnp.zeros_like, stats)

  def plain(state, batch):
    params, opt_state, step = state
    params, opt_state, loss, _, _ = train(params, opt_state, batch)
    return (params, opt_state, step + 1), loss

  def stats(state, batch):
    params, opt_state, step = state
    params, opt_state, loss, grads, scale = train(params, opt_state, batch)
    return (params, opt_state, step + 1), (loss, stats_of(grads, scale))

  def cond_stats(state, batch):
    params, opt_state, step = state
    params, opt_state, loss, grads, scale = train(params, opt_state, batch)
    collected = lax.cond(step % EVERY == 0, lambda g: stats_of(g, scale),
                         lambda g: stats_of(g, scale, collect=False), grads)
    return (params, opt_state, step + 1), (loss, collected)

  def cond_step(state, batch):
    params, opt_state, step = state

    def branch(collect):
      def run(params, opt_state):
        params, opt_state, loss, grads, scale = train(params, opt_state, batch)
        return params, opt_state, loss, stats_of(grads, scale, collect)
      return run

    params, opt_state, loss, collected = lax.cond(
        step % EVERY == 0, branch(True), branch(False), params, opt_state)
    return (params, opt_state, step + 1), (loss, collected)

  return dict(plain=plain, stats=stats, cond_stats=cond_stats, cond_step=cond_step)


def check(fns, states, batch) -> tuple[dict, dict[str, Any]]:
  """Runs every variant CHECK_STEPS steps; their params must be plain's,
  within CHECK_RTOL / CHECK_ATOL."""
  for name in fns:
    states[name], _ = common.run_steps(fns[name], states[name], batch, CHECK_STEPS)
  diffs = {name: runner.max_abs_diff(states[name][0], states["plain"][0]) for name in fns}
  same = all(runner.allclose(states[name][0], states["plain"][0], CHECK_RTOL, CHECK_ATOL)
             for name in fns)
  return states, {"steps": CHECK_STEPS, "rtol": CHECK_RTOL, "atol": CHECK_ATOL,
                  "max_abs_param_diff": diffs, "same": same}


def measure(workload_compute: tuple[wl.Workload, str], args) -> dict[str, Any]:
  workload, compute = workload_compute
  policy = wl.policy(compute)
  params, batch = wl.setup(workload, args.seed)
  opt = jmp_lite.loss_scaling(optax.adam(common.LEARNING_RATE),
                              jmp_lite.DynamicLossScale(common.INITIAL_SCALE))
  steps = make_steps(wl.loss_fn(workload, "policy", policy), opt)
  states = {name: common.fresh_copy((params, opt.init(params), jnp.zeros([], jnp.int32)))
            for name in steps}
  name = f"{workload.name}-{compute}"
  result = runner.measure(name, steps, states, batch, runner.Timing.from_args(args),
                          check=check, ratios=RATIOS)
  return {"workload": name, "description": workload.description, "policy": str(policy),
          "param_count": common.param_count(params),
          "gradient_leaves": len(jax.tree.leaves(params)), **result}


def table(report: dict[str, Any]) -> list[str]:
  lines = [
      "Every variant is the same `jmp_lite.loss_scaling(adam)` step (params "
      f"f32, `DynamicLossScale({common.INITIAL_SCALE:g})`, `jax.jit` with the state "
      "donated, compiled ahead of time) plus: **stats** — "
      "`diagnostics.tensor_stats` of the unscaled gradients at the step's loss "
      "scale (counts, largest magnitude, 300-bin log2 histogram per leaf), "
      "every step, returned from `jit`; **cond_stats** — the same under "
      f"`lax.cond(step % {EVERY} == 0, ...)` around the statistics only, zeros "
      "otherwise; **cond_step** — `lax.cond` choosing between the whole step "
      "with the statistics and the whole step without. A timed block of "
      f"{report['config']['steps']} steps rarely contains a collecting step, so "
      f"the cond variants give the cost of collecting every {EVERY} steps on the "
      "other steps.",
      "",
      runner.method(report["config"], "to the plain step"),
      "",
      "| workload | policy | plain ms/step | variant | ms/step | ratio to plain "
      "| ratio IQR | CPU-time ratio | kernels |",
      "|---|---|---:|---|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    plain = r["step_time_s"]["plain"]["median"] * 1e3
    for name, ratio in r["ratio_to_plain"].items():
      lines.append(
          f"| {r['workload']}: {r['description']} | `{r['policy']}` | {plain:.2f} "
          f"| {name} | {r['step_time_s'][name]['median'] * 1e3:.2f} "
          f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
          f"| {r['cpu_ratio_to_plain'][name]['median']:.3f} "
          f"| {r['compile'][name]['entry_kernels']} (plain "
          f"{r['compile']['plain']['entry_kernels']}) |")
  return lines + [
      "",
      "Kernels: instructions in the optimized HLO's ENTRY computation. Before "
      f"timing, every variant was run {CHECK_STEPS} steps from the same params "
      f"and gave the plain step's params (rtol {CHECK_RTOL:g}, atol "
      f"{CHECK_ATOL:g}; largest differences in the JSON). Full figures: "
      "`diagnostics_overhead.json`.",
      "",
  ]


STUDY = runner.Study(
    name="diagnostics_overhead",
    title="Diagnostics overhead: precision statistics inside a jitted train step",
    description="Step-time overhead of jmp_lite.diagnostics statistics inside a "
                "jitted MLP train step.",
    workloads=lambda args: [(w, c) for w in wl.make_workloads(
        "quick" if args.quick else "cpu", ["mlp"]) for c in args.computes],
    measure=measure, table=table, repeats=(41, 3), steps=(4, 2),
    config=lambda args: {"every": EVERY, "check_steps": CHECK_STEPS, "variants": VARIANTS})


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
