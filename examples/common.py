"""Helpers shared by the examples: data, step bookkeeping, reports, plots.

Nothing here is about precision: the training steps and the mixed-precision
lines (marked ``# [mixed precision]``) stay in each example. The examples run
as modules from the repository root (``python -m examples.digits_demo``) and
import this one as ``from examples import common``.

* :data:`RESULTS_DIR`, :data:`SCRATCH_DIR`, :func:`add_output_args`,
  :func:`output_dir`: where results go (a scratch folder unless
  ``--update-results`` asks for the committed ``examples/results/``), with
  :func:`write_json` the output plumbing of :mod:`models.results`, which the
  benchmarks share.
* :data:`SMOOTHING`,
  :data:`ACCURACY_TOLERANCE`, :data:`LINE_STYLES`: settings the examples share.
* :func:`flax_run_specs`: the f32 / bf16 / f16 + loss scaling runs of the Flax
  examples.
* :func:`cross_entropy`, :func:`make_eval_fn`: the loss and the evaluation
  of the digits classifiers.
* :func:`batch_indices`: seeded, reshuffled-epoch batches.
* :class:`StepLog`: per-step loss, loss scale, skipped steps and step times.
* :func:`moving_average`: the smoothing of the loss plots.
* :func:`loss_and_scale_axes`, :func:`style_loss_axis`,
  :func:`plot_loss_scale_steps`, :func:`plot_loss_and_scale`,
  :func:`save_figure`: pieces of the figures.
* :func:`format_scale`, :func:`command_line`, :func:`write_markdown`: the
  written results.
* :func:`check_at_least_one`, :func:`check_positive_finite`: flag validation.
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")  # Write image files only; never open a window.
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
from models import results  # noqa: E402

#: The committed results, written only when a script is given --update-results.
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
#: Where the scripts write by default, so that running them leaves the clone
#: unchanged.
SCRATCH_DIR = results.scratch_dir("examples")
_OUTPUTS = results.Outputs(committed=RESULTS_DIR, scratch=SCRATCH_DIR)
#: ``--out DIR`` and ``--update-results`` (mutually exclusive).
add_output_args = _OUTPUTS.add_args
#: The folder chosen by :func:`add_output_args`'s flags, created.
output_dir = _OUTPUTS.folder
#: Writes JSON with 6 significant digits, lists of numbers on one line.
write_json = results.write_json

SMOOTHING = 25  # Window of the moving average in the loss plot.
ACCURACY_TOLERANCE = 1.0  # Points of test accuracy that count as "matching".
# Runs that train overlap in the loss plot: dashes tell them apart.
LINE_STYLES = (
    dict(color="tab:blue", linewidth=3, alpha=0.6),
    dict(color="tab:orange", linestyle="--"),
    dict(color="tab:green", linestyle=":", linewidth=2),
    dict(color="tab:red"),
)


# -- runs and data -------------------------------------------------------------


def flax_run_specs(period: int):
  """``(name, label, policy spec, initial loss scale)``, f32 (reference) first.

  The three runs of the Flax examples: f32, bf16, and f16 with dynamic loss
  scaling; params and outputs stay in float32.

  Args:
    period: growth period of the dynamic loss scale, in steps.
  """
  return (
      ("f32", "f32", "p=f32,c=f32,o=f32", jmp_lite.NoOpLossScale()),
      ("bf16", "bf16", "p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale()),
      ("f16_scaled", "f16 + dynamic loss scaling", "p=f32,c=f16,o=f32",
       jmp_lite.DynamicLossScale(2.0**15, period=period)),
  )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy, in the dtype of ``logits`` (float32 here)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_eval_fn(apply_fn):
  """Builds a jitted ``evaluate(params, x, y) -> (accuracy, cross_entropy)``."""

  @jax.jit
  def evaluate(params, x, y):
    logits = apply_fn({"params": params}, x)
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return accuracy, cross_entropy(logits, y)

  return evaluate


def batch_indices(num_examples: int, batch_size: int, steps: int, seed: int):
  """Yields the indices of each step's batch, from reshuffled epochs.

  The same seed gives every run exactly the same batches.
  """
  rng = np.random.default_rng(seed)
  order = np.array([], dtype=np.int64)
  for _ in range(steps):
    if len(order) < batch_size:
      order = np.concatenate([order, rng.permutation(num_examples)])
    yield order[:batch_size]
    order = order[batch_size:]


# -- per-step bookkeeping ------------------------------------------------------


class StepLog:
  """Per-step figures of one training run.

  Attributes:
    losses: the loss of each step.
    scales: the loss scale each step used.
    skipped_at: the steps whose update was skipped (non-finite gradients).
    step_ms: the wall time of each step, in milliseconds.
  """

  def __init__(self):
    self.losses, self.scales, self.skipped_at, self.step_ms = [], [], [], []

  def record(self, step: int, start: float, metrics, loss_key: str = "loss"):
    """Records one step that began at ``start`` (``time.perf_counter()``).

    Args:
      step: the step's index.
      start: when the step began; it ends now.
      metrics: the step's metrics, on the host: ``loss_key``, ``loss_scale``
        and ``finite``.
      loss_key: the key of the loss in ``metrics``.
    """
    self.step_ms.append(1e3 * (time.perf_counter() - start))
    self.losses.append(float(metrics[loss_key]))
    self.scales.append(float(metrics["loss_scale"]))
    if not metrics["finite"]:
      self.skipped_at.append(step)

  def median_step_ms(self, warmup: int) -> float:
    """Median step time, leaving out the first ``warmup`` steps (compilation)
    when there are more."""
    return float(np.median(self.step_ms[warmup:] or self.step_ms))

  def histories(self) -> dict[str, list]:
    """``loss_history``, ``loss_scale_history`` and ``skipped_at``."""
    return dict(loss_history=self.losses, loss_scale_history=self.scales,
                skipped_at=self.skipped_at)


# -- figures -------------------------------------------------------------------


def moving_average(values, window: int) -> np.ndarray:
  """Trailing moving average over the finite values (NaN where none)."""
  values = np.asarray(values, dtype=np.float64)
  out = np.full_like(values, np.nan)
  for i in range(len(values)):
    chunk = values[max(0, i - window + 1):i + 1]
    chunk = chunk[np.isfinite(chunk)]
    if chunk.size:
      out[i] = chunk.mean()
  return out


def style_loss_axis(ax, ylabel: str, title: str) -> None:
  """Log scale, labels, title, grid and legend of a loss-curve axis."""
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()


def plot_loss_scale_steps(ax, run: dict, color: str,
                          fit_ylim: bool = False) -> None:
  """The loss scale of ``run`` as a step plot, with its skipped steps.

  Args:
    ax: the axis to draw on.
    run: a run's figures (``label``, ``loss_scale_history``, ``skipped_at``).
    color: the color of the loss-scale line.
    fit_ylim: whether to fit the y range to the loss scale, one octave apart.
  """
  log2_scale = np.log2(run["loss_scale_history"])
  ax.step(np.arange(len(log2_scale)), log2_scale, where="post",
          color=color, label="loss scale used by the step")
  skipped = run["skipped_at"]
  ax.plot(skipped, log2_scale[skipped], "x", color="tab:red",
          markersize=8, label=f"skipped steps ({len(skipped)})")
  if "final_loss_scale" in run:
    # The scale after the last step (the tables' "final loss scale"); the
    # curve shows the scale each step used.
    final = np.log2(run["final_loss_scale"])
    ax.plot([len(log2_scale)], [final], "o", color=color,
            label=f"after the last step: 2^{final:g}")
    log2_scale = np.append(log2_scale, final)
  ax.set_xlabel("step")
  ax.set_ylabel("log2(loss scale)")
  if fit_ylim:
    ax.set_ylim(log2_scale.min() - 1, log2_scale.max() + 1)
  ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.set_title(f"{run['label']}: loss scale")
  ax.grid(True, alpha=0.3)
  ax.legend()


def loss_and_scale_axes(figsize):
  """A new figure of two side-by-side axes: ``fig, (ax_loss, ax_scale)``."""
  return plt.subplots(1, 2, figsize=figsize)


def save_figure(fig, path: str, dpi: int) -> None:
  """Lays out ``fig``, writes it to ``path`` and closes it."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)


