"""Operation-level automatic mixed precision for any JAX function.

``autocast(fn, dtype)`` traces ``fn`` to a jaxpr and evaluates it with a
precision rule per primitive -- the JAX counterpart of ``torch.autocast``,
recursing into ``jit``, ``remat``, ``scan``, ``cond``, ``while``,
``custom_jvp``/``custom_vjp`` and ``shard_map``. See ``README.md`` in this
package for the default op lists next to torch.autocast's.

Example:
  >>> import jax.numpy as jnp
  >>> from jmp_lite._src.autocast import autocast
  >>> autocast(lambda w, x: x @ w, "bf16")(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype
  dtype('float32')
"""

from jmp_lite._src.autocast.api import autocast
from jmp_lite._src.autocast.api import op_dtypes
from jmp_lite._src.autocast.interpreter import autocast_disabled
from jmp_lite._src.autocast.rules import DEFAULT_RULES
from jmp_lite._src.autocast.rules import RULE_NAMES
from jmp_lite._src.autocast.rules import RuleContext

__all__ = (
    "DEFAULT_RULES",
    "RULE_NAMES",
    "RuleContext",
    "autocast",
    "autocast_disabled",
    "op_dtypes",
)
