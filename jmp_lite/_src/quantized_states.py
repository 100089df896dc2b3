"""Optimizer moments stored in low-bit formats, for any optax optimizer.

:func:`quantized_states` wraps an optax optimizer: ``init`` runs the inner
``init`` on float32 params and stores each moment in the format chosen for
its role (:mod:`jmp_lite._src.state_codes`); ``update`` decodes the moments
to float32, runs the inner optimizer's own ``update`` and re-encodes the new
moments with fresh block scales. No optimizer's math is re-implemented.

Roles. A floating state leaf is *first-moment-like* (signed: ``mu=``'s
format), *second-moment-like* (non-negative: ``nu=``'s format, whose codes
cannot decode to zero), or *kept* in float32. The role comes from the field
of the optax state ``NamedTuple`` that holds the leaf's tree
(:data:`SIGNED_FIELDS`, :data:`NON_NEGATIVE_FIELDS`); leaves under any other
field (a lookahead's slow params, ``MultiSteps``' accumulated gradients,
hyperparameters) are kept. ``roles=`` overrides by path. Leaves with fewer
than ``min_size`` elements (biases, norm scales) and the paths matched by
``keep=`` are kept too. Every decision is made on global shapes, so the
device mesh never changes the optimizer.

Guide: ``docs/precision.md`` ("Low-bit optimizer states").
"""

from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import dtypes
from jmp_lite._src import state_codes
from jmp_lite._src import tree as tree_lib

_F32 = np.dtype(np.float32)

#: Fields of optax states whose trees are signed first moments.
SIGNED_FIELDS = frozenset({"mu", "trace", "m", "ema", "exp_avg", "momentum"})
#: Fields of optax states whose trees are non-negative second moments.
NON_NEGATIVE_FIELDS = frozenset({
    "nu", "nu_max", "v", "v_row", "v_col", "sum_of_squares", "exp_avg_sq",
    "grad_sum_sq"})
# Where a state type uses a name above for another kind of moment.
_TYPED_ROLES = {
    ("ScaleByAdanState", "v"): "mu",  # Adan's v: a difference of gradients.
    ("ScaleByAdanState", "n"): "nu",
    ("SophiaState", "nu"): "mu",  # A Hessian-diagonal estimate: any sign.
}
#: The roles ``roles=`` may give a path.
ROLES = ("mu", "nu", "keep")
#: Leaves with fewer elements stay in float32 (bitsandbytes' rule).
MIN_SIZE = 4096

FORMAT_HELP = (
    "Valid formats are 'float32' ('f32'), 'bfloat16' ('bf16'), "
    "'bfloat16_sr' ('bf16_sr': stochastic rounding), 'e4m3' ('fp8': float8 "
    "under a float32 scale per block of 256), '8bit' (bitsandbytes' "
    "dynamic-exponent code, blocks of 256) and '4bit' (blocks of 128: a "
    "dynamic code for signed moments, a code without zero for non-negative "
    "ones) and, for nu only, '4bit_rank1' (the 4-bit code without zero "
    "under lpmm's rank-1 scales, min(row max, column max), on 2-D leaves; "
    "'4bit' on the others). Other dtypes: with_state_dtype(inner, dtype) "
    "stores every moment in one floating dtype."
)

ROLE_HELP = ("A role is 'mu' (signed, mu='s format), 'nu' (non-negative, "
             "nu='s format) or 'keep' (float32).")

BLOCK_SIZE = (
    "it must be a power of two from 32 to 4096, so that 4-bit pairs never "
    "straddle a block and blocks tile the padded last axis (the last block of "
    "a row is zero-padded). Leave it None for each format's own (256, 4-bit "
    "128)."
)

#: A wrapper around loss_scaling (jmp_lite's optimizer-side wrappers).
LOSS_SCALING_INSIDE = (
    "{owner} wraps loss_scaling, which must be the outermost transformation "
    "(a skipped step must leave {owner}'s state untouched too): write "
    "loss_scaling({owner}(inner, ...), loss_scale)."
)

