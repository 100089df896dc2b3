"""The GPU suite: throughput, achieved TFLOP/s, MFU and peak memory per dtype.

Run as ``python -m benchmarks run --suite gpu`` from the repository root on a
machine with a CUDA GPU (see ``benchmarks/README.md`` for the commands that
produce ``benchmarks/results/gpu.{json,md}``). For every workload (MLP,
ResNet-50, GPT-2 small) and mode:

* ``f32``: float32, ``jax.default_matmul_precision("highest")`` (true float32
  matmuls; XLA may otherwise use TF32 for float32 dots);
* ``tf32``: float32 params and activations,
  ``jax.default_matmul_precision("tensorfloat32")``;
* ``bf16``: policy ``p=f32,c=bf16,o=f32``, ``loss_scaling(adam, NoOpLossScale())``;
* ``f16``: policy ``p=f32,c=f16,o=f32``, ``loss_scaling(adam, DynamicLossScale(2**15))``;

a case compiles the jitted train step, runs warm-up steps, times ``--gpu-steps``
steps one by one (each waited for) and reports the median step time, the peak
device memory (``memory_stats()``) and XLA's memory analysis of the step. The
report adds examples/s, achieved TFLOP/s (matmul/conv FLOPs of the step,
counted on the jaxpr, over the step time), MFU against the device's published
dense peak for the mode's dtype and the speedups over f32 and TF32.

Two comparisons ride on the mixed-precision cases (same process, same batch,
the two steps timed in interleaved blocks like the CPU suite):

* ``bf16``: ``jmp_lite.autocast`` of the float32 loss against the hand-cast
  policy loss (step time, compile time, XLA temp memory, half FLOP share);
* ``f16``: the ``loss_scaling`` wrapper against the same step written by hand
  (``common.make_hand_step``), after checking they compute the same thing.

With PyTorch importable (and CUDA visible to it), the same three models
(``benchmarks/torch_models.py``) are trained under the same four modes with
``torch.autocast`` + ``GradScaler`` for a side-by-side.

Each case runs in its own subprocess, so that peak memory is per case and an
out-of-memory case does not end the suite, under a per-case timeout and a total
time budget: a case that times out, fails or is not started because the budget
is spent is reported as such. Runs split by ``--gpu-workloads``,
``--gpu-libraries`` or ``--gpu-modes`` merge into the ``gpu.json`` already in
the output folder (:func:`merge_previous`).

The hidden ``--dry-run`` flag runs every case at tiny shapes on whatever backend
is present (CPU), in-process unless ``--gpu-subprocess`` is given, to test the
code without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import workloads as wl
from benchmarks.wrapper_overhead import check_same

MODES = ("f32", "tf32", "bf16", "f16")
LIBRARIES = ("jax", "torch")
LIBRARY_NAMES = {"jax": "jmp_lite (JAX)", "torch": "PyTorch"}
MODE_DESCRIPTIONS = {
    "f32": "float32, matmul precision 'highest'",
    "tf32": "float32, matmul precision 'tensorfloat32'",
    "bf16": "p=f32,c=bf16,o=f32, NoOpLossScale",
    "f16": "p=f32,c=f16,o=f32, DynamicLossScale(2**15)",
}
TORCH_MODE_DESCRIPTIONS = {
    "f32": "TF32 off (matmuls and cuDNN)",
    "tf32": "TF32 on",
    "bf16": "torch.autocast bfloat16",
    "f16": "torch.autocast float16 + GradScaler(2**15)",
}
MATMUL_PRECISION = {"f32": "highest", "tf32": "tensorfloat32"}
PEAK_KIND = {"f32": "f32", "tf32": "tf32", "bf16": "half", "f16": "half"}
# Published dense (no sparsity) peaks, TFLOP/s. Matched on device_kind.
PEAK_TFLOPS = (
    ("H100", {"half": 989.0, "tf32": 494.0, "f32": 67.0}),   # H100 SXM
    ("H200", {"half": 989.0, "tf32": 494.0, "f32": 67.0}),
    ("A100", {"half": 312.0, "tf32": 156.0, "f32": 19.5}),
)
LEARNING_RATE = 1e-3
INITIAL_SCALE = 2.0**15
WARMUP_STEPS = 3
# The comparisons time blocks of this many steps, --gpu-steps blocks per variant.
COMPARE_BLOCK_STEPS = 2
# Defaults of --gpu-budget-s and --gpu-case-timeout-s: one command stays
# under 10 minutes (the parent's own start-up and the writing take seconds).
DEFAULT_BUDGET_S = 540.0
DEFAULT_CASE_TIMEOUT_S = 300.0
# A case is not started with less than this left of the budget.
MIN_CASE_S = 20.0
STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT, STATUS_NOT_RUN = "ok", "error", "timeout", "not run"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# The parent process only asks JAX which GPU there is: it must not take the
# GPU memory the cases need (see check_gpu). Children get the user's setting.
_USER_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")


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


# Device names the peak table must resolve, and what to: (name, kind, TFLOP/s),
# None where MFU is omitted (a part whose peak the table does not hold).
_PEAK_CHECKS = (
    ("NVIDIA H100 80GB HBM3", "half", 989.0),
    ("NVIDIA H200", "tf32", 494.0),
    ("NVIDIA A100-SXM4-80GB", "f32", 19.5),
    ("NVIDIA H100 PCIe", None, None),
    ("cpu", None, None),
)


def self_check() -> list[str]:
  """The suite's consistency checks, run by ``python -m benchmarks check``.

  * the peak table resolves the device names above;
  * every PyTorch workload has exactly the parameters of its JAX twin, at the
    tiny and the GPU sizes (built on torch's ``meta`` device: nothing is
    allocated); skipped when torch is not installed.

  Returns:
    One line per failed check (empty when all pass).
  """
  problems = []
  for name, kind, want in _PEAK_CHECKS:
    peaks = peak_tflops(name)
    got = None if peaks is None or kind is None else peaks.get(kind)
    if (peaks is None) != (want is None) or got != want:
      problems.append(f"peak_tflops({name!r}) gave {peaks}, expected {kind}={want}")
  available, _ = torch_available(dry_run=True)  # meta tensors: any device
  if available:
    import torch  # pylint: disable=import-outside-toplevel
    from benchmarks import torch_models  # pylint: disable=import-outside-toplevel
    for size in ("tiny", "gpu"):
      for workload in wl.make_workloads(size):
        shapes = jax.eval_shape(workload.init, jax.random.PRNGKey(0))
        jax_count = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
        with torch.device("meta"):
          model = torch_models.make_model(workload.name, workload.spec)
        torch_count = sum(p.numel() for p in model.parameters())
        if torch_count != jax_count:
          problems.append(f"{workload.name} ({size}): torch has {torch_count} "
                          f"parameters, JAX {jax_count}")
  return problems


def check_gpu(dry_run: bool) -> str | None:
  """``None`` if the GPU suite can run, else why not.

  Also stops JAX in this (the parent) process from preallocating GPU memory:
  every case runs in a child process that needs it.
  """
  if dry_run:
    return None
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
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


def _policy(mode: str) -> jmp_lite.Policy:
  return jmp_lite.get_policy(f"p=f32,c={mode},o=f32")


def _optimizer(mode: str) -> optax.GradientTransformation:
  scale = (jmp_lite.DynamicLossScale(jnp.float32(INITIAL_SCALE)) if mode == "f16"
           else jmp_lite.NoOpLossScale())
  return jmp_lite.loss_scaling(optax.adam(LEARNING_RATE), scale)


def _loss(workload: wl.Workload, mode: str, cast: str = "policy"):
  """The mode's loss; ``cast`` is ``"policy"`` (by hand) or ``"autocast"``."""
  if mode in MATMUL_PRECISION:
    return wl.loss_fn(workload, "f32")
  return wl.loss_fn(workload, cast, _policy(mode))


