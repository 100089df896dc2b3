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
the other steps.

Before timing, the script checks that every variant produces the same params
as ``plain`` (the statistics do not change training). Method as in
``benchmarks.wrapper_overhead``: each step is compiled ahead of time, then
timed in blocks of ``--steps`` steps, the variants interleaved in this process
with the order rotating each repeat, ``--repeats`` times; ratios are medians of
the per-repeat ratios to ``plain`` (wall clock, and process CPU time as a
cross-check).

Run from the repository root::

  python -m benchmarks.diagnostics_overhead                   # ~2 min on 2 CPU cores
  python -m benchmarks.diagnostics_overhead --update-results  # ... into benchmarks/results/
  python -m benchmarks.diagnostics_overhead --quick --out /tmp/do   # smoke test

Writes ``diagnostics_overhead.json`` (machine, config, figures) and
``diagnostics_overhead.md`` (the table, with the command line) to ``--out`` (a
scratch folder by default).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from jmp_lite import diagnostics
from benchmarks import common
from benchmarks.common import compile_step
from benchmarks.common import fresh_copy
from benchmarks.common import run_steps
from benchmarks.common import State
from benchmarks.common import Step
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
EVERY = 100
CHECK_STEPS = 6
VARIANTS = ("plain", "stats", "cond_stats", "cond_step")
DESCRIPTIONS = {
    "plain": "loss_scaling(adam) step",
    "stats": "+ tensor_stats(grads) every step",
    "cond_stats": f"+ tensor_stats under lax.cond(step % {EVERY} == 0), zeros otherwise",
    "cond_step": f"lax.cond(step % {EVERY} == 0) between the whole step with and without tensor_stats",
}


def make_steps(loss_fn, opt) -> dict[str, Step]:
  """The four variants. State: (params, opt_state, step, extra)."""

  def grads_and_update(params, opt_state):
    def inner(batch):
      loss_scale = jmp_lite.get_loss_scale(opt_state)
      loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
      updates, new_opt_state = opt.update(grads, opt_state, params)
      return loss, grads, loss_scale, optax.apply_updates(params, updates), new_opt_state
    return inner

  def stats_of(grads, loss_scale):
    # The unscaled gradients, measured at the step's loss scale.
    return diagnostics.tensor_stats(loss_scale.unscale(grads), loss_scale)

  def plain(state, batch):
    params, opt_state, step, extra = state
    loss, _, _, params, opt_state = grads_and_update(params, opt_state)(batch)
    return (params, opt_state, step + 1, extra), loss

  def stats(state, batch):
    params, opt_state, step, extra = state
    loss, grads, scale, params, opt_state = grads_and_update(params, opt_state)(batch)
    return (params, opt_state, step + 1, extra), (loss, stats_of(grads, scale))

  def cond_stats(state, batch):
    params, opt_state, step, extra = state
    loss, grads, scale, params, opt_state = grads_and_update(params, opt_state)(batch)
    collected = lax.cond(
        step % EVERY == 0,
        lambda g: stats_of(g, scale),
        lambda g: jax.tree.map(jnp.zeros_like, stats_of(g, scale)),
        grads)
    return (params, opt_state, step + 1, extra), (loss, collected)

  def cond_step(state, batch):
    params, opt_state, step, extra = state

    def branch(collect):
      def run(params, opt_state):
        loss, grads, scale, params, opt_state = grads_and_update(params, opt_state)(batch)
        stats = stats_of(grads, scale)
        if not collect:
          stats = jax.tree.map(jnp.zeros_like, stats)
        return params, opt_state, loss, stats
      return run

    params, opt_state, loss, collected = lax.cond(
        step % EVERY == 0, branch(True), branch(False), params, opt_state)
    return (params, opt_state, step + 1, extra), (loss, collected)

  return dict(plain=plain, stats=stats, cond_stats=cond_stats,
              cond_step=cond_step)


def check_same(fns, states, batch) -> tuple[dict[str, State], dict[str, Any]]:
  """Runs every variant CHECK_STEPS steps; their params must equal plain's."""
  for name in VARIANTS:
    states[name], _ = run_steps(fns[name], states[name], batch, CHECK_STEPS)
  jax.block_until_ready(states)
  ref = jax.tree_util.tree_leaves(states["plain"][0])
  diffs = {
      name: max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(states[name][0]), ref))
      for name in VARIANTS
  }
  return states, {"steps": CHECK_STEPS, "max_abs_param_diff": diffs,
                  "same": all(d == 0 for d in diffs.values())}


