"""Every argument contract of jmp_lite, validated in one place.

Each function checks one contract -- a number, an integer in a range, a loss
scale, an axis name, a callable, an optax transformation -- and raises a
``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
that says who was called (``owner``), which argument (``what``), what was
received, what is allowed and how to fix it. Long explanations are named
constants. Validation runs in constructors and factories, never in a pytree's
unflatten (which JAX calls with tracers and placeholders).

Flax-specific contracts (module classes, rule entries) live in the Flax layer;
dtype names in :mod:`jmp_lite._src.dtypes`.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Mapping, Sequence

import jax
from jax import lax
import numpy as np
import optax

#: The smallest loss scale: the smallest normal float32, 2**-126.
SCALE_MIN = 2.0**-126
#: The largest loss scale, 2**126: its reciprocal is still a normal float32.
SCALE_MAX = 2.0**126
INT32_MAX = 2**31 - 1

#: Why loss scales live in [2**-126, 2**126].
SCALE_RANGE = (
    "[2**-126, 2**126], the range in which a float32 scale and its reciprocal "
    "are both normal numbers (outside it, scaling or unscaling rounds to 0 or "
    "inf). Typical scales are powers of two from 1 to 2**24"
)

#: How to run code that reduces over a mapped axis.
UNBOUND_AXIS = (
    "must run inside jax.pmap or jax.shard_map over that axis (pass the same "
    "axis_name there); here no such axis is bound. Under jax.jit with sharded "
    "arrays, no axis_name is needed (jmp_lite.grouped_value_and_grad makes "
    "the gradient reduction float32 there)"
)


# -- kinds of values -------------------------------------------------------------


def is_concrete(tree: Any) -> bool:
  """Whether every leaf of ``tree`` can be read (none is a tracer)."""
  return not any(isinstance(x, jax.core.Tracer)
                 for x in jax.tree.leaves(tree))


def is_array(x: Any) -> bool:
  """Whether ``x`` is a JAX or numpy array (or numpy scalar), tracers included."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_bool(x: Any) -> bool:
  """A Python/numpy bool, or an array of dtype bool."""
  return isinstance(x, (bool, np.bool_)) or (is_array(x) and x.dtype == np.bool_)


def is_real_number(x: Any) -> bool:
  """A Python or numpy real number that is not a bool (arrays excluded)."""
  return (isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
          and not isinstance(x, np.ndarray))


def _is_complex(x: Any) -> bool:
  return isinstance(x, complex) or (
      is_array(x) and np.issubdtype(x.dtype, np.complexfloating))


def _shown(x: Any) -> str:
  return f"{type(x).__name__}: {x!r}"


# -- numbers -----------------------------------------------------------------------


def real_scalar(x: Any, what: str, owner: str) -> None:
  """A real scalar: a number or a 0-d array (tracers too), not a bool."""
  if is_bool(x) or _is_complex(x) or not (is_real_number(x) or is_array(x)):
    shown = f"a bool ({x!r})" if is_bool(x) else _shown(x)
    raise TypeError(
        f"{owner}: {what} must be a number, got {shown}. Pass a real number "
        "or a scalar array, e.g. 2.0**15."
    )
  if np.ndim(x) != 0:
    raise ValueError(
        f"{owner}: {what} must be a scalar, got an array of shape "
        f"{np.shape(x)}. Pass a single number such as 2.0**15."
    )


def static_number(x: Any, what: str, owner: str) -> float:
  """Static configuration: a finite real number (Python, numpy, or a concrete
  0-d array), never a traced value."""
  if not is_concrete(x):
    raise TypeError(
        f"{owner}: {what} is static configuration and cannot be a traced "
        "value; pass a Python number."
    )
  if is_bool(x) or _is_complex(x) or not (
      is_real_number(x) or (is_array(x) and np.ndim(x) == 0)):
    raise TypeError(f"{owner}: {what} must be a real number, got {_shown(x)}.")
  value = float(x)
  if not math.isfinite(value):
    raise ValueError(f"{owner}: {what} must be finite, got {value}.")
  return value


