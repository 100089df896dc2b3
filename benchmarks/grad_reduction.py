"""Cost of reducing gradients across devices in float32 (``pmean_value_and_grad(..., num_groups=...)``).

The question: under ``jax.jit`` with a sharded batch, ``jax.jit`` all-reduces
each weight gradient in the compute dtype (float16/bfloat16), right after the
backward matmul that produces it. ``jmp_lite.pmean_value_and_grad`` with
``num_groups`` computes
one gradient per device group (``jax.vmap``) and averages the groups in
float32, so the all-reduce is float32. What does that cost per train step?

Both steps run the same data-parallel MLP train step on 8 simulated CPU
devices (batch sharded over them, params and optimizer state replicated):
policy params f32 / compute f16 or bf16 / output f32, Adam,
``DynamicLossScale``, ``loss_scaling`` + ``scaled_value_and_grad``:

(a) grouped: ``pmean_value_and_grad(scaled_value_and_grad(loss_fn, state), num_groups=8)``;
(b) plain: ``scaled_value_and_grad(loss_fn, state)``.

For each, the script reports the dtypes of the weight-gradient all-reduces
(from the HLO right after SPMD partitioning, and from the compiled HLO: XLA:CPU
promotes bfloat16 all-reduces to float32 later on, GPUs do not), checks that
both steps compute the same gradients (up to float16/bfloat16 rounding), then
times them (``benchmarks/runner.py``). Control rows run the same two steps on
one device.

**CPU caveat.** The 8 devices are simulated on the host's cores and their
all-reduces are memory copies, so the figures measure the extra local work
(per-group gradients, float32 converts, the float32 reduction) more than the
collective: on GPUs with NCCL a float32 all-reduce moves twice the bytes of a
half-precision one, which this machine cannot measure.

Run from the repository root::

  python -m benchmarks.grad_reduction                    # ~2 min on 2 cores
  python -m benchmarks.grad_reduction --update-results   # ... into benchmarks/results/
  python -m benchmarks.grad_reduction --quick --out /tmp/gr   # smoke test
"""

from __future__ import annotations

import os

DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Before jax initialises its backend.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import glob  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import runner  # noqa: E402
from benchmarks import workloads as wl  # noqa: E402

VARIANTS = {
    "grouped": f"pmean_value_and_grad(scaled_value_and_grad(loss_fn, state), num_groups={DEVICES})",
    "plain": "scaled_value_and_grad(loss_fn, state)",
}
RATIOS = {"ratio_grouped_over_plain": ("grouped", "plain")}
CHECK_STEPS = 4
# The gradients of the two steps differ by the rounding of the per-device
# partial gradients to the half dtype (summed in float32 in (a), in the half
# dtype in (b)): they agree to a few units of its epsilon, relative to each
# gradient's largest element (the tolerance of tests/test_grad_reduction.py).
CHECK_RTOL = {"f16": 2.0**-8, "bf16": 2.0**-5}


def make_step(loss_fn, opt, num_groups: int | None) -> common.Step:
  """The loss-scaled Adam step; ``num_groups`` wraps the gradient in
  ``pmean_value_and_grad(..., num_groups=num_groups)`` (``None``: the plain
  step)."""

  def step(state, batch):
    params, opt_state = state
    grad_fn = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)
    if num_groups is not None:
      grad_fn = jmp_lite.pmean_value_and_grad(grad_fn, num_groups=num_groups)
    loss, grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


# --- HLO ------------------------------------------------------------------------


def all_reduce_types(hlo_text: str) -> list[str]:
  """``dtype[shape]`` of every array an all-reduce of the HLO reduces."""
  types = []
  for line in hlo_text.splitlines():
    if re.search(r"\ball-reduce(-start)?\(", line):
      result = line.split("=", 1)[1].split("all-reduce", 1)[0]
      types += re.findall(r"\b([a-z]+\d*\[[\d,]*\])", result)
  return types


def weight_dtypes(types: list[str]) -> list[str]:
  """The dtypes of the non-scalar all-reduced arrays (the gradients)."""
  return sorted({t.split("[", 1)[0] for t in types if not t.endswith("[]")})