def _precision(mode: str):
  precision = MATMUL_PRECISION.get(mode)
  return jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()


def _xla_memory(compiled) -> dict[str, int] | None:
  """XLA's static memory analysis of a compiled step (bytes), if available."""
  try:
    stats = compiled.memory_analysis()
  except (AttributeError, NotImplementedError, RuntimeError):
    return None
  if stats is None:
    return None
  return {key: int(getattr(stats, f"{key}_size_in_bytes"))
          for key in ("argument", "output", "alias", "temp")}


def _compile(step, state_shapes, batch_shapes, mode: str) -> tuple[Any, dict[str, Any]]:
  """FLOPs (jaxpr walk) and AOT compilation of ``step`` under the mode's precision."""
  with _precision(mode):
    flops = analysis.matmul_flops(step, state_shapes, batch_shapes)
    compiled, info = common.compile_step(step, state_shapes, batch_shapes)
  del info["entry_opcodes"]
  info["xla_memory"] = _xla_memory(compiled)
  info["flops"] = flops
  return compiled, info


def _interleave(fns, states, batch, repeats: int, num: str, den: str) -> dict[str, Any]:
  """Times ``num`` against ``den`` in interleaved blocks; per-step times and ratio."""
  per_step = common.time_interleaved(fns, states, batch, COMPARE_BLOCK_STEPS, repeats, [num, den])
  wall = per_step["wall"]
  return {
      "block_steps": COMPARE_BLOCK_STEPS,
      "repeats": repeats,
      "step_time_s": {name: common.summarize(wall[name]) for name in (num, den)},
      "ratio": common.ratio_summary(wall[num], wall[den]),
  }


