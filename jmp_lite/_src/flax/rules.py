"""Per-module precision rules shared by the Flax linen and NNX integrations.

Nothing here imports Flax: the framework-specific parts (which classes count as
modules, how a model is walked and called) live in ``linen.py`` and
``nnx.py``.

Vocabulary used by both integrations:

* A *path* is a tuple of keys naming a module inside the model, ``()`` for the
  model itself; rules see it as ``"/".join(keys)``, e.g. ``"decoder/Dense_0"``.
* A *boundary* is a module with a policy of its own: the model itself (the
  policy given to ``apply_policy``) and every module a rule matches. At a
  boundary, floating inputs are cast to the compute dtype and outputs to the
  output dtype.
* Every module computes under the policy of the nearest boundary at or above
  it (its *effective* policy): its params are cast to that compute dtype where
  they are used, and are stored in that param dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, ClassVar, Iterable, Sequence, Union

import numpy as np

from jmp_lite._src import compat
from jmp_lite._src import dtypes
from jmp_lite._src import policy as policy_lib

Path = tuple[Any, ...]


def require_flax(module: str) -> None:
  """Raises an ImportError naming the extra to install if Flax is missing.

  Args:
    module: the public module being imported, e.g. ``"jmp_lite.linen"``.
  """
  try:
    import flax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as err:
    raise ImportError(
        f"{module} needs Flax, which is not installed: pip install "
        f"'jmp_lite[flax]' (or pip install 'flax>={compat.FLAX_FLOOR}'). The rest of "
        "jmp_lite (policies, loss scaling, autocast) works without it."
    ) from err


@dataclasses.dataclass(frozen=True)
class FullPrecision:
  """A rule's policy: keep the matched modules in float32, hand back compute dtype.

  Matched modules store their params in float32, receive float32 inputs and
  compute in float32 (statistics, scale and bias of a norm layer included;
  matmuls and convolutions in full float32, not TF32);
  their outputs go back in the compute dtype of the surrounding policy, so the
  layers after them keep running in half precision. float64 stays float64.
  It is what the default rules use for normalisation layers; use it for any
  numerically sensitive module of your own (a softmax head, a loss module).

  Example:
    >>> import flax.linen as nn, jmp_lite, jmp_lite.linen as jlinen
    >>> rules = jlinen.ModuleRules((nn.LayerNorm, jlinen.FullPrecision()))
    >>> jlinen.FullPrecision().resolve(jmp_lite.get_policy("mixed_bfloat16"))
    Policy('p=full,c=full,o=bf16,m=f32')
  """

  def resolve(self, outer: policy_lib.Policy) -> policy_lib.Policy:
    """Returns the concrete policy inside a module whose outer policy is ``outer``.

    Args:
      outer: the effective policy around the matched module.

    Returns:
      ``Policy(param=at least f32, compute=at least f32,
      output=outer.compute_dtype)``, with float32 matmul precision when the
      compute dtype is float32.

    Raises:
      TypeError: if ``outer`` is not a ``jmp_lite.Policy``.
    """
    if not isinstance(outer, policy_lib.Policy):
      raise TypeError(
          f"FullPrecision.resolve(outer) takes a jmp_lite.Policy, got "
          f"{type(outer).__name__}: {outer!r}. Pass the policy around the "
          "matched module, e.g. jmp_lite.get_policy('mixed_bfloat16').")
    compute = dtypes.at_least_f32(outer.compute_dtype)
    return policy_lib.Policy(
        dtypes.at_least_f32(outer.param_dtype),
        compute,
        outer.compute_dtype,
        # Full float32 matmuls too: JAX's GPU default for float32 is TF32.
        matmul_precision="f32" if compute == dtypes.FLOAT32 else None,
    )


class UnmatchedRuleWarning(UserWarning):
  """A path rule of a policy matched no module of the model.

  Usually a typo in the pattern. Patterns are matched against paths such as
  ``"decoder/Dense_0"`` with :func:`fnmatch.fnmatchcase` (``*`` also matches
  ``/``); compiled regexes must match the whole path. Silence it with
  ``warnings.filterwarnings("ignore", category=UnmatchedRuleWarning)`` where a
  rule is meant for optional parts of a model.

  Example:
    >>> import warnings, jmp_lite.linen as jlinen
    >>> warnings.filterwarnings("ignore", category=jlinen.UnmatchedRuleWarning)
  """


#: What a rule can match by (the hint of a rule whose match is not one).
RULE_MATCHERS = (
    "A rule matches modules by class (e.g. nn.LayerNorm, or a non-empty tuple "
    "of classes), by path pattern (e.g. 'decoder/*', fnmatch syntax) or by a "
    r"compiled str regex (e.g. re.compile(r'block_\d+/attn'))."
)

#: What a rule's policy can be (the hint of one that is none of them).
RULE_POLICIES = (
    "A rule's policy is a jmp_lite.Policy, a spec string such as "
    "'p=f32,c=f32,o=f16', or FullPrecision() (an instance, not the class)."
)
#: What a rule looks like.
RULE_EXAMPLE = (
    "Example: (nn.LayerNorm, FullPrecision()) or ('decoder/*', "
    "'p=f32,c=f32,o=f16')."
)

#: Why a bytes pattern is refused.
BYTES_PATTERN = (
    "A path pattern must be a str (e.g. 'decoder/*') or a compiled str regex "
    r"(e.g. re.compile(r'block_\d+/attn'), not re.compile(b'...')), or the "
    "rule matches by module type (e.g. nn.Dense)."
)

Override = Union[policy_lib.Policy, FullPrecision]
Matcher = Union[tuple, str, "re.Pattern[str]"]


def path_str(path: Path) -> str:
  """``("blocks", 0, "norm")`` -> ``"blocks/0/norm"``; ``()`` -> ``""``."""
  return "/".join(str(k) for k in path)


def _describe_match(match: Matcher) -> str:
  if isinstance(match, tuple):
    names = ", ".join(c.__name__ for c in match)
    return f"({names})" if len(match) > 1 else names
  if isinstance(match, str):
    return repr(match)
  return f"re.compile({match.pattern!r})"


@dataclasses.dataclass(frozen=True)
class Framework:
  """What the shared code needs to know about one Flax API (linen or NNX).

  Attributes:
    name: the Flax API, for messages (``"flax.linen"``).
    public_module: jmp_lite's public module for it (``"jmp_lite.linen"``).
    module_base: its module base class (``flax.linen.Module``).
    instance_example: how to make an instance of a class ``{cls}``, for hints
      (``"{cls}(...)"``).
    other: the other Flax API's name (``"flax.nnx"``); classes whose module
      starts with it get a hint pointing there.
    other_public_module: jmp_lite's public module for the other API.
  """

  name: str
  public_module: str
  module_base: type
  instance_example: str
  other: str
  other_public_module: str

  @property
  def other_hint(self) -> str:
    return (f"For {self.other} models use {self.other_public_module}.ModuleRules"
            f" and {self.other_public_module}.apply_policy.")

  def is_other(self, obj: Any) -> bool:
    """Whether ``obj`` (a class or an instance) belongs to the other Flax API."""
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__module__.startswith(self.other)

  def check_module(self, module: Any) -> None:
    """``apply_policy``'s check that it was given one of this API's modules."""
    if isinstance(module, self.module_base):
      return
    hint = ""
    if self.is_other(module):
      hint = (f" For {self.other} modules use "
              f"{self.other_public_module}.apply_policy.")
    elif isinstance(module, type) and issubclass(module, self.module_base):
      example = self.instance_example.format(cls=module.__name__)
      hint = f" Pass an instance, e.g. {example}, not the class."
    raise TypeError(
        f"{self.public_module}.apply_policy expects a {self.name}.Module "
        f"instance, got {type(module).__name__}: {module!r}.{hint}"
    )


def is_policy_method(name: str) -> bool:
  """Methods whose calls are policy boundaries: ``__call__`` and public ones.

  ``setup`` (linen's constructor hook) is not one.
  """
  if name == "__call__":
    return True
  return name.isidentifier() and not name.startswith("_") and name != "setup"


@dataclasses.dataclass(frozen=True, init=False)
class ModuleRulesBase:
  """Ordered, immutable, hashable per-module policy rules (framework-neutral).

  Use the framework's subclass: ``jmp_lite.linen.ModuleRules`` or
  ``jmp_lite.nnx.ModuleRules``.
  """

  entries: tuple[tuple[Matcher, Override], ...]

  #: The Flax API the rules are for (set by each subclass).
  framework: ClassVar[Framework]

  def __init__(self, *entries: Any):
    normalised = tuple(
        self._normalise_entry(i, entry) for i, entry in enumerate(entries)
    )
    object.__setattr__(self, "entries", normalised)

  # -- construction -----------------------------------------------------------

  @classmethod
  def _normalise_entry(cls, index: int, entry: Any) -> tuple[Matcher, Override]:
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
      raise TypeError(f"{cls.__qualname__} entry {index} must be a (match, "
                      f"policy) pair, got {type(entry).__name__}: {entry!r}. "
                      f"{RULE_EXAMPLE}")
    match, override = entry
    return cls._normalise_match(index, match), cls._normalise_override(
        index, match, override
    )

  @classmethod
  def _normalise_match(cls, index: int, match: Any) -> Matcher:
    where = f"{cls.__qualname__} entry {index}"
    if isinstance(match, str):
      if not match:
        raise ValueError(
            f"{where}: the path pattern is empty. Use e.g. 'decoder/*' (fnmatch"
            " syntax; '*' also matches '/')."
        )
      return match
    if isinstance(match, re.Pattern) and isinstance(match.pattern, str):
      return match
    if isinstance(match, (bytes, bytearray, re.Pattern)):
      # A bytes regex (re.compile(b'...')) or bytes key: paths are str.
      raise TypeError(f"{where}: {_describe_match_raw(match)} is a bytes "
                      f"pattern; module paths are str. {BYTES_PATTERN}")
    classes = match if isinstance(match, tuple) else (match,)
    for c in classes or (match,):  # an empty tuple is refused like a non-class
      cls._check_module_class(where, c)
    return tuple(classes)

  @classmethod
  def _check_module_class(cls, where: str, c: Any) -> None:
    framework = cls.framework
    if isinstance(c, type) and issubclass(c, framework.module_base):
      return
    if isinstance(c, framework.module_base):
      problem = (f"got a module instance ({type(c).__name__}(...)); rules "
                 f"match by class, so pass the class {type(c).__name__} itself.")
    elif isinstance(c, type):
      problem = (f"{c.__module__}.{c.__qualname__} is not a {framework.name} "
                 "module class.")
    else:
      problem = (f"{type(c).__name__}: {c!r} is not a {framework.name} module "
                 "class.")
    hint = (framework.other_hint
            if isinstance(c, type) and framework.is_other(c) else RULE_MATCHERS)
    raise TypeError(f"{where}: {problem} {hint}")

  @classmethod
  def _normalise_override(cls, index: int, match: Any, override: Any) -> Override:
    where = f"{cls.__qualname__} entry {index} ({_describe_match_raw(match)})"
    if isinstance(override, (policy_lib.Policy, FullPrecision)):
      return override
    try:
      return policy_lib.get_policy(override)
    except (TypeError, ValueError) as e:
      hint = f" {RULE_POLICIES}" if isinstance(e, TypeError) else ""
      raise type(e)(f"{where}: {e}{hint}") from None

  # -- use --------------------------------------------------------------------

  @classmethod
  def coerce(cls, rules: Any, where: str) -> "ModuleRulesBase":
    """Accepts rules of this framework, ``None`` (no rules) or a pair sequence."""
    if rules is None:
      return cls()
    if isinstance(rules, cls):
      return rules
    if isinstance(rules, (tuple, list)):
      return cls(*rules)
    if isinstance(rules, ModuleRulesBase):
      got = (f"{rules.framework.public_module}.ModuleRules "
             f"({rules.framework.name} rules); {cls.framework.name} models need "
             f"{cls.framework.public_module}.ModuleRules. "
             f"{cls.framework.other_hint}")
    else:
      got = f"{type(rules).__name__}."
    raise TypeError(
        f"{where}: rules must be a ModuleRules (e.g. DEFAULT_MODULE_RULES), a "
        f"sequence of (match, policy) pairs, or None; got {got}"
    )

  @property
  def has_class_rules(self) -> bool:
    """Whether any rule matches by class (then the module tree must be known)."""
    return any(isinstance(m, tuple) for m, _ in self.entries)

  def match(self, path: Path, cls: type | None) -> Override | None:
    """Returns the override of the first rule matching a module, or None.

    Args:
      path: the module's path.
      cls: the module's class, or None where unknown (class rules then do
        not match).
    """
    text = path_str(path)
    for matcher, override in self.entries:
      if _matches(matcher, cls, text):
        return override
    return None

  def unmatched_patterns(self, paths: Iterable[Path]) -> list[tuple[int, Matcher]]:
    """The path rules (index, pattern) that match none of ``paths``."""
    texts = {path_str(p) for p in paths}
    return [
        (i, m)
        for i, (m, _) in enumerate(self.entries)
        if not isinstance(m, tuple) and not any(_matches(m, None, t) for t in texts)
    ]

  def __add__(self, other: Any) -> "ModuleRulesBase":
    if not isinstance(other, ModuleRulesBase):
      return NotImplemented
    if type(other) is not type(self):
      raise TypeError(
          f"Cannot combine {self.framework.name} rules with "
          f"{other.framework.name} rules."
      )
    return type(self)(*self.entries, *other.entries)

  def __len__(self) -> int:
    return len(self.entries)

  def __iter__(self):
    return iter(self.entries)

  def __repr__(self) -> str:
    body = ", ".join(
        f"({_describe_match(m)}, {o!r})" for m, o in self.entries
    )
    return f"{type(self).__qualname__}({body})"


def _describe_match_raw(match: Any) -> str:
  if isinstance(match, type):
    return match.__name__
  if isinstance(match, tuple) and all(isinstance(c, type) for c in match):
    return _describe_match(match)
  if isinstance(match, str) or (isinstance(match, re.Pattern)
                                and isinstance(match.pattern, str)):
    return _describe_match(match)
  if isinstance(match, re.Pattern):
    return f"re.compile({match.pattern!r})"
  return repr(match)


def _matches(matcher: Matcher, cls: type | None, text: str) -> bool:
  if isinstance(matcher, tuple):
    return cls is not None and issubclass(cls, matcher)
  if isinstance(matcher, str):
    return fnmatch.fnmatchcase(text, matcher)
  return matcher.fullmatch(text) is not None


def resolve_override(override: Override, outer: policy_lib.Policy) -> policy_lib.Policy:
  """The concrete policy of a boundary, given the policy around it."""
  if isinstance(override, FullPrecision):
    return override.resolve(outer)
  return override


class Resolver:
  """Answers, for one call of a model, which policy each module runs under.

  Args:
    policy: the model's policy (the boundary at path ``()``).
    rules: the rules, first match wins.
    classes: path -> module class for the modules known so far. The dict is
      read, and extended by :meth:`note`; it is owned by one call.
  """

  def __init__(
      self,
      policy: policy_lib.Policy,
      rules: ModuleRulesBase,
      classes: dict[Path, type] | None = None,
  ):
    self.policy = policy
    self.rules = rules
    self.classes = {} if classes is None else classes
    self._boundary: dict[Path, policy_lib.Policy | None] = {}

  def note(self, path: Path, cls: type) -> None:
    """Records a module's class (the first class seen at a path wins)."""
    self.classes.setdefault(path, cls)

  def boundary(self, path: Path) -> policy_lib.Policy | None:
    """The module's own policy if it is a boundary, else None."""
    if path not in self._boundary:
      override = self.rules.match(path, self.classes.get(path))
      outer = self.policy if not path else self.effective(path[:-1])
      if override is None:
        result = self.policy if not path else None
      else:
        result = resolve_override(override, outer)
      self._boundary[path] = result
    return self._boundary[path]

  def describe(self, path: Path) -> policy_lib.Policy:
    """What a module runs under, as reported to users.

    A boundary's own policy; for any other module the effective policy with
    output dtype = compute dtype (its outputs are not cast).
    """
    found = self.boundary(path)
    if found is not None:
      return found
    inner = self.effective(path)
    return inner.with_output_dtype(inner.compute_dtype)

  def effective(self, path: Path) -> policy_lib.Policy:
    """The policy a module (or a variable owned by it) computes under."""
    for end in range(len(path), 0, -1):
      found = self.boundary(path[:end])
      if found is not None:
        return found
    return self.boundary(())  # the root is always a boundary


