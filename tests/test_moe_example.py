"""End-to-end test of ``examples/moe_parity.py`` in its ``--quick`` mode.

The example runs as a user would run it (a subprocess, ``python -m
examples.moe_parity``) on a tiny MoE LM for a few steps, into a temporary
folder. The test asserts behaviour, never figures: every run trains (its loss
falls), the router spreads the tokens over several experts, the expert
matmuls (``ragged_dot_general``) run in each run's precision (read from the
jaxprs with ``jmp_lite.op_dtypes``, as the example reports them), and the
verdicts follow from the figures and the dense examples' bars.
"""

import json
import subprocess
import sys

import pytest

from helpers import assert_exited_cleanly
from helpers import example_env
from helpers import is_finite_number
from helpers import ROOT
from helpers import run_example

SCRIPT = ROOT / "examples" / "moe_parity.py"
RUNS = ("f32", "bf16", "fp8_rowwise", "mxfp8", "nvfp4")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("moe")
  proc = run_example(SCRIPT, "--quick", "--out", out)
  assert_exited_cleanly(proc)
  return (json.loads((out / "moe_parity.json").read_text()),
          (out / "moe_parity.md").read_text())


def _dtypes(counts):
  return {d for key in counts for d in key.split(", ")}


@pytest.mark.slow
def test_every_run_trains_and_routes_over_several_experts(quick):
  result, _ = quick
  config = result["config"]
  assert config["quick"] is True and config["experts"] == 8
  assert config["top_k"] == 2
  runs = result["runs"]["0"]
  assert tuple(runs) == RUNS
  for name, run in runs.items():
    for key in ("validation_loss", "validation_accuracy", "final_train_loss",
                "median_step_ms"):
      assert is_finite_number(run[key]), (name, key)
    losses = run["loss_history"]
    assert len(losses) == config["steps"]
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.5, name  # it learns
    # Routing: each block's token copies go to several experts, none takes
    # most of them (the load-balancing loss at work).
    assert len(run["expert_share"]) == config["blocks"]
    for block in run["expert_share"]:
      assert len(block) == 8
      assert sum(share > 0 for share in block) >= 4, (name, block)
      assert max(block) < 0.5, (name, block)
      assert sum(block) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_expert_matmuls_run_in_each_recipe(quick):
  result, _ = quick
  runs = result["runs"]["0"]
  blocks = result["config"]["blocks"]
  for name, run in runs.items():
    forward = run["evidence"]["forward"]
    gradient = run["evidence"]["gradient"]
    # 3 expert matmuls per block (gate, up, down); the gradient adds the
    # input and the weight gradients of each.
    assert sum(forward["ragged_dot"].values()) == 3 * blocks, name
    assert sum(gradient["ragged_dot"].values()) == 9 * blocks, name
    assert not [k for k in gradient["fallbacks"]
                if k.startswith("ragged_dot_general")], name
    assert run["experts_in_recipe"] is True, (name, gradient)
  assert _dtypes(runs["f32"]["evidence"]["gradient"]["ragged_dot"]) == {
      "float32"}
  # bf16: autocast casts the expert matmuls' operands to bfloat16.
  assert _dtypes(runs["bf16"]["evidence"]["forward"]["ragged_dot"]) == {
      "bfloat16"}
  assert _dtypes(runs["bf16"]["evidence"]["gradient"]["ragged_dot"]) == {
      "bfloat16"}
  # Rowwise float8: float8 operands, forward and backward.
  rowwise = runs["fp8_rowwise"]["evidence"]
  for part in ("forward", "gradient"):
    assert all(d.startswith("float8") for d in _dtypes(
        rowwise[part]["ragged_dot"])), part
  # MXFP8 and NVFP4: float8/FP4 operands, or on CPU their exact emulation
  # (float32 values dequantized from float8/FP4 just before the product).
  for name in ("mxfp8", "nvfp4"):
    experts = runs[name]["evidence"]["gradient"]["experts"]
    assert set(experts) <= {"low_bit", "emulated"}, (name, experts)
    assert sum(experts.values()) == 9 * blocks


