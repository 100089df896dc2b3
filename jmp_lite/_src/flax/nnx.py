"""Policies on Flax NNX models: ``apply_policy``, ``PolicyModule``,
``ModuleRules``, ``Fp8State``.

NNX modules are stateful objects built eagerly, so ``PolicyModule`` holds the
model: a call splits it, casts params per module into a private copy, swaps
every rule-matched submodule for a boundary module in its slot, and writes the
changed non-param state back. Delayed float8 scaling keeps its amax histories
in an :class:`Fp8State` variable of the ``PolicyModule``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple
import warnings

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import checks
from jmp_lite._src.flax import float8 as float8_lib
from jmp_lite._src.flax import rules as common
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree as tree_lib



class ModuleRules(common.ModuleRulesBase):
  """Ordered per-module policy overrides for NNX models; first match wins.

  Each entry is a ``(match, policy)`` pair:

  * ``match``: a ``flax.nnx.Module`` subclass or a tuple of them (matched with
    ``isinstance``); a path pattern string in :mod:`fnmatch` syntax matched
    against the module's ``/``-joined path, e.g. ``"blocks/*/attn"`` (list
    indices are path keys too; ``*`` also matches ``/``); or a compiled
    ``re.Pattern`` that must match the whole path.
  * ``policy``: a ``jmp_lite.Policy``, a spec string such as
    ``"p=f32,c=f32,o=f16"``, or :class:`FullPrecision`.

  A matched module is a *boundary*: its floating inputs are cast to its
  compute dtype and its outputs to its output dtype; modules inside it inherit
  its param and compute dtypes. Immutable, hashable, combined with ``+``
  (earlier rules win).

  Example:
    >>> from flax import nnx
    >>> import jmp_lite.nnx as jnnx
    >>> rules = jnnx.ModuleRules(("head", "p=f32,c=f32,o=f32")) + jnnx.DEFAULT_MODULE_RULES
    >>> len(rules)
    2
  """

  framework = common.Framework(
      name="flax.nnx",
      public_module="jmp_lite.nnx",
      module_base=nnx.Module,
      instance_example="{cls}(..., rngs=nnx.Rngs(0))",
      other="flax.linen",
      other_public_module="jmp_lite.linen",
  )


#: Normalisation layers keep float32 statistics, scale and bias, and hand their
#: output back in the compute dtype.
DEFAULT_MODULE_RULES = ModuleRules(
    (
        (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm),
        common.FullPrecision(),
    ),
)


def _is_nnx_object(x: Any) -> bool:
  return isinstance(x, (nnx.Module, nnx.Variable, nnx.Rngs))


def _cast(tree: Any, dtype: np.dtype) -> Any:
  """Casts floating array leaves; NNX modules, variables and Rngs pass whole.

  (Mapping ``tree_map`` over an ``nnx.Rngs`` argument would hand the model a
  copy, whose advanced RNG counters would then be lost.)
  """
  return tree_lib.cast_floating(tree, dtype, is_leaf=_is_nnx_object)


def _call_under(policy: policy_lib.Policy, fn: Callable[..., Any], args,
                kwargs, regions: bool = False):
  """``fn`` at a boundary under ``policy``; with ``regions``, inside the
  named scope marking the boundary's recipe (:func:`float8_lib.region`),
  which the grouped-matmul route reads at each ``ragged_dot`` (a module's
  effective recipe is its nearest boundary's)."""
  args, kwargs = _cast((args, kwargs), policy.compute_dtype)
  region = (float8_lib.region(float8_lib.recipe(policy)) if regions
            else contextlib.nullcontext())
  with policy.matmul_context(), region:
    return _cast(fn(*args, **kwargs), policy.output_dtype)


class Fp8State(nnx.Variable):
  """The amax histories of delayed float8 scaling of one NNX layer.

  ``PolicyModule.fp8_state`` holds one per layer under a delayed recipe,
  keyed by the layer's path, created with zeros by ``apply_policy``. Not an
  ``nnx.Param``: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never sees it,
  and ``nnx.grad`` does not differentiate it. Its value is ``{"lhs":
  history, "rhs": history}``, the uint32 bit patterns of float32 amaxes,
  newest first (integers, so that no optimizer can step them;
  ``docs/fp8.md``), rolled on every call in training mode
  (``model.train()``, the default); ``model.eval()`` freezes it, as it
  freezes BatchNorm's statistics. Filter it like any variable type:
  ``nnx.state(model, jnnx.Fp8State)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite.nnx as jnnx
    >>> model = jnnx.apply_policy(nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
    ...                           "p=f32,c=bf16,o=f32,m=fp8_delayed(include_output_head=true)")
    >>> _ = model(jnp.ones((16, 16)))
    >>> bits = model.fp8_state[""].get_value()["lhs"]   # "": the Linear itself
    >>> history = jax.lax.bitcast_convert_type(bits, jnp.float32)
    >>> history.shape, float(history[0])
    ((16,), 1.0)
  """


class _Boundary(nnx.Module):
  """Stands in for a rule-matched module during one call (never stored).

  Calling it, or one of the module's public methods through it, casts the
  inputs to the boundary's compute dtype and the outputs to its output dtype;
  other attributes are read through to the module. It is an NNX module itself,
  so NNX transforms inside the model (``nnx.remat``, ``nnx.scan``,
  ``nnx.vmap``) split and merge it like any other submodule.
  """

  def __init__(self, module: nnx.Module, policy: policy_lib.Policy,
               regions: bool = False):
    self.module = module
    self.policy = policy
    self.regions = regions

  def __call__(self, *args, **kwargs):
    return _call_under(self.policy, self.module, args, kwargs, self.regions)

  def __getattr__(self, name: str) -> Any:
    # Only reached for names the boundary itself lacks. Private names are
    # NNX's own bookkeeping (looked up while the object is being built).
    module = vars(self).get("module")
    if module is None or name.startswith("_"):
      raise AttributeError(name)
    attr = getattr(module, name)
    if callable(attr) and common.is_policy_method(name) and hasattr(attr, "__self__"):
      policy, regions = self.policy, self.regions

      def method(*args, **kwargs):
        return _call_under(policy, attr, args, kwargs, regions)

      return method
    return attr


def _set_child(parent: nnx.Module, key: Any, child: nnx.Module) -> None:
  """Puts ``child`` in ``parent``'s slot ``key`` (as ``nnx.iter_children`` names it).

  ``nnx.List`` names its slots by int (items); other modules by attribute.
  """
  if isinstance(key, int):
    parent[key] = child
  else:
    setattr(parent, key, child)


def _install_boundaries(
    root: nnx.Module, targets: dict[int, _Boundary]
) -> list[tuple[Any, Any, Any]]:
  """Swaps every reference to a target module inside ``root`` for its boundary.

  Walks the module graph with ``nnx.iter_children`` (``nnx.List`` and
  ``nnx.Dict`` included); a module referenced from several places is swapped
  in each of them.

  Returns:
    ``(parent, key, original)`` undo records, in the order applied.
  """
  undo: list[tuple[Any, Any, Any]] = []
  visited: set[int] = set()

  def visit(node: nnx.Module) -> None:
    if id(node) in visited:
      return
    visited.add(id(node))
    for key, child in list(nnx.iter_children(node)):
      if not isinstance(child, nnx.Module):
        continue  # a variable
      visit(child)
      boundary = targets.get(id(child))
      if boundary is not None:
        undo.append((node, key, child))
        _set_child(node, key, boundary)

  visit(root)
  return undo


def _undo(records: list[tuple[Any, Any, Any]]) -> None:
  for parent, key, original in reversed(records):
    _set_child(parent, key, original)


class PolicyModule(nnx.Module):
  """An NNX module running another under a precision policy.

  Made by :func:`apply_policy`. It holds the wrapped module as ``.module``
  and shares its variables: training the ``PolicyModule`` (``nnx.grad``,
  ``nnx.Optimizer``) trains that module, and batch statistics and RNG
  counters advance on it, but its structure, attributes and dtypes are never
  changed. Its state paths are those of the wrapped module under
  ``"module"``; save ``nnx.state(policy_module.module)`` to get checkpoints
  that load into the plain module.

  With a float8 recipe in its policy or rules, the matmul layers under it
  (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) compute in float8
  through their own ``dot_general``/``einsum_op`` hook, set on the call's
  private copy (``docs/fp8.md``); with a delayed-scaling recipe it also
  holds each such layer's amax histories, an :class:`Fp8State` in the
  ``nnx.Dict`` ``fp8_state`` keyed by layer path, rolled on each call unless
  ``use_running_average`` (set by ``model.eval()``, cleared by
  ``model.train()``). A module's own ``jax.lax.ragged_dot`` (a
  Mixture-of-Experts layer's experts), which no Flax hook reaches, runs in
  the recipe of its module (its nearest rule-matched module's, else the
  policy's; per-expert scales, current scaling under a delayed recipe): a
  call that makes one runs through autocast's interpreter with the
  grouped-matmul rule only (:func:`float8_lib.grouped_in_recipes`), every
  boundary's call marked with its recipe; other calls are not interpreted.

  Attributes:
    module: the wrapped module.
    policy: the model's policy (its inputs are cast to ``compute_dtype``, its
      outputs to ``output_dtype``).
    module_rules: the per-module overrides (:class:`ModuleRules`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_lite.nnx as jnnx
    >>> model = jnnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "mixed_float16")
    >>> model(jnp.ones((1, 3))).dtype, model.module.kernel.dtype
    (dtype('float32'), dtype('float32'))
  """

  def __init__(
      self,
      module: nnx.Module,
      policy: policy_lib.Policy,
      module_rules: ModuleRules,
  ):
    self.module = module
    self.policy = policy
    self.module_rules = module_rules
    self._fp8 = float8_lib.scaling_in_use(
        [policy, *(o for _, o in module_rules)])
    if self._fp8 == "delayed":
      resolver = _resolver(module, policy, module_rules)
      setattr(self, checks.FP8_STATE, nnx.Dict({
          common.path_str(path): Fp8State(float8_lib.zero_histories(
              config.history_length, _stack_shape(layer)))
          for path, layer, config in _hooked_layers(module, resolver)
          if config.scaling == "delayed"}))
      self.use_running_average = False

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the wrapped module under the policy.

    Args:
      *args: the module's positional inputs (floating arrays are cast to the
        compute dtype; ints, bools, ``nnx.Rngs`` and other objects pass).
      **kwargs: its keyword inputs.

    Returns:
      The module's outputs, floating leaves in the output dtype.
    """
    return self.call_method("__call__", *args, **kwargs)

  def call_method(
      self, method: str | Callable[..., Any], *args: Any, **kwargs: Any
  ) -> Any:
    """Calls another method of the wrapped module under the policy.

    Args:
      method: a method name such as ``"encode"``, or a function taking the
        module first (e.g. ``MyModel.encode``).
      *args: the method's positional inputs.
      **kwargs: its keyword inputs.

    Returns:
      The method's outputs, floating leaves in the output dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jmp_lite.nnx as jnnx
      >>> embed = jnnx.apply_policy(nnx.Embed(5, 3, rngs=nnx.Rngs(0)), "mixed_bfloat16")
      >>> embed.call_method("attend", jnp.ones((2, 3))).dtype
      dtype('float32')
    """
    resolver = self._resolver()
    graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)
    _check_params(params, resolver)
    found = _Discovery(None, 0)
    if self._fp8 is not None:
      found = _discover(self.module, resolver, method, args, kwargs)
    # A model calling ragged_dot (no Flax hook): every boundary marks its
    # call with its recipe, and the call runs through the grouped route.
    regions = found.grouped > 0
    copy = nnx.merge(graphdef, _cast_params(params, resolver), rest)
    undo = _install_boundaries(copy, _boundaries(copy, resolver, regions))
    if self._fp8 is not None:
      undo += _install_hooks(copy, resolver, found.head, self._histories())
    try:
      if regions:
        out = _grouped_call(copy, method, resolver.boundary(()), args, kwargs)
      else:
        out = _call_under(resolver.boundary(()), _bound(copy, method), args,
                          kwargs)
      # The outputs leave in the policy's output dtype even where a rule
      # matches the module itself (e.g. a bare BatchNorm).
      out = _cast(out, self.policy.output_dtype)
    finally:
      _undo(undo)
    # The hooks' attributes (restored above) are no state of the module.
    changed = nnx.state(copy, nnx.All(
        nnx.Not(nnx.Param), *(nnx.Not(nnx.PathContains(field))
                              for field in _HOOK_FIELDS)))
    nnx.update(self.module, tree_lib.cast_like(changed, rest))
    return out

  def _histories(self) -> dict[str, tuple[Fp8State, bool]] | None:
    """Each delayed layer's ``Fp8State`` by path, and whether to roll it."""
    if self._fp8 != "delayed":
      return None
    roll = not self.use_running_average
    return {path: (var, roll)
            for path, var in getattr(self, checks.FP8_STATE).items()}

  def module_policies(self) -> dict[str, policy_lib.Policy]:
    """The policy of every submodule, by ``/``-joined path.

    Boundaries (the wrapped module, matched modules) report their own policy;
    other modules the param and compute dtypes they inherit, with output
    dtype = compute dtype (their outputs are not cast).

    Returns:
      ``{path: Policy}``; ``""`` is the wrapped module itself (whose final
      outputs are then cast to the model's policy's output dtype).

    Example:
      >>> from flax import nnx
      >>> import jmp_lite.nnx as jnnx
      >>> model = jnnx.apply_policy(nnx.LayerNorm(3, rngs=nnx.Rngs(0)), "mixed_float16")
      >>> str(model.module_policies()[""])
      'p=full,c=full,o=f16,m=f32'
    """
    resolver = self._resolver()
    return {
        common.path_str(path): resolver.describe(path)
        for path, _ in nnx.iter_modules(self.module)
    }

  def _resolver(self) -> common.Resolver:
    return _resolver(self.module, self.policy, self.module_rules)


