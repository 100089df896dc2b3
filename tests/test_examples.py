"""End-to-end test of the demo, ``examples/digits_demo.py``.

The demo runs as a user would run it (a subprocess, with the repository root on
``PYTHONPATH`` so an uninstalled checkout works), for a few steps only: this
checks that it runs and writes well-formed results, not the accuracies it
reaches with the default number of steps.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import assert_exited_cleanly
from helpers import assert_finite_figures
from helpers import assert_is_png
from helpers import is_finite_number
from helpers import ROOT
from helpers import run_example

DEMO = ROOT / "examples" / "digits_demo.py"
RUNS = ("f32", "bf16", "f16_scaled", "f16_unscaled")
NUMBERS = (
    "test_accuracy",
    "final_train_loss",
    "median_step_ms",
    "skipped_steps",
    "final_loss_scale",
    "zero_grad_fraction",
)
STEPS = 30


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """Runs the demo once for all tests in this module."""
  out = tmp_path_factory.mktemp("digits_demo")
  proc = run_example(DEMO, "--steps", STEPS, "--period", 10, "--out", out)
  return proc, out


@pytest.mark.slow
def test_demo_exits_cleanly_and_prints_the_comparison(demo_run):
  proc, _ = demo_run
  assert_exited_cleanly(proc)
  for text in ("| run | policy |", "f16 + dynamic loss scaling",
               "f16, no loss scaling", "Verdict:", "Underflow setting:"):
    assert text in proc.stdout


@pytest.mark.slow
def test_demo_writes_png_markdown_and_json(demo_run):
  proc, out = demo_run
  assert_exited_cleanly(proc)
  assert_is_png(out / "digits_demo.png")
  markdown = (out / "digits_demo.md").read_text()
  assert "| f16, no loss scaling |" in markdown
  assert "Verdict:" in markdown


@pytest.mark.slow
def test_demo_json_has_the_four_runs_with_finite_figures(demo_run):
  proc, out = demo_run
  assert_exited_cleanly(proc)
  data = json.loads((out / "digits_demo.json").read_text())
  assert data["config"]["steps"] == STEPS
  assert tuple(data["runs"]) == RUNS
  assert_finite_figures(data["runs"], NUMBERS, STEPS)
  for name, run in data["runs"].items():
    assert 0 <= run["test_accuracy"] <= 100
    assert 0 <= run["zero_grad_fraction"] <= 1
    assert all(is_finite_number(x) for x in run["loss_history"]), name
  runs = data["runs"]
  assert runs["f16_scaled"]["policy"] == "p=full,c=f16,o=full"
  assert runs["bf16"]["policy"] == "p=full,c=bf16,o=full"
  # No-op runs keep scale 1; the dynamic run starts at 2**15 and, with
  # --period 10 and 30 steps, grows or backs off: it changes.
  for name in ("f32", "bf16", "f16_unscaled"):
    assert runs[name]["final_loss_scale"] == 1
  scale_history = runs["f16_scaled"]["loss_scale_history"]
  assert scale_history[0] == 2.0**15
  assert len(set(scale_history)) > 1
  # The same initial parameters and batch in every run: the first loss agrees
  # across precisions up to half-precision rounding.
  first = [run["loss_history"][0] for run in runs.values()]
  assert max(first) - min(first) < 0.05
  # The default loss weight is the underflow setting: without loss scaling
  # most f16 gradient entries are exactly zero at step 1, unlike f32's.
  zeros = {name: run["zero_grad_fraction"] for name, run in runs.items()}
  assert zeros["f16_unscaled"] > zeros["f32"] + 0.5
  assert zeros["f16_scaled"] < zeros["f32"] + 0.05


def test_scratch_folders_cannot_shadow_the_package(tmp_path):
  """The examples and benchmarks write to folders under the system temp
  folder. Named "jmp_lite", such a folder was imported as a namespace package
  by any script run from the temp folder afterwards (with the README's
  editable install), hiding the real one: `jmp_lite.loss_scaling` was an
  AttributeError there."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["TMPDIR"] = str(tmp_path)
  made = subprocess.run(
      [sys.executable, "-c",
       "import os, examples.common as e, benchmarks.common as b\n"
       "for d in (e.SCRATCH_DIR, b.SCRATCH_DIR): os.makedirs(d)\n"
       "print(e.SCRATCH_DIR, b.SCRATCH_DIR)"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  assert all(d.startswith(str(tmp_path)) for d in made.stdout.split())
  (tmp_path / "script.py").write_text(
      "import jmp_lite\nprint(jmp_lite.loss_scaling.__name__)\n")
  run = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
  if "No module named 'jmp_lite'" in run.stderr:
    pytest.skip("jmp_lite is not installed (only on PYTHONPATH)")
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == "loss_scaling"
