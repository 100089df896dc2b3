"""Every JAX and optax internal jmp_lite relies on, and every version branch.

autocast interprets jaxprs, so it depends on things JAX does not promise to keep
stable: ``jax.extend`` and ``jax._src`` names, the parameters of higher-order
primitives (``scan``'s ``num_consts``/``num_carry`` became a ``ft_in`` tree in
jax 0.11; ``shard_map``'s ``manual_axes`` became ``newly_manual_axes`` in
0.10.2) and the jaxpr data structures. The rest of jmp_lite reads a few more
internals: a primitive's output types (``save_half_residuals``), the varying
marking of ``shard_map`` (``pmean_value_and_grad``) and the optax code running
an init (``loss_scaling`` refusing wrappers around it). All of that is read
here and nowhere else in jmp_lite, so that a new JAX or optax release means
changing this file only. Branches serve only versions inside the supported
range (:data:`SUPPORTED_JAX`); older ones are deleted.

Importing this module never fails: a name JAX no longer has is recorded in
:data:`PROBLEMS` and looked up as ``None``; a primitive that is missing is left
out of the rule tables. :func:`require` raises :class:`UnsupportedJaxError`,
naming the installed jax version, when autocast is used on a jax whose
internals it cannot read; policies, loss scaling and everything else in
jmp_lite keep working.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from typing import Any, Callable, Iterator, Sequence

import jax
import jaxlib

#: The jax versions the test matrix covers (the pins in pyproject.toml).
SUPPORTED_JAX = "0.10.0 to 0.12.x"
#: The pip requirement naming that range.
JAX_REQUIREMENT = "jax>=0.10.0,<0.13"
#: The oldest Flax jmp_lite supports (the first that runs on jax 0.10).
FLAX_FLOOR = "0.12.7"

def _release(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


#: Whether this jaxlib's XLA:CPU rounds a float32 -> float8 cast twice
#: (through a narrower float: a value just above a midpoint comes out one code
#: low). jaxlib 0.10.0 does; 0.10.2 is the first release tested to round once
#: (0.10.1, untested, is treated as 0.10.0). Where it does, the float8
#: encodings round on the format's grid in float32 arithmetic first
#: (``fp8.formats.encode``); elsewhere they are the plain cast.
FLOAT8_CAST_ROUNDS_TWICE = _release(jaxlib.__version__) < (0, 10, 2)

#: What could not be found in the installed jax (``"module.name: error"``).
PROBLEMS: list[str] = []


class UnsupportedJaxError(RuntimeError):
  """autocast met a JAX internal it does not know (a newer or older jax)."""


def _load(module: str, name: str | None = None) -> Any:
  """``module.name`` (or the module itself), or None if the jax lacks it."""
  try:
    mod = importlib.import_module(module)
    return mod if name is None else getattr(mod, name)
  except (ImportError, AttributeError) as err:
    PROBLEMS.append(f"{module}{'.' + name if name else ''}: {err}")
    return None


_core = _load("jax.extend.core")
_primitives_module = _load("jax.extend.core.primitives")
_linear_util = _load("jax.extend.linear_util")
_source_info = _load("jax.extend.source_info_util")

Primitive: Any = getattr(_core, "Primitive", None)
Jaxpr: Any = getattr(_core, "Jaxpr", None)
ClosedJaxpr: Any = getattr(_core, "ClosedJaxpr", None)
Literal: Any = getattr(_core, "Literal", None)
#: The abstract value of a jaxpr variable (``jax.core.ShapedArray``).
ShapedArray: Any = getattr(jax.core, "ShapedArray", None)
DropVar: Any = getattr(_core, "DropVar", None)
_jaxprs_in_params = getattr(_core, "jaxprs_in_params", None)

# Primitives that jax keeps outside jax.extend.core.primitives and jax.lax.
_INTERNAL_PRIMITIVES = {
    "shard_map_p": ("jax._src.shard_map",),
    "pvary_p": ("jax._src.core",),
    "psum_invariant_p": ("jax._src.lax.parallel",),
    "reduce_scatter_p": ("jax._src.lax.parallel",),
    # jax's main branch renames closed_call to eval_jaxpr (in jax 0.12 the
    # attribute closed_call_p already holds the primitive named eval_jaxpr).
    "eval_jaxpr_p": ("jax._src.core",),
    # The one primitive of JAX's "hi" (hijax) higher-order operations: its
    # parameter ``_prim`` is an object (RematTraced, CustomJVPTraced,
    # CustomVJPTraced, Scan3...) holding the body. The upgrade flags
    # jax_remat3, jax_custom_jvp3, jax_custom_vjp3 and jax_scan3 trace
    # checkpoint, custom_jvp, custom_vjp and scan to it.
    "call_hi_primitive_p": ("jax._src.hijax",),
    # ``jax.lax.ragged_dot``/``ragged_dot_general`` (grouped matmuls of
    # Mixture-of-Experts layers) bind it; jax 0.10 to 0.12 export only the
    # functions. Missing, autocast leaves grouped matmuls as traced (the
    # compatibility report lists it).
    "ragged_dot_general_p": ("jax._src.lax.lax",),
}

_looked_up: dict[str, Any] = {}


def is_primitive(x: Any) -> bool:
  """Whether ``x`` is a JAX primitive object (e.g. ``jax.lax.exp_p``)."""
  return Primitive is not None and isinstance(x, Primitive)


def primitive(name: str) -> Any:
  """The primitive called ``name`` (``"scan_p"``), or None if this jax lacks it.

  Looks in ``jax.extend.core.primitives``, then ``jax.lax``, then the internal
  modules of :data:`_INTERNAL_PRIMITIVES`.
  """
  if name not in _looked_up:
    found = None
    modules = [_primitives_module, jax.lax]
    modules += [_load_quietly(m) for m in _INTERNAL_PRIMITIVES.get(name, ())]
    for module in modules:
      candidate = getattr(module, name, None)
      if is_primitive(candidate):
        found = candidate
        break
    _looked_up[name] = found
  return _looked_up[name]


def _load_quietly(module: str) -> Any:
  try:
    return importlib.import_module(module)
  except ImportError:
    return None


def primitives(*names: str) -> tuple[Any, ...]:
  """The primitives of ``names`` this jax has, in order; missing ones dropped."""
  return tuple(p for p in map(primitive, names) if p is not None)


def missing_primitives(names: Sequence[str]) -> list[str]:
  """Which of ``names`` the installed jax lacks."""
  return [name for name in names if primitive(name) is None]


def primitive_attribute_names() -> dict[str, str]:
  """``{primitive.name: attribute}`` for ``jax.extend.core.primitives``.

  Used to suggest the object when a user keys a rule by a name string.
  """
  out = {}
  for attr in dir(_primitives_module) if _primitives_module else ():
    prim = getattr(_primitives_module, attr)
    if is_primitive(prim):
      out.setdefault(prim.name, attr)
  return out


def available() -> bool:
  """Whether every internal autocast cannot do without was found."""
  essential = (Primitive, Jaxpr, ClosedJaxpr, Literal, _jaxprs_in_params,
               _linear_util, _source_info)
  return all(x is not None for x in essential)


def require(what: str = "autocast") -> None:
  """Raises :class:`UnsupportedJaxError` if autocast cannot run on this jax."""
  if not available():
    raise unsupported(what, "; ".join(PROBLEMS) or "jax.extend is missing")


def unsupported(what: str, detail: str) -> UnsupportedJaxError:
  """The error for an internal that moved, naming the installed jax."""
  return UnsupportedJaxError(
      f"{what} cannot read the internals of jax {jax.__version__}: {detail}. "
      f"jmp_lite's autocast is tested with jax {SUPPORTED_JAX}; install one of "
      f"those (pip install '{JAX_REQUIREMENT}'), or use jmp_lite.with_policy / "
      "the Flax policies, which do not depend on jax internals."
  )


# -- jaxprs -----------------------------------------------------------------------


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
  """The value of a literal operand, as an array of its aval's dtype."""
  return atom.val


