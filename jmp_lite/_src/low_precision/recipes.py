"""Float8 recipes as data: the named recipes, :class:`Fp8Config`, and their
text in the policy grammar.

The recipe layer sits below the policy and imports nothing above the
foundations and the float8 element formats: a :class:`Fp8Config` is a
frozen, hashable dataclass (a static value: ``functools.partial(
fp8_dot_general, config=...)``, a ``jit`` static argument, a policy's
resolved recipe). Its constructor validates and canonicalises every field, so
equal recipes compare and hash equal.

The policy grammar names recipes (``m=fp8``, ``m=fp8_rowwise``...):
:data:`FP8_RECIPES` holds each name's fields, :func:`recipe_config` turns a
policy's matmul precision into its recipe (once, when the policy is built:
``Policy.fp8_recipe``), and :meth:`Fp8Config.spec` / :func:`from_spec` write
and read a recipe in the grammar (``"fp8_delayed(margin=1)"``). This module
also holds the one granularity vocabulary (:data:`GRANULARITIES`,
:data:`MATMUL_GRANULARITIES`) that the quantizers, the matmul and the
diagnostics use.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np

from jmp_lite._src import checks
from jmp_lite._src import dtypes as dtypes_lib
from jmp_lite._src.low_precision import formats as formats_lib

#: The float8 matmul recipes a policy names with ``m=`` (plain data: the
#: fields of :class:`Fp8Config` that differ from its defaults). Why each:
#: ``docs/fp8.md``.
FP8_RECIPES: dict[str, dict[str, Any]] = {
    # Per-tensor current scaling, e4m3 forward, e5m2 gradients: torchao's
    # "tensorwise", Transformer Engine's Float8CurrentScaling (HYBRID).
    "fp8": {},
    # One scale per row along the contracting dimension, e4m3 everywhere,
    # power-of-two scales: torchao's "rowwise".
    "fp8_rowwise": {"granularity": "row", "gradient_format": "e4m3"},
    # DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight blocks,
    # e4m3 everywhere (Transformer Engine's Float8BlockScaling).
    "fp8_blockwise": {"granularity": "blockwise", "gradient_format": "e4m3"},
    # OCP MX: 1x32 blocks, E8M0 scales, e4m3 everywhere (TE's
    # MXFP8BlockScaling default).
    "mxfp8": {"granularity": "mxfp8", "gradient_format": "e4m3"},
    # Per-tensor delayed scaling of the forward operands (amax histories),
    # current-scaled gradients.
    "fp8_delayed": {"scaling": "delayed"},
}

# -- the granularity vocabulary ---------------------------------------------------
#
# One set of names for how elements share a float8 scale. An operand is scaled
# per "tensor", per "row", in 1 x block_size "tile"s, in block_size x
# block_size "block"s, or in 1x32 "mxfp8" blocks (E8M0 scales): the
# quantizer's GRANULARITIES. A matmul's granularity (MATMUL_GRANULARITIES,
# Fp8Config.granularity, the diagnostics') names how its two operands are
# scaled: "tensor", "row" and "mxfp8" scale both alike, "blockwise" is
# DeepSeek-V3's tiles for the activation and blocks for the weight.

#: How the elements of one operand share scales (``quantize``).
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "tile", "block", "mxfp8")
#: How a float8 matmul scales its operands (``Fp8Config.granularity``).
MATMUL_GRANULARITIES: tuple[str, ...] = ("tensor", "row", "blockwise", "mxfp8")
#: ``(activation, weight)`` operand granularities of each matmul granularity.
MATMUL_OPERANDS: dict[str, tuple[str, str]] = {
    "tensor": ("tensor", "tensor"), "row": ("row", "row"),
    "blockwise": ("tile", "block"), "mxfp8": ("mxfp8", "mxfp8"),
}
#: Spellings accepted before the vocabulary was unified: each raises an error
#: naming the one spelling (for one release).
RENAMED_GRANULARITIES: dict[str, str] = {
    "tensorwise": "tensor", "per_tensor": "tensor",
    "rowwise": "row", "axiswise": "row", "per_row": "row",
    "mx": "mxfp8",
}
#: The MX block size (OCP Microscaling spec: 32 elements share a scale).
MX_BLOCK_SIZE = 32
#: DeepSeek-V3's tile/block size.
DEFAULT_BLOCK_SIZE = 128
#: The algorithms delayed scaling takes its amax from a history with
#: (Transformer Engine's names).
AMAX_ALGORITHMS: tuple[str, ...] = ("max", "most_recent")
AMAX_ALGORITHM_HELP = (
    "Valid amax algorithms: 'max', 'most_recent' (the largest amax of the "
    "history, or its newest entry).")


def check_granularity(name: Any, valid: tuple[str, ...], help_text: str, *,
                      owner: str) -> str:
  """Canonicalises a granularity name of ``valid`` or raises a teaching error
  (an old spelling: an error naming the one spelling)."""
  key = name.strip().lower() if isinstance(name, str) else None
  if key in RENAMED_GRANULARITIES:
    help_text = (f"{name!r} is now spelled {RENAMED_GRANULARITIES[key]!r} "
                 f"(one name per granularity). {help_text}")
  return checks.choice(name, "granularity", owner, valid, help_text)

#: The scaling modes.
SCALING_MODES: tuple[str, ...] = ("current", "delayed")
#: Delayed scaling's defaults: a 16-step history, its maximum, no margin
#: (why: ``docs/fp8.md``, delayed scaling).
DEFAULT_HISTORY_LENGTH = 16
DEFAULT_AMAX_ALGORITHM = "max"
#: By default only matmuls whose M, N and K are multiples of this run in
#: float8 (float8 tensor-core GEMMs need multiples of 16).
DEFAULT_DIM_MULTIPLE = 16

MATMUL_GRANULARITY_HELP = (
    "Valid matmul granularities are 'tensor' (one scale per operand), 'row' "
    "(one scale per row along the contracting dimension, for each operand "
    "and for each backward matmul: torchao's rowwise recipe), 'blockwise' "
    "(DeepSeek-V3: 1 x block_size tiles for the lhs and the gradient, "
    "block_size x block_size blocks for the rhs, block_size 128 by default) "
    "and 'mxfp8' (1x32 blocks along the contracting dimension with "
    "power-of-two E8M0 scales)."
)
SCALING_HELP = (
    "Valid scaling modes are 'current' (the scale of each operand is computed "
    "from its own amax, just in time: the default) and 'delayed' (the scales "
    "of the forward operands come from amax histories of earlier steps; "
    "per-tensor granularity only; the incoming gradient stays current-scaled)."
)
DELAYED_GRANULARITY_HELP = (
    "Delayed scaling keeps one amax history per tensor, so it needs "
    "granularity='tensor'. Use scaling='current' with 'row', 'blockwise' or "
    "'mxfp8': their scales follow the data of each step, which is what makes "
    "them accurate."
)
BLOCK_SIZE_HELP = (
    "block_size sets the tile/block edge of granularity='blockwise' (default "
    "128, DeepSeek-V3's). It must be a positive multiple of 16: each block "
    "is a float8 GEMM along the contracting dimension, and float8 tensor "
    "cores need multiples of 16."
)
DELAYED_ONLY_HELP = (
    "history_length, margin and amax_algorithm configure delayed scaling's "
    "amax histories; with scaling='current' leave them unset (use the recipe "
    "'fp8_delayed', or scaling='delayed')."
)
POLICY_COMPUTE_DTYPE = (
    "Fp8Config.compute_dtype is the result dtype of jmp_lite.fp8.dot_general "
    "called directly; in a policy the policy's compute dtype applies. Leave it None "
    "(e.g. dataclasses.replace(config, compute_dtype=None))."
)

MXFP8_POWER_OF_TWO = (
    "granularity='mxfp8' uses E8M0 scales, which are powers of two: "
    "power_of_two_scales=False is not possible with it."
)
BLOCK_SIZE_ONLY = (
    "block_size only applies to granularity='blockwise'; leave it None. "
    "MXFP8 blocks are always 32 elements."
)

_OWNER = "Fp8Config"
#: The boolean fields of :class:`Fp8Config`.
_FLAGS = ("power_of_two_scales", "include_output_head", "include_batched",
          "native_mx", "include_moe_gating")
#: Fields that only some granularities or scaling modes take: (the fields a
#: refusal shows, whether the given fields conflict, why and how to fix it).
_CONFLICTS = (
    (("scaling", "granularity"),
     lambda f: f["scaling"] == "delayed" and f["granularity"] != "tensor",
     DELAYED_GRANULARITY_HELP),
    (("granularity", "power_of_two_scales"),
     lambda f: f["granularity"] == "mxfp8" and not f["power_of_two_scales"],
     MXFP8_POWER_OF_TWO),
    (("block_size", "granularity"),
     lambda f: f["block_size"] is not None and f["granularity"] != "blockwise",
     BLOCK_SIZE_ONLY),
    (("history_length", "margin", "amax_algorithm", "scaling"),
     lambda f: f["scaling"] != "delayed" and (
         f["history_length"], f["margin"], f["amax_algorithm"]) != (
             None, 0, None),
     DELAYED_ONLY_HELP),
)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """How float8 matmuls quantize their operands and gradients (a recipe).

  The named recipes of the policy grammar are configs: ``m=fp8`` is
  ``Fp8Config()``, ``m=fp8_rowwise`` is ``Fp8Config(granularity="row",
  gradient_format="e4m3")``, and so on (``docs/fp8.md``). Build one to change
  a field, and put it in a policy (``Policy(..., matmul_precision=config)``,
  ``policy.with_matmul_precision(config)``) or pass it to
  :func:`~jmp_lite.fp8.fp8_dot_general`. ``str(policy)`` writes it in the
  grammar (:meth:`spec`), and ``get_policy`` reads that back.

  Attributes:
    forward_format: the format of both forward operands, ``"e4m3"`` (default)
      or ``"e5m2"``.
    gradient_format: the format of the incoming gradient in the backward pass:
      ``"e5m2"`` (default: the "hybrid" recipe, for its range) or ``"e4m3"``
      (e4m3 everywhere, as the rowwise, blockwise and MX recipes use).
    granularity: ``"tensor"`` (default), ``"row"``, ``"blockwise"`` or
      ``"mxfp8"``. Every granularity scales along the contracting dimension
      of the matmul at hand, so the backward matmuls requantize their operands
      along their own contracting dimensions (except per-tensor scaling, whose
      forward operands are reused).
    scaling: ``"current"`` (default) or ``"delayed"`` (per-tensor only: the
      forward operands are scaled from amax histories of earlier steps, the
      incoming gradient from its own amax).
    power_of_two_scales: round computed scales up to powers of two (default
      True: exact scaling). MX scales always are.
    block_size: the tile/block size of ``"blockwise"`` (default 128, a
      positive multiple of 16); must be None for the other granularities.
    history_length: delayed scaling's amax history length (default 16).
    margin: delayed scaling's headroom in powers of two (default 0): scales
      are multiplied by ``2**margin``. A whole number from 0 to 64 (a
      negative margin clips the largest values; why: ``docs/fp8.md``).
    amax_algorithm: delayed scaling's amax from its history, ``"max"``
      (default) or ``"most_recent"``.
    include_output_head: under a policy, also run the output head (the last
      matmul of the forward pass) in float8 (default False).
    include_batched: under a policy, also run matmuls with batch dimensions
      (attention scores and their product with the values) in float8
      (default False).
    dim_multiple: under a policy, matmuls run in float8 only where M, N and
      K are multiples of it (default 16; 1 admits every shape).
    compute_dtype: the dtype of the result when ``fp8_dot_general`` gets no
      ``preferred_element_type``; None (default): the (promoted) dtype of the
      operands. Must be None in a policy.
    native_mx: with ``"mxfp8"``, run the block-scaled matmul natively
      (``jax.nn.scaled_matmul``, cuDNN/cuBLAS MXFP8) when the program is
      lowered for CUDA, and the exact emulation on every other platform
      (default True); False: the emulation everywhere (e.g. to export one
      program for several platforms, which the native path cannot lower for).
    axis_name: under ``jax.pmap``/``jax.shard_map``, the mapped axis (a
      string, or a tuple of strings) over which per-tensor amaxes are
      reduced (``lax.pmax``), current and delayed, so that every replica
      uses the same scales and records the same amax history (Transformer
      Engine's amax reduction over the data-parallel group). None (default):
      a delayed recipe reduces over every mapped axis bound where it runs
      (its histories are state: replicas never hold different ones); current
      scaling scales each replica from its own shard. Not needed under
      ``jax.jit`` with sharded arrays, where amaxes are global already
      (``docs/fp8.md``).
    include_moe_gating: under ``autocast``/``with_policy``, also run a
      Mixture-of-Experts layer's gating matmuls in float8: the router (a
      matmul whose scores pick the experts, through ``top_k``/``argmax``/
      ``sort``) and the combine (a matmul with the gate weights). Default
      False: they stay in the compute dtype, as DeepSeek-V3 keeps them
      (``docs/fp8.md``).
    fsdp_axis: under ``jax.jit`` with weights sharded over a mesh axis
      (FSDP), that axis (a string, or a tuple of strings). The matmul
      quantizes the rhs (the weight) shard by shard with the scales every
      shard shares (per tensor and per row: the maximum of the amaxes, one
      max all-reduce), then replicates the float8 values and their scales
      as their bits (``uint8``; ``jax.lax.with_sharding_constraint``), so
      that XLA all-gathers 1 byte per element and no wider copy of the
      weight; the backward pass reuses the gathered weight (per tensor) or
      gathers its requantized transpose the same way (row, blockwise, MX).
      Every granularity. The mesh is the one set where the step is traced
      (``jax.set_mesh(mesh)``); the gathered weight is fully replicated, so
      a weight also sharded over another axis (tensor parallelism) is
      gathered over it too. None (default): XLA partitions the matmul
      itself (XLA:CPU widens a float8 all-gather to float16;
      ``docs/fp8.md``, "FSDP: the weight all-gather in float8").

  Raises:
    TypeError, ValueError: for a field of the wrong type or value.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite.fp8 import Fp8Config
    >>> Fp8Config(granularity="row") == Fp8Config(granularity=" Row ")
    True
    >>> config = Fp8Config(scaling="delayed", margin=1)
    >>> config.spec(), config.history_length
    ('fp8_delayed(margin=1)', 16)
    >>> print(jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(config))
    p=full,c=bf16,o=full,m=fp8_delayed(margin=1)
  """

  forward_format: str = "e4m3"
  gradient_format: str = "e5m2"
  granularity: str = "tensor"
  scaling: str = "current"
  power_of_two_scales: bool = True
  block_size: int | None = None
  history_length: int | None = None
  margin: int = 0
  amax_algorithm: str | None = None
  include_output_head: bool = False
  include_batched: bool = False
  dim_multiple: int = DEFAULT_DIM_MULTIPLE
  compute_dtype: Any = None
  native_mx: bool = True
  axis_name: Any = None
  include_moe_gating: bool = False
  fsdp_axis: Any = None

  def __post_init__(self):
    fields = dict(
        forward_format=formats_lib.get_format(
            self.forward_format, "forward_format").name,
        gradient_format=formats_lib.get_format(
            self.gradient_format, "gradient_format").name,
        granularity=check_granularity(
            self.granularity, MATMUL_GRANULARITIES, MATMUL_GRANULARITY_HELP,
            owner=_OWNER),
        scaling=checks.choice(self.scaling, "scaling", _OWNER, SCALING_MODES,
                              SCALING_HELP),
        block_size=self.block_size, history_length=self.history_length,
        margin=checks.fp8_margin(self.margin, _OWNER),
        amax_algorithm=self.amax_algorithm,
        dim_multiple=checks.integer(self.dim_multiple, "dim_multiple", _OWNER,
                                    low=1),
        compute_dtype=None if self.compute_dtype is None else
        dtypes_lib.canonical_dtype(self.compute_dtype,
                                   "Fp8Config.compute_dtype"),
        axis_name=_canonical_axis_name(self.axis_name),
        fsdp_axis=_canonical_fsdp_axis(self.fsdp_axis),
    )
    for name in _FLAGS:
      fields[name] = checks.flag(getattr(self, name), name, _OWNER)
    for names, conflict, why in _CONFLICTS:
      if conflict(fields):
        shown = ", ".join(f"{n}={fields[n]!r}" for n in names)
        raise ValueError(f"{_OWNER}({shown}): {why}")
    if fields["granularity"] == "blockwise":
      size = fields["block_size"] = checks.integer(
          DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size,
          "block_size", _OWNER)
      if size < 16 or size % 16:
        raise ValueError(f"Fp8Config.block_size={size} is not a positive "
                         f"multiple of 16. {BLOCK_SIZE_HELP}")
    if fields["scaling"] == "delayed":
      fields["history_length"] = checks.integer(
          DEFAULT_HISTORY_LENGTH if self.history_length is None
          else self.history_length, "history_length", _OWNER, low=1,
          high=2**20)
      fields["amax_algorithm"] = checks.choice(
          DEFAULT_AMAX_ALGORITHM if self.amax_algorithm is None
          else self.amax_algorithm, "amax_algorithm", _OWNER,
          AMAX_ALGORITHMS, AMAX_ALGORITHM_HELP)
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  @property
  def forward(self) -> formats_lib.Fp8Format:
    """The forward operands' :class:`~jmp_lite._src.low_precision.formats.Fp8Format`."""
    return formats_lib.get_format(self.forward_format)

  @property
  def gradient(self) -> formats_lib.Fp8Format:
    """The incoming gradient's :class:`~jmp_lite._src.low_precision.formats.Fp8Format`."""
    return formats_lib.get_format(self.gradient_format)

  def spec(self) -> str:
    """The recipe in the policy grammar: ``"fp8_delayed(margin=1)"``.

    The named recipe with this granularity and scaling, followed by the
    fields that differ from it, in field order; ``from_spec`` (and
    ``get_policy``'s ``m=``) reads it back to an equal config.
    """
    name = _base_name(self.granularity, self.scaling)
    return _named_spec(self, name, _named(name))

  def check_policy_use(self) -> None:
    """Raises if the config cannot be a policy's recipe: a compute dtype, or
    an axis name the policy grammar cannot write."""
    problem = (
        f"compute_dtype={np.dtype(self.compute_dtype).name}. "
        f"{POLICY_COMPUTE_DTYPE}" if self.compute_dtype is not None else
        _unwritable_axis_name(self.axis_name) or
        _unwritable_axis_name(self.fsdp_axis, "fsdp_axis"))
    if problem:
      raise ValueError(f"{self.spec()}: {problem}")