def integer(x: Any, what: str, owner: str, low: int = 0,
            high: int = INT32_MAX, *, whole_floats: bool = False) -> int:
  """An integer in ``[low, high]`` (static). With ``whole_floats``, a float
  such as ``5.0`` is accepted too (jmp accepts ``period=5.0``)."""
  if whole_floats:
    value = static_number(x, what, owner)
    if not value.is_integer():
      raise ValueError(f"{owner}: {what} must be a whole number, got {x!r}.")
  elif is_bool(x) or not isinstance(x, (numbers.Integral, np.integer)):
    raise TypeError(
        f"{owner}: {what} must be an int >= {low}, got {_shown(x)}.")
  else:
    value = x
  if not low <= value <= high:
    bounds = (f"an int >= {low}" if high == INT32_MAX
              else f"between {low} and {high}")
    why = (" (it is stored as an int32)" if value > high == INT32_MAX
           else "")
    raise ValueError(f"{owner}: {what} must be {bounds}{why}, got {int(value)!r}.")
  return int(value)


#: The largest delayed-scaling margin (``Fp8Config.margin``, the scaling
#: functions' ``margin``).
FP8_MARGIN_MAX = 64

#: What a float8 scale's margin is, and why it is a whole number in [0, 64].
FP8_MARGIN_RANGE = (
    "margin is headroom in powers of two: each scale is multiplied by "
    "2**margin, so values that grow between the step whose amax made the "
    "scale and the step that uses it still fit below the format's largest "
    "number. It must be a whole number from 0 to 64: a negative margin "
    "shrinks the scale below amax / format max and clips (saturates) the "
    "largest values, e.g. the biggest products of a matmul; a fractional one "
    "breaks the exact power-of-two scales; and no float8 format spans more "
    "than about 32 powers of two (e4m3: 2**-9 to 448, e5m2: 2**-16 to 57344), "
    "so a margin above that flushes every value to zero, and a larger one "
    "pushes the scale out of float32's range (margin=200 gives infinite "
    "scales and NaN outputs). Transformer Engine "
    "uses 0 by default; 1 or 2 give headroom for growing activations."
)


def fp8_margin(x: Any, owner: str, what: str = "margin") -> int:
  """A float8 scale's margin: a whole number in ``[0, FP8_MARGIN_MAX]``,
  returned as an int (a whole float such as ``1.0`` is accepted)."""
  if is_bool(x) or _is_complex(x) or not (is_real_number(x) or (
      is_array(x) and np.ndim(x) == 0 and is_concrete(x)
      and np.issubdtype(np.asarray(x).dtype, np.number))):
    raise TypeError(
        f"{owner}: {what} must be a whole number from 0 to {FP8_MARGIN_MAX}, "
        f"got {_shown(x)}. {FP8_MARGIN_RANGE}")
  value = float(x)
  if not (math.isfinite(value) and value.is_integer()
          and 0 <= value <= FP8_MARGIN_MAX):
    raise ValueError(
        f"{owner}: {what}={x!r} is not a whole number from 0 to "
        f"{FP8_MARGIN_MAX}. {FP8_MARGIN_RANGE}")
  return int(value)


def choice(x: Any, what: str, owner: str, valid: Sequence[str],
           help_text: str = "", aliases: Mapping[str, str] | None = None) -> str:
  """One of ``valid`` names (case and surrounding space ignored; ``aliases``
  map other spellings to them), canonical; ``help_text`` says what each is."""
  tail = f" {help_text}" if help_text else (
      f" Valid: {', '.join(map(repr, valid))}.")
  if not isinstance(x, str):
    raise TypeError(f"{owner}: {what} must be a string, got {_shown(x)}.{tail}")
  key = x.strip().lower()
  key = (aliases or {}).get(key, key)
  if key not in valid:
    raise ValueError(f"{owner}: unknown {what} {x!r}.{tail}")
  return key


def flag(x: Any, what: str, owner: str) -> bool:
  """A Python (or numpy) bool."""
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{owner}: {what} must be a bool, got {_shown(x)}.")
  return bool(x)


