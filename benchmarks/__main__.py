"""Entry point: ``python -m benchmarks run [--suite cpu|gpu|all]``.

Writes ``<out>/cpu.json`` + ``<out>/cpu.md`` and/or ``<out>/gpu.json`` +
``<out>/gpu.md`` (a scratch folder by default; ``--update-results`` writes the
committed ``benchmarks/results/``). The studies run on their own:
``python -m benchmarks.<study>``. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import cpu_suite
from benchmarks import gpu_suite
from benchmarks import runner


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                   description="jmp_lite benchmark suites.")
  sub = parser.add_subparsers(dest="command", required=True)
  run = sub.add_parser("run", help="run a suite and write its JSON and markdown")
  run.add_argument("--suite", choices=("cpu", "gpu", "all"), default="cpu",
                   help="cpu: ratios and static figures (any machine); gpu: throughput, "
                   "memory and MFU (needs a CUDA GPU); all: both (default cpu)")
  runner.add_flags(cpu_suite.STUDY, run)
  gpu_suite.add_flags(run)
  args = parser.parse_args(argv)
  gpu_suite.finish_flags(run, args)
  return runner.finish_flags(cpu_suite.STUDY, run, args)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.suite in ("gpu", "all"):
    problem = gpu_suite.check_gpu(args.dry_run)
    if problem:
      print(f"error: {problem}", file=sys.stderr)
      return 2
  if args.suite in ("cpu", "all"):
    runner.run(cpu_suite.STUDY, args, argv)
  if args.suite in ("gpu", "all"):
    gpu_suite.run(args, argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
