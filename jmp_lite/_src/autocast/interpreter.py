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
  the autocast body gives them. Every call of one traced ``jit`` body with
  the same input types binds the same autocast body object (one evaluation
  keeps a memo), so JAX's lowering emits one function for them all, as it
  does for the original program, instead of one per call site.
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

**Float8 regions** (``fp8=True``: a float8 recipe is in force somewhere). The
recipe of each ``dot_general`` is a recipe object: the one of the innermost
float8 marker in its name stack (``jmp_lite.fp8[<key>]``, a key into the
registry of :mod:`jmp_lite._src.markers`, never recipe text), else the
region the interpreter carries (the policy's recipe object, handed over by
``autocast``/``with_policy``; a higher-order equation hands the recipe in
force at it down to its bodies). The output head -- a ``dot_general`` from
which no other one is reachable, at the top level of the traced program or in
a non-loop body of it -- runs with no recipe. A Mixture-of-Experts layer's
gating matmuls run with no recipe either, unless it says
``include_moe_gating`` (:class:`_GatingFlow`): the router, a ``dot_general``
whose scores pick experts, and the combine, a ``dot_general`` with the gate
weights. The interpreter keeps no
state: a delayed recipe (which ``autocast`` and ``with_policy`` refuse, and a
marker may still name) is scaled currently.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import markers
from jmp_lite._src import tree as tree_lib
from jmp_lite._src import compat
from jmp_lite._src.autocast import rules as rules_lib

_DOT = compat.primitive("dot_general_p")
_RAGGED = compat.primitive("ragged_dot_general_p")
_MATMULS = frozenset(p for p in (_DOT, _RAGGED) if p is not None)
#: The operations by which a router's scores pick experts.
_SELECTIONS = frozenset(compat.primitives(
    "top_k_p", "approx_top_k_p", "argmax_p", "sort_p"))
#: The fallback notes of a Mixture-of-Experts layer's gating matmuls.
MOE_ROUTER = "MoE router (include_moe_gating=False)"
MOE_COMBINE = "MoE combine (include_moe_gating=False)"

def _is_disabled(eqn: Any) -> bool:
  """Traced inside a float32 island (``in_float32``): left as traced."""
  return markers.in_island(compat.name_stack(eqn))


def _is_quantized_dot(eqn: Any, region: Any) -> bool:
  """A ``dot_general`` float8 would quantize under the recipe in force there
  (whatever its shapes), or one in float8 or int8 already (a nested recipe's
  product): batched matmuls float8 leaves alone (attention, a cross-entropy
  written as an einsum) and other integer or float64 operands do not count.
  A grouped matmul (``ragged_dot_general``) in the form float8 quantizes
  counts too (no dense matmul before it is the output head)."""
  if eqn.primitive not in _MATMULS:
    return False
  avals = [v.aval for v in eqn.invars[:2]]
  if len(avals) == 2 and all(rules_lib.dtype_of(a) == np.dtype(np.int8)
                             for a in avals):
    return True  # an int8 recipe's s8 x s8 product (a nested int8 route)
  if len(avals) != 2 or not all(
      tree_lib.is_float(a) and 1 <= np.dtype(a.dtype).itemsize <= 4
      for a in avals):
    return False
  if any(np.dtype(a.dtype).itemsize == 1 for a in avals):
    return True  # quantized already (its batch dimension is its own)
  if eqn.primitive is _RAGGED:
    dnums = eqn.params["ragged_dot_dimension_numbers"]
    (contracting, _), (batch, _) = dnums.dot_dimension_numbers
    return not batch and not set(dnums.lhs_ragged_dimensions) & set(contracting)
  if not eqn.params["dimension_numbers"][1][0]:
    return True
  recipe = markers.marked_recipe(compat.name_stack(eqn), region)
  return recipe is not None and recipe.include_batched


def _contains_dot(eqn: Any, region: Any) -> bool:
  if _is_quantized_dot(eqn, region):
    return True
  return any(_is_quantized_dot(e, region)
             for sub in compat.sub_jaxprs(eqn.params)
             for e in compat.walk_eqns(sub))