def all_prefixes(paths: Iterable[Path]) -> set[Path]:
  """Every path and all its prefixes (module paths implied by variable paths)."""
  out: set[Path] = set()
  for p in paths:
    for end in range(len(p) + 1):
      out.add(tuple(p[:end]))
  return out


def unmatched_message(
    rules: ModuleRulesBase, paths: Sequence[Path], model_name: str
) -> str | None:
  """A warning text for path rules that match no module, or None."""
  unmatched = rules.unmatched_patterns(paths)
  if not unmatched:
    return None
  shown = sorted(path_str(p) for p in paths if p)
  listing = ", ".join(repr(p) for p in shown[:12])
  if len(shown) > 12:
    listing += f", ... ({len(shown)} in all)"
  bad = ", ".join(f"entry {i} {_describe_match(m)}" for i, m in unmatched)
  return (
      f"jmp_lite: the path rule(s) {bad} matched no module of {model_name}. "
      f"Its module paths are: {listing or '(only the model itself)'}. Patterns "
      "use fnmatch syntax on '/'-joined paths ('*' also matches '/'); regexes "
      "must match a whole path. Fix the pattern, or silence this with "
      "warnings.filterwarnings('ignore', category="
      f"{rules.framework.public_module}.UnmatchedRuleWarning)."
  )


