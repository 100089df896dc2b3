"""The autocast rule table: the defaults, and user rules merged over them.

The defaults come from two places only: the op lists of ``rules.py`` (one
built-in rule each) and the interpreter's registry of higher-order primitives
(``"recurse"``). Primitives the installed jax lacks are simply absent.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import numpy as np

from jmp_lite._src import compat
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.autocast import rules as rules_lib


def _default_rules() -> dict[Any, Any]:
  table: dict[Any, Any] = {}
  for prims, rule in (
      (rules_lib.PROMOTE_PRIMITIVES, "promote"),
      (rules_lib.F32_PRIMITIVES, "f32"),
      (rules_lib.LOWER_PRIMITIVES, "lower"),
      (rules_lib.PASSTHROUGH_PRIMITIVES, "passthrough"),
      (tuple(interpreter_lib.HIGHER_ORDER), "recurse"),
  ):
    for prim in prims:
      table[prim] = rule
  convert = compat.primitive("convert_element_type_p")
  if convert is not None:
    table[convert] = rules_lib.convert_element_type_rule
  return table


#: The default rule table ``{primitive: rule}`` (read-only). Primitives not in
#: it run ``"passthrough"``.
DEFAULT_OP_RULES: Mapping[Any, Any] = types.MappingProxyType(_default_rules())

#: Every primitive name the default table refers to (for the compatibility
#: report: ``compat.missing_primitives(EXPECTED_PRIMITIVES)``).
EXPECTED_PRIMITIVES: tuple[str, ...] = (
    *rules_lib.LOWER_NAMES, *rules_lib.F32_NAMES, *rules_lib.PROMOTE_NAMES,
    *rules_lib.PASSTHROUGH_NAMES, *interpreter_lib.HIGHER_ORDER_HANDLERS,
    "convert_element_type_p",
)


def _key_error(key: Any) -> TypeError:
  hint = ""
  if isinstance(key, str):
    by_name = compat.primitive_attribute_names()
    attr = by_name.get(key)
    if attr is None and compat.primitive(key) is not None:
      attr = key
    if attr is None and compat.primitive(f"{key}_p") is not None:
      attr = f"{key}_p"
    hint = (
        f" Did you mean jax.extend.core.primitives.{attr}?"
        if attr
        else f" No jax primitive is called {key!r}."
    )
  return TypeError(
      "autocast rules are keyed by primitive objects (e.g. jax.lax.exp_p or "
      "jax.extend.core.primitives.dot_general_p), not names; got key "
      f"{key!r} of type {type(key).__name__}.{hint}"
  )


def _is_dtype_like(rule: Any) -> bool:
  if isinstance(rule, np.dtype):
    return True
  if isinstance(rule, type):
    try:
      return rules_lib.dtypes.is_floating(np.dtype(rule))
    except TypeError:
      return False
  return False


#: What a rule given as a dtype should be instead.
DTYPE_RULE = (
    " A dtype is not a rule: use 'f32' to run the op in float32, 'lower' to "
    "run it in the compute dtype, 'passthrough' to keep it as traced."
)


def resolve_rules(rules: Any) -> dict[Any, Any]:
  """Validates user rules and merges them over :data:`DEFAULT_OP_RULES`.

  Args:
    rules: ``None``, or a mapping (or ``(primitive, rule)`` pairs) from
      primitive objects to a rule name or a callable.

  Returns:
    The merged table.

  Raises:
    TypeError: if a key is not a primitive, or a rule is neither a rule name
      nor a callable rule (a dtype such as ``jnp.float32`` is not a rule: use
      ``"f32"`` or ``"lower"``).
    ValueError: for an unknown rule name, or ``"recurse"`` on a primitive
      autocast cannot enter.
  """
  table = dict(DEFAULT_OP_RULES)
  names = ", ".join(repr(r) for r in rules_lib.OP_RULE_NAMES)
  entered = ", ".join(p.name for p in interpreter_lib.HIGHER_ORDER)
  for key, rule in dict(rules or {}).items():
    if not compat.is_primitive(key):
      raise _key_error(key)
    if isinstance(rule, str) and (
        rule not in rules_lib.OP_RULE_NAMES
        or (rule == "recurse" and key not in interpreter_lib.HIGHER_ORDER)):
      raise ValueError(
          f"The autocast rule {rule!r} cannot apply to primitive "
          f"{key.name!r}: valid rules are {names} ('recurse' only applies to "
          f"higher-order primitives: {entered}) or a callable "
          "rule(ctx, *args, **params).")
    if not isinstance(rule, str) and (_is_dtype_like(rule) or not callable(rule)):
      raise TypeError(
          f"The autocast rule for primitive {key.name!r} must be one of "
          f"{names} or a callable rule(ctx, *args, **params); got "
          f"{type(rule).__name__}: {rule!r}."
          f"{DTYPE_RULE if _is_dtype_like(rule) else ''}")
    table[key] = rule
  return table