def _canonical_axis_name(name: Any) -> Any:
  """None, a str, or a tuple of str (a list becomes a tuple: hashable)."""
  if name is None:
    return None
  checks.axis_name(name)
  return tuple(name) if isinstance(name, (tuple, list)) else name


FSDP_AXIS_HELP = (
    "fsdp_axis names the mesh axis (a string such as 'fsdp', or a tuple of "
    "them) over which the weights (the rhs of each float8 matmul) are "
    "sharded under jax.jit, FSDP-style: the matmul quantizes the local shard "
    "and all-gathers the 1-byte float8 values (as uint8 bits) and their "
    "scales, never a wider copy (docs/fp8.md, 'FSDP: the weight all-gather "
    "in float8'). None (default): XLA partitions the matmul as it likes."
)


def _canonical_fsdp_axis(axis: Any, owner: str = "Fp8Config") -> Any:
  """None, a mesh axis name, or a tuple of them (a list becomes a tuple)."""
  if axis is None:
    return None
  names = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  if not names or not all(isinstance(n, str) and n for n in names):
    raise TypeError(f"{owner}.fsdp_axis must be a mesh axis name or a tuple "
                    f"of them, got {type(axis).__name__}: {axis!r}. "
                    f"{FSDP_AXIS_HELP}")
  if len(set(names)) != len(names):
    raise ValueError(f"{owner}.fsdp_axis={axis!r} names an axis twice. "
                     f"{FSDP_AXIS_HELP}")
  return names if isinstance(axis, (tuple, list)) else axis


