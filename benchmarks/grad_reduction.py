"""Cost of reducing gradients across devices in float32 (``grouped_value_and_grad``).

The question: under ``jax.jit`` with a sharded batch, ``jax.jit`` all-reduces
each weight gradient in the compute dtype (float16/bfloat16), right after the
backward matmul that produces it. ``jmp_lite.grouped_value_and_grad`` computes
one gradient per device group (``jax.vmap``) and averages the groups in
float32, so the all-reduce is float32. What does that cost per train step?

Both steps run the same data-parallel MLP train step on 8 simulated CPU
devices (batch sharded over them, params and optimizer state replicated):
policy params f32 / compute f16 or bf16 / output f32, Adam,
``DynamicLossScale``, ``loss_scaling`` + ``scaled_value_and_grad``:

(a) grouped: ``grouped_value_and_grad(scaled_value_and_grad(loss_fn, state), 8)``;
(b) plain: ``scaled_value_and_grad(loss_fn, state)``.

For each, the script reports the dtypes of the weight-gradient all-reduces
(from the HLO right after SPMD partitioning, and from the compiled HLO: XLA:CPU
promotes bfloat16 all-reduces to float32 later on, GPUs do not), checks that
both steps train to the same params (up to float16/bfloat16 rounding), then
times them as ``benchmarks/wrapper_overhead.py`` does: blocks of ``--steps``
steps, (a) and (b) interleaved in one process, alternating which goes first,
``--repeats`` times; ratio = median of the per-block ratios (a)/(b).

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

_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Before jax initialises its backend.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={_DEVICES}").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.models import apply_mlp  # noqa: E402
from benchmarks.models import init_mlp  # noqa: E402

NAME = "grad_reduction"
VARIANTS = ("grouped", "plain")
INITIAL_SCALE = 2.0**15
LEARNING_RATE = 1e-3
CHECK_STEPS = 4
# The gradients of the two steps differ by the rounding of the per-device
# partial gradients to the half dtype (summed in float32 in (a), in the half
# dtype in (b)): they agree to a few units of its epsilon, relative to each
# gradient's largest element (the tolerance of tests/test_grad_reduction.py).
CHECK_RTOL = {"f16": 2.0**-8, "bf16": 2.0**-5}


@dataclasses.dataclass(frozen=True)
class Workload:
  """The data-parallel MLP at one compute dtype.

  Attributes:
    compute: ``"f16"`` or ``"bf16"``.
    batch: global batch size (split over the devices).
    sizes: MLP widths including input and output.
  """

  compute: str
  batch: int
  sizes: tuple[int, ...]
  devices: int = _DEVICES

  @property
  def name(self) -> str:
    return f"mlp-{self.compute}" + ("" if self.devices == _DEVICES else "-1dev")

  @property
  def policy(self) -> jmp_lite.Policy:
    return jmp_lite.get_policy(f"p=f32,c={self.compute},o=f32")

  def describe(self) -> str:
    where = (f"over {self.devices} devices" if self.devices > 1
             else f"on 1 device ({_DEVICES} groups, control)")
    return f"MLP {'->'.join(map(str, self.sizes))}, global batch {self.batch} {where}"


def make_workloads(computes: list[str], quick: bool, control: bool) -> list[Workload]:
  """The 8-device workloads, then (``control``) the same on one device."""
  batch, sizes = (16, (16, 32, 32, 10)) if quick else (256, (784, 1024, 1024, 10))
  return [Workload(c, batch, sizes, devices)
          for devices in ((_DEVICES, 1) if control else (_DEVICES,))
          for c in computes]


def make_loss_fn(policy: jmp_lite.Policy):
  def loss_fn(params, batch):
    params, x = policy.cast_to_compute((params, batch["x"]))
    logits = apply_mlp(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()

  return loss_fn


def make_step(loss_fn, opt, num_groups: int | None) -> common.Step:
  """The loss-scaled Adam step; ``num_groups`` wraps the gradient in
  ``grouped_value_and_grad`` (``None``: the plain step)."""

  def step(state, batch):
    params, opt_state = state
    grad_fn = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)
    if num_groups is not None:
      grad_fn = jmp_lite.grouped_value_and_grad(grad_fn, num_groups)
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


def check_same(states, batch, loss_fn, compute: str) -> dict[str, Any]:
  """Compares the two steps' (scaled) gradients and losses from one state."""
  params, opt_state = states["plain"]
  plain = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)
  grouped = jmp_lite.grouped_value_and_grad(plain, _DEVICES)
  (loss_a, grads_a), (loss_b, grads_b) = (
      jax.jit(f)(params, batch) for f in (grouped, plain))
  rel = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
               / np.max(np.abs(np.asarray(b, np.float64))))
         for a, b in zip(jax.tree_util.tree_leaves(grads_a),
                         jax.tree_util.tree_leaves(grads_b))]
  check = {"max_rel_grad_diff": max(rel), "rtol": CHECK_RTOL[compute],
           "loss": [float(loss_a), float(loss_b)]}
  check["same"] = bool(max(rel) <= check["rtol"] and
                       abs(float(loss_a) - float(loss_b)) <= 1e-3 * abs(float(loss_b)))
  return check


