"""The autocast jaxpr interpreter: ``eval_jaxpr`` with a precision rule per op.

The interpreter evaluates a jaxpr equation by equation, like
``jax.core.eval_jaxpr``, but each value may carry another floating dtype than
the one it was traced with; the rule of each primitive (see ``rules.py``)
decides which dtypes the inputs are cast to before the primitive is bound.
Because it only binds primitives, the result composes with ``jit``, ``grad``,
``vmap`` and every other transformation applied around it.

Higher-order primitives are entered ("recurse") and re-bound with autocast
bodies; how each keeps its type invariants:

* ``jit``/``closed_call``: the body is autocast and re-bound with the
  original parameters (name, shardings, donation); outputs keep the dtypes
  the autocast body gives them.
* ``remat`` (``jax.checkpoint``): re-wrapped with ``jax.checkpoint`` with the
  original ``policy`` and ``prevent_cse``.
* ``scan``/``while``: loop carries stay in their traced dtypes (cast on entry
  and at the end of every iteration); scanned inputs/outputs and loop
  constants flow in whatever dtype they have.
* ``cond``: every branch is autocast; an output on which branches disagree is
  cast to the widest of their dtypes.
* ``custom_jvp``: re-wrapped with ``jax.custom_jvp``: the primal function is
  autocast, and the original JVP rule (as traced by JAX) is evaluated with the
  autocast interpreter, its outputs cast to the primal output dtypes.
* ``custom_vjp``: inputs and outputs keep their traced dtypes at the boundary
  (the user's ``bwd`` was written for them); the primal function and the
  ``fwd`` rule are autocast inside, ``bwd`` runs as written.
* ``shard_map``: re-wrapped with ``jax.shard_map`` with the same mesh, specs
  and ``check_vma``.

Equations traced inside :func:`jmp_lite.in_float32` run with the
``"passthrough"`` rule, and higher-order primitives there are not entered.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax import lax
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree as tree_lib
from jmp_lite._src import compat
from jmp_lite._src.autocast import rules as rules_lib

def _is_disabled(eqn: Any) -> bool:
  """Traced inside a float32 island (``in_float32``): left as traced."""
  return policy_lib.ISLAND_SCOPE in compat.name_stack(eqn)


def _read(env: dict[Any, Any], atom: Any) -> Any:
  if compat.is_literal(atom):
    val = compat.literal_value(atom)
    if getattr(val, "dtype", None) is None and hasattr(atom.aval, "dtype"):
      val = np.asarray(val, atom.aval.dtype)
    return val
  return env[atom]


def cast_all(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
  """Casts floating values to the given dtypes (``None`` keeps the value)."""
  return [
      tree_lib.cast(v, d) if d is not None and tree_lib.is_float(v) else v
      for v, d in zip(values, dtypes)
  ]


def _float_dtypes(avals: Sequence[Any]) -> list[np.dtype | None]:
  """Per aval, its dtype if floating, else None (the value is left alone)."""
  out = []
  for aval in avals:
    dtype = rules_lib.dtype_of(aval)
    out.append(dtype if dtype is not None and tree_lib.is_float(aval) else None)
  return out


class Interpreter:
  """Evaluates jaxprs with autocast rules.

  Args:
    compute_dtype: the low-precision dtype of ``"lower"`` ops.
    rules: the resolved rule table ``{primitive: rule}``.
    accumulate_f32: see ``OpRuleContext.accumulate_f32``.
  """

  def __init__(
      self, compute_dtype: np.dtype, rules: dict[Any, Any], accumulate_f32: bool = True
  ):
    self.compute_dtype = np.dtype(compute_dtype)
    self.rules = rules
    self.accumulate_f32 = accumulate_f32

  def for_tangents(self) -> "Interpreter":
    """The interpreter for custom JVP rules (see ``OpRuleContext.accumulate_f32``)."""
    return Interpreter(self.compute_dtype, self.rules, accumulate_f32=False)

  # -- evaluation ------------------------------------------------------------

  def eval_jaxpr(
      self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
  ) -> list[Any]:
    """Evaluates an open jaxpr; returns its outputs in their autocast dtypes."""
    env: dict[Any, Any] = {}
    weak: set[Any] = set()
    for var, val in compat.bind_inputs(jaxpr, consts, args):
      env[var] = val
      if getattr(var.aval, "weak_type", False):
        weak.add(var)
    for eqn in jaxpr.eqns:
      invals = [_read(env, v) for v in eqn.invars]
      in_weak = tuple(compat.is_literal(v) or v in weak for v in eqn.invars)
      outs = self._eval_eqn(eqn, invals, in_weak)
      if not eqn.primitive.multiple_results:
        outs = [outs]
      out_weak = bool(in_weak) and all(in_weak) and not self._recurses(eqn)
      for var, val in zip(eqn.outvars, outs):
        if compat.is_dropvar(var):
          continue
        env[var] = val
        if out_weak or getattr(var.aval, "weak_type", False):
          weak.add(var)
    return [_read(env, v) for v in jaxpr.outvars]

  def eval_closed(self, closed: Any, args: Sequence[Any]) -> list[Any]:
    return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

  def trace_closed(
      self,
      closed: Any,
      args: Sequence[Any],
      out_dtypes: Sequence[Any] | None = None,
  ) -> Any:
    """The autocast version of ``closed`` for inputs like ``args``.

    Args:
      closed: the traced body.
      args: values (or tracers) whose avals the new jaxpr takes.
      out_dtypes: if given, outputs are cast to these dtypes (None: kept).
    """

    def body(*xs):
      outs = self.eval_closed(closed, xs)
      return outs if out_dtypes is None else cast_all(outs, out_dtypes)

    return jax.make_jaxpr(body)(*args)

  def _rule_for(self, eqn: Any) -> Any:
    if _is_disabled(eqn):
      return "passthrough"
    return self.rules.get(eqn.primitive, "passthrough")

  def _recurses(self, eqn: Any) -> bool:
    return self._rule_for(eqn) == "recurse"

  def _eval_eqn(
      self, eqn: Any, invals: list[Any], in_weak: tuple[bool, ...]
  ) -> Any:
    rule = self._rule_for(eqn)
    ctx = rules_lib.OpRuleContext(
        primitive=eqn.primitive,
        compute_dtype=self.compute_dtype,
        in_avals=tuple(v.aval for v in eqn.invars),
        out_avals=tuple(v.aval for v in eqn.outvars),
        weak=in_weak,
        accumulate_f32=self.accumulate_f32,
        _recurse=self._recurse if eqn.primitive in HIGHER_ORDER else None,
    )
    with compat.equation_context(eqn):
      if isinstance(rule, str):
        return ctx.apply(rule, *invals, **eqn.params)
      return rule(ctx, *invals, **eqn.params)

  def _recurse(self, ctx: rules_lib.OpRuleContext, *args: Any, **params: Any) -> Any:
    return HIGHER_ORDER[ctx.primitive](self, ctx, list(args), params)


# -- higher-order primitives ---------------------------------------------------
#
# Each handler takes (interpreter, ctx, args, params) and returns what binding
# the primitive would; every parameter is read through `compat`.


def _jit(interp: Interpreter, ctx: rules_lib.OpRuleContext, args, params):
  new_body = interp.trace_closed(compat.jit_body(params), args)
  return ctx.bind(*args, **compat.with_jit_body(params, new_body))


def _closed_call(interp, ctx, args, params):
  del ctx  # Inlining a closed_call is equivalent to binding it.
  return interp.eval_closed(compat.closed_call_body(params), args)


def _remat(interp, ctx, args, params):
  # `differentiated` is set by JAX's AD only; jax.checkpoint recomputes it.
  del ctx
  body, prevent_cse, policy = compat.remat_parts(params)

  def run(*xs):
    return interp.eval_jaxpr(compat.open_jaxpr(body), (), xs)

  return jax.checkpoint(run, prevent_cse=prevent_cse, policy=policy)(*args)


def _scan(interp, ctx, args, params):
  body, consts, init, xs = compat.scan_parts(params, args)
  _, _, traced_init, _ = compat.scan_parts(params, ctx.in_avals)
  carry_dtypes = _float_dtypes(traced_init)
  init = cast_all(init, carry_dtypes)
  n_carry = len(init)

  def step(carry, x):
    outs = interp.eval_closed(body, [*consts, *carry, *x])
    return cast_all(outs[:n_carry], carry_dtypes), outs[n_carry:]

  carry, ys = lax.scan(step, init, xs, **compat.scan_options(params))
  return [*carry, *ys]


def _while(interp, ctx, args, params):
  cond, body, cond_consts, body_consts, init = compat.while_parts(params, args)
  *_, traced_init = compat.while_parts(params, ctx.in_avals)
  carry_dtypes = _float_dtypes(traced_init)
  init = cast_all(init, carry_dtypes)

  def cond_fun(carry):
    return interp.eval_closed(cond, [*cond_consts, *carry])[0]

  def body_fun(carry):
    outs = interp.eval_closed(body, [*body_consts, *carry])
    return tuple(cast_all(outs, carry_dtypes))

  return list(lax.while_loop(cond_fun, body_fun, tuple(init)))


def _cond(interp, ctx, args, params):
  del ctx
  index, *operands = args

  def make_branch(closed):
    return lambda *xs: interp.eval_closed(closed, xs)

  fns = [make_branch(b) for b in compat.cond_branches(params)]
  shapes = [jax.eval_shape(fn, *operands) for fn in fns]
  targets = []
  for per_branch in zip(*shapes):
    dtype = np.dtype(per_branch[0].dtype)
    if tree_lib.is_float(per_branch[0]):
      for other in per_branch[1:]:
        dtype = rules_lib.wider(dtype, np.dtype(other.dtype))
    targets.append(dtype)

  def cast_branch(fn):
    return lambda *xs: cast_all(fn(*xs), targets)

  return list(lax.switch(index, [cast_branch(fn) for fn in fns], *operands))


def _zeros_tangent(shape_dtype: Any) -> Any:
  if tree_lib.is_float(shape_dtype) or jax.numpy.issubdtype(
      shape_dtype.dtype, jax.numpy.complexfloating
  ):
    return jax.numpy.zeros(shape_dtype.shape, shape_dtype.dtype)
  return np.zeros(shape_dtype.shape, jax.dtypes.float0)


def _custom_jvp(interp, ctx, args, params):
  call_jaxpr, jvp_thunk, num_consts = compat.custom_jvp_parts(params)
  if jvp_thunk is None:  # A jax with another protocol: run as traced.
    return ctx.apply("passthrough", *args, **params)
  in_avals = ctx.in_avals[num_consts:]
  # Integer/bool inputs have float0 tangents: the rule was traced without them.
  zeros = tuple(
      not jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in in_avals
  )

  def primal(*xs):
    return tuple(interp.eval_closed(call_jaxpr, xs))

  primal.__name__ = primal.__qualname__ = compat.func_name(call_jaxpr, "custom_jvp")
  fn = jax.custom_jvp(primal)
  tangent_interp = interp.for_tangents()

  def jvp(primals, tangents):
    out_types = jax.eval_shape(primal, *primals)
    xs, ts = primals[num_consts:], tangents[num_consts:]
    jvp_jaxpr, jvp_consts, out_zeros = compat.call_jvp_rule(jvp_thunk, zeros)
    nonzero_ts = [t for t, z in zip(ts, zeros) if not z]
    outs = tangent_interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*xs, *nonzero_ts])
    n_out = len(out_zeros)
    out_primals = cast_all(outs[:n_out], [t.dtype for t in out_types])
    nonzero_out_ts = iter(outs[n_out:])
    out_tangents = []
    for zero, out_type in zip(out_zeros, out_types):
      if zero:
        out_tangents.append(_zeros_tangent(out_type))
      else:
        t = next(nonzero_out_ts)
        out_tangents.append(
            tree_lib.cast(t, out_type.dtype) if tree_lib.is_float(t) else t
        )
    return tuple(out_primals), tuple(out_tangents)

  fn.defjvp(jvp)
  return list(fn(*args))


def _autocast_fwd_thunk(interp: Interpreter, thunk: Any) -> Any:
  """Wraps a custom_vjp ``fwd`` jaxpr thunk so the fwd jaxpr is autocast.

  The wrapped jaxpr takes and returns the traced dtypes (residuals included),
  so the user's ``bwd`` sees exactly the types it was written for.
  """
  cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}

  def autocast_thunk(*zeros):
    if zeros not in cache:
      fwd_jaxpr, fwd_consts = compat.call_fwd_rule(thunk, zeros)
      closed = compat.closed_jaxpr(fwd_jaxpr, fwd_consts)
      out_dtypes = _float_dtypes([v.aval for v in fwd_jaxpr.outvars])
      new = interp.trace_closed(closed, [v.aval for v in fwd_jaxpr.invars], out_dtypes)
      cache[zeros] = (new.jaxpr, new.consts)
    return cache[zeros]

  return compat.wrap_init(autocast_thunk, like=thunk)


def _custom_vjp(interp, ctx, args, params):
  call_jaxpr, fwd_thunk = compat.custom_vjp_parts(params)
  in_dtypes = _float_dtypes(ctx.in_avals)
  args = cast_all(args, in_dtypes)
  out_dtypes = _float_dtypes(call_jaxpr.out_avals)
  new_call = interp.trace_closed(call_jaxpr, args, out_dtypes)
  # Without a thunk this jax understands, fwd runs as traced.
  new_thunk = None if fwd_thunk is None else _autocast_fwd_thunk(interp, fwd_thunk)
  return ctx.bind(*args, **compat.with_custom_vjp_parts(params, new_call, new_thunk))


def _shard_map(interp, ctx, args, params):
  del ctx
  body, kwargs = compat.shard_map_parts(params)

  def run(*xs):
    return tuple(interp.eval_jaxpr(compat.open_jaxpr(body), (), xs))

  return list(jax.shard_map(run, **kwargs)(*args))


#: The higher-order primitives autocast enters (rule ``"recurse"``), by
#: attribute name, with the handler that re-binds each with an autocast body.
HIGHER_ORDER_HANDLERS: dict[str, Callable[..., Any]] = {
    "jit_p": _jit,
    "closed_call_p": _closed_call,
    "remat_p": _remat,
    "scan_p": _scan,
    "while_p": _while,
    "cond_p": _cond,
    "custom_jvp_call_p": _custom_jvp,
    "custom_vjp_call_p": _custom_vjp,
    "shard_map_p": _shard_map,
}

#: The one registry of higher-order primitives: ``{primitive: handler}`` for
#: those this jax has. The default rule table and the validation of user rules
#: derive from it.
HIGHER_ORDER: dict[Any, Callable[..., Any]] = {
    prim: handler
    for name, handler in HIGHER_ORDER_HANDLERS.items()
    if (prim := compat.primitive(name)) is not None
}
