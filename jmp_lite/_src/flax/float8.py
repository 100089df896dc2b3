"""Float8 matmuls in Flax layers, through the layers' own ``dot_general`` hook.

Flax's matmul layers take the function that computes their product as an
argument (``dot_general``/``dot_general_cls`` on linen ``Dense`` and
``DenseGeneral`` and NNX ``Linear`` and ``LinearGeneral``; ``einsum_op`` on
NNX ``Einsum``), as Transformer Engine and Flax's own ``fp8_ops`` use it. The
linen and NNX policies hand the layers a :class:`Matmul` for the duration of
a call: it runs :func:`jmp_lite._src.low_precision.fp8_matmul.fp8_dot_general` where the
recipe in force there puts the product in float8, and the product as written
elsewhere (every fallback visible, as autocast's). No jaxpr is interpreted.

Delayed scaling keeps one pair of amax histories per layer, at the layer's
own path: ``{"lhs": uint32[history_length], "rhs": uint32[history_length]}``,
the **bit patterns** of float32 amaxes, newest first (a layer under a scan
over layers has a leading axis, one slot per iteration). Integers, because
the state is not a parameter and nothing may step it: ``jax.grad`` over a
tree holding it raises JAX's integer-input ``TypeError`` and optax's
optimizers refuse integer gradients, where float32 histories were silently
shrunk by ``optax.adamw``'s weight decay (issue 25, item 8). Read them with
:func:`decode`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import compat
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.low_precision import recipes as config_lib
from jmp_lite._src.low_precision import recipe_matmuls as recipe_matmuls_lib
from jmp_lite._src.low_precision import fp8_matmul as matmul_lib
from jmp_lite._src.low_precision import scaling as scaling_lib

_F32 = np.dtype(np.float32)
_BITS = np.dtype(np.uint32)

#: A delayed-scaling layer with no history in the state handed to apply.
MISSING_HISTORY = (
    "jmp_lite: the float8 state has no amax history for the matmul at "
    "{path}, which runs a delayed-scaling recipe here. The state passed in "
    "was made for another model, other module rules or another recipe (e.g. "
    "one with include_output_head=False, which keeps the output head out of "
    "float8 and no history for it), or lost this entry. Pass the variables "
    "that init made for this very model and policy (params and "
    "'fp8_state'): re-create them with init after changing the model, its "
    "rules or its recipe, or restore a checkpoint saved from the same "
    "configuration."
)
#: A stored layer entry that is not ``{"lhs": history, "rhs": history}``.
MALFORMED_HISTORY = (
    "jmp_lite: the float8 state's entry for the matmul at {path} is not "
    "{{'lhs': history, 'rhs': history}} (got {got}). The state comes from "
    "PolicyModel.init / the first call of an NNX PolicyModule: re-create it "
    "(init again), or restore a checkpoint saved from the same model and "
    "recipe; do not edit or merge its entries by hand."
)
#: A stored history whose length is not the recipe's history_length.
HISTORY_LENGTH_MISMATCH = (
    "jmp_lite: the float8 state holds a {stored}-step amax history for the "
    "matmul at {path}, but the recipe {spec!r} keeps history_length="
    "{configured}. A restored state must match the recipe it is used with "
    "(a longer history would silently keep scales from {stored} steps). "
    "Re-create the state with init (fresh histories), keep the recipe's "
    "history_length={stored}, or convert the checkpoint: newest amaxes come "
    "first, so jax.tree.map(lambda h: h[..., :{configured}], state) keeps the "
    "{configured} most recent (pad with zeros to lengthen)."
)
#: A delayed-scaling layer inside a lifted transform that does not carry
#: the state (linen ``nn.scan``/``nn.vmap`` without ``'fp8_state'``).
STATE_NOT_LIFTED = (
    "jmp_lite.linen: the layer at {path} runs a delayed-scaling float8 "
    "recipe, whose amax histories live in the 'fp8_state' collection, but "
    "that collection does not reach it: a lifted transform around it "
    "(nn.scan, nn.vmap) lists the collections it carries, and 'fp8_state' "
    "is not among them. Add it next to 'params', e.g. nn.scan(Block, "
    "variable_axes={{'params': 0, 'fp8_state': 0}}, ...) (one history per "
    "iteration), or use a current-scaling recipe (m=fp8, fp8_rowwise, "
    "mxfp8), which keeps no state. docs/flax.md, float8."
)


def recipe(policy: Any) -> config_lib.Fp8Config | None:
  """The float8 recipe of a policy, or None."""
  found = getattr(policy, "fp8_recipe", None)
  if found is None and hasattr(policy, "matmul_precision"):
    found = config_lib.recipe_config(policy.matmul_precision)
  return found


def scaling_in_use(policies: Any) -> str | None:
  """``"delayed"`` if any policy has a delayed float8 recipe, ``"current"``
  if any has another float8 recipe, None without float8 (rules' other
  values, such as ``FullPrecision``, are ignored)."""
  recipes = [recipe(p) for p in policies]
  recipes = [r for r in recipes if r is not None]
  if any(r.scaling == "delayed" for r in recipes):
    return "delayed"
  return "current" if recipes else None


def encode(history: Any) -> jax.Array:
  """float32 amaxes -> their uint32 bit patterns (the stored form)."""
  return lax.bitcast_convert_type(jnp.asarray(history, _F32), jnp.uint32)


def decode(bits: Any) -> jax.Array:
  """Stored uint32 bit patterns -> the float32 amaxes they hold."""
  return lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint32), jnp.float32)


def zero_histories(length: int, stack: tuple[int, ...] = ()) -> dict:
  """A layer's fresh state: zero histories (``stack``: leading axes)."""
  zeros = jnp.zeros(tuple(stack) + (length,), _BITS)
  return {"lhs": zeros, "rhs": zeros}