def storable(stored: Any, wanted: Any) -> bool:
  """Whether params stored in ``stored`` satisfy a param dtype of ``wanted``.

  Equal dtypes, and wider ones (a float32 copy under a bfloat16 policy is never
  less accurate), are fine; narrower or same-width-but-different ones are not.
  """
  stored, wanted = np.dtype(stored), np.dtype(wanted)
  return stored == wanted or stored.itemsize > wanted.itemsize


def narrow_params_error(
    leaf_path: Path,
    stored: np.dtype,
    owner_policy: policy_lib.Policy,
    count: int,
    fix: str,
) -> ValueError:
  """The message for params stored narrower than their policy's param dtype."""
  more = f" ({count - 1} other param(s) too)" if count > 1 else ""
  return ValueError(
      f"jmp_lite: param {path_str(leaf_path)!r} is stored in "
      f"{np.dtype(stored).name}{more}, but its module's policy "
      f"({owner_policy}) stores params in {np.dtype(owner_policy.param_dtype).name}. "
      "Params kept in half precision lose small updates (a float16 weight of "
      "1.0 cannot move by less than ~0.0005), which is why mixed precision "
      f"keeps a float32 copy. Fix: {fix} To train in pure half precision on "
      "purpose, use a policy that says so, e.g. "
      "jmp_lite.get_policy('p=f16,c=f16,o=f16')."
  )


def check_params(
    leaves: Iterable[tuple[Path, Any]], resolver: Resolver, fix: str
) -> None:
  """Raises if a param is stored narrower than its module's param dtype.

  Args:
    leaves: ``(variable path, value)`` for every param; the owning module's
      path is the variable path without its last key.
    resolver: answers which policy each module runs under.
    fix: how to fix it in this Flax API, for the message.

  Raises:
    ValueError: naming the first such param, its dtype, its policy and the fix.
  """
  bad = [
      (path, np.dtype(value.dtype), resolver.effective(path[:-1]))
      for path, value in leaves
      if hasattr(value, "dtype") and dtypes.is_floating(value.dtype)
      and not storable(value.dtype, resolver.effective(path[:-1]).param_dtype)
  ]
  if bad:
    path, dtype, owner = bad[0]
    raise narrow_params_error(path, dtype, owner, len(bad), fix=fix)
