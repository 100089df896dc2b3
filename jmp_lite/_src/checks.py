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
from typing import Any, Callable, Mapping, Sequence
import warnings

import jax
from jax import lax
import numpy as np
import optax

#: The smallest loss scale: the smallest normal float32, 2**-126.
SCALE_MIN = 2.0**-126
#: The largest loss scale, 2**126: its reciprocal is still a normal float32.
SCALE_MAX = 2.0**126
INT32_MAX = 2**31 - 1
#: The largest seed: jax.random.key takes any uint32 on every configuration.
UINT32_MAX = 2**32 - 1

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
    "arrays, no axis_name is needed (jmp_lite.pmean_value_and_grad with "
    "num_groups= instead of axis_name makes the gradient reduction float32 "
    "there)"
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


def real_scalar(x: Any, what: str, owner: str, kind: str = "a number",
                static: bool = False) -> None:
  """A real scalar: a number or a 0-d array (tracers too, unless ``static``:
  static configuration is read in Python), not a bool; ``kind`` says which."""
  if (is_bool(x) or _is_complex(x) or not (is_real_number(x) or is_array(x))
      or (static and not is_concrete(x))):
    shown = (f"a bool ({x!r})" if is_bool(x) else "a traced value (it is "
             "static configuration: pass a Python number)"
             if not is_concrete(x) else _shown(x))
    raise TypeError(f"{owner}: {what} must be {kind}, got {shown}.")
  if np.ndim(x) != 0:
    raise ValueError(f"{owner}: {what} must be a scalar, got an array of shape "
                     f"{np.shape(x)}. Pass a single number.")


def number(x: Any, what: str, owner: str, *, low: float = -math.inf,
           high: float = math.inf, low_open: bool = False,
           meaning: str = "") -> float:
  """Static configuration: a finite real number (Python, numpy or a concrete
  0-d array, never a traced value) in ``[low, high]`` (``(low, high]`` with
  ``low_open``); ``meaning`` says what it is for."""
  real_scalar(x, what, owner, static=True)
  value = float(x)
  above = value > low if low_open else value >= low
  if not (math.isfinite(value) and above and value <= high):
    bounds = (f" in {'(' if low_open else '['}{low:g}, {high:g}]"
              if math.isfinite(high) else f" {'>' if low_open else '>='} {low:g}"
              if math.isfinite(low) else "")
    raise ValueError(f"{owner}: {what} must be a finite number{bounds}, got "
                     f"{x!r}{'; ' + meaning if meaning else ''}.")
  return value


def integer(x: Any, what: str, owner: str, low: int = 0,
            high: int = INT32_MAX, *, whole_floats: bool = False) -> int:
  """An integer in ``[low, high]`` (static). With ``whole_floats``, a float
  such as ``5.0`` is accepted too (jmp accepts ``period=5.0``)."""
  if whole_floats:
    value = number(x, what, owner)
  elif is_bool(x) or not isinstance(x, (numbers.Integral, np.integer)):
    raise TypeError(
        f"{owner}: {what} must be an int >= {low}, got {_shown(x)}.")
  else:
    value = x
  if not (float(value).is_integer() and low <= value <= high):
    bounds = (f"an int >= {low}" if high == INT32_MAX
              else f"between {low} and {high}")
    why = " (it is stored as an int32)" if value > high == INT32_MAX else ""
    raise ValueError(f"{owner}: {what} must be {bounds}{why}, got {x!r}.")
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
  real_scalar(x, what, owner, f"a whole number from 0 to {FP8_MARGIN_MAX}")
  value = float(x)
  if not (value.is_integer() and 0 <= value <= FP8_MARGIN_MAX):
    raise ValueError(f"{owner}: {what}={x!r} is not a whole number from 0 to "
                     f"{FP8_MARGIN_MAX}. {FP8_MARGIN_RANGE}")
  return int(value)


def choice(x: Any, what: str, owner: str, valid: Sequence[str],
           help_text: str = "", aliases: Mapping[str, str] | None = None) -> str:
  """One of ``valid`` names (case and surrounding space ignored; ``aliases``
  map other spellings to them), canonical; ``help_text`` says what each is."""
  tail = help_text or f"Valid: {', '.join(map(repr, valid))}."
  if not isinstance(x, str):
    raise TypeError(f"{owner}: {what} must be a string, got {_shown(x)}. {tail}")
  key = x.strip().lower()
  key = (aliases or {}).get(key, key)
  if key not in valid:
    raise ValueError(f"{owner}: unknown {what} {x!r}. {tail}")
  return key


def flag(x: Any, what: str, owner: str) -> bool:
  """A Python (or numpy) bool."""
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{owner}: {what} must be a bool, got {_shown(x)}.")
  return bool(x)


def at_least(x: Any, what: str, owner: str, low: float, meaning: str) -> float:
  """A finite real number >= ``low``; ``meaning`` says what it is for."""
  return number(x, what, owner, low=low, meaning=meaning)