def _unwritable_axis_name(axis: Any, field: str = "axis_name") -> str | None:
  """Why a recipe's (canonical) axis name cannot be written in the policy
  grammar, or None if it can."""
  names = axis if isinstance(axis, tuple) else (axis,)
  if axis is None or (names and all(
      isinstance(n, str) and _AXIS_NAME.match(n) and n.lower() != "none"
      for n in names)):
    return None
  return (f"{field}={axis!r} cannot be written in the policy grammar. "
          f"{AXIS_NAME_SPELLING}")


def _base_name(granularity: str, scaling: str) -> str:
  """The named recipe with this granularity and scaling (each pair has one:
  ``_CONFLICTS`` refuses delayed scaling but per tensor)."""
  return {(fields.get("granularity", "tensor"),
           fields.get("scaling", "current")): name
          for name, fields in FP8_RECIPES.items()}[granularity, scaling]


@functools.lru_cache(maxsize=None)
def _named(name: str) -> Fp8Config:
  return Fp8Config(**FP8_RECIPES[name])


# -- FP4 recipes ------------------------------------------------------------------

#: The FP4 matmul recipes a policy names with ``m=`` (each is
#: ``Fp4Config(recipe=name)``; why each: ``docs/fp4.md``).
FP4_RECIPES: tuple[str, ...] = ("nvfp4", "mxfp4")
#: NVFP4 blocks: 16 elements along the contracting axis (16x16 weight tiles).
NVFP4_BLOCK_SIZE = 16
#: MXFP4 blocks: 32 elements along the contracting axis.
MXFP4_BLOCK_SIZE = 32
#: MXFP4 scale rules: ``"round_up"`` (cuBLAS, JAX; the default) or ``"floor"``
#: (the OCP Microscaling spec's).
MX_SCALE_RULES: tuple[str, ...] = ("round_up", "floor")

