"""Smoke tests: the benchmarks run and write well-formed results.

Benchmarks report figures; these tests only check that the scripts run end to
end at tiny sizes (``python -m benchmarks.wrapper_overhead --quick``,
``python -m benchmarks run --suite cpu --quick``) and that their JSON has the
documented shape. They assert nothing about speed or ratios. The GPU suite's
tests are in ``test_gpu_suite.py``.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ("jmp_lite", "hand")


def _positive_finite(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("wrapper_overhead")
  env = dict(os.environ)
  # One CPU device is enough; the test suite's simulated devices are not needed.
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.wrapper_overhead", "--quick",
       "--out", str(out)],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
  )
  return proc, out


def test_exits_zero_and_prints_table(quick_run):
  proc, _ = quick_run
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "| workload | policy |" in proc.stdout


def test_json_has_machine_config_and_results(quick_run):
  _, out = quick_run
  report = json.loads((out / "wrapper_overhead.json").read_text())
  assert report["benchmark"] == "wrapper_overhead"
  assert "--quick" in report["command"]
  for key in ("platform", "cpu_count", "python", "jax", "jaxlib", "optax",
              "device_kind", "backend"):
    assert report["machine"][key] not in (None, ""), key
  assert report["config"]["quick"] is True
  assert report["config"]["target_ratio"] == pytest.approx(1.03)
  names = {r["workload"] for r in report["results"]}
  assert names == {"mlp-f16", "mlp-bf16", "conv-f16", "conv-bf16"}


def test_every_workload_has_positive_finite_figures(quick_run):
  _, out = quick_run
  report = json.loads((out / "wrapper_overhead.json").read_text())
  repeats = report["config"]["repeats"]
  for result in report["results"]:
    assert result["check"]["same"] is True, result["check"]
    for clock in ("step_time_s", "cpu_time_s"):
      for variant in VARIANTS:
        stats = result[clock][variant]
        assert len(stats["values"]) == repeats
        assert all(_positive_finite(v) for v in stats["values"]), stats
        assert stats["q25"] <= stats["median"] <= stats["q75"]
    for ratio in ("ratio_a_over_b", "cpu_ratio_a_over_b"):
      assert _positive_finite(result[ratio]["median"]), result[ratio]
      assert result[ratio]["iqr"] >= 0
    for variant in VARIANTS:
      info = result["compile"][variant]
      assert _positive_finite(info["lower_s"])
      assert _positive_finite(info["compile_s"])
      assert info["entry_kernels"] > 0
    assert isinstance(result["within_target"], bool)


def test_markdown_names_the_command_and_every_workload(quick_run):
  _, out = quick_run
  text = (out / "wrapper_overhead.md").read_text()
  assert "python -m benchmarks.wrapper_overhead --quick" in text
  for name in ("mlp-f16", "mlp-bf16", "conv-f16", "conv-bf16"):
    assert f"| {name}:" in text


# --- the suite: python -m benchmarks run -------------------------------------


def _run_suite(out, *args):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
      [sys.executable, "-m", "benchmarks", "run", *args, "--out", str(out)],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
  )


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("cpu_suite")
  return _run_suite(out, "--suite", "cpu", "--quick"), out


def test_cpu_suite_quick_writes_json_and_markdown(cpu_quick):
  proc, out = cpu_quick
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((out / "cpu.json").read_text())
  assert report["suite"] == "cpu"
  assert "--quick" in report["command"]
  assert report["config"]["quick"] is True
  for key in ("jax", "jaxlib", "device_kind", "cpu_count", "platform"):
    assert report["machine"][key] not in (None, ""), key
  assert len(report["load_average"]["before"]) == 3
  text = (out / "cpu.md").read_text()
  assert "python -m benchmarks run --suite cpu --quick" in text
  for heading in ("## 1. Step time", "## 2. Residuals", "## 3. Share of matmul",
                  "## 4. Compile time", "## 5. `autocast`"):
    assert heading in text


def test_cpu_suite_timing_figures(cpu_quick):
  _, out = cpu_quick
  report = json.loads((out / "cpu.json").read_text())
  assert report["results"], "no workload ran"
  for result in report["results"]:
    for variant in ("bf16/jmp_lite", "bf16/hand", "bf16/apply_if_finite",
                    "bf16/autocast", "f16/jmp_lite", "f16/hand"):
      stats = result["step_time_s"][variant]
      assert len(stats["values"]) == report["config"]["repeats"]
      assert all(_positive_finite(v) for v in stats["values"])
      assert _positive_finite(result["compile"][variant]["total_s"])
    for name in ("jmp_lite/hand bf16", "jmp_lite/hand f16",
                 "jmp_lite/apply_if_finite bf16", "autocast/policy bf16"):
      assert _positive_finite(result["ratios"][name]["wall"]["median"])
    for name in ("jmp_lite/hand bf16", "jmp_lite/apply_if_finite bf16",
                 "autocast/policy bf16", "jmp_lite bf16/f32"):
      assert _positive_finite(result["compile_ratios"][name])


def test_cpu_suite_static_figures(cpu_quick):
  _, out = cpu_quick
  report = json.loads((out / "cpu.json").read_text())
  for result in report["results"]:
    static = result["static"]
    assert static["f32"]["flops"]["half_share"] == 0.0
    for key in ("policy bf16", "policy f16", "autocast bf16", "autocast f16"):
      flops, res = static[key]["flops"], static[key]["residuals"]
      assert flops["total"] == static["f32"]["flops"]["total"] > 0
      assert 0.0 <= flops["half_share"] <= 1.0
      assert res["bytes"] == res["activation_bytes"] + res["param_copy_bytes"]
      assert _positive_finite(res["ratio_vs_f32"])
  for name in ("DigitsCNN", "CharLM"):
    figures = report["example_models"][name]["figures"]
    assert figures["f32"]["residuals"]["ratio_vs_f32"] == 1.0
    for dt in ("bf16", "f16"):
      assert figures[dt]["flops"]["total"] > 0
      assert _positive_finite(figures[dt]["residuals"]["ratio_vs_f32"])