def is_dropvar(var: Any) -> bool:
  return DropVar is not None and isinstance(var, DropVar)


def open_jaxpr(jaxpr: Any) -> Any:
  """The ``Jaxpr`` of a ``ClosedJaxpr`` (a ``Jaxpr`` is returned as is)."""
  return getattr(jaxpr, "jaxpr", jaxpr)


def bind_inputs(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
  """``(var, value)`` for a jaxpr's constants and inputs.

  Released jax keeps constants in ``constvars``; jax's main branch after 0.11
  moves them to the front of ``invars``. Both layouts are handled.
  """
  constvars = list(jaxpr.constvars)
  invars = list(jaxpr.invars)
  if len(constvars) == len(consts):
    yield from zip(constvars, consts)
    yield from zip(invars, args)
  elif not constvars and len(invars) == len(consts) + len(args):
    yield from zip(invars, [*consts, *args])
  else:
    raise unsupported(
        "autocast",
        f"a jaxpr has {len(constvars)} constvars and {len(invars)} invars for "
        f"{len(consts)} constants and {len(args)} arguments",
    )


def closed_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
  return ClosedJaxpr(jaxpr, list(consts))


def sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
  """The jaxprs inside a primitive's parameters (bodies of scan, cond...).

  A "hi" primitive (:func:`hi_operation`) keeps its bodies in the parameters
  of its ``_prim`` object, as jaxprs or as ``jax.stages.Traced`` objects
  (custom_jvp3/custom_vjp3's primal function): those are found too.
  """
  yield from _jaxprs_in_params(params)
  op = hi_operation(params)
  if op is not None:
    inner = dict(getattr(op, "params", None) or {})
    yield from _jaxprs_in_params(inner)
    for value in inner.values():
      if isinstance(value, (Jaxpr, ClosedJaxpr)):
        continue  # found above
      body = getattr(value, "jaxpr", None)
      if Jaxpr is not None and isinstance(body, (Jaxpr, ClosedJaxpr)):
        yield body


def walk_eqns_in_scopes(jaxpr: Any, live_only: bool = False,
                        outer: str = "") -> Iterator[tuple[Any, str]]:
  """:func:`walk_eqns` with each equation's full name stack: a body's
  equations are traced in scopes of their own, here prefixed by those of the
  equation holding the body."""
  jaxpr = open_jaxpr(jaxpr)
  read: set[Any] = set()
  if live_only:
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if not is_literal(v)}
    read.update(v for v in jaxpr.outvars if not is_literal(v))
  for eqn in jaxpr.eqns:
    if live_only and not eqn.effects and not any(v in read for v in eqn.outvars):
      continue
    stack = "/".join(part for part in (outer, name_stack(eqn)) if part)
    yield eqn, stack
    for sub in sub_jaxprs(eqn.params):
      yield from walk_eqns_in_scopes(sub, live_only, stack)