def _resolver(
    module: nnx.Module, policy: policy_lib.Policy, rules: ModuleRules
) -> common.Resolver:
  classes = {path: type(m) for path, m in nnx.iter_modules(module)}
  return common.Resolver(policy, rules, classes)


def _cast_params(params: Any, resolver: common.Resolver) -> Any:
  """Casts each param to the compute dtype its owning module runs under."""
  return nnx.from_flat_state([
      (path, var.replace(_cast(var.get_value(), _compute_dtype(resolver, path))))
      for path, var in nnx.to_flat_state(params)
  ])


def _compute_dtype(resolver: common.Resolver, variable_path: common.Path) -> np.dtype:
  return resolver.effective(variable_path[:-1]).compute_dtype


def _boundaries(root: nnx.Module, resolver: common.Resolver,
                regions: bool = False) -> dict[int, _Boundary]:
  """``id(module) -> _Boundary`` for every rule-matched submodule of ``root``."""
  return {
      id(node): _Boundary(node, resolver.boundary(path), regions)
      for path, node in nnx.iter_modules(root)
      if path and resolver.boundary(path) is not None
  }


#: The attributes through which a policy hooks a layer's product.
_HOOK_FIELDS = ("dot_general", "einsum_op")


def _hook_field(layer: nnx.Module) -> str | None:
  """The attribute a policy sets to hook a layer (``dot_general`` of
  ``Linear``/``LinearGeneral``, ``einsum_op`` of ``Einsum``), None where the
  user set one of their own (the layer then runs as written)."""
  if isinstance(layer, nnx.Linear):
    return "dot_general" if layer.dot_general is lax.dot_general else None
  if isinstance(layer, nnx.LinearGeneral):
    own = layer.dot_general is not None or layer.dot_general_cls is not None
    return None if own else "dot_general"
  if isinstance(layer, nnx.Einsum):
    return "einsum_op" if layer.einsum_op is jnp.einsum else None
  return None


