"""The skeleton every benchmark study shares: flags, check-then-time, publishing.

A study (``python -m benchmarks.<name>``) asks what one way of writing a train
step costs against another. It declares what is specific to it in a
:class:`Study` -- its workloads, how to measure one (its variants and its
equivalence criterion, through :func:`measure`), its table -- and this module
does the rest:

* :func:`add_flags` / :func:`finish_flags`: ``--repeats``, ``--steps`` (or
  ``--block-s``), ``--quick``, ``--computes``, ``--seed``, ``--out`` /
  ``--update-results`` and the study's own flags, each checked;
* :func:`measure`: compiles every variant ahead of time, runs the study's
  equivalence check and stops the script if the variants do not compute the
  same thing (timing them against each other would mean nothing), then times
  them in interleaved blocks, the order rotating each repeat, and reports the
  per-step medians and the median and interquartile range of the per-block
  ratios, from the wall clock and from the process's CPU time;
* :func:`publish`: ``<name>.json`` (command, date, machine and versions, load
  average, config, results) and ``<name>.md`` (:func:`header` and the
  study's table), in a scratch folder unless ``--update-results``.

The CPU suite is a study too (``python -m benchmarks run --suite cpu``); the
GPU suite uses :func:`publish` and :func:`check_then_time`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from benchmarks import common
from models import results as output

Check = Callable[[dict, dict, Any], tuple[dict, dict[str, Any]]]
#: A ratio: ``(numerator variant, denominator variant)``, or a dict of them.
RatioSpec = tuple[str, str] | dict[str, tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Study:
  """What is specific to one study; :func:`main` runs it.

  Attributes:
    name: the results' file stem (``<name>.json``, ``<name>.md``).
    title: the markdown page's title.
    description: one line for ``--help``.
    workloads: ``args -> [workload]``, what to measure.
    measure: ``(workload, args) -> dict``, one row of ``results``.
    table: ``report -> [markdown line]``, the page below :func:`header`.
    repeats: default ``--repeats``, without and with ``--quick``.
    steps: default ``--steps`` (steps per timed block), without and with
      ``--quick``; ``None``: blocks last about ``--block-s`` seconds instead.
    steps_help: the help of ``--steps``, where its default is not ``steps``.
    block_s: default ``--block-s`` when ``steps`` is ``None``.
    computes: the choices of ``--computes`` (the default: all); ``()``: no
      such flag.
    add_flags: ``parser -> None``, the study's own flags.
    finish_flags: ``(parser, args) -> None``, checks (and defaults) them;
      runs before the shared flags get their defaults.
    config: ``args -> dict``, the study's entries of ``report["config"]``.
    summary: ``(results, args) -> dict``, report entries computed from all
      the results (written next to ``results``).
    module: the module a command line names (default ``benchmarks.<name>``).
  """

  name: str
  title: str
  description: str
  workloads: Callable[[argparse.Namespace], Sequence[Any]]
  measure: Callable[[Any, argparse.Namespace], dict[str, Any]]
  table: Callable[[dict[str, Any]], list[str]]
  repeats: tuple[int, int] = (31, 3)
  steps: tuple[int, int] | None = None
  steps_help: str | None = None
  block_s: float = 0.1
  computes: tuple[str, ...] = ("f16", "bf16")
  add_flags: Callable[[argparse.ArgumentParser], None] | None = None
  finish_flags: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None
  config: Callable[[argparse.Namespace], dict[str, Any]] | None = None
  summary: Callable[[list, argparse.Namespace], dict[str, Any]] | None = None
  module: str | None = None


@dataclasses.dataclass(frozen=True)
class Timing:
  """How :func:`check_then_time` times: ``repeats`` blocks per variant of
  ``steps`` steps each, or (``steps=None``) of as many steps as last about
  ``block_s`` seconds (one step with ``quick``)."""

  repeats: int
  steps: int | None = None
  block_s: float = 0.1
  quick: bool = False

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> "Timing":
    return cls(args.repeats, getattr(args, "steps", None),
               getattr(args, "block_s", 0.1), args.quick)


# --- flags -----------------------------------------------------------------------


def add_flags(study: Study, parser: argparse.ArgumentParser) -> None:
  """Adds the shared flags and the study's own to ``parser``."""
  if study.steps is not None:
    parser.add_argument("--steps", type=int, default=None, help=study.steps_help or (
        f"steps per timed block (default {study.steps[0]}; {study.steps[1]} with --quick)"))
  else:
    parser.add_argument("--block-s", type=float, default=study.block_s,
                        help="target duration of a timed block in seconds "
                        f"(default {study.block_s:g}; one step with --quick)")
  parser.add_argument("--repeats", type=int, default=None,
                      help=f"timed blocks per variant (default {study.repeats[0]}; "
                      f"{study.repeats[1]} with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes and few steps: a smoke test, not a measurement")
  if study.computes:
    parser.add_argument("--computes", default=",".join(study.computes),
                        help="comma-separated compute dtypes (default "
                        f"{','.join(study.computes)})")
  parser.add_argument("--seed", type=int, default=0,
                      help="PRNG seed for params and the synthetic batch (default 0)")
  common.OUTPUTS.add_args(parser)
  if study.add_flags:
    study.add_flags(parser)


