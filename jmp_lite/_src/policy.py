"""Precision policies: which dtype params are stored in, computed in, returned
in, and how precisely matmuls run.

A policy's float8 recipe (``m=fp8``...) is resolved once, when the policy is
built, to a recipe object of the layer below (``Policy.fp8_recipe``, a
``jmp_lite.fp8.Fp8Config``); applying a policy to a function
(``with_policy``, ``in_float32``) lives in the layer above autocast
(``_src/apply.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, TypeVar
import warnings

import jax
import numpy as np

from jmp_lite._src import dtypes
from jmp_lite._src import tree as tree_lib
from jmp_lite._src.low_precision import recipes as recipes_lib

T = TypeVar("T")

_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "m": "matmul_precision",
    "matmul": "matmul_precision",
}

#: Named presets accepted by :func:`get_policy` (Keras-style names; ``tf32``:
#: float32 everywhere, matmuls and convolutions in TensorFloat-32;
#: ``mixed_fp8``: ``mixed_bfloat16`` with per-tensor float8 matmuls;
#: ``mixed_nvfp4``: ``mixed_bfloat16`` with NVFP4 matmuls; ``mixed_int8``:
#: ``mixed_bfloat16`` with int8 matmuls, for TPUs and A100s).
PRESETS: dict[str, str] = {
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_half": "p=f32,c=half,o=f32",
    "tf32": "p=f32,c=f32,o=f32,m=tf32",
    "mixed_fp8": "p=f32,c=bf16,o=f32,m=fp8",
    "mixed_nvfp4": "p=f32,c=bf16,o=f32,m=nvfp4",
    "mixed_int8": "p=f32,c=bf16,o=f32,m=int8",
}

# Matmul precisions a policy may name: ours (aliases -> canonical name) and
# every jax.lax.DotAlgorithmPreset but DEFAULT, by lowercase name. Each maps to
# the value of jax.default_matmul_precision that applies it.
_PRECISION_ALIASES = {
    "tf32": "tf32", "tensorfloat32": "tf32",
    "f32": "f32", "float32": "f32", "highest": "f32",
    "bf16": "bf16", "bfloat16": "bf16",
}
# "bf16" is the one-pass preset: JAX's own "bfloat16" setting is DEFAULT (TF32
# on NVIDIA GPUs, full float32 on CPU), not a bfloat16 pass.
_JAX_PRECISION = {"tf32": "tensorfloat32", "f32": "highest",
                  "bf16": "BF16_BF16_F32"}
_PRESETS_BY_NAME = {
    preset.name.lower(): preset
    for preset in jax.lax.DotAlgorithmPreset
    if preset.name != "DEFAULT"
}

#: Every matmul precision name a policy accepts (``m=...``), canonical forms.
MATMUL_PRECISIONS: tuple[str, ...] = ("tf32", "f32", "bf16", *_PRESETS_BY_NAME)


#: The compute dtypes a float8 or FP4 recipe takes (its operands are
#: quantized from them and its results come back in them).
_FP8_COMPUTE = tuple(np.dtype(d) for d in ("float32", "bfloat16", "float16"))

#: What a matmul precision may be (``m=``), for errors naming a bad one.
MATMUL_PRECISION_HELP = (
    "Valid: {names} (tf32/f32/bf16 for float32 compute; the others are "
    "jax.lax.DotAlgorithmPreset names), 'default', a float8 recipe: {fp8} "
    "(custom: 'fp8_delayed(margin=1)' or a jmp_lite.fp8.Fp8Config; see "
    "docs/fp8.md), an FP4 recipe: {fp4} (custom: 'nvfp4(rht=false)' or a "
    "jmp_lite.fp4.Fp4Config; see docs/fp4.md), or an int8 recipe: {int8} "
    "(custom: 'int8(quantize_weight_gradient=false)' or a "
    "jmp_lite.int8.Int8Config; see docs/int8.md)."
)


def _recipe_text(value: Any) -> str:
  return value if isinstance(value, str) else value.spec()


def _matmul_precision(
    value: Any, compute_dtype: Any) -> "str | recipes_lib.Fp8Config | None":
  """Validates a matmul precision for a compute dtype; its canonical form.

  A recipe equal to a named one is stored by its name, so that the two
  spellings make equal (and equally hashing) policies.
  """
  given = value
  if isinstance(value, jax.lax.DotAlgorithmPreset):
    value = value.name
  if isinstance(value, str):
    compact = "".join(value.split())
    name = compact.lower()
    if "(" in name:  # The recipe's fields keep their case (axis names).
      value = recipes_lib.from_spec(compact)
    else:
      value = _PRECISION_ALIASES.get(name, name)
  if value is None or value == "default":
    return None
  if isinstance(value, recipes_lib.RECIPE_TYPES) or (
      value in recipes_lib.RECIPE_NAMES):
    if not isinstance(value, str):
      value.check_policy_use()
      value = value.spec() if value.spec() in recipes_lib.RECIPE_NAMES else value
    kind_of = type(recipes_lib.recipe_config(value))
    family, preset, spec = {
        recipes_lib.Fp4Config: ("an FP4", "mixed_nvfp4", "m=nvfp4"),
        recipes_lib.Int8Config: ("an int8", "mixed_int8", "m=int8"),
    }.get(kind_of, ("a float8", "mixed_fp8", "m=fp8"))
    kind, supported = f"is {family} recipe, which", _FP8_COMPUTE
    fix = f"Use e.g. {preset!r} (p=f32,c=bf16,o=f32,{spec})."
  elif not isinstance(value, str):
    raise TypeError(
        "matmul_precision must be a name such as 'tf32', 'fp8' or "
        "'bf16_bf16_f32_x3', a jax.lax.DotAlgorithmPreset, a "
        "jmp_lite.fp8.Fp8Config, a jmp_lite.fp4.Fp4Config or a "
        "jmp_lite.int8.Int8Config, got "
        f"{type(value).__name__}: {value!r}.")
  elif value in _JAX_PRECISION:
    kind, supported = "(how float32 matmuls run)", (dtypes.FLOAT32,)
    fix = ("Use a float32 compute dtype (e.g. get_policy('tf32') or "
           "'p=f32,c=f32,o=f32,m=tf32'), or leave the matmul precision unset "
           "for half-precision compute.")
  elif value in _PRESETS_BY_NAME:
    preset = _PRESETS_BY_NAME[value]
    kind = f"({preset.name})"
    supported = tuple(np.dtype(t) for t in preset.supported_lhs_types or ())
    fix = "Choose a preset for those inputs or change the compute dtype."
  else:
    raise ValueError(
        f"Unknown matmul precision {given!r}. " + MATMUL_PRECISION_HELP.format(
            names=", ".join(MATMUL_PRECISIONS),
            fp8=", ".join(recipes_lib.FP8_RECIPES),
            fp4=", ".join(recipes_lib.FP4_RECIPES),
            int8=", ".join(recipes_lib.INT8_RECIPES)))
  compute = np.dtype(compute_dtype)
  if compute not in supported:
    allowed = ", ".join(d.name for d in supported) or "float8"
    raise ValueError(
        f"matmul_precision {_recipe_text(value)!r} {kind} takes {allowed} "
        f"inputs, but the policy computes in {compute.name}. {fix}")
  return value


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
  """An immutable mixed-precision policy: param, compute and output dtypes.

  Dtypes are canonicalised to JAX's scalar types (``policy.compute_dtype is
  jnp.float16``, as in jmp), so equal policies compare and hash equal however
  they were spelled and a policy is usable as static config. An optional
  ``matmul_precision`` (``"tf32"``, ``"f32"``, ``"bf16"`` or a
  ``jax.lax.DotAlgorithmPreset`` name) says how matmuls run where the policy
  applies; what reaches matmuls and convolutions is tabled in
  ``docs/precision.md`` (matmul precision). A float8 recipe (``"fp8"``,
  ``"fp8_rowwise"``, ``"fp8_blockwise"``, ``"mxfp8"``, ``"fp8_delayed"`` or a
  ``jmp_lite.fp8.Fp8Config``) runs the policy's matmuls in float8 instead:
  ``docs/fp8.md``; an FP4 recipe (``"nvfp4"``, ``"mxfp4"`` or a
  ``jmp_lite.fp4.Fp4Config``) runs them in FP4: ``docs/fp4.md``; an int8
  recipe (``"int8"``, ``"int8_switchback"`` or a
  ``jmp_lite.int8.Int8Config``) runs them as int8 integer products:
  ``docs/int8.md``. ``matmul_precision`` keeps the spelling given (a named
  recipe stays its name); ``fp8_recipe`` holds the recipe resolved to an
  ``Fp8Config``, ``Fp4Config`` or ``Int8Config`` once, when the policy is
  built (None without one).

  Args:
    param_dtype: dtype parameters are stored in (usually float32).
    compute_dtype: dtype the computation runs in (float16/bfloat16 for mixed
      precision).
    output_dtype: dtype outputs are returned in.
    matmul_precision: optional matmul precision, float8, FP4 or int8 recipe; ``None``
      leaves it to JAX's default.

  Raises:
    TypeError: if a dtype is ``None`` or not dtype-like.
    ValueError: for a non-floating, float8 or FP4 dtype, an unknown matmul
      precision, or one that does not apply to the compute dtype (TF32 with
      float16 compute).

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> policy = jmp_lite.Policy(jnp.float32, jnp.float16, jnp.float32)
    >>> str(policy)
    'p=full,c=f16,o=full'
    >>> policy == jmp_lite.get_policy("p=f32,c=f16,o=f32")
    True
    >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
    dtype('float16')
    >>> str(jmp_lite.get_policy("tf32"))
    'p=full,c=full,o=full,m=tf32'
    >>> str(policy.with_compute_dtype("bf16").with_matmul_precision("fp8"))
    'p=full,c=bf16,o=full,m=fp8'
  """

  param_dtype: type
  compute_dtype: type
  output_dtype: type
  matmul_precision: "str | recipes_lib.Fp8Config | None" = None
  #: The policy's float8, FP4 or int8 recipe, resolved once from
  #: ``matmul_precision`` (``"fp8"`` -> ``Fp8Config()``, ``"nvfp4"`` ->
  #: ``Fp4Config()``, ``"int8"`` -> ``Int8Config()``), or None without one.
  fp8_recipe: ("recipes_lib.Fp8Config | recipes_lib.Fp4Config | "
               "recipes_lib.Int8Config | None") = dataclasses.field(
      default=None, init=False, compare=False, repr=False)

  def __init__(
      self,
      param_dtype: Any,
      compute_dtype: Any,
      output_dtype: Any,
      *,
      matmul_precision: Any = None,
  ):
    for field, value in (
        ("param_dtype", param_dtype),
        ("compute_dtype", compute_dtype),
        ("output_dtype", output_dtype),
    ):
      object.__setattr__(self, field, dtypes.scalar_type(value, f"Policy's {field}"))
    object.__setattr__(
        self, "matmul_precision",
        _matmul_precision(matmul_precision, self.compute_dtype))
    object.__setattr__(
        self, "fp8_recipe", recipes_lib.recipe_config(self.matmul_precision))

  def cast_to_param(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the param dtype.

    Casting changes dtypes only: a policy with a matmul precision (``m=``)
    warns once that it takes no effect this way (see :meth:`cast_to_compute`).
    """
    _warn_unapplied_precision(self, "cast_to_param")
    return tree_lib.cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the compute dtype.

    Casting changes dtypes only: a policy's matmul precision (``m=tf32``, a
    float8 recipe such as ``m=fp8``) takes effect through
    :func:`~jmp_lite.with_policy`, :func:`~jmp_lite.autocast` and the Flax
    policies (``jmp_lite.linen``, ``jmp_lite.nnx``), not here. So that a
    jmp-API client (Levanter, Haiku), which only casts, never trains in
    another precision silently, the first cast of each policy with one emits
    a ``UserWarning`` saying how to apply it (``docs/precision.md``,
    Levanter, Haiku, Equinox).
    """
    _warn_unapplied_precision(self, "cast_to_compute")
    return tree_lib.cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating leaves of ``x`` to the output dtype.

    Casting changes dtypes only: a policy with a matmul precision (``m=``)
    warns once that it takes no effect this way (see :meth:`cast_to_compute`).
    """
    _warn_unapplied_precision(self, "cast_to_output")
    return tree_lib.cast_floating(x, self.output_dtype)

  def with_param_dtype(self, param_dtype: Any) -> "Policy":
    """Returns a copy with another param dtype (a dtype or a dtype name)."""
    return dataclasses.replace(self, param_dtype=param_dtype)

  def with_compute_dtype(self, compute_dtype: Any) -> "Policy":
    """Returns a copy with another compute dtype (a dtype or a dtype name)."""
    return dataclasses.replace(self, compute_dtype=compute_dtype)

  def with_output_dtype(self, output_dtype: Any) -> "Policy":
    """Returns a copy with another output dtype (a dtype or a dtype name)."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def with_matmul_precision(self, matmul_precision: Any) -> "Policy":
    """Returns a copy with another matmul precision (``None``: JAX's default)."""
    return dataclasses.replace(self, matmul_precision=matmul_precision)

  def matmul_context(self) -> contextlib.AbstractContextManager:
    """A context applying the matmul precision to what is traced inside it.

    ``jax.default_matmul_precision`` with this policy's precision, or a
    context that changes nothing when the policy has none or a float8 recipe
    (an enclosing policy's precision then stays in force; float8 matmuls are
    made by autocast's interpreter, not by a precision setting).
    """
    if self.matmul_precision is None or self.fp8_recipe is not None:
      return contextlib.nullcontext()
    name = _JAX_PRECISION.get(self.matmul_precision,
                              self.matmul_precision.upper())
    return jax.default_matmul_precision(name)

  def __str__(self) -> str:
    text = "p={},c={},o={}".format(
        dtypes.dtype_name(self.param_dtype),
        dtypes.dtype_name(self.compute_dtype),
        dtypes.dtype_name(self.output_dtype),
    )
    if self.matmul_precision is None:
      return text
    return f"{text},m={_recipe_text(self.matmul_precision)}"

  def __repr__(self) -> str:
    return f"Policy({str(self)!r})"


#: The warning of a policy whose matmul precision a cast cannot apply.
UNAPPLIED_MATMUL_PRECISION = (
    "jmp_lite: m={m} has no effect through Policy.{method}. The policy {policy} "
    "sets its matmuls' precision, but casting changes dtypes only: the "
    "matmuls of code that merely casts with it run in {compute} at JAX's "
    "default precision, not {meaning}. To apply m=, wrap the loss or model "
    "function: jmp_lite.with_policy(loss_fn, policy) or "
    "jmp_lite.autocast(loss_fn, policy); Flax: jmp_lite.linen.apply_policy or "
    "jmp_lite.nnx.apply_policy. Levanter, Haiku and Equinox steps: "
    "docs/precision.md, 'Levanter, Haiku, Equinox'. (Shown once per policy; "
    "if the function these casts feed already runs under one of those, this "
    "warning does not apply.)"
)

# The policies whose UNAPPLIED_MATMUL_PRECISION warning was shown (host-side,
# at trace time: once per policy value, not per call or trace).
_WARNED_UNAPPLIED: set[Policy] = set()


def _warn_unapplied_precision(policy: Policy, method: str) -> None:
  if policy.matmul_precision is None or policy in _WARNED_UNAPPLIED:
    return
  _WARNED_UNAPPLIED.add(policy)
  m = _recipe_text(policy.matmul_precision)
  recipe = policy.fp8_recipe
  if recipe is None:
    meaning = f"at the {m} precision"
  elif isinstance(recipe, recipes_lib.Fp4Config):
    meaning = f"in FP4 ({m})"
  else:  # float8 or int8
    meaning = f"in {recipes_lib.format_name(recipe)} ({m})"
  warnings.warn(
      UNAPPLIED_MATMUL_PRECISION.format(
          m=m, method=method, policy=f"'{policy}'",
          compute=np.dtype(policy.compute_dtype).name, meaning=meaning),
      UserWarning, stacklevel=3)


def cast_inputs(policy: Policy, tree: T) -> T:
  """``policy.cast_to_compute(tree)`` for the library's own routes, which
  apply the matmul precision themselves (so no warning)."""
  return tree_lib.cast_floating(tree, policy.compute_dtype)


def cast_outputs(policy: Policy, tree: T) -> T:
  """``policy.cast_to_output(tree)`` for the library's own routes."""
  return tree_lib.cast_floating(tree, policy.output_dtype)


def _looks_fp8(token: str) -> bool:
  return ("fp8" in token or "float8" in token
          or token in recipes_lib.FP8_RECIPES)


def _looks_fp4(token: str) -> bool:
  return ("fp4" in token or "float4" in token or "e2m1" in token)


def _spec_error(spec: str, problem: str) -> ValueError:
  return ValueError(
      f"Invalid policy spec {spec!r}: {problem}. A spec is a dtype name "
      "(e.g. 'bf16'), a preset "
      f"({', '.join(repr(p) for p in PRESETS)}), or comma-separated key=value "
      "pairs with keys p/params, c/compute, o/output (dtypes) and m/matmul "
      "(matmul precision), e.g. 'params=f32,compute=f16,output=f32'. Valid "
      f"dtype names: {', '.join(dtypes.DTYPE_NAMES)}."
  )


def _split_entries(text: str) -> list[str]:
  """Splits ``text`` at the commas outside a recipe's parentheses."""
  parts, depth, start = [], 0, 0
  for i, char in enumerate(text):
    depth += (char == "(") - (char == ")")
    if char == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def _entry_problem(part: str, key: str, value: str,
                   chosen: dict[str, tuple[str, str]]) -> str | None:
  """What is wrong with one ``key=value`` entry of a spec, or None."""
  if not part:
    return "it has an empty entry (a stray comma?)"
  if value.count("(") < value.count(")"):
    return f"it has a ')' with no '(' before it at {part!r}"
  if value.count("(") > value.count(")"):
    return (f"the recipe {value!r} does not close its parenthesis: "
            "write name(field=value;...), e.g. "
            "'m=fp8_delayed(margin=1;history_length=32)'")
  if "=" not in part or ("=" in value and "(" not in value):
    return f"entry {part!r} is not a single key=value pair"
  if key not in _KEYS:
    return f"unknown key {key!r} (valid keys: {', '.join(_KEYS)})"
  if _KEYS[key] in chosen:
    return (f"key {key!r} sets {_KEYS[key]} which "
            f"{chosen[_KEYS[key]][0]!r} already set")
  return None if value else f"key {key!r} has no value"


def _parse_pairs(spec: str, text: str) -> dict[str, tuple[str, str]]:
  """``"p=f32,c=f16"`` -> ``{"param_dtype": ("p", "f32"), ...}`` (key, value).

  Keys are lowercased, and values but for a custom float8 recipe's fields,
  which sit in parentheses, separated by ``;``:
  ``"c=bf16,m=fp8_delayed(margin=1;history_length=32)"`` (their values keep
  their case: axis names are case-sensitive); the recipe's own grammar is
  checked where it is read (``low_precision/recipes.py``).
  """
  chosen: dict[str, tuple[str, str]] = {}
  for raw_part in _split_entries(text):
    part = raw_part.strip()
    key, _, value = (s.strip() for s in part.partition("="))
    key = key.lower()
    head, paren, fields = value.partition("(")
    value = head.lower() + paren + fields
    problem = _entry_problem(part, key, value, chosen)
    if problem:
      raise _spec_error(spec, problem)
    chosen[_KEYS[key]] = (key, value)
  return chosen


def _parse_dtype(spec: str, value: str, problem: str) -> np.dtype:
  dtype = dtypes.parse_dtype(value)
  if dtype is None:
    hint = (dtypes.FP4_POLICY_DTYPE if _looks_fp4(value) else
            dtypes.FLOAT8_POLICY_DTYPE if _looks_fp8(value) else "")
    raise _spec_error(spec, f"{problem}. {hint[:-1]}" if hint else problem)
  return dtype


def _dtype_of(spec: str, chosen: dict[str, tuple[str, str]], field: str,
              default: np.dtype) -> np.dtype:
  if field not in chosen:
    return default
  key, value = chosen[field]
  return _parse_dtype(spec, value, f"Unknown dtype {value!r} for key {key!r}")


def get_policy(spec: str | Policy) -> Policy:
  """Parses a policy spec, with jmp's grammar plus presets and a matmul key.

  Grammar (case and whitespace are ignored, but in a recipe's axis names):

  * ``"p=f32,c=f16,o=f32"`` or ``"params=f32,compute=f16,output=f32"``: explicit
    dtypes. Missing keys default in a cascade: params to float32, compute to
    params, output to compute (``"c=f16"`` means ``p=f32,c=f16,o=f16``: jmp's
    rule, so outputs -- and a loss computed from them -- are float16 unless
    you say ``o=f32`` or use a ``mixed_*`` preset).
  * ``"f16"``, ``"bf16"``, ``"half"``, ``"full"``...: a bare dtype sets all three.
  * presets: ``"mixed_float16"`` (``p=f32,c=f16,o=f32``), ``"mixed_bfloat16"``
    (``p=f32,c=bf16,o=f32``), ``"mixed_half"`` (half is f16, or bf16 on TPU),
    ``"tf32"`` (``p=f32,c=f32,o=f32,m=tf32``).
  * ``"mixed_fp8"`` (``p=f32,c=bf16,o=f32,m=fp8``): bfloat16 compute with
    per-tensor float8 matmuls; ``"mixed_nvfp4"`` (``p=f32,c=bf16,o=f32,
    m=nvfp4``): with NVFP4 matmuls; ``"mixed_int8"`` (``p=f32,c=bf16,o=f32,
    m=int8``): with int8 matmuls (TPUs, A100s).
  * ``m=...`` / ``matmul=...`` (optional): the matmul precision, e.g.
    ``"p=f32,c=f32,o=f32,m=tf32"`` or ``"c=f32,m=bf16_bf16_f32_x3"``, or a
    float8 recipe: ``fp8``, ``fp8_rowwise``, ``fp8_blockwise``, ``mxfp8``,
    ``fp8_delayed``, or one of them with fields changed,
    ``"m=fp8_delayed(margin=1;history_length=32)"`` (``docs/fp8.md``), or
    an FP4 recipe: ``nvfp4``, ``mxfp4``, or one of them with fields changed,
    ``"m=nvfp4(rht=false;stochastic_rounding=false)"`` (``docs/fp4.md``), or
    an int8 recipe: ``int8``, ``int8_switchback``, or one of them with
    fields changed, ``"m=int8(quantize_weight_gradient=false)"``
    (``docs/int8.md``); see :class:`Policy`. ``str(policy)`` prints it only
    when set, so jmp's specs
    and strings are unchanged.

  ``get_policy(str(policy)) == policy`` (with equal hashes) for every
  policy; a ``Policy`` is returned unchanged.

  Args:
    spec: the spec string, or a ``Policy``.

  Returns:
    The ``Policy``.

  Raises:
    TypeError: if ``spec`` is neither a string nor a ``Policy``.
    ValueError: for an empty spec, an unknown key, dtype or matmul precision,
      a duplicated key or recipe field, recipe fields separated by ``,``
      instead of ``;``, or a malformed pair; the message names the bad token
      and the valid choices.

  Example:
    >>> import jax.numpy as jnp, jmp_lite
    >>> policy = jmp_lite.get_policy("params=f32,compute=f16")
    >>> print(policy)
    p=full,c=f16,o=f16
    >>> jmp_lite.get_policy("mixed_bfloat16").compute_dtype is jnp.bfloat16
    True
    >>> print(jmp_lite.get_policy("c=f32, matmul=TF32"))
    p=full,c=full,o=full,m=tf32
    >>> print(jmp_lite.get_policy("mixed_fp8"))
    p=full,c=bf16,o=full,m=fp8
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError("get_policy expects a spec string such as 'params=f32,"
                    f"compute=f16' or a Policy, got {type(spec).__name__}: {spec!r}.")
  text = spec.strip()
  lowered = text.lower()
  if lowered in PRESETS:
    return get_policy(PRESETS[lowered])
  if "=" not in text:
    dtype = _parse_dtype(spec, lowered, "it is empty" if not text else
                         f"Unknown dtype or preset {lowered!r}")
    return Policy(dtype, dtype, dtype)
  if "(" in text:
    # A custom float8 recipe: its parentheses hold no spaces.
    text = "".join(text.split())
  chosen = _parse_pairs(spec, text)
  param = _dtype_of(spec, chosen, "param_dtype", dtypes.FLOAT32)
  compute = _dtype_of(spec, chosen, "compute_dtype", param)
  output = _dtype_of(spec, chosen, "output_dtype", compute)
  _, matmul = chosen.get("matmul_precision", (None, None))
  try:
    return Policy(param, compute, output, matmul_precision=matmul)
  except ValueError as err:
    raise ValueError(f"Invalid policy spec {spec!r}: {err}") from None


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