def _hooked_layers(root: nnx.Module, resolver: common.Resolver):
  """``(path, layer, recipe)`` of every hookable layer under a float8 recipe."""
  for path, layer in nnx.iter_modules(root):
    if _hook_field(layer) is not None:
      config = float8_lib.recipe(resolver.effective(tuple(path)))
      if config is not None:
        yield tuple(path), layer, config


def _stack_shape(layer: nnx.Module) -> tuple[int, ...]:
  """Leading axes of a layer's kernel beyond its own (``nnx.vmap``-made
  stacks of layers, scanned over): its histories get the same."""
  if isinstance(layer, nnx.Linear):
    own = 2
  elif isinstance(layer, nnx.LinearGeneral):
    own = (len(layer.batch_axis) + len(layer.in_features)
           + len(layer.out_features))
  else:
    own = len(layer.kernel_shape)
  shape = np.shape(layer.kernel.get_value())
  return tuple(shape[:len(shape) - own])


class _Matmul(nnx.Module):
  """A layer's hook for one call: float8 with the layer's histories.

  An NNX module, so that NNX transforms inside the model (``nnx.scan`` over
  a stack of layers) split and merge it with the layer, and the histories
  it holds (the ``PolicyModule``'s ``fp8_state`` entry, shared) follow the
  layer: one slot per iteration.
  """

  def __init__(self, config, path: str, excluded: str | None,
               histories: Fp8State | None, roll: bool, einsum: bool):
    self.config = config
    self.path = path
    self.excluded = excluded
    self.histories = nnx.data(histories)
    self.roll = roll
    self.einsum = einsum

  def _matmul(self) -> float8_lib.Matmul:
    var, config, path = self.histories, self.config, self.path
    histories = None
    if var is not None:

      def read():
        stored = var.get_value()
        float8_lib.check_histories(stored, path, config)
        return stored

      histories = (read, var.set_value if self.roll else None)
    return float8_lib.Matmul(config, path, histories, self.excluded)

  def __call__(self, *args, **kwargs):
    if self.einsum:
      return jnp.einsum(*args, _dot_general=self._matmul(), **kwargs)
    return self._matmul()(*args, **kwargs)