FP4_RECIPE_HELP = (
    "Valid FP4 recipes are 'nvfp4' (NVIDIA: 1x16 blocks of E2M1 with E4M3 "
    "scales under a float32 per-tensor scale; 16x16 weight tiles, random "
    "Hadamard transform and stochastic rounding in the backward pass) and "
    "'mxfp4' (OCP Microscaling: 1x32 blocks with power-of-two E8M0 scales; "
    "random Hadamard transform and stochastic rounding in the backward pass, "
    "as Tseng et al. train)."
)
TWO_D_HELP = (
    "two_d_weights quantizes the weight (the rhs) in 16x16 tiles, NVFP4's "
    "recipe. MXFP4 blocks are 1x32 along the contracting dimension and have "
    "no 2D variant: leave two_d_weights unset (None) or False with "
    "recipe='mxfp4'."
)
SCALE_RULE_NVFP4_HELP = (
    "mx_scale_rule chooses MXFP4's power-of-two scale; NVFP4's E4M3 block "
    "scales are rounded to nearest. Leave mx_scale_rule unset (None) with "
    "recipe='nvfp4'."
)
SCALE_RULE_HELP = (
    "Valid rules are the strings 'round_up' (the block's largest element is "
    "never clipped, as cuBLAS and JAX round) and 'floor' (the OCP "
    "Microscaling spec's rule)."
)
_FP4_OWNER = "Fp4Config"
_FP4_FLAGS = ("rht", "stochastic_rounding", "native", "quantize_forward",
              "include_output_head", "include_batched", "include_moe_gating")


def check_scale_rule(rule: Any) -> str:
  """A valid MXFP4 scale rule (canonical), or a teaching error (a TypeError
  for a non-string)."""
  name = rule.strip().lower().replace("-", "_") if isinstance(rule, str) else None
  if name not in MX_SCALE_RULES:
    raise (ValueError if isinstance(rule, str) else TypeError)(
        f"Unknown MXFP4 scale rule {rule!r} ({type(rule).__name__}). "
        f"{SCALE_RULE_HELP}")
  return name


def _check_fp4_flag(value: Any, name: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"Fp4Config: {name} must be True or False, got "
        f"{type(value).__name__}: {value!r}.")