def finish_flags(study: Study, parser: argparse.ArgumentParser,
                 args: argparse.Namespace) -> argparse.Namespace:
  """Checks the flags of :func:`add_flags`, fills the defaults left open and
  chooses (and creates) the output folder; a bad value exits with a usage
  error naming the flag."""
  if study.finish_flags:
    study.finish_flags(parser, args)
  quick = int(args.quick)
  if args.repeats is None:
    args.repeats = study.repeats[quick]
  if study.steps is not None and args.steps is None:
    args.steps = study.steps[quick]
  for flag in ("repeats", "steps"):
    if getattr(args, flag, 1) < 1:
      parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
  if study.steps is None and not (args.block_s > 0 and math.isfinite(args.block_s)):
    parser.error(f"--block-s must be a positive number of seconds, got {args.block_s}")
  if study.computes:
    args.computes = split_choices(parser, "--computes", args.computes, study.computes)
  args.out = common.OUTPUTS.folder(args)
  return args


def split_choices(parser: argparse.ArgumentParser, flag: str, value: str,
                  choices: Sequence[str]) -> list[str]:
  """A comma-separated flag value as a list, each item one of ``choices``."""
  items = [v.strip() for v in value.split(",") if v.strip()]
  unknown = [v for v in items if v not in choices]
  if unknown or not items:
    parser.error(f"{flag}: {', '.join(map(repr, unknown)) or 'nothing'} given; "
                 f"choose a comma-separated subset of {','.join(choices)}")
  return items


# --- check, then time --------------------------------------------------------------