def _dot_sinks(jaxpr: Any, region: Any = None) -> set[int]:
  """Equations holding a float8 candidate ``dot_general`` from which no later
  one is reachable (see :func:`_is_quantized_dot`)."""
  feeds_dot: set[Any] = set()
  sinks: set[int] = set()
  for index in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[index]
    feeds = any(v in feeds_dot for v in eqn.outvars)
    has_dot = _contains_dot(eqn, region)
    if has_dot and not feeds:
      sinks.add(index)
    if has_dot or feeds:
      feeds_dot.update(v for v in eqn.invars if not compat.is_literal(v))
  return sinks


_NONE: frozenset = frozenset()


class _GatingFlow:
  """Finds the gating matmuls of Mixture-of-Experts layers, by dataflow.

  One forward pass over a jaxpr and every body in it (a body's inputs are
  its equation's where they correspond one to one: ``jit``, ``remat``,
  ``custom_jvp``/``custom_vjp``, ``scan``, ``shard_map``, ``cond``'s
  branches; elsewhere a body is searched on its own). Each floating value
  carries the matmuls (``dot_general``, ``ragged_dot_general``) it derives
  from through floating non-matmul operations (elementwise ops, softmax,
  reshapes, gathers...: a matmul's result starts afresh), and each value,
  integer or not, the routers whose choice it derives from. Then:

  * the **router** is a ``dot_general`` whose scores reach a selection
    (``top_k``, ``approx_top_k``, ``argmax``, ``sort``) whose result (expert
    indices, gate values) then reaches a matmul -- so an ``argmax`` of the
    output head's logits (an accuracy metric) makes no router;
  * the **combine** is a ``dot_general`` with an operand computed from the
    routers' scores alone (the gate weights, e.g. ``top_k``'s values or a
    gather of the probabilities, scattered into a combine matrix). A dispatch
    matmul whose one-hot operand comes from the expert indices alone
    (integers) is no combine; one whose mask is cast from the gate weights
    counts as one.
  """

  def __init__(self):
    self.seen: dict[int, Any] = {}        # id(jaxpr) -> jaxpr searched
    self._dots: dict[int, Any] = {}       # id(eqn) -> dot_general eqn
    self._operands: dict[int, list[frozenset]] = {}
    self._reach: set[int] = set()          # dots whose scores reach a selection
    self._routing: set[int] = set()        # dots whose choice reaches a matmul

  def roles(self) -> dict[int, tuple[Any, str]]:
    """``{id(eqn): (eqn, MOE_ROUTER or MOE_COMBINE)}``."""
    routers = {d for d in self._reach & self._routing if d in self._dots}
    out = {d: (self._dots[d], MOE_ROUTER) for d in routers}
    for d, operands in self._operands.items():
      if d not in routers and routers and any(
          src and src <= routers for src in operands):
        out[d] = (self._dots[d], MOE_COMBINE)
    return out

  def run(self, jaxpr: Any, inputs: Sequence[Any] | None = None) -> list[Any]:
    """The ``(matmuls, routers)`` of each output of ``jaxpr`` given those of
    its inputs (none: nothing)."""
    jaxpr = compat.open_jaxpr(jaxpr)
    self.seen[id(jaxpr)] = jaxpr
    empty = (_NONE, _NONE)
    env: dict[Any, Any] = {}
    if inputs is not None:
      env.update(zip(jaxpr.invars, inputs))
    read = lambda v: empty if compat.is_literal(v) else env.get(v, empty)
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      floats = [src for (src, _), v in zip(ins, eqn.invars)
                if tree_lib.is_float(v.aval)]
      src = frozenset().union(*floats)
      chosen = frozenset().union(*(sel for _, sel in ins))
      if eqn.primitive in _MATMULS:
        self._routing.update(chosen)
        if eqn.primitive is _DOT:
          self._dots[id(eqn)] = eqn
          self._operands[id(eqn)] = floats
        outs = [(frozenset({id(eqn)}), _NONE)] * len(eqn.outvars)
      elif eqn.primitive in _SELECTIONS:
        self._reach.update(src)
        outs = [(src if tree_lib.is_float(v.aval) else _NONE, chosen | src)
                for v in eqn.outvars]
      else:
        outs = (self._through_bodies(eqn, ins) if eqn.primitive in HIGHER_ORDER
                else None)
        if outs is None:
          outs = [(src if tree_lib.is_float(v.aval) else _NONE, chosen)
                  for v in eqn.outvars]
      for var, out in zip(eqn.outvars, outs):
        env[var] = out
    return [read(v) for v in jaxpr.outvars]

  def _through_bodies(self, eqn: Any, ins: list[Any]) -> list[Any] | None:
    """The outputs of a higher-order equation through its bodies, or None
    where no body corresponds to it one to one (searched on their own)."""
    mapped = []
    for body in compat.sub_jaxprs(eqn.params):
      body = compat.open_jaxpr(body)
      n_in, n_out = len(body.invars), len(body.outvars)
      if n_out == len(eqn.outvars) and n_in in (len(ins), len(ins) - 1):
        # cond's branches take its operands after the branch index.
        mapped.append(self.run(body, ins[len(ins) - n_in:]))
      else:
        self.run(body)
    if not mapped:
      return None
    return [(frozenset().union(*(m[i][0] for m in mapped)),
             frozenset().union(*(m[i][1] for m in mapped)))
            for i in range(len(eqn.outvars))]


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