def plot_loss_and_scale(runs: dict, path: str, smoothing: int,
                        loss_ylabel: str, loss_title: str,
                        log_loss: bool = False) -> None:
  """Loss curves of every run and the f16 run's loss scale, as a PNG.

  The figure of the Flax examples: ``runs`` holds the f32, bf16 and
  ``f16_scaled`` runs' figures.

  Args:
    runs: each run's figures, by name.
    path: where to write the PNG.
    smoothing: window of the loss curves' moving average.
    loss_ylabel: y label of the loss plot.
    loss_title: title of the loss plot.
    log_loss: whether the loss axis is logarithmic.
  """
  fig, (ax_loss, ax_scale) = loss_and_scale_axes(figsize=(11, 4))
  styles = ({"linewidth": 3, "alpha": 0.6}, {"linestyle": "--"},
            {"linestyle": ":", "linewidth": 2})
  for (r, style) in zip(runs.values(), styles):
    ax_loss.plot(moving_average(r["loss_history"], smoothing),
                 label=r["label"], **style)
  ax_loss.set(xlabel="step", ylabel=loss_ylabel,
              **({"yscale": "log"} if log_loss else {}), title=loss_title)
  ax_loss.legend()
  scaled = runs["f16_scaled"]
  ax_scale.plot(np.log2(scaled["loss_scale_history"]), color="tab:green")
  if scaled["skipped_at"]:
    ax_scale.plot(scaled["skipped_at"],
                  np.log2(np.asarray(scaled["loss_scale_history"]))[
                      scaled["skipped_at"]], "rx", label="skipped step")
    ax_scale.legend()
  ax_scale.set(xlabel="step", ylabel="log2(loss scale)",
               title="f16 dynamic loss scale")
  ax_scale.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  save_figure(fig, path, dpi=100)