def run_all(fns: dict, states: dict, batch: Any, steps: int) -> tuple[dict, dict]:
  """Runs every variant ``steps`` steps; returns the states and the losses
  (floats), by variant."""
  losses = {}
  for name in fns:
    states[name], out = common.run_steps(fns[name], states[name], batch, steps)
    losses[name] = [float(x) for x in jax.device_get(out)]
  return states, losses


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest ``|a - b|`` over the leaves of two trees of the same structure."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def allclose(a: Any, b: Any, rtol: float, atol: float) -> bool:
  """Whether two trees of the same structure agree leaf by leaf within
  ``rtol`` / ``atol`` (``np.allclose``)."""
  return all(np.allclose(x, y, rtol=rtol, atol=atol)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def measure(label: str, steps: dict[str, common.Step], states: dict[str, Any],
            batch: Any, timing: Timing, *, check: Check, ratios: dict[str, RatioSpec],
            inspect: Callable[[dict], dict] | None = None) -> dict[str, Any]:
  """Compiles, checks and times the variants ``steps`` of one workload.

  Args:
    label: names the workload in the printed lines and the error.
    steps: the variants' step functions, in timing order.
    states: their initial states (donated: no two may share a buffer).
    batch: the batch every step trains on.
    timing: blocks and repeats.
    check: ``(compiled fns, states, batch) -> (states, verdict)``, the
      study's equivalence criterion; ``verdict["same"]`` says whether the
      variants compute the same thing. Its steps double as warm-up.
    ratios: ``{key: (numerator, denominator)}`` (or a dict of such pairs):
      the per-block ratios to report as ``result[key]`` (wall clock) and
      ``result["cpu_" + key]`` (CPU time).
    inspect: ``compiled fns -> dict``, more figures of the compiled programs.

  Returns:
    ``compile`` (per variant: lowering and compile times, HLO kernels),
    ``check``, ``steps_per_block``, ``step_time_s`` and ``cpu_time_s`` (per
    variant: :func:`common.summarize` of the per-step times) and the ratios.

  Raises:
    SystemExit: if the check finds that the variants differ.
  """
  fns, compiled = {}, {}
  for name in steps:
    fns[name], compiled[name] = common.compile_step(steps[name], states[name], batch)
  result = {"compile": compiled, **(inspect(fns) if inspect else {})}
  result.update(check_then_time(label, fns, states, batch, timing, check=check,
                                ratios=ratios))
  return result


def check_then_time(label: str, fns: dict, states: dict, batch: Any, timing: Timing, *,
                    check: Check, ratios: dict[str, RatioSpec],
                    stop: bool = True) -> dict[str, Any]:
  """:func:`measure` for steps compiled already; with ``stop=False`` a failed
  check returns the verdict untimed instead of ending the script."""
  states, verdict = check(fns, states, batch)
  print(f"[{label}] check: {json.dumps(verdict, default=str)}", flush=True)
  if not verdict["same"]:
    if not stop:
      return {"check": verdict}
    raise SystemExit(
        f"{label}: the variants do not compute the same thing ({verdict}); "
        "timing them against each other would be meaningless.")
  steps = timing.steps or _steps_per_block(fns, states, batch, timing)
  per_step = common.time_interleaved(fns, states, batch, steps, timing.repeats)
  result = {"check": verdict, "steps_per_block": steps}
  for clock, key in (("wall", "step_time_s"), ("cpu", "cpu_time_s")):
    result[key] = {name: common.summarize(t) for name, t in per_step[clock].items()}
  for key, spec in ratios.items():
    result[key] = _ratios(per_step["wall"], spec)
    result["cpu_" + key] = _ratios(per_step["cpu"], spec)
  medians = {name: s["median"] for name, s in result["step_time_s"].items()}
  print(f"[{label}] ms/step: "
        + ", ".join(f"{name} {t * 1e3:.3f}" for name, t in medians.items())
        + "; ratios: " + ", ".join(f"{key} {value:.4f}" for key, value in
                                    _flat_medians(result, ratios)), flush=True)
  return result


def _steps_per_block(fns: dict, states: dict, batch: Any, timing: Timing) -> int:
  """Steps per block so that a block of the first variant lasts ``block_s``."""
  if timing.quick:
    return 1
  name = next(iter(fns))
  states[name], wall, _ = common.time_block(fns[name], states[name], batch, 2)
  return int(np.clip(round(timing.block_s / (wall / 2)), 1, 64))


def _ratios(times: dict[str, list[float]], spec: RatioSpec) -> dict[str, Any]:
  if isinstance(spec, dict):
    return {name: _ratios(times, pair) for name, pair in spec.items()}
  num, den = spec
  return common.ratio_summary(times[num], times[den])


def _flat_medians(result: dict, ratios: dict[str, RatioSpec]):
  for key, spec in ratios.items():
    if isinstance(spec, dict):
      yield from ((f"{key}[{name}]", r["median"]) for name, r in result[key].items())
    else:
      yield key, result[key]["median"]


# --- publishing ----------------------------------------------------------------------


def publish(name: str, module: str, argv: Sequence[str], out: pathlib.Path,
            config: dict[str, Any], measure_all: Callable[[], dict[str, Any]],
            markdown: Callable[[dict[str, Any]], str],
            finish: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
  """Runs ``measure_all()`` and writes, prints and returns its report.

  The report holds what every committed figure needs: the command line, the
  date, the machine and versions, the load average before and after, the
  config, what ``measure_all()`` returns (``results`` and any other entries)
  and the wall time; ``finish(report)`` may merge it with an earlier one
  before it is written as ``<out>/<name>.json`` and ``<out>/<name>.md``
  (``markdown(report)``).
  """
  load_before = os.getloadavg()
  started = time.perf_counter()
  measured = measure_all()
  report = {
      "benchmark": name,
      "command": output.command_line(module, argv),
      "date": output.utc_now(),
      "machine": output.machine_info(),
      "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
      "config": config,
      **measured,
      "wall_s": time.perf_counter() - started,
  }
  if finish:
    report = finish(report)
  text = markdown(report)
  out.mkdir(parents=True, exist_ok=True)
  output.write_json(out / f"{name}.json", report)
  (out / f"{name}.md").write_text(text)
  print()
  print(text)
  print(f"Wrote {out / (name + '.json')} and {out / (name + '.md')} "
        f"({report['wall_s']:.0f} s).")
  return report


def header(title: str, report: dict[str, Any]) -> list[str]:
  """The opening lines of a page: the title, the command and date, the
  machine, the versions and the load average."""
  load = report["load_average"]
  lines = [
      f"# {title}",
      "",
      f"Generated by `{report['command']}` on {report['date']} "
      f"({report['wall_s']:.0f} s).",
      "",
      output.machine_line(report["machine"])
      + f" Load average (1 min) before/after the run: {load['before'][0]:.2f}"
      f" / {load['after'][0]:.2f}.",
      "",
  ]
  if report["config"].get("quick"):
    lines += ["**`--quick`: tiny shapes, a smoke test; these figures mean nothing.**", ""]
  return lines


def method(config: dict[str, Any], baseline: str, unit: str = "steps") -> str:
  """The paragraph saying how the step times and ratios were measured."""
  block = (f"{config['steps']} {unit}" if config.get("steps")
           else f"about {config['block_s']:g} s")
  return (f"Per-step time: median over {config['repeats']} blocks of {block}, "
          "the variants interleaved in one process, the order rotating each "
          f"repeat. Ratios: median of the per-block ratios {baseline}, with the "
          "interquartile range; the CPU-time ratio is the same from the "
          "process's CPU time, less sensitive to other processes.")


def ratio_cell(r: dict[str, Any]) -> str:
  """``median (q25-q75)`` of a ratio summary."""
  return f"{r['median']:.3f} ({r['q25']:.3f}-{r['q75']:.3f})"


def fmt(value: float | None, spec: str = ".3f") -> str:
  """Formats a number for a table; ``None`` (not measured) as an en dash."""
  return "–" if value is None else format(value, spec)


def yes_no(ok: bool | None) -> str:
  return "–" if ok is None else ("yes" if ok else "no")


# --- running a study -------------------------------------------------------------------


def run(study: Study, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
  """Measures every workload of ``study`` and publishes the report."""
  timing = {"steps": args.steps} if study.steps else {"block_s": args.block_s}
  config = {"quick": args.quick, "repeats": args.repeats, **timing, "seed": args.seed,
            "learning_rate": common.LEARNING_RATE,
            "initial_loss_scale": common.INITIAL_SCALE,
            **(study.config(args) if study.config else {})}

  def measure_all() -> dict[str, Any]:
    results = [study.measure(w, args) for w in study.workloads(args)]
    return {"results": results, **(study.summary(results, args) if study.summary else {})}

  return publish(
      study.name, study.module or f"benchmarks.{study.name}", argv, args.out, config,
      measure_all, lambda report: "\n".join(header(study.title, report) + study.table(report)))


def main(study: Study, argv: Sequence[str] | None = None) -> int:
  """``python -m benchmarks.<study>``: parses the flags and runs the study."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(prog=f"python -m {study.module or 'benchmarks.' + study.name}",
                                   description=study.description)
  add_flags(study, parser)
  run(study, finish_flags(study, parser, parser.parse_args(argv)), argv)
  return 0