def share(x: Any, what: str, owner: str, *, zero_allowed: bool) -> float:
  """A share of entries: a number in [0, 1] (or (0, 1])."""
  return number(x, what, owner, low=0, high=1, low_open=not zero_allowed,
                meaning=f"{what} is a share of entries, e.g. 0.01 for 1%")


# -- arrays ------------------------------------------------------------------------


#: What a quantizer takes, and why.
FLOAT_ARRAY = (
    "Pass a float32, bfloat16 or float16 array (cast others first, e.g. "
    "x.astype(jnp.float32)): the quantizer computes the scale from the "
    "high-precision values and casts them itself."
)


def float_array(x: Any, what: str, *, float8: bool = False) -> jax.Array:
  """A floating array (float32, bfloat16, float16; float8 only if allowed),
  returned as a ``jax.Array``; None, bools, integers and objects are
  refused with a TypeError naming ``what``."""
  try:
    x, got = jax.numpy.asarray(x), None
  except (TypeError, ValueError):  # None, strings, objects
    got = f"must be a floating array, got {_shown(x)}"
  if got is None and not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
    got = f"must be a floating array, got dtype {np.dtype(x.dtype).name}"
  elif got is None and not float8 and np.dtype(x.dtype).itemsize == 1:
    got = f"is already float8 ({np.dtype(x.dtype).name})"
  if got is not None:
    raise TypeError(f"{what} {got}. {FLOAT_ARRAY}")
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


def loss_scale_value(x: Any, what: str, owner: str,
                     hint: str = "") -> float | None:
  """A concrete scale in [SCALE_MIN, SCALE_MAX], as a float; None for a traced
  value (which cannot be checked: the loss scales clamp it instead)."""
  if not is_concrete(x):
    return None
  real_scalar(x, what, owner, static=True)
  value = float(x)
  if not SCALE_MIN <= value <= SCALE_MAX:
    problem = (f" must be finite, got {value}" if not math.isfinite(value)
               else f" must be positive, got {value}" if value <= 0
               else f"={value:g} is outside {SCALE_RANGE}")
    raise ValueError(f"{owner}: {what}{problem}.{hint}")
  return value


# -- predicates and mapped axes ------------------------------------------------------


#: What a predicate is, and how to make one.
PREDICATE = ("Pass a bool or a bool array of shape (), e.g. "
             "jmp_lite.all_finite(grads) or jnp.all(x > 0).")


def predicate(pred: Any, what: str) -> jax.Array:
  """A scalar boolean (array or Python/numpy bool), returned as an array."""
  if not is_bool(pred):
    raise TypeError(f"{what} must be a scalar boolean, got {_shown(pred)}. "
                    f"{PREDICATE}")
  if np.ndim(pred) != 0:
    raise ValueError(f"{what} must be a scalar (shape ()), got shape "
                     f"{np.shape(pred)}. {PREDICATE}")
  return jax.numpy.asarray(pred)