@dataclasses.dataclass(frozen=True)
class Fp4Config:
  """The static configuration of an FP4 matmul (a recipe), frozen and hashable.

  Every component of the recipe has a switch, so that its ablations can be
  run (as Transformer Engine's ``disable_rht``,
  ``disable_stochastic_rounding``, ``disable_2d_quantization``). A policy
  names it as ``m=nvfp4`` or ``m=mxfp4``, with changed fields in
  parentheses (``m=nvfp4(rht=false;stochastic_rounding=false)``): the
  policy's matmuls then run :func:`~jmp_lite.fp4.fp4_dot_general` through
  every route (``autocast``, ``with_policy``, linen, NNX), with the
  exclusions of float8 (``docs/fp4.md``).

  Attributes:
    recipe: ``"nvfp4"`` (default) or ``"mxfp4"`` (case ignored).
    rht: apply the 16-point random Hadamard transform to both operands of
      the weight-gradient matmul, along its contracting dimension.
    stochastic_rounding: round the incoming gradient stochastically (both
      backward matmuls), with 8 random bits per element (as Blackwell's
      ``cvt.rs``); everything else rounds to nearest even.
    two_d_weights: quantize the weight (the rhs) in 16x16 tiles. None (the
      default) means True for NVFP4 and False for MXFP4, which has no 2D
      tiles (True is refused there).
    mx_scale_rule: MXFP4's scale rule, ``"round_up"`` or ``"floor"``. None
      (the default) means ``"round_up"`` for MXFP4; it must stay None for
      NVFP4.
    native: on CUDA, multiply with ``jax.nn.scaled_matmul`` (a block-scaled
      GEMM on Blackwell); False always uses the exact emulation.
    quantize_forward: quantize the forward product's operands. False runs
      the forward product on the operands as given (e.g. bfloat16) with
      float32 accumulation while the backward pass stays FP4: the NVFP4
      paper's late switch (its appendix D: the forward pass in bf16 for the
      last part of training). A changed config is one recompile.
    include_output_head: under a policy, also run the output head (the last
      matmul of the forward pass) in FP4 (default False).
    include_batched: under a policy, also run matmuls with batch dimensions
      (attention scores and their product with the values) in FP4 (default
      False).
    dim_multiple: under a policy, matmuls run in FP4 only where N and K are
      multiples of it. None (the default) means the recipe's block size (16
      for NVFP4, 32 for MXFP4); 1 admits every shape (``fp4_dot_general``
      zero-pads K, and N for 16x16 tiles: exact, at the cost of a copy).
    axis_name: under ``jax.pmap``/``jax.shard_map``, the mapped axis (a
      string, or a tuple of strings) over which NVFP4's per-tensor amaxes
      are reduced (``lax.pmax``, as ``Fp8Config.axis_name``), so that every
      replica uses the same tensor scales; a NaN or inf on one replica makes
      every replica's product NaN, as it would unsharded. Block scales (and
      all of MXFP4's) are local by construction. None (default): each
      replica scales from its own shard. Not needed under ``jax.jit`` with
      sharded arrays, where amaxes are global already.
    include_moe_gating: under ``autocast``/``with_policy``, also run a
      Mixture-of-Experts layer's router and combine matmuls in FP4 (default
      False: the compute dtype, as for float8).

  Raises:
    TypeError: for a non-string recipe or rule, or a non-bool switch.
    ValueError: for an unknown recipe or rule, or a switch that does not
      apply to the recipe.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import fp4
    >>> fp4.Fp4Config("mxfp4").mx_scale_rule
    'round_up'
    >>> fp4.Fp4Config(two_d_weights=True) == fp4.Fp4Config()
    True
    >>> fp4.Fp4Config(rht=False).spec()
    'nvfp4(rht=false)'
    >>> print(jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(
    ...     fp4.Fp4Config(quantize_forward=False)))
    p=full,c=bf16,o=full,m=nvfp4(quantize_forward=false)
  """

  recipe: str = "nvfp4"
  rht: bool = True
  stochastic_rounding: bool = True
  two_d_weights: bool | None = None
  mx_scale_rule: str | None = None
  native: bool = True
  quantize_forward: bool = True
  include_output_head: bool = False
  include_batched: bool = False
  dim_multiple: int | None = None
  axis_name: Any = None
  include_moe_gating: bool = False

  def __post_init__(self):
    if not isinstance(self.recipe, str):
      raise TypeError(
          f"Fp4Config: recipe must be a string, got "
          f"{type(self.recipe).__name__}: {self.recipe!r}. {FP4_RECIPE_HELP}")
    recipe = self.recipe.strip().lower()
    if recipe not in FP4_RECIPES:
      raise ValueError(
          f"Fp4Config: unknown recipe {self.recipe!r}. {FP4_RECIPE_HELP}")
    for name in _FP4_FLAGS:
      _check_fp4_flag(getattr(self, name), name)
    two_d = self.two_d_weights
    if two_d is not None:
      _check_fp4_flag(two_d, "two_d_weights")
    rule = self.mx_scale_rule
    if recipe == "nvfp4":
      two_d = True if two_d is None else bool(two_d)
      if rule is not None:
        raise ValueError(
            f"Fp4Config: mx_scale_rule={rule!r} was given with "
            f"recipe='nvfp4'. {SCALE_RULE_NVFP4_HELP}")
    else:
      if two_d:
        raise ValueError(
            f"Fp4Config: two_d_weights=True was given with recipe='mxfp4'. "
            f"{TWO_D_HELP}")
      two_d = False
      rule = check_scale_rule("round_up" if rule is None else rule)
    block = NVFP4_BLOCK_SIZE if recipe == "nvfp4" else MXFP4_BLOCK_SIZE
    multiple = block if self.dim_multiple is None else checks.integer(
        self.dim_multiple, "dim_multiple", _FP4_OWNER, low=1)
    object.__setattr__(self, "recipe", recipe)
    object.__setattr__(self, "two_d_weights", two_d)
    object.__setattr__(self, "mx_scale_rule", rule)
    object.__setattr__(self, "dim_multiple", int(multiple))
    object.__setattr__(self, "axis_name",
                       _canonical_axis_name(self.axis_name))
    for name in _FP4_FLAGS:
      object.__setattr__(self, name, bool(getattr(self, name)))

  @property
  def block_size(self) -> int:
    """Elements per block along the contracting dimension (16 or 32)."""
    return NVFP4_BLOCK_SIZE if self.recipe == "nvfp4" else MXFP4_BLOCK_SIZE

  @property
  def scaling(self) -> str:
    """``"current"``: FP4 scales come from each step's own amaxes (the
    routes read this as they read a float8 recipe's)."""
    return "current"

  def spec(self) -> str:
    """The recipe in the policy grammar: ``"nvfp4(rht=false)"``.

    The recipe's name followed by the fields that differ from the named
    recipe, in field order; ``from_spec`` (and ``get_policy``'s ``m=``)
    reads it back to an equal config.
    """
    return _named_spec(self, self.recipe, _named_fp4(self.recipe))

  def check_policy_use(self) -> None:
    """Raises if the config cannot be a policy's recipe: an axis name the
    policy grammar cannot write."""
    problem = _unwritable_axis_name(self.axis_name)
    if problem:
      raise ValueError(f"{self.spec()}: {problem}")


def _named_spec(config: Any, name: str, base: Any) -> str:
  """``name``, followed in parentheses by the fields in which ``config``
  differs from the named recipe ``base``, in field order: a recipe's text
  in the policy grammar."""
  changed = [
      f"{f.name}={_render(getattr(config, f.name))}"
      for f in dataclasses.fields(config)
      if getattr(config, f.name) != getattr(base, f.name)
  ]
  return f"{name}({';'.join(changed)})" if changed else name


@functools.lru_cache(maxsize=None)
def _named_fp4(name: str) -> Fp4Config:
  return Fp4Config(recipe=name)


# -- int8 recipes ------------------------------------------------------------------

