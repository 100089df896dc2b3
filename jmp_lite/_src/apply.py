"""Functional apply: running a function under a policy (``with_policy``) and
float32 islands inside one (``in_float32``).

The layer above autocast: a policy with a float8 recipe runs its function
through autocast's interpreter (everything as traced but the matmuls, which
go to float8), handing it the policy's recipe object.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import compat
from jmp_lite._src import dtypes
from jmp_lite._src import markers
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.autocast import float8 as float8_lib
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.low_precision import recipes as recipes_lib
from jmp_lite._src.policy import cast_inputs
from jmp_lite._src.policy import cast_outputs
from jmp_lite._src.policy import get_policy
from jmp_lite._src.policy import Policy

def _in_float8(fn: Callable[..., Any], args: tuple, kwargs: dict,
               policy: Policy) -> Any:
  """``fn(*args, **kwargs)`` with its matmuls in float8 under ``policy``'s
  recipe (but for the exclusions), everything else as traced.

  Array leaves of the arguments are traced, every other leaf is static; the
  floating outputs leave in the dtypes ``fn`` traced them with.
  """
  compat.require("jmp_lite.with_policy (float8 matmuls)")
  return interpreter_lib.run_as_traced(
      fn, args, kwargs, policy.compute_dtype, float8_lib.passthrough_table(),
      region=policy.fp8_recipe)


def with_policy(fn: Callable[..., Any], policy: str | Policy) -> Callable[..., Any]:
  """Wraps a function so it runs under ``policy``: a functional apply.

  The wrapper casts every floating leaf of its positional and keyword arguments
  (params, inputs) to the compute dtype, calls ``fn`` (under the policy's
  matmul precision, if it has one) and casts the floating leaves of the result
  to the output dtype. With a float8 recipe (``"mixed_fp8"``), ``fn`` is
  traced and its matmuls run in float8 but for the defaults' exclusions
  (``docs/fp8.md``); array leaves of the arguments are traced, other leaves
  are static. Integer inputs (labels, token ids),
  ``None`` and other objects pass through. Keep params stored in the param
  dtype outside; gradients with respect to them come back in that dtype.

  Args:
    fn: any function of pytrees, e.g. a Flax ``model.apply``.
    policy: a ``Policy`` or a spec for :func:`get_policy`.

  Returns:
    The wrapped function (``functools.wraps`` keeps ``fn``'s name and doc).

  Raises:
    TypeError: if ``fn`` is not callable.
    ValueError: for a delayed-scaling float8 recipe (it needs state: use the
      Flax policies).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def apply(params, x):
    ...   return x @ params["w"]
    >>> f = jmp_lite.with_policy(apply, "p=f32,c=f16,o=f32")
    >>> f({"w": jnp.ones((3, 2))}, jnp.ones((4, 3))).dtype
    dtype('float32')
  """
  checks.function(fn, "with_policy", "a callable (e.g. model.apply)")
  policy = get_policy(policy)
  fp8 = policy.fp8_recipe is not None
  if fp8:
    # Float8 matmuls are made by autocast's interpreter.
    float8_lib.check_stateless(policy.fp8_recipe, "jmp_lite.with_policy")

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    args, kwargs = cast_inputs(policy, (args, kwargs))
    if fp8:
      return cast_outputs(policy, _in_float8(fn, args, kwargs, policy))
    with policy.matmul_context():
      out = fn(*args, **kwargs)
    return cast_outputs(policy, out)

  wrapped.policy = policy  # type: ignore[attr-defined]
  return wrapped


# -- float32 islands ----------------------------------------------------------------

#: What an island's matmul precision may be, and why.
ISLAND_PRECISION = (
    "in_float32 runs fn as a float32 island: its matmuls take float32 "
    "operands at full float32 precision by default ('f32', HIGHEST). "
    "matmul_precision may name another precision for float32 operands: "
    "'tf32', 'bf16' (one bfloat16 pass) or a jax.lax.DotAlgorithmPreset for "
    "float32 inputs such as 'bf16_bf16_f32_x3' or 'tf32_tf32_f32'. A float8 "
    "recipe, a preset for half-precision or float8 inputs, or JAX's default "
    "(TF32 on NVIDIA GPUs) would run the island's matmuls below float32 and "
    "defeat the island; to run a region in float8, use a float8 policy "
    "instead (e.g. jmp_lite.with_policy(fn, 'mixed_fp8')), and leave "
    "matmul_precision unset here."
)


def _island_policy(matmul_precision: Any) -> Policy:
  """The float32 policy of an island with ``matmul_precision``, checked."""
  owner = "jmp_lite.in_float32"
  f32 = dtypes.FLOAT32
  try:
    policy = Policy(f32, f32, f32, matmul_precision=matmul_precision)
  except (TypeError, ValueError) as err:
    raise type(err)(
        f"{owner}: matmul_precision={matmul_precision!r} is not a precision "
        f"for float32 matmuls ({err}). {ISLAND_PRECISION}") from None
  recipe = policy.fp8_recipe
  if policy.matmul_precision is None or recipe is not None:
    what = ("leaves the island's matmuls at JAX's default precision"
            if recipe is None else "is an FP4 recipe"
            if isinstance(recipe, recipes_lib.Fp4Config) else
            f"is an {recipes_lib.format_name(recipe)} recipe"
            if isinstance(recipe, recipes_lib.Int8Config) else
            "is a float8 recipe")
    shown = repr(matmul_precision if recipe is None else recipe.spec())
    raise ValueError(
        f"{owner}: matmul_precision={shown} {what}. {ISLAND_PRECISION}")
  return policy


def in_float32(
    fn: Callable[..., Any], *, matmul_precision: str = "f32"
) -> Callable[..., Any]:
  """Runs ``fn`` as a float32 island inside a half-precision computation.

  The JAX counterpart of torch's ``custom_fwd(cast_inputs=torch.float32)`` and
  MaxText's ``logits_dot_in_fp32``: the wrapper casts the floating leaves of
  the arguments that are narrower than float32 to float32 (float64 stays),
  and calls ``fn`` in a region ``autocast`` leaves as traced (in float32),
  with full float32 matmuls (``HIGHEST``, not TF32, JAX's GPU default for
  float32), also inside a tf32 or float8 policy. Outputs stay float32; gradients with respect to the
  arguments come back in the arguments' dtypes. Works inside ``with_policy``,
  the Flax policies (call it in a module's code) and ``autocast`` alike.

  Args:
    fn: the function to run in float32 (e.g. the logits matmul).
    matmul_precision: the matmul precision inside: ``"f32"`` (default, full
      float32), ``"tf32"``, ``"bf16"`` or a ``jax.lax.DotAlgorithmPreset``
      for float32 inputs, such as ``"bf16_bf16_f32_x3"``. Float8 recipes,
      presets for narrower inputs and ``None``/``"default"`` (TF32 on
      NVIDIA GPUs) are refused: they would defeat the island.

  Returns:
    The wrapped function (``functools.wraps`` keeps ``fn``'s name and doc).

  Raises:
    TypeError: if ``fn`` is not callable.
    TypeError: if ``matmul_precision`` is not a name or a preset.
    ValueError: if ``matmul_precision`` is unknown, a float8 recipe, JAX's
      default, or not for float32 inputs.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> logits = jmp_lite.in_float32(lambda h, w: h @ w)
    >>> h, w = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 8))
    >>> logits(h, w).dtype
    dtype('float32')
    >>> f = jmp_lite.autocast(lambda w, x: logits(x @ w, w), "bf16")
    >>> [d for op, d in jmp_lite.op_dtypes(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
    ...  if op == "dot_general"]
    [('bfloat16', 'bfloat16'), ('float32', 'float32')]
  """
  checks.function(fn, "in_float32",
                  "a callable, the function to run in float32")
  inside = _island_policy(matmul_precision)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    args, kwargs = tree_lib.widen_floating((args, kwargs))
    with jax.named_scope(markers.ISLAND_SCOPE), inside.matmul_context():
      return fn(*args, **kwargs)

  return wrapped