def walk_eqns(jaxpr: Any, live_only: bool = False) -> Iterator[Any]:
  """Every equation of a (closed) jaxpr and its sub-jaxprs, in program order.

  Args:
    jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
    live_only: skip equations that compute nothing anyone reads and have no
      side effects (JAX's AD leaves some; XLA removes them, so they never
      run), and everything inside them.
  """
  for eqn, _ in walk_eqns_in_scopes(jaxpr, live_only):
    yield eqn


def func_name(closed: Any, default: str) -> str:
  """The traced function's name, from the jaxpr's debug info, or ``default``."""
  debug_info = getattr(open_jaxpr(closed), "debug_info", None)
  name = getattr(debug_info, "func_name", None)
  return name if isinstance(name, str) and name.isidentifier() else default


# -- equations ----------------------------------------------------------------------


def name_stack(eqn: Any) -> str:
  """The named scopes an equation was traced in, e.g. ``"jit(f)/block"``."""
  return str(eqn.source_info.name_stack)


@contextlib.contextmanager
def equation_context(eqn: Any):
  """Re-enters an equation's source location, name stack and context manager.

  Operations bound inside keep the user's traceback and named scopes (so
  float32 islands and profiler names survive), and the
  equation's own context (e.g. a ``jax.named_scope`` or sharding context).
  """
  stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with _source_info.user_context(eqn.source_info.traceback, name_stack=stack):
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    with manager if manager is not None else contextlib.nullcontext():
      yield


def bind(primitive_: Any, args: Sequence[Any], params: dict[str, Any]) -> Any:
  """``primitive.bind(*args, **params)`` with a jaxpr equation's params (which
  must go through ``get_bind_params``)."""
  return primitive_.bind(*args, **primitive_.get_bind_params(params))


def wrap_init(fn: Callable[..., Any], like: Any) -> Any:
  """``linear_util.wrap_init`` with the debug info of the thunk ``like``."""
  return _linear_util.wrap_init(fn, debug_info=getattr(like, "debug_info", None))