#: A wrapper that stores moments around master_weights.
MASTER_WEIGHTS_INSIDE = (
    "{owner} wraps an optimizer containing master_weights, which must see the "
    "params in their own dtype (and whose float32 master copy is no moment to "
    "store narrower). Put it inside instead: master_weights({owner}(inner, "
    "...))."
)

RANK1_SIGNED = (
    "{owner}: mu={value!r}: rank-1 normalisation scales by row and column "
    "maxima, which only non-negative (second-moment-like) leaves have. Use "
    "it for nu (nu='4bit_rank1') and a signed format for mu, e.g. "
    "mu='4bit'."
)

PARAM_DTYPE = (
    "{owner}: the param {path} is {dtype}; low-bit optimizer states are for "
    "float32, bfloat16 or float16 params. Keep integer leaves out of the "
    "optimizer (optax.partition, or a params tree without them); float8 "
    "belongs to the matmul recipe (m=fp8), not to the params."
)

HYPERPARAMETER_DTYPE = (
    "{owner}: the optimizer state holds the scalar {path} in {dtype} "
    "(value {value}). Hyperparameters must stay in float32: in bfloat16 a "
    "beta2 of 0.999 is 1.0 and the second moment never moves. Pass Python "
    "floats or float32 arrays (optax.inject_hyperparams keeps them as "
    "given), and let {owner} choose the moments' storage."
)

RESTORED_FORMAT = (
    "{owner}: the state does not have the layout this optimizer stores "
    "(mu={mu!r}, nu={nu!r}, block_size={block_size}); {detail}. It was "
    "probably saved by an optimizer with other formats. Build the optimizer "
    "with the formats the checkpoint was written with, or restore with a "
    "target made by jax.eval_shape(opt.init, params) of this optimizer and "
    "start its moments afresh."
)


FORMAT_MISMATCH = (
    "{owner}: the state holds moments stored as {got}, but this optimizer "
    "stores {want}{detail}. It was saved by an optimizer with other "
    "formats: restore it into {owner}(inner, {got_args}), or start the "
    "moments afresh from this optimizer's init."
)


class QuantizedStatesState(NamedTuple):
  """State of an optimizer whose moments are stored in low-bit formats.

  Attributes:
    inner_state: the inner optimizer's state, with each quantized moment
      replaced by its stored array (the params' leading axes, the last axis
      in blocks with their scales: see ``docs/precision.md``) and the other
      leaves as the inner optimizer made them (float32).
    rng_key: the raw ``uint32`` PRNG key of ``"bfloat16_sr"`` (split at
      every update), or ``None``.
    formats: which formats the state holds: ``{tag: codes}``, the tag
      (``"mu=8bit,nu=4bit,block_size=default"``) a dict key, so that it is
      part of the state's structure (orbax refuses to restore into a target
      with another tag; ``update`` refuses a state with another tag), and
      ``codes`` a ``uint8`` array: 1, then per leaf of ``inner_state`` 0
      (stored as the inner optimizer made it) or 1 + the index in
      ``state_codes.FORMAT_NAMES`` of the format it is stored in.
  """

  inner_state: Any
  rng_key: Any = None
  formats: Any = None


def _format(value: Any, role: str, owner: str) -> state_codes.StateFormat:
  if not isinstance(value, str):
    try:  # A dtype (jnp.bfloat16) names its format.
      value = np.dtype(value).name
    except TypeError:
      pass  # checks.choice names it.
  name = checks.choice(value, f"{role} format", owner,
                       tuple(state_codes.FORMATS), FORMAT_HELP,
                       state_codes.ALIASES)
  fmt = state_codes.FORMATS[name]
  if fmt.kind == "rank1" and role != "nu":
    raise ValueError(RANK1_SIGNED.format(owner=owner, value=value))
  return fmt


