"""End-to-end tests of the Flax examples and of the parity report.

``examples/linen_cnn_digits.py`` and ``examples/nnx_char_lm.py`` run as a user
would run them (subprocesses, with the repository root on ``PYTHONPATH`` so an
uninstalled checkout works) for a few steps only, into a temporary folder;
``examples/parity.py`` then reads their JSON. This checks that they run and
write well-formed results, not the accuracies the full runs reach.
"""

import json
import math

import pytest

from helpers import assert_exited_cleanly
from helpers import assert_finite_figures
from helpers import ROOT
from helpers import run_example

EXAMPLES = ROOT / "examples"
RUNS = ("f32", "bf16", "f16_scaled")
COMMON = ("final_train_loss", "median_step_ms", "skipped_steps",
          "final_loss_scale")
CNN_NUMBERS = COMMON + ("test_accuracy", "test_loss")
LM_NUMBERS = COMMON + ("validation_loss",)


def _run(script, *args):
  return run_example(EXAMPLES / script, *args)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  """Runs both examples once, for a few steps, into one temporary folder."""
  out = tmp_path_factory.mktemp("flax_examples")
  cnn = _run("linen_cnn_digits.py", "--steps", 12, "--period", 4,
             "--out", out)
  lm = _run("nnx_char_lm.py", "--steps", 6, "--period", 2, "--seq-len", 16,
            "--batch-size", 4, "--d-model", 32, "--max-chars", 20_000,
            "--val-windows", 8, "--sample-length", 8, "--out", out)
  return out, cnn, lm


def _check_outputs(out, proc, name, numbers):
  assert_exited_cleanly(proc)
  for ext in ("md", "json", "png"):
    path = out / f"{name}.{ext}"
    assert path.is_file() and path.stat().st_size > 0, path
  result = json.loads((out / f"{name}.json").read_text())
  assert tuple(result["runs"]) == RUNS
  assert_finite_figures(result["runs"], numbers, result["config"]["steps"])
  table = (out / f"{name}.md").read_text()
  for figures in result["runs"].values():
    assert figures["label"] in table and figures["policy"] in table
  return result


@pytest.mark.slow
def test_linen_cnn_digits_writes_results(out_dir):
  out, cnn, _ = out_dir
  result = _check_outputs(out, cnn, "linen_cnn_digits", CNN_NUMBERS)
  runs = result["runs"]
  assert runs["f32"]["policy"] == "p=full,c=full,o=full"
  assert runs["f16_scaled"]["policy"] == "p=full,c=f16,o=full"
  assert runs["f32"]["final_loss_scale"] == 1.0
  # The dynamic scale starts at 2**15 and, with period 4, changes within 12
  # steps (grows without skips, halves on a skip); always a power of two.
  history = runs["f16_scaled"]["loss_scale_history"]
  assert history[0] == 2.0**15 and len(set(history)) > 1
  scale = runs["f16_scaled"]["final_loss_scale"]
  assert math.log2(scale) == int(math.log2(scale))
  for figures in runs.values():
    assert 0.0 <= figures["test_accuracy"] <= 100.0


@pytest.mark.slow
def test_nnx_char_lm_writes_results_and_samples(out_dir):
  out, _, lm = out_dir
  result = _check_outputs(out, lm, "nnx_char_lm", LM_NUMBERS)
  for figures in result["runs"].values():
    assert figures["sample"].startswith(result["config"]["prompt"])
    assert figures["sample"] in (out / "nnx_char_lm.md").read_text()
  assert result["runs"]["bf16"]["policy"] == "p=full,c=bf16,o=full"


@pytest.mark.slow
def test_parity_reads_both_results_and_computes_verdicts(out_dir):
  out, cnn, lm = out_dir
  assert cnn.returncode == 0 and lm.returncode == 0
  report = out / "report"
  proc = _run("parity.py", "--results", out, "--out", report)
  assert proc.returncode in (0, 1), proc.stderr[-3000:]
  text = (report / "parity.md").read_text()
  rows = [line for line in text.splitlines()
          if line.startswith("| DigitsCNN") or line.startswith("| CharLM")]
  assert len(rows) == 4  # bf16 and f16 for each model
  verdicts = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
  assert set(verdicts) <= {"PASS", "FAIL"}
  assert proc.returncode == (0 if verdicts == ["PASS"] * 4 else 1)
  # Loose tolerances make every finite row pass; zero ones fail any difference.
  loose = _run("parity.py", "--results", out, "--out", report,
               "--acc-tolerance", 100, "--loss-tolerance", 1000)
  assert loose.returncode == 0, loose.stdout
  assert (report / "parity.md").read_text().count("| PASS |") == 4


@pytest.mark.slow  # runs an example program
def test_parity_fails_a_row_outside_the_tolerance(tmp_path):
  def runs(**metrics):
    return {"runs": {name: dict(label=name, **{k: v[i] for k, v in
                                               metrics.items()})
                     for i, name in enumerate(RUNS)}}

  (tmp_path / "linen_cnn_digits.json").write_text(
      json.dumps(runs(test_accuracy=[98.0, 97.8, 97.0])))
  (tmp_path / "nnx_char_lm.json").write_text(
      json.dumps(runs(validation_loss=[1.50, 1.52, 1.60])))
  proc = _run("parity.py", "--results", tmp_path)
  assert proc.returncode == 1
  text = (tmp_path / "parity.md").read_text()
  verdicts = [line.rstrip(" |").rsplit("| ", 1)[1]
              for line in text.splitlines()
              if line.startswith("| DigitsCNN") or line.startswith("| CharLM")]
  # 97.8 is 0.2 pt from 98.0; 97.0 is 1 pt; 1.52 is +1.33%; 1.60 is +6.67%.
  assert verdicts == ["PASS", "FAIL", "PASS", "FAIL"]
  assert "+1.33 %" in text and "-1.00 pt" in text