# -- parameters of higher-order primitives ---------------------------------------


def _param(params: dict[str, Any], *names: str) -> Any:
  for name in names:
    if name in params:
      return params[name]
  raise unsupported("autocast", f"none of the parameters {names} is present "
                    f"(got {sorted(params)})")


def jit_body(params: dict[str, Any]) -> Any:
  return _param(params, "jaxpr", "call_jaxpr")


def with_jit_body(params: dict[str, Any], body: Any) -> dict[str, Any]:
  return {**params, "jaxpr": body}


def closed_call_body(params: dict[str, Any]) -> Any:
  return _param(params, "call_jaxpr", "jaxpr")


def remat_parts(params: dict[str, Any]) -> tuple[Any, bool, Any]:
  """``(body jaxpr, prevent_cse, policy)`` of a ``jax.checkpoint``."""
  return params["jaxpr"], params.get("prevent_cse", True), params.get("policy")


def _group_sizes(params: dict[str, Any], tree_key: str, count_keys: tuple[str, ...]) -> list[int]:
  if tree_key in params:  # jax >= 0.11: a FlatTree of the input groups.
    return [len(group) for group in params[tree_key].unpack()]
  return [_param(params, k) for k in count_keys]


def scan_parts(params: dict[str, Any], args: Sequence[Any]) -> tuple[Any, list[Any], list[Any], list[Any]]:
  """``(body, consts, carry, xs)`` of a ``lax.scan`` equation's inputs."""
  sizes = _group_sizes(params, "ft_in", ("num_consts", "num_carry"))
  n_consts, n_carry = sizes[0], sizes[1]
  args = list(args)
  return (params["jaxpr"], args[:n_consts], args[n_consts:n_consts + n_carry],
          args[n_consts + n_carry:])


def scan_options(params: dict[str, Any]) -> dict[str, Any]:
  """The keyword arguments that re-create the scan with ``lax.scan``."""
  options = {k: params[k] for k in ("length", "reverse", "unroll") if k in params}
  if "_split_transpose" in params:
    options["_split_transpose"] = params["_split_transpose"]
  return options


def while_parts(params: dict[str, Any], args: Sequence[Any]) -> tuple[Any, Any, list[Any], list[Any], list[Any]]:
  """``(cond, body, cond_consts, body_consts, carry)`` of a ``while_loop``."""
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  args = list(args)
  return (params["cond_jaxpr"], params["body_jaxpr"], args[:nc],
          args[nc:nc + nb], args[nc + nb:])


def cond_branches(params: dict[str, Any]) -> Sequence[Any]:
  return params["branches"]


def custom_jvp_parts(params: dict[str, Any]) -> tuple[Any, Any, int]:
  """``(call_jaxpr, jvp rule thunk or None, num_consts)`` of a custom_jvp.

  The thunk is None when this jax uses a protocol autocast does not know;
  the equation then runs as traced.
  """
  thunk = params.get("jvp_jaxpr_fun", params.get("jvp_jaxpr_thunk"))
  if not hasattr(thunk, "call_wrapped"):
    thunk = None
  return params["call_jaxpr"], thunk, params.get("num_consts", 0)


def call_jvp_rule(thunk: Any, zeros: Sequence[bool]) -> tuple[Any, Sequence[Any], Sequence[bool]]:
  """``(jvp jaxpr, consts, which output tangents are zero)`` of a custom_jvp."""
  return thunk.call_wrapped(*zeros)


def custom_vjp_parts(params: dict[str, Any]) -> tuple[Any, Any]:
  """``(call_jaxpr, fwd thunk or None)`` of a custom_vjp."""
  thunk = params.get("fwd_jaxpr_thunk")
  return params["call_jaxpr"], thunk if hasattr(thunk, "call_wrapped") else None


def with_custom_vjp_parts(params: dict[str, Any], call_jaxpr: Any, fwd_thunk: Any) -> dict[str, Any]:
  out = {**params, "call_jaxpr": call_jaxpr}
  if fwd_thunk is not None:
    out["fwd_jaxpr_thunk"] = fwd_thunk
  return out


def call_fwd_rule(thunk: Any, zeros: Sequence[bool]) -> tuple[Any, Sequence[Any]]:
  """``(fwd jaxpr, consts)`` of a custom_vjp's forward rule."""
  return thunk.call_wrapped(*zeros)


