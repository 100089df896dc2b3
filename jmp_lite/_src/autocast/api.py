"""The public ``autocast`` transformation."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree as tree_lib
from jmp_lite._src import compat
from jmp_lite._src import markers
from jmp_lite._src.autocast import float8 as float8_lib
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.autocast import default_rules as table_lib

#: What autocast applies.
AUTOCAST_TARGET = (
    "a floating compute dtype (float16, bfloat16, float32 or float64, or a "
    "name such as 'f16' / 'bf16'), a Policy, or a policy spec such as "
    "'mixed_bfloat16'"
)
#: What a function autocast traces must do.
UNTRACEABLE = (
    "it must be traceable by jax.jit (no Python control flow on array values "
    "-- use jnp.where/lax.cond -- and no conversion of traced arrays to NumPy "
    "or Python values). Pass values that drive Python control flow as Python "
    "scalars (they are static), or move that code outside autocast."
)

_TRACING_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _resolve_policy(policy_or_dtype: Any) -> policy_lib.Policy:
  """The policy whose compute dtype and matmul precision autocast applies.

  A bare compute dtype (``jnp.float16``, ``"bf16"``) is the mixed policy with
  that compute dtype, like the ``mixed_float16`` / ``mixed_bfloat16`` presets.
  """
  if isinstance(policy_or_dtype, policy_lib.Policy):
    return policy_or_dtype
  if isinstance(policy_or_dtype, str):
    text = policy_or_dtype.strip().lower()
    if "=" in text or text in policy_lib.PRESETS:
      return policy_lib.get_policy(policy_or_dtype)
  try:
    compute = dtypes.canonical_dtype(policy_or_dtype, "compute dtype")
  except (TypeError, ValueError) as err:
    raise type(err)(f"autocast needs {AUTOCAST_TARGET}; got "
                    f"{policy_or_dtype!r}. {err}") from None
  wide = dtypes.at_least_f32(compute)
  return policy_lib.Policy(wide, compute, wide)


def _is_dynamic(leaf: Any) -> bool:
  """Leaves autocast traces as arrays; everything else is static config."""
  return checks.is_array(leaf)


def autocast(
    fn: Callable[..., Any],
    policy_or_dtype: Any,
    *,
    op_rules: Mapping[Any, Any] | None = None,
    enabled: bool = True,
) -> Callable[..., Any]:
  """Operation-level mixed precision, like ``torch.autocast``, for any JAX function.

  The returned function traces ``fn`` to a jaxpr and evaluates it with a
  precision rule per primitive: matmuls and convolutions in the compute dtype
  (accumulating in float32), numerically sensitive operations (exp/log,
  powers, sums, ...) in float32, everything else in the dtype its inputs
  arrive in; bodies of ``jit``, ``checkpoint``, ``scan``, ``cond``,
  ``while_loop``, ``custom_jvp``/``custom_vjp`` and ``shard_map`` too. It
  never changes ``fn``'s interface: inputs are not cast and floating outputs
  leave in the dtypes ``fn`` returns. Of a policy it uses the compute dtype and
  the matmul precision; with a float8 recipe (``"mixed_fp8"``,
  ``"c=bf16,m=fp8_rowwise"``) the matmuls run in float8, but for the
  defaults' exclusions (the output head, batched matmuls such as attention
  scores, a Mixture-of-Experts layer's router and combine, shapes that are
  not multiples of 16: ``docs/fp8.md``); grouped matmuls
  (``jax.lax.ragged_dot``) are matmuls too. Array leaves of the arguments are traced, every other
  leaf is static; wrap the train step in ``jax.jit`` so the trace happens once.
  Guide, op lists next to torch's, limitations: ``docs/autocast.md``.

  Args:
    fn: a function ``jax.jit`` could trace (a Flax ``model.apply``, a loss).
    policy_or_dtype: the compute dtype (``jnp.float16``, ``"bf16"``...) or a
      ``Policy`` / policy spec (``"mixed_bfloat16"``, ``"tf32"``).
    op_rules: optional ``{primitive: rule}`` overrides (a mapping, or
      ``(primitive, rule)`` pairs) merged over
      ``jmp_lite.autocast_rules.DEFAULT_OP_RULES``; a rule is one of
      ``OP_RULE_NAMES`` or a callable ``rule(ctx, *args, **params)``.
    enabled: ``False`` returns a wrapper that calls ``fn`` unchanged (a
      config flag). Regions inside ``fn`` stay float32 with
      :func:`jmp_lite.in_float32`.

  Returns:
    A function with the same signature as ``fn``.

  Raises:
    TypeError: if ``fn`` is not callable, an ``op_rules`` key is not a
      primitive object, or (when called) ``fn`` cannot be traced.
    ValueError: if the compute dtype is not floating, a rule name is
      unknown, or the policy's float8 recipe uses delayed scaling (which
      needs state: the Flax policies keep it).

  Example:
    >>> import jax, jax.numpy as jnp, jmp_lite
    >>> def layer(w, x):
    ...   return jax.nn.softmax(x @ w)
    >>> f = jmp_lite.autocast(layer, jnp.float16)
    >>> w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    >>> f(w, x).dtype                       # same output dtype as layer
    dtype('float32')
    >>> [op for op in jmp_lite.op_dtypes(f, w, x) if op[0] in ("dot_general", "exp")]
    [('dot_general', ('float16', 'float16')), ('exp', ('float32',))]
  """
  checks.function(fn, "autocast",
                  "a callable (e.g. model.apply or a loss function)")
  policy = _resolve_policy(policy_or_dtype)
  enabled = checks.flag(enabled, "enabled", "autocast")
  fp8 = policy.fp8_recipe is not None
  if fp8:
    float8_lib.check_stateless(policy.fp8_recipe, "jmp_lite.autocast")
  if enabled:
    # On a jax whose internals autocast cannot read, only autocast fails.
    compat.require("jmp_lite.autocast")
  if compat.available():
    op_rules = dict(op_rules or {})  # a mapping, or (primitive, rule) pairs
    table = table_lib.resolve_rules(op_rules)
    if fp8:
      # Float8 matmuls (dense and grouped) where the recipe is in force; a
      # user's own rule for one of them wins over the recipe.
      table.update({prim: rule for prim, rule in float8_lib.fp8_rules().items()
                    if prim not in op_rules})

  if not enabled:

    @functools.wraps(fn)
    def passthrough(*args, **kwargs):
      return fn(*args, **kwargs)

    return passthrough

  interp = interpreter_lib.Interpreter(
      policy.compute_dtype, table, fp8=fp8,
      region=policy.fp8_recipe)
  name = getattr(fn, "__qualname__", None) or repr(fn)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    flat_fn, dynamic = interpreter_lib.split_static(fn, args, kwargs)
    try:
      with policy.matmul_context():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
    except _TRACING_ERRORS as err:
      raise TypeError(f"autocast could not trace {name}: {UNTRACEABLE}\n"
                      f"{err}") from err
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    outs = interp.eval_closed(closed, dynamic)
    targets = [
        np.dtype(s.dtype) if tree_lib.is_float(s) else None
        for s in out_leaves
    ]
    outs = interpreter_lib.cast_all(outs, targets)
    return jax.tree.unflatten(out_tree, outs)

  return wrapped


class OpDtypes(tuple):
  """One entry of :func:`op_dtypes`: ``(primitive name, input dtypes)``.

  A plain 2-tuple (it unpacks and compares as one) with an attribute
  ``note``: for a ``dot_general`` (or a grouped ``ragged_dot_general``) a
  float8 or FP4 recipe left out of its format, why
  (``"output head (include_output_head=False)"``, ``"batched matmul
  (include_batched=False)"``, ``"dims not multiple of 16: K=24"``...), else
  None. The note shows in the repr.
  """

  note: str | None

  def __new__(cls, name: str, dtypes_: tuple[str, ...],
              note: str | None = None) -> "OpDtypes":
    self = super().__new__(cls, (name, dtypes_))
    self.note = note
    return self

  def __repr__(self) -> str:
    text = tuple.__repr__(self)
    return text if self.note is None else f"{text[:-1]}, note={self.note!r})"


def op_dtypes(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> list[tuple[str, tuple[str, ...]]]:
  """Lists the floating input dtypes of every operation ``fn`` runs.

  A debugging aid for autocast (the JAX analogue of printing ``.dtype``
  inside a ``torch.autocast`` region): traces ``fn(*args, **kwargs)`` with
  ``jax.make_jaxpr`` and walks every equation, sub-jaxprs of ``jit``,
  ``scan``, ``cond``, ``custom_jvp``... included, in program order.
  Equations whose results nothing reads (JAX's AD leaves a few; XLA removes
  them, so they never run) are left out.

  Args:
    fn: any traceable function, e.g. one returned by :func:`autocast`.
    *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``);
      other leaves (strings, Python scalars, ``mutable=[...]``) are static.
    **kwargs: its keyword arguments, split the same way.

  Returns:
    A list of ``(primitive name, (dtype name, ...))`` pairs, one per equation,
    listing the dtypes of its floating inputs (for a ``dot_general`` or
    ``ragged_dot_general``, its two operands' floating or integer dtypes
    (an int8 recipe's product shows as ``('int8', 'int8')``)). One that a
    float8, FP4 or int8 recipe left out of its format carries the reason in the
    pair's ``note`` attribute (shown in its repr; ``docs/fp8.md``, what stays
    out of float8); a debug record of the logger ``"jmp_lite"`` says the
    same, naming the format ("stays out of NVFP4: ...") when the matmul is
    traced.

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> f = jmp_lite.autocast(lambda x: jnp.exp(x @ x), jnp.bfloat16)
    >>> [op for op in jmp_lite.op_dtypes(f, jnp.ones((2, 2))) if op[0] in ("dot_general", "exp")]
    [('dot_general', ('bfloat16', 'bfloat16')), ('exp', ('float32',))]
  """
  checks.function(fn, "op_dtypes", "a callable first, whose operations it "
                  "lists: jmp_lite.op_dtypes(fn, *args), e.g. "
                  "op_dtypes(jmp_lite.autocast(f, 'bf16'), x)")
  compat.require("jmp_lite.op_dtypes")
  flat_fn, dynamic = interpreter_lib.split_static(
      fn,
      args,
      kwargs,
      lambda x: _is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct),
  )
  closed = jax.make_jaxpr(flat_fn)(*dynamic)
  matmuls = {compat.primitive("dot_general_p"),
             compat.primitive("ragged_dot_general_p")} - {None}
  return [
      OpDtypes(
          eqn.primitive.name,
          _listed_dtypes(eqn, eqn.primitive in matmuls),
          markers.fallback_reason(stack) if eqn.primitive in matmuls
          else None,
      )
      for eqn, stack in compat.walk_eqns_in_scopes(closed, live_only=True)
  ]


def _listed_dtypes(eqn: Any, matmul: bool) -> tuple[str, ...]:
  """The dtype names :func:`op_dtypes` lists for an equation: its floating
  inputs; for a matmul, its two operands' floating or integer dtypes, so
  that an int8 product shows as ``('int8', 'int8')`` (a grouped matmul's
  group sizes are not operands)."""
  def listed(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return tree_lib.is_float(aval) or (
        matmul and dtype is not None
        and jax.dtypes.issubdtype(dtype, np.integer))
  operands = eqn.invars[:2] if matmul else eqn.invars
  return tuple(np.dtype(v.aval.dtype).name for v in operands
               if listed(v.aval))
