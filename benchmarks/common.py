"""Pieces shared by the benchmarks: train steps, compilation, timing, reporting.

Every benchmark here compares train steps that compute the same thing in
different ways. The steps share one state convention (a tuple, donated to
``jax.jit``), are compiled ahead of time with :func:`compile_step`, and are
timed with :func:`time_interleaved`: short blocks of steps of every variant in
turn, in one process, the order rotating each repeat, so that load from other
processes affects all variants alike. Ratios are the median of the per-repeat
ratios.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import platform
import re
import shlex
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

import jmp_lite

Params = Any
Batch = dict[str, jax.Array]
State = tuple[Any, ...]
Step = Callable[[State, Batch], tuple[State, jax.Array]]

#: The committed results, written only when a benchmark is given --update-results.
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
#: Where benchmarks write by default, so that running them leaves the clone
#: unchanged.
# "jmp-lite": a folder named like the package would shadow it (see
# examples/common.py).
SCRATCH_DIR = pathlib.Path(tempfile.gettempdir()) / "jmp-lite" / "benchmarks"


def add_output_args(parser) -> None:
  """Adds ``--out DIR`` and ``--update-results`` (mutually exclusive)."""
  group = parser.add_mutually_exclusive_group()
  group.add_argument(
      "--out", type=pathlib.Path, default=None,
      help=f"directory for the results (default: {SCRATCH_DIR}, a scratch folder)")
  group.add_argument(
      "--update-results", action="store_true",
      help="write into benchmarks/results/, replacing the committed results")


def output_dir(args) -> pathlib.Path:
  """The directory chosen by :func:`add_output_args`'s flags (not created)."""
  return RESULTS_DIR if args.update_results else (args.out or SCRATCH_DIR)


# --- train steps ---------------------------------------------------------------


def make_jmp_lite_step(loss_fn, opt: optax.GradientTransformation) -> Step:
  """The step written with the optimizer wrapper. State: (params, opt_state).

  ``opt`` is ``jmp_lite.loss_scaling(inner, loss_scale)``; the loss scale
  lives in its state.
  """

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state = state
    loss_scale = jmp_lite.get_loss_scale(opt_state)
    loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, loss_scale)(
        params, batch
    )
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def make_hand_step(loss_fn, inner: optax.GradientTransformation) -> Step:
  """The same step by hand, jmp style. State: (params, opt_state, loss_scale)."""

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state, loss_scale = state

    def scaled_loss(p):
      loss = loss_fn(p, batch)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    finite = jmp_lite.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = inner.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp_lite.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return (params, opt_state, loss_scale), loss

  return step


def make_plain_step(loss_fn, opt: optax.GradientTransformation) -> Step:
  """A step with no loss scaling: ``value_and_grad`` and ``opt.update``.

  With ``opt = optax.apply_if_finite(adam, n)`` this is optax's own way of
  skipping non-finite steps. State: (params, opt_state).
  """

  def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def fresh_copy(tree: Any) -> Any:
  """Copies every array leaf into a new buffer.

  The steps donate their state, so no two states may share a buffer: several
  variants start from the same ``params``, and the states must not alias the
  arrays of the loss scale the optimizer was built with.
  """
  return jax.tree_util.tree_map(
      lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree
  )


# --- compilation ------------------------------------------------------------------

_SKIP_OPCODES = {"parameter", "constant", "tuple", "get-tuple-element"}
_OPCODE = re.compile(r"=\s.*?\b([a-z][a-z0-9-]*)\(")


def entry_opcodes(hlo_text: str) -> dict[str, int]:
  """Counts the instructions of the optimized HLO's ENTRY computation by opcode.

  Parameters, constants and tuple plumbing are left out, so the total is about
  the number of kernels (fusions, dots, convolutions...) run per step.
  """
  counts: dict[str, int] = {}
  in_entry = False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
      continue
    if in_entry and line.startswith("}"):
      break
    if in_entry:
      match = _OPCODE.search(line)
      if match and match.group(1) not in _SKIP_OPCODES:
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
  return dict(sorted(counts.items()))


