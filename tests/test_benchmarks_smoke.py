"""Smoke test: the wrapper-overhead benchmark runs and writes well-formed results.

Benchmarks report figures; this test only checks that the script runs end to
end at tiny sizes and that its JSON has the documented shape. It asserts
nothing about speed or the ratio.
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
