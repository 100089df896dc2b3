"""Host-side diagnostics: advice, table, histogram plot and report.

:class:`Advice` and :func:`advise_half` (a static loss scale, float16 or
bfloat16, what to keep in float32: what the public ``advise`` does with
half-precision statistics) and :func:`report`, the one call that prints the
tables and the advice and writes the plot. They read statistics from
:mod:`jmp_lite._src.diagnostics.stats` on the host; matplotlib is imported
only when a plot is drawn. Guide: ``docs/diagnostics.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Any, Mapping, TextIO

import jax
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src.diagnostics.stats import BF16_MAX
from jmp_lite._src.diagnostics.stats import combine_stats
from jmp_lite._src.diagnostics.stats import F16_MAX
from jmp_lite._src.diagnostics.stats import group_stats
from jmp_lite._src.diagnostics.stats import host_stats
from jmp_lite._src.diagnostics.stats import is_stats
from jmp_lite._src.diagnostics.stats import tensor_stats
from jmp_lite._src.diagnostics.stats import TensorStats

_EXPONENTS = TensorStats.HISTOGRAM_EXPONENTS


# -- reading statistics on the host ---------------------------------------------


#: What to do with float8 statistics given to the half-precision advice.
FP8_STATS_GIVEN = (
    "report, format_table, plot_histograms and advise's activation_stats "
    "read half-precision statistics (diagnostics.tensor_stats); these are "
    "float8 statistics (diagnostics.fp8_stats): give them to "
    "diagnostics.advise as its first argument (every role in one tree), "
    "whose result prints its own table.")


def _as_stats(tree: Any) -> Any:
  """A tree of statistics as it is, or the statistics of a tree of arrays."""
  leaves = jax.tree.leaves(tree, is_leaf=is_stats)
  if any(not isinstance(leaf, TensorStats) and is_stats(leaf)
         for leaf in leaves):
    raise TypeError(FP8_STATS_GIVEN)
  if any(isinstance(leaf, TensorStats) for leaf in leaves):
    return tree
  return tensor_stats(tree)


def _host_named(tree: Any, by: Any, what: str) -> dict[str, TensorStats]:
  """``{name: TensorStats of numpy values}`` of a tree of stats or arrays."""
  grouped = group_stats(_as_stats(tree), by)
  host_stats(grouped, what)
  return {name: TensorStats(*(np.asarray(v) for v in s))
          for name, s in jax.device_get(grouped).items()}


def _bin_portions(exp: float, shift: float) -> np.ndarray:
  """Share of each binade of ``|x| * s0`` that falls below ``2**exp`` once
  multiplied by ``2**shift``: 0 or 1 when ``shift`` is an integer, linear in
  log2 within the one binade that straddles the threshold otherwise."""
  low = _EXPONENTS + shift
  return np.clip(exp - low, 0.0, 1.0)


def _count_below(stats: TensorStats, exp: float, scale: float) -> float:
  """Entries with ``|x| * scale < 2**exp``, from the histogram (measured at
  ``stats.loss_scale``): exact when ``scale / stats.loss_scale`` is a power of
  two, interpolated within one binade otherwise."""
  shift = math.log2(scale) - math.log2(float(stats.loss_scale))
  return float(np.sum(stats.histogram * _bin_portions(exp, shift)))


def _format_pow2(value: float) -> str:
  exponent = math.log2(value) if value > 0 else 0.5
  if exponent == int(exponent) and abs(exponent) >= 1:
    return f"2^{int(exponent)}"
  return f"{value:g}"


def _format_percent(share: float) -> str:
  if share == 0:
    return "0"
  if share < 0.001:
    return "<0.1"
  if share > 0.999 and share < 1:
    return ">99.9"
  return f"{100 * share:.1f}"


_TABLE_COLUMNS = (
    ("zeros", "zero"),
    ("f16_underflow", "f16 underflow (<2^-24)"),
    ("f16_subnormal", "f16 subnormal (<2^-14)"),
    ("f16_overflow", "f16 overflow (>65504)"),
    ("bf16_underflow", "bf16 underflow (<2^-133)"),
    ("bf16_overflow", "bf16 overflow"),
    ("nonfinite", "inf/nan"),
)


def _table(named: Mapping[str, TensorStats], first: str) -> str:
  lines = [
      f"| {first} | entries | max abs | loss scale | "
      + " | ".join(f"{title} %" for _, title in _TABLE_COLUMNS) + " |",
      "|---|--:|--:|--:|" + "--:|" * len(_TABLE_COLUMNS),
  ]
  rows = list(named.items())
  if len(rows) > 1:
    rows.append(("all", combine_stats(list(named.values()))))
  for name, s in rows:
    s = TensorStats(*(np.asarray(v) for v in s))
    cells = [name, f"{int(s.size):,}", f"{float(s.max_abs):.3g}",
             _format_pow2(float(s.loss_scale))]
    cells += [_format_percent(s.fraction(field)) for field, _ in _TABLE_COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def format_table(stats: Any, *, by: Any = None, title: str = "leaf") -> str:
  """The statistics as a markdown table, one row per leaf or group and a
  last row ``all`` (what :func:`report` prints).

  Columns: entries, largest ``|x|`` (without the loss scale), the loss scale
  of the measurement, then the share (%) of entries that are zero, underflow
  float16, are float16-subnormal, overflow float16, underflow or overflow
  bfloat16, and are inf/NaN; ``<0.1`` marks a share small but not zero.

  Args:
    stats: a tree of :class:`TensorStats`, or a tree of arrays (measured at
      loss scale 1).
    by: grouping, as in :func:`group_stats`.
    title: the header of the first column.

  Returns:
    The table; a one-line note for a tree without floating leaves.
  """
  named = _host_named(stats, by, "format_table")
  if not named:
    return "(no floating-point leaves)"
  return _table(named, title)


# -- advice ----------------------------------------------------------------------

#: The default headroom of :func:`advise`: the recommended loss scale keeps the
#: largest scaled gradient at least this factor below float16's max (65504).
DEFAULT_HEADROOM = 8.0


@dataclasses.dataclass(frozen=True)
class Advice:
  """What :func:`advise` recommends, with the figures behind it.

  ``str(advice)`` (what :func:`report` prints) is a small table and the
  reasons. ``docs/diagnostics.md`` (advice) explains the rule.

  Attributes:
    dtype: ``"float16"`` or ``"bfloat16"``; ``None`` when the gradients hold
      no nonzero finite entry (nothing to measure).
    loss_scale: the static loss scale to use with ``dtype``: the float16 scale
      below for float16, 1.0 for bfloat16 (it has float32's range: no loss
      scaling needed); ``None`` with ``dtype``.
    f16_loss_scale: the largest power of two ``s`` with ``max_abs * s *
      headroom <= 65504``: the float16 loss scale that keeps the largest
      gradient ``headroom`` times below float16's max (clamped to 2^-126 ...
      2^126); ``None`` with ``dtype``.
    headroom: the factor asked for.
    max_abs: the largest finite gradient magnitude measured.
    f16_underflow: share of gradient entries that underflow float16 (below
      2^-24) at ``f16_loss_scale``.
    f16_subnormal: share of gradient entries below float16's smallest normal
      (2^-14) at ``f16_loss_scale``.
    unscaled_f16_underflow: share of gradient entries that underflow float16
      without loss scaling (scale 1).
    keep_f32: names of the leaves (or groups) to keep in float32.
    reasons: one sentence per decision: the dtype, then each ``keep_f32``
      entry, then warnings (non-finite gradients).

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> advice = diagnostics.advise({"w": jnp.array([1e-6, 2.0**-10, 0.5])})
    >>> advice.dtype, advice.loss_scale == 2.0**13
    ('float16', True)
  """

  dtype: str | None
  loss_scale: float | None
  f16_loss_scale: float | None
  headroom: float
  max_abs: float
  f16_underflow: float
  f16_subnormal: float
  unscaled_f16_underflow: float
  keep_f32: tuple[str, ...]
  reasons: tuple[str, ...]

  def __str__(self) -> str:
    scale = "–" if self.loss_scale is None else _format_pow2(self.loss_scale)
    f16_scale = ("–" if self.f16_loss_scale is None
                 else _format_pow2(self.f16_loss_scale))
    rows = [
        ("dtype", self.dtype or "–"),
        ("static loss scale", scale),
        (f"float16 loss scale (headroom {self.headroom:g}x)", f16_scale),
        ("largest gradient magnitude", f"{self.max_abs:.3g}"),
        ("f16 underflow at that scale", f"{_format_percent(self.f16_underflow)}%"),
        ("f16 underflow without loss scaling",
         f"{_format_percent(self.unscaled_f16_underflow)}%"),
        ("keep in float32", ", ".join(self.keep_f32) or "nothing"),
    ]
    lines = ["| advice | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines.append("")
    lines += [f"- {r}" for r in self.reasons]
    return "\n".join(lines)


def _f16_scale(max_abs: float, headroom: float) -> float:
  """The largest power of two s with max_abs * s * headroom <= F16_MAX."""
  exponent = math.floor(math.log2(F16_MAX / (headroom * max_abs)))
  while max_abs * 2.0**exponent * headroom > F16_MAX:
    exponent -= 1
  while max_abs * 2.0**(exponent + 1) * headroom <= F16_MAX:
    exponent += 1
  return 2.0**min(max(exponent, -126), 126)


def advise_half(
    grad_stats: Any,
    activation_stats: Any = None,
    *,
    by: Any = None,
    headroom: float = DEFAULT_HEADROOM,
    max_underflow: float = 0.01,
    keep_f32_underflow: float = 0.5,
) -> Advice:
  """Recommends a static loss scale, float16 or bfloat16, and what stays f32.

  Give it statistics of *unscaled* gradients (measured at any loss scale)
  and, optionally, of float32 activations. The loss scale is the largest
  power of two ``s`` with ``max|g| * s * headroom <= 65504``; float16 when at
  most ``max_underflow`` of the gradient entries fall below 2^-24 at ``s``,
  else bfloat16; leaves that underflow or overflow are kept in float32.

  Args:
    grad_stats: statistics of the gradients (a tree of :class:`TensorStats`),
      or the gradients themselves.
    activation_stats: optionally, statistics (or values) of the forward pass's
      intermediate values, measured at loss scale 1.
    by: grouping of the leaves, as in :func:`group_stats` (e.g. ``-1`` for
      parameter modules).
    headroom: factor (>= 1) kept between the largest scaled gradient and
      65504.
    max_underflow: the share of gradient entries allowed to underflow float16
      at the recommended scale, in [0, 1].
    keep_f32_underflow: the underflow share, in (0, 1], above which a leaf is
      kept in float32.

  Returns:
    An :class:`Advice`.

  Raises:
    TypeError: on statistics that are traced (call it outside ``jit``) or not
      :class:`TensorStats`, or non-numeric settings.
    ValueError: on settings out of range.

  The public door is :func:`jmp_lite.diagnostics.advise` (its example shows
  this advice). See ``docs/diagnostics.md`` (advice) for the rule in full and why the
  figures are a lower bound.
  """
  headroom = checks.at_least(
      headroom, "headroom", "advise", 1,
      "it is the factor kept between the largest scaled gradient and 65504 "
      "(e.g. 8)")
  max_underflow = checks.share(max_underflow, "max_underflow", "advise",
                               zero_allowed=True)
  keep_f32_underflow = checks.share(keep_f32_underflow, "keep_f32_underflow",
                                    "advise", zero_allowed=False)
  grads = _host_named(grad_stats, by, "advise")
  acts = ({} if activation_stats is None
          else _host_named(activation_stats, by, "advise"))

  def empty(reason):
    return Advice(None, None, None, headroom, 0.0, 0.0, 0.0, 0.0, (), (reason,))

  if not grads:
    return empty("No floating-point gradient leaves: nothing to advise.")
  total = combine_stats(list(grads.values()))
  total = TensorStats(*(np.asarray(v) for v in total))
  size = int(total.size)
  max_abs = float(total.max_abs)
  if max_abs == 0 or not int(np.sum(total.histogram)):
    return empty("Every gradient entry is zero or non-finite: no magnitude to "
                 "choose a loss scale from.")

  s = _f16_scale(max_abs, headroom)
  underflow = _count_below(total, -24, s) / size
  subnormal = _count_below(total, -14, s) / size
  unscaled = _count_below(total, -24, 1.0) / size
  use_f16 = underflow <= max_underflow
  nonzero = np.nonzero(total.histogram)[0]
  shift = math.log2(float(total.loss_scale))
  span = _EXPONENTS[nonzero[-1]] - _EXPONENTS[nonzero[0]] + 1
  if use_f16:
    reasons = [
        f"float16 with a static loss scale of {_format_pow2(s)}: the largest "
        f"gradient ({max_abs:.3g}) times {_format_pow2(s)} is "
        f"{max_abs * s:.4g}, at least {headroom:g}x below float16's max 65504, "
        f"and {_format_percent(underflow)}% of the gradient entries underflow "
        f"(< 2^-24) at that scale (limit {_format_percent(max_underflow)}%)."
        + (f" Without loss scaling {_format_percent(unscaled)}% would."
           if unscaled > underflow else "")
    ]
  else:
    reasons = [
        f"bfloat16 (no loss scaling): even the largest safe float16 scale, "
        f"{_format_pow2(s)} (largest gradient {max_abs:.3g} x scale x "
        f"{headroom:g} <= 65504), leaves {_format_percent(underflow)}% of the "
        "gradient entries below float16's smallest subnormal 2^-24 (limit "
        f"{_format_percent(max_underflow)}%). The nonzero gradients span about "
        f"2^{span} (2^{_EXPONENTS[nonzero[0]] - shift:.0f} to "
        f"2^{_EXPONENTS[nonzero[-1]] + 1 - shift:.0f}), float16 only "
        "2^40 (2^-24 to 2^16) less the headroom; bfloat16 has float32's "
        "exponent range."
    ]

  keep: dict[str, str] = {}

  def flag(name, why):
    keep.setdefault(name, why)

  for name, st in grads.items():
    n = max(int(st.size), 1)
    if use_f16:
      share = _count_below(st, -24, s) / n
      if share > keep_f32_underflow:
        flag(name, f"{_format_percent(share)}% of its gradient entries "
             f"underflow float16 at loss scale {_format_pow2(s)}.")
    if int(st.bf16_overflow):
      flag(name, f"its gradients overflow bfloat16 ({int(st.bf16_overflow)} "
           "entries).")
    bf16_share = _count_below(st, -133, 1.0) / n
    if bf16_share > keep_f32_underflow:
      flag(name, f"{_format_percent(bf16_share)}% of its gradient entries "
           "underflow bfloat16 (< 2^-133).")
  for name, st in acts.items():
    n = max(int(st.size), 1)
    if use_f16 and int(st.f16_overflow):
      flag(name, f"its activations overflow float16 ({int(st.f16_overflow)} "
           f"of {int(st.size):,} entries above 65504; largest "
           f"{float(st.max_abs):.3g}).")
    elif use_f16 and st.fraction("f16_underflow") > keep_f32_underflow:
      flag(name, f"{_format_percent(st.fraction('f16_underflow'))}% of its "
           "activations underflow float16.")
    if int(st.bf16_overflow):
      flag(name, f"its activations overflow bfloat16 ({int(st.bf16_overflow)} "
           "entries).")
    elif st.fraction("bf16_underflow") > keep_f32_underflow:
      flag(name, f"{_format_percent(st.fraction('bf16_underflow'))}% of its "
           "activations underflow bfloat16.")
  reasons += [f"Keep {name} in float32: {why}" for name, why in keep.items()]
  if int(total.nonfinite):
    reasons.append(
        f"{int(total.nonfinite)} gradient entries are inf/NaN in the values "
        "measured: fix those first (they are not a precision problem if the "
        "gradients were computed in float32).")
  return Advice(
      dtype="float16" if use_f16 else "bfloat16",
      loss_scale=s if use_f16 else 1.0,
      f16_loss_scale=s,
      headroom=headroom,
      max_abs=max_abs,
      f16_underflow=underflow,
      f16_subnormal=subnormal,
      unscaled_f16_underflow=unscaled,
      keep_f32=tuple(keep),
      reasons=tuple(reasons),
  )


# -- the plot and the report --------------------------------------------------------


def _draw_ranges(ax, first: bool) -> None:
  f16_max = math.log2(F16_MAX)
  bf16_max = math.log2(BF16_MAX)
  ax.axvspan(-24, -14, color="tab:orange", alpha=0.15,
             label="f16 subnormal (2^-24 to 2^-14)" if first else None)
  ax.axvspan(-14, f16_max, color="tab:green", alpha=0.12,
             label="f16 normal (2^-14 to 65504)" if first else None)
  ax.axvline(-24, color="tab:red", linewidth=1.2,
             label="f16 flush to zero / max" if first else None)
  ax.axvline(f16_max, color="tab:red", linewidth=1.2)
  ax.axvspan(-133, -126, color="tab:purple", alpha=0.12,
             label="bf16 subnormal (2^-133 to 2^-126)" if first else None)
  ax.axvline(-133, color="tab:purple", linestyle="--", linewidth=1.2,
             label="bf16 smallest subnormal (2^-133) / max (2^128)"
             if first else None)
  ax.axvline(bf16_max, color="tab:purple", linestyle="--", linewidth=1.2)


def _draw_row(ax, name: str, s: TensorStats, kind: str, xlim, first: bool):
  size = max(int(s.size), 1)
  shares = np.asarray(s.histogram, np.float64) / size
  _draw_ranges(ax, first)
  # One filled step outline, not a bar per binade: ~270 bar patches per row
  # made the figure take seconds to draw.
  edges = np.append(_EXPONENTS, _EXPONENTS[-1] + 1)
  ax.stairs(shares, edges, fill=True, color="tab:blue",
            label="share of entries per binade" if first else None)
  ax.set_xlim(*xlim)
  top = float(shares.max()) if shares.size else 0.0
  ax.set_ylim(0, max(top, 0.01) * 1.3)
  scale = float(s.loss_scale)
  scale_note = "" if scale == 1 else f" x loss scale {_format_pow2(scale)}"
  notes = (f"{kind} {name}{scale_note}: zero {_format_percent(s.fraction('zeros'))}%,"
           f" f16 underflow {_format_percent(s.fraction('f16_underflow'))}%, "
           f"f16 overflow {_format_percent(s.fraction('f16_overflow'))}%")
  if int(s.nonfinite):
    notes += f", inf/nan {_format_percent(s.fraction('nonfinite'))}%"
  ax.set_title(notes, fontsize=8, loc="left")
  ax.tick_params(labelsize=7)
  ax.set_ylabel("share", fontsize=7)


def plot_histograms(
    stats: Any,
    path: str | os.PathLike,
    *,
    activation_stats: Any = None,
    by: Any = None,
    title: str | None = None,
    dpi: int = 100,
) -> str:
  """Writes a figure of each leaf's magnitudes against the f16/bf16 ranges
  (what :func:`report` draws with a ``path``).

  One row per leaf (or group), gradients first, then activations: the share
  of entries per binade of ``log2(|x| * loss_scale)``, over float16's and
  bfloat16's subnormal and normal ranges. matplotlib is imported here; the
  figure is drawn without pyplot (no window, no global state).

  Args:
    stats: a tree of :class:`TensorStats` (or of arrays, measured at loss
      scale 1): the gradients.
    path: the file to write, a str or os.PathLike (the format follows the
      suffix, e.g. ``.png``).
    activation_stats: optionally, statistics (or values) of activations.
    by: grouping, as in :func:`group_stats`.
    title: the figure's title.
    dpi: resolution, a positive number of dots per inch.

  Returns:
    ``path``.

  Raises:
    TypeError: if ``path`` is not a str or os.PathLike, or ``dpi`` is not a
      number (checked before anything is drawn).
    ValueError: if ``dpi`` is not positive and finite.
  """
  checks.path(path, "path", "plot_histograms")
  checks.number(dpi, "dpi (dots per inch)", "plot_histograms", low=0,
                low_open=True)
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = [("gradient", n, s) for n, s in
          _host_named(stats, by, "plot_histograms").items()]
  if activation_stats is not None:
    rows += [("activation", n, s) for n, s in
             _host_named(activation_stats, by, "plot_histograms").items()]
  if not rows:
    fig = Figure(figsize=(8, 1.5))
    fig.text(0.5, 0.5, "no floating-point leaves", ha="center", va="center")
    fig.savefig(path, dpi=dpi)
    return path
  used = [_EXPONENTS[np.nonzero(s.histogram)[0]] for _, _, s in rows]
  used = np.concatenate(used) if used else np.array([], int)
  low = min(-27, int(used.min()) - 1) if used.size else -27
  high = max(18, int(used.max()) + 2) if used.size else 18
  fig = Figure(figsize=(10, 1.3 + 1.3 * len(rows)), layout="constrained")
  axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
  for i, ((kind, name, s), ax) in enumerate(zip(rows, axes)):
    _draw_row(ax, name, s, kind, (low, high), first=i == 0)
  axes[-1].set_xlabel(
      "log2(|value| x loss scale): bar e counts 2^e <= |value| x scale < 2^(e+1)")
  fig.legend(loc="outside lower center", ncol=3, fontsize=7, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=dpi)
  return path


#: How to call :func:`report` without a figure.
NO_FIGURE = "Leave path=None to print the tables and the advice without a figure."
#: What :func:`report`'s ``file`` takes.
REPORT_FILE_HELP = (
    "Pass a writable text stream (sys.stdout, io.StringIO(), a file opened "
    "with open(name, 'w')) or a file path (a str or os.PathLike such as "
    "'report.txt', created or overwritten with the report); path= names the "
    "figure, not the text.")


def report(
    grad_stats: Any,
    path: str | os.PathLike | None = None,
    *,
    activation_stats: Any = None,
    by: Any = None,
    headroom: float = DEFAULT_HEADROOM,
    max_underflow: float = 0.01,
    keep_f32_underflow: float = 0.5,
    title: str | None = None,
    file: TextIO | None = None,
) -> Advice:
  """Prints the tables and the advice, writes the histogram plot: one call.

  Prints a table of the gradients' statistics (and of the activations', when
  given), then ``str(advise(...))``; with a ``path``, writes a figure of each
  leaf's magnitudes against the float16 and bfloat16 ranges. Call it outside
  ``jit``, on statistics a jitted step returned or on a tree of arrays.

  Args:
    grad_stats: statistics of the gradients (from :func:`tensor_stats`), or
      the gradients themselves (then measured at loss scale 1).
    path: where to write the figure, a str or os.PathLike whose suffix names
      the format (e.g. ``"grads.png"``); ``None``: no figure.
    activation_stats: optionally, statistics (or values) of activations.
    by: grouping, as in :func:`group_stats`.
    headroom: see :func:`advise`.
    max_underflow: see :func:`advise`.
    keep_f32_underflow: see :func:`advise`.
    title: a line printed first, and the figure's title.
    file: where to print: a writable text stream (default ``sys.stdout``),
      or a file path (a str or os.PathLike), which is created or
      overwritten with the report (text, UTF-8) and closed again.

  Returns:
    The :class:`Advice`.

  Raises:
    TypeError: if ``path`` is not None, a str or os.PathLike, ``title``
      is not None or a str, or ``file`` is neither a path nor an object
      with a ``write`` method (checked before anything is printed or
      drawn); as ``print`` raises, if ``file`` is a binary stream.
    ValueError: on bad advice settings (see :func:`advise`); as ``print``
      raises, if ``file`` is closed or not writable (the tables are printed
      before the figure is drawn, so nothing is written then).

  Example:
    >>> import io, jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> out = io.StringIO()
    >>> advice = diagnostics.report({"w": jnp.array([1e-7, 1e-3])}, file=out)
    >>> "| w |" in out.getvalue(), advice.dtype
    (True, 'float16')

  See ``docs/diagnostics.md`` (the report and the plot) for the table's
  columns and the figure.
  """
  if title is not None and not isinstance(title, str):
    raise TypeError(
        f"report: title must be a str (a line printed first, and the "
        f"figure's title) or None, got {type(title).__name__}: {title!r}. "
        f"Pass a string, e.g. title=str({title!r}).")
  if path is not None:
    try:
      checks.path(path, "path", "report")
    except TypeError as err:
      raise TypeError(f"{err} {NO_FIGURE}") from None
  to_path = isinstance(file, (str, os.PathLike))
  if not (file is None or to_path or callable(getattr(file, "write", None))):
    raise TypeError(
        f"report: file must be a writable text stream or a file path, got "
        f"{type(file).__name__}: {file!r}. {REPORT_FILE_HELP}")
  grad_stats = _as_stats(grad_stats)
  if activation_stats is not None:
    activation_stats = _as_stats(activation_stats)
  advice = advise_half(grad_stats, activation_stats, by=by, headroom=headroom,
                  max_underflow=max_underflow,
                  keep_f32_underflow=keep_f32_underflow)
  parts = []
  if title:
    parts.append(title)
  parts.append("Gradients:\n\n" + format_table(grad_stats, by=by))
  if activation_stats is not None:
    parts.append("Activations:\n\n" + format_table(activation_stats, by=by))
  parts.append(str(advice))
  # A path is opened only now, when every argument has been checked: a bad
  # setting leaves an existing file as it was.
  with (open(file, "w", encoding="utf-8") if to_path  # pylint: disable=consider-using-with
        else contextlib.nullcontext(sys.stdout if file is None else file)
        ) as stream:
    # Printed before the figure is drawn: a file that print cannot write to
    # (closed, binary, read-only) fails before anything is written.
    print("\n\n".join(parts), file=stream)
    if path is not None:
      plot_histograms(grad_stats, path, activation_stats=activation_stats,
                      by=by, title=title)
      print(f"\nWrote {path}", file=stream)
  return advice