def compile_step(
    step: Step, state: State, batch: Batch, repeats: int = 1
) -> tuple[Any, dict[str, Any]]:
  """AOT-compiles ``step`` (state donated) and times lowering and compilation.

  Each repeat wraps a new function calling ``step`` in a fresh ``jax.jit``, so
  tracing, lowering and XLA compilation all run again (jitted library functions
  called inside ``step`` keep their trace caches after the first repeat); the
  reported times are medians over repeats.

  Returns:
    The compiled step of the last repeat and a dict of timings (seconds) and
    HLO statistics.
  """
  lower_s, compile_s = [], []
  for _ in range(repeats):
    # A new function object each time: jax.jit caches traces by function.
    fresh = functools.wraps(step)(lambda state, batch: step(state, batch))
    jitted = jax.jit(fresh, donate_argnums=0)
    start = time.perf_counter()
    lowered = jitted.lower(state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    lower_s.append(lowered_at - start)
    compile_s.append(compiled_at - lowered_at)
  ops = entry_opcodes(compiled.as_text())
  totals = [a + b for a, b in zip(lower_s, compile_s)]
  info = {
      "lower_s": float(np.median(lower_s)),
      "compile_s": float(np.median(compile_s)),
      "total_s": float(np.median(totals)),
      "total_s_values": [float(t) for t in totals],
      "stablehlo_ops": lowered.as_text().count(" = stablehlo."),
      "entry_kernels": sum(ops.values()),
      "entry_opcodes": ops,
  }
  return compiled, info


# --- timing -----------------------------------------------------------------------


def run_steps(fn: Step, state: State, batch: Batch, steps: int) -> tuple[State, list[jax.Array]]:
  losses = []
  for _ in range(steps):
    state, loss = fn(state, batch)
    losses.append(loss)
  return state, losses


def time_block(fn: Step, state: State, batch: Batch, steps: int) -> tuple[State, float, float]:
  """Runs ``steps`` steps and waits for them.

  Returns:
    The new state, the wall-clock seconds and the CPU seconds of this process
    (all its threads); the latter is less sensitive to other processes
    competing for the cores.
  """
  wall_start, cpu_start = time.perf_counter(), time.process_time()
  state, losses = run_steps(fn, state, batch, steps)
  jax.block_until_ready((state, losses))
  return state, time.perf_counter() - wall_start, time.process_time() - cpu_start


def time_interleaved(
    fns: dict[str, Step], states: dict[str, State], batch: Batch,
    steps: int, repeats: int, names: Sequence[str] | None = None,
) -> dict[str, dict[str, list[float]]]:
  """Per-step wall and CPU seconds per repeat, variants interleaved.

  Each repeat runs one block of ``steps`` steps of every variant; the order
  rotates by one each repeat (for two variants: alternates). ``states`` is
  updated in place with the final states.
  """
  names = list(fns if names is None else names)
  per_step = {clock: {name: [] for name in names} for clock in ("wall", "cpu")}
  for repeat in range(repeats):
    shift = repeat % len(names)
    for name in names[shift:] + names[:shift]:
      states[name], wall, cpu = time_block(fns[name], states[name], batch, steps)
      per_step["wall"][name].append(wall / steps)
      per_step["cpu"][name].append(cpu / steps)
  return per_step


def summarize(values: list[float]) -> dict[str, Any]:
  q25, median, q75 = np.percentile(values, [25, 50, 75])
  return {
      "median": float(median),
      "q25": float(q25),
      "q75": float(q75),
      "iqr": float(q75 - q25),
      "min": float(np.min(values)),
      "values": [float(v) for v in values],
  }


def ratio_summary(num: list[float], den: list[float]) -> dict[str, Any]:
  """Summary of the per-repeat ratios ``num[i] / den[i]``."""
  return summarize([a / b for a, b in zip(num, den)])


# --- reporting ----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
  device = jax.devices()[0]
  return {
      "platform": platform.platform(),
      "machine": platform.machine(),
      "processor": platform.processor(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "optax": optax.__version__,
      "numpy": np.__version__,
      "jmp_lite": jmp_lite.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def machine_line(machine: dict[str, Any]) -> str:
  """One markdown sentence naming the machine and the library versions."""
  return (
      f"Machine: {machine['device_kind']} ({machine['backend']} backend, "
      f"{machine['device_count']} device(s)), {machine['cpu_count']} CPU cores, "
      f"{machine['platform']}; Python {machine['python']}, jax {machine['jax']}, "
      f"jaxlib {machine['jaxlib']}, optax {machine['optax']}, "
      f"jmp_lite {machine['jmp_lite']}."
  )


def command_line(module: str, argv: Sequence[str]) -> str:
  return shlex.join(["python", "-m", module, *argv])


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def add_timing_args(parser, *, repeats: tuple[int, int],
                    steps: tuple[int, int] | None = None,
                    computes: Sequence[str] = ("f16", "bf16"),
                    seed: bool = True) -> None:
  """The flags the interleaved timing benchmarks share.

  ``--repeats`` (and ``--steps`` when ``steps`` is given): ``(default,
  default with --quick)``; ``--quick``; ``--computes``, a comma-separated
  subset of ``computes``; ``--seed`` (unless ``seed=False``); ``--out`` /
  ``--update-results``. :func:`finish_timing_args` completes them after
  parsing.
  """
  if steps is not None:
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per timed block (default {steps[0]}; "
                        f"{steps[1]} with --quick)")
  parser.add_argument("--repeats", type=int, default=None,
                      help=f"timed blocks per variant (default {repeats[0]}; "
                      f"{repeats[1]} with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes and few steps: a smoke test, not a measurement")
  parser.add_argument("--computes", default=",".join(computes),
                      help=f"comma-separated compute dtypes (default {','.join(computes)})")
  if seed:
    parser.add_argument("--seed", type=int, default=0,
                        help="PRNG seed for params and the synthetic batch (default 0)")
  add_output_args(parser)
  parser.set_defaults(_timing=dict(repeats=repeats, steps=steps,
                                   computes=tuple(computes)))


def finish_timing_args(parser, args) -> Any:
  """Fills the defaults :func:`add_timing_args` left open and checks the values."""
  timing = args._timing  # pylint: disable=protected-access
  quick = int(args.quick)
  if args.repeats is None:
    args.repeats = timing["repeats"][quick]
  if timing["steps"] is not None and args.steps is None:
    args.steps = timing["steps"][quick]
  if args.repeats < 1 or getattr(args, "steps", 1) < 1:
    parser.error("--steps and --repeats must be >= 1")
  args.computes = split_choices(parser, args.computes, timing["computes"],
                                "compute dtype")
  args.out = output_dir(args)
  return args


def split_choices(parser, value: str, choices: Sequence[str], what: str) -> list[str]:
  """A comma-separated flag value as a list, each item one of ``choices``."""
  items = [v.strip() for v in value.split(",") if v.strip()]
  for item in items:
    if item not in choices:
      parser.error(f"unknown {what} {item!r}; choose from {', '.join(choices)}")
  return items


def publish(name: str, argv: Sequence[str], out: pathlib.Path,
            config: dict[str, Any], measure: Callable[[], Any],
            markdown: Callable[[dict[str, Any]], str],
            summary: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
  """Runs ``measure()`` and writes, prints and returns its report.

  The report records what every committed figure needs: the command line,
  the date, the machine and versions, the load average before and after,
  the config, the results (plus ``summary(results)``) and the wall time; it is
  written as ``<out>/<name>.json`` and ``<out>/<name>.md`` (``markdown(report)``).
  """
  load_before = os.getloadavg()
  started = time.perf_counter()
  results = measure()
  report = {
      "benchmark": name,
      "command": command_line(f"benchmarks.{name}", argv),
      "date": utc_now(),
      "machine": machine_info(),
      "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
      "config": config,
      "results": results,
      **(summary(results) if summary else {}),
      "wall_s": time.perf_counter() - started,
  }
  text = markdown(report)
  write_results(out, name, report, text)
  print()
  print(text)
  print(f"Wrote {out / (name + '.json')} and {out / (name + '.md')} "
        f"({report['wall_s']:.0f} s).")
  return report


def report_header(title: str, report: dict[str, Any]) -> list[str]:
  """The opening lines of a :func:`publish` report's markdown: the title,
  the command and date, the machine and the load average."""
  load = report["load_average"]
  return [
      f"# {title}",
      "",
      f"Generated by `{report['command']}` on {report['date']} "
      f"({report['wall_s']:.0f} s).",
      "",
      machine_line(report["machine"])
      + f" Load average (1 min) before/after the run: {load['before'][0]:.2f}"
      f" / {load['after'][0]:.2f}.",
      "",
  ]


def write_results(out: pathlib.Path, name: str, report: dict[str, Any], markdown: str) -> None:
  """Writes ``<out>/<name>.json`` and ``<out>/<name>.md``."""
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
  (out / f"{name}.md").write_text(markdown)


def fmt(value: float | None, spec: str = ".3f") -> str:
  """Formats a number for a table; ``None`` (not measured) as an en dash."""
  return "–" if value is None else format(value, spec)


def yes_no(ok: bool | None) -> str:
  return "–" if ok is None else ("yes" if ok else "no")