def partitioned_types(step, state, batch) -> list[str]:
  """All-reduce types right after SPMD partitioning (before backend passes)."""
  with tempfile.TemporaryDirectory() as dump:
    jax.jit(step).lower(state, batch).compile(compiler_options={
        "xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    files = glob.glob(os.path.join(dump, "*after_spmd-partitioning*"))
    return all_reduce_types(pathlib.Path(files[0]).read_text()) if files else []


# --- one workload -------------------------------------------------------------------


def make_check(loss_fn, compute: str):
  """The criterion: from one state, the two gradients agree up to the half
  dtype's rounding (largest |difference| / largest |gradient| per leaf) and
  the losses to 1e-3; then every step runs CHECK_STEPS steps (warm-up)."""

  def check(fns, states, batch):
    params, opt_state = states["plain"]
    plain = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)
    grouped = jmp_lite.pmean_value_and_grad(plain, num_groups=DEVICES)
    (loss_a, grads_a), (loss_b, grads_b) = (jax.jit(f)(params, batch) for f in (grouped, plain))
    rel = max(runner.max_abs_diff(a, b) / float(np.max(np.abs(np.asarray(b, np.float64))))
              for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)))
    losses = [float(loss_a), float(loss_b)]
    states, _ = runner.run_all(fns, states, batch, CHECK_STEPS)
    return states, {"max_rel_grad_diff": rel, "rtol": CHECK_RTOL[compute], "loss": losses,
                    "same": bool(rel <= CHECK_RTOL[compute]
                                 and abs(losses[0] - losses[1]) <= 1e-3 * abs(losses[1]))}

  return check


def measure(case: tuple[wl.Workload, str, int], args) -> dict[str, Any]:
  workload, compute, devices = case
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  policy = wl.policy(compute)
  params, batch = wl.setup(workload, args.seed)
  batch = jax.device_put(batch, data)
  loss_fn = wl.loss_fn(workload, "policy", policy)
  opt = jmp_lite.loss_scaling(optax.adam(common.LEARNING_RATE),
                              jmp_lite.DynamicLossScale(common.INITIAL_SCALE))
  steps = {"grouped": make_step(loss_fn, opt, DEVICES), "plain": make_step(loss_fn, opt, None)}
  states = {name: jax.device_put(common.fresh_copy((params, opt.init(params))), replicated)
            for name in steps}

  def inspect(fns):
    return {"all_reduce_dtypes": {name: {
        "partitioned": weight_dtypes(partitioned_types(steps[name], states[name], batch)),
        "compiled": weight_dtypes(all_reduce_types(fns[name].as_text()))} for name in fns}}

  name = f"{workload.name}-{compute}" + ("" if devices == DEVICES else "-1dev")
  where = (f"over {devices} devices" if devices > 1
           else f"on 1 device ({DEVICES} groups, control)")
  result = runner.measure(name, steps, states, batch, runner.Timing.from_args(args),
                          check=make_check(loss_fn, compute), ratios=RATIOS, inspect=inspect)
  return {"workload": name,
          "description": f"{workload.description.replace('batch', 'global batch')} {where}",
          "policy": str(policy), "devices": devices, "num_groups": DEVICES,
          "param_count": common.param_count(params), **result}


# --- reporting ----------------------------------------------------------------------