#: The int8 matmul recipes a policy names with ``m=`` (each is
#: ``Int8Config(recipe=name)``; why each: ``docs/int8.md``).
INT8_RECIPES: tuple[str, ...] = ("int8", "int8_switchback")
#: How an int8 recipe scales the weight: per output channel (one scale per
#: element of the weight's non-contracting axes, the amax along the
#: contracted one) or one scale for the whole tensor (SwitchBack's).
INT8_WEIGHT_GRANULARITIES: tuple[str, ...] = ("channel", "tensor")
#: The largest int8 value a quantized operand takes (symmetric: -127..127;
#: -128 is never used, so that negation is exact and the range symmetric).
INT8_MAX = 127

INT8_RECIPE_HELP = (
    "Valid int8 recipes are 'int8' (row-wise int8 activations and "
    "gradients, per-output-channel weights, all three matmuls of a linear "
    "in int8 with int32 accumulation: torchao's int8 mixed-precision "
    "training) and 'int8_switchback' (SwitchBack, arXiv 2304.13013: "
    "row-wise activations and gradients, a tensor-wise weight scale, the "
    "weight gradient in the compute dtype)."
)
WEIGHT_GRANULARITY_HELP = (
    "Valid weight granularities are the strings 'channel' (one scale per "
    "output channel, int8's default) and 'tensor' (one scale for the whole "
    "weight, SwitchBack's)."
)
_INT8_OWNER = "Int8Config"
_INT8_FLAGS = ("quantize_forward", "quantize_input_gradient",
               "stochastic_rounding", "include_output_head", "include_batched",
               "include_moe_gating")


@dataclasses.dataclass(frozen=True)
class Int8Config:
  """The static configuration of an int8 matmul (a recipe), frozen and hashable.

  For the hardware with int8 matrix units and no float8 ones (TPU v4, v5e,
  v5p, v6e; NVIDIA A100 and other Ampere/Ada GPUs). Every product of a
  linear (forward ``y = x W``, input gradient ``dx = g W^T``, weight
  gradient ``dW = x^T g``) quantizes each operand to symmetric int8 in
  ``[-127, 127]`` with float32 scales taken along the product's own
  contracted axis, multiplies ``s8 x s8 -> s32`` and rescales the int32
  result once in float32: ``round_half_to_even(v * (1 / s))`` with
  ``s = amax * float32(1 / 127)`` per row (activations and gradients), per output
  channel or per tensor (the weight). A policy names it as ``m=int8`` or
  ``m=int8_switchback``, with changed fields in parentheses
  (``m=int8(quantize_weight_gradient=false)``); every route (``autocast``,
  ``with_policy``, linen, NNX) then runs the policy's matmuls through
  :func:`~jmp_lite.int8.int8_dot_general`, with float8's exclusions
  (``docs/int8.md``).

  Attributes:
    recipe: ``"int8"`` (default) or ``"int8_switchback"`` (case ignored).
    weight_granularity: ``"channel"`` or ``"tensor"``. None (the default)
      means ``"channel"`` for int8 and ``"tensor"`` for SwitchBack.
    quantize_forward: run the forward product in int8 (False: the operands
      as given, float32 accumulation).
    quantize_input_gradient: run the input-gradient product in int8.
    quantize_weight_gradient: run the weight-gradient product in int8
      (False: the compute dtype with float32 accumulation, torchao's advice
      when convergence suffers). None (the default) means True for int8 and
      False for SwitchBack.
    stochastic_rounding: round the incoming gradient stochastically (AQT's
      option) in both backward products, with bits derived from the
      gradient's own bits; everything else rounds half to even.
    include_output_head: under a policy, also run the output head (the last
      matmul of the forward pass) in int8 (default False).
    include_batched: under a policy, also run matmuls with batch dimensions
      (attention scores and their product with the values) in int8 (default
      False).
    dim_multiple: under a policy, matmuls run in int8 only where N and K
      are multiples of it (default 16, as float8's).
    axis_name: under ``jax.pmap``/``jax.shard_map``, the mapped axis (a
      string or a tuple of strings) over which a tensor-wise weight amax is
      reduced (``lax.pmax``), so that replicas share it. Row and channel
      scales are local. None (default): each replica scales from its own
      values. Not needed under ``jax.jit`` with sharded arrays.
    include_moe_gating: under ``autocast``/``with_policy``, also run a
      Mixture-of-Experts layer's router and combine matmuls in int8
      (default False: the compute dtype, as for float8).
    fsdp_axis: under ``jax.jit`` with weights sharded over a mesh axis
      (FSDP), that axis (a string or a tuple of strings): the weight is
      quantized shard by shard with the scales every shard shares and its
      int8 values and scales are all-gathered as their bits (1 byte per
      element), as ``Fp8Config.fsdp_axis`` does (``docs/fp8.md``, FSDP).

  Raises:
    TypeError: for a non-string recipe or granularity, or a non-bool
      switch.
    ValueError: for an unknown recipe or granularity.

  Example:
    >>> import jmp_lite
    >>> from jmp_lite import int8
    >>> int8.Int8Config("int8_switchback").weight_granularity
    'tensor'
    >>> int8.Int8Config(quantize_weight_gradient=False).spec()
    'int8(quantize_weight_gradient=false)'
    >>> print(jmp_lite.get_policy("p=f32,c=bf16,o=f32,m=int8"))
    p=full,c=bf16,o=full,m=int8
  """

  recipe: str = "int8"
  weight_granularity: str | None = None
  quantize_forward: bool = True
  quantize_input_gradient: bool = True
  quantize_weight_gradient: bool | None = None
  stochastic_rounding: bool = False
  include_output_head: bool = False
  include_batched: bool = False
  dim_multiple: int = 16
  axis_name: Any = None
  include_moe_gating: bool = False
  fsdp_axis: Any = None

  def __post_init__(self):
    if not isinstance(self.recipe, str):
      raise TypeError(
          f"Int8Config: recipe must be a string, got "
          f"{type(self.recipe).__name__}: {self.recipe!r}. {INT8_RECIPE_HELP}")
    recipe = self.recipe.strip().lower()
    if recipe not in INT8_RECIPES:
      raise ValueError(
          f"Int8Config: unknown recipe {self.recipe!r}. {INT8_RECIPE_HELP}")
    switchback = recipe == "int8_switchback"
    for name in _INT8_FLAGS:
      _check_flag(getattr(self, name), name, _INT8_OWNER)
    wgrad = self.quantize_weight_gradient
    if wgrad is None:
      wgrad = not switchback
    _check_flag(wgrad, "quantize_weight_gradient", _INT8_OWNER)
    granularity = self.weight_granularity
    if granularity is None:
      granularity = "tensor" if switchback else "channel"
    name = (granularity.strip().lower() if isinstance(granularity, str)
            else None)
    if name not in INT8_WEIGHT_GRANULARITIES:
      raise (ValueError if isinstance(granularity, str) else TypeError)(
          f"Int8Config: unknown weight_granularity {granularity!r}. "
          f"{WEIGHT_GRANULARITY_HELP}")
    object.__setattr__(self, "recipe", recipe)
    object.__setattr__(self, "weight_granularity", name)
    object.__setattr__(self, "quantize_weight_gradient", bool(wgrad))
    object.__setattr__(self, "dim_multiple", checks.integer(
        self.dim_multiple, "dim_multiple", _INT8_OWNER, low=1))
    object.__setattr__(self, "axis_name",
                       _canonical_axis_name(self.axis_name))
    object.__setattr__(self, "fsdp_axis",
                       _canonical_fsdp_axis(self.fsdp_axis, _INT8_OWNER))
    for flag in _INT8_FLAGS:
      object.__setattr__(self, flag, bool(getattr(self, flag)))

  @property
  def scaling(self) -> str:
    """``"current"``: int8 scales come from each step's own amaxes (the
    routes read this as they read a float8 recipe's)."""
    return "current"

  def spec(self) -> str:
    """The recipe in the policy grammar: ``"int8(stochastic_rounding=true)"``.

    The recipe's name followed by the fields that differ from the named
    recipe, in field order; ``from_spec`` (and ``get_policy``'s ``m=``)
    reads it back to an equal config.
    """
    return _named_spec(self, self.recipe, _named_int8(self.recipe))

  def check_policy_use(self) -> None:
    """Raises if the config cannot be a policy's recipe: an axis name the
    policy grammar cannot write."""
    problem = (_unwritable_axis_name(self.axis_name) or
               _unwritable_axis_name(self.fsdp_axis, "fsdp_axis"))
    if problem:
      raise ValueError(f"{self.spec()}: {problem}")


