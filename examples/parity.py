"""FP32-vs-mixed-precision parity of the two Flax examples, as a table.

Reads ``linen_cnn_digits.json`` and ``nnx_char_lm.json`` (written by
``linen_cnn_digits.py`` and ``nnx_char_lm.py``) and writes ``parity.md``: for
each mixed-precision run, its metric next to float32's and a PASS/FAIL
computed against a tolerance:

* DigitsCNN: test accuracy within ``--acc-tolerance`` points (0.5) of f32;
* CharLM: validation loss within ``--loss-tolerance`` percent (2%) of f32,
  relative to f32's.

Run it with::

  python -m examples.parity                    # reads and writes the scratch folder
  python -m examples.parity --update-results   # reads and writes examples/results/
  python -m examples.parity --results /tmp/runs --out /tmp/out

It prints the table and exits with status 1 if any row fails (or a result
file is missing), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from examples import common
CNN_FILE = "linen_cnn_digits.json"
LM_FILE = "nnx_char_lm.json"


def load(path: str) -> dict:
  """The ``runs`` of one example's JSON output, f32 included."""
  with open(path) as f:
    runs = json.load(f)["runs"]
  if "f32" not in runs:
    raise ValueError(f"{path} has no f32 run to compare with")
  return runs


def accuracy_rows(runs: dict, tolerance: float) -> list[dict]:
  """One row per mixed run: accuracy difference from f32, in points."""
  ref = runs["f32"]["test_accuracy"]
  rows = []
  for name, r in runs.items():
    if name == "f32":
      continue
    diff = r["test_accuracy"] - ref
    rows.append(dict(
        model="DigitsCNN (linen)", metric="test accuracy (%)",
        run=r["label"], f32=f"{ref:.2f}", mixed=f"{r['test_accuracy']:.2f}",
        diff=f"{diff:+.2f} pt", tolerance=f"±{tolerance:g} pt",
        passed=math.isfinite(diff) and abs(diff) <= tolerance))
  return rows


def loss_rows(runs: dict, tolerance: float) -> list[dict]:
  """One row per mixed run: validation loss difference from f32, in %."""
  ref = runs["f32"]["validation_loss"]
  rows = []
  for name, r in runs.items():
    if name == "f32":
      continue
    rel = 100.0 * (r["validation_loss"] - ref) / ref
    rows.append(dict(
        model="CharLM (nnx)", metric="validation loss (nats/byte)",
        run=r["label"], f32=f"{ref:.4f}", mixed=f"{r['validation_loss']:.4f}",
        diff=f"{rel:+.2f} %", tolerance=f"±{tolerance:g} %",
        passed=math.isfinite(rel) and abs(rel) <= tolerance))
  return rows


def format_table(rows: list[dict]) -> str:
  """The parity table as GitHub markdown."""
  lines = [
      "| model | metric | run | f32 | mixed | difference | tolerance | parity |",
      "|---|---|---|--:|--:|--:|--:|:-:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['model']} | {r['metric']} | {r['run']} | {r['f32']} "
        f"| {r['mixed']} | {r['diff']} | {r['tolerance']} "
        f"| {'PASS' if r['passed'] else 'FAIL'} |")
  return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=None,
                      help="folder holding the two JSON files (default: the "
                      "output folder, where the two examples write; parity.md "
                      "is then written there too unless --out is given)")
  common.add_output_args(parser)
  parser.add_argument("--acc-tolerance", type=float, default=0.5,
                      help="test-accuracy tolerance, points")
  parser.add_argument("--loss-tolerance", type=float, default=2.0,
                      help="relative validation-loss tolerance, percent")
  args = parser.parse_args(argv)
  if args.results and not (args.out or args.update_results):
    args.out = args.results  # parity.md goes next to the results it reads
  args.out = common.output_dir(args)
  args.results = args.results or args.out
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  out = args.out
  cnn = load(os.path.join(args.results, CNN_FILE))
  lm = load(os.path.join(args.results, LM_FILE))
  rows = (accuracy_rows(cnn, args.acc_tolerance)
          + loss_rows(lm, args.loss_tolerance))
  table = format_table(rows)
  passed = all(r["passed"] for r in rows)
  summary = (f"{sum(r['passed'] for r in rows)} of {len(rows)} mixed-precision "
             "runs within tolerance of float32.")
  print(table)
  print(summary)
  with open(os.path.join(out, "parity.md"), "w") as f:
    f.write(
        "# Accuracy parity: float32 vs mixed precision\n\n"
        "Same model, initial parameters, batches and hyperparameters per "
        "row; only the policy (and the loss scale) changes. Written by "
        "`python -m examples.parity` from "
        f"[`{CNN_FILE}`]({CNN_FILE}) and [`{LM_FILE}`]({LM_FILE}). "
        "Parity is computed: |accuracy difference| <= "
        f"{args.acc_tolerance:g} points; |relative validation-loss "
        f"difference| <= {args.loss_tolerance:g}%.\n\n"
        f"{table}\n\n{summary}\n")
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main())
