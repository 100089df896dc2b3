"""Policies on Flax linen models: ``apply_policy``, ``PolicyModel``,
``ModuleRules``.

A linen model is a pure function of its variables, so ``PolicyModel`` wraps
``init``/``apply``: params are cast per module, and a
``flax.linen.intercept_methods`` interceptor casts at every boundary (and, for
float8 recipes, marks it for autocast's interpreter). Delayed float8 scaling
keeps its amax histories in the ``"fp8_state"`` collection.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping
import warnings

import flax.linen as nn
from flax import traverse_util
from flax.core import FrozenDict
from flax.core import scope as flax_scope
import jax
import jax.numpy as jnp

from jmp_lite._src import checks
from jmp_lite._src.fp8 import config as fp8_config
from jmp_lite._src.flax import rules as common
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree as tree_lib



class ModuleRules(common.ModuleRulesBase):
  """Ordered per-module policy overrides for linen models; first match wins.

  Each entry is a ``(match, policy)`` pair:

  * ``match``: a ``flax.linen.Module`` subclass or a tuple of them (matched
    with ``isinstance``, so subclasses match too); a path pattern string in
    :mod:`fnmatch` syntax matched against ``"/".join(module.path)``, e.g.
    ``"decoder/*"`` (``*`` also matches ``/``); or a compiled ``re.Pattern``
    that must match the whole path.
  * ``policy``: a ``jmp_lite.Policy``, a spec string such as
    ``"p=f32,c=f32,o=f16"``, or :class:`FullPrecision` (float32 inside,
    surrounding compute dtype out).

  A matched module is a *boundary*: its floating inputs are cast to its
  compute dtype and its outputs to its output dtype. Modules inside it inherit
  its param and compute dtypes. Rules are immutable and hashable (usable as
  static config), combine with ``+`` (earlier rules win) and validate their
  entries when built.

  Example:
    >>> import re, flax.linen as nn, jmp_lite.linen as jlinen
    >>> rules = jlinen.ModuleRules(
    ...     ("head", "p=f32,c=f32,o=f32"),                 # by path
    ...     (re.compile(r"block_\\d+/attn"), jlinen.FullPrecision()),
    ... ) + jlinen.DEFAULT_MODULE_RULES                          # norms in f32
    >>> len(rules), hash(rules) == hash(rules + jlinen.ModuleRules())
    (3, True)
  """

  framework = common.Framework(
      name="flax.linen",
      public_module="jmp_lite.linen",
      module_base=nn.Module,
      instance_example="{cls}(...)",
      other="flax.nnx",
      other_public_module="jmp_lite.nnx",
  )


#: Normalisation layers keep float32 statistics, scale and bias, and hand their
#: output back in the compute dtype.
DEFAULT_MODULE_RULES = ModuleRules(
    (
        (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm),
        common.FullPrecision(),
    ),
)


def _recorder(classes: dict[common.Path, type]) -> Callable[..., Any]:
  """An interceptor that records the class of every module that runs."""

  def intercept(next_fun, args, kwargs, context):
    # Lifted transforms (nn.scan, nn.remat...) also call a '<lambda>' method on
    # a wrapper whose path is not its real one: skip those.
    if context.method_name.isidentifier():
      classes.setdefault(tuple(context.module.path), type(context.module))
    return next_fun(*args, **kwargs)

  return intercept


def _boundary_interceptor(
    resolver: common.Resolver, seen: set[common.Path], fp8: bool = False
) -> Callable[..., Any]:
  """An interceptor casting inputs and outputs at every policy boundary.

  With ``fp8``, each boundary also marks its region with its policy's float8
  recipe (or none) for autocast's interpreter.
  """
  active: list[common.Path] = []

  def intercept(next_fun, args, kwargs, context):
    name = context.method_name
    if not name.isidentifier():
      return next_fun(*args, **kwargs)
    module = context.module
    path = tuple(module.path)
    resolver.note(path, type(module))
    seen.add(path)
    # A module's own methods calling each other (``__call__`` -> ``encode``)
    # stay inside it: no cast to the output dtype in the middle.
    if not common.is_policy_method(name) or path in active:
      return next_fun(*args, **kwargs)
    policy = resolver.boundary(path)
    if policy is None:  # Not a boundary: the module runs as written.
      return next_fun(*args, **kwargs)
    active.append(path)
    try:
      args, kwargs = policy_lib.cast_inputs(policy, (args, kwargs))
      with common.fp8_region(policy, fp8), policy.matmul_context():
        return policy_lib.cast_outputs(policy, next_fun(*args, **kwargs))
    finally:
      active.pop()

  return intercept


def _map_params(params: Any, fn: Callable[[common.Path, Any], Any]) -> Any:
  """Maps ``fn(owner_path, leaf)`` over a params collection.

  ``owner_path`` is the path of the module owning the leaf. Boxed leaves such
  as ``nn.Partitioned`` are handed to ``fn`` whole (``flatten_dict`` stops at
  them); a ``FrozenDict`` stays frozen.
  """
  flat = traverse_util.flatten_dict(params)
  out = traverse_util.unflatten_dict(
      {path: fn(path[:-1], leaf) for path, leaf in flat.items()})
  return FrozenDict(out) if isinstance(params, FrozenDict) else out


def _replace_collection(variables: Any, name: str, value: Any) -> Any:
  out = dict(variables)
  out[name] = value
  return FrozenDict(out) if isinstance(variables, FrozenDict) else out


@dataclasses.dataclass(frozen=True)
class PolicyModel:
  """A linen model with a precision policy: ``init`` and ``apply`` like linen's.

  Made by :func:`apply_policy`. Immutable and hashable when the module is, so
  it can be closed over or passed as a static argument to ``jax.jit``.

  Attributes:
    module: the wrapped linen module (unchanged).
    policy: the model's policy: its inputs are cast to ``compute_dtype``, its
      outputs to ``output_dtype``, and modules no rule matches store params in
      ``param_dtype`` and compute in ``compute_dtype``.
    module_rules: the per-module overrides (:class:`ModuleRules`).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
    >>> model = jlinen.apply_policy(nn.Dense(3), "mixed_float16")
    >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> variables["params"]["kernel"].dtype, model.apply(variables, jnp.ones((2, 4))).dtype
    (dtype('float32'), dtype('float32'))
  """

  module: nn.Module
  policy: policy_lib.Policy
  module_rules: ModuleRules

  def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
    """Creates the model's variables, params in their policy's param dtype.

    The model runs as written (no casting) to create its variables; then each
    module's params are cast to the param dtype of its effective policy.
    Other collections (``batch_stats``...) are returned as created. Where a
    policy has a delayed-scaling float8 recipe, the model is also traced
    once more (abstractly, under its policy) to create the ``"fp8_state"``
    collection: zero amax histories for each float8 matmul
    (``docs/fp8.md``).

    Args:
      rngs: as for ``flax.linen.Module.init`` (a key or a dict of keys).
      *args: the model's positional inputs.
      method: as for ``Module.init``.
      **kwargs: the model's keyword inputs and ``Module.init`` options
        (``mutable=``, ``capture_intermediates=``).

    Returns:
      The variables dict, as ``Module.init`` returns it.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
      >>> model = jlinen.apply_policy(nn.LayerNorm(), "p=bf16,c=bf16,o=bf16")
      >>> model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]["scale"].dtype
      dtype('float32')
    """
    classes: dict[common.Path, type] = {}
    with nn.intercept_methods(_recorder(classes)):
      variables = self.module.init(rngs, *args, method=method, **kwargs)
    resolver = common.Resolver(self.policy, self.module_rules, classes)
    params = variables.get("params") if isinstance(variables, Mapping) else None
    if params is not None:
      self._warn_unmatched(set(classes) | _owner_paths(params))
      params = _map_params(
          params,
          lambda owner, leaf: tree_lib.cast_floating(
              leaf, resolver.effective(owner).param_dtype
          ),
      )
      variables = _replace_collection(variables, "params", params)
    if self._fp8_kind() == "delayed":
      state = self._initial_fp8_state(variables, rngs, args, method, kwargs)
      variables = _replace_collection(variables, checks.FP8_STATE, state)
    return variables

  def apply(
      self,
      variables: Any,
      *args: Any,
      rngs: Any = None,
      method: Any = None,
      mutable: Any = False,
      **kwargs: Any,
  ) -> Any:
    """Runs the model under its policy; the signature of ``Module.apply``.

    Params are cast per module to the compute dtype of its effective policy,
    floating inputs and outputs are cast at every boundary, and mutable
    collections come back in the dtypes they came in with. Where a policy
    has a float8 recipe, the model is traced and its matmuls run in float8
    (``docs/fp8.md``); a delayed-scaling recipe reads the ``"fp8_state"``
    collection, and rolls it (returns the new one) when ``mutable`` includes
    ``"fp8_state"``, as BatchNorm's ``"batch_stats"``.

    Args:
      variables: the variables (from :meth:`init`, or your own with params
        stored in the policy's param dtype or wider).
      *args: the model's positional inputs.
      rngs: as for ``Module.apply`` (e.g. ``{"dropout": key}``).
      method: as for ``Module.apply``.
      mutable: as for ``Module.apply`` (e.g. ``["batch_stats"]``).
      **kwargs: the model's keyword inputs and other ``Module.apply`` options.

    Returns:
      The output, or ``(output, mutated_variables)`` when ``mutable`` is set.

    Raises:
      ValueError: if a param is stored narrower than its policy's param dtype
        (e.g. float16 params under a float32-param policy), or a delayed
        float8 recipe finds no ``"fp8_state"`` in ``variables``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
      >>> model = jlinen.apply_policy(nn.BatchNorm(use_running_average=False), "mixed_bfloat16")
      >>> variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
      >>> y, updates = model.apply(variables, jnp.ones((4, 3)), mutable=["batch_stats"])
      >>> y.dtype, updates["batch_stats"]["mean"].dtype
      (dtype('float32'), dtype('float32'))
    """
    fp8 = self._fp8_kind()
    fp8_state, flax_mutable, roll = None, mutable, False
    if fp8 is not None:
      variables, fp8_state = _pop_collection(variables, checks.FP8_STATE)
      roll = fp8 == "delayed" and flax_scope.in_filter(mutable,
                                                        checks.FP8_STATE)
      flax_mutable = _without(mutable, checks.FP8_STATE)
      if fp8 == "delayed" and fp8_state is None:
        raise ValueError(_NO_FP8_STATE)
    call_kwargs = dict(rngs=rngs, method=method, mutable=flax_mutable,
                       **kwargs)
    classes = (
        self._discover(variables, args, call_kwargs)
        if self.module_rules.has_class_rules
        else {}
    )
    resolver = common.Resolver(self.policy, self.module_rules, classes)
    run_variables = variables
    params = variables.get("params") if isinstance(variables, Mapping) else None
    if params is not None:
      self._check_params(params, resolver)
      params = _map_params(
          params,
          lambda owner, leaf: tree_lib.cast_floating(
              leaf, resolver.effective(owner).compute_dtype
          ),
      )
      run_variables = _replace_collection(variables, "params", params)
    seen: set[common.Path] = set()
    interceptor = _boundary_interceptor(resolver, seen, fp8=fp8 is not None)
    if fp8 is None:
      with nn.intercept_methods(interceptor), self.policy.matmul_context():
        out = self.module.apply(run_variables, *args, **call_kwargs)
    else:
      float8 = common.fp8_interpreter()
      store = None if fp8 == "current" else float8.Fp8Store(
          fp8_state, "roll" if roll else "read")
      with nn.intercept_methods(interceptor):
        out = float8.evaluate(self.module.apply, (run_variables, *args),
                              call_kwargs, self.policy, store=store,
                              owner="jmp_lite.linen")
    known = seen | set(classes)
    if params is not None:
      known |= _owner_paths(params)
    self._warn_unmatched(known)
    # The model's outputs leave in the policy's output dtype even where a rule
    # matches the model itself (e.g. a bare BatchNorm under DEFAULT_MODULE_RULES).
    if mutable is False:
      return policy_lib.cast_outputs(self.policy, out)
    y, updated = (out, {}) if flax_mutable is False else out
    updated = tree_lib.cast_like(updated, variables)
    if roll:
      updated = _replace_collection(updated, checks.FP8_STATE, store.final())
    return policy_lib.cast_outputs(self.policy, y), updated

  def module_policies(
      self, variables: Any, *args: Any, **kwargs: Any
  ) -> dict[str, policy_lib.Policy]:
    """The policy of every module one call would run, by path.

    Traces the model abstractly (no computation). Useful to check that rules
    do what you meant. Boundaries (the model, matched modules) report their
    own policy; other modules the param and compute dtypes they inherit, with
    output dtype = compute dtype (their outputs are not cast).

    Args:
      variables: as for :meth:`apply`.
      *args: the model's positional inputs.
      **kwargs: keyword inputs and ``Module.apply`` options (``rngs=``,
        ``mutable=``, ``method=``...).

    Returns:
      ``{"/".join(path): Policy}``; ``""`` is the model itself (whose final
      outputs are then cast to the model's policy's output dtype).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
      >>> model = jlinen.apply_policy(nn.Sequential([nn.Dense(3), nn.LayerNorm()]), "mixed_float16")
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> {k: str(v) for k, v in model.module_policies(variables, jnp.ones((2, 4))).items()}
      {'': 'p=full,c=f16,o=full', 'layers_0': 'p=full,c=f16,o=f16',
       'layers_1': 'p=full,c=full,o=f16,m=f32'}
    """
    kwargs.setdefault("mutable", False)
    classes = self._discover(variables, args, kwargs)
    resolver = common.Resolver(self.policy, self.module_rules, classes)
    return {
        common.path_str(p): resolver.describe(p)
        for p in sorted(classes, key=lambda p: (len(p), common.path_str(p)))
    }

  # -- helpers ----------------------------------------------------------------

  def _fp8_kind(self) -> str | None:
    """``"delayed"``, ``"current"`` or None: the float8 recipes in force."""
    return fp8_config.scaling_in_use(
        [self.policy, *(o for _, o in self.module_rules)])

  def _initial_fp8_state(self, variables: Any, rngs: Any, args: tuple,
                         method: Any, kwargs: dict) -> dict:
    """Zero amax histories for each delayed float8 matmul of one call."""
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ("mutable", "capture_intermediates")}
    rngs = rngs if isinstance(rngs, Mapping) else {"params": rngs}

    call_kwargs = dict(rngs=rngs, method=method, mutable=True, **kwargs)
    float8 = common.fp8_interpreter()

    def trace(variables):
      store = float8.Fp8Store(None, "create")
      classes = (self._discover(variables, args, call_kwargs)
                 if self.module_rules.has_class_rules else {})
      resolver = common.Resolver(self.policy, self.module_rules, classes)
      params = variables.get("params")
      run = variables if params is None else _replace_collection(
          variables, "params", _map_params(
              params, lambda owner, leaf: tree_lib.cast_floating(
                  leaf, resolver.effective(owner).compute_dtype)))
      with nn.intercept_methods(_boundary_interceptor(resolver, set(), True)):
        float8.evaluate(self.module.apply, (run, *args), call_kwargs,
                        self.policy, store=store, owner="jmp_lite.linen")
      return store.final()

    shapes = jax.eval_shape(trace, variables)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def _discover(self, variables: Any, args: tuple, call_kwargs: dict) -> dict[common.Path, type]:
    """Traces the model abstractly to learn the class at every module path."""
    classes: dict[common.Path, type] = {}

    def run():
      # Only module classes matter here, not dtypes: standard promotion lets
      # the unmodified model run whatever dtypes its params are stored in.
      with jax.numpy_dtype_promotion("standard"):
        with nn.intercept_methods(_recorder(classes)):
          return self.module.apply(variables, *args, **call_kwargs)

    jax.eval_shape(run)
    return classes

  def _check_params(self, params: Any, resolver: common.Resolver) -> None:
    common.check_params(
        ((path, x) for path, leaf in traverse_util.flatten_dict(params).items()
         for x in jax.tree.leaves(leaf)),
        resolver,
        fix=(
            "create the variables with policy_model.init(...) (it stores "
            "params in the policy's param dtype), or cast yours first, e.g. "
            "variables = {**variables, 'params': "
            "jmp_lite.cast_to_full(variables['params'])}."
        ),
    )

  def _warn_unmatched(self, paths: set[common.Path]) -> None:
    message = common.unmatched_message(
        self.module_rules, sorted(common.all_prefixes(paths), key=common.path_str),
        type(self.module).__name__,
    )
    if message:
      warnings.warn(message, common.UnmatchedRuleWarning, stacklevel=3)


_NO_FP8_STATE = (
    "jmp_lite.linen: the policy has a delayed-scaling float8 recipe, whose "
    "amax histories live in the 'fp8_state' collection, but the variables "
    "passed to apply have none. Create the variables with "
    "policy_model.init(...) (it makes the collection), keep the collection "
    "next to 'params' (an optimizer gets variables['params'] only), and pass "
    "mutable=['fp8_state'] (with your other mutable collections) in training "
    "steps. docs/fp8.md, delayed scaling."
)


def _pop_collection(variables: Any, name: str) -> tuple[Any, Any]:
  """``(variables without the collection, the collection or None)``."""
  if not isinstance(variables, Mapping) or name not in variables:
    return variables, None
  rest = {k: v for k, v in variables.items() if k != name}
  if isinstance(variables, FrozenDict):
    rest = FrozenDict(rest)
  return rest, variables[name]


def _without(mutable: Any, name: str) -> Any:
  """A ``mutable`` filter without one collection (False if nothing is left)."""
  if mutable is False:
    return False
  left = flax_scope.subtract_filters(mutable, name)
  if isinstance(left, (set, frozenset, list, tuple)):
    return sorted(left) or False
  return left


def _owner_paths(params: Any) -> set[common.Path]:
  return {p[:-1] for p in traverse_util.flatten_dict(params)}


def apply_policy(
    module: nn.Module,
    policy: str | policy_lib.Policy,
    module_rules: ModuleRules | Any = DEFAULT_MODULE_RULES,
) -> PolicyModel:
  """Puts a linen model under a precision policy, with per-module overrides.

  The model is not modified: the returned :class:`PolicyModel` has ``init``
  and ``apply`` with linen's signatures and runs the model with params stored
  in the param dtype and cast to the compute dtype where they are used (so
  gradients come back in the stored dtype), inputs and outputs cast at every
  boundary (the model, each module a rule matches), norm layers in float32
  under the default rules, and mutable collections in their dtypes. Guide:
  ``docs/flax.md``.

  Args:
    module: the linen model (any ``flax.linen.Module``).
    policy: a ``jmp_lite.Policy`` or a spec such as ``"mixed_bfloat16"`` or
      ``"params=float32,compute=float16,output=float32"``.
    module_rules: per-module overrides, first match wins (default: the norm
      layers in float32; add your own with ``ModuleRules(...) +
      DEFAULT_MODULE_RULES``; ``None``: no overrides).

  Returns:
    A :class:`PolicyModel`.

  Raises:
    TypeError: if ``module`` is not a linen module or ``module_rules`` are
      not linen rules.
    ValueError: if ``policy`` does not parse.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(2)(nn.LayerNorm()(nn.relu(nn.Dense(8)(x))))
    >>> model = jlinen.apply_policy(MLP(), "params=float32,compute=float16,output=float32")
    >>> variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> grads = jax.grad(lambda p: model.apply({"params": p}, jnp.ones((4, 3))).sum())(
    ...     variables["params"])
    >>> grads["Dense_0"]["kernel"].dtype
    dtype('float32')
  """
  ModuleRules.framework.check_module(module)
  policy = policy_lib.get_policy(policy)
  module_rules = ModuleRules.coerce(module_rules,
                                    "jmp_lite.linen.apply_policy")
  return PolicyModel(module, policy, module_rules)
