"""Host-side float8, FP4 and int8 advice: per layer, the cheapest granularity
(or FP4 or int8 recipe) that keeps the quantization losses small, or to keep
the layer out of float8 (FP4, int8: in 16 bits), with the layers ranked by
their error.

:class:`Fp8Advice` and :func:`advise_fp8` (what the public ``advise`` does
with float8, FP4 and int8 statistics). They read the statistics of
:mod:`jmp_lite._src.diagnostics.fp8_stats` on the host. Guide:
``docs/diagnostics.md`` (Float8).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax

from jmp_lite._src import checks
from jmp_lite._src.diagnostics.fp8_stats import combine_fp8_stats
from jmp_lite._src.diagnostics.fp8_stats import E2M1_UNIT_ROUNDOFF
from jmp_lite._src.diagnostics.fp8_stats import FP4_FORMAT
from jmp_lite._src.diagnostics.fp8_stats import FP4_STAT_RECIPES
from jmp_lite._src.diagnostics.fp8_stats import Fp8Stats
from jmp_lite._src.diagnostics.fp8_stats import GRANULARITIES
from jmp_lite._src.diagnostics.fp8_stats import INT8_FORMAT
from jmp_lite._src.diagnostics.fp8_stats import INT8_STAT_RECIPES
from jmp_lite._src.diagnostics.fp8_stats import ROLES
from jmp_lite._src.diagnostics.report import _format_percent
from jmp_lite._src.diagnostics.stats import _group_key
from jmp_lite._src.diagnostics.stats import _path_name
from jmp_lite._src.diagnostics.stats import host_stats
from jmp_lite._src.diagnostics.stats import is_stats
from jmp_lite._src.diagnostics.stats import TensorStats
from jmp_lite._src.low_precision import recipes as fp8_config
from jmp_lite._src.low_precision import formats as fp8_formats
from jmp_lite._src.low_precision import scaling as fp8_scaling

#: The default share of entries :func:`advise` lets a float8 granularity flush
#: to zero: 1%, the share of float16 underflow it accepts by default.
DEFAULT_MAX_FLUSHED = 0.01
#: The default share of entries :func:`advise` lets a float8 recipe clip: none.
DEFAULT_MAX_CLIPPED = 0.0
#: The default limits for FP4 statistics: no limit on clipping and flushing
#: (NVFP4 clips a block's largest entry whenever its E4M3 scale rounds
#: down, and every FP4 block flushes its entries below 1/24 of its largest:
#: the row error counts what both cost), the mean row error at E2M1's unit
#: roundoff (25%).
FP4_DEFAULT_LIMITS = (1.0, 1.0, E2M1_UNIT_ROUNDOFF)
#: The default mean row error for int8 statistics: 2**-5 (3.125%, an SQNR
#: of 30.1 dB). Gaussian rows lose about 0.9% (41 dB) under row-wise int8;
#: the limit lets a row's largest entry be up to about 14 times its RMS
#: (the grid step is ``amax / 127``), beyond which outliers (LLM.int8's
#: outlier features) set the scale and the rest of the row loses its bits.
INT8_MAX_ERROR = 2.0**-5
#: The default limits for int8 statistics: no clipping (current absmax
#: scaling never clips; clipping means a stale given scale), 5% of the
#: entries flushed to zero (Gaussian rows flush about 1.2%: their entries
#: below half a grid step; an outlier 16 times the RMS flushes about 5%),
#: the mean row error at :data:`INT8_MAX_ERROR`.
INT8_DEFAULT_LIMITS = (0.0, 0.05, INT8_MAX_ERROR)

_NAMES = {"tensor": "per tensor", "row": "per row", "blockwise": "blockwise",
          "mxfp8": "MXFP8", "delayed": "with the given delayed scales",
          "cast": "without scaling", "nvfp4": "NVFP4", "mxfp4": "MXFP4",
          "int8": "int8 (row-wise, per-channel weights)",
          "int8_switchback": "SwitchBack's int8 (a per-tensor weight scale)"}
_PLURAL = {"activation": "activations", "weight": "weights",
           "gradient": "gradients"}


@dataclasses.dataclass(frozen=True)
class Fp8Advice:
  """What :func:`advise` recommends per layer from float8 (FP4, int8)
  statistics, with the figures behind it.

  ``str(advice)`` is the verdict per layer, a table of the measurements and
  the reasons. ``docs/diagnostics.md`` (Float8) explains the rule.

  Attributes:
    granularity: ``{layer: granularity}``, the cheapest float8 granularity
      that keeps every measured role of the layer within the limits:
      ``"tensor"``, ``"row"``, ``"blockwise"`` or ``"mxfp8"`` (the order
      they are tried in), or ``None``: keep the layer out of float8. For FP4
      statistics, the first FP4 recipe that fits (``"nvfp4"``,
      ``"mxfp4"``) or ``None``: keep the layer in the compute dtype (bf16);
      for int8 statistics, the first int8 recipe that fits (``"int8"``,
      ``"int8_switchback"``) or ``None``: keep the layer in 16 bits.
    keep_out: the layers whose granularity is ``None``, in order.
    delayed: ``{layer: fits}`` for the layers measured with a delayed scale
      (``fp8_stats(..., scale=...)``): whether those scales keep every role
      within the limits.
    max_clipped: the limit on the share of entries clipped.
    max_flushed: the limit on the share of entries flushed to zero.
    max_error: ``{format: limit}`` on the mean relative row error.
    stats: ``{layer: {role: Fp8Stats}}``, the measurements, grouped.
    reasons: one sentence per decision that is not per tensor, per layer
      kept out, per delayed scale that does not fit, and per warning.
    ranking: the layers from the largest quantization error to the
      smallest: each layer's largest mean row error over its roles, under
      the first granularity (recipe) tried. The candidates for a keep-list
      (FP4: which layers to keep in bf16) come first.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> stats = {"w": diagnostics.fp8_stats(jnp.ones((64, 64)), "weight")}
    >>> diagnostics.advise(stats).granularity
    {'w': 'tensor'}
  """

  granularity: Mapping[str, str | None]
  keep_out: tuple[str, ...]
  delayed: Mapping[str, bool]
  max_clipped: float
  max_flushed: float
  max_error: Mapping[str, float]
  stats: Mapping[str, Mapping[str, Fp8Stats]]
  reasons: tuple[str, ...]
  ranking: tuple[str, ...] = ()

  def __str__(self) -> str:
    if not self.stats:
      return "\n".join(f"- {r}" for r in self.reasons)
    kind = _kind(self.stats)
    title = {"fp4": "FP4 recipe", "int8": "int8 recipe"}.get(
        kind, "float8 granularity")
    lines = [f"| layer | {title} | roles measured |", "|---|---|---|"]
    for layer, choice in self.granularity.items():
      verdict = ("keep out of float8" if kind == "float8" else
                 "keep in the compute dtype") if choice is None else choice
      if layer in self.delayed:
        verdict += ("; delayed scales fit" if self.delayed[layer]
                    else "; delayed scales do not fit")
      lines.append(f"| {layer} | {verdict} | "
                   f"{', '.join(self.stats[layer])} |")
    lines += ["", _measurements(self.stats), ""]
    measured = {f for roles in self.stats.values() for st in roles.values()
                for f in st.formats}
    limits = ", ".join(f"{fmt} {100 * v:g}%"
                       for fmt, v in self.max_error.items()
                       if fmt in measured)
    lines.append(
        f"Limits: clipped <= {_format_percent(self.max_clipped)}%, flushed <= "
        f"{_format_percent(self.max_flushed)}%, mean row error <= {limits}.")
    lines += [f"- {r}" for r in self.reasons]
    if self.ranking:
      lines.append("- Largest error first: " + ", ".join(self.ranking) + ".")
    return "\n".join(lines)


#: What each kind of statistics is called in the advice's sentences.
_KIND_NAMES = {"float8": "float8", "fp4": "FP4", "int8": "int8"}


def _leaf_kind(s: Fp8Stats) -> str:
  """``"fp4"``, ``"int8"`` or ``"float8"``: which matmuls ``s`` measures."""
  return {(FP4_FORMAT,): "fp4", (INT8_FORMAT,): "int8"}.get(s.formats,
                                                             "float8")


def _kind(stats: Mapping[str, Mapping[str, Fp8Stats]]) -> str:
  kinds = {_leaf_kind(s) for roles in stats.values() for s in roles.values()}
  return kinds.pop() if len(kinds) == 1 else "float8"


def _percent(share: float) -> str:
  return _format_percent(share)


def _error(value: float) -> str:
  return f"{100 * value:.1f}"


def _cell(s: Fp8Stats, fmt: str, recipe: str) -> str:
  clipped = s.fraction("clipped", recipe, fmt)
  flushed = _percent(s.fraction("flushed", recipe, fmt))
  error = _error(s.error(recipe, fmt))
  if recipe in ("cast", "delayed") + FP4_STAT_RECIPES:
    return f"{_percent(clipped)} / {flushed} / {error}"
  cell = f"{flushed} / {error}"
  return cell + (f" (clipped {_percent(clipped)})" if clipped else "")


def _measurements(stats: Mapping[str, Mapping[str, Fp8Stats]]) -> str:
  recipes = ("cast",) + GRANULARITIES
  kind = _kind(stats)
  if kind == "fp4":
    recipes = FP4_STAT_RECIPES
  elif kind == "int8":
    recipes = INT8_STAT_RECIPES
  if kind != "fp4" and any("delayed" in s.recipes for roles in stats.values()
         for s in roles.values()):
    recipes += ("delayed",)
  titles = [f"{r}: clipped / flushed / error %"
            if r in ("cast", "delayed") + FP4_STAT_RECIPES
            else f"{r}: flushed / error %" for r in recipes]
  lines = ["| layer | role | format | entries | max abs | "
           + " | ".join(titles) + " |",
           "|---|---|---|--:|--:|" + "--:|" * len(recipes)]
  for layer, roles in stats.items():
    for role, s in roles.items():
      for fmt in s.formats:
        cells = [layer, role, fmt, f"{int(s.size):,}",
                 f"{float(s.max_abs):.3g}"]
        cells += [_cell(s, fmt, r) if r in s.recipes else "–"
                  for r in recipes]
        lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _problems(s: Fp8Stats, recipe: str, limits) -> list[str]:
  """What exceeds the limits for the role's first format and ``recipe``."""
  max_clipped, max_flushed, max_error = limits
  fmt = s.formats[0]
  out = []
  clipped = s.fraction("clipped", recipe, fmt)
  if clipped > max_clipped:
    out.append(f"clip {_percent(clipped)}% (limit {_percent(max_clipped)}%)")
  flushed = s.fraction("flushed", recipe, fmt)
  if flushed > max_flushed:
    out.append(f"flush {_percent(flushed)}% to zero (limit "
               f"{_percent(max_flushed)}%)")
  error = s.error(recipe, fmt)
  if error > max_error[fmt]:
    out.append(f"lose {_error(error)}% of each row on average (limit "
               f"{100 * max_error[fmt]:g}%)")
  return out


