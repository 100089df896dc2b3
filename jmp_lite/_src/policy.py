"""Precision policies: which dtype params are stored in, computed in, returned in."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, TypeVar

import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib

T = TypeVar("T")

_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}

#: Named presets accepted by :func:`get_policy` (Keras-style names).
PRESETS: dict[str, str] = {
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_half": "p=f32,c=half,o=f32",
}


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
  """An immutable mixed-precision policy: param, compute and output dtypes.

  Dtypes are canonicalised to JAX's scalar types (``jnp.float32``,
  ``jnp.float16``, ``jnp.bfloat16``, ``jnp.float64``), the objects jmp uses,
  so that equal policies compare and hash equal whatever spelling built them
  (``jnp.float16``, ``np.float16``, ``np.dtype("float16")``, ``"f16"``), and
  ``policy.compute_dtype is jnp.float16`` holds. A policy is therefore usable
  as static config (``jax.jit``'s ``static_argnums``, Flax module attributes,
  dict keys). A float64 policy needs ``jax.config.update("jax_enable_x64",
  True)`` to give float64 JAX arrays.

  Args:
    param_dtype: dtype parameters are stored in (usually float32).
    compute_dtype: dtype the computation runs in (float16/bfloat16 for mixed
      precision).
    output_dtype: dtype outputs are returned in.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> policy = jmp_lite.Policy(jnp.float32, jnp.float16, jnp.float32)
    >>> str(policy)
    'p=full,c=f16,o=full'
    >>> policy == jmp_lite.get_policy("p=f32,c=f16,o=f32")
    True
    >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
    dtype('float16')
  """

  param_dtype: type
  compute_dtype: type
  output_dtype: type

  def __init__(self, param_dtype: Any, compute_dtype: Any, output_dtype: Any):
    for field, value in (
        ("param_dtype", param_dtype),
        ("compute_dtype", compute_dtype),
        ("output_dtype", output_dtype),
    ):
      object.__setattr__(self, field, dtypes.scalar_type(value, f"Policy's {field}"))

  def cast_to_param(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the param dtype."""
    return tree_lib.cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the compute dtype."""
    return tree_lib.cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the output dtype."""
    return tree_lib.cast_floating(x, self.output_dtype)

  def with_param_dtype(self, param_dtype: Any) -> "Policy":
    """Returns a copy with another param dtype (a dtype or a dtype name)."""
    return Policy(param_dtype, self.compute_dtype, self.output_dtype)

  def with_compute_dtype(self, compute_dtype: Any) -> "Policy":
    """Returns a copy with another compute dtype (a dtype or a dtype name)."""
    return Policy(self.param_dtype, compute_dtype, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> "Policy":
    """Returns a copy with another output dtype (a dtype or a dtype name)."""
    return Policy(self.param_dtype, self.compute_dtype, output_dtype)

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
        dtypes.dtype_name(self.param_dtype),
        dtypes.dtype_name(self.compute_dtype),
        dtypes.dtype_name(self.output_dtype),
    )

  def __repr__(self) -> str:
    return f"Policy({str(self)!r})"


def _spec_error(spec: str, problem: str) -> ValueError:
  return ValueError(
      f"Invalid policy spec {spec!r}: {problem}. A spec is a dtype name "
      "(e.g. 'bf16'), a preset "
      f"({', '.join(repr(p) for p in PRESETS)}), or comma-separated key=dtype "
      "pairs with keys p/params, c/compute, o/output, e.g. "
      "'params=f32,compute=f16,output=f32'. Valid dtype names: "
      f"{', '.join(dtypes.DTYPE_NAMES)}."
  )


