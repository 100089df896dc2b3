"""The public ``autocast`` transformation."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree as tree_lib
from jmp_lite._src import compat
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.autocast import rules as rules_lib
from jmp_lite._src.autocast import table as table_lib

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
  if policy_or_dtype is None:
    raise TypeError(
        "autocast needs a compute dtype (e.g. jnp.float16, jnp.bfloat16, 'bf16')"
        " or a Policy / policy spec (e.g. 'mixed_bfloat16'); got None."
    )
  if isinstance(policy_or_dtype, policy_lib.Policy):
    return policy_or_dtype
  if isinstance(policy_or_dtype, str):
    text = policy_or_dtype.strip().lower()
    if "=" in text or text in policy_lib.PRESETS:
      return policy_lib.get_policy(policy_or_dtype)
  try:
    compute = dtypes.canonical_dtype(policy_or_dtype, "compute dtype")
  except (TypeError, ValueError) as err:
    raise type(err)(
        "autocast needs a floating compute dtype (float16, bfloat16, float32 "
        "or float64, or a name such as 'f16' / 'bf16'), a Policy, or a policy "
        f"spec such as 'mixed_bfloat16'; got {policy_or_dtype!r}. {err}"
    ) from None
  wide = dtypes.at_least_f32(compute)
  return policy_lib.Policy(wide, compute, wide)


def _is_dynamic(leaf: Any) -> bool:
  """Leaves autocast traces as arrays; everything else is static config."""
  return tree_lib.is_array(leaf)


def autocast(
    fn: Callable[..., Any],
    policy_or_dtype: Any,
    *,
    rules: Mapping[Any, Any] | None = None,
    enabled: bool = True,
) -> Callable[..., Any]:
  """Operation-level mixed precision, like ``torch.autocast``, for any JAX function.

  The returned function traces ``fn`` to a jaxpr on every call and evaluates it
  with a precision rule per primitive: matmuls and convolutions run in the
  compute dtype (accumulating in float32), numerically sensitive operations
  (exp/log, powers, rsqrt, erf, sums and cumulative sums, ...) in float32,
  mixed-dtype operations in the widest input dtype, and everything else in the
  dtype its inputs arrive in. Softmax, log-softmax and layer/RMS norm
  decompose into those pieces and so run in float32, without touching the
  model. Bodies of nested ``jit``, ``jax.checkpoint``, ``scan``, ``cond``,
  ``while_loop``, ``custom_jvp``/``custom_vjp`` and ``shard_map`` are autocast
  too. The default tables and their differences from ``torch.autocast`` are in
  ``docs/autocast.md``; ``jmp_lite.autocast_rules`` holds them.

  autocast changes what happens inside ``fn``, never its interface, whether
  given a dtype or a policy: inputs are not cast (cast params with a
  ``Policy`` if you store them in half), and floating outputs leave in the
  dtypes ``fn`` returns them in -- a float32 loss stays a float32 loss, an
  explicit ``.astype(jnp.bfloat16)`` on an output is kept -- so the autocast
  function can replace ``fn`` in a train step. Of a policy, autocast uses the
  compute dtype and the matmul precision (``"p=f32,c=f32,o=f32,m=tf32"``
  applies to every matmul and convolution of ``fn``; an algorithm preset to
  every matmul); its param and output
  dtypes concern the casts ``with_policy`` makes at a function's boundary.
  Gradients with respect to the inputs come back in the inputs' dtypes.

  Array leaves of the arguments (JAX/numpy arrays, tracers) are traced; every
  other leaf (Python scalars, strings, ``None``, callables such as Flax's
  ``method=``) is static, as if marked static for ``jax.jit``. Wrap the train
  step in ``jax.jit`` so the trace happens once.

  Args:
    fn: a function of pytrees of arrays that ``jax.jit`` could trace (a Flax
      ``model.apply``, a loss function...).
    policy_or_dtype: the compute dtype (``jnp.float16``, ``"bf16"``, ...);
      or a ``Policy`` / policy spec (``"mixed_bfloat16"``, ``"tf32"``) whose
      compute dtype and matmul precision apply.
    rules: optional ``{primitive: rule}`` overrides merged over
      ``DEFAULT_RULES``; a rule is ``"lower"``, ``"f32"``, ``"promote"``,
      ``"passthrough"``, ``"recurse"`` (higher-order primitives only) or a
      callable ``rule(ctx, *args, **params)`` (see ``RuleContext``).
    enabled: ``False`` returns a wrapper that calls ``fn`` unchanged (handy for
      a config flag); regions inside ``fn`` are excluded with
      ``autocast_disabled()``.

  Returns:
    A function with the same signature as ``fn``.

  Raises:
    TypeError: if ``fn`` is not callable, a ``rules`` key is not a primitive
      object, or (when called) ``fn`` cannot be traced.
    ValueError: if the compute dtype is not floating, or a rule name is
      unknown.

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
  if not callable(fn):
    raise TypeError(
        f"autocast expects a callable (e.g. model.apply or a loss function), "
        f"got {type(fn).__name__}: {fn!r}."
    )
  policy = _resolve_policy(policy_or_dtype)
  if not isinstance(enabled, bool):
    raise TypeError(f"autocast's enabled must be a bool, got {enabled!r}.")
  if enabled:
    # On a jax whose internals autocast cannot read, only autocast fails.
    compat.require("jmp_lite.autocast")
  if compat.available():
    table = table_lib.resolve_rules(rules)

  if not enabled:

    @functools.wraps(fn)
    def passthrough(*args, **kwargs):
      return fn(*args, **kwargs)

    return passthrough

  interp = interpreter_lib.Interpreter(policy.compute_dtype, table)
  name = getattr(fn, "__qualname__", None) or repr(fn)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    flat_fn, dynamic = _split_static(fn, args, kwargs)
    try:
      with policy.matmul_context():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
    except _TRACING_ERRORS as err:
      raise TypeError(
          f"autocast could not trace {name}: it must be traceable by jax.jit "
          "(no Python control flow on array values -- use jnp.where/lax.cond "
          "-- and no conversion of traced arrays to NumPy or Python values). "
          "Pass values that drive Python control flow as Python scalars (they "
          f"are static), or move that code outside autocast.\n{err}"
      ) from err
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    outs = interp.eval_closed(closed, dynamic)
    targets = [
        np.dtype(s.dtype) if rules_lib.is_float_value(s) else None
        for s in out_leaves
    ]
    outs = interpreter_lib.cast_all(outs, targets)
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return wrapped