def _check_flag(value: Any, name: str, owner: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"{owner}: {name} must be True or False, got "
        f"{type(value).__name__}: {value!r}.")


@functools.lru_cache(maxsize=None)
def _named_int8(name: str) -> Int8Config:
  return Int8Config(recipe=name)


#: The recipe types a policy's ``m=`` resolves to.
RECIPE_TYPES: tuple[type, ...] = (Fp8Config, Fp4Config, Int8Config)
#: Every recipe name of the policy grammar (float8, then FP4, then int8).
RECIPE_NAMES: tuple[str, ...] = (*FP8_RECIPES, *FP4_RECIPES, *INT8_RECIPES)


#: The recipe fields whose values keep their case in the grammar (names of
#: mapped axes are case-sensitive); every other value is case-insensitive.
_CASED_FIELDS = ("axis_name", "fsdp_axis")
#: How the grammar writes a tuple of axis names: ``axis_name=(data|fsdp)``
#: (``,`` separates a policy's keys and ``;`` a recipe's fields).
_AXIS_SEPARATOR = "|"
#: An axis name the grammar can write and read back.
_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")

AXIS_NAME_SPELLING = (
    "In a policy, a recipe's axis_name is written in the policy grammar "
    "(str(policy), read back by get_policy), so each axis name must be a "
    "name such as 'batch' or 'data_parallel' (letters, digits, '_', '.', "
    "'-'; not starting with a digit, and not 'none'); a tuple is written "
    "axis_name=(data|fsdp). Rename the mesh axis, or pass the config to "
    "jmp_lite.fp8.dot_general (jmp_lite.fp4.dot_general, "
    "jmp_lite.int8.dot_general) directly."
)
FIELD_SEPARATOR_HELP = (
    "Fields inside a recipe are separated by ';' (',' separates the "
    "policy's keys)"
)


def _render(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "none"
  if isinstance(value, float):
    return repr(value)  # exact: float(repr(x)) == x
  if isinstance(value, np.dtype):
    return value.name
  if isinstance(value, tuple):
    return f"({_AXIS_SEPARATOR.join(map(str, value))})"
  return str(value)


def _parse_value(key: str, text: str) -> Any:
  if key in _CASED_FIELDS:
    if text.lower() == "none":
      return None
    if text.startswith("(") and text.endswith(")"):
      return tuple(text[1:-1].split(_AXIS_SEPARATOR))
    return text
  text = text.lower()
  if text in ("true", "false"):
    return text == "true"
  if text == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


#: The values a recipe field takes in the grammar, by the field's type.
_GRAMMAR_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true or false"),
    "bool | None": ((bool, type(None)), "true, false or none"),
    "int": ((int,), "a whole number"),
    "int | None": ((int, type(None)), "a whole number or none"),
    "str": ((str,), "a name"),
    "str | None": ((str, type(None)), "a name or none"),
}


#: Whole-number fields whose config reads a whole float too (``margin=1.0``)
#: and explains why any other number is refused: the grammar passes it on.
_WHOLE_FLOAT_FIELDS = ("margin",)


def _field_choices(key: str) -> tuple[str, ...] | None:
  """The names a string field of a recipe takes, or None."""
  return {
      "forward_format": formats_lib.FORMAT_NAMES,
      "gradient_format": formats_lib.FORMAT_NAMES,
      "granularity": MATMUL_GRANULARITIES,
      "scaling": SCALING_MODES,
      "amax_algorithm": AMAX_ALGORITHMS,
      "mx_scale_rule": MX_SCALE_RULES,
      "weight_granularity": INT8_WEIGHT_GRANULARITIES,
  }.get(key)


def _type_problem(kind: type, key: str, value: Any, text: str,
                  where: str) -> str | None:
  """What is wrong with the type of a recipe field's value as the grammar
  read it, or None (the config validates the value itself)."""
  field = {f.name: f for f in dataclasses.fields(kind)}[key]
  if field.type not in _GRAMMAR_TYPES:   # axis_name: read as names
    return None
  types, allowed = _GRAMMAR_TYPES[field.type]
  if key in _WHOLE_FLOAT_FIELDS:
    types += (float,)
  if isinstance(value, types) and not (
      isinstance(value, bool) and bool not in types):
    return None
  choices = _field_choices(key)
  if choices:
    allowed = "one of " + ", ".join(choices) + (
        " or none" if type(None) in types else "")
    fix = f"e.g. {key}={choices[0]}"
  elif bool in types:
    fix = f"{key}=true or {key}=false"
  else:   # whole numbers: the default, or a size every such field takes
    example = field.default if isinstance(field.default, int) else 16
    fix = f"e.g. {key}={example}"
  return f"Field {key!r} {where} takes {allowed}, got {text!r}: write {fix}."


