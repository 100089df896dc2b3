"""A rematerialisation policy that keeps backward-pass residuals in half
precision (why and what it costs: ``docs/precision.md``, memory)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_lite._src import compat

#: save_half_residuals called as something other than a checkpoint policy.
NOT_A_PRIMITIVE = (
    "save_half_residuals is a jax.checkpoint policy, which JAX calls with "
    "each primitive of the function; it got {got}. Pass it as the policy, "
    "without calling it: jax.checkpoint(loss_fn, "
    "policy=jmp_lite.save_half_residuals) (it is not a decorator of its own)."
)


def save_half_residuals(prim: Any, *avals: Any, **params: Any) -> bool:
  """``jax.checkpoint`` policy: save half-precision values only.

  An operation's outputs are saved for the backward pass when all of them are
  float16/bfloat16 arrays; everything else (float32 norm statistics, softmax,
  masks, constants) is recomputed from the saved values, and an operation
  whose output types cannot be inferred is recomputed too, which is always
  correct. Use it with half-precision compute:
  ``jax.checkpoint(loss_fn, policy=jmp_lite.save_half_residuals)``. Guide:
  ``docs/precision.md`` (memory).

  Args:
    prim: the primitive (given by ``jax.checkpoint``).
    *avals: its input abstract values.
    **params: its parameters.

  Returns:
    Whether the primitive's outputs may be saved.

  Raises:
    TypeError: if ``prim`` is not a JAX primitive (the policy was called by
      hand or used as a decorator).

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def loss(w, x):
    ...   h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
    ...   return jnp.sum(jax.nn.softmax(h))
    >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    >>> def saved_dtypes(fn):  # dtypes of what jax.vjp keeps, beyond w and x
    ...   _, f_vjp = jax.vjp(fn, w, x)
    ...   leaves = jax.tree.leaves(f_vjp)
    ...   return sorted({str(r.dtype) for r in leaves if r.ndim and r is not w and r is not x})
    >>> saved_dtypes(loss)
    ['float16', 'float32']
    >>> saved_dtypes(jax.checkpoint(loss, policy=jmp_lite.save_half_residuals))
    ['float16']
  """
  # (On a jax whose internals compat cannot read, the check is skipped.)
  if compat.Primitive is not None and not compat.is_primitive(prim):
    raise TypeError(NOT_A_PRIMITIVE.format(got=f"{type(prim).__name__}: {prim!r}"))
  if getattr(prim, "name", None) in _FREE:
    return False
  try:
    outs = compat.out_avals(prim, avals, params)
  except Exception:  # pylint: disable=broad-except
    return False
  return bool(outs) and all(
      np.dtype(getattr(out, "dtype", np.float32)) in _HALF for out in outs
  )


# Half-precision floating dtypes whose values are worth saving.
_HALF = frozenset({np.dtype(jnp.float16), np.dtype(jnp.bfloat16)})
# Operations that cost nothing to redo (a broadcast of a scalar, an iota).
_FREE = frozenset({"broadcast_in_dim", "iota"})