def _compare_autocast(workload, compiled, state, batch, shapes, repeats) -> tuple[Any, dict]:
  """bf16: ``jmp_lite.autocast`` of the float32 loss vs the hand-cast policy loss."""
  step = common.make_jmp_lite_step(_loss(workload, "bf16", "autocast"), _optimizer("bf16"))
  fn, info = _compile(step, *shapes, "bf16")
  states = {"policy": state, "autocast": common.fresh_copy(state)}
  states["autocast"], losses = common.run_steps(fn, states["autocast"], batch, WARMUP_STEPS)
  out = _interleave({"policy": compiled, "autocast": fn}, states, batch, repeats,
                    "autocast", "policy")
  out.update(compile=info, half_flop_share=info["flops"]["half_share"],
             losses=[float(x) for x in losses])
  return states["policy"], out


def _compare_hand(workload, compiled, state, batch, shapes, repeats) -> tuple[Any, dict]:
  """f16: the ``loss_scaling`` wrapper vs the same step by hand, jmp style.

  The hand-written step starts from the wrapper's current params, Adam state
  and loss scale; both run ``wrapper_overhead.check_same``'s steps and must
  give the same params, scale and losses (``check["same"]``) before timing.
  """
  loss = _loss(workload, "f16")
  adam = optax.adam(LEARNING_RATE)
  step = common.make_hand_step(loss, adam)
  params, opt_state = state
  hand_state = common.fresh_copy((params, opt_state.inner_state,
                                  jmp_lite.get_loss_scale(opt_state)))
  hand_shapes = jax.eval_shape(lambda: hand_state)
  fn, info = _compile(step, hand_shapes, shapes[1], "f16")
  states, check = check_same({"jmp_lite": compiled, "hand": fn},
                             {"jmp_lite": state, "hand": hand_state}, batch)
  out = _interleave({"jmp_lite": compiled, "hand": fn}, states, batch, repeats,
                    "jmp_lite", "hand")
  out.update(compile=info, check=check)
  return states["jmp_lite"], out


_SETUP_PROGRAMS: dict[tuple[str, str, int], Any] = {}


def _setup_program(workload: wl.Workload, seed: int):
  """``wl.setup`` jitted: params and batch in one program.

  Eagerly, every random op of the initialisation compiles on its own. The
  program is kept per workload shape, so the cases of a dry run (one process)
  share it.
  """
  key = (workload.name, workload.description, seed)
  if key not in _SETUP_PROGRAMS:
    _SETUP_PROGRAMS[key] = jax.jit(lambda: wl.setup(workload, seed))
  return _SETUP_PROGRAMS[key]


def run_jax_case(workload: wl.Workload, mode: str, steps: int, seed: int) -> dict[str, Any]:
  """Compiles and times one workload under one mode in this process.

  The step is compiled from shapes before any array exists, so the peak device
  memory is that of the step (params, Adam state, activations), not of the
  compiler's autotuning next to a live state.
  """
  started = time.perf_counter()
  opt = _optimizer(mode)
  step = common.make_jmp_lite_step(_loss(workload, mode), opt)

  def init():
    params, batch = wl.setup(workload, seed)
    return (params, opt.init(params)), batch

  shapes = jax.eval_shape(init)
  compiled, compile_info = _compile(step, *shapes, mode)
  init_started = time.perf_counter()
  params, batch = _setup_program(workload, seed)()
  opt_state = opt.init(params)
  # The step donates its state: the state's loss scale must not be the
  # arrays the optimizer was built with (copying only them keeps the peak
  # memory that of the step).
  state = (params, opt_state._replace(loss_scale=common.fresh_copy(opt_state.loss_scale)))
  del params, opt_state
  jax.block_until_ready(state)
  init_s = time.perf_counter() - init_started

  state, _ = common.run_steps(compiled, state, batch, WARMUP_STEPS)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    state, wall, _ = common.time_block(compiled, state, batch, 1)
    times.append(wall)
  state, losses = common.run_steps(compiled, state, batch, 1)
  stats = jax.devices()[0].memory_stats() or {}
  result = {
      "status": STATUS_OK,
      "mode": mode,
      "steps": steps,
      "warmup_steps": WARMUP_STEPS,
      "step_time_s": float(np.median(times)),
      "step_times_s": [float(t) for t in times],
      "flops_per_step": compile_info["flops"]["total"],
      "half_flop_share": compile_info["flops"]["half_share"],
      "peak_bytes": stats.get("peak_bytes_in_use"),
      "bytes_limit": stats.get("bytes_limit"),
      "compile": compile_info,
      "init_s": init_s,
      "final_loss": float(losses[-1]),
  }
  # The comparisons come after the peak memory is read: they hold a second state.
  if mode == "bf16":
    state, result["autocast_vs_policy"] = _compare_autocast(
        workload, compiled, state, batch, shapes, steps)
  elif mode == "f16":
    state, result["wrapper_vs_hand"] = _compare_hand(
        workload, compiled, state, batch, shapes, steps)
  opt_state = state[1]
  result["loss_scale"] = float(jmp_lite.get_loss_scale(opt_state).loss_scale)
  result["skipped_steps"] = int(opt_state.skipped_steps)
  result["device"] = jax.devices()[0].device_kind
  result["case_wall_s"] = time.perf_counter() - started
  return result


