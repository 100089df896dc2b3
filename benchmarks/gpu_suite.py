"""The GPU suite: throughput, TFLOP/s, MFU and peak memory per dtype, next to torch.amp.

Run as ``python -m benchmarks run --suite gpu`` on a machine with a CUDA GPU
(``benchmarks/README.md`` has the commands that write
``benchmarks/results/gpu.{json,md}``). It measures the CPU suite's workloads
and steps (``workloads.py``, ``common.make_variant``) at the GPU size
(``workloads.SIZES["gpu"]``: an MLP, ResNet-50, GPT-2 small, and a
Mixture-of-Experts LM whose experts are ``jax.lax.ragged_dot`` grouped matmuls,
``workloads.GPU_NAMES``), each under these modes: ``f32`` (float32 matmuls, TF32 off), ``tf32``, ``bf16`` (the policy
``p=f32,c=bf16,o=f32``, ``loss_scaling(adam, NoOpLossScale())``) and ``f16``
(``p=f32,c=f16,o=f32``, ``DynamicLossScale(2**15)``), and three float8 modes
on top of bf16 (``fp8``: per-tensor current scaling, ``fp8_rowwise``,
``mxfp8``; the policy ``p=f32,c=bf16,o=f32,m=<recipe>`` through
``jmp_lite.with_policy``); with PyTorch installed, the same models under
``torch.autocast`` + ``GradScaler``, and torchao's float8 training for
``fp8``/``fp8_rowwise`` (``torch_side.py``). A case that cannot measure its
mode is skipped with its reason: ResNet-50's float8 modes (its convolutions
stay in bf16 and its head is kept out of float8: no matmul would run in
float8), PyTorch's ``mxfp8``, PyTorch's float8 modes without torchao, every
PyTorch case of the MoE (no PyTorch twin), and the MoE's float8/FP4 modes
when this jmp_lite's ``with_policy`` leaves its grouped matmuls in bf16
(:func:`grouped_problem`: checked on the step's jaxpr, so that no float8
figure is reported for a bf16 program).
MXFP8 has tensor cores on Blackwell only: elsewhere XLA runs its fallback
(both operands dequantized, one dot), and the case records which path the
compiled program took. The FP4 modes ``nvfp4`` and ``mxfp4`` (the policy
``p=f32,c=bf16,o=f32,m=<recipe>`` through ``jmp_lite.with_policy``, as the
float8 modes) need Blackwell's FP4 tensor cores: on any other GPU (an H100)
the suite says so and skips them (``fp4_problem``); on Blackwell and in the
dry run they run, ResNet-50 excepted (no matmul would run in FP4), and the
case records whether the compiled program kept the native block-scaled GEMM.
The int8 modes ``int8`` and ``int8_switchback`` (issue 38; the policy
``p=f32,c=bf16,o=f32,m=<recipe>`` through ``jmp_lite.with_policy``) run
``s8 x s8 -> s32`` products on the int8 matrix units (A100/Ada, and Hopper);
ResNet-50 is skipped (no matmul would run in int8) and so is PyTorch (no
twin: ``torch._int_mm`` has no autograd and torchao's int8 training is a
prototype); each case records its int8 FLOP share.

After the cases, the **collectives row** (issue 39) reads the bytes each
collective moves in XLA:GPU's compiled programs
(``benchmarks/collective_bytes.py`` in a subprocess, on 2, 4 or 8 of the
machine's GPUs): the data-parallel gradient reduction in each wire format,
the float8 MoE dispatch, and the FSDP weight all-gathers under ``jax.jit``
and ``jax.shard_map``, each against its plain program. With one GPU there
is nothing to gather or exchange: the row is skipped and says so
(``--no-gpu-collectives`` leaves it out).

A case (workload, library, mode) compiles its step from shapes, runs warm-up
steps, times ``--gpu-steps`` steps one by one and reads the peak device
memory. The bf16 and f16 JAX cases then compare, in their process, the
``autocast`` loss with the hand-cast policy (bf16) and the ``loss_scaling``
step with the same step by hand (f16), checked then timed as the studies do
(``runner.check_then_time``). Each case runs in its own subprocess (peak
memory per case; an out-of-memory case does not end the suite) under a
per-case timeout and a total budget; split runs merge into the ``gpu.json``
already in the output folder. The hidden ``--dry-run`` runs every case at the
``"tiny"`` size on whatever backend is present (in-process unless
``--gpu-subprocess``): ``tests/test_gpu_suite.py`` runs it on the CPU.
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
import numpy as np

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl
from benchmarks import wrapper_overhead
from models import results as output

MODES = ("f32", "tf32", "bf16", "f16", "fp8", "fp8_rowwise", "mxfp8", "nvfp4", "mxfp4",
         "int8", "int8_switchback")
#: The int8 modes (``jmp_lite.int8``, issue 38): ``s8 x s8 -> s32`` products on
#: the int8 matrix units of A100/Ada GPUs (and Hopper's, at float8's rate).
INT8_MODES = ("int8", "int8_switchback")
#: The FP4 modes (``jmp_lite.fp4``): tensor cores on Blackwell only.
FP4_MODES = ("nvfp4", "mxfp4")
#: Compute capabilities with FP4 tensor cores (Blackwell: B200/GB200/B300 10.x,
#: RTX 50xx / RTX PRO 12.x).
FP4_COMPUTE_CAPABILITIES = ("10.", "12.")
#: The float8 modes: jmp_lite's recipe (the policy's ``m=`` key) and torchao's.
FP8_MODES = {"fp8": "fp8", "fp8_rowwise": "fp8_rowwise", "mxfp8": "mxfp8"}
TORCHAO_RECIPES = {"fp8": "tensorwise", "fp8_rowwise": "rowwise"}
LIBRARIES = ("jax", "torch")
LIBRARY_NAMES = {"jax": "jmp_lite (JAX)", "torch": "PyTorch"}
MODE_DESCRIPTIONS = {
    "jax": {"f32": "float32, matmul precision 'highest'",
            "tf32": "float32, matmul precision 'tensorfloat32'",
            "bf16": "p=f32,c=bf16,o=f32, NoOpLossScale",
            "f16": "p=f32,c=f16,o=f32, DynamicLossScale(2**15)",
            "fp8": "p=f32,c=bf16,o=f32,m=fp8 through with_policy (e4m3 operands, "
                   "per-tensor current scaling, e5m2 gradients), NoOpLossScale",
            "fp8_rowwise": "p=f32,c=bf16,o=f32,m=fp8_rowwise through with_policy "
                           "(per-row scales, e4m3 gradients)",
            "mxfp8": "p=f32,c=bf16,o=f32,m=mxfp8 through with_policy (1x32 blocks, "
                     "E8M0 scales; tensor cores on Blackwell only, XLA's "
                     "dequantize-and-dot fallback elsewhere)",
            "nvfp4": "p=f32,c=bf16,o=f32,m=nvfp4 through with_policy (1x16 "
                     "E2M1 blocks, E4M3 scales, tensor scale, 16x16 weight "
                     "tiles, RHT, stochastic rounding); Blackwell only",
            "mxfp4": "p=f32,c=bf16,o=f32,m=mxfp4 through with_policy (1x32 "
                     "E2M1 blocks, E8M0 scales, RHT, stochastic rounding); "
                     "Blackwell only",
            "int8": "p=f32,c=bf16,o=f32,m=int8 through with_policy (row-wise int8 "
                    "operands, per-channel weights, all three matmuls s8 x s8 -> s32)",
            "int8_switchback": "p=f32,c=bf16,o=f32,m=int8_switchback through "
                               "with_policy (per-tensor weight scale, the weight "
                               "gradient in bf16)"},
    "torch": {"f32": "TF32 off (matmuls and cuDNN)", "tf32": "TF32 on",
              "bf16": "torch.autocast bfloat16",
              "f16": "torch.autocast float16 + GradScaler(2**15)",
              "fp8": "torchao convert_to_float8_training, recipe 'tensorwise', "
                     "under torch.autocast bfloat16 (eager)",
              "fp8_rowwise": "torchao convert_to_float8_training, recipe 'rowwise', "
                             "under torch.autocast bfloat16 (eager)",
              "mxfp8": "not run (torchao's MX training is a prototype)",
              "nvfp4": "not run (torchao's NVFP4 training is a prototype)",
              "mxfp4": "not run (torchao's MXFP4 training is a prototype)",
              "int8": "not run (no PyTorch twin: torch._int_mm is an inference GEMM "
                      "with no autograd, and torchao's int8 mixed-precision training "
                      "is a prototype)",
              "int8_switchback": "not run (no PyTorch twin: SwitchBack is not in "
                                 "torch or torchao)"},
}
MATMUL_PRECISION = {"f32": "highest", "tf32": "tensorfloat32"}
PEAK_KIND = {"f32": "f32", "tf32": "tf32", "bf16": "half", "f16": "half",
             "fp8": "fp8", "fp8_rowwise": "fp8", "mxfp8": "fp8",
             "nvfp4": "fp4", "mxfp4": "fp4", "int8": "int8", "int8_switchback": "int8"}
#: Published dense (no sparsity) peaks, TFLOP/s, matched on device_kind (the
#: A100 has no float8: its float8 modes get no MFU; int8: dense TOPS).
PEAK_TFLOPS = (
    ("H100", {"fp8": 1979.0, "int8": 1979.0, "half": 989.0, "tf32": 494.0,
              "f32": 67.0}),   # H100 SXM
    ("H200", {"fp8": 1979.0, "int8": 1979.0, "half": 989.0, "tf32": 494.0,
              "f32": 67.0}),
    ("A100", {"int8": 624.0, "half": 312.0, "tf32": 156.0, "f32": 19.5}),
)
WARMUP_STEPS = 3
#: The comparisons time blocks of this many steps, --gpu-steps blocks each.
COMPARE_BLOCK_STEPS = 2
#: bf16 autocast vs the hand-cast policy: the losses of the warm-up steps
#: agree to this relative tolerance (bfloat16 rounds to 2**-8).
AUTOCAST_RTOL = 2.0**-5
# --gpu-budget-s and --gpu-case-timeout-s: a command stays under 10 minutes.
DEFAULT_BUDGET_S = 540.0
DEFAULT_CASE_TIMEOUT_S = 300.0
MIN_CASE_S = 20.0  # A case is not started with less than this left.
OK, ERROR, TIMEOUT, NOT_RUN, SKIPPED = "ok", "error", "timeout", "not run", "skipped"
#: The custom call of a cuDNN block-scaled (MXFP8) GEMM in the optimized HLO:
#: where XLA:GPU's BlockScalingRewriter keeps the native path.
CUDNN_BLOCK_SCALED = "__cudnn$blockScaledDot"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# The parent process only asks JAX which GPU there is: it must not take the
# GPU memory the cases need (see check_gpu). Children get the user's setting.
_USER_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")


# --- flags ----------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--gpu-steps", type=int, default=20,
                      help="GPU suite: timed steps per case (default 20)")
  for name, choices in (("workloads", wl.GPU_NAMES), ("libraries", LIBRARIES), ("modes", MODES)):
    parser.add_argument(f"--gpu-{name}", default=",".join(choices),
                        help=f"GPU suite: comma-separated subset of {','.join(choices)}")
  parser.add_argument("--no-torch", action="store_true",
                      help="GPU suite: skip the PyTorch side-by-side (= --gpu-libraries jax)")
  parser.add_argument("--gpu-budget-s", type=float, default=DEFAULT_BUDGET_S,
                      help="GPU suite: total time budget in seconds; a case gets at most "
                      "what is left, later cases are reported as not run "
                      f"(default {DEFAULT_BUDGET_S:g}: a command stays under 10 minutes)")
  parser.add_argument("--gpu-case-timeout-s", type=float, default=DEFAULT_CASE_TIMEOUT_S,
                      help="GPU suite: a case (one subprocess) is killed and reported as "
                      f"timed out after this many seconds (default {DEFAULT_CASE_TIMEOUT_S:g})")
  parser.add_argument("--no-gpu-collectives", dest="gpu_collectives",
                      action="store_false",
                      help="GPU suite: leave out the collectives row (bytes on the wire "
                      "of the low-precision collectives, on 2 or more GPUs)")
  # Hidden: every case at the tiny size on whatever backend there is (CPU),
  # in-process unless --gpu-subprocess: tests the code paths without a GPU.
  parser.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--gpu-subprocess", action="store_true", help=argparse.SUPPRESS)


def finish_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  for name, choices in (("workloads", wl.GPU_NAMES), ("libraries", LIBRARIES), ("modes", MODES)):
    setattr(args, f"gpu_{name}", runner.split_choices(
        parser, f"--gpu-{name}", getattr(args, f"gpu_{name}"), choices))
  if args.no_torch:
    args.gpu_libraries = [lib for lib in args.gpu_libraries if lib != "torch"]
    if not args.gpu_libraries:
      parser.error("--no-torch with --gpu-libraries torch leaves nothing to run")
  if args.gpu_steps < 1:
    parser.error(f"--gpu-steps must be >= 1, got {args.gpu_steps}")
  if not (args.gpu_budget_s >= 0 and args.gpu_case_timeout_s > 0):
    parser.error("--gpu-budget-s must be >= 0 and --gpu-case-timeout-s > 0")


def peak_tflops(device_kind: str) -> dict[str, float] | None:
  """Dense peak TFLOP/s by dtype kind for a known device, else ``None`` (H100
  PCIe and NVL have lower peaks than the SXM part the table holds)."""
  if "PCIe" in device_kind or "NVL" in device_kind:
    return None
  return next((peaks for name, peaks in PEAK_TFLOPS if name in device_kind), None)


def check_gpu(dry_run: bool) -> str | None:
  """``None`` if the GPU suite can run, else why not. Also stops JAX in this
  (the parent) process from preallocating the GPU memory the cases need."""
  if dry_run:
    return None
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  try:
    gpus, reason = jax.devices("gpu"), "no GPU devices"
  except RuntimeError as e:
    gpus, reason = [], str(e).splitlines()[0]
  if gpus:
    return None
  return ("the GPU suite needs a CUDA GPU visible to JAX, and jax.devices('gpu') "
          f"found none ({reason}; default backend: {jax.default_backend()}). Install jax "
          "with CUDA support (pip install -U 'jax[cuda12]') on a machine with an NVIDIA "
          "GPU, or run the CPU suite: python -m benchmarks run --suite cpu")


def torch_available(dry_run: bool) -> tuple[bool, str]:
  """Whether the PyTorch cases can run, and a note for the report."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return False, f"not run: import torch failed ({e})"
  if torch.cuda.is_available():
    return True, f"torch {torch.__version__}, CUDA {torch.version.cuda}"
  if dry_run:
    return True, f"torch {torch.__version__} on the CPU (dry run)"
  return False, f"not run: torch {torch.__version__} sees no CUDA device"