def _describe(problems: Mapping[str, list[str]]) -> str:
  return "; ".join(f"its {_PLURAL[role]} ({role_fmt}) {' and '.join(p)}"
                   for (role, role_fmt), p in problems.items() if p)


def _named(stats: Any) -> list[tuple[str, Fp8Stats]]:
  leaves = jax.tree.leaves_with_path(stats, is_leaf=is_stats)
  out = []
  for path, leaf in leaves:
    if isinstance(leaf, Fp8Stats):
      out.append((_path_name(path), leaf))
      continue
    if isinstance(leaf, TensorStats):
      got = "half-precision statistics (TensorStats, from tensor_stats)"
    elif checks.is_array(leaf):
      got = f"a {leaf.dtype} array"
    else:
      got = type(leaf).__name__
    raise TypeError(
        f"advise expects float8 statistics (a tree of Fp8Stats from "
        f"diagnostics.fp8_stats), got {got} at {_path_name(path)!r}. Measure "
        "the values first, e.g. diagnostics.fp8_stats(params, 'weight'); "
        "half-precision statistics go to diagnostics.advise on their own.")
  return out


#: What ``granularities`` holds for int8 statistics.
INT8_LADDER_HELP = (
    "For int8 statistics (fp8_stats(..., fmt='int8')) granularities names "
    "the int8 recipes to try, in order: 'int8', 'int8_switchback' (default "
    "('int8', 'int8_switchback'): per-channel weight scales first, the more "
    "accurate; activations and gradients measure the same under both)."
)