def run_as_traced(fn: Callable[..., Any], args: tuple, kwargs: dict,
                  compute_dtype: Any, table: Any, region: Any = None) -> Any:
  """``fn(*args, **kwargs)`` evaluated by an :class:`Interpreter` with
  ``table`` and float8 regions (``region``: the recipe outside every
  marker), its floating outputs cast back to the dtypes ``fn`` traced them
  with. Array leaves of the arguments are traced, every other leaf is
  static. What ``with_policy``'s float8 route and the linen policies'
  grouped-matmul route run."""
  flat_fn, dynamic = split_static(fn, args, kwargs)
  closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
  interp = Interpreter(compute_dtype, table, fp8=True, region=region)
  outs = interp.eval_closed(closed, dynamic)
  leaves, treedef = jax.tree.flatten(out_shape)
  outs = cast_all(outs, [np.dtype(v.dtype) if tree_lib.is_float(v) else None
                         for v in leaves])
  return jax.tree.unflatten(treedef, outs)


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
    fp8: whether float8 regions are possible (markers are read, the output
      head is found); False keeps the plain autocast path untouched.
    region: the float8 recipe (``Fp8Config``) in force where no marker says
      otherwise, or None.
    tail: whether nothing after the evaluated jaxpr reaches a
      ``dot_general`` (its last matmul is then the output head).
  """

  def __init__(
      self, compute_dtype: np.dtype, rules: dict[Any, Any],
      accumulate_f32: bool = True, *, fp8: bool = False, region: Any = None,
      tail: bool = True,
  ):
    self.compute_dtype = np.dtype(compute_dtype)
    self.rules = rules
    self.accumulate_f32 = accumulate_f32
    self.fp8 = fp8
    self.region = region
    self.tail = tail
    # Shared by an interpreter and its children: the autocast bodies of the
    # `jit` equations of the evaluation in progress (see `_jit`), and how
    # deep evaluations are nested (the memo is dropped when the outermost
    # one returns, so it never outlives a trace).
    self._memo: dict[Any, tuple[Any, Any]] = {}
    self._depth = [0]
    # Also shared, and dropped with the memo: the jaxprs searched for MoE
    # gating matmuls and their roles (see `_gating_roles`).
    self._gating: list[Any] = [{}, {}]

  def child(self, **changes: Any) -> "Interpreter":
    """A copy with some attributes changed (for a body, a JVP rule...)."""
    attrs = dict(compute_dtype=self.compute_dtype, rules=self.rules,
                 accumulate_f32=self.accumulate_f32, fp8=self.fp8,
                 region=self.region, tail=self.tail)
    attrs.update(changes)
    new = Interpreter(**attrs)
    new._memo, new._depth, new._gating = self._memo, self._depth, self._gating
    return new

  def memo_key(self, closed: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """What the autocast version of ``closed`` for ``args`` depends on."""
    return (id(closed), self.compute_dtype, self.accumulate_f32, self.fp8,
            self.region, self.tail,
            tuple((np.shape(x), rules_lib.dtype_of(x),
                   bool(getattr(getattr(x, "aval", None), "weak_type", False)))
                  for x in args))

  def traced_once(self, closed: Any, args: Sequence[Any]) -> Any:
    """:meth:`trace_closed`, memoized for the evaluation in progress.

    The memo holds ``closed`` itself next to its autocast version, so an id
    is never reused while its entry lives.
    """
    key = self.memo_key(closed, args)
    hit = self._memo.get(key)
    if hit is not None and hit[0] is closed:
      return hit[1]
    new = self.trace_closed(closed, args)
    self._memo[key] = (closed, new)
    return new

  def for_tangents(self) -> "Interpreter":
    """The interpreter for custom JVP rules (see ``OpRuleContext.accumulate_f32``)."""
    return self.child(accumulate_f32=False)

  # -- evaluation ------------------------------------------------------------

  def eval_jaxpr(
      self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
  ) -> list[Any]:
    """Evaluates an open jaxpr; returns its outputs in their autocast dtypes."""
    self._depth[0] += 1
    try:
      return self._eval_jaxpr(jaxpr, consts, args)
    finally:
      self._depth[0] -= 1
      if not self._depth[0]:
        self._memo.clear()
        for table in self._gating:
          table.clear()

  def _eval_jaxpr(
      self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
  ) -> list[Any]:
    env: dict[Any, Any] = {}
    weak: set[Any] = set()
    for var, val in compat.bind_inputs(jaxpr, consts, args):
      env[var] = val
      if getattr(var.aval, "weak_type", False):
        weak.add(var)
    sinks = (_dot_sinks(jaxpr, self.region) if self.fp8 and self.tail
             else set())
    if self.fp8:
      self._gating_roles(jaxpr)
    for index, eqn in enumerate(jaxpr.eqns):
      invals = [_read(env, v) for v in eqn.invars]
      in_weak = tuple(compat.is_literal(v) or v in weak for v in eqn.invars)
      outs = self._eval_eqn(eqn, invals, in_weak, index in sinks)
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

  def _gating_roles(self, jaxpr: Any) -> None:
    """Searches ``jaxpr`` (and its bodies) for MoE gating matmuls, unless a
    search from an enclosing jaxpr covered it already (which also saw where
    its inputs come from)."""
    seen, roles = self._gating
    if seen.get(id(jaxpr)) is jaxpr:
      return
    flow = _GatingFlow()
    flow.run(jaxpr)
    seen.update(flow.seen)
    roles.update(flow.roles())

  def _gating_role(self, eqn: Any) -> str | None:
    """:data:`MOE_ROUTER`, :data:`MOE_COMBINE` or None for an equation."""
    eqn_and_role = self._gating[1].get(id(eqn))
    return None if eqn_and_role is None or eqn_and_role[0] is not eqn else (
        eqn_and_role[1])

  def _rule_for(self, eqn: Any) -> Any:
    if _is_disabled(eqn):
      return "passthrough"
    return self.rules.get(eqn.primitive, "passthrough")

  def _recurses(self, eqn: Any) -> bool:
    return self._rule_for(eqn) == "recurse"

  def _eval_eqn(
      self, eqn: Any, invals: list[Any], in_weak: tuple[bool, ...],
      is_sink: bool = False,
  ) -> Any:
    rule = self._rule_for(eqn)
    recipe, recurse, excluded = None, None, None
    if self.fp8:
      recipe = markers.marked_recipe(compat.name_stack(eqn), self.region)
      if eqn.primitive is _DOT and recipe is not None:
        if is_sink and not recipe.include_output_head:
          # The output head stays in the compute dtype (the rule names the
          # recipe's format in its fallback record).
          excluded = "output head (include_output_head=False)"
        elif not recipe.include_moe_gating:
          # A MoE layer's router and combine, as DeepSeek-V3 keeps them.
          excluded = self._gating_role(eqn)
    if eqn.primitive in HIGHER_ORDER:
      recurse = self._child_for(eqn, recipe, is_sink)._recurse
    elif eqn.primitive not in self.rules and not _is_disabled(eqn):
      _refuse_unknown(eqn.primitive, eqn.params)
    ctx = rules_lib.OpRuleContext(
        primitive=eqn.primitive,
        compute_dtype=self.compute_dtype,
        in_avals=tuple(v.aval for v in eqn.invars),
        out_avals=tuple(v.aval for v in eqn.outvars),
        weak=in_weak,
        accumulate_f32=self.accumulate_f32,
        fp8_config=recipe,
        _recurse=recurse,
        _fp8_excluded=excluded,
    )
    with compat.equation_context(eqn):
      if isinstance(rule, str):
        return ctx.apply(rule, *invals, **eqn.params)
      return rule(ctx, *invals, **eqn.params)

  def _child_for(self, eqn: Any, recipe: Any,
                 is_sink: bool) -> "Interpreter":
    """The interpreter of a higher-order equation's bodies."""
    if not self.fp8:
      return self
    tail = self.tail and is_sink and kind_of(eqn) not in _LOOPS
    return self.child(region=recipe, tail=tail)

  def _recurse(self, ctx: rules_lib.OpRuleContext, *args: Any, **params: Any) -> Any:
    return HIGHER_ORDER[ctx.primitive](self, ctx, list(args), params)