def run_workload(workload: Workload, steps: int, repeats: int, seed: int) -> dict[str, Any]:
  mesh = Mesh(np.array(jax.devices()[:workload.devices]), ("data",))
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  key_params, key_x, key_y = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = init_mlp(key_params, workload.sizes)
  batch = jax.device_put({
      "x": jax.random.normal(key_x, (workload.batch, workload.sizes[0]), jnp.float32),
      "y": jax.random.randint(key_y, (workload.batch,), 0, workload.sizes[-1], jnp.int32),
  }, data)
  loss_fn = make_loss_fn(workload.policy)
  opt = jmp_lite.loss_scaling(optax.adam(LEARNING_RATE),
                              jmp_lite.DynamicLossScale(INITIAL_SCALE))
  steps_fns = {"grouped": make_step(loss_fn, opt, _DEVICES),
               "plain": make_step(loss_fn, opt, None)}
  states = {name: jax.device_put(common.fresh_copy((params, opt.init(params))), replicated)
            for name in VARIANTS}

  hlo, fns, compile_info = {}, {}, {}
  for name in VARIANTS:
    fns[name], compile_info[name] = common.compile_step(steps_fns[name], states[name], batch)
    hlo[name] = {
        "partitioned": weight_dtypes(partitioned_types(steps_fns[name], states[name], batch)),
        "compiled": weight_dtypes(all_reduce_types(fns[name].as_text())),
    }
  print(f"[{workload.name}] weight-gradient all-reduces: {hlo}", flush=True)

  check = check_same(states, batch, loss_fn, workload.compute)
  print(f"[{workload.name}] check: {check}", flush=True)
  if not check["same"]:
    raise SystemExit(f"{workload.name}: the two steps do not compute alike ({check}).")
  for name in VARIANTS:  # warm-up
    states[name], _ = common.run_steps(fns[name], states[name], batch, CHECK_STEPS)

  per_step = common.time_interleaved(fns, states, batch, steps, repeats, VARIANTS)
  ratio, cpu_ratio = (
      common.ratio_summary(times["grouped"], times["plain"])
      for times in (per_step["wall"], per_step["cpu"]))
  result = {
      "workload": workload.name,
      "description": workload.describe(),
      "policy": str(workload.policy),
      "batch": workload.batch,
      "sizes": list(workload.sizes),
      "devices": workload.devices,
      "num_groups": _DEVICES,
      "param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
      "all_reduce_dtypes": hlo,
      "check": check,
      "compile": compile_info,
      "step_time_s": {n: common.summarize(per_step["wall"][n]) for n in VARIANTS},
      "cpu_time_s": {n: common.summarize(per_step["cpu"][n]) for n in VARIANTS},
      "ratio_grouped_over_plain": ratio,
      "cpu_ratio_grouped_over_plain": cpu_ratio,
  }
  print(
      f"[{workload.name}] grouped {result['step_time_s']['grouped']['median'] * 1e3:.2f} ms"
      f"  plain {result['step_time_s']['plain']['median'] * 1e3:.2f} ms"
      f"  ratio {ratio['median']:.3f} [IQR {ratio['q25']:.3f}-{ratio['q75']:.3f}]"
      f"  CPU-time ratio {cpu_ratio['median']:.3f}", flush=True)
  return result


