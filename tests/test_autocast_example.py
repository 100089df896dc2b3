"""End-to-end test of ``examples/autocast_digits.py``.

The example runs as a user would run it (a subprocess, with the repository
root on ``PYTHONPATH`` so an uninstalled checkout works) for a few steps: this
checks that it runs, writes well-formed results and that its op-dtype evidence
shows autocast at work, not the accuracies of a full run.
"""

import json

import pytest

from helpers import assert_exited_cleanly
from helpers import assert_finite_figures
from helpers import assert_is_png
from helpers import is_finite_number
from helpers import ROOT
from helpers import run_example

EXAMPLE = ROOT / "examples" / "autocast_digits.py"
RUNS = ("f32", "f16_autocast", "bf16_autocast")
NUMBERS = (
    "test_accuracy",
    "final_train_loss",
    "median_step_ms",
    "skipped_steps",
    "final_loss_scale",
)
STEPS = 12


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
  """Runs the example once for all tests in this module."""
  out = tmp_path_factory.mktemp("autocast_digits")
  proc = run_example(EXAMPLE, "--steps", STEPS, "--out", out)
  return proc, out


@pytest.mark.slow
def test_example_exits_cleanly_and_prints_the_tables(example_run):
  proc, _ = example_run
  assert_exited_cleanly(proc)
  for text in ("| run | test acc. (%)", "f16 autocast + dynamic loss scaling",
               "bf16 autocast", "`dot_general` with half inputs", "Verdict:"):
    assert text in proc.stdout


@pytest.mark.slow
def test_example_writes_png_and_markdown(example_run):
  proc, out = example_run
  assert_exited_cleanly(proc)
  assert_is_png(out / "autocast_digits.png")
  markdown = (out / "autocast_digits.md").read_text()
  assert "| bf16 autocast |" in markdown
  assert "`reduce_sum` inputs" in markdown
  assert f"--steps {STEPS}" in markdown


@pytest.mark.slow
def test_example_json_has_the_three_runs_with_finite_figures(example_run):
  proc, out = example_run
  assert_exited_cleanly(proc)
  data = json.loads((out / "autocast_digits.json").read_text())
  assert data["config"]["steps"] == STEPS
  assert tuple(data["runs"]) == RUNS
  assert_finite_figures(data["runs"], NUMBERS, STEPS)
  for name, run in data["runs"].items():
    assert 0 <= run["test_accuracy"] <= 100
    assert all(is_finite_number(x) for x in run["loss_history"]), name
  runs = data["runs"]
  assert runs["f32"]["compute_dtype"] is None
  assert runs["f16_autocast"]["compute_dtype"] == "float16"
  assert runs["bf16_autocast"]["compute_dtype"] == "bfloat16"
  assert runs["f16_autocast"]["loss_scale_type"] == "DynamicLossScale"
  assert runs["f16_autocast"]["loss_scale_history"][0] == 2.0**15
  assert runs["f32"]["final_loss_scale"] == 1
  assert runs["bf16_autocast"]["final_loss_scale"] == 1
  # Same init and batches: the first losses agree up to half rounding.
  first = [run["loss_history"][0] for run in runs.values()]
  assert max(first) - min(first) < 0.05


@pytest.mark.slow
def test_example_evidence_shows_half_matmuls_and_f32_reductions(example_run):
  proc, out = example_run
  assert_exited_cleanly(proc)
  runs = json.loads((out / "autocast_digits.json").read_text())["runs"]
  f32_step = runs["f32"]["evidence"]["train_step"]
  assert f32_step["dot_general_total"] > 0
  assert f32_step["dot_general_half"] == 0
  for name, half in (("f16_autocast", "float16"),
                     ("bf16_autocast", "bfloat16")):
    for part in ("forward", "train_step"):
      evidence = runs[name]["evidence"][part]
      assert evidence["dot_general_total"] > 0, (name, part)
      assert evidence["dot_general_half"] == evidence["dot_general_total"]
      assert evidence["ops"]["dot_general"] == {
          f"{half}, {half}": evidence["dot_general_total"]}
      assert set(evidence["ops"]["exp"]) == {"float32"}, (name, part)
      # Every reduce_sum that runs sums in float32.
      assert set(evidence["ops"]["reduce_sum"]) == {"float32"}, (name, part)
    assert (runs[name]["evidence"]["train_step"]["dot_general_total"]
            == f32_step["dot_general_total"])
