"""Precision rules for autocast: which dtype each JAX primitive runs in.

A *rule* decides the dtypes an operation's inputs are cast to before the
primitive is bound. Rules are keyed by primitive objects (``jax.lax.exp_p``,
``jax.extend.core.primitives.dot_general_p``...), never by name, and are one of

* ``"lower"``: floating inputs run in the compute dtype (float16/bfloat16).
  Primitives with a ``preferred_element_type`` parameter (``dot_general``,
  ``conv_general_dilated``, ``ragged_dot_general``: ``jax.lax.ragged_dot``,
  the grouped matmul of Mixture-of-Experts layers) accumulate in float32 and
  the result is cast to the compute dtype. Float64 operations are not eligible (as in ``torch.autocast``)
  and run as ``"promote"``.
* ``"f32"``: numerically sensitive operations: floating inputs narrower than
  float32 are widened to float32 (float64 stays float64).
* ``"promote"``: the operation runs in the dtype its floating inputs arrive in;
  inputs that arrive in different dtypes are promoted to the widest of them.
  Values derived only from Python scalars / literals (JAX's "weak" values,
  e.g. the ``2.0`` in ``x * 2.0``) adopt the dtype of the other operands
  instead of widening them.
* ``"passthrough"``: autocast leaves the operation exactly as traced: floating
  inputs are cast back to the dtypes they had when ``fn`` was traced. The rule
  for dtype-sensitive primitives (``bitcast_convert_type``), for every
  primitive autocast does not know, and for excluded regions.
* ``"recurse"``: only for the higher-order primitives the interpreter knows
  (``interpreter.HIGHER_ORDER``): their bodies are autocast too.
* a callable ``rule(ctx, *args, **params)`` returning what
  ``primitive.bind(*args, **params)`` returns; ``ctx`` is a
  :class:`OpRuleContext` giving the traced dtypes and ``ctx.apply("f32", ...)``
  to delegate to a built-in rule.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Mapping, Sequence

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib
from jmp_lite._src import compat

FLOAT32 = dtypes.FLOAT32

#: The built-in rule names.
OP_RULE_NAMES: tuple[str, ...] = ("lower", "f32", "promote", "passthrough", "recurse")

# The default op lists, by the attribute names of the primitives in
# jax.extend.core.primitives / jax.lax. A name the installed jax lacks is left
# out (compat.primitives); the test suite lists which.

LOWER_NAMES = ("dot_general_p", "conv_general_dilated_p",
               "ragged_dot_general_p")

F32_NAMES = (
    # exp/log family: overflow or lose all precision in half.
    "exp_p", "exp2_p", "log_p", "log1p_p", "expm1_p", "logistic_p",
    # powers: pow, and squares/integer powers that feed variances and norms
    # (x**2 overflows float16 above 256).
    "pow_p", "integer_pow_p", "square_p", "rsqrt_p",
    # special functions.
    "erf_p", "erfc_p", "erf_inv_p", "lgamma_p", "digamma_p", "igamma_p",
    "igammac_p", "igamma_grad_a_p", "polygamma_p", "zeta_p", "bessel_i0e_p",
    "bessel_i1e_p", "regularized_incomplete_beta_p",
    # trigonometric/hyperbolic functions torch also runs in float32.
    "tan_p", "acos_p", "asin_p", "cosh_p", "sinh_p", "acosh_p", "asinh_p",
    "atanh_p",
    # float reductions: sums and products accumulate error and overflow.
    "reduce_sum_p", "reduce_prod_p", "cumsum_p", "cumprod_p",
    "cumlogsumexp_p", "reduce_window_sum_p",
)

PROMOTE_NAMES = (
    # binary and ternary elementwise ops.
    "add_p", "sub_p", "mul_p", "div_p", "rem_p", "max_p", "min_p", "atan2_p",
    "nextafter_p", "select_n_p", "clamp_p", "complex_p", "add_jaxvals_p",
    "eq_p", "ne_p", "lt_p", "le_p", "gt_p", "ge_p",
    # unary elementwise ops that are accurate in half precision.
    "neg_p", "abs_p", "sign_p", "floor_p", "ceil_p", "round_p", "is_finite_p",
    "sqrt_p", "cbrt_p", "tanh_p", "sin_p", "cos_p", "atan_p", "real_p",
    "imag_p", "conj_p", "copy_p", "stop_gradient_p", "name_p",
    # shape, indexing and data movement.
    "reshape_p", "broadcast_in_dim_p", "transpose_p", "squeeze_p", "rev_p",
    "slice_p", "dynamic_slice_p", "dynamic_update_slice_p", "gather_p",
    "scatter_p", "concatenate_p", "split_p", "tile_p",
    "pad_p", "iota_p", "sort_p", "top_k_p", "optimization_barrier_p",
    "sharding_constraint_p", "device_put_p",
    # order statistics and pooling (exact in any dtype).
    "reduce_max_p", "reduce_min_p", "argmax_p", "argmin_p", "cummax_p",
    "cummin_p", "reduce_window_max_p", "reduce_window_min_p",
    "select_and_gather_add_p", "select_and_scatter_add_p",
    # collectives move data in the dtype it has.
    "psum_p", "pmax_p", "pmin_p", "all_gather_p", "all_to_all_p",
    "ppermute_p", "pvary_p", "psum_invariant_p", "reduce_scatter_p",
)

PASSTHROUGH_NAMES = (
    "bitcast_convert_type_p", "reduce_precision_p",
    # Scatters that combine (the gradient of a gather is a scatter-add): their
    # combiner is a jaxpr traced for the operands' dtype, so they run in it.
    "scatter_add_p", "scatter_mul_p", "scatter_min_p", "scatter_max_p",
    "scatter_sub_p",
)

# First-order primitives whose parameters hold a jaxpr that is a scalar
# combiner (reduce's monoid, scatter's update), not a body to autocast: they
# are not "unknown higher-order primitives" (interpreter.UNKNOWN_HIGHER_ORDER).
FIRST_ORDER_WITH_JAXPRS_NAMES = (
    "reduce_p", "reduce_window_p", "select_and_scatter_p", "scatter_p",
    "scatter_add_p", "scatter_mul_p", "scatter_min_p", "scatter_max_p",
    "scatter_sub_p",
)

#: Matmuls (dense and grouped) and convolutions: run in the compute dtype,
#: accumulate in float32.
LOWER_PRIMITIVES = compat.primitives(*LOWER_NAMES)
#: Numerically sensitive primitives that run in float32.
F32_PRIMITIVES = compat.primitives(*F32_NAMES)
#: Primitives that run in the dtype their inputs arrive in (widest on mismatch).
PROMOTE_PRIMITIVES = compat.primitives(*PROMOTE_NAMES)
#: Primitives autocast keeps exactly as traced (the default for unknown ones).
PASSTHROUGH_PRIMITIVES = compat.primitives(*PASSTHROUGH_NAMES)
#: Primitives with a scalar-combiner jaxpr in their parameters (not bodies).
FIRST_ORDER_WITH_JAXPRS = frozenset(
    compat.primitives(*FIRST_ORDER_WITH_JAXPRS_NAMES))

# Primitives linear in each floating operand, their other operands (the
# integer group sizes of ragged_dot_general) being constants: the
# float32-accumulating matmul rule builds their tangent from the partial
# products, one per floating operand.
_MULTILINEAR = frozenset(LOWER_PRIMITIVES)


def _is_float_dtype(dtype: Any) -> bool:
  return dtype is not None and dtypes.is_floating(dtype)


def dtype_of(x: Any) -> np.dtype | None:
  """The dtype of an array, tracer or numpy value; None for tokens, typed
  PRNG key arrays (``jax.random.key``: an extended dtype, no NumPy one)
  etc."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return None
  return np.dtype(dtype)