#: What ``granularities`` holds for FP4 statistics.
FP4_LADDER_HELP = (
    "For FP4 statistics (fp8_stats(..., fmt='e2m1')) granularities names "
    "the FP4 recipes to try, in order: 'nvfp4', 'mxfp4' (default "
    "('nvfp4', 'mxfp4'): NVFP4 first, the more accurate at the same FP4 "
    "rate)."
)


def _granularities(granularities: Any, kind: str) -> tuple[str, ...]:
  """The ladder to try: a tuple (or list) of distinct names, cheapest first."""
  ladder = (tuple(granularities) if isinstance(granularities, (tuple, list))
            else None)
  recipes = {"fp4": FP4_STAT_RECIPES, "int8": INT8_STAT_RECIPES}.get(kind)
  if recipes and ladder == GRANULARITIES:
    return recipes
  what, help_text = {
      "fp4": ("FP4 recipe", FP4_LADDER_HELP),
      "int8": ("int8 recipe", INT8_LADDER_HELP),
  }.get(kind, ("granularity", fp8_config.MATMUL_GRANULARITY_HELP))
  names = tuple(
      checks.choice(g, what, "advise", recipes, help_text)
      if recipes else
      fp8_scaling.check_granularity(g, GRANULARITIES, help_text)
      for g in ladder or ())
  if not names or len(set(names)) != len(names):
    raise (TypeError if ladder is None else ValueError)(
        f"advise: granularities must be a tuple naming at least one "
        f"{what}, each once, cheapest first, got {granularities!r}; e.g. "
        f"('tensor', 'row', 'blockwise'). {help_text}")
  return names