# --- one JAX case ---------------------------------------------------------------------


def _variant(workload: wl.Workload, mode: str, cast: str = "policy", kind: str = "jmp_lite"):
  """``(step, init)`` of the mode (``common.make_variant``); ``cast``:
  ``"policy"`` or ``"autocast"``, ``kind``: ``"jmp_lite"`` or ``"hand"``."""
  if mode in MATMUL_PRECISION:
    return common.make_variant("plain", wl.loss_fn(workload, "f32"))
  if mode in FP8_MODES or mode in FP4_MODES or mode in INT8_MODES:  # recipes
    loss = wl.loss_fn(workload, "with_policy",
                      wl.policy("bf16", FP8_MODES.get(mode, mode)))
    return common.make_variant(kind, loss, jmp_lite.NoOpLossScale())
  scale = jmp_lite.NoOpLossScale() if mode == "bf16" else None
  return common.make_variant(kind, wl.loss_fn(workload, cast, wl.policy(mode)), scale)


def _compile(step, state, batch, mode: str) -> tuple[Any, dict[str, Any]]:
  """FLOPs (jaxpr walk), AOT compilation and XLA's memory analysis, under the
  mode's matmul precision."""
  precision = MATMUL_PRECISION.get(mode)
  with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
    flops = analysis.matmul_flops(step, state, batch)
    compiled, info = common.compile_step(step, state, batch)
  del info["entry_opcodes"]
  try:
    stats = compiled.memory_analysis()
    info["xla_memory"] = {key: int(getattr(stats, f"{key}_size_in_bytes"))
                          for key in ("argument", "output", "alias", "temp")}
  except (AttributeError, NotImplementedError, RuntimeError):
    info["xla_memory"] = None
  return compiled, dict(info, flops=flops)


