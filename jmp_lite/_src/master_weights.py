"""Optimizer-side precision: master weights, low-memory updates, state dtypes.

Two optax wrappers, usable with any optax optimizer and with each other:

* :func:`master_weights` lets half-precision params (bfloat16, float16) train
  like float32 ones, in one of three ways (``method=``): a float32 master copy
  in the optimizer state (``"copy"``, Apex's O2 recipe: the params are the
  master copy rounded, bit for bit); the float32 update rounded to the params'
  dtype stochastically (``"stochastic_rounding"``: unbiased, no per-parameter
  state); or a 16-bit compensation of each param's rounding error carried
  into the next step (``"kahan"``: params + compensation are the float32
  value a master copy would hold, in 2 bytes instead of 4).
* :func:`with_state_dtype` stores an optimizer's moments in a chosen dtype
  (e.g. bfloat16, to halve the optimizer state) and does the update math in
  float32.

:func:`get_master_params` reads the full-precision params out of an optimizer
state, wherever it sits (``optax.chain``, ``MultiSteps``,
``inject_hyperparams``...).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import quantized_states as quantized_states_lib
from jmp_lite._src import state_codes
from jmp_lite._src import tree as tree_lib

# -- shared helpers ----------------------------------------------------------


def _check_enabled(dtype: np.dtype, what: str) -> None:
  """float64 needs x64 mode; without it JAX silently makes float32 arrays."""
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise ValueError(f"{what} is {dtype.name}, but {NO_X64}")


#: Why float64 needs x64 mode.
NO_X64 = (
    "JAX is running without jax_enable_x64, so arrays of that dtype cannot "
    "be made. Enable it (jax.config.update('jax_enable_x64', True)) or use "
    "jnp.float32."
)


def _represents(wide: np.dtype, narrow: np.dtype) -> bool:
  """Whether every value of ``narrow`` is exactly a value of ``wide``."""
  if wide == narrow:
    return True
  fw, fn = jnp.finfo(wide), jnp.finfo(narrow)
  return (
      fw.nmant >= fn.nmant
      and fw.maxexp >= fn.maxexp
      and fw.minexp <= fn.minexp
  )


# -- master weights ----------------------------------------------------------

#: The ways :func:`master_weights` keeps what half-precision params would lose
#: to rounding: a float32 master copy, stochastic rounding, Kahan compensation.
METHODS = ("copy", "stochastic_rounding", "kahan")

# The param dtypes stochastic rounding and Kahan compensation round to, as
# (significand bits after the leading one, smallest normal exponent): the
# rounding is done in float32 arithmetic from these, never by a float32 ->
# half -> float32 round trip, which XLA:GPU may remove as a no-op
# (xla_allow_excess_precision), silently turning the rounding off.
_FORMATS = {
    np.dtype(jnp.bfloat16): (7, -126),
    np.dtype(jnp.float16): (10, -14),
}
_F32 = np.dtype(jnp.float32)
#: Kahan compensation: an int16 count of 2**-16 of the param's spacing.
_COMPENSATION_DTYPE = np.dtype(jnp.int16)
_COMPENSATION_UNITS = 2.0**16

METHOD_HELP = (
    "Choose 'copy' (a float32 master copy, the default), "
    "'stochastic_rounding' (no per-parameter state) or 'kahan' (a 2-byte "
    "compensation per parameter)."
)

#: A PRNG key where the seed goes.
SEED_IS_KEY = (
    "{owner}: seed must be an int, got an array of shape {shape} and dtype "
    "{dtype} (a PRNG key?). The optimizer derives its random keys from the "
    "seed and keeps them in its state: pass an int such as 0, and no key per "
    "step."
)

#: A master dtype that cannot hold the params.
UNREPRESENTED = (
    "{owner}: the master dtype {dtype} cannot represent every value of the "
    "params {params}; the master copy must be at least as precise as the "
    "params it keeps. Use {owner}(inner, dtype=jnp.float32) (the default) for "
    "float16 or bfloat16 params; float32 params need no master copy."
)

#: Stochastic rounding and Kahan compensation with float8 params.
OTHER_NARROW = (
    "{owner}(method={method!r}) rounds to bfloat16 or float16 params, got "
    "{found}. Use method='copy' for those params (it keeps a float32 copy of "
    "any narrower float)."
)

#: Why stochastic rounding and Kahan compensation need half-precision params.
NOTHING_TO_ROUND = (
    "{owner}(method={method!r}) rounds each float32 update to half-precision "
    "params (bfloat16 or float16), but no param is narrower than float32 "
    "(got {found}), so it would do nothing. Cast the params to the policy's "
    "param dtype first, e.g. jmp_lite.get_policy('p=bf16,c=bf16,o=f32')"
    ".cast_to_param(params); for float32 params use the inner optimizer alone "
    "(or method='copy', which passes float32 params through)."
)


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`.

  Each ``method`` fills the fields it needs; the others are ``None``.

  Attributes:
    inner_state: the wrapped optimizer's state, made by ``inner.init`` from the
      params in the master dtype (float32), so its moments are float32.
    master_params: ``method="copy"``: the master copy, a tree with the params'
      structure: every floating param narrower than the master dtype
      (bfloat16, float16) has its copy there, in the master dtype and with the
      param's sharding; the other params (already in the master dtype, or not
      floating) need none and hold ``optax.MaskedNode()`` (no leaf, no bytes:
      optax's marker of a param without state, as in ``optax.masked``). It
      is authoritative: after each step
      ``params == master_params.astype(params.dtype)``, bit for bit. Read it,
      completed with those params, with :func:`get_master_params`.
    compensation: ``method="kahan"``: a tree with the params' structure
      holding, for each bfloat16 or float16 param, what rounding took from it
      (the float32 value minus the param) as an ``int16`` count of 2**-16 of
      the param's spacing, with the param's sharding; ``optax.MaskedNode()``,
      as in ``master_params``, for the other params. :func:`get_master_params`
      adds it back.
    rng_key: ``method="stochastic_rounding"``: the raw ``uint32`` PRNG key
      (``jax.random.key_data``) made from ``seed``; each update splits it,
      draws its random bits from one half and keeps the other.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.master_weights(optax.sgd(0.1))
    >>> state = opt.init({"w": jnp.ones(2, jnp.bfloat16), "scale": jnp.ones(2)})
    >>> state.master_params["w"].dtype, state.master_params["scale"]
    (dtype('float32'), MaskedNode())
    >>> state.compensation, state.rng_key
    (None, None)
  """

  inner_state: Any
  master_params: Any
  compensation: Any = None
  rng_key: Any = None


