"""FP4 matmuls (NVFP4, MXFP4): the recipe type and the FP4 ``dot_general``.

FP4 training multiplies E2M1 values (``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``) with
small block scales and float32 accumulation: NVIDIA's NVFP4 recipe (1x16
blocks with E4M3 scales under a float32 per-tensor scale, 16x16 weight tiles,
a random Hadamard transform on the weight-gradient matmul, stochastic
rounding of gradients) and OCP's MXFP4 (1x32 blocks, power-of-two scales).
Exact on every platform; on CUDA the block-scaled product is
``jax.nn.scaled_matmul``. A policy names an FP4 recipe as ``m=nvfp4`` or
``m=mxfp4`` (fields in parentheses: ``m=nvfp4(rht=false)``; the preset
``mixed_nvfp4``), and every route (``with_policy``, ``autocast``, linen,
NNX) then runs the policy's matmuls through :func:`dot_general`, with
float8's exclusions; or call it yourself (e.g. with a PRNG key per layer),
and :func:`ragged_dot` for a Mixture-of-Experts layer's
``jax.lax.ragged_dot`` (named as in ``jax.lax``, the module saying the
format).
Guide: ``docs/fp4.md``.

Example:
  >>> import jax.numpy as jnp
  >>> from jmp_lite import fp4
  >>> config = fp4.Fp4Config("nvfp4", stochastic_rounding=False)
  >>> fp4.dot_general(jnp.ones((2, 16)), jnp.ones((16, 4)),
  ...                 (((1,), (0,)), ((), ())), config=config)[0, 0]
  Array(16., dtype=float32)
  >>> import jmp_lite
  >>> jmp_lite.get_policy("mixed_nvfp4").fp8_recipe == fp4.Fp4Config()
  True
"""

from jmp_lite._src import checks as _checks
from jmp_lite._src.low_precision.fp4_grouped import fp4_ragged_dot as ragged_dot
from jmp_lite._src.low_precision.fp4_matmul import Fp4Config
from jmp_lite._src.low_precision.fp4_matmul import fp4_dot_general as dot_general

__all__ = (
    "Fp4Config",
    "dot_general",
    "ragged_dot",
)

# The old spellings (deprecated: they go in a later release): fp4.fp4_dot_general etc.
__getattr__ = _checks.old_names("jmp_lite.fp4", renamed={
    f"fp4_{name}": (f"jmp_lite.fp4.{name} (same function)", globals()[name])
    for name in ("dot_general", "ragged_dot")})