def check_histories(stored: Any, path: str,
                    config: config_lib.Fp8Config) -> None:
  """Raises the teaching error for a stored entry that is missing (None or
  empty), is not ``{"lhs": history, "rhs": history}``, or whose histories
  are not ``config.history_length`` long."""
  keyed = hasattr(stored, "keys")
  if stored is None or (keyed and not stored):
    message = MISSING_HISTORY.format(path=path)
  elif not (keyed and "lhs" in stored and "rhs" in stored):
    got = sorted(stored) if keyed else type(stored).__name__
    message = MALFORMED_HISTORY.format(path=path, got=got)
  else:
    wrong = [length for length in (
        np.shape(stored[name])[-1] if np.ndim(stored[name]) else 0
        for name in ("lhs", "rhs")) if length != config.history_length]
    if not wrong:
      return
    message = HISTORY_LENGTH_MISMATCH.format(
        stored=wrong[0], path=path, spec=config.spec(),
        configured=config.history_length)
  raise ValueError(message)


def delayed_scales(stored: Any, x: Any, y: Any, config: config_lib.Fp8Config
                   ) -> tuple[matmul_lib.DelayedScales, dict]:
  """This step's scales of the two operands, and the rolled histories."""
  # Every replica records (and scales from) the global amax: over the
  # recipe's axis_name, or else every mapped axis bound here.
  config = scaling_lib.with_bound_axes(config)
  matmul_lib.check_axis_bound(config)
  amax = [scaling_lib.global_amax(lax.stop_gradient(
      jnp.max(jnp.abs(v.astype(_F32)), initial=0.0)), config.axis_name)
          for v in (x, y)]
  fmt = config.forward
  scales, new = [], {}
  for name, value in zip(("lhs", "rhs"), amax):
    history = decode(stored[name])
    # No usable history yet (the first steps): scale from this step's amax.
    current = scaling_lib.scale_from_amax(
        value, fmt, power_of_two=config.power_of_two_scales)
    scales.append(lax.stop_gradient(scaling_lib.scale_from_history(
        history, fmt, margin=config.margin, algorithm=config.amax_algorithm,
        previous_scale=current, power_of_two=config.power_of_two_scales)))
    new[name] = encode(scaling_lib.update_amax_history(history, value))
  return matmul_lib.DelayedScales(*scales), new