def wider(a: np.dtype, b: np.dtype) -> np.dtype:
  """The wider of two floating dtypes; float16 vs bfloat16 gives float32."""
  if a == b:
    return a
  if a.itemsize != b.itemsize:
    return a if a.itemsize > b.itemsize else b
  return FLOAT32 if a.itemsize < 4 else a


@dataclasses.dataclass(frozen=True)
class OpRuleContext:
  """What a rule knows about the operation it runs.

  Attributes:
    primitive: the primitive being evaluated.
    compute_dtype: autocast's compute dtype (e.g. float16).
    in_avals: the abstract values (shape, dtype) the inputs had when the
      original function was traced; the arguments the rule receives may have
      other floating dtypes.
    out_avals: the abstract values of the outputs in the original trace.
    weak: per input, whether it derives only from Python scalars/literals
      (such values adopt the dtype of the other operands).
    accumulate_f32: whether ``"lower"`` matmuls/convolutions accumulate in
      float32 explicitly. False while autocast evaluates a custom JVP rule,
      whose matmuls compute tangents: they then run like the tangent matmuls
      of autocast's own matmul rule (compute-dtype output), so that the
      backward pass has no mixed-dtype matmuls.
    fp8_config: the float8 recipe (``jmp_lite.fp8.Fp8Config``) in force
      where the operation was traced, or None: outside float8 regions, in
      float32 islands, and for the output head (``docs/fp8.md``). The
      ``dot_general`` rule of a float8 policy reads it.
  """

  primitive: Any
  compute_dtype: np.dtype
  in_avals: tuple[Any, ...]
  out_avals: tuple[Any, ...]
  weak: tuple[bool, ...]
  accumulate_f32: bool = True
  fp8_config: Any = None
  _recurse: Callable[..., Any] | None = None
  _fp8_excluded: str | None = None

  def bind(self, *args: Any, **params: Any) -> Any:
    """Binds the primitive to ``args`` (like ``eval_jaxpr`` does)."""
    return compat.bind(self.primitive, args, params)

  def apply(self, rule: str, *args: Any, **params: Any) -> Any:
    """Runs the built-in rule named ``rule`` (one of :data:`OP_RULE_NAMES`)."""
    if rule == "recurse" and self._recurse is not None:
      return self._recurse(self, *args, **params)
    builtin = BUILTIN_RULES.get(rule) if isinstance(rule, str) else None
    if builtin is None:
      raise ValueError(
          f"No built-in autocast rule {rule!r} applies to "
          f"{self.primitive.name}; valid rules: {', '.join(OP_RULE_NAMES)} "
          "('recurse' only for higher-order primitives: jit, scan, cond, ...)"
          " or a callable.")
    return builtin(self, *args, **params)

  def cast_outputs(self, out: Any, dtype: Any) -> Any:
    """Casts the floating outputs of a bind (one value or a list) to dtype."""
    if self.primitive.multiple_results:
      return [tree_lib.cast(o, dtype) if tree_lib.is_float(o) else o for o in out]
    return tree_lib.cast(out, dtype) if tree_lib.is_float(out) else out


