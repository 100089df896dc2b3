"""The GPU suite's code paths, end to end at tiny sizes on the CPU.

``python -m benchmarks run --suite gpu --dry-run`` runs every case of the GPU
suite (every workload, every mode, jmp_lite and -- when ``import torch``
works -- PyTorch, the autocast and hand-written-step comparisons) at tiny
shapes on the CPU, derives the figures and writes ``gpu.json``/``gpu.md``;
split runs merge into one report. These tests check that this works and that
the report is complete and self-consistent. They assert nothing about speed.
The PyTorch tests (marker ``torch``) need torch, the ``bench`` extra: ``nox -s
bench`` installs it and runs them; every other selection leaves them out
(``-m "not torch"``), so nothing here skips.

The dry runs compile about thirty train steps; to keep that short on two
cores, XLA's LLVM optimisation of the CPU code is turned off
(``--xla_backend_optimization_level=0``): the code paths are the same.
"""

import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT
from helpers import example_env

#: the GPU suite's dry runs compile every workload: the slow stage.
pytestmark = pytest.mark.slow

MODES = ("f32", "tf32", "bf16", "f16", "fp8", "fp8_rowwise", "mxfp8", "nvfp4", "mxfp4",
         "int8", "int8_switchback")
INT8_MODES = ("int8", "int8_switchback")
FP8_MODES = ("fp8", "fp8_rowwise", "mxfp8")
FP4_MODES = ("nvfp4", "mxfp4")
WORKLOADS = ("mlp", "resnet", "transformer", "moe")
# The figures computed from the measured ones when a report is written.
DERIVED = {"examples_per_s", "tokens_per_s", "tflops", "peak_tflops", "mfu",
           "speedup_vs_f32", "speedup_vs_tf32", "speedup_vs_bf16"}
# The two runs of the split fixture, and the workloads each covers.
SPLIT = (("mlp,resnet", ("mlp", "resnet")), ("transformer,moe", ("transformer", "moe")))


#: Workloads the GPU suite has no PyTorch twin of (their torch cases are
#: skipped, with the reason).
TORCH_LESS = ("moe",)

def _env():
  env = example_env()
  env["XLA_FLAGS"] = (env["XLA_FLAGS"] + " --xla_backend_optimization_level=0").strip()
  return env


def _run(args, timeout=600):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=timeout, check=False)


def _dry_run(out, *args):
  return _run(["benchmarks", "run", "--suite", "gpu", "--dry-run", "--gpu-steps", "2",
               *args, "--out", str(out)])


def _ok(proc):
  assert proc.returncode == 0, proc.stderr[-4000:]