def number(x: Any, what: str, owner: str, *, low: float,
           high: float = math.inf, low_open: bool = False,
           meaning: str = "") -> float:
  """A finite real number in ``[low, high]`` (``(low, high]`` with
  ``low_open``); ``meaning`` says what it is for."""
  if is_bool(x) or not is_real_number(x):
    raise TypeError(
        f"{owner}: {what} must be a number, got {_shown(x)}.")
  value = float(x)
  above = value > low if low_open else value >= low
  if not (math.isfinite(value) and above and value <= high):
    bounds = (f"in {'(' if low_open else '['}{low:g}, {high:g}]"
              if math.isfinite(high) else f"{'>' if low_open else '>='} {low:g}")
    raise ValueError(
        f"{owner}: {what} must be a finite number {bounds}, got "
        f"{x!r}{'; ' + meaning if meaning else ''}.")
  return value


def at_least(x: Any, what: str, owner: str, low: float, meaning: str) -> float:
  """A finite real number >= ``low``; ``meaning`` says what it is for."""
  return number(x, what, owner, low=low, meaning=meaning)


def share(x: Any, what: str, owner: str, *, zero_allowed: bool) -> float:
  """A share of entries: a number in [0, 1] (or (0, 1])."""
  return number(x, what, owner, low=0, high=1, low_open=not zero_allowed,
                meaning=f"{what} is a share of entries, e.g. 0.01 for 1%")


# -- arrays ------------------------------------------------------------------------


def float_array(x: Any, what: str, *, float8: bool = False) -> jax.Array:
  """A floating array (float32, bfloat16, float16; float8 only if allowed),
  returned as a ``jax.Array``; None, bools, integers and objects are
  refused with a TypeError naming ``what``."""
  try:
    x = jax.numpy.asarray(x)
  except (TypeError, ValueError):  # None, strings, objects
    raise TypeError(
        f"{what} must be a floating array, got {_shown(x)}.") from None
  dtype = np.dtype(x.dtype)
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    raise TypeError(
        f"{what} must be a floating array (float32, bfloat16, float16), got "
        f"dtype {dtype.name}. Cast it first, e.g. x.astype(jnp.float32): "
        "float8 quantization scales real values.")
  if not float8 and dtype.itemsize == 1:
    raise TypeError(
        f"{what} is already float8 ({dtype.name}). Pass the high-precision "
        "array (float32, bfloat16 or float16): the quantizer computes the "
        "scale from it and casts it itself.")
  return x


# -- float8 state ------------------------------------------------------------------

#: The name of the float8 amax-history state: the linen collection made by
#: ``PolicyModel.init`` and the attribute of an NNX ``PolicyModule``.
FP8_STATE = "fp8_state"

#: Why the float8 state must not reach an optimizer, and what to do instead.
FP8_STATE_IN_OPTIMIZER = (
    "{owner}: the tree handed to the optimizer contains jmp_lite's float8 "
    "state at {path} (amax histories of delayed scaling). That state is not "
    "a parameter: an optimizer would step it like one (adding momentum and "
    "weight decay to amaxes), which silently corrupts the float8 scales. "
    "Give the optimizer the params only: opt.init(variables['params']) for "
    "linen (pass the 'fp8_state' collection to apply as mutable, like "
    "'batch_stats'), nnx.Optimizer(model, tx, wrt=nnx.Param) for NNX. "
    "docs/fp8.md explains the state."
)


def _key_name(key: Any) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def no_fp8_state(tree: Any, owner: str) -> None:
  """Raises if ``tree`` (params handed to an optimizer) holds the float8 state.

  The state is recognised by its name (:data:`FP8_STATE`) anywhere in the
  tree's key paths (a linen collection, an NNX attribute). Host-side; one
  ``jax.tree`` walk of the paths.
  """
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if any(_key_name(k) == FP8_STATE for k in path):
      raise ValueError(FP8_STATE_IN_OPTIMIZER.format(
          owner=owner, path=jax.tree_util.keystr(path)))


# -- loss scales -------------------------------------------------------------------


def loss_scale_value(x: Any, what: str, owner: str) -> float | None:
  """A concrete scale in [SCALE_MIN, SCALE_MAX], as a float; None for a traced
  value (which cannot be checked: the loss scales clamp it instead)."""
  if not is_concrete(x):
    return None
  value = static_number(x, what, owner)
  if value <= 0:
    raise ValueError(f"{owner}: {what} must be positive, got {value}.")
  if not SCALE_MIN <= value <= SCALE_MAX:
    raise ValueError(
        f"{owner}: {what}={value:g} is outside {SCALE_RANGE}.")
  return value