def _harmonize(
    ctx: OpRuleContext, args: Sequence[Any], target_of: Callable[[np.dtype], np.dtype]
) -> list[Any]:
  """Casts floating inputs that were traced with one dtype to a common dtype.

  Inputs are grouped by their traced dtype (an op traced with mixed dtypes
  keeps them apart). In each group the widest dtype among the non-weak inputs
  (all inputs if every one is weak) is passed to ``target_of``, and every
  member is cast to the result.
  """
  groups: dict[np.dtype, list[int]] = {}
  for i, (x, aval) in enumerate(zip(args, ctx.in_avals)):
    traced = dtype_of(aval)
    if tree_lib.is_float(x) and _is_float_dtype(traced):
      groups.setdefault(traced, []).append(i)
  new_args = list(args)
  for members in groups.values():
    strong = [i for i in members if not ctx.weak[i]] or members
    widest = dtype_of(args[strong[0]])
    for i in strong[1:]:
      widest = wider(widest, dtype_of(args[i]))
    target = target_of(widest)
    for i in members:
      new_args[i] = tree_lib.cast(args[i], target)
  return new_args


def promote_rule(ctx: OpRuleContext, *args: Any, **params: Any) -> Any:
  """Runs the op in the dtype its inputs arrive in, widest on a mismatch."""
  return ctx.bind(*_harmonize(ctx, args, lambda d: d), **params)


def f32_rule(ctx: OpRuleContext, *args: Any, **params: Any) -> Any:
  """Runs the op in float32 (float64 stays float64)."""
  return ctx.bind(*_harmonize(ctx, args, dtypes.at_least_f32), **params)


def _accumulate_in_f32(
    ctx: OpRuleContext, args: Sequence[Any], params: dict[str, Any],
    target: np.dtype) -> Any:
  """A matmul/conv on ``target`` inputs, accumulated in float32.

  The forward pass binds the primitive with ``preferred_element_type=f32``
  and casts the result to ``target``. Differentiating that directly would
  give the backward matmuls a float32 cotangent against a ``target`` operand
  (a mixed-dtype matmul XLA runs in float32), so a ``custom_jvp`` gives the
  tangent its own matmuls with ``target`` inputs and outputs: the backward
  pass then runs in half precision as in ``torch.autocast`` (accumulating in
  float32 wherever the backend does so for half matmuls: GPU, TPU).

  The primitive must be linear in each floating operand (``dot_general``,
  ``conv_general_dilated``, ``ragged_dot_general``); its other operands
  (``ragged_dot_general``'s integer group sizes) are constants of the
  product and have no tangent.
  """
  # Equation parameters are hashable (jax requires it since 0.7).
  static = tuple(sorted(params.items()))
  return _f32_accumulated(ctx.primitive, static, np.dtype(target), *args)