def _same_losses(fns, states, batch):
  """autocast vs policy: the warm-up losses agree to AUTOCAST_RTOL."""
  states, losses = runner.run_all(fns, states, batch, WARMUP_STEPS)
  a, b = np.asarray(losses["autocast"]), np.asarray(losses["policy"])
  return states, {"losses": losses, "rtol": AUTOCAST_RTOL, "same": bool(
      np.all(np.isfinite(a)) and np.allclose(a, b, rtol=AUTOCAST_RTOL, atol=0))}


def _compare(workload, mode, compiled, state, batch, steps) -> tuple[Any, dict[str, Any]]:
  """The mode's comparison in this process, from the case's current state.

  bf16: the ``autocast`` loss against the hand-cast policy (the case's step);
  f16: the case's ``loss_scaling`` step against the same step by hand,
  checked with ``wrapper_overhead.check``. Untimed if the check fails.
  Returns the case's state after it and the comparison's figures.
  """
  if mode == "bf16":
    case, other, ratio, check = "policy", "autocast", ("autocast", "policy"), _same_losses
    step, _ = _variant(workload, mode, cast="autocast")
    other_state = common.fresh_copy(state)
  else:
    case, other, ratio, check = "jmp_lite", "hand", ("jmp_lite", "hand"), wrapper_overhead.check
    step, _ = _variant(workload, mode, kind="hand")
    params, opt_state = state
    other_state = common.fresh_copy(
        (params, opt_state.inner_state, jmp_lite.get_loss_scale(opt_state)))
  fn, info = _compile(step, *jax.eval_shape(lambda: (other_state, batch)), mode)
  states = {case: state, other: other_state}  # updated in place
  out = runner.check_then_time(
      f"{workload.name} {mode}", {case: compiled, other: fn}, states, batch,
      runner.Timing(repeats=steps, steps=COMPARE_BLOCK_STEPS), check=check,
      ratios={"ratio": ratio}, stop=False)
  return states[case], dict(out, compile=info, half_flop_share=info["flops"]["half_share"])


