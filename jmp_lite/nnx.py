"""Mixed precision for Flax NNX models: a policy, per-module overrides.

Three lines turn an unmodified NNX model into a mixed-precision one, with
normalisation layers kept in float32::

  import jmp_lite.nnx as jnnx
  model = jnnx.apply_policy(MyModel(rngs=nnx.Rngs(0)), "mixed_bfloat16")
  optimizer = nnx.Optimizer(model, jmp_lite.loss_scaling(optax.adam(1e-3),
                            jmp_lite.DynamicLossScale(2.0**15)), wrt=nnx.Param)

The returned module shares the variables of the one you pass and never
changes it. Importing this module imports Flax; ``import jmp_lite`` alone does
not.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import jmp_lite.nnx as jnnx
  >>> model = jnnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "mixed_float16")
  >>> model(jnp.ones((1, 3))).dtype
  dtype('float32')
"""

from jmp_lite._src.flax.rules import require_flax

require_flax("jmp_lite.nnx")

# pylint: disable=g-import-not-at-top,wrong-import-position
from jmp_lite._src.flax.nnx import apply_policy
from jmp_lite._src.flax.nnx import DEFAULT_MODULE_RULES
from jmp_lite._src.flax.nnx import Fp8State
from jmp_lite._src.flax.rules import FullPrecision
from jmp_lite._src.flax.nnx import PolicyModule
from jmp_lite._src.flax.nnx import ModuleRules
from jmp_lite._src.flax.rules import UnmatchedRuleWarning

__all__ = (
    "DEFAULT_MODULE_RULES",
    "Fp8State",
    "FullPrecision",
    "PolicyModule",
    "ModuleRules",
    "UnmatchedRuleWarning",
    "apply_policy",
)