SPEC_HELP = (
    "A float8 recipe is one of {names}, optionally followed by the fields to "
    "change in parentheses, separated by ';', e.g. "
    "'fp8_delayed(margin=1;history_length=32)' or "
    "'fp8_rowwise(gradient_format=e5m2)'. Fields: {fields}."
)
FP4_SPEC_HELP = (
    "An FP4 recipe is one of {names}, optionally followed by the fields to "
    "change in parentheses, separated by ';', e.g. "
    "'nvfp4(rht=false;stochastic_rounding=false)' or "
    "'mxfp4(mx_scale_rule=floor)'. Fields: {fields}."
)
INT8_SPEC_HELP = (
    "An int8 recipe is one of {names}, optionally followed by the fields to "
    "change in parentheses, separated by ';', e.g. "
    "'int8(quantize_weight_gradient=false)' or "
    "'int8_switchback(stochastic_rounding=true)'. Fields: {fields}."
)


def _grammar_fields(kind: type) -> tuple[str, ...]:
  """The fields a recipe's text may set (the name sets the rest)."""
  skip = ("compute_dtype",) if kind is Fp8Config else ("recipe",)
  return tuple(f.name for f in dataclasses.fields(kind) if f.name not in skip)


def _spec_help(kind: type = Fp8Config) -> str:
  if kind is Int8Config:
    return INT8_SPEC_HELP.format(names=", ".join(INT8_RECIPES),
                                 fields=", ".join(_grammar_fields(Int8Config)))
  if kind is Fp4Config:
    return FP4_SPEC_HELP.format(names=", ".join(FP4_RECIPES),
                                fields=", ".join(_grammar_fields(Fp4Config)))
  return SPEC_HELP.format(names=", ".join(FP8_RECIPES),
                          fields=", ".join(_grammar_fields(Fp8Config)))


def _spec_problem(text: str, name: str, paren: str, rest: str,
                  family: str) -> str | None:
  """What is wrong with a recipe's text as a whole, or None."""
  if name not in RECIPE_NAMES:
    return (f"Malformed recipe {text!r}: {name!r} names no float8, FP4 or "
            "int8 recipe.")
  extra = rest.count(")") - rest.count("(") - 1  # ')' beyond the fields'
  if paren and (extra < 0 or not rest.endswith(")")):
    return (f"The {family} recipe {text!r} does not close its parenthesis: "
            "write name(field=value;...).")
  if paren and extra > 0:
    return f"The {family} recipe {text!r} has a ')' with no '(' before it."
  if "," in rest:
    return (f"The {family} recipe {text!r} separates its fields with ','. "
            f"{FIELD_SEPARATOR_HELP}: write {text.replace(',', ';')!r}.")
  return None


@functools.lru_cache(maxsize=None)
def from_spec(text: str) -> Fp8Config | Fp4Config | Int8Config:
  """Reads a recipe written in the policy grammar (see :meth:`Fp8Config.spec`,
  :meth:`Fp4Config.spec`).

  Args:
    text: ``"name"`` or ``"name(field=value;...)"``; whitespace is ignored,
      and case too but in axis names.

  Returns:
    The :class:`Fp8Config` of a float8 recipe name, the :class:`Fp4Config`
    of an FP4 one, the :class:`Int8Config` of an int8 one.

  Raises:
    ValueError: for an unknown name or field, a field given twice, fields
      separated by ``,``, a malformed entry, a value of the wrong type for
      its field (``rht=maybe``: quoting the field, the value and what it
      takes), or a value the config refuses.
  """
  compact = "".join(text.split())
  name, paren, rest = compact.partition("(")
  name = name.lower()
  kind = (Fp4Config if name in FP4_RECIPES else
          Int8Config if name in INT8_RECIPES else Fp8Config)
  family = {Fp4Config: "FP4", Int8Config: "int8"}.get(kind, "float8")
  problem = _spec_problem(compact, name, paren, rest, family)
  fields = (dict(FP8_RECIPES.get(name, {})) if kind is Fp8Config
            else {"recipe": name})
  names = set(_grammar_fields(kind))
  given: dict[str, str] = {}
  for entry in rest[:-1].split(";") if rest[:-1] and not problem else ():
    key, eq, value = entry.partition("=")
    key = key.lower()
    where = f"in the {family} recipe {text!r}"
    problem = (
        f"Malformed entry {entry!r} {where}: write field=value."
        if not (eq and key and value) else
        f"Unknown field {key!r} {where}." if key not in names else
        f"Field {key!r} is given twice {where} ({given[key]}, then {entry}):"
        " give each field once." if key in given else None)
    parsed = None if problem else _parse_value(key, value)
    problem = problem or _type_problem(kind, key, parsed, value, where)
    if problem:
      break
    given[key] = entry
    fields[key] = parsed
  if problem:
    help_text = (_spec_help(kind) if name in RECIPE_NAMES else
                 f"{_spec_help()} {_spec_help(Fp4Config)} "
                 f"{_spec_help(Int8Config)}")
    raise ValueError(f"{problem} {help_text}")
  return kind(**fields)


def recipe_config(matmul_precision: Any) -> Fp8Config | Fp4Config | Int8Config | None:
  """The recipe of a policy's matmul precision, or None if it names none.

  Args:
    matmul_precision: a ``Policy.matmul_precision`` (a name, an
      :class:`Fp8Config`, :class:`Fp4Config` or :class:`Int8Config`, or
      None).

  Returns:
    The config of a named recipe (``"fp8"`` -> ``Fp8Config()``, ``"nvfp4"``
    -> ``Fp4Config()``, ``"int8"`` -> ``Int8Config()``), the config itself,
    or None for a precision that is no float8, FP4 or int8 recipe.
  """
  if isinstance(matmul_precision, RECIPE_TYPES):
    return matmul_precision
  if isinstance(matmul_precision, str):
    if matmul_precision in FP8_RECIPES:
      return _named(matmul_precision)
    if matmul_precision in FP4_RECIPES:
      return _named_fp4(matmul_precision)
    if matmul_precision in INT8_RECIPES:
      return _named_int8(matmul_precision)
  return None


def format_name(recipe: Fp8Config | Fp4Config | Int8Config) -> str:
  """How messages name the format of a recipe's matmuls: ``"NVFP4"``,
  ``"MXFP4"``, ``"int8"`` or ``"float8"`` (e.g. "a dot_general stays out of NVFP4")."""
  if isinstance(recipe, Int8Config):
    return "int8"
  return recipe.recipe.upper() if isinstance(recipe, Fp4Config) else "float8"