# --- reporting ----------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
  config = report["config"]
  lines = common.report_header(
      "Gradient reduction in float32: `grouped_value_and_grad` vs the plain step",
      report) + [
      f"A data-parallel train step on {_DEVICES} simulated CPU devices (batch "
      "sharded, params and Adam state replicated; `jax.jit`, state donated, "
      f"compiled ahead of time): `loss_scaling(adam({LEARNING_RATE:g}), "
      f"DynamicLossScale({INITIAL_SCALE:g}))`, params f32. (a) grouped: "
      f"`grouped_value_and_grad(scaled_value_and_grad(loss_fn, state), "
      f"{_DEVICES})`; (b) plain: `scaled_value_and_grad(loss_fn, state)`. "
      "The control rows (`-1dev`) run the same two steps on one device, the "
      f"grouped one still with {_DEVICES} groups: no all-reduce, so they show "
      "what the grouping itself costs locally.",
      "",
      f"Per-step time: median over {config['repeats']} blocks of "
      f"{config['steps']} steps, (a) and (b) interleaved in one process, "
      "alternating which goes first; ratio: median of the per-block ratios "
      "(a)/(b) and its interquartile range; CPU-time ratio: the same from the "
      "process's CPU time.",
      "",
      "| workload | policy | weight-grad all-reduce (a) / (b), after partitioning "
      "| ... compiled for CPU | (a) ms/step | (b) ms/step | ratio (a)/(b) "
      "| ratio IQR | CPU-time ratio | compile (a) / (b) s |",
      "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    a, b = r["step_time_s"]["grouped"], r["step_time_s"]["plain"]
    ratio, cpu = r["ratio_grouped_over_plain"], r["cpu_ratio_grouped_over_plain"]
    h = r["all_reduce_dtypes"]
    fmt = lambda d: "+".join(d) or "none"  # noqa: E731
    lines.append(
        f"| {r['workload']}: {r['description']} | `{r['policy']}` "
        f"| {fmt(h['grouped']['partitioned'])} / {fmt(h['plain']['partitioned'])} "
        f"| {fmt(h['grouped']['compiled'])} / {fmt(h['plain']['compiled'])} "
        f"| {a['median'] * 1e3:.2f} | {b['median'] * 1e3:.2f} "
        f"| {ratio['median']:.3f} | {ratio['q25']:.3f}-{ratio['q75']:.3f} "
        f"| {cpu['median']:.3f} "
        f"| {r['compile']['grouped']['total_s']:.2f} / "
        f"{r['compile']['plain']['total_s']:.2f} |")
  lines += [
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
      "**CPU caveat**: the 8 devices are simulated on the host's cores and "
      "their all-reduces are memory copies, so these ratios say little about "
      "a GPU: they mix the extra local work of the grouped step (per-group "
      "gradients as batched matmuls, float32 converts and sums) with how "
      "XLA:CPU runs each program's collectives and matmuls (a ratio below 1 "
      "is such an artefact, not a speed-up to expect; the control rows show "
      "the grouping's local cost without any collective: on one device, all "
      f"{_DEVICES} per-group weight gradients are materialised before the "
      "average). On GPUs "
      "with NCCL a float32 all-reduce moves twice the bytes of a "
      "half-precision one; that cost was not measured (no GPU). Full figures: "
      "`grad_reduction.json`.",
      "",
  ]
  return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.grad_reduction",
      description="Step-time cost of jmp_lite.grouped_value_and_grad's float32 "
                  "gradient reduction on 8 simulated CPU devices.")
  common.add_timing_args(parser, steps=(2, 1), repeats=(31, 3),
                         computes=tuple(CHECK_RTOL))
  parser.add_argument("--no-control", action="store_true",
                      help="skip the control rows: the same steps on one device")
  return common.finish_timing_args(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if jax.device_count() < _DEVICES:
    raise SystemExit(
        f"needs {_DEVICES} devices, found {jax.device_count()}: XLA_FLAGS "
        f"already set --xla_force_host_platform_device_count lower "
        f"({os.environ.get('XLA_FLAGS')!r}).")
  config = {
      "steps": args.steps, "repeats": args.repeats, "quick": args.quick,
      "seed": args.seed, "devices": _DEVICES, "check_steps": CHECK_STEPS,
      "initial_loss_scale": INITIAL_SCALE, "learning_rate": LEARNING_RATE,
      "variants": {
          "grouped": f"grouped_value_and_grad(scaled_value_and_grad(loss_fn, "
                     f"state), {_DEVICES})",
          "plain": "scaled_value_and_grad(loss_fn, state)",
      },
  }
  common.publish(
      NAME, argv, args.out, config,
      lambda: [run_workload(w, args.steps, args.repeats, args.seed)
               for w in make_workloads(args.computes, args.quick,
                                       not args.no_control)],
      markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
