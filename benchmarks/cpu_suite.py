"""The CPU suite: step-time and compile-time ratios, residual bytes, FLOP shares.

Run as ``python -m benchmarks run --suite cpu`` (see ``benchmarks/README.md``);
it writes ``cpu.json`` and ``cpu.md``. Absolute CPU times say nothing about
accelerators (XLA:CPU emulates half precision); the suite reports *ratios*
between variants that compute the same thing (timed with
``benchmarks/runner.py``), and static properties of the programs (bytes saved
for the backward pass, share of matmul FLOPs in half precision), which carry
over to GPUs. The example models' static figures come from the builders of
``residual_recompute.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import residual_recompute
from benchmarks import runner
from benchmarks import workloads as wl

CHECK_STEPS = 3
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5
#: bf16 variants compiled --compile-repeats times, interleaved (median;
#: ratios: median of the per-round ratios).
COMPILE_REPEATED = ("jmp_lite", "hand", "autocast")
TARGETS = {
    "wrapper_step_ratio": 1.03,
    "autocast_step_ratio": 1.05,
    "autocast_compile_ratio": 1.5,
    "residual_ratio_examples": 0.55,
    "residual_ratio_floor": 0.5,
    "half_flop_share": 1.0,
}
#: Interleaved groups: variants timed against each other, by compute dtype.
#: ``autocast`` is the ``jmp_lite`` step on the loss under ``jmp_lite.autocast``;
#: the others are :data:`common.STEP_KINDS` on the loss cast by the policy.
GROUPS = {
    "bf16": ("jmp_lite", "hand", "apply_if_finite", "autocast"),
    "f16": ("jmp_lite", "hand"),
}
RATIOS = {  # name: (group, numerator, denominator)
    "jmp_lite/hand bf16": ("bf16", "jmp_lite", "hand"),
    "jmp_lite/hand f16": ("f16", "jmp_lite", "hand"),
    "jmp_lite/apply_if_finite bf16": ("bf16", "jmp_lite", "apply_if_finite"),
    "autocast/policy bf16": ("bf16", "autocast", "jmp_lite"),
}
MB = 1e6
REMAT = "`save_half_residuals`"


# --- step and compile time --------------------------------------------------------


def check(fns, states, batch) -> tuple[dict, dict[str, Any]]:
  """The jmp_lite and hand-written steps give the same losses (every variant
  runs CHECK_STEPS steps; their losses are kept)."""
  states, losses = runner.run_all(fns, states, batch, CHECK_STEPS)
  return states, {"losses": losses, "same": bool(np.allclose(
      losses["jmp_lite"], losses["hand"], rtol=CHECK_RTOL, atol=CHECK_ATOL))}


def time_workload(workload: wl.Workload, params, batch, args) -> dict[str, Any]:
  """Compiles, checks and times every variant of one workload, group by group."""
  result: dict[str, Any] = {key: {} for key in (
      "compile", "check", "step_time_s", "cpu_time_s", "block_steps", "ratios")}
  f32_step, f32_state = common.build_step("plain", wl.loss_fn(workload, "f32"), params)
  _, result["compile"]["f32"] = common.compile_step(f32_step, f32_state, batch)
  for group, names in GROUPS.items():
    policy = wl.policy(group)
    built = {name: common.build_step(
        "jmp_lite" if name == "autocast" else name,
        wl.loss_fn(workload, "autocast" if name == "autocast" else "policy", policy),
        params) for name in names}
    shapes = {name: common.shape_structs(state) for name, (_, state) in built.items()}
    ratios = {key: (num, den) for key, (g, num, den) in RATIOS.items() if g == group}
    measured = runner.measure(
        f"{workload.name} {group}", {n: step for n, (step, _) in built.items()},
        {n: state for n, (_, state) in built.items()}, batch,
        runner.Timing.from_args(args), check=check, ratios={"ratios": ratios})
    for name in names:
      for key in ("compile", "step_time_s", "cpu_time_s"):
        result[key][f"{group}/{name}"] = measured[key][name]
      result["check"][f"{group}/{name}"] = measured["check"]["losses"][name]
    result["block_steps"][group] = measured["steps_per_block"]
    for key in ratios:
      result["ratios"][key] = {"wall": measured["ratios"][key],
                               "cpu": measured["cpu_ratios"][key]}
    if group == "bf16":
      _recompile_interleaved(built, shapes, batch, args.compile_repeats - 1,
                             result["compile"])
  comp = result["compile"]

  def round_ratio(num: str, den: str) -> float:
    """Median over compilation rounds of the per-round ratio."""
    pairs = zip(comp[num]["total_s_values"], comp[den]["total_s_values"])
    return float(np.median([a / b for a, b in pairs]))

  result["compile_ratios"] = {
      "jmp_lite/hand bf16": round_ratio("bf16/jmp_lite", "bf16/hand"),
      "jmp_lite/apply_if_finite bf16":
          comp["bf16/jmp_lite"]["total_s"] / comp["bf16/apply_if_finite"]["total_s"],
      "autocast/policy bf16": round_ratio("bf16/autocast", "bf16/jmp_lite"),
      "jmp_lite bf16/f32": comp["bf16/jmp_lite"]["total_s"] / comp["f32"]["total_s"],
  }
  return result


def _recompile_interleaved(built, shapes, batch, rounds: int, compile_info) -> None:
  """Compiles the ``COMPILE_REPEATED`` bf16 variants ``rounds`` more times.

  Rounds interleave the variants (order rotating), like the step timing, so
  that a burst of load from other processes hits one round of every variant
  rather than all compilations of one. Updates ``compile_info`` in place:
  ``total_s_values`` gets one value per round, ``total_s`` etc. the medians.
  """
  names = list(COMPILE_REPEATED)
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      _, info = common.compile_step(built[name][0], shapes[name], batch)
      entry = compile_info[f"bf16/{name}"]
      entry["total_s_values"].append(info["total_s"])
      for key in ("lower_s", "compile_s"):
        entry.setdefault(f"{key}_values", [entry[key]]).append(info[key])
  for name in names:
    entry = compile_info[f"bf16/{name}"]
    entry["total_s"] = float(np.median(entry["total_s_values"]))
    for key in ("lower_s", "compile_s"):
      entry[key] = float(np.median(entry.get(f"{key}_values", [entry[key]])))


# --- static figures ---------------------------------------------------------------


def figures(loss, params, exclude) -> dict[str, Any]:
  """Residual bytes and matmul FLOPs of the scalar function ``loss(params)``."""
  return {"residuals": analysis.residual_bytes(loss, params, exclude),
          "flops": analysis.matmul_flops(jax.value_and_grad(loss), params)}


def relative_to_f32(out: dict[str, Any]) -> dict[str, Any]:
  """Adds each entry's residual ratios to the ``"f32"`` entry's; returns ``out``."""
  base = out["f32"]["residuals"]
  for figs in out.values():
    r = figs["residuals"]
    r["ratio_vs_f32"] = r["bytes"] / base["bytes"]
    r["activation_ratio_vs_f32"] = r["activation_bytes"] / base["activation_bytes"]
  return out


def workload_static(workload: wl.Workload, params, batch) -> dict[str, Any]:
  """f32, policy, autocast and policy + ``save_half_residuals``, bf16 and f16."""
  losses = {"f32": wl.loss_fn(workload, "f32")}
  for dt in GROUPS:
    losses[f"policy {dt}"] = wl.loss_fn(workload, "policy", wl.policy(dt))
    losses[f"autocast {dt}"] = wl.loss_fn(workload, "autocast", wl.policy(dt))
    losses[f"policy+remat {dt}"] = jax.checkpoint(
        losses[f"policy {dt}"], policy=jmp_lite.save_half_residuals)
  return relative_to_f32({k: figures(lambda p, f=f: f(p, batch), params, batch)
                          for k, f in losses.items()})


def example_static(name: str, args) -> dict[str, Any]:
  """An example model (``DigitsCNN`` under ``jmp_lite.linen.apply_policy`` in
  training mode, ``CharLM`` under ``jmp_lite.nnx.apply_policy``): f32, the
  policy and the policy + ``save_half_residuals`` (``remat loss``)."""
  out = {}
  for compute in GROUPS:
    model = residual_recompute.MODELS[name](compute, args.quick, args.seed)
    for variant, key in (("f32", "f32"), ("policy", compute),
                         ("remat loss", f"{compute}+remat")):
      loss = model["losses"][variant]
      out[key] = figures(lambda p, loss=loss: loss(p, model["stats"], model["batch"])[0],
                         model["params"][variant],
                         (model["batch"], model["stats"], model["exclude"][variant]))
  return {"description": model["description"], "figures": relative_to_f32(out)}


def measure(workload: wl.Workload, args) -> dict[str, Any]:
  print(f"[cpu] {workload.name}: {workload.description}", flush=True)
  params, batch = wl.setup(workload, args.seed)
  return {"workload": workload.name, "description": workload.description,
          "param_count": common.param_count(params),
          "static": workload_static(workload, params, batch),
          **time_workload(workload, params, batch, args)}


# --- tables -------------------------------------------------------------------------


def step_time_table(report: dict[str, Any]) -> list[str]:
  target = report["config"]["targets"]["wrapper_step_ratio"]
  lines = [
      "## 1. Step time: the wrapper vs the same step by hand vs `optax.apply_if_finite`",
      "",
      "Per-step wall time, median over the interleaved blocks (ms). Ratio: median "
      "of the per-block ratios (interquartile range in brackets). bf16 variants "
      "are interleaved with each other, f16 variants likewise. "
      f"Target: jmp_lite/hand <= {target}.",
      "",
      "| workload | bf16 jmp_lite | bf16 hand | bf16 apply_if_finite | f16 jmp_lite "
      "| f16 hand | jmp_lite/hand bf16 | jmp_lite/hand f16 | <= 1.03 "
      "| jmp_lite/apply_if_finite bf16 | CPU-time ratios (bf16, f16, aif) |",
      "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|",
  ]
  keys = ("jmp_lite/hand bf16", "jmp_lite/hand f16", "jmp_lite/apply_if_finite bf16")
  for r in report["results"]:
    t, ratios = r["step_time_s"], r["ratios"]
    ok = all(ratios[k]["wall"]["median"] <= target for k in keys[:2])
    lines.append(
        f"| {r['workload']}: {r['description']} "
        + "".join(f"| {t[k]['median'] * 1e3:.2f} " for k in (
            "bf16/jmp_lite", "bf16/hand", "bf16/apply_if_finite", "f16/jmp_lite", "f16/hand"))
        + "".join(f"| {runner.ratio_cell(ratios[k]['wall'])} " for k in keys[:2])
        + f"| {runner.yes_no(ok)} | {runner.ratio_cell(ratios[keys[2]]['wall'])} "
        + "| " + ", ".join(f"{ratios[k]['cpu']['median']:.3f}" for k in keys) + " |")
  return lines + [""]


def _residual_row(name: str, method: str, f32: dict, bf16: dict, f16: dict,
                  target: float | None) -> str:
  ok = None if target is None else max(
      bf16["activation_ratio_vs_f32"], f16["activation_ratio_vs_f32"]) <= target
  return (
      f"| {name} | {method} | {f32['bytes'] / MB:.2f} | {bf16['bytes'] / MB:.2f} "
      f"| {f16['bytes'] / MB:.2f} | {bf16['ratio_vs_f32']:.3f} | {f16['ratio_vs_f32']:.3f} "
      f"| {bf16['activation_ratio_vs_f32']:.3f} | {f16['activation_ratio_vs_f32']:.3f} "
      f"| {bf16['param_copy_bytes'] / MB:.2f} "
      f"| {runner.fmt(target, '.2f')} | {runner.yes_no(ok)} |"
  )


def residual_table(report: dict[str, Any]) -> list[str]:
  targets = report["config"]["targets"]
  lines = [
      "## 2. Residuals saved for the backward pass",
      "",
      "Bytes (MB = 1e6) of the arrays `jax.vjp(loss, params)` keeps in its closure, "
      "less the params and the batch themselves (traced with `jax.eval_shape`; "
      "see README). Half copies of the params count (they are memory the "
      "backward pass holds); *activations* leaves them out. Floor: "
      f"{targets['residual_ratio_floor']}x. Target for the example models: "
      f"activations <= {targets['residual_ratio_examples']}x f32's, "
      "under both bf16 and f16 (the *met* column).",
      "",
      "| model | method | f32 MB | bf16 MB | f16 MB | bf16/f32 | f16/f32 "
      "| activations bf16/f32 | activations f16/f32 | half param copies MB | target | met |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
  ]
  for r in report["results"]:
    s = r["static"]
    for method, label in (("policy", "policy (pure JAX)"),
                          ("policy+remat", f"policy + {REMAT}"),
                          ("autocast", "autocast (pure JAX)")):
      lines.append(_residual_row(
          r["workload"], label, s["f32"]["residuals"],
          s[f"{method} bf16"]["residuals"], s[f"{method} f16"]["residuals"], None))
  for name, ex in report["example_models"].items():
    fig = ex["figures"]
    method = f"`jmp_lite.{'linen' if name == 'DigitsCNN' else 'nnx'}.apply_policy`"
    for suffix, label in (("", method), ("+remat", f"{method} + {REMAT}")):
      lines.append(_residual_row(
          ex["description"], label, fig["f32"]["residuals"], fig[f"bf16{suffix}"]["residuals"],
          fig[f"f16{suffix}"]["residuals"], targets["residual_ratio_examples"]))
  return lines + [
      "",
      f"{REMAT}: the loss under `jax.checkpoint(loss, policy=jmp_lite.save_half_residuals)`,"
      " which saves only half-precision values and recomputes everything else in the"
      " backward pass (norm statistics kept in f32 by the default rules, softmax, casts,"
      " ReLU masks, broadcasts). Without it, layers kept in float32 save float32 tensors."
      " Its ratios can fall below the 0.5x floor because the f32 run saves masks and"
      " broadcasts that it recomputes; the recomputation costs backward-pass time.",
      "",
  ]


def flop_table(report: dict[str, Any]) -> list[str]:
  lines = [
      "## 3. Share of matmul/conv FLOPs in half precision",
      "",
      "`dot_general` and `conv_general_dilated` FLOPs of `jax.value_and_grad(loss)` "
      "(forward and backward; the optimizer has no matmuls), counted on the "
      "jaxpr, by operand dtype; half = all operands float16/bfloat16. Target: 100%.",
      "",
      "| model | method | GFLOP/step | half share bf16 | half share f16 | other dtypes (bf16) |",
      "|---|---|---:|---:|---:|---|",
  ]

  def row(name, method, bf16, f16):
    other = {k: v for k, v in bf16["by_dtype"].items() if k != "bfloat16"}
    other_s = ", ".join(f"{k}: {v / 1e9:.3g} GFLOP" for k, v in other.items()) or "–"
    return (f"| {name} | {method} | {bf16['total'] / 1e9:.3f} "
            f"| {100 * bf16['half_share']:.1f}% | {100 * f16['half_share']:.1f}% | {other_s} |")

  for r in report["results"]:
    s = r["static"]
    for method in ("policy", "autocast"):
      lines.append(row(r["workload"], method, s[f"{method} bf16"]["flops"],
                       s[f"{method} f16"]["flops"]))
  for ex in report["example_models"].values():
    fig = ex["figures"]
    lines.append(row(ex["description"], "apply_policy", fig["bf16"]["flops"], fig["f16"]["flops"]))
  return lines + [""]


def compile_table(report: dict[str, Any]) -> list[str]:
  lines = [
      "## 4. Compile time",
      "",
      "Tracing + lowering + XLA compilation of the whole jitted train step (s); "
      "bf16 jmp_lite, hand and autocast: median of "
      f"{report['config']['compile_repeats']} rounds of compilations (each traced "
      "afresh; rounds interleave the three variants), the others one; their ratios "
      "are medians of the per-round ratios. The f32 step is compiled first in each "
      "workload, so it also pays for tracing the library's own jitted helpers once.",
      "",
      "| workload | f32 (adam) | bf16 jmp_lite | bf16 hand | bf16 apply_if_finite "
      "| bf16 autocast | jmp_lite/hand | jmp_lite/apply_if_finite | jmp_lite bf16/f32 "
      "| autocast/policy |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["results"]:
    c, q = r["compile"], r["compile_ratios"]
    lines.append(
        f"| {r['workload']} "
        + "".join(f"| {c[k]['total_s']:.2f} " for k in (
            "f32", "bf16/jmp_lite", "bf16/hand", "bf16/apply_if_finite", "bf16/autocast"))
        + "".join(f"| {q[k]:.2f} " for k in (
            "jmp_lite/hand bf16", "jmp_lite/apply_if_finite bf16", "jmp_lite bf16/f32",
            "autocast/policy bf16"))
        + "|")
  return lines + [""]


def autocast_table(report: dict[str, Any]) -> list[str]:
  targets = report["config"]["targets"]
  lines = [
      "## 5. `autocast` vs the same model cast by hand with a policy",
      "",
      "bf16 compute (`p=f32,c=bf16,o=f32`), both in the same `loss_scaling` train "
      "step. Half share: FLOP share in half precision under autocast. Residuals: "
      "autocast's residual bytes relative to f32 and to the hand-cast policy. "
      f"Targets: half share 100%, compile <= {targets['autocast_compile_ratio']}x, "
      f"CPU step time <= {targets['autocast_step_ratio']}x.",
      "",
      "| model | half share | residuals vs f32 | residuals vs policy | compile autocast/policy "
      "| <= 1.5 | step autocast/policy (IQR) | <= 1.05 | CPU-time ratio |",
      "|---|---:|---:|---:|---:|:---:|---:|:---:|---:|",
  ]
  for r in report["results"]:
    s = r["static"]
    res_a, res_p = s["autocast bf16"]["residuals"], s["policy bf16"]["residuals"]
    comp = r["compile_ratios"]["autocast/policy bf16"]
    step = r["ratios"]["autocast/policy bf16"]
    lines.append(
        f"| {r['workload']}: {r['description']} "
        f"| {100 * s['autocast bf16']['flops']['half_share']:.1f}% "
        f"| {res_a['ratio_vs_f32']:.3f} | {res_a['bytes'] / res_p['bytes']:.3f} "
        f"| {comp:.2f} | {runner.yes_no(comp <= targets['autocast_compile_ratio'])} "
        f"| {runner.ratio_cell(step['wall'])} "
        f"| {runner.yes_no(step['wall']['median'] <= targets['autocast_step_ratio'])} "
        f"| {step['cpu']['median']:.3f} |")
  return lines + [""]


def table(report: dict[str, Any]) -> list[str]:
  """The whole ``cpu.md`` page below the header."""
  lines = [
      "Workloads: full jitted train steps (forward, backward, Adam, loss scaling), "
      "params float32; see `benchmarks/README.md`. Timing: variants interleaved in "
      f"one process, {report['config']['repeats']} blocks each, order rotating; "
      f"blocks of about {report['config']['block_s'] * 1e3:.0f} ms. CPU times say "
      "nothing about GPUs; read the ratios.",
      "",
  ]
  for section in (step_time_table, residual_table, flop_table, compile_table, autocast_table):
    lines += section(report)
  return lines + ["Full figures (every block time, HLO kernel counts, residuals by "
                  "dtype): `cpu.json`.", ""]


def add_flags(parser) -> None:
  parser.add_argument("--compile-repeats", type=int, default=3,
                      help="CPU suite: compilations of the bf16 jmp_lite, hand and "
                      "autocast steps (default 3; 1 with --quick)")


def finish_flags(parser, args) -> None:
  if args.compile_repeats < 1:
    parser.error(f"--compile-repeats must be >= 1, got {args.compile_repeats}")
  if args.quick:
    args.compile_repeats = 1


STUDY = runner.Study(
    name="cpu", module="benchmarks",
    title="jmp_lite benchmarks: CPU suite",
    description="CPU suite: ratios and static figures (any machine).",
    # --quick (the smoke test) measures only the MLP: compilation dominates there.
    workloads=lambda args: wl.make_workloads(
        "quick", ["mlp"]) if args.quick else wl.make_workloads("cpu"),
    measure=measure, table=table, repeats=(31, 3), block_s=0.1, computes=(),
    add_flags=add_flags, finish_flags=finish_flags,
    config=lambda args: {
        "compile_repeats": args.compile_repeats,
        "max_consecutive_errors": common.MAX_CONSECUTIVE_ERRORS,
        "policies": {dt: str(wl.policy(dt)) for dt in GROUPS},
        "groups": {k: list(v) for k, v in GROUPS.items()},
        "targets": TARGETS},
    summary=lambda results, args: {"example_models": {
        name: example_static(name, args) for name in residual_recompute.MODELS}})