def run_jax_case(workload: wl.Workload, mode: str, steps: int, seed: int) -> dict[str, Any]:
  """Compiles and times one workload under one mode in this process.

  The step is compiled from shapes before any array exists, so the peak device
  memory is that of the step (params, Adam state, activations), not of the
  compiler's autotuning next to a live state.
  """
  started = time.perf_counter()
  step, init = _variant(workload, mode)

  def setup():
    params, batch = wl.setup(workload, seed)
    return init(params), batch

  compiled, compile_info = _compile(step, *jax.eval_shape(setup), mode)
  init_started = time.perf_counter()
  params, batch = jax.jit(lambda: wl.setup(workload, seed))()
  state = init(params)
  del params
  jax.block_until_ready(state)
  init_s = time.perf_counter() - init_started
  state, _ = common.run_steps(compiled, state, batch, WARMUP_STEPS)
  times = []
  for _ in range(steps):
    state, wall, _ = common.time_block(compiled, state, batch, 1)
    times.append(wall)
  state, losses = common.run_steps(compiled, state, batch, 1)
  memory = jax.devices()[0].memory_stats() or {}
  result = {
      "status": OK, "mode": mode, "steps": steps, "warmup_steps": WARMUP_STEPS,
      "step_time_s": float(np.median(times)), "step_times_s": [float(t) for t in times],
      "flops_per_step": compile_info["flops"]["total"],
      "half_flop_share": compile_info["flops"]["half_share"],
      "peak_bytes": memory.get("peak_bytes_in_use"), "bytes_limit": memory.get("bytes_limit"),
      "compile": compile_info, "init_s": init_s, "final_loss": float(losses[-1]),
  }
  if mode in FP8_MODES or mode in FP4_MODES or mode in INT8_MODES:
    key = ("fp8" if mode in FP8_MODES else "fp4" if mode in FP4_MODES else "int8")
    result[key] = (fp8_info(mode, compile_info["flops"], compiled.as_text())
                   if key == "fp8" else fp4_info(mode, compiled.as_text())
                   if key == "fp4" else int8_info(mode, compile_info["flops"]))
    # TFLOP/s counts the model's matmuls, as in every other mode. The float8
    # and FP4 steps' jaxprs count more: MX's zero-padding of short contracting
    # dimensions, and the first layer's input gradient, which a custom_vjp
    # computes and XLA then removes (kept in result["fp8"] / result["fp4"]).
    result[key]["step_jaxpr_flops"] = result["flops_per_step"]
    shapes = jax.eval_shape(lambda: wl.setup(workload, seed))
    result["flops_per_step"] = analysis.matmul_flops(
        jax.value_and_grad(wl.loss_fn(workload, "f32")), *shapes)["total"]
    if workload.name == "moe":
      # The grouped matmuls' operand dtypes in the step (float8, or the
      # MX/FP4 emulation's float32): what grouped_problem checked.
      result[key]["grouped_dtypes"] = grouped_dtypes(step, *jax.eval_shape(setup))
  # The comparisons come after the peak memory is read: they hold a second state.
  if mode in ("bf16", "f16"):
    state, result["comparison"] = _compare(workload, mode, compiled, state, batch, steps)
  opt_state = state[1]
  scaled = isinstance(opt_state, jmp_lite.LossScaleState)
  result.update(
      loss_scale=float(jmp_lite.get_loss_scale(opt_state).loss_scale) if scaled else None,
      skipped_steps=int(opt_state.skipped_steps) if scaled else 0,
      device=jax.devices()[0].device_kind, case_wall_s=time.perf_counter() - started)
  return result


def fp8_info(mode: str, flops: dict[str, Any], optimized_hlo: str) -> dict[str, Any]:
  """What a float8 case ran: the share of its matmul FLOPs on float8 operands
  (the jaxpr's count; MXFP8's matmuls are not ``dot_general``s there, see
  ``mx_path``) and, for ``mxfp8``, which path the compiled program took."""
  by_dtype = flops["by_dtype"]
  fp8 = sum(v for k, v in by_dtype.items() if "float8" in k)
  info = {"recipe": FP8_MODES[mode],
          "fp8_flop_share": fp8 / flops["total"] if flops["total"] and mode != "mxfp8"
          else None}
  if mode == "mxfp8":
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu":
      path = (f"emulation ({device.platform}: e4m3 values times their E8M0 scales, "
              "one float32 dot; no CUDA program)")
    elif CUDNN_BLOCK_SCALED in optimized_hlo:
      path = "native: cuDNN block-scaled MXFP8 GEMM"
    else:
      path = (f"fallback: compute capability {capability} has no MXFP8 tensor cores "
              "(Blackwell, 10.0, has), so XLA dequantizes both operands and runs one "
              "dot (BlockScalingRewriter)")
    info.update(mx_path=path, compute_capability=capability,
                native_gemm=CUDNN_BLOCK_SCALED in optimized_hlo)
  return info


def int8_info(mode: str, flops: dict[str, Any]) -> dict[str, Any]:
  """What an int8 case ran: the share of its matmul FLOPs on int8 operands
  (the jaxpr's count: the ``s8 x s8 -> s32`` ``dot_general``s)."""
  int8 = sum(v for k, v in flops["by_dtype"].items() if "int8" in k)
  return {"recipe": mode,
          "int8_flop_share": int8 / flops["total"] if flops["total"] else None}


def fp4_problem(dry_run: bool) -> str | None:
  """Why the FP4 modes are skipped on this machine, or ``None`` (they run).

  FP4 matmuls run on Blackwell's tensor cores only: on any other GPU (an H100:
  compute capability 9.0) the suite says so and skips them. On Blackwell and
  in the dry run (the exact emulation on the CPU) they run through the policy
  routes, as every other mode.
  """
  if dry_run:
    return None
  device = jax.devices()[0]
  capability = str(getattr(device, "compute_capability", None))
  if not capability.startswith(FP4_COMPUTE_CAPABILITIES):
    return (f"FP4 tensor cores are Blackwell only (compute capability 10.x or "
            f"12.x); this GPU, {device.device_kind}, has {capability}: skipped")
  return None


def fp4_info(mode: str, optimized_hlo: str) -> dict[str, Any]:
  """The FP4 case's recipe and the path its compiled program took: the
  native block-scaled GEMM (cuDNN, Blackwell) or the exact emulation."""
  native = CUDNN_BLOCK_SCALED in optimized_hlo
  platform = jax.devices()[0].platform
  return {"recipe": mode, "native_gemm": native,
          "fp4_path": ("native block-scaled GEMM" if native else
                       f"emulation ({platform}: dequantized operands, one "
                       "float32 dot)")}