def _current(config: config_lib.Fp8Config) -> config_lib.Fp8Config:
  return dataclasses.replace(config, scaling="current", history_length=None,
                             margin=0.0, amax_algorithm=None)


def _float8_rules() -> Any:
  # The exclusions, fallback scope and log are autocast's (one predicate for
  # every route); imported on use so a 16-bit Flax model never loads autocast.
  from jmp_lite._src.autocast import float8  # pylint: disable=g-import-not-at-top
  return float8


def fallback(reason: str, config: Any, shapes: str = "") -> Any:
  """The visible fallback out of ``config``'s format (float8, NVFP4, MXFP4):
  a debug record and the named scope ``op_dtypes`` reports (a context
  manager around the product as written)."""
  float8 = _float8_rules()
  float8.logger.debug("jmp_lite: a dot_general %s stays out of %s: %s",
                      shapes, config_lib.format_name(config), reason)
  try:  # the one owner of name-stack markers (being introduced, issue 26)
    from jmp_lite._src import markers  # pylint: disable=g-import-not-at-top
    scope = markers.fallback_scope(reason)
  except ImportError:
    scope = f"{float8.FALLBACK_SCOPE}[{reason}]"
  return jax.named_scope(scope)


def is_head_candidate(lhs: Any, rhs: Any, dimension_numbers: Any,
                      config: config_lib.Fp8Config | None) -> bool:
  """A product the output-head rule counts (whatever its shapes): float
  operands of at most 4 bytes, no batch dimensions unless the recipe there
  quantizes batched products (as autocast's head rule)."""
  for v in (lhs, rhs):
    if not (tree_lib.is_float(v) and np.dtype(v.dtype).itemsize <= 4):
      return False
  if not dimension_numbers[1][0]:
    return True
  return config is not None and config.include_batched


@dataclasses.dataclass(frozen=True, eq=False)
class Matmul:
  """The ``dot_general`` a policy hands one Flax layer for one call.

  Attributes:
    config: the float8 recipe in force at the layer.
    path: the layer's path, for messages.
    histories: delayed scaling's state access: ``(read, write)``; ``read()``
      returns the layer's stored histories (checked), ``write(new)`` stores
      rolled ones or is None (evaluation, init). None: current scaling.
    excluded: a reason the layer stays out of float8 whatever its shapes
      (the output head), or None.
  """

  config: config_lib.Fp8Config
  path: str
  histories: tuple[Callable[[], Any], Callable[[Any], None] | None] | None
  excluded: str | None = None

  def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any,
               precision: Any = None, preferred_element_type: Any = None,
               **kwargs: Any) -> jax.Array:
    as_written = lambda: lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, **kwargs)
    if any(tree_lib.is_float(v) and np.dtype(v.dtype).itemsize == 1
           for v in (lhs, rhs)):
      return as_written()  # float8 already (a nested float8 route): as is
    config = self.config
    reason = self.excluded or _float8_rules().exclusion(
        config, (lhs, rhs), dimension_numbers)
    histories = self.histories
    stored = None
    if histories is not None and reason is None:
      stored = histories[0]()
    if reason is not None:
      shapes = f"{tuple(lhs.shape)} x {tuple(rhs.shape)}"
      with fallback(reason, config, shapes):
        return as_written()
    # The product keeps the result dtype it has as written (the layer's
    # compute dtype), its operands quantized from the dtypes they come in.
    out_dtype = jax.eval_shape(
        lambda a, b: lax.dot_general(
            a, b, dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
        jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)).dtype
    scales = None
    if config.scaling == "delayed":
      if stored is None:
        config = _current(config)
      else:
        # The incoming gradient's (current) scale is global too.
        config = scaling_lib.with_bound_axes(config)
        scales, new = delayed_scales(stored, lhs, rhs, config)
        if histories[1] is not None:
          histories[1](new)
    return recipe_matmuls_lib.recipe_dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=out_dtype,
        config=config, scales=scales, out_sharding=kwargs.get("out_sharding"))