# Jitted with inline=True (docs/design.md): the operations are inlined into
# the caller's program as if bound there, and the product and its derivative
# are traced once per primitive, parameters and operand types, not once per
# matmul (a deep model's blocks repeat the same few matmuls).
@functools.partial(jax.jit, inline=True, static_argnums=(0, 1, 2))
def _f32_accumulated(primitive: Any, static: tuple[tuple[str, Any], ...],
                     target: np.dtype, *operands: Any) -> Any:
  """:func:`_accumulate_in_f32`'s custom-derivative product."""
  params = dict(static)
  accumulate = dict(params, preferred_element_type=FLOAT32)
  low = dict(params, preferred_element_type=target)
  linear = tuple(i for i, x in enumerate(operands) if tree_lib.is_float(x))

  def primal(*xs):
    return tree_lib.cast(compat.bind(primitive, xs, accumulate), target)

  primal.__name__ = primal.__qualname__ = f"{primitive.name}_f32_accumulate"

  lowered = jax.custom_jvp(primal)

  def jvp(primals, tangents):
    out = lowered(*primals)  # Not primal(): higher orders then use this rule too.
    terms = []
    for i in linear:  # integer operands: constants, no tangent
      if not isinstance(tangents[i], SymbolicZero):
        xs = list(primals)
        xs[i] = tangents[i]
        terms.append(compat.bind(primitive, xs, low))
    if not terms:
      return out, jnp.zeros_like(out)
    return out, functools.reduce(lax.add, terms)

  lowered.defjvp(jvp, symbolic_zeros=True)
  return lowered(*operands)


def lower_rule(ctx: OpRuleContext, *args: Any, **params: Any) -> Any:
  """Runs the op in the compute dtype, accumulating in float32 if it can."""
  floats = [i for i, x in enumerate(args) if tree_lib.is_float(x)]
  if not floats or any(dtype_of(args[i]).itemsize > 4 for i in floats):
    # Integer matmuls and float64 ops are not eligible (as in torch.autocast).
    return promote_rule(ctx, *args, **params)
  if any(dtype_of(args[i]).itemsize == 1 for i in floats):
    # A float8 matmul (one made by a float8 recipe inside the function) is
    # already quantized: it runs as written.
    return passthrough_rule(ctx, *args, **params)
  target = ctx.compute_dtype
  new_args = [tree_lib.cast(x, target) if i in floats else x for i, x in enumerate(args)]
  if "preferred_element_type" not in params or len(ctx.out_avals) != 1:
    return ctx.bind(*new_args, **params)
  traced_out = dtype_of(ctx.out_avals[0])
  traced_in = {dtype_of(ctx.in_avals[i]) for i in floats}
  if traced_out not in traced_in:
    # An explicit wider output (bf16 x bf16 -> f32 in the trace) is kept.
    return ctx.bind(*new_args, **params)
  if target.itemsize >= 4 or not ctx.accumulate_f32:
    return ctx.bind(*new_args, **dict(params, preferred_element_type=target))
  if ctx.primitive in _MULTILINEAR and len(floats) == 2:
    return _accumulate_in_f32(ctx, new_args, params, target)
  out = ctx.bind(*new_args, **dict(params, preferred_element_type=FLOAT32))
  return ctx.cast_outputs(out, target)


def passthrough_rule(ctx: OpRuleContext, *args: Any, **params: Any) -> Any:
  """Runs the op exactly as traced: inputs go back to their traced dtypes."""
  new_args = [
      tree_lib.cast(x, dtype_of(aval))
      if tree_lib.is_float(x) and _is_float_dtype(dtype_of(aval))
      else x
      for x, aval in zip(args, ctx.in_avals)
  ]
  return ctx.bind(*new_args, **params)


def convert_element_type_rule(
    ctx: OpRuleContext, x: Any, *, new_dtype: Any, **params: Any
) -> Any:
  """Honours real casts; keeps the autocast dtype through traced no-op casts.

  A ``convert_element_type`` whose traced input already had ``new_dtype``
  only changed weak typing (``jnp.asarray(x, jnp.float32)`` on a float32
  value); replaying it literally would undo autocast, so the value keeps its
  current dtype. Casts that changed the dtype in the trace (``x.astype(f32)``
  on a float16 input, float to int...) are replayed as written.
  """
  traced_in = dtype_of(ctx.in_avals[0])
  current = dtype_of(x)
  if (
      _is_float_dtype(traced_in)
      and traced_in == np.dtype(new_dtype)
      and current is not None
      and current != traced_in
  ):
    new_dtype = current
  return ctx.bind(x, new_dtype=new_dtype, **params)


#: Rule name -> implementation ("recurse" lives in the interpreter).
BUILTIN_RULES: Mapping[str, Callable[..., Any]] = types.MappingProxyType({
    "lower": lower_rule,
    "f32": f32_rule,
    "promote": promote_rule,
    "passthrough": passthrough_rule,
})