def get_policy(spec: str | Policy) -> Policy:
  """Parses a policy spec, with jmp's grammar plus presets.

  Grammar (case and whitespace are ignored):

  * ``"p=f32,c=f16,o=f32"`` or ``"params=f32,compute=f16,output=f32"``: explicit
    dtypes. Missing keys default in a cascade: params to float32, compute to
    params, output to compute (``"c=f16"`` means ``p=f32,c=f16,o=f16``).
  * ``"f16"``, ``"bf16"``, ``"half"``, ``"full"``...: a bare dtype sets all three.
  * presets: ``"mixed_float16"`` (``p=f32,c=f16,o=f32``), ``"mixed_bfloat16"``
    (``p=f32,c=bf16,o=f32``), ``"mixed_half"`` (half is f16, or bf16 on TPU).

  ``get_policy(str(policy)) == policy`` for every policy; a ``Policy`` is
  returned unchanged.

  Args:
    spec: the spec string, or a ``Policy``.

  Returns:
    The ``Policy``.

  Raises:
    TypeError: if ``spec`` is neither a string nor a ``Policy``.
    ValueError: for an empty spec, an unknown key or dtype, a duplicated key or
      a malformed pair; the message names the bad token and the valid choices.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> policy = jmp_lite.get_policy("params=f32,compute=f16")
    >>> print(policy)
    p=full,c=f16,o=f16
    >>> jmp_lite.get_policy("mixed_bfloat16").compute_dtype is jnp.bfloat16
    True
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError(
        "get_policy expects a spec string such as 'params=f32,compute=f16' or a"
        f" Policy, got {type(spec).__name__}: {spec!r}."
    )
  text = spec.strip().lower()
  if not text:
    raise _spec_error(spec, "it is empty")
  if text in PRESETS:
    return get_policy(PRESETS[text])

  if "=" not in text:
    try:
      dtype = dtypes.parse_dtype(text)
    except ValueError:
      raise _spec_error(spec, f"Unknown dtype or preset {text!r}") from None
    return Policy(dtype, dtype, dtype)

  chosen: dict[str, np.dtype] = {}
  seen_token: dict[str, str] = {}
  for raw_part in text.split(","):
    part = raw_part.strip()
    if not part:
      raise _spec_error(spec, "it has an empty entry (a stray comma?)")
    if part.count("=") != 1:
      raise _spec_error(spec, f"entry {part!r} is not a single key=dtype pair")
    key, value = (s.strip() for s in part.split("="))
    if key not in _KEYS:
      raise _spec_error(
          spec,
          f"unknown key {key!r} (valid keys: {', '.join(_KEYS)})",
      )
    field = _KEYS[key]
    if field in chosen:
      raise _spec_error(
          spec,
          f"key {key!r} sets {field} which {seen_token[field]!r} already set",
      )
    if not value:
      raise _spec_error(spec, f"key {key!r} has no dtype")
    try:
      chosen[field] = dtypes.parse_dtype(value)
    except ValueError:
      raise _spec_error(spec, f"Unknown dtype {value!r} for key {key!r}") from None
    seen_token[field] = key

  param = chosen.get("param_dtype", dtypes.FLOAT32)
  compute = chosen.get("compute_dtype", param)
  output = chosen.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Casts every floating leaf of ``tree`` to float32; other leaves pass through.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.cast_to_full({"h": jnp.ones(2, jnp.float16), "i": 3})["h"].dtype
    dtype('float32')
  """
  return tree_lib.cast_floating(tree, dtypes.FLOAT32)


def cast_to_half(tree: T) -> T:
  """Casts every floating leaf of ``tree`` to :func:`half_dtype`.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> jmp_lite.cast_to_half({"f": jnp.ones(2)})["f"].dtype == jmp_lite.half_dtype()
    True
  """
  return tree_lib.cast_floating(tree, dtypes.half_dtype())


def with_policy(fn: Callable[..., Any], policy: str | Policy) -> Callable[..., Any]:
  """Wraps a function so it runs under ``policy``: a functional apply.

  The wrapper casts every floating leaf of its positional and keyword arguments
  (params, inputs) to the compute dtype, calls ``fn`` and casts the floating
  leaves of the result to the output dtype. Integer inputs (labels, token ids),
  ``None`` and other objects pass through. Keep params stored in the param
  dtype outside; gradients with respect to them come back in that dtype.

  Args:
    fn: any function of pytrees, e.g. a Flax ``model.apply``.
    policy: a ``Policy`` or a spec for :func:`get_policy`.

  Returns:
    The wrapped function (``functools.wraps`` keeps ``fn``'s name and doc).

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> def apply(params, x):
    ...   return x @ params["w"]
    >>> f = jmp_lite.with_policy(apply, "p=f32,c=f16,o=f32")
    >>> f({"w": jnp.ones((3, 2))}, jnp.ones((4, 3))).dtype
    dtype('float32')
  """
  if not callable(fn):
    raise TypeError(
        f"with_policy expects a callable (e.g. model.apply), got "
        f"{type(fn).__name__}: {fn!r}."
    )
  policy = get_policy(policy)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    args, kwargs = policy.cast_to_compute((args, kwargs))
    return policy.cast_to_output(fn(*args, **kwargs))

  wrapped.policy = policy  # type: ignore[attr-defined]
  return wrapped