#: What keep= and the keys of roles= take.
PATTERN_HELP = (
    "They are regular expressions (str), searched in each state leaf's path "
    "as jax.tree_util.keystr writes it, e.g. keep=(r\"\\['embed'\\]\",) "
    "or roles={{'v_diag': 'nu'}}."
)


def _pattern(item: Any, what: str, owner: str) -> re.Pattern:
  if not isinstance(item, str):
    raise TypeError(f"{owner}: {what} holds {item!r} "
                    f"({type(item).__name__}), not a string. "
                    + PATTERN_HELP.format())
  try:
    return re.compile(item)
  except re.error as error:
    raise ValueError(f"{owner}: {what} holds {item!r}, not a valid regular "
                     f"expression ({error}). " + PATTERN_HELP.format()
                     ) from error


def _patterns(value: Any, owner: str) -> tuple[re.Pattern, ...]:
  """keep=: a string or a sequence of strings, each a regular expression."""
  if isinstance(value, str):
    value = (value,)
  if (not isinstance(value, (list, tuple, set, frozenset))
      or isinstance(value, (bytes, bytearray))):
    raise TypeError(f"{owner}: keep={value!r} ({type(value).__name__}); keep "
                    "must be a string or a tuple/list of strings. "
                    + PATTERN_HELP.format())
  return tuple(_pattern(item, f"keep={value!r}", owner) for item in value)


def _role_rules(roles: Any, owner: str) -> tuple[tuple[re.Pattern, str], ...]:
  if roles is None:
    return ()
  if not isinstance(roles, Mapping):
    raise TypeError(f"{owner}: roles={roles!r} ({type(roles).__name__}); "
                    "roles must be a dict {pattern: 'mu' | 'nu' | 'keep'}. "
                    + PATTERN_HELP.format())
  return tuple((_pattern(pattern, "roles (a key)", owner), checks.choice(
      role, f"role of {pattern!r}", owner, ROLES, ROLE_HELP))
               for pattern, role in roles.items())


def _block_size(value: Any, owner: str) -> int | None:
  if value is None:
    return None
  value = checks.integer(value, "block_size", owner, 1)
  if value not in state_codes.BLOCK_SIZES:
    raise ValueError(f"{owner}: block_size={value!r}; {BLOCK_SIZE}")
  return value


def _holds(state: Any, tuple_name: str, field: str) -> bool:
  """Whether a ``tuple_name`` state with ``field`` is inside ``state`` (found
  by name: the optimizer-side wrappers import this module, not it them)."""
  return bool(optax.tree.get_all_with_path(
      state, field,
      filtering=lambda p, v: getattr(p[-1], "tuple_name", None) == tuple_name))


def refuse_wrapped(state: Any, owner: str, master_weights: bool = True) -> None:
  """Refuses an inner state holding loss_scaling (which must be outermost)
  or, with ``master_weights``, master_weights (which must be outside)."""
  if _holds(state, "LossScaleState", "loss_scale"):
    raise TypeError(LOSS_SCALING_INSIDE.format(owner=owner))
  if master_weights and _holds(state, "MasterWeightsState", "master_params"):
    raise ValueError(MASTER_WEIGHTS_INSIDE.format(owner=owner))


def _structural_role(state: Any, path: tuple[Any, ...]) -> str | None:
  """The role of the leaf at ``path`` from the innermost optax state field
  (a ``NamedTuple`` named ``...State``) on its path; None if unknown."""
  found = None
  node = state
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      if isinstance(node, tuple) and type(node).__name__.endswith("State"):
        found = (type(node).__name__, key.name)
      node = getattr(node, key.name, None)
    elif isinstance(key, jax.tree_util.SequenceKey):
      node = node[key.idx] if isinstance(node, (list, tuple)) else None
    elif isinstance(key, jax.tree_util.DictKey):
      node = node[key.key] if isinstance(node, Mapping) else None
    else:
      node = None
  if found is None:
    return None
  if found in _TYPED_ROLES:
    return _TYPED_ROLES[found]
  if found[1] in NON_NEGATIVE_FIELDS:
    return "nu"
  if found[1] in SIGNED_FIELDS:
    return "mu"
  return None