# Loops (whose last matmul is no output head: it feeds the next iteration).
_LOOPS = frozenset({"scan", "while"})

#: Why autocast stops at a higher-order primitive it does not know.
UNKNOWN_HIGHER_ORDER = (
    "jmp_lite.autocast: the program contains {what}, a higher-order "
    "operation (its parameters hold a jaxpr) that autocast does not know how "
    "to enter. Binding it as traced would silently leave its body in the "
    "traced precision (float8 regions and autocast's op rules would not "
    "reach it), so autocast refuses it. jax {version}; autocast enters {known}. "
    "To run it as traced, wrap the call in jmp_lite.in_float32 (a float32 "
    "island autocast leaves alone), or give it a rule of your own: "
    "autocast(fn, policy, op_rules={{<its primitive object>: 'passthrough'}}) "
    "(or a callable rule). docs/autocast.md, limitations."
)

#: The kinds of higher-order operation autocast enters.
_KNOWN_KINDS = ("jit", "closed_call/eval_jaxpr", "checkpoint (remat)", "scan",
                "while_loop", "cond", "custom_jvp", "custom_vjp", "shard_map")


def _refuse_unknown(primitive: Any, params: Any, holding: str = "") -> None:
  """Raises the teaching error for an unknown higher-order operation (one
  whose parameters hold a jaxpr); returns for a first-order one."""
  if primitive in rules_lib.FIRST_ORDER_WITH_JAXPRS:
    return  # scalar combiners (reduce, scatter...): no body to autocast
  if not any(True for _ in compat.sub_jaxprs(params)):
    return
  raise ValueError(UNKNOWN_HIGHER_ORDER.format(
      what=f"the primitive {primitive.name!r}{holding}",
      version=jax.__version__, known=", ".join(_KNOWN_KINDS)))


