"""Name-stack markers: the ``jax.named_scope`` names by which regions of a
traced program reach autocast's interpreter.

Three kinds, all owned here:

* a float8 region, ``jmp_lite.fp8[<key>]``: ``<key>`` is a small integer
  standing for a recipe object (an ``Fp8Config``, or none) in this module's
  registry, never the recipe's text, so the interpreter reads the recipe of a
  matmul with one dictionary lookup;
* a float32 island, :data:`ISLAND_SCOPE` (``jmp_lite.in_float32``): autocast
  leaves what is traced inside as it is;
* a low-bit fallback, ``jmp_lite.fp8_fallback[<reason>]``: a matmul a float8
  or FP4 recipe left out of its format is bound under it, so ``op_dtypes``
  can say why.

The registry only grows, by one entry per distinct recipe a program was
marked with (recipes are hashable, equal recipes share a key), so a key in a
traced program stays valid for the life of the process.
"""

from __future__ import annotations

import threading
from typing import Any

#: The ``jax.named_scope`` prefix of a float8 region marker.
FP8_SCOPE = "jmp_lite.fp8"
#: The ``jax.named_scope`` that marks a float32 island: ``autocast`` leaves
#: the operations traced inside it as they are.
ISLAND_SCOPE = "jmp_lite.float32_island"
#: The named scope prefix a float8 fallback matmul is bound under.
FALLBACK_SCOPE = "jmp_lite.fp8_fallback"

_FP8_OPEN = FP8_SCOPE + "["
_FALLBACK_OPEN = FALLBACK_SCOPE + "["

# key -> recipe (key 0: no recipe), and recipe -> key.
_RECIPES: list[Any] = [None]
_KEYS: dict[Any, int] = {None: 0}
_LOCK = threading.Lock()


def fp8_marker(recipe: Any) -> str:
  """The named scope marking a float8 region with ``recipe`` (None: none).

  Args:
    recipe: a hashable recipe object (``jmp_lite.fp8.Fp8Config``) or None
      (a region where matmuls stay out of float8).

  Returns:
    ``"jmp_lite.fp8[<key>]"``, ``<key>`` the recipe's registry key.
  """
  key = _KEYS.get(recipe)
  if key is None:
    with _LOCK:
      key = _KEYS.get(recipe)
      if key is None:
        key = len(_RECIPES)
        _RECIPES.append(recipe)
        _KEYS[recipe] = key
  return f"{_FP8_OPEN}{key}]"


def marked_recipe(stack: str, default: Any) -> Any:
  """The recipe of the innermost float8 marker in a name stack, or
  ``default`` where the stack holds none."""
  start = stack.rfind(_FP8_OPEN)
  if start < 0:
    return default
  end = stack.find("]", start)
  return _RECIPES[int(stack[start + len(_FP8_OPEN):end])]


def in_island(stack: str) -> bool:
  """Whether a name stack lies inside a float32 island."""
  return ISLAND_SCOPE in stack


def fallback_scope(reason: str) -> str:
  """The named scope a matmul a float8 or FP4 recipe left out is bound
  under."""
  return f"{_FALLBACK_OPEN}{reason}]"


def fallback_reason(stack: str) -> str | None:
  """The fallback reason recorded in a name stack, or None."""
  start = stack.rfind(_FALLBACK_OPEN)
  if start < 0:
    return None
  end = stack.find("]", start)
  return stack[start + len(_FALLBACK_OPEN):end]
