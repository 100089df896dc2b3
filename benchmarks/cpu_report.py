"""Markdown tables of the CPU suite's report (``cpu.md``)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import fmt
from benchmarks.common import machine_line
from benchmarks.common import yes_no

MB = 1e6


def _ratio_cell(r: dict[str, Any]) -> str:
  return f"{r['median']:.3f} ({r['q25']:.3f}-{r['q75']:.3f})"


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
  for r in report["results"]:
    t, ratios = r["step_time_s"], r["ratios"]
    ok = all(ratios[k]["wall"]["median"] <= target
             for k in ("jmp_lite/hand bf16", "jmp_lite/hand f16"))
    lines.append(
        f"| {r['workload']}: {r['description']} "
        + "".join(f"| {t[k]['median'] * 1e3:.2f} " for k in (
            "bf16/jmp_lite", "bf16/hand", "bf16/apply_if_finite", "f16/jmp_lite", "f16/hand"))
        + f"| {_ratio_cell(ratios['jmp_lite/hand bf16']['wall'])} "
        f"| {_ratio_cell(ratios['jmp_lite/hand f16']['wall'])} | {yes_no(ok)} "
        f"| {_ratio_cell(ratios['jmp_lite/apply_if_finite bf16']['wall'])} "
        f"| {ratios['jmp_lite/hand bf16']['cpu']['median']:.3f}, "
        f"{ratios['jmp_lite/hand f16']['cpu']['median']:.3f}, "
        f"{ratios['jmp_lite/apply_if_finite bf16']['cpu']['median']:.3f} |"
    )
  lines.append("")
  return lines


def compile_table(report: dict[str, Any]) -> list[str]:
  lines = [
      "## 4. Compile time",
      "",
      "Tracing + lowering + XLA compilation of the whole jitted train step (s); "
      "bf16 jmp_lite, hand and autocast: median of "
      f"{report['config']['compile_repeats']} rounds of compilations (each traced "
      "afresh; rounds interleave the three variants), the others one; their ratios "
      "are medians of the per-round ratios. The f32 step is compiled first in each workload, so it also "
      "pays for tracing the library's own jitted helpers once.",
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
        + "|"
    )
  lines.append("")
  return lines


REMAT = "`save_half_residuals`"


def _residual_row(name: str, method: str, f32: dict, bf16: dict, f16: dict,
                  target: float | None) -> str:
  ok = None if target is None else max(
      bf16["activation_ratio_vs_f32"], f16["activation_ratio_vs_f32"]) <= target
  return (
      f"| {name} | {method} | {f32['bytes'] / MB:.2f} | {bf16['bytes'] / MB:.2f} "
      f"| {f16['bytes'] / MB:.2f} | {bf16['ratio_vs_f32']:.3f} | {f16['ratio_vs_f32']:.3f} "
      f"| {bf16['activation_ratio_vs_f32']:.3f} | {f16['activation_ratio_vs_f32']:.3f} "
      f"| {bf16['param_copy_bytes'] / MB:.2f} "
      f"| {fmt(target, '.2f') if target else '–'} | {yes_no(ok)} |"
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
      if f"{method} bf16" not in s:
        continue
      lines.append(_residual_row(
          r["workload"], label, s["f32"]["residuals"],
          s[f"{method} bf16"]["residuals"], s[f"{method} f16"]["residuals"], None))
  for name, ex in report["example_models"].items():
    fig = ex["figures"]
    method = "`jmp_lite.linen.apply_policy`" if name == "DigitsCNN" else "`jmp_lite.nnx.apply_policy`"
    lines.append(_residual_row(
        ex["description"], method, fig["f32"]["residuals"], fig["bf16"]["residuals"],
        fig["f16"]["residuals"], targets["residual_ratio_examples"]))
    if "bf16+remat" in fig:
      lines.append(_residual_row(
          ex["description"], f"{method} + {REMAT}", fig["f32"]["residuals"],
          fig["bf16+remat"]["residuals"], fig["f16+remat"]["residuals"],
          targets["residual_ratio_examples"]))
  lines += [
      "",
      f"{REMAT}: the loss under `jax.checkpoint(loss, policy=jmp_lite.save_half_residuals)`,"
      " which saves only half-precision values and recomputes everything else in the"
      " backward pass (norm statistics kept in f32 by the default rules, softmax, casts,"
      " ReLU masks, broadcasts). Without it, layers kept in float32 save float32 tensors."
      " Its ratios can fall below the 0.5x floor because the f32 run saves masks and"
      " broadcasts that it recomputes; the recomputation costs backward-pass time.",
      "",
  ]
  return lines


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
  for name, ex in report["example_models"].items():
    fig = ex["figures"]
    lines.append(row(ex["description"], "apply_policy", fig["bf16"]["flops"], fig["f16"]["flops"]))
  lines.append("")
  return lines


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
        f"| {comp:.2f} | {yes_no(comp <= targets['autocast_compile_ratio'])} "
        f"| {_ratio_cell(step['wall'])} "
        f"| {yes_no(step['wall']['median'] <= targets['autocast_step_ratio'])} "
        f"| {step['cpu']['median']:.3f} |"
    )
  lines.append("")
  return lines


def markdown(report: dict[str, Any]) -> str:
  """The whole ``cpu.md`` page."""
  load = report["load_average"]
  config = report["config"]
  lines = [
      "# jmp_lite benchmarks: CPU suite",
      "",
      f"Generated by `{report['command']}` on {report['date']} ({report['wall_s']:.0f} s).",
      "",
      machine_line(report["machine"])
      + f" Load average (1/5/15 min) before: {', '.join(f'{x:.2f}' for x in load['before'])}; "
      f"after: {', '.join(f'{x:.2f}' for x in load['after'])}.",
      "",
      "Workloads: full jitted train steps (forward, backward, Adam, loss scaling), "
      "params float32; see `benchmarks/README.md`. Timing: variants interleaved in "
      f"one process, {config['repeats']} blocks each, order rotating; blocks of about "
      f"{config['block_s'] * 1e3:.0f} ms. CPU times say nothing about GPUs; read the ratios.",
      "",
  ]
  if config["quick"]:
    lines += ["**`--quick`: tiny shapes, a smoke test; these figures mean nothing.**", ""]
  for section in (step_time_table, residual_table, flop_table, compile_table, autocast_table):
    lines += section(report)
  lines += ["Full figures (every block time, HLO kernel counts, residuals by dtype): `cpu.json`.", ""]
  return "\n".join(lines)