#: A state made by another method (or not by master_weights at all).
OTHER_METHOD = (
    "{owner}(method={method!r})'s update got {got}. A state works only with "
    "the optimizer that made it: {fix}, or start from opt.init(params)."
)
#: Params whose dtypes differ from those the state was made for.
OTHER_PARAMS = (
    "{where} got params that do not fit the master_weights(method="
    "{method!r}) state: {found}. The state keeps {what} exactly for the params that "
    "were {narrow} at init. Pass the params in the dtypes given to init (a "
    "policy's cast_to_param, say), or start from opt.init(params) for "
    "these params."
)
_HOLDS = {"copy": "a master copy", "kahan": "a Kahan compensation",
          "stochastic_rounding": "a random key"}


def _made_by(state: "MasterWeightsState") -> str | None:
  """The method that made ``state`` (None if it is no such state)."""
  if not isinstance(state, MasterWeightsState):
    return None
  if state.master_params is not None:
    return "copy"
  if state.compensation is not None:
    return "kahan"
  if state.rng_key is not None:
    return "stochastic_rounding"
  return None


def _mismatch(state: Any, made: str | None) -> dict[str, str]:
  """:data:`OTHER_METHOD`'s ``got`` and ``fix`` for a state made by ``made``
  (None: not by master_weights)."""
  if made is None:
    return dict(got=f"a {type(state).__name__}, not the MasterWeightsState "
                "made by its init", fix="pass the state returned by opt.init")
  return dict(got=f"a state made by method={made!r} (it holds {_HOLDS[made]})",
              fix=f"build the optimizer with method={made!r} (and restore a "
              "checkpoint into that optimizer's init)")


#: The entry of a per-param tree (``master_params``, ``compensation``) for a
#: param the state keeps nothing for: optax's marker, a pytree node without
#: leaves, so it costs no bytes and checkpoints (orbax refuses zero-size
#: arrays) and ``jax.eval_shape`` keep it as it is.
_NOTHING = optax.MaskedNode()


def _dtype_of(p: Any) -> np.dtype:
  return np.dtype(p.dtype) if hasattr(p, "dtype") else np.result_type(p)


def _check_seed(seed: Any, method: str, owner: str) -> int | None:
  """The seed of stochastic rounding (0 by default); None for the others."""
  if method != "stochastic_rounding":
    if seed is not None:
      raise ValueError(
          f"{owner}: seed={seed!r} was given, but method={method!r} draws no "
          "random bits. Only method='stochastic_rounding' takes a seed: "
          "remove seed=, or choose that method.")
    return None
  if checks.is_array(seed) and np.ndim(seed) != 0:
    raise TypeError(SEED_IS_KEY.format(owner=owner, shape=np.shape(seed),
                                       dtype=seed.dtype))
  return 0 if seed is None else checks.integer(seed, "seed", owner, 0,
                                               checks.UINT32_MAX)