def _split_static(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    is_dynamic: Callable[[Any], bool] = _is_dynamic,
) -> tuple[Callable[..., Any], list[Any]]:
  """Splits a call into a function of its array leaves and those leaves.

  Every other leaf (strings, Python scalars, Flax's ``mutable=[...]``) is
  closed over, as if static for ``jax.jit``.
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  dynamic_idx = [i for i, leaf in enumerate(leaves) if is_dynamic(leaf)]

  def flat_fn(*dynamic):
    full = list(leaves)
    for i, value in zip(dynamic_idx, dynamic):
      full[i] = value
    call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
    return fn(*call_args, **call_kwargs)

  return flat_fn, [leaves[i] for i in dynamic_idx]


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
    listing the dtypes of its floating inputs only.

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> f = jmp_lite.autocast(lambda x: jnp.exp(x @ x), jnp.bfloat16)
    >>> [op for op in jmp_lite.op_dtypes(f, jnp.ones((2, 2))) if op[0] in ("dot_general", "exp")]
    [('dot_general', ('bfloat16', 'bfloat16')), ('exp', ('float32',))]
  """
  if not callable(fn):
    raise TypeError(
        "op_dtypes lists the operations of a function: its first argument "
        f"must be a callable, got {type(fn).__name__}: {fn!r}. Call it as "
        "jmp_lite.op_dtypes(fn, *args), e.g. op_dtypes(jmp_lite.autocast(f, "
        "'bf16'), x)."
    )
  compat.require("jmp_lite.op_dtypes")
  flat_fn, dynamic = _split_static(
      fn,
      args,
      kwargs,
      lambda x: _is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct),
  )
  closed = jax.make_jaxpr(flat_fn)(*dynamic)
  return [
      (
          eqn.primitive.name,
          tuple(
              np.dtype(v.aval.dtype).name
              for v in eqn.invars
              if rules_lib.is_float_value(v.aval)
          ),
      )
      for eqn in compat.walk_eqns(closed, live_only=True)
  ]
