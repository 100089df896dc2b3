"""Mixed precision for Flax linen models: a policy, per-module overrides.

Three lines turn an unmodified linen model into a mixed-precision one, with
normalisation layers kept in float32::

  import jmp_lite.linen as jlinen
  model = jlinen.apply_policy(MyModel(), "mixed_bfloat16")
  variables = model.init(rng, x)        # then model.apply(variables, x, ...)

Importing this module imports Flax; ``import jmp_lite`` alone does not.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.linen as jlinen
  >>> model = jlinen.apply_policy(nn.Dense(2), "mixed_float16")
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> model.apply(variables, jnp.ones((1, 3))).dtype
  dtype('float32')
"""

from jmp_lite._src.flax.rules import require_flax

require_flax("jmp_lite.linen")

# pylint: disable=g-import-not-at-top,wrong-import-position
from jmp_lite._src.flax.linen import apply_policy
from jmp_lite._src.flax.linen import DEFAULT_MODULE_RULES
from jmp_lite._src.flax.rules import FullPrecision
from jmp_lite._src.flax.linen import PolicyModel
from jmp_lite._src.flax.linen import ModuleRules
from jmp_lite._src.flax.rules import UnmatchedRuleWarning

__all__ = (
    "DEFAULT_MODULE_RULES",
    "FullPrecision",
    "PolicyModel",
    "ModuleRules",
    "UnmatchedRuleWarning",
    "apply_policy",
)