def kind_of(eqn: Any) -> str | None:
  """Which higher-order operation an equation is (``"remat"``, ``"scan"``...).

  A "hi" primitive (jax 0.12's upgrade flags) is the kind of its operation;
  None for an equation autocast does not enter.
  """
  name = HIGHER_ORDER_NAMES.get(eqn.primitive)
  if name == "call_hi_primitive_p":
    return compat.hi_kind(eqn.params)
  return _KIND_OF_NAME.get(name)


def split_static(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    is_dynamic: Callable[[Any], bool] = checks.is_array,
) -> tuple[Callable[..., Any], list[Any]]:
  """Splits a call into a function of its array leaves and those leaves.

  Every other leaf (strings, Python scalars, Flax's ``mutable=[...]``) is
  closed over, as if static for ``jax.jit``.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic_idx = [i for i, leaf in enumerate(leaves) if is_dynamic(leaf)]

  def flat_fn(*dynamic):
    full = list(leaves)
    for i, value in zip(dynamic_idx, dynamic):
      full[i] = value
    call_args, call_kwargs = jax.tree.unflatten(treedef, full)
    return fn(*call_args, **call_kwargs)

  return flat_fn, [leaves[i] for i in dynamic_idx]



# -- higher-order primitives ---------------------------------------------------
#
# Each handler takes (interpreter, ctx, args, params) and returns what binding
# the primitive would; every parameter is read through `compat`.


def _jit(interp: Interpreter, ctx: rules_lib.OpRuleContext, args, params):
  # One autocast body per traced body and input types: re-bound calls of one
  # jitted function then share a function in the lowered program.
  new_body = interp.traced_once(compat.jit_body(params), args)
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


def _remat3(interp, ctx, args, params):
  """``jax.checkpoint`` under jax_remat3: the same as :func:`_remat`."""
  body, prevent_cse, policy = compat.hi_remat_parts(params)
  return _remat(interp, ctx, args, {"jaxpr": body, "prevent_cse": prevent_cse,
                                    "policy": policy})


def _custom_jvp3(interp, ctx, args, params):
  """``jax.custom_jvp`` under jax_custom_jvp3, as :func:`_custom_jvp`.

  The primal body is autocast; the JVP rule (a Python function of
  structured inputs here) is traced on the primals and tangents and
  evaluated by the tangent interpreter; outputs take the traced dtypes.
  """
  body, rule, in_tree, _ = compat.hi_custom_jvp_parts(params)
  out_dtypes = [np.dtype(a.dtype) for a in body.out_avals]

  def primal(*xs):
    # The traced dtypes: JAX checks the rule's primal outputs against them.
    return tuple(cast_all(interp.eval_closed(body, xs), out_dtypes))

  primal.__name__ = primal.__qualname__ = compat.func_name(body, "custom_jvp")
  fn = jax.custom_jvp(primal)
  tangent_interp = interp.for_tangents()

  def flat_rule(primals, tangents):
    outs, out_tangents = rule(jax.tree.unflatten(in_tree, primals),
                              jax.tree.unflatten(in_tree, tangents))
    return jax.tree.leaves(outs), jax.tree.leaves(out_tangents)

  # The rule is traced on the traced types (JAX checks its primal outputs
  # against them) and evaluated by the interpreter on the autocast values.
  primal_types = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       weak_type=getattr(a, "weak_type", False))
                  for a in ctx.in_avals]
  tangent_types = [
      jax.ShapeDtypeStruct(a.shape, a.dtype if jax.numpy.issubdtype(
          a.dtype, jax.numpy.inexact) else jax.dtypes.float0)
      for a in ctx.in_avals]

  def jvp(primals, tangents):
    closed = jax.make_jaxpr(flat_rule)(primal_types, tangent_types)
    outs = tangent_interp.eval_closed(closed, [*primals, *tangents])
    n_out = len(out_dtypes)
    if len(outs) != 2 * n_out:
      raise compat.unsupported("autocast", "a custom_jvp rule returned "
                               f"{len(outs) - n_out} tangents for {n_out} "
                               "outputs")
    out_primals = cast_all(outs[:n_out], out_dtypes)
    out_tangents = [
        tree_lib.cast(t, d) if tree_lib.is_float(t) else t
        for t, d in zip(outs[n_out:], out_dtypes)
    ]
    return tuple(out_primals), tuple(out_tangents)

  fn.defjvp(jvp)
  return list(fn(*args))


def _flat_cotangents(in_tree: Any, in_cts: Any) -> list[Any]:
  """One cotangent per flat input after the closure's constants (None where
  there is none), from a jax_custom_vjp3 bwd rule's cotangents per user
  argument: an argument's cotangent may be None or JAX's symbolic zero (an
  integer input's), which have no leaves and would be dropped by
  ``jax.tree.leaves``, shifting every later cotangent."""
  out: list[Any] = []
  for tree, ct in zip(in_tree.children()[2:], in_cts):
    if not jax.tree.leaves(ct):   # None, a symbolic zero: zeros
      out += [None] * tree.num_leaves
    else:
      out += tree.flatten_up_to(ct)
  return out


def _custom_vjp3(interp, ctx, args, params):
  """``jax.custom_vjp`` under jax_custom_vjp3, as :func:`_custom_vjp`.

  Inputs and outputs keep their traced dtypes at the boundary; the primal
  body and the ``fwd`` rule are autocast (residuals leave in their traced
  dtypes); ``bwd`` runs as written.
  """
  body, fwd_rule, bwd_rule, in_tree, n_leading = (
      compat.hi_custom_vjp_parts(params))
  in_dtypes = _float_dtypes(ctx.in_avals)
  args = cast_all(args, in_dtypes)
  out_dtypes = _float_dtypes(body.out_avals)
  n_out = len(out_dtypes)
  res_tree: list[Any] = []
  out_tree: list[Any] = []

  def primal(*xs):
    return tuple(cast_all(interp.eval_closed(body, xs), out_dtypes))

  primal.__name__ = primal.__qualname__ = compat.func_name(body, "custom_vjp")
  fn = jax.custom_vjp(primal)

  def flat_fwd(*xs):
    structured = jax.tree.unflatten(in_tree, xs)
    nonzeros = jax.tree.map(lambda _: True, structured)
    out, res = fwd_rule(nonzeros, *structured)
    res_leaves, tree = jax.tree.flatten(res)
    res_tree[:] = [tree]
    # The rules' own output structure (jax 0.12.0: the bare output; 0.12.1:
    # a list), which bwd_rule takes its cotangents in.
    out_tree[:] = [jax.tree.structure(out)]
    return [*jax.tree.leaves(out), *res_leaves]

  def fwd(*xs):
    closed = jax.make_jaxpr(flat_fwd)(*xs)
    outs = cast_all(interp.eval_closed(closed, xs),
                    _float_dtypes(closed.out_avals))
    return tuple(outs[:n_out]), outs[n_out:]

  def bwd(res_leaves, cts):
    res = jax.tree.unflatten(res_tree[0], res_leaves)
    in_cts, _ = bwd_rule(res, jax.tree.unflatten(out_tree[0], list(cts)))
    flat_cts = _flat_cotangents(in_tree, in_cts)
    out = []
    for i, (x, aval) in enumerate(zip(args, ctx.in_avals)):
      ct = flat_cts[i - n_leading] if i >= n_leading else None
      if not checks.is_array(ct):
        ct = _zeros_tangent(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
      out.append(ct)
    return tuple(out)

  fn.defvjp(fwd, bwd)
  return list(fn(*args))


_SCAN3 = (" (traced so under the flag jax_scan3, which JAX itself cannot "
          "differentiate yet; turn the flag off)")
_HI_HANDLERS = {"remat": _remat3, "custom_jvp": _custom_jvp3,
                "custom_vjp": _custom_vjp3}


def _hi(interp, ctx, args, params):
  """A "hi" primitive (jax 0.12's upgrade flags): by its operation's class."""
  handler = _HI_HANDLERS.get(compat.hi_kind(params))
  if handler is None:
    _refuse_unknown(ctx.primitive, params, f" holding {compat.hi_name(params)}"
                    + (_SCAN3 if compat.hi_kind(params) == "scan" else ""))
    # A first-order hi operation (jnp.frexp's Frexp): as traced.
    return ctx.apply("passthrough", *args, **params)
  return handler(interp, ctx, args, params)


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
    # jax's main branch names closed_call eval_jaxpr (the same object here).
    "eval_jaxpr_p": _closed_call,
    "call_hi_primitive_p": _hi,
}

_KIND_OF_NAME = {
    "jit_p": "jit", "closed_call_p": "closed_call",
    "eval_jaxpr_p": "closed_call", "remat_p": "remat", "scan_p": "scan",
    "while_p": "while", "cond_p": "cond", "custom_jvp_call_p": "custom_jvp",
    "custom_vjp_call_p": "custom_vjp", "shard_map_p": "shard_map",
}

#: The one registry of higher-order primitives: ``{primitive: handler}`` for
#: those this jax has. The default rule table and the validation of user rules
#: derive from it.
HIGHER_ORDER: dict[Any, Callable[..., Any]] = {
    prim: handler
    for name, handler in HIGHER_ORDER_HANDLERS.items()
    if (prim := compat.primitive(name)) is not None
}
#: ``{primitive: attribute name}`` of the same registry.
HIGHER_ORDER_NAMES: dict[Any, str] = {
    prim: name
    for name in HIGHER_ORDER_HANDLERS
    if (prim := compat.primitive(name)) is not None
}