#: The named scope a discovery pass binds each hooked product under.
SITE_SCOPE = "jmp_lite.flax_matmul"


@dataclasses.dataclass(frozen=True, eq=False)
class Recorder:
  """The ``dot_general`` of a discovery pass: the product as written, bound
  under a named scope that numbers it (see :func:`head_site`)."""

  index: int

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, **kwargs):
    with jax.named_scope(f"{SITE_SCOPE}[{self.index}]"):
      return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type,
                             **kwargs)


def head_site(closed_jaxpr: Any, candidates: dict[int, Any]) -> int | None:
  """The hooked product that is the model's output head, or None.

  The head is the last product in program order (call order) that float8
  would quantize (:func:`is_head_candidate`); when that product is not one
  a hook numbered (a raw ``x @ w``, a tied embedding's ``attend``), no hooked
  layer is the head.

  Args:
    closed_jaxpr: the discovery pass's program.
    candidates: hook index -> the recipe in force there (or None) for every
      hooked product.
  """
  from jmp_lite._src import compat  # pylint: disable=g-import-not-at-top
  dot = compat.primitive("dot_general_p")
  marker = SITE_SCOPE + "["
  last = None
  for eqn, stack in compat.walk_eqns_in_scopes(closed_jaxpr):
    if eqn.primitive is not dot:
      continue
    start = stack.rfind(marker)
    index = (int(stack[start + len(marker):stack.find("]", start)])
             if start >= 0 else None)
    avals = [v.aval for v in eqn.invars]
    config = candidates.get(index)
    if is_head_candidate(*avals, eqn.params["dimension_numbers"], config):
      last = index
  return last


def grouped_matmuls(closed_jaxpr: Any) -> int:
  """How many ``ragged_dot``s on float operands a traced model calls."""
  ragged = compat.primitive("ragged_dot_general_p")
  if ragged is None:
    return 0
  return sum(
      1 for eqn in compat.walk_eqns(closed_jaxpr, live_only=True)
      if eqn.primitive is ragged
      and all(tree_lib.is_float(v.aval) for v in eqn.invars[:2]))


def region(config: Any) -> Any:
  """The named scope marking a module's call with its recipe (or none), for
  :func:`grouped_in_recipes`."""
  from jmp_lite._src import markers  # pylint: disable=g-import-not-at-top
  return jax.named_scope(markers.fp8_marker(config))


def grouped_in_recipes(fn: Callable[..., Any], args: tuple, kwargs: dict,
                       compute_dtype: Any) -> Any:
  """``fn(*args, **kwargs)`` with every ``ragged_dot`` in the recipe of the
  innermost :func:`region` around it (none outside every region), all else
  as traced: autocast's interpreter with a table of the grouped-matmul rule
  only (``with_policy``'s, which keeps operand and result dtypes as traced).
  What the linen and NNX policies run for a model whose modules call
  ``ragged_dot`` (no Flax hook reaches it); the ``dot_general``s stay the
  hooks'."""
  from jmp_lite._src.autocast import float8 as autocast_float8  # pylint: disable=g-import-not-at-top
  from jmp_lite._src.autocast import interpreter as interpreter_lib  # pylint: disable=g-import-not-at-top
  compat.require(
      "jmp_lite.linen/jmp_lite.nnx (grouped matmuls under a float8/FP4 "
      "recipe)")
  table: dict[Any, Any] = {prim: "recurse"
                           for prim in interpreter_lib.HIGHER_ORDER}
  table[compat.primitive("ragged_dot_general_p")] = (
      autocast_float8.fp8_ragged_passthrough)
  return interpreter_lib.run_as_traced(fn, args, kwargs, compute_dtype, table)