# -- predicates and mapped axes ------------------------------------------------------


def predicate(pred: Any, what: str) -> jax.Array:
  """A scalar boolean (array or Python/numpy bool), returned as an array."""
  if isinstance(pred, (bool, np.bool_)):
    return jax.numpy.asarray(pred)
  if not is_bool(pred):
    raise TypeError(
        f"{what} must be a scalar boolean array (e.g. the result of "
        f"jmp_lite.all_finite), got {_shown(pred)}. Compare explicitly, e.g. "
        "`x > 0`, or use jmp_lite.all_finite(...)."
    )
  if np.ndim(pred) != 0:
    raise ValueError(
        f"{what} must be a scalar (shape ()), got shape {np.shape(pred)}. "
        "Reduce it first, e.g. with jnp.all(...) or jmp_lite.all_finite(...)."
    )
  return pred


def axis_name(name: Any) -> None:
  """A mapped axis is named by a string (or a tuple of strings)."""
  names = name if isinstance(name, (tuple, list)) else (name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(
        "axis_name must be the name of a pmap/shard_map axis (a string such "
        f"as 'batch') or a tuple of names, got {name!r}. (An integer would be "
        "taken as a positional array axis.)"
    )


def bound_axis(name: Any, owner: str) -> None:
  """Raises unless ``name`` is a mapped axis bound here (pmap/shard_map).

  ``lax.psum`` of a constant is the axis size, computed while tracing (no
  collective runs); on an unbound axis JAX raises NameError (or, under pmap
  over another axis, a bare AssertionError for some collectives).
  """
  axis_name(name)
  try:
    lax.psum(1, name)
  except (NameError, AssertionError) as err:
    raise ValueError(
        f"{owner}(axis_name={name!r}) {UNBOUND_AXIS}. ({err})") from None


# -- functions and transformations ---------------------------------------------------


def function(fn: Any, owner: str, expected: str = "a callable") -> None:
  """A callable argument; ``expected`` says which (``"a loss function"``)."""
  if not callable(fn):
    raise TypeError(f"{owner} expects {expected}, got {_shown(fn)}.")


def optax_transformation(
    inner: Any, owner: str) -> optax.GradientTransformationExtraArgs:
  """An optax ``GradientTransformation``, with extra-args support."""
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"{owner} expects an optax GradientTransformation such as "
        f"optax.adam(1e-3) as its first argument, got {_shown(inner)}."
    )
  return optax.with_extra_args_support(inner)


def argnums(nums: Any, what: str, owner: str) -> tuple[int, ...]:
  """An int or a sequence of distinct non-negative ints."""
  values = tuple(nums) if isinstance(nums, (tuple, list)) else (nums,)
  if not values:
    raise ValueError(
        f"{owner}: {what} must name at least one argument, got {nums!r}.")
  for n in values:
    integer(n, what, owner)
  if len(set(values)) != len(values):
    raise ValueError(f"{owner}: {what} has duplicates: {nums!r}.")
  return tuple(int(n) for n in values)


def argnums_in_range(nums: Sequence[int], what: str, nargs: int,
                     owner: str) -> None:
  """Each index names one of the ``nargs`` positional arguments of a call."""
  bad = [n for n in nums if n >= nargs]
  if bad:
    raise ValueError(
        f"{owner}: {what}={nums if len(nums) > 1 else nums[0]!r} but the "
        f"function was called with {nargs} positional argument(s) (valid "
        f"indices: 0..{nargs - 1}). Pass the batch positionally, or fix "
        f"{what}."
    )


# -- files ---------------------------------------------------------------------------


def path(value: Any, what: str, owner: str) -> None:
  """A file path (str or os.PathLike)."""
  if not isinstance(value, (str, os.PathLike)):
    raise TypeError(
        f"{owner}: {what} must be a file path (a str or os.PathLike such as "
        f"'grads.png'), got {_shown(value)}."
    )