def skip_reason(workload: str, library: str, mode: str, torchao: str | None,
                fp4: str | None = None) -> str | None:
  """Why the case (workload, library, mode) is not run, or ``None``.

  ``torchao``: why torchao cannot run (``None`` when it can); ``fp4``: why the
  FP4 modes cannot run (:func:`fp4_problem`).
  """
  if library == "torch" and workload == "moe":
    return ("no PyTorch twin: the MoE (router, top-2, tokens sorted by expert, "
            "jax.lax.ragged_dot experts) has no layer-for-layer PyTorch model in "
            "torch_side.py (PyTorch has no ragged_dot; its MoEs loop over experts "
            "or call a grouped GEMM kernel outside torch.amp)")
  if mode in FP4_MODES:
    if library == "torch":
      return MODE_DESCRIPTIONS["torch"][mode]
    if fp4:
      return fp4
    if workload == "resnet":
      return ("no FP4 matmul: the convolutions stay in bf16 (FP4 covers "
              "dot_general) and the output head is kept out of FP4")
    return None
  if mode in INT8_MODES:
    if library == "torch":
      return MODE_DESCRIPTIONS["torch"][mode]
    if workload == "resnet":
      return ("no int8 matmul: the convolutions stay in bf16 (int8 covers "
              "dot_general) and the output head is kept out of int8")
    return None
  if mode not in FP8_MODES:
    return None
  if workload == "resnet":
    return ("no float8 matmul: the convolutions stay in bf16 (float8 covers "
            "dot_general / nn.Linear) and the output head is kept out of float8")
  if library == "torch" and mode not in TORCHAO_RECIPES:
    return "torchao's MXFP8 training is a prototype (torchao.prototype.mx_formats): not run"
  if library == "torch" and torchao:
    return torchao
  return None


def grouped_dtypes(fn, *args) -> dict[str, int]:
  """How many ``ragged_dot_general`` (grouped matmuls) ``fn(*args)`` runs, by
  operand dtypes (``jmp_lite.op_dtypes``: traced, nothing runs; ``args`` may
  be shapes)."""
  return _count_grouped(_grouped_ops(fn, *args))


def _grouped_ops(fn, *args) -> list[Any]:
  return [op for op in jmp_lite.op_dtypes(fn, *args) if op[0] == "ragged_dot_general"]


def _count_grouped(ops: list[Any]) -> dict[str, int]:
  counts: dict[str, int] = {}
  for op in ops:
    key = "+".join(sorted(set(op[1])))
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))


def grouped_problem(workload: wl.Workload, mode: str) -> str | None:
  """Why the float8/FP4 ``mode`` of a workload with grouped matmuls (the MoE)
  would time a bf16 program, or ``None``.

  The case's loss (``with_policy``, ``m=<recipe>``) is traced with its
  gradient: if a ``ragged_dot_general`` of the forward or backward pass still
  has bfloat16 operands, the recipe did not reach the grouped matmuls (the
  quantized ones run on float8 operands, or on the MX/FP4 emulation's
  dequantized float32 ones), and the MoE's dense matmuls are its router
  (N = 8 experts) and its output head, which stay out of float8 anyway: the
  case is skipped with this reason rather than reported as a float8 figure.
  """
  if mode not in FP8_MODES and mode not in FP4_MODES and mode not in INT8_MODES:
    return None
  recipe = FP8_MODES.get(mode, mode)
  loss = wl.loss_fn(workload, "with_policy", wl.policy("bf16", recipe))
  shapes = jax.eval_shape(lambda: wl.setup(workload, 0))
  ops = _grouped_ops(jax.value_and_grad(loss), *shapes)
  counts = _count_grouped(ops)
  half = counts.get("bfloat16", 0)
  if not half:
    return None
  notes = sorted({op.note for op in ops if getattr(op, "note", None)})
  return (f"the grouped matmuls stay in bf16: {half} of the step's "
          f"{sum(counts.values())} ragged_dot_general have bfloat16 operands under "
          f"m={recipe} through with_policy"
          + (f" ({'; '.join(notes)})" if notes else
             " (this jmp_lite has no float8/FP4/int8 rule for ragged_dot_general)")
          + f"; a {mode} figure would time the bf16 program: not run")


def torchao_problem() -> str | None:
  """``None`` if torchao's float8 training imports, else why not."""
  try:
    from torchao.float8 import convert_to_float8_training  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return f"torchao's float8 training does not import ({e}): pip install torchao"
  return None


# --- running a case: in this process or in a child ------------------------------------


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
  """Runs one case described by ``spec`` (``{"library", "size", "workload",
  "mode", "steps", "seed"}``, plain data: it crosses the process boundary as
  JSON) in this process."""
  (workload,) = wl.make_workloads(spec["size"], [spec["workload"]])
  if spec["library"] == "jax":
    return run_jax_case(workload, spec["mode"], spec["steps"], spec["seed"])
  from benchmarks import torch_side  # pylint: disable=import-outside-toplevel
  started = time.perf_counter()
  result = torch_side.run_case(workload.name, workload.spec, spec["mode"], spec["steps"],
                               WARMUP_STEPS, spec["seed"])
  return dict(result, status=OK, steps=spec["steps"], warmup_steps=WARMUP_STEPS,
              case_wall_s=time.perf_counter() - started)


