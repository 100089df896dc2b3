"""Operation-level automatic mixed precision for any JAX function.

``autocast(fn, dtype)`` traces ``fn`` to a jaxpr and evaluates it with a
precision rule per primitive -- the JAX counterpart of ``torch.autocast``,
recursing into ``jit``, ``remat``, ``scan``, ``cond``, ``while``,
``custom_jvp``/``custom_vjp`` and ``shard_map``. User documentation:
``docs/autocast.md``; public names: ``jmp_lite.autocast``,
``jmp_lite.autocast_disabled``, ``jmp_lite.op_dtypes`` and the module
``jmp_lite.autocast_rules``.

Modules: ``compat`` (every JAX internal used), ``rules`` (the per-op rules and
op lists), ``interpreter`` (the jaxpr interpreter and the registry of
higher-order primitives), ``table`` (the default table, user rules), ``api``.
"""


from jmp_lite._src.autocast.api import autocast
from jmp_lite._src.autocast.api import op_dtypes
from jmp_lite._src.autocast.interpreter import autocast_disabled
from jmp_lite._src.autocast.interpreter import in_float32
from jmp_lite._src.autocast.rules import RULE_NAMES
from jmp_lite._src.autocast.rules import RuleContext
from jmp_lite._src.autocast.table import DEFAULT_RULES

__all__ = (
    "DEFAULT_RULES",
    "RULE_NAMES",
    "RuleContext",
    "autocast",
    "autocast_disabled",
    "in_float32",
    "op_dtypes",
)