# -- written results -----------------------------------------------------------


def format_scale(value: float) -> str:
  """Formats a loss scale: ``2^15`` for powers of two above 1, else ``%g``."""
  exponent = math.log2(value) if value > 0 else 0.5
  if exponent >= 1 and exponent == int(exponent):
    return f"2^{int(exponent)}"
  return f"{value:g}"


def command_line(name: str, config: dict[str, Any]) -> str:
  """``python -m examples.<name> --flag value ...``, the flags in ``config``."""
  flags = [x for k, v in config.items() for x in (f"--{k.replace('_', '-')}", v)]
  return results.command_line(f"examples.{name}", flags)


def write_markdown(path: str, title: str, report: list[str], command: str,
                   image: str) -> None:
  """Writes the markdown results: title, report paragraphs, command, figure."""
  with open(path, "w") as f:
    f.write(f"# {title}\n\n")
    f.write("\n\n".join(report) + "\n\n")
    f.write(f"Command: `{command}` (jax {jax.__version__}, "
            f"{jax.default_backend()} backend).\n\n")
    f.write(f"![loss curves and loss scale]({image})\n")


# -- flags ---------------------------------------------------------------------


def check_at_least_one(parser, args, names) -> None:
  """Exits with a usage error unless every flag in ``names`` is at least 1."""
  for name in names:
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")


def check_positive_finite(parser, args, names) -> None:
  """Exits with a usage error unless every flag in ``names`` is positive and
  finite."""
  for name in names:
    value = getattr(args, name)
    if not (value > 0 and math.isfinite(value)):
      parser.error(f"--{name.replace('_', '-')} must be positive and finite")