def _install_hooks(copy: nnx.Module, resolver: common.Resolver,
                   head: str | None, histories: dict | None) -> list:
  """Hooks every float8 layer of ``copy``; returns undo records."""
  undo = []
  for path, layer, config in list(_hooked_layers(copy, resolver)):
    name = common.path_str(path)
    excluded = None
    if name == head and not config.include_output_head:
      excluded = "output head (include_output_head=False)"
    var, roll = None, False
    if config.scaling == "delayed" and histories is not None:
      var, roll = histories.get(name, (None, False))
    field = _hook_field(layer)
    hook = _Matmul(config, name, excluded, var, roll, field == "einsum_op")
    undo.append((layer, field, getattr(layer, field)))
    setattr(layer, field, nnx.data(hook))
  return undo


class _Recorder(nnx.Module):
  """A discovery pass's hook: the product as written, numbered."""

  def __init__(self, index: int, einsum: bool):
    self.index = index
    self.einsum = einsum

  def __call__(self, *args, **kwargs):
    record = float8_lib.Recorder(self.index)
    if self.einsum:
      return jnp.einsum(*args, _dot_general=record, **kwargs)
    return record(*args, **kwargs)


class _Discovery(NamedTuple):
  """What the discovery trace of one call found."""

  head: str | None  # the path of the output head's layer
  grouped: int  # ragged_dot calls on float operands (grouped matmuls)