def shard_map_parts(params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
  """``(body jaxpr, keyword arguments of jax.shard_map)`` of a shard_map.

  The manual axes are ``newly_manual_axes`` from jax 0.10.2, ``manual_axes``
  in 0.10.0 and 0.10.1.
  """
  kwargs = dict(
      mesh=params["mesh"],
      in_specs=tuple(params["in_specs"]),
      out_specs=tuple(params["out_specs"]),
      axis_names=_param(params, "newly_manual_axes", "manual_axes"),
      check_vma=params["check_vma"],
  )
  return params["jaxpr"], kwargs


# -- "hi" primitives (jax >= 0.12 under its upgrade flags) -------------------------
#
# jax 0.12's upgrade flags (jax_remat3, jax_custom_jvp3, jax_custom_vjp3,
# jax_scan3; about to become the defaults) trace jax.checkpoint, custom_jvp,
# custom_vjp and scan to one primitive, ``call_hi_primitive``, whose parameter
# ``_prim`` is an object of a class per operation. autocast dispatches on
# those classes (objects, never names), read here.

_hijax = _load_quietly("jax._src.hijax")
_ad_checkpoint = _load_quietly("jax._src.ad_checkpoint")
_loops = _load_quietly("jax._src.lax.control_flow.loops")

#: ``{kind: class}`` of the hi operations autocast knows, for this jax.
_HI_CLASSES: dict[str, Any] = {
    kind: cls for kind, cls in (
        ("remat", getattr(_ad_checkpoint, "RematTraced", None)),
        ("custom_jvp", getattr(_hijax, "CustomJVPTraced", None)),
        # jax 0.10/0.11's CustomVJPTraced keeps the user's rules under
        # another protocol (no _custom_vjp_fwd wrapper): not known there.
        ("custom_vjp", getattr(_hijax, "CustomVJPTraced", None)
         if hasattr(_hijax, "_custom_vjp_fwd") else None),
        ("scan", getattr(_loops, "Scan3", None)),
    ) if isinstance(cls, type)
}


def hi_operation(params: dict[str, Any]) -> Any:
  """The ``_prim`` object of a ``call_hi_primitive`` equation, else None."""
  op = params.get("_prim") if isinstance(params, dict) else None
  return None if op is None or isinstance(op, (str, int, float)) else op


def hi_kind(params: dict[str, Any]) -> str | None:
  """Which operation a ``call_hi_primitive`` equation is: ``"remat"``,
  ``"custom_jvp"``, ``"custom_vjp"``, ``"scan"``, or None (unknown)."""
  op = hi_operation(params)
  for kind, cls in _HI_CLASSES.items():
    if isinstance(op, cls):
      return kind
  return None


def hi_name(params: dict[str, Any]) -> str:
  """The class name of a hi operation (``"RematTraced"``), for messages."""
  return type(hi_operation(params)).__name__


def _traced_body(traced: Any) -> Any:
  """The closed jaxpr of a ``jax.stages.Traced`` taking its flat inputs."""
  body = traced.jaxpr
  if body.constvars:
    raise unsupported("autocast", "a traced custom_jvp/custom_vjp body has "
                      f"{len(body.constvars)} constvars")
  return ClosedJaxpr(body, [])


def hi_remat_parts(params: dict[str, Any]) -> tuple[Any, bool, Any]:
  """``(body, prevent_cse, policy)`` of a jax_remat3 ``jax.checkpoint``.

  A per-input ``prevent_cse`` (a tuple, made by JAX's own transformations)
  becomes True if any input asked for it.
  """
  op = hi_operation(params)
  prevent_cse = op.params.get("prevent_cse", True)
  if not isinstance(prevent_cse, bool):
    prevent_cse = any(prevent_cse)
  return op.params["jaxpr"], prevent_cse, op.params.get("policy")


def hi_custom_jvp_parts(params: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
  """``(body, rule, in_tree, out_tree)`` of a jax_custom_jvp3 custom_jvp.

  ``body`` is the primal function's closed jaxpr over the equation's flat
  inputs; ``rule(primals, tangents)`` is the JVP rule on inputs structured
  by ``in_tree`` (the closure's constants first), returning
  ``(outputs, output tangents)`` structured by ``out_tree``.
  """
  op = hi_operation(params)
  return _traced_body(op.traced), op.jvp_rule, op.in_tree, op.out_tree


def hi_custom_vjp_parts(
    params: dict[str, Any]) -> tuple[Any, Any, Any, Any, int]:
  """``(body, fwd, bwd, in_tree, n_leading)`` of a jax_custom_vjp3 custom_vjp.

  ``fwd(nonzeros, *args)`` and ``bwd(residuals, out_cotangent)`` are the
  rules on inputs structured by ``in_tree``; ``bwd`` returns ``(cotangents
  of the user's arguments, logs)``; the first ``n_leading`` flat inputs are
  the closure's constants (zero cotangents).
  """
  op = hi_operation(params)
  if op.params.get("with_logs") or op.params.get("bwd_accums") is not None:
    raise unsupported("autocast", "a custom_vjp with backward-pass logs or "
                      "accumulators (defvjp_with_logs/defvjp_with_accums)")
  children = op.in_tree.children()
  n_leading = children[0].num_leaves + children[1].num_leaves
  return _traced_body(op.traced), op.fwd, op.bwd, op.in_tree, n_leading


# -- outside autocast -----------------------------------------------------------


def out_avals(primitive_: Any, avals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
  """The output abstract values a primitive gives for ``avals``.

  ``abstract_eval`` returns ``(avals, effects)`` throughout the supported range.
  """
  out, _ = primitive_.abstract_eval(*avals, **params)
  return list(out) if isinstance(out, (list, tuple)) else [out]


def to_varying(x: Any, axis_name: Any) -> Any:
  """``x`` marked as varying over the ``shard_map`` axis ``axis_name``
  (``lax.pcast(..., to="varying")``).

  A no-op under ``pmap`` and ``shard_map(check_vma=False)``; values that are
  already varying, and axes that are not shard_map axes (``vmap``'s), are left
  as they are.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  # Only shard_map's manual mesh axes have varying types: a vmap axis of the
  # same name (jit of vmap) would fail pcast's batching rule.
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
  names = tuple(n for n in names if n in manual)
  if not names:
    return x
  try:
    return jax.lax.pcast(x, names, to="varying")
  except ValueError:
    return x


def varying_like(fn: Any) -> Any:
  """``fn`` whose result varies over every ``shard_map`` axis its operands
  vary over.

  For the GPU branch of ``lax.platform_dependent``: ``custom_vmap`` (and some
  GPU-only primitives) drop that type, and both branches must agree with the
  emulation's.
  """

  def wrapped(*args):
    return vary_over(fn(*args), frozenset().union(*map(varying_axes, args)))

  return wrapped


def all_gather_invariant(x: Any, axis_name: Any) -> Any:
  """``lax.all_gather(x, axis_name, tiled=True)``, typed as the same on every
  device of a ``shard_map`` axis (so that ``out_specs=P()`` accepts it):
  JAX's internal ``all_gather_invariant`` (``jax._src.lax.parallel``: public
  name in jax 0.10, ``_all_gather_invariant`` in 0.12). Where ``x`` does not
  vary over ``axis_name`` by type (``pmap``, ``vmap``, ``shard_map(
  check_vma=False)``), the plain ``lax.all_gather``."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not set(names) & varying_axes(x):
    return jax.lax.all_gather(x, axis_name, tiled=True)
  parallel = _load_quietly("jax._src.lax.parallel")
  gather = (getattr(parallel, "all_gather_invariant", None) or
            getattr(parallel, "_all_gather_invariant", None))
  if gather is None:
    raise UnsupportedJaxError(
        f"jmp_lite cannot gather a value as invariant over a shard_map axis "
        f"with jax {jax.__version__} (jax._src.lax.parallel."
        f"all_gather_invariant is missing): pmean_value_and_grad's narrow "
        f"wire formats need it. Use wire_format='float32', or install a jax "
        f"jmp_lite is tested with (pip install '{JAX_REQUIREMENT}').")
  return gather(x, axis_name, axis=0, tiled=True)


def vary_over(x: Any, axes: frozenset) -> Any:
  """``x`` marked varying over each of the ``shard_map`` ``axes`` it does not
  vary over yet (``x`` itself where there is none)."""
  missing = tuple(sorted(axes - varying_axes(x)))
  return to_varying(x, missing) if missing else x


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` axes ``x`` varies over (empty outside ``shard_map``).

  jax 0.10 and 0.12 keep them in ``aval.manual_axis_type.varying``; earlier
  versions in ``aval.vma``.
  """
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def bound_axis_names() -> tuple[Any, ...]:
  """The mapped axes bound where this runs, outermost first: those of every
  enclosing ``pmap`` (an unnamed one's internal name too), ``shard_map``
  (its manual axes) and ``vmap`` with an ``axis_name``; empty under
  ``jax.jit`` alone, whose sharded arrays are global.

  JAX's axis environment (``jax._src.core.get_axis_env``, the same in
  jax 0.10 to 0.12), not the Python call stack.
  """
  core = _load_quietly("jax._src.core")
  get_env = getattr(core, "get_axis_env", None)
  sizes = getattr(get_env(), "axis_sizes", None) if get_env else None
  if sizes is None:
    raise UnsupportedJaxError(
        f"jmp_lite cannot read the mapped axes in force from jax "
        f"{jax.__version__} (jax._src.core.get_axis_env().axis_sizes is "
        f"missing): a float8 delayed-scaling recipe without axis_name needs "
        f"them. Install a jax jmp_lite is tested with (pip install "
        f"'{JAX_REQUIREMENT}'), or give the recipe its axis_name.")
  return tuple(sizes)



# -- explicit sharding (sharding in types) ---------------------------------------
#
# ``jax.make_mesh`` makes Explicit axes by default: an array's type carries its
# sharding and every operation must be able to say how its result is sharded
# (a block reshape across a sharded axis, a gather, a contraction over a
# sharded axis may not). The quantizers and the low-bit state codes are
# written once, for JAX's partitioner: under Explicit axes they run inside
# ``jax.sharding.auto_axes`` (public since before jax 0.10), partitioned as
# under Auto axes, with their results typed as the caller says.


def explicit_axes(*xs: Any) -> tuple[Any, tuple[str, ...]]:
  """``(mesh, names)``: the abstract mesh in the sharding types of ``xs``
  (or, where they have none, the one ``jax.set_mesh`` sets) and the names of
  its Explicit axes (empty under Auto axes, inside ``shard_map``'s Manual
  axes, or without a mesh)."""
  mesh = None
  for x in jax.tree.leaves(xs):
    candidate = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if candidate is not None and not getattr(candidate, "empty", True):
      mesh = candidate
      break
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  explicit = jax.sharding.AxisType.Explicit
  names = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == explicit)
  return mesh, names


def spec_for_shape(x: Any, shape: Sequence[int]) -> Any:
  """``x``'s ``PartitionSpec`` for an array of ``shape`` (as many axes as
  ``x``): each axis sharded as ``x``'s where the mesh axes divide its length
  (Explicit types shard evenly), unsharded elsewhere. None where ``x``'s type
  names no mesh (nothing to type)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  entries = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  out = []
  for entry, n in zip(entries, shape):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    ways = math.prod(sizes.get(name, 1) for name in names)
    out.append(entry if ways > 1 and n % ways == 0 else None)
  return jax.sharding.PartitionSpec(*out)


def partitioned_as_auto(fn: Callable[..., Any], out_specs: Any,
                        *args: Any) -> Any:
  """``fn(*args)``, partitioned by JAX as under Auto axes.

  Where ``args`` are typed on a mesh with Explicit axes (or ``jax.set_mesh``
  set one), ``fn`` runs inside ``jax.sharding.auto_axes`` over those axes:
  its operations (reshapes into blocks, gathers, contractions over sharded
  axes) need not say how their results are sharded, the compiled program is
  the one the same arrays give under Auto axes, and its results are typed
  with ``out_specs`` (a ``PartitionSpec`` per result, as ``fn``'s result
  tree, or one for every result below it: a tree prefix). Elsewhere (no mesh, Auto axes, inside ``shard_map``), or where
  ``out_specs`` is None (operands whose types name no mesh), it is
  ``fn(*args)``.
  """
  mesh, axes = explicit_axes(*args)
  if not axes or out_specs is None:
    return fn(*args)
  spec_type = jax.sharding.PartitionSpec
  shardings = jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(mesh, spec), out_specs,
      is_leaf=lambda s: isinstance(s, spec_type))
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=shardings)(*args)