def master_weights(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.float32,
    *,
    method: str = "copy",
    seed: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Lets half-precision params train like float32 ones.

  Params stored in bfloat16 or float16 lose every update smaller than half
  their spacing (a bfloat16 ``1.0`` ignores any update below ``2**-9``).
  This wrapper runs ``inner`` in float32 and writes its updates back to the
  params in one of three ways (``method``):

  * ``"copy"`` (the default; Apex's O2 recipe): a master copy of the params
    in ``dtype`` lives in the optimizer state; the inner updates accumulate
    there and the params are the master copy rounded to their dtype, bit for
    bit. Memory: the copy (4 bytes per parameter).
  * ``"stochastic_rounding"``: the float32 result of each step is rounded to
    one of its two neighbours in the params' dtype, with probabilities
    proportional to closeness, so every update counts in expectation.
    Memory: one PRNG key; the random bits come from ``seed``, no key is
    passed per step, and the same seed gives the same run.
  * ``"kahan"``: what rounding took from each param is kept in a 16-bit
    compensation and added back before the next step, so params plus
    compensation are the float32 value a master copy would hold (for
    bfloat16 params, to float32's own precision). Memory: 2 bytes per
    parameter; deterministic.

  ``update(grads, state, params, **extra_args)`` casts the floating gradients
  to float32, runs ``inner`` on the float32 params (the master copy, the params
  themselves, or params plus compensation: so its moments are float32 and
  ``adamw``'s weight decay sees those values) and returns the updates that
  take the params exactly to their new values (``optax.apply_updates`` lands
  on them; the guide says why). Params already in float32 (a norm scale among
  bfloat16 weights) and non-floating params train exactly as under ``inner``
  alone.

  Compose with :func:`loss_scaling` outside
  (``loss_scaling(master_weights(optax.adam(1e-3)), loss_scale)``), so that a
  skipped step leaves the master copy, the compensation and the key
  untouched; put :func:`with_state_dtype` inside to store the moments in
  bfloat16. Guide, and the bytes per parameter of each recipe:
  ``docs/precision.md``.

  Args:
    inner: the optax optimizer to run in float32
      (``GradientTransformation`` or ``GradientTransformationExtraArgs``).
    dtype: the master dtype of ``method="copy"``, a floating dtype at least as
      precise as every floating param: ``jnp.float32`` (the default), or
      ``jnp.float64`` with ``jax_enable_x64``. A name such as ``"f32"`` is
      accepted too. The other methods compute in float32.
    method: ``"copy"``, ``"stochastic_rounding"`` or ``"kahan"``.
    seed: the seed of ``method="stochastic_rounding"``'s random bits, an int
      (default 0). The other methods draw none and take no seed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update`` needs ``params``.

  Raises:
    TypeError: if ``inner`` is not an optax transformation, ``dtype`` is not
      a floating dtype, ``method`` is not a string or ``seed`` not an int (a
      PRNG key included); from ``init``, if ``inner`` contains
      :func:`loss_scaling`.
    ValueError: if ``method`` is unknown, a ``seed`` is given to a method
      that draws no random bits, or ``dtype`` is not float32 for
      ``"stochastic_rounding"``/``"kahan"``; from ``init``, if ``dtype``
      cannot represent some floating param (e.g. a bfloat16 master for float32
      params), or, for ``"stochastic_rounding"``/``"kahan"``, if no param is
      bfloat16 or float16 or some param is another narrow float (float8);
      from ``update``, if ``params`` is not given or the state is not one
      this wrapper's init made (with this method, for these params).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> opt = jmp_lite.master_weights(optax.sgd(1e-3))
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> for _ in range(10):  # each step is below bfloat16's spacing at 1.0
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> master = jmp_lite.get_master_params(state, params)["w"]
    >>> master.dtype, round(float(master[0]), 6)
    (dtype('float32'), 0.99)
    >>> params["w"]  # the master copy, rounded (plain sgd would stay at 1)
    Array([0.988281, 0.988281, 0.988281], dtype=bfloat16)
    >>> opt = jmp_lite.master_weights(optax.sgd(1e-3), method="kahan")
    >>> opt.init(params).compensation["w"].dtype  # 2 bytes, not a 4-byte copy
    dtype('int16')
  """
  owner = "master_weights"
  inner = checks.optax_transformation(inner, owner)
  master_dtype = dtypes.floating_dtype(
      dtype, f"{owner}'s dtype", policy=False,
      example="jnp.float32 (the default)")
  method = checks.choice(method, "method", owner, METHODS, METHOD_HELP)
  seed = _check_seed(seed, method, owner)
  if method != "copy" and master_dtype != _F32:
    raise ValueError(
        f"{owner}(method={method!r}) computes in float32, got dtype="
        f"{master_dtype.name}. Leave dtype at jnp.float32; a "
        f"{master_dtype.name} master copy is method='copy'.")

  def narrower(p):
    """A floating param this wrapper keeps precision for."""
    return tree_lib.is_float(p) and np.dtype(p.dtype) != master_dtype

  def init_fn(params):
    checks.no_fp8_state(params, "jmp_lite.master_weights")
    _check_enabled(master_dtype, f"{owner}'s dtype")
    unrepresented = [
        (jax.tree_util.keystr(path), np.dtype(p.dtype))
        for path, p in jax.tree.leaves_with_path(params)
        if tree_lib.is_float(p)
        and not _represents(master_dtype, np.dtype(p.dtype))
    ]
    if unrepresented:
      raise ValueError(UNREPRESENTED.format(
          owner=owner, dtype=master_dtype.name,
          params=_shown_paths(unrepresented)))
    if method != "copy":
      _check_rounded_params(params, method, owner)
    # Every per-param entry is made from its param by jax.tree.map (so
    # optax.tree_map_params, which runs init on a placeholder for the whole
    # params tree, sees a params tree here; its is_leaf= maps the params'
    # shardings over the MaskedNode entries, as for optax.masked), one or two
    # ops per param: no arithmetic runs eagerly at init (each op would
    # compile per shape).
    if method == "copy":
      master = jax.tree.map(
          lambda p: jnp.asarray(p, master_dtype) if narrower(p)
          else _NOTHING, params)
      state = MasterWeightsState(inner_state=None, master_params=master)
      inner_params = _inner_params(params, state)
    elif method == "kahan":
      compensation = jax.tree.map(
          lambda p: jnp.zeros_like(p, _COMPENSATION_DTYPE) if _rounded(p)
          else _NOTHING, params)
      state = MasterWeightsState(
          inner_state=None, master_params=None, compensation=compensation)
      # No compensation yet: params + compensation are the params.
      inner_params = _as_f32(params)
    else:
      key = jax.random.key_data(jax.random.key(seed))
      state = MasterWeightsState(
          inner_state=None, master_params=None, rng_key=key)
      inner_params = _as_f32(params)
    inner_state = inner.init(inner_params)
    quantized_states_lib.refuse_wrapped(inner_state, owner,
                                        master_weights=False)
    return state._replace(inner_state=inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    made = _made_by(state)
    if made != method:
      raise ValueError(OTHER_METHOD.format(owner=owner, method=method,
                                           **_mismatch(state, made)))
    if params is None:
      raise ValueError(f"{owner}'s update needs the current params, to "
                       "return the updates that take them to their new "
                       "values: call opt.update(grads, state, params).")
    if method == "copy":
      _check_fits(params, state.master_params, narrower,
                  f"{owner}(method={method!r})'s update", method,
                  "a master copy", f"narrower than {master_dtype.name}")
    elif method == "kahan":
      _check_fits(params, state.compensation, _rounded,
                  f"{owner}(method={method!r})'s update", method,
                  "a compensation", "bfloat16 or float16")
    # The inner optimizer sees the float32 params (the master copy, the
    # params, or params + compensation) and gradients in their dtypes.
    inner_params = _inner_params(params, state)
    grads = tree_lib.cast_like(updates, inner_params)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, inner_params, **extra_args
    )
    inner_updates = tree_lib.cast_like(inner_updates, inner_params)
    if method == "copy":
      updates_out, state = _copy_write(params, state, inner_updates)
    elif method == "kahan":
      updates_out, state = _kahan_write(params, state, inner_params,
                                        inner_updates)
    else:
      updates_out, state = _stochastic_write(params, state, inner_params,
                                             inner_updates)
    return updates_out, state._replace(inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_f32(params: Any) -> Any:
  """The params with their bfloat16/float16 leaves in float32."""
  return jax.tree.map(lambda p: p.astype(_F32) if _rounded(p) else p, params)


def _check_fits(params: Any, slots: Any, keeps: Any, where: str, method: str,
                what: str, narrow: str) -> None:
  """The per-param tree ``slots`` must have the params' structure and hold a
  value exactly for the params ``keeps`` selects (host-side, on shapes and
  dtypes: trace-time); ``keeps=None`` checks the structure only."""
  leaves, treedef = jax.tree.flatten_with_path(params)
  try:
    flat_slots = treedef.flatten_up_to(slots)
    wrong = [
        f"{jax.tree_util.keystr(path) or '<root>'} is "
        f"{_dtype_of(p).name}{list(np.shape(p))} and the state keeps "
        f"{'nothing' if keeps(p) else what} for it"
        for (path, p), slot in zip(leaves, flat_slots)
        if keeps and checks.is_array(p) and keeps(p) != _holds(slot, p)]
  except (ValueError, TypeError):
    wrong = [f"the structure of the params is {treedef}, the state was made "
             f"for {jax.tree.structure(slots)}"]
  if wrong:
    raise ValueError(OTHER_PARAMS.format(
        where=where, method=method, what=what, narrow=narrow,
        found="; ".join(wrong[:3]) + (
            f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")))


def _shown_paths(entries: list[tuple[str, np.dtype]]) -> str:
  shown = ", ".join(f"{path or '<root>'} ({d.name})" for path, d in entries[:5])
  more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
  return shown + more


def _check_rounded_params(params: Any, method: str, owner: str) -> None:
  """Stochastic rounding and Kahan compensation round to bfloat16/float16:
  at least one such param, and no other float narrower than float32."""
  narrow = [
      (jax.tree_util.keystr(path), np.dtype(p.dtype))
      for path, p in jax.tree.leaves_with_path(params)
      if tree_lib.is_float(p) and np.dtype(p.dtype) != _F32
  ]
  others = [(path, d) for path, d in narrow if d not in _FORMATS]
  leaves = jax.tree.leaves(params)
  # No leaves at all (empty params, or optax.tree_map_params' placeholder for
  # the whole tree): nothing to check.
  if others or (not narrow and leaves):
    found = ", ".join(sorted({
        np.dtype(x.dtype).name if checks.is_array(x) else type(x).__name__
        for x in leaves}))
    raise ValueError((OTHER_NARROW if others else NOTHING_TO_ROUND).format(
        owner=owner, method=method, found=_shown_paths(others) or found))


def _inner_params(params: Any, state: MasterWeightsState) -> Any:
  """The params the inner optimizer runs on, in the master dtype where the
  wrapper keeps precision for them, the params themselves elsewhere."""
  if state.master_params is not None:  # A master copy.
    return jax.tree.map(
        lambda p, m: m if _holds(m, p) else p, params, state.master_params)
  if state.compensation is not None:  # Kahan: params + compensation.
    return jax.tree.map(
        lambda p, c: _compensated(p, c) if _holds(c, p) and _rounded(p)
        else p,
        params, state.compensation)
  # Stochastic rounding: the params, in float32.
  return _as_f32(params)


def _holds(slot: Any, p: Any) -> bool:
  """Whether a per-param entry holds a value for ``p`` (an array of its
  shape, not :data:`_NOTHING`)."""
  return checks.is_array(slot) and np.shape(slot) == np.shape(p)


def _rounded(p: Any) -> bool:
  """A param stochastic rounding rounds to (bfloat16 or float16)."""
  return tree_lib.is_float(p) and np.dtype(p.dtype) in _FORMATS


def _copy_write(params, state, inner_updates):
  """The master copy takes the updates; the params become it, rounded.
  Params with no copy train as under the inner optimizer alone."""
  updates_out, master_out = _per_leaf(
      lambda p, m, u: _copy_leaf(p, m, u) if _holds(m, p) else (u, m),
      params, state.master_params, inner_updates)
  return updates_out, state._replace(master_params=master_out)


def _kahan_write(params, state, inner_params, inner_updates):
  """Each new value rounded to nearest; what rounding took is kept for the
  next step."""
  updates_out, compensation = _per_leaf(
      lambda p, c, x, u: _kahan_leaf(p, x, u) if _holds(c, p) else (u, c),
      params, state.compensation, inner_params, inner_updates)
  return updates_out, state._replace(compensation=compensation)


def _per_leaf(write, params, *trees):
  """``write(p, *leaves)`` -> ``(update, slot)`` for each param: the tree of
  updates and the tree of slots (master values or compensations)."""
  pairs = jax.tree.map(write, params, *trees)
  return (jax.tree.map(lambda _, pair: pair[0], params, pairs),
          jax.tree.map(lambda _, pair: pair[1], params, pairs))


def _stochastic_write(params, state, inner_params, inner_updates):
  """Each new value rounded up or down at random, unbiased."""
  key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng_key))
  leaves, treedef = jax.tree.flatten(params)
  xs = treedef.flatten_up_to(inner_params)
  us = treedef.flatten_up_to(inner_updates)
  out = []
  for index, (p, x, u) in enumerate(zip(leaves, xs, us)):
    if not _rounded(p):
      out.append(u)
      continue
    # One stream per leaf; within a leaf, the bits depend on the element's
    # global index only, so each shard of a sharded param draws its own bits
    # and no result depends on the sharding.
    out.append(_stochastic_leaf(p, x, u, jax.random.fold_in(step_key, index)))
  return treedef.unflatten(out), state._replace(
      rng_key=jax.random.key_data(key))


# -- one leaf's write -----------------------------------------------------------
#
# Each is jitted with inline=True: under a trace (a jitted step, grad, vmap,
# shard_map) its operations join the caller's program as if written there; an
# eager call (an update outside jit, get_master_params) compiles one program
# per leaf shape instead of each of its tens of operations (about 1 s on a CPU
# the first time).
_one_program = functools.partial(jax.jit, inline=True)


@_one_program
def _copy_leaf(p: jax.Array, m: jax.Array, u: jax.Array):
  """(the update taking ``p`` to the new master value rounded, the new
  master value ``m + u``)."""
  new_m = m + u
  # Exact in the master dtype (see docs/precision.md), so p + update lands on
  # the rounded master value.
  target = new_m.astype(p.dtype).astype(m.dtype)
  return target - p.astype(m.dtype), new_m


@_one_program
def _kahan_leaf(p: jax.Array, x: jax.Array, u: jax.Array):
  """(the update taking ``p`` to ``x + u`` rounded to nearest, the
  compensation of what rounding took)."""
  fmt = _FORMATS[np.dtype(p.dtype)]
  target = x + u
  # The new param, materialised in its own dtype (exact: the rounded value
  # is one of the format's) before the compensation reads it. Without the
  # barrier each output re-derives it from the old param and compensation,
  # so XLA copies both donated buffers (4 bytes per param) before writing
  # either in place; with it, the step's compiled peak is below the master
  # copy's (benchmarks/results/update_rounding.md).
  new_p = lax.optimization_barrier(_round_half_up(target, fmt).astype(p.dtype))
  new_p = new_p.astype(_F32)
  return new_p - p.astype(_F32), _compensation(target - new_p, new_p, fmt)


@_one_program
def _stochastic_leaf(p: jax.Array, x: jax.Array, u: jax.Array,
                     key: jax.Array) -> jax.Array:
  """The update taking ``p`` to ``x + u`` rounded stochastically with
  ``key``'s bits."""
  new_p = _round_stochastically(x + u, _FORMATS[np.dtype(p.dtype)], key)
  return new_p - p.astype(_F32)


# -- rounding to bfloat16/float16 in float32 arithmetic --------------------------
#
# Every value below is a float32 array. The params' dtype enters only as its
# format (significand bits, smallest normal exponent), and rounding is on its
# grid, exact in float32 (dtypes.spacing_exponent says how).


def _spacing_exponent(x: jax.Array, fmt: tuple[int, int],
                      toward_zero: jax.Array | None = None) -> jax.Array:
  """``k`` (int32) with ``2**k`` the spacing of the format's values around
  float32 ``x``.

  Between 2**e and 2**(e + 1) (in magnitude) it is 2**(max(e, emin) - bits).
  With ``toward_zero`` (where True), for an ``x`` that is itself a normal
  power of two: the spacing just below it (half as large).
  """
  bits, emin = fmt
  k = dtypes.spacing_exponent(x, bits, emin)
  if toward_zero is not None:
    magnitude = lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    power_of_two = ((magnitude & 0x7FFFFF) == 0) & (k + bits > emin)
    k = k - (toward_zero & power_of_two).astype(jnp.int32)
  # Not below float32's smallest normal: the spacing of bfloat16's subnormals
  # (2**-133) is itself subnormal, and flushed to zero where the hardware
  # flushes subnormals (XLA:CPU). Below 2**-119 bfloat16 params are rounded on
  # the coarser grid of 2**-126. At most 2**121 (inf and NaN), so 2**-k is a
  # normal float32 too.
  return jnp.maximum(k, -126)


# Dividing by a spacing is multiplying by its inverse power of two, exactly
# (both are normal float32 numbers). Multiplications keep every rounding step
# a cheap elementwise operation, which XLA fuses into each consumer instead of
# materializing a float32 temporary of the param's size (it does not
# duplicate a division, which it deems expensive).


def _round_half_up(x: jax.Array, fmt: tuple[int, int]) -> jax.Array:
  """``x`` rounded to the nearest value of the format, ties upwards.

  Ties go up (not to even) so that what rounding takes, ``x`` minus the
  result, lies in [-spacing/2, spacing/2): an int16 count of 2**-16 of the
  spacing holds it.
  """
  k = _spacing_exponent(x, fmt)
  rounded = jnp.floor(x * dtypes.pow2(-k) + 0.5) * dtypes.pow2(k)
  return jnp.where(jnp.isfinite(x), rounded, x)


def _round_stochastically(x: jax.Array, fmt: tuple[int, int],
                          key: jax.Array) -> jax.Array:
  """``x`` rounded to its neighbour below or above in the format, the one
  above with probability (x - below) / spacing: unbiased."""
  k = _spacing_exponent(x, fmt)
  q = x * dtypes.pow2(-k)
  below = jnp.floor(q)
  # u has 23 random bits; q - below has at most 16 (bfloat16) or 13 (float16)
  # fraction bits, so P(u < q - below) is exactly q - below. The bits are a
  # keyed hash of each element's index, fused into this update by XLA (no
  # temporary of the param's size; state_codes.counter_bits says why).
  u = state_codes.uniform_from_bits(state_codes.counter_bits(key, x.shape))
  rounded = (below + (u < q - below).astype(jnp.float32)) * dtypes.pow2(k)
  return jnp.where(jnp.isfinite(x), rounded, x)


def _side_spacing_exponent(p: jax.Array, error: jax.Array,
                           fmt: tuple[int, int]) -> jax.Array:
  """The exponent of the spacing on the side of ``p`` (a value of the
  format) where ``p + error`` lies."""
  toward_zero = ((error < 0) & (p > 0)) | ((error > 0) & (p < 0))
  return _spacing_exponent(p, fmt, toward_zero)


def _compensation(error: jax.Array, p: jax.Array,
                  fmt: tuple[int, int]) -> jax.Array:
  """``error`` (|error| <= half the spacing at ``p``) as an int16 count of
  2**-16 of the spacing on its side of ``p``: exact for bfloat16 params,
  whose float32 neighbourhood has 16 more significand bits."""
  inverse = dtypes.pow2(-_side_spacing_exponent(p, error, fmt))
  units = jnp.round(error * inverse * _COMPENSATION_UNITS)
  units = jnp.where(jnp.isfinite(units), units, 0.0)
  # Within int16 by construction (ties round up); the clip only guards the
  # float16 subnormals, where the error is not a whole number of units.
  return jnp.clip(units, -(2.0**15), 2.0**15 - 1).astype(_COMPENSATION_DTYPE)


@_one_program
def _compensated(p: jax.Array, c: jax.Array) -> jax.Array:
  """A Kahan param in float32: the param plus its compensation."""
  fmt = _FORMATS[np.dtype(p.dtype)]
  wide = p.astype(_F32)
  units = c.astype(_F32)
  k = _side_spacing_exponent(wide, units, fmt)
  return wide + units * (1.0 / _COMPENSATION_UNITS) * dtypes.pow2(k)


def get_master_params(opt_state: Any, params: Any) -> Any:
  """Returns the full-precision params from an optimizer state.

  The :class:`MasterWeightsState` may sit anywhere inside ``opt_state``: at the
  top, inside ``loss_scaling``, ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams``, dicts or named tuples. What it returns for
  each half-precision param depends on the method: the master copy
  (``"copy"``), the param plus its compensation in float32 (``"kahan"``: the
  value a master copy would hold), or the param itself
  (``"stochastic_rounding"`` keeps nothing more precise).

  Args:
    opt_state: the state of an optimizer built with :func:`master_weights`.
    params: the current params (those that need no master copy -- already in
      the master dtype, or not floating -- are returned as they are).

  Returns:
    The params' tree with the full-precision values where the state keeps
    them (in the master dtype) and ``params``' own leaves elsewhere. Evaluate
    or export from these rather than from the rounded half-precision params.

  Raises:
    ValueError: if the state holds no master weights, or more than one (then
      pass the sub-state you mean), or ``params`` does not have the structure
      of the params the state was made for.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.loss_scaling(jmp_lite.master_weights(optax.sgd(0.1)),
    ...                             jmp_lite.NoOpLossScale())
    >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(2)}
    >>> jmp_lite.get_master_params(opt.init(params), params)["w"]
    Array([1., 1.], dtype=float32)
  """
  master = tree_lib.find_one(opt_state, MasterWeightsState, "master_params",
                             "get_master_params", "master weights",
                             "jmp_lite.master_weights(inner)")
  state = MasterWeightsState(None, master, *(
      tree_lib.find(opt_state, MasterWeightsState, f)[0]
      for f in ("compensation", "rng_key")))
  if state.rng_key is not None:
    # Stochastic rounding keeps nothing more precise than the params.
    return params
  if state.compensation is not None:
    _check_fits(params, state.compensation, _rounded, "get_master_params",
                "kahan", "a compensation", "bfloat16 or float16")
  else:
    _check_fits(params, state.master_params, None, "get_master_params",
                "copy", "a master copy", "narrower than the master dtype")
  return _inner_params(params, state)


# -- optimizer-state dtypes --------------------------------------------------


def _is_moment(x: Any) -> bool:
  """The state leaves :func:`with_state_dtype` stores in its dtype."""
  return tree_lib.is_float(x) and np.ndim(x) >= 1


#: Why with_state_dtype takes either one dtype or per-role formats.
DTYPE_OR_FORMATS = (
    "with_state_dtype takes either dtype (one floating dtype for every "
    "moment, e.g. jnp.bfloat16) or mu=/nu= (a format per role: 'float32', "
    "'bfloat16', 'bfloat16_sr', 'e4m3', '8bit', '4bit'), got {got}. E.g. "
    "with_state_dtype(optax.adam(1e-3), mu='8bit', nu='8bit'); keep=, "
    "roles=, min_size=, block_size= and seed= go with mu=/nu=."
)


def with_state_dtype(
    inner: optax.GradientTransformation,
    dtype: Any = None,
    *,
    mu: Any = None,
    nu: Any = None,
    keep: Any = (),
    roles: Any = None,
    min_size: int = quantized_states_lib.MIN_SIZE,
    block_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Stores an optimizer's moments in ``dtype``; computes in float32.

  For any optax optimizer (optax's ``mu_dtype`` covers only ``adam``'s first
  moment): ``init`` stores the moments -- the floating state leaves with at
  least one dimension -- in ``dtype``; ``update`` runs the inner update in
  float32 (float64 stays) and rounds the new moments back to ``dtype``. Other
  leaves keep their dtypes and the state keeps the inner optimizer's
  structure. Put it inside :func:`master_weights`. Guide, and what bfloat16
  moments cost in accuracy: ``docs/precision.md``.

  With ``mu=``/``nu=`` instead of ``dtype``, each moment is stored in a
  format chosen by its role, low-bit ones included (``"e4m3"``, ``"8bit"``,
  ``"4bit"``, ``"bfloat16_sr"``): the first moments (signed) in ``mu``'s,
  the second moments (non-negative; their codes never decode to zero) in
  ``nu``'s; leaves with fewer than ``min_size`` elements and the paths
  ``keep=`` matches stay in float32. ``update`` decodes the moments to
  float32, runs ``inner``'s own update and re-encodes them with fresh block
  scales. Guide: ``docs/precision.md`` ("Low-bit optimizer states").

  Args:
    inner: the optax optimizer whose state to store in ``dtype``.
    dtype: a floating dtype, e.g. ``jnp.bfloat16``, ``jnp.float16``,
      ``jnp.float32``, or a name such as ``"bf16"``: every moment in it.
    mu: instead of ``dtype``: the format of the signed (first) moments:
      ``"float32"`` (the default when only ``nu`` is given), ``"bfloat16"``,
      ``"bfloat16_sr"``, ``"e4m3"``, ``"8bit"`` or ``"4bit"``.
    nu: the format of the non-negative (second) moments, from the same list
      or ``"4bit_rank1"`` (lpmm's rank-1 normalisation on 2-D leaves: each
      element scaled by ``min(row max, column max)``; ``"4bit"`` on others).
    keep: regular expressions matched against state paths; matching leaves
      stay in float32 (e.g. ``("embed",)``).
    roles: ``{pattern: "mu" | "nu" | "keep"}`` overriding the role read from
      the optax state's field names.
    min_size: leaves with fewer elements (global shape) stay in float32.
    block_size: block size of the block formats (a power of two from 32 to
      4096; default 256, 128 for ``"4bit"``).
    seed: the seed of ``"bfloat16_sr"``'s random bits.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``inner``'s state
    structure.

  Raises:
    TypeError: if ``inner`` is not an optax transformation or ``dtype`` is not
      a floating dtype.
    ValueError: from ``init``, if ``inner`` contains :func:`master_weights`
      (the master copy would be stored in ``dtype`` too).

  Example:
    >>> import jax.numpy as jnp, optax, jmp_lite
    >>> opt = jmp_lite.with_state_dtype(optax.adam(1e-3), jnp.bfloat16)
    >>> state = opt.init({"w": jnp.ones(3)})
    >>> state[0].mu["w"].dtype, state[0].nu["w"].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype(bfloat16), dtype('int32'))
    >>> updates, state = opt.update({"w": jnp.ones(3)}, state)
    >>> updates["w"].dtype, state[0].mu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
    >>> opt = jmp_lite.with_state_dtype(optax.adam(1e-3), mu="8bit", nu="4bit")
    >>> state = opt.init({"w": jnp.ones((64, 256))})
    >>> state.inner_state[0].mu["w"].shape, state.inner_state[0].nu["w"].shape
    ((64, 260), (64, 136))
  """
  owner = "with_state_dtype"
  formats = mu is not None or nu is not None
  extras = [k + "=" for k, given in (
      ("keep", keep != ()), ("roles", roles is not None),
      ("min_size", min_size != quantized_states_lib.MIN_SIZE),
      ("block_size", block_size is not None), ("seed", seed != 0)) if given]
  if (dtype is not None and formats) or (extras and not formats):
    raise ValueError(DTYPE_OR_FORMATS.format(got=f"dtype={dtype!r}" + (
        f" and mu={mu!r}, nu={nu!r}" if formats else " with "
        + ", ".join(extras))))
  if formats:
    return quantized_states_lib.quantized_states(
        inner, mu="float32" if mu is None else mu,
        nu="float32" if nu is None else nu, keep=keep, roles=roles,
        min_size=min_size, block_size=block_size, seed=seed, owner=owner)
  inner = checks.optax_transformation(inner, owner)
  store_dtype = dtypes.floating_dtype(
      dtype, f"{owner}'s dtype", policy=False,
      example="jnp.bfloat16 or jnp.float32")

  def store(state):
    return jax.tree.map(
        lambda x: x.astype(store_dtype)
        if _is_moment(x) and x.dtype != store_dtype
        else x,
        state,
    )

  def init_fn(params):
    checks.no_fp8_state(params, "jmp_lite.with_state_dtype")
    _check_enabled(store_dtype, f"{owner}'s dtype")
    state = inner.init(params)
    quantized_states_lib.refuse_wrapped(state, owner)
    return store(state)

  def update_fn(updates, state, params=None, **extra_args):
    # The moments, the other floating leaves, the gradients and the params,
    # all in float32 (or wider): the math runs there, strict-promotion clean.
    new_updates, new_state = inner.update(
        tree_lib.widen_floating(updates), tree_lib.widen_floating(state),
        tree_lib.widen_floating(params), **extra_args
    )

    # Back to the stored dtypes: the moments' dtype, and each other leaf's own.
    return new_updates, tree_lib.cast_like(new_state, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
