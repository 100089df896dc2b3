"""Smoke test of ``examples/fp4_parity.py``: the --quick run (bf16 and NVFP4
with the late switch, 3 steps of a 4-block LM) exits cleanly and writes the
results' schema; its figures mean nothing."""

import json

import pytest

from helpers import assert_exited_cleanly
from helpers import is_finite_number
from helpers import ROOT
from helpers import run_example

SCRIPT = ROOT / "examples" / "fp4_parity.py"


@pytest.mark.slow
def test_fp4_parity_quick_run_writes_the_report(tmp_path):
  proc = run_example(SCRIPT, "--quick", "--out", tmp_path)
  assert_exited_cleanly(proc)
  report = json.loads((tmp_path / "fp4_parity.json").read_text())
  assert report["config"]["quick"] is True
  assert report["config"]["criteria"]["gap_percent"] == 1.5
  assert report["config"]["criteria"]["switch_gap_percent"] == 0.5
  runs = report["runs"]["0"]
  assert set(runs) == {"bf16", "nvfp4_switch"}
  for run in runs.values():
    assert is_finite_number(run["validation_loss"])
    assert len(run["loss_history"]) == 3
  # 3 steps, the last 20% (rounded: 1 step) with the forward pass in bf16.
  assert runs["nvfp4_switch"]["switch_step"] == 2
  (gap,) = report["gaps"]
  assert gap["run"] == "nvfp4_switch" and gap["criterion"] == 0.5
  assert isinstance(gap["passed"], bool)
  diag = report["diagnostics"]
  assert diag["final_blocks"] == ["block_3"]
  assert sorted(diag["ranking"]) == [f"block_{i}" for i in range(4)]
  assert set(diag["per_block"]["block_0"]) == {"activation", "weight",
                                               "gradient"}
  markdown = (tmp_path / "fp4_parity.md").read_text()
  for text in ("## Final-loss gap to bf16", "## Every run",
               "## Diagnostics: which blocks FP4 hurts most", "| FP4 recipe |"):
    assert text in markdown


@pytest.mark.slow  # runs an example program
def test_quick_and_update_results_are_refused():
  proc = run_example(SCRIPT, "--quick", "--update-results")
  assert proc.returncode == 2 and "never replace" in proc.stderr