def _in_process_case(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  """:func:`run_case` here (dry run): an exception becomes an error case."""
  del timeout_s  # nothing can stop a case in this process
  try:
    return run_case(spec)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return {"status": ERROR, "error": f"{type(e).__name__}: {e}"[:500]}


def _subprocess_case(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  """Runs one case in a fresh interpreter (``python -m benchmarks.gpu_suite
  CASE_JSON``), killed with its process group after ``timeout_s``."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  if spec["library"] == "torch":  # It imports jax but never uses its GPU.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  elif _USER_PREALLOCATE is not None:
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = _USER_PREALLOCATE
  started = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_suite", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO_ROOT, env=env, start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {"status": TIMEOUT, "error": f"timed out after {timeout_s:.3g} s (killed)",
            "case_wall_s": time.perf_counter() - started}
  lines = [line for line in stdout.splitlines() if line.startswith("{")]
  if proc.returncode == 0 and lines:
    return json.loads(lines[-1])
  tail = " / ".join(line.strip() for line in stderr.strip().splitlines()[-3:])
  return {"status": ERROR, "error": f"exit code {proc.returncode}: {tail[-500:] or 'no output'}",
          "case_wall_s": time.perf_counter() - started}


# --- the suite -------------------------------------------------------------------------


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
  """Runs the cases in order (workload, library, mode) while the budget lasts;
  returns the results and the config of this run."""
  deadline = time.perf_counter() + args.gpu_budget_s
  size = "tiny" if args.dry_run else "gpu"
  steps = min(args.gpu_steps, 3) if args.dry_run else args.gpu_steps
  in_process = args.dry_run and not args.gpu_subprocess
  runner_fn = _in_process_case if in_process else _subprocess_case
  libraries = [lib for lib in LIBRARIES if lib in args.gpu_libraries]
  torch_note, torchao = "not requested", None
  if "torch" in libraries:
    use_torch, torch_note = torch_available(args.dry_run)
    if not use_torch:
      libraries.remove("torch")
      print(f"[gpu] PyTorch side-by-side {torch_note}", flush=True)
    elif any(mode in TORCHAO_RECIPES for mode in args.gpu_modes):
      torchao = torchao_problem()
      if torchao:
        print(f"[gpu] PyTorch float8 modes skipped: {torchao}", flush=True)
  fp4 = (fp4_problem(args.dry_run) if any(m in FP4_MODES for m in args.gpu_modes)
         else None)
  if fp4:
    print(f"[gpu] FP4 modes skipped: {fp4}", flush=True)
  results = []
  for workload in wl.make_workloads(size, [n for n in wl.GPU_NAMES if n in args.gpu_workloads]):
    print(f"[gpu] {workload.name}: {workload.description}", flush=True)
    shapes = jax.eval_shape(lambda w=workload: wl.setup(w, 0))
    flops = analysis.matmul_flops(jax.value_and_grad(wl.loss_fn(workload, "f32")), *shapes)
    entry = {"workload": workload.name, "description": workload.description,
             "examples": workload.examples, "tokens": workload.tokens,
             "flops_per_step": flops["total"]}
    for library in libraries:
      entry[library] = {}
      for mode in args.gpu_modes:
        left = deadline - time.perf_counter()
        reason = skip_reason(workload.name, library, mode, torchao, fp4)
        if not reason and library == "jax" and workload.name == "moe":
          reason = grouped_problem(workload, mode)
        if reason:
          case = {"status": SKIPPED, "reason": reason}
        elif left <= 0 or (left < MIN_CASE_S and not in_process):
          case = {"status": NOT_RUN,
                  "error": f"the time budget (--gpu-budget-s {args.gpu_budget_s:g}) was spent"}
        else:
          case = runner_fn({"library": library, "size": size, "workload": workload.name,
                            "mode": mode, "steps": steps, "seed": args.seed},
                           min(args.gpu_case_timeout_s, left))
        entry[library][mode] = case
        print(f"  {library} {mode}: " + (f"{case['step_time_s'] * 1e3:.2f} ms/step"
                                         if case["status"] == OK else case["status"])
              + (f" ({case['fp8']['mx_path']})" if "mx_path" in case.get("fp8", {}) else ""),
              flush=True)
    results.append(entry)
  incomplete = [f"{e['workload']}/{lib}/{mode}: {c['status']}" for e in results
                for lib in libraries for mode, c in e[lib].items() if c["status"] not in (OK, SKIPPED)]
  if incomplete:
    print(f"[gpu] warning: {len(incomplete)} case(s) did not complete: "
          + "; ".join(incomplete), file=sys.stderr, flush=True)
  config = {"dry_run": args.dry_run, "size": size, "steps": steps,
            "warmup_steps": WARMUP_STEPS, "compare_block_steps": COMPARE_BLOCK_STEPS,
            "workloads": [e["workload"] for e in results], "libraries": libraries,
            "modes": list(args.gpu_modes), "budget_s": args.gpu_budget_s,
            "case_timeout_s": args.gpu_case_timeout_s,
            "isolation": "in-process" if in_process else "subprocess",
            "mode_descriptions": MODE_DESCRIPTIONS, "torch": torch_note,
            "torchao": torchao or ("not needed" if "torch" not in libraries else "ok")}
  out = {"results": results, "config": config}
  if args.gpu_collectives:
    out["collectives"] = collectives_row(
        args.dry_run, min(args.gpu_case_timeout_s,
                          max(deadline - time.perf_counter(), MIN_CASE_S)))
    row = out["collectives"]
    print(f"[gpu] collectives: {row['status']}"
          + (f" on {row['devices']} {row['platform']} devices" if row["status"] == OK
             else f" ({row.get('reason') or row.get('error', '')[:200]})"), flush=True)
  return out


def collectives_row(dry_run: bool, timeout_s: float) -> dict[str, Any]:
  """The collectives row: ``benchmarks.collective_bytes`` in a subprocess on
  the largest of 2, 4 or 8 devices this machine has (the dry run: 8
  simulated CPU devices, tiny sizes), or skipped with the reason."""
  count = 8 if dry_run else jax.device_count()
  devices = max((n for n in (2, 4, 8) if n <= count), default=None)
  if devices is None:
    return {"status": SKIPPED,
            "reason": f"{count} {jax.devices()[0].platform} device: nothing to "
                      "gather or exchange (needs 2 or more GPUs)"}
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as out:
    cmd = [sys.executable, "-m", "benchmarks.collective_bytes", "--devices",
           str(devices), "--out", out] + (["--quick"] if dry_run else [])
    env = dict(os.environ)
    if not dry_run:   # the GPUs, not simulated CPU devices
      env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "") or "cuda"
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
      return {"status": TIMEOUT, "error": f"no result within {timeout_s:g} s"}
    if proc.returncode:
      return {"status": ERROR, "error": (proc.stderr or proc.stdout)[-2000:]}
    report = json.loads((pathlib.Path(out) / "collective_bytes.json").read_text())
  return {"status": OK, "devices": report["devices"],
          "platform": report["platform"], "size": report["config"]["size"],
          "results": report["results"]}


def derive(report: dict[str, Any]) -> dict[str, Any]:
  """Adds, in place, each successful case's examples/s (tokens/s), TFLOP/s,
  MFU (against the device's dense peak for the mode, or ``None``) and
  speedups over the same library's f32, TF32 and bf16 cases; returns ``report``."""
  peaks = report["peak_tflops"] = peak_tflops(report["machine"]["device_kind"])
  for entry in report["results"]:
    for cases in (entry.get(library, {}) for library in LIBRARIES):
      ok = {mode: c for mode, c in cases.items() if c["status"] == OK}
      for mode, case in ok.items():
        t = case["step_time_s"]
        case["examples_per_s"] = entry["examples"] / t
        case["tokens_per_s"] = entry["tokens"] / t if entry["tokens"] else None
        case["tflops"] = case.get("flops_per_step", entry["flops_per_step"]) / t / 1e12
        case["peak_tflops"] = peaks.get(PEAK_KIND[mode]) if peaks else None
        case["mfu"] = case["tflops"] / case["peak_tflops"] if case["peak_tflops"] else None
        for base in ("f32", "tf32", "bf16"):
          case[f"speedup_vs_{base}"] = ok[base]["step_time_s"] / t if base in ok else None
  return report


def merge_previous(report: dict[str, Any], out: pathlib.Path) -> dict[str, Any]:
  """Merges this run into ``out/gpu.json`` if there is one; returns the merge.

  A case is identified by (workload, library, mode): this run's cases replace
  the earlier ones, the others are kept, each naming the run that measured it
  (``case["run"]``, an index into ``report["runs"]``: command, date, machine
  of every run still represented). A report from another device, size or
  dry-run status is replaced (with a note), never mixed in.
  """
  config = report["config"]
  run = {key: report[key] for key in ("command", "date", "wall_s", "machine")}
  run.update({key: config[key] for key in ("workloads", "libraries", "modes", "steps", "torch")})
  previous, path = {"runs": [], "results": []}, out / "gpu.json"
  if path.exists():
    try:
      old = json.loads(path.read_text())
      reason = next((why for why, bad in (
          ("not a GPU suite report", old.get("benchmark") != "gpu" or "runs" not in old),
          ("one is a dry run, the other not", old["config"]["dry_run"] != config["dry_run"]),
          (f"workload size {old['config']['size']} vs {config['size']}",
           old["config"]["size"] != config["size"]),
          (f"measured on {old['machine']['device_kind']}, this run on "
           f"{report['machine']['device_kind']}",
           old["machine"]["device_kind"] != report["machine"]["device_kind"])) if bad), None)
    except (OSError, ValueError, KeyError, TypeError) as e:
      reason = f"unreadable: {e}"
    if reason:
      print(f"[gpu] note: {path} is replaced, not merged ({reason}).", flush=True)
    else:
      previous = old
      print(f"[gpu] merged into {path}.", flush=True)
  runs = previous["runs"] + [run]
  by_name = {e["workload"]: e for e in previous["results"]}
  for entry in report["results"]:
    merged = dict(by_name.get(entry["workload"], {}), **{
        k: v for k, v in entry.items() if k not in LIBRARIES})
    for library in LIBRARIES:
      cases = dict(merged.get(library, {}))
      cases.update({mode: dict(c, run=len(runs) - 1) for mode, c in entry.get(library, {}).items()})
      if cases:
        merged[library] = {m: cases[m] for m in MODES if m in cases}
    by_name[entry["workload"]] = merged
  results = [by_name[name] for name in wl.GPU_NAMES if name in by_name]
  # Keep only the runs some case still comes from, renumbered.
  cases = [c for e in results for lib in LIBRARIES for c in e.get(lib, {}).values()]
  used = sorted({c["run"] for c in cases})
  for c in cases:
    c["run"] = used.index(c["run"])
  runs = [runs[i] for i in used]
  if "collectives" not in report and "collectives" in previous:
    report = dict(report, collectives=previous["collectives"])   # kept
  return derive(dict(report, results=results, runs=runs,
                     wall_s=sum(r["wall_s"] for r in runs)))


# --- markdown -------------------------------------------------------------------------


def _gib(x: int | None) -> str:
  return "–" if x is None else f"{x / 2**30:.2f}"


def _pct(x: float | None) -> str:
  return "–" if x is None else f"{100 * x:.1f}%"


def _case_row(library: str, mode: str, c: dict[str, Any], key: str, versus: str) -> str:
  head = f"| {LIBRARY_NAMES[library]} | {mode} "
  if c["status"] != OK:
    why = c.get("reason") or c.get("error", "")
    return head + f"| {c['status']}: {why[:160]} | | | | | | | | |"
  return (head + f"| {c['step_time_s'] * 1e3:.2f} | {c[key]:,.0f} | {c['tflops']:.1f} "
          f"| {_pct(c['mfu'])} | {_gib(c['peak_bytes'])} | {runner.fmt(c['speedup_vs_f32'], '.2f')} "
          f"| {runner.fmt(c['speedup_vs_tf32'], '.2f')} "
          f"| {runner.fmt(c.get('speedup_vs_bf16'), '.2f')} | {versus} |")


def _fp8_rows(report: dict[str, Any]) -> list[str]:
  """One row per float8 JAX case that ran: its FLOP share and MXFP8 path."""
  rows = []
  for r in report["results"]:
    for mode, c in r.get("jax", {}).items():
      if c.get("status") == OK and "fp8" in c:
        info = c["fp8"]
        rows.append(f"| {r['workload']} | {mode} | {_pct(info['fp8_flop_share'])} "
                    f"| {runner.fmt(c.get('speedup_vs_bf16'), '.2f')} "
                    f"| {info.get('mx_path', '–')} |")
  return rows


def _int8_rows(report: dict[str, Any]) -> list[str]:
  """One row per int8 JAX case that ran: its int8 FLOP share and speedup."""
  rows = []
  for r in report["results"]:
    for mode, c in r.get("jax", {}).items():
      if c.get("status") == OK and "int8" in c:
        rows.append(f"| {r['workload']} | {mode} | {_pct(c['int8']['int8_flop_share'])} "
                    f"| {runner.fmt(c.get('speedup_vs_bf16'), '.2f')} |")
  return rows


def _comparison_rows(report: dict[str, Any]) -> list[str]:
  rows = []
  for r in report["results"]:
    for mode, (a, b) in (("bf16", ("autocast", "policy")), ("f16", ("jmp_lite", "hand"))):
      c = r.get("jax", {}).get(mode, {})
      if c.get("status") != OK:
        continue
      cmp = c["comparison"]
      times = cmp.get("step_time_s")
      ms = (f"{times[a]['median'] * 1e3:.2f} | {times[b]['median'] * 1e3:.2f} "
            f"| {runner.ratio_cell(cmp['ratio'])}") if times else "– | – | not timed"
      rows.append(f"| {r['workload']} | {mode}: {a} / {b} | {ms} "
                  f"| {runner.yes_no(cmp['check']['same'])} "
                  f"| {c['compile']['total_s']:.1f} / {cmp['compile']['total_s']:.1f} "
                  f"| {_gib((c['compile']['xla_memory'] or {}).get('temp'))} / "
                  f"{_gib((cmp['compile']['xla_memory'] or {}).get('temp'))} |")
  return rows


def markdown(report: dict[str, Any]) -> str:
  """The ``gpu.md`` page (of a run or of merged runs)."""
  runs, config = report["runs"], report["config"]
  lines = ["# jmp_lite benchmarks: GPU suite", "", "Measured by these runs (a case's "
           "run is in `gpu.json`):", ""]
  lines += [f"{i + 1}. `{r['command']}` on {r['date']} ({r['wall_s']:.0f} s)"
            for i, r in enumerate(runs)]
  lines += ["", output.machine_line(report["machine"]), ""]
  if config["dry_run"]:
    lines += ["**Dry run (`--dry-run`): tiny shapes on the "
              f"{report['machine']['backend']} backend; these figures mean nothing.**", ""]
  peaks = report["peak_tflops"]
  lines += [
      "Modes, jmp_lite: " + "; ".join(f"**{k}**: {v}" for k, v in MODE_DESCRIPTIONS["jax"].items())
      + ". PyTorch (eager): "
      + "; ".join(f"**{k}**: {v}" for k, v in MODE_DESCRIPTIONS["torch"].items()) + ". "
      f"Step time: median of the timed steps, each waited for, after {WARMUP_STEPS} "
      "warm-up steps. TFLOP/s: matmul/conv FLOPs of the train step (forward + "
      "backward, counted on the jaxpr; the PyTorch models are the same layer for "
      "layer) / step time. MFU: against the dense peak for the mode's dtype"
      + (f" ({', '.join(f'{k} {v:g}' for k, v in peaks.items())} TFLOP/s)." if peaks
         else " (device not in the table: omitted).")
      + " Peak memory: JAX `peak_bytes_in_use` of the case's process, PyTorch "
      "`max_memory_allocated` over the timed steps. vs PyTorch: jmp_lite's step "
      "time over PyTorch's in the same mode (below 1: jmp_lite is faster). "
      "PyTorch: " + "; ".join(sorted({r["torch"] for r in runs})) + ".",
      "",
  ]
  for r in report["results"]:
    key = "tokens_per_s" if r["tokens"] else "examples_per_s"
    lines += [
        f"## {r['workload']}: {r['description']}", "",
        f"Matmul/conv FLOPs per step: {r['flops_per_step']:.4g}.", "",
        f"| library | mode | ms/step | {key.split('_')[0]}/s | TFLOP/s | MFU "
        "| peak memory GiB | speedup vs f32 | speedup vs tf32 | speedup vs bf16 "
        "| vs PyTorch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for library in LIBRARIES:
      for mode, case in r.get(library, {}).items():
        torch_case = r.get("torch", {}).get(mode, {})
        both = library == "jax" and case["status"] == torch_case.get("status") == OK
        versus = (f"{case['step_time_s'] / torch_case['step_time_s']:.3g}" if both else "–")
        lines.append(_case_row(library, mode, case, key, versus))
    lines.append("")
  rows = _fp8_rows(report)
  if rows:
    lines += [
        "## Float8 cases",
        "",
        "Float8 FLOP share: the train step's matmul FLOPs whose operands are float8 "
        "(counted on the jaxpr; the rest stay in bf16: attention scores, heads, "
        "matmuls whose dimensions are not multiples of 16). MXFP8's block-scaled "
        "matmuls are not `dot_general`s on float8 operands there (–): its path says "
        "what the compiled program runs. Speedup vs bf16: the bf16 case's step time over "
        "this one's.",
        "",
        "| workload | mode | float8 FLOP share | speedup vs bf16 | MXFP8 path |",
        "|---|---|---:|---:|---|",
        *rows,
        "",
    ]
  rows = _int8_rows(report)
  if rows:
    lines += [
        "## int8 cases",
        "",
        "int8 FLOP share: the train step's matmul FLOPs whose operands are int8 "
        "(`s8 x s8 -> s32` products, counted on the jaxpr; the rest stay in bf16). "
        "Speedup vs bf16: the bf16 case's step time over this one's. MFU against "
        "the GPU's dense int8 peak.",
        "",
        "| workload | mode | int8 FLOP share | speedup vs bf16 |",
        "|---|---|---:|---:|",
        *rows,
        "",
    ]
  rows = _comparison_rows(report)
  if rows:
    lines += [
        "## Comparisons in the mixed-precision cases",
        "",
        "In the bf16 case's process, `jmp_lite.autocast(loss, policy)` on the float32 "
        "loss against the loss cast by hand with the policy; in the f16 case's, the "
        "`loss_scaling` step against the same step by hand, jmp style. Both from the "
        "case's state, checked first (autocast: the warm-up losses agree to "
        f"{AUTOCAST_RTOL:g} relative; wrapper: params, loss scale and losses as in "
        "`wrapper_overhead`; GPU kernels such as scatter-adds are not bitwise "
        "deterministic, so a failed check leaves the pair untimed), then timed in "
        f"interleaved blocks of {COMPARE_BLOCK_STEPS} steps. Ratio: median of the "
        "per-block ratios (IQR). XLA temp: the compiled step's scratch memory.",
        "",
        "| workload | comparison | ms/step | ms/step | ratio | check | compile s "
        "| XLA temp GiB |",
        "|---|---|---:|---:|---:|:---:|---:|---:|",
        *rows,
        "",
    ]
  row = report.get("collectives")
  if row:
    lines += ["## Collectives: bytes on the wire", ""]
    if row["status"] == OK:
      # (Imported here: importing it sets XLA_FLAGS for its own runs.)
      from benchmarks import collective_bytes  # pylint: disable=import-outside-toplevel
      lines += collective_bytes.table(
          {"config": {"size": row["size"]}, "devices": row["devices"],
           "platform": row["platform"], "results": row["results"]})
    else:
      lines += [f"{row['status']}: {row.get('reason') or row.get('error', '')[:300]}", ""]
  lines += ["Full figures (every step time, compile times, XLA memory analysis, loss "
            "scale, skipped steps, the run of each case): `gpu.json`.", ""]
  return "\n".join(lines)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
  """Runs the GPU suite (or its dry run) and publishes it merged with the
  earlier runs in the output folder."""
  return runner.publish("gpu", "benchmarks", argv, args.out, {}, lambda: measure_all(args),
                        markdown, finish=lambda r: merge_previous(r, args.out))


if __name__ == "__main__":
  # A child process of the suite: runs the case given as JSON, prints its figures last.
  if len(sys.argv) != 2:
    sys.exit("usage: python -m benchmarks.gpu_suite CASE_JSON runs one case of the GPU "
             "suite (its child process); run the suite with: python -m benchmarks run "
             "--suite gpu")
  print(json.dumps(run_case(json.loads(sys.argv[1]))))