def axis_name(name: Any) -> None:
  """A mapped axis is named by a string (or a tuple of strings)."""
  names = name if isinstance(name, (tuple, list)) else (name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(f"axis_name must be a pmap/shard_map axis name (a string "
                    f"such as 'batch') or a tuple of them, got {name!r}. "
                    "(An integer would be a positional array axis.)")


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
    raise ValueError(f"{owner}(axis_name={name!r}) {UNBOUND_AXIS}. ({err})") from None


# -- functions and transformations ---------------------------------------------------


def function(fn: Any, owner: str, expected: str = "a callable") -> None:
  """A callable argument; ``expected`` says which (``"a loss function"``)."""
  if not callable(fn):
    raise TypeError(f"{owner} expects {expected}, got {_shown(fn)}.")


def optax_transformation(
    inner: Any, owner: str) -> optax.GradientTransformationExtraArgs:
  """An optax ``GradientTransformation``, with extra-args support."""
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(f"{owner} expects an optax GradientTransformation such "
                    f"as optax.adam(1e-3) first, got {_shown(inner)}.")
  return optax.with_extra_args_support(inner)


def argnums(nums: Any, what: str, owner: str) -> tuple[int, ...]:
  """An int or a sequence of distinct non-negative ints."""
  values = tuple(nums) if isinstance(nums, (tuple, list)) else (nums,)
  for n in values:
    integer(n, what, owner)
  if not values or len(set(values)) != len(values):
    raise ValueError(f"{owner}: {what} must name one or more distinct "
                     f"arguments, got {nums!r}.")
  return tuple(int(n) for n in values)


#: An argument index beyond those of a call.
ARGNUMS_RANGE = (
    "{owner}: {what}={nums!r} but the function was called with {nargs} "
    "positional argument(s) (valid indices: 0..{last}). Pass the batch "
    "positionally, or fix {what}."
)


def argnums_in_range(nums: Sequence[int], what: str, nargs: int,
                     owner: str) -> None:
  """Each index names one of the ``nargs`` positional arguments of a call."""
  if max(nums) >= nargs:
    raise ValueError(ARGNUMS_RANGE.format(
        owner=owner, what=what, nargs=nargs, last=nargs - 1,
        nums=nums if len(nums) > 1 else nums[0]))


# -- matmuls --------------------------------------------------------------------------

#: The form of a dot_general's dimension numbers.
DIMENSION_NUMBERS = (
    "dimension_numbers must be (((lhs_contract,), (rhs_contract,)), "
    "((lhs_batch,), (rhs_batch,))) as for jax.lax.dot_general: tuples of "
    "distinct non-negative integer axes of each operand, as many for the lhs "
    "as for the rhs, axis for axis of the same size; e.g. "
    "(((x.ndim - 1,), (0,)), ((), ())) for x @ w"
)


def integer_axes(value: Any) -> tuple[int, ...] | None:
  """A group of axes as a tuple of ints (a bare int is one axis; a tuple or
  list of them), or None if an item is not an integer (bools are not)."""
  items = value if isinstance(value, (tuple, list)) else (value,)
  out = []
  for a in items:
    if isinstance(a, (bool, np.bool_)) or not isinstance(a, numbers.Integral):
      return None
    out.append(int(a))
  return tuple(out)


def dimension_numbers(dn: Any, lhs_shape: Sequence[int],
                      rhs_shape: Sequence[int],
                      owner: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
  """``jax.lax.dot_general``'s dimension numbers, normalised to
  ``((lc, rc), (lb, rb))`` tuples of ints for operands of these shapes.

  Raises a ``TypeError`` (as ``jax.lax.dot_general`` does for numbers that do
  not fit its operands) naming ``dimension_numbers``, the value received and
  the expected form: for a malformed structure, a non-integer axis, an axis
  out of range, an axis repeated, unequal numbers of lhs and rhs axes, and
  paired axes of different sizes.
  """
  def refuse(problem: str):
    raise TypeError(f"{owner}: {problem}; got dimension_numbers={dn!r} for "
                    f"lhs of shape {tuple(lhs_shape)} and rhs of shape "
                    f"{tuple(rhs_shape)}. {DIMENSION_NUMBERS}.")

  try:
    (lc, rc), (lb, rb) = dn
  except (TypeError, ValueError):
    lc = None
  if lc is None:
    refuse("not a pair of (lhs, rhs) pairs")
  groups = [integer_axes(g) for g in (lc, rc, lb, rb)]
  if any(g is None for g in groups):
    refuse("an axis is not an integer")
  lc, rc, lb, rb = groups
  for side, shape, contract, batch in (("lhs", lhs_shape, lc, lb),
                                       ("rhs", rhs_shape, rc, rb)):
    axes = contract + batch
    if any(not 0 <= a < len(shape) for a in axes):
      refuse(f"the {side} axes {axes} are not all in [0, {len(shape)})")
    if len(set(axes)) != len(axes):
      refuse(f"the {side} axes {axes} repeat an axis")
  for what, l, r in (("contracting", lc, rc), ("batch", lb, rb)):
    if len(l) != len(r):
      refuse(f"{len(l)} lhs but {len(r)} rhs {what} axes")
    lsize = tuple(lhs_shape[a] for a in l)
    rsize = tuple(rhs_shape[a] for a in r)
    if lsize != rsize:
      refuse(f"the {what} axes have sizes {lsize} (lhs) and {rsize} (rhs)")
  return (lc, rc), (lb, rb)


# -- files ---------------------------------------------------------------------------


def path(value: Any, what: str, owner: str) -> None:
  """A file path (str or os.PathLike)."""
  if not isinstance(value, (str, os.PathLike)):
    raise TypeError(f"{owner}: {what} must be a file path (a str or "
                    f"os.PathLike such as 'grads.png'), got {_shown(value)}.")


# -- public names that went ------------------------------------------------------------


#: What a renamed public name says when it is used (for one release).
RENAMED = ("{old} is now {new}; the old name will be removed in a later "
           "release.")


def old_names(module: str, renamed: Mapping[str, tuple[str, Any]] | None = None,
              removed: Mapping[str, str] | None = None
              ) -> Callable[[str], Any]:
  """A public module's ``__getattr__`` (PEP 562) for the names that went.

  ``renamed`` maps an old name to ``(new, obj)``: the old name still gives
  ``obj``, with a ``DeprecationWarning`` saying ``"{module}.{old} is now
  {new}; ..."`` (``new`` is the new spelling, and what changed if anything
  did). ``removed`` maps an old name to the ``AttributeError`` message that
  names its replacement. Any other name is an ``AttributeError`` as usual.
  Neither kind is in the module's ``__all__``.
  """
  renamed = dict(renamed or {})
  removed = dict(removed or {})

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in renamed:
      new, obj = renamed[name]
      warnings.warn(RENAMED.format(old=f"{module}.{name}", new=new),
                    DeprecationWarning, stacklevel=2)
      return obj
    if name in removed:
      raise AttributeError(removed[name])
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__
