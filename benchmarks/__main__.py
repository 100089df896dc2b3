"""Entry point: ``python -m benchmarks run [--suite cpu|gpu|all]``.

Writes ``<out>/cpu.json`` + ``<out>/cpu.md`` and/or ``<out>/gpu.json`` +
``<out>/gpu.md`` (a scratch folder by default; ``--update-results`` writes the
committed ``benchmarks/results/``). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="jmp_lite benchmark suite.")
  sub = parser.add_subparsers(dest="command", required=True)
  run = sub.add_parser("run", help="run a suite and write its JSON and markdown")
  run.add_argument("--suite", choices=("cpu", "gpu", "all"), default="cpu",
                   help="cpu: ratios and static figures (any machine); gpu: throughput, "
                   "memory and MFU (needs a CUDA GPU); all: both (default cpu)")
  common.add_output_args(run)
  run.add_argument("--quick", action="store_true",
                   help="CPU suite at tiny sizes with few repeats: a smoke test")
  run.add_argument("--repeats", type=int, default=None,
                   help="CPU suite: timed blocks per variant (default 31; 3 with --quick)")
  run.add_argument("--block-s", type=float, default=0.1,
                   help="CPU suite: target duration of a timed block in seconds (default 0.1)")
  run.add_argument("--compile-repeats", type=int, default=3,
                   help="CPU suite: compilations of the bf16 jmp_lite and autocast steps (default 3)")
  run.add_argument("--gpu-steps", type=int, default=20,
                   help="GPU suite: timed steps per case (default 20)")
  run.add_argument("--gpu-workloads", default="mlp,resnet,transformer",
                   help="GPU suite: comma-separated subset of mlp,resnet,transformer")
  run.add_argument("--no-torch", action="store_true",
                   help="GPU suite: skip the PyTorch side-by-side")
  run.add_argument("--seed", type=int, default=0)
  # Hidden: the GPU suite at tiny shapes on whatever backend there is (CPU),
  # in-process, to test its code paths without a GPU.
  run.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.repeats is None:
    args.repeats = 3 if args.quick else 31
  if args.repeats < 1 or args.compile_repeats < 1 or args.gpu_steps < 1:
    parser.error("--repeats, --compile-repeats and --gpu-steps must be >= 1")
  args.gpu_workloads = [w.strip() for w in args.gpu_workloads.split(",") if w.strip()]
  args.out = common.output_dir(args)
  return args


def run_suite(name: str, args, argv: list[str]) -> None:
  """Runs the ``cpu`` or ``gpu`` suite and writes ``<name>.json`` and ``<name>.md``."""
  if name == "cpu":
    from benchmarks import cpu_report as report_module
    from benchmarks import cpu_suite as suite
  else:
    from benchmarks import gpu_suite as suite
    report_module = suite

  report = suite.run(args)
  report["command"] = common.command_line("benchmarks", argv)
  report["date"] = common.utc_now()
  text = report_module.markdown(report)
  common.write_results(args.out, name, report, text)
  print(text)
  print(f"Wrote {args.out / (name + '.json')} and {args.out / (name + '.md')}.")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.suite in ("gpu", "all"):
    from benchmarks import gpu_suite
    problem = gpu_suite.check_gpu(args.dry_run)
    if problem:
      print(f"error: {problem}", file=sys.stderr)
      return 2
  for name in ("cpu", "gpu"):
    if args.suite in (name, "all"):
      run_suite(name, args, argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
