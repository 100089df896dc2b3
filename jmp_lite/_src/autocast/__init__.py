"""Operation-level automatic mixed precision for any JAX function.

``autocast(fn, dtype)`` traces ``fn`` to a jaxpr and evaluates it with a
precision rule per primitive -- the JAX counterpart of ``torch.autocast``,
recursing into ``jit``, ``remat``, ``scan``, ``cond``, ``while``,
``custom_jvp``/``custom_vjp`` and ``shard_map``. User documentation:
``docs/autocast.md``; public names: ``jmp_lite.autocast``,
``jmp_lite.op_dtypes`` and the module ``jmp_lite.autocast_rules``.

Modules: ``rules`` (the built-in rules and the op lists), ``interpreter`` (the
jaxpr interpreter and the registry of higher-order primitives),
``default_rules`` (every primitive's default rule, user rules merged over
them), ``api``. Every JAX internal they read is in ``jmp_lite._src.compat``.
"""

from jmp_lite._src.autocast.api import autocast
from jmp_lite._src.autocast.api import op_dtypes

__all__ = ("autocast", "op_dtypes")