def _positive_finite(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


def _has_torch():
  return importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def split(tmp_path_factory):
  """Two dry runs into one folder: mlp and resnet, then the transformer."""
  out = tmp_path_factory.mktemp("gpu_split")
  procs = [_dry_run(out, "--gpu-workloads", workloads) for workloads, _ in SPLIT]
  for proc in procs:
    _ok(proc)
  return procs, out, json.loads((out / "gpu.json").read_text())


def _moe_grouped_in_bf16(mode):
  """Whether this jmp_lite's with_policy leaves the tiny MoE's grouped matmuls
  (ragged_dot_general, forward and backward) on bfloat16 operands under the
  float8/FP4 ``mode``: checked here with jmp_lite.op_dtypes, independently
  of the suite."""
  import jax  # pylint: disable=import-outside-toplevel
  import jmp_lite  # pylint: disable=import-outside-toplevel
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  (moe,) = workloads.make_workloads("tiny", ["moe"])
  loss = workloads.loss_fn(moe, "with_policy", workloads.policy("bf16", mode))
  shapes = jax.eval_shape(lambda: workloads.setup(moe, 0))
  ops = [dtypes for name, dtypes in jmp_lite.op_dtypes(jax.value_and_grad(loss), *shapes)
         if name == "ragged_dot_general"]
  assert len(ops) == 6  # two grouped matmuls, each with its dx and dw
  return any(set(dtypes) == {"bfloat16"} for dtypes in ops)


def _skipped(entry, library, mode, report):
  """Why the case must be skipped (a phrase of its reason), or None."""
  if entry["workload"] == "moe":
    if library == "torch":
      return "no PyTorch twin"
    if mode in FP8_MODES + FP4_MODES + INT8_MODES and _moe_grouped_in_bf16(mode):
      return "the grouped matmuls stay in bf16"
    return None
  if mode in INT8_MODES:   # no PyTorch twin; ResNet's convolutions stay bf16
    if library == "torch":
      return "no PyTorch twin"
    return "no int8 matmul" if entry["workload"] == "resnet" else None
  if mode in FP4_MODES:   # the dry run runs FP4 through the policy routes
    if library == "torch":
      return "prototype"
    return "no FP4 matmul" if entry["workload"] == "resnet" else None
  if mode not in FP8_MODES:
    return None
  if entry["workload"] == "resnet":
    return "no float8 matmul"
  if library == "torch" and mode == "mxfp8":
    return "prototype"
  if library == "torch" and report["config"]["torchao"] != "ok":
    return "torchao"
  return None


def _check_library_cases(entry, library, steps, report):
  """Every mode ran (or was skipped with its reason), with figures
  consistent with each other and the entry's."""
  cases = entry[library]
  assert tuple(cases) == MODES, (entry["workload"], library)
  for mode, case in list(cases.items()):
    where = (entry["workload"], library, mode)
    reason = _skipped(entry, library, mode, report)
    if reason:
      assert case["status"] == "skipped" and reason in case["reason"], (where, case)
      assert not DERIVED & set(case), where
      continue
    assert case["status"] == "ok", (where, case.get("error"))
    assert case["mode"] == mode
    t = case["step_time_s"]
    assert _positive_finite(t), where
    assert len(case["step_times_s"]) == steps == case["steps"]
    assert all(_positive_finite(x) for x in case["step_times_s"]), where
    assert min(case["step_times_s"]) <= t <= max(case["step_times_s"])
    assert math.isfinite(case["final_loss"]), where
    # The JSON keeps 6 significant digits: derived figures agree to 1e-5.
    assert case["examples_per_s"] == pytest.approx(entry["examples"] / t, rel=1e-5)
    if entry["tokens"]:
      assert case["tokens_per_s"] == pytest.approx(entry["tokens"] / t, rel=1e-5)
    assert case["tflops"] == pytest.approx(entry["flops_per_step"] / t / 1e12, rel=1e-5)
    # Speedups: the same library's f32 (TF32) step time over this mode's.
    for base in ("f32", "tf32", "bf16"):
      assert case[f"speedup_vs_{base}"] == pytest.approx(
          cases[base]["step_time_s"] / t, rel=1e-5)
    # A CPU is not in the peak table: no MFU, rather than a wrong one.
    assert case["peak_tflops"] is None and case["mfu"] is None
    assert case["skipped_steps"] >= 0
  if library == "torch" and entry["workload"] in TORCH_LESS:
    return  # every case skipped (checked above): no PyTorch twin
  assert cases["f32"]["speedup_vs_f32"] == 1.0
  assert cases["f16"]["loss_scale"] > 0
  # float32 and TF32 train without loss scaling.
  assert cases["f32"]["loss_scale"] is None and cases["tf32"]["loss_scale"] is None


def test_every_jax_case_ran_with_consistent_figures(split):
  _, _, report = split
  assert report["benchmark"] == "gpu" and report["config"]["dry_run"] is True
  assert [e["workload"] for e in report["results"]] == list(WORKLOADS)
  for entry in report["results"]:
    assert entry["flops_per_step"] > 0
    _check_library_cases(entry, "jax", steps=2, report=report)
    cases = {m: c for m, c in entry["jax"].items() if c["status"] == "ok"}
    for mode, case in cases.items():
      # Every mode counts the same matmul/conv FLOPs as the static count.
      assert case["flops_per_step"] == entry["flops_per_step"], mode
      assert case["compile"]["total_s"] > 0
      assert case["compile"]["xla_memory"]["argument"] > 0
    assert cases["f32"]["half_flop_share"] == cases["tf32"]["half_flop_share"] == 0.0
    assert cases["bf16"]["half_flop_share"] == cases["f16"]["half_flop_share"] == 1.0
    assert cases["bf16"]["loss_scale"] == 1.0  # NoOpLossScale
    if entry["workload"] == "resnet":
      assert not set(FP8_MODES) & set(cases)  # skipped: no float8 matmul
      assert not set(FP4_MODES) & set(cases)  # nor FP4
      assert not set(INT8_MODES) & set(cases)  # nor int8
      continue
    # The int8 rows ran through with_policy: most matmul FLOPs on int8
    # operands (SwitchBack's weight gradients stay in bf16).
    for mode in set(INT8_MODES) & set(cases):
      info = cases[mode]["int8"]
      assert info["recipe"] == mode and cases[mode]["loss_scale"] == 1.0
      assert "speedup_vs_bf16" in cases[mode]
      low = 0.5 if mode == "int8" else 0.3
      assert low < info["int8_flop_share"] < 1.0, (entry["workload"], mode, info)
    # The MoE's float8/FP4 cases run where with_policy quantizes its grouped
    # matmuls (else they are skipped: checked by _check_library_cases).
    for mode in set(FP8_MODES) & set(cases):
      info = cases[mode]["fp8"]
      assert info["recipe"] == mode and cases[mode]["loss_scale"] == 1.0
      assert "speedup_vs_bf16" in cases[mode]
    # Every matmul but the head (and the attention's batched ones, the MoE's
    # router) in float8.
    for mode in {"fp8", "fp8_rowwise"} & set(cases):
      assert 0.5 < cases[mode]["fp8"]["fp8_flop_share"] < 1.0, (entry["workload"], mode)
      assert cases[mode]["half_flop_share"] < 0.5
    if "mxfp8" in cases:
      mx = cases["mxfp8"]["fp8"]
      assert mx["fp8_flop_share"] is None and mx["native_gemm"] is False
      assert mx["mx_path"].startswith("emulation (cpu"), mx
    if entry["workload"] == "moe":
      # No grouped matmul of a float8/FP4 case that ran is on bf16 operands.
      for mode in (set(FP8_MODES) | set(FP4_MODES) | set(INT8_MODES)) & set(cases):
        grouped = cases[mode]["fp8" if mode in FP8_MODES else "fp4" if mode in FP4_MODES
                              else "int8"]["grouped_dtypes"]
        assert sum(grouped.values()) == 6 and "bfloat16" not in grouped, (mode, grouped)
    # The FP4 rows ran through with_policy, emulated on the CPU.
    for mode in set(FP4_MODES) & set(cases):
      info = cases[mode]["fp4"]
      assert info["recipe"] == mode and info["native_gemm"] is False, info
      assert info["fp4_path"].startswith("emulation (cpu"), info
      assert cases[mode]["loss_scale"] == 1.0
      assert "speedup_vs_bf16" in cases[mode]


def test_fp4_modes_skip_off_blackwell_and_say_why(monkeypatch):
  """An H100 (compute capability 9.0) says FP4 is Blackwell only and skips;
  a Blackwell GPU and the dry run run the FP4 rows (ResNet-50 excepted: no
  matmul of it would run in FP4)."""
  from benchmarks import gpu_suite

  class Device:
    device_kind = "NVIDIA H100 80GB HBM3"
    compute_capability = "9.0"

  monkeypatch.setattr(gpu_suite.jax, "devices", lambda *a: [Device()])
  reason = gpu_suite.fp4_problem(dry_run=False)
  assert "Blackwell only" in reason and "H100" in reason and "9.0" in reason
  Device.device_kind, Device.compute_capability = "NVIDIA B200", "10.0"
  assert gpu_suite.fp4_problem(dry_run=False) is None
  assert gpu_suite.fp4_problem(dry_run=True) is None
  for mode in FP4_MODES:
    assert gpu_suite.skip_reason("mlp", "jax", mode, None, reason) == reason
    assert "prototype" in gpu_suite.skip_reason("mlp", "torch", mode, None, reason)
    assert gpu_suite.skip_reason("mlp", "jax", mode, None, None) is None
    assert "no FP4 matmul" in gpu_suite.skip_reason("resnet", "jax", mode, None,
                                                    None)
  assert gpu_suite.skip_reason("mlp", "jax", "bf16", None, reason) is None


def test_int8_modes_skip_resnet_and_torch_and_say_why():
  from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
  for mode in INT8_MODES:
    assert gpu_suite.skip_reason("mlp", "jax", mode, None) is None
    assert gpu_suite.skip_reason("transformer", "jax", mode, None) is None
    assert "no int8 matmul" in gpu_suite.skip_reason("resnet", "jax", mode, None)
    assert "no PyTorch twin" in gpu_suite.skip_reason("mlp", "torch", mode, None)
    assert gpu_suite.PEAK_KIND[mode] == "int8"
  assert gpu_suite.peak_tflops("NVIDIA A100-SXM4-80GB")["int8"] == 624.0


def test_moe_row_compares_bf16_with_every_recipe_or_says_why_not():
  """The MoE (ragged_dot experts): its FLOPs count the grouped matmuls; its
  bf16 row runs them in bf16; a float8/FP4 mode runs only where with_policy
  takes the grouped matmuls out of bf16, else it is skipped with the reason;
  PyTorch has no twin of it. No dry run: traced only."""
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import analysis  # pylint: disable=import-outside-toplevel
  from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  assert workloads.GPU_NAMES == workloads.NAMES + ("moe",)
  assert "moe" not in workloads.SIZES["cpu"]  # the committed CPU suite is unchanged
  (moe,) = workloads.make_workloads("tiny", ["moe"])
  cfg = moe.spec["config"]
  assert cfg["experts"] == 8 and cfg["top_k"] == 2
  assert all(cfg[k] % 32 == 0 for k in ("width", "hidden"))
  shapes = jax.eval_shape(lambda: workloads.setup(moe, 0))
  # Static FLOPs: forward and both gradients of each grouped matmul (2mkn
  # per product, m = token copies), the router's and the tied head's.
  tokens = moe.tokens
  copies, d, f, e, v = tokens * cfg["top_k"], cfg["width"], cfg["hidden"], 8, cfg["vocab"]
  flops = analysis.matmul_flops(jax.value_and_grad(workloads.loss_fn(moe, "f32")), *shapes)
  grouped = 3 * 2 * (2 * copies * d * f) * cfg["layers"]
  dense = 3 * 2 * tokens * d * (e * cfg["layers"] + v)
  assert flops["total"] == grouped + dense, flops
  # The bf16 row: plain ragged_dot in bf16 (the hand-cast policy).
  bf16 = workloads.loss_fn(moe, "policy", workloads.policy("bf16"))
  assert gpu_suite.grouped_dtypes(jax.value_and_grad(bf16), *shapes) == {"bfloat16": 6}
  assert gpu_suite.grouped_problem(moe, "bf16") is None
  for mode in FP8_MODES + FP4_MODES + INT8_MODES:
    reason = gpu_suite.grouped_problem(moe, mode)
    assert (reason is not None) == _moe_grouped_in_bf16(mode), (mode, reason)
    if reason:
      assert reason.startswith("the grouped matmuls stay in bf16") and f"m={mode}" in reason
  for mode in MODES:
    assert "no PyTorch twin" in gpu_suite.skip_reason("moe", "torch", mode, None)
    assert gpu_suite.skip_reason("moe", "jax", mode, None) is None


def test_markdown_lists_the_float8_cases(split):
  _, out, report = split
  text = (out / "gpu.md").read_text()
  assert "## Float8 cases" in text
  for entry in report["results"]:
    for mode in FP8_MODES:
      case = entry["jax"][mode]
      if case["status"] == "skipped":
        why = ("the grouped matmuls stay in bf16" if entry["workload"] == "moe"
               else "no float8 matmul")
        assert f"| jmp_lite (JAX) | {mode} | skipped: {why}" in text
      else:
        assert f"| {entry['workload']} | {mode} | " in text
  assert "| mlp | mxfp8 | – | " in text and "emulation (cpu" in text


def test_collectives_row_reads_the_compiled_programs(split):
  # The dry run reads the collectives of the programs compiled for 8 CPU
  # devices (on a GPU machine: its GPUs): each low-precision row moves its
  # payload as 1- or 2-byte bits and fewer bytes than its plain baseline.
  _, out, report = split
  row = report["collectives"]
  assert row["status"] == "ok" and row["devices"] == 8, row
  assert row["platform"] == "cpu"
  settings = {r["setting"] for r in row["results"]}
  assert settings == {"gradient reduction", "MoE dispatch",
                      "MoE dispatch, gradient", "FSDP", "FSDP under shard_map"}
  for r in row["results"]:
    if r["program"].startswith(("float8 (fp8.dot_general", "int8 (int8.dot_general")):
      gathers = [c for c in r["collectives"] if c["op"] == "all-gather"]
      assert gathers and all(c["types"] == ["u8"] for c in gathers), r
      assert r["sent_ratio"] < 1, r
  text = (out / "gpu.md").read_text()
  assert "## Collectives: bytes on the wire" in text
  assert "| FSDP under shard_map | float8 (fp8.dot_general, fsdp_axis=d) |" in text


def test_collectives_row_with_one_device_says_why(monkeypatch):
  # (Only the device count decides; nothing runs.)
  from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(gpu_suite.jax, "device_count", lambda: 1)
  row = gpu_suite.collectives_row(dry_run=False, timeout_s=10)
  assert row["status"] == "skipped"
  assert "nothing to gather or exchange" in row["reason"]


def test_markdown_lists_the_int8_cases(split):
  _, out, report = split
  text = (out / "gpu.md").read_text()
  assert "## int8 cases" in text
  for entry in report["results"]:
    for mode in INT8_MODES:
      case = entry["jax"][mode]
      if case["status"] == "skipped":
        why = ("the grouped matmuls stay in bf16" if entry["workload"] == "moe"
               else "no int8 matmul")
        assert f"| jmp_lite (JAX) | {mode} | skipped: {why}" in text
      else:
        share = case["int8"]["int8_flop_share"]
        assert f"| {entry['workload']} | {mode} | {100 * share:.1f}%" in text or (
            f"| {entry['workload']} | {mode} | " in text)


@pytest.mark.torch
def test_every_torch_case_ran_with_consistent_figures(split):
  _, _, report = split
  assert report["config"]["torch"].startswith("torch ")
  for entry in report["results"]:
    _check_library_cases(entry, "torch", steps=2, report=report)
    if entry["workload"] in TORCH_LESS:
      assert {c["status"] for c in entry["torch"].values()} == {"skipped"}
      continue
    assert entry["torch"]["f16"]["loss_scale"] == 2.0**15  # no overflow, no growth yet


def test_the_report_says_whether_torch_ran(split):
  """With torch (nox -s bench) every workload has its PyTorch cases; without
  it the report says why there are none."""
  _, _, report = split
  if _has_torch():
    assert report["config"]["torch"].startswith("torch ")
    assert all("torch" in e for e in report["results"])
  else:
    assert report["config"]["torch"].startswith("not run: import torch failed")
    assert all("torch" not in e for e in report["results"])


def test_autocast_and_wrapper_comparisons(split):
  _, _, report = split
  for entry in report["results"]:
    auto = entry["jax"]["bf16"]["comparison"]
    assert auto["half_flop_share"] == 1.0
    assert auto["check"]["same"] is True, auto["check"]
    assert auto["steps_per_block"] == 2
    for name in ("policy", "autocast"):
      assert len(auto["step_time_s"][name]["values"]) == 2  # --gpu-steps blocks
      assert all(_positive_finite(v) for v in auto["step_time_s"][name]["values"])
      assert all(math.isfinite(x) for x in auto["check"]["losses"][name])
    ratios = [a / b for a, b in zip(auto["step_time_s"]["autocast"]["values"],
                                    auto["step_time_s"]["policy"]["values"])]
    assert auto["ratio"]["values"] == pytest.approx(ratios, rel=1e-5)
    hand = entry["jax"]["f16"]["comparison"]
    assert hand["check"]["same"] is True, hand["check"]
    assert hand["check"]["loss_scale"]["jmp_lite"] == hand["check"]["loss_scale"]["hand"]
    assert _positive_finite(hand["ratio"]["median"])
    assert _positive_finite(hand["cpu_ratio"]["median"])
    assert hand["compile"]["total_s"] > 0
    for mode in ("f32", "tf32"):
      assert "comparison" not in entry["jax"][mode]


def test_split_runs_merge_into_one_report(split):
  _, _, report = split
  runs = report["runs"]
  assert len(runs) == 2
  for run, (workloads, names) in zip(runs, SPLIT):
    assert f"--gpu-workloads {workloads}" in run["command"]
    assert run["workloads"] == list(names)
  for entry in report["results"]:
    for library in ("jax", "torch"):
      for case in entry.get(library, {}).values():
        assert entry["workload"] in runs[case["run"]]["workloads"]
  assert report["wall_s"] == pytest.approx(sum(r["wall_s"] for r in runs), rel=1e-5)


def test_markdown_has_every_table(split):
  procs, out, report = split
  text = (out / "gpu.md").read_text()
  assert "Measured by these runs" in text and "Dry run" in text
  for run in report["runs"]:
    assert f"`{run['command']}`" in text
  for entry in report["results"]:
    assert f"## {entry['workload']}: {entry['description']}" in text
    for mode in MODES:
      assert f"| jmp_lite (JAX) | {mode} |" in text
      if "torch" in entry:
        assert f"| PyTorch | {mode} |" in text
    assert f"| {entry['workload']} | bf16: autocast / policy |" in text
    assert f"| {entry['workload']} | f16: jmp_lite / hand |" in text
  assert "## Comparisons in the mixed-precision cases" in text
  assert "error" not in text and "timeout" not in text and "not timed" not in text
  assert text in procs[-1].stdout  # the page is also printed


@pytest.mark.torch
def test_markdown_puts_jax_next_to_torch(split):
  """The jmp_lite rows end with their step time over PyTorch's in the mode."""
  _, out, report = split
  text = (out / "gpu.md").read_text()
  for entry in report["results"]:
    section = text[text.index(f"## {entry['workload']}:"):]
    for mode in MODES:
      if "ok" != entry["jax"][mode]["status"] or "ok" != entry["torch"][mode]["status"]:
        continue  # skipped float8 cases: checked by the case tests
      row = next(l for l in section.splitlines() if l.startswith(f"| jmp_lite (JAX) | {mode} |"))
      ratio = entry["jax"][mode]["step_time_s"] / entry["torch"][mode]["step_time_s"]
      assert row.endswith(f"| {ratio:.3g} |"), row


def test_rerun_in_subprocesses_replaces_only_its_cases(split, tmp_path):
  """A case re-run (here in a subprocess, as on a GPU) replaces the old one;
  the speedups of the cases kept are recomputed against it."""
  _, out, before = split
  shutil.copy(out / "gpu.json", tmp_path / "gpu.json")
  libraries = "jax,torch" if _has_torch() else "jax"
  proc = _dry_run(tmp_path, "--gpu-subprocess", "--gpu-workloads", "mlp",
                  "--gpu-libraries", libraries, "--gpu-modes", "f32")
  _ok(proc)
  report = json.loads((tmp_path / "gpu.json").read_text())
  assert len(report["runs"]) == 3
  assert report["runs"][-1]["workloads"] == ["mlp"]
  mlp = report["results"][0]
  for library in libraries.split(","):
    cases = mlp[library]
    assert cases["f32"]["run"] == 2 and cases["f16"]["run"] == 0
    assert cases["f32"]["status"] == "ok"
    assert cases["f16"]["step_time_s"] == before["results"][0][library]["f16"]["step_time_s"]
    assert cases["f16"]["speedup_vs_f32"] == pytest.approx(
        cases["f32"]["step_time_s"] / cases["f16"]["step_time_s"], rel=1e-5)
  # The other workloads' cases are kept; their derived figures are recomputed
  # from the measured ones (6 significant digits in the JSON).
  for entry, old in zip(report["results"][1:], before["results"][1:], strict=True):
    for library in ("jax", "torch"):
      for mode, case in entry.get(library, {}).items():
        kept = old[library][mode]
        assert {k: v for k, v in case.items() if k not in DERIVED} == {
            k: v for k, v in kept.items() if k not in DERIVED}
        for key in DERIVED & set(case):
          want = None if kept[key] is None else pytest.approx(kept[key], rel=1e-5)
          assert case[key] == want, key


def test_case_timeout_is_reported_not_dropped(tmp_path):
  proc = _dry_run(tmp_path, "--gpu-subprocess", "--gpu-workloads", "mlp",
                  "--gpu-libraries", "jax", "--gpu-modes", "f32,f16",
                  "--gpu-case-timeout-s", "0.5")
  _ok(proc)
  assert "2 case(s) did not complete" in proc.stderr
  cases = json.loads((tmp_path / "gpu.json").read_text())["results"][0]["jax"]
  for case in cases.values():
    assert case["status"] == "timeout"
    assert case["error"] == "timed out after 0.5 s (killed)"
  assert "| jmp_lite (JAX) | f16 | timeout: timed out after 0.5 s" in (
      tmp_path / "gpu.md").read_text()


def test_spent_budget_reports_cases_as_not_run_and_replaces_other_reports(tmp_path):
  previous = {"benchmark": "gpu", "runs": [], "results": [],
              "config": {"size": "gpu", "dry_run": False},
              "machine": {"device_kind": "NVIDIA H100"}}
  (tmp_path / "gpu.json").write_text(json.dumps(previous))
  proc = _dry_run(tmp_path, "--gpu-workloads", "mlp", "--gpu-budget-s", "0")
  _ok(proc)
  assert "is replaced, not merged (one is a dry run, the other not)" in proc.stdout
  report = json.loads((tmp_path / "gpu.json").read_text())
  assert len(report["runs"]) == 1
  entry = report["results"][0]
  for library in ("jax", "torch") if _has_torch() else ("jax",):
    for mode, case in entry[library].items():
      if library == "torch" and mode in ("mxfp8", "nvfp4", "mxfp4") + INT8_MODES:
        assert case["status"] == "skipped"  # never run, whatever the budget
        continue
      if library == "torch" and case["status"] == "skipped":
        # torch's float8 modes without torchao (the bench session installs
        # torch, not torchao): skipped before any budget is spent.
        assert mode in ("fp8", "fp8_rowwise") and "torchao" in case["reason"]
        continue
      assert case["status"] == "not run"
      assert "--gpu-budget-s 0" in case["error"]
  assert "| jmp_lite (JAX) | f32 | not run:" in (tmp_path / "gpu.md").read_text()


@pytest.mark.parametrize("flag, value", [("--gpu-workloads", "resnet50"),
                                         ("--gpu-modes", "fp16"),
                                         ("--gpu-libraries", "pytorch")])
def test_unknown_selection_is_an_error(tmp_path, flag, value):
  proc = _dry_run(tmp_path, flag, value)
  assert proc.returncode == 2
  assert f"{flag}: '{value}' given; choose a comma-separated subset of" in proc.stderr
  assert not (tmp_path / "gpu.json").exists()


def test_without_a_gpu_the_suite_fails_clearly(tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  try:
    if jax.devices("gpu"):
      pytest.skip("a GPU is present")
  except RuntimeError:
    pass
  proc = _run(["benchmarks", "run", "--suite", "gpu", "--out", str(tmp_path)])
  assert proc.returncode == 2
  assert "needs a CUDA GPU" in proc.stderr
  assert not (tmp_path / "gpu.json").exists()


@pytest.mark.parametrize("device, kind, peak", [
    ("NVIDIA H100 80GB HBM3", "half", 989.0), ("NVIDIA H200", "tf32", 494.0),
    ("NVIDIA A100-SXM4-80GB", "f32", 19.5), ("NVIDIA H100 PCIe", None, None),
    ("NVIDIA H100 NVL", None, None), ("cpu", None, None)])
def test_peak_table_resolves_devices(device, kind, peak):
  """MFU is against the right dense peak, or omitted: never a wrong one."""
  from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
  peaks = gpu_suite.peak_tflops(device)
  assert (peaks is None) == (peak is None)
  if peak is not None:
    assert peaks[kind] == peak


@pytest.mark.torch
@pytest.mark.parametrize("size", ["tiny", "gpu"])
def test_torch_models_have_their_jax_twins_parameters(size):
  """Layer for layer: the same parameter count as the JAX workload, at the
  dry run's size and at the GPU size (built on torch's meta device and traced
  by jax.eval_shape: nothing is allocated)."""
  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from benchmarks import torch_side  # pylint: disable=import-outside-toplevel
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  for workload in workloads.make_workloads(size):
    shapes = jax.eval_shape(workload.init, jax.random.PRNGKey(0))
    jax_count = sum(x.size for x in jax.tree.leaves(shapes))
    with torch.device("meta"):
      model = torch_side.make_model(workload.name, workload.spec)
    assert sum(p.numel() for p in model.parameters()) == jax_count, workload.name


def test_the_case_worker_needs_its_case():
  proc = _run(["benchmarks.gpu_suite"])
  assert proc.returncode == 1
  assert "usage: python -m benchmarks.gpu_suite CASE_JSON" in proc.stderr
