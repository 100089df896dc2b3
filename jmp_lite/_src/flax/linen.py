"""Policies on Flax linen models: ``apply_policy``, ``PolicyModel``,
``ModuleRules``.

A linen model is a pure function of its variables, so ``PolicyModel`` wraps
``init``/``apply``: params are cast per module, and a
``flax.linen.intercept_methods`` interceptor casts at every boundary and,
under float8 recipes, hands ``nn.Dense``/``nn.DenseGeneral`` a float8
``dot_general`` for the call. Delayed float8 scaling keeps each layer's amax
histories in the ``"fp8_state"`` collection, at the layer's path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple
import warnings

import flax.linen as nn
from flax import traverse_util
from flax.core import FrozenDict
import jax

from jmp_lite._src import checks
from jmp_lite._src.flax import float8 as float8_lib
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


#: The linen layers whose product a policy computes through their own
#: ``dot_general`` field (``nn.Einsum`` has none in Flax 0.12: it stays as
#: written, a visible fallback).
_HOOKED = (nn.Dense, nn.DenseGeneral)
_NO_HOOK = "flax.linen.Einsum has no dot_general hook"
_OWN_HOOK = "the layer has its own dot_general/dot_general_cls"


class _Float8:
  """What one pass of a linen model does with its matmul layers.

  Args:
    mode: ``"discover"`` (number every product for :func:`head_site`),
      ``"init"`` (create zero histories), ``"apply"``.
    resolver: the policies.
    head: the path of the output head (apply, init), or None.
    regions: mark every module's call with its recipe (a model calling
      ``ragged_dot``: :func:`float8_lib.grouped_in_recipes`).
  """

  def __init__(self, mode: str, resolver: common.Resolver,
               head: common.Path | None = None, regions: bool = False):
    self.mode = mode
    self.resolver = resolver
    self.head = head
    self.regions = regions
    self.candidates: dict[int, Any] = {}
    self.sites: list[common.Path] = []

  def wrap(self, module: nn.Module, path: common.Path,
           call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with the module's product hooked (or ``call`` unchanged)."""
    config = float8_lib.recipe(self.resolver.effective(path))
    if not isinstance(module, _HOOKED):
      if config is None or not isinstance(module, nn.Einsum):
        return call
      return _in_scope(call, float8_lib.fallback(_NO_HOOK, config))
    current = module.dot_general
    if isinstance(current, (float8_lib.Matmul, float8_lib.Recorder)):
      return call  # hooked already (a lifted transform's inner call)
    if current is not None or module.dot_general_cls is not None:
      if config is None or self.mode == "discover":
        return call
      return _in_scope(call, float8_lib.fallback(_OWN_HOOK, config))
    if self.mode == "discover":
      hook = float8_lib.Recorder(len(self.sites))
      self.candidates[hook.index] = config
      self.sites.append(path)
    elif config is None:
      return call
    else:
      excluded = None
      if path == self.head and not config.include_output_head:
        excluded = "output head (include_output_head=False)"
      histories = None
      if config.scaling == "delayed":
        histories = (functools.partial(_read_histories, module, config,
                                       self.mode),
                     _writer(module, self.mode))
      hook = float8_lib.Matmul(config, common.path_str(path), histories,
                               excluded)

    # The layer's own field, set for this call and restored after: linen
    # modules are frozen dataclasses, and Flax reads `dot_general` when
    # __call__ runs (a lifted transform's clone copies it). A clone bound
    # to the same scope would be a second module at the same path.
    def hooked(*args, **kwargs):
      object.__setattr__(module, "dot_general", hook)
      try:
        return call(*args, **kwargs)
      finally:
        object.__setattr__(module, "dot_general", current)

    return hooked


def _in_scope(call: Callable[..., Any], scope: Any) -> Callable[..., Any]:
  def scoped(*args, **kwargs):
    with scope:
      return call(*args, **kwargs)
  return scoped


def _read_histories(module: nn.Module, config: Any, mode: str) -> Any:
  """The layer's stored histories (created as zeros by init), checked."""
  path = common.path_str(module.path)
  if mode == "init":
    if not module.is_mutable_collection(checks.FP8_STATE):
      raise ValueError(float8_lib.STATE_NOT_LIFTED.format(path=path))
    zeros = float8_lib.zero_histories(config.history_length)
    for name in ("lhs", "rhs"):
      module.variable(checks.FP8_STATE, name, lambda z=zeros[name]: z)
  stored = module.variables.get(checks.FP8_STATE)
  float8_lib.check_histories(stored, path, config)
  return stored


def _writer(module: nn.Module, mode: str) -> Callable[[Any], None] | None:
  """Stores rolled histories where the collection is mutable (training)."""
  if mode != "apply" or not module.is_mutable_collection(checks.FP8_STATE):
    return None

  def write(new):
    for name, value in new.items():
      module.put_variable(checks.FP8_STATE, name, value)

  return write


