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
  from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="jmp_lite benchmark suite.")
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("check", help="the suites' consistency checks (peak table, "
                 "PyTorch vs JAX model parameters); exits 1 on a failure")
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
  run.add_argument("--gpu-libraries", default=",".join(gpu_suite.LIBRARIES),
                   help="GPU suite: comma-separated subset of jax,torch (default both; "
                   "torch runs only where PyTorch sees a CUDA device)")
  run.add_argument("--gpu-modes", default=",".join(gpu_suite.MODES),
                   help="GPU suite: comma-separated subset of f32,tf32,bf16,f16")
  run.add_argument("--no-torch", action="store_true",
                   help="GPU suite: skip the PyTorch side-by-side (same as --gpu-libraries jax)")
  run.add_argument("--gpu-budget-s", type=float, default=gpu_suite.DEFAULT_BUDGET_S,
                   help="GPU suite: total time budget in seconds; a case gets at most what "
                   "is left, and cases that would start after it are reported as not run "
                   f"(default {gpu_suite.DEFAULT_BUDGET_S:g}: a command stays under 10 minutes)")
  run.add_argument("--gpu-case-timeout-s", type=float, default=gpu_suite.DEFAULT_CASE_TIMEOUT_S,
                   help="GPU suite: a case (one subprocess) is killed and reported as timed "
                   f"out after this many seconds (default {gpu_suite.DEFAULT_CASE_TIMEOUT_S:g})")
  run.add_argument("--seed", type=int, default=0)
  # Hidden: the GPU suite at tiny shapes on whatever backend there is (CPU),
  # in-process, to test its code paths without a GPU; --gpu-subprocess runs
  # its cases in subprocesses as on a GPU.
  run.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
  run.add_argument("--gpu-subprocess", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.command == "check":
    return args
  if args.repeats is None:
    args.repeats = 3 if args.quick else 31
  if args.repeats < 1 or args.compile_repeats < 1 or args.gpu_steps < 1:
    parser.error("--repeats, --compile-repeats and --gpu-steps must be >= 1")
  _parse_gpu_args(parser, args, gpu_suite)
  args.out = common.output_dir(args)
  return args


def _parse_gpu_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    gpu_suite) -> None:
  """Splits and checks the GPU suite's comma-separated lists."""
  choices = {"--gpu-workloads": gpu_suite.wl.NAMES, "--gpu-libraries": gpu_suite.LIBRARIES,
             "--gpu-modes": gpu_suite.MODES}
  for flag, allowed in choices.items():
    attr = flag[2:].replace("-", "_")
    values = [v.strip() for v in getattr(args, attr).split(",") if v.strip()]
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
      parser.error(f"{flag}: {', '.join(map(repr, unknown)) or 'nothing'} given; "
                   f"choose a comma-separated subset of {','.join(allowed)}")
    setattr(args, attr, values)
  if args.no_torch:
    args.gpu_libraries = [lib for lib in args.gpu_libraries if lib != "torch"]
    if not args.gpu_libraries:
      parser.error("--no-torch with --gpu-libraries torch leaves nothing to run")
  if args.gpu_budget_s < 0 or args.gpu_case_timeout_s <= 0:
    parser.error("--gpu-budget-s must be >= 0 and --gpu-case-timeout-s > 0")


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
  if name == "gpu":
    # Split runs (--gpu-workloads, --gpu-libraries, --gpu-modes) add up.
    report = suite.merge_previous(report, args.out)
  text = report_module.markdown(report)
  common.write_results(args.out, name, report, text)
  print(text)
  print(f"Wrote {args.out / (name + '.json')} and {args.out / (name + '.md')}.")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.command == "check":
    from benchmarks import gpu_suite  # pylint: disable=import-outside-toplevel
    problems = gpu_suite.self_check()
    print("\n".join(problems) or "All benchmark consistency checks passed.")
    return 1 if problems else 0
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
