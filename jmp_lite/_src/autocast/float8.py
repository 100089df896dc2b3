"""Float8 matmuls in the autocast interpreter: the ``dot_general`` and
``ragged_dot_general`` rules, the default exclusions and the rule table of
``with_policy``'s float8 route.

``autocast`` and ``with_policy`` make float8 matmuls by the interpreter evaluating the traced
program with :func:`fp8_dot_rule` for ``dot_general``: the rule reads the
recipe object in force (``ctx.fp8_config``: the policy's, or the one a
marker's key stands for; never recipe text), leaves the excluded matmuls to its fallback rule, and
otherwise calls :func:`jmp_lite._src.low_precision.fp8_matmul.fp8_dot_general` (float8
operands, float32 accumulation, result in the compute dtype or, under
``with_policy``/Flax, in the dtype the program was traced with). What stays
out of float8 and why: ``docs/fp8.md``. A grouped matmul
(``jax.lax.ragged_dot``, a Mixture-of-Experts layer's experts) goes the same
way through :data:`fp8_ragged_lower` (:data:`fp8_ragged_passthrough`) to
:func:`jmp_lite._src.low_precision.recipe_matmuls.recipe_ragged_dot`, in its basic form only
(:func:`ragged_exclusion`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable

import jax
import numpy as np

from jmp_lite._src import compat
from jmp_lite._src import markers
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.autocast import rules as rules_lib
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import recipe_matmuls as recipe_matmuls_lib

_F32 = np.dtype(np.float32)

#: Why autocast and with_policy refuse delayed scaling, and what to use.
DELAYED_NEEDS_STATE = (
    "{owner}: the recipe {spec!r} uses delayed scaling, whose amax histories "
    "are state that must be carried from step to step, but {owner} returns a "
    "stateless function. Use current scaling ('fp8', 'fp8_rowwise', "
    "'fp8_blockwise', 'mxfp8': as accurate, and what torchao kept), or put "
    "the delayed recipe on a Flax model, whose policies keep the histories "
    "(jmp_lite.linen: the 'fp8_state' collection; jmp_lite.nnx: a "
    "variable of the policy module). docs/fp8.md, delayed scaling."
)
#: Where float8 fallbacks are logged (level DEBUG, once per traced matmul).
logger = logging.getLogger("jmp_lite")

def check_stateless(recipe: config_lib.Fp8Config | None, owner: str) -> None:
  """Refuses a delayed recipe where no state can be kept (autocast, with_policy)."""
  if recipe is not None and recipe.scaling == "delayed":
    raise ValueError(DELAYED_NEEDS_STATE.format(owner=owner,
                                                spec=recipe.spec()))


# -- which matmuls run in float8 -------------------------------------------------


def _dims(avals, dimension_numbers):
  """(M, N, K, has batch dimensions) of a dot_general."""
  (lc, rc), (lb, rb) = dimension_numbers
  lhs, rhs = avals
  k = math.prod(lhs.shape[d] for d in lc)
  m = math.prod(n for d, n in enumerate(lhs.shape) if d not in lc + lb)
  n = math.prod(n for d, n in enumerate(rhs.shape) if d not in rc + rb)
  return m, n, k, bool(lb)


def _quantizable(aval: Any) -> bool:
  """float32, bfloat16 or float16: what a float8 recipe quantizes."""
  if not tree_lib.is_float(aval):
    return False
  return 2 <= np.dtype(aval.dtype).itemsize <= 4


def quantized_already(avals: tuple[Any, ...]) -> bool:
  """A matmul a recipe made already (a nested float8, FP4 or int8 route, or
  a hand call of ``fp8.dot_general``/``int8.dot_general``): an operand in a
  one-byte float format, or two int8 operands (``s8 x s8 -> s32``). It runs
  as written, no fallback."""
  if any(tree_lib.is_float(a) and np.dtype(a.dtype).itemsize == 1
         for a in avals):
    return True
  return len(avals) == 2 and all(
      rules_lib.dtype_of(a) == np.dtype(np.int8) for a in avals)


def exclusion(config: config_lib.Fp8Config, avals: tuple[Any, ...],
              dimension_numbers: Any) -> str | None:
  """Why a ``dot_general`` stays out of float8 under ``config``, or None.

  Excluded: integer, float64 and float8 operands; matmuls with batch
  dimensions (attention scores and their product with the values) unless
  ``include_batched``; matmuls whose K (contracting) or N (the right
  operand's free dimensions: a weight's output features) is not a multiple
  of ``dim_multiple``, or that are empty. M, the left operand's free
  dimensions (tokens, batch: what data parallelism and ``shard_map`` split),
  is not constrained: the float8 GEMM fixes the dimensions of the weight,
  not the rows (``torch._scaled_mm`` checks the same two). The output head
  is excluded by the interpreter, which sees the whole program.
  """
  reason = _operands_reason(avals)
  if reason is not None:
    return reason
  m, n, k, batched = _dims(avals, dimension_numbers)
  if batched and not config.include_batched:
    return "batched matmul (include_batched=False)"
  return _shape_reason(config, m, n, k)


def _operands_reason(operands: tuple[Any, ...]) -> str | None:
  """Why operands are not the two a recipe quantizes (float32, bfloat16 or
  float16), or None."""
  if len(operands) == 2 and all(map(_quantizable, operands)):
    return None
  names = ", ".join(np.dtype(a.dtype).name for a in operands
                    if hasattr(a, "dtype"))
  return f"operands not float32/bfloat16/float16 ({names})"


def _shape_reason(config: Any, m: int, n: int, k: int,
                  empty: bool = False) -> str | None:
  """Why a product of these dimensions stays out of ``config``'s format:
  empty (or ``empty``), or K or N not a multiple of ``dim_multiple``."""
  if empty or m == 0 or n == 0 or k == 0:
    return "empty matmul"
  odd = [f"{name}={d}" for name, d in (("K", k), ("N", n))
         if d % config.dim_multiple]
  if odd:
    return (f"dims not multiple of {config.dim_multiple}: "
            + ", ".join(odd))
  return None


def in_float8(config: config_lib.Fp8Config, avals: tuple[Any, ...],
              dimension_numbers: Any) -> bool:
  """Whether a ``dot_general`` runs in float8 under ``config``'s exclusions
  (:func:`exclusion` finds no reason to keep it out)."""
  return exclusion(config, avals, dimension_numbers) is None


def _batched_excluded(config, avals, dimension_numbers) -> bool:
  """Excluded whatever the shapes: a batched matmul, or no float operands."""
  if len(avals) != 2 or not all(map(_quantizable, avals)):
    return True
  return bool(dimension_numbers[1][0]) and not config.include_batched


# -- the dot_general rule ---------------------------------------------------------


def _rule(fallback: str) -> Callable[..., Any]:
  def fp8_dot_rule(ctx: rules_lib.OpRuleContext, lhs: Any, rhs: Any, *,
                   dimension_numbers: Any, precision: Any = None,
                   preferred_element_type: Any = None, **params: Any) -> Any:
    config = ctx.fp8_config
    reason = ctx._fp8_excluded  # pylint: disable=protected-access
    if quantized_already(ctx.in_avals):  # a nested recipe's product: as is
      config, reason = None, None
    elif config is not None and reason is None:
      reason = exclusion(config, ctx.in_avals, dimension_numbers)
    if config is None or reason is not None:
      call = functools.partial(
          ctx.apply, fallback, lhs, rhs, dimension_numbers=dimension_numbers,
          precision=precision, preferred_element_type=preferred_element_type,
          **params)
      if reason is None:
        return call()  # no float8 recipe here: nothing fell back
      _log_fallback("dot_general", ctx, config, reason)
      with jax.named_scope(markers.fallback_scope(reason)):
        return call()
    # with_policy and the Flax policies: the program stays as traced, its
    # matmuls swapped for float8 ones with the same operand/result dtypes.
    operand_dtypes, out_dtype = _quantized_dtypes(ctx, fallback)
    x, y = (tree_lib.cast(v, d) for v, d in zip((lhs, rhs), operand_dtypes))
    if config.scaling == "delayed":  # no state here: scaled currently
      config = _current(config)
    return recipe_matmuls_lib.recipe_dot_general(
        x, y, dimension_numbers, preferred_element_type=out_dtype,
        config=config, out_sharding=params.get("out_sharding"))

  fp8_dot_rule.__qualname__ = fp8_dot_rule.__name__ = f"fp8_dot_{fallback}"
  return fp8_dot_rule


#: autocast's rule: float8 where a recipe is in force, else "lower".
fp8_dot_lower = _rule("lower")
#: with_policy's and the Flax policies': float8 where a recipe is in force,
#: else the matmul as traced.
fp8_dot_passthrough = _rule("passthrough")


# -- the ragged_dot_general rule ----------------------------------------------------


def _ragged_layout(avals, dnums) -> tuple[tuple[int, int] | None, str | None]:
  """``(lhs permutation, rhs permutation)`` to ``[M, K]`` and ``[G, K, N]``
  of a ``ragged_dot_general`` in the basic grouped form, or why it is not:
  the grouped float8 matmul takes a 2-D lhs ragged along its rows (M), a 3-D
  rhs with one group dimension, one contracting dimension, no batch
  dimensions (``jax.lax.ragged_dot``'s form, either weight layout)."""
  lhs, rhs = avals[:2]
  (lc, rc), (lb, rb) = dnums.dot_dimension_numbers
  ragged, group = dnums.lhs_ragged_dimensions, dnums.rhs_group_dimensions
  if lb or rb:
    return None, ("batched grouped matmul (ragged_dot_general with batch "
                  "dimensions, e.g. under vmap)")
  if any(d in lc for d in ragged):
    return None, ("grouped matmul ragged along its contracting dimension "
                  "(a weight gradient's form)")
  if (lhs.ndim != 2 or rhs.ndim != 3 or len(lc) != 1 or len(group) != 1
      or len(ragged) != 1):
    return None, (f"grouped matmul of rank {lhs.ndim} x {rhs.ndim}: only "
                  "[M, K] x [G, K, N] is quantized")
  lhs_perm = (ragged[0], lc[0])
  rhs_free = [d for d in range(3) if d not in (group[0], rc[0])]
  return (lhs_perm, (group[0], rc[0], *rhs_free)), None


def ragged_exclusion(config: Any, avals: tuple[Any, ...],
                     dnums: Any) -> str | None:
  """Why a ``ragged_dot_general`` stays out of ``config``'s format, or None.

  As :func:`exclusion` for ``dot_general`` (non-float operands, K or N not a
  multiple of ``dim_multiple``, empty products; M, the tokens, is free), and
  every form but the basic one (:func:`_ragged_layout`): a grouped matmul
  ragged along its contracting dimension or with batch dimensions stays in
  the compute dtype with float32 accumulation.
  """
  reason = _operands_reason(avals[:2])
  if reason is not None:
    return reason
  perms, reason = _ragged_layout(avals, dnums)
  if reason is not None:
    return reason
  lhs_perm, rhs_perm = perms
  m, k = (avals[0].shape[d] for d in lhs_perm)
  n = avals[1].shape[rhs_perm[2]]
  return _shape_reason(config, m, n, k,
                       empty=avals[1].shape[rhs_perm[0]] == 0)


def _ragged_rule(fallback: str) -> Callable[..., Any]:
  def fp8_ragged_rule(ctx: rules_lib.OpRuleContext, lhs: Any, rhs: Any,
                      group_sizes: Any, *, ragged_dot_dimension_numbers: Any,
                      **params: Any) -> Any:
    dnums = ragged_dot_dimension_numbers
    config = ctx.fp8_config
    reason = ctx._fp8_excluded  # pylint: disable=protected-access
    if quantized_already(ctx.in_avals[:2]):  # a nested recipe's: as is
      config, reason = None, None
    elif config is not None and reason is None:
      reason = ragged_exclusion(config, ctx.in_avals, dnums)
      if reason is None and params.get("out_sharding") is not None:
        reason = "grouped matmul with an explicit out_sharding"
    if config is None or reason is not None:
      call = functools.partial(
          ctx.apply, fallback, lhs, rhs, group_sizes,
          ragged_dot_dimension_numbers=dnums, **params)
      if reason is None:
        return call()  # no float8 recipe here: nothing fell back
      _log_fallback("ragged_dot_general", ctx, config, reason)
      with jax.named_scope(markers.fallback_scope(reason)):
        return call()
    operand_dtypes, out_dtype = _quantized_dtypes(ctx, fallback)
    x, y = (tree_lib.cast(v, d) for v, d in zip((lhs, rhs), operand_dtypes))
    (lhs_perm, rhs_perm), _ = _ragged_layout(ctx.in_avals, dnums)
    if lhs_perm != (0, 1):
      x = jax.lax.transpose(x, lhs_perm)
    if rhs_perm != (0, 1, 2):  # [G, N, K] (or another order) to [G, K, N]
      y = jax.lax.transpose(y, rhs_perm)
    if config.scaling == "delayed":  # no state here: scaled currently
      config = _current(config)
    return recipe_matmuls_lib.recipe_ragged_dot(
        x, y, group_sizes, config=config, preferred_element_type=out_dtype)

  fp8_ragged_rule.__qualname__ = fp8_ragged_rule.__name__ = (
      f"fp8_ragged_{fallback}")
  return fp8_ragged_rule


#: autocast's grouped-matmul rule: the recipe's grouped matmul where one is
#: in force, else "lower".
fp8_ragged_lower = _ragged_rule("lower")
#: with_policy's: the recipe's grouped matmul where one is in force, else the
#: grouped matmul as traced.
fp8_ragged_passthrough = _ragged_rule("passthrough")


def _quantized_dtypes(ctx: rules_lib.OpRuleContext, fallback: str
                      ) -> tuple[list[np.dtype], np.dtype]:
  """The operand dtypes and the result dtype of a quantized matmul: under
  with_policy and the Flax policies (``"passthrough"``) those the program was
  traced with; under autocast the compute dtype (an explicitly wider traced
  result, bf16 x bf16 -> f32, is kept)."""
  operands = ctx.in_avals[:2]
  traced_out = np.dtype(ctx.out_avals[0].dtype)
  traced_in = {np.dtype(a.dtype) for a in operands}
  if fallback == "passthrough":
    return [np.dtype(a.dtype) for a in operands], traced_out
  out_dtype = traced_out if traced_out not in traced_in else ctx.compute_dtype
  return [ctx.compute_dtype] * 2, out_dtype


def _log_fallback(what: str, ctx: rules_lib.OpRuleContext, config: Any,
                  reason: str) -> None:
  shapes = " x ".join(str(tuple(a.shape)) for a in ctx.in_avals[:2])
  logger.debug("jmp_lite: a %s %s stays out of %s: %s", what, shapes,
               config_lib.format_name(config), reason)


@functools.lru_cache(maxsize=None)
def _current(config: config_lib.Fp8Config) -> config_lib.Fp8Config:
  return dataclasses.replace(config, scaling="current", history_length=None,
                             margin=0.0, amax_algorithm=None)


@functools.lru_cache(maxsize=None)
def passthrough_table() -> dict[Any, Any]:
  """The rule table of ``with_policy``'s float8 route (and the Flax
  policies'): everything as traced but float8 matmuls
  (:data:`fp8_dot_passthrough`); bodies entered, so that markers and the
  policy's recipe reach them."""
  table: dict[Any, Any] = {prim: "recurse" for prim in interpreter_lib.HIGHER_ORDER}
  table.update(fp8_rules(fallback="passthrough"))
  return table


def fp8_rules(fallback: str = "lower") -> dict[Any, Any]:
  """``{primitive: rule}`` of the matmuls a float8/FP4 recipe quantizes:
  ``dot_general`` and (where this jax has it) ``ragged_dot_general``, whose
  rules fall back to ``fallback`` (``"lower"``: autocast's,
  ``"passthrough"``: with_policy's)."""
  rules = {"lower": (fp8_dot_lower, fp8_ragged_lower),
           "passthrough": (fp8_dot_passthrough, fp8_ragged_passthrough)}
  dot_rule, ragged_rule = rules[fallback]
  out = {compat.primitive("dot_general_p"): dot_rule}
  ragged = compat.primitive("ragged_dot_general_p")
  if ragged is not None:
    out[ragged] = ragged_rule
  return out