def _boundary_interceptor(
    resolver: common.Resolver, seen: set[common.Path],
    float8: _Float8 | None = None, cast: bool = True,
) -> Callable[..., Any]:
  """An interceptor casting inputs and outputs at every policy boundary.

  With ``float8``, the matmul layers' products are hooked (:class:`_Float8`);
  ``cast=False`` only records classes and hooks (init, discovery).
  """
  active: list[common.Path] = []

  def intercept(next_fun, args, kwargs, context):
    name = context.method_name
    # Lifted transforms (nn.scan, nn.remat...) also call a '<lambda>' method
    # on a wrapper whose path is not its real one: skip those.
    if not name.isidentifier():
      return next_fun(*args, **kwargs)
    module = context.module
    path = tuple(module.path)
    resolver.note(path, type(module))
    seen.add(path)
    call = next_fun
    if float8 is not None and name == "__call__":
      call = float8.wrap(module, path, next_fun)
    if float8 is not None and float8.regions:
      # Grouped matmuls (no Flax hook): each module's call marked with its
      # recipe, which the interpreter around the model reads at each one.
      call = _in_scope(call, float8_lib.region(
          float8_lib.recipe(float8.resolver.effective(path))))
    # A module's own methods calling each other (``__call__`` -> ``encode``)
    # stay inside it: no cast to the output dtype in the middle.
    if not cast or not common.is_policy_method(name) or path in active:
      return call(*args, **kwargs)
    policy = resolver.boundary(path)
    if policy is None:  # Not a boundary: the module runs as written.
      return call(*args, **kwargs)
    active.append(path)
    try:
      args, kwargs = policy_lib.cast_inputs(policy, (args, kwargs))
      with policy.matmul_context():
        return policy_lib.cast_outputs(policy, call(*args, **kwargs))
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
  # What a call's discovery pass found, per input signature (not config).
  _cache: dict = dataclasses.field(default_factory=dict, compare=False,
                                   hash=False, repr=False)

  def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
    """Creates the model's variables, params in their policy's param dtype.

    The model runs as written (no casting) to create its variables; then each
    module's params are cast to the param dtype of its effective policy.
    Other collections (``batch_stats``...) are returned as created. Where a
    policy has a float8 recipe, the model is also traced once more
    (abstractly) to find its output head, cached for ``apply``; a
    delayed-scaling recipe's layers create the ``"fp8_state"`` collection:
    zero amax histories for each float8 layer, the output head included only
    where its recipe says ``include_output_head=True`` (``docs/fp8.md``).

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
    resolver = common.Resolver(self.policy, self.module_rules, classes)
    fp8 = self._fp8_kind()
    # The model runs as written (no casts); a delayed recipe's layers create
    # their zero histories as they run.
    float8 = _Float8("init", resolver) if fp8 == "delayed" else None
    with nn.intercept_methods(
        _boundary_interceptor(resolver, set(), float8, cast=False)):
      variables = self.module.init(rngs, *args, method=method, **kwargs)
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
    if fp8 is not None:
      # Which layer is the output head is known once the whole call is seen:
      # discover it now (cached for apply with inputs of the same shapes).
      call_kwargs = {k: v for k, v in kwargs.items()
                     if k not in ("mutable", "capture_intermediates")}
      rngs = rngs if isinstance(rngs, Mapping) else {"params": rngs}
      found = self._discovery(variables, args, dict(
          rngs=rngs, method=method, **call_kwargs))
      if fp8 == "delayed":
        state = variables.get(checks.FP8_STATE, {})
        # The head keeps its histories where its recipe puts it in float8
        # (include_output_head=True); elsewhere apply leaves it out.
        head_recipe = (None if found.head is None else
                       float8_lib.recipe(resolver.effective(found.head)))
        if head_recipe is not None and not head_recipe.include_output_head:
          state = _drop(state, found.head)
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
    has a float8 recipe, its ``nn.Dense``/``nn.DenseGeneral`` layers compute
    in float8 (``docs/fp8.md``); a delayed-scaling recipe reads the
    ``"fp8_state"`` collection, and rolls it (returns the new one) when
    ``mutable`` includes ``"fp8_state"``, as BatchNorm's ``"batch_stats"``.

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
    if fp8 == "delayed" and not (isinstance(variables, Mapping)
                                 and checks.FP8_STATE in variables):
      raise ValueError(_NO_FP8_STATE)
    call_kwargs = dict(rngs=rngs, method=method, mutable=mutable, **kwargs)
    found = (
        self._discovery(variables, args, call_kwargs)
        if fp8 is not None or self.module_rules.has_class_rules
        else _Discovery({}, None)
    )
    resolver = common.Resolver(self.policy, self.module_rules,
                               dict(found.classes))
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
    float8 = (None if fp8 is None
              else _Float8("apply", resolver, head=found.head,
                           regions=found.grouped > 0))
    interceptor = _boundary_interceptor(resolver, seen, float8)

    def run(variables, args, kwargs):
      with nn.intercept_methods(interceptor), self.policy.matmul_context():
        return self.module.apply(variables, *args, **kwargs)

    if float8 is not None and float8.regions:
      # The model's own ragged_dots (no Flax hook): in their module's recipe.
      out = float8_lib.grouped_in_recipes(
          run, (run_variables, args, call_kwargs), {},
          self.policy.compute_dtype)
    else:
      out = run(run_variables, args, call_kwargs)
    known = seen | set(found.classes)
    if params is not None:
      known |= _owner_paths(params)
    self._warn_unmatched(known)
    # The model's outputs leave in the policy's output dtype even where a rule
    # matches the model itself (e.g. a bare BatchNorm under DEFAULT_MODULE_RULES).
    if mutable is False:
      return policy_lib.cast_outputs(self.policy, out)
    y, updated = out
    updated = tree_lib.cast_like(updated, variables)
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
    return float8_lib.scaling_in_use(
        [self.policy, *(o for _, o in self.module_rules)])

  def _discovery(self, variables: Any, args: tuple,
                 call_kwargs: dict) -> "_Discovery":
    """The module classes and the output head of one call (cached).

    One abstract trace of the model as written, cached per method, keyword
    options and input shapes: ``init`` fills the cache, so ``apply`` on
    inputs of the same shapes traces the model once.
    """
    key = _signature(args, call_kwargs)
    found = self._cache.get(key) if key is not None else None
    if found is None:
      found = self._discover_call(variables, args, call_kwargs)
      if key is not None:
        self._cache[key] = found
    return found

  def _discover_call(self, variables: Any, args: tuple,
                     call_kwargs: dict) -> "_Discovery":
    classes: dict[common.Path, type] = {}
    resolver = common.Resolver(self.policy, self.module_rules, classes)
    fp8 = self._fp8_kind() is not None
    float8 = _Float8("discover", resolver) if fp8 else None
    # Everything mutable: a model updating its statistics runs as in training.
    call_kwargs = dict(call_kwargs, mutable=True)
    leaves, treedef = jax.tree.flatten((variables, args, call_kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if checks.is_array(leaf)]

    def run(*values):
      full = list(leaves)
      for i, value in zip(dynamic, values):
        full[i] = value
      variables, args, kwargs = jax.tree.unflatten(treedef, full)
      # Only module classes and products matter here, not dtypes: standard
      # promotion lets the unmodified model run whatever dtypes its params
      # are stored in.
      with jax.numpy_dtype_promotion("standard"):
        with nn.intercept_methods(
            _boundary_interceptor(resolver, set(), float8, cast=False)):
          return self.module.apply(variables, *args, **kwargs)

    values = [leaves[i] for i in dynamic]
    if not fp8:
      jax.eval_shape(run, *values)
      return _Discovery(dict(classes), None)
    closed = jax.make_jaxpr(run)(*values)
    index = float8_lib.head_site(closed, float8.candidates)
    head = None if index is None else float8.sites[index]
    return _Discovery(dict(classes), head,
                      float8_lib.grouped_matmuls(closed))

  def _discover(self, variables: Any, args: tuple, call_kwargs: dict) -> dict[common.Path, type]:
    """Traces the model abstractly to learn the class at every module path."""
    return dict(self._discovery(variables, args, call_kwargs).classes)

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


class _Discovery(NamedTuple):
  """What one abstract trace of a call found."""

  classes: dict  # path -> module class, for class rules
  head: common.Path | None  # the output head's path
  grouped: int = 0  # ragged_dot calls (grouped matmuls), under a recipe


def _signature(args: tuple, call_kwargs: dict) -> Any:
  """A hashable key for a call's inputs (shapes, dtypes, options), or None
  where an option is not hashable. Variables, rngs and ``mutable`` are left
  out: they decide no module's class and no product's place."""
  kwargs = {k: v for k, v in call_kwargs.items()
            if k not in ("rngs", "mutable")}
  leaves, treedef = jax.tree.flatten((args, kwargs))
  key = [treedef]
  for leaf in leaves:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      key.append((tuple(leaf.shape), str(leaf.dtype)))
    else:
      key.append(leaf)
  key = tuple(key)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _drop(state: Any, path: common.Path) -> Any:
  """``state`` without the entry at a module path (and emptied parents)."""
  flat = traverse_util.flatten_dict(state)
  kept = {k: v for k, v in flat.items() if tuple(k[:len(path)]) != path}
  out = traverse_util.unflatten_dict(kept) if kept else {}
  return FrozenDict(out) if isinstance(state, FrozenDict) else out


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
