"""Static measurements of a program: residual bytes and matmul/conv FLOPs.

Neither runs the model: both trace it.

* :func:`residual_bytes` is the memory the backward pass keeps alive: the
  arrays ``jax.vjp`` saves in its closure, less the function's own inputs.
* :func:`matmul_flops` counts the FLOPs of every ``dot_general``,
  ``ragged_dot_general`` (grouped matmuls) and ``conv_general_dilated`` in a jaxpr (sub-jaxprs included, scan bodies
  multiplied by their length), grouped by the dtype of the operands.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

HALF_DTYPES = ("float16", "bfloat16")
MATMUL_PRIMITIVES = ("dot_general", "ragged_dot_general", "conv_general_dilated")


# --- residuals --------------------------------------------------------------------


def residual_bytes(fn: Callable[[Any], jax.Array], params: Any, exclude: Any = ()) -> dict[str, Any]:
  """Bytes of the residuals ``jax.vjp(fn, params)`` saves for the backward pass.

  The residuals are the array leaves of the VJP closure, found by tracing
  (``jax.eval_shape``, nothing is computed). What counts: every saved array
  except ``params`` themselves and the arrays in ``exclude`` (the batch, batch
  statistics: anything that exists whether or not a backward pass follows).
  Half-precision copies of the params made by a policy *do* count: they are
  extra memory the backward pass holds.

  Args:
    fn: a scalar function of ``params`` (close over the batch).
    params: the pytree to differentiate with respect to.
    exclude: a pytree of further arrays ``fn`` closes over that do not count.

  Returns:
    ``{"bytes": total, "count": number of arrays, "by_dtype": {dtype: bytes},
    "param_copy_bytes": ..., "activation_bytes": ...}``; the param copies are
    the half-precision residuals with the shape of a param (matched one to
    one, a heuristic: an activation of exactly a weight's shape would be
    counted as a copy), the activations everything else.
  """
  excluded = jax.tree_util.tree_leaves(exclude)

  def saved(p):
    _, f_vjp = jax.vjp(fn, p)
    inputs = {id(x) for x in jax.tree_util.tree_leaves(p)} | {id(x) for x in excluded}
    return [x for x in jax.tree_util.tree_leaves(f_vjp)
            if hasattr(x, "dtype") and id(x) not in inputs]

  leaves = jax.eval_shape(saved, params)
  param_shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(params)]
  by_dtype: dict[str, int] = {}
  param_copies = 0
  for leaf in leaves:
    nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    by_dtype[str(leaf.dtype)] = by_dtype.get(str(leaf.dtype), 0) + nbytes
    if str(leaf.dtype) in HALF_DTYPES and tuple(leaf.shape) in param_shapes:
      param_shapes.remove(tuple(leaf.shape))
      param_copies += nbytes
  total = sum(by_dtype.values())
  return {"bytes": total, "count": len(leaves),
          "param_copy_bytes": param_copies,
          "activation_bytes": total - param_copies,
          "by_dtype": dict(sorted(by_dtype.items()))}


# --- FLOPs ------------------------------------------------------------------------


def _dot_flops(eqn) -> int:
  lhs = eqn.invars[0].aval
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  contract = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
  out = int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
  # Every output element (batch dims included) is a dot product of length contract.
  return 2 * out * contract


def _ragged_dot_flops(eqn) -> int:
  """``2 x lhs size x the right operand's free size``: every left element meets
  each free column of its group's right operand once. Right for the three
  ragged modes: non-contracting ``[m, k] x [g, k, n]`` (``2mkn``, the group
  dimension is not free), contracting (the weight gradient ``[k, m] x [m, n]
  -> [g, k, n]``: ``2kmn``, each token in one group) and batch."""
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  dn = eqn.params["ragged_dot_dimension_numbers"]
  (_, rhs_contract), (_, rhs_batch) = dn.dot_dimension_numbers
  shared = set(rhs_contract) | set(rhs_batch) | set(dn.rhs_group_dimensions)
  free = int(np.prod([d for i, d in enumerate(rhs.shape) if i not in shared], dtype=np.int64))
  return 2 * int(np.prod(lhs.shape, dtype=np.int64)) * free


def _conv_flops(eqn) -> int:
  rhs = eqn.invars[1].aval
  dn = eqn.params["dimension_numbers"]
  out = int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
  spatial = int(np.prod([rhs.shape[d] for d in dn.rhs_spec[2:]], dtype=np.int64))
  in_features = rhs.shape[dn.rhs_spec[1]]
  # Output elements x (kernel window x input features per group) multiply-adds.
  return 2 * out * spatial * in_features


def _walk(jaxpr, multiplier: int, totals: dict[str, int]) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in MATMUL_PRIMITIVES:
      flops = {"dot_general": _dot_flops, "ragged_dot_general": _ragged_dot_flops,
               "conv_general_dilated": _conv_flops}[name](eqn)
      # The operands (not ragged_dot_general's integer group sizes).
      dtypes = sorted({str(v.aval.dtype) for v in eqn.invars[:2]})
      key = dtypes[0] if len(dtypes) == 1 else "+".join(dtypes)
      totals[key] = totals.get(key, 0) + multiplier * flops
      continue
    inner = multiplier * int(eqn.params.get("length", 1)) if name == "scan" else multiplier
    if name == "cond":
      # Branches are alternatives: count the most expensive one.
      branch_totals = []
      for branch in eqn.params["branches"]:
        t: dict[str, int] = {}
        _walk(getattr(branch, "jaxpr", branch), inner, t)
        branch_totals.append(t)
      best = max(branch_totals, key=lambda t: sum(t.values()), default={})
      for k, v in best.items():
        totals[k] = totals.get(k, 0) + v
      continue
    # The bodies of jit, remat, custom_jvp/vjp, while, scan (public jax.extend API).
    for sub in jax_core.jaxprs_in_params(eqn.params):
      _walk(getattr(sub, "jaxpr", sub), inner, totals)


def matmul_flops(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
  """Matmul and convolution FLOPs of ``fn(*args)``, by operand dtype.

  Walks the jaxpr of ``fn`` (``jax.make_jaxpr``; for a train step this is the
  forward pass, the backward pass and the update) including the bodies of
  ``jit``, ``custom_jvp``/``custom_vjp``, ``remat``, ``while`` (counted once)
  and ``scan`` (times its length); of a ``cond`` the costliest branch. A
  ``dot_general`` on an ``(m, k) x (k, n)`` pair is ``2mkn`` FLOPs; a
  convolution ``2 x output elements x kernel window x input features``
  (per feature group); a ``ragged_dot_general`` (``jax.lax.ragged_dot``:
  ``[m, k] x [g, k, n]``) ``2mkn``, as the per-group loop of dense matmuls. An operation counts as half precision when all its
  operands are float16 or bfloat16.

  Returns:
    ``{"total": flops, "half": flops, "half_share": half / total,
    "by_dtype": {operand dtypes: flops}}``.
  """
  jaxpr = jax.make_jaxpr(fn)(*args)
  totals: dict[str, int] = {}
  _walk(jaxpr.jaxpr, 1, totals)
  total = sum(totals.values())
  half = sum(v for k, v in totals.items() if k in HALF_DTYPES)
  return {"total": total, "half": half,
          "half_share": half / total if total else None,
          "by_dtype": dict(sorted(totals.items()))}
