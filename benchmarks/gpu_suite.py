"""The GPU suite: throughput, achieved TFLOP/s, MFU and peak memory per dtype.

Run as ``python -m benchmarks run --suite gpu`` on a machine with a CUDA GPU
(see ``benchmarks/README.md``). For every workload (MLP, ResNet-50, GPT-2
small) and mode:

* ``f32``: float32, ``jax.default_matmul_precision("highest")`` (true float32
  matmuls; XLA may otherwise use TF32 for float32 dots);
* ``tf32``: float32 params and activations,
  ``jax.default_matmul_precision("tensorfloat32")``;
* ``bf16``: policy ``p=f32,c=bf16,o=f32``, ``loss_scaling(adam, NoOpLossScale())``;
* ``f16``: policy ``p=f32,c=f16,o=f32``, ``loss_scaling(adam, DynamicLossScale(2**15))``;

it compiles the jitted train step, runs warm-up steps, times ``--gpu-steps``
steps one by one (each waited for) and reports the median step time,
examples/s, achieved TFLOP/s (matmul/conv FLOPs of the step, counted on the
jaxpr, over the step time), MFU against the device's published dense peak for
the mode's dtype, and the peak device memory (``memory_stats()``). Each case
runs in its own subprocess so that peak memory is per case and one
out-of-memory case does not end the suite. With PyTorch importable (and CUDA
visible to it), the same ResNet and LM are trained with ``torch.autocast`` +
``GradScaler`` for a side-by-side of the speedups.

The hidden ``--dry-run`` flag runs every JAX case in-process at tiny shapes on
whatever backend is present (CPU), to test the code without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import workloads as wl

MODES = ("f32", "tf32", "bf16", "f16")
MODE_DESCRIPTIONS = {
    "f32": "float32, matmul precision 'highest'",
    "tf32": "float32, matmul precision 'tensorfloat32'",
    "bf16": "p=f32,c=bf16,o=f32, NoOpLossScale",
    "f16": "p=f32,c=f16,o=f32, DynamicLossScale(2**15)",
}
MATMUL_PRECISION = {"f32": "highest", "tf32": "tensorfloat32"}
PEAK_KIND = {"f32": "f32", "tf32": "tf32", "bf16": "half", "f16": "half"}
# Published dense (no sparsity) peaks, TFLOP/s. Matched on device_kind.
PEAK_TFLOPS = (
    ("H100", {"half": 989.0, "tf32": 494.0, "f32": 67.0}),   # H100 SXM
    ("H200", {"half": 989.0, "tf32": 494.0, "f32": 67.0}),
    ("A100", {"half": 312.0, "tf32": 156.0, "f32": 19.5}),
)
TORCH_WORKLOADS = ("resnet", "transformer")
WARMUP_STEPS = 3
CASE_TIMEOUT_S = 1200
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def peak_tflops(device_kind: str) -> dict[str, float] | None:
  """Dense peak TFLOP/s by dtype kind for a known device, else ``None``.

  H100 PCIe and NVL have lower peaks than the SXM part the table holds, so they
  count as unknown (MFU omitted).
  """
  if "PCIe" in device_kind or "NVL" in device_kind:
    return None
  for name, peaks in PEAK_TFLOPS:
    if name in device_kind:
      return peaks
  return None


def check_gpu(dry_run: bool) -> str | None:
  """``None`` if the GPU suite can run, else why not."""
  if dry_run:
    return None
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as e:
    gpus, reason = [], str(e).splitlines()[0]
  else:
    reason = "no GPU devices"
  if not gpus:
    return (
        f"the GPU suite needs a CUDA GPU visible to JAX, and jax.devices('gpu') "
        f"found none ({reason}; default backend: {jax.default_backend()}). "
        "Install jax with CUDA support (pip install -U 'jax[cuda12]') on a machine "
        "with an NVIDIA GPU, or run the CPU suite: python -m benchmarks run --suite cpu"
    )
  return None


# --- one JAX case --------------------------------------------------------------------


def _step_and_state(workload: wl.Workload, mode: str, params):
  adam = optax.adam(1e-3)
  if mode in ("f32", "tf32"):
    loss = wl.loss_fn(workload, "f32")
    scale = jmp_lite.NoOpLossScale()
  else:
    policy = jmp_lite.get_policy(f"p=f32,c={mode},o=f32")
    loss = wl.loss_fn(workload, "policy", policy)
    scale = jmp_lite.DynamicLossScale(2.0**15) if mode == "f16" else jmp_lite.NoOpLossScale()
  opt = jmp_lite.loss_scaling(adam, scale)
  return common.make_jmp_lite_step(loss, opt), common.fresh_copy((params, opt.init(params)))


def run_jax_case(workload: wl.Workload, mode: str, steps: int, seed: int) -> dict[str, Any]:
  """Compiles and times one workload under one mode in this process."""
  params, batch = wl.setup(workload, seed)
  step, state = _step_and_state(workload, mode, params)
  del params  # the state holds its own copy; keep peak memory to the step's
  precision = MATMUL_PRECISION.get(mode)
  ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
  with ctx:
    flops = analysis.matmul_flops(step, state, batch)
    compiled, compile_info = common.compile_step(step, state, batch)
  del compile_info["entry_opcodes"]
  state, _ = common.run_steps(compiled, state, batch, WARMUP_STEPS)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    state, wall, _ = common.time_block(compiled, state, batch, 1)
    times.append(wall)
  state, losses = common.run_steps(compiled, state, batch, 1)
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  step_s = float(np.median(times))
  opt_state = state[1]
  return {
      "mode": mode,
      "step_time_s": step_s,
      "step_times_s": [float(t) for t in times],
      "examples_per_s": workload.examples / step_s,
      "tokens_per_s": workload.tokens / step_s if workload.tokens else None,
      "flops_per_step": flops["total"],
      "half_flop_share": flops["half_share"],
      "tflops": flops["total"] / step_s / 1e12,
      "peak_bytes": stats.get("peak_bytes_in_use"),
      "bytes_limit": stats.get("bytes_limit"),
      "compile": compile_info,
      "final_loss": float(losses[-1]),
      "loss_scale": float(jmp_lite.get_loss_scale(opt_state).loss_scale),
      "skipped_steps": int(opt_state.skipped_steps),
  }


def _subprocess_case(flag: str, payload: dict[str, Any]) -> dict[str, Any]:
  """Runs one case in a fresh interpreter; returns its JSON or the error."""
  cmd = [sys.executable, "-m", "benchmarks.gpu_suite", flag, json.dumps(payload)]
  env = dict(os.environ)
  if flag == "--torch-case":
    # The worker imports jax (for the model configs): keep it off the GPU memory.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                          cwd=REPO_ROOT, env=env)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {CASE_TIMEOUT_S} s"}
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:500]}
  return json.loads(lines[-1])


# --- the suite -------------------------------------------------------------------------


def _speedups(cases: dict[str, dict[str, Any]]) -> None:
  for base in ("f32", "tf32"):
    ref = cases.get(base, {}).get("step_time_s")
    for case in cases.values():
      t = case.get("step_time_s")
      case[f"speedup_vs_{base}"] = ref / t if ref and t else None


def _add_mfu(cases: dict[str, dict[str, Any]], peaks: dict[str, float] | None) -> None:
  for mode, case in cases.items():
    if peaks is None or "tflops" not in case:
      case["peak_tflops"] = case["mfu"] = None
    else:
      case["peak_tflops"] = peaks[PEAK_KIND[mode]]
      case["mfu"] = case["tflops"] / case["peak_tflops"]


def torch_available() -> tuple[bool, str]:
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return False, f"import torch failed ({e})"
  if not torch.cuda.is_available():
    return False, f"torch {torch.__version__} sees no CUDA device"
  return True, f"torch {torch.__version__}"


def run(args) -> dict[str, Any]:
  """Runs the GPU suite (or its dry run); returns the report."""
  started = time.perf_counter()
  size = "tiny" if args.dry_run else "gpu"
  chosen = [w for w in wl.make_workloads(size) if w.name in args.gpu_workloads]
  machine = common.machine_info()
  peaks = peak_tflops(machine["device_kind"])
  steps = min(args.gpu_steps, 3) if args.dry_run else args.gpu_steps
  if args.dry_run or args.no_torch:
    use_torch, torch_note = False, "not run (--dry-run or --no-torch)"
  else:
    use_torch, torch_note = torch_available()
  results = []
  for workload in chosen:
    print(f"[gpu] {workload.name}: {workload.description}", flush=True)
    cases = {}
    for mode in MODES:
      if args.dry_run:
        cases[mode] = run_jax_case(workload, mode, steps, args.seed)
      else:
        cases[mode] = _subprocess_case("--case", {
            "size": size, "workload": workload.name, "mode": mode,
            "steps": steps, "seed": args.seed})
      print(f"  jax {mode}: {_brief(cases[mode])}", flush=True)
    _speedups(cases)
    _add_mfu(cases, peaks)
    entry = {"workload": workload.name, "description": workload.description,
             "examples": workload.examples, "tokens": workload.tokens, "jax": cases}
    if use_torch and workload.name in TORCH_WORKLOADS:
      torch_cases = {}
      for mode in MODES:
        torch_cases[mode] = _subprocess_case("--torch-case", {
            "workload": workload.name, "spec": workload.spec, "mode": mode, "steps": steps})
        print(f"  torch {mode}: {_brief(torch_cases[mode])}", flush=True)
      _speedups(torch_cases)
      entry["torch"] = torch_cases
    results.append(entry)
  return {
      "suite": "gpu",
      "dry_run": args.dry_run,
      "machine": machine,
      "peak_tflops": peaks,
      "load_average": {"after": list(os.getloadavg())},
      "config": {"steps": steps, "warmup_steps": WARMUP_STEPS, "seed": args.seed,
                 "modes": MODE_DESCRIPTIONS, "size": size, "torch": torch_note},
      "results": results,
      "wall_s": time.perf_counter() - started,
  }


def _brief(case: dict[str, Any]) -> str:
  if "error" in case:
    return f"error: {case['error']}"
  return f"{case['step_time_s'] * 1e3:.2f} ms/step"


def _gb(x: int | None) -> str:
  return "–" if x is None else f"{x / 2**30:.2f}"


def markdown(report: dict[str, Any]) -> str:
  """The ``gpu.md`` page."""
  lines = [
      "# jmp_lite benchmarks: GPU suite",
      "",
      f"Generated by `{report['command']}` on {report['date']} ({report['wall_s']:.0f} s).",
      "",
      common.machine_line(report["machine"]),
      "",
  ]
  if report["dry_run"]:
    lines += ["**Dry run (`--dry-run`): tiny shapes on the "
              f"{report['machine']['backend']} backend; these figures mean nothing.**", ""]
  peaks = report["peak_tflops"]
  lines += [
      "Modes: " + "; ".join(f"**{k}**: {v}" for k, v in report["config"]["modes"].items())
      + f". Median of {report['config']['steps']} steps after "
      f"{report['config']['warmup_steps']} warm-up steps. TFLOP/s: matmul/conv FLOPs "
      "of the train step (forward + backward) / step time. MFU: against the dense "
      "peak for the mode's dtype"
      + (f" ({', '.join(f'{k} {v:g}' for k, v in peaks.items())} TFLOP/s)." if peaks
         else " (device not in the table: omitted).")
      + f" PyTorch side-by-side: {report['config']['torch']}.",
      "",
  ]
  for r in report["results"]:
    lines += [
        f"## {r['workload']}: {r['description']}",
        "",
        "| mode | ms/step | examples/s | TFLOP/s | MFU | peak memory GiB "
        "| speedup vs f32 | speedup vs tf32 | torch ms/step | torch vs f32 | torch vs tf32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
      c = r["jax"][mode]
      t = r.get("torch", {}).get(mode, {})
      if "error" in c:
        lines.append(f"| {mode} | error: {c['error'][:120]} |||||||||| ")
        continue
      lines.append(
          f"| {mode} | {c['step_time_s'] * 1e3:.2f} | {c['examples_per_s']:.1f} "
          f"| {c['tflops']:.2f} | {common.fmt(c['mfu'] and 100 * c['mfu'], '.1f')}"
          f"{'%' if c['mfu'] else ''} | {_gb(c['peak_bytes'])} "
          f"| {common.fmt(c['speedup_vs_f32'], '.2f')} | {common.fmt(c['speedup_vs_tf32'], '.2f')} "
          f"| {common.fmt(t.get('step_time_s') and t['step_time_s'] * 1e3, '.2f')} "
          f"| {common.fmt(t.get('speedup_vs_f32'), '.2f')} "
          f"| {common.fmt(t.get('speedup_vs_tf32'), '.2f')} |"
      )
    lines.append("")
  lines += ["Full figures (every step time, compile times, loss scale): `gpu.json`.", ""]
  return "\n".join(lines)


def _worker(argv: list[str]) -> int:
  """Subprocess entry: ``--case JSON`` (JAX) or ``--torch-case JSON``."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite")
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--case")
  group.add_argument("--torch-case")
  args = parser.parse_args(argv)
  if args.case:
    spec = json.loads(args.case)
    workload = {w.name: w for w in wl.make_workloads(spec["size"])}[spec["workload"]]
    result = run_jax_case(workload, spec["mode"], spec["steps"], spec["seed"])
  else:
    from benchmarks import torch_models  # pylint: disable=import-outside-toplevel
    spec = json.loads(args.torch_case)
    result = torch_models.run_case(spec["workload"], spec["spec"], spec["mode"], spec["steps"])
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(_worker(sys.argv[1:]))