def run_workload(workload: Workload, steps: int, repeats: int, seed: int) -> dict[str, Any]:
  key_params, key_batch = jax.random.split(jax.random.PRNGKey(seed))
  params = init_mlp(key_params, workload.sizes)
  batch = make_batch(key_batch, workload)
  opt = jmp_lite.loss_scaling(optax.adam(LEARNING_RATE),
                              jmp_lite.DynamicLossScale(INITIAL_SCALE))
  step_fns = make_steps(make_loss_fn(apply_mlp, workload.policy), opt)
  states = {}
  for name in VARIANTS:
    extra = jnp.zeros([])
    states[name] = fresh_copy(
        (params, opt.init(params), jnp.zeros([], jnp.int32), extra))
  fns, compile_info = {}, {}
  for name in VARIANTS:
    fns[name], compile_info[name] = compile_step(step_fns[name], states[name], batch)

  states, check = check_same(fns, states, batch)
  print(f"[{workload.name}] check after {check['steps']} steps: same={check['same']} "
        f"max|dparams|={check['max_abs_param_diff']}", flush=True)
  if not check["same"]:
    raise SystemExit(f"{workload.name}: the variants do not train alike ({check}).")

  per_step = time_interleaved(fns, states, batch, steps, repeats, VARIANTS)
  ratios = {
      clock: {name: summarize([a / b for a, b in zip(per_step[clock][name],
                                                      per_step[clock]["plain"])])
              for name in VARIANTS if name != "plain"}
      for clock in ("wall", "cpu")
  }
  result = {
      "workload": workload.name,
      "description": workload.describe(),
      "policy": str(workload.policy),
      "batch": workload.batch,
      "sizes": list(workload.sizes),
      "param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
      "gradient_leaves": len(jax.tree_util.tree_leaves(params)),
      "check": check,
      "compile": compile_info,
      "step_time_s": {name: summarize(per_step["wall"][name]) for name in VARIANTS},
      "cpu_time_s": {name: summarize(per_step["cpu"][name]) for name in VARIANTS},
      "ratio_to_plain": ratios["wall"],
      "cpu_ratio_to_plain": ratios["cpu"],
  }
  print(f"[{workload.name}] plain {result['step_time_s']['plain']['median'] * 1e3:.2f} ms; "
        + "; ".join(f"{name} x{ratios['wall'][name]['median']:.3f}"
                    for name in VARIANTS if name != "plain"), flush=True)
  return result


# --- reporting ----------------------------------------------------------------


def markdown_table(report: dict[str, Any]) -> str:
  config = report["config"]
  lines = common.report_header(
      "Diagnostics overhead: precision statistics inside a jitted train step",
      report) + [
      "Every variant is the same `jmp_lite.loss_scaling(adam)` step (params "
      f"f32, `DynamicLossScale({INITIAL_SCALE:g})`, `jax.jit` with the state "
      "donated, compiled ahead of time) plus: **stats** — "
      "`diagnostics.tensor_stats` of the unscaled gradients at the step's loss "
      "scale (counts, largest magnitude, 300-bin log2 histogram per leaf), "
      "every step, returned from `jit`; **cond_stats** — the same under "
      f"`lax.cond(step % {EVERY} == 0, ...)` around the statistics only, zeros "
      "otherwise; **cond_step** — `lax.cond` choosing between the whole step "
      "with the statistics and the whole step without. A "
      "timed block of 4 steps rarely contains a collecting step, so the cond "
      f"variants give the cost of collecting every {EVERY} steps on the other "
      "steps.",
      "",
      f"Per-step time: median over {config['repeats']} blocks of "
      f"{config['steps']} steps, the variants interleaved in one process, the "
      "order rotating each repeat. Ratios: median of the per-block ratios to "
      "the plain step, with the interquartile range; the CPU-time ratio is the "
      "same from the process's CPU time.",
      "",
      "| workload | policy | plain ms/step | variant | ms/step | ratio to plain "
      "| ratio IQR | CPU-time ratio | kernels |",
      "|---|---|---:|---|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    plain = r["step_time_s"]["plain"]["median"] * 1e3
    for name in VARIANTS[1:]:
      ratio, cpu = r["ratio_to_plain"][name], r["cpu_ratio_to_plain"][name]
      lines.append(
          f"| {r['workload']}: {r['description']} | `{r['policy']}` | {plain:.2f} "
          f"| {name} | {r['step_time_s'][name]['median'] * 1e3:.2f} "
          f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
          f"| {cpu['median']:.3f} "
          f"| {r['compile'][name]['entry_kernels']} (plain "
          f"{r['compile']['plain']['entry_kernels']}) |")
  lines += [
      "",
      "Kernels: instructions in the optimized HLO's ENTRY computation. Before "
      f"timing, every variant was run {CHECK_STEPS} steps from the same params "
      "and gave exactly the plain step's params. Full figures: "
      "`diagnostics_overhead.json`.",
      "",
  ]
  return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.diagnostics_overhead",
      description="Step-time overhead of jmp_lite.diagnostics statistics "
                  "inside a jitted MLP train step.")
  common.add_timing_args(parser, steps=(4, 2), repeats=(41, 3))
  return common.finish_timing_args(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  config = {
      "steps": args.steps,
      "repeats": args.repeats,
      "quick": args.quick,
      "seed": args.seed,
      "every": EVERY,
      "check_steps": CHECK_STEPS,
      "initial_loss_scale": INITIAL_SCALE,
      "learning_rate": LEARNING_RATE,
      "variants": DESCRIPTIONS,
  }
  common.publish(
      "diagnostics_overhead", argv, args.out, config,
      lambda: [run_workload(w, args.steps, args.repeats, args.seed)
               for w in make_workloads(["mlp"], args.computes, args.quick)],
      markdown_table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