def table(report: dict[str, Any]) -> list[str]:
  lines = [
      f"A data-parallel train step on {DEVICES} simulated CPU devices (batch "
      "sharded, params and Adam state replicated; `jax.jit`, state donated, "
      f"compiled ahead of time): `loss_scaling(adam({common.LEARNING_RATE:g}), "
      f"DynamicLossScale({common.INITIAL_SCALE:g}))`, params f32. (a) grouped: "
      f"`{VARIANTS['grouped']}`; (b) plain: `{VARIANTS['plain']}`. "
      "The control rows (`-1dev`) run the same two steps on one device, the "
      f"grouped one still with {DEVICES} groups: no all-reduce, so they show "
      "what the grouping itself costs locally.",
      "",
      runner.method(report["config"], "(a)/(b)"),
      "",
      "| workload | policy | weight-grad all-reduce (a) / (b), after partitioning "
      "| ... compiled for CPU | (a) ms/step | (b) ms/step | ratio (a)/(b) "
      "| ratio IQR | CPU-time ratio | compile (a) / (b) s |",
      "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  dtypes = lambda d: "+".join(d) or "none"  # noqa: E731
  for r in report["results"]:
    a, b = r["step_time_s"]["grouped"], r["step_time_s"]["plain"]
    ratio, h = r["ratio_grouped_over_plain"], r["all_reduce_dtypes"]
    lines.append(
        f"| {r['workload']}: {r['description']} | `{r['policy']}` "
        f"| {dtypes(h['grouped']['partitioned'])} / {dtypes(h['plain']['partitioned'])} "
        f"| {dtypes(h['grouped']['compiled'])} / {dtypes(h['plain']['compiled'])} "
        f"| {a['median'] * 1e3:.2f} | {b['median'] * 1e3:.2f} "
        f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
        f"| {r['cpu_ratio_grouped_over_plain']['median']:.3f} "
        f"| {r['compile']['grouped']['total_s']:.2f} / "
        f"{r['compile']['plain']['total_s']:.2f} |")
  return lines + [
      "",
      "All-reduce dtypes: of the non-scalar all-reduces (the gradients), in "
      "the HLO right after SPMD partitioning and in the compiled CPU HLO. "
      "XLA:CPU rewrites bfloat16 all-reduces to float32 after partitioning "
      "(`all-reduce-promotion`); GPU backends keep them in bfloat16. Before "
      "timing, the two gradients of the same state were checked to agree up "
      "to the half dtype's rounding (max |difference| / max |gradient| per "
      "leaf: "
      + ", ".join(f"{r['workload']} {r['check']['max_rel_grad_diff']:.1e}"
                  for r in report["results"]) + ").",
      "",
      f"**CPU caveat**: the {DEVICES} devices are simulated on the host's cores and "
      "their all-reduces are memory copies, so these ratios say little about "
      "a GPU: they mix the extra local work of the grouped step (per-group "
      "gradients as batched matmuls, float32 converts and sums) with how "
      "XLA:CPU runs each program's collectives and matmuls (a ratio below 1 "
      "is such an artefact, not a speed-up to expect; the control rows show "
      "the grouping's local cost without any collective: on one device, all "
      f"{DEVICES} per-group weight gradients are materialised before the "
      "average). On GPUs with NCCL a float32 all-reduce moves twice the bytes "
      "of a half-precision one; that cost was not measured (no GPU). Full "
      "figures: `grad_reduction.json`.",
      "",
  ]


def workloads(args) -> list[tuple[wl.Workload, str, int]]:
  """The 8-device workloads, then (unless ``--no-control``) the same on one device."""
  if jax.device_count() < DEVICES:
    raise SystemExit(
        f"needs {DEVICES} devices, found {jax.device_count()}: XLA_FLAGS "
        f"already set --xla_force_host_platform_device_count lower "
        f"({os.environ.get('XLA_FLAGS')!r}).")
  (workload,) = wl.make_workloads("quick" if args.quick else "cpu", ["mlp"])
  if args.quick:
    # Two examples per device: the float16 gradient of one example, scaled by
    # 2**15, can overflow in its group.
    workload = wl.mlp(2 * DEVICES, tuple(workload.spec["sizes"]))
  return [(workload, compute, devices)
          for devices in ((DEVICES,) if args.no_control else (DEVICES, 1))
          for compute in args.computes]


STUDY = runner.Study(
    name="grad_reduction",
    title="Gradient reduction in float32: `pmean_value_and_grad(num_groups=...)` vs the plain step",
    description="Step-time cost of jmp_lite.pmean_value_and_grad's float32 "
                f"gradient reduction on {DEVICES} simulated CPU devices.",
    workloads=workloads, measure=measure, table=table,
    repeats=(31, 3), steps=(2, 1), computes=tuple(CHECK_RTOL),
    add_flags=lambda parser: parser.add_argument(
        "--no-control", action="store_true",
        help="skip the control rows: the same steps on one device"),
    config=lambda args: {"devices": DEVICES, "check_steps": CHECK_STEPS,
                         "control": not args.no_control, "variants": VARIANTS})


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
