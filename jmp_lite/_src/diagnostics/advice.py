"""The one ``advise``: half-precision advice or float8/FP4/int8 advice, by the
statistics given.

Statistics of :func:`tensor_stats` (or raw arrays) go to the float16/bfloat16
advice of :mod:`jmp_lite._src.diagnostics.report` (an :class:`Advice`);
statistics of :func:`fp8_stats` (float8, FP4 or int8) to the granularity
advice of :mod:`jmp_lite._src.diagnostics.fp8_advice` (an
:class:`Fp8Advice`). The options of one kind are refused with the other.
Guide: ``docs/diagnostics.md``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jmp_lite._src import checks
from jmp_lite._src.diagnostics.fp8_advice import advise_fp8
from jmp_lite._src.diagnostics.fp8_advice import Fp8Advice
from jmp_lite._src.diagnostics.fp8_stats import GRANULARITIES
from jmp_lite._src.diagnostics.fp8_stats import is_fp8_stats
from jmp_lite._src.diagnostics.stats import _path_name
from jmp_lite._src.diagnostics.stats import is_stats
from jmp_lite._src.diagnostics.report import Advice
from jmp_lite._src.diagnostics.report import advise_half
from jmp_lite._src.diagnostics.stats import TensorStats


class _Default:
  """The default of an option of :func:`advise` (tells "not given" apart)."""

  def __repr__(self) -> str:
    return "<default>"


#: The default of each option of :func:`advise` (the signature shows it as
#: ``DEFAULT``; each option's documentation says what it is).
DEFAULT: Any = _Default()

#: The options that apply to half-precision statistics only.
_HALF_OPTIONS = ("headroom", "max_underflow", "keep_f32_underflow")
#: The options that apply to float8, FP4 and int8 statistics only.
_FP8_OPTIONS = ("max_clipped", "max_flushed", "max_error", "granularities")

#: The two kinds of statistics, as the messages name them.
_HALF = ("half-precision statistics (TensorStats from "
         "diagnostics.tensor_stats, or the values themselves)")
_FP8 = ("float8, FP4 or int8 statistics (Fp8Stats from diagnostics.fp8_stats)")


def _misplaced(options: dict[str, Any], given_kind: str, for_kind: str,
               use: Sequence[str]) -> None:
  given = [name for name, value in options.items() if value is not DEFAULT]
  if given:
    raise TypeError(
        f"advise: {given[0]}= is an option for {for_kind}; these are "
        f"{given_kind}, whose options are {', '.join(use)} (and by). Leave "
        f"{given[0]} out, or measure the values the other way.")


def _kind_of(tree: Any) -> str:
  """``"fp8"`` when ``tree`` holds :class:`Fp8Stats`, else ``"half"``.

  Raises:
    TypeError: if ``tree`` mixes :class:`Fp8Stats` with half-precision
      statistics or values.
  """
  leaves = jax.tree.leaves_with_path(tree, is_leaf=is_stats)
  fp8 = [(p, x) for p, x in leaves if is_fp8_stats(x)]
  if not fp8:
    return "half"
  other = [(p, x) for p, x in leaves if not is_fp8_stats(x)]
  if other:
    path, leaf = other[0]
    got = ("half-precision statistics (TensorStats)"
           if isinstance(leaf, TensorStats) else
           f"a {leaf.dtype} array" if checks.is_array(leaf)
           else type(leaf).__name__)
    raise TypeError(
        f"advise: these statistics mix {_FP8} (e.g. at "
        f"{_path_name(fp8[0][0])!r}) with {got} at {_path_name(path)!r}. "
        "Advise each kind on its own: advise(fp8_stats_tree) for the float8 "
        "(FP4, int8) granularities, advise(tensor_stats_tree) for float16 "
        "or bfloat16 and a loss scale.")
  return "fp8"


def advise(
    grad_stats: Any,
    activation_stats: Any = None,
    *,
    by: Any = None,
    headroom: float = DEFAULT,
    max_underflow: float = DEFAULT,
    keep_f32_underflow: float = DEFAULT,
    max_clipped: float | None = DEFAULT,
    max_flushed: float | None = DEFAULT,
    max_error: float | None = DEFAULT,
    granularities: Sequence[str] = DEFAULT,
) -> Advice | Fp8Advice:
  """Advice from statistics: float16 or bfloat16, or per layer the float8 (FP4, int8) recipe.

  The kind of statistics decides what is advised:

  - half-precision statistics (a tree of :class:`TensorStats` from
    :func:`tensor_stats`, or the gradients themselves): a static loss scale,
    float16 or bfloat16, and what stays in float32 (an :class:`Advice`).
    The loss scale is the largest power of two ``s`` with ``max|g| * s *
    headroom <= 65504``; float16 when at most ``max_underflow`` of the
    gradient entries fall below 2^-24 at ``s``, else bfloat16; leaves that
    underflow or overflow are kept in float32. Give it statistics of
    *unscaled* gradients (measured at any loss scale) and, optionally, of
    float32 activations.
  - float8, FP4 or int8 statistics (a tree of :class:`Fp8Stats` from
    :func:`fp8_stats`, every role in one tree, e.g. ``{"weight": ...,
    "activation": ..., "gradient": ...}``): per layer (``by``) the cheapest
    granularity (FP4, int8: recipe) that keeps every measured role within
    the limits, or ``None``: keep the layer in the compute dtype; the layers
    ranked by their error (an :class:`Fp8Advice`). A granularity *fits* a
    role when, in the role's first measured format, at most ``max_clipped``
    of the entries are clipped, at most ``max_flushed`` flushed to zero, and
    the mean relative row error is at most ``max_error``. Each layer gets
    the first of ``granularities`` that fits: by default ``"tensor"``,
    ``"row"``, ``"blockwise"``, ``"mxfp8"`` (the float8 matmul's cost
    order); ``"nvfp4"``, ``"mxfp4"`` for FP4 statistics
    (``fmt="e2m1"``); ``"int8"``, ``"int8_switchback"`` for int8 statistics
    (``fmt="int8"``). A tree mixing float8, FP4 and int8 statistics is
    refused (advise each on its own).

  An option of one kind given with statistics of the other is refused.

  Args:
    grad_stats: the statistics: of the gradients (a tree of
      :class:`TensorStats`, or the gradients themselves), or a tree of
      :class:`Fp8Stats`.
    activation_stats: half precision only: optionally, statistics (or
      values) of the forward pass's intermediate values, measured at loss
      scale 1. (Float8 statistics carry their role: put activations in the
      first argument's tree.)
    by: grouping of the leaves, as in :func:`group_stats` (e.g. ``-1`` for
      parameter modules); for float8 statistics, the layers.
    headroom: half precision: factor (>= 1, default 8) kept between the
      largest scaled gradient and 65504.
    max_underflow: half precision: the share of gradient entries allowed to
      underflow float16 at the recommended scale, in [0, 1] (default 0.01).
    keep_f32_underflow: half precision: the underflow share, in (0, 1]
      (default 0.5), above which a leaf is kept in float32.
    max_clipped: float8: the share of entries a recipe may clip, in [0, 1].
      None (default): 0 for float8 and int8 (current scaling never clips;
      clipping means a stale scale), no limit for FP4 (NVFP4 clips a
      block's largest entry when its E4M3 scale rounds down; the row error
      counts it).
    max_flushed: float8: the share of entries a granularity may flush to
      zero, in [0, 1]. None (default): 1% for float8, no limit for FP4
      (every FP4 block flushes its entries below 1/24 of its largest; the
      row error counts it), 5% for int8 (Gaussian rows flush about 1.2%).
    max_error: float8: the largest mean relative row error; None (default):
      each format's unit roundoff (6.25% for e4m3, 12.5% for e5m2, 25% for
      FP4's e2m1), the most rounding alone can cost a row in the format's
      normal range; 2**-5 (3.125%) for int8, whose error grows with the
      ratio of a row's largest entry to its RMS.
    granularities: float8: the granularities (FP4, int8: recipes) to try,
      cheapest first, a tuple (e.g. without ``"mxfp8"`` on GPUs without
      MXFP8 tensor cores, where it brings no speedup).

  Returns:
    An :class:`Advice` for half-precision statistics, an
    :class:`Fp8Advice` for float8, FP4 or int8 statistics.

  Raises:
    TypeError: on statistics that are traced (call it outside ``jit``), a
      tree mixing :class:`Fp8Stats` with other statistics or values, an
      option of the other kind of statistics (or ``activation_stats`` with
      float8 statistics), or non-numeric settings.
    ValueError: on settings out of range, an unknown or repeated
      granularity, statistics mixing float8, FP4 and int8, or a layer
      whose statistics of one role measured different things.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite import diagnostics
    >>> grads = {"a": jnp.array([1e-12, 1e-3]), "b": jnp.array([1e-30, 1e-14, 1e-2])}
    >>> advice = diagnostics.advise(diagnostics.tensor_stats(grads))
    >>> advice.dtype, advice.f16_loss_scale == 2.0**19
    ('bfloat16', True)
    >>> x = jnp.ones((4, 64)).at[0].set(1e6)     # one row of outliers
    >>> stats = {"dense": diagnostics.fp8_stats(x, "activation")}
    >>> diagnostics.advise(stats).granularity
    {'dense': 'row'}

  See ``docs/diagnostics.md`` (advice; Float8) for the rules in full, the
  limits and the cost order.
  """
  half_options = dict(zip(_HALF_OPTIONS,
                          (headroom, max_underflow, keep_f32_underflow)))
  fp8_options = dict(zip(_FP8_OPTIONS,
                         (max_clipped, max_flushed, max_error, granularities)))
  if _kind_of(grad_stats) == "fp8":
    _misplaced(half_options, _FP8, _HALF, _FP8_OPTIONS)
    if activation_stats is not None:
      raise TypeError(
          f"advise: activation_stats is for {_HALF}; these are {_FP8}, "
          "which carry their role: put every role in the first argument, "
          "e.g. advise({'activation': fp8_stats(acts, 'activation'), "
          "'weight': fp8_stats(params, 'weight')}).")
    given = {k: v for k, v in fp8_options.items() if v is not DEFAULT}
    given.setdefault("granularities", GRANULARITIES)
    return advise_fp8(grad_stats, by=by, **given)
  _misplaced(fp8_options, _HALF, _FP8, _HALF_OPTIONS)
  given = {k: v for k, v in half_options.items() if v is not DEFAULT}
  return advise_half(grad_stats, activation_stats, by=by, **given)