class _Leaf(NamedTuple):
  path: str
  role: str  # "mu", "nu" or "keep"
  fmt: state_codes.StateFormat | None  # None: kept as the inner state has it
  shape: tuple[int, ...]
  dtype: np.dtype


def quantized_states(
    inner: optax.GradientTransformation,
    *,
    mu: Any = "float32",
    nu: Any = "float32",
    keep: Sequence[str] = (),
    roles: Mapping[str, str] | None = None,
    min_size: int = MIN_SIZE,
    block_size: int | None = None,
    seed: int = 0,
    owner: str = "with_state_dtype",
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s moments in low-bit formats (see the module docstring).

  Args:
    inner: any optax optimizer.
    mu: the format of signed (first-moment-like) leaves.
    nu: the format of non-negative (second-moment-like) leaves.
    keep: regular expressions; state leaves whose path
      (``jax.tree_util.keystr``) matches one stay in float32.
    roles: ``{pattern: "mu" | "nu" | "keep"}``, overriding the role read
      from the state's structure for matching paths (the first match wins).
    min_size: leaves with fewer elements (global shape) stay in float32.
    block_size: the block size of the block formats (default: 256 for
      ``"8bit"`` and ``"e4m3"``, 128 for ``"4bit"``).
    seed: the seed of ``"bfloat16_sr"``'s random bits.
    owner: the public name errors quote.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`QuantizedStatesState`.
  """
  inner = checks.optax_transformation(inner, owner)
  mu_fmt, nu_fmt = _format(mu, "mu", owner), _format(nu, "nu", owner)
  keep_rules = _patterns(keep, owner)
  role_rules = _role_rules(roles, owner)
  min_size = checks.integer(min_size, "min_size", owner, low=0)
  size = _block_size(block_size, owner)
  if size is not None:
    mu_fmt, nu_fmt = (state_codes.with_block_size(f, size) if f.blocked else f
                      for f in (mu_fmt, nu_fmt))
  stochastic = mu_fmt.stochastic or nu_fmt.stochastic
  seed = checks.integer(seed, "seed", owner, 0, checks.UINT32_MAX)
  names = {"mu": mu_fmt, "nu": nu_fmt}
  tag = (f"mu={mu_fmt.name},nu={nu_fmt.name},"
         f"block_size={size or 'default'}")

  def format_codes(leaves_plan) -> np.ndarray:
    codes = [1]
    for spec in leaves_plan:
      if spec is None or spec.fmt is None:
        codes.append(0)
      else:
        fmt = state_codes.for_shape(spec.fmt, spec.shape)
        codes.append(1 + state_codes.FORMAT_NAMES.index(fmt.name))
    return np.array(codes, np.uint8)

  def plan(state: Any) -> list[_Leaf | None]:
    """One entry per leaf of the inner state: None for non-floating ones."""
    out = []
    for path, leaf in jax.tree.leaves_with_path(state):
      if not tree_lib.is_float(leaf):
        out.append(None)
        continue
      where = jax.tree_util.keystr(path)
      shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
      role = next((r for pattern, r in role_rules if pattern.search(where)),
                  None)
      if role is None:
        if any(pattern.search(where) for pattern in keep_rules):
          role = "keep"
        elif int(np.prod(shape, dtype=np.int64)) < min_size:
          role = "keep"
        else:
          role = _structural_role(state, path) or "keep"
      fmt = names.get(role)
      if fmt is not None and fmt.name == "float32":
        fmt = None
      if fmt is not None and fmt.blocked and not shape:
        fmt = None
      out.append(_Leaf(where, role, fmt, shape, dtype))
    return out

  def check_params(params: Any) -> None:
    checks.no_fp8_state(params, f"jmp_lite.{owner}")
    for path, p in jax.tree.leaves_with_path(params):
      if not (checks.is_array(p) or isinstance(p, jax.ShapeDtypeStruct)):
        continue
      dtype = np.dtype(p.dtype)
      narrow_float = dtypes.is_floating(dtype) and dtype.itemsize == 1
      if not dtypes.is_floating(dtype) or narrow_float:
        raise ValueError(PARAM_DTYPE.format(
            owner=owner, dtype=dtype.name,
            path=jax.tree_util.keystr(path) or "<root>"))

  def check_hyperparameters(state: Any) -> None:
    for path, leaf in jax.tree.leaves_with_path(state):
      if (tree_lib.is_float(leaf) and np.ndim(leaf) == 0
          and np.dtype(leaf.dtype).itemsize < 4):
        value = leaf if checks.is_concrete(leaf) else "traced"
        raise ValueError(HYPERPARAMETER_DTYPE.format(
            owner=owner, path=jax.tree_util.keystr(path),
            dtype=np.dtype(leaf.dtype).name, value=value))

  def encode_state(state: Any, leaves_plan, key, old=None) -> Any:
    """Encodes the moments; with ``old`` (decoded, stored), a moment left
    bitwise unchanged keeps its stored bytes (state_codes.reencode)."""
    leaves, treedef = jax.tree.flatten(state)
    if old is not None:
      decoded, stored = (treedef.flatten_up_to(t) for t in old)
    out = []
    for index, (leaf, spec) in enumerate(zip(leaves, leaves_plan)):
      if spec is None or spec.fmt is None:
        out.append(leaf)
        continue
      leaf_key = (jax.random.fold_in(key, index)
                  if spec.fmt.stochastic else None)
      x = jnp.asarray(leaf, _F32)
      if old is None:
        out.append(state_codes.encode(x, spec.fmt, spec.role == "nu",
                                      leaf_key))
      else:
        out.append(state_codes.reencode(
            x, jnp.asarray(decoded[index], _F32), stored[index], spec.fmt,
            spec.role == "nu", leaf_key))
    return treedef.unflatten(out)

  def decode_state(state: Any, leaves_plan) -> Any:
    leaves, treedef = jax.tree.flatten(state)
    out = []
    for leaf, spec in zip(leaves, leaves_plan):
      if spec is None or spec.fmt is None:
        out.append(leaf)
        continue
      out.append(state_codes.decode(leaf, spec.fmt, spec.role == "nu",
                                    spec.shape).astype(spec.dtype))
    return treedef.unflatten(out)

  def float32_params(params: Any) -> Any:
    return tree_lib.widen_floating(params)

  def init_fn(params):
    check_params(params)
    state = inner.init(float32_params(params))
    check_hyperparameters(state)
    refuse_wrapped(state, owner)
    key = None
    if stochastic:
      key = jax.random.key(seed)
    leaves_plan = plan(state)
    stored = encode_state(state, leaves_plan,
                          None if key is None else jax.random.fold_in(key, 0))
    return QuantizedStatesState(
        stored, None if key is None else jax.random.key_data(key),
        {tag: jnp.asarray(format_codes(leaves_plan))})

  def expected_state(updates: Any) -> tuple[Any, list[_Leaf | None]]:
    abstract = jax.eval_shape(inner.init, float32_params(updates))
    leaves_plan = plan(abstract)
    leaves, treedef = jax.tree.flatten(abstract)
    stored = []
    for leaf, spec in zip(leaves, leaves_plan):
      if spec is None or spec.fmt is None:
        stored.append(leaf)
      else:
        stored.append(jax.ShapeDtypeStruct(
            state_codes.stored_shape(spec.shape, spec.fmt),
            state_codes.stored_dtype(spec.fmt)))
    return treedef.unflatten(stored), leaves_plan

  def check_layout(state: QuantizedStatesState, expected: Any,
                   leaves_plan) -> None:
    def fail(detail):
      raise ValueError(RESTORED_FORMAT.format(
          owner=owner, mu=mu_fmt.name, nu=nu_fmt.name,
          block_size=size or "format default", detail=detail))

    if not isinstance(state, QuantizedStatesState):
      fail(f"it is a {type(state).__name__}, not the QuantizedStatesState "
           "made by this optimizer's init")
    formats = state.formats
    if not isinstance(formats, Mapping) or len(formats) != 1:
      fail(f"its formats field is {formats!r}, not the {{tag: codes}} made "
           "by this optimizer's init")
    (got_tag, codes), = formats.items()
    if got_tag != tag:
      raise ValueError(FORMAT_MISMATCH.format(
          owner=owner, got=got_tag, want=tag, detail="",
          got_args=_as_args(got_tag)))
    if checks.is_concrete(codes):
      want_codes = format_codes(leaves_plan)
      got_codes = np.asarray(codes)
      if (got_codes.shape != want_codes.shape
          or not np.array_equal(got_codes, want_codes)):
        raise ValueError(FORMAT_MISMATCH.format(
            owner=owner, got=f"{got_tag} (leaf formats {got_codes.tolist()})",
            want=f"{tag} (leaf formats {want_codes.tolist()})",
            detail=" (keep=, roles= or min_size= differ)",
            got_args=_as_args(got_tag)))
    if (state.rng_key is None) == stochastic:
      fail("its random key is " + ("missing" if stochastic else
                                   "present, but no format rounds "
                                   "stochastically"))
    got, got_def = jax.tree.flatten_with_path(state.inner_state)
    want, want_def = jax.tree.flatten(expected)
    if got_def != want_def:
      fail(f"its structure is {got_def}, expected {want_def}")
    for (path, leaf), spec in zip(got, want):
      if not hasattr(leaf, "dtype"):
        continue
      if (tuple(np.shape(leaf)) != tuple(spec.shape)
          or np.dtype(leaf.dtype) != np.dtype(spec.dtype)):
        fail(f"the leaf {jax.tree_util.keystr(path)} is "
             f"{np.dtype(leaf.dtype).name}{list(np.shape(leaf))}, expected "
             f"{np.dtype(spec.dtype).name}{list(spec.shape)}")

  def update_fn(updates, state, params=None, **extra_args):
    expected, leaves_plan = expected_state(updates)
    check_layout(state, expected, leaves_plan)
    inner_state = decode_state(state.inner_state, leaves_plan)
    new_updates, new_inner = inner.update(
        tree_lib.widen_floating(updates), inner_state,
        None if params is None else float32_params(params), **extra_args)
    key = step_key = None
    if stochastic:
      key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng_key))
    new_inner = tree_lib.cast_like(new_inner, inner_state)
    stored = encode_state(new_inner, leaves_plan, step_key,
                          old=(inner_state, state.inner_state))
    return new_updates, QuantizedStatesState(
        stored, None if key is None else jax.random.key_data(key),
        state.formats)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_args(tag: str) -> str:
  """``"mu=8bit,nu=4bit,block_size=default"`` -> ``mu='8bit', nu='4bit'``
  (and ``block_size=...`` unless the default)."""
  parts = dict(item.split("=", 1) for item in tag.split(",") if "=" in item)
  out = [f"{k}={parts[k]!r}" for k in ("mu", "nu") if k in parts]
  if parts.get("block_size", "default") != "default":
    out.append(f"block_size={parts['block_size']}")
  return ", ".join(out)


def bytes_per_parameter(state: Any, params: Any) -> float:
  """Bytes of ``state`` (arrays or ``jax.eval_shape`` structs) per parameter
  of ``params``."""
  def nbytes(tree):
    return sum(int(np.prod(np.shape(x), dtype=np.int64))
               * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
  count = sum(int(np.prod(np.shape(p), dtype=np.int64))
              for p in jax.tree.leaves(params) if hasattr(p, "dtype"))
  return nbytes(state) / count