#: What the discovery trace found, per model structure, policy, method and
#: inputs.
_FOUND: dict = {}


def _discover(module: nnx.Module, resolver: common.Resolver, method: Any,
              args: tuple, kwargs: dict) -> _Discovery:
  """The output head of this call (the path of its layer, or None) and how
  many ``ragged_dot``s it calls.

  One abstract trace of the call with every hookable layer numbered
  (:func:`float8_lib.head_site`), cached per model structure, policy,
  method and input shapes.
  """
  configs = [c for _, _, c in _hooked_layers(module, resolver)]
  find_head = not all(c.include_output_head for c in configs)
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_nnx_object)
  objects = {i: nnx.split(x) for i, x in enumerate(leaves)
             if _is_nnx_object(x)}
  signature = tuple(
      ("nnx", objects[i][0]) if i in objects else
      (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else x
      for i, x in enumerate(leaves))
  key = (graphdef, resolver.policy, resolver.rules, method, treedef, signature)
  try:
    return _FOUND[key]
  except (KeyError, TypeError):
    pass
  dynamic = [i for i, x in enumerate(leaves)
             if i not in objects and checks.is_array(x)]
  layers: list[tuple[str, Any]] = []

  def run(state, values, object_states):
    copy = nnx.merge(graphdef, state)
    full = list(leaves)
    for i, value in zip(dynamic, values):
      full[i] = value
    for i, obj_state in object_states.items():
      full[i] = nnx.merge(objects[i][0], obj_state)
    call_args, call_kwargs = jax.tree.unflatten(treedef, full)
    layers.clear()
    for path, layer in list(nnx.iter_modules(copy)):
      field = _hook_field(layer)
      if field is not None:
        config = float8_lib.recipe(resolver.effective(tuple(path)))
        setattr(layer, field, nnx.data(_Recorder(len(layers),
                                                 field == "einsum_op")))
        layers.append((common.path_str(path), config))
    with jax.numpy_dtype_promotion("standard"):
      return _bound(copy, method)(*call_args, **call_kwargs)

  closed = jax.make_jaxpr(run)(
      state, [leaves[i] for i in dynamic],
      {i: s for i, (_, s) in objects.items()})
  index = None
  if find_head:
    index = float8_lib.head_site(closed, dict(enumerate(c for _, c in layers)))
  found = _Discovery(None if index is None else layers[index][0],
                     float8_lib.grouped_matmuls(closed))
  if len(_FOUND) > 256:
    _FOUND.clear()
  try:
    _FOUND[key] = found
  except TypeError:
    pass
  return found


def _bound(module: nnx.Module, method: str | Callable[..., Any]
           ) -> Callable[..., Any]:
  """``module``'s method ``method`` (a name, or a function taking the
  module first), bound."""
  if isinstance(method, str):
    return getattr(module, method)
  return lambda *a, **k: method(module, *a, **k)


def _grouped_call(copy: nnx.Module, method: Any, policy: policy_lib.Policy,
                  args: tuple, kwargs: dict) -> Any:
  """The call of ``copy`` (hooks and region-marking boundaries installed)
  with every ``ragged_dot`` in the recipe of the boundary around it.

  Flax has no ``ragged_dot`` hook: the call runs through
  :func:`float8_lib.grouped_in_recipes` (autocast's interpreter with the
  grouped-matmul rule only), as a pure function of the state of ``copy``
  and of the NNX objects among the inputs (``nnx.Rngs``...), whose changed
  state (statistics, RNG counters, rolled amax histories) is written back
  after it.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_nnx_object)
  objects = [i for i, x in enumerate(leaves) if _is_nnx_object(x)]
  nodes = (copy, [leaves[i] for i in objects])
  graphdef, state = nnx.split(nodes)
  dynamic = [i for i, x in enumerate(leaves)
             if i not in objects and checks.is_array(x)]

  def pure(state, values):
    model, objs = nnx.merge(graphdef, state)
    full = list(leaves)
    for i, value in zip(dynamic, values):
      full[i] = value
    for i, obj in zip(objects, objs):
      full[i] = obj
    call_args, call_kwargs = jax.tree.unflatten(treedef, full)
    out = _call_under(policy, _bound(model, method), call_args, call_kwargs,
                      regions=True)
    return out, nnx.state((model, objs))

  out, new_state = float8_lib.grouped_in_recipes(
      pure, (state, [leaves[i] for i in dynamic]), {}, policy.compute_dtype)
  # Only the variables the call set: the others (a frozen Fp8State in
  # evaluation, an outer trace's variables) come back as they went in.
  before = dict(nnx.to_flat_state(state))
  same = lambda a, b: all(x is y for x, y in zip(
      jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value())))
  changed = [(path, var) for path, var in nnx.to_flat_state(new_state)
             if path not in before or not same(var, before[path])]
  if changed:
    nnx.update(nodes, nnx.from_flat_state(changed))
  return out


def _check_params(params: Any, resolver: common.Resolver) -> None:
  common.check_params(
      ((path, var.get_value()) for path, var in nnx.to_flat_state(params)),
      resolver,
      fix=(
          "build the module with param_dtype=jnp.float32 (Flax's default) "
          "for its layers, or cast its params first, e.g. "
          "nnx.update(model, jmp_lite.cast_to_full(nnx.state(model, nnx.Param)))."
      ),
  )


def apply_policy(
    module: nnx.Module,
    policy: str | policy_lib.Policy,
    module_rules: ModuleRules | Any = DEFAULT_MODULE_RULES,
) -> PolicyModule:
  """Puts an NNX module under a precision policy, with per-module overrides.

  Returns a :class:`PolicyModule` that shares ``module``'s variables (and
  never changes ``module``) and, when called, casts each param to its module's
  compute dtype where it is used, casts inputs and outputs at every boundary
  (the module, each module a rule matches), keeps norm layers in float32 under
  the default rules and non-param state in its dtypes. ``module``'s params
  must be at least as wide as the param dtype. Works with ``nnx.jit``,
  ``nnx.grad`` and ``nnx.Optimizer``. Guide: ``docs/flax.md``.

  Args:
    module: the NNX model (any ``flax.nnx.Module``).
    policy: a ``jmp_lite.Policy`` or a spec such as ``"mixed_bfloat16"``.
    module_rules: per-module overrides, first match wins (default: the norm
      layers in float32; add your own with ``ModuleRules(...) +
      DEFAULT_MODULE_RULES``; ``None``: no overrides).

  Returns:
    A :class:`PolicyModule`.

  Raises:
    TypeError: if ``module`` is not an NNX module or ``module_rules`` are
      not NNX rules.
    ValueError: if ``policy`` does not parse, or a param is stored narrower
      than its policy's param dtype (half params under a float32 policy).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> from flax import nnx
    >>> import jmp_lite.nnx as jnnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs))
    >>> model = jnnx.apply_policy(model, "params=float32,compute=float16,output=float32")
    >>> grads = nnx.grad(lambda m: m(jnp.ones((2, 3))).sum())(model)
    >>> grads["module"]["layers"][0]["kernel"][...].dtype
    dtype('float32')
  """
  if isinstance(module, PolicyModule):
    raise TypeError(
        "jmp_lite.nnx.apply_policy got a module that already has a policy "
        f"({module.policy}). Apply it to the plain module instead: "
        "apply_policy(policy_module.module, new_policy)."
    )
  ModuleRules.framework.check_module(module)
  policy = policy_lib.get_policy(policy)
  module_rules = ModuleRules.coerce(module_rules, "jmp_lite.nnx.apply_policy")
  wrapped = PolicyModule(module, policy, module_rules)
  paths = [path for path, _ in nnx.iter_modules(module)]
  message = common.unmatched_message(
      module_rules, sorted(paths, key=common.path_str), type(module).__name__
  )
  if message:
    warnings.warn(message, common.UnmatchedRuleWarning, stacklevel=2)
  _check_params(nnx.state(module, nnx.Param),
                _resolver(module, policy, module_rules))
  return wrapped