# --- running a case: in this process or in a child ------------------------------------


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
  """Runs one case described by ``spec`` in this process.

  Args:
    spec: ``{"library": "jax" | "torch", "size", "workload", "mode", "steps",
      "seed"}`` (plain data: it crosses the process boundary as JSON).

  Returns:
    The case's figures (``"status": "ok"``).
  """
  workload = {w.name: w for w in wl.make_workloads(spec["size"])}[spec["workload"]]
  library = spec.get("library", "jax")
  if library == "jax":
    return run_jax_case(workload, spec["mode"], spec["steps"], spec["seed"])
  if library == "torch":
    from benchmarks import torch_models  # pylint: disable=import-outside-toplevel
    started = time.perf_counter()
    result = torch_models.run_case(workload.name, workload.spec, spec["mode"], spec["steps"],
                                   warmup=WARMUP_STEPS, seed=spec["seed"])
    result.update(status=STATUS_OK, steps=spec["steps"], warmup_steps=WARMUP_STEPS,
                  case_wall_s=time.perf_counter() - started)
    return result
  raise ValueError(f"unknown library {library!r}; choose from {', '.join(LIBRARIES)}")


def _in_process_case(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  """:func:`run_case` here (dry run): an exception becomes an error case."""
  del timeout_s  # nothing can stop a case in this process
  try:
    return run_case(spec)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return {"status": STATUS_ERROR, "error": f"{type(e).__name__}: {e}"[:500]}


def _child_env(library: str) -> dict[str, str]:
  env = dict(os.environ)
  if library == "torch":
    # The torch worker imports jax (for the model configs) but never uses its
    # GPU backend: keep JAX off the GPU memory in any case.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  elif _USER_PREALLOCATE is None:
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  else:
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = _USER_PREALLOCATE
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  return env


def _error_tail(stderr: str, lines: int = 3) -> str:
  tail = [l.strip() for l in stderr.strip().splitlines() if l.strip()][-lines:]
  return " / ".join(tail)[-500:] or "no output"


def _subprocess_case(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  """Runs one case in a fresh interpreter (``python -m benchmarks.gpu_suite --case``).

  The child is killed (with its process group) after ``timeout_s``.

  Returns:
    The child's JSON, or ``{"status": "timeout" | "error", "error": why}``.
  """
  cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--case", json.dumps(spec)]
  started = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO_ROOT, env=_child_env(spec.get("library", "jax")),
                          start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {"status": STATUS_TIMEOUT,
            "error": f"timed out after {timeout_s:.3g} s (killed)",
            "case_wall_s": time.perf_counter() - started}
  lines = [l for l in stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    return {"status": STATUS_ERROR,
            "error": f"exit code {proc.returncode}: {_error_tail(stderr)}",
            "case_wall_s": time.perf_counter() - started}
  return json.loads(lines[-1])


# --- the suite -------------------------------------------------------------------------


def static_flops(workload: wl.Workload) -> int:
  """Matmul/conv FLOPs of the float32 forward + backward pass (traced on shapes only).

  The PyTorch models are the same layer for layer, so their steps have the
  same FLOPs.
  """
  params, batch = jax.eval_shape(lambda: wl.setup(workload, 0))
  loss = wl.loss_fn(workload, "f32")
  return analysis.matmul_flops(jax.value_and_grad(loss), params, batch)["total"]


def torch_available(dry_run: bool) -> tuple[bool, str]:
  """Whether the PyTorch cases can run, and a note for the report."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return False, f"not run: import torch failed ({e})"
  if not torch.cuda.is_available():
    if dry_run:
      return True, f"torch {torch.__version__} on the CPU (dry run)"
    return False, f"not run: torch {torch.__version__} sees no CUDA device"
  return True, f"torch {torch.__version__}, CUDA {torch.version.cuda}"


def _not_run(why: str) -> dict[str, Any]:
  return {"status": STATUS_NOT_RUN, "error": why}


def run(args) -> dict[str, Any]:
  """Runs the GPU suite (or its dry run); returns the report of this run.

  Cases run in order (workload, then library, then mode) while the budget
  ``args.gpu_budget_s`` lasts; each gets at most ``args.gpu_case_timeout_s``
  and never more than the budget left.
  """
  started = time.perf_counter()
  deadline = started + args.gpu_budget_s
  size = "tiny" if args.dry_run else "gpu"
  chosen = [w for w in wl.make_workloads(size) if w.name in args.gpu_workloads]
  machine = common.machine_info()
  steps = min(args.gpu_steps, 3) if args.dry_run else args.gpu_steps
  in_process = args.dry_run and not args.gpu_subprocess
  runner = _in_process_case if in_process else _subprocess_case
  libraries = [lib for lib in LIBRARIES if lib in args.gpu_libraries]
  torch_note = "not requested"
  if "torch" in libraries:
    use_torch, torch_note = torch_available(args.dry_run)
    if not use_torch:
      libraries.remove("torch")
      print(f"[gpu] PyTorch side-by-side {torch_note}", flush=True)
  results = []
  for workload in chosen:
    print(f"[gpu] {workload.name}: {workload.description}", flush=True)
    entry = {"workload": workload.name, "description": workload.description,
             "examples": workload.examples, "tokens": workload.tokens,
             "flops_per_step": static_flops(workload)}
    for library in libraries:
      cases = {}
      for mode in args.gpu_modes:
        left = deadline - time.perf_counter()
        if left <= 0 or (left < MIN_CASE_S and not in_process):
          case = _not_run(f"the time budget (--gpu-budget-s {args.gpu_budget_s:g}) was spent")
        else:
          spec = {"library": library, "size": size, "workload": workload.name, "mode": mode,
                  "steps": steps, "seed": args.seed}
          case = runner(spec, min(args.gpu_case_timeout_s, left))
        cases[mode] = case
        print(f"  {library} {mode}: {_brief(case)}", flush=True)
      entry[library] = cases
    results.append(entry)
  report = {
      "suite": "gpu",
      "dry_run": args.dry_run,
      "machine": machine,
      "load_average": {"after": list(os.getloadavg())},
      "config": {"size": size, "steps": steps, "warmup_steps": WARMUP_STEPS,
                 "compare_block_steps": COMPARE_BLOCK_STEPS, "seed": args.seed,
                 "workloads": [w.name for w in chosen], "libraries": libraries,
                 "modes": list(args.gpu_modes), "budget_s": args.gpu_budget_s,
                 "case_timeout_s": args.gpu_case_timeout_s,
                 "isolation": "in-process" if in_process else "subprocess",
                 "mode_descriptions": {"jax": MODE_DESCRIPTIONS, "torch": TORCH_MODE_DESCRIPTIONS},
                 "torch": torch_note},
      "results": results,
      "wall_s": time.perf_counter() - started,
  }
  derive(report)
  incomplete = [f"{r['workload']}/{lib}/{mode}: {c['status']}"
                for r in results for lib in LIBRARIES for mode, c in r.get(lib, {}).items()
                if c["status"] != STATUS_OK]
  if incomplete:
    print(f"[gpu] warning: {len(incomplete)} case(s) did not complete: "
          + "; ".join(incomplete), file=sys.stderr, flush=True)
  return report


def derive(report: dict[str, Any]) -> None:
  """Adds the figures computed from the cases' raw ones, in place.

  Per successful case: examples/s (and tokens/s), TFLOP/s (the workload's
  matmul/conv FLOPs per step over the step time), MFU (against the dense peak
  of the device for the mode's dtype, or ``None``), and the speedups over the
  same library's f32 and TF32 cases.
  """
  peaks = peak_tflops(report["machine"]["device_kind"])
  report["peak_tflops"] = peaks
  for entry in report["results"]:
    for library in LIBRARIES:
      cases = entry.get(library)
      if not cases:
        continue
      for mode, case in cases.items():
        if case["status"] != STATUS_OK:
          continue
        t = case["step_time_s"]
        flops = case.get("flops_per_step", entry["flops_per_step"])
        case["examples_per_s"] = entry["examples"] / t
        case["tokens_per_s"] = entry["tokens"] / t if entry["tokens"] else None
        case["tflops"] = flops / t / 1e12
        case["peak_tflops"] = peaks[PEAK_KIND[mode]] if peaks else None
        case["mfu"] = case["tflops"] / case["peak_tflops"] if peaks else None
      for base in ("f32", "tf32"):
        ref = cases.get(base, {})
        for case in cases.values():
          if case["status"] == STATUS_OK:
            case[f"speedup_vs_{base}"] = (ref["step_time_s"] / case["step_time_s"]
                                          if ref.get("status") == STATUS_OK else None)


# --- merging split runs --------------------------------------------------------------


def _run_record(report: dict[str, Any]) -> dict[str, Any]:
  config = report["config"]
  return {"command": report["command"], "date": report["date"], "wall_s": report["wall_s"],
          "workloads": config["workloads"], "libraries": config["libraries"],
          "modes": config["modes"], "steps": config["steps"], "torch": config["torch"],
          "machine": report["machine"]}


def _incompatible(previous: dict[str, Any], report: dict[str, Any]) -> str | None:
  if previous.get("suite") != "gpu" or "runs" not in previous:
    return "not a GPU suite report"
  if previous.get("dry_run") != report["dry_run"]:
    return "one is a dry run, the other not"
  if previous["config"]["size"] != report["config"]["size"]:
    return f"workload size {previous['config']['size']} vs {report['config']['size']}"
  old, new = previous["machine"]["device_kind"], report["machine"]["device_kind"]
  if old != new:
    return f"measured on {old}, this run on {new}"
  return None


def merge_previous(report: dict[str, Any], out: pathlib.Path) -> dict[str, Any]:
  """Merges this run's report into ``out/gpu.json`` if there is one; returns the merge.

  A case is identified by (workload, library, mode): this run's cases replace
  the earlier ones, the others are kept, each case naming the run that
  measured it (``case["run"]``, an index into ``report["runs"]``, which keeps
  the command, date and machine of every run still represented). Derived
  figures (speedups, MFU) are recomputed over the merged cases. An earlier
  report from another device, size, or dry-run status is replaced (with a
  note), never mixed in.

  Args:
    report: this run's report, with ``command`` and ``date`` set.
    out: the output folder.
  """
  run = _run_record(report)
  for entry in report["results"]:
    for library in LIBRARIES:
      for case in entry.get(library, {}).values():
        case["run"] = 0
  report["runs"] = [run]
  path = out / "gpu.json"
  previous = None
  if path.exists():
    try:
      previous = json.loads(path.read_text())
      reason = _incompatible(previous, report)
    except (OSError, ValueError, KeyError, TypeError) as e:
      reason = f"unreadable: {e}"
    if reason:
      print(f"[gpu] note: {path} is replaced, not merged ({reason}).", flush=True)
      previous = None
  if previous is None:
    derive(report)
    return report

  runs = previous["runs"] + [run]
  new_index = len(runs) - 1
  by_name = {e["workload"]: e for e in previous["results"]}
  for entry in report["results"]:
    old = by_name.get(entry["workload"])
    merged = dict(entry)
    for library in LIBRARIES:
      cases = dict(old.get(library, {})) if old else {}
      for mode, case in entry.get(library, {}).items():
        cases[mode] = dict(case, run=new_index)
      if cases:
        merged[library] = {m: cases[m] for m in MODES if m in cases}
    by_name[entry["workload"]] = merged
  results = [by_name[name] for name in wl.NAMES if name in by_name]
  # Keep only the runs some case still comes from; renumber.
  used = sorted({c["run"] for e in results for lib in LIBRARIES for c in e.get(lib, {}).values()})
  renumber = {old: new for new, old in enumerate(used)}
  for entry in results:
    for library in LIBRARIES:
      for case in entry.get(library, {}).values():
        case["run"] = renumber[case["run"]]
  merged_report = dict(report, results=results, runs=[runs[i] for i in used])
  merged_report["wall_s"] = sum(r["wall_s"] for r in merged_report["runs"])
  derive(merged_report)
  print(f"[gpu] merged into {path}: {len(merged_report['runs'])} run(s).", flush=True)
  return merged_report


# --- markdown -------------------------------------------------------------------------


def _brief(case: dict[str, Any]) -> str:
  if case["status"] != STATUS_OK:
    return f"{case['status']}: {case['error']}"
  return f"{case['step_time_s'] * 1e3:.2f} ms/step"


def _gib(x: int | None) -> str:
  return "–" if x is None else f"{x / 2**30:.2f}"


def _pct(x: float | None) -> str:
  return "–" if x is None else f"{100 * x:.1f}%"


def _ratio(r: dict[str, Any]) -> str:
  return f"{r['median']:.3f} ({r['q25']:.3f}-{r['q75']:.3f})"


def _case_row(library: str, mode: str, c: dict[str, Any], throughput_key: str) -> str:
  head = f"| {LIBRARY_NAMES[library]} | {mode} "
  if c["status"] != STATUS_OK:
    return head + f"| {c['status']}: {c['error'][:160]} | | | | | | |"
  return (
      head + f"| {c['step_time_s'] * 1e3:.2f} | {c[throughput_key]:,.0f} "
      f"| {c['tflops']:.1f} | {_pct(c['mfu'])} | {_gib(c['peak_bytes'])} "
      f"| {common.fmt(c['speedup_vs_f32'], '.2f')} | {common.fmt(c['speedup_vs_tf32'], '.2f')} |"
  )


def _side_by_side(report: dict[str, Any]) -> list[str]:
  lines = [
      "## Speedup over float32, side by side",
      "",
      "Each library's step time in f32 over its step time in the mode (same GPU, "
      "same model and batch). Last column: jmp_lite's step time over PyTorch's "
      "(below 1: jmp_lite is faster).",
      "",
      "| workload | mode | jmp_lite speedup | PyTorch speedup | jmp_lite / PyTorch step time |",
      "|---|---|---:|---:|---:|",
  ]
  for r in report["results"]:
    for mode in MODES:
      j, t = r.get("jax", {}).get(mode), r.get("torch", {}).get(mode)
      if not j and not t:
        continue
      ok = lambda c: c is not None and c["status"] == STATUS_OK  # pylint: disable=unnecessary-lambda-assignment
      ratio = j["step_time_s"] / t["step_time_s"] if ok(j) and ok(t) else None
      lines.append(
          f"| {r['workload']} | {mode} "
          f"| {common.fmt(j.get('speedup_vs_f32') if ok(j) else None, '.2f')} "
          f"| {common.fmt(t.get('speedup_vs_f32') if ok(t) else None, '.2f')} "
          f"| {common.fmt(ratio, '.3g')} |")
  lines.append("")
  return lines


def _comparisons(report: dict[str, Any]) -> list[str]:
  autocast_rows, hand_rows = [], []
  for r in report["results"]:
    c = r.get("jax", {}).get("bf16")
    if c and c["status"] == STATUS_OK:
      a = c["autocast_vs_policy"]
      mem = [(x or {}).get("temp") for x in (c["compile"]["xla_memory"],
                                              a["compile"]["xla_memory"])]
      autocast_rows.append(
          f"| {r['workload']} | {a['step_time_s']['policy']['median'] * 1e3:.2f} "
          f"| {a['step_time_s']['autocast']['median'] * 1e3:.2f} | {_ratio(a['ratio'])} "
          f"| {c['compile']['total_s']:.1f} / {a['compile']['total_s']:.1f} "
          f"| {_gib(mem[0])} / {_gib(mem[1])} | {_pct(a['half_flop_share'])} |")
    c = r.get("jax", {}).get("f16")
    if c and c["status"] == STATUS_OK:
      h = c["wrapper_vs_hand"]
      check = h["check"]
      scales = check["loss_scale"]
      hand_rows.append(
          f"| {r['workload']} | {h['step_time_s']['jmp_lite']['median'] * 1e3:.2f} "
          f"| {h['step_time_s']['hand']['median'] * 1e3:.2f} | {_ratio(h['ratio'])} "
          f"| {check['max_abs_loss_diff']:.2g} | {check['max_abs_param_diff']:.2g} "
          f"| {common.yes_no(scales['jmp_lite'] == scales['hand'])} "
          f"| {c['compile']['total_s']:.1f} / {h['compile']['total_s']:.1f} |")
  lines = []
  if autocast_rows:
    lines += [
        "## `autocast` vs the hand-cast policy (bf16)",
        "",
        "In the bf16 case's process: `jmp_lite.autocast(loss, policy)` on the float32 "
        "loss against the loss cast by hand with the policy, same optimizer, timed in "
        f"interleaved blocks of {COMPARE_BLOCK_STEPS} steps. Ratio: median of the "
        "per-block ratios autocast/policy (interquartile range). XLA temp: the compiled "
        "step's scratch memory (activations saved for the backward pass, temporaries).",
        "",
        "| workload | policy ms/step | autocast ms/step | autocast/policy | compile s "
        "policy / autocast | XLA temp GiB policy / autocast | half FLOP share autocast |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *autocast_rows,
        "",
    ]
  if hand_rows:
    lines += [
        "## `loss_scaling` wrapper vs the same step by hand (f16, DynamicLossScale)",
        "",
        "In the f16 case's process: the step written with `jmp_lite.loss_scaling` + "
        "`scaled_value_and_grad` against the jmp-style step by hand (scale, grad, unscale, "
        "`all_finite`, `adjust`, `select_tree`), both run from the same state for "
        "the equivalence check (largest differences in loss and params after it; GPU "
        "kernels such as scatter-adds are not bitwise deterministic), then timed in "
        f"interleaved blocks of {COMPARE_BLOCK_STEPS} steps. Ratio: median of the "
        "per-block ratios wrapper/hand (interquartile range).",
        "",
        "| workload | wrapper ms/step | hand ms/step | wrapper/hand | max abs loss diff "
        "| max abs param diff | same loss scale | compile s wrapper / hand |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|",
        *hand_rows,
        "",
    ]
  return lines


def markdown(report: dict[str, Any]) -> str:
  """The ``gpu.md`` page (of a run or of merged runs)."""
  runs = report.get("runs") or [_run_record(report)]
  lines = ["# jmp_lite benchmarks: GPU suite", ""]
  if len(runs) == 1:
    lines.append(f"Generated by `{runs[0]['command']}` on {runs[0]['date']} "
                 f"({runs[0]['wall_s']:.0f} s).")
  else:
    lines.append("Merged from these runs (a case's run is in `gpu.json`):")
    lines.append("")
    lines += [f"{i + 1}. `{r['command']}` on {r['date']} ({r['wall_s']:.0f} s)"
              for i, r in enumerate(runs)]
  lines += ["", common.machine_line(report["machine"]), ""]
  if report["dry_run"]:
    lines += ["**Dry run (`--dry-run`): tiny shapes on the "
              f"{report['machine']['backend']} backend; these figures mean nothing.**", ""]
  peaks = report["peak_tflops"]
  config = report["config"]
  torch_notes = sorted({r["torch"] for r in runs})
  steps = sorted({c["steps"] for r in report["results"] for lib in LIBRARIES
                  for c in r.get(lib, {}).values() if c["status"] == STATUS_OK})
  lines += [
      "Modes (jmp_lite): " + "; ".join(f"**{k}**: {v}" for k, v in MODE_DESCRIPTIONS.items())
      + ". Modes (PyTorch, eager): "
      + "; ".join(f"**{k}**: {v}" for k, v in TORCH_MODE_DESCRIPTIONS.items()) + ". "
      f"Step time: median of {' or '.join(map(str, steps)) or 'no'} "
      f"steps, each waited for, after {config['warmup_steps']} warm-up steps. "
      "TFLOP/s: matmul/conv FLOPs of the train step (forward + backward, counted on "
      "the jaxpr; the PyTorch models are the same layer for layer) / step time. "
      "MFU: against the dense peak for the mode's dtype"
      + (f" ({', '.join(f'{k} {v:g}' for k, v in peaks.items())} TFLOP/s)." if peaks
         else " (device not in the table: omitted).")
      + " Peak memory: JAX `peak_bytes_in_use` of the case's process, PyTorch "
      "`max_memory_allocated` over the timed steps. PyTorch side-by-side: "
      + "; ".join(torch_notes) + ".",
      "",
  ]
  for r in report["results"]:
    throughput = "tokens_per_s" if r["tokens"] else "examples_per_s"
    lines += [
        f"## {r['workload']}: {r['description']}",
        "",
        f"Matmul/conv FLOPs per step: {r['flops_per_step']:.4g}.",
        "",
        f"| library | mode | ms/step | {'tokens' if r['tokens'] else 'examples'}/s "
        "| TFLOP/s | MFU | peak memory GiB | speedup vs f32 | speedup vs tf32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for library in LIBRARIES:
      for mode, case in r.get(library, {}).items():
        lines.append(_case_row(library, mode, case, throughput))
    lines.append("")
  lines += _side_by_side(report)
  lines += _comparisons(report)
  lines += ["Full figures (every step time, compile times, XLA memory analysis, loss "
            "scale, skipped steps, the run of each case): `gpu.json`.", ""]
  return "\n".join(lines)


def _worker(argv: list[str]) -> int:
  """Subprocess entry: ``--case JSON`` prints the case's JSON on the last line."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite")
  parser.add_argument("--case", required=True,
                      help='JSON: {"library", "size", "workload", "mode", "steps", "seed"}')
  args = parser.parse_args(argv)
  result = run_case(json.loads(args.case))
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(_worker(sys.argv[1:]))