@pytest.mark.slow
def test_verdicts_follow_from_the_figures_and_the_dense_bars(quick):
  result, text = quick
  bars = result["config"]["bars"]
  assert bars["bf16"]["tolerance_percent"] == 2.0  # examples/parity.py
  assert bars["fp8_rowwise"]["tolerance_percent"] == 0.25  # fp8_parity.py
  assert bars["mxfp8"]["tolerance_percent"] == 0.25
  assert bars["nvfp4"]["tolerance_percent"] == 1.5  # fp4_parity.py
  assert bars["nvfp4"]["one_sided"] and not bars["mxfp8"]["one_sided"]
  runs = result["runs"]["0"]
  rows = result["verdicts"]
  assert [(r["run"], r["reference"]) for r in rows] == [
      ("bf16", "f32"), ("fp8_rowwise", "bf16"), ("mxfp8", "bf16"),
      ("nvfp4", "bf16")]
  for row in rows:
    value = runs[row["run"]]["validation_loss"]
    ref = runs[row["reference"]]["validation_loss"]
    # The JSON keeps 6 significant digits of each loss.
    assert row["error"] == pytest.approx(100 * (value - ref) / ref, abs=2e-3)
    within = (row["error"] <= row["tolerance"] if row["one_sided"]
              else abs(row["error"]) <= row["tolerance"])
    assert row["passed"] == (within if row["experts_in_recipe"] else None)
  for heading in ("## Parity", "## Every run",
                  "## Evidence: what the expert matmuls ran in"):
    assert heading in text


@pytest.mark.slow  # imports the examples
def test_bars_are_the_dense_examples_own(tmp_path):
  code = (
      "import sys\n"
      "from examples import fp4_parity, fp8_parity, moe_parity, parity\n"
      "dense = parity.parse_args(['--out', sys.argv[1]]).loss_tolerance\n"
      "bars = {n: b[0] for n, b in moe_parity.BARS.items()}\n"
      "assert bars == {'bf16': dense, 'fp8_rowwise': fp8_parity.LOSS_TOLERANCE,"
      " 'mxfp8': fp8_parity.LOSS_TOLERANCE, 'nvfp4': fp4_parity.GAP}, bars\n")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                        capture_output=True, text=True, env=example_env(),
                        cwd=ROOT, timeout=300, check=False)
  assert_exited_cleanly(proc)


@pytest.mark.slow  # runs an example program
def test_quick_and_update_results_are_refused():
  proc = run_example(SCRIPT, "--quick", "--update-results")
  assert proc.returncode == 2 and "never replace" in proc.stderr


def test_committed_results_ran_in_their_recipes_and_the_readme_quotes_them():
  """The committed run: every run's expert matmuls ran in its recipe (no
  result of a fallback is committed), each verdict is its bar applied to the
  committed losses, and examples/README.md quotes each gap and verdict."""
  result = json.loads(
      (ROOT / "examples" / "results" / "moe_parity.json").read_text())
  readme = (ROOT / "examples" / "README.md").read_text()
  section = readme[readme.index("## `moe_parity.py`"):]
  assert result["config"]["quick"] is False
  assert result["config"]["seeds"] == [0, 1]
  for seed, runs in result["runs"].items():
    assert tuple(runs) == RUNS, seed
    for name, run in runs.items():
      assert run["experts_in_recipe"] is True, (seed, name)
      if name not in ("f32", "bf16"):  # every expert matmul quantized
        assert "plain" not in run["evidence"]["gradient"]["experts"], name
  rows = result["verdicts"]
  assert len(rows) == 8
  for row in rows:
    runs = result["runs"][str(row["seed"])]
    value = runs[row["run"]]["validation_loss"]
    ref = runs[row["reference"]]["validation_loss"]
    error = 100 * (value - ref) / ref
    assert row["error"] == pytest.approx(error, abs=2e-3)
    within = (error <= row["tolerance"] if row["one_sided"]
              else abs(error) <= row["tolerance"])
    assert row["passed"] is within
    assert f"{row['error']:+.3f}%" in section, row
  for name, label in (("bf16", "bf16 (vs f32)"),
                      ("fp8_rowwise", "float8 rowwise"), ("mxfp8", "MXFP8"),
                      ("nvfp4", "NVFP4")):
    met = all(r["passed"] for r in rows if r["run"] == name)
    line = next(l for l in section.splitlines()
                if l.startswith(f"| {label} |"))
    assert line.endswith("| meets |" if met else "| MISSES |"), line