def _max_error(max_error: Any, kind: str) -> dict[str, float]:
  if max_error is None:
    if kind == "fp4":
      return {FP4_FORMAT: E2M1_UNIT_ROUNDOFF}
    if kind == "int8":
      return {INT8_FORMAT: INT8_MAX_ERROR}
    return {name: fp8_formats.get_format(name).unit_roundoff
            for name in fp8_formats.FORMAT_NAMES}
  value = checks.at_least(
      max_error, "max_error", "advise", 0,
      "it is the largest mean relative row error allowed, e.g. 0.0625 "
      "(None: each format's unit roundoff, 2**-4 for e4m3, 2**-3 for e5m2, "
      "2**-2 for FP4's e2m1; 2**-5 for int8)")
  names = {"fp4": (FP4_FORMAT,), "int8": (INT8_FORMAT,)}.get(
      kind, fp8_formats.FORMAT_NAMES)
  return {name: value for name in names}


def advise_fp8(stats: Any, *, by: Any = None,
               max_clipped: float | None = None,
               max_flushed: float | None = None,
               max_error: float | None = None,
               granularities: Sequence[str] = GRANULARITIES) -> Fp8Advice:
  """Per layer: the cheapest float8 granularity (or FP4 recipe), or keep it out.

  What the public ``jmp_lite.diagnostics.advise`` does with float8, FP4 and
  int8 statistics (the deprecated ``jmp_lite.diagnostics.advise_fp8`` is
  that ``advise``).

  The leaves are grouped into layers (``by``, as in :func:`group_stats`),
  each role's statistics combined within a layer. A granularity *fits* a
  role when, in the role's first measured format, at most ``max_clipped`` of
  the entries are clipped, at most ``max_flushed`` flushed to zero, and the
  mean relative row error is at most ``max_error``. Each layer gets the first
  of ``granularities`` — by default ``"tensor"``, ``"row"``,
  ``"blockwise"``, ``"mxfp8"``, the float8 matmul's cost order — that fits
  every role measured, or ``None`` (keep it in the compute dtype) when none
  does. The layers are also ranked by their error (:attr:`Fp8Advice.\
ranking`), the largest first: the candidates for a keep-list.

  FP4 statistics (``fp8_stats(..., fmt="e2m1")``) are advised the same way,
  with the FP4 recipes as the ladder (``"nvfp4"``, then ``"mxfp4"``) and
  ``None`` meaning: keep the layer in the compute dtype (bf16). A tree
  mixing float8 and FP4 statistics is refused (advise each on its own).

  int8 statistics (``fp8_stats(..., fmt="int8")``) likewise, with the int8
  recipes as the ladder (``"int8"``, then ``"int8_switchback"``) and
  ``None`` meaning: keep the layer in 16 bits (the compute dtype). Default
  limits: nothing clipped, at most 5% flushed to zero, a mean row error of
  at most 2**-5 (3.125%; an SQNR of 30.1 dB).

  Args:
    stats: a tree of :class:`Fp8Stats` (from :func:`fp8_stats`), e.g.
      ``{"weight": ..., "activation": ..., "gradient": ...}``.
    by: how leaf paths map to layers: ``None`` (each leaf is a layer), an
      int or a function from a path to the layer's name, as in
      :func:`group_stats`.
    max_clipped: the share of entries a recipe may clip, in [0, 1]. None
      (default): 0 for float8 (current scaling never clips; clipping means
      a stale scale), no limit for FP4 (NVFP4 clips a block's largest entry
      when its E4M3 scale rounds down; the row error counts it).
    max_flushed: the share of entries a granularity may flush to zero, in
      [0, 1]. None (default): 1% for float8, no limit for FP4 (every FP4
      block flushes its entries below 1/24 of its largest; the row error
      counts it), 5% for int8 (Gaussian rows flush about 1.2%).
    max_error: the largest mean relative row error; None (default): each
      format's unit roundoff (6.25% for e4m3, 12.5% for e5m2, 25% for
      FP4's e2m1), the most rounding alone can cost a row in the format's
      normal range; 2**-5 (3.125%) for int8, whose error grows with the
      ratio of a row's largest entry to its RMS.
    granularities: the granularities to try, cheapest first (e.g. without
      ``"mxfp8"`` on GPUs without MXFP8 tensor cores, where it brings no
      speedup).

  Returns:
    An :class:`Fp8Advice`.

  Raises:
    TypeError: for statistics that are traced (call it outside ``jit``) or
      not :class:`Fp8Stats`, or non-numeric limits.
    ValueError: for limits out of range, an unknown or repeated
      granularity (FP4 recipe), statistics mixing float8 and FP4, or a
      layer whose statistics of one role measured different things.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> x = jnp.ones((4, 64)).at[0].set(1e6)     # one row of outliers
    >>> stats = {"dense": diagnostics.fp8_stats(x, "activation")}
    >>> diagnostics.advise(stats).granularity
    {'dense': 'row'}

  See ``docs/diagnostics.md`` (Float8) for the limits, the cost order and
  how to capture each role.
  """
  key = _group_key(by, "advise")
  named = _named(stats)
  host_stats([leaf for _, leaf in named], "advise")
  first = {}
  for name, leaf in named:
    first.setdefault(_leaf_kind(leaf), name)
  if len(first) > 1:
    (kind_a, name_a), (kind_b, name_b) = sorted(
        first.items(), key=lambda item: ("fp4", "int8", "float8").index(
            item[0]))[:2]
    raise ValueError(
        f"advise: these statistics mix {_KIND_NAMES[kind_a]} "
        f"({name_a!r}) and {_KIND_NAMES[kind_b]} ({name_b!r}) measurements, "
        "whose recipes differ. Advise each on its own: "
        f"advise({kind_a}_stats), advise({kind_b}_stats).")
  kind = next(iter(first), "float8")
  default_clipped, default_flushed = {
      "fp4": FP4_DEFAULT_LIMITS[:2], "int8": INT8_DEFAULT_LIMITS[:2]}.get(
          kind, (DEFAULT_MAX_CLIPPED, DEFAULT_MAX_FLUSHED))
  max_clipped = checks.share(
      default_clipped if max_clipped is None else max_clipped,
      "max_clipped", "advise", zero_allowed=True)
  max_flushed = checks.share(
      default_flushed if max_flushed is None else max_flushed,
      "max_flushed", "advise", zero_allowed=True)
  errors = _max_error(max_error, kind)
  ladder = _granularities(granularities, kind)
  family = _KIND_NAMES[kind]
  grouped: dict[str, dict[str, list[Fp8Stats]]] = {}
  for name, leaf in named:
    layer = key(name)
    grouped.setdefault(layer, {}).setdefault(leaf.role, []).append(leaf)
  layers = {
      layer: {role: jax.device_get(combine_fp8_stats(roles[role],
                                                     f"{layer} ({role})"))
              for role in ROLES if role in roles}
      for layer, roles in grouped.items()}
  if not layers:
    return Fp8Advice({}, (), {}, max_clipped, max_flushed, errors, {},
                     ("No floating-point leaves: nothing to advise.",))

  limits = (max_clipped, max_flushed, errors)
  choice: dict[str, str | None] = {}
  delayed: dict[str, bool] = {}
  reasons: list[str] = []
  for layer, roles in layers.items():
    failed = []
    for granularity in ladder:
      problems = {(role, s.formats[0]): _problems(s, granularity, limits)
                  for role, s in roles.items()}
      if not any(problems.values()):
        choice[layer] = granularity
        break
      failed.append((granularity, problems))
    else:
      choice[layer] = None
    if choice[layer] is None:
      reasons.append(
          f"Keep {layer} out of {family} (in the "
          f"compute dtype): even {_NAMES[ladder[-1]]}, "
          f"{_describe(failed[-1][1])}.")
    elif failed:
      why = "; ".join(f"{_NAMES[g]}, {_describe(p)}" for g, p in failed)
      reasons.append(f"{layer}: {choice[layer]}, because {why}.")
    measured = [s for s in roles.values() if "delayed" in s.recipes]
    if measured:
      problems = {(role, s.formats[0]): _problems(s, "delayed", limits)
                  for role, s in roles.items() if "delayed" in s.recipes}
      delayed[layer] = not any(problems.values())
      if not delayed[layer]:
        reasons.append(
            f"{layer}: the given delayed scales do not fit: "
            f"{_describe(problems)}. A larger margin or current scaling "
            "avoids clipping.")
    for role, s in roles.items():
      if int(s.nonfinite):
        reasons.append(
            f"{layer}: {int(s.nonfinite)} of its {_PLURAL[role]} are inf/NaN "
            f"(measured as zeros): fix those first; in a "
            f"{family} matmul they make the result "
            "non-finite whatever the granularity.")
  worst = {layer: max(s.error(ladder[0], s.formats[0])
                      for s in roles.values())
           for layer, roles in layers.items()}
  ranking = tuple(sorted(worst, key=lambda layer: -worst[layer]))
  return Fp8Advice(
      granularity=choice,
      keep_out=tuple(layer for layer, g in choice.items() if g is None),
      delayed=delayed,
      max_clipped=max_clipped,
      max_flushed=max_flushed,
      max_error=errors,
      stats=layers,
      reasons=tuple(reasons),
      ranking=ranking,
  )
